#include "tools/fp8mla/audit/timeline.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

namespace fp8mla::audit {
namespace {

bool is_step_marker(const std::string& name) {
  return name.rfind("ProfilerStep#", 0) == 0;
}

// A CPU op as nesting sees it: its category, and the outermost categorised op above it (or
// itself), which is where its time and bytes are counted.
struct CpuNode {
  std::size_t event = 0;
  Category category = Category::other;
  long top = -1;  // index into nodes of the outermost categorised ancestor-or-self
};

struct CpuOps {
  std::vector<CpuNode> nodes;                            // CPU ops and annotations, nested
  std::unordered_map<std::int64_t, std::size_t> by_ext;  // External id -> node
  std::vector<WorkItem> items;                           // CPU work items
};

// Nests each CPU lane's ops by time and makes one work item per outermost categorised op (and
// per outermost gather), with the bytes of the aten::copy_ calls inside a cast.
CpuOps nest_cpu_ops(const Trace& trace, const CategoryRules& rules) {
  CpuOps ops;
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < trace.events.size(); ++i) {
    const TraceEvent& e = trace.events[i];
    if (e.kind != EventKind::cpu_op && e.kind != EventKind::annotation) continue;
    if (is_step_marker(trace.name_of(e))) continue;
    order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const TraceEvent &x = trace.events[a], &y = trace.events[b];
    if (x.lane != y.lane) return x.lane < y.lane;
    if (x.ts != y.ts) return x.ts < y.ts;
    return x.dur > y.dur;  // the enclosing op first
  });
  std::vector<long> item_of(order.size(), -1);  // node -> its work item
  std::unordered_set<long> copies;              // items whose copy_ was seen
  std::vector<std::size_t> stack;               // node indices
  std::uint32_t lane = ~0u;
  const std::uint32_t copy_name = [&] {
    const auto it = std::find(trace.names.begin(), trace.names.end(), "aten::copy_");
    return it == trace.names.end() ? ~0u : static_cast<std::uint32_t>(it - trace.names.begin());
  }();
  for (const std::size_t ei : order) {
    const TraceEvent& e = trace.events[ei];
    if (e.lane != lane) {
      stack.clear();
      lane = e.lane;
    }
    while (!stack.empty() && trace.events[ops.nodes[stack.back()].event].end() <= e.ts) {
      stack.pop_back();
    }
    CpuNode node;
    node.event = ei;
    const std::string& name = trace.name_of(e);
    node.category = categorize(name, rules);
    if (!stack.empty()) node.top = ops.nodes[stack.back()].top;
    const std::size_t id = ops.nodes.size();
    const bool gather = is_gather(name);
    if (node.top < 0 && (node.category != Category::other || gather)) {
      if (node.category != Category::other) node.top = static_cast<long>(id);
      WorkItem w;
      w.start = e.ts;
      w.dur = e.dur;
      w.lane = e.lane;
      w.name = w.op = e.name;
      w.category = node.category;
      w.gather = gather && node.category == Category::other;
      w.fp8_source = e.in0.fp8 || names_fp8(name);
      w.in_shape = e.in0.shape_hash;
      if (node.category == Category::attention) w.kv_bytes = e.largest.bytes();
      if (node.category == Category::cast_copy && e.in0.elements >= 0) {
        // Until a copy_ inside says better: the input, and an output of the dtype asked for.
        const double in = e.in0.bytes();
        const double out = static_cast<double>(e.in0.elements) *
                           (e.out_dtype_bytes > 0 ? e.out_dtype_bytes : e.in0.dtype_bytes);
        w.out_bytes = out;
        w.bytes = in + out;
      }
      item_of[id] = static_cast<long>(ops.items.size());
      ops.items.push_back(w);
    }
    // aten::copy_(dst, src) in a cast (or the cast itself): the bytes it really moves.
    if (e.name == copy_name && node.top >= 0 && e.in0.elements >= 0 && e.in1.elements >= 0) {
      const long item = item_of[static_cast<std::size_t>(node.top)];
      if (item >= 0 && ops.items[static_cast<std::size_t>(item)].category == Category::cast_copy) {
        WorkItem& w = ops.items[static_cast<std::size_t>(item)];
        const bool first = copies.insert(item).second;
        w.out_bytes = (first ? 0.0 : w.out_bytes) + e.in0.bytes();
        w.bytes = (first ? 0.0 : w.bytes) + e.in0.bytes() + e.in1.bytes();
        w.fp8_source = w.fp8_source || e.in1.fp8;
      }
    }
    if (e.external_id >= 0) ops.by_ext.emplace(e.external_id, id);
    ops.nodes.push_back(node);
    stack.push_back(id);
  }
  return ops;
}

// GPU work items: kernels, memcpys and memsets, sized and categorised through the CPU op that
// launched them when their own name does not say.
std::vector<WorkItem> gpu_items(const Trace& trace, const CpuOps& ops, const CategoryRules& rules) {
  std::vector<WorkItem> items;
  for (const TraceEvent& e : trace.events) {
    if (e.kind != EventKind::kernel && e.kind != EventKind::memcpy && e.kind != EventKind::memset) {
      continue;
    }
    WorkItem w;
    w.start = e.ts;
    w.dur = e.dur;
    w.lane = e.lane;
    w.name = w.op = e.name;
    const std::string& name = trace.name_of(e);
    w.category = e.kind == EventKind::kernel ? categorize(name, rules) : Category::cast_copy;
    w.gather = is_gather(name);
    w.fp8_source = names_fp8(name);
    if (e.bytes >= 0) w.bytes = e.bytes;
    const auto it = e.external_id >= 0 ? ops.by_ext.find(e.external_id) : ops.by_ext.end();
    if (it != ops.by_ext.end()) {
      const CpuNode& node = ops.nodes[it->second];
      const TraceEvent& op = trace.events[node.event];
      const CpuNode* top = node.top >= 0 ? &ops.nodes[static_cast<std::size_t>(node.top)] : nullptr;
      const TraceEvent* top_op = top != nullptr ? &trace.events[top->event] : nullptr;
      w.op = top_op != nullptr ? top_op->name : op.name;
      // The op that launched it says what it is: index_put_ and index launch the same
      // index_elementwise_kernel, only one of them gathers.
      w.gather = is_gather(trace.name_of(op));
      if (w.category == Category::other && top != nullptr) w.category = top->category;
      if (w.category == Category::cast_copy && op.in0.elements >= 0) {
        w.fp8_source = w.fp8_source || op.in0.fp8 || op.in1.fp8;
        if (op.in1.elements >= 0) {  // aten::copy_(dst, src)
          w.out_bytes = op.in0.bytes();
          w.bytes = op.in0.bytes() + op.in1.bytes();
        } else if (op.out_dtype_bytes > 0) {  // aten::to(self, dtype) / aten::_to_copy
          w.out_bytes = static_cast<double>(op.in0.elements) * op.out_dtype_bytes;
          w.bytes = op.in0.bytes() + w.out_bytes;
        }
        w.in_shape = op.in1.elements >= 0 ? op.in1.shape_hash : op.in0.shape_hash;
      }
      if (w.category == Category::attention && top_op != nullptr) {
        w.kv_bytes = top_op->largest.bytes();
      }
    }
    items.push_back(w);
  }
  return items;
}

// When each GPU item was launched (its runtime call's time), to put it in a marker's step.
std::vector<double> launch_times(const Trace& trace, const std::vector<WorkItem>& items) {
  std::unordered_map<std::int64_t, double> runtime_ts;
  for (const TraceEvent& e : trace.events) {
    if (e.kind == EventKind::runtime && e.correlation >= 0) runtime_ts.emplace(e.correlation, e.ts);
  }
  std::vector<double> launch;
  launch.reserve(items.size());
  std::size_t k = 0;
  for (const TraceEvent& e : trace.events) {
    if (e.kind != EventKind::kernel && e.kind != EventKind::memcpy && e.kind != EventKind::memset) {
      continue;
    }
    const auto it = e.correlation >= 0 ? runtime_ts.find(e.correlation) : runtime_ts.end();
    launch.push_back(it != runtime_ts.end() ? it->second : items[k].start);
    ++k;
  }
  return launch;
}

// Where one step ends and the next begins between two attention calls: in the middle of the
// longest idle time between them (sampling and scheduling leave the device idle), or of the
// whole gap when nothing runs in it.
double boundary(const std::vector<WorkItem>& items, const WorkItem& a, const WorkItem& b) {
  double best_len = -1, best_at = (a.end() + b.start) / 2;
  double busy_until = a.end();
  for (const WorkItem& w : items) {  // sorted by start
    if (w.start < a.end()) continue;
    if (w.start >= b.start) break;
    if (w.start - busy_until > best_len) {
      best_len = w.start - busy_until;
      best_at = (busy_until + w.start) / 2;
    }
    busy_until = std::max(busy_until, w.end());
  }
  if (b.start - busy_until > best_len) best_at = (busy_until + b.start) / 2;
  return best_at;
}

// Steps from the repeating attention pattern: a step boundary is a gap between consecutive
// attention calls (on the lane with the most of them) on the long side of the natural break in
// the gaps; the steps so cut must mostly hold the same number of calls.
std::vector<std::pair<double, double>> pattern_steps(const std::vector<WorkItem>& items) {
  std::unordered_map<std::uint32_t, int> per_lane;
  for (const WorkItem& w : items)
    if (w.category == Category::attention) ++per_lane[w.lane];
  if (per_lane.empty()) return {};
  const std::uint32_t lane =
      std::max_element(per_lane.begin(), per_lane.end(), [](const auto& a, const auto& b) {
        return a.second < b.second;
      })->first;
  std::vector<const WorkItem*> att;
  for (const WorkItem& w : items)
    if (w.category == Category::attention && w.lane == lane) att.push_back(&w);
  if (att.size() < 4) return {};
  std::vector<double> gaps;
  for (std::size_t i = 1; i < att.size(); ++i) gaps.push_back(att[i]->start - att[i - 1]->end());
  // The natural break in the sorted gaps: the largest ratio between neighbours, with the
  // larger side (step boundaries) the smaller group.
  std::vector<double> sorted = gaps;
  std::sort(sorted.begin(), sorted.end());
  double best = 1, threshold = 0;
  for (std::size_t i = (sorted.size() + 1) / 2; i < sorted.size(); ++i) {
    const double lo = std::max(sorted[i - 1], 1e-3), hi = std::max(sorted[i], 1e-3);
    if (hi / lo > best) {
      best = hi / lo;
      threshold = std::sqrt(lo * hi);
    }
  }
  if (best < 1.3) return {};
  std::vector<std::size_t> firsts = {0};  // first attention call of each step
  for (std::size_t i = 0; i < gaps.size(); ++i)
    if (gaps[i] > threshold) firsts.push_back(i + 1);
  if (firsts.size() < 2) return {};
  // Calls a step: the most common count; partial steps at either end are dropped.
  std::vector<std::size_t> counts;
  for (std::size_t s = 0; s < firsts.size(); ++s)
    counts.push_back((s + 1 < firsts.size() ? firsts[s + 1] : att.size()) - firsts[s]);
  std::unordered_map<std::size_t, int> freq;
  for (const std::size_t c : counts) ++freq[c];
  const std::size_t mode =
      std::max_element(freq.begin(), freq.end(), [](const auto& a, const auto& b) {
        return a.second < b.second || (a.second == b.second && a.first < b.first);
      })->first;
  if (freq[mode] < 2 || mode < 2) return {};
  const double t0 = items.front().start;
  double t1 = 0;
  for (const WorkItem& w : items) t1 = std::max(t1, w.end());
  std::vector<std::pair<double, double>> steps;
  for (std::size_t s = 0; s < firsts.size(); ++s) {
    if (counts[s] != mode) continue;
    const std::size_t first = firsts[s];
    const std::size_t last = first + counts[s] - 1;
    const double begin = first == 0 ? t0 : boundary(items, *att[first - 1], *att[first]);
    const double end = last + 1 >= att.size() ? t1 : boundary(items, *att[last], *att[last + 1]);
    steps.emplace_back(begin, end);
  }
  return steps;
}

double union_length(std::vector<WorkItem>& items) {
  double total = 0, cur_start = 0, cur_end = -1e300;
  for (const WorkItem& w : items) {  // sorted by start
    if (w.start > cur_end) {
      if (cur_end > cur_start) total += cur_end - cur_start;
      cur_start = w.start;
      cur_end = w.end();
    } else {
      cur_end = std::max(cur_end, w.end());
    }
  }
  if (cur_end > cur_start) total += cur_end - cur_start;
  return total;
}

}  // namespace

Timeline build_timeline(const Trace& trace, const CategoryRules& rules) {
  Timeline t;
  t.gpu = trace.has_gpu();
  CpuOps ops = nest_cpu_ops(trace, rules);
  std::vector<WorkItem> items = t.gpu ? gpu_items(trace, ops, rules) : std::move(ops.items);
  // Where an item falls for step assignment: its launch on the GPU, its start on the CPU.
  std::vector<double> key;
  if (t.gpu) {
    key = launch_times(trace, items);
  } else {
    for (const WorkItem& w : items) key.push_back(w.start);
  }
  std::vector<std::size_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return items[a].start < items[b].start; });

  std::vector<std::pair<double, double>> spans;  // in `key` time
  std::vector<std::string> labels;
  for (const TraceEvent& e : trace.events) {
    if (e.kind == EventKind::annotation && is_step_marker(trace.name_of(e))) {
      spans.emplace_back(e.ts, e.end());
      labels.push_back(trace.name_of(e));
    }
  }
  if (!spans.empty()) {
    t.step_source = "ProfilerStep markers";
    std::vector<std::size_t> idx(spans.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](auto a, auto b) { return spans[a] < spans[b]; });
    std::vector<std::pair<double, double>> s2;
    std::vector<std::string> l2;
    for (const std::size_t i : idx) {
      s2.push_back(spans[i]);
      l2.push_back(labels[i]);
    }
    spans = std::move(s2);
    labels = std::move(l2);
  } else {
    std::vector<WorkItem> sorted_items;
    for (const std::size_t i : order) sorted_items.push_back(items[i]);
    spans = pattern_steps(sorted_items);
    if (!spans.empty()) {
      t.step_source = "the repeating pattern of attention calls (no ProfilerStep markers)";
      for (std::size_t i = 0; i < items.size(); ++i) key[i] = items[i].start;
    } else if (!items.empty()) {
      t.step_source = "the whole trace (no ProfilerStep markers, no repeating attention calls)";
      double a = items.front().start, b = 0;
      for (const WorkItem& w : items) {
        a = std::min(a, w.start);
        b = std::max(b, w.end());
      }
      spans.emplace_back(a, b);
      key.assign(items.size(), a);
    }
    for (std::size_t i = 0; i < spans.size(); ++i)
      labels.push_back("step " + std::to_string(i + 1));
  }

  t.steps.resize(spans.size());
  for (std::size_t s = 0; s < spans.size(); ++s) {
    t.steps[s].label = labels[s];
    t.steps[s].start = spans[s].first;
    t.steps[s].end = spans[s].second;
  }
  for (const std::size_t i : order) {
    // The last step that starts at or before the item's key and ends after it.
    const auto it = std::upper_bound(spans.begin(), spans.end(), std::make_pair(key[i], 1e300));
    if (it == spans.begin()) continue;
    const std::size_t s = static_cast<std::size_t>(it - spans.begin()) - 1;
    if (key[i] > spans[s].second) continue;
    t.steps[s].items.push_back(items[i]);
  }
  for (Step& step : t.steps) {
    double sum_categorized = 0;
    for (const WorkItem& w : step.items) {
      if (w.category == Category::attention) ++step.attention_calls;
      if (w.category != Category::other || t.gpu) {
        step.by_category[static_cast<int>(w.category)] += w.dur;
        if (w.category != Category::other) sum_categorized += w.dur;
      }
    }
    if (t.gpu && !step.items.empty()) {
      step.start = step.items.front().start;
      step.end = 0;
      for (const WorkItem& w : step.items) step.end = std::max(step.end, w.end());
      step.busy = union_length(step.items);
    } else {
      step.busy = step.wall();
      // On the CPU, "other" is what the categorised ops leave of the step.
      step.by_category[static_cast<int>(Category::other)] =
          std::max(0.0, step.wall() - sum_categorized);
    }
  }
  return t;
}

}  // namespace fp8mla::audit
