// What the demo and the CPU bench run on: a model's attention shape, a filled paged FP8 pool,
// and a batch of decode requests whose pages are scattered through it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/cache.h"
#include "tools/fp8mla/util.h"

namespace fp8mla::cli {

// The attention part of a model (docs/design/architecture.md); every one is 576/512 wide.
struct ModelPreset {
  std::string_view display;  // for output; lowercased, the --model spelling (model_key)
  int layers;
  int heads_per_gpu;  // at TP8
  float sm_scale;     // as SGLang computes it (YaRN mscale^2 folded in)
};
// The presets' --model spellings, in order; find_model(key) returns nullptr for an unknown one.
std::vector<std::string> model_names();
const ModelPreset* find_model(std::string_view key);
std::string model_key(const ModelPreset& model);

// The story: GLM-5 at TP8 on 8xH200 serves from a 495,040-token FP8 pool, and an engine's cast
// of that whole pool to bf16 (576 bytes read and 1152 written a token) took 0.90 ms a layer on
// an H200: ~0.95 TB/s.
inline constexpr std::int64_t kStoryPoolTokens = 495040;
inline constexpr double kStoryCastBytesPerSecond = 495040.0 * (576 + 1152) / 0.90e-3;

struct WorkloadConfig {
  std::int64_t pool_tokens = 0;  // rounded up to whole pages
  int page_size = 1;
  KvFormat format = KvFormat::fp8_e4m3;
  float scale = 1.0f;  // fp8_e4m3: SGLang's pool is unscaled
  int batch = 1;
  int mean_context = 4096;
  bool ragged = true;  // contexts uniform in [mean/4, 7*mean/4]; else all = mean
  int qo_len = 1;      // query tokens a request (causal: each context is at least this long)
  std::uint64_t seed = 1;
  DeviceKind device = DeviceKind::cpu;
  int device_id = 0;
};

struct Workload {
  WorkloadConfig config;
  std::int64_t num_pages = 0;
  // The pool: always on the host (the float64 reference reads it there) and, for a CUDA run,
  // a device copy with identical bytes.
  std::unique_ptr<PagedLatentCache> host_cache;
  std::unique_ptr<PagedLatentCache> device_cache;
  // The batch: config.qo_len query tokens a request (1: decode; more: MTP / speculative verify).
  std::vector<std::int32_t> qo_indptr;   // [batch + 1]
  std::vector<std::int32_t> kv_indptr;   // [batch + 1], pages
  std::vector<std::int32_t> kv_indices;  // pool page ids, scattered
  std::vector<std::int32_t> kv_len;      // [batch], tokens
  std::int64_t active_tokens = 0;        // sum of kv_len
  std::int64_t active_pages = 0;         // kv_indices.size()

  const PagedLatentCache& cache() const { return device_cache ? *device_cache : *host_cache; }
  int batch() const { return static_cast<int>(kv_len.size()); }
};

// Draws the batch, allocates its pages at random places in the pool and fills them with
// quantized random tokens (other pages stay zero: casting costs the same whatever they hold).
// Throws Error(invalid_argument) naming --pool when the batch does not fit.
Workload make_workload(const WorkloadConfig& config);

// A bf16 cache view over `buffer` ([num_pages, page_size, 576] bf16, ckv and kpe as two
// strided views of each token, as SGLang lays out its pool).
KvCacheView bf16_cache_view(const Buffer& buffer, std::int64_t num_pages, int page_size);

// A Problem over the workload's batch (spans point into the workload's vectors).
Problem make_problem(const Workload& w, int num_heads, float sm_scale, KvFormat format,
                     std::int64_t num_pages, std::span<const std::int32_t> kv_indices,
                     DeviceKind device);

// Queries and outputs of one decode call, on the run's device, plus host copies.
struct Activations {
  Activations(int total_q, int heads, DeviceKind device, int device_id);
  int total_q;
  int heads;
  Buffer q_nope, q_pe;  // bf16 [total_q, heads, 512] / [.., 64]
  std::vector<std::uint16_t> host_q_nope, host_q_pe;
  // Draws fresh queries (normal, like post-RoPE activations) and uploads them.
  void draw(Rng& rng);
  TensorView q_nope_view() const;
  TensorView q_pe_view() const;
};

struct Output {
  Output(int total_q, int heads, DeviceKind device, int device_id);
  Buffer out;  // bf16 [total_q, heads, 512]
  Buffer lse;  // f32 [total_q, heads]
  int total_q;
  int heads;
  TensorView out_view() const;
  TensorView lse_view() const;
  // Fills out and lse with NaN bytes, so a run that skips an element cannot pass a check.
  void poison();
  std::vector<std::uint16_t> host_out() const;
  std::vector<float> host_lse() const;
};

}  // namespace fp8mla::cli
