// wide_rows' entry in the launch table: its instantiation for a format.
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::wide_rows {

// instantiations/*.cu
KernelEntry fp8_e4m3();
KernelEntry fp8_e4m3_block();
KernelEntry bf16();

KernelEntry entry(KvFormat format, int row_tiles, int /*device_id*/) {
  // <= 16-row tiles: the block format only (the dispatch table).
  if (row_tiles == 1 && format != KvFormat::fp8_e4m3_block)
    no_kernel(KernelFamily::wide_rows, format, row_tiles);
  return format == KvFormat::bf16             ? bf16()
         : format == KvFormat::fp8_e4m3_block ? fp8_e4m3_block()
                                              : fp8_e4m3();
}

}  // namespace fp8mla::detail::wide_rows
