// Reproducer (session 28, not built by CMake): racecheck reports WAR hazards between reads and
// writes that `bar.sync 1, 256` orders, once the kernel also has the fp8 gather kernel's
// mbarrier release and warpgroup barriers (mode 15). Output: h200_v69_racecheck_repro.txt.
#include <cstdint>
#include <cstdio>
template <int kId, int kCount>
__device__ __forceinline__ void bar_sync_aligned() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kCount) : "memory");
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ unsigned sa(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(void* bar, unsigned n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(sa(bar)), "r"(n));
}
__device__ __forceinline__ void mbar_arrive(void* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(sa(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(void* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}\n" ::"r"(sa(bar)),
      "r"(parity)
      : "memory");
}
// kMode bits: 1 producer warps join barrier 0 (384) before exiting; 2 math threads release
// each block on an mbarrier that a producer waits on; 4 the warpgroups' barriers 3/4 in the loop;
// 8 warpgroup 1 has no block (a one-block tile: it reaches barrier 1 first).
template <int kMode>
__global__ void k(float* out) {
  __shared__ float buf[4096];
  __shared__ alignas(8) std::uint64_t rel[2];
  const int warp = threadIdx.x / 32;
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0), tid = threadIdx.x % 128;
  constexpr int kBlocks = 8;
  if (threadIdx.x == 0) {
    mbar_init(&rel[0], 128);
    mbar_init(&rel[1], 128);
  }
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) buf[i] = i;
  __syncthreads();
  if (warp >= 8) {
    if (kMode & 1) named_barrier_sync(0, 384);
    if (kMode & 2)
      for (int blk = 0; blk < ((kMode & 8) ? 1 : kBlocks); ++blk)
        mbar_wait(&rel[blk % 2], (blk / 2) % 2);
    return;
  }
  if (kMode & 1) named_barrier_sync(0, 384);
  float acc = 0;
  for (int blk = wg; blk < ((kMode & 8) ? 1 : kBlocks); blk += 2) {
    if (kMode & 4) {
      if (wg == 0)
        bar_sync_aligned<3, 128>();
      else
        bar_sync_aligned<4, 128>();
    }
    if ((kMode & 8) && wg == 0)
      for (int s = 0; s < 20000; ++s) acc = acc * 0.999f + 1e-3f;
    for (int j = 0; j < 32; ++j) acc += buf[(tid * 32 + j + 4 * blk) % 4096];
    if (kMode & 2) mbar_arrive(&rel[blk % 2]);
  }
  bar_sync_aligned<1, 256>();
  if (wg == 1)
    for (int j = 0; j < 32; ++j) buf[tid * 32 + j] = j;
  bar_sync_aligned<1, 256>();
  if (wg == 1) return;
  out[blockIdx.x * 128 + tid] = acc + buf[tid];
}
template <int kMode>
void launch(float* out) {
  k<kMode><<<2, 384>>>(out);
  printf("mode %d: %s\n", kMode, cudaGetErrorString(cudaDeviceSynchronize()));
}
int main(int argc, char** argv) {
  float* out;
  cudaMalloc(&out, 2 * 128 * sizeof(float));
  switch (argc > 1 ? atoi(argv[1]) : 0) {
    case 0:
      launch<0>(out);
      break;
    case 1:
      launch<1>(out);
      break;
    case 2:
      launch<2>(out);
      break;
    case 3:
      launch<3>(out);
      break;
    case 4:
      launch<4>(out);
      break;
    case 7:
      launch<7>(out);
      break;
    case 8:
      launch<8>(out);
      break;
    case 9:
      launch<9>(out);
      break;
    case 15:
      launch<15>(out);
      break;
  }
  return 0;
}
