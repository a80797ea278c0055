// The portable family's tile sizes and shared-memory plan (kernel.cuh says what it computes).
// Every CTA multiplies a tile of 16 x MT rows by blocks of 64 / MT tokens (1024 row-token
// products a block at every MT), with cp.async stages of the cache's raw token bytes; its shared
// memory fits the 99 KB a CTA may use on sm_86, sm_89 and sm_120 with one stage, and with two
// wherever the device allows (the kernel reads how many from the launch's dynamic size).
#pragma once

#include "fp8mla/format.h"

namespace fp8mla::detail::portable {

// How S = Q K^T is multiplied: fp16 products of converted codes (exact; bf16 caches multiply
// bf16), fp8 products (mma.sync m16n8k32 e4m3, sm_89 and newer; Q as two e4m3 terms), or, for
// fp16 queries over a bf16 cache, fp16-exact products: Q and P each split into two bf16 terms
// (ops::half2_to_bf16x2_terms) that multiply the bf16 codes into one accumulator.
enum class Scores { f16, e4m3, bf16x2 };

inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kMaxSmem = 99 * 1024;  // sm_86 / sm_89 / sm_120 per-CTA opt-in limit

template <KvFormat F, int MT, Scores kScores = Scores::f16>
struct Config {
  static_assert(MT == 1 || MT == 2 || MT == 4, "16, 32 or 64 rows");
  static_assert(kScores != Scores::e4m3 || F == KvFormat::fp8_e4m3, "e4m3 products: fp8_e4m3");
  static_assert(kScores != Scores::bf16x2 || F == KvFormat::bf16, "bf16x2 products: bf16");
  static constexpr int kRows = 16 * MT;
  static constexpr int kBlockN = 64 / MT;       // tokens a block
  static constexpr int kGroups = kBlockN / 16;  // 16-token groups (two n-tiles) a block
  static constexpr int kSharers = 2 * kGroups;  // warps whose S covers one m-tile (8 / MT)
  static constexpr int kTokenBytes = static_cast<int>(fp8mla::token_bytes(F));
  // Staged token rows: a pitch of 16 or 80 (mod 128) bytes keeps both the S reads (16 bytes at
  // 16 tq of tokens n and n + 4) and the P V reads (8 bytes of tokens 2 tq, 2 tq + 1) free of
  // bank conflicts; bf16's V goes through ldmatrix.trans (any 16-byte-multiple pitch).
  static constexpr int kPitch = F == KvFormat::fp8_e4m3 ? 592 : F == KvFormat::bf16 ? 1168 : 656;
  static constexpr int kChunks = kTokenBytes / 16;  // 16-byte cp.async copies a token
  static constexpr int kStageBytes = kBlockN * kPitch;
  static constexpr int kPerToken = kThreads / kBlockN;  // threads copying one token
  // Q rows: fp16 / bf16 (1152 bytes + pad; bf16x2 keeps the fp16 query and splits it where it
  // multiplies) or, for e4m3 products, hi and lo e4m3 terms (576 bytes each). Pads keep each
  // thread's Q reads (rows g and g + 8) conflict free.
  // (bf16 at 64 rows keeps the fp16 pad: the wider one would not fit 99 KB.)
  static constexpr int kQPitch = kScores == Scores::e4m3                ? 576
                                 : F == KvFormat::bf16 && MT < 4 ? 1152 + 64
                                                                 : 1152 + 16;
  static constexpr int kQBytes = (kScores == Scores::e4m3 ? 2 : 1) * kRows * kQPitch;
  // P: bf16 for bf16 caches, else fp16 (bf16x2 splits it where it multiplies; the block
  // format's warps multiply it by their columns' block scales on the way into the products).
  static constexpr int kPPitch = (kBlockN + 8) * 2;
  static constexpr int kPBytes = kRows * kPPitch;
  static constexpr int kXchBytes = 4 * 32 * 16 * 2;  // S halves exchanged between warp pairs
  static constexpr int kPXBytes = kPBytes > kXchBytes ? kPBytes : kXchBytes;  // P and exchange
  static constexpr int kRedBytes = kRows * kSharers * 4;  // [row][sharer] float
  // Offsets (bytes) from the 16-byte-aligned dynamic shared memory.
  static constexpr int kQ = 0;
  static constexpr int kPX = kQ + kQBytes;
  static constexpr int kRedMax = kPX + kPXBytes;
  static constexpr int kRedSum = kRedMax + kRedBytes;
  static constexpr int kQInv = kRedSum + kRedBytes;  // [row] float: 2^-e of the row's Q scale
  static constexpr int kFlags = kQInv + kRows * 4;   // [stage][token] byte
  static constexpr int kStages0 = (kFlags + 2 * kBlockN + 15) / 16 * 16;
  static constexpr int bytes(int stages) { return kStages0 + stages * kStageBytes; }
  static_assert(bytes(1) <= kMaxSmem, "one stage fits every target");
  // Two CTAs an SM for fp8_e4m3 at 16 rows, whose two stages fit twice in sm_90 / sm_100's
  // 227 KB: 128 registers (the block format needs a few more).
  static constexpr int kMinBlocks = MT == 1 && F == KvFormat::fp8_e4m3 && kScores == Scores::f16 ? 2 : 1;
};

}  // namespace fp8mla::detail::portable
