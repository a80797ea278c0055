// Internal: the one dispatch table. plan() describes its problem as a DispatchKey, asks
// choose_family() once, partitions the work for that family, and records it in the PlanState;
// run() launches exactly that family (the CUDA launch table, src/cuda/decode/launch_table.cpp,
// maps a family to its kernel). The rule lives here and nowhere else.
//
// Columns (src/core/dispatch.cpp, kDispatchTable):
//   arch     0 = the CPU; a CUDA device's compute capability as 10 * major + minor (90 = sm_90)
//   format   KvFormat of the cache
//   rows     tile rows (query tokens x heads) the kernel is chosen for: <= 16 or 17-64
//   mode     dense (page tables) or sparse (index lists)
//   pages    page size: 1-7 tokens, 8-63, 64-128
//   scale    fp8_e4m3's kpe_scale / ckv_scale: a power of two (checked by run()) or any
//            (PlanOptions::any_scale_ratio)
//   scores   fast (fp8 tensor cores allowed) or exact (PlanOptions::exact_scores)
//   queries  the query dtype: bf16 or fp16 (Problem::q_dtype)
//   tiles    the longest tile: < 32 blocks of 64 tokens or longer (decided after the partition)
//   waves    the partition's tiles: one wave (at most sm_count x ctas_per_sm of the family it
//            was made for) or several (decided after the partition)
// The first row whose every column holds the key's value is the family. A row also states what
// its family can serve: PlanOptions::kernel_family accepts a family when one of its rows matches
// the key in every column but `tiles` and `waves` (rows below an earlier match serve only such
// requests).
//
// Adding a family: its KernelFamily enumerator and name (include/fp8mla/attention.h,
// dispatch.cpp's kNames), its rows here, and its entry in the CUDA launch table.
#pragma once

#include <cstdint>

#include "fp8mla/attention.h"

namespace fp8mla::detail {

enum class RowsClass : std::uint8_t { upto16, upto64 };
enum class PageClass : std::uint8_t { under8, under64, large };
enum class TileClass : std::uint8_t { short_tiles, long_tiles };
enum class WaveClass : std::uint8_t { one, several };

// Tiles of at least this many kv tokens are long (TileClass::long_tiles).
inline constexpr std::int64_t kLongTileTokens = 32 * 64;

struct DispatchKey {
  int arch = 0;  // 0: the CPU; else 10 * major + minor of the CUDA device
  KvFormat format = KvFormat::fp8_e4m3;
  RowsClass rows = RowsClass::upto16;
  bool sparse = false;
  PageClass pages = PageClass::under8;
  bool any_scale_ratio = false;
  bool exact_scores = false;
  bool f16_queries = false;
  TileClass tiles = TileClass::short_tiles;
  WaveClass waves = WaveClass::one;
};

RowsClass rows_class(int rows);
PageClass page_class(int page_size);
TileClass tile_class(std::int64_t longest_tile_tokens);
WaveClass wave_class(std::int64_t tiles, std::int64_t tiles_in_flight);

// The family for `key`: `requested` when it is not automatic and one of its rows serves the key
// (any tile length), else Error(invalid_argument, "options.kernel_family") naming it and the
// key; automatic: the first matching row, or Error(unsupported) when none does.
KernelFamily choose_family(const DispatchKey& key, KernelFamily requested);
// The first row's family for `key`, or automatic when no row matches.
KernelFamily first_match(const DispatchKey& key);
// Whether a row of `family` serves `key` (every column but `tiles` and `waves`).
bool family_serves(KernelFamily family, const DispatchKey& key);

// The family computes fp8_e4m3 scores on fp8 tensor cores and needs kpe_scale / ckv_scale to be
// a power of two, folded exactly into q_pe.
bool needs_pow2_scale_ratio(KernelFamily family);
// kpe_scale / ckv_scale as the kernels see it (both times sm_scale * log2(e), as the launcher
// multiplies them) is a power of two.
bool pow2_scale_ratio(float sm_scale, float ckv_scale, float kpe_scale);
inline constexpr float kLog2e = 1.4426950408889634f;

// PlanOptions::max_tile_rows = 0: 16 when the problem has <= 16 heads, tiles capped at 16 rows
// run a family that computes fp8_e4m3 scores on fp8 tensor cores (key16: the problem's key with
// rows = upto16, chosen as options.kernel_family asks; fp8_tma and
// fp8_gather run a 64-token block faster than wide_rows does), the uncapped tiles have more than
// 16 rows (rows_uncapped), and the batch is too small to fill the GPU: at most 128 kv tokens an
// SM (summed over the requests with query tokens) and its 16-row tiles (requests x their 16-row
// query blocks) at most a quarter of the SMs. There the SMs a 64-row plan leaves idle take the
// extra tiles; with longer contexts each capped tile re-reads its pages and the cap costs up to
// 2x. Graph mode judges once, from the capacities (max_kv_indices x page_size tokens, max_batch
// x max_qo_len query tokens), and replan() keeps it. Otherwise 64. A positive option is kept.
int choose_max_tile_rows(const Problem& p, const PlanOptions& o, const DispatchKey& key16,
                         int rows_uncapped, int sm_count);

}  // namespace fp8mla::detail
