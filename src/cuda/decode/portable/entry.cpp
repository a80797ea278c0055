// The portable families' entries in the launch table (src/cuda/decode/launch_table.h):
// portable (fp16 products), portable_fp8 (fp8 products) and portable_f16_exact (fp16 queries over
// a bf16 cache, fp16-exact products), sized for the device.
#include <cstdlib>
#include <string>

#include "src/cuda/cuda_check.h"
#include "src/cuda/decode/launch_table.h"
#include "src/cuda/decode/portable/launch.h"

namespace fp8mla::detail::portable {

namespace {

// Shared memory a portable kernel gets on `device_id`: two cp.async stages where the device
// allows them (sm_80, sm_90, sm_100), else one (sm_86, sm_89, sm_120: 99 KB a CTA).
// FP8MLA_PORTABLE_STAGES=1 in the environment asks for one everywhere (the GPU tests run the
// one-stage form on Hopper so).
int portable_smem(const KernelInfo& k, int device_id) {
  int optin = 0;
  FP8MLA_CUDA_CHECK(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id));
  static const bool one_stage = [] {
    const char* v = std::getenv("FP8MLA_PORTABLE_STAGES");
    return v != nullptr && std::string(v) == "1";
  }();
  return !one_stage && k.smem_two_stages <= optin ? k.smem_two_stages : k.smem_one_stage;
}

KernelEntry sized(const KernelInfo& k, int device_id) {
  return {k.fn, portable_smem(k, device_id), kThreads};
}

}  // namespace

KernelEntry entry(KvFormat format, int row_tiles, int device_id) {
  return sized(kernel_for(format, row_tiles, Scores::f16), device_id);
}

KernelEntry fp8_entry(KvFormat format, int row_tiles, int device_id) {
  return sized(kernel_for(format, row_tiles, Scores::e4m3), device_id);
}

KernelEntry f16_exact_entry(KvFormat format, int row_tiles, int device_id) {
  return sized(kernel_for(format, row_tiles, Scores::bf16x2), device_id);
}

}  // namespace fp8mla::detail::portable
