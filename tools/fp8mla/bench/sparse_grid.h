// The sparse top-k grid of `fp8mla bench --sparse` (DeepSeek sparse attention: each query token
// reads only the top-k cache slots an indexer picked): its cases, the top-k rows of a timed call
// and each case's floors. Host code, shared by the GPU runner (sparse_bench.cu) and its test.
#pragma once

#include <cstdint>
#include <vector>

#include "fp8mla/format.h"

namespace fp8mla::bench {

// The grid's axes (issue: GLM-5 and DeepSeek-V3.2 read the top 2,048 slots; 512 for a shorter
// budget). Heads are per GPU after tensor parallelism (GLM-5 at TP8: 8); a request has one query
// token, or two (MTP: the next-token draft verified in the same step), each with its own row.
inline constexpr int kSparseTopks[] = {2048, 512};
inline constexpr int kSparseHeads[] = {8, 16, 64, 128};
inline constexpr int kSparseBatches[] = {1, 16, 64, 128};
inline constexpr int kSparseQoLens[] = {1, 2};
inline constexpr int kSparsePages[] = {1, 64};
inline constexpr KvFormat kSparseFormats[] = {KvFormat::fp8_e4m3_block, KvFormat::fp8_e4m3};
// --quick: (topk, heads, batch) as bench/peers' quick sparse grid, at qo 1 and 2, both formats,
// pages of 64 tokens (FlashMLA's sparse layout).
struct SparseTriple {
  int topk, heads, batch;
};
inline constexpr SparseTriple kQuickSparse[] = {
    {2048, 8, 128}, {2048, 64, 128}, {2048, 128, 128}, {2048, 16, 1}, {512, 16, 64}};
inline constexpr int kQuickSparsePages[] = {64};
// The top-k slots are drawn over the whole pool, which must hold at least this many tokens (a
// long context's worth, far larger than L2).
inline constexpr std::int64_t kSparseMinPoolTokens = std::int64_t{1} << 20;

struct SparseCase {
  int topk = 0, heads = 0, batch = 0, qo_len = 1, page_size = 1;
  KvFormat format = KvFormat::fp8_e4m3_block;
  // Query tokens of a call: one top-k row each.
  std::int64_t rows() const { return std::int64_t{batch} * qo_len; }
};

// The axes a command line gives; an empty list takes the grid's default above.
struct SparseGridAxes {
  bool quick = false;
  std::vector<int> topks, heads, batches, qo_lens, page_sizes;
  std::vector<KvFormat> formats;
};

// The cases, format outermost, then page size, top-k, heads, batch and query tokens. --quick
// without --topk, --heads or --batch runs kQuickSparse's triples; given any of them, the cross
// product of the given lists and the full defaults of the others.
std::vector<SparseCase> sparse_grid(const SparseGridAxes& axes);

// -1 entries of each top-k row: k / 20 (5%, bench/peers' default share), at random positions of
// the row; the other entries are valid and distinct.
int sparse_invalid_per_row(int topk);
inline int sparse_valid_per_row(int topk) {
  return topk - sparse_invalid_per_row(topk);
}

// The floor's bytes of one call: every listed (not -1) slot of every row once, in the format's
// bytes a token (656 for fp8_e4m3_block, 576 for fp8_e4m3, 1152 for bf16).
double sparse_floor_bytes(const SparseCase& c);
// The flops of one call: each listed slot of each row, each head, 2 x 576 (scores) + 2 x 512
// (P V).
double sparse_flops(const SparseCase& c);

// One call's top-k rows: `rows` x `topk` int32 global slots (page * page_size + offset) drawn
// uniformly over [0, pool_tokens), distinct within a row, with exactly sparse_invalid_per_row
// entries -1 at random positions of each row; the same for the same arguments. Throws
// Error(invalid_argument) naming pool_tokens when it holds fewer than topk tokens or more than
// int32 slots address.
std::vector<std::int32_t> draw_sparse_rows(std::int64_t rows, int topk, std::int64_t pool_tokens,
                                           std::uint64_t seed);

}  // namespace fp8mla::bench
