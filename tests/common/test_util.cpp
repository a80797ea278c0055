#include "tests/common/test_util.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>

namespace fp8mla::test {

std::string golden_dir() {
  if (const char* env = std::getenv("FP8MLA_GOLDEN_DIR"); env != nullptr && *env != '\0') {
    return env;
  }
#ifdef FP8MLA_GOLDEN_DIR
  return FP8MLA_GOLDEN_DIR;
#else
  return "../shared/golden";
#endif
}

namespace {

using Rng = std::mt19937_64;

int uniform_int(Rng& rng, int lo, int hi) {
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}
double uniform01(Rng& rng) {
  return std::uniform_real_distribution<double>(0.0, 1.0)(rng);
}

// Bytes of one element of the ckv / kpe views.
std::int64_t element_bytes(KvFormat f) {
  return f == KvFormat::bf16 ? 2 : 1;
}

bool split_layout(const ProblemSpec& s) {
  return s.layout == CacheLayout::split && s.format != KvFormat::fp8_e4m3_block;
}

// Where the ckv and kpe halves of a token start and how far apart tokens are (all in bytes).
struct CacheGeometry {
  std::int64_t ckv_offset = 0;  // of token (0, 0)
  std::int64_t kpe_offset = 0;
  std::int64_t ckv_stride = 0;  // between two tokens
  std::int64_t kpe_stride = 0;
  std::int64_t total = 0;  // pool bytes
};

CacheGeometry geometry(const ProblemSpec& s, std::int64_t num_pages) {
  const std::int64_t e = element_bytes(s.format);
  const std::int64_t slots = num_pages * s.page_size;
  CacheGeometry g;
  if (split_layout(s)) {
    g.ckv_stride = kDimCkv * e + s.token_pad_bytes;
    g.kpe_stride = kDimKpe * e + s.token_pad_bytes;
    g.kpe_offset = slots * g.ckv_stride;
    g.total = slots * (g.ckv_stride + g.kpe_stride);
  } else {
    g.ckv_stride = token_bytes(s.format) + s.token_pad_bytes;
    g.kpe_stride = g.ckv_stride;
    g.kpe_offset = kDimCkv * e;
    g.total = slots * g.ckv_stride;
  }
  return g;
}

// One token of random values: N(0, 1) x 2^u with u drawn per group of 128 and for the rope.
void random_token(Rng& rng, float magnitude_log2, std::vector<float>& x) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-magnitude_log2, magnitude_log2);
  for (int g = 0; g <= kBlockScales; ++g) {
    const int begin = g * kBlockGroup;
    const int end = g < kBlockScales ? begin + kBlockGroup : kDimQk;
    const float magnitude = std::exp2(exponent(rng));
    for (int i = begin; i < end; ++i) x[i] = normal(rng) * magnitude;
  }
}

// Encodes x and stores it at `slot` of the pool. fp8_e4m3 encodes the kpe part with its own
// scale (encode_token takes one scale per call).
void write_token(const ProblemSpec& s, const CacheGeometry& g, std::int64_t slot,
                 std::span<const float> x, std::vector<std::uint8_t>& pool) {
  const std::int64_t tb = token_bytes(s.format);
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(tb));
  encode_token(s.format, s.ckv_scale, x, bytes);
  if (s.format == KvFormat::fp8_e4m3_block) {
    std::memcpy(pool.data() + slot * g.ckv_stride, bytes.data(), bytes.size());
    return;
  }
  const std::int64_t e = element_bytes(s.format);
  if (s.format == KvFormat::fp8_e4m3 && s.kpe_scale != s.ckv_scale) {
    std::vector<std::uint8_t> kpe(static_cast<std::size_t>(tb));
    encode_token(s.format, s.kpe_scale, x, kpe);
    std::copy(kpe.begin() + kDimCkv, kpe.end(), bytes.begin() + kDimCkv);
  }
  std::memcpy(pool.data() + g.ckv_offset + slot * g.ckv_stride, bytes.data(),
              static_cast<std::size_t>(kDimCkv * e));
  std::memcpy(pool.data() + g.kpe_offset + slot * g.kpe_stride, bytes.data() + kDimCkv * e,
              static_cast<std::size_t>(kDimKpe * e));
}

void check_spec(const ProblemSpec& s) {
  auto require = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("ProblemSpec: ") + what);
  };
  require(s.batch >= 1, "batch must be >= 1");
  require(s.num_heads >= 1, "num_heads must be >= 1");
  require(s.page_size >= 1, "page_size must be >= 1");
  require(s.qo_len_min >= 0 && s.qo_len_min <= s.qo_len_max, "need 0 <= qo_len_min <= max");
  require(s.kv_len_min >= 0 && s.kv_len_min <= s.kv_len_max, "need 0 <= kv_len_min <= max");
  require(s.token_pad_bytes >= 0 && s.token_pad_bytes % element_bytes(s.format) == 0,
          "token_pad_bytes must be a non-negative multiple of the element size");
  require(s.topk >= 0 && s.spare_pages >= 0, "topk and spare_pages must be >= 0");
}

}  // namespace

std::string describe(const ProblemSpec& s) {
  std::ostringstream os;
  os << "batch=" << s.batch << " heads=" << s.num_heads << " ps=" << s.page_size << " "
     << format_name(s.format) << " qo=[" << s.qo_len_min << "," << s.qo_len_max << "] kv=["
     << s.kv_len_min << "," << s.kv_len_max << "] empty=" << s.empty_fraction
     << " causal=" << s.causal << " topk=" << s.topk << " invalid=" << s.invalid_fraction
     << " layout=" << (s.layout == CacheLayout::fused ? "fused" : "split")
     << " pad=" << s.token_pad_bytes << " u8=" << s.fp8_as_u8 << " fused_q=" << s.fused_q
     << " scales=" << s.ckv_scale << "," << s.kpe_scale << " mag=" << s.magnitude_log2
     << " seed=" << s.seed;
  return os.str();
}

RandomCase make_case(const ProblemSpec& spec) {
  check_spec(spec);
  Rng rng(spec.seed);
  RandomCase c;
  c.spec = spec;
  c.sm_scale = spec.sm_scale > 0.0f ? spec.sm_scale : 1.0f / std::sqrt(192.0f);

  // Lengths and how many pages each request lists.
  std::vector<int> listed(static_cast<std::size_t>(spec.batch));
  c.qo_indptr.assign(1, 0);
  c.kv_indptr.assign(1, 0);
  for (int r = 0; r < spec.batch; ++r) {
    const int qo_len = uniform_int(rng, spec.qo_len_min, spec.qo_len_max);
    int kv_len = uniform_int(rng, spec.kv_len_min, spec.kv_len_max);
    if (uniform01(rng) < spec.empty_fraction) kv_len = 0;
    if (spec.causal && spec.topk == 0 && kv_len > 0) kv_len = std::max(kv_len, qo_len);
    listed[r] = (kv_len + spec.page_size - 1) / spec.page_size + (uniform01(rng) < 0.3 ? 1 : 0);
    c.qo_indptr.push_back(c.qo_indptr.back() + qo_len);
    c.kv_indptr.push_back(c.kv_indptr.back() + listed[r]);
    c.kv_len.push_back(kv_len);
  }
  c.total_q = c.qo_indptr.back();
  c.num_pages = std::max<std::int64_t>(1, c.kv_indptr.back() + spec.spare_pages);

  // Pages in a random order, so a request's pages are scattered through the pool.
  std::vector<std::int32_t> perm(static_cast<std::size_t>(c.num_pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  c.kv_indices.assign(perm.begin(), perm.begin() + c.kv_indptr.back());

  // The pool: request tokens random, every other slot NaN (or random).
  const CacheGeometry g = geometry(spec, c.num_pages);
  c.cache.assign(static_cast<std::size_t>(g.total), 0);
  const std::int64_t slots = c.num_pages * spec.page_size;
  std::vector<bool> used(static_cast<std::size_t>(slots), false);
  for (int r = 0; r < spec.batch; ++r) {
    for (std::int64_t slot : c.request_slots(r)) used[slot] = true;
  }
  std::vector<float> x(kDimQk);
  const std::vector<float> nan_token(kDimQk, std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t slot = 0; slot < slots; ++slot) {
    random_token(rng, spec.magnitude_log2, x);
    write_token(spec, g, slot, used[slot] || !spec.poison_unused ? x : nan_token, c.cache);
  }

  // q: N(0, 1) in bf16.
  std::normal_distribution<float> normal(0.0f, 1.0f);
  c.q.resize(static_cast<std::size_t>(c.rows()) * kDimQk);
  for (auto& v : c.q) v = float_to_bf16(normal(rng));

  // Sparse indices: distinct slots of the request's tokens, some positions -1.
  if (spec.topk > 0) {
    c.sparse_indices.assign(static_cast<std::size_t>(c.total_q) * spec.topk, -1);
    for (int r = 0; r < spec.batch; ++r) {
      std::vector<std::int64_t> candidates = c.request_slots(r);
      for (int t = c.qo_indptr[r]; t < c.qo_indptr[r + 1]; ++t) {
        std::size_t taken = 0;  // candidates[0, taken) are used, a partial Fisher-Yates shuffle
        for (int k = 0; k < spec.topk; ++k) {
          if (taken == candidates.size() || uniform01(rng) < spec.invalid_fraction) continue;
          const std::size_t pick =
              std::uniform_int_distribution<std::size_t>(taken, candidates.size() - 1)(rng);
          std::swap(candidates[taken], candidates[pick]);
          c.sparse_indices[static_cast<std::size_t>(t) * spec.topk + k] =
              static_cast<std::int32_t>(candidates[taken++]);
        }
      }
    }
  }
  return c;
}

std::vector<std::int64_t> RandomCase::request_slots(int r) const {
  std::vector<std::int64_t> slots;
  const std::int64_t ps = spec.page_size;
  for (std::int64_t j = 0; j < kv_len[r]; ++j) {
    slots.push_back(kv_indices[kv_indptr[r] + j / ps] * ps + j % ps);
  }
  return slots;
}

Problem RandomCase::problem(DeviceKind device, int device_id) const {
  Problem p;
  p.num_heads = spec.num_heads;
  p.page_size = spec.page_size;
  p.num_pages = num_pages;
  p.kv_format = spec.format;
  p.causal = spec.causal;
  p.sm_scale = sm_scale;
  p.qo_indptr = qo_indptr;
  p.kv_indptr = kv_indptr;
  p.kv_indices = kv_indices;
  p.kv_len = kv_len;
  p.topk = spec.topk;
  p.sparse_indices = sparse_indices;
  p.device = device;
  p.device_id = device_id;
  return p;
}

KvCacheView RandomCase::kv_view(void* cache_data, DeviceKind device, int device_id) const {
  const CacheGeometry g = geometry(spec, num_pages);
  const std::int64_t ps = spec.page_size;
  auto* base = static_cast<std::uint8_t*>(cache_data);
  KvCacheView kv;
  kv.format = spec.format;
  if (spec.format == KvFormat::fp8_e4m3_block) {
    kv.ckv = make_strided_view(base, DType::u8, {num_pages, ps, token_bytes(spec.format)},
                               {ps * g.ckv_stride, g.ckv_stride, 1}, device, device_id);
    return kv;
  }
  const std::int64_t e = element_bytes(spec.format);
  const DType dtype = spec.format == KvFormat::bf16 ? DType::bf16
                      : spec.fp8_as_u8              ? DType::u8
                                                    : DType::fp8_e4m3;
  kv.ckv = make_strided_view(base + g.ckv_offset, dtype, {num_pages, ps, kDimCkv},
                             {ps * g.ckv_stride / e, g.ckv_stride / e, 1}, device, device_id);
  kv.kpe = make_strided_view(base + g.kpe_offset, dtype, {num_pages, ps, kDimKpe},
                             {ps * g.kpe_stride / e, g.kpe_stride / e, 1}, device, device_id);
  if (spec.format == KvFormat::fp8_e4m3) {
    kv.ckv_scale = spec.ckv_scale;
    kv.kpe_scale = spec.kpe_scale;
  }
  return kv;
}

TensorView RandomCase::q_nope_view(void* q_data, DeviceKind device, int device_id) const {
  const std::int64_t h = spec.num_heads;
  if (spec.fused_q) {
    return make_strided_view(q_data, DType::bf16, {total_q, h, kDimCkv}, {h * kDimQk, kDimQk, 1},
                             device, device_id);
  }
  return make_view(q_data, DType::bf16, {total_q, h, kDimCkv}, device, device_id);
}

TensorView RandomCase::q_pe_view(void* q_data, DeviceKind device, int device_id) const {
  const std::int64_t h = spec.num_heads;
  auto* base = static_cast<std::uint16_t*>(q_data);
  if (spec.fused_q) {
    return make_strided_view(base + kDimCkv, DType::bf16, {total_q, h, kDimKpe},
                             {h * kDimQk, kDimQk, 1}, device, device_id);
  }
  return make_view(base + rows() * kDimCkv, DType::bf16, {total_q, h, kDimKpe}, device, device_id);
}

TensorView RandomCase::out_view(void* out, DeviceKind device, int device_id) const {
  return make_view(out, DType::bf16, {total_q, spec.num_heads, kDimCkv}, device, device_id);
}

TensorView RandomCase::lse_view(void* lse, DeviceKind device, int device_id) const {
  return make_view(lse, DType::f32, {total_q, spec.num_heads}, device, device_id);
}

TensorView RandomCase::sparse_view(void* indices, DeviceKind device, int device_id) const {
  return make_view(indices, DType::i32, {total_q, spec.topk}, device, device_id);
}

RunArgs RandomCase::host_args(HostOutput& out) {
  RunArgs args;
  args.q_nope = q_nope_view(q.data());
  args.q_pe = q_pe_view(q.data());
  args.kv = kv_view(cache.data());
  args.out = out.out_view();
  args.lse = out.lse_view();
  return args;
}

// ---- poisoned outputs ----

void poison(std::span<std::uint16_t> bf16) {
  std::fill(bf16.begin(), bf16.end(), kPoisonBf16);
}
void poison(std::span<float> f32) {
  std::fill(f32.begin(), f32.end(), std::bit_cast<float>(kPoisonF32));
}

HostOutput::HostOutput(std::int64_t q_tokens, int heads, std::int64_t guard_elements)
    : total_q(q_tokens),
      num_heads(heads),
      guard(guard_elements),
      out_storage(static_cast<std::size_t>(q_tokens * heads * kDimCkv + 2 * guard_elements)),
      lse_storage(static_cast<std::size_t>(q_tokens * heads + 2 * guard_elements)) {
  repoison();
}

std::span<std::uint16_t> HostOutput::out() {
  return std::span(out_storage)
      .subspan(static_cast<std::size_t>(guard),
               out_storage.size() - 2 * static_cast<std::size_t>(guard));
}
std::span<float> HostOutput::lse() {
  return std::span(lse_storage)
      .subspan(static_cast<std::size_t>(guard),
               lse_storage.size() - 2 * static_cast<std::size_t>(guard));
}
TensorView HostOutput::out_view() {
  return make_view(out().data(), DType::bf16, {total_q, num_heads, kDimCkv});
}
TensorView HostOutput::lse_view() {
  return make_view(lse().data(), DType::f32, {total_q, num_heads});
}
void HostOutput::repoison() {
  poison(out_storage);
  poison(lse_storage);
}

bool HostOutput::guards_intact() const {
  const auto g = static_cast<std::size_t>(guard);
  auto out_ok = [&](std::size_t i) { return out_storage[i] == kPoisonBf16; };
  auto lse_ok = [&](std::size_t i) {
    return std::bit_cast<std::uint32_t>(lse_storage[i]) == kPoisonF32;
  };
  for (std::size_t i = 0; i < g; ++i) {
    if (!out_ok(i) || !out_ok(out_storage.size() - 1 - i)) return false;
    if (!lse_ok(i) || !lse_ok(lse_storage.size() - 1 - i)) return false;
  }
  return true;
}

// ---- comparisons ----

namespace {

template <class T, class ToDouble>
Comparison compare(std::span<const T> out, std::span<const T> ref, ToDouble to_double) {
  if (out.size() != ref.size()) throw std::invalid_argument("compare: sizes differ");
  Comparison c;
  c.count = static_cast<std::int64_t>(out.size());
  double diff2 = 0.0;
  double ref2 = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double o = to_double(out[i]);
    const double r = to_double(ref[i]);
    const bool o_nan = std::isnan(o);
    const bool r_nan = std::isnan(r);
    if (o_nan != r_nan) {
      (o_nan ? c.nan_extra : c.nan_missing) += 1;
      if (c.first_nan_mismatch < 0) c.first_nan_mismatch = static_cast<std::int64_t>(i);
    }
    if (!std::isfinite(o) || !std::isfinite(r)) continue;
    diff2 += (o - r) * (o - r);
    ref2 += r * r;
    c.max_abs = std::max(c.max_abs, std::fabs(o - r));
  }
  c.rel_l2 = ref2 > 0.0    ? std::sqrt(diff2 / ref2)
             : diff2 > 0.0 ? std::numeric_limits<double>::infinity()
                           : 0.0;
  return c;
}

}  // namespace

Comparison compare_bf16(std::span<const std::uint16_t> out, std::span<const std::uint16_t> ref) {
  return compare(out, ref, [](std::uint16_t b) { return static_cast<double>(bf16_to_float(b)); });
}

Comparison compare_f32(std::span<const float> out, std::span<const float> ref) {
  return compare(out, ref, [](float f) { return static_cast<double>(f); });
}

std::string describe(const Comparison& c) {
  std::ostringstream os;
  os << "rel_l2=" << c.rel_l2 << " max_abs=" << c.max_abs << " nan_extra=" << c.nan_extra
     << " nan_missing=" << c.nan_missing << " first_nan_mismatch=" << c.first_nan_mismatch << " of "
     << c.count;
  return os.str();
}

LseComparison compare_lse(std::span<const float> out, std::span<const float> ref) {
  if (out.size() != ref.size()) throw std::invalid_argument("compare_lse: sizes differ");
  LseComparison c;
  c.count = static_cast<std::int64_t>(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double o = out[i];
    const double r = ref[i];
    bool bad = false;
    if (std::isnan(o) || std::isnan(r)) {
      if (std::isnan(o) != std::isnan(r)) {
        (std::isnan(o) ? c.nan_extra : c.nan_missing) += 1;
        bad = true;
      }
    } else if (std::isinf(o) || std::isinf(r)) {
      if (o != r) {
        c.inf_mismatch += 1;
        bad = true;
      }
    } else {
      c.max_err = std::max(c.max_err, std::fabs(o - r) / std::max(1.0, std::fabs(r)));
    }
    if (bad && c.first_mismatch < 0) c.first_mismatch = static_cast<std::int64_t>(i);
  }
  return c;
}

std::string describe(const LseComparison& c) {
  std::ostringstream os;
  os << "max_err=" << c.max_err << " inf_mismatch=" << c.inf_mismatch
     << " nan_extra=" << c.nan_extra << " nan_missing=" << c.nan_missing
     << " first_mismatch=" << c.first_mismatch << " of " << c.count;
  return os.str();
}

}  // namespace fp8mla::test
