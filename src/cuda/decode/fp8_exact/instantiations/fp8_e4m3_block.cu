// fp8_exact for block-format (fp8_e4m3_block, 656-byte) caches.
#include "src/cuda/decode/fp8_exact/kernel.cuh"
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::fp8_exact {

KernelEntry fp8_e4m3_block() {
  return {&fp8_exact_kernel<KvFormat::fp8_e4m3_block>, Layout<KvFormat::fp8_e4m3_block>::kSmemBytes};
}

}  // namespace fp8mla::detail::fp8_exact
