// Internal: the max of the merges, which keeps NaN.
#pragma once

namespace fp8mla::detail::merge {

// max that keeps NaN: a split whose rows saw a NaN in the cache has lse NaN, and the merged row
// must stay NaN as in the reference (fmaxf would drop it and return o = 0, lse = -inf).
__device__ __forceinline__ float nan_max(float a, float b) {
  return a != a ? a : b != b ? b : fmaxf(a, b);
}

}  // namespace fp8mla::detail::merge
