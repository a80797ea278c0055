#include "tools/fp8mla/audit/category.h"

#include <algorithm>
#include <cctype>

namespace fp8mla::audit {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool has_any(const std::string& name, std::initializer_list<std::string_view> parts) {
  return std::any_of(parts.begin(), parts.end(),
                     [&](std::string_view p) { return name.find(p) != std::string::npos; });
}

bool has_any(const std::string& name, const std::vector<std::string>& parts) {
  return std::any_of(parts.begin(), parts.end(), [&](const std::string& p) {
    return !p.empty() && name.find(lower(p)) != std::string::npos;
  });
}

bool is_exact(const std::string& name, std::initializer_list<std::string_view> names) {
  return std::any_of(names.begin(), names.end(), [&](std::string_view n) { return name == n; });
}

}  // namespace

std::string_view category_label(Category c) {
  switch (c) {
    case Category::attention:
      return "attention";
    case Category::cast_copy:
      return "cast/copy";
    case Category::gemm:
      return "GEMM";
    case Category::communication:
      return "comm";
    case Category::other:
      break;
  }
  return "other";
}

std::string_view category_key(Category c) {
  switch (c) {
    case Category::attention:
      return "attention";
    case Category::cast_copy:
      return "cast_copy";
    case Category::gemm:
      return "gemm";
    case Category::communication:
      return "communication";
    case Category::other:
      break;
  }
  return "other";
}

Category categorize(std::string_view raw, const CategoryRules& rules) {
  const std::string name = lower(raw);
  if (has_any(name, {"nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                     "reducescatter", "all_to_all", "alltoall", "c10d::", "cross_device_reduce",
                     "broadcast_", "send_recv", "_allreduce"})) {
    return Category::communication;
  }
  if (has_any(name, rules.attention) || has_any(name, {"attention",
                                                       "attn",
                                                       "fmha",
                                                       "mla_decode",
                                                       "fp8mla",
                                                       "flashmla",
                                                       "flash_mla",
                                                       "flashinfer::batch",
                                                       "batchmla",
                                                       "batch_mla",
                                                       "mha_fwd",
                                                       "mha_varlen",
                                                       "paged_mqa",
                                                       "sdpa",
                                                       "scaled_dot_product",
                                                       "decode_mla",
                                                       "mla_fwd",
                                                       "splitkv_mla",
                                                       "flash_fwd",
                                                       "flashfwd"})) {
    return Category::attention;
  }
  if (has_any(name, rules.cast)) return Category::cast_copy;
  if (is_exact(name, {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
                      "aten::linear", "aten::_scaled_mm", "aten::einsum", "aten::_addmm_activation",
                      "aten::dot", "aten::mv", "aten::addmv"}) ||
      has_any(name, {"gemm", "gemv", "cublas", "cutlass", "xmma", "nvjet", "_mm_", "matmul",
                     "cutlass_scaled_mm", "deep_gemm", "wgmma", "mkldnn_matmul", "brgemm"})) {
    return Category::gemm;
  }
  if (is_exact(name, {"aten::copy_", "aten::to", "aten::_to_copy", "aten::_copy_from",
                      "aten::_copy_from_and_resize", "aten::clone", "aten::contiguous",
                      "aten::type_as", "aten::_to_dtype"}) ||
      has_any(name, {"copy_kernel", "direct_copy", "memcpy", "copy_device_to_device", "withcast",
                     "_cast_", "cast_kernel", "convert_", "dequant", "quant_"})) {
    return Category::cast_copy;
  }
  return Category::other;
}

bool is_gather(std::string_view raw) {
  const std::string name = lower(raw);
  return is_exact(name, {"aten::index", "aten::index_select", "aten::gather", "aten::take",
                         "aten::embedding"}) ||
         has_any(name, {"index_elementwise_kernel", "indexselect", "index_select", "gather_kernel",
                        "vectorized_gather"});
}

bool names_fp8(std::string_view raw) {
  const std::string name = lower(raw);
  return has_any(name, {"float8", "fp8", "e4m3", "e5m2"});
}

}  // namespace fp8mla::audit
