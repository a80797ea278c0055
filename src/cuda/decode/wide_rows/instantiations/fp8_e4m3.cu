// wide_rows for fp8_e4m3 caches.
#include "src/cuda/decode/launch_table.h"
#include "src/cuda/decode/wide_rows/kernel.cuh"

namespace fp8mla::detail::wide_rows {

KernelEntry fp8_e4m3() {
  return {&wide_rows_kernel<KvFormat::fp8_e4m3>, Layout<false>::kSmemBytes, kThreads, kLaunchRegs};
}

}  // namespace fp8mla::detail::wide_rows
