// fp8_gather's entry in the launch table: its instantiation for a format.
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::fp8_gather {

// instantiations/*.cu
KernelEntry fp8_e4m3();
KernelEntry fp8_e4m3_block();

KernelEntry entry(KvFormat format, int row_tiles, int /*device_id*/) {
  if (row_tiles != 1 || format == KvFormat::bf16)
    no_kernel(KernelFamily::fp8_gather, format, row_tiles);
  return format == KvFormat::fp8_e4m3_block ? fp8_e4m3_block() : fp8_e4m3();
}

}  // namespace fp8mla::detail::fp8_gather
