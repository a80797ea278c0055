// Fuzz target: plan() and shard_context() on hostile Problems and PlanOptions, and run() of what
// plans (small problems, CPU backend) over a cache, q and outputs backed exactly.
//
// Findings: a crash or sanitizer report, an exception other than fp8mla::Error, a plan whose
// tiles leave the problem, a run that leaves NaN or a poisoned value in its output (the cache
// holds finite values), an allocation over libFuzzer's -rss_limit_mb, or an input slower than
// -timeout (the bounds of fp8mla/limits.h keep plan()'s work and memory small).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/context_parallel.h"
#include "fp8mla/error.h"
#include "fuzz/fuzz_input.h"

namespace {

using fp8mla::Error;
using fp8mla::Plan;
using fp8mla::Problem;

// What plan() promises about its tiles (attention.h, plan.cpp's header comment).
void check_tiles(const Plan& p, const Problem& pb) {
  const bool sparse = pb.topk > 0;
  for (const fp8mla::WorkTile& t : p.tiles()) {
    const bool ok =
        t.request >= 0 && t.request < p.batch() && t.q_count >= 1 && t.head_count >= 1 &&
        t.q_count * t.head_count <= fp8mla::kMaxRowsPerTile && t.head_begin >= 0 &&
        t.head_begin + t.head_count <= p.num_heads() && t.q_begin >= 0 &&
        t.q_begin + t.q_count <= pb.qo_indptr[t.request + 1] - pb.qo_indptr[t.request] &&
        t.kv_begin >= 0 && t.kv_begin <= t.kv_end &&
        t.kv_end <= (sparse ? pb.topk : pb.kv_len[t.request]);
    if (!ok) std::abort();
  }
}

// Runs a small CPU plan on random finite data: outputs must be written completely and finite.
void run_small(const Plan& p, const Problem& pb, fp8mla::fuzz::Input& in) {
  const std::int64_t tq = p.total_q(), h = p.num_heads(), ps = pb.page_size;
  const std::int64_t pages = pb.num_pages;
  const std::int64_t tb = fp8mla::token_bytes(pb.kv_format);
  // Small runs only: the harness's own encoding of the pool must not dominate an input's time.
  if (tq * h > 4096 || pages * ps * tb > (std::int64_t{1} << 20)) return;
  std::vector<std::uint8_t> cache(static_cast<std::size_t>(pages * ps * tb));
  // Finite cache values: e4m3 codes without 0x7f / 0xff, bf16 and block scales from small values.
  std::vector<float> token(fp8mla::kDimQk);
  for (std::int64_t slot = 0; slot < pages * ps; ++slot) {
    for (int d = 0; d < fp8mla::kDimQk; ++d)
      token[d] = static_cast<float>(static_cast<std::int8_t>(in.u8() + slot + d)) / 32.0f;
    fp8mla::encode_token(
        pb.kv_format, 1.0f, token,
        std::span<std::uint8_t>(cache.data() + slot * tb, static_cast<std::size_t>(tb)));
  }
  std::vector<std::uint16_t> q(static_cast<std::size_t>(tq * h * fp8mla::kDimQk));
  for (std::size_t i = 0; i < q.size(); ++i)
    q[i] = fp8mla::float_to_bf16(static_cast<float>(static_cast<std::int8_t>(in.u8() + i)) / 64.0f);
  std::vector<std::uint16_t> out(static_cast<std::size_t>(tq * h * fp8mla::kDimCkv), 0x7fc1);
  std::vector<float> lse(static_cast<std::size_t>(tq * h), std::nanf(""));
  fp8mla::RunArgs a;
  using fp8mla::DType;
  a.q_nope = fp8mla::make_strided_view(q.data(), DType::bf16, {tq, h, 512}, {h * 576, 576, 1});
  // (No query tokens: q is empty and its data pointer may be null, which takes no offset.)
  a.q_pe = fp8mla::make_strided_view(q.empty() ? nullptr : q.data() + 512, DType::bf16, {tq, h, 64},
                                     {h * 576, 576, 1});
  a.out = fp8mla::make_view(out.data(), DType::bf16, {tq, h, 512});
  a.lse = fp8mla::make_view(lse.data(), DType::f32, {tq, h});
  a.kv.format = pb.kv_format;
  if (pb.kv_format == fp8mla::KvFormat::fp8_e4m3_block) {
    a.kv.ckv = fp8mla::make_view(cache.data(), DType::u8, {pages, ps, tb});
  } else {
    const DType e = pb.kv_format == fp8mla::KvFormat::bf16 ? DType::bf16 : DType::fp8_e4m3;
    const std::int64_t w = pb.kv_format == fp8mla::KvFormat::bf16 ? 2 : 1;  // element bytes
    a.kv.ckv = fp8mla::make_strided_view(cache.data(), e, {pages, ps, 512}, {ps * 576, 576, 1});
    a.kv.kpe =
        fp8mla::make_strided_view(cache.data() + 512 * w, e, {pages, ps, 64}, {ps * 576, 576, 1});
  }
  fp8mla::run(p, a);
  for (const std::uint16_t v : out)
    if ((v & 0x7fff) > 0x7f80) std::abort();  // NaN: unwritten (poison) or a wrong result
  for (const float l : lse)
    if (std::isnan(l)) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fp8mla::fuzz::Input in(data, size);
  const std::uint8_t flags = in.u8();
  Problem pb;
  pb.causal = (flags & 1) != 0;
  pb.kv_format = static_cast<fp8mla::KvFormat>(in.u8() % 4);  // 3: not a format
  pb.num_heads = in.int_in(1, 16);
  pb.page_size = in.int_in(1, 16);
  pb.num_pages = in.int64_in(1, 32);
  pb.sm_scale = in.f32();
  if (in.flag()) pb.sm_scale = 0.0625f;
  pb.topk = (flags & 2) != 0 ? in.int_in(1, 64) : 0;
  fp8mla::PlanOptions o;
  o.sm_count = in.int_in(0, 64);
  o.ctas_per_sm = in.int_in(0, 4);
  o.min_chunk_tokens = in.int_in(1, 256);
  o.num_threads = in.int_in(0, 2);
  o.max_tile_rows = in.int_in(0, 64);
  o.cpu_reference = (flags & 32) != 0;
  o.cuda_graph = (flags & 4) != 0;
  o.max_batch = in.int_in(0, 8);
  o.max_total_q = in.int_in(0, 32);
  o.max_kv_indices = in.int64_in(0, 256);
  o.max_qo_len = in.int_in(0, 8);
  const std::int32_t rank = in.int_in(0, 3), world = in.int_in(1, 4);
  // The kernel family: the table's choice below 128, else forced (values past the last family
  // included); a CPU problem names a CUDA family at times.
  const std::uint8_t family = in.u8();
  if (family >= 128) o.kernel_family = static_cast<fp8mla::KernelFamily>(family % 16);
  o.any_scale_ratio = (family & 1) != 0;
  const std::vector<std::int32_t> qo_indptr = in.array(64, 0, 64);
  const std::vector<std::int32_t> kv_indptr = in.array(64, 0, 64);
  const std::vector<std::int32_t> kv_indices = in.array(512, -1, 40);
  const std::vector<std::int32_t> kv_len = in.array(64, 0, 300);
  const std::vector<std::int32_t> causal_len = in.array(64, 0, 300);
  const std::vector<std::int32_t> sparse = in.array(1024, -2, 600);
  pb.qo_indptr = qo_indptr;
  pb.kv_indptr = kv_indptr;
  pb.kv_indices = kv_indices;
  pb.kv_len = kv_len;
  if ((flags & 64) != 0) pb.causal_len = causal_len;
  pb.sparse_indices = sparse;

  try {
    if ((flags & 16) != 0) {
      fp8mla::ContextShard shard;
      fp8mla::shard_context(pb, rank, world, shard);
      const Plan p = fp8mla::plan(shard.problem, o);
      check_tiles(p, shard.problem);
      if ((flags & 8) != 0) run_small(p, shard.problem, in);
    } else {
      const Plan p = fp8mla::plan(pb, o);
      check_tiles(p, pb);
      if ((flags & 8) != 0) run_small(p, pb, in);
    }
  } catch (const Error&) {
    // The documented outcome of bad input.
  }
  return 0;
}
