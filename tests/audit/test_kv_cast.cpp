// Steps, categories and the KV cast finder on made-up traces: a CUDA-shaped trace (kernels
// linked to CPU ops, no shapes, as a server's CUDA-graph replay leaves them), with a pool cast, a
// gather then cast, and natively; steps from markers and from the attention pattern; CPU traces
// where a big cast before attention is not the KV.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/audit/trace_text.h"
#include "tools/fp8mla/audit/kv_cast.h"
#include "tools/fp8mla/audit/timeline.h"
#include "tools/fp8mla/audit/trace_reader.h"

namespace fp8mla::audit {
namespace {

using testing::Ev;

constexpr const char* kCastKernel =
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(c10::Float8_e4m3fn)#1}>";
constexpr const char* kAttention = "void flashinfer::mla::BatchMLAPagedAttentionKernel<...>";
constexpr const char* kGemm = "nvjet_tst_128x64_64x8_1x1_v_bz_TNT";
constexpr const char* kIndex = "void at::native::index_elementwise_kernel<128, 4>";

enum class Way { pool, gather, native };

struct GpuTraceSpec {
  Way way = Way::pool;
  int steps = 4, layers = 6;
  double cast_us = 900, attention_us = 200, gemm_us = 150, append_us = 4, gather_us = 60;
  bool markers = true;
  bool shapes = false;  // record_shapes on the CPU ops that launch the kernels
  long long pool = 65536;
};

// Each layer: GEMM, the new token's append (a tiny cast and a scatter), [gather], [the KV
// cast], attention, GEMM. Kernels run on stream 7 a little after their launches (cudaLaunchKernel
// on the CPU).
std::string gpu_trace(const GpuTraceSpec& s) {
  std::vector<Ev> ev;
  double cpu = 100, gpu = 150;
  std::int64_t id = 1;
  const std::string pool = std::to_string(s.pool);
  auto kernel = [&](const std::string& name, double dur, const std::string& op,
                    const std::string& shapes = "", const std::string& types = "") {
    Ev o{"cpu_op", op, cpu, 3};
    o.external_id = id;
    if (s.shapes) {
      o.shapes = shapes;
      o.types = types;
    }
    ev.push_back(o);
    Ev r{"cuda_runtime", "cudaLaunchKernel", cpu + 1, 2};
    r.correlation = id;
    r.external_id = id;
    ev.push_back(r);
    Ev k{"kernel", name, gpu, dur};
    k.pid = 0;
    k.tid = 7;
    k.correlation = id;
    k.external_id = id;
    ev.push_back(k);
    ++id;
    cpu += 5;
    gpu += dur + 2;
  };
  for (int step = 0; step < s.steps; ++step) {
    const double step_start = cpu;
    const std::size_t marker = ev.size();
    ev.push_back({"user_annotation", "ProfilerStep#" + std::to_string(step + 1), step_start, 0});
    for (int layer = 0; layer < s.layers; ++layer) {
      const std::string fp8_to_bf16 = "[\"c10::BFloat16\", \"c10::Float8_e4m3fn\", \"Scalar\"]";
      kernel(kGemm, s.gemm_us, "aten::mm");
      kernel(kCastKernel, s.append_us, "aten::copy_", "[[4, 576], [4, 576], []]", fp8_to_bf16);
      kernel(kIndex, 3, "aten::index_put_");  // the append's scatter: the same kernel as a gather
      if (s.way == Way::gather) kernel(kIndex, s.gather_us, "aten::index");
      if (s.way != Way::native) {
        kernel(kCastKernel, s.cast_us, "aten::copy_",
               "[[" + pool + ", 1, 576], [" + pool + ", 1, 576], []]", fp8_to_bf16);
      }
      kernel(kAttention, s.attention_us, "flashinfer::batch_mla_run",
             "[[4, 16, 512], [" + pool + ", 1, 512], [" + pool + ", 1, 64]]",
             "[\"c10::BFloat16\", \"c10::BFloat16\", \"c10::BFloat16\"]");
      kernel(kGemm, s.gemm_us, "aten::mm");
    }
    cpu = std::max(cpu, gpu) + 400;  // sampling and a sync end the step; the next starts later
    gpu = cpu + 50;
    ev[marker].dur = cpu - step_start - 1;
    if (!s.markers) ev.erase(ev.begin() + static_cast<long>(marker));
  }
  return testing::trace_json(ev, "NVIDIA H200");
}

struct Result {
  Trace trace;
  Timeline timeline;
  KvCastFinding kv;
};

Result audit_text(const std::string& text, const CategoryRules& rules = {}) {
  const std::string path = testing::write_file("kv.json", text);
  Result r;
  r.trace = read_trace(path);
  r.timeline = build_timeline(r.trace, rules);
  r.kv = find_kv_cast(r.trace, r.timeline);
  std::remove(path.c_str());
  return r;
}

TEST(AuditKvCast, PoolCastOnTheGpuWithoutShapes) {
  GpuTraceSpec s;
  const Result r = audit_text(gpu_trace(s));
  EXPECT_TRUE(r.timeline.gpu);
  EXPECT_EQ(r.timeline.step_source, "ProfilerStep markers");
  ASSERT_EQ(r.timeline.steps.size(), 4u);
  for (const Step& step : r.timeline.steps) {
    EXPECT_EQ(step.attention_calls, s.layers);
    EXPECT_DOUBLE_EQ(step.by_category[static_cast<int>(Category::attention)],
                     s.layers * s.attention_us);
    EXPECT_DOUBLE_EQ(step.by_category[static_cast<int>(Category::gemm)], 2 * s.layers * s.gemm_us);
    EXPECT_DOUBLE_EQ(step.by_category[static_cast<int>(Category::cast_copy)],
                     s.layers * (s.cast_us + s.append_us));
    EXPECT_DOUBLE_EQ(step.by_category[static_cast<int>(Category::other)], s.layers * 3.0);
  }
  ASSERT_TRUE(r.kv.found);
  EXPECT_EQ(r.kv.kind, "pool");
  EXPECT_EQ(r.kv.per_step, s.layers);
  EXPECT_TRUE(r.kv.fp8_source);  // the kernel's name says Float8_e4m3fn
  EXPECT_EQ(r.kv.op, "aten::copy_");
  EXPECT_LT(r.kv.bytes_each, 0);  // no shapes: no bytes claimed
  EXPECT_DOUBLE_EQ(r.kv.us_each, s.cast_us);
  EXPECT_DOUBLE_EQ(r.kv.cast_us_per_step, s.layers * s.cast_us);
  // The step's GPU span: every kernel plus a 2 us gap after each.
  const double per_layer = 2 * s.gemm_us + s.append_us + 3 + s.cast_us + s.attention_us + 6 * 2;
  const double wall = s.layers * per_layer - 2;
  EXPECT_NEAR(r.kv.share, s.layers * s.cast_us / wall, 1e-9);
}

TEST(AuditKvCast, PoolCastOnTheGpuWithShapesHasBytes) {
  GpuTraceSpec s;
  s.shapes = true;
  const Result r = audit_text(gpu_trace(s));
  ASSERT_TRUE(r.kv.found);
  EXPECT_EQ(r.kv.kind, "pool");
  const double elems = static_cast<double>(s.pool) * 576;
  EXPECT_DOUBLE_EQ(r.kv.bytes_each, elems * 3);      // the launching copy_'s src and dst
  EXPECT_DOUBLE_EQ(r.kv.out_bytes_each, elems * 2);  // against attention's [pool, 1, 512] bf16
  EXPECT_NEAR(r.kv.kv_ratio, 576.0 / 512, 1e-12);
  EXPECT_DOUBLE_EQ(r.kv.save_bytes_per_step, s.layers * elems * 3);
  // Native with shapes: the append's copy of 4 tokens is far smaller than attention's input.
  s.way = Way::native;
  s.append_us = 150;  // even as long as attention
  EXPECT_FALSE(audit_text(gpu_trace(s)).kv.found);
}

TEST(AuditKvCast, GatherThenCast) {
  GpuTraceSpec s;
  s.way = Way::gather;
  s.cast_us = 80;  // the batch's pages only: about attention's size
  const Result r = audit_text(gpu_trace(s));
  ASSERT_TRUE(r.kv.found);
  EXPECT_EQ(r.kv.kind, "gather");
  EXPECT_DOUBLE_EQ(r.kv.gather_us_per_step, s.layers * s.gather_us);
  EXPECT_DOUBLE_EQ(r.kv.save_us_per_step, s.layers * (s.gather_us + s.cast_us));
}

TEST(AuditKvCast, NativeHasNothingToFlag) {
  GpuTraceSpec s;
  s.way = Way::native;
  const Result r = audit_text(gpu_trace(s));
  EXPECT_EQ(r.timeline.steps.size(), 4u);
  EXPECT_FALSE(r.kv.found);  // the append's 4 us cast is not the KV
}

TEST(AuditKvCast, CastInOnlyOneStepIsNotAPattern) {
  GpuTraceSpec s;
  s.way = Way::native;
  std::string text = gpu_trace(s);
  // One big copy before one attention call of one step: not every layer, not every step.
  const Result base = audit_text(text);
  ASSERT_FALSE(base.kv.found);
  GpuTraceSpec one = s;
  one.steps = 1;
  one.layers = 1;
  one.way = Way::pool;
  const Result r = audit_text(gpu_trace(one));
  EXPECT_TRUE(r.kv.found);  // a one-layer, one-step trace is still consistent with itself
  GpuTraceSpec mixed = s;
  mixed.steps = 3;
  const std::string native = gpu_trace(mixed);
  EXPECT_FALSE(audit_text(native).kv.found);
}

TEST(AuditKvCast, StepsFromTheAttentionPatternWithoutMarkers) {
  GpuTraceSpec s;
  s.markers = false;
  s.steps = 5;
  const Result r = audit_text(gpu_trace(s));
  EXPECT_NE(r.timeline.step_source.find("repeating pattern"), std::string::npos)
      << r.timeline.step_source;
  ASSERT_EQ(r.timeline.steps.size(), 5u);
  for (const Step& step : r.timeline.steps) EXPECT_EQ(step.attention_calls, s.layers);
  ASSERT_TRUE(r.kv.found);
  EXPECT_EQ(r.kv.per_step, s.layers);
}

TEST(AuditKvCast, UnknownAttentionNeedsItsName) {
  GpuTraceSpec s;
  std::string text = gpu_trace(s);
  // Rename the attention kernel and op to names no rule knows.
  for (const std::string& from :
       {std::string(kAttention), std::string("flashinfer::batch_mla_run")}) {
    for (std::size_t at = text.find(from); at != std::string::npos; at = text.find(from, at)) {
      text.replace(at, from.size(), "my_decode_kernel");
    }
  }
  EXPECT_FALSE(audit_text(text).kv.found);
  CategoryRules rules;
  rules.attention = {"MY_DECODE"};  // case-insensitive
  const Result r = audit_text(text, rules);
  EXPECT_TRUE(r.kv.found);
}

// CPU traces with shapes: the KV cast writes what attention reads; a cast of something else
// before attention, however long, is not the KV.
std::string cpu_trace(double other_cast_bytes_ratio) {
  std::vector<Ev> ev;
  double t = 0;
  for (int step = 0; step < 3; ++step) {
    const double start = t;
    const std::size_t marker = ev.size();
    ev.push_back({"user_annotation", "ProfilerStep#" + std::to_string(step + 1), t, 0});
    for (int layer = 0; layer < 4; ++layer) {
      const long long rows = static_cast<long long>(8192 * other_cast_bytes_ratio);
      Ev cast{"cpu_op", "aten::to", t + 1, 100};
      cast.shapes = "[[" + std::to_string(rows) + ", 1, 576], [], [], [], []]";
      cast.types = "[\"c10::Float8_e4m3fn\", \"Scalar\", \"Scalar\", \"Scalar\", \"\"]";
      ev.push_back(cast);
      Ev copy{"cpu_op", "aten::copy_", t + 2, 98};
      copy.shapes =
          "[[" + std::to_string(rows) + ", 1, 576], [" + std::to_string(rows) + ", 1, 576], []]";
      copy.types = "[\"c10::BFloat16\", \"c10::Float8_e4m3fn\", \"Scalar\"]";
      ev.push_back(copy);
      Ev att{"cpu_op", "fp8mla::mla_decode", t + 110, 20};
      att.shapes =
          "[[], [4, 8, 512], [4, 8, 64], [8192, 1, 512], [8192, 1, 64], [4, 8, 512], [], [], []]";
      att.types =
          "[\"Scalar\", \"c10::BFloat16\", \"c10::BFloat16\", \"c10::BFloat16\", "
          "\"c10::BFloat16\", \"c10::BFloat16\", \"\", \"Scalar\", \"Scalar\"]";
      ev.push_back(att);
      t += 140;
    }
    t += 30;
    ev[marker].dur = t - start - 1;
  }
  return testing::trace_json(ev);
}

TEST(AuditKvCast, CpuCastTheSizeOfTheCacheIsTheKv) {
  const Result r = audit_text(cpu_trace(1.0));
  ASSERT_TRUE(r.kv.found);
  EXPECT_FALSE(r.timeline.gpu);
  EXPECT_EQ(r.kv.kind, "pool");
  EXPECT_DOUBLE_EQ(r.kv.bytes_each, 8192.0 * 576 * 3);  // fp8 read + bf16 written
  EXPECT_DOUBLE_EQ(r.kv.out_bytes_each, 8192.0 * 576 * 2);
  EXPECT_NEAR(r.kv.kv_ratio, 576.0 / 512, 1e-12);
  EXPECT_DOUBLE_EQ(r.kv.save_bytes_per_step, 4 * 8192.0 * 576 * 3);
}

TEST(AuditKvCast, CpuCastMuchSmallerThanTheCacheIsNot) {
  const Result r = audit_text(cpu_trace(0.25));  // writes 0.28x what attention is handed
  EXPECT_FALSE(r.kv.found);
}

}  // namespace
}  // namespace fp8mla::audit
