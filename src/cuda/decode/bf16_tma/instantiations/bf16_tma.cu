// bf16_tma's kernel (decode_tile with tensor-map copies) and its entry in the launch table.
#include "src/cuda/decode/bf16_tma/kernel.cuh"
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::bf16_tma {

__global__ void __launch_bounds__(kCtaThreads<false>, 1)
    bf16_tma_kernel(const __grid_constant__ DecodeParams p) {
  decode_tile<false>(p);
}

KernelEntry entry(KvFormat format, int row_tiles, int /*device_id*/) {
  if (format != KvFormat::bf16 || row_tiles != 1)
    no_kernel(KernelFamily::bf16_tma, format, row_tiles);
  return {&bf16_tma_kernel, Layout<false>::kSmemBytes, kCtaThreads<false>, 0, true};
}

}  // namespace fp8mla::detail::bf16_tma
