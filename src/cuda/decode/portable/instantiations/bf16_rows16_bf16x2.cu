#include "src/cuda/decode/portable/kernel.cuh"
#include "src/cuda/decode/portable/launch.h"

namespace fp8mla::detail::portable {

template <>
KernelInfo kernel_info<KvFormat::bf16, 1, Scores::bf16x2>() {
  using C = Config<KvFormat::bf16, 1, Scores::bf16x2>;
  return {&portable_decode_kernel<KvFormat::bf16, 1, Scores::bf16x2>, C::bytes(1), C::bytes(2)};
}

}  // namespace fp8mla::detail::portable
