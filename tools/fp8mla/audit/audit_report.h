// What `fp8mla audit` prints and writes: the steps and their time by category, the KV cast when
// there is one (bytes, share of the step, what reading FP8 natively saves), and a verdict line.
#pragma once

#include <string>

#include "tools/fp8mla/audit/kv_cast.h"
#include "tools/fp8mla/audit/timeline.h"
#include "tools/fp8mla/audit/trace.h"

namespace fp8mla::audit {

struct Audit {
  std::string path;
  Trace trace;
  Timeline timeline;
  KvCastFinding kv;
};

// One line a person can act on.
std::string verdict(const Audit& a);

// The report on stdout; `max_steps` rows of steps at most (then the mean).
void print_report(const Audit& a, int max_steps);

// The same as JSON (throws std::runtime_error naming `path` when it cannot be written).
void write_report_json(const Audit& a, const std::string& path);

}  // namespace fp8mla::audit
