// What the GPU decode grids measure (gpu_bench.cu: dense; sparse_bench.cu: sparse top-k): the
// device's ceilings and one row of results.
#pragma once

#include <cstdint>
#include <string>

#include "fp8mla/format.h"

namespace fp8mla::bench {

struct Ceilings {
  double copy_gbs = 0, read_gbs = 0, matmul_tfs = 0;  // matmul 0 = not measured
};

struct CaseResult {
  int batch = 0, heads = 0, context = 0, qo_len = 1, page_size = 0;
  KvFormat format = KvFormat::fp8_e4m3;
  std::string strategy;  // native | cast_pool | gather_cast
  double us = 0, gbs = 0, read_pct = 0, tfs = 0, mm_pct = 0;
  // Rel L2 of the output against check_against's on the same inputs (-1: not checked; NaN or
  // infinite: a row the run left unwritten or wrong).
  double check = -1;
  std::string kernel;         // native: the plan's kernel family (Plan::kernel_name)
  std::string check_against;  // what check compares with: gather_cast (dense), reference (sparse)
  int topk = 0;               // > 0: a sparse top-k row (context 0)
  int valid_per_row = 0;      // sparse: listed (not -1) slots a top-k row
  std::int64_t pool_tokens = 0;  // sparse: the tokens the slots are drawn over
  double bytes = 0;              // the floor's bytes of one call (GB/s is bytes / us)
  double gather_gbs = 0;         // sparse: the same lists' bytes read by a plain gather kernel
};

// The format in the tables' 9-character column: fp8 (fp8_e4m3), fp8_block (FlashMLA's 656-byte
// tokens), bf16.
inline const char* table_format(KvFormat f) {
  return f == KvFormat::fp8_e4m3 ? "fp8" : f == KvFormat::fp8_e4m3_block ? "fp8_block" : "bf16";
}

}  // namespace fp8mla::bench
