// fp8_gather for block-format (fp8_e4m3_block, 656-byte) caches.
#include "src/cuda/decode/fp8_gather/kernel.cuh"
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::fp8_gather {

KernelEntry fp8_e4m3_block() {
  return {.fn = &fp8_gather_kernel<KvFormat::fp8_e4m3_block>,
          .smem = Layout<KvFormat::fp8_e4m3_block>::kSmemBytes,
          .threads = kCtaThreads,
          .rows8_fn = &fp8_gather_kernel<KvFormat::fp8_e4m3_block, true>};
}

}  // namespace fp8mla::detail::fp8_gather
