// bf16_wide_rows's kernel and its entry in the launch table.
#include "src/cuda/decode/bf16_wide_rows/kernel.cuh"
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::bf16_wide_rows {

DecodeFn f16_io();  // bf16_wide_rows_f16.cu

KernelEntry entry(KvFormat format, int row_tiles, int /*device_id*/) {
  if (format != KvFormat::bf16 || !(row_tiles > 1))
    no_kernel(KernelFamily::bf16_wide_rows, format, row_tiles);
  return {&bf16_wide_rows_kernel<false>, Layout::kSmemBytes, kThreads, 0, true, f16_io()};
}

}  // namespace fp8mla::detail::bf16_wide_rows
