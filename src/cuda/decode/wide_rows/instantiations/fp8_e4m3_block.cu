// wide_rows for block-format (fp8_e4m3_block) caches: dequantized into the bf16 tile.
#include "src/cuda/decode/launch_table.h"
#include "src/cuda/decode/wide_rows/kernel.cuh"

namespace fp8mla::detail::wide_rows {

DecodeFn fp8_e4m3_block_f16();  // fp8_e4m3_block_f16.cu

KernelEntry fp8_e4m3_block() {
  return {&wide_rows_kernel<KvFormat::fp8_e4m3_block, false>,
          Layout<true>::kSmemBytes,
          kThreads,
          kLaunchRegs,
          false,
          fp8_e4m3_block_f16()};
}

}  // namespace fp8mla::detail::wide_rows
