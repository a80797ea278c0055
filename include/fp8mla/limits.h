// fp8mla: the bounds on the work and memory one call may ask for.
//
// Small inputs must not make the library allocate gigabytes or run for minutes: a two-entry
// qo_indptr can name 2^31 query tokens, an option a million SMs, a stride-0 view a tensor of
// 2^62 rows. Each bound below is checked before the work or memory it limits, and breaking one
// throws Error(invalid_argument) naming the argument, its value and the bound. They sit far
// above what a decode batch needs (a 4096-request step of 8 query tokens at 128 heads is
// 2^22 rows); what they buy is that no call asks for more than the stated amounts.
#pragma once

#include <cstdint>

namespace fp8mla {

// Rows (query tokens x heads) of a plan (total_q x num_heads, graph mode also max_total_q x
// num_heads) and of a merge_states() call: the bf16 output of a plan at the bound is 4 GiB.
inline constexpr std::int64_t kMaxRows = std::int64_t{1} << 22;
// A plan's tiles are at most one a row plus one a wave slot, kMaxRows + kMaxWaveTiles records.

// PlanOptions::sm_count (parallel units the partition aims at) and ctas_per_sm (tiles a unit
// runs at once): at most 4096 and 32 (Hopper keeps at most 32 CTAs on an SM), and their product,
// the tiles of one wave, at most kMaxWaveTiles. The split-KV workspace a plan (and a CPU run)
// holds is below 2 x 64 rows x kMaxWaveTiles = 524,288 partial rows (1 GiB of float32).
inline constexpr int kMaxSmCount = 4096;
inline constexpr int kMaxCtasPerSm = 32;
inline constexpr std::int64_t kMaxWaveTiles = 4096;

// PlanOptions::num_threads: CPU backend threads a run starts at most.
inline constexpr int kMaxThreads = 1024;

// Problem::sm_scale: at most 2^16. Real models scale by 1/sqrt(192) ~ 0.072 (YaRN's factors keep
// it below 1); a scale near float's range turns every score into inf and every output into NaN.
// run() also needs sm_scale x kv scale x log2(e) to be a finite float (the CUDA kernels fold
// them into one factor).
inline constexpr float kMaxSmScale = 65536.0f;

// Sparse problems: total_q x topk <= 2^31 - 1 index entries (they are addressed with int32).
inline constexpr std::int64_t kMaxSparseEntries = (std::int64_t{1} << 31) - 1;

// merge_states(): num_states <= 4096, D <= 65536, and rows x num_states x D <= 2^36 values read
// (a view with stride 0 describes any number of them in a few bytes). Rows <= kMaxRows.
inline constexpr std::int64_t kMaxMergeStates = 4096;
inline constexpr std::int64_t kMaxMergeDim = 65536;
inline constexpr std::int64_t kMaxMergeValues = std::int64_t{1} << 36;

}  // namespace fp8mla
