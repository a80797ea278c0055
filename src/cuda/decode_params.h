// Internal: what the decode and merge kernels read. Host launchers (decode.cu) fill it from a
// PlanState, its device buffers and the RunArgs; kernels (src/cuda/decode/<family>/kernel.cuh) never see host types.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fp8mla/attention.h"

namespace fp8mla::detail {

// A WorkTile with the request values its kernel needs, resolved when the plan is uploaded
// (cuda_upload_plan): a CTA loads them with its tile at once instead of through t.request (the
// chain tile -> qo_indptr / kv_indptr -> page table -> cache would be four dependent loads
// before the first copy).
struct DeviceTile {
  WorkTile tile;
  std::int32_t q_first;       // qo_indptr[request] + q_begin: global index of its first query token
  std::int32_t qo_len;        // the request's query tokens
  std::int32_t kv_len;        // the length its causal mask counts from (0 when sparse)
  std::int32_t kv_base;       // kv_indptr[request]: its first page-table entry (0 when sparse)
  std::int64_t partial_base;  // partial_offset[request]: its first split-KV partial row
  std::int64_t unused = 0;    // 64 bytes: four 16-byte loads
};
static_assert(sizeof(DeviceTile) == 64, "one tile is four 16-byte loads");

// A CUtensorMap (cuda.h: 128 opaque bytes, 64-byte aligned), encoded by the launcher
// (decode.cu); kernels pass its address to the TMA engine.
struct alignas(64) TensorMap {
  std::uint64_t opaque[16];
};

struct DecodeParams {
  const DeviceTile* tiles;             // [capacity]; the first *num_tiles are live
  const std::int32_t* num_tiles;       // device scalar (rewritten in place by replan)
  const std::int32_t* kv_indices;      // pages (a request's start: DeviceTile::kv_base)
  const std::int32_t* sparse_indices;  // [total_q, topk] global slots, -1 = skip (sparse only)
  int topk;                            // 0 = dense
  int num_heads;
  int page_shift;           // log2(page_size)
  std::int64_t pool_slots;  // num_pages * page_size (bound for sparse indices)
  bool causal;
  // The entries the copies follow (kv_indices dense, sparse_indices sparse) are the plan's own,
  // written only by host copies, so a kernel may read them before pdl_wait (the set-up that
  // overlaps the kernel before it). false when the caller owns them (a borrowed page table,
  // sparse indices passed to run()): an engine's kernel may write them right before run(), so
  // they are read after the wait, as q and the cache are.
  bool entries_before_wait;
  float scale_nope;  // multiplies q_nope . ckv: sm_scale * log2(e) * ckv_scale (fp8_e4m3)
  float scale_pe;    // multiplies q_pe . kpe:  sm_scale * log2(e) * kpe_scale (fp8_e4m3)
  float out_scale;   // multiplies the output: ckv_scale for fp8_e4m3, else 1

  // [total_q, H, 512] and [total_q, H, 64], strides in elements: bf16, or fp16 (2-byte elements
  // alike) when q_f16, which the families round to bf16 as they load a chunk (ops::q_as_bf16).
  const __nv_bfloat16* q_nope;
  std::int64_t q_nope_stride[2];
  const __nv_bfloat16* q_pe;
  std::int64_t q_pe_stride[2];
  bool q_f16;
  // Cache halves as bytes: token (page p, offset o) starts at base + p*page_stride +
  // o*token_stride. fp8_e4m3_block: ckv is the whole 656-byte token and kpe is unused.
  const std::uint8_t* ckv;
  std::int64_t ckv_page_stride, ckv_token_stride;
  const std::uint8_t* kpe;
  std::int64_t kpe_page_stride, kpe_token_stride;

  __nv_bfloat16* out;  // [total_q, H, 512]: bf16, or fp16 (2-byte elements alike) when out_f16
  std::int64_t out_stride[2];
  bool out_f16;
  float* lse;  // [total_q, H] or null
  std::int64_t lse_stride[2];
  float* partial_o;    // [partial_rows, 512]
  float* partial_lse;  // [partial_rows]
  // The tensor-map families only (fp8_tma, bf16_tma, bf16_wide_rows): ckv as
  // [num_pages, page_size, 512 x element bytes] (boxes of 128 x min(page_size, 64) x 1, 128-byte
  // swizzle) and kpe as [num_pages, page_size, 64 x element bytes] (fp8: boxes of 64, 64-byte
  // swizzle; bf16: 128, 128-byte swizzle).
  TensorMap ckv_map, kpe_map;
};

// One row of a split request to merge: request and row (t * H + h) within it.
struct MergeItem {
  std::int32_t request;
  std::int32_t row;
};

struct MergeParams {
  const MergeItem* items;         // [capacity]
  const std::int32_t* num_items;  // device scalar
  const std::int32_t* form;       // device scalar: 0 whole rows, 1 (row, 64 columns) (graph kernel)
  const std::int32_t* qo_indptr;
  const std::int32_t* num_splits;
  const std::int64_t* partial_offset;
  int num_heads;
  const float* partial_o;
  const float* partial_lse;
  __nv_bfloat16* out;  // bf16, or fp16 when out_f16
  std::int64_t out_stride[2];
  bool out_f16;
  float* lse;
  std::int64_t lse_stride[2];
};

}  // namespace fp8mla::detail
