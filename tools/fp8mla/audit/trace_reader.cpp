#include "tools/fp8mla/audit/trace_reader.h"

#include <chrono>
#include <cstring>
#include <string_view>
#include <vector>

#include "fp8mla/error.h"
#include "tools/fp8mla/audit/trace_error.h"
#include "tools/fp8mla/audit/trace_framer.h"
#include "tools/fp8mla/audit/trace_source.h"

#if FP8MLA_HAVE_SIMDJSON
#include <simdjson.h>
#endif

namespace fp8mla::audit {

#if !FP8MLA_HAVE_SIMDJSON

bool trace_reader_built() {
  return false;
}

Trace read_trace(const std::string&, const ReadOptions&) {
  throw Error(ErrorCode::unsupported, "audit",
              "this build of fp8mla has no trace reader: it was configured without simdjson "
              "(Debian/Ubuntu: apt-get install libsimdjson-dev zlib1g-dev, then re-run cmake)");
}

#else

namespace od = simdjson::ondemand;

namespace {

struct DType {
  std::string_view name;
  int bytes;
  bool fp8;
};
// record_shapes' "Input type" strings for tensor arguments (c10's C++ type names).
constexpr DType kDTypes[] = {
    {"c10::BFloat16", 2, false},
    {"c10::Half", 2, false},
    {"float", 4, false},
    {"double", 8, false},
    {"long int", 8, false},
    {"int", 4, false},
    {"short int", 2, false},
    {"signed char", 1, false},
    {"unsigned char", 1, false},
    {"bool", 1, false},
    {"c10::Float8_e4m3fn", 1, true},
    {"c10::Float8_e5m2", 1, true},
    {"c10::Float8_e4m3fnuz", 1, true},
    {"c10::Float8_e5m2fnuz", 1, true},
    {"c10::Float8_e8m0fnu", 1, true},
    {"c10::complex<float>", 8, false},
    {"c10::complex<double>", 16, false},
    {"c10::complex<c10::Half>", 4, false},
    {"unsigned short", 2, false},
    {"unsigned int", 4, false},
    {"unsigned long", 8, false},
};

const DType* find_dtype(std::string_view name) {
  for (const DType& d : kDTypes)
    if (d.name == name) return &d;
  return nullptr;
}

// c10::ScalarType's numbering, for aten::to's dtype argument in "Concrete Inputs".
int scalar_type_bytes(std::string_view text) {
  constexpr int kBytes[] = {1, 1, 2, 4, 8, 2, 4, 8, 4, 8, 16, 1, 1, 1, 4,
                            2, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1,  1, 2, 4, 8};
  int v = 0;
  if (text.empty() || text.size() > 2) return 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return 0;
    v = v * 10 + (c - '0');
  }
  return v < static_cast<int>(std::size(kBytes)) ? kBytes[v] : 0;
}

std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

bool eq_nocase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = static_cast<char>(x - 'A' + 'a');
    if (y >= 'A' && y <= 'Z') y = static_cast<char>(y - 'A' + 'a');
    if (x != y) return false;
  }
  return true;
}

// The kinds of event kept, by "cat" (torch >= 1.9 names first, then the older ones).
bool kind_of(std::string_view cat, EventKind* kind) {
  struct Cat {
    std::string_view name;
    EventKind kind;
  };
  static constexpr Cat kCats[] = {
      {"cpu_op", EventKind::cpu_op},
      {"kernel", EventKind::kernel},
      {"gpu_kernel", EventKind::kernel},
      {"cuda_runtime", EventKind::runtime},
      {"user_annotation", EventKind::annotation},
      {"gpu_user_annotation", EventKind::gpu_annotation},
      {"gpu_memcpy", EventKind::memcpy},
      {"gpu_memset", EventKind::memset},
      {"cuda_driver", EventKind::runtime},
      {"operator", EventKind::cpu_op},
      {"memcpy", EventKind::memcpy},
      {"memset", EventKind::memset},
      {"runtime", EventKind::runtime},
  };
  for (const Cat& c : kCats) {
    if (eq_nocase(cat, c.name)) {
      *kind = c.kind;
      return true;
    }
  }
  return false;
}

// One event's fields while it is read (views into the parser's string buffer).
struct RawEvent {
  std::string_view ph, cat, name;
  std::int64_t pid = 0, tid = 0;
  double ts = 0, dur = 0;
  bool has_ts = false;
  std::int64_t external_id = -1, correlation = -1;
  double bytes = -1;
  std::vector<std::string_view> types;
  std::vector<std::int64_t> elements;  // -1 for a non-tensor or a tensor list
  std::vector<std::uint64_t> hashes;
  std::string_view concrete1;  // "Concrete Inputs"[1]
  void clear() {
    ph = cat = name = concrete1 = {};
    pid = tid = 0;
    ts = dur = 0;
    has_ts = false;
    external_id = correlation = -1;
    bytes = -1;
    types.clear();
    elements.clear();
    hashes.clear();
  }
};

class Reader {
 public:
  Reader(std::string path, Trace* trace) : path_(std::move(path)), trace_(trace) {}

  void parse_batch(const std::string& json, std::int64_t offset, std::int64_t first_event) {
    json_ = &json;
    offset_ = offset;
    index_ = first_event;
    const simdjson::padded_string_view view(json.data(), json.size(), json.capacity());
    od::document doc;
    check(parser_.iterate(view).get(doc), nullptr);
    od::array arr;
    check(doc.get_array().get(arr), &doc);
    for (auto element : arr) {
      od::value value;
      check(element.get(value), &doc);
      od::object obj;
      if (value.get_object().get(obj) != simdjson::SUCCESS) {
        fail_at(location(&doc), "traceEvents[" + std::to_string(index_) + "] is not an object");
      }
      read_event(obj, &doc);
      ++index_;
      ++trace_->events_seen;
    }
  }

  void parse_skeleton(const TraceFramer& framer) {
    const std::string& s = framer.skeleton();
    if (s.empty() || s.front() != '{') {
      // A bare array of events: nothing but the brackets.
      std::size_t i = 0;
      while (i < s.size() && s[i] != '[') ++i;
      if (i == s.size()) fail_at(0, "no JSON value");
      return;
    }
    skeleton_ = s;
    skeleton_.reserve(skeleton_.size() + simdjson::SIMDJSON_PADDING);
    json_ = &skeleton_;
    const simdjson::padded_string_view view(skeleton_.data(), skeleton_.size(),
                                            skeleton_.capacity());
    od::document doc;
    auto where = [&](od::document* d) {
      const char* at = nullptr;
      if (d != nullptr && d->current_location().get(at) == simdjson::SUCCESS) {
        return framer.file_offset_of_skeleton(at - skeleton_.data());
      }
      return std::int64_t{0};
    };
    auto check_top = [&](simdjson::error_code e, od::document* d) {
      if (e != simdjson::SUCCESS) fail_at(where(d), simdjson::error_message(e));
    };
    check_top(parser_.iterate(view).get(doc), nullptr);
    od::object top;
    check_top(doc.get_object().get(top), &doc);
    for (auto field : top) {
      std::string_view key;
      check_top(field.unescaped_key().get(key), &doc);
      if (key == "deviceProperties") {
        od::array devices;
        if (field.value().get_array().get(devices) != simdjson::SUCCESS) continue;
        for (auto dev : devices) {
          od::object d;
          if (dev.get_object().get(d) != simdjson::SUCCESS) continue;
          std::string_view name;
          if (trace_->device_name.empty() && d["name"].get_string().get(name) == simdjson::SUCCESS)
            trace_->device_name = std::string(name);
        }
      } else if (key == "record_shapes") {
        std::int64_t v = 0;
        if (field.value().get_int64().get(v) == simdjson::SUCCESS) trace_->record_shapes_flag = v;
      }
    }
  }

 private:
  std::int64_t location(od::document* doc) const {
    const char* at = nullptr;
    if (doc != nullptr && doc->current_location().get(at) == simdjson::SUCCESS &&
        at >= json_->data() && at <= json_->data() + json_->size()) {
      const std::int64_t pos = at - json_->data();
      return offset_ + (pos > 0 ? pos - 1 : 0);  // json[0] is the framer's '['
    }
    return -1;
  }

  [[noreturn]] void fail_at(std::int64_t at, const std::string& what) const {
    if (at < 0) {
      throw TraceError(path_ + ": in traceEvents[" + std::to_string(index_) + "...], bytes " +
                       std::to_string(offset_) + ".." +
                       std::to_string(offset_ + static_cast<std::int64_t>(json_->size()) - 2) +
                       ": " + what);
    }
    throw TraceError(path_ + ": byte " + std::to_string(at) + ": " + what + " (in traceEvents[" +
                     std::to_string(index_) + "])");
  }

  void check(simdjson::error_code e, od::document* doc) const {
    if (e != simdjson::SUCCESS) fail_at(location(doc), simdjson::error_message(e));
  }

  // A number that may be written as an integer, a float or a string of digits.
  static bool get_number(od::value v, double* out) {
    if (v.get_double().get(*out) == simdjson::SUCCESS) return true;
    std::string_view s;
    if (v.get_string().get(s) == simdjson::SUCCESS) {
      char* end = nullptr;
      const std::string copy(s);
      *out = std::strtod(copy.c_str(), &end);
      return end != copy.c_str();
    }
    return false;
  }
  // pid / tid: integers, or strings ("stream 7", names) hashed to a stable id.
  static std::int64_t get_id(od::value v, od::document* doc, const Reader& r) {
    std::int64_t i = 0;
    if (v.get_int64().get(i) == simdjson::SUCCESS) return i;
    double d = 0;
    if (v.get_double().get(d) == simdjson::SUCCESS) return static_cast<std::int64_t>(d);
    std::string_view s;
    if (v.get_string().get(s) == simdjson::SUCCESS) {
      return static_cast<std::int64_t>(std::hash<std::string_view>{}(s) >> 1) |
             (std::int64_t{1} << 62);
    }
    r.fail_at(r.location(doc), "pid/tid is neither a number nor a string");
  }

  void read_event(od::object obj, od::document* doc) {
    ev_.clear();
    for (auto field : obj) {
      std::string_view key;
      check(field.unescaped_key().get(key), doc);
      od::value v;
      check(field.value().get(v), doc);
      if (key == "ph") {
        check(v.get_string().get(ev_.ph), doc);
      } else if (key == "cat") {
        check(v.get_string().get(ev_.cat), doc);
      } else if (key == "name") {
        check(v.get_string().get(ev_.name), doc);
      } else if (key == "ts") {
        ev_.has_ts = get_number(v, &ev_.ts);
        if (!ev_.has_ts) fail_at(location(doc), "\"ts\" is not a number");
      } else if (key == "dur") {
        if (!get_number(v, &ev_.dur)) fail_at(location(doc), "\"dur\" is not a number");
      } else if (key == "pid") {
        ev_.pid = get_id(v, doc, *this);
      } else if (key == "tid") {
        ev_.tid = get_id(v, doc, *this);
      } else if (key == "args") {
        od::object args;
        if (v.get_object().get(args) == simdjson::SUCCESS) read_args(args, doc);
      }
    }
    if (ev_.ph != "X" || !ev_.has_ts) return;  // only complete events carry a duration
    EventKind kind;
    if (!kind_of(ev_.cat, &kind)) return;
    TraceEvent e;
    e.ts = ev_.ts;
    e.dur = ev_.dur > 0 ? ev_.dur : 0;
    e.kind = kind;
    e.name = trace_->intern(ev_.name);
    const bool gpu = kind == EventKind::kernel || kind == EventKind::memcpy ||
                     kind == EventKind::memset || kind == EventKind::gpu_annotation;
    e.lane = trace_->lane(ev_.pid, ev_.tid, gpu);
    e.external_id = ev_.external_id;
    e.correlation = ev_.correlation;
    e.bytes = ev_.bytes;
    if (kind == EventKind::cpu_op) {
      int tensors = 0;
      for (std::size_t i = 0; i < ev_.elements.size(); ++i) {
        if (ev_.elements[i] < 0 || i >= ev_.types.size()) continue;
        const DType* d = find_dtype(ev_.types[i]);
        if (d == nullptr) continue;
        TensorArg t;
        t.elements = ev_.elements[i];
        t.dtype_bytes = d->bytes;
        t.fp8 = d->fp8;
        t.shape_hash = ev_.hashes[i];
        if (tensors == 0) e.in0 = t;
        if (tensors == 1) e.in1 = t;
        if (t.bytes() > e.largest.bytes()) e.largest = t;
        ++tensors;
      }
      e.out_dtype_bytes = scalar_type_bytes(ev_.concrete1);
    }
    trace_->events.push_back(e);
  }

  void read_args(od::object args, od::document* doc) {
    for (auto field : args) {
      std::string_view key;
      check(field.unescaped_key().get(key), doc);
      od::value v;
      check(field.value().get(v), doc);
      if (key == "External id") {
        double d = 0;
        if (get_number(v, &d)) ev_.external_id = static_cast<std::int64_t>(d);
      } else if (key == "correlation") {
        double d = 0;
        if (get_number(v, &d)) ev_.correlation = static_cast<std::int64_t>(d);
      } else if (key == "bytes") {
        double d = 0;
        if (get_number(v, &d)) ev_.bytes = d;
      } else if (key == "Input type") {
        od::array a;
        if (v.get_array().get(a) != simdjson::SUCCESS) continue;
        for (auto t : a) {
          std::string_view s;
          ev_.types.push_back(t.get_string().get(s) == simdjson::SUCCESS ? s : std::string_view());
        }
      } else if (key == "Input Dims") {
        od::array a;
        if (v.get_array().get(a) != simdjson::SUCCESS) continue;
        for (auto input : a) {
          std::int64_t elements = 1;
          std::uint64_t hash = 0x51ed270b;
          od::array dims;
          if (input.get_array().get(dims) != simdjson::SUCCESS) {
            elements = -1;
          } else {
            for (auto dim : dims) {
              std::int64_t n = 0;
              if (dim.get_int64().get(n) != simdjson::SUCCESS) {
                elements = -1;  // a list of tensors ([[..], [..]]): not one tensor
              } else if (elements >= 0) {
                elements *= n;
                hash = mix(hash, static_cast<std::uint64_t>(n));
              }
            }
          }
          ev_.elements.push_back(elements);
          ev_.hashes.push_back(hash);
        }
      } else if (key == "Concrete Inputs") {
        od::array a;
        if (v.get_array().get(a) != simdjson::SUCCESS) continue;
        int i = 0;
        for (auto c : a) {
          std::string_view s;
          if (i++ == 1 && c.get_string().get(s) == simdjson::SUCCESS) ev_.concrete1 = s;
        }
      }
    }
  }

  std::string path_;
  Trace* trace_;
  od::parser parser_;
  RawEvent ev_;
  const std::string* json_ = nullptr;
  std::string skeleton_;
  std::int64_t offset_ = 0;
  std::int64_t index_ = 0;
};

}  // namespace

bool trace_reader_built() {
  return true;
}

Trace read_trace(const std::string& path, const ReadOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  Trace trace;
  TraceSource source(path);
  Reader reader(path, &trace);
  TraceFramer framer(path, options.batch_bytes,
                     [&](const std::string& json, std::int64_t offset, std::int64_t first) {
                       reader.parse_batch(json, offset, first);
                     });
  std::string chunk;
  chunk.reserve(options.read_bytes);
  for (;;) {
    chunk.clear();
    if (!source.read(chunk, options.read_bytes)) break;
    framer.feed(chunk);
  }
  framer.finish();
  reader.parse_skeleton(framer);
  trace.file_bytes = source.file_bytes();
  trace.json_bytes = framer.bytes();
  trace.gzip = source.gzip();
  trace.read_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return trace;
}

#endif  // FP8MLA_HAVE_SIMDJSON

}  // namespace fp8mla::audit
