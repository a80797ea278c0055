// merge_states() on CUDA (include/fp8mla/attention.h): general strides and dtypes, one warp a
// row.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "src/core/backend.h"
#include "src/cuda/cuda_check.h"
#include "src/cuda/merge/nan_max.cuh"

namespace fp8mla::detail {

namespace merge {

constexpr int kMergeWarps = 8;

template <class In, class Out>
__global__ void merge_states_kernel(const In* v, std::int64_t v_r, std::int64_t v_s, const float* s,
                                    std::int64_t s_r, std::int64_t s_s, Out* vo, std::int64_t vo_r,
                                    float* so, std::int64_t so_r, std::int64_t rows, int states,
                                    int dim) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float mx = -INFINITY;
  for (int i = 0; i < states; ++i) mx = nan_max(mx, s[row * s_r + i * s_s]);
  float wsum = 0.0f;
  if (mx != -INFINITY)
    for (int i = 0; i < states; ++i) wsum += __expf(s[row * s_r + i * s_s] - mx);
  const float inv = wsum > 0.0f ? 1.0f / wsum : wsum == 0.0f ? 0.0f : NAN;  // NaN lse stays NaN
  for (int d = lane; d < dim; d += 32) {
    float acc = 0.0f;
    if (mx != -INFINITY)
      for (int i = 0; i < states; ++i) {
        const float w = __expf(s[row * s_r + i * s_s] - mx);
        if (w > 0.0f) acc += w * static_cast<float>(v[row * v_r + i * v_s + d]);
      }
    vo[row * vo_r + d] = static_cast<Out>(acc * inv);
  }
  if (so != nullptr && lane == 0)
    so[row * so_r] = wsum > 0.0f ? mx + logf(wsum) : wsum == 0.0f ? -INFINITY : NAN;
}

}  // namespace merge

void cuda_merge_states(const TensorView& v, const TensorView& s, const TensorView& v_out,
                       const TensorView& s_out, void* stream) {
  FP8MLA_CUDA_CHECK(cudaSetDevice(v.device_id));
  const std::int64_t rows = v.shape[0];
  if (rows == 0) return;
  const int states = static_cast<int>(v.shape[1]), dim = static_cast<int>(v.shape[2]);
  const auto blocks = static_cast<unsigned>((rows + merge::kMergeWarps - 1) / merge::kMergeWarps);
  float* so = s_out.defined() ? static_cast<float*>(s_out.data) : nullptr;
  const std::int64_t so_r = s_out.defined() ? s_out.stride[0] : 0;
  const auto launch = [&](auto* in, auto* out) {
    merge::merge_states_kernel<<<blocks, 32 * merge::kMergeWarps, 0,
                                 static_cast<cudaStream_t>(stream)>>>(
        in, v.stride[0], v.stride[1], static_cast<const float*>(s.data), s.stride[0], s.stride[1],
        out, v_out.stride[0], so, so_r, rows, states, dim);
    FP8MLA_CUDA_CHECK_LAUNCH("merge_states_kernel");
  };
  const bool in_f32 = v.dtype == DType::f32, out_f32 = v_out.dtype == DType::f32;
  auto* vi32 = static_cast<const float*>(v.data);
  auto* vib = static_cast<const __nv_bfloat16*>(v.data);
  auto* vo32 = static_cast<float*>(v_out.data);
  auto* vob = static_cast<__nv_bfloat16*>(v_out.data);
  if (in_f32 && out_f32) launch(vi32, vo32);
  if (in_f32 && !out_f32) launch(vi32, vob);
  if (!in_f32 && out_f32) launch(vib, vo32);
  if (!in_f32 && !out_f32) launch(vib, vob);
}

}  // namespace fp8mla::detail
