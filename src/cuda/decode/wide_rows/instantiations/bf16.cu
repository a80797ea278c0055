// wide_rows for bf16 caches.
#include "src/cuda/decode/launch_table.h"
#include "src/cuda/decode/wide_rows/kernel.cuh"

namespace fp8mla::detail::wide_rows {

KernelEntry bf16() {
  return {&wide_rows_kernel<KvFormat::bf16>, Layout<true>::kSmemBytes, kThreads, kLaunchRegs};
}

}  // namespace fp8mla::detail::wide_rows
