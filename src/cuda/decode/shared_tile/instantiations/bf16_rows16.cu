// shared_tile for bf16 tiles of up to 16 rows.
#include "src/cuda/decode/launch_table.h"
#include "src/cuda/decode/shared_tile/kernel.cuh"

namespace fp8mla::detail::shared_tile {

KernelEntry bf16_rows16() {
  return {&shared_tile_kernel<KvFormat::bf16, 1>, Smem<KvFormat::bf16, 1>::kBytes, kThreads};
}

}  // namespace fp8mla::detail::shared_tile
