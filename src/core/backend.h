// Internal: the entry points each backend provides to the host layer. src/cpu implements the
// cpu_* ones; src/cuda implements the cuda_* ones, or src/core/no_cuda.cpp throws
// Error(unsupported) for them when the library is built without CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "fp8mla/attention.h"
#include "fp8mla/cache.h"
#include "src/core/plan_state.h"

namespace fp8mla::detail {

// ---- CPU backend (src/cpu) ----
// Attention for a validated plan and validated arguments. cpu_reference: float64 accumulation,
// one thread, straight from the definition (ignores the partition). cpu_run: the threaded fast
// path: runs the planned tiles (float32 accumulation), then merges split requests. Both only
// read the plan (cpu_run keeps its split-KV workspace per run), so runs of one plan may overlap.
void cpu_reference(const PlanState& plan, const RunArgs& args);
void cpu_run(const PlanState& plan, const RunArgs& args);
void cpu_merge_states(const TensorView& v, const TensorView& s, const TensorView& v_out,
                      const TensorView& s_out);

// ---- CUDA backend (src/cuda) ----
bool cuda_built() noexcept;        // false in a build without CUDA
int cuda_device_count() noexcept;  // 0 when none is visible (or not built)
// Empty when a CUDA device is visible; otherwise why not, in words for a person (no CUDA
// backend in this build, no NVIDIA driver or one too old for this build's runtime, no device).
std::string cuda_unavailable_reason();
int cuda_sm_count(int device_id);  // multiprocessors of the device
// The device's compute capability as 10 * major + minor (90 for sm_90).
int cuda_compute_capability(int device_id);
// CTAs of `family`'s kernel for plan.kv_format and tiles of up to plan.kernel_rows rows that
// fit one SM.
int cuda_ctas_per_sm(const PlanState& plan, KernelFamily family);
void* cuda_malloc(std::size_t bytes, int device_id);  // zero-filled; throws out_of_memory
void cuda_free(void* ptr) noexcept;
void cuda_copy_to_host(void* dst, const void* src, std::size_t bytes);    // synchronous
void cuda_copy_to_device(void* dst, const void* src, std::size_t bytes);  // synchronous
void cuda_synchronize(int device_id);  // waits for all work on the device
void cuda_set_device(int device_id);   // the calling thread's current device
int cuda_current_device() noexcept;    // the calling thread's current device; -1 when none
// Makes `device_id` current again unless it already is, or its primary context is not active
// (CUDA 12+ creates one on cudaSetDevice: ~0.5 GB on a GPU the process never used), as torch's
// MaybeSetDevice does. Errors are ignored (-1 is a no-op).
void cuda_restore_device(int device_id) noexcept;
// The first entry of a device page table (i32 [n], contiguous) outside [0, num_pages), and its
// value; {-1, 0} when every entry is inside. Synchronous.
struct PageOutside {
  std::int64_t index;
  std::int32_t page;
};
PageOutside cuda_find_page_outside(const TensorView& pages, std::int64_t num_pages);

// The public CUDA entry points (plan, replan, run, merge_states, the cache, context parallelism)
// select their device with cudaSetDevice inside; this puts the caller's current device back
// when they return or throw, so a thread that drives several GPUs (torch.cuda.current_device()
// reads the same setting) is not moved to another one. Inactive (no CUDA call) unless `cuda`.
class CurrentDeviceGuard {
 public:
  explicit CurrentDeviceGuard(bool cuda) noexcept : saved_(cuda ? cuda_current_device() : -1) {}
  ~CurrentDeviceGuard() {
    if (saved_ >= 0) cuda_restore_device(saved_);
  }
  CurrentDeviceGuard(const CurrentDeviceGuard&) = delete;
  CurrentDeviceGuard& operator=(const CurrentDeviceGuard&) = delete;

 private:
  int saved_;
};
// Device memory owned by a scope (cuda_malloc: zero-filled; cuda_free on destruction), for the
// library's and the benches' buffers that are not a plan's.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(std::size_t bytes, int device_id) : ptr_(cuda_malloc(bytes, device_id)) {}
  ~DeviceMemory() { cuda_free(ptr_); }
  DeviceMemory(DeviceMemory&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)) {}
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    return *this;
  }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

// Uploads the plan's arrays into plan.cuda (allocating it, or reusing it in graph mode: then it
// first waits for the device to be idle, and the copies complete before it returns).
void cuda_upload_plan(PlanState& plan);
// Graph mode's stream-ordered upload into the existing plan.cuda: the arrays go through the
// plan's pinned staging and copies enqueued on `stream`; no device allocation or wait (the host
// waits only for a staging slot still being copied from by the upload two calls back).
void cuda_upload_plan_async(PlanState& plan, void* stream);
void cuda_run(PlanState& plan, const RunArgs& args);
void cuda_merge_states(const TensorView& v, const TensorView& s, const TensorView& v_out,
                       const TensorView& s_out, void* stream);
// Quantizing append into a device cache: storage is u8 [num_pages, page_size, token_bytes].
void cuda_append(const CacheConfig& config, void* storage, const TensorView& slots,
                 const TensorView& ckv, const TensorView& kpe, void* stream);
// fill_page_table on the device, for checked arguments: pages[r] = request r's page count
// (their sum > 0), enqueued on `stream`.
void cuda_fill_page_table(const TensorView& tokens, const TensorView& rows,
                          std::span<const std::int32_t> pages, int page_size,
                          const TensorView& table, void* stream);

}  // namespace fp8mla::detail
