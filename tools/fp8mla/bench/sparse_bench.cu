// `fp8mla bench --sparse` on a CUDA device (sparse_bench.cuh). A case plans once and times
// `calls` run()s in one CUDA graph, each call with its own top-k rows (RunArgs::sparse_indices, as
// an engine passes the indexer's choice every layer) drawn over the whole pool of >= 1M tokens,
// so successive calls read different slots and the figures are HBM figures. Then call 0 runs
// on a NaN-poisoned output, which must be written everywhere and match the float64 reference on
// a sample (the first and last request's rows, up to 8 heads spread over the range).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <unordered_map>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/error.h"
#include "src/core/check.h"
#include "src/cuda/cuda_check.h"
#include "tools/fp8mla/bench/case_error.h"
#include "tools/fp8mla/bench/gpu_bench_util.cuh"
#include "tools/fp8mla/bench/sparse_bench.cuh"
#include "tools/fp8mla/bench/sparse_grid.h"

namespace fp8mla::bench {
namespace {

using detail::msg;

constexpr double kReferenceTol = 1e-2;
// 1 / sqrt(192), as the dense grid (UniformBatch).
const float kSmScale = 1.0f / std::sqrt(192.0f);

std::size_t align256(std::size_t bytes) {
  return (bytes + 255) & ~std::size_t{255};
}

std::vector<int> sample_heads(int heads) {
  std::vector<int> h;
  if (heads <= 8) {
    for (int i = 0; i < heads; ++i) h.push_back(i);
  } else {
    for (int j = 0; j < 8; ++j) h.push_back(j * (heads - 1) / 7);
  }
  return h;
}

struct SparseRunner {
  const BenchMemory& m;
  const GpuBenchOptions& o;
  std::int64_t l2_bytes;

  CaseResult run(const SparseCase& c) {
    const std::int64_t tb = token_bytes(c.format);
    // Slots are int32 over whole pages of the pool.
    std::int64_t pool_tokens = std::min<std::int64_t>(static_cast<std::int64_t>(m.pool_bytes) / tb,
                                                      std::numeric_limits<std::int32_t>::max());
    pool_tokens -= pool_tokens % c.page_size;
    if (pool_tokens < kSparseMinPoolTokens) {
      throw Error(ErrorCode::out_of_memory, "--sparse",
                  msg("the pool holds ", pool_tokens, " ", format_name(c.format),
                      " tokens, fewer than the ", kSparseMinPoolTokens,
                      " the top-k slots are drawn over"));
    }
    const std::int64_t num_pages = pool_tokens / c.page_size, rows = c.rows();
    // Calls a replay: >= 8, and enough that a replay reads >= 4x L2 (up to 512 calls), so that
    // small cases read HBM, not what the replay before left in L2.
    const int calls = static_cast<int>(std::clamp<double>(
        std::ceil(4.0 * static_cast<double>(l2_bytes) / sparse_floor_bytes(c)), 8, 512));
    const std::uint64_t seed = 1000003ull * static_cast<std::uint64_t>(c.topk) +
                               7919ull * static_cast<std::uint64_t>(c.heads) +
                               131ull * static_cast<std::uint64_t>(c.batch) +
                               17ull * static_cast<std::uint64_t>(c.qo_len) +
                               static_cast<std::uint64_t>(c.page_size);
    std::vector<std::vector<std::int32_t>> idx;
    for (int v = 0; v < calls; ++v)
      idx.push_back(draw_sparse_rows(rows, c.topk, pool_tokens, seed + 0x9e3779b9ull * v));

    // Scratch: every call's indices, then the check's slots and tokens; q, out and lse at its end.
    const std::size_t idx_elems = static_cast<std::size_t>(rows) * c.topk;
    const std::size_t q_elems = static_cast<std::size_t>(rows) * c.heads * 576;
    const std::size_t o_elems = static_cast<std::size_t>(rows) * c.heads * 512;
    const std::size_t check_slots = std::size_t{4} * c.qo_len * c.topk;
    const std::size_t idx_bytes = align256(calls * idx_elems * 4);
    const std::size_t slots_bytes = align256(check_slots * 4);
    const std::size_t tokens_bytes = align256(check_slots * static_cast<std::size_t>(tb));
    const std::size_t tail_bytes = align256(q_elems * 2) + align256(o_elems * 2) +
                                   align256(static_cast<std::size_t>(rows) * c.heads * 4);
    if (idx_bytes + slots_bytes + tokens_bytes + tail_bytes > m.scratch_bytes) {
      throw Error(ErrorCode::out_of_memory, "--sparse",
                  msg("the case needs ", idx_bytes + slots_bytes + tokens_bytes + tail_bytes,
                      " bytes of scratch, the run has ", m.scratch_bytes));
    }
    auto* d_idx = reinterpret_cast<std::int32_t*>(m.scratch);
    auto* d_slots = reinterpret_cast<std::int32_t*>(m.scratch + idx_bytes);
    std::uint8_t* d_tokens = m.scratch + idx_bytes + slots_bytes;
    std::uint8_t* tail = m.scratch + m.scratch_bytes - tail_bytes;
    auto* q = reinterpret_cast<std::uint16_t*>(tail);
    auto* out = reinterpret_cast<std::uint16_t*>(tail + align256(q_elems * 2));
    auto* lse = reinterpret_cast<float*>(tail + align256(q_elems * 2) + align256(o_elems * 2));
    for (int v = 0; v < calls; ++v) {
      FP8MLA_CUDA_CHECK(cudaMemcpyAsync(d_idx + v * idx_elems, idx[v].data(), idx_elems * 4,
                                        cudaMemcpyHostToDevice, m.s));
    }
    fill_bf16(m.s, q, static_cast<std::int64_t>(q_elems), 3);

    std::vector<std::int32_t> qo_indptr(static_cast<std::size_t>(c.batch) + 1);
    for (int r = 0; r <= c.batch; ++r) qo_indptr[r] = r * c.qo_len;
    Problem p;
    p.num_heads = c.heads;
    p.page_size = c.page_size;
    p.num_pages = num_pages;
    p.kv_format = c.format;
    p.causal = false;  // a sparse row sees exactly its listed slots
    p.sm_scale = kSmScale;
    p.qo_indptr = qo_indptr;
    p.topk = c.topk;
    p.sparse_indices = idx[0];
    p.device = DeviceKind::cuda;
    PlanOptions po;
    if (o.min_chunk_tokens > 0) po.min_chunk_tokens = o.min_chunk_tokens;
    po.exact_scores = o.exact_scores;
    po.max_tile_rows = o.max_tile_rows;
    const Plan sparse_plan = fp8mla::plan(p, po);

    RunArgs args;
    args.q_nope = make_strided_view(q, DType::bf16, {rows, c.heads, 512}, {c.heads * 576, 576, 1},
                                    DeviceKind::cuda);
    args.q_pe = make_strided_view(q + 512, DType::bf16, {rows, c.heads, 64},
                                  {c.heads * 576, 576, 1}, DeviceKind::cuda);
    args.out = make_view(out, DType::bf16, {rows, c.heads, 512}, DeviceKind::cuda);
    args.lse = make_view(lse, DType::f32, {rows, c.heads}, DeviceKind::cuda);
    args.kv = cache_view(m.pool, c.format, num_pages, c.page_size);
    args.stream = m.s;
    auto call_indices = [&](int v) {
      return make_view(d_idx + v * idx_elems, DType::i32, {rows, c.topk}, DeviceKind::cuda);
    };
    // Replays: as many as fill ~0.15 s of device time (quick: 0.05 s), 3 to 15 (quick: 5).
    const double us =
        time_captured_within(m.s, calls, o.quick ? 0.05 : 0.15, 3, o.quick ? 5 : 15, [&] {
          for (int v = 0; v < calls; ++v) {
            args.sparse_indices = call_indices(v);
            fp8mla::run(sparse_plan, args);
          }
        });

    CaseResult r;
    r.batch = c.batch;
    r.heads = c.heads;
    r.qo_len = c.qo_len;
    r.page_size = c.page_size;
    r.format = c.format;
    r.strategy = "native";
    r.us = us;
    r.kernel = sparse_plan.kernel_name();
    r.check_against = "reference";
    r.topk = c.topk;
    r.valid_per_row = sparse_valid_per_row(c.topk);
    r.pool_tokens = pool_tokens;
    r.bytes = sparse_floor_bytes(c);
    r.gbs = r.bytes / (us * 1e3);
    r.read_pct = 100.0 * r.gbs / m.ceil.read_gbs;
    r.tfs = sparse_flops(c) / (us * 1e6);
    r.mm_pct = m.ceil.matmul_tfs > 0 ? 100.0 * r.tfs / m.ceil.matmul_tfs : 0;
    // The gather ceiling: the same calls' lists read by read_tokens, timed the same way (the
    // check's slot scratch, rewritten below, takes the sink's word).
    const double gather_us =
        time_captured_within(m.s, calls, o.quick ? 0.05 : 0.15, 3, o.quick ? 5 : 15, [&] {
          for (int v = 0; v < calls; ++v) {
            read_tokens(m.s, m.pool, tb, d_idx + v * idx_elems,
                        static_cast<std::int64_t>(idx_elems),
                        reinterpret_cast<std::uint32_t*>(d_slots));
          }
        });
    r.gather_gbs = r.bytes / (gather_us * 1e3);

    // The check: call 0 on a poisoned output (0xffff: a bf16 NaN in every element).
    FP8MLA_CUDA_CHECK(cudaMemsetAsync(out, 0xff, o_elems * 2, m.s));
    args.sparse_indices = call_indices(0);
    fp8mla::run(sparse_plan, args);
    std::vector<std::uint16_t> got(o_elems);
    FP8MLA_CUDA_CHECK(cudaMemcpyAsync(got.data(), out, o_elems * 2, cudaMemcpyDeviceToHost, m.s));
    FP8MLA_CUDA_CHECK(cudaStreamSynchronize(m.s));
    // The pool and q hold no NaN: one in the output is an element the run did not write.
    if (std::any_of(got.begin(), got.end(),
                    [](std::uint16_t b) { return (b & 0x7fff) > 0x7f80; })) {
      r.check = std::numeric_limits<double>::quiet_NaN();
      return r;
    }
    r.check = check_sample(c, idx[0], tb, d_slots, d_tokens, q, got);
    return r;
  }

  // Rel L2 of the sample's rows of `got` (call 0's output) against the float64 reference, which
  // reads a copy of the listed tokens (pages of one token, the slots renumbered).
  double check_sample(const SparseCase& c, const std::vector<std::int32_t>& idx, std::int64_t tb,
                      std::int32_t* d_slots, std::uint8_t* d_tokens, const std::uint16_t* q,
                      const std::vector<std::uint16_t>& got) {
    std::vector<int> requests{0};
    if (c.batch > 1) requests.push_back(c.batch - 1);
    const std::vector<int> heads = sample_heads(c.heads);
    const auto hs = static_cast<std::int64_t>(heads.size());
    std::vector<std::int64_t> rows;
    for (const int r : requests)
      for (int i = 0; i < c.qo_len; ++i) rows.push_back(std::int64_t{r} * c.qo_len + i);
    const auto n_rows = static_cast<std::int64_t>(rows.size());

    std::vector<std::int32_t> slots, ref_idx;
    std::unordered_map<std::int32_t, std::int32_t> compact;
    for (const std::int64_t row : rows) {
      for (int k = 0; k < c.topk; ++k) {
        const std::int32_t slot = idx[static_cast<std::size_t>(row * c.topk + k)];
        if (slot < 0) {
          ref_idx.push_back(-1);
          continue;
        }
        const auto [it, fresh] = compact.emplace(slot, static_cast<std::int32_t>(slots.size()));
        if (fresh) slots.push_back(slot);
        ref_idx.push_back(it->second);
      }
    }
    const auto n = static_cast<std::int64_t>(slots.size());
    std::vector<std::uint8_t> tokens(static_cast<std::size_t>(n * tb));
    FP8MLA_CUDA_CHECK(
        cudaMemcpyAsync(d_slots, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice, m.s));
    gather_tokens(m.s, m.pool, tb, d_slots, n, d_tokens);
    FP8MLA_CUDA_CHECK(
        cudaMemcpyAsync(tokens.data(), d_tokens, tokens.size(), cudaMemcpyDeviceToHost, m.s));
    // q of the sample: its rows, its heads.
    std::vector<std::uint16_t> q_row(static_cast<std::size_t>(c.heads) * 576);
    std::vector<std::uint16_t> q_host(static_cast<std::size_t>(n_rows * hs * 576));
    std::vector<std::uint16_t> want_got(static_cast<std::size_t>(n_rows * hs * 512));
    for (std::int64_t i = 0; i < n_rows; ++i) {
      FP8MLA_CUDA_CHECK(cudaMemcpyAsync(q_row.data(), q + rows[i] * c.heads * 576, q_row.size() * 2,
                                        cudaMemcpyDeviceToHost, m.s));
      FP8MLA_CUDA_CHECK(cudaStreamSynchronize(m.s));
      for (std::int64_t j = 0; j < hs; ++j) {
        std::copy_n(q_row.begin() + heads[j] * 576, 576, q_host.begin() + (i * hs + j) * 576);
        std::copy_n(got.begin() + (rows[i] * c.heads + heads[j]) * 512, 512,
                    want_got.begin() + (i * hs + j) * 512);
      }
    }

    std::vector<std::int32_t> qo_indptr;
    for (std::size_t r = 0; r <= requests.size(); ++r)
      qo_indptr.push_back(static_cast<std::int32_t>(r) * c.qo_len);
    Problem p;
    p.num_heads = static_cast<int>(hs);
    p.page_size = 1;
    p.num_pages = std::max<std::int64_t>(n, 1);
    p.kv_format = c.format;
    p.causal = false;
    p.sm_scale = kSmScale;
    p.qo_indptr = qo_indptr;
    p.topk = c.topk;
    p.sparse_indices = ref_idx;
    p.device = DeviceKind::cpu;
    PlanOptions ro;
    ro.cpu_reference = true;
    std::vector<std::uint16_t> want(want_got.size());
    std::vector<float> lse(static_cast<std::size_t>(n_rows * hs));
    RunArgs a;
    a.q_nope = make_strided_view(q_host.data(), DType::bf16, {n_rows, hs, 512}, {hs * 576, 576, 1},
                                 DeviceKind::cpu);
    a.q_pe = make_strided_view(q_host.data() + 512, DType::bf16, {n_rows, hs, 64},
                               {hs * 576, 576, 1}, DeviceKind::cpu);
    a.kv = cache_view(tokens.data(), c.format, p.num_pages, 1, 0, DeviceKind::cpu);
    a.out = make_view(want.data(), DType::bf16, {n_rows, hs, 512}, DeviceKind::cpu);
    a.lse = make_view(lse.data(), DType::f32, {n_rows, hs}, DeviceKind::cpu);
    fp8mla::run(fp8mla::plan(p, ro), a);
    return rel_l2_bf16(want_got, want);
  }
};

bool check_passes(double rel) {
  return rel >= 0 && rel <= kReferenceTol;  // false for NaN
}

}  // namespace

bool run_sparse_grid(const BenchMemory& m, const GpuBenchOptions& o, std::vector<CaseResult>& all) {
  SparseGridAxes axes;
  axes.quick = o.quick;
  axes.topks = o.topks;
  axes.heads = o.heads;
  axes.batches = o.batches;
  axes.qo_lens = o.qo_lens;
  axes.page_sizes = o.page_sizes;
  axes.formats = o.formats;
  const std::vector<SparseCase> cases = sparse_grid(axes);
  std::printf(
      "sparse top-k: every query token reads its own row of k slots drawn over the whole pool "
      "(distinct;\nk / 20 of them -1); GB/s counts the listed slots' bytes once a row; gath: "
      "the same lists'\nbytes read by a plain gather kernel (GB/s), the case's gather ceiling; "
      "check: rel L2 against\nthe float64 reference (first and last request, <= 8 heads), every "
      "output element written\n");
  int device = 0, l2 = 0;
  FP8MLA_CUDA_CHECK(cudaGetDevice(&device));
  FP8MLA_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  SparseRunner runner{m, o, std::max(l2, 1 << 20)};
  std::vector<CaseResult> rows;
  KvFormat filled = KvFormat::bf16;
  bool any = false;
  int done = 0;
  for (const SparseCase& c : cases) {
    if (!any || filled != c.format) {
      fill_pool(m.s, m.pool, static_cast<std::int64_t>(m.pool_bytes) / token_bytes(c.format),
                c.format, 12345);
      filled = c.format;
      any = true;
    }
    const std::string label = msg("sparse k=", c.topk, " bs=", c.batch, " heads=", c.heads,
                                  " qo=", c.qo_len, " page=", c.page_size, " ",
                                  format_name(c.format));
    if (o.progress) std::fprintf(stderr, "[%d/%zu] %s\n", ++done, cases.size(), label.c_str());
    rows.push_back(run_named_case(label, [&] { return runner.run(c); }));
  }
  bool ok = true;
  std::printf("\n%-5s %-4s %-5s %-3s %-4s %-9s %-14s %9s %8s %8s %7s %6s %7s %8s %7s %9s\n",
              "topk", "bs", "heads", "qo", "page", "format", "kernel", "us", "MB", "GB/s", "%read",
              "gath", "%gath", "TF/s", "%mm", "check");
  for (const CaseResult& r : rows) {
    const bool pass = check_passes(r.check);
    ok = ok && pass;
    std::printf(
        "%-5d %-4d %-5d %-3d %-4d %-9s %-14s %9.1f %8.2f %8.0f %6.1f%% %6.0f %6.1f%% %8.1f %6.1f%% "
        "%9s%s\n",
        r.topk, r.batch, r.heads, r.qo_len, r.page_size, table_format(r.format), r.kernel.c_str(),
        r.us, r.bytes / 1e6, r.gbs, r.read_pct, r.gather_gbs,
        r.gather_gbs > 0 ? 100.0 * r.gbs / r.gather_gbs : 0.0, r.tfs, r.mm_pct,
        std::isnan(r.check) ? "unwritten" : msg(r.check).substr(0, 8).c_str(),
        pass ? "" : "  FAILED");
    all.push_back(r);
  }
  std::printf("\n%s: every sparse case %s the float64 reference within %g\n", ok ? "OK" : "FAILED",
              ok ? "matches" : "should match", kReferenceTol);
  return ok;
}

}  // namespace fp8mla::bench
