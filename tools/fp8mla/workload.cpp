#include "tools/fp8mla/workload.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstring>
#include <thread>

#include "fp8mla/error.h"
#include "fp8mla/format.h"
#include "src/core/backend.h"

namespace fp8mla::cli {
namespace {

constexpr std::array<ModelPreset, 3> kModels = {{
    {"GLM-5", 78, 8, 0.0625f},
    {"DeepSeek-V3", 61, 16, 0.13523f},
    {"Kimi-K2", 61, 8, 0.13086f},
}};

// Fills the tokens of `pages` with quantized random values, spread over the cores. Each page
// draws from its own generator (seeded by its id), so the pool does not depend on the thread
// count.
void fill_pages(PagedLatentCache& cache, std::span<const std::int32_t> pages, std::uint64_t seed) {
  const CacheConfig& c = cache.config();
  const TensorView storage = cache.storage();
  const std::int64_t tb = token_bytes(c.format);
  auto work = [&](std::size_t begin, std::size_t end) {
    std::array<float, kDimQk> values{};
    for (std::size_t i = begin; i < end; ++i) {
      const std::int32_t page = pages[i];
      Rng rng(seed * 0x100000001b3ull + static_cast<std::uint64_t>(page));
      for (int t = 0; t < c.page_size; ++t) {
        for (float& v : values) v = rng.normal();
        auto* token = static_cast<std::uint8_t*>(storage.data) + page * storage.stride[0] +
                      t * storage.stride[1];
        encode_token(c.format, c.scale, values, std::span(token, static_cast<std::size_t>(tb)));
      }
    }
  };
  const std::size_t threads = std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1,
                                                      std::max<std::size_t>(pages.size() / 64, 1));
  std::vector<std::jthread> pool;
  const std::size_t per = (pages.size() + threads - 1) / threads;
  for (std::size_t k = 1; k < threads; ++k) {
    pool.emplace_back(work, std::min(pages.size(), k * per), std::min(pages.size(), (k + 1) * per));
  }
  work(0, std::min(pages.size(), per));
}

}  // namespace

std::string model_key(const ModelPreset& model) {
  std::string key(model.display);
  for (char& c : key) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return key;
}

const ModelPreset* find_model(std::string_view key) {
  for (const ModelPreset& m : kModels) {
    if (model_key(m) == key) return &m;
  }
  return nullptr;
}

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const ModelPreset& m : kModels) names.push_back(model_key(m));
  return names;
}

Workload make_workload(const WorkloadConfig& config) {
  Workload w;
  w.config = config;
  w.num_pages = (config.pool_tokens + config.page_size - 1) / config.page_size;

  // Contexts: ragged around the mean, as a serving batch is.
  Rng rng(config.seed);
  std::int64_t total_pages = 0;
  w.kv_len.resize(static_cast<std::size_t>(config.batch));
  for (std::int32_t& len : w.kv_len) {
    const double f = config.ragged ? 0.25 + 1.5 * rng.uniform() : 1.0;
    len = std::max(std::max(1, config.qo_len), static_cast<int>(f * config.mean_context));
    total_pages += (len + config.page_size - 1) / config.page_size;
  }
  if (total_pages > w.num_pages) {
    throw Error(ErrorCode::invalid_argument, "--pool",
                "the batch needs " + format_count(total_pages * config.page_size) +
                    " tokens of pages but the pool holds " +
                    format_count(w.num_pages * config.page_size) +
                    ": raise --pool or lower --batch / --context");
  }

  CacheConfig cc;
  cc.num_pages = w.num_pages;
  cc.page_size = config.page_size;
  cc.format = config.format;
  cc.scale = config.scale;
  w.host_cache = std::make_unique<PagedLatentCache>(cc);

  // Scatter the batch's pages through the pool, as a long-running server's free list leaves
  // them: take every page, shuffle, hand out the first ones.
  std::vector<std::int32_t> pages = w.host_cache->allocate(w.num_pages);
  for (std::size_t i = pages.size(); i > 1; --i) {
    std::swap(pages[i - 1], pages[rng.below(i)]);
  }
  w.qo_indptr.push_back(0);
  w.kv_indptr.push_back(0);
  std::size_t next = 0;
  for (const std::int32_t len : w.kv_len) {
    const std::int64_t n = (len + config.page_size - 1) / config.page_size;
    for (std::int64_t i = 0; i < n; ++i) w.kv_indices.push_back(pages[next++]);
    w.qo_indptr.push_back(w.qo_indptr.back() + config.qo_len);
    w.kv_indptr.push_back(static_cast<std::int32_t>(w.kv_indices.size()));
    w.active_tokens += len;
  }
  w.active_pages = static_cast<std::int64_t>(w.kv_indices.size());
  fill_pages(*w.host_cache, w.kv_indices, config.seed);

  if (config.device == DeviceKind::cuda) {
    cc.device = DeviceKind::cuda;
    cc.device_id = config.device_id;
    w.device_cache = std::make_unique<PagedLatentCache>(cc);
    w.device_cache->allocate(w.num_pages);
    const TensorView src = w.host_cache->storage();
    detail::cuda_copy_to_device(w.device_cache->storage().data, src.data,
                                static_cast<std::size_t>(src.numel()));
  }
  return w;
}

KvCacheView bf16_cache_view(const Buffer& buffer, std::int64_t num_pages, int page_size) {
  KvCacheView v;
  v.format = KvFormat::bf16;
  auto* base = static_cast<std::uint16_t*>(buffer.data());
  const std::int64_t page_stride = std::int64_t{page_size} * kDimQk;
  v.ckv = make_strided_view(base, DType::bf16, {num_pages, page_size, kDimCkv},
                            {page_stride, kDimQk, 1}, buffer.device(), buffer.device_id());
  v.kpe = make_strided_view(base + kDimCkv, DType::bf16, {num_pages, page_size, kDimKpe},
                            {page_stride, kDimQk, 1}, buffer.device(), buffer.device_id());
  return v;
}

Problem make_problem(const Workload& w, int num_heads, float sm_scale, KvFormat format,
                     std::int64_t num_pages, std::span<const std::int32_t> kv_indices,
                     DeviceKind device) {
  Problem p;
  p.num_heads = num_heads;
  p.page_size = w.config.page_size;
  p.num_pages = num_pages;
  p.kv_format = format;
  p.causal = true;
  p.sm_scale = sm_scale;
  p.qo_indptr = w.qo_indptr;
  p.kv_indptr = w.kv_indptr;
  p.kv_indices = kv_indices;
  p.kv_len = w.kv_len;
  p.device = device;
  p.device_id = w.config.device_id;
  return p;
}

// ---- Activations / Output ----

Activations::Activations(int total_q_, int heads_, DeviceKind device, int device_id)
    : total_q(total_q_),
      heads(heads_),
      q_nope(static_cast<std::size_t>(total_q_) * heads_ * kDimCkv * 2, device, device_id),
      q_pe(static_cast<std::size_t>(total_q_) * heads_ * kDimKpe * 2, device, device_id),
      host_q_nope(static_cast<std::size_t>(total_q_) * heads_ * kDimCkv),
      host_q_pe(static_cast<std::size_t>(total_q_) * heads_ * kDimKpe) {}

void Activations::draw(Rng& rng) {
  fill_normal_bf16(rng, host_q_nope);
  fill_normal_bf16(rng, host_q_pe);
  q_nope.upload(bytes_of(host_q_nope));
  q_pe.upload(bytes_of(host_q_pe));
}

TensorView Activations::q_nope_view() const {
  return q_nope.view(DType::bf16, {total_q, heads, kDimCkv});
}
TensorView Activations::q_pe_view() const {
  return q_pe.view(DType::bf16, {total_q, heads, kDimKpe});
}

Output::Output(int total_q_, int heads_, DeviceKind device, int device_id)
    : out(static_cast<std::size_t>(total_q_) * heads_ * kDimCkv * 2, device, device_id),
      lse(static_cast<std::size_t>(total_q_) * heads_ * 4, device, device_id),
      total_q(total_q_),
      heads(heads_) {}

TensorView Output::out_view() const {
  return out.view(DType::bf16, {total_q, heads, kDimCkv});
}
TensorView Output::lse_view() const {
  return lse.view(DType::f32, {total_q, heads});
}

void Output::poison() {
  out.upload(bytes_of(std::vector<std::uint8_t>(out.bytes(), 0xff)));
  lse.upload(bytes_of(std::vector<std::uint8_t>(lse.bytes(), 0xff)));
}

std::vector<std::uint16_t> Output::host_out() const {
  std::vector<std::uint16_t> v(out.bytes() / 2);
  out.download(writable_bytes_of(v));
  return v;
}

std::vector<float> Output::host_lse() const {
  std::vector<float> v(lse.bytes() / 4);
  lse.download(writable_bytes_of(v));
  return v;
}

}  // namespace fp8mla::cli
