#include "tools/fp8mla/audit/trace_framer.h"

#include <utility>

#include "tools/fp8mla/audit/trace_error.h"

namespace fp8mla::audit {
namespace {

// The top level outside traceEvents holds device properties and a few fields: kilobytes.
constexpr std::size_t kMaxSkeletonBytes = std::size_t{64} << 20;
// One event is a few hundred bytes; a batch that grows this far past its target without an
// event ending means the brackets never close.
constexpr std::size_t kMaxEventBytes = std::size_t{256} << 20;
constexpr std::size_t kPadding = 64;  // simdjson::SIMDJSON_PADDING

bool is_space(char c) {
  return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

std::string quoted(char c) {
  if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
    static const char* hex = "0123456789abcdef";
    const auto u = static_cast<unsigned char>(c);
    return std::string("byte 0x") + hex[u >> 4] + hex[u & 15];
  }
  return std::string("'") + c + "'";
}

}  // namespace

TraceFramer::TraceFramer(std::string what, std::size_t batch_bytes, BatchFn on_batch)
    : what_(std::move(what)), batch_bytes_(batch_bytes), on_batch_(std::move(on_batch)) {
  batch_.reserve(batch_bytes_ + (batch_bytes_ >> 3) + kPadding);
}

void TraceFramer::fail(std::int64_t at, const std::string& what) const {
  throw TraceError(what_ + ": byte " + std::to_string(at) + ": " + what);
}

std::string TraceFramer::event_context() const {
  if (where_ != Where::events || element_start_ < 0) return "";
  return " (in traceEvents[" + std::to_string(events_) + "], which starts at byte " +
         std::to_string(element_start_) + ")";
}

std::int64_t TraceFramer::file_offset_of_skeleton(std::int64_t pos) const {
  if (split_ < 0 || pos < split_) return pos;
  return resume_ + (pos - split_);
}

void TraceFramer::feed(std::string_view bytes) {
  process(bytes.data(), bytes.size());
  offset_ += static_cast<std::int64_t>(bytes.size());
}

void TraceFramer::switch_dest(Dest d, const char* chunk, std::size_t i) {
  if (i > run_start_) {
    if (dest_ == Dest::skeleton) {
      skeleton_.append(chunk + run_start_, i - run_start_);
      if (skeleton_.size() > kMaxSkeletonBytes) {
        fail(offset_ + static_cast<std::int64_t>(i),
             "the top level outside traceEvents is over 64 MB: not a Chrome trace");
      }
    } else if (dest_ == Dest::batch) {
      batch_.append(chunk + run_start_, i - run_start_);
    }
  }
  dest_ = d;
  run_start_ = i;
}

void TraceFramer::emit_batch() {
  if (batch_.size() > 1) {
    batch_ += ']';
    batch_.reserve(batch_.size() + kPadding);
    on_batch_(batch_, batch_offset_, batch_first_event_);
  }
  batch_.assign(1, '[');
  batch_offset_ = -1;
}

void TraceFramer::open_bracket(char c, const char* chunk, std::size_t i) {
  const std::int64_t at = offset_ + static_cast<std::int64_t>(i);
  if (where_ == Where::before_root) {
    if (c == '[') {  // a bare array of events
      where_ = Where::events;
      events_depth_ = 1;
      found_events_ = true;
      stack_.push_back(c);
      open_at_.push_back(at);
      switch_dest(Dest::none, chunk, i + 1);
      split_ = at + 1;
      return;
    }
    where_ = Where::top;
  } else if (where_ == Where::top && stack_.size() == 1 && c == '[' && last_top_ == ':' &&
             key_ == "traceEvents" && !found_events_) {
    where_ = Where::events;
    events_depth_ = 2;
    found_events_ = true;
    stack_.push_back(c);
    open_at_.push_back(at);
    switch_dest(Dest::none, chunk, i + 1);
    split_ = static_cast<std::int64_t>(skeleton_.size());
    return;
  }
  if (stack_.size() == 1) last_top_ = c;
  stack_.push_back(c);
  open_at_.push_back(at);
}

void TraceFramer::close_bracket(char c, const char* chunk, std::size_t i) {
  const std::int64_t at = offset_ + static_cast<std::int64_t>(i);
  const char want = c == '}' ? '{' : '[';
  if (stack_.empty()) fail(at, quoted(c) + " closes nothing");
  if (stack_.back() != want) {
    fail(at, quoted(c) + " closes the '" + std::string(1, stack_.back()) + "' opened at byte " +
                 std::to_string(open_at_.back()) + event_context());
  }
  if (where_ == Where::events && stack_.size() == events_depth_) {  // traceEvents ends
    if (after_sep_) fail(at, "']' after ',' in traceEvents");
    switch_dest(Dest::none, chunk, i);
    emit_batch();
    need_sep_ = false;
    element_start_ = -1;
    switch_dest(Dest::skeleton, chunk, i);
    resume_ = at;
    where_ = events_depth_ == 1 ? Where::after_root : Where::top;
    stack_.pop_back();
    open_at_.pop_back();
    if (where_ == Where::top) last_top_ = ']';
    return;
  }
  stack_.pop_back();
  open_at_.pop_back();
  if (stack_.empty()) {
    where_ = Where::after_root;
    return;
  }
  if (stack_.size() == 1 && where_ == Where::top) last_top_ = c;
  if (where_ == Where::events && stack_.size() == events_depth_) {  // an element ends
    ++events_;
    element_start_ = -1;
    if (batch_.size() + (i + 1 - run_start_) >= batch_bytes_) {
      switch_dest(Dest::none, chunk, i + 1);
      emit_batch();
      need_sep_ = true;
    }
  }
}

void TraceFramer::process(const char* p, std::size_t n) {
  run_start_ = 0;
  std::size_t i = 0;
  while (i < n) {
    if (in_string_) {
      // The fast path: most of a trace is string bytes.
      while (i < n) {
        const char c = p[i];
        if (escape_) {
          escape_ = false;
        } else if (c == '\\') {
          escape_ = true;
        } else if (c == '"') {
          in_string_ = false;
          if (key_capture_) {
            key_capture_ = false;
            last_top_ = '"';
          }
          ++i;
          break;
        } else if (static_cast<unsigned char>(c) < 0x20) {
          // JSON strings escape control characters; the parser would say so without a place.
          fail(offset_ + static_cast<std::int64_t>(i),
               quoted(c) + " inside a string: control characters must be escaped in JSON" +
                   event_context());
        } else if (key_capture_ && key_.size() < 64) {
          key_ += c;
        }
        ++i;
      }
      continue;
    }
    const char c = p[i];
    if (is_space(c)) {
      ++i;
      continue;
    }
    const std::int64_t at = offset_ + static_cast<std::int64_t>(i);
    if (where_ == Where::after_root) fail(at, quoted(c) + " after the end of the JSON value");
    if (where_ == Where::before_root && c != '{' && c != '[') {
      fail(at, "a Chrome trace starts with '{' or '[', not " + quoted(c));
    }
    // Between two elements of traceEvents after a batch was cut (or before the first one).
    if (where_ == Where::events && stack_.size() == events_depth_ && dest_ == Dest::none) {
      if (c == ',') {
        if (!need_sep_) fail(at, "unexpected ',' in traceEvents" + event_context());
        need_sep_ = false;
        after_sep_ = true;
        ++i;
        continue;
      }
      if (c != ']') {
        if (need_sep_) {
          fail(at, "expected ',' or ']' after traceEvents[" + std::to_string(events_ - 1) +
                       "], found " + quoted(c));
        }
        after_sep_ = false;
        switch_dest(Dest::batch, p, i);
        if (batch_offset_ < 0) {
          batch_offset_ = at;
          batch_first_event_ = events_;
        }
      }
    }
    if (where_ == Where::events && stack_.size() == events_depth_ && c != ',' && c != ']') {
      element_start_ = at;
    }
    switch (c) {
      case '"':
        in_string_ = true;
        if (where_ == Where::top && stack_.size() == 1) {
          key_.clear();
          key_capture_ = true;
        }
        break;
      case '{':
      case '[':
        open_bracket(c, p, i);
        break;
      case '}':
      case ']':
        close_bracket(c, p, i);
        break;
      default:
        if (where_ == Where::top && stack_.size() == 1) last_top_ = c;
        break;
    }
    ++i;
  }
  switch_dest(dest_, p, n);
  if (batch_.size() > batch_bytes_ + kMaxEventBytes) {
    fail(element_start_ >= 0 ? element_start_ : offset_,
         "an element of traceEvents runs past 256 MB without closing: the brackets do not "
         "match (not a Chrome trace, or a corrupt one)");
  }
}

void TraceFramer::finish() {
  if (where_ == Where::before_root) {
    fail(offset_, offset_ == 0 ? "the file is empty" : "no JSON value, only whitespace");
  }
  if (in_string_ || !stack_.empty()) {
    std::string what = "the JSON ends ";
    what += in_string_ ? "inside a string"
                       : "with " + std::to_string(stack_.size()) + " bracket" +
                             (stack_.size() == 1 ? "" : "s") + " still open";
    what += event_context();
    what += ": the trace is truncated";
    fail(offset_, what);
  }
  if (!found_events_) {
    fail(0,
         "no traceEvents array at the top level: not a Chrome trace (torch.profiler's "
         "export_chrome_trace writes one)");
  }
}

}  // namespace fp8mla::audit
