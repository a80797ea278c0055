// fp8mla: the paged latent KV cache.
//
// Storage is one buffer of [num_pages, page_size, token_bytes(format)] bytes, on the host or on
// a CUDA device. A token lives at a global slot = page * page_size + offset. Attention reads the
// cache through a KvCacheView, which callers can also build over memory they own (e.g. SGLang's
// or FlashInfer's pool tensors) without a PagedLatentCache.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "fp8mla/format.h"
#include "fp8mla/tensor.h"

namespace fp8mla {

// How attention sees a paged cache. Shapes (strides are free, innermost stride must be 1):
//   bf16:           ckv bf16     [num_pages, page_size, 512], kpe bf16     [num_pages, page_size,
//   64] fp8_e4m3:       ckv fp8_e4m3 [num_pages, page_size, 512], kpe fp8_e4m3 [num_pages,
//   page_size, 64]
//                   (u8 is accepted for fp8_e4m3 data: many frameworks store FP8 as bytes)
//   fp8_e4m3_block: ckv u8       [num_pages, page_size, 656] (the whole token); kpe undefined
// ckv_scale / kpe_scale: real = code * scale, fp8_e4m3 only (SGLang's pool is unscaled: 1.0).
struct KvCacheView {
  KvFormat format = KvFormat::fp8_e4m3;
  TensorView ckv;
  TensorView kpe;
  float ckv_scale = 1.0f;
  float kpe_scale = 1.0f;
};

struct CacheConfig {
  std::int64_t num_pages = 0;  // >= 1
  int page_size = 1;           // power of two in [1, 128]
  KvFormat format = KvFormat::fp8_e4m3;
  float scale = 1.0f;  // fp8_e4m3 only: real = code * scale; finite and > 0
  DeviceKind device = DeviceKind::cpu;
  int device_id = 0;
};

class PagedLatentCache {
 public:
  // Allocates num_pages * page_size * token_bytes bytes on config.device (zero-filled) and puts
  // every page on the free list. Errors: invalid_argument for a bad config (names the field and
  // its bound), unsupported for DeviceKind::cuda in a build without CUDA, out_of_memory.
  explicit PagedLatentCache(const CacheConfig& config);
  ~PagedLatentCache();
  PagedLatentCache(PagedLatentCache&&) noexcept;
  PagedLatentCache& operator=(PagedLatentCache&&) noexcept;
  PagedLatentCache(const PagedLatentCache&) = delete;
  PagedLatentCache& operator=(const PagedLatentCache&) = delete;

  const CacheConfig& config() const noexcept;
  std::int64_t free_pages() const noexcept;
  std::int64_t capacity_tokens() const noexcept;  // num_pages * page_size

  // Takes n pages off the free list (lowest ids first, so runs are deterministic) and returns
  // their ids. Errors: n < 0; out_of_memory when fewer than n are free, and then nothing is
  // taken: pages already handed out and the data in them stay as they were.
  std::vector<std::int32_t> allocate(std::int64_t n);
  // Returns pages to the free list. All-or-nothing: an id outside [0, num_pages), an id not
  // currently allocated (double release) or repeated in `pages` throws invalid_argument and
  // releases none. Data in released pages is left in place (it is not read again).
  void release(std::span<const std::int32_t> pages);
  bool is_allocated(std::int32_t page) const;

  // Quantizing append: writes token i (ckv[i], kpe[i]) at global slot slots[i].
  //   slots: i32 [n]; ckv: bf16|f16|f32 [n, 512]; kpe: same dtype [n, 64]; rows may be strided.
  // All on the cache's device (a CUDA cache takes device tensors and runs on `stream`, a
  // cudaStream_t passed as void*; nullptr = the default stream).
  // At most capacity_tokens() tokens a call (invalid_argument naming slots.shape[0] beyond).
  // Host caches check every slot (inside the pool and on an allocated page) before writing
  // anything, and convert one token at a time (no memory grows with n). A CUDA cache cannot read device slots without a sync, so its kernel skips a slot
  // outside the pool (it never writes outside the cache) and does not check allocation.
  // NanPolicy::error is checked on the host only (device append propagates; documented).
  void append(const TensorView& slots, const TensorView& ckv, const TensorView& kpe,
              NanPolicy nan = NanPolicy::propagate, void* stream = nullptr);

  // Raw storage, u8 [num_pages, page_size, token_bytes] on the cache's device.
  TensorView storage() const noexcept;
  // The view attention reads (ckv and kpe as strided views into storage()).
  KvCacheView view() const noexcept;

  // Host-side read of one token, decoded to 576 floats (for tests and tools; a CUDA cache copies
  // the token back synchronously). Errors: slot outside the pool, out.size() != 576.
  void read_token(std::int64_t slot, std::span<float> out) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fp8mla
