// run(), merge_states() and the build facts (include/fp8mla/attention.h): host-side checks of
// the arguments against the plan, then dispatch to the plan's backend.
#include <cmath>
#include <limits>
#include <mutex>
#include <string>

#include "fp8mla/attention.h"
#include "fp8mla/error.h"
#include "fp8mla/limits.h"
#include "src/core/backend.h"
#include "src/core/check.h"
#include "src/core/dispatch.h"
#include "src/core/plan_state.h"

#ifndef FP8MLA_VERSION
#error "FP8MLA_VERSION must be defined by the build (src/CMakeLists.txt)"
#endif

namespace fp8mla {
namespace {

using detail::check_tensor;
using detail::PlanState;
using detail::require;

// The fp8_e4m3 cache's scale: a code of 448 decodes to a finite float, and the CUDA kernels'
// score factor sm_scale x scale x log2(e) is a finite float too.
void check_cache_scale(float scale, float sm_scale, const char* name) {
  constexpr double kMaxFloat = std::numeric_limits<float>::max();
  require(std::isfinite(scale) && scale > 0.0f && double{scale} * kFp8Max <= kMaxFloat, name, scale,
          " must be finite and > 0, and at most FLT_MAX / 448 (codes times it stay finite)");
  const double factor = double{sm_scale} * scale * 1.4426950408889634;
  require(factor <= kMaxFloat, name, "sm_scale x ", name, " x log2(e) = ", factor,
          " overflows float (sm_scale ", sm_scale, ")");
}

// The cache view: its format as planned, and each half with the dtype and
// [num_pages, page_size, width] shape that format stores.
void check_cache(const PlanState& s, const KvCacheView& kv) {
  require(kv.format == s.kv_format, "kv.format", "expected ", format_name(s.kv_format),
          " (planned), got ", format_name(kv.format));
  const std::int64_t pages = s.num_pages;
  const std::int64_t page = s.page_size;
  switch (kv.format) {
    case KvFormat::bf16:
      check_tensor(kv.ckv, "kv.ckv", {DType::bf16}, {pages, page, kDimCkv}, s.device, s.device_id);
      check_tensor(kv.kpe, "kv.kpe", {DType::bf16}, {pages, page, kDimKpe}, s.device, s.device_id);
      return;
    case KvFormat::fp8_e4m3:
      // Many frameworks store FP8 as bytes: u8 is the same data.
      check_tensor(kv.ckv, "kv.ckv", {DType::fp8_e4m3, DType::u8}, {pages, page, kDimCkv}, s.device,
                   s.device_id);
      check_tensor(kv.kpe, "kv.kpe", {DType::fp8_e4m3, DType::u8}, {pages, page, kDimKpe}, s.device,
                   s.device_id);
      check_cache_scale(kv.ckv_scale, s.sm_scale, "kv.ckv_scale");
      check_cache_scale(kv.kpe_scale, s.sm_scale, "kv.kpe_scale");
      // The plan's family was chosen for this ratio class (src/core/dispatch.h).
      require(s.device != DeviceKind::cuda || s.options.any_scale_ratio ||
                  detail::pow2_scale_ratio(s.sm_scale, kv.ckv_scale, kv.kpe_scale),
              "kv.kpe_scale", "kpe_scale / ckv_scale = ", kv.kpe_scale, " / ", kv.ckv_scale,
              " is not a power of two, as the plan assumes (plan with options.any_scale_ratio = "
              "true for any ratio)");
      return;
    case KvFormat::fp8_e4m3_block:
      // The whole 656-byte token; FlashMLA hands it over typed as float8_e4m3fn.
      check_tensor(kv.ckv, "kv.ckv", {DType::u8, DType::fp8_e4m3},
                   {pages, page, token_bytes(KvFormat::fp8_e4m3_block)}, s.device, s.device_id);
      return;
  }
  require(false, "kv.format", "unknown KvFormat value ", static_cast<int>(kv.format));
}

// The page ids a CPU run reads from a borrowed table (Problem::borrowed_kv_indices), checked at
// run time because the caller may have rewritten them since plan().
void check_borrowed_ids(const PlanState& s) {
  const auto* pages = static_cast<const std::int32_t*>(s.borrowed_kv_indices.data);
  const std::int64_t n = s.kv_indptr.empty() ? 0 : s.kv_indptr.back();
  for (std::int64_t i = 0; i < n; ++i) {
    if (pages[i] < 0 || pages[i] >= s.num_pages) {
      throw Error(ErrorCode::invalid_argument, detail::msg("borrowed_kv_indices[", i, "]"),
                  detail::msg(pages[i], " is outside the pool [0, ", s.num_pages,
                              ") (a borrowed page table is checked when run() reads it)"));
    }
  }
}

}  // namespace

void run(const Plan& p, const RunArgs& args) try {
  PlanState& s = p.state();
  // Checked even when there is nothing to compute: a batch of no query tokens takes q and out of
  // 0 rows (any strides), so a caller's q of 5 tokens is a mismatch, not 5 rows left unwritten.
  const std::int64_t tq = s.total_q;
  const std::int64_t h = s.num_heads;
  check_tensor(args.q_nope, "q_nope", {s.q_dtype}, {tq, h, kDimCkv}, s.device, s.device_id);
  check_tensor(args.q_pe, "q_pe", {s.q_dtype}, {tq, h, kDimKpe}, s.device, s.device_id);
  check_tensor(args.out, "out", {s.out_dtype}, {tq, h, kDimCkv}, s.device, s.device_id,
               detail::kOutput);
  if (args.lse.defined()) {
    check_tensor(args.lse, "lse", {DType::f32}, {tq, h}, s.device, s.device_id, detail::kOutput);
  }
  check_cache(s, args.kv);
  if (args.sparse_indices.defined()) {
    require(s.topk > 0, "sparse_indices", "given, but the plan is dense (topk = 0)");
    check_tensor(args.sparse_indices, "sparse_indices", {DType::i32}, {tq, s.topk}, s.device,
                 s.device_id);
  }
  // A batch whose requests have no query tokens has nothing to compute or write.
  if (s.total_q == 0) return;

  if (s.device == DeviceKind::cpu && s.borrowed_kv_indices.defined()) check_borrowed_ids(s);

  if (s.device == DeviceKind::cuda) {
    const detail::CurrentDeviceGuard keep(true);
    // A run is two launches on `stream` that share the plan's workspace: runs from several
    // threads on one stream must not interleave them (different streams must be ordered by the
    // caller: attention.h).
    const std::lock_guard<std::mutex> lock(*s.launch_mutex);
    detail::cuda_run(s, args);
  } else if (s.family == KernelFamily::cpu_reference) {
    detail::cpu_reference(s, args);
  } else {
    detail::cpu_run(s, args);
  }
} catch (...) {
  detail::rethrow_as_error("run");
}

void merge_states(const TensorView& v, const TensorView& s, const TensorView& v_out,
                  const TensorView& s_out, void* stream) try {
  // Every tensor lives where v does.
  const DeviceKind device = v.device;
  const int id = v.device_id;
  check_tensor(v, "v", {DType::f32, DType::bf16}, {-1, -1, -1}, device, id);
  const std::int64_t rows = v.shape[0];
  const std::int64_t states = v.shape[1];
  const std::int64_t dim = v.shape[2];
  // The work is rows x states x D values whatever memory backs them (stride 0 repeats one).
  require(rows <= kMaxRows, "v.shape[0]", "rows ", rows, " exceed the bound ", kMaxRows,
          " (fp8mla/limits.h)");
  require(states <= kMaxMergeStates, "v.shape[1]", "num_states ", states, " exceeds the bound ",
          kMaxMergeStates, " (fp8mla/limits.h)");
  require(dim <= kMaxMergeDim, "v.shape[2]", "D ", dim, " exceeds the bound ", kMaxMergeDim,
          " (fp8mla/limits.h)");
  require(rows * states * dim <= kMaxMergeValues, "v", "rows x num_states x D = ", rows, " x ",
          states, " x ", dim, " = ", rows * states * dim, " values exceed the bound ",
          kMaxMergeValues, " (fp8mla/limits.h)");
  check_tensor(s, "s", {DType::f32}, {rows, states}, device, id, detail::kAnyInnerStride);
  check_tensor(v_out, "v_out", {DType::f32, DType::bf16}, {rows, dim}, device, id, detail::kOutput);
  if (s_out.defined()) {
    check_tensor(s_out, "s_out", {DType::f32}, {rows}, device, id,
                 detail::kOutput | detail::kAnyInnerStride);
  }
  // No rows: nothing to write. No states (or D = 0): each row merges nothing, v_out = 0 and
  // s_out = -inf, as for rows whose states are all empty.
  if (rows == 0) return;

  if (device == DeviceKind::cuda) {
    const detail::CurrentDeviceGuard keep(true);
    detail::cuda_merge_states(v, s, v_out, s_out, stream);
  } else {
    detail::cpu_merge_states(v, s, v_out, s_out);
  }
} catch (...) {
  detail::rethrow_as_error("merge_states");
}

bool cuda_available() {
  return detail::cuda_built() && detail::cuda_device_count() > 0;
}

const char* version() {
  return FP8MLA_VERSION;
}

}  // namespace fp8mla
