// The dispatch table (src/core/dispatch.h says how it is read) and the planner's rule for
// PlanOptions::max_tile_rows = 0.
#include "src/core/dispatch.h"

#include <array>
#include <cmath>
#include <string>

#include "fp8mla/error.h"
#include "src/core/check.h"

namespace fp8mla {

namespace {

struct FamilyName {
  KernelFamily family;
  const char* name;
};
constexpr std::array kNames = {
    FamilyName{KernelFamily::automatic, "auto"},
    FamilyName{KernelFamily::cpu_fast, "cpu_fast"},
    FamilyName{KernelFamily::cpu_reference, "cpu_reference"},
    FamilyName{KernelFamily::shared_tile, "shared_tile"},
    FamilyName{KernelFamily::fp8_exact, "fp8_exact"},
    FamilyName{KernelFamily::fp8_tma, "fp8_tma"},
    FamilyName{KernelFamily::fp8_gather, "fp8_gather"},
    FamilyName{KernelFamily::bf16_tma, "bf16_tma"},
    FamilyName{KernelFamily::bf16_gather, "bf16_gather"},
    FamilyName{KernelFamily::wide_rows, "wide_rows"},
    FamilyName{KernelFamily::bf16_wide_rows, "bf16_wide_rows"},
    FamilyName{KernelFamily::portable, "portable"},
    FamilyName{KernelFamily::portable_fp8, "portable_fp8"},
    FamilyName{KernelFamily::portable_f16_exact, "portable_f16_exact"},
};

}  // namespace

const char* kernel_family_name(KernelFamily f) {
  for (const FamilyName& n : kNames)
    if (n.family == f) return n.name;
  return "unknown";
}

KernelFamily parse_kernel_family(std::string_view name) {
  std::string names;
  for (const FamilyName& n : kNames) {
    if (name == n.name) return n.family;
    names += names.empty() ? "" : ", ";
    names += n.name;
  }
  throw Error(ErrorCode::invalid_argument, "kernel_family",
              detail::msg("unknown kernel family \"", name, "\" (expected one of ", names, ")"));
}

namespace detail {

namespace {

// A column's accepted values as a bit set (bit i: the value with underlying value i).
using Set = std::uint8_t;
template <class E>
constexpr Set bit(E e) {
  return static_cast<Set>(1u << static_cast<unsigned>(e));
}
constexpr Set kAll = 0xff;

// Formats.
constexpr Set kBf16 = bit(KvFormat::bf16);
constexpr Set kFp8 = bit(KvFormat::fp8_e4m3);
constexpr Set kBlock = bit(KvFormat::fp8_e4m3_block);
// Rows.
constexpr Set kRows16 = bit(RowsClass::upto16);
constexpr Set kRows64 = bit(RowsClass::upto64);
// Mode: dense (0) or sparse (1).
constexpr Set kDense = 1, kSparse = 2;
// Pages.
constexpr Set kPagesUnder8 = bit(PageClass::under8);
constexpr Set kPagesFrom8 = bit(PageClass::under64) | bit(PageClass::large);
constexpr Set kPagesFrom64 = bit(PageClass::large);
// Scale ratio: a power of two (0) or any (1).
constexpr Set kPow2 = 1;
// Scores: fast (0) or exact (1).
constexpr Set kFast = 1;
// Queries: bf16 (0) or fp16 (1).
constexpr Set kF16Queries = 2;
// Tiles.
constexpr Set kShortTiles = bit(TileClass::short_tiles);
// Waves.
constexpr Set kOneWave = bit(WaveClass::one);

struct Arch {
  int min, max;  // compute capabilities (10 * major + minor), inclusive; {0, 0}: the CPU
};
constexpr Arch kCpu{0, 0};
constexpr Arch kSm90{90, 90};  // the Hopper families: sm_90a code (wgmma, setmaxnreg, TMA)
constexpr Arch kSm80Up{80, 999};  // the portable family: cp.async, ldmatrix, mma.sync
// fp8 mma.sync in hardware: sm_89 (Ada) and sm_12x (consumer Blackwell); sm_90 and sm_100
// compile it as fp16 products (their fp8 tensor cores are wgmma's and tcgen05's).
constexpr Arch kSm89{89, 89};
constexpr Arch kSm12x{120, 129};
constexpr Arch kSm90Up{90, 119};

struct Row {
  Arch arch;
  Set format, rows, mode, pages, scale, scores, queries, tiles, waves;
  KernelFamily family;
};

// clang-format off
constexpr Row kDispatchTable[] = {
  // arch    format         rows     mode     pages         scale  scores queries      tiles        waves     family
  {kCpu,    kAll,          kAll,    kAll,    kAll,         kAll,  kAll,  kAll,        kAll,        kAll,     KernelFamily::cpu_fast},
  {kCpu,    kAll,          kAll,    kAll,    kAll,         kAll,  kAll,  kAll,        kAll,        kAll,     KernelFamily::cpu_reference},
  // fp16 queries over a bf16 cache, on every GPU from sm_80: fp16-exact products (the other
  // families round fp16 queries to bf16).
  {kSm80Up, kBf16,         kAll,    kAll,    kAll,         kAll,  kAll,  kF16Queries, kAll,        kAll,     KernelFamily::portable_f16_exact},
  // 17-64 rows: bf16 dense pages of >= 64 tokens (a block is one page's run of nine tensor-map
  // boxes), else the warp-specialized family (every format; for the block format its producer
  // warpgroup dequantizes while the 64-row tile's tensor work runs).
  {kSm90,   kBf16,         kRows64, kDense,  kPagesFrom64, kAll,  kAll,  kAll,        kAll,        kAll,     KernelFamily::bf16_wide_rows},
  {kSm90,   kAll,          kRows64, kAll,    kAll,         kAll,  kAll,  kAll,        kAll,        kAll,     KernelFamily::wide_rows},
  // <= 16 rows, bf16 dense: tensor-map boxes of page runs while tiles are short; per-token copies
  // by producer warps on pages of < 8 tokens (a one-token box into the swizzled tile faults) and
  // for long tiles (their copies outrun the boxes, while a first block landing later costs
  // short tiles more).
  {kSm90,   kBf16,         kRows16, kDense,  kPagesFrom8,  kAll,  kAll,  kAll,        kShortTiles, kAll,     KernelFamily::bf16_tma},
  {kSm90,   kBf16,         kRows16, kDense,  kAll,         kAll,  kAll,  kAll,        kAll,        kAll,     KernelFamily::bf16_gather},
  // <= 16 rows, fp8_e4m3 dense with fast scores and a power-of-two ratio: S on fp8 tensor cores.
  {kSm90,   kFp8,          kRows16, kDense,  kPagesFrom8,  kPow2, kFast, kAll,        kAll,        kAll,     KernelFamily::fp8_tma},
  {kSm90,   kFp8,          kRows16, kDense,  kPagesUnder8, kPow2, kFast, kAll,        kAll,        kAll,     KernelFamily::fp8_gather},
  // ... and sparse index lists (per-token copies, skipped slots masked by their flags) that fit
  // one wave of its one CTA an SM; more tiles go to fp8_exact below, whose two CTAs an SM
  // overlap two tiles' chains (bs 128 x 2 query tokens: 112 against 119 us, fp8_gather.md).
  {kSm90,   kFp8,          kRows16, kSparse, kAll,         kPow2, kFast, kAll,        kAll,        kOneWave, KernelFamily::fp8_gather},
  // <= 16 rows, the block format with fast scores: fp8 tensor-core scores from the gathered rows.
  {kSm90,   kBlock,        kRows16, kAll,    kAll,         kAll,  kFast, kAll,        kAll,        kAll,     KernelFamily::fp8_gather},
  // <= 16 rows, fp8_e4m3 otherwise (exact scores, any ratio) and the block format:
  // fp16 products of the codes as they lie in the staged tokens.
  {kSm90,   kFp8 | kBlock, kRows16, kAll,    kAll,         kAll,  kAll,  kAll,        kAll,        kAll,     KernelFamily::fp8_exact},
  {kSm90,   kBlock,        kRows16, kAll,    kAll,         kAll,  kAll,  kAll,        kAll,        kAll,     KernelFamily::wide_rows},
  // bf16 sparse lists of <= 16 rows, and the block format when forced.
  {kSm90,   kBlock,        kAll,    kAll,    kAll,         kAll,  kAll,  kAll,        kAll,        kAll,     KernelFamily::shared_tile},
  {kSm90,   kBf16,         kRows16, kAll,    kAll,         kAll,  kAll,  kAll,        kAll,        kAll,     KernelFamily::shared_tile},
  // Every other GPU from sm_80: the portable family, fp8 products where the tensor cores have
  // them (fp8_e4m3, fast scores).
  {kSm89,   kFp8,          kAll,    kAll,    kAll,         kAll,  kFast, kAll,        kAll,        kAll,     KernelFamily::portable_fp8},
  {kSm12x,  kFp8,          kAll,    kAll,    kAll,         kAll,  kFast, kAll,        kAll,        kAll,     KernelFamily::portable_fp8},
  {kSm80Up, kAll,          kAll,    kAll,    kAll,         kAll,  kAll,  kAll,        kAll,        kAll,     KernelFamily::portable},
  // Served when forced (never first: the rows above match first), at <= 16 rows: sm_90 and
  // sm_100 emulate the instruction (src/cuda/decode/portable/kernel.cuh).
  {kSm90Up, kFp8,          kRows16, kAll,    kAll,         kAll,  kFast, kAll,        kAll,        kAll,     KernelFamily::portable_fp8},
};
// clang-format on

// any_tile: ignore the columns decided after the partition (tiles, waves).
bool matches(const Row& r, const DispatchKey& k, bool any_tile) {
  const bool sparse = k.sparse, any_ratio = k.any_scale_ratio, exact = k.exact_scores;
  return k.arch >= r.arch.min && k.arch <= r.arch.max && (r.format & bit(k.format)) != 0 &&
         (r.rows & bit(k.rows)) != 0 && (r.mode & (sparse ? kSparse : kDense)) != 0 &&
         (r.pages & bit(k.pages)) != 0 && (r.scale & (any_ratio ? 2 : 1)) != 0 &&
         (r.scores & (exact ? 2 : 1)) != 0 && (r.queries & (k.f16_queries ? 2 : 1)) != 0 &&
         (any_tile || ((r.tiles & bit(k.tiles)) != 0 && (r.waves & bit(k.waves)) != 0));
}

std::string describe(const DispatchKey& k) {
  return msg(k.arch == 0 ? std::string("cpu") : msg("sm_", k.arch), ", ", format_name(k.format),
             ", ", k.rows == RowsClass::upto16 ? "<= 16" : "17-64", " rows, ",
             k.sparse ? "sparse" : "dense", ", pages of ",
             k.pages == PageClass::under8    ? "< 8"
             : k.pages == PageClass::under64 ? "8-63"
                                             : ">= 64",
             " tokens, ", k.any_scale_ratio ? "any" : "power-of-two", " scale ratio, ",
             k.exact_scores ? "exact" : "fast", " scores, ", k.f16_queries ? "fp16" : "bf16",
             " queries");
}

}  // namespace

RowsClass rows_class(int rows) {
  return rows <= 16 ? RowsClass::upto16 : RowsClass::upto64;
}
PageClass page_class(int page_size) {
  return page_size < 8 ? PageClass::under8 : page_size < 64 ? PageClass::under64 : PageClass::large;
}
TileClass tile_class(std::int64_t longest_tile_tokens) {
  return longest_tile_tokens < kLongTileTokens ? TileClass::short_tiles : TileClass::long_tiles;
}
WaveClass wave_class(std::int64_t tiles, std::int64_t tiles_in_flight) {
  return tiles <= tiles_in_flight ? WaveClass::one : WaveClass::several;
}

KernelFamily first_match(const DispatchKey& key) {
  for (const Row& r : kDispatchTable)
    if (matches(r, key, false)) return r.family;
  return KernelFamily::automatic;
}

bool family_serves(KernelFamily family, const DispatchKey& key) {
  for (const Row& r : kDispatchTable)
    if (r.family == family && matches(r, key, true)) return true;
  return false;
}

KernelFamily choose_family(const DispatchKey& key, KernelFamily requested) {
  if (requested != KernelFamily::automatic) {
    if (family_serves(requested, key)) return requested;
    throw Error(ErrorCode::invalid_argument, "options.kernel_family",
                msg(kernel_family_name(requested), " cannot serve this plan (", describe(key),
                    "); use automatic or a family whose dispatch rows cover it"));
  }
  const KernelFamily found = first_match(key);
  if (found != KernelFamily::automatic) return found;
  throw Error(ErrorCode::unsupported, "problem",
              msg("no kernel family serves ", describe(key),
                  key.arch != 0 ? " (the CUDA families need compute capability 8.0 or newer)" : ""));
}

bool needs_pow2_scale_ratio(KernelFamily family) {
  return family == KernelFamily::fp8_tma || family == KernelFamily::fp8_gather;
}

bool pow2_scale_ratio(float sm_scale, float ckv_scale, float kpe_scale) {
  const float s = sm_scale * kLog2e;
  const float nope = s * ckv_scale, pe = s * kpe_scale;
  int e = 0;
  return std::isnormal(nope) && std::isnormal(pe) && std::frexp(pe / nope, &e) == 0.5f;
}

int choose_max_tile_rows(const Problem& p, const PlanOptions& o, const DispatchKey& key16,
                         int rows_uncapped, int sm_count) {
  if (o.max_tile_rows > 0) return o.max_tile_rows;
  constexpr int kCap = 16;
  constexpr std::int64_t kFewTokensPerSm = 128;
  if (p.num_heads > kCap || rows_uncapped <= kCap) return kMaxRowsPerTile;
  const KernelFamily requested = o.kernel_family;
  const KernelFamily capped = requested == KernelFamily::automatic ? first_match(key16)
                              : family_serves(requested, key16)    ? requested
                                                                   : KernelFamily::automatic;
  // The cap is measured for fp8_e4m3's fp8-score kernels (the block format's is not).
  if (p.kv_format != KvFormat::fp8_e4m3 || !needs_pow2_scale_ratio(capped)) return kMaxRowsPerTile;
  const std::int64_t q_per_tile = kCap / p.num_heads;
  std::int64_t tiles = 0, tokens = 0;
  if (o.cuda_graph) {
    const std::int64_t max_qo_len = o.max_qo_len > 0 ? o.max_qo_len : o.max_total_q;
    tiles = std::int64_t{o.max_batch} * ((max_qo_len + q_per_tile - 1) / q_per_tile);
    tokens = o.max_kv_indices * p.page_size;
  } else {
    for (std::size_t r = 0; r + 1 < p.qo_indptr.size(); ++r) {
      const std::int64_t qo = p.qo_indptr[r + 1] - p.qo_indptr[r];
      tiles += (qo + q_per_tile - 1) / q_per_tile;
      if (qo > 0) tokens += p.kv_len[r];
    }
  }
  return tokens <= kFewTokensPerSm * sm_count && tiles * 4 <= sm_count ? kCap : kMaxRowsPerTile;
}

}  // namespace detail
}  // namespace fp8mla
