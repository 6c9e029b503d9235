#pragma once
// What the grouped expert GEMMs share (moe.cu's mma.sync kernel, moe_sm90.cu's wgmma kernel) and the
// decode kernels' SwiGLU (moe_decode.cu): a block's expert and rows from the tile table, the weight
// row a tile row reads, SwiGLU, and the bf16 stores of the epilogue. Device helpers only.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/moe.h"

namespace dflash::cuda::moe_detail {

// SwiGLU's silu on an fp32 dot product (expf: every MoE kernel rounds it alike).
__device__ __forceinline__ float silu_expf(float g) { return g / (1.0f + expf(-g)); }

// The block of grouped-GEMM tile `tile`: its expert e (tile_offsets[e] <= tile < tile_offsets[e + 1])
// and its rows [row0, row_end) of the permuted rows; false for the grid's spare blocks (the same for
// every thread). Every thread of the block calls it (a barrier inside): the threads test experts t,
// t + blockDim.x, ... in one round of loads, where a binary search was ~8 dependent global loads
// before a block could issue its first weight load (microseconds of a decode step's expert GEMMs).
__device__ __forceinline__ bool tile_rows(const MoeGemmParams& p, int tile, int rows_per_tile, int& e, int& row0,
                                          int& row_end) {
  __shared__ int s_expert;
  const int E = static_cast<int>(p.E);
  if (tile >= p.tile_offsets[E]) return false;
#pragma unroll 2
  for (int i = static_cast<int>(threadIdx.x); i < E; i += static_cast<int>(blockDim.x))
    if (p.tile_offsets[i] <= tile && tile < p.tile_offsets[i + 1]) s_expert = i;  // exactly one expert
  __syncthreads();
  e = s_expert;
  row0 = p.offsets[e] + (tile - p.tile_offsets[e]) * rows_per_tile;
  row_end = p.offsets[e + 1];
  return true;
}

// A grouped-GEMM block's operands: a routed tile of the tile table (blockIdx.x < max_tiles), or a
// tile of the extra group (MoeGemmParams::extra_*) past them; false for the grid's spare blocks (the
// same for every thread; every thread calls it). w: the expert's weight matrix (kWeightBytes a
// weight); e: the expert, -1 for the extra group.
struct TileOperands {
  int e = -1, row0 = 0, row_end = 0;
  const unsigned char* w = nullptr;
  const __nv_bfloat16* x = nullptr;
  const int32_t* src_row = nullptr;  // nullptr: row pos reads x row pos
  __nv_bfloat16* y = nullptr;
};
template <int kWeightBytes>
__device__ __forceinline__ bool tile_operands(const MoeGemmParams& p, int rows_per_tile, TileOperands& o) {
  const int tile = static_cast<int>(blockIdx.x);
  if (tile >= p.max_tiles) {
    o.row0 = (tile - static_cast<int>(p.max_tiles)) * rows_per_tile;
    if (!p.extra_w || o.row0 >= p.extra_rows) return false;
    o.row_end = static_cast<int>(p.extra_rows);
    o.w = static_cast<const unsigned char*>(p.extra_w);
    o.x = static_cast<const __nv_bfloat16*>(p.extra_x);
    o.y = static_cast<__nv_bfloat16*>(p.extra_y);
    return true;
  }
  if (!tile_rows(p, tile, rows_per_tile, o.e, o.row0, o.row_end)) return false;
  o.w = static_cast<const unsigned char*>(p.w) + static_cast<int64_t>(o.e) * (p.swiglu ? 2 : 1) * p.Nout * p.K * kWeightBytes;
  o.x = static_cast<const __nv_bfloat16*>(p.x);
  o.src_row = p.src_row;
  o.y = static_cast<__nv_bfloat16*>(p.y);
  return true;
}

// The expert's weight row read by row r of a block's BN-row weight tile whose first output column
// is col0: with swiglu rows [0, BN/2) are gate rows col0 + r, the rest the up rows of the same
// columns (at Nout + ...); ok: the row exists (else the tile row is zero-filled).
__device__ __forceinline__ int weight_row(const MoeGemmParams& p, int r, int col0, int bn, bool& ok) {
  const int Nout = static_cast<int>(p.Nout);
  if (p.swiglu) {
    const int ac = col0 + (r & (bn / 2 - 1));
    ok = ac < Nout;
    return (r < bn / 2 ? 0 : Nout) + ac;
  }
  ok = col0 + r < Nout;
  return col0 + r;
}

// Output columns c, c + 1 of row yr: a 4-byte store where `pairs` (every row start 4-byte aligned)
// and both exist, else the existing ones alone.
__device__ __forceinline__ void store2(__nv_bfloat16* yr, int c, int Nout, float v0, float v1, bool pairs) {
  if (pairs && c + 1 < Nout) {
    *reinterpret_cast<__nv_bfloat162*>(yr + c) = __floats2bfloat162_rn(v0, v1);
  } else {
    if (c < Nout) yr[c] = __float2bfloat16(v0);
    if (c + 1 < Nout) yr[c + 1] = __float2bfloat16(v1);
  }
}

}  // namespace dflash::cuda::moe_detail
