#include "tools/fp8mla/audit/trace_source.h"

#include <cerrno>
#include <cstring>
#include <vector>

#include "tools/fp8mla/audit/trace_error.h"

#if FP8MLA_HAVE_ZLIB
#include <zlib.h>
#endif

namespace fp8mla::audit {

#if FP8MLA_HAVE_ZLIB
struct TraceSource::Inflater {
  z_stream z{};
  std::vector<unsigned char> in = std::vector<unsigned char>(1 << 20);
  bool member_done = false;  // the last inflate() ended a gzip member
  Inflater() {
    // 16 + MAX_WBITS: gzip framing (header and CRC checked by zlib).
    if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) throw TraceError("zlib: inflateInit2 failed");
  }
  ~Inflater() { inflateEnd(&z); }
};
#else
struct TraceSource::Inflater {};
#endif

TraceSource::TraceSource(const std::string& path) : path_(path) {
  file_ = std::fopen(path.c_str(), "rb");
  if (file_ == nullptr) {
    throw TraceError(path + ": cannot open: " + std::strerror(errno));
  }
  if (std::fseek(file_, 0, SEEK_END) == 0) {
    file_bytes_ = std::ftell(file_);
    std::fseek(file_, 0, SEEK_SET);
  }
  unsigned char magic[2] = {0, 0};
  const std::size_t got = std::fread(magic, 1, 2, file_);
  std::fseek(file_, 0, SEEK_SET);
  gzip_ = got == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
  if (gzip_) {
#if FP8MLA_HAVE_ZLIB
    inflater_ = std::make_unique<Inflater>();
#else
    throw TraceError(path +
                     ": gzip-compressed, and this build of fp8mla has no zlib "
                     "(install zlib1g-dev and re-run cmake, or gunzip the trace)");
#endif
  }
}

TraceSource::~TraceSource() {
  if (file_ != nullptr) std::fclose(file_);
}

bool TraceSource::read(std::string& out, std::size_t max) {
  if (at_end_ || max == 0) return false;
  return gzip_ ? read_gzip(out, max) : read_plain(out, max);
}

bool TraceSource::read_plain(std::string& out, std::size_t max) {
  const std::size_t old = out.size();
  out.resize(old + max);
  const std::size_t got = std::fread(out.data() + old, 1, max, file_);
  out.resize(old + got);
  if (got == 0) {
    if (std::ferror(file_)) throw TraceError(path_ + ": read error: " + std::strerror(errno));
    at_end_ = true;
    return false;
  }
  bytes_in_ += static_cast<std::int64_t>(got);
  bytes_out_ += static_cast<std::int64_t>(got);
  return true;
}

#if FP8MLA_HAVE_ZLIB
bool TraceSource::read_gzip(std::string& out, std::size_t max) {
  z_stream& z = inflater_->z;
  const std::size_t old = out.size();
  out.resize(old + max);
  z.next_out = reinterpret_cast<Bytef*>(out.data() + old);
  z.avail_out = static_cast<uInt>(max);
  while (z.avail_out > 0) {
    if (z.avail_in == 0) {
      const std::size_t got = std::fread(inflater_->in.data(), 1, inflater_->in.size(), file_);
      if (got == 0) {
        if (std::ferror(file_)) throw TraceError(path_ + ": read error: " + std::strerror(errno));
        if (!inflater_->member_done) {
          throw TraceError(
              path_ + ": the gzip stream ends early at byte " + std::to_string(bytes_in_) +
              " of the file (" +
              std::to_string(bytes_out_ + static_cast<std::int64_t>(max - z.avail_out)) +
              " bytes of JSON inflated): the file is truncated");
        }
        at_end_ = true;
        break;
      }
      bytes_in_ += static_cast<std::int64_t>(got);
      z.next_in = inflater_->in.data();
      z.avail_in = static_cast<uInt>(got);
    }
    if (inflater_->member_done) {
      // Another gzip member follows (concatenated gzip files inflate to their concatenation).
      if (inflateReset(&z) != Z_OK) throw TraceError("zlib: inflateReset failed");
      inflater_->member_done = false;
    }
    const int rc = inflate(&z, Z_NO_FLUSH);
    if (rc == Z_STREAM_END) {
      inflater_->member_done = true;
    } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
      const std::int64_t at = bytes_in_ - static_cast<std::int64_t>(z.avail_in);
      throw TraceError(path_ + ": corrupt gzip data near byte " + std::to_string(at) +
                       " of the file: " + (z.msg != nullptr ? z.msg : "inflate failed"));
    }
  }
  const std::size_t produced = max - z.avail_out;
  out.resize(old + produced);
  bytes_out_ += static_cast<std::int64_t>(produced);
  return produced > 0 || !at_end_;
}
#else
bool TraceSource::read_gzip(std::string&, std::size_t) {
  return false;
}
#endif

}  // namespace fp8mla::audit
