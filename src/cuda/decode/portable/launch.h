// The portable family's kernels as the launcher sees them: one instantiation file each
// (instantiations/*.cu) defines kernel_info<F, MT, S>().
#pragma once

#include "fp8mla/format.h"
#include "src/cuda/decode/portable/config.h"
#include "src/cuda/decode_params.h"

namespace fp8mla::detail::portable {

struct KernelInfo {
  void (*fn)(DecodeParams);
  int smem_one_stage;   // dynamic shared memory with one cp.async stage
  int smem_two_stages;  // with two (the kernel reads which from the size it gets)
};

template <KvFormat F, int MT, Scores S>
KernelInfo kernel_info();

// The kernel for a cache format, 16-row m-tiles (1, 2 or 4) and score products.
KernelInfo kernel_for(KvFormat format, int row_tiles, Scores scores);

}  // namespace fp8mla::detail::portable
