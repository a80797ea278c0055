// The paged latent KV cache (include/fp8mla/cache.h): storage, page free list, quantizing
// append and host-side token reads.
#include "fp8mla/cache.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <new>

#include "fp8mla/error.h"
#include "src/core/backend.h"
#include "src/core/check.h"

namespace fp8mla {
namespace {

// IEEE half -> float32 (exact: every half is a float32).
float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float32 arithmetic.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  const std::uint32_t float_exponent = exponent == 0x1f ? 0xffu : exponent - 15u + 127u;
  return std::bit_cast<float>(sign | float_exponent << 23 | mantissa << 13);
}

// Element `index` of a bf16, f16 or f32 array, as float32 (exact for all three).
float load_as_float(const void* data, DType dtype, std::int64_t index) {
  switch (dtype) {
    case DType::bf16:
      return bf16_to_float(static_cast<const std::uint16_t*>(data)[index]);
    case DType::f16:
      return f16_to_float(static_cast<const std::uint16_t*>(data)[index]);
    default:
      return static_cast<const float*>(data)[index];
  }
}

TensorView raw_view(void* data, DType dtype, std::array<std::int64_t, 3> shape,
                    std::array<std::int64_t, 3> stride, const CacheConfig& config) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = 3;
  for (int i = 0; i < 3; ++i) {
    t.shape[i] = shape[i];
    t.stride[i] = stride[i];
  }
  t.device = config.device;
  t.device_id = config.device_id;
  return t;
}

void check_config(const CacheConfig& c) {
  using detail::require;
  require(c.num_pages >= 1, "config.num_pages", "must be >= 1, got ", c.num_pages);
  require(c.page_size >= 1 && c.page_size <= kMaxPageSize &&
              std::has_single_bit(static_cast<unsigned>(c.page_size)),
          "config.page_size", "must be a power of two in [1, ", kMaxPageSize, "], got ",
          c.page_size);
  // Slots (page * page_size + offset) are int32 in every index array, so the pool must fit.
  const std::int64_t max_slots = std::numeric_limits<std::int32_t>::max();
  require(c.num_pages <= max_slots / c.page_size, "config.num_pages",
          "num_pages * page_size = ", c.num_pages, " * ", c.page_size,
          " exceeds the int32 slot range ", max_slots);
  require(c.format == KvFormat::bf16 || c.format == KvFormat::fp8_e4m3 ||
              c.format == KvFormat::fp8_e4m3_block,
          "config.format", "unknown KvFormat value ", static_cast<int>(c.format));
  // Checked for every format (the view reports it as ckv_scale / kpe_scale either way).
  require(std::isfinite(c.scale) && c.scale > 0.0f, "config.scale", "must be finite and > 0, got ",
          c.scale);
  require(c.device == DeviceKind::cpu || c.device == DeviceKind::cuda, "config.device",
          "unknown DeviceKind value ", static_cast<int>(c.device));
  require(c.device == DeviceKind::cpu || c.device_id >= 0, "config.device_id", "must be >= 0, got ",
          c.device_id);
}

}  // namespace

struct PagedLatentCache::Impl {
  CacheConfig config;
  std::int64_t token_bytes = 0;
  std::vector<std::uint8_t> host;       // CPU storage
  void* device = nullptr;               // CUDA storage (cuda_malloc)
  std::vector<std::uint8_t> allocated;  // [num_pages] 1 while handed out
  // Free page ids as a min-heap, so allocate() hands out the lowest ids first in
  // O(n log num_pages) and costs 4 bytes per page.
  std::vector<std::int32_t> free_heap;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    if (device) detail::cuda_free(device);
  }

  std::uint8_t* base() const {
    return device ? static_cast<std::uint8_t*>(device) : const_cast<std::uint8_t*>(host.data());
  }
  std::int64_t capacity() const { return config.num_pages * config.page_size; }
};

PagedLatentCache::PagedLatentCache(const CacheConfig& config) try {
  check_config(config);
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->token_bytes = token_bytes(config.format);
  const std::int64_t bytes = impl->capacity() * impl->token_bytes;
  if (config.device == DeviceKind::cuda) {
    const detail::CurrentDeviceGuard keep(true);
    impl->device = detail::cuda_malloc(static_cast<std::size_t>(bytes), config.device_id);
  } else {
    try {
      impl->host.assign(static_cast<std::size_t>(bytes), 0);
    } catch (const std::bad_alloc&) {
      throw Error(ErrorCode::out_of_memory, "config.num_pages",
                  detail::msg("cannot allocate ", bytes, " bytes of host storage"));
    }
  }
  const auto num_pages = static_cast<std::size_t>(config.num_pages);
  impl->allocated.assign(num_pages, 0);
  impl->free_heap.resize(num_pages);
  // Ascending order is already a valid min-heap.
  for (std::size_t i = 0; i < num_pages; ++i) impl->free_heap[i] = static_cast<std::int32_t>(i);
  impl_ = std::move(impl);
} catch (...) {
  detail::rethrow_as_error("PagedLatentCache");
}

PagedLatentCache::~PagedLatentCache() = default;
PagedLatentCache::PagedLatentCache(PagedLatentCache&&) noexcept = default;
PagedLatentCache& PagedLatentCache::operator=(PagedLatentCache&&) noexcept = default;

const CacheConfig& PagedLatentCache::config() const noexcept {
  return impl_->config;
}

std::int64_t PagedLatentCache::free_pages() const noexcept {
  return static_cast<std::int64_t>(impl_->free_heap.size());
}

std::int64_t PagedLatentCache::capacity_tokens() const noexcept {
  return impl_->capacity();
}

std::vector<std::int32_t> PagedLatentCache::allocate(std::int64_t n) try {
  detail::require(n >= 0, "n", "must be >= 0, got ", n);
  if (n > free_pages()) {
    throw Error(ErrorCode::out_of_memory, "n",
                detail::msg("requested ", n, " pages but only ", free_pages(), " of ",
                            impl_->config.num_pages, " are free"));
  }
  std::vector<std::int32_t> pages;
  pages.reserve(static_cast<std::size_t>(n));
  auto& heap = impl_->free_heap;
  for (std::int64_t i = 0; i < n; ++i) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    const std::int32_t page = heap.back();
    heap.pop_back();
    impl_->allocated[static_cast<std::size_t>(page)] = 1;
    pages.push_back(page);
  }
  return pages;
} catch (...) {
  detail::rethrow_as_error("PagedLatentCache::allocate");
}

void PagedLatentCache::release(std::span<const std::int32_t> pages) {
  // Validate everything first (release is all-or-nothing). A repeated id is found by marking
  // pages as we go and undoing the marks before throwing.
  auto& allocated = impl_->allocated;
  const std::int64_t num_pages = impl_->config.num_pages;
  std::size_t checked = 0;
  auto unmark = [&] {
    for (std::size_t j = 0; j < checked; ++j) allocated[static_cast<std::size_t>(pages[j])] = 1;
  };
  for (; checked < pages.size(); ++checked) {
    const std::int32_t page = pages[checked];
    const auto name = detail::join("pages[", checked, "]");  // formatted only on failure
    if (page < 0 || page >= num_pages) {
      unmark();
      detail::require(false, name, "= ", page, " is outside the pool [0, ", num_pages, ")");
    }
    const auto p = static_cast<std::size_t>(page);
    if (allocated[p] != 1) {
      const bool repeated = allocated[p] == 2;
      unmark();
      detail::require(false, name, "= ", page,
                      repeated ? " appears more than once in this release"
                               : " is not allocated (double release?)");
    }
    allocated[p] = 2;  // seen in this call
  }
  auto& heap = impl_->free_heap;
  for (std::int32_t page : pages) {
    allocated[static_cast<std::size_t>(page)] = 0;
    heap.push_back(page);
    std::push_heap(heap.begin(), heap.end(), std::greater<>{});
  }
}

bool PagedLatentCache::is_allocated(std::int32_t page) const {
  // An id outside the pool is simply not allocated; release() is where it is an error.
  return page >= 0 && page < impl_->config.num_pages &&
         impl_->allocated[static_cast<std::size_t>(page)] != 0;
}

void PagedLatentCache::append(const TensorView& slots, const TensorView& ckv, const TensorView& kpe,
                              NanPolicy nan, void* stream) try {
  const CacheConfig& c = impl_->config;
  detail::check_tensor(slots, "slots", {DType::i32}, {-1}, c.device, c.device_id);
  const std::int64_t n = slots.shape[0];
  // Each token has its own slot, so a call writes at most the whole pool (a stride-0 view could
  // otherwise name any number of tokens in a few bytes).
  const std::int64_t capacity = impl_->capacity();
  detail::require(n <= capacity, "slots.shape[0]", n, " tokens exceed the pool's ", capacity,
                  " slots");
  detail::check_tensor(ckv, "ckv", {DType::bf16, DType::f16, DType::f32}, {n, kDimCkv}, c.device,
                       c.device_id);
  detail::check_tensor(kpe, "kpe", {ckv.dtype}, {n, kDimKpe}, c.device, c.device_id);
  if (n == 0) return;
  if (c.device == DeviceKind::cuda) {
    // The device cannot be read without a sync: the kernel skips slots outside the pool and
    // always propagates NaN (documented in cache.h).
    const detail::CurrentDeviceGuard keep(true);
    detail::cuda_append(c, impl_->device, slots, ckv, kpe, stream);
    return;
  }

  // Host: check every slot, then (under NanPolicy::error) every value, and only then write, so a
  // rejected call leaves the cache as it was. Rows are converted one at a time: the memory used
  // does not grow with n.
  const auto* slot_data = slots.as<const std::int32_t>();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t slot = slot_data[i * slots.stride[0]];
    if (slot < 0 || slot >= capacity) {
      detail::require(false, detail::msg("slots[", i, "]"), "= ", slot, " is outside the pool [0, ",
                      capacity, ")");
    }
    const auto page = static_cast<std::int32_t>(slot / c.page_size);
    if (impl_->allocated[static_cast<std::size_t>(page)] == 0) {
      detail::require(false, detail::msg("slots[", i, "]"), "= ", slot, " is on page ", page,
                      ", which is not allocated");
    }
  }
  std::array<float, kDimQk> row;
  const auto load_row = [&](std::int64_t i) {
    for (int j = 0; j < kDimCkv; ++j) {
      row[j] = load_as_float(ckv.data, ckv.dtype, i * ckv.stride[0] + j);
    }
    for (int j = 0; j < kDimKpe; ++j) {
      row[kDimCkv + j] = load_as_float(kpe.data, kpe.dtype, i * kpe.stride[0] + j);
    }
  };
  if (nan == NanPolicy::error) {
    for (std::int64_t i = 0; i < n; ++i) {
      load_row(i);
      for (int j = 0; j < kDimQk; ++j) {
        if (!std::isnan(row[j])) continue;
        const bool in_ckv = j < kDimCkv;
        detail::require(
            false, detail::msg(in_ckv ? "ckv[" : "kpe[", i, ", ", in_ckv ? j : j - kDimCkv, "]"),
            "is NaN (NanPolicy::error); nothing was written");
      }
    }
  }
  const std::int64_t tb = impl_->token_bytes;
  std::uint8_t* base = impl_->base();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t slot = slot_data[i * slots.stride[0]];
    load_row(i);
    encode_token(c.format, c.scale, row,
                 std::span<std::uint8_t>(base + slot * tb, static_cast<std::size_t>(tb)),
                 NanPolicy::propagate);
  }
} catch (...) {
  detail::rethrow_as_error("PagedLatentCache::append");
}

TensorView PagedLatentCache::storage() const noexcept {
  const CacheConfig& c = impl_->config;
  const std::int64_t tb = impl_->token_bytes;
  return raw_view(impl_->base(), DType::u8, {c.num_pages, c.page_size, tb},
                  {c.page_size * tb, tb, 1}, c);
}

KvCacheView PagedLatentCache::view() const noexcept {
  const CacheConfig& c = impl_->config;
  const std::int64_t ps = c.page_size;
  std::uint8_t* base = impl_->base();
  KvCacheView v;
  v.format = c.format;
  v.ckv_scale = c.scale;
  v.kpe_scale = c.scale;
  switch (c.format) {
    case KvFormat::bf16:
      // Strides in bf16 elements: a token is 576 of them, kpe starts 512 in (byte 1024).
      v.ckv = raw_view(base, DType::bf16, {c.num_pages, ps, kDimCkv}, {ps * kDimQk, kDimQk, 1}, c);
      v.kpe = raw_view(base + 2 * kDimCkv, DType::bf16, {c.num_pages, ps, kDimKpe},
                       {ps * kDimQk, kDimQk, 1}, c);
      break;
    case KvFormat::fp8_e4m3:
      v.ckv =
          raw_view(base, DType::fp8_e4m3, {c.num_pages, ps, kDimCkv}, {ps * kDimQk, kDimQk, 1}, c);
      v.kpe = raw_view(base + kDimCkv, DType::fp8_e4m3, {c.num_pages, ps, kDimKpe},
                       {ps * kDimQk, kDimQk, 1}, c);
      break;
    case KvFormat::fp8_e4m3_block: {
      const std::int64_t tb = impl_->token_bytes;
      v.ckv = raw_view(base, DType::u8, {c.num_pages, ps, tb}, {ps * tb, tb, 1}, c);
      break;  // kpe stays undefined: the rope part lives inside each 656-byte token
    }
  }
  return v;
}

void PagedLatentCache::read_token(std::int64_t slot, std::span<float> out) const {
  const CacheConfig& c = impl_->config;
  const std::int64_t capacity = impl_->capacity();
  detail::require(slot >= 0 && slot < capacity, "slot", "= ", slot, " is outside the pool [0, ",
                  capacity, ")");
  detail::require(out.size() == static_cast<std::size_t>(kDimQk), "out", "expected ", kDimQk,
                  " values, got ", out.size());
  const auto tb = static_cast<std::size_t>(impl_->token_bytes);
  const std::uint8_t* token = impl_->base() + slot * impl_->token_bytes;
  if (c.device == DeviceKind::cuda) {
    std::vector<std::uint8_t> copy(tb);
    detail::cuda_copy_to_host(copy.data(), token, tb);
    decode_token(c.format, c.scale, copy, out);
    return;
  }
  decode_token(c.format, c.scale, std::span<const std::uint8_t>(token, tb), out);
}

}  // namespace fp8mla
