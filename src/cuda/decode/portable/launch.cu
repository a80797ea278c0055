// kernel_for(): the portable instantiation for a format, row tiles and score products.
#include "src/cuda/decode/portable/launch.h"

#include "fp8mla/error.h"

namespace fp8mla::detail::portable {

namespace {

template <KvFormat F, Scores S>
KernelInfo by_rows(int row_tiles) {
  switch (row_tiles) {
    case 1:
      return kernel_info<F, 1, S>();
    case 2:
      return kernel_info<F, 2, S>();
    default:
      return kernel_info<F, 4, S>();
  }
}

}  // namespace

KernelInfo kernel_for(KvFormat format, int row_tiles, Scores scores) {
  if (scores == Scores::e4m3) {
    if (format != KvFormat::fp8_e4m3)
      throw Error(ErrorCode::unsupported, "kernel_family",
                  "fp8 score products need an fp8_e4m3 cache");
    return by_rows<KvFormat::fp8_e4m3, Scores::e4m3>(row_tiles);
  }
  if (scores == Scores::bf16x2) {
    if (format != KvFormat::bf16)
      throw Error(ErrorCode::unsupported, "kernel_family",
                  "fp16-exact products (two bf16 terms) need a bf16 cache");
    return by_rows<KvFormat::bf16, Scores::bf16x2>(row_tiles);
  }
  switch (format) {
    case KvFormat::bf16:
      return by_rows<KvFormat::bf16, Scores::f16>(row_tiles);
    case KvFormat::fp8_e4m3:
      return by_rows<KvFormat::fp8_e4m3, Scores::f16>(row_tiles);
    default:
      return by_rows<KvFormat::fp8_e4m3_block, Scores::f16>(row_tiles);
  }
}

}  // namespace fp8mla::detail::portable
