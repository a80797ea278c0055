// Reads a PyTorch profiler trace (Chrome trace JSON, as torch.profiler's export_chrome_trace
// and tensorboard_trace_handler write it, gzipped or not) into a Trace, streaming: the file is
// read, inflated, framed and parsed (simdjson's On-Demand API) a batch of events at a time, so
// memory holds one batch plus the compact records kept, whatever the file's size.
#pragma once

#include <cstddef>
#include <string>

#include "tools/fp8mla/audit/trace.h"

namespace fp8mla::audit {

struct ReadOptions {
  std::size_t batch_bytes = std::size_t{8} << 20;  // JSON handed to the parser at a time
  std::size_t read_bytes = std::size_t{4} << 20;   // bytes read (inflated) at a time
};

// False when this build has no JSON parser (configured without simdjson).
bool trace_reader_built();

// Reads `path`. Throws TraceError naming the file and the byte offset (of the JSON text, after
// gzip) for a trace that is truncated, not JSON, or not a Chrome trace; fp8mla::Error
// (unsupported) when this build has no trace reader.
Trace read_trace(const std::string& path, const ReadOptions& options = {});

}  // namespace fp8mla::audit
