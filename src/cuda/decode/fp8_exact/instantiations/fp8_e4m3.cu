// fp8_exact for fp8_e4m3 caches (576-byte tokens, per-tensor scales).
#include "src/cuda/decode/fp8_exact/kernel.cuh"
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::fp8_exact {

KernelEntry fp8_e4m3() {
  return {&fp8_exact_kernel<KvFormat::fp8_e4m3>, Layout<KvFormat::fp8_e4m3>::kSmemBytes};
}

}  // namespace fp8mla::detail::fp8_exact
