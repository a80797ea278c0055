// The CUDA entry points of a build without CUDA: every one reports Error(unsupported).
#include "fp8mla/error.h"
#include "src/core/backend.h"

namespace fp8mla::detail {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw Error(ErrorCode::unsupported, what,
              "this build of fp8mla has no CUDA backend (configure with -DFP8MLA_CUDA=ON)");
}
}  // namespace

void destroy_cuda_buffers(CudaPlanBuffers*) noexcept {}
bool cuda_built() noexcept {
  return false;
}
int cuda_device_count() noexcept {
  return 0;
}
std::string cuda_unavailable_reason() {
  return "this build of fp8mla has no CUDA backend (configure with -DFP8MLA_CUDA=ON)";
}
int cuda_sm_count(int) {
  no_cuda("device");
}
int cuda_compute_capability(int) {
  no_cuda("device");
}
int cuda_ctas_per_sm(const PlanState&, KernelFamily) {
  no_cuda("problem.device");
}
void* cuda_malloc(std::size_t, int) {
  no_cuda("device");
}
void cuda_free(void*) noexcept {}
void cuda_copy_to_host(void*, const void*, std::size_t) {
  no_cuda("device");
}
void cuda_copy_to_device(void*, const void*, std::size_t) {
  no_cuda("device");
}
void cuda_synchronize(int) {
  no_cuda("device");
}
void cuda_set_device(int) {
  no_cuda("device_id");
}
void cuda_upload_plan(PlanState&) {
  no_cuda("problem.device");
}
void cuda_upload_plan_async(PlanState&, void*) {
  no_cuda("problem.device");
}
void cuda_run(PlanState&, const RunArgs&) {
  no_cuda("plan.device");
}
void cuda_merge_states(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                       void*) {
  no_cuda("v.device");
}
void cuda_append(const CacheConfig&, void*, const TensorView&, const TensorView&, const TensorView&,
                 void*) {
  no_cuda("config.device");
}
void cuda_fill_page_table(const TensorView&, const TensorView&, std::span<const std::int32_t>, int,
                          const TensorView&, void*) {
  no_cuda("tokens.device");
}
int cuda_current_device() noexcept {
  return -1;
}
void cuda_restore_device(int) noexcept {}
PageOutside cuda_find_page_outside(const TensorView&, std::int64_t) {
  no_cuda("device_kv_indices");
}

}  // namespace fp8mla::detail
