// fp8_exact's kernel and its entry in the launch table.
#include "src/cuda/decode/fp8_exact/kernel.cuh"
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::fp8_exact {

KernelEntry entry(KvFormat format, int row_tiles, int /*device_id*/) {
  if (format != KvFormat::fp8_e4m3 || !(row_tiles == 1))
    no_kernel(KernelFamily::fp8_exact, format, row_tiles);
  return {&fp8_exact_kernel, kSmemBytes};
}

}  // namespace fp8mla::detail::fp8_exact
