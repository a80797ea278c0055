// `fp8mla bench`'s GPU grid in a build without CUDA: it cannot run, so it says why.
#include "bench/gpu_bench.h"
#include "fp8mla/error.h"

namespace fp8mla::bench {

int run_gpu_bench(const GpuBenchOptions&) {
  throw Error(ErrorCode::unsupported, "bench",
              "the GPU benchmark needs a build with CUDA (configure with -DFP8MLA_CUDA=ON) and a "
              "CUDA device");
}

}  // namespace fp8mla::bench
