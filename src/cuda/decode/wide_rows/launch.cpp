// wide_rows' entry in the launch table: its instantiation for a format.
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::wide_rows {

// instantiations/*.cu
KernelEntry fp8_e4m3();
KernelEntry bf16();

KernelEntry entry(KvFormat format, int row_tiles, int /*device_id*/) {
  if (format == KvFormat::fp8_e4m3_block || row_tiles == 1)
    no_kernel(KernelFamily::wide_rows, format, row_tiles);
  return format == KvFormat::bf16 ? bf16() : fp8_e4m3();
}

}  // namespace fp8mla::detail::wide_rows
