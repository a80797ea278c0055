// Builds Chrome trace JSON for the audit tests: events written as torch.profiler writes them,
// and helpers to store text (plain or gzip) in a temporary file.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#if FP8MLA_HAVE_ZLIB
#include <zlib.h>
#endif

namespace fp8mla::audit::testing {

struct Ev {
  Ev() = default;
  Ev(std::string c, std::string n, double t, double d)
      : cat(std::move(c)), name(std::move(n)), ts(t), dur(d) {}
  std::string cat = "cpu_op";
  std::string name;
  double ts = 0, dur = 0;
  std::int64_t pid = 1, tid = 1;
  std::int64_t external_id = -1, correlation = -1;
  std::string shapes;  // "Input Dims" JSON, e.g. "[[8192, 1, 576], []]"
  std::string types;   // "Input type" JSON, e.g. "[\"c10::Float8_e4m3fn\", \"Scalar\"]"
};

inline std::string escape_json(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

inline std::string event_json(const Ev& e) {
  char buf[160];
  std::string s = "  {\n    \"ph\": \"X\", \"cat\": \"" + e.cat + "\", \"name\": \"" +
                  escape_json(e.name) + "\", ";
  std::snprintf(buf, sizeof buf, "\"pid\": %lld, \"tid\": %lld,\n    \"ts\": %.3f, \"dur\": %.3f",
                static_cast<long long>(e.pid), static_cast<long long>(e.tid), e.ts, e.dur);
  s += buf;
  s += ",\n    \"args\": {";
  bool first = true;
  auto arg = [&](const std::string& kv) {
    s += (first ? "" : ", ") + kv;
    first = false;
  };
  if (e.external_id >= 0) arg("\"External id\": " + std::to_string(e.external_id));
  if (e.correlation >= 0) arg("\"correlation\": " + std::to_string(e.correlation));
  if (!e.types.empty()) arg("\"Input type\": " + e.types);
  if (!e.shapes.empty()) arg("\"Input Dims\": " + e.shapes);
  s += "}\n  }";
  return s;
}

// {"schemaVersion": 1, "deviceProperties": [...], "traceEvents": [ ... ], "traceName": ...}
inline std::string trace_json(const std::vector<Ev>& events, const std::string& device = "") {
  std::string s = "{\n  \"schemaVersion\": 1,\n  \"deviceProperties\": [";
  if (!device.empty()) s += "{\"id\": 0, \"name\": \"" + device + "\"}";
  s += "],\n  \"traceEvents\": [\n";
  for (std::size_t i = 0; i < events.size(); ++i) {
    s += event_json(events[i]);
    s += i + 1 < events.size() ? ",\n" : "\n";
  }
  s += "  ],\n  \"traceName\": \"test\"\n}\n";
  return s;
}

inline std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("fp8mla_audit_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

inline std::string write_file(const std::string& name, const std::string& text) {
  const std::string path = temp_path(name);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

#if FP8MLA_HAVE_ZLIB
inline std::string gzip_bytes(const std::string& text) {
  z_stream z{};
  deflateInit2(&z, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&z, static_cast<uLong>(text.size())) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  z.avail_in = static_cast<uInt>(text.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}
#endif

}  // namespace fp8mla::audit::testing
