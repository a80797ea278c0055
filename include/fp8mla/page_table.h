// fp8mla: a batch's CSR page table from an engine's token table, on the table's device.
//
// Engines such as SGLang keep, for each request row, the pool slot of each of its tokens
// (req_to_token [rows, width]); with a page's tokens placed together, token j of a request lies on
// page tokens[row, j] / page_size. fill_page_table writes the pages of a batch's requests in order,
// as plan() and run() read a page table (Problem::kv_indices, or the buffer a graph-mode plan
// borrows): request r's page k < ceil(kv_len[r] / page_size) at kv_indptr[r] + k, where kv_indptr is
// the running sum of those counts (what the caller's plan takes, from the same kv_len; written to
// kv_indptr when the caller passes one). It is the per-step work that lets a graph-mode plan borrow
// the table: one launch on the caller's stream.
#pragma once

#include <cstdint>
#include <span>

#include "fp8mla/tensor.h"

namespace fp8mla {

// tokens: i32 [rows, width], innermost stride 1 (any row stride). rows: i32 or i64 [batch], the
// batch's rows of tokens. kv_len: host, [batch], each >= 0 and at most width rounded up to a whole
// page (a request's last page starts inside its row). table: i32 [>= the batch's pages],
// contiguous; its first kv_indptr[batch] entries are written, nothing else. tokens, rows and table
// are on one device: host memory, or one CUDA device, where the fill is enqueued on `stream` (a
// cudaStream_t; null: the legacy default stream) and the host does not wait. On the host each row
// id is checked against [0, rows); on CUDA the ids are read on the device unchecked, and every page
// of a request whose row lies outside the token table is written as -1, an entry the kernels skip.
// Errors (invalid_argument naming the argument, value and bound): page_size not a power of two in
// 1..128; a tensor of the wrong dtype, rank, size, strides or device; kv_len out of range; table
// too short; kv_indptr neither empty nor batch + 1 entries; unsupported for CUDA tensors in a build
// without CUDA. kv_indptr (host; empty: not wanted) receives the running sum of the requests' page
// counts, [0, p0, p0 + p1, ...], once the fill is checked and enqueued; nothing when an argument is
// refused.
void fill_page_table(const TensorView& tokens, const TensorView& rows,
                     std::span<const std::int32_t> kv_len, int page_size,
                     const TensorView& table, void* stream = nullptr,
                     std::span<std::int32_t> kv_indptr = {});

}  // namespace fp8mla
