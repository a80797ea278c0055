// Quantizing append into a device cache: bit-identical to the host codec (src/core/format.cpp).
#include "src/core/backend.h"
#include "src/core/check.h"
#include "src/cuda/cuda_check.h"
#include "src/cuda/ops/convert.cuh"

namespace fp8mla::detail {

namespace cache {

constexpr int kWarpsPerBlock = 8;

// Same rules as float_to_fp8_e4m3: RNE, saturate beyond 448 (and inf), NaN -> 0x7f | sign.
__device__ __forceinline__ std::uint8_t encode_e4m3(float x) {
  const std::uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u)
    return static_cast<std::uint8_t>(0x7f | ((bits >> 24) & 0x80));
  return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float pow2_ceil(float v) {
  const std::uint32_t bits = __float_as_uint(v);
  const std::uint32_t exponent = bits >> 23, mantissa = bits & 0x7fffffu;
  if (exponent >= 254 && mantissa != 0) return __uint_as_float(254u << 23);
  return __uint_as_float((exponent + (mantissa != 0 ? 1u : 0u)) << 23);
}

template <class T>
__device__ __forceinline__ float load_value(const void* base, std::int64_t i) {
  return static_cast<float>(static_cast<const T*>(base)[i]);
}

template <class T>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    append_kernel(KvFormat format, float scale, std::uint8_t* storage, std::int64_t pool_slots,
                  const std::int32_t* slots, std::int64_t n, const T* ckv, std::int64_t ckv_row,
                  const T* kpe, std::int64_t kpe_row) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= n) return;
  const std::int64_t slot = slots[i];
  if (slot < 0 || slot >= pool_slots) return;  // documented: never writes outside the cache
  float x[16], r[2];
#pragma unroll
  for (int k = 0; k < 16; ++k) x[k] = static_cast<float>(ckv[i * ckv_row + 16 * lane + k]);
  r[0] = static_cast<float>(kpe[i * kpe_row + 2 * lane]);
  r[1] = static_cast<float>(kpe[i * kpe_row + 2 * lane + 1]);
  std::uint8_t* tok = storage + slot * token_bytes(format);
  if (format == KvFormat::bf16) {
    auto* dst = reinterpret_cast<__nv_bfloat16*>(tok);
#pragma unroll
    for (int k = 0; k < 16; ++k) dst[16 * lane + k] = __float2bfloat16_rn(x[k]);
    dst[512 + 2 * lane] = __float2bfloat16_rn(r[0]);
    dst[512 + 2 * lane + 1] = __float2bfloat16_rn(r[1]);
    return;
  }
  float s = scale;
  if (format == KvFormat::fp8_e4m3_block) {
    // amax of the lane's 128-value group (lanes 8g .. 8g + 7); NaN takes no part.
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const float a = fabsf(x[k]);
      if (a > amax) amax = a;
    }
#pragma unroll
    for (int off = 1; off < 8; off *= 2)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    float v = __fdiv_rn(amax, kFp8Max);
    if (!(v >= 1e-4f)) v = 1e-4f;
    s = isinf(v) ? __uint_as_float(254u << 23) : pow2_ceil(v);
    if (lane % 8 == 0) reinterpret_cast<float*>(tok + kBlockScaleOffset)[lane / 8] = s;
  }
  std::uint32_t packed[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    packed[k] = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b)
      packed[k] |= static_cast<std::uint32_t>(encode_e4m3(__fdiv_rn(x[4 * k + b], s))) << (8 * b);
  }
  *reinterpret_cast<uint4*>(tok + 16 * lane) =
      make_uint4(packed[0], packed[1], packed[2], packed[3]);
  if (format == KvFormat::fp8_e4m3) {
    tok[512 + 2 * lane] = encode_e4m3(__fdiv_rn(r[0], scale));
    tok[512 + 2 * lane + 1] = encode_e4m3(__fdiv_rn(r[1], scale));
  } else {
    auto* rope = reinterpret_cast<__nv_bfloat16*>(tok + kBlockRopeOffset);
    rope[2 * lane] = __float2bfloat16_rn(r[0]);
    rope[2 * lane + 1] = __float2bfloat16_rn(r[1]);
  }
}

}  // namespace cache

void cuda_append(const CacheConfig& config, void* storage, const TensorView& slots,
                 const TensorView& ckv, const TensorView& kpe, void* stream) {
  const std::int64_t n = slots.shape[0];
  if (n == 0) return;
  FP8MLA_CUDA_CHECK(cudaSetDevice(config.device_id));
  const auto blocks =
      static_cast<unsigned>((n + cache::kWarpsPerBlock - 1) / cache::kWarpsPerBlock);
  const std::int64_t pool = config.num_pages * config.page_size;
  auto* dst = static_cast<std::uint8_t*>(storage);
  auto* s = static_cast<const std::int32_t*>(slots.data);
  const auto st = static_cast<cudaStream_t>(stream);
  const auto launch = [&](auto* c, auto* k) {
    cache::append_kernel<<<blocks, 32 * cache::kWarpsPerBlock, 0, st>>>(
        config.format, config.scale, dst, pool, s, n, c, ckv.stride[0], k, kpe.stride[0]);
    FP8MLA_CUDA_CHECK_LAUNCH("append_kernel");
  };
  switch (ckv.dtype) {
    case DType::f32:
      launch(static_cast<const float*>(ckv.data), static_cast<const float*>(kpe.data));
      break;
    case DType::bf16:
      launch(static_cast<const __nv_bfloat16*>(ckv.data),
             static_cast<const __nv_bfloat16*>(kpe.data));
      break;
    case DType::f16:
      launch(static_cast<const __half*>(ckv.data), static_cast<const __half*>(kpe.data));
      break;
    default:
      throw Error(ErrorCode::invalid_argument, "ckv.dtype",
                  msg("expected bf16, f16 or f32, got ", dtype_name(ckv.dtype)));
  }
}

}  // namespace fp8mla::detail
