// The CPU reference: attention straight from the definition in attention.h, accumulated in
// float64, one thread, ignoring the plan's partition. Every other path is tested against it, so
// it favours obviousness over speed; its only economy is decoding a request's tokens once.
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "fp8mla/format.h"
#include "src/core/backend.h"
#include "src/core/f16.h"
#include "src/cpu/kv_reader.h"

namespace fp8mla::detail {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Correct RNE of a double to bf16. Rounding to float first and then to bf16 could round twice
// (a double just above a bf16 midpoint may become the midpoint as a float and then round to
// even, the wrong way). Rounding to float by round-to-odd keeps the information that decides
// the second rounding, because float has 16 more mantissa bits than bf16 (2 would be enough).
std::uint16_t double_to_bf16(double x) {
  if (std::isnan(x)) return float_to_bf16(static_cast<float>(x));
  float f = static_cast<float>(x);  // round to nearest
  if (std::isinf(f) || static_cast<double>(f) == x) return float_to_bf16(f);
  // Inexact: truncate toward zero, then set the last bit (the odd one of the two neighbours).
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = std::nextafter(f, 0.0f);
  return float_to_bf16(std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | 1u));
}

// One query row: s_j = sm_scale * (q . k_j) over the visible tokens, then softmax-weighted ckv.
// `tokens` are decoded 576-float rows; `visible` lists which of them the row sees (in order).
// An output element of `dtype` (bf16 or f16 bits) from float64, rounded once.
std::uint16_t output_bits(double x, DType dtype) {
  return dtype == DType::f16 ? double_to_f16_bits(x) : double_to_bf16(x);
}

// A query element of `dtype` (bf16 or f16 bits), exactly.
double query_value(std::uint16_t bits, DType dtype) {
  return dtype == DType::f16 ? f16_bits_to_float(bits) : bf16_to_float(bits);
}

void attend_row(const double* q, const std::vector<float>& tokens,
                const std::vector<std::int64_t>& visible, double sm_scale, std::uint16_t* out,
                DType out_dtype, float* lse) {
  std::vector<double> s(visible.size());
  double m = kNegInf;
  for (std::size_t j = 0; j < visible.size(); ++j) {
    const float* k = tokens.data() + visible[j] * kDimQk;
    // Four partial sums: the same float64 accuracy, without one 576-long chain of dependent adds
    // (the demo checks whole batches against this reference).
    double dot[4] = {};
    for (int d = 0; d < kDimQk; d += 4) {
      for (int i = 0; i < 4; ++i) dot[i] += q[d + i] * static_cast<double>(k[d + i]);
    }
    s[j] = sm_scale * ((dot[0] + dot[1]) + (dot[2] + dot[3]));
    m = std::isnan(s[j]) || s[j] > m ? s[j] : m;
  }
  if (visible.empty()) {
    for (int d = 0; d < kDimCkv; ++d) out[d] = 0;
    if (lse != nullptr) *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  std::vector<double> o(kDimCkv, 0.0);
  double sum = 0.0;
  for (std::size_t j = 0; j < visible.size(); ++j) {
    const double p = std::exp(s[j] - m);
    sum += p;
    const float* v = tokens.data() + visible[j] * kDimQk;
    for (int d = 0; d < kDimCkv; ++d) o[d] += p * static_cast<double>(v[d]);
  }
  for (int d = 0; d < kDimCkv; ++d) out[d] = output_bits(o[d] / sum, out_dtype);
  if (lse != nullptr) *lse = static_cast<float>(m + std::log(sum));
}

}  // namespace

void cpu_reference(const PlanState& plan, const RunArgs& args) {
  const KvReader reader(args.kv);
  const std::int64_t page_size = plan.page_size;
  const std::int64_t num_slots = plan.num_pages * page_size;
  const bool sparse = plan.topk > 0;
  const double sm_scale = plan.sm_scale;

  std::vector<float> tokens;          // decoded tokens the current rows may see, 576 each
  std::vector<std::int64_t> visible;  // indices into `tokens` one row sees
  std::vector<double> q(kDimQk);

  auto decode_slot = [&](std::int64_t page, std::int64_t offset) {
    tokens.resize(tokens.size() + kDimQk);
    reader.read(page, offset, tokens.data() + tokens.size() - kDimQk);
  };
  auto sparse_index = [&](std::int64_t t, std::int64_t k) -> std::int64_t {
    if (args.sparse_indices.defined())
      return *element_ptr<const std::int32_t>(args.sparse_indices, t, k);
    return plan.sparse_indices[t * plan.topk + k];
  };

  const std::int32_t* pages = host_page_table(plan);
  for (int r = 0; r < plan.batch; ++r) {
    const std::int64_t q_first = plan.qo_indptr[r];
    const std::int64_t qo_len = plan.qo_indptr[r + 1] - q_first;
    const std::int64_t kv_len = sparse ? 0 : plan.kv_len[r];
    if (!sparse) {
      // Token j of the request: page kv_indices[kv_indptr[r] + j / page_size], offset j % ps.
      tokens.clear();
      for (std::int64_t j = 0; j < kv_len; ++j) {
        decode_slot(pages[plan.kv_indptr[r] + j / page_size], j % page_size);
      }
    }
    for (std::int64_t i = 0; i < qo_len; ++i) {
      const std::int64_t t = q_first + i;
      visible.clear();
      if (sparse) {
        tokens.clear();
        for (std::int64_t k = 0; k < plan.topk; ++k) {
          const std::int64_t slot = sparse_index(t, k);
          if (slot < 0 || slot >= num_slots) continue;  // -1 and out-of-range entries
          visible.push_back(static_cast<std::int64_t>(visible.size()));
          decode_slot(slot / page_size, slot % page_size);
        }
      } else {
        const std::int64_t end =
            plan.causal
                ? std::min(kv_len, causal_mask_len(plan, static_cast<int>(r)) - qo_len + i + 1)
                : kv_len;
        for (std::int64_t j = 0; j < end; ++j) visible.push_back(j);
      }
      for (std::int64_t h = 0; h < plan.num_heads; ++h) {
        const auto* q_nope = element_ptr<const std::uint16_t>(args.q_nope, t, h);
        const auto* q_pe = element_ptr<const std::uint16_t>(args.q_pe, t, h);
        for (int d = 0; d < kDimCkv; ++d) q[d] = query_value(q_nope[d], plan.q_dtype);
        for (int d = 0; d < kDimKpe; ++d) q[kDimCkv + d] = query_value(q_pe[d], plan.q_dtype);
        float* lse = args.lse.defined() ? element_ptr<float>(args.lse, t, h) : nullptr;
        attend_row(q.data(), tokens, visible, sm_scale, element_ptr<std::uint16_t>(args.out, t, h),
                   plan.out_dtype, lse);
      }
    }
  }
}

}  // namespace fp8mla::detail
