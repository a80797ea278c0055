// `fp8mla bench --plot FILE.svg`: the grid as a roofline. Each case is a point at its
// arithmetic intensity (attention flops per byte of KV traffic, as the bench counts them) and
// its achieved TF/s; the measured ceilings are the roofs (streaming read and device copy
// bandwidth, bf16 matmul). A point's distance below its roof is what is left on the table.
#pragma once

#include <string>
#include <vector>

namespace fp8mla::cli {

struct RooflinePoint {
  std::string series;  // "native fp8_e4m3", "cast_pool", ... (one colour and marker each)
  double flops_per_byte = 0;
  double tflops = 0;
  std::string label;  // shown on hover
};

struct RooflineData {
  std::string title;
  std::string device;
  double read_gbs = 0;    // streaming read ceiling (0: not measured)
  double copy_gbs = 0;    // device copy ceiling (read + write)
  double matmul_tfs = 0;  // bf16 matmul ceiling (0: not measured)
  std::vector<RooflinePoint> points;
  std::string note;  // one line under the title
};

// Throws std::runtime_error naming `path` when it cannot be written.
void plot_roofline(const RooflineData& data, const std::string& path);

}  // namespace fp8mla::cli
