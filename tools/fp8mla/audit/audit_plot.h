// `fp8mla audit --plot FILE.svg`: each step as a stacked bar of its time by category (the KV
// cast hatched red), and the median step as a timeline of its work, KV casts marked.
#pragma once

#include <string>

#include "tools/fp8mla/audit/kv_cast.h"
#include "tools/fp8mla/audit/timeline.h"
#include "tools/fp8mla/audit/trace.h"

namespace fp8mla::audit {

// Throws std::runtime_error naming `path` when it cannot be written.
void plot_audit(const Trace& trace, const Timeline& timeline, const KvCastFinding& kv,
                const std::string& title, const std::string& verdict, const std::string& path);

}  // namespace fp8mla::audit
