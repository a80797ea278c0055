// The trace reader: events as written, the same result however the text is cut into reads and
// batches, gzip, and for truncated or malformed traces a TraceError naming the byte offset,
// never a crash or another exception.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "tests/audit/trace_text.h"
#include "tools/fp8mla/audit/trace_error.h"
#include "tools/fp8mla/audit/trace_reader.h"

namespace fp8mla::audit {
namespace {

using testing::Ev;

// A small trace with the awkward parts: escaped quotes and brackets inside strings, a key
// named traceEvents below the top level, unicode escapes, skipped kinds of event.
std::string tricky_trace(int events) {
  std::vector<Ev> ev;
  ev.push_back({"user_annotation", "ProfilerStep#1", 0, 1e6});
  for (int i = 0; i < events; ++i) {
    Ev e;
    e.name = i % 3 == 0 ? "aten::to" : i % 3 == 1 ? "weird \"name\" }] \\ {[" : "cafe op";
    e.ts = 10.0 * i + 1;
    e.dur = 5.5;
    e.external_id = i;
    if (i % 3 == 0) {
      e.shapes = "[[8192, 1, 576], [], []]";
      e.types = "[\"c10::Float8_e4m3fn\", \"Scalar\", \"\"]";
    }
    ev.push_back(e);
  }
  std::string text = testing::trace_json(ev, "NVIDIA H200");
  // A JSON unicode escape: "caf\u00e9 op" is "café op".
  for (std::size_t at = text.find("cafe op"); at != std::string::npos; at = text.find("cafe op"))
    text.replace(at, 7, "caf\\u00e9 op");
  // Kinds the reader skips, and a nested "traceEvents" key that must not confuse the framer.
  const std::string extra =
      "  {\"ph\": \"i\", \"cat\": \"cpu_instant_event\", \"name\": \"x\", \"pid\": 1, \"tid\": 1, "
      "\"ts\": 3},\n  {\"ph\": \"X\", \"cat\": \"python_function\", \"name\": \"f\", \"pid\": 1, "
      "\"tid\": 1, \"ts\": 4, \"dur\": 1, \"args\": {\"traceEvents\": [1, {\"a\": \"]}\"}]}},\n";
  text.insert(text.find("  {\n    \"ph\": \"X\""), extra);
  return text;
}

std::vector<std::string> names(const Trace& t) {
  std::vector<std::string> out;
  for (const TraceEvent& e : t.events) out.push_back(t.name_of(e) + "@" + std::to_string(e.ts));
  return out;
}

TEST(AuditTraceReader, ReadsEventsShapesAndTopLevel) {
  const std::string path = testing::write_file("basic.json", tricky_trace(6));
  const Trace t = read_trace(path);
  ASSERT_EQ(t.events.size(), 7u);  // the step marker and 6 ops; instants and Python frames go
  EXPECT_EQ(t.events_seen, 9);
  EXPECT_EQ(t.device_name, "NVIDIA H200");
  EXPECT_EQ(t.name_of(t.events[0]), "ProfilerStep#1");
  EXPECT_EQ(t.events[0].kind, EventKind::annotation);
  const TraceEvent& cast = t.events[1];
  EXPECT_EQ(t.name_of(cast), "aten::to");
  EXPECT_DOUBLE_EQ(cast.ts, 1.0);
  EXPECT_DOUBLE_EQ(cast.dur, 5.5);
  EXPECT_EQ(cast.external_id, 0);
  EXPECT_EQ(cast.in0.elements, 8192 * 576);
  EXPECT_EQ(cast.in0.dtype_bytes, 1);
  EXPECT_TRUE(cast.in0.fp8);
  EXPECT_EQ(cast.in1.elements, -1);  // "Scalar": not a tensor
  EXPECT_DOUBLE_EQ(cast.largest.bytes(), 8192.0 * 576);
  EXPECT_EQ(t.name_of(t.events[2]), "weird \"name\" }] \\ {[");
  EXPECT_EQ(t.name_of(t.events[3]), "caf\xc3\xa9 op");
  EXPECT_TRUE(t.has_shapes());
  EXPECT_FALSE(t.has_gpu());
  std::remove(path.c_str());
}

TEST(AuditTraceReader, SameEventsWhateverTheReadAndBatchSizes) {
  const std::string text = tricky_trace(300);
  const std::string path = testing::write_file("sizes.json", text);
  const std::vector<std::string> want = names(read_trace(path));
  ASSERT_EQ(want.size(), 301u);
  for (const std::size_t batch : {std::size_t{1}, std::size_t{100}, std::size_t{1000}}) {
    for (const std::size_t read : {std::size_t{1}, std::size_t{7}, std::size_t{4096}}) {
      ReadOptions o;
      o.batch_bytes = batch;
      o.read_bytes = read;
      EXPECT_EQ(names(read_trace(path, o)), want) << "batch " << batch << " read " << read;
    }
  }
  std::remove(path.c_str());
}

TEST(AuditTraceReader, BareArrayOfEvents) {
  const std::string path = testing::write_file(
      "bare.json",
      " [{\"ph\": \"X\", \"cat\": \"cpu_op\", \"name\": \"aten::mm\", \"pid\": 1, \"tid\": 2, "
      "\"ts\": 5, \"dur\": 7}, {\"ph\": \"X\", \"cat\": \"kernel\", \"name\": \"gemm\", "
      "\"pid\": 0, \"tid\": \"stream 7\", \"ts\": 6, \"dur\": 1}]\n");
  const Trace t = read_trace(path);
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_EQ(t.name_of(t.events[1]), "gemm");
  EXPECT_TRUE(t.has_gpu());
  std::remove(path.c_str());
}

#if FP8MLA_HAVE_ZLIB
TEST(AuditTraceReader, GzipGivesTheSameEvents) {
  const std::string text = tricky_trace(200);
  const std::string plain = testing::write_file("plain.json", text);
  const std::string gz = testing::write_file("gz.json.gz", testing::gzip_bytes(text));
  const Trace a = read_trace(plain), b = read_trace(gz);
  EXPECT_EQ(names(a), names(b));
  EXPECT_TRUE(b.gzip);
  EXPECT_EQ(b.json_bytes, static_cast<std::int64_t>(text.size()));
  std::remove(plain.c_str());
  std::remove(gz.c_str());
}

TEST(AuditTraceReader, TruncatedGzipIsAnError) {
  const std::string gz = testing::gzip_bytes(tricky_trace(200));
  std::mt19937 rng(7);
  for (int i = 0; i < 60; ++i) {
    const std::size_t cut = rng() % gz.size();
    const std::string path = testing::write_file("cut.json.gz", gz.substr(0, cut));
    try {
      (void)read_trace(path);
      ADD_FAILURE() << "a gzip file cut at byte " << cut << " of " << gz.size() << " was read";
    } catch (const TraceError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("byte"), std::string::npos) << e.what();
    }
    std::remove(path.c_str());
  }
}
#endif

// The offset a TraceError names ("...: byte N: ..."), or -1.
long long offset_in(const std::string& message) {
  const std::size_t at = message.find(": byte ");
  if (at == std::string::npos) return -1;
  return std::stoll(message.substr(at + 7));
}

TEST(AuditTraceReader, TruncatedAnywhereIsAnErrorAtTheEnd) {
  const std::string text = tricky_trace(200);
  const std::size_t last = text.rfind('}');
  std::mt19937 rng(11);
  for (int i = 0; i < 200; ++i) {
    const std::size_t cut = i < 4 ? static_cast<std::size_t>(i) : rng() % last;
    const std::string path = testing::write_file("cut.json", text.substr(0, cut));
    ReadOptions o;
    o.batch_bytes = 512;  // cuts fall in every state of the framer and between batches
    try {
      (void)read_trace(path, o);
      ADD_FAILURE() << "the trace cut at byte " << cut << " was read";
    } catch (const TraceError& e) {
      const long long at = offset_in(e.what());
      EXPECT_GE(at, 0) << e.what();
      EXPECT_LE(at, static_cast<long long>(cut)) << e.what();
    }
    std::remove(path.c_str());
  }
}

struct Malformed {
  const char* what;
  std::string (*mutate)(std::string);
  const char* message;  // a fragment of the error
};

TEST(AuditTraceReader, MalformedTracesNameTheByte) {
  const Malformed cases[] = {
      {"a '}' closed by ']'",
       [](std::string s) {
         const std::size_t at = s.find("}\n  }", s.find("aten::to"));
         s[at + 4] = ']';
         return s;
       },
       "closes the '{'"},
      {"a missing comma between events",
       [](std::string s) {
         s.erase(s.find("},\n  {", s.find("aten::to")) + 1, 1);
         return s;
       },
       "byte"},
      {"a control character in a string",
       [](std::string s) {
         s[s.find("aten::to") + 4] = '\x01';
         return s;
       },
       "control characters must be escaped"},
      {"text after the trace", [](std::string s) { return s + "x"; }, "after the end"},
      {"not JSON", [](std::string) { return std::string("hello"); }, "starts with '{' or '['"},
      {"empty", [](std::string) { return std::string(); }, "the file is empty"},
      {"no traceEvents",
       [](std::string) { return std::string("{\"a\": [1, {\"traceEvents\": []}]}"); },
       "no traceEvents array"},
      {"a number that is not one",
       [](std::string s) {
         s.replace(s.find("\"dur\": ") + 7, 3, "1.2.3");
         return s;
       },
       "byte"},
      {"an event that is not an object",
       [](std::string s) {
         s.insert(s.find("[\n") + 2, "  42,\n");
         return s;
       },
       "is not an object"},
  };
  const std::string text = tricky_trace(40);
  for (const Malformed& m : cases) {
    const std::string bad = m.mutate(text);
    const std::string path = testing::write_file("bad.json", bad);
    for (const std::size_t batch : {std::size_t{64}, std::size_t{1} << 20}) {
      ReadOptions o;
      o.batch_bytes = batch;
      try {
        (void)read_trace(path, o);
        ADD_FAILURE() << m.what << ": read without an error";
      } catch (const TraceError& e) {
        EXPECT_NE(std::string(e.what()).find(m.message), std::string::npos)
            << m.what << ": " << e.what();
        EXPECT_LE(offset_in(e.what()), static_cast<long long>(bad.size())) << e.what();
      }
    }
    std::remove(path.c_str());
  }
}

TEST(AuditTraceReader, RandomByteChangesNeverCrash) {
  const std::string text = tricky_trace(60);
  std::mt19937 rng(3);
  int errors = 0;
  for (int i = 0; i < 300; ++i) {
    std::string bad = text;
    for (int k = 0; k < 1 + i % 3; ++k) {
      bad[rng() % bad.size()] = "{}[],:\"\\ x0\x01\xff"[rng() % 14];
    }
    const std::string path = testing::write_file("flip.json", bad);
    ReadOptions o;
    o.batch_bytes = 1 + rng() % 2048;
    try {
      (void)read_trace(path, o);  // some changes leave valid JSON
    } catch (const TraceError&) {
      ++errors;
    }
    std::remove(path.c_str());
  }
  EXPECT_GT(errors, 100);  // most changes break the JSON, and each is reported
}

TEST(AuditTraceReader, MissingFile) {
  try {
    (void)read_trace("/nonexistent/trace.json");
    FAIL() << "read a missing file";
  } catch (const TraceError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fp8mla::audit
