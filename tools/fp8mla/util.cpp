#include "tools/fp8mla/util.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <utility>

#include "fp8mla/error.h"
#include "fp8mla/format.h"
#include "src/core/backend.h"
#include "tools/fp8mla/args.h"

namespace fp8mla::cli {

// ---- Buffer ----

Buffer::Buffer(std::size_t bytes, DeviceKind device, int device_id)
    : bytes_(bytes), device_(device), device_id_(device_id) {
  if (device == DeviceKind::cuda) {
    data_ = detail::cuda_malloc(std::max<std::size_t>(bytes, 1), device_id);
  } else {
    host_.resize(std::max<std::size_t>(bytes, 1));
    data_ = host_.data();
  }
}

Buffer::~Buffer() {
  reset();
}

Buffer::Buffer(Buffer&& other) noexcept {
  *this = std::move(other);
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    // A moved std::vector keeps its heap block, so data_ stays valid for CPU buffers.
    host_ = std::move(other.host_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
    device_id_ = other.device_id_;
  }
  return *this;
}

void Buffer::reset() noexcept {
  if (device_ == DeviceKind::cuda && data_ != nullptr) detail::cuda_free(data_);
  data_ = nullptr;
  bytes_ = 0;
  host_.clear();
}

void Buffer::upload(std::span<const std::byte> host) {
  if (host.size() > bytes_) throw std::logic_error("Buffer::upload: source larger than buffer");
  if (host.empty()) return;
  if (device_ == DeviceKind::cuda) {
    detail::cuda_copy_to_device(data_, host.data(), host.size());
  } else {
    std::memcpy(data_, host.data(), host.size());
  }
}

void Buffer::download(std::span<std::byte> out) const {
  if (out.size() > bytes_) throw std::logic_error("Buffer::download: target larger than buffer");
  if (out.empty()) return;
  if (device_ == DeviceKind::cuda) {
    detail::cuda_copy_to_host(out.data(), data_, out.size());
  } else {
    std::memcpy(out.data(), data_, out.size());
  }
}

TensorView Buffer::view(DType dtype, std::initializer_list<std::int64_t> shape) const {
  return make_view(data_, dtype, shape, device_, device_id_);
}

void synchronize(DeviceKind device, int device_id) {
  if (device == DeviceKind::cuda) detail::cuda_synchronize(device_id);
}

void fill_normal_bf16(Rng& rng, std::span<std::uint16_t> out, float stddev) {
  for (std::uint16_t& v : out) v = float_to_bf16(rng.normal() * stddev);
}

// ---- comparisons ----

namespace {
template <class Get>
Comparison compare(std::size_t n, Get get) {
  Comparison c;
  double diff2 = 0.0;
  double ref2 = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto [a, b] = get(i);
    if (std::isnan(a) || std::isnan(b)) {
      ++c.nan_mismatch;  // NaN in an attention output is always a failure here
      continue;
    }
    if (std::isinf(a) || std::isinf(b)) {
      if (a != b) ++c.nan_mismatch;  // an infinity must be matched exactly
      continue;
    }
    const double d = a - b;
    diff2 += d * d;
    ref2 += b * b;
    c.max_abs = std::max(c.max_abs, std::fabs(d));
  }
  c.rel_l2 = ref2 > 0.0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  return c;
}
}  // namespace

Comparison compare_bf16(std::span<const std::uint16_t> a, std::span<const std::uint16_t> b) {
  if (a.size() != b.size()) throw std::logic_error("compare_bf16: sizes differ");
  return compare(a.size(), [&](std::size_t i) {
    return std::pair<double, double>(bf16_to_float(a[i]), bf16_to_float(b[i]));
  });
}

Comparison compare_f32(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) throw std::logic_error("compare_f32: sizes differ");
  return compare(a.size(), [&](std::size_t i) { return std::pair<double, double>(a[i], b[i]); });
}

// ---- formatting ----

std::string format_fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

std::string format_sci(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.1e", v);
  return buf;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "kB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 1000.0 && u < 4) {
    bytes /= 1000.0;
    ++u;
  }
  return format_fixed(bytes, u == 0 ? 0 : bytes < 10.0 ? 2 : 1) + " " + units[u];
}

std::string format_count(std::int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i != 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

std::string count_of(std::int64_t n, std::string_view noun) {
  std::string out = format_count(n) + " ";
  out += noun;
  if (n != 1) out += 's';
  return out;
}

// ---- Progress ----

Progress::Progress(std::string label, std::int64_t total, bool enabled)
    : label_(std::move(label)),
      total_(std::max<std::int64_t>(total, 1)),
      enabled_(enabled && isatty(STDERR_FILENO) != 0) {}

Progress::~Progress() {
  finish();
}

void Progress::update(std::int64_t done) {
  if (!enabled_) return;
  constexpr int kWidth = 30;
  const double fraction =
      std::clamp(static_cast<double>(done) / static_cast<double>(total_), 0.0, 1.0);
  const int filled = static_cast<int>(fraction * kWidth);
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.resize(kWidth, '.');
  std::fprintf(stderr, "\r%s [%s] %lld/%lld  %.1f s", label_.c_str(), bar.c_str(),
               static_cast<long long>(done), static_cast<long long>(total_), seconds_since(start_));
  std::fflush(stderr);
}

void Progress::clear() {
  if (!enabled_) return;
  std::fprintf(stderr, "\r\033[K");  // erase the bar so output below starts clean
  std::fflush(stderr);
}

void Progress::finish() {
  clear();
  enabled_ = false;
}

// ---- JsonWriter ----

namespace {
std::string escape(std::string_view s) {
  std::string out;
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out;
}
}  // namespace

// Appends piecewise: GCC 12 warns falsely (-Wrestrict) on "literal" + std::string at -O3.
void JsonWriter::newline(std::size_t depth) {
  out_ += '\n';
  out_.append(2 * depth, ' ');
}

void JsonWriter::quoted(std::string_view s) {
  out_ += '"';
  out_ += escape(s);
  out_ += '"';
}

void JsonWriter::prefix(std::string_view key) {
  if (!first_.empty()) {
    if (!first_.back()) out_ += ',';
    first_.back() = false;
    newline(first_.size());
  }
  if (!key.empty()) {
    quoted(key);
    out_ += ": ";
  }
}

JsonWriter& JsonWriter::begin_object(std::string_view key) {
  prefix(key);
  out_ += "{";
  first_.push_back(true);
  return *this;
}

JsonWriter& JsonWriter::end_object() {
  const bool empty = first_.back();
  first_.pop_back();
  if (!empty) newline(first_.size());
  out_ += "}";
  return *this;
}

JsonWriter& JsonWriter::begin_array(std::string_view key) {
  prefix(key);
  out_ += "[";
  first_.push_back(true);
  return *this;
}

JsonWriter& JsonWriter::end_array() {
  const bool empty = first_.back();
  first_.pop_back();
  if (!empty) newline(first_.size());
  out_ += "]";
  return *this;
}

JsonWriter& JsonWriter::value(std::string_view key, std::string_view v) {
  prefix(key);
  quoted(v);
  return *this;
}

JsonWriter& JsonWriter::value(std::string_view key, double v) {
  prefix(key);
  if (std::isfinite(v)) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.6g", v);
    out_ += buf;
  } else {
    out_ += "null";  // JSON has no inf/NaN
  }
  return *this;
}

JsonWriter& JsonWriter::value(std::string_view key, std::int64_t v) {
  prefix(key);
  out_ += std::to_string(v);
  return *this;
}

JsonWriter& JsonWriter::value(std::string_view key, bool v) {
  prefix(key);
  out_ += v ? "true" : "false";
  return *this;
}

void JsonWriter::save(const std::string& path) const {
  std::ofstream f(path);
  f << out_ << "\n";
  if (!f) throw std::runtime_error("--json: cannot write '" + path + "'");
}

// ---- checks before a run ----

void require_writable(std::string_view command, std::string_view option, const std::string& path) {
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  errno = 0;
  const bool ok = std::ofstream(path, std::ios::app).good();
  const int err = errno;
  if (!existed) std::filesystem::remove(path, ec);
  if (!ok) {
    std::string message(command);
    message += ": ";
    message += option;
    message += ": cannot write '" + path + "'";
    if (err != 0) message += std::string(" (") + std::strerror(err) + ")";
    throw UsageError(message);
  }
}

void require_cuda_device() {
  const std::string why = detail::cuda_unavailable_reason();
  if (!why.empty()) throw Error(ErrorCode::unsupported, "--device cuda", why);
}

}  // namespace fp8mla::cli
