// wide_rows for bf16 caches, the instantiation for plans with fp16 queries or outputs
// (KernelEntry::half_fn; its own file so that the two compile in parallel).
#include "src/cuda/decode/launch_table.h"
#include "src/cuda/decode/wide_rows/kernel.cuh"

namespace fp8mla::detail::wide_rows {

DecodeFn bf16_f16() {
  return &wide_rows_kernel<KvFormat::bf16, true>;
}

}  // namespace fp8mla::detail::wide_rows
