// shared_tile for fp8_e4m3_block tiles of up to 16 rows.
#include "src/cuda/decode/launch_table.h"
#include "src/cuda/decode/shared_tile/kernel.cuh"

namespace fp8mla::detail::shared_tile {

KernelEntry fp8_e4m3_block_rows16() {
  return {&shared_tile_kernel<KvFormat::fp8_e4m3_block, 1>,
          Smem<KvFormat::fp8_e4m3_block, 1>::kBytes, kThreads};
}

}  // namespace fp8mla::detail::shared_tile
