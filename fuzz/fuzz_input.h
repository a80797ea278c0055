// The fuzz targets' input decoder: a byte string read front to back as little-endian fields.
//
// A field is either taken raw (any value, extremes included: what a hostile caller passes) or
// folded into a small range (what a valid call looks like, so the fuzzer gets past the first
// checks and into the planner and the kernels). The mode byte before each folded field decides;
// past the end every read gives 0. fuzz/seeds.py writes inputs in this format.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace fp8mla::fuzz {

// A finding the targets check themselves (a wrong result, a refused call that wrote): abort, which
// libFuzzer reports as a crash with the input.
inline void require(bool ok) {
  if (!ok) std::abort();
}

class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

  std::uint8_t u8() { return read<std::uint8_t>(); }
  std::int32_t i32() { return read<std::int32_t>(); }
  std::int64_t i64() { return read<std::int64_t>(); }
  float f32() { return read<float>(); }
  bool flag() { return (u8() & 1) != 0; }

  // Mode byte, then a raw i32: mode 0 keeps the raw value, any other folds it into [lo, hi].
  std::int32_t int_in(std::int32_t lo, std::int32_t hi) {
    const std::uint8_t mode = u8();
    const std::int32_t raw = i32();
    if (mode == 0) return raw;
    const auto span = static_cast<std::uint64_t>(std::int64_t{hi} - lo + 1);
    return static_cast<std::int32_t>(
        lo + static_cast<std::int64_t>(static_cast<std::uint32_t>(raw) % span));
  }
  // A count for the fuzzer's own buffers (not an argument of the library): a mode byte and an
  // i32 like int_in, always folded into [0, max].
  std::size_t size_in(std::size_t max) {
    (void)u8();
    return static_cast<std::uint32_t>(i32()) % (max + 1);
  }
  // The same for 64-bit values.
  std::int64_t int64_in(std::int64_t lo, std::int64_t hi) {
    const std::uint8_t mode = u8();
    const std::int64_t raw = i64();
    if (mode == 0) return raw;
    // In unsigned arithmetic: hi - lo + 1 wraps to 0 only for the full range.
    const std::uint64_t span = static_cast<std::uint64_t>(hi) - static_cast<std::uint64_t>(lo) + 1;
    if (span == 0) return raw;
    return static_cast<std::int64_t>(static_cast<std::uint64_t>(lo) +
                                     static_cast<std::uint64_t>(raw) % span);
  }

  // An int32 array: mode byte, count (u16, at most `max_count`), then
  //   mode 0: raw values;  mode 1: offsets from 0, each step a u8 (valid indptr arrays);
  //   mode 2: values in [lo, hi] (one mode byte + i32 each, as int_in).
  std::vector<std::int32_t> array(std::size_t max_count, std::int32_t lo, std::int32_t hi) {
    const std::uint8_t mode = u8();
    std::size_t n = read<std::uint16_t>();
    if (n > max_count) n = max_count;
    std::vector<std::int32_t> a(n);
    std::int32_t sum = 0;
    for (std::size_t i = 0; i < n; ++i) {
      switch (mode % 3) {
        case 0:
          a[i] = i32();
          break;
        case 1:
          a[i] = i == 0 ? 0 : (sum += u8());
          break;
        default:
          a[i] = int_in(lo, hi);
          break;
      }
    }
    return a;
  }

  bool exhausted() const { return pos_ >= size_; }

 private:
  template <class T>
  T read() {
    T v{};
    if (pos_ + sizeof(T) <= size_) {
      std::memcpy(&v, data_ + pos_, sizeof(T));
    } else if (pos_ < size_) {
      std::memcpy(&v, data_ + pos_, size_ - pos_);
    }
    pos_ += sizeof(T);
    return v;
  }

  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

}  // namespace fp8mla::fuzz
