// Finds the KV cast: a dtype cast that makes a bf16 copy of the KV cache for attention to read,
// once per layer, in every step (the bug fp8mla exists for: a serving engine cast its whole
// FP8 pool to bf16 before a bf16-only attention kernel in each of 78 layers).
//
// A cast is taken as a KV cast when
//   - it runs before an attention call with no other attention call between them (on the
//     same CPU thread or GPU stream); of several casts there, the largest;
//   - it is the size of what attention reads: with record_shapes, the bytes it writes are at
//     least half the attention's largest input (the cache it is handed); without shapes, it
//     takes at least a quarter of the attention call's time (a KV append of a few tokens does
//     not);
//   - it repeats: the same size (bytes within 2x of the step's median, or time within 3x) before
//     at least half the step's attention calls, in at least half the steps.
// It is a "pool" cast when nothing gathers rows before it since the last attention call (it
// casts what it was given: the layer's pool), a "gather" cast when a gather (aten::index, an
// index kernel) runs first (gather then cast: only the batch's pages, still 3 bytes moved for
// every FP8 byte attention needs).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "tools/fp8mla/audit/timeline.h"

namespace fp8mla::audit {

struct KvCastStep {
  int casts = 0;                   // KV casts in the step
  double cast_us = 0;              // their time
  double gather_us = 0;            // the gathers before them (gather kind)
  double bytes = 0;                // the casts' bytes moved (when recorded)
  double share = 0;                // (cast_us + gather_us) / the step's wall time
  std::vector<std::size_t> items;  // indices into Step::items (casts and their gathers)
};

struct KvCastFinding {
  bool found = false;
  std::string kind;  // "pool" or "gather"
  std::string name;  // the cast's op (CPU) or kernel (GPU) name, the most common one
  std::string op;    // GPU: the CPU op that launched it
  int per_step = 0;  // median count a step
  int attention_per_step = 0;
  double bytes_each = -1;      // median bytes moved by one cast (read + written), -1: unknown
  double out_bytes_each = -1;  // median bytes it writes
  double kv_ratio = -1;        // out_bytes / the attention's largest input (~1 for a KV cast)
  bool fp8_source = false;     // its input is FP8 (record_shapes or the kernel's name)
  double us_each = 0;          // median time of one cast
  // Means over the steps where the pattern holds; share: of those steps' mean time.
  double cast_us_per_step = 0, gather_us_per_step = 0, share = 0;
  double save_us_per_step = 0, save_bytes_per_step = -1;
  int steps_with_pattern = 0;
  std::vector<KvCastStep> steps;  // one per Timeline step
};

KvCastFinding find_kv_cast(const Trace& trace, const Timeline& timeline);

}  // namespace fp8mla::audit
