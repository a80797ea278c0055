// wide_rows for fp8_e4m3 caches.
#include "src/cuda/decode/launch_table.h"
#include "src/cuda/decode/wide_rows/kernel.cuh"

namespace fp8mla::detail::wide_rows {

DecodeFn fp8_e4m3_f16();  // fp8_e4m3_f16.cu

KernelEntry fp8_e4m3() {
  return {&wide_rows_kernel<KvFormat::fp8_e4m3, false>,
          Layout<false>::kSmemBytes,
          kThreads,
          kLaunchRegs,
          false,
          fp8_e4m3_f16()};
}

}  // namespace fp8mla::detail::wide_rows
