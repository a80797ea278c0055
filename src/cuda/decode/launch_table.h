// The CUDA launch table: a kernel family (src/core/dispatch.h) and the tile's format and rows ->
// the kernel run() launches. Each family's entry() lives in its folder (src/cuda/decode/<family>/,
// instantiations/*.cu). Adding a family: its entry() and one row of kLaunchTable
// (launch_table.cpp).
#pragma once

#include "fp8mla/attention.h"
#include "src/cuda/decode_params.h"

namespace fp8mla::detail {

using DecodeFn = void (*)(const DecodeParams);
struct KernelEntry {
  DecodeFn fn;
  int smem;                  // dynamic shared memory, bytes
  int threads = 256;         // CTA size
  int regs = 0;              // > 0: the register count the kernel's setmaxnreg split assumes
  bool tensor_maps = false;  // reads the cache through DecodeParams::ckv_map / kpe_map
  // The kernel run() launches instead of fn when the plan's queries or output are fp16, for
  // families that build one apart (same smem, threads and registers) so that fn holds no fp16
  // conversion; nullptr: fn serves every dtype.
  DecodeFn half_fn = nullptr;
  // The kernel run() launches when every tile of the plan has at most 8 rows (plan.kernel_rows),
  // for families that build one (same smem, threads and registers); nullptr: fn serves them. It
  // serves the dtypes fn serves: a family with a half_fn runs fp16 plans on half_fn at any rows.
  DecodeFn rows8_fn = nullptr;
};

// The kernel of `family` for a `format` cache and tiles of `row_tiles` 16-row m-tiles (1, 2 or 4)
// on device `device_id`. The dispatch table gives a family only what it serves; anything else is
// Error(internal).
KernelEntry kernel_entry(KernelFamily family, KvFormat format, int row_tiles, int device_id);
// Error(internal): `family` has no kernel for this format and row count.
[[noreturn]] void no_kernel(KernelFamily family, KvFormat format, int row_tiles);

namespace shared_tile {
KernelEntry entry(KvFormat format, int row_tiles, int device_id);
}
namespace fp8_exact {
KernelEntry entry(KvFormat format, int row_tiles, int device_id);
}
namespace fp8_tma {
KernelEntry entry(KvFormat format, int row_tiles, int device_id);
}
namespace fp8_gather {
KernelEntry entry(KvFormat format, int row_tiles, int device_id);
}
namespace bf16_tma {
KernelEntry entry(KvFormat format, int row_tiles, int device_id);
}
namespace bf16_gather {
KernelEntry entry(KvFormat format, int row_tiles, int device_id);
}
namespace wide_rows {
KernelEntry entry(KvFormat format, int row_tiles, int device_id);
}
namespace bf16_wide_rows {
KernelEntry entry(KvFormat format, int row_tiles, int device_id);
}
namespace portable {
KernelEntry entry(KvFormat format, int row_tiles, int device_id);
KernelEntry fp8_entry(KvFormat format, int row_tiles, int device_id);        // portable_fp8
KernelEntry f16_exact_entry(KvFormat format, int row_tiles, int device_id);  // portable_f16_exact
}  // namespace portable

}  // namespace fp8mla::detail
