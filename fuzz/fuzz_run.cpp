// Fuzz target: run()'s arguments against a valid CPU plan, and merge_states(), with hostile
// views (fuzz/fuzz_tensor.h: ndim, extents, strides, dtypes, devices, null data), each backed by
// exactly the memory it describes.
//
// Findings: a crash or sanitizer report (a read or write outside a view), an exception other
// than fp8mla::Error, an allocation over -rss_limit_mb or an input slower than -timeout (the
// merge's work is bounded by fp8mla/limits.h whatever the views' strides).
#include <cstdint>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/error.h"
#include "fuzz/fuzz_input.h"
#include "fuzz/fuzz_tensor.h"

namespace {

using fp8mla::DType;
using fp8mla::fuzz::Input;
using fp8mla::fuzz::Tensor;
using fp8mla::fuzz::tensor;

void fuzz_run(Input& in) {
  // A valid plan, small: up to 4 requests of up to 3 query tokens over up to 16 pages.
  const auto format = static_cast<fp8mla::KvFormat>(in.u8() % 3);
  const int heads = in.int_in(1, 16) & 127;
  const int page_size = 1 << (in.u8() % 5);
  const int batch = 1 + in.u8() % 4;
  std::vector<std::int32_t> qo{0}, kvp{0}, kvi, len;
  const std::int64_t num_pages = 16;
  for (int r = 0; r < batch; ++r) {
    qo.push_back(qo.back() + in.u8() % 4);
    const int pages = in.u8() % 5;
    for (int i = 0; i < pages; ++i) kvi.push_back(in.u8() % num_pages);
    kvp.push_back(static_cast<std::int32_t>(kvi.size()));
    len.push_back(pages == 0 ? 0 : in.u8() % (pages * page_size) + 1);
  }
  fp8mla::Problem pb;
  pb.num_heads = heads < 1 ? 1 : heads;
  pb.page_size = page_size;
  pb.num_pages = num_pages;
  pb.kv_format = format;
  pb.causal = false;
  pb.sm_scale = 0.0625f;
  pb.qo_indptr = qo;
  pb.kv_indptr = kvp;
  pb.kv_indices = kvi;
  pb.kv_len = len;
  fp8mla::PlanOptions o;
  o.sm_count = 1 + in.u8() % 16;
  o.num_threads = 1 + in.u8() % 2;
  o.min_chunk_tokens = 1;
  o.cpu_reference = in.flag();
  const fp8mla::Plan p = fp8mla::plan(pb, o);  // valid by construction

  const std::int64_t tq = qo.back(), h = pb.num_heads, ps = page_size;
  const bool bf16 = format == fp8mla::KvFormat::bf16;
  const DType cache_type = bf16 ? DType::bf16 : DType::u8;
  const bool block = format == fp8mla::KvFormat::fp8_e4m3_block;
  Tensor q_nope = tensor(in, DType::bf16, {tq, h, 512});
  Tensor q_pe = tensor(in, DType::bf16, {tq, h, 64});
  Tensor out = tensor(in, DType::bf16, {tq, h, 512});
  Tensor lse = tensor(in, DType::f32, {tq, h});
  Tensor ckv = tensor(in, cache_type, {num_pages, ps, block ? 656 : 512});
  Tensor kpe = tensor(in, cache_type, {num_pages, ps, 64});
  // Finite fp8 codes (0x7f / 0xff are NaN) are not needed here: outputs are not judged.
  for (const Tensor* t : {&q_nope, &q_pe, &out, &lse, &ckv, &kpe})
    if (!t->safe) return;
  fp8mla::RunArgs a;
  a.q_nope = q_nope.view;
  a.q_pe = q_pe.view;
  a.out = out.view;
  a.lse = lse.view;
  a.kv.format = format;
  a.kv.ckv = ckv.view;
  a.kv.kpe = kpe.view;
  a.kv.ckv_scale = in.flag() ? in.f32() : 1.0f;
  a.kv.kpe_scale = in.flag() ? in.f32() : 1.0f;
  fp8mla::run(p, a);
}

void fuzz_merge(Input& in) {
  const std::int64_t rows = in.int64_in(0, 40), states = in.int64_in(0, 6),
                     dim = in.int64_in(0, 600);
  const bool v_bf16 = in.flag(), out_bf16 = in.flag();
  Tensor v = tensor(in, v_bf16 ? DType::bf16 : DType::f32, {rows, states, dim});
  Tensor s = tensor(in, DType::f32, {rows, states});
  Tensor v_out = tensor(in, out_bf16 ? DType::bf16 : DType::f32, {rows, dim});
  Tensor s_out = tensor(in, DType::f32, {rows});
  for (const Tensor* t : {&v, &s, &v_out, &s_out})
    if (!t->safe) return;
  fp8mla::merge_states(v.view, s.view, v_out.view, s_out.view);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  try {
    if (in.u8() % 2 == 0) {
      fuzz_run(in);
    } else {
      fuzz_merge(in);
    }
  } catch (const fp8mla::Error&) {
    // The documented outcome of bad input.
  }
  return 0;
}
