// A trace turned into decode steps of categorised work.
//
// Where the work is measured: a trace with GPU kernels is measured on the GPU (kernels,
// memcpys and memsets: a CPU op there only launches work); a CPU-only trace by its CPU ops,
// each counted once at its outermost categorised op (aten::to's time includes the
// aten::_to_copy and aten::copy_ inside it). A GPU item takes its category from its own name
// first (a GEMM or attention kernel says so), else from the CPU op that launched it (the
// elementwise kernel that aten::copy_ launches is a copy). Sizes come from record_shapes on
// the CPU ops; a GPU item gets those of the op that launched it.
//
// Steps: the profiler's ProfilerStep#N markers when the trace has them (a GPU item belongs to
// the step whose marker spans its launch); else the repeating pattern of attention calls (a
// step ends at the gaps between two attention calls that stand out as longer than the rest);
// else the whole trace is one step.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "tools/fp8mla/audit/category.h"
#include "tools/fp8mla/audit/trace.h"

namespace fp8mla::audit {

struct WorkItem {
  double start = 0, dur = 0;  // microseconds
  std::uint32_t lane = 0;     // CPU thread or GPU stream
  std::uint32_t name = 0;     // the op's or kernel's name (Trace::names)
  std::uint32_t op = 0;       // GPU: the CPU op that launched it (its name); CPU: = name
  Category category = Category::other;
  bool gather = false;         // picks rows by index (aten::index, a gather kernel)
  bool fp8_source = false;     // a cast that reads FP8 (its recorded input dtype or its name)
  double bytes = -1;           // bytes moved (a cast: read + written), -1 when not recorded
  double out_bytes = -1;       // a cast: bytes written
  double kv_bytes = -1;        // attention: its largest input (the KV cache it is given)
  std::uint64_t in_shape = 0;  // a cast: its input's shape (hash)
  double end() const { return start + dur; }
};

struct Step {
  std::string label;            // "ProfilerStep#3", or "step 3"
  double start = 0, end = 0;    // microseconds: the step's span (GPU: its items' span)
  double busy = 0;              // GPU: time some item runs (the union); CPU: = wall
  std::vector<WorkItem> items;  // by start time
  std::array<double, kCategories> by_category{};  // microseconds
  int attention_calls = 0;
  double wall() const { return end - start; }
};

struct Timeline {
  bool gpu = false;         // measured on the GPU (the trace has kernels)
  std::string step_source;  // how the steps were found, for the report
  std::vector<Step> steps;
};

Timeline build_timeline(const Trace& trace, const CategoryRules& rules);

}  // namespace fp8mla::audit
