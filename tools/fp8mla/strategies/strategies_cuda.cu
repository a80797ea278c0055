// The story's two slow strategies on the GPU: decode FP8 tokens to a bf16 cache (whole pool, or
// the gathered active pages), so the bf16 attention path can run on the result.
#include "tools/fp8mla/strategies/strategies_cuda.h"
#include "src/cuda/cuda_check.h"
#include "src/cuda/ops/convert.cuh"

namespace fp8mla::strategies {
namespace {

struct CastParams {
  KvFormat format;
  const std::uint8_t* ckv;  // source token bytes (block: the whole 656-byte token)
  const std::uint8_t* kpe;
  std::int64_t ckv_page, ckv_tok, kpe_page, kpe_tok;  // byte strides
  float ckv_scale, kpe_scale;
  __nv_bfloat16* dckv;  // destination bf16 views
  __nv_bfloat16* dkpe;
  std::int64_t dckv_page, dckv_tok, dkpe_page, dkpe_tok;  // element strides
  const std::int32_t* pages;  // dst page i <- src page pages[i]; null = identity
  std::int64_t num_pages;
  int page_size;
};

// One thread per 8 values of a token: 72 groups (64 ckv + 8 kpe).
__global__ void cast_kernel(const CastParams p) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t tokens = p.num_pages * p.page_size;
  if (i >= tokens * 72) return;
  const std::int64_t token = i / 72;
  const int g = static_cast<int>(i % 72);
  const std::int64_t dpage = token / p.page_size, off = token % p.page_size;
  const std::int64_t spage = p.pages == nullptr ? dpage : p.pages[dpage];
  const bool rope = g >= 64;
  __nv_bfloat16* dst = rope ? p.dkpe + dpage * p.dkpe_page + off * p.dkpe_tok + 8 * (g - 64)
                            : p.dckv + dpage * p.dckv_page + off * p.dckv_tok + 8 * g;
  const std::uint8_t* tok_ckv = p.ckv + spage * p.ckv_page + off * p.ckv_tok;
  float v[8];
  if (p.format == KvFormat::bf16) {
    const std::uint8_t* src =
        rope ? p.kpe + spage * p.kpe_page + off * p.kpe_tok + 16 * (g - 64) : tok_ckv + 16 * g;
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    return;
  }
  if (p.format == KvFormat::fp8_e4m3_block && rope) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(tok_ckv + 528 + 16 * (g - 64));
    return;
  }
  const std::uint8_t* src =
      rope ? p.kpe + spage * p.kpe_page + off * p.kpe_tok + 8 * (g - 64) : tok_ckv + 8 * g;
  float scale = rope ? p.kpe_scale : p.ckv_scale;
  if (p.format == KvFormat::fp8_e4m3_block)
    scale = reinterpret_cast<const float*>(tok_ckv + 512)[g / 16];
  const uint2 codes = *reinterpret_cast<const uint2*>(src);
  const std::uint32_t w[2] = {codes.x, codes.y};
  for (int k = 0; k < 2; ++k) {
    const float2 lo = detail::fp8x2_to_float2(static_cast<std::uint16_t>(w[k] & 0xffff));
    const float2 hi = detail::fp8x2_to_float2(static_cast<std::uint16_t>(w[k] >> 16));
    v[4 * k] = lo.x * scale, v[4 * k + 1] = lo.y * scale;
    v[4 * k + 2] = hi.x * scale, v[4 * k + 3] = hi.y * scale;
  }
  uint4 out;
  out.x = detail::float2_to_bf16x2(v[0], v[1]);
  out.y = detail::float2_to_bf16x2(v[2], v[3]);
  out.z = detail::float2_to_bf16x2(v[4], v[5]);
  out.w = detail::float2_to_bf16x2(v[6], v[7]);
  *reinterpret_cast<uint4*>(dst) = out;
}

std::int64_t bytes(const TensorView& t, int d) {
  return t.stride[d] * static_cast<std::int64_t>(dtype_size(t.dtype));
}

void launch(const KvCacheView& src, const std::int32_t* pages, std::int64_t n,
            const KvCacheView& dst, void* stream) {
  CastParams p{};
  p.format = src.format;
  p.ckv = static_cast<const std::uint8_t*>(src.ckv.data);
  p.ckv_page = bytes(src.ckv, 0);
  p.ckv_tok = bytes(src.ckv, 1);
  if (src.kpe.defined()) {
    p.kpe = static_cast<const std::uint8_t*>(src.kpe.data);
    p.kpe_page = bytes(src.kpe, 0);
    p.kpe_tok = bytes(src.kpe, 1);
  }
  p.ckv_scale = src.ckv_scale;
  p.kpe_scale = src.kpe_scale;
  p.dckv = static_cast<__nv_bfloat16*>(dst.ckv.data);
  p.dkpe = static_cast<__nv_bfloat16*>(dst.kpe.data);
  p.dckv_page = dst.ckv.stride[0];
  p.dckv_tok = dst.ckv.stride[1];
  p.dkpe_page = dst.kpe.stride[0];
  p.dkpe_tok = dst.kpe.stride[1];
  p.pages = pages;
  p.num_pages = n;
  p.page_size = static_cast<int>(src.ckv.shape[1]);
  const std::int64_t work = n * p.page_size * 72;
  if (work == 0) return;
  FP8MLA_CUDA_CHECK(cudaSetDevice(src.ckv.device_id));
  cast_kernel<<<static_cast<unsigned>((work + 255) / 256), 256, 0,
                static_cast<cudaStream_t>(stream)>>>(p);
  FP8MLA_CUDA_CHECK_LAUNCH("cast_kernel");
}

}  // namespace

void cuda_cast_pool_to_bf16(const KvCacheView& src, const KvCacheView& dst, void* stream) {
  launch(src, nullptr, src.ckv.shape[0], dst, stream);
}

void cuda_gather_cast_to_bf16(const KvCacheView& src, const std::int32_t* pages, std::int64_t n,
                              const KvCacheView& dst, void* stream) {
  launch(src, pages, n, dst, stream);
}

}  // namespace fp8mla::strategies
