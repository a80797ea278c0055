// shared_tile's entry in the launch table: its instantiation for a format and row count.
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::shared_tile {

// instantiations/*.cu
KernelEntry bf16_rows16();
KernelEntry fp8_e4m3_block_rows16();
KernelEntry fp8_e4m3_block_rows32();
KernelEntry fp8_e4m3_block_rows64();

KernelEntry entry(KvFormat format, int row_tiles, int /*device_id*/) {
  if (format == KvFormat::fp8_e4m3_block)
    return row_tiles == 1   ? fp8_e4m3_block_rows16()
           : row_tiles == 2 ? fp8_e4m3_block_rows32()
                            : fp8_e4m3_block_rows64();
  if (format == KvFormat::bf16 && row_tiles == 1) return bf16_rows16();
  no_kernel(KernelFamily::shared_tile, format, row_tiles);
}

}  // namespace fp8mla::detail::shared_tile
