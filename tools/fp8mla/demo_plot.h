// `fp8mla demo --plot FILE.svg`: the three strategies layer by layer (each layer's cast or
// gather and its attention stacked, native FP8 beside them), and the whole step's totals with
// the bytes each moves.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fp8mla::cli {

struct DemoLayerTimes {
  double cast_ms = 0, cast_attend_ms = 0;      // (1) cast the pool, attend bf16
  double gather_ms = 0, gather_attend_ms = 0;  // (2) gather + cast, attend bf16
  double native_ms = 0;                        // (3) native FP8
};

struct DemoPlotData {
  std::string model, device, format;
  std::int64_t pool_tokens = 0, active_tokens = 0;
  int batch = 0, page_size = 0;
  double bytes_cast = 0, bytes_gather = 0, bytes_native = 0;  // KV bytes a layer
  std::vector<DemoLayerTimes> layers;
};

// Throws std::runtime_error naming `path` when it cannot be written.
void plot_demo(const DemoPlotData& data, const std::string& path);

}  // namespace fp8mla::cli
