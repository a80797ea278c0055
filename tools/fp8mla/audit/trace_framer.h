// Cuts a Chrome trace's JSON text, fed in pieces as it is read, into batches of whole events,
// so that a JSON parser (simdjson) can parse a trace of any size a batch at a time.
//
// A Chrome trace is `{"traceEvents": [event, event, ...], ...}` (or a bare `[event, ...]`). The
// framer finds where each element of traceEvents ends by tracking only what decides that:
// strings (and their escapes) and the nesting of brackets. It checks that brackets match and
// that elements are separated by commas, and it hands out
//   - batches: "[" + a run of whole events as they appear in the file + "]", each a valid JSON
//     array when the trace is valid, with the file offset of its first event;
//   - the skeleton: the top level with traceEvents' elements left out (device properties and
//     the like, small), parsed once at the end.
// Everything else (values, numbers, escapes, UTF-8) is the parser's to validate: a batch that
// is not valid JSON is reported by the parser at its offset in the file. Debian's simdjson
// (3.0) cannot stream a comma-separated array by itself (iterate_many takes whitespace-
// separated documents; its comma mode, from 3.2, needs the whole input in one batch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace fp8mla::audit {

class TraceFramer {
 public:
  // json: "[" + events + "]", with at least 64 bytes of capacity past its end (simdjson's
  // padding); offset: the file offset of json[1]; first_event: the index of its first event.
  using BatchFn =
      std::function<void(const std::string& json, std::int64_t offset, std::int64_t first_event)>;

  // `what` names the input in messages (the file's path); batches hold about batch_bytes.
  TraceFramer(std::string what, std::size_t batch_bytes, BatchFn on_batch);

  // The next bytes of the text. Throws TraceError, naming the byte offset, for text that
  // cannot be a Chrome trace (mismatched brackets, a missing comma between events, ...).
  void feed(std::string_view bytes);
  // The end of the text: emits the last batch; throws TraceError when the text stops early
  // (truncated) or has no traceEvents array.
  void finish();

  // After finish(): the top level without traceEvents' elements, and how its offsets map back
  // to the file's.
  const std::string& skeleton() const { return skeleton_; }
  std::int64_t file_offset_of_skeleton(std::int64_t pos) const;
  std::int64_t events() const { return events_; }
  std::int64_t bytes() const { return offset_; }

 private:
  enum class Where : std::uint8_t { before_root, top, events, after_root };
  enum class Dest : std::uint8_t { skeleton, batch, none };
  void process(const char* p, std::size_t n);
  void switch_dest(Dest d, const char* chunk, std::size_t i);
  void open_bracket(char c, const char* chunk, std::size_t i);
  void close_bracket(char c, const char* chunk, std::size_t i);
  void emit_batch();
  [[noreturn]] void fail(std::int64_t at, const std::string& what) const;
  std::string event_context() const;

  std::string what_;
  std::size_t batch_bytes_;
  BatchFn on_batch_;

  Where where_ = Where::before_root;
  Dest dest_ = Dest::skeleton;
  std::size_t run_start_ = 0;          // chunk index where the current destination's run began
  std::vector<char> stack_;            // open brackets
  std::vector<std::int64_t> open_at_;  // their offsets
  bool in_string_ = false;
  bool escape_ = false;
  std::int64_t offset_ = 0;  // file offset of the current chunk's first byte
  // Top-level keys: the last string closed at depth 1 and the last significant character.
  std::string key_;
  bool key_capture_ = false;
  char last_top_ = 0;
  // traceEvents.
  std::size_t events_depth_ = 0;  // depth of the events array (1: a bare array; 2: the key)
  bool found_events_ = false;
  bool need_sep_ = false;   // a batch was cut after the last element: its ',' is skipped
  bool after_sep_ = false;  // that ',' was skipped: an element must follow
  std::int64_t events_ = 0;
  std::int64_t element_start_ = -1;  // offset of the element being read
  std::string batch_ = "[";
  std::int64_t batch_offset_ = -1;
  std::int64_t batch_first_event_ = 0;
  // The skeleton: [0, split_) of the file, then [resume_, end).
  std::string skeleton_;
  std::int64_t split_ = -1, resume_ = -1;
};

}  // namespace fp8mla::audit
