// wide_rows for bf16 caches.
#include "src/cuda/decode/launch_table.h"
#include "src/cuda/decode/wide_rows/kernel.cuh"

namespace fp8mla::detail::wide_rows {

DecodeFn bf16_f16();  // bf16_f16.cu

KernelEntry bf16() {
  return {&wide_rows_kernel<KvFormat::bf16, false>,
          Layout<true>::kSmemBytes,
          kThreads,
          kLaunchRegs,
          false,
          bf16_f16()};
}

}  // namespace fp8mla::detail::wide_rows
