// bf16_gather's kernel (bf16_tma's decode_tile with per-token copies by producer warps) and its
// entry in the launch table.
#include "src/cuda/decode/bf16_tma/kernel.cuh"
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::bf16_gather {

__global__ void __launch_bounds__(bf16_tma::kCtaThreads<true>, 1)
    bf16_gather_kernel(const __grid_constant__ DecodeParams p) {
  bf16_tma::decode_tile<true>(p);
}

KernelEntry entry(KvFormat format, int row_tiles, int /*device_id*/) {
  if (format != KvFormat::bf16 || row_tiles != 1)
    no_kernel(KernelFamily::bf16_gather, format, row_tiles);
  return {&bf16_gather_kernel, bf16_tma::Layout<true>::kSmemBytes, bf16_tma::kCtaThreads<true>};
}

}  // namespace fp8mla::detail::bf16_gather
