// CUDA implementations of the strategies (strategies_cuda.cu). Same contracts as strategies.h;
// the dispatcher in strategies.cpp calls them for device views.
#pragma once

#include <cstdint>

#include "fp8mla/cache.h"

namespace fp8mla::strategies {

void cuda_cast_pool_to_bf16(const KvCacheView& src, const KvCacheView& dst, void* stream);
void cuda_gather_cast_to_bf16(const KvCacheView& src, const std::int32_t* pages, std::int64_t n,
                              const KvCacheView& dst, void* stream);

}  // namespace fp8mla::strategies
