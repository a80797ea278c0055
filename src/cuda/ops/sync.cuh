// Barriers and launch order: named barriers, warpgroup register reallocation, programmatic
// dependent launch (PTX, named once).
#pragma once

namespace fp8mla::detail {

// Warpgroup register reallocation (sm_90a, all 128 threads of a warpgroup): a producer
// warpgroup gives registers back, consumers take them; the CTA's pool is the launch's count
// (__launch_bounds__) times its threads, so the counts must add up to no more than that.
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
// A barrier of `threads` threads (whole warps) on hardware barrier `id` (0 is __syncthreads').
// barrier.sync, not bar.sync: the warps may reach it from different instructions (role branches
// of a warp-specialized kernel); bar.sync promises one instruction (synccheck flags it).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// A barrier of kCount threads on hardware barrier kId that every warp reaches from one
// instruction (bar.sync, aligned): ptxas then keeps the warps converged across it (barrier.sync
// costs bf16_gather 9 registers and a spill).
template <int kId, int kCount>
__device__ __forceinline__ void bar_sync_aligned() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kCount) : "memory");
}

// Programmatic dependent launch: the split-KV merge is launched as a dependent of the decode
// kernel, so its launch overlaps the decode's last wave. Every decode CTA lets it start once all
// of them are running (launch_dependents); the merge waits for the decode grid to finish and its
// writes to be visible (wait) before it reads a partial. No-ops without the launch attribute,
// and compiled to nothing before sm_90 (no PDL there: launches run in stream order).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

}  // namespace fp8mla::detail
