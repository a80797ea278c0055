// The CPU fast path: the planned tiles on a pool of std::threads, float32 math, online softmax.
//
// A tile's rows (query tokens x heads) all read the same cache tokens, so each chunk of kChunk
// tokens is decoded once into a float buffer and then consumed by every row of the tile, kGroup
// rows at a time so one load of a decoded value feeds kGroup multiply-adds. Split requests write
// partial (o, lse) rows into the run's own workspace; the thread that finishes a request's last
// tile merges them with the same row kernel merge_states uses, so there is no second pass.
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "fp8mla/error.h"
#include "fp8mla/format.h"
#include "src/core/backend.h"
#include "src/core/check.h"
#include "src/core/f16.h"
#include "src/cpu/kv_reader.h"

namespace fp8mla::detail {
namespace {

constexpr int kChunk = 32;  // tokens decoded at once: 32 x 576 floats = 72 KiB, L2 resident
constexpr int kGroup = 4;   // rows sharing each load of a decoded value
// Tokens between a token's prefetch and its decode (KvReader::prefetch): pages sit anywhere in
// the pool, so without it every token's first line is a DRAM miss. At page 1 it took the demo's
// native step from 19 to 12 ms a layer on a 2-core host; 4 to 32 ahead measured alike.
constexpr int kPrefetchAhead = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- threads ----

int resolve_threads(int requested) {
  if (requested > 0) return requested;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// Calls work(i) for every i in [0, n) on up to `threads` threads (the caller is one of them).
// Indices come from a shared counter, so uneven items balance. make_worker() runs once per
// thread and returns its `work` callable (which owns that thread's scratch). The first
// exception stops the others taking new items and is rethrown here.
template <class MakeWorker>
void parallel_for(int threads, std::int64_t n, const MakeWorker& make_worker) {
  std::atomic<std::int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto body = [&] {
    try {
      auto work = make_worker();
      for (std::int64_t i = next.fetch_add(1); i < n && !failed.load(); i = next.fetch_add(1)) {
        work(i);
      }
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      failed.store(true);
    }
  };
  const int count =
      static_cast<int>(std::clamp<std::int64_t>(threads, 1, std::max<std::int64_t>(n, 1)));
  {
    std::vector<std::jthread> pool;
    pool.reserve(static_cast<std::size_t>(count - 1));
    // A thread the system cannot start (std::system_error: a process or container limit) is
    // not an error: the threads that did start, and this one, take its items.
    try {
      for (int w = 1; w < count; ++w) pool.emplace_back(body);
    } catch (const std::system_error&) {
    }
    body();
  }  // joins the pool
  if (error) std::rethrow_exception(error);
}

// ---- merging attention states ----

// Elements of f32 or bf16 (as bits) tensors, read and written as float.
inline float to_float(const float* p) {
  return *p;
}
inline float to_float(const std::uint16_t* p) {
  return bf16_bits_to_float(*p);
}
inline void store_float(float* p, float v) {
  *p = v;
}
inline void store_float(std::uint16_t* p, float v) {
  *p = float_to_bf16(v);
}

// Normalised weights w_i = exp(s_i - max) / sum_j exp(s_j - max) of n states (lse s_i at
// s[i * s_stride]); an empty state (s_i = -inf) gets weight 0. Returns the merged lse, -inf
// when every state is empty. A NaN lse propagates to every weight and the result.
float merge_weights(int n, const float* s, std::int64_t s_stride, float* w) {
  float m = kNegInf;
  for (int i = 0; i < n; ++i) {
    const float si = s[i * s_stride];
    if (std::isnan(si) || si > m) m = si;
    if (std::isnan(m)) break;
  }
  if (m == kNegInf) {
    std::fill(w, w + n, 0.0f);
    return kNegInf;
  }
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float si = s[i * s_stride];
    w[i] = si == kNegInf ? 0.0f : std::exp(si - m);
    sum += w[i];
  }
  for (int i = 0; i < n; ++i) w[i] /= sum;
  return m + std::log(sum);
}

// out[d * out_stride] = sum_i w[i] * v[i * v_state + d * v_dim] for d < dim. Zero-weight states
// are skipped, so an empty state's (undefined) values are never read. `acc` holds dim floats.
template <class In, class Out>
void merge_values(int n, const In* v, std::int64_t v_state, std::int64_t v_dim, std::int64_t dim,
                  const float* w, Out* out, std::int64_t out_stride, float* acc) {
  std::fill(acc, acc + dim, 0.0f);
  for (int i = 0; i < n; ++i) {
    if (w[i] == 0.0f) continue;
    const In* vi = v + i * v_state;
    for (std::int64_t d = 0; d < dim; ++d) acc[d] += w[i] * to_float(vi + d * v_dim);
  }
  for (std::int64_t d = 0; d < dim; ++d) store_float(out + d * out_stride, acc[d]);
}

template <class In, class Out>
void merge_tensors(const TensorView& v, const TensorView& s, const TensorView& v_out,
                   const TensorView& s_out) {
  // merge_states() bounds rows, states and D (fp8mla/limits.h), so these products fit.
  const std::int64_t rows = v.shape[0];
  const int n = static_cast<int>(v.shape[1]);
  const std::int64_t dim = v.shape[2];
  // Threads only pay off for big merges (context parallelism); a few rows run inline.
  constexpr std::int64_t kRowsPerItem = 64;
  const std::int64_t items = (rows + kRowsPerItem - 1) / kRowsPerItem;
  const bool big = rows * n * dim >= (std::int64_t{1} << 20);
  parallel_for(big ? resolve_threads(0) : 1, items, [&] {
    return [&, w = std::vector<float>(static_cast<std::size_t>(n)),
            acc = std::vector<float>(static_cast<std::size_t>(dim))](std::int64_t item) mutable {
      const std::int64_t end = std::min(rows, (item + 1) * kRowsPerItem);
      for (std::int64_t r = item * kRowsPerItem; r < end; ++r) {
        // Rows of no states (n = 0) or no values (D = 0): v, s or v_out have no elements and
        // maybe no data, so no address is formed in them.
        const float lse =
            n > 0 ? merge_weights(n, element_ptr<const float>(s, r), s.stride[1], w.data())
                  : kNegInf;
        if (dim > 0) {
          merge_values(n, n > 0 ? element_ptr<const In>(v, r) : nullptr, v.stride[1],
                       v.stride[2], dim, w.data(), element_ptr<Out>(v_out, r), v_out.stride[1],
                       acc.data());
        }
        if (s_out.defined()) *element_ptr<float>(s_out, r) = lse;
      }
    };
  });
}

// ---- attention tiles ----

// Float vectors of the GCC / Clang vector extension, which both compilers keep in registers
// (plain loops over arrays of accumulators they do not). The kernels below are templates on the
// vector type: 8 lanes for AVX2 + FMA, 4 for the baseline (SSE2, NEON). Vectors pass by
// reference: by value, a 32-byte vector changes the ABI between SSE and AVX code (-Wpsabi).
using f32x4 = float __attribute__((vector_size(16)));
using f32x8 = float __attribute__((vector_size(32)));
template <class V>
constexpr int kLanes = static_cast<int>(sizeof(V) / sizeof(float));

template <class V>
[[gnu::always_inline]] inline void load(V& v, const float* p) {
  std::memcpy(&v, p, sizeof v);
}
template <class V>
[[gnu::always_inline]] inline void store(float* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}
template <class V>
[[gnu::always_inline]] inline float hsum(const V& v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes<V>; ++i) s += v[i];
  return s;
}

// One thread's working set for a tile: rows are (query token, head) pairs, token-major.
struct TileScratch {
  std::vector<float> q = std::vector<float>(kMaxRowsPerTile * kDimQk);   // [rows, 576]
  std::vector<float> o = std::vector<float>(kMaxRowsPerTile * kDimCkv);  // [rows, 512]
  std::vector<float> k = std::vector<float>(kChunk * kDimQk);            // [kChunk, 576]
  std::vector<float> merge_w;                                            // [splits]
  std::vector<float> merge_acc = std::vector<float>(kDimCkv);
  std::vector<float> merge_row = std::vector<float>(kDimCkv);  // a merged row before its store
  float m[kMaxRowsPerTile];                                    // running max score per row
  float l[kMaxRowsPerTile];    // running sum of exp(score - m) per row (0: nothing seen yet)
  int n_row[kMaxRowsPerTile];  // tokens of the current chunk each row sees (a prefix)
};

// Online-softmax update of G rows (q[g], o[g], m[g], l[g]) with the first n_row[g] decoded
// tokens of the chunk k (576 floats each). Register blocking: scores take G rows x 2 tokens
// per pass over the 576 values, the value update G rows x 2 vectors of columns per pass over
// the tokens, so each load feeds several multiply-adds.
template <class V, int G>
[[gnu::always_inline]] inline void attend_group(const float* k, const int* n_row, float* const* q,
                                                float* const* o, float* m, float* l,
                                                float sm_scale) {
  int n_min = kChunk;
  int n_max = 0;
  for (int g = 0; g < G; ++g) {
    n_min = std::min(n_min, n_row[g]);
    n_max = std::max(n_max, n_row[g]);
  }
  float s[G][kChunk];
  for (int t = 0; t < n_max; t += 2) {
    const float* k0 = k + t * kDimQk;
    const float* k1 = t + 1 < n_max ? k0 + kDimQk : k0;  // odd count: the last token twice
    V a0[G] = {};
    V a1[G] = {};
    for (int d = 0; d < kDimQk; d += kLanes<V>) {
      V x0, x1;
      load(x0, k0 + d);
      load(x1, k1 + d);
      for (int g = 0; g < G; ++g) {
        V qg;
        load(qg, q[g] + d);
        a0[g] += qg * x0;
        a1[g] += qg * x1;
      }
    }
    for (int g = 0; g < G; ++g) {
      s[g][t] = hsum(a0[g]) * sm_scale;
      if (t + 1 < n_max) s[g][t + 1] = hsum(a1[g]) * sm_scale;
    }
  }
  // p = exp(s - new max) over each row's prefix, 0 past it.
  float p[G][kChunk];
  for (int g = 0; g < G; ++g) {
    std::fill(p[g], p[g] + kChunk, 0.0f);
    if (n_row[g] == 0) continue;
    float m_new = m[g];
    for (int t = 0; t < n_row[g]; ++t) {
      if (std::isnan(s[g][t]) || s[g][t] > m_new) m_new = s[g][t];
    }
    const float alpha = std::exp(m[g] - m_new);  // 0 on a row's first tokens (m = -inf)
    float sum = 0.0f;
    for (int t = 0; t < n_row[g]; ++t) {
      p[g][t] = std::exp(s[g][t] - m_new);
      sum += p[g][t];
    }
    l[g] = l[g] * alpha + sum;
    m[g] = m_new;
    if (alpha != 1.0f) {
      for (int d = 0; d < kDimCkv; ++d) o[g][d] *= alpha;
    }
  }
  // o += p . v over the prefix every row of the group sees.
  constexpr int kL = kLanes<V>;
  for (int d = 0; d < kDimCkv; d += 2 * kL) {
    V a[G][2];
    for (int g = 0; g < G; ++g) {
      load(a[g][0], o[g] + d);
      load(a[g][1], o[g] + d + kL);
    }
    for (int t = 0; t < n_min; ++t) {
      V lo, hi;  // token t's values at columns d and d + kL
      load(lo, k + t * kDimQk + d);
      load(hi, k + t * kDimQk + d + kL);
      for (int g = 0; g < G; ++g) {
        a[g][0] += p[g][t] * lo;
        a[g][1] += p[g][t] * hi;
      }
    }
    for (int g = 0; g < G; ++g) {
      store(o[g] + d, a[g][0]);
      store(o[g] + d + kL, a[g][1]);
    }
  }
  // Causal tails: tokens only some rows see (a row never multiplies a value it cannot see,
  // even by 0, so a NaN there stays out of it).
  for (int g = 0; g < G; ++g) {
    for (int t = n_min; t < n_row[g]; ++t) {
      const float* vt = k + t * kDimQk;
      for (int d = 0; d < kDimCkv; ++d) o[g][d] += p[g][t] * vt[d];
    }
  }
}

// Rows [begin, end) of the scratch against its decoded chunk, kGroup rows at a time.
template <class V>
[[gnu::always_inline]] inline void attend_rows(TileScratch& sc, int begin, int end,
                                               float sm_scale) {
  for (int g0 = begin; g0 < end; g0 += kGroup) {
    float* q[kGroup];
    float* o[kGroup];
    const int count = std::min(kGroup, end - g0);
    for (int g = 0; g < count; ++g) {
      q[g] = sc.q.data() + (g0 + g) * kDimQk;
      o[g] = sc.o.data() + (g0 + g) * kDimCkv;
    }
    const float* k = sc.k.data();
    const int* n = sc.n_row + g0;
    switch (count) {
      case 4:
        attend_group<V, 4>(k, n, q, o, sc.m + g0, sc.l + g0, sm_scale);
        break;
      case 3:
        attend_group<V, 3>(k, n, q, o, sc.m + g0, sc.l + g0, sm_scale);
        break;
      case 2:
        attend_group<V, 2>(k, n, q, o, sc.m + g0, sc.l + g0, sm_scale);
        break;
      default:
        attend_group<V, 1>(k, n, q, o, sc.m + g0, sc.l + g0, sm_scale);
        break;
    }
  }
}

// What every tile of one run shares, including the run's own split-KV workspace: runs of one
// plan on several threads at once each write theirs (the plan is only read).
struct TileContext {
  TileContext(const PlanState& p, const RunArgs& a)
      : plan(p),
        args(a),
        reader(a.kv),
        page_shift(std::countr_zero(static_cast<unsigned>(p.page_size))),
        page_mask(p.page_size - 1),
        num_slots(p.num_pages * p.page_size),
        partial_o(static_cast<std::size_t>(p.partial_rows) * kDimCkv),
        partial_lse(static_cast<std::size_t>(p.partial_rows)),
        remaining(static_cast<std::size_t>(p.batch)) {
    for (const WorkTile& tile : p.tiles) {
      check_tile(tile);
      if (tile.split >= 0) remaining[tile.request].fetch_add(1, std::memory_order_relaxed);
    }
  }

  // The tile records come from plan(); a broken one would make the kernels read or write out
  // of bounds, so it fails loudly here instead (a few comparisons per tile).
  void check_tile(const WorkTile& t) const {
    const bool request_ok = t.request >= 0 && t.request < plan.batch;
    const std::int64_t qo_len =
        request_ok ? plan.qo_indptr[t.request + 1] - plan.qo_indptr[t.request] : 0;
    const std::int64_t kv_bound = plan.topk > 0 ? plan.topk
                                  : request_ok  ? plan.kv_len[t.request]
                                                : 0;
    const bool ok = request_ok && t.q_count >= 1 && t.head_count >= 1 &&
                    t.q_count * t.head_count <= kMaxRowsPerTile && t.q_begin >= 0 &&
                    t.q_begin + t.q_count <= qo_len && t.head_begin >= 0 &&
                    t.head_begin + t.head_count <= plan.num_heads && t.kv_begin >= 0 &&
                    t.kv_begin <= t.kv_end && t.kv_end <= kv_bound &&
                    t.split < plan.num_splits[t.request] &&
                    (t.split < 0 || plan.num_splits[t.request] > 1);
    if (!ok) {
      throw Error(ErrorCode::internal, "plan",
                  msg("tile (request ", t.request, ", q ", t.q_begin, "+", t.q_count, ", heads ",
                      t.head_begin, "+", t.head_count, ", kv [", t.kv_begin, ", ", t.kv_end,
                      "), split ", t.split, ") is outside the planned problem"));
    }
  }

  const PlanState& plan;
  const RunArgs& args;
  const KvReader reader;
  const int page_shift;  // page_size is a power of two
  const std::int64_t page_mask;
  const std::int64_t num_slots;
  std::vector<float> partial_o;             // [plan.partial_rows, 512] split requests' partials
  std::vector<float> partial_lse;           // [plan.partial_rows]
  std::vector<std::atomic<int>> remaining;  // split tiles of each request not yet finished
};

// Dense: the tile's rows share one token range; causal rows see different prefixes of it.
template <class V>
[[gnu::always_inline]] inline void run_dense(const TileContext& ctx, const WorkTile& tile,
                                             TileScratch& sc) {
  const PlanState& plan = ctx.plan;
  const int r = tile.request;
  const std::int64_t qo_len = plan.qo_indptr[r + 1] - plan.qo_indptr[r];
  const std::int64_t end = std::min<std::int64_t>(tile.kv_end, plan.kv_len[r]);
  // Query token i of the request sees [0, M - qo_len + i], M = causal_mask_len (kv_len unless
  // the tokens are a context-parallel shard); the limit is exclusive.
  const std::int64_t mask = causal_mask_len(plan, r);
  auto limit = [&](int tq) {
    return plan.causal ? std::min(end, mask - qo_len + tile.q_begin + tq + 1) : end;
  };
  const std::int64_t last = limit(tile.q_count - 1);  // the tile's last token sees the most
  const std::int32_t* pages = host_page_table(plan) + plan.kv_indptr[r];
  const int rows = tile.q_count * tile.head_count;
  for (std::int64_t c = tile.kv_begin; c < last; c += kChunk) {
    const int n = static_cast<int>(std::min<std::int64_t>(kChunk, last - c));
    for (int j = 0; j < n; ++j) {
      const std::int64_t token = c + j;
      if (const std::int64_t ahead = token + kPrefetchAhead; ahead < last) {
        ctx.reader.prefetch(pages[ahead >> ctx.page_shift], ahead & ctx.page_mask);
      }
      ctx.reader.read(pages[token >> ctx.page_shift], token & ctx.page_mask,
                      sc.k.data() + j * kDimQk);
    }
    for (int row = 0; row < rows; ++row) {
      sc.n_row[row] =
          static_cast<int>(std::clamp<std::int64_t>(limit(row / tile.head_count) - c, 0, n));
    }
    attend_rows<V>(sc, 0, rows, plan.sm_scale);
  }
}

// Sparse: each query token has its own index list. Its valid slots are decoded a chunk at a
// time and run against that token's heads.
template <class V>
[[gnu::always_inline]] inline void run_sparse(const TileContext& ctx, const WorkTile& tile,
                                              TileScratch& sc) {
  const PlanState& plan = ctx.plan;
  const TensorView& given = ctx.args.sparse_indices;
  for (int tq = 0; tq < tile.q_count; ++tq) {
    const std::int64_t t = plan.qo_indptr[tile.request] + tile.q_begin + tq;
    const int begin = tq * tile.head_count;
    const int end = begin + tile.head_count;
    int filled = 0;
    auto flush = [&] {
      std::fill(sc.n_row + begin, sc.n_row + end, filled);
      attend_rows<V>(sc, begin, end, plan.sm_scale);
      filled = 0;
    };
    // Position pos's slot, or -1 for a -1 or out-of-range entry (skipped).
    auto slot_at = [&](std::int64_t pos) -> std::int64_t {
      const std::int64_t slot = given.defined() ? *element_ptr<const std::int32_t>(given, t, pos)
                                                : plan.sparse_indices[t * plan.topk + pos];
      return slot < ctx.num_slots ? slot : -1;
    };
    for (std::int64_t pos = tile.kv_begin; pos < tile.kv_end; ++pos) {
      if (pos + kPrefetchAhead < tile.kv_end) {
        const std::int64_t ahead = slot_at(pos + kPrefetchAhead);
        if (ahead >= 0) ctx.reader.prefetch(ahead >> ctx.page_shift, ahead & ctx.page_mask);
      }
      const std::int64_t slot = slot_at(pos);
      if (slot < 0) continue;  // -1 and out-of-range entries
      ctx.reader.read(slot >> ctx.page_shift, slot & ctx.page_mask, sc.k.data() + filled * kDimQk);
      if (++filled == kChunk) flush();
    }
    if (filled > 0) flush();
  }
}

// Loads the tile's q rows, runs its kv range, and leaves the unnormalised o, m, l in `sc`.
template <class V>
[[gnu::always_inline]] inline void compute_tile(const TileContext& ctx, const WorkTile& tile,
                                                TileScratch& sc) {
  const std::int64_t q_first = ctx.plan.qo_indptr[tile.request] + tile.q_begin;
  const int rows = tile.q_count * tile.head_count;
  for (int row = 0; row < rows; ++row) {
    const std::int64_t t = q_first + row / tile.head_count;
    const std::int64_t h = tile.head_begin + row % tile.head_count;
    const auto* q_nope = element_ptr<const std::uint16_t>(ctx.args.q_nope, t, h);
    const auto* q_pe = element_ptr<const std::uint16_t>(ctx.args.q_pe, t, h);
    float* q = sc.q.data() + row * kDimQk;
    if (ctx.plan.q_dtype == DType::f16) {
      for (int d = 0; d < kDimCkv; ++d) q[d] = f16_bits_to_float(q_nope[d]);
      for (int d = 0; d < kDimKpe; ++d) q[kDimCkv + d] = f16_bits_to_float(q_pe[d]);
    } else {
      for (int d = 0; d < kDimCkv; ++d) q[d] = bf16_bits_to_float(q_nope[d]);
      for (int d = 0; d < kDimKpe; ++d) q[kDimCkv + d] = bf16_bits_to_float(q_pe[d]);
    }
    std::fill_n(sc.o.data() + row * kDimCkv, kDimCkv, 0.0f);
    sc.m[row] = kNegInf;
    sc.l[row] = 0.0f;
  }
  if (ctx.plan.topk > 0) {
    run_sparse<V>(ctx, tile, sc);
  } else {
    run_dense<V>(ctx, tile, sc);
  }
}

// The hot loop, built twice on x86-64: 8 lanes with AVX2 + FMA enabled (everything above is
// inlined into it, so the whole tile is compiled for that target), used when the CPU has them,
// and 4 lanes for the baseline. Elsewhere (ARM: NEON) the 4-lane build only.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
[[gnu::target("avx2,fma")]] void compute_tile_avx2(const TileContext& ctx, const WorkTile& tile,
                                                   TileScratch& sc) {
  compute_tile<f32x8>(ctx, tile, sc);
}
void compute_tile_any(const TileContext& ctx, const WorkTile& tile, TileScratch& sc) {
  static const bool avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2_fma) return compute_tile_avx2(ctx, tile, sc);
  compute_tile<f32x4>(ctx, tile, sc);
}
#else
void compute_tile_any(const TileContext& ctx, const WorkTile& tile, TileScratch& sc) {
  compute_tile<f32x4>(ctx, tile, sc);
}
#endif

// Writes one output row of 512 floats, each times `scale`, as the plan's out dtype (bf16 or f16).
void store_out_row(const PlanState& plan, const float* o, float scale, std::uint16_t* out) {
  if (plan.out_dtype == DType::f16) {
    for (int d = 0; d < kDimCkv; ++d) out[d] = float_to_f16_bits(o[d] * scale);
  } else {
    for (int d = 0; d < kDimCkv; ++d) out[d] = float_to_bf16(o[d] * scale);
  }
}

// Combines the partial rows of split request r into out / lse.
void merge_request(const TileContext& ctx, int r, TileScratch& sc) {
  const PlanState& plan = ctx.plan;
  const int splits = plan.num_splits[r];
  const std::int64_t qo_len = plan.qo_indptr[r + 1] - plan.qo_indptr[r];
  const std::int64_t heads = plan.num_heads;
  const std::int64_t state_rows = qo_len * heads;  // partial rows between two splits
  sc.merge_w.resize(static_cast<std::size_t>(splits));
  for (std::int64_t row = 0; row < state_rows; ++row) {
    const std::int64_t first = plan.partial_offset[r] + row;
    const float lse =
        merge_weights(splits, ctx.partial_lse.data() + first, state_rows, sc.merge_w.data());
    const std::int64_t t = plan.qo_indptr[r] + row / heads;
    const std::int64_t h = row % heads;
    // Merged in float32 into merge_row, then stored once as the out dtype.
    merge_values(splits, ctx.partial_o.data() + first * kDimCkv, state_rows * kDimCkv, 1, kDimCkv,
                 sc.merge_w.data(), sc.merge_row.data(), 1, sc.merge_acc.data());
    store_out_row(plan, sc.merge_row.data(), 1.0f, element_ptr<std::uint16_t>(ctx.args.out, t, h));
    if (ctx.args.lse.defined()) *element_ptr<float>(ctx.args.lse, t, h) = lse;
  }
}

// Runs one tile and stores its rows normalised: to out / lse, or to the split workspace (the
// thread completing a split request's last tile then merges the request).
void run_tile(TileContext& ctx, const WorkTile& tile, TileScratch& sc) {
  compute_tile_any(ctx, tile, sc);
  const PlanState& plan = ctx.plan;
  const int r = tile.request;
  const std::int64_t qo_len = plan.qo_indptr[r + 1] - plan.qo_indptr[r];
  const int rows = tile.q_count * tile.head_count;
  for (int row = 0; row < rows; ++row) {
    const std::int64_t tq = tile.q_begin + row / tile.head_count;
    const std::int64_t h = tile.head_begin + row % tile.head_count;
    const bool empty = sc.l[row] == 0.0f;
    const float inv = empty ? 0.0f : 1.0f / sc.l[row];
    const float lse = empty ? kNegInf : sc.m[row] + std::log(sc.l[row]);
    const float* o = sc.o.data() + row * kDimCkv;
    if (tile.split < 0) {
      const std::int64_t t = plan.qo_indptr[r] + tq;
      store_out_row(plan, o, inv, element_ptr<std::uint16_t>(ctx.args.out, t, h));
      if (ctx.args.lse.defined()) *element_ptr<float>(ctx.args.lse, t, h) = lse;
    } else {
      const std::int64_t prow =
          plan.partial_offset[r] + (tile.split * qo_len + tq) * plan.num_heads + h;
      float* po = ctx.partial_o.data() + prow * kDimCkv;
      for (int d = 0; d < kDimCkv; ++d) po[d] = o[d] * inv;
      ctx.partial_lse[static_cast<std::size_t>(prow)] = lse;
    }
  }
  if (tile.split >= 0 && ctx.remaining[r].fetch_sub(1, std::memory_order_acq_rel) == 1) {
    merge_request(ctx, r, sc);
  }
}

}  // namespace

void cpu_run(const PlanState& plan, const RunArgs& args) {
  if (plan.tiles.empty()) return;
  TileContext ctx(plan, args);
  parallel_for(resolve_threads(plan.options.num_threads),
               static_cast<std::int64_t>(plan.tiles.size()), [&] {
                 return [&, sc = std::make_unique<TileScratch>()](std::int64_t i) {
                   run_tile(ctx, plan.tiles[static_cast<std::size_t>(i)], *sc);
                 };
               });
}

void cpu_merge_states(const TensorView& v, const TensorView& s, const TensorView& v_out,
                      const TensorView& s_out) {
  const bool in_bf16 = v.dtype == DType::bf16;
  const bool out_bf16 = v_out.dtype == DType::bf16;
  if (in_bf16 && out_bf16) return merge_tensors<std::uint16_t, std::uint16_t>(v, s, v_out, s_out);
  if (in_bf16) return merge_tensors<std::uint16_t, float>(v, s, v_out, s_out);
  if (out_bf16) return merge_tensors<float, std::uint16_t>(v, s, v_out, s_out);
  merge_tensors<float, float>(v, s, v_out, s_out);
}

}  // namespace fp8mla::detail
