// Validation of a Problem and its PlanOptions (src/core/validate.h).
#include "src/core/validate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <utility>

#include "fp8mla/error.h"
#include "fp8mla/limits.h"
#include "src/core/backend.h"
#include "src/core/check.h"

namespace fp8mla::detail {
namespace {

using I32Span = std::span<const std::int32_t>;

constexpr std::int64_t kMaxInt32 = std::numeric_limits<std::int32_t>::max();

// For per-element loops: builds the message only when the check failed.
template <class... Parts>
[[noreturn]] void fail_at(const char* name, std::int64_t index, Parts&&... message) {
  throw Error(ErrorCode::invalid_argument, msg(name, "[", index, "]"),
              msg(std::forward<Parts>(message)...));
}

// An offsets array of `entries` values starting at 0 and never decreasing (so every entry is in
// [0, INT32_MAX] and differences of entries cannot overflow).
void check_indptr(I32Span a, const char* name, std::size_t entries) {
  require(a.size() == entries, name, "expected ", entries, " entries (batch + 1), got ", a.size());
  require(a[0] == 0, join(name, "[0]"), a[0], " must be 0");
  for (std::size_t i = 1; i < entries; ++i) {
    if (a[i] < a[i - 1]) {
      fail_at(name, static_cast<std::int64_t>(i), a[i], " is less than ", name, "[", i - 1,
              "] = ", a[i - 1], " (offsets must be non-decreasing)");
    }
  }
}

// Every page id in [0, num_pages). The common case, all inside, is one branch-free pass the
// compiler vectorises; the failing entry is then looked for.
void check_pages(I32Span pages, std::int64_t num_pages) {
  // One unsigned compare an id: negative ids wrap above every bound.
  const auto bound = static_cast<std::uint32_t>(std::min<std::int64_t>(num_pages, 1ll << 31));
  std::uint32_t outside = 0;
  for (const std::int32_t page : pages) outside |= static_cast<std::uint32_t>(page) >= bound;
  if (outside == 0) return;
  for (std::size_t i = 0; i < pages.size(); ++i) {
    if (pages[i] < 0 || pages[i] >= num_pages) {
      fail_at("kv_indices", static_cast<std::int64_t>(i), pages[i], " is outside the pool [0, ",
              num_pages, ")");
    }
  }
}

// A page table on the device (Problem::device_kv_indices): its view here; its ids last
// (validate_device_page_ids), once every host-side check has passed.
void check_device_pages(const Problem& p, std::int64_t entries) {
  require(p.device == DeviceKind::cuda, "device_kv_indices",
          "is for CUDA plans; a CPU plan takes kv_indices on the host");
  require(p.kv_indices.empty(), "kv_indices", "given with device_kv_indices: give one of the two");
  check_tensor(p.device_kv_indices, "device_kv_indices", {DType::i32}, {entries}, DeviceKind::cuda,
               p.device_id);
}

// A borrowed page table (Problem::borrowed_kv_indices): its view; its ids are read by run().
void check_borrowed_pages(const Problem& p, std::int64_t entries) {
  require(p.kv_indices.empty() && !p.device_kv_indices.defined(), "borrowed_kv_indices",
          "given with kv_indices or device_kv_indices: give one page table");
  check_tensor(p.borrowed_kv_indices, "borrowed_kv_indices", {DType::i32}, {-1}, p.device,
               p.device_id);
  require(p.borrowed_kv_indices.shape[0] >= entries, "borrowed_kv_indices", "has ",
          p.borrowed_kv_indices.shape[0], " entries, fewer than kv_indptr[", p.kv_indptr.size() - 1,
          "] = ", entries);
}

// rows = a x b <= kMaxRows, for a, b >= 0 that each fit in int32 (no overflow in int64).
template <class Argument>
void require_rows(std::int64_t a, std::int64_t b, const Argument& argument, const char* what) {
  require(a * b <= kMaxRows, argument, what, " = ", a, " x ", b, " = ", a * b,
          " rows (query tokens x heads) exceed the bound ", kMaxRows, " (fp8mla/limits.h)");
}

}  // namespace

void validate_options(const PlanOptions& o) {
  require(o.sm_count >= 0 && o.sm_count <= kMaxSmCount, "options.sm_count", o.sm_count,
          " is outside [0, ", kMaxSmCount, "] (0 = ask the device)");
  require(o.ctas_per_sm >= 0 && o.ctas_per_sm <= kMaxCtasPerSm, "options.ctas_per_sm",
          o.ctas_per_sm, " is outside [0, ", kMaxCtasPerSm, "] (0 = the kernel's residency)");
  require(o.min_chunk_tokens >= 1, "options.min_chunk_tokens", o.min_chunk_tokens, " must be >= 1");
  require(o.num_threads >= 0 && o.num_threads <= kMaxThreads, "options.num_threads", o.num_threads,
          " is outside [0, ", kMaxThreads, "] (0 = hardware_concurrency)");
  require(o.max_tile_rows >= 0 && o.max_tile_rows <= kMaxRowsPerTile, "options.max_tile_rows",
          o.max_tile_rows, " is outside [0, ", kMaxRowsPerTile, "] (0 = the planner's choice)");
  if (o.sm_count > 0 && o.ctas_per_sm > 0) validate_wave(o.sm_count, o.ctas_per_sm);
  if (!o.cuda_graph) return;
  require(o.max_batch > 0 && o.max_batch <= kMaxRows, "options.max_batch", o.max_batch,
          " is outside [1, ", kMaxRows, "] with cuda_graph");
  require(o.max_total_q > 0 && o.max_total_q <= kMaxRows, "options.max_total_q", o.max_total_q,
          " is outside [1, ", kMaxRows, "] with cuda_graph");
  require(o.max_qo_len >= 0 && o.max_qo_len <= kMaxRows, "options.max_qo_len", o.max_qo_len,
          " is outside [0, ", kMaxRows, "] (0 = max_total_q)");
  require(o.max_kv_indices > 0 && o.max_kv_indices <= kMaxInt32, "options.max_kv_indices",
          o.max_kv_indices, " is outside [1, ", kMaxInt32,
          "] with cuda_graph (kv_indptr is int32)");
}

void validate_wave(std::int64_t sm_count, std::int64_t ctas_per_sm) {
  require(sm_count * ctas_per_sm <= kMaxWaveTiles, "options.sm_count x options.ctas_per_sm",
          sm_count, " x ", ctas_per_sm, " = ", sm_count * ctas_per_sm,
          " tiles a wave exceed the bound ", kMaxWaveTiles, " (fp8mla/limits.h)");
}

void validate_scalars(const Problem& p) {
  require(p.num_heads >= 1 && p.num_heads <= kMaxHeads, "num_heads", p.num_heads,
          " is outside [1, ", kMaxHeads, "]");
  require(p.page_size >= 1 && p.page_size <= kMaxPageSize && (p.page_size & (p.page_size - 1)) == 0,
          "page_size", p.page_size, " must be a power of two in [1, ", kMaxPageSize, "]");
  require(p.num_pages >= 1 && p.num_pages <= kMaxInt32, "num_pages", p.num_pages,
          " is outside [1, ", kMaxInt32, "] (page ids are int32)");
  require(p.kv_format == KvFormat::bf16 || p.kv_format == KvFormat::fp8_e4m3 ||
              p.kv_format == KvFormat::fp8_e4m3_block,
          "kv_format", "unknown KvFormat value ", static_cast<int>(p.kv_format));
  require(p.q_dtype == DType::bf16 || p.q_dtype == DType::f16, "q_dtype",
          "expected bf16 or f16, got ", dtype_name(p.q_dtype));
  require(p.out_dtype == DType::bf16 || p.out_dtype == DType::f16, "out_dtype",
          "expected bf16 or f16, got ", dtype_name(p.out_dtype));
  require(std::isfinite(p.sm_scale) && p.sm_scale > 0.0f && p.sm_scale <= kMaxSmScale, "sm_scale",
          p.sm_scale, " must be finite and in (0, ", kMaxSmScale,
          "] (larger scales overflow float scores)");
  require(p.topk >= 0, "topk", p.topk, " must be >= 0 (0 = dense)");
  require(p.device == DeviceKind::cpu || p.device == DeviceKind::cuda, "device",
          "unknown DeviceKind value ", static_cast<int>(p.device));
  require(p.device_id >= 0, "device_id", p.device_id, " must be >= 0");
}

void validate_arrays(const Problem& p, const PlanOptions& o, bool page_ids) {
  require(!p.qo_indptr.empty(), "qo_indptr", "expected batch + 1 >= 1 entries, got 0");
  (void)narrow_i32(static_cast<std::int64_t>(p.qo_indptr.size()), "qo_indptr.size()");
  const std::size_t batch = p.qo_indptr.size() - 1;
  check_indptr(p.qo_indptr, "qo_indptr", batch + 1);
  const std::int64_t total_q = p.qo_indptr[batch];
  require_rows(total_q, p.num_heads, join("qo_indptr[", batch, "]"), "total_q x num_heads");
  const bool sparse = p.topk > 0;

  const bool device_pages = p.device_kv_indices.defined();
  const bool borrowed = p.borrowed_kv_indices.defined();
  const bool has_pages =
      !sparse || !p.kv_indptr.empty() || !p.kv_indices.empty() || device_pages || borrowed;
  if (has_pages) {
    check_indptr(p.kv_indptr, "kv_indptr", batch + 1);
    if (device_pages) {
      check_device_pages(p, p.kv_indptr[batch]);
    } else if (borrowed) {
      check_borrowed_pages(p, p.kv_indptr[batch]);
    } else {
      require(static_cast<std::size_t>(p.kv_indptr[batch]) == p.kv_indices.size(),
              join("kv_indptr[", batch, "]"), p.kv_indptr[batch],
              " must equal kv_indices.size() = ", p.kv_indices.size());
      if (page_ids) check_pages(p.kv_indices, p.num_pages);
    }
  }

  if (!sparse || !p.kv_len.empty()) {
    require(p.kv_len.size() == batch, "kv_len", "expected batch = ", batch, " entries, got ",
            p.kv_len.size());
    for (std::size_t r = 0; r < batch; ++r) {
      const std::int64_t len = p.kv_len[r];
      const auto ri = static_cast<std::int64_t>(r);
      if (len < 0) fail_at("kv_len", ri, len, " must be >= 0");
      if (has_pages) {
        const std::int64_t pages = std::int64_t{p.kv_indptr[r + 1]} - p.kv_indptr[r];
        if (len > pages * p.page_size) {
          fail_at("kv_len", ri, len, " exceeds the ", pages, " pages listed x page_size ",
                  p.page_size, " = ", pages * p.page_size, " tokens");
        }
      }
      if (!sparse && p.causal && p.causal_len.empty())
        require_causal_fits("kv_len", ri, len, std::int64_t{p.qo_indptr[r + 1]} - p.qo_indptr[r]);
    }
  }

  if (!p.causal_len.empty()) {
    require(!sparse && p.causal, "causal_len", "is for causal dense problems");
    require(p.causal_len.size() == batch, "causal_len", "expected batch = ", batch,
            " entries, got ", p.causal_len.size());
    for (std::size_t r = 0; r < batch; ++r) {
      if (p.causal_len[r] < p.kv_len[r]) {
        fail_at("causal_len", static_cast<std::int64_t>(r), p.causal_len[r],
                " is less than kv_len = ", p.kv_len[r]);
      }
    }
  }

  const std::int64_t entries = total_q * p.topk;  // < 2^62
  require(entries <= kMaxSparseEntries, "topk", "total_q x topk = ", total_q, " x ", p.topk, " = ",
          entries, " index entries exceed the bound ", kMaxSparseEntries, " (fp8mla/limits.h)");
  require(static_cast<std::int64_t>(p.sparse_indices.size()) == entries, "sparse_indices",
          "expected total_q x topk = ", total_q, " x ", p.topk, " = ", entries, " entries, got ",
          p.sparse_indices.size());
  const std::int64_t slots = p.num_pages * p.page_size;  // < 2^38
  for (std::size_t i = 0; i < p.sparse_indices.size(); ++i) {
    const std::int32_t slot = p.sparse_indices[i];
    if (slot != -1 && (slot < 0 || slot >= slots)) {
      const auto ii = static_cast<std::int64_t>(i);
      fail_at("sparse_indices", ii, slot, " is outside the pool slots [0, ", slots,
              ") and is not -1 (token ", ii / p.topk, ", position ", ii % p.topk, ")");
    }
  }

  if (!o.cuda_graph) return;
  require_rows(o.max_total_q, p.num_heads, "options.max_total_q", "max_total_q x num_heads");
  const std::int64_t sparse_capacity = std::int64_t{o.max_total_q} * p.topk;
  require(sparse_capacity <= kMaxSparseEntries, "options.max_total_q",
          "max_total_q x topk = ", o.max_total_q, " x ", p.topk, " = ", sparse_capacity,
          " index entries exceed the bound ", kMaxSparseEntries, " (fp8mla/limits.h)");
  require(static_cast<std::int64_t>(batch) <= o.max_batch, "qo_indptr", "batch ", batch,
          " exceeds the graph capacity options.max_batch = ", o.max_batch);
  require(total_q <= o.max_total_q, "qo_indptr", "total_q ", total_q,
          " exceeds the graph capacity options.max_total_q = ", o.max_total_q);
  // The page table's size (on the host or the device), checked before any upload.
  const std::int64_t page_table = device_pages || borrowed
                                      ? std::int64_t{p.kv_indptr[batch]}
                                      : static_cast<std::int64_t>(p.kv_indices.size());
  require(page_table <= o.max_kv_indices,
          device_pages ? "device_kv_indices"
          : borrowed   ? "borrowed_kv_indices"
                       : "kv_indices",
          "size ", page_table,
          " exceeds the graph capacity options.max_kv_indices = ", o.max_kv_indices);
  const std::int64_t max_qo_len = graph_max_qo_len(o);
  for (std::size_t r = 0; r < batch; ++r) {
    const std::int64_t qo_len = std::int64_t{p.qo_indptr[r + 1]} - p.qo_indptr[r];
    if (qo_len > max_qo_len) {
      fail_at("qo_indptr", static_cast<std::int64_t>(r + 1), "request ", r, " has qo_len ", qo_len,
              ", more than the graph's options.max_qo_len = ", max_qo_len);
    }
  }
}

void validate_device_page_ids(const Problem& p) {
  if (!p.device_kv_indices.defined() || p.device_kv_indices.shape[0] == 0) return;
  const auto [index, page] = cuda_find_page_outside(p.device_kv_indices, p.num_pages);
  if (index >= 0) {
    fail_at("device_kv_indices", index, page, " is outside the pool [0, ", p.num_pages, ")");
  }
}

}  // namespace fp8mla::detail
