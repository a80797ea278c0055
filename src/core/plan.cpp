// The planner (include/fp8mla/attention.h): validates a Problem, copies its index arrays, chooses
// the kernel family once (src/core/dispatch.h) and partitions the work into tiles for it.
//
// Partition, a deterministic function of (Problem, PlanOptions, resolved sm_count):
//  * Rows of a tile = q_count x head_count <= kMaxRowsPerTile (64).
//    Head blocks: H <= 64 gives one block of all H heads, and query tokens are grouped
//    q_count = min(qo_len, max(1, M / H)) per tile, M = options.max_tile_rows, or when 0 the
//    planner's choice (dispatch.h, choose_max_tile_rows: 16 or 64; the last q block may be
//    smaller); H > 64
//    gives blocks of 64 heads (the last one smaller) and q_count = 1. Sparse mode always has
//    q_count = 1: each token has its own index list.
//  * A group is (request, q block, head block). Its work is the request's length L_r: kv_len[r]
//    when dense (with causal the last row sees all L_r tokens, so that bounds every row), topk
//    when sparse (then the kv range is positions [0, topk) of each token's index list).
//  * target = sm_count * ctas_per_sm (ctas_per_sm resolved: the option, or the residency of the
//    chosen family's kernel from the occupancy API, or 1 on the CPU), W = sum of the groups'
//    work; but target = sm_count when ctas_per_sm came from the kernel and W < 768 tokens per
//    SM: below that a second CTA per SM costs more (start-up, twice the partials to merge) than
//    it hides, and from ~1000 tokens per SM on two CTAs win,
//    c_min = round_up(max(min_chunk_tokens, ceil(W / target)), 64). For a chunk c, request r gets
//    n_r = ceil(L_r / c) splits (1 when L_r <= c, so also for L_r = 0). A split request
//    cuts [0, L_r) into n_r near-equal ranges of chunk_r = round_up(ceil(L_r / n_r), 64) <= c
//    tokens (the last one shorter); that keeps n_r and balances the splits.
//    The chunk is the c >= c_min (among c_min and round_up(ceil(L_max / n), 64)) with the least
//    estimated time ceil(tiles / target) * (longest tile + 64) + (any split ? 128 : 0), in
//    tokens: tiles run in waves of `target`, a CTA has a fixed start-up cost, and a split costs
//    the merge launch. Ties go to the larger chunk. (c = c_min alone can leave a last partial
//    wave: 384 tiles on 264 CTA slots at 128 requests x 8192 tokens.)
//  * Tiles: requests in order, a request's tiles contiguous and ordered by (split, head block,
//    q block), so tiles reading the same kv range are neighbours. Split requests' tiles carry
//    split = s in [0, n_r), the others -1. qo_len = 0 gives no tiles; L_r = 0 with qo_len > 0
//    gives tiles with kv_begin = kv_end = 0 (the backend writes o = 0, lse = -inf).
//  * Causal masking is the backend's job: every group of a request sees the same kv ranges.
//
// Capacities (graph mode: they must hold every problem within options.max_*). With G groups,
//   tiles = sum_r n_r * groups_r <= sum_r (1 + L_r / chunk) * groups_r = G + W / chunk
//         <= G + target,
// and G <= total_q * head_blocks (a q block holds at least one token). A split request has
// L_r > chunk, so n_r < 1 + L_r / chunk < 2 L_r / chunk, and its partial rows are
//   n_r * qo_len_r * H <= n_r * groups_r * R < 2 R groups_r L_r / chunk,
// where R bounds the rows of a tile; summed over split requests that is < 2 R W / chunk <=
// 2 R target. Hence tile_capacity = target + max_total_q * head_blocks and
// partial_rows_capacity = 2 * R * target with R = min(64, H * min(max_qo_len, max(1, M / H)))
// (a tile holds at most max_qo_len tokens; max_qo_len = 0 means max_total_q).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <thread>

#include "fp8mla/attention.h"
#include "fp8mla/error.h"
#include "src/core/backend.h"
#include "src/core/check.h"
#include "src/core/dispatch.h"
#include "src/core/plan_state.h"
#include "src/core/validate.h"

namespace fp8mla {
namespace {

using detail::graph_max_qo_len;
using detail::msg;
using detail::PlanState;
using detail::require;

constexpr std::int64_t kChunkAlign = 64;       // split boundaries, in tokens (a kernel's kv tile)
constexpr std::int64_t kSharedSmTokens = 768;  // work per SM from which CTAs share SMs (above)

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}
std::int64_t round_up(std::int64_t a, std::int64_t b) {
  return ceil_div(a, b) * b;
}

// Parallel units the partition aims at (see PlanOptions::sm_count).
int resolve_sm_count(const Problem& p, const PlanOptions& o) {
  if (o.sm_count > 0) return o.sm_count;
  if (p.device == DeviceKind::cuda) return detail::cuda_sm_count(p.device_id);
  if (o.num_threads > 0) return o.num_threads;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// ---- partition ----

struct Blocking {
  int head_blocks;     // ceil(H / 64)
  int max_q_per_tile;  // tokens per q block (before clamping to qo_len)
};

Blocking blocking(int num_heads, bool sparse, const PlanOptions& o) {
  const int max_rows = o.max_tile_rows > 0 ? o.max_tile_rows : kMaxRowsPerTile;
  const int per_tile = max_rows / num_heads;  // 0 when H > max_rows
  return {static_cast<int>(ceil_div(num_heads, kMaxRowsPerTile)),
          sparse ? 1 : std::max(1, per_tile)};
}

std::int64_t target_tiles(const PlanState& s) {
  return static_cast<std::int64_t>(s.sm_count) * s.ctas_per_sm;
}

// Rows of the largest tile the backend's kernel is chosen for (graph mode: any problem within
// the options' bounds).
int kernel_rows(const Problem& p, const PlanOptions& o) {
  const Blocking b = blocking(p.num_heads, p.topk > 0, o);
  const int heads = std::min(p.num_heads, kMaxRowsPerTile);
  std::int64_t q = 1;
  if (o.cuda_graph) {
    q = graph_max_qo_len(o);
  } else {
    for (std::size_t r = 0; r + 1 < p.qo_indptr.size(); ++r)
      q = std::max<std::int64_t>(q, p.qo_indptr[r + 1] - p.qo_indptr[r]);
  }
  return static_cast<int>(heads * std::min<std::int64_t>(q, b.max_q_per_tile));
}

// The problem as the dispatch table sees it: tiles of up to `rows` rows, the longest tile
// `longest_tile` kv tokens, the partition's tiles in `waves`.
detail::DispatchKey dispatch_key(const Problem& p, const PlanOptions& o, int arch, int rows,
                                 std::int64_t longest_tile,
                                 detail::WaveClass waves = detail::WaveClass::one) {
  return {.arch = arch,
          .format = p.kv_format,
          .rows = detail::rows_class(rows),
          .sparse = p.topk > 0,
          .pages = detail::page_class(p.page_size),
          .any_scale_ratio = o.any_scale_ratio,
          .exact_scores = o.exact_scores,
          .f16_queries = p.q_dtype == DType::f16,
          .tiles = detail::tile_class(longest_tile),
          .waves = waves};
}

// FP8MLA_KERNEL_FAMILY in the environment: a family plans use where they leave the choice to
// the table (PlanOptions::kernel_family automatic) and the family serves them, so a whole test
// suite or program can run on one family (e.g. portable on Hopper) without code changes.
KernelFamily environment_family() {
  static const KernelFamily f = [] {
    const char* v = std::getenv("FP8MLA_KERNEL_FAMILY");
    return v == nullptr || *v == '\0' ? KernelFamily::automatic : parse_kernel_family(v);
  }();
  return f;
}

// What the table is asked for: PlanOptions::kernel_family, else FP8MLA_KERNEL_FAMILY where it
// serves `key`; PlanOptions::cpu_reference asks a CPU plan for the reference.
KernelFamily requested_family(const Problem& p, const PlanOptions& o,
                              const detail::DispatchKey& key) {
  if (o.kernel_family != KernelFamily::automatic) return o.kernel_family;
  if (o.cpu_reference && p.device == DeviceKind::cpu) return KernelFamily::cpu_reference;
  const KernelFamily env = environment_family();
  return env != KernelFamily::automatic && detail::family_serves(env, key)
             ? env
             : KernelFamily::automatic;
}

// s: the problem's fields and kernel_rows set; `family`'s residency.
int resolve_ctas_per_sm(const PlanState& s, KernelFamily family) {
  if (s.options.ctas_per_sm > 0) return s.options.ctas_per_sm;
  if (s.device == DeviceKind::cuda) return detail::cuda_ctas_per_sm(s, family);
  return 1;
}

void set_capacities(PlanState& s) {
  if (!s.options.cuda_graph) {
    s.tile_capacity = static_cast<std::int64_t>(s.tiles.size());
    s.partial_rows_capacity = s.partial_rows;
    return;
  }
  const Blocking b = blocking(s.num_heads, s.topk > 0, s.options);
  const std::int64_t target = target_tiles(s);
  const std::int64_t rows_per_tile = std::min<std::int64_t>(
      kMaxRowsPerTile,
      s.num_heads * std::min<std::int64_t>(graph_max_qo_len(s.options), b.max_q_per_tile));
  s.tile_capacity = target + std::int64_t{s.options.max_total_q} * b.head_blocks;
  s.partial_rows_capacity = 2 * rows_per_tile * target;
  if (static_cast<std::int64_t>(s.tiles.size()) > s.tile_capacity ||
      s.partial_rows > s.partial_rows_capacity) {
    throw Error(ErrorCode::internal, "plan",
                msg("partition exceeds its graph capacity: ", s.tiles.size(), " tiles (capacity ",
                    s.tile_capacity, "), ", s.partial_rows, " partial rows (capacity ",
                    s.partial_rows_capacity, ")"));
  }
}

void partition(PlanState& s) {
  detail::validate_wave(s.sm_count, s.ctas_per_sm);  // resolved: the bound on tiles in flight
  const bool sparse = s.topk > 0;
  const Blocking b = blocking(s.num_heads, sparse, s.options);
  auto qo_len = [&](int r) { return s.qo_indptr[r + 1] - s.qo_indptr[r]; };
  auto length = [&](int r) -> std::int64_t { return sparse ? s.topk : s.kv_len[r]; };
  auto q_blocks = [&](int r) { return ceil_div(qo_len(r), b.max_q_per_tile); };

  std::int64_t work = 0, longest = 0;
  for (int r = 0; r < s.batch; ++r) {
    work += q_blocks(r) * b.head_blocks * length(r);
    if (qo_len(r) > 0) longest = std::max(longest, length(r));
  }
  const std::int64_t target =
      s.options.ctas_per_sm == 0 && s.ctas_per_sm > 1 && work < kSharedSmTokens * s.sm_count
          ? s.sm_count
          : target_tiles(s);
  const std::int64_t c_min = round_up(
      std::max<std::int64_t>(s.options.min_chunk_tokens, ceil_div(work, target)), kChunkAlign);
  auto splits_of = [](std::int64_t len, std::int64_t c) { return len <= c ? 1 : ceil_div(len, c); };
  auto chunk_of = [](std::int64_t len, std::int64_t splits) {
    return splits == 1 ? len : round_up(ceil_div(len, splits), kChunkAlign);
  };
  auto cost = [&](std::int64_t c) {
    std::int64_t tiles = 0, groups = 0, longest_tile = 0;
    for (int r = 0; r < s.batch; ++r) {
      if (qo_len(r) == 0) continue;
      const std::int64_t g = q_blocks(r) * b.head_blocks, n = splits_of(length(r), c);
      tiles += g * n;
      groups += g;
      longest_tile = std::max(longest_tile, chunk_of(length(r), n));
    }
    return ceil_div(tiles, target) * (longest_tile + 64) + (tiles > groups ? 128 : 0);
  };
  // Candidates from the largest down to c_min, each evaluated once.
  std::int64_t chunk = std::max(c_min, longest), best = cost(chunk);
  for (std::int64_t n = 2, last = chunk; last > c_min; ++n) {
    const std::int64_t c = std::max(c_min, round_up(ceil_div(longest, n), kChunkAlign));
    if (c == last) continue;
    last = c;
    if (const std::int64_t t = cost(c); t < best) best = t, chunk = c;
  }

  s.tiles.clear();
  s.num_splits.assign(s.batch, 1);
  s.partial_offset.assign(s.batch, 0);
  s.partial_rows = 0;
  s.longest_tile = 0;
  for (int r = 0; r < s.batch; ++r) {
    const std::int32_t q_len = qo_len(r);
    const std::int64_t len = length(r);
    s.partial_offset[r] = s.partial_rows;
    if (q_len == 0) continue;
    const std::int64_t splits = splits_of(len, chunk);
    const std::int64_t chunk_r = chunk_of(len, splits);
    const int q_per_tile = std::min(q_len, b.max_q_per_tile);
    s.num_splits[r] = static_cast<std::int32_t>(splits);
    if (splits > 1) s.partial_rows += splits * q_len * s.num_heads;
    s.longest_tile = std::max(s.longest_tile, std::min(len, chunk_r));
    for (std::int64_t split = 0; split < splits; ++split) {
      const auto kv_begin = static_cast<std::int32_t>(split * chunk_r);
      const auto kv_end = static_cast<std::int32_t>(std::min(len, (split + 1) * chunk_r));
      for (int hb = 0; hb < b.head_blocks; ++hb) {
        const int head_begin = hb * kMaxRowsPerTile;
        const int head_count = std::min(kMaxRowsPerTile, s.num_heads - head_begin);
        for (int q_begin = 0; q_begin < q_len; q_begin += q_per_tile) {
          s.tiles.push_back(WorkTile{
              .request = r,
              .q_begin = q_begin,
              .q_count = std::min(q_per_tile, q_len - q_begin),
              .head_begin = head_begin,
              .head_count = head_count,
              .kv_begin = kv_begin,
              .kv_end = kv_end,
              .split = splits > 1 ? static_cast<std::int32_t>(split) : -1,
          });
        }
      }
    }
  }
}

void validate(const Problem& p, const PlanOptions& o) {
  detail::validate_options(o);
  detail::validate_scalars(p);
  detail::validate_arrays(p, o);
  detail::validate_device_page_ids(p);
}

// Everything but the device upload, for a validated problem. `original`: null for plan(),
// which chooses the kernel family and resolves ctas_per_sm; replan() passes the original plan,
// whose family, ctas_per_sm and arch it keeps.
PlanState build_state(const Problem& p, const PlanOptions& o, int sm_count,
                      const PlanState* original) {
  PlanState s;
  s.num_heads = p.num_heads;
  s.page_size = p.page_size;
  s.num_pages = p.num_pages;
  s.kv_format = p.kv_format;
  s.q_dtype = p.q_dtype;
  s.out_dtype = p.out_dtype;
  s.causal = p.causal;
  s.sm_scale = p.sm_scale;
  s.topk = p.topk;
  s.device = p.device;
  s.device_id = p.device_id;
  s.options = o;
  s.sm_count = sm_count;
  s.arch = original != nullptr            ? original->arch
           : p.device == DeviceKind::cuda ? detail::cuda_compute_capability(p.device_id)
                                          : 0;
  // kept by replan(): the options it passes are the original plan's
  s.options.max_tile_rows = detail::choose_max_tile_rows(p, o, dispatch_key(p, o, s.arch, 16, 0),
                                                         kernel_rows(p, o), sm_count);
  s.kernel_rows = kernel_rows(p, s.options);
  s.batch = static_cast<int>(p.qo_indptr.size() - 1);
  s.total_q = p.qo_indptr.back();
  s.qo_indptr.assign(p.qo_indptr.begin(), p.qo_indptr.end());
  s.kv_indptr.assign(p.kv_indptr.begin(), p.kv_indptr.end());
  s.kv_indices.assign(p.kv_indices.begin(), p.kv_indices.end());
  s.borrowed_kv_indices = p.borrowed_kv_indices;
  s.kv_len.assign(p.kv_len.begin(), p.kv_len.end());
  s.causal_len.assign(p.causal_len.begin(), p.causal_len.end());
  s.sparse_indices.assign(p.sparse_indices.begin(), p.sparse_indices.end());
  if (original != nullptr) {
    s.family = original->family;
    s.ctas_per_sm = original->ctas_per_sm;
    partition(s);
  } else {
    // The family depends on the longest tile and the tile count, which the partition decides,
    // and the partition on the family's residency: partition for the family chosen for short
    // tiles in one wave, then choose with the partition's longest tile and its waves at that
    // residency; a family of another residency gets its own partition.
    const detail::DispatchKey key = dispatch_key(p, o, s.arch, s.kernel_rows, 0);
    const KernelFamily requested = requested_family(p, o, key);
    const KernelFamily first = detail::choose_family(key, requested);
    s.ctas_per_sm = resolve_ctas_per_sm(s, first);
    partition(s);
    const detail::WaveClass waves =
        detail::wave_class(static_cast<std::int64_t>(s.tiles.size()), target_tiles(s));
    s.family = detail::choose_family(
        dispatch_key(p, o, s.arch, s.kernel_rows, s.longest_tile, waves), requested);
    if (s.family != first) {
      const int ctas = resolve_ctas_per_sm(s, s.family);
      if (ctas != s.ctas_per_sm) {
        s.ctas_per_sm = ctas;
        partition(s);
      }
    }
  }
  set_capacities(s);
  return s;
}

// What replan() may not change: the graph's kernels and buffers were chosen for these.
template <class T>
void require_same(const T& given, const T& planned, const char* name) {
  require(given == planned, name, "differs from the graph-mode plan (planned ",
          static_cast<std::int64_t>(planned), ", got ", static_cast<std::int64_t>(given),
          "); make a new plan instead");
}

}  // namespace

// ---- Plan ----

Plan::Plan() = default;
Plan::~Plan() = default;
Plan::Plan(Plan&&) noexcept = default;
Plan& Plan::operator=(Plan&&) noexcept = default;

detail::PlanState& Plan::state() const {
  if (!state_) {
    throw Error(ErrorCode::invalid_argument, "plan",
                "is empty (default-constructed or moved from); make one with fp8mla::plan()");
  }
  return *state_;
}

int Plan::batch() const {
  return state().batch;
}
int Plan::total_q() const {
  return state().total_q;
}
int Plan::num_heads() const {
  return state().num_heads;
}
int Plan::topk() const {
  return state().topk;
}
KvFormat Plan::kv_format() const {
  return state().kv_format;
}
DeviceKind Plan::device() const {
  return state().device;
}
std::span<const WorkTile> Plan::tiles() const {
  return state().tiles;
}
std::span<const std::int32_t> Plan::num_splits() const {
  return state().num_splits;
}
std::int64_t Plan::partial_rows() const {
  return state().partial_rows;
}
KernelFamily Plan::kernel_family() const {
  return state().family;
}
const char* Plan::kernel_name() const {
  return kernel_family_name(state().family);
}

Plan plan(const Problem& problem, const PlanOptions& options) try {
  // Validate before asking the device, so bad input reads as bad input in any build (a page
  // table on the device is checked there).
  const detail::CurrentDeviceGuard keep(problem.device == DeviceKind::cuda);
  validate(problem, options);
  auto state = std::make_unique<PlanState>(
      build_state(problem, options, resolve_sm_count(problem, options), nullptr));
  if (state->device == DeviceKind::cuda) {
    state->device_kv_indices = problem.device_kv_indices;  // read by the upload only
    detail::cuda_upload_plan(*state);
    state->device_kv_indices = {};
  }
  Plan p;
  p.state_ = std::move(state);
  return p;
} catch (...) {
  detail::rethrow_as_error("plan");
}

namespace {

// What replan() may not change about the borrowed page table: a captured run reads the buffer
// (address) the plan was made with.
void require_same_borrowed(const Problem& problem, const PlanState& s) {
  const TensorView& given = problem.borrowed_kv_indices;
  const TensorView& planned = s.borrowed_kv_indices;
  require(given.defined() == planned.defined(), "borrowed_kv_indices",
          planned.defined() ? "the graph-mode plan borrows the caller's page table: give it again"
                            : "the graph-mode plan copies its page table: give kv_indices");
  require(!given.defined() || given.data == planned.data, "borrowed_kv_indices",
          "is another buffer than the one the graph-mode plan borrows (a captured run reads that "
          "one); make a new plan instead");
}

// replan() and its stream-ordered form: `stream` null = synchronous (waits for the device).
void replan_state(Plan& p, const Problem& problem, void* const* stream) {
  PlanState& s = p.state();
  require(s.options.cuda_graph, "plan",
          "replan() needs a plan made with options.cuda_graph = true; call plan() instead");
  require_same(problem.num_heads, s.num_heads, "num_heads");
  require_same(problem.kv_format, s.kv_format, "kv_format");
  require_same(problem.page_size, s.page_size, "page_size");
  require_same(problem.topk, s.topk, "topk");
  require_same(problem.device, s.device, "device");
  require_same(problem.device_id, s.device_id, "device_id");
  require_same(problem.q_dtype, s.q_dtype, "q_dtype");
  require_same(problem.out_dtype, s.out_dtype, "out_dtype");
  require_same_borrowed(problem, s);
  const bool ordered = stream != nullptr && s.device == DeviceKind::cuda;
  require(!ordered || !problem.device_kv_indices.defined(), "device_kv_indices",
          "the stream-ordered replan does not read back a device page table to check it: give "
          "kv_indices (host) or borrowed_kv_indices");
  // Same options and sm_count as the original, so the capacities (and buffers) still fit.
  const detail::CurrentDeviceGuard keep(s.device == DeviceKind::cuda);
  validate(problem, s.options);
  PlanState next = build_state(problem, s.options, s.sm_count, &s);
  if (next.device == DeviceKind::cuda) {
    next.cuda = std::move(s.cuda);
    next.device_kv_indices = problem.device_kv_indices;
    try {
      if (ordered) {
        detail::cuda_upload_plan_async(next, *stream);
      } else {
        detail::cuda_upload_plan(next);
      }
    } catch (...) {
      s.cuda = std::move(next.cuda);
      throw;
    }
    next.device_kv_indices = {};
  }
  s = std::move(next);
}

}  // namespace

void replan(Plan& p, const Problem& problem) try {
  replan_state(p, problem, nullptr);
} catch (...) {
  detail::rethrow_as_error("replan");
}

void replan(Plan& p, const Problem& problem, void* stream) try {
  replan_state(p, problem, &stream);
} catch (...) {
  detail::rethrow_as_error("replan");
}

}  // namespace fp8mla
