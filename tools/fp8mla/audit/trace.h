// What `fp8mla audit` keeps of a PyTorch profiler trace: one compact record per event it can
// use (CPU ops, annotations, GPU kernels, memcpy/memset, CUDA runtime calls), with names
// interned. Python frames, flow arrows, instants and metadata are read past and dropped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace fp8mla::audit {

enum class EventKind : std::uint8_t {
  cpu_op,          // cat "cpu_op" (an ATen or custom operator)
  annotation,      // cat "user_annotation" (record_function ranges, ProfilerStep#N)
  gpu_annotation,  // cat "gpu_user_annotation" (the same ranges on the GPU timeline)
  kernel,          // cat "kernel"
  memcpy,          // cat "gpu_memcpy"
  memset,          // cat "gpu_memset"
  runtime,         // cat "cuda_runtime" / "cuda_driver" (cudaLaunchKernel, ...)
};

// A tensor argument of a CPU op as record_shapes saw it.
struct TensorArg {
  std::int64_t elements = -1;  // -1: not a tensor, or not recorded
  int dtype_bytes = 0;         // 0: unknown dtype
  bool fp8 = false;            // c10::Float8_* (or uint8 storage is not assumed to be fp8)
  std::uint64_t shape_hash = 0;
  double bytes() const {
    return elements >= 0 && dtype_bytes > 0 ? static_cast<double>(elements) * dtype_bytes : -1.0;
  }
};

struct TraceEvent {
  double ts = 0;           // start, microseconds (the trace's clock)
  double dur = 0;          // microseconds
  std::uint32_t name = 0;  // Trace::names index
  std::uint32_t lane = 0;  // Trace::lanes index (a CPU thread or a GPU stream)
  EventKind kind = EventKind::cpu_op;
  std::int64_t external_id = -1;  // links a kernel to the CPU op that launched it
  std::int64_t correlation = -1;  // links a kernel to its runtime call
  double bytes = -1;              // memcpy / memset: args "bytes"
  // record_shapes (CPU ops only): the first two tensor inputs, and the largest one.
  TensorArg in0, in1, largest;
  int out_dtype_bytes = 0;  // aten::to / _to_copy: the ScalarType argument's size, if given
  double end() const { return ts + dur; }
};

struct Lane {
  std::int64_t pid = 0;
  std::int64_t tid = 0;
  bool gpu = false;  // holds kernels / memcpys (a stream), not CPU ops
};

struct Trace {
  std::vector<TraceEvent> events;  // in file order
  std::vector<std::string> names;
  std::vector<Lane> lanes;
  // From the top level, when present.
  std::string device_name;  // deviceProperties[0].name
  bool record_shapes_flag = false;
  // Reading statistics.
  std::int64_t file_bytes = 0;  // on disk
  std::int64_t json_bytes = 0;  // after gzip
  bool gzip = false;
  std::int64_t events_seen = 0;  // every element of traceEvents, kept or not
  double read_seconds = 0;

  std::uint32_t intern(std::string_view name);
  std::uint32_t lane(std::int64_t pid, std::int64_t tid, bool gpu);
  const std::string& name_of(const TraceEvent& e) const { return names[e.name]; }
  bool has_gpu() const;
  bool has_shapes() const;

 private:
  struct NameHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, std::uint32_t, NameHash, std::equal_to<>> name_ids_;
  std::uint32_t last_lane_ = 0;
};

}  // namespace fp8mla::audit
