// The sparse top-k grid of `fp8mla bench --sparse` (sparse_grid.h).
#include "tools/fp8mla/bench/sparse_grid.h"

#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <unordered_set>

#include "fp8mla/error.h"

namespace fp8mla::bench {
namespace {

template <class T, std::size_t N>
std::vector<T> or_default(const std::vector<T>& given, const T (&fallback)[N]) {
  return given.empty() ? std::vector<T>(fallback, fallback + N) : given;
}

}  // namespace

std::vector<SparseCase> sparse_grid(const SparseGridAxes& a) {
  std::vector<SparseTriple> triples;
  if (a.quick && a.topks.empty() && a.heads.empty() && a.batches.empty()) {
    triples.assign(std::begin(kQuickSparse), std::end(kQuickSparse));
  } else {
    for (const int k : or_default(a.topks, kSparseTopks))
      for (const int h : or_default(a.heads, kSparseHeads))
        for (const int b : or_default(a.batches, kSparseBatches)) triples.push_back({k, h, b});
  }
  const std::vector<int> pages = a.quick ? or_default(a.page_sizes, kQuickSparsePages)
                                         : or_default(a.page_sizes, kSparsePages);
  std::vector<SparseCase> cases;
  for (const KvFormat f : or_default(a.formats, kSparseFormats))
    for (const int ps : pages)
      for (const SparseTriple& t : triples)
        for (const int qo : or_default(a.qo_lens, kSparseQoLens)) {
          SparseCase c;
          c.topk = t.topk;
          c.heads = t.heads;
          c.batch = t.batch;
          c.qo_len = qo;
          c.page_size = ps;
          c.format = f;
          cases.push_back(c);
        }
  return cases;
}

int sparse_invalid_per_row(int topk) {
  return topk / 20;
}

double sparse_floor_bytes(const SparseCase& c) {
  return static_cast<double>(c.rows()) * sparse_valid_per_row(c.topk) *
         static_cast<double>(token_bytes(c.format));
}

double sparse_flops(const SparseCase& c) {
  return static_cast<double>(c.rows()) * sparse_valid_per_row(c.topk) * c.heads * 2.0 * (576 + 512);
}

std::vector<std::int32_t> draw_sparse_rows(std::int64_t rows, int topk, std::int64_t pool_tokens,
                                           std::uint64_t seed) {
  if (pool_tokens < topk || pool_tokens > std::numeric_limits<std::int32_t>::max()) {
    throw Error(ErrorCode::invalid_argument, "pool_tokens",
                std::to_string(pool_tokens) + " tokens: the top-k rows need between topk (" +
                    std::to_string(topk) + ") and 2^31 - 1 (int32 slots)");
  }
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int32_t> slot(0, static_cast<std::int32_t>(pool_tokens - 1));
  const int invalid = sparse_invalid_per_row(topk);
  std::vector<std::int32_t> out(static_cast<std::size_t>(rows) * topk);
  std::vector<int> positions(static_cast<std::size_t>(topk));
  std::unordered_set<std::int32_t> seen;
  seen.reserve(static_cast<std::size_t>(2 * topk));
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int32_t* row = out.data() + r * topk;
    seen.clear();
    for (int k = 0; k < topk; ++k) {
      std::int32_t s = slot(rng);
      while (!seen.insert(s).second) s = slot(rng);
      row[k] = s;
    }
    // The -1 positions: the first `invalid` of a partial Fisher-Yates shuffle of 0..topk-1.
    std::iota(positions.begin(), positions.end(), 0);
    for (int i = 0; i < invalid; ++i) {
      const int j = std::uniform_int_distribution<int>(i, topk - 1)(rng);
      std::swap(positions[static_cast<std::size_t>(i)], positions[static_cast<std::size_t>(j)]);
      row[positions[static_cast<std::size_t>(i)]] = -1;
    }
  }
  return out;
}

}  // namespace fp8mla::bench
