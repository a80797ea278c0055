// run() on a CUDA plan: the decode kernel of the plan's family, then the split-KV merge.
#include <cuda.h>  // CUtensorMap and its encoder's types; the encoder is reached through the runtime

#include <array>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>

#include "src/core/backend.h"
#include "src/core/check.h"
#include "src/core/dispatch.h"
#include "src/cuda/cuda_util.cuh"
#include "src/cuda/decode_bf16_seesaw_kernel.cuh"
#include "src/cuda/decode_bf16_tma_kernel.cuh"
#include "src/cuda/decode_fp8_gather_kernel.cuh"
#include "src/cuda/decode_fp8_kernel.cuh"
#include "src/cuda/decode_fp8_tma_kernel.cuh"
#include "src/cuda/decode_kernel.cuh"
#include "src/cuda/decode_wgmma_kernel.cuh"
#include "src/cuda/decode_wgmma_ws_kernel.cuh"
#include "src/cuda/decode/portable/launch.h"
#include "src/cuda/merge/split_merge.h"
#include "src/cuda/plan_buffers.h"

namespace fp8mla::detail {

namespace {

// ---- the launch table: kernel family (src/core/dispatch.h) -> kernel ----
using DecodeFn = void (*)(const DecodeParams);
struct KernelEntry {
  DecodeFn fn;
  int smem;
  int threads = decode::kThreads;
  int regs = 0;              // > 0: the register count the kernel's setmaxnreg split assumes
  bool tensor_maps = false;  // reads the cache through DecodeParams::ckv_map / kpe_map
};
template <KvFormat F, int MT>
constexpr KernelEntry shared_tile_entry() {
  return {&mla_decode_kernel<F, MT>, decode::Smem<F, MT>::kBytes};
}
template <bool kBf16>
constexpr KernelEntry wide_rows_entry() {
  return {&mla_decode_wgmma_ws_kernel<kBf16>, ws::Layout<kBf16>::kSmemBytes, ws::kThreads,
          ws::kLaunchRegs};
}
const KernelEntry kSharedTile[] = {
    shared_tile_entry<KvFormat::bf16, 1>(), shared_tile_entry<KvFormat::fp8_e4m3_block, 1>(),
    shared_tile_entry<KvFormat::fp8_e4m3_block, 2>(),
    shared_tile_entry<KvFormat::fp8_e4m3_block, 4>()};
const KernelEntry kFp8Exact{&mla_decode_fp8_kernel, fp8frag::kSmemBytes};
const KernelEntry kFp8Tma{&mla_decode_fp8_tma_kernel, fp8tma::kSmemBytes, decode::kThreads, 0,
                          true};
const KernelEntry kFp8Gather{&mla_decode_fp8_gather_kernel, fp8gather::kSmemBytes,
                             fp8gather::kCtaThreads};
const KernelEntry kBf16Tma{&mla_decode_bf16_tma_kernel<false>, bf16tma::Layout<false>::kSmemBytes,
                           decode::kThreads, 0, true};
const KernelEntry kBf16Gather{&mla_decode_bf16_tma_kernel<true>, bf16tma::Layout<true>::kSmemBytes,
                              bf16tma::kCtaThreads<true>};
const KernelEntry kWideRows[] = {wide_rows_entry<false>(), wide_rows_entry<true>()};
const KernelEntry kBf16WideRows{&mla_decode_bf16_seesaw_kernel, seesaw::Layout::kSmemBytes,
                                seesaw::kThreads, 0, true};

// Shared memory a portable kernel gets on `device_id`: two cp.async stages where the device
// allows them (sm_80, sm_90, sm_100), else one (sm_86, sm_89, sm_120: 99 KB a CTA).
// FP8MLA_PORTABLE_STAGES=1 in the environment asks for one everywhere (the GPU tests run the
// one-stage form on Hopper so).
int portable_smem(const portable::KernelInfo& k, int device_id) {
  int optin = 0;
  FP8MLA_CUDA_CHECK(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id));
  static const bool one_stage = [] {
    const char* v = std::getenv("FP8MLA_PORTABLE_STAGES");
    return v != nullptr && std::string(v) == "1";
  }();
  return !one_stage && k.smem_two_stages <= optin ? k.smem_two_stages : k.smem_one_stage;
}

// The kernel of `family` for tiles of `row_tiles` 16-row m-tiles of a `format` cache on
// `device_id`. The dispatch table gives each family only the formats and rows it serves;
// anything else is a bug.
KernelEntry kernel_entry(KernelFamily family, KvFormat format, int row_tiles, int device_id) {
  const bool rows16 = row_tiles == 1;
  switch (family) {
    case KernelFamily::portable:
    case KernelFamily::portable_fp8: {
      const portable::KernelInfo k = portable::kernel_for(
          format, row_tiles,
          family == KernelFamily::portable_fp8 ? portable::Scores::e4m3 : portable::Scores::f16);
      return {k.fn, portable_smem(k, device_id), portable::kThreads};
    }
    case KernelFamily::shared_tile:
      if (format == KvFormat::fp8_e4m3_block) return kSharedTile[row_tiles == 1 ? 1 : row_tiles == 2 ? 2 : 3];
      if (format == KvFormat::bf16 && rows16) return kSharedTile[0];
      break;
    case KernelFamily::fp8_exact:
      if (format == KvFormat::fp8_e4m3 && rows16) return kFp8Exact;
      break;
    case KernelFamily::fp8_tma:
      if (format == KvFormat::fp8_e4m3 && rows16) return kFp8Tma;
      break;
    case KernelFamily::fp8_gather:
      if (format == KvFormat::fp8_e4m3 && rows16) return kFp8Gather;
      break;
    case KernelFamily::bf16_tma:
      if (format == KvFormat::bf16 && rows16) return kBf16Tma;
      break;
    case KernelFamily::bf16_gather:
      if (format == KvFormat::bf16 && rows16) return kBf16Gather;
      break;
    case KernelFamily::wide_rows:
      if (format != KvFormat::fp8_e4m3_block && !rows16)
        return kWideRows[format == KvFormat::bf16 ? 1 : 0];
      break;
    case KernelFamily::bf16_wide_rows:
      if (format == KvFormat::bf16 && !rows16) return kBf16WideRows;
      break;
    default:
      break;
  }
  throw Error(ErrorCode::internal, "plan",
              msg("kernel family ", kernel_family_name(family), " has no CUDA kernel for ",
                  format_name(format), " tiles of ", 16 * row_tiles, " rows"));
}

// cuTensorMapEncodeTiled (a host function of the driver), found once through the runtime so the
// library links no libcuda.
using EncodeTiledFn = decltype(&cuTensorMapEncodeTiled);
EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    FP8MLA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                       cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || f == nullptr)
      throw Error(ErrorCode::cuda_error, "cuTensorMapEncodeTiled",
                  "the CUDA driver does not provide it (needs CUDA 12.0 or later)");
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// One cache half as a [num_pages, page_size, bytes] u8 tensor map with boxes of
// (bytes <= 128 wide) x min(page_size, 64) x 1 tokens and the swizzle of that width.
void encode_page_map(TensorMap& map, const void* base, std::uint64_t bytes, int page_size,
                     std::int64_t num_pages, std::int64_t token_stride, std::int64_t page_stride,
                     const char* name) {
  const cuuint64_t dims[3] = {bytes, static_cast<cuuint64_t>(page_size),
                              static_cast<cuuint64_t>(num_pages)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(token_stride),
                                 static_cast<cuuint64_t>(page_stride)};
  const cuuint32_t box[3] = {bytes >= 128 ? 128u : static_cast<cuuint32_t>(bytes),
                             static_cast<cuuint32_t>(std::min(page_size, 64)), 1};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = encode_tiled()(
      reinterpret_cast<CUtensorMap*>(&map), CU_TENSOR_MAP_DATA_TYPE_UINT8, 3,
      const_cast<void*>(base), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
      bytes >= 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error(
        ErrorCode::cuda_error, name,
        msg("cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(r), ") for token stride ",
            token_stride, " and page stride ", page_stride, " bytes"));
}

// Raises each kernel's dynamic shared-memory limit once per process (and device), and checks
// that a kernel with a setmaxnreg split got the register count the split adds up to (fewer
// would leave its consumers waiting for registers that never come).
void prepare(const KernelEntry& k) {
  static std::mutex mu;
  static std::array<const void*, 16> done{};
  std::lock_guard<std::mutex> lock(mu);
  for (const void* d : done)
    if (d == reinterpret_cast<const void*>(k.fn)) return;
  FP8MLA_CUDA_CHECK(
      cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem));
  if (k.regs > 0) {
    cudaFuncAttributes a{};
    FP8MLA_CUDA_CHECK(cudaFuncGetAttributes(&a, k.fn));
    require_register_count("decode kernel", a.numRegs, k.regs);
  }
  for (const void*& d : done)
    if (d == nullptr) {
      d = reinterpret_cast<const void*>(k.fn);
      break;
    }
}

void require_aligned(const void* p, std::int64_t bytes_stride_a, std::int64_t bytes_stride_b,
                     int align, const std::string& name) {
  const bool ok = reinterpret_cast<std::uintptr_t>(p) % align == 0 && bytes_stride_a % align == 0 &&
                  bytes_stride_b % align == 0;
  if (!ok) {
    throw Error(
        ErrorCode::invalid_argument, name,
        msg("the CUDA kernels need ", align, "-byte aligned data and outer strides (pointer ", p,
            ", strides ", bytes_stride_a, " and ", bytes_stride_b, " bytes)"));
  }
}

std::int64_t byte_stride(const TensorView& t, int dim) {
  return t.stride[dim] * static_cast<std::int64_t>(dtype_size(t.dtype));
}

}  // namespace

int cuda_ctas_per_sm(const PlanState& plan, KernelFamily family) {
  FP8MLA_CUDA_CHECK(cudaSetDevice(plan.device_id));
  const KernelEntry k =
      kernel_entry(family, plan.kv_format, row_tiles_for(plan.kernel_rows), plan.device_id);
  prepare(k);
  int n = 0;
  FP8MLA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k.fn, k.threads, k.smem));
  return std::max(n, 1);
}

void cuda_run(PlanState& plan, const RunArgs& args) {
  CudaPlanBuffers& b = *plan.cuda;
  FP8MLA_CUDA_CHECK(cudaSetDevice(plan.device_id));
  const auto stream = static_cast<cudaStream_t>(args.stream);
  const KvCacheView& kv = args.kv;
  require_aligned(args.q_nope.data, byte_stride(args.q_nope, 0), byte_stride(args.q_nope, 1), 16,
                  "q_nope");
  require_aligned(args.q_pe.data, byte_stride(args.q_pe, 0), byte_stride(args.q_pe, 1), 16, "q_pe");
  require_aligned(kv.ckv.data, byte_stride(kv.ckv, 0), byte_stride(kv.ckv, 1), 16, "kv.ckv");
  if (kv.format != KvFormat::fp8_e4m3_block)
    require_aligned(kv.kpe.data, byte_stride(kv.kpe, 0), byte_stride(kv.kpe, 1), 16, "kv.kpe");
  require_aligned(args.out.data, byte_stride(args.out, 0), byte_stride(args.out, 1), 4, "out");

  DecodeParams p{};
  p.tiles = b.tiles;
  p.num_tiles = b.counts;
  // A borrowed page table (Problem::borrowed_kv_indices) is read where the caller keeps it.
  p.kv_indices = plan.borrowed_kv_indices.defined()
                     ? static_cast<const std::int32_t*>(plan.borrowed_kv_indices.data)
                     : b.kv_indices;
  p.sparse_indices = args.sparse_indices.defined()
                         ? static_cast<const std::int32_t*>(args.sparse_indices.data)
                         : b.sparse;
  p.topk = plan.topk;
  p.num_heads = plan.num_heads;
  p.page_shift = 0;
  while ((1 << p.page_shift) < plan.page_size) ++p.page_shift;
  p.pool_slots = plan.num_pages * plan.page_size;
  p.causal = plan.causal;
  const float s = plan.sm_scale * kLog2e;  // as pow2_scale_ratio (dispatch.h) computes it
  const bool per_tensor = kv.format == KvFormat::fp8_e4m3;
  p.scale_nope = per_tensor ? s * kv.ckv_scale : s;
  p.scale_pe = per_tensor ? s * kv.kpe_scale : s;
  p.out_scale = per_tensor ? kv.ckv_scale : 1.0f;
  p.q_nope = static_cast<const __nv_bfloat16*>(args.q_nope.data);
  p.q_nope_stride[0] = args.q_nope.stride[0];
  p.q_nope_stride[1] = args.q_nope.stride[1];
  p.q_pe = static_cast<const __nv_bfloat16*>(args.q_pe.data);
  p.q_pe_stride[0] = args.q_pe.stride[0];
  p.q_pe_stride[1] = args.q_pe.stride[1];
  p.ckv = static_cast<const std::uint8_t*>(kv.ckv.data);
  p.ckv_page_stride = byte_stride(kv.ckv, 0);
  p.ckv_token_stride = byte_stride(kv.ckv, 1);
  if (kv.format != KvFormat::fp8_e4m3_block) {
    p.kpe = static_cast<const std::uint8_t*>(kv.kpe.data);
    p.kpe_page_stride = byte_stride(kv.kpe, 0);
    p.kpe_token_stride = byte_stride(kv.kpe, 1);
  }
  p.out = static_cast<__nv_bfloat16*>(args.out.data);
  p.out_stride[0] = args.out.stride[0];
  p.out_stride[1] = args.out.stride[1];
  p.lse = args.lse.defined() ? static_cast<float*>(args.lse.data) : nullptr;
  if (p.lse != nullptr) {
    p.lse_stride[0] = args.lse.stride[0];
    p.lse_stride[1] = args.lse.stride[1];
  }
  p.partial_o = b.partial_o;
  p.partial_lse = b.partial_lse;

  // Graph-mode plans launch their full capacity (idle CTAs exit at once), so a captured launch
  // stays valid when replan() changes the tile count.
  const std::int64_t grid = b.graph ? b.cap_tiles : b.num_tiles;
  const KernelEntry k = kernel_entry(plan.family, kv.format, b.row_tiles, plan.device_id);
  if (k.tensor_maps && grid > 0) {
    const int element = kv.format == KvFormat::bf16 ? 2 : 1;  // bytes
    encode_page_map(p.ckv_map, p.ckv, 512 * element, plan.page_size, plan.num_pages,
                    p.ckv_token_stride, p.ckv_page_stride, "kv.ckv");
    encode_page_map(p.kpe_map, p.kpe, 64 * element, plan.page_size, plan.num_pages,
                    p.kpe_token_stride, p.kpe_page_stride, "kv.kpe");
  }
  // Both launches are programmatic dependents of the kernel before them (pdl_wait in the
  // kernels): a launch overlaps that kernel's end instead of following it
  // (decode::begin_after_previous_kernel).
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.stream = stream;
  cfg.attrs = &pdl;
  cfg.numAttrs = plan.arch >= 90 ? 1 : 0;  // PDL exists from sm_90
  if (grid > 0) {
    prepare(k);
    cfg.gridDim = dim3(static_cast<unsigned>(grid));
    cfg.blockDim = dim3(static_cast<unsigned>(k.threads));
    cfg.dynamicSmemBytes = static_cast<std::size_t>(k.smem);
    FP8MLA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, k.fn, p));
  }
  launch_split_merge(plan, b, p, cfg);
}

}  // namespace fp8mla::detail
