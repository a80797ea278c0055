// Helpers shared by the `fp8mla` subcommands: device-agnostic buffers, timing, random data,
// comparisons, number formatting, a progress bar and a small JSON writer.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fp8mla/tensor.h"

namespace fp8mla::cli {

// Bytes on the host or on a CUDA device (zero-filled), freed on destruction. The same code
// then runs on either: host data is built on the CPU and uploaded, results are downloaded.
class Buffer {
 public:
  Buffer() = default;
  Buffer(std::size_t bytes, DeviceKind device, int device_id = 0);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }
  DeviceKind device() const noexcept { return device_; }
  int device_id() const noexcept { return device_id_; }
  // Copies `host` into the buffer's first host.size() bytes (synchronous).
  void upload(std::span<const std::byte> host);
  // Copies the buffer's first out.size() bytes into `out` (synchronous).
  void download(std::span<std::byte> out) const;
  // A dense row-major view of the buffer's memory.
  TensorView view(DType dtype, std::initializer_list<std::int64_t> shape) const;

 private:
  void reset() noexcept;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  DeviceKind device_ = DeviceKind::cpu;
  int device_id_ = 0;
  std::vector<std::byte> host_;  // storage for CPU buffers
};

template <class T>
std::span<const std::byte> bytes_of(const std::vector<T>& v) {
  return std::as_bytes(std::span(v));
}
template <class T>
std::span<std::byte> writable_bytes_of(std::vector<T>& v) {
  return std::as_writable_bytes(std::span(v));
}

// Waits for the device (no-op on the CPU): timing brackets a region with it.
void synchronize(DeviceKind device, int device_id);

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// splitmix64: tiny, fast and identical on every platform (std distributions are not), so a
// seed names the same experiment everywhere.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n).
  std::uint64_t below(std::uint64_t n) noexcept { return next() % n; }
  // Uniform in [0, 1).
  double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Approximately standard normal (sum of four uniforms, rescaled: mean 0, variance 1); the
  // tails stop at +-3.46, which is all random attention data needs and costs no libm call.
  float normal() noexcept {
    const std::uint64_t r = next();
    const int s = static_cast<int>(r & 0xffff) + static_cast<int>((r >> 16) & 0xffff) +
                  static_cast<int>((r >> 32) & 0xffff) + static_cast<int>(r >> 48);
    return static_cast<float>(s - 2 * 65535) * (1.7320508f / 65535.0f);
  }

 private:
  std::uint64_t state_;
};

// Fills `out` with bf16 bit patterns of normal values (scaled by `stddev`).
void fill_normal_bf16(Rng& rng, std::span<std::uint16_t> out, float stddev = 1.0f);

struct Comparison {
  double rel_l2 = 0.0;            // ||a - b|| / ||b|| over all elements
  double max_abs = 0.0;           // max |a - b|
  std::int64_t nan_mismatch = 0;  // elements where exactly one side is NaN, or NaN on both
};
Comparison compare_bf16(std::span<const std::uint16_t> a, std::span<const std::uint16_t> b);
// Like compare_bf16 for float32; infinities of equal sign compare equal (lse = -inf rows).
Comparison compare_f32(std::span<const float> a, std::span<const float> b);
// True when the comparison is within tolerance and clean of NaN (NaN never passes).
inline bool passes(const Comparison& c, double rel_tol) {
  return c.nan_mismatch == 0 && c.rel_l2 <= rel_tol;
}

// "37.7 MB", "1.20 GB" (decimal units, as bandwidth figures use).
std::string format_bytes(double bytes);
// "12,345".
std::string format_count(std::int64_t n);
// "1 layer", "78 layers", "1,024 pages": format_count(n) and the noun, plural ("s") unless n is 1.
std::string count_of(std::int64_t n, std::string_view noun);
// Fixed-point with `digits` decimals.
std::string format_fixed(double v, int digits);
// "1.2e-03".
std::string format_sci(double v);

// A one-line progress bar on stderr, drawn only when stderr is a terminal and it is enabled.
class Progress {
 public:
  Progress(std::string label, std::int64_t total, bool enabled);
  ~Progress();
  void update(std::int64_t done);
  void clear();   // erases the bar (before printing a line of output); update() redraws it
  void finish();  // erases the bar for good

 private:
  std::string label_;
  std::int64_t total_;
  bool enabled_;
  Clock::time_point start_ = Clock::now();
};

// Writes JSON with correct commas and escaping; values are appended in document order.
class JsonWriter {
 public:
  JsonWriter& begin_object(std::string_view key = {});
  JsonWriter& end_object();
  JsonWriter& begin_array(std::string_view key = {});
  JsonWriter& end_array();
  JsonWriter& value(std::string_view key, std::string_view v);
  JsonWriter& value(std::string_view key, const char* v) { return value(key, std::string_view(v)); }
  JsonWriter& value(std::string_view key, double v);
  JsonWriter& value(std::string_view key, std::int64_t v);
  JsonWriter& value(std::string_view key, int v) { return value(key, std::int64_t{v}); }
  JsonWriter& value(std::string_view key, bool v);
  const std::string& str() const { return out_; }
  // Writes the document to `path`; throws std::runtime_error naming the path on failure.
  void save(const std::string& path) const;

 private:
  void prefix(std::string_view key);
  void newline(std::size_t depth);
  void quoted(std::string_view s);
  std::string out_;
  std::vector<bool> first_;  // per open container: no element written yet
};

// Checks before a run that `path` can be written (created, or rewritten), so a command fails at
// once instead of after its work; a file the check creates is removed again. Throws UsageError
// "<command>: <option>: cannot write '<path>' (<reason>)".
void require_writable(std::string_view command, std::string_view option, const std::string& path);

// Throws Error(unsupported) naming "--device cuda" and saying why in words (no CUDA backend in
// this build, no NVIDIA driver, no device) unless a CUDA device is visible.
void require_cuda_device();

}  // namespace fp8mla::cli
