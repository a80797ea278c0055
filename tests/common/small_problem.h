// A small valid decode problem that the CPU validation and bad-input tests edit one field at a
// time: 2 requests of 1 and 2 query tokens over 5 and 9 cached tokens, 8 heads, pages of 4 in a
// pool of 16, a 4-SM plan. sparse_indices is empty (dense) until a test fills it.
#pragma once

#include <cstdint>
#include <vector>

#include "fp8mla/attention.h"

namespace fp8mla::test {

struct SmallProblem {
  std::vector<std::int32_t> qo_indptr{0, 1, 3};
  std::vector<std::int32_t> kv_indptr{0, 2, 5};
  std::vector<std::int32_t> kv_indices{0, 1, 2, 3, 4};
  std::vector<std::int32_t> kv_len{5, 9};
  std::vector<std::int32_t> sparse_indices;
  Problem p;
  PlanOptions o;

  SmallProblem() {
    p.num_heads = 8;
    p.page_size = 4;
    p.num_pages = 16;
    p.sm_scale = 0.0625f;
    o.sm_count = 4;
  }
  // p with the arrays as they are now (views of this object's vectors).
  Problem problem() {
    p.qo_indptr = qo_indptr;
    p.kv_indptr = kv_indptr;
    p.kv_indices = kv_indices;
    p.kv_len = kv_len;
    p.sparse_indices = sparse_indices;
    return p;
  }
};

}  // namespace fp8mla::test
