// The CUDA launch table (launch_table.h).
#include "fp8mla/error.h"
#include "src/core/check.h"
#include "src/cuda/decode/launch_table.h"

namespace fp8mla::detail {

namespace {

struct LaunchRow {
  KernelFamily family;
  KernelEntry (*entry)(KvFormat format, int row_tiles, int device_id);
};
const LaunchRow kLaunchTable[] = {
    {KernelFamily::shared_tile, &shared_tile::entry},
    {KernelFamily::fp8_exact, &fp8_exact::entry},
    {KernelFamily::fp8_tma, &fp8_tma::entry},
    {KernelFamily::fp8_gather, &fp8_gather::entry},
    {KernelFamily::bf16_tma, &bf16_tma::entry},
    {KernelFamily::bf16_gather, &bf16_gather::entry},
    {KernelFamily::wide_rows, &wide_rows::entry},
    {KernelFamily::bf16_wide_rows, &bf16_wide_rows::entry},
    {KernelFamily::portable, &portable::entry},
    {KernelFamily::portable_fp8, &portable::fp8_entry},
    {KernelFamily::portable_f16_exact, &portable::f16_exact_entry},
};

}  // namespace

void no_kernel(KernelFamily family, KvFormat format, int row_tiles) {
  throw Error(ErrorCode::internal, "plan",
              msg("kernel family ", kernel_family_name(family), " has no CUDA kernel for ",
                  format_name(format), " tiles of ", 16 * row_tiles, " rows"));
}

KernelEntry kernel_entry(KernelFamily family, KvFormat format, int row_tiles, int device_id) {
  for (const LaunchRow& r : kLaunchTable)
    if (r.family == family) return r.entry(format, row_tiles, device_id);
  no_kernel(family, format, row_tiles);
}

}  // namespace fp8mla::detail
