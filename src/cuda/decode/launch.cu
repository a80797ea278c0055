// run() on a CUDA plan: the decode kernel of the plan's family, then the split-KV merge.
#include <cuda.h>  // CUtensorMap and its encoder's types; the encoder is reached through the runtime

#include <array>
#include <cmath>
#include <mutex>

#include "src/core/backend.h"
#include "src/core/check.h"
#include "src/core/dispatch.h"
#include "src/cuda/cuda_check.h"
#include "src/cuda/decode/launch_table.h"
#include "src/cuda/merge/split_merge.h"
#include "src/cuda/plan_buffers.h"

namespace fp8mla::detail {

namespace {

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
                     int align, const char* name) {
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
  p.entries_before_wait =
      plan.topk > 0 ? !args.sparse_indices.defined() : !plan.borrowed_kv_indices.defined();
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
  p.q_f16 = args.q_nope.dtype == DType::f16;
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
  p.out_f16 = args.out.dtype == DType::f16;
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
  KernelEntry k = kernel_entry(plan.family, kv.format, b.row_tiles, plan.device_id);
  // One instantiation a plan: fp16 plans of a family that builds them apart take half_fn at any
  // row count (rows8_fn serves what fn serves); other plans of <= 8-row tiles take rows8_fn.
  if ((p.q_f16 || p.out_f16) && k.half_fn != nullptr) {
    k.fn = k.half_fn;
  } else if (plan.kernel_rows <= 8 && k.rows8_fn != nullptr) {
    k.fn = k.rows8_fn;
  }
  if (k.tensor_maps && grid > 0) {
    const int element = kv.format == KvFormat::bf16 ? 2 : 1;  // bytes
    encode_page_map(p.ckv_map, p.ckv, 512 * element, plan.page_size, plan.num_pages,
                    p.ckv_token_stride, p.ckv_page_stride, "kv.ckv");
    encode_page_map(p.kpe_map, p.kpe, 64 * element, plan.page_size, plan.num_pages,
                    p.kpe_token_stride, p.kpe_page_stride, "kv.kpe");
  }
  // Both launches are programmatic dependents of the kernel before them (pdl_wait in the
  // kernels): a launch overlaps that kernel's end instead of following it
  // (ops::begin_after_previous_kernel).
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
