// Uses only the installed public headers: builds a small FP8 cache on the CPU, appends a
// request's tokens, plans one decode step and runs it. Exits non-zero on a non-finite result.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/cache.h"
#include "fp8mla/error.h"
#include "fp8mla/format.h"
#include "fp8mla/tensor.h"

int main() {
  using namespace fp8mla;
  try {
    constexpr int kTokens = 40, kHeads = 8, kPageSize = 16;
    CacheConfig config;
    config.num_pages = 8;
    config.page_size = kPageSize;
    config.format = KvFormat::fp8_e4m3;
    PagedLatentCache cache(config);
    std::vector<std::int32_t> pages = cache.allocate(3);  // 48 slots for 40 tokens

    // Deterministic values in [-1, 1): no RNG needed to show the API.
    auto value = [](int i) { return static_cast<float>((i * 37) % 200) / 100.0f - 1.0f; };
    std::vector<float> ckv(kTokens * kDimCkv), kpe(kTokens * kDimKpe);
    for (std::size_t i = 0; i < ckv.size(); ++i) ckv[i] = value(static_cast<int>(i));
    for (std::size_t i = 0; i < kpe.size(); ++i) kpe[i] = value(static_cast<int>(i) + 7);
    std::vector<std::int32_t> slots(kTokens);
    for (int t = 0; t < kTokens; ++t) slots[t] = pages[t / kPageSize] * kPageSize + t % kPageSize;
    cache.append(make_view(slots.data(), DType::i32, {kTokens}),
                 make_view(ckv.data(), DType::f32, {kTokens, kDimCkv}),
                 make_view(kpe.data(), DType::f32, {kTokens, kDimKpe}));

    const std::vector<std::int32_t> qo_indptr = {0, 1}, kv_indptr = {0, 3}, kv_len = {kTokens};
    Problem problem;
    problem.num_heads = kHeads;
    problem.page_size = kPageSize;
    problem.num_pages = config.num_pages;
    problem.kv_format = config.format;
    problem.sm_scale = 0.0625f;
    problem.qo_indptr = qo_indptr;
    problem.kv_indptr = kv_indptr;
    problem.kv_indices = pages;
    problem.kv_len = kv_len;
    const Plan p = plan(problem);

    std::vector<std::uint16_t> q_nope(kHeads * kDimCkv), q_pe(kHeads * kDimKpe);
    for (std::size_t i = 0; i < q_nope.size(); ++i)
      q_nope[i] = float_to_bf16(value(static_cast<int>(i) + 3));
    for (std::size_t i = 0; i < q_pe.size(); ++i)
      q_pe[i] = float_to_bf16(value(static_cast<int>(i) + 5));
    std::vector<std::uint16_t> out(kHeads * kDimCkv);
    std::vector<float> lse(kHeads);
    RunArgs args;
    args.q_nope = make_view(q_nope.data(), DType::bf16, {1, kHeads, kDimCkv});
    args.q_pe = make_view(q_pe.data(), DType::bf16, {1, kHeads, kDimKpe});
    args.kv = cache.view();
    args.out = make_view(out.data(), DType::bf16, {1, kHeads, kDimCkv});
    args.lse = make_view(lse.data(), DType::f32, {1, kHeads});
    run(p, args);

    double sum = 0.0;
    for (const std::uint16_t v : out) sum += bf16_to_float(v);
    std::printf(
        "fp8mla %s consumer: decode of %d fp8 tokens x %d heads: sum(o) = %.4f, lse[0] = %.4f\n",
        version(), kTokens, kHeads, sum, static_cast<double>(lse[0]));
    return std::isfinite(sum) && std::isfinite(lse[0]) ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "fp8mla consumer: %s\n", e.what());
    return 1;
  }
}
