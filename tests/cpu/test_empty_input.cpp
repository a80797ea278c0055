// Empty is valid: zero-element arrays are accepted wherever a zero extent is legal, whatever their
// strides and data pointer (numpy 2 and nanobind give empty arrays stride 0; torch gives them a
// null pointer), and give the documented results: rows that see no token get o = 0 and
// lse = -inf, and calls with nothing to do are no-ops that write nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/cache.h"
#include "fp8mla/context_parallel.h"
#include "tests/common/test_util.h"

namespace fp8mla {
namespace {

using I32 = std::vector<std::int32_t>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

TEST(EmptyInput, ViewsWithoutElementsAreContiguousWhateverTheirStrides) {
  std::int32_t x = 0;
  EXPECT_TRUE(make_strided_view(&x, DType::i32, {0}, {0}).is_contiguous());
  EXPECT_TRUE(make_strided_view(&x, DType::f32, {0, 512}, {0, 0}).is_contiguous());
  EXPECT_TRUE(make_strided_view(&x, DType::f32, {3, 0, 4}, {7, 0, 9}).is_contiguous());
  EXPECT_EQ(make_strided_view(&x, DType::f32, {3, 0, 4}, {7, 0, 9}).numel(), 0);
  // An extent of 1 takes any stride (torch's rule); a larger one does not.
  EXPECT_TRUE(make_strided_view(&x, DType::f32, {2, 1, 3}, {3, 99, 1}).is_contiguous());
  EXPECT_FALSE(make_strided_view(&x, DType::f32, {2, 2, 3}, {3, 99, 1}).is_contiguous());
}

// Host tensors for `tokens` query tokens x 4 heads over an fp8_e4m3 pool of 8 pages of 4.
struct Batch {
  I32 qo_indptr, kv_indptr, kv_indices, kv_len;
  std::vector<std::uint16_t> q_nope, q_pe;
  std::vector<std::uint8_t> cache = std::vector<std::uint8_t>(8 * 4 * 576);
  test::HostOutput out;
  Problem p;

  Batch(I32 qo, I32 kvp, I32 kvi, I32 len)
      : qo_indptr(std::move(qo)),
        kv_indptr(std::move(kvp)),
        kv_indices(std::move(kvi)),
        kv_len(std::move(len)),
        q_nope(static_cast<std::size_t>(qo_indptr.back()) * 4 * 512, 0x3f80),
        q_pe(static_cast<std::size_t>(qo_indptr.back()) * 4 * 64, 0x3f80),
        out(qo_indptr.back(), 4, 16) {
    p.num_heads = 4;
    p.page_size = 4;
    p.num_pages = 8;
    p.sm_scale = 0.125f;
    p.qo_indptr = qo_indptr;
    p.kv_indptr = kv_indptr;
    p.kv_indices = kv_indices;
    p.kv_len = kv_len;
  }
  RunArgs args() {
    const std::int64_t tq = qo_indptr.back();
    RunArgs a;
    a.q_nope = make_view(q_nope.data(), DType::bf16, {tq, 4, 512});
    a.q_pe = make_view(q_pe.data(), DType::bf16, {tq, 4, 64});
    a.kv.format = KvFormat::fp8_e4m3;
    a.kv.ckv = make_strided_view(cache.data(), DType::u8, {8, 4, 512}, {4 * 576, 576, 1});
    a.kv.kpe = make_strided_view(cache.data() + 512, DType::u8, {8, 4, 64}, {4 * 576, 576, 1});
    a.out = out.out_view();
    a.lse = out.lse_view();
    return a;
  }
};

// Every request has kv_len 0 and the page table is empty: each row gets o = 0, lse = -inf (a
// context-parallel shard past the end of every request looks like this), on both CPU paths.
TEST(EmptyInput, BatchWithoutContext) {
  for (const bool reference : {false, true}) {
    Batch b({0, 1, 3, 3}, {0, 0, 0, 0}, {}, {0, 0, 0});
    b.p.causal = true;  // qo_len > kv_len = 0 is allowed: nothing to see
    PlanOptions o;
    o.cpu_reference = reference;
    run(plan(b.p, o), b.args());
    for (const std::uint16_t v : b.out.out()) ASSERT_EQ(v, 0);
    for (const float l : b.out.lse()) ASSERT_EQ(l, kNegInf);
    EXPECT_TRUE(b.out.guards_intact());
  }
}

// No requests at all (qo_indptr = [0]: an engine's idle step): plans, and run() takes views of 0
// rows with any strides and a null data pointer, writing nothing.
TEST(EmptyInput, BatchOfNoRequests) {
  Batch b({0}, {0}, {}, {});
  const Plan p = plan(b.p);
  EXPECT_EQ(p.batch(), 0);
  EXPECT_EQ(p.total_q(), 0);
  EXPECT_TRUE(p.tiles().empty());
  RunArgs a = b.args();
  a.q_nope = make_strided_view(nullptr, DType::bf16, {0, 4, 512}, {0, 0, 0});
  a.q_pe = make_strided_view(nullptr, DType::bf16, {0, 4, 64}, {0, 0, 0});
  a.out = make_strided_view(nullptr, DType::bf16, {0, 4, 512}, {0, 0, 0});
  EXPECT_NO_THROW(run(p, a));
  EXPECT_TRUE(b.out.guards_intact());
  // The empty batch shards too (every rank gets it).
  ContextShard s;
  shard_context(b.p, 1, 2, s);
  EXPECT_EQ(s.kv_indptr, I32{0});
}

// Requests without query tokens: nothing to compute; the 0-row views may have stride 0.
TEST(EmptyInput, RequestsWithoutQueryTokens) {
  Batch b({0, 0, 0}, {0, 1, 2}, {0, 1}, {3, 4});
  const Plan p = plan(b.p);
  RunArgs a = b.args();
  a.q_nope = make_strided_view(b.q_pe.data(), DType::bf16, {0, 4, 512}, {0, 0, 0});
  a.q_pe = make_strided_view(b.q_pe.data(), DType::bf16, {0, 4, 64}, {0, 0, 0});
  a.out = make_strided_view(b.q_pe.data(), DType::bf16, {0, 4, 512}, {0, 0, 0});
  a.lse = make_strided_view(b.q_pe.data(), DType::f32, {0, 4}, {0, 0});
  EXPECT_NO_THROW(run(p, a));
}

TEST(EmptyInput, AppendOfNoTokens) {
  PagedLatentCache cache({.num_pages = 2, .page_size = 4});
  const std::vector<std::uint8_t> before(cache.storage().as<std::uint8_t>(),
                                         cache.storage().as<std::uint8_t>() + 2 * 4 * 576);
  std::int32_t slot = 0;
  float value = 0.0f;
  EXPECT_NO_THROW(cache.append(make_strided_view(&slot, DType::i32, {0}, {0}),
                               make_strided_view(&value, DType::f32, {0, 512}, {0, 0}),
                               make_strided_view(&value, DType::f32, {0, 64}, {0, 0})));
  EXPECT_NO_THROW(cache.append(make_view(nullptr, DType::i32, {0}),
                               make_view(nullptr, DType::bf16, {0, 512}),
                               make_view(nullptr, DType::bf16, {0, 64})));
  EXPECT_TRUE(std::equal(before.begin(), before.end(), cache.storage().as<std::uint8_t>()));
  EXPECT_NO_THROW(cache.release({}));
  EXPECT_TRUE(cache.allocate(0).empty());
}

TEST(EmptyInput, MergeOfNoRows) {
  float x = 0.0f;
  EXPECT_NO_THROW(merge_states(make_strided_view(&x, DType::f32, {0, 3, 16}, {0, 0, 0}),
                               make_strided_view(&x, DType::f32, {0, 3}, {0, 0}),
                               make_strided_view(&x, DType::bf16, {0, 16}, {0, 0}),
                               make_strided_view(&x, DType::f32, {0}, {0})));
  EXPECT_EQ(x, 0.0f);
}

// Rows that merge no states (num_states = 0) are rows whose states are all empty: v_out = 0,
// s_out = -inf. D = 0 leaves nothing but s_out to write.
TEST(EmptyInput, MergeOfNoStates) {
  std::vector<float> v_out(3 * 16, std::bit_cast<float>(test::kPoisonF32));
  std::vector<float> s_out(3, std::bit_cast<float>(test::kPoisonF32));
  // Null data with the strides of a dense view: no address may be formed in them (UBSan).
  merge_states(make_strided_view(nullptr, DType::f32, {3, 0, 16}, {0, 16, 1}),
               make_strided_view(nullptr, DType::f32, {3, 0}, {5, 1}),
               make_view(v_out.data(), DType::f32, {3, 16}),
               make_view(s_out.data(), DType::f32, {3}));
  for (const float v : v_out) ASSERT_EQ(v, 0.0f);
  for (const float s : s_out) ASSERT_EQ(s, kNegInf);
  std::vector<float> s{0.5f, 1.0f, -1.0f, kNegInf, 2.0f, 2.0f};
  s_out.assign(3, 0.0f);
  merge_states(make_strided_view(nullptr, DType::f32, {3, 2, 0}, {2, 1, 1}),
               make_view(s.data(), DType::f32, {3, 2}),
               make_strided_view(nullptr, DType::f32, {3, 0}, {4, 1}),
               make_view(s_out.data(), DType::f32, {3}));
  EXPECT_NEAR(s_out[0], std::log(std::exp(0.5f) + std::exp(1.0f)), 1e-6);
  EXPECT_EQ(s_out[1], -1.0f);
  EXPECT_NEAR(s_out[2], 2.0f + std::log(2.0f), 1e-6);
}

}  // namespace
}  // namespace fp8mla
