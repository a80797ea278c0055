// `fp8mla bench`'s GPU parts in a build without CUDA: they cannot run, so they say why.
#include "tools/fp8mla/bench/gpu_bench.h"
#include "fp8mla/error.h"

namespace fp8mla::bench {

int run_gpu_bench(const GpuBenchOptions&) {
  throw Error(ErrorCode::unsupported, "--device cuda",
              "the GPU benchmark needs a build with CUDA (configure with -DFP8MLA_CUDA=ON) and a "
              "CUDA device");
}

int run_cp_bench(const CpBenchOptions&) {
  throw Error(ErrorCode::unsupported, "--cp",
              "context parallelism needs a build with CUDA (configure with -DFP8MLA_CUDA=ON) and "
              "CUDA devices");
}

}  // namespace fp8mla::bench
