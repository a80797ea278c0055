// The categories `fp8mla audit` sorts a step's time into, and the name rules that decide them.
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <vector>

namespace fp8mla::audit {

enum class Category : int { attention, cast_copy, gemm, communication, other };
constexpr int kCategories = 5;
constexpr std::array<Category, kCategories> kAllCategories = {
    Category::attention, Category::cast_copy, Category::gemm, Category::communication,
    Category::other};

// "attention", "cast/copy", "GEMM", "comm", "other" (for tables), and the JSON keys.
std::string_view category_label(Category c);
std::string_view category_key(Category c);

// Extra name fragments (case-insensitive substrings) given on the command line.
struct CategoryRules {
  std::vector<std::string> attention, cast;
};

// The category of an operator or kernel by its name: communication (nccl, all_reduce, ...),
// then attention (attention, attn, fmha, mla, flash, ...), then GEMM (gemm, gemv, aten::mm,
// aten::linear, cutlass, nvjet, ...), then dtype casts and copies (aten::copy_, aten::to,
// aten::_to_copy, direct_copy_kernel, memcpy, casts and (de)quantisation), else other.
Category categorize(std::string_view name, const CategoryRules& rules = {});

// Gathers: an operator or kernel that picks rows by index (aten::index, index_select, gather,
// embedding), which a KV "gather then cast" runs before its cast.
bool is_gather(std::string_view name);
// A dtype conversion rather than a plain copy, where the name says so (a cast kernel names
// its element types, e.g. "...Float8_e4m3fn..." or "...WithCast...").
bool names_fp8(std::string_view name);

}  // namespace fp8mla::audit
