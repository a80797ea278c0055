// fp8_gather's kernel and its entry in the launch table.
#include "src/cuda/decode/fp8_gather/kernel.cuh"
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::fp8_gather {

KernelEntry entry(KvFormat format, int row_tiles, int /*device_id*/) {
  if (format != KvFormat::fp8_e4m3 || !(row_tiles == 1))
    no_kernel(KernelFamily::fp8_gather, format, row_tiles);
  return {&fp8_gather_kernel, kSmemBytes, kCtaThreads};
}

}  // namespace fp8mla::detail::fp8_gather
