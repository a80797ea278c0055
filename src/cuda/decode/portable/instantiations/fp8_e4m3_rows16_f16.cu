#include "src/cuda/decode/portable/kernel.cuh"
#include "src/cuda/decode/portable/launch.h"

namespace fp8mla::detail::portable {

template <>
KernelInfo kernel_info<KvFormat::fp8_e4m3, 1, Scores::f16>() {
  using C = Config<KvFormat::fp8_e4m3, 1, Scores::f16>;
  return {&portable_decode_kernel<KvFormat::fp8_e4m3, 1, Scores::f16>, C::bytes(1), C::bytes(2)};
}

}  // namespace fp8mla::detail::portable
