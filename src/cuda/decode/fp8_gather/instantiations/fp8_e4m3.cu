// fp8_gather for fp8_e4m3 caches (576-byte tokens, per-tensor scales).
#include "src/cuda/decode/fp8_gather/kernel.cuh"
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::fp8_gather {

KernelEntry fp8_e4m3() {
  return {.fn = &fp8_gather_kernel<KvFormat::fp8_e4m3>,
          .smem = Layout<KvFormat::fp8_e4m3>::kSmemBytes,
          .threads = kCtaThreads,
          .rows8_fn = &fp8_gather_kernel<KvFormat::fp8_e4m3, true>};
}

}  // namespace fp8mla::detail::fp8_gather
