#include "tools/fp8mla/audit/trace.h"

#include <algorithm>

namespace fp8mla::audit {

std::uint32_t Trace::intern(std::string_view name) {
  if (const auto it = name_ids_.find(name); it != name_ids_.end()) return it->second;
  const auto id = static_cast<std::uint32_t>(names.size());
  names.emplace_back(name);
  name_ids_.emplace(names.back(), id);
  return id;
}

std::uint32_t Trace::lane(std::int64_t pid, std::int64_t tid, bool gpu) {
  auto same = [&](const Lane& l) { return l.pid == pid && l.tid == tid && l.gpu == gpu; };
  if (last_lane_ < lanes.size() && same(lanes[last_lane_])) return last_lane_;
  const auto it = std::find_if(lanes.begin(), lanes.end(), same);
  if (it != lanes.end()) {
    last_lane_ = static_cast<std::uint32_t>(it - lanes.begin());
  } else {
    last_lane_ = static_cast<std::uint32_t>(lanes.size());
    lanes.push_back({pid, tid, gpu});
  }
  return last_lane_;
}

bool Trace::has_gpu() const {
  return std::any_of(lanes.begin(), lanes.end(), [](const Lane& l) { return l.gpu; });
}

bool Trace::has_shapes() const {
  return record_shapes_flag || std::any_of(events.begin(), events.end(),
                                           [](const TraceEvent& e) { return e.in0.elements >= 0; });
}

}  // namespace fp8mla::audit
