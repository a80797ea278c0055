// Test helpers shared by the CPU and GPU suites: random attention problems, poisoned output
// buffers, and comparisons that look at NaN and -inf positions as well as values.
//
// Everything is built in host memory so a GPU test can copy the same bytes to a device:
//
//   test::RandomCase c = test::make_case({.batch = 8, .num_heads = 16, .page_size = 64});
//   // CPU: views over c's own buffers.
//   test::HostOutput out(c);
//   fp8mla::run(fp8mla::plan(c.problem()), c.host_args(out));
//   // GPU: copy c.cache and c.q to the device, then build views over the device copies.
//   RunArgs args{c.q_nope_view(d_q, DeviceKind::cuda), c.q_pe_view(d_q, DeviceKind::cuda),
//                c.kv_view(d_cache, DeviceKind::cuda), c.out_view(d_out, DeviceKind::cuda)};
//
// Each case draws from its own std::mt19937_64 seeded with spec.seed, so a failure reproduces
// from the seed printed by describe().
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/cache.h"
#include "fp8mla/format.h"
#include "fp8mla/tensor.h"

namespace fp8mla::test {

// Where the golden vectors made by PyTorch and FlashMLA live: $FP8MLA_GOLDEN_DIR, else the
// build's definition (../shared/golden beside the checkout, else the copy in tests/golden).
std::string golden_dir();

// ---- random problems ----

// How the pool's bytes are arranged (bf16 and fp8_e4m3; fp8_e4m3_block is always fused).
enum class CacheLayout : std::uint8_t {
  fused,  // one [num_pages, page_size, token] buffer, ckv and kpe as two views (SGLang)
  split,  // a ckv region [P, ps, 512] followed by a kpe region [P, ps, 64] (FlashInfer)
};

struct ProblemSpec {
  int batch = 4;
  int num_heads = 16;
  int page_size = 16;
  KvFormat format = KvFormat::fp8_e4m3;
  // Per request, uniform in [min, max]. With `causal`, kv_len is raised to qo_len unless 0.
  int qo_len_min = 1;
  int qo_len_max = 1;
  int kv_len_min = 0;
  int kv_len_max = 300;
  double empty_fraction = 0.0;  // probability that a request gets kv_len = 0 anyway
  bool causal = false;
  // Sparse when topk > 0: each query token lists topk distinct slots of its request's tokens;
  // a position is -1 with probability invalid_fraction (and when the request is too short).
  int topk = 0;
  double invalid_fraction = 0.15;
  // Pool pages no request lists, and (with probability 0.3 per request) one listed page past
  // kv_len. Attention must read neither; with poison_unused their tokens encode NaN, so a read
  // shows up as NaN in the output.
  int spare_pages = 3;
  bool poison_unused = true;
  CacheLayout layout = CacheLayout::fused;
  std::int64_t token_pad_bytes = 0;  // gap after each token (a multiple of the element size)
  bool fp8_as_u8 = false;            // fp8_e4m3 views typed u8 instead of fp8_e4m3
  bool fused_q = false;              // q_nope / q_pe as two views of one [total_q, H, 576] buffer
  // fp8_e4m3 per-cache scales (real = code * scale); ignored by the other formats.
  float ckv_scale = 1.0f;
  float kpe_scale = 1.0f;
  // Cache values are N(0, 1) x 2^u, u uniform in [-magnitude_log2, magnitude_log2], drawn per
  // token and per group of 128 (and for the rope part), so block scales differ. q is N(0, 1).
  float magnitude_log2 = 2.0f;
  float sm_scale = 0.0f;  // 0: 1 / sqrt(192)
  std::uint64_t seed = 1;
};

// "batch=4 heads=16 ps=16 fp8_e4m3 qo=[1,1] kv=[0,300] causal=0 topk=0 seed=1 ...".
std::string describe(const ProblemSpec& spec);

// Output buffers on the host: out bf16 [total_q, H, 512] and lse f32 [total_q, H], dense, each
// with `guard` poisoned elements before and after it so a write outside can be detected.
struct HostOutput;

// A generated problem: index arrays, the pool's bytes and q, all on the host.
struct RandomCase {
  ProblemSpec spec;
  int total_q = 0;
  std::int64_t num_pages = 0;
  float sm_scale = 0.0f;
  std::vector<std::int32_t> qo_indptr;       // [batch + 1]
  std::vector<std::int32_t> kv_indptr;       // [batch + 1]
  std::vector<std::int32_t> kv_indices;      // [kv_indptr[batch]] a random permutation of pages
  std::vector<std::int32_t> kv_len;          // [batch]
  std::vector<std::int32_t> sparse_indices;  // [total_q, topk] (sparse only)
  // The pool's bytes, laid out as spec.layout says; copy them as they are to a device.
  std::vector<std::uint8_t> cache;
  // q as bf16 bits: fused_q: [total_q, H, 576]; else q_nope [total_q, H, 512] followed by
  // q_pe [total_q, H, 64] in the same vector.
  std::vector<std::uint16_t> q;

  std::int64_t rows() const { return static_cast<std::int64_t>(total_q) * spec.num_heads; }
  // Global slots (page * page_size + offset) holding request r's tokens, in token order.
  std::vector<std::int64_t> request_slots(int r) const;

  // The Problem to plan (spans into this case's vectors: keep the case alive during plan()).
  Problem problem(DeviceKind device = DeviceKind::cpu, int device_id = 0) const;
  // Views over memory holding a copy of `cache` / `q` (this case's own, or a device copy).
  KvCacheView kv_view(void* cache_data, DeviceKind device = DeviceKind::cpu,
                      int device_id = 0) const;
  TensorView q_nope_view(void* q_data, DeviceKind device = DeviceKind::cpu,
                         int device_id = 0) const;
  TensorView q_pe_view(void* q_data, DeviceKind device = DeviceKind::cpu, int device_id = 0) const;
  // Dense views: out bf16 [total_q, H, 512], lse f32 [total_q, H], indices i32 [total_q, topk].
  TensorView out_view(void* out, DeviceKind device = DeviceKind::cpu, int device_id = 0) const;
  TensorView lse_view(void* lse, DeviceKind device = DeviceKind::cpu, int device_id = 0) const;
  TensorView sparse_view(void* indices, DeviceKind device = DeviceKind::cpu,
                         int device_id = 0) const;
  // Run arguments over this case's host buffers and `out` (lse included).
  RunArgs host_args(HostOutput& out);
};

// Builds a case from its spec (deterministic in spec.seed).
RandomCase make_case(const ProblemSpec& spec);

// ---- poisoned outputs ----

inline constexpr std::uint16_t kPoisonBf16 = 0x7fc1;      // a quiet NaN no kernel computes
inline constexpr std::uint32_t kPoisonF32 = 0x7fc00001u;  // same, float32
void poison(std::span<std::uint16_t> bf16);
void poison(std::span<float> f32);

struct HostOutput {
  HostOutput(std::int64_t q_tokens, int heads, std::int64_t guard_elements = 0);
  explicit HostOutput(const RandomCase& c, std::int64_t guard_elements = 0)
      : HostOutput(c.total_q, c.spec.num_heads, guard_elements) {}

  std::span<std::uint16_t> out();  // the [total_q, H, 512] region, without guards
  std::span<float> lse();          // the [total_q, H] region
  TensorView out_view();
  TensorView lse_view();
  void repoison();  // poisons everything again (regions and guards)
  // True when every guard element still holds its poison.
  bool guards_intact() const;

  std::int64_t total_q;
  int num_heads;
  std::int64_t guard;
  std::vector<std::uint16_t> out_storage;  // guard | out | guard
  std::vector<float> lse_storage;          // guard | lse | guard
};

// ---- comparisons ----

// Values of `out` against a reference (both the same length), in float64.
struct Comparison {
  std::int64_t count = 0;
  double rel_l2 = 0.0;           // ||out - ref|| / ||ref|| over positions where both are finite
                                 // (0 when both are 0 there, +inf when only ref is)
  double max_abs = 0.0;          // max |out - ref| over the same positions
  std::int64_t nan_extra = 0;    // out NaN where ref is not (a poison survived, or a bug)
  std::int64_t nan_missing = 0;  // ref NaN where out is not
  std::int64_t first_nan_mismatch = -1;
  bool nan_ok() const { return nan_extra == 0 && nan_missing == 0; }
};
Comparison compare_bf16(std::span<const std::uint16_t> out, std::span<const std::uint16_t> ref);
Comparison compare_f32(std::span<const float> out, std::span<const float> ref);
std::string describe(const Comparison& c);

// lse against a reference: -inf (empty row) positions must match exactly; elsewhere the error
// is |out - ref| / max(1, |ref|).
struct LseComparison {
  std::int64_t count = 0;
  double max_err = 0.0;
  std::int64_t inf_mismatch = 0;  // one is -inf (or +inf) and the other is not the same
  std::int64_t nan_extra = 0;     // out NaN where ref is not
  std::int64_t nan_missing = 0;   // ref NaN where out is not
  std::int64_t first_mismatch = -1;
  bool positions_ok() const { return inf_mismatch == 0 && nan_extra == 0 && nan_missing == 0; }
};
LseComparison compare_lse(std::span<const float> out, std::span<const float> ref);
std::string describe(const LseComparison& c);

}  // namespace fp8mla::test
