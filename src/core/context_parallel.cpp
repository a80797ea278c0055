#include "fp8mla/context_parallel.h"

#include <algorithm>

#include "src/core/check.h"

namespace fp8mla {

using detail::require;

void shard_context(const Problem& full, int rank, int world, ContextShard& shard) {
  require(world >= 1, "world", "must be >= 1, got ", world);
  require(rank >= 0 && rank < world, "rank", rank, " is outside [0, ", world, ")");
  require(full.topk == 0, "problem.topk",
          "sparse problems index global slots; shard them by filtering the indices");
  require(full.page_size >= 1, "problem.page_size", "must be >= 1, got ", full.page_size);
  const std::size_t batch = full.qo_indptr.empty() ? 0 : full.qo_indptr.size() - 1;
  require(full.kv_indptr.size() == batch + 1, "problem.kv_indptr", "expected ", batch + 1,
          " entries, got ", full.kv_indptr.size());
  require(full.kv_len.size() == batch, "problem.kv_len", "expected ", batch, " entries, got ",
          full.kv_len.size());
  shard.qo_indptr.assign(full.qo_indptr.begin(), full.qo_indptr.end());
  shard.kv_indptr.assign(1, 0);
  shard.kv_indices.clear();
  shard.kv_len.clear();
  for (std::size_t r = 0; r < batch; ++r) {
    const std::int64_t qo = full.qo_indptr[r + 1] - full.qo_indptr[r];
    require(!full.causal || qo <= 1, detail::msg("problem.qo_indptr[", r + 1, "]"),
            "context-parallel causal decode supports qo_len <= 1, got ", qo);
    const std::int64_t len = full.kv_len[r], ps = full.page_size;
    const std::int64_t listed = full.kv_indptr[r + 1] - full.kv_indptr[r];
    const std::int64_t pages = (len + ps - 1) / ps;
    require(len >= 0 && pages <= listed, detail::msg("problem.kv_len[", r, "]"), len,
            " tokens need ", pages, " pages but ", listed, " are listed");
    const std::int64_t per = (pages + world - 1) / world;
    const std::int64_t first = std::min(pages, rank * per), last = std::min(pages, first + per);
    for (std::int64_t p = first; p < last; ++p)
      shard.kv_indices.push_back(full.kv_indices[full.kv_indptr[r] + p]);
    shard.kv_indptr.push_back(static_cast<std::int32_t>(shard.kv_indices.size()));
    shard.kv_len.push_back(static_cast<std::int32_t>(
        std::max<std::int64_t>(0, std::min(len, last * ps) - first * ps)));
  }
  shard.problem = full;
  shard.problem.qo_indptr = shard.qo_indptr;
  shard.problem.kv_indptr = shard.kv_indptr;
  shard.problem.kv_indices = shard.kv_indices;
  shard.problem.kv_len = shard.kv_len;
}

}  // namespace fp8mla
