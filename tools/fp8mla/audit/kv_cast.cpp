#include "tools/fp8mla/audit/kv_cast.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include "tools/fp8mla/audit/trace.h"

namespace fp8mla::audit {
namespace {

// Of a step's bytes per cast, how far from the median still counts as "the same size".
constexpr double kBytesSpread = 2.0;
constexpr double kTimeSpread = 3.0;
// A KV cast writes at least this fraction of the attention's largest input ...
constexpr double kMinKvRatio = 0.5;
// ... or, without shapes, takes at least this fraction of the attention call's time.
constexpr double kMinTimeRatio = 0.25;

double median(std::vector<double> v) {
  if (v.empty()) return -1;
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

struct Candidate {
  std::size_t cast;  // Step::items index
  long gather = -1;  // the gather before it, if any
  double kv_bytes = -1;
};

// The candidates of one step: for each attention call, the largest cast since the previous
// attention call on its lane, when it is the size of what attention reads.
std::vector<Candidate> candidates(const Step& step) {
  std::vector<Candidate> out;
  std::unordered_map<std::uint32_t, std::vector<std::size_t>> since;  // lane -> items
  for (std::size_t i = 0; i < step.items.size(); ++i) {
    const WorkItem& w = step.items[i];
    std::vector<std::size_t>& pending = since[w.lane];
    if (w.category != Category::attention) {
      pending.push_back(i);
      continue;
    }
    long best = -1;
    for (const std::size_t j : pending) {
      const WorkItem& c = step.items[j];
      if (c.category != Category::cast_copy) continue;
      const WorkItem* b = best >= 0 ? &step.items[static_cast<std::size_t>(best)] : nullptr;
      const bool bigger =
          b == nullptr || (c.bytes >= 0 && b->bytes >= 0 ? c.bytes > b->bytes : c.dur > b->dur);
      if (bigger) best = static_cast<long>(j);
    }
    if (best >= 0) {
      const WorkItem& c = step.items[static_cast<std::size_t>(best)];
      const bool sized = c.out_bytes > 0 && w.kv_bytes > 0;
      const bool big =
          sized ? c.out_bytes >= kMinKvRatio * w.kv_bytes : c.dur >= kMinTimeRatio * w.dur;
      if (big) {
        Candidate cand{static_cast<std::size_t>(best), -1, w.kv_bytes};
        for (const std::size_t j : pending) {
          if (j < cand.cast && step.items[j].gather) cand.gather = static_cast<long>(j);
        }
        out.push_back(cand);
      }
    }
    pending.clear();
  }
  return out;
}

}  // namespace

KvCastFinding find_kv_cast(const Trace& trace, const Timeline& timeline) {
  KvCastFinding f;
  f.steps.resize(timeline.steps.size());
  std::vector<double> bytes_each, out_each, time_each, ratios, att_counts, per_step;
  std::map<std::uint32_t, int> names;
  std::map<std::uint32_t, int> ops;
  int gathers = 0, total = 0, fp8 = 0;
  for (std::size_t s = 0; s < timeline.steps.size(); ++s) {
    const Step& step = timeline.steps[s];
    std::vector<Candidate> cands = candidates(step);
    if (cands.empty()) continue;
    // The same size: keep those near the step's median.
    const bool sized = std::all_of(cands.begin(), cands.end(), [&](const Candidate& c) {
      return step.items[c.cast].bytes > 0;
    });
    std::vector<double> sizes;
    for (const Candidate& c : cands)
      sizes.push_back(sized ? step.items[c.cast].bytes : step.items[c.cast].dur);
    const double mid = median(sizes);
    const double spread = sized ? kBytesSpread : kTimeSpread;
    std::vector<Candidate> kept;
    for (std::size_t i = 0; i < cands.size(); ++i) {
      if (sizes[i] >= mid / spread && sizes[i] <= mid * spread) kept.push_back(cands[i]);
    }
    if (kept.empty() || 2 * static_cast<int>(kept.size()) < step.attention_calls) continue;
    KvCastStep& ks = f.steps[s];
    for (const Candidate& c : kept) {
      const WorkItem& w = step.items[c.cast];
      ++ks.casts;
      ks.cast_us += w.dur;
      if (w.bytes > 0) ks.bytes += w.bytes;
      ks.items.push_back(c.cast);
      if (c.gather >= 0) {
        ks.gather_us += step.items[static_cast<std::size_t>(c.gather)].dur;
        ks.items.push_back(static_cast<std::size_t>(c.gather));
        ++gathers;
      }
      ++total;
      fp8 += w.fp8_source ? 1 : 0;
      ++names[w.name];
      ++ops[w.op];
      if (w.bytes > 0) bytes_each.push_back(w.bytes);
      if (w.out_bytes > 0) out_each.push_back(w.out_bytes);
      if (w.out_bytes > 0 && c.kv_bytes > 0) ratios.push_back(w.out_bytes / c.kv_bytes);
      time_each.push_back(w.dur);
    }
    ks.share = step.wall() > 0 ? (ks.cast_us + ks.gather_us) / step.wall() : 0;
    per_step.push_back(ks.casts);
    att_counts.push_back(step.attention_calls);
    ++f.steps_with_pattern;
  }
  if (f.steps_with_pattern == 0 ||
      2 * f.steps_with_pattern < static_cast<int>(timeline.steps.size())) {
    f.steps_with_pattern = 0;
    for (KvCastStep& ks : f.steps) ks = KvCastStep{};
    return f;
  }
  f.found = true;
  f.kind = 2 * gathers > total ? "gather" : "pool";
  f.fp8_source = 2 * fp8 > total;
  auto most = [&](const std::map<std::uint32_t, int>& m) {
    return trace.names[std::max_element(m.begin(), m.end(), [](const auto& a, const auto& b) {
                         return a.second < b.second;
                       })->first];
  };
  f.name = most(names);
  f.op = most(ops);
  f.per_step = static_cast<int>(median(per_step));
  f.attention_per_step = static_cast<int>(median(att_counts));
  f.bytes_each = median(bytes_each);
  f.out_bytes_each = median(out_each);
  f.kv_ratio = median(ratios);
  f.us_each = median(time_each);
  double bytes_sum = 0, wall_sum = 0;
  bool bytes_known = !bytes_each.empty();
  for (std::size_t s = 0; s < f.steps.size(); ++s) {
    const KvCastStep& ks = f.steps[s];
    if (ks.casts == 0) continue;
    f.cast_us_per_step += ks.cast_us / f.steps_with_pattern;
    f.gather_us_per_step += ks.gather_us / f.steps_with_pattern;
    bytes_sum += ks.bytes / f.steps_with_pattern;
    wall_sum += timeline.steps[s].wall() / f.steps_with_pattern;
  }
  // The share of the mean step (so that it agrees with the mean row of the report).
  f.share = wall_sum > 0 ? (f.cast_us_per_step + f.gather_us_per_step) / wall_sum : 0;
  f.save_us_per_step = f.cast_us_per_step + f.gather_us_per_step;
  if (bytes_known) {
    // The casts' own traffic; a gather before them reads and writes what the cast reads.
    const double gather_bytes = f.kind == "gather" && f.out_bytes_each > 0 && f.bytes_each > 0
                                    ? 2.0 * (f.bytes_each - f.out_bytes_each) * f.per_step
                                    : 0.0;
    f.save_bytes_per_step = bytes_sum + gather_bytes;
  }
  return f;
}

}  // namespace fp8mla::audit
