// The story's slow strategies on the CPU, and the dispatch to their CUDA versions.
//
// Both decode FP8 (or block-scaled, or bf16) tokens into a bf16 cache with per-format lookup
// tables: a code's bf16 value is fixed once its scale is known, so the table gives exactly what
// decode_token followed by float_to_bf16 would give, at a fraction of the cost. The work is
// spread over all cores, as the library's CPU fast path is, so the demo compares strategies
// rather than thread counts.
#include "tools/fp8mla/strategies/strategies.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "fp8mla/error.h"
#include "fp8mla/format.h"
#include "src/core/check.h"

#ifdef FP8MLA_WITH_CUDA
#include "tools/fp8mla/strategies/strategies_cuda.h"
#endif

namespace fp8mla::strategies {
namespace {

using detail::require;

// Extents a view must have (-1 = any) and its element type, checked with one-line messages.
void check_view(const TensorView& t, const std::string& name, std::initializer_list<DType> dtypes,
                std::int64_t pages, std::int64_t page_size, std::int64_t width) {
  require(t.defined(), name, "is not defined");
  require(std::find(dtypes.begin(), dtypes.end(), t.dtype) != dtypes.end(), name + ".dtype",
          "unexpected dtype ", dtype_name(t.dtype));
  require(t.ndim == 3, name + ".ndim", "expected 3 dimensions, got ", t.ndim);
  require(pages < 0 || t.shape[0] == pages, name + ".shape[0]", "expected ", pages, ", got ",
          t.shape[0]);
  require(t.shape[1] == page_size, name + ".shape[1]", "expected page size ", page_size, ", got ",
          t.shape[1]);
  require(t.shape[2] == width, name + ".shape[2]", "expected ", width, ", got ", t.shape[2]);
  require(t.stride[2] == 1, name + ".stride[2]", "innermost stride must be 1, got ", t.stride[2]);
  require(t.stride[0] >= 0 && t.stride[1] >= 0, name + ".stride", "strides must be >= 0");
}

// Checks src (any format) and dst (bf16, same page size) and returns src's page count.
std::int64_t check_views(const KvCacheView& src, const KvCacheView& dst) {
  const std::int64_t page_size = src.ckv.ndim == 3 ? src.ckv.shape[1] : -1;
  if (src.format == KvFormat::fp8_e4m3_block) {
    check_view(src.ckv, "src.ckv", {DType::u8}, -1, page_size, token_bytes(src.format));
  } else {
    if (src.format == KvFormat::bf16) {
      check_view(src.ckv, "src.ckv", {DType::bf16}, -1, page_size, kDimCkv);
      check_view(src.kpe, "src.kpe", {DType::bf16}, src.ckv.shape[0], page_size, kDimKpe);
    } else {
      check_view(src.ckv, "src.ckv", {DType::fp8_e4m3, DType::u8}, -1, page_size, kDimCkv);
      check_view(src.kpe, "src.kpe", {DType::fp8_e4m3, DType::u8}, src.ckv.shape[0], page_size,
                 kDimKpe);
    }
  }
  require(dst.format == KvFormat::bf16, "dst.format", "expected bf16, got ",
          format_name(dst.format));
  check_view(dst.ckv, "dst.ckv", {DType::bf16}, -1, page_size, kDimCkv);
  check_view(dst.kpe, "dst.kpe", {DType::bf16}, dst.ckv.shape[0], page_size, kDimKpe);
  for (const TensorView* t : {&src.kpe, &dst.ckv, &dst.kpe}) {
    if (!t->defined()) continue;  // block format: no kpe view
    require(t->device == src.ckv.device && t->device_id == src.ckv.device_id, "dst.device",
            "all views must be on ", device_name(src.ckv.device), ":", src.ckv.device_id);
  }
  return src.ckv.shape[0];
}

// Byte address of token (page, offset) of a 3-d view.
std::uint8_t* token_ptr(const TensorView& t, std::int64_t page, std::int64_t offset) {
  return static_cast<std::uint8_t*>(t.data) + (page * t.stride[0] + offset * t.stride[1]) *
                                                  static_cast<std::int64_t>(dtype_size(t.dtype));
}

// Turns one source token into 512 + 64 bf16 values.
class TokenDecoder {
 public:
  explicit TokenDecoder(const KvCacheView& src) : src_(src) {
    for (int c = 0; c < 256; ++c) {
      const float v = fp8_e4m3_to_float(static_cast<std::uint8_t>(c));
      code_value_[c] = v;
      ckv_lut_[c] = float_to_bf16(v * src.ckv_scale);
      kpe_lut_[c] = float_to_bf16(v * src.kpe_scale);
    }
  }

  void decode(std::int64_t page, std::int64_t offset, std::uint16_t* ckv,
              std::uint16_t* kpe) const {
    const std::uint8_t* c = token_ptr(src_.ckv, page, offset);
    switch (src_.format) {
      case KvFormat::bf16:
        std::memcpy(ckv, c, kDimCkv * 2);
        std::memcpy(kpe, token_ptr(src_.kpe, page, offset), kDimKpe * 2);
        break;
      case KvFormat::fp8_e4m3: {
        const std::uint8_t* k = token_ptr(src_.kpe, page, offset);
        for (int i = 0; i < kDimCkv; ++i) ckv[i] = ckv_lut_[c[i]];
        for (int i = 0; i < kDimKpe; ++i) kpe[i] = kpe_lut_[k[i]];
        break;
      }
      case KvFormat::fp8_e4m3_block:
        for (int g = 0; g < kBlockScales; ++g) {
          float scale = 0.0f;  // little endian float32, possibly unaligned
          std::memcpy(&scale, c + kBlockScaleOffset + 4 * g, sizeof(float));
          const std::uint8_t* codes = c + g * kBlockGroup;
          std::uint16_t* out = ckv + g * kBlockGroup;
          // A power-of-two scale (what DeepSeek's writer stores) times an e4m3 value (4
          // significant bits) is exact in float32 with the low 16 bits zero, so bf16 is its upper
          // half: no rounding to do. Far from the subnormal range that holds for inf and NaN too.
          // Any other scale takes the rounding path.
          const auto bits = std::bit_cast<std::uint32_t>(scale);
          const std::uint32_t exponent = (bits >> 23) & 0xff;
          if ((bits & 0x7fffff) == 0 && exponent >= 30 && exponent < 255) {
            for (int i = 0; i < kBlockGroup; ++i) {
              out[i] = static_cast<std::uint16_t>(
                  std::bit_cast<std::uint32_t>(code_value_[codes[i]] * scale) >> 16);
            }
          } else {
            for (int i = 0; i < kBlockGroup; ++i) {
              out[i] = float_to_bf16(code_value_[codes[i]] * scale);
            }
          }
        }
        std::memcpy(kpe, c + kBlockRopeOffset, kDimKpe * 2);
        break;
    }
  }

 private:
  const KvCacheView& src_;
  std::array<float, 256> code_value_{};
  std::array<std::uint16_t, 256> ckv_lut_{};
  std::array<std::uint16_t, 256> kpe_lut_{};
};

// Decodes dst page i from src page src_page(i) for i in [0, n), split over the cores by tokens
// (pages of 1 token are common, so pages alone would balance poorly only for huge pages).
template <class SrcPage>
void cast_pages(const KvCacheView& src, const KvCacheView& dst, std::int64_t n, SrcPage src_page) {
  const std::int64_t page_size = src.ckv.shape[1];
  const std::int64_t tokens = n * page_size;
  const TokenDecoder decoder(src);
  auto work = [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t t = begin; t < end; ++t) {
      const std::int64_t page = t / page_size;
      const std::int64_t offset = t % page_size;
      decoder.decode(src_page(page), offset,
                     reinterpret_cast<std::uint16_t*>(token_ptr(dst.ckv, page, offset)),
                     reinterpret_cast<std::uint16_t*>(token_ptr(dst.kpe, page, offset)));
    }
  };
  // Below ~8K tokens a thread costs more to start than it saves.
  constexpr std::int64_t kMinTokensPerThread = 8192;
  const std::int64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const std::int64_t threads = std::clamp<std::int64_t>(tokens / kMinTokensPerThread, 1, hw);
  if (threads == 1) {
    work(0, tokens);
    return;
  }
  std::vector<std::jthread> pool;
  pool.reserve(static_cast<std::size_t>(threads - 1));
  const std::int64_t per = (tokens + threads - 1) / threads;
  for (std::int64_t i = 1; i < threads; ++i) {
    pool.emplace_back(work, std::min(tokens, i * per), std::min(tokens, (i + 1) * per));
  }
  work(0, std::min(tokens, per));
}

[[noreturn, maybe_unused]] void no_cuda(const char* what) {
  throw Error(ErrorCode::unsupported, what,
              "device views need a build with CUDA (configure with -DFP8MLA_CUDA=ON)");
}

}  // namespace

void cast_pool_to_bf16(const KvCacheView& src, const KvCacheView& dst,
                       [[maybe_unused]] void* stream) {
  const std::int64_t num_pages = check_views(src, dst);
  require(dst.ckv.shape[0] == num_pages, "dst.ckv.shape[0]", "expected the source's ", num_pages,
          " pages, got ", dst.ckv.shape[0]);
  if (src.ckv.device == DeviceKind::cuda) {
#ifdef FP8MLA_WITH_CUDA
    cuda_cast_pool_to_bf16(src, dst, stream);
    return;
#else
    no_cuda("src.ckv.device");
#endif
  }
  cast_pages(src, dst, num_pages, [](std::int64_t p) { return p; });
}

void gather_cast_to_bf16(const KvCacheView& src, const std::int32_t* pages, std::int64_t n,
                         const KvCacheView& dst, [[maybe_unused]] void* stream) {
  const std::int64_t num_pages = check_views(src, dst);
  require(n >= 0, "n", "must be >= 0, got ", n);
  require(n == 0 || pages != nullptr, "pages", "is null with n = ", n);
  require(dst.ckv.shape[0] >= n, "dst.ckv.shape[0]", "holds ", dst.ckv.shape[0],
          " pages, fewer than the ", n, " to gather");
  if (src.ckv.device == DeviceKind::cuda) {
#ifdef FP8MLA_WITH_CUDA
    cuda_gather_cast_to_bf16(src, pages, n, dst, stream);
    return;
#else
    no_cuda("src.ckv.device");
#endif
  }
  for (std::int64_t i = 0; i < n; ++i) {
    require(pages[i] >= 0 && pages[i] < num_pages, "pages[" + std::to_string(i) + "]", pages[i],
            " is outside the pool [0, ", num_pages, ")");
  }
  cast_pages(src, dst, n, [pages](std::int64_t i) { return pages[i]; });
}

}  // namespace fp8mla::strategies
