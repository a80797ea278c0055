// The bytes of a trace file, read in chunks and inflated on the fly when the file is gzip
// (recognised by its magic bytes, not its name), so a trace of any size is read in bounded
// memory.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

namespace fp8mla::audit {

class TraceSource {
 public:
  // Opens `path`; throws TraceError when it cannot be read, or when it is gzip and this build
  // has no zlib.
  explicit TraceSource(const std::string& path);
  ~TraceSource();
  TraceSource(const TraceSource&) = delete;
  TraceSource& operator=(const TraceSource&) = delete;

  // Appends up to `max` further bytes of the (decompressed) trace to `out`; false once there
  // are none. Throws TraceError for a truncated or corrupt gzip stream.
  bool read(std::string& out, std::size_t max);

  bool gzip() const { return gzip_; }
  std::int64_t file_bytes() const { return file_bytes_; }
  std::int64_t bytes_out() const { return bytes_out_; }  // decompressed bytes delivered

 private:
  struct Inflater;
  bool read_plain(std::string& out, std::size_t max);
  bool read_gzip(std::string& out, std::size_t max);
  std::string path_;
  std::FILE* file_ = nullptr;
  bool gzip_ = false;
  bool at_end_ = false;
  std::int64_t file_bytes_ = 0;
  std::int64_t bytes_in_ = 0;  // compressed bytes read
  std::int64_t bytes_out_ = 0;
  std::unique_ptr<Inflater> inflater_;
};

}  // namespace fp8mla::audit
