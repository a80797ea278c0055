// wide_rows for fp8_e4m3 caches, the instantiation for plans with fp16 queries or outputs
// (KernelEntry::half_fn; its own file so that the two compile in parallel).
#include "src/cuda/decode/launch_table.h"
#include "src/cuda/decode/wide_rows/kernel.cuh"

namespace fp8mla::detail::wide_rows {

DecodeFn fp8_e4m3_f16() {
  return &wide_rows_kernel<KvFormat::fp8_e4m3, true>;
}

}  // namespace fp8mla::detail::wide_rows
