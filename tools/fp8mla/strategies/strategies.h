// The two slow strategies of the story, the demo's and the bench's baselines (not library API).
// Both produce a bf16 cache that the ordinary bf16 attention path then reads.
// Views may be on the CPU or on a CUDA device (all on the same one); CUDA work runs on `stream`.
#pragma once

#include <cstdint>
#include <span>

#include "fp8mla/cache.h"

namespace fp8mla::strategies {

// "Cast the whole pool": decode every token of `src` (any format) into `dst`, a bf16 cache view
// with the same num_pages and page_size. Moves token_bytes(src) + 1152 bytes per pool token.
void cast_pool_to_bf16(const KvCacheView& src, const KvCacheView& dst, void* stream = nullptr);

// "Gather then cast": copy the pages listed in `pages` (page ids of src; i32 on the views'
// device, n entries) into dst pages 0..n-1, decoded to bf16. The caller then plans with
// kv_indices = 0..n-1 (in the same order). Moves (token_bytes(src) + 1152) bytes per gathered
// token.
void gather_cast_to_bf16(const KvCacheView& src, const std::int32_t* pages, std::int64_t n,
                         const KvCacheView& dst, void* stream = nullptr);

}  // namespace fp8mla::strategies
