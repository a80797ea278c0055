// MMA steps: ldmatrix / stmatrix, mma.sync m16n8k16, and Hopper's warpgroup MMA (wgmma: operand
// descriptors over swizzled shared memory, the m64nNkK products) (PTX, named once); and O += P V
// over 16 tokens of e4m3 V codes converted into mma.sync fragments (pv_step).
#pragma once

#include <cstdint>

#include "src/cuda/ops/convert.cuh"
#include "src/cuda/ops/copy.cuh"

namespace fp8mla::detail {

// ldmatrix: four (x4) or two (x2) 8x8 b16 matrices; `trans` transposes each.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

// stmatrix: four 8x8 b16 matrices from the mma fragment registers (lanes 8 m .. 8 m + 7 give
// matrix m's row addresses, as ldmatrix's).
__device__ __forceinline__ void stmatrix_x4(void* smem, const std::uint32_t (&r)[4]) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(smem_addr(smem)),
      "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
      : "memory");
}

// D = A * B + D, m16n8k16, fp32 accumulators; inputs bf16 (kBf16) or fp16.
#define FP8MLA_MMA_16816(TY)                                                  \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY             \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <bool kBf16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const std::uint32_t (&a)[4],
                                          std::uint32_t b0, std::uint32_t b1) {
  if constexpr (kBf16) {
    FP8MLA_MMA_16816("bf16");
  } else {
    FP8MLA_MMA_16816("f16");
  }
}
#undef FP8MLA_MMA_16816
// ---- wgmma (sm_90a warpgroup MMA): 128 threads issue one asynchronous 64 x N x 16 product ----
// Shared-memory operand descriptor for the 128-byte-swizzled layout: rows of 128 bytes, 16-byte
// unit u of row r stored at unit u ^ (r % 8), 8-row atoms of 1024 bytes (the base must be
// 1024-byte aligned up to the in-row offset). lbo / sbo: the byte strides the PTX ISA names
// "leading" and "stride" dimension offsets for the operand's major-ness.
// kSwizzle = 64: rows of 64 bytes, unit u of row r at u ^ (r / 2 % 4), 512-byte atoms.
template <int kSwizzle = 128>
__device__ __forceinline__ std::uint64_t wgmma_desc(const void* smem, std::uint32_t lbo,
                                                    std::uint32_t sbo) {
  static_assert(kSwizzle == 128 || kSwizzle == 64, "128- or 64-byte swizzle");
  constexpr std::uint64_t kLayout = kSwizzle == 128 ? 1 : 2;
  return static_cast<std::uint64_t>((smem_addr(smem) & 0x3ffffu) >> 4) |
         static_cast<std::uint64_t>((lbo >> 4) & 0x3fffu) << 16 |
         static_cast<std::uint64_t>((sbo >> 4) & 0x3fffu) << 32 | kLayout << 62;
}
// A descriptor moved by `bytes` (a multiple of 16 that keeps the address in shared memory).
// Only the low word changes: the 14-bit address field cannot carry (shared memory < 256 KB).
__device__ __forceinline__ std::uint64_t desc_add(std::uint64_t desc, std::uint32_t bytes) {
  const auto lo = static_cast<std::uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xffffffff00000000ull) | lo;
}
// Byte offset of (row, byte) in a 128-byte-swizzled panel.
__device__ __forceinline__ int sw128(int row, int byte) {
  return row * 128 + ((((byte >> 4) ^ row) & 7) << 4) + (byte & 15);
}
// Byte offset of (row, byte) in a 64-byte-swizzled panel (the TMA engine's and wgmma's
// SWIZZLE_64B: address bits 4-5 XOR bits 7-8).
__device__ __forceinline__ int sw64(int row, int byte) {
  return row * 64 + ((((byte >> 4) ^ (row >> 1)) & 3) << 4) + (byte & 15);
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from touching accumulators across an in-flight wgmma (their registers are
// written asynchronously): call on them after wgmma_wait and before reading them.
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The fp8-score kernels' S, issued as kChains accumulator chains (fp8 wgmma keeps its sums to
// ~13 bits, so chains stay short): commit the last step, wait for every product, then sum the
// chains in fp32 into d.
template <int kChains, int kN>
__device__ __forceinline__ void sum_chains(float (&dc)[kChains][kN], float (&d)[kN]) {
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int c = 0; c < kChains; ++c) wgmma_fence_operand(dc[c]);
#pragma unroll
  for (int e = 0; e < kN; ++e) {
    d[e] = dc[0][e];
#pragma unroll
    for (int c = 1; c < kChains; ++c) d[e] += dc[c][e];
  }
}
// Generic-proxy shared-memory writes (st.shared) made visible to wgmma's async proxy; before the
// barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The asm statements below differ only in the input type (TY: "f16" or "bf16").
#define FP8MLA_WGMMA_D32                                                                          \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FP8MLA_WGMMA_D8 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define FP8MLA_WGMMA_D16                                                                          \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15])
// D (64 x 32 fp32) (+)= A (64 x 32 e4m3, shared memory, K-major) * B (32 x 32 e4m3, shared
// memory, K-major): fp8 operands must both be K-major.
#define FP8MLA_WGMMA_64x32x32_E4M3                                                                \
  asm volatile(                                                                                   \
      "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"                                              \
      " wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3"                                     \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, " \
      "1;\n}\n"                                                                                   \
      : FP8MLA_WGMMA_D16                                                                          \
      : "l"(a), "l"(b), "r"(accumulate))
#define FP8MLA_WGMMA_64x64_SS(TY)                                                                \
  asm volatile(                                                                                  \
      "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"                                             \
      " wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY                                   \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "  \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, " \
      "%35;\n}\n"                                                                                \
      : FP8MLA_WGMMA_D32                                                                         \
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransB))
#define FP8MLA_WGMMA_D128                                                                         \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[0][4]), "+f"(d[0][5]),       \
      "+f"(d[0][6]), "+f"(d[0][7]), "+f"(d[0][8]), "+f"(d[0][9]), "+f"(d[0][10]), "+f"(d[0][11]), \
      "+f"(d[0][12]), "+f"(d[0][13]), "+f"(d[0][14]), "+f"(d[0][15]), "+f"(d[0][16]),             \
      "+f"(d[0][17]), "+f"(d[0][18]), "+f"(d[0][19]), "+f"(d[0][20]), "+f"(d[0][21]),             \
      "+f"(d[0][22]), "+f"(d[0][23]), "+f"(d[0][24]), "+f"(d[0][25]), "+f"(d[0][26]),             \
      "+f"(d[0][27]), "+f"(d[0][28]), "+f"(d[0][29]), "+f"(d[0][30]), "+f"(d[0][31]),             \
      "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[1][4]), "+f"(d[1][5]),   \
      "+f"(d[1][6]), "+f"(d[1][7]), "+f"(d[1][8]), "+f"(d[1][9]), "+f"(d[1][10]), "+f"(d[1][11]), \
      "+f"(d[1][12]), "+f"(d[1][13]), "+f"(d[1][14]), "+f"(d[1][15]), "+f"(d[1][16]),             \
      "+f"(d[1][17]), "+f"(d[1][18]), "+f"(d[1][19]), "+f"(d[1][20]), "+f"(d[1][21]),             \
      "+f"(d[1][22]), "+f"(d[1][23]), "+f"(d[1][24]), "+f"(d[1][25]), "+f"(d[1][26]),             \
      "+f"(d[1][27]), "+f"(d[1][28]), "+f"(d[1][29]), "+f"(d[1][30]), "+f"(d[1][31]),             \
      "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[2][4]), "+f"(d[2][5]),   \
      "+f"(d[2][6]), "+f"(d[2][7]), "+f"(d[2][8]), "+f"(d[2][9]), "+f"(d[2][10]), "+f"(d[2][11]), \
      "+f"(d[2][12]), "+f"(d[2][13]), "+f"(d[2][14]), "+f"(d[2][15]), "+f"(d[2][16]),             \
      "+f"(d[2][17]), "+f"(d[2][18]), "+f"(d[2][19]), "+f"(d[2][20]), "+f"(d[2][21]),             \
      "+f"(d[2][22]), "+f"(d[2][23]), "+f"(d[2][24]), "+f"(d[2][25]), "+f"(d[2][26]),             \
      "+f"(d[2][27]), "+f"(d[2][28]), "+f"(d[2][29]), "+f"(d[2][30]), "+f"(d[2][31]),             \
      "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[3][4]), "+f"(d[3][5]),   \
      "+f"(d[3][6]), "+f"(d[3][7]), "+f"(d[3][8]), "+f"(d[3][9]), "+f"(d[3][10]), "+f"(d[3][11]), \
      "+f"(d[3][12]), "+f"(d[3][13]), "+f"(d[3][14]), "+f"(d[3][15]), "+f"(d[3][16]),             \
      "+f"(d[3][17]), "+f"(d[3][18]), "+f"(d[3][19]), "+f"(d[3][20]), "+f"(d[3][21]),             \
      "+f"(d[3][22]), "+f"(d[3][23]), "+f"(d[3][24]), "+f"(d[3][25]), "+f"(d[3][26]),             \
      "+f"(d[3][27]), "+f"(d[3][28]), "+f"(d[3][29]), "+f"(d[3][30]), "+f"(d[3][31])
// m64n256k16, A from registers, B N-major (the last 1), always accumulating (the first 1).
#define FP8MLA_WGMMA_64x256_RS(TY)                                                                \
  asm volatile(                                                                                   \
      "{\n wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY                                \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "   \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "     \
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "     \
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, "     \
      "%70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, "     \
      "%87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, " \
      "%104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, "      \
      "%118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, "   \
      "%132, 1, 1, 1, 1;\n}\n"                                                                    \
      : FP8MLA_WGMMA_D128                                                                         \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
// m64n64k16, A from registers, B K-major (the last 0).
#define FP8MLA_WGMMA_64x64_RS(TY)                                                                \
  asm volatile(                                                                                  \
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"                                             \
      " wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY                                   \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "  \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, " \
      "%36, p, 1, 1, 0;\n}\n"                                                                    \
      : FP8MLA_WGMMA_D32                                                                         \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate))
#define FP8MLA_WGMMA_64x32_SS(TY)                                                                 \
  asm volatile(                                                                                   \
      "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"                                              \
      " wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY                                    \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, " \
      "1, 0, 0;\n}\n"                                                                             \
      : FP8MLA_WGMMA_D16                                                                          \
      : "l"(a), "l"(b), "r"(accumulate))
// D (64 x 64 fp32, the m64nNk16 fragment layout) (+)= A (64 x 16, shared memory, K-major) *
// B (16 x 64, shared memory; kTransB = 0: K-major, 1: N-major); inputs bf16 (kBf16) or fp16.
// accumulate = 0: D = A * B.
template <int kTransB, bool kBf16>
__device__ __forceinline__ void wgmma_64x64x16_ss(float (&d)[32], std::uint64_t a, std::uint64_t b,
                                                  int accumulate) {
  if constexpr (kBf16) {
    FP8MLA_WGMMA_64x64_SS("bf16");
  } else {
    FP8MLA_WGMMA_64x64_SS("f16");
  }
}
// D (64 x 256 fp32: d[c] the m64n64 accumulator of columns 64 c + [0, 64)) += A (64 x 16 in
// registers: the mma.sync m16n8k16 A fragment of each warp's 16 rows, warp w rows 16 w .. 16 w +
// 15) * B (16 x 256, shared memory, N-major: four 64-column swizzled panels, the descriptor's
// leading byte offset apart); inputs bf16 (kBf16) or fp16. One instruction where four m64n64k16
// would issue.
template <bool kBf16>
__device__ __forceinline__ void wgmma_64x256x16_rs(float (&d)[4][32], const std::uint32_t (&a)[4],
                                                   std::uint64_t b) {
  if constexpr (kBf16) {
    FP8MLA_WGMMA_64x256_RS("bf16");
  } else {
    FP8MLA_WGMMA_64x256_RS("f16");
  }
}
// D (64 x 64 fp32) (+)= A (64 x 16 in registers, the A fragment of wgmma_64x256x16_rs) * B
// (16 x 64, shared memory, K-major); inputs bf16 (kBf16) or fp16. accumulate = 0: D = A * B.
template <bool kBf16>
__device__ __forceinline__ void wgmma_64x64x16_rs(float (&d)[32], const std::uint32_t (&a)[4],
                                                  std::uint64_t b, int accumulate) {
  if constexpr (kBf16) {
    FP8MLA_WGMMA_64x64_RS("bf16");
  } else {
    FP8MLA_WGMMA_64x64_RS("f16");
  }
}
// D (64 x 32 fp32) (+)= A (64 x 16, shared memory, K-major) * B (16 x 32, shared memory,
// K-major).
template <bool kBf16>
__device__ __forceinline__ void wgmma_64x32x16_ss(float (&d)[16], std::uint64_t a, std::uint64_t b,
                                                  int accumulate) {
  if constexpr (kBf16) {
    FP8MLA_WGMMA_64x32_SS("bf16");
  } else {
    FP8MLA_WGMMA_64x32_SS("f16");
  }
}
// D (64 x 16 fp32) (+)= A (64 x 16 bf16, shared memory, K-major) * B (16 x 16 bf16, shared
// memory, K-major).
__device__ __forceinline__ void wgmma_64x16x16_bf16(float (&d)[8], std::uint64_t a, std::uint64_t b,
                                                    int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16"
      " {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
      : FP8MLA_WGMMA_D8
      : "l"(a), "l"(b), "r"(accumulate));
}
// D (64 x 16 fp32) (+)= A (64 x 16 bf16 in registers: the m16n8k16 A fragment of each warp's 16
// rows) * B (16 x 16 bf16, shared memory, K-major).
__device__ __forceinline__ void wgmma_64x16x16_bf16_rs(float (&d)[8], const std::uint32_t (&a)[4],
                                                       std::uint64_t b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16"
      " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
      : FP8MLA_WGMMA_D8
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
// D (64 x 8 fp32) (+)= A (64 x 16 bf16 in registers) * B (16 x 8 bf16, shared memory, K-major):
// the block format's rope for tiles of <= 8 rows.
__device__ __forceinline__ void wgmma_64x8x16_bf16_rs(float (&d)[4], const std::uint32_t (&a)[4],
                                                      std::uint64_t b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %9, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16"
      " {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_64x32x32_e4m3(float (&d)[16], std::uint64_t a,
                                                    std::uint64_t b, int accumulate) {
  FP8MLA_WGMMA_64x32x32_E4M3;
}
// D (64 x 32 fp32) (+)= A (64 x 32 e4m3 in registers: the m16n8k32 A fragment of each warp's 16
// rows) * B (32 x 32 e4m3, shared memory, K-major).
__device__ __forceinline__ void wgmma_64x32x32_e4m3_rs(float (&d)[16], const std::uint32_t (&a)[4],
                                                       std::uint64_t b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %21, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3"
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15},"
      " {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
      : FP8MLA_WGMMA_D16
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
// The same with N = 16 (tiles of <= 8 rows: their hi and lo terms).
__device__ __forceinline__ void wgmma_64x16x32_e4m3_rs(float (&d)[8], const std::uint32_t (&a)[4],
                                                       std::uint64_t b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3"
      " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
      : FP8MLA_WGMMA_D8
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
#undef FP8MLA_WGMMA_64x32x32_E4M3
#undef FP8MLA_WGMMA_64x32_SS
#undef FP8MLA_WGMMA_64x64_RS
#undef FP8MLA_WGMMA_64x256_RS
#undef FP8MLA_WGMMA_D128
#undef FP8MLA_WGMMA_64x64_SS
#undef FP8MLA_WGMMA_D16
#undef FP8MLA_WGMMA_D8
#undef FP8MLA_WGMMA_D32

namespace ops {

// O += P V for 16 tokens: `a` the P fragment (ldmatrix), x0 / x1 / x8 / x9 the thread's 8 codes
// of tokens tk, tk + 1, tk + 8, tk + 9 (tk = 16 kk + 2 tq; its 8 columns, one per n-tile).
// Byte permutes pair token tk's and tk + 1's codes of a column: [x0 y0 x1 y1], [x2 y2 x3 y3].
__device__ __forceinline__ void pv_step(float (&o)[8][4], const std::uint32_t (&a)[4], uint2 x0,
                                        uint2 x1, uint2 x8, uint2 x9) {
  std::uint32_t b0[8], b1[8];
  fp8x4_to_half2x2(__byte_perm(x0.x, x1.x, 0x5140), b0[0], b0[1]);
  fp8x4_to_half2x2(__byte_perm(x0.x, x1.x, 0x7362), b0[2], b0[3]);
  fp8x4_to_half2x2(__byte_perm(x0.y, x1.y, 0x5140), b0[4], b0[5]);
  fp8x4_to_half2x2(__byte_perm(x0.y, x1.y, 0x7362), b0[6], b0[7]);
  fp8x4_to_half2x2(__byte_perm(x8.x, x9.x, 0x5140), b1[0], b1[1]);
  fp8x4_to_half2x2(__byte_perm(x8.x, x9.x, 0x7362), b1[2], b1[3]);
  fp8x4_to_half2x2(__byte_perm(x8.y, x9.y, 0x5140), b1[4], b1[5]);
  fp8x4_to_half2x2(__byte_perm(x8.y, x9.y, 0x7362), b1[6], b1[7]);
#pragma unroll
  for (int n = 0; n < 8; ++n) mma_16816<false>(o[n], a, b0[n], b1[n]);
}

}  // namespace ops

}  // namespace fp8mla::detail
