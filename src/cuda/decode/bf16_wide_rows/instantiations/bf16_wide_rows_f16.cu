// bf16_wide_rows's instantiation for plans with fp16 queries or outputs (KernelEntry::half_fn;
// its own file so that the two compile in parallel).
#include "src/cuda/decode/bf16_wide_rows/kernel.cuh"
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail::bf16_wide_rows {

DecodeFn f16_io() {
  return &bf16_wide_rows_kernel<true>;
}

}  // namespace fp8mla::detail::bf16_wide_rows
