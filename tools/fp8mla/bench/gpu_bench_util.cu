// The GPU benchmarks' shared kernels and views (gpu_bench_util.cuh).
#include <cuda_fp16.h>

#include <cmath>
#include <numeric>
#include <random>

#include "tools/fp8mla/bench/gpu_bench_util.cuh"

namespace fp8mla::bench {
namespace {

__global__ void read_kernel(const uint4* p, std::size_t n, std::uint32_t* sink) {
  std::uint32_t acc = 0;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads alive
}

__global__ void copy_kernel(const uint4* src, uint4* dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    __stcs(dst + i, __ldcs(src + i));
}

__device__ std::uint32_t hash32(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<std::uint32_t>(x);
}

// Random but well-formed tokens: fp8 codes of magnitude 2^-4..2^3 (no NaN), bf16 values in
// (-2, 2), block scales 2^-2..2^1.
__global__ void fill_kernel(std::uint8_t* pool, std::int64_t tokens, int format,
                            std::uint64_t seed) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int tb = format == 0 ? 1152 : format == 1 ? 576 : 656;
  if (i >= tokens * tb / 4) return;
  const std::int64_t byte = 4 * i, in_tok = byte % tb;
  const std::uint32_t h = hash32(seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(i));
  std::uint32_t w = 0;
  const auto bf16 = [&](std::uint32_t r) {
    const float f = (static_cast<float>(r & 0xffff) / 65536.0f - 0.5f) * 4.0f;
    return static_cast<std::uint32_t>(__float_as_uint(f) >> 16);
  };
  const auto code = [](std::uint32_t r) { return (r & 0x80) | (0x18 + (r % 0x38)); };
  if (format == 0 || (format == 2 && in_tok >= 528)) {
    w = bf16(h) | (bf16(h >> 16) << 16);
  } else if (format == 2 && in_tok >= 512) {
    w = __float_as_uint(exp2f(static_cast<float>(static_cast<int>(h % 4) - 2)));
  } else {
    for (int k = 0; k < 4; ++k) w |= code(h >> (8 * k)) << (8 * k);
  }
  reinterpret_cast<std::uint32_t*>(pool)[i] = w;
}

// n 16-bit values in (-2, 2) from a hash of seed + i: bf16 (truncated) or, kF16, fp16 (rounded).
template <bool kF16>
__global__ void fill_16bit_kernel(std::uint16_t* p, std::int64_t n, std::uint64_t seed) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float f = (static_cast<float>(hash32(seed + i) & 0xffff) / 65536.0f - 0.5f) * 4.0f;
  p[i] = kF16 ? __half_as_ushort(__float2half_rn(f))
              : static_cast<std::uint16_t>(__float_as_uint(f) >> 16);
}

__global__ void gather_tokens_kernel(const uint4* pool, std::int64_t vecs_per_token,
                                     const std::int32_t* slots, uint4* dst) {
  const std::int64_t t = blockIdx.x;
  const uint4* src = pool + static_cast<std::int64_t>(slots[t]) * vecs_per_token;
  for (std::int64_t i = threadIdx.x; i < vecs_per_token; i += blockDim.x)
    dst[t * vecs_per_token + i] = src[i];
}

// Four 16-byte loads a thread of the tokens at slots (a -1 slot reads nothing), all issued before
// any is used, so the GPU holds as many in flight as its threads allow.
__global__ void read_tokens_kernel(const uint4* pool, std::int64_t vecs_per_token,
                                   const std::int32_t* slots, std::int64_t n_vecs,
                                   std::uint32_t* sink) {
  const std::int64_t first =
      4 * (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
  uint4 v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const std::int64_t i = first + j, t = i / vecs_per_token;
    const std::int32_t slot = i < n_vecs ? __ldg(slots + t) : -1;
    v[j] = slot >= 0 ? __ldcs(pool + slot * vecs_per_token + (i - t * vecs_per_token))
                     : make_uint4(0, 0, 0, 0);
  }
  std::uint32_t acc = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads alive
}

int sm_count() {
  int device = 0, sms = 0;
  FP8MLA_CUDA_CHECK(cudaGetDevice(&device));
  FP8MLA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

}  // namespace

double measure_copy_gbs(cudaStream_t s, std::uint8_t* big, std::size_t big_bytes) {
  const std::size_t half = std::min<std::size_t>(big_bytes / 2, std::size_t{4} << 30);
  const int sms = sm_count();
  // A copy kernel, not cudaMemcpyAsync: captured in a graph, the latter may run on a copy
  // engine, which is slower than the SMs and not what a kernel can reach.
  return 2.0 * half /
         (time_captured(s, 1, 10,
                        [&] {
                          copy_kernel<<<sms * 8, 512, 0, s>>>(reinterpret_cast<const uint4*>(big),
                                                              reinterpret_cast<uint4*>(big + half),
                                                              half / 16);
                        }) *
          1e3);
}

double measure_read_gbs(cudaStream_t s, std::uint8_t* big, std::size_t big_bytes) {
  const int sms = sm_count();
  std::uint32_t* sink = reinterpret_cast<std::uint32_t*>(big + big_bytes - 64);
  const std::size_t n = std::min((std::size_t{8} << 30) / 16, (big_bytes - 64) / 16);
  return 16.0 * n /
         (time_captured(s, 1, 10,
                        [&] {
                          read_kernel<<<sms * 8, 512, 0, s>>>(reinterpret_cast<const uint4*>(big),
                                                              n, sink);
                        }) *
          1e3);
}

void fill_pool(cudaStream_t s, std::uint8_t* pool, std::int64_t tokens, KvFormat f,
               std::uint64_t seed) {
  const std::int64_t words = tokens * token_bytes(f) / 4;
  fill_kernel<<<static_cast<unsigned>((words + 255) / 256), 256, 0, s>>>(pool, tokens,
                                                                         static_cast<int>(f), seed);
  FP8MLA_CUDA_CHECK_LAUNCH("fill_kernel");
}

void fill_bf16(cudaStream_t s, std::uint16_t* p, std::int64_t n, std::uint64_t seed) {
  fill_16bit_kernel<false><<<static_cast<unsigned>((n + 255) / 256), 256, 0, s>>>(p, n, seed);
  FP8MLA_CUDA_CHECK_LAUNCH("fill_bf16");
}

void fill_f16(cudaStream_t s, std::uint16_t* p, std::int64_t n, std::uint64_t seed) {
  fill_16bit_kernel<true><<<static_cast<unsigned>((n + 255) / 256), 256, 0, s>>>(p, n, seed);
  FP8MLA_CUDA_CHECK_LAUNCH("fill_f16");
}

void gather_tokens(cudaStream_t s, const std::uint8_t* pool, std::int64_t token_bytes,
                   const std::int32_t* slots, std::int64_t n, std::uint8_t* dst) {
  if (n == 0) return;
  gather_tokens_kernel<<<static_cast<unsigned>(n), 64, 0, s>>>(
      reinterpret_cast<const uint4*>(pool), token_bytes / 16, slots, reinterpret_cast<uint4*>(dst));
  FP8MLA_CUDA_CHECK_LAUNCH("gather_tokens");
}

void read_tokens(cudaStream_t s, const std::uint8_t* pool, std::int64_t token_bytes,
                 const std::int32_t* slots, std::int64_t n, std::uint32_t* sink) {
  const std::int64_t n_vecs = n * (token_bytes / 16);
  if (n_vecs == 0) return;
  read_tokens_kernel<<<static_cast<unsigned>((n_vecs + 1023) / 1024), 256, 0, s>>>(
      reinterpret_cast<const uint4*>(pool), token_bytes / 16, slots, n_vecs, sink);
  FP8MLA_CUDA_CHECK_LAUNCH("read_tokens");
}

double rel_l2_bf16(std::span<const std::uint16_t> got, std::span<const std::uint16_t> want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double x = bf16_to_float(got[i]), y = bf16_to_float(want[i]);
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
}

KvCacheView cache_view(std::uint8_t* base, KvFormat f, std::int64_t pages, int ps, int device_id,
                       DeviceKind kind) {
  KvCacheView v;
  v.format = f;
  const std::int64_t tb = token_bytes(f);
  if (f == KvFormat::fp8_e4m3_block) {
    v.ckv = make_strided_view(base, DType::u8, {pages, ps, tb}, {ps * tb, tb, 1}, kind, device_id);
    return v;
  }
  const DType dt = f == KvFormat::bf16 ? DType::bf16 : DType::fp8_e4m3;
  const std::int64_t e = f == KvFormat::bf16 ? 2 : 1, t = tb / e;
  v.ckv = make_strided_view(base, dt, {pages, ps, 512}, {ps * t, t, 1}, kind, device_id);
  v.kpe = make_strided_view(base + 512 * e, dt, {pages, ps, 64}, {ps * t, t, 1}, kind, device_id);
  return v;
}

UniformBatch::UniformBatch(int bs, int ctx, int ps, int n_regions, std::uint64_t seed, int qo_len_)
    : qo_indptr(static_cast<std::size_t>(bs + 1)),
      kv_indptr(static_cast<std::size_t>(bs + 1)),
      kv_len(static_cast<std::size_t>(bs), ctx),
      regions(static_cast<std::size_t>(n_regions)),
      qo_len(qo_len_) {
  const std::int32_t per_req = (ctx + ps - 1) / ps, per_call = per_req * bs;
  std::mt19937_64 rng(seed);
  for (std::vector<std::int32_t>& r : regions) {
    r.resize(static_cast<std::size_t>(per_call));
    std::iota(r.begin(), r.end(), static_cast<std::int32_t>(&r - regions.data()) * per_call);
    std::shuffle(r.begin(), r.end(), rng);
  }
  for (int r = 0; r <= bs; ++r) qo_indptr[r] = r * qo_len, kv_indptr[r] = r * per_req;
}

Problem UniformBatch::problem(std::span<const std::int32_t> indices, int heads, int ps,
                              std::int64_t num_pages, KvFormat f, int device_id) const {
  Problem p;
  p.num_heads = heads;
  p.page_size = ps;
  p.num_pages = num_pages;
  p.kv_format = f;
  p.causal = qo_len > 1;  // one token: the same either way (and as the earlier grids ran)
  p.sm_scale = 1.0f / std::sqrt(192.0f);
  p.qo_indptr = qo_indptr;
  p.kv_indptr = kv_indptr;
  p.kv_indices = indices;
  p.kv_len = kv_len;
  p.device = DeviceKind::cuda;
  p.device_id = device_id;
  return p;
}

}  // namespace fp8mla::bench
