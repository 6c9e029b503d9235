// FP8 quantization kernels (issue 18): the dynamic per-token 1 x 128 activation groups and the
// 128 x 128 weight blocks of the official -FP8 checkpoints, bit for bit the CPU reference
// (kernels/cpu/fp8.cpp, kernels/ops.h "fp8"): per group / block scale = max(amax, 1e-10) / 448,
// q = e4m3(clamp(x / scale, +-448)), the division IEEE (__fdiv_rn: the reference divides in f32) and
// the cast round-to-nearest-even (cvt.rn.satfinite.e4m3x2.f32, which is fp8::e4m3_from_float for
// every finite input and NaN). Scale layouts are gemm_fp8's (gemm.h "FP8").
//
// Roofline (H200, ~4.8 TB/s; no arithmetic worth counting: a max, a division and a cvt per element):
//   quantize_fp8_act     2·M·K read + M·K + 4·M·ceil(K/128) written (M 8192, K 5120: 126 MB, ~26 us)
//   quantize_fp8_weight  2·N·K read + N·K written (a 27B model's 54 GB of bf16 weights: ~17 ms, once)
// Measured on an H200 (kernel_bench --only fp8, at 7912da0 + these files): quantize_fp8_act at
// M 8192 runs at 1.55 TB/s (K 5120: 82 us; K 6144: 1.67 TB/s; K 17408: 1.56 TB/s), a third of the
// roofline: each lane has one 16-byte load in flight per pass and waits for it before the group's
// shuffles. Keeping two or four groups in flight per half warp is the next step (not measured yet).
// The fused producers at T 8192 (rate on the fused kernel's bytes): rms_norm_quant_fp8 (D 5120)
// 0.086 ms = 1.48 TB/s vs 0.126 ms for rms_norm + quantize_fp8_act; swiglu_quant_fp8 (I 17408)
// 0.334 vs 0.411 ms (2.15 TB/s); gated_rms_norm_quant_fp8 (48 x 128) 0.137 vs 0.165 ms (1.85 TB/s).
//
// Layout of the work:
//   * activations: one group of 16 lanes (half a warp) per (token, 128-column group), 8 bf16 = one
//     16-byte load per lane, the group's amax by 4 shuffles inside the half warp, 8 codes stored as
//     one 8-byte store; the (token, group) pairs are walked by a grid-stride loop (consecutive pairs
//     are consecutive groups of a row: a warp reads 512 contiguous bytes) over a grid of every
//     resident block, kActBatch pairs per half warp and pass with their loads issued first.
//   * weights: one 256-thread block per 128 x 128 block: each thread keeps its 8 16-byte units in
//     registers between the amax (block reduction) and the store.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/check.h"
#include "kernels/cuda/grid.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/emulatable.cuh"
#include "kernels/cuda/fp8_act.cuh"
#include "kernels/cuda/vec.cuh"
#include "core/error.h"
#include "core/fp8.h"

namespace dflash::cuda {

namespace {

using namespace vec;

using namespace fp8_act;

constexpr int kThreads = 256;
constexpr int kGroupsPerBlock = kThreads / kGroupLanes;
constexpr int kBlockUnits = fp8::kBlock / kUnit;       // 16 units across a 128-wide block
constexpr int kWeightRowsPerPass = kThreads / kBlockUnits;            // 16
constexpr int kWeightPasses = fp8::kBlock / kWeightRowsPerPass;       // 8

// What the activation quantizer reads: 8 bf16 values (as f32) of row m at column col.
struct PlainSource {  // quantize_fp8_act
  const bf16* x;
  int64_t ldx;
  __device__ void operator()(int m, int col, float (&v)[kUnit]) const {
    unpack(__ldg(reinterpret_cast<const uint4*>(x + m * ldx + col)), v);
  }
};
struct SwigluSource {  // swiglu_quant_fp8: silu(gate) * up rounded to bf16, as cuda::swiglu stores it
  const bf16* gu;      // [N, 2I]
  int64_t I;
  __device__ void operator()(int m, int col, float (&v)[kUnit]) const {
    const bf16* src = gu + m * 2 * I + col;
    float up[kUnit];
    unpack(__ldg(reinterpret_cast<const uint4*>(src)), v);
    unpack(__ldg(reinterpret_cast<const uint4*>(src + I)), up);
#pragma unroll
    for (int e = 0; e < kUnit; ++e) v[e] = round_bf16(silu(v[e]) * up[e]);
  }
};
struct SigmoidGateSource {  // sigmoid_gate_quant_fp8: x * sigmoid(gate) rounded to bf16, as cuda::sigmoid_gate stores it
  const bf16* x;            // [N, H * d] contiguous
  const bf16* gate;         // token n, head h at gate + n * ldg + h * hsg
  int64_t ldg, hsg, K;
  int d;                    // a multiple of 8: a unit of 8 columns lies in one head
  __device__ void operator()(int m, int col, float (&v)[kUnit]) const {
    const int h = col / d, j = col - h * d;
    float g[kUnit];
    unpack(__ldg(reinterpret_cast<const uint4*>(x + m * K + col)), v);
    unpack(__ldg(reinterpret_cast<const uint4*>(gate + m * ldg + h * hsg + j)), g);
#pragma unroll
    for (int e = 0; e < kUnit; ++e) v[e] = round_bf16(v[e] * sigmoid(g[e]));
  }
};

// kActBatch (token, group) pairs per half warp and pass, their loads issued before any is reduced
// (ncu at 4d73020: with 4 the kernel held 3 blocks per SM by registers and was issue-bound, 60% SM
// throughput against 34% DRAM). lds =
// fp8_act_scale_ld(M): scale of (m, g) at scale[g * lds + m].
constexpr int kActBatch = 2;
// CTAs an SM the registers allow (48 a thread, no spills; 55 and 4 CTAs without the bound): the grid
// is persistent, and every resident CTA's half warps have their loads in flight (ncu, H100, e30ec37:
// 50% occupancy, DRAM 67%, the warps waiting on loads; with the bound 62.5%, DRAM 73%, and 3-6% more
// bandwidth at the drafter's shapes, bench/results/h100-quant-b5ed5d0).
constexpr int kActMinBlocks = 5;

template <class Source>
__global__ void __launch_bounds__(kThreads, kActMinBlocks)
    quantize_act_kernel(const Source src, uint8_t* __restrict__ q, int64_t ldq, float* __restrict__ scale, int64_t lds,
                        int M, int K, int G) {
  const int lane = static_cast<int>(threadIdx.x) % kGroupLanes;
  const unsigned mask = 0xFFFFu << (16 * ((threadIdx.x / kGroupLanes) % 2));  // this half warp
  const int total = M * G;  // < 2^31: checked on the host
  const int stride = static_cast<int>(gridDim.x) * kGroupsPerBlock;
  for (int base = static_cast<int>(blockIdx.x) * kGroupsPerBlock + static_cast<int>(threadIdx.x) / kGroupLanes;
       base < total; base += stride * kActBatch) {
    float v[kActBatch][kUnit];
#pragma unroll
    for (int b = 0; b < kActBatch; ++b) {
      const int i = base + b * stride;  // (uniform across the half warp)
      const int m = i / G, g = i - m * G;
      const int col = g * static_cast<int>(fp8::kBlock) + lane * kUnit;
      if (i < total && col < K) {  // the last group may be partial (K % 8 == 0: whole units)
        src(m, col, v[b]);
      } else {
#pragma unroll
        for (int j = 0; j < kUnit; ++j) v[b][j] = 0.0f;
      }
    }
#pragma unroll
    for (int b = 0; b < kActBatch; ++b) {
      const int i = base + b * stride;
      if (i >= total) break;
      const int m = i / G, g = i - m * G;
      const int col = g * static_cast<int>(fp8::kBlock) + lane * kUnit;
      quantize_group(v[b], col < K, mask, lane, m, M, g, q + m * ldq + col, scale, lds);
    }
  }
}

// rms_norm_quant_fp8: norm.cu's row_norm_kernel (W = 8, G lanes per row, kCache units per
// lane in registers) with the same sum of squares in the same order (lane partial sums in unit order,
// the group reduction: vec::group_sum), y = rn_bf16(x * inv * (1 + w)) as RmsNormOp stores it, then
// per 128 columns (16 units: the 16 lanes of a half warp, G being a multiple of 16) the quantization.
// Rows longer than kNormCache * G units are not supported (the unfused kernel re-reads them).
constexpr int kNormCache = 4;

template <int G>
__global__ void __launch_bounds__(kThreads) rms_norm_quant_kernel(const bf16* __restrict__ x, int64_t ldx,
                                                                   const bf16* __restrict__ w, uint8_t* __restrict__ q,
                                                                   int64_t ldq, float* __restrict__ scale, int64_t lds,
                                                                   int rows, int units, int D, float eps) {
  __shared__ float red[kThreads / 32];
  const int lane = static_cast<int>(threadIdx.x) % G;
  const int row = static_cast<int>(blockIdx.x) * (kThreads / G) + static_cast<int>(threadIdx.x) / G;
  const bool active = row < rows;  // inactive groups still join the shuffles
  float v[kNormCache][kUnit];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kNormCache; ++i) {
    const int u = lane + i * G;
    if (active && u < units) {
      unpack(__ldg(reinterpret_cast<const uint4*>(x + row * ldx + u * kUnit)), v[i]);
#pragma unroll
      for (int e = 0; e < kUnit; ++e) ss += v[i][e] * v[i][e];
    }
  }
  ss = group_sum<G>(ss, red);
  if (!active) return;  // a whole half warp (G = 16) or more
  const float inv = rsqrtf(ss / static_cast<float>(D) + eps);
  const unsigned mask = 0xFFFFu << (16 * ((threadIdx.x / kGroupLanes) % 2));
#pragma unroll
  for (int i = 0; i < kNormCache; ++i) {
    const int u = lane + i * G;
    if ((u & ~(kGroupLanes - 1)) >= units) continue;  // the half warp's group starts past the row
    const bool on = u < units;
    float y[kUnit];
    if (on) {
      float wv[kUnit];
      unpack(__ldg(reinterpret_cast<const uint4*>(w + u * kUnit)), wv);
#pragma unroll
      for (int e = 0; e < kUnit; ++e) {
        float t = v[i][e] * inv;
        t *= 1.0f + wv[e];
        y[e] = round_bf16(t);
      }
    } else {
#pragma unroll
      for (int e = 0; e < kUnit; ++e) y[e] = 0.0f;
    }
    quantize_group(y, on, mask, lane % kGroupLanes, row, rows, u / kGroupLanes, q + row * ldq + u * kUnit, scale, lds);
  }
}

// gated_rms_norm_quant_fp8: norm.cu's gated_rms_norm_kernel (dv / 8 lanes per row = G, one
// 16-byte unit of core and z per lane) with the same arithmetic in the same order, rows walked by a
// grid-stride loop with the next row's core and z loaded before the current row is reduced (two rows
// in flight per lane). dv in {128, 256}: a row is one or two 128-column groups of the output row.
template <int G>
__global__ void __launch_bounds__(kThreads) gated_rms_norm_quant_kernel(
    const bf16* __restrict__ core, const bf16* __restrict__ z, int64_t ldz, const bf16* __restrict__ w,
    uint8_t* __restrict__ q, int64_t ldq, float* __restrict__ scale, int64_t lds, int N, int Hv, float eps) {
  constexpr int kGroups = kThreads / G, dv = G * kUnit;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % G;
  const int rows = N * Hv;
  const int stride = static_cast<int>(gridDim.x) * kGroups;
  const int first = static_cast<int>(blockIdx.x) * kGroups + tid / G;
  // Loop while the warp's first group has a row, so every lane of a warp joins each shuffle.
  const int warp_first = static_cast<int>(blockIdx.x) * kGroups + (tid / 32) * (32 / G);
  auto fetch = [&](int r, uint4& c, uint4& zz) {
    if (r < rows) {
      const int n = r / Hv, h = r - n * Hv;
      c = __ldg(reinterpret_cast<const uint4*>(core + static_cast<int64_t>(r) * dv + lane * kUnit));
      zz = __ldg(reinterpret_cast<const uint4*>(z + static_cast<int64_t>(n) * ldz + h * dv + lane * kUnit));
    }
  };
  float wv[kUnit];
  unpack(__ldg(reinterpret_cast<const uint4*>(w + lane * kUnit)), wv);
  uint4 c_next = make_uint4(0, 0, 0, 0), z_next = c_next;
  fetch(first, c_next, z_next);
  const unsigned mask = 0xFFFFu << (16 * ((tid / kGroupLanes) % 2));
  for (int r = first, wf = warp_first; wf < rows; r += stride, wf += stride) {
    const uint4 c_cur = c_next, z_cur = z_next;
    fetch(r + stride, c_next, z_next);
    float v[kUnit], zv[kUnit];
    unpack(c_cur, v);
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < kUnit; ++e) ss += v[e] * v[e];
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (r >= rows) continue;  // a whole half warp: the quantization shuffles use the half-warp mask
    unpack(z_cur, zv);
    const float inv = rsqrtf(ss / static_cast<float>(dv) + eps);
#pragma unroll
    for (int e = 0; e < kUnit; ++e) {
      v[e] *= inv;
      v[e] *= wv[e] * silu(zv[e]);
      v[e] = round_bf16(v[e]);
    }
    const int n = r / Hv, h = r - n * Hv;
    const int col = h * dv + lane * kUnit;
    quantize_group(v, true, mask, lane % kGroupLanes, n, N, col / static_cast<int>(fp8::kBlock), q + n * ldq + col,
                   scale, lds);
  }
}

// One 128 x 128 block per CTA; thread t covers unit t % 16 of rows t / 16 + 16 j, j < 8.
__global__ void __launch_bounds__(kThreads) quantize_weight_kernel(const bf16* __restrict__ w, int64_t N, int64_t K,
                                                                    uint8_t* __restrict__ q,
                                                                    float* __restrict__ scale_inv, int64_t ld_scale) {
  __shared__ float red[kThreads / 32];
  const int64_t kb = blockIdx.x, nb = blockIdx.y;
  const int64_t col = kb * fp8::kBlock + (threadIdx.x % kBlockUnits) * kUnit;
  const int64_t row0 = nb * fp8::kBlock + threadIdx.x / kBlockUnits;
  uint4 raw[kWeightPasses];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kWeightPasses; ++j) {
    const int64_t r = row0 + j * kWeightRowsPerPass;
    raw[j] = make_uint4(0, 0, 0, 0);  // +0 bf16: no effect on the amax
    if (r < N && col < K) raw[j] = __ldg(reinterpret_cast<const uint4*>(w + r * K + col));
    float v[kUnit];
    unpack(raw[j], v);
    amax = fmaxf(amax, unit_amax(v));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) amax = fmaxf(amax, red[i]);
  const float s = scale_of(amax);
  if (threadIdx.x == 0) scale_inv[nb * ld_scale + kb] = s;
#pragma unroll
  for (int j = 0; j < kWeightPasses; ++j) {
    const int64_t r = row0 + j * kWeightRowsPerPass;
    if (r >= N || col >= K) continue;
    float v[kUnit];
    unpack(raw[j], v);
    *reinterpret_cast<uint2*>(q + r * K + col) = encode(v, s);
  }
}

// quantize_fp8_tiles (the FP8 drafter's operands): one 128 x 128 tile of x per CTA, loaded once
// (thread t: unit t % 16 of rows t / 16 + 16 j, as quantize_weight_kernel) into registers and shared
// memory. Block mode: one scale for the tile (block reduction), q written from the registers; columns
// mode: one scale per column (thread pair t, t ^ 1 walks column t / 2 in halves of 64 rows), and with q
// also one per row (the 16 lanes of a half warp hold a row's 128 values: quantize_group's reduction and
// arithmetic, so these codes are quantize_fp8_act's). The transposed codes are written from shared
// memory by the column pairs, 16 codes per 16-byte store, rows past x's (the padding up to
// rows_padded) as 0.
// Tried (b5ed5d0, reverted): the transposed codes by warp-uniform column halves in two passes of 16
// rows over shared memory, 62 registers and 4 CTAs an SM instead of 80 and 3: 5-33% slower on an H100
// (quant_xt 2,100 -> 1,410 GB/s; ncu: more stalls per instruction, the passes' shared loads exposed).
// The kernel is latency-bound (block mode at 6144 x 5120: DRAM 51%, SMs 29%), not short of registers.
// Tried (9bda3b1, reverted): a persistent grid with two shared-memory tile buffers, the next tile's
// cp.async copies in flight while this one is quantized: block mode (the weights) +14-17% at 2 CTAs an
// SM (98 registers), but the columns mode (the output gradients and xᵀ) 3-8% slower, and 3 CTAs an SM
// (80 registers, spilling) slower in both; kernel_bench's quantization sum of a 27B drafter step 11.8
// -> 11.5 ms on an H100 at best (bench/results/h100-quant-b5ed5d0): not worth a second tile kernel.
constexpr int kTileLd = fp8::kBlock + 8;  // bf16 per shared row (16-byte aligned rows)

__global__ void __launch_bounds__(kThreads) quantize_tiles_kernel(const bf16* __restrict__ x, int64_t ldx, int64_t rows,
                                                                   int64_t cols, bool block, uint8_t* __restrict__ q,
                                                                   int64_t ldq, float* __restrict__ scale, int64_t lds,
                                                                   uint8_t* __restrict__ qt, int64_t ldqt, int64_t qt_cols,
                                                                   float* __restrict__ scale_t, int64_t ldst) {
  __shared__ __align__(16) bf16 tile[fp8::kBlock * kTileLd];
  __shared__ float red[kThreads / 32];
  const int64_t cb = blockIdx.x, rb = blockIdx.y;
  const int tid = static_cast<int>(threadIdx.x);
  const int unit = tid % kBlockUnits;
  const int64_t col = cb * fp8::kBlock + unit * kUnit;
  uint4 raw[kWeightPasses];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kWeightPasses; ++j) {
    const int lr = tid / kBlockUnits + j * kWeightRowsPerPass;
    const int64_t r = rb * fp8::kBlock + lr;
    raw[j] = make_uint4(0, 0, 0, 0);  // +0 bf16: no effect on the amax, code 0
    if (r < rows && col < cols) raw[j] = __ldg(reinterpret_cast<const uint4*>(x + r * ldx + col));
    *reinterpret_cast<uint4*>(tile + lr * kTileLd + unit * kUnit) = raw[j];
    if (block) {
      float v[kUnit];
      unpack(raw[j], v);
      amax = fmaxf(amax, unit_amax(v));
    }
  }
  if (!block && q != nullptr) {  // per row and 128-column group: quantize_fp8_act's codes and scales
    const unsigned mask = 0xFFFFu << (16 * ((tid / kGroupLanes) % 2));  // this half warp: one row
#pragma unroll
    for (int j = 0; j < kWeightPasses; ++j) {
      const int64_t r = rb * fp8::kBlock + tid / kBlockUnits + j * kWeightRowsPerPass;
      float v[kUnit];
      unpack(raw[j], v);
      if (r < rows) quantize_group(v, col < cols, mask, unit, static_cast<int>(r), static_cast<int>(rows),
                                   static_cast<int>(cb), q + r * ldq + col, scale, lds);
    }
  }
  float s = 0.0f;
  if (block) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (tid % 32 == 0) red[tid / 32] = amax;
  }
  __syncthreads();
  if (block) {
    amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kThreads / 32; ++i) amax = fmaxf(amax, red[i]);
    s = scale_of(amax);
    if (tid == 0 && q != nullptr) scale[rb * lds + cb] = s;
    if (tid == 0 && qt != nullptr) scale_t[cb * ldst + rb] = s;
    if (q != nullptr) {
#pragma unroll
      for (int j = 0; j < kWeightPasses; ++j) {
        const int64_t r = rb * fp8::kBlock + tid / kBlockUnits + j * kWeightRowsPerPass;
        if (r >= rows || col >= cols) continue;
        float v[kUnit];
        unpack(raw[j], v);
        *reinterpret_cast<uint2*>(q + r * ldq + col) = encode_act(v, s);
      }
    }
  }
  if (qt == nullptr) return;
  // The transposed codes: column c of the tile, rows [h * 64, h * 64 + 64), by the pair (c, h).
  constexpr int kHalf = fp8::kBlock / 2;
  const int c = tid / 2, h = tid % 2;
  const int64_t gc = cb * fp8::kBlock + c;
  float v[kHalf];
#pragma unroll
  for (int i = 0; i < kHalf; ++i) v[i] = __bfloat162float(tile[(h * kHalf + i) * kTileLd + c]);
  if (!block) {
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) a = fmaxf(a, fabsf(v[i]));
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
    s = scale_of(a);
    if (h == 0 && gc < cols) scale_t[rb * ldst + gc] = s;
  }
  if (gc >= cols) return;
#pragma unroll
  for (int k = 0; k < kHalf / 16; ++k) {
    const int64_t r = rb * fp8::kBlock + h * kHalf + k * 16;
    if (r >= qt_cols) break;  // qt_cols % 16 == 0: whole stores
    float a8[kUnit], b8[kUnit];
#pragma unroll
    for (int e = 0; e < kUnit; ++e) a8[e] = v[k * 16 + e], b8[e] = v[k * 16 + kUnit + e];
    const uint2 lo = encode_act(a8, s), hi = encode_act(b8, s);
    *reinterpret_cast<uint4*>(qt + gc * ldqt + r) = make_uint4(lo.x, lo.y, hi.x, hi.y);
  }
}

int64_t act_scale_ld(int64_t M) { return (M + 3) / 4 * 4; }

template <class Source>
void launch_act(const Source& src, uint8_t* q, int64_t ldq, float* scale, int64_t M, int64_t K, cudaStream_t st) {
  const int64_t G = fp8::blocks(K);
  const auto kernel = quantize_act_kernel<Source>;
  const unsigned grid = persistent_grid(reinterpret_cast<const void*>(kernel), kThreads, 0, 0, M * G, kGroupsPerBlock);
  launch_kernel(kernel, dim3(grid), dim3(kThreads), 0, st, src, q, ldq, scale, act_scale_ld(M), static_cast<int>(M),
                static_cast<int>(K), static_cast<int>(G));
}

}  // namespace

int64_t fp8_act_scale_ld(int64_t M) { return act_scale_ld(M); }

size_t fp8_act_scale_elems(int64_t M, int64_t K) {
  return static_cast<size_t>(fp8::blocks(K)) * static_cast<size_t>(fp8_act_scale_ld(M));
}

void quantize_fp8_act(const Fp8ActQuantParams& p, Stream s) {
  DFLASH_CHECK(p.M >= 0 && p.K > 0 && p.K % 16 == 0,
               "quantize_fp8_act: need M >= 0 and K > 0 a multiple of 16, got M=" << p.M << " K=" << p.K);
  DFLASH_CHECK(p.ldx >= p.K && p.ldq >= p.K,
               "quantize_fp8_act: row strides ldx=" << p.ldx << " ldq=" << p.ldq << " are smaller than K=" << p.K);
  if (p.M == 0) return;
  const int64_t G = fp8::blocks(p.K);
  DFLASH_CHECK(p.M * G < (int64_t{1} << 31) && p.M * p.ldx < (int64_t{1} << 31) && p.M * p.ldq < (int64_t{1} << 31),
               "quantize_fp8_act: M=" << p.M << " x ld=" << std::max(p.ldx, p.ldq)
                                      << " is too large for this kernel's 32-bit indexing");
  DFLASH_CHECK(p.x != nullptr && p.q != nullptr && p.scale != nullptr,
               "quantize_fp8_act: null pointer (x=" << p.x << " q=" << static_cast<const void*>(p.q)
                                                    << " scale=" << p.scale << ")");
  DFLASH_CHECK_HINT(aligned16(p.x) && aligned16(p.q) && aligned16(p.scale) && p.ldx % 8 == 0 && p.ldq % 16 == 0,
                    "quantize_fp8_act: x, q and scale must be 16-byte aligned with ldx % 8 == 0 and ldq % 16 == 0, got x="
                        << p.x << " ldx=" << p.ldx << " q=" << static_cast<const void*>(p.q) << " ldq=" << p.ldq
                        << " scale=" << p.scale,
                    "these are what gemm_fp8 needs of its operand; slice activations at column offsets that are "
                    "multiples of 16");
  launch_act(PlainSource{static_cast<const bf16*>(p.x), p.ldx}, p.q, p.ldq, p.scale, p.M, p.K,
             static_cast<cudaStream_t>(s));
}

void quantize_fp8_weight(const void* w_bf16, int64_t N, int64_t K, uint8_t* q, float* scale_inv, int64_t ld_scale,
                         Stream s) {
  DFLASH_CHECK(N >= 0 && K > 0 && K % 16 == 0,
               "quantize_fp8_weight: need N >= 0 and K > 0 a multiple of 16, got N=" << N << " K=" << K);
  DFLASH_CHECK(ld_scale >= fp8::blocks(K), "quantize_fp8_weight: ld_scale=" << ld_scale << " is smaller than ceil(K/128)="
                                                                          << fp8::blocks(K) << " (K=" << K << ")");
  if (N == 0) return;
  DFLASH_CHECK(w_bf16 != nullptr && q != nullptr && scale_inv != nullptr,
               "quantize_fp8_weight: null pointer (w=" << w_bf16 << " q=" << static_cast<const void*>(q)
                                                       << " scale_inv=" << scale_inv << ")");
  DFLASH_CHECK_HINT(aligned16(w_bf16) && aligned16(q),
                    "quantize_fp8_weight: w and q must be 16-byte aligned, got w=" << w_bf16
                                                                                   << " q=" << static_cast<const void*>(q),
                    "pass whole tensors (device allocations are aligned), not views at odd offsets");
  DFLASH_CHECK(fp8::blocks(N) < 65536, "quantize_fp8_weight: N=" << N << " has more than 65535 row blocks");
  const dim3 grid(static_cast<unsigned>(fp8::blocks(K)), static_cast<unsigned>(fp8::blocks(N)));
  launch_kernel(quantize_weight_kernel, grid, dim3(kThreads), 0, static_cast<cudaStream_t>(s),
                static_cast<const bf16*>(w_bf16), N, K, q, scale_inv, ld_scale);
}


void quantize_fp8_tiles(const Fp8TileQuantParams& p, Stream s) {
  DFLASH_CHECK(p.rows >= 0 && p.cols > 0 && p.cols % 8 == 0 && p.ldx >= p.cols && p.ldx % 8 == 0,
               "quantize_fp8_tiles: need rows >= 0, cols > 0 a multiple of 8 and ldx >= cols a multiple of 8, got rows="
                   << p.rows << " cols=" << p.cols << " ldx=" << p.ldx);
  // (block mode: qt's columns [rows, rows rounded up to 16) get codes 0, the tile's zero rows)
  const int64_t qt_cols = p.block ? (p.rows + 15) / 16 * 16 : (p.rows_padded > 0 ? p.rows_padded : (p.rows + 15) / 16 * 16);
  DFLASH_CHECK(p.block || p.qt != nullptr, "quantize_fp8_tiles: the columns mode writes qt; got none");
  DFLASH_CHECK(p.block || (qt_cols >= p.rows && qt_cols % 16 == 0 && p.rows < (int64_t{1} << 31)),
               "quantize_fp8_tiles: the columns mode writes qt over rows_padded >= rows, a multiple of 16; got rows="
                   << p.rows << " rows_padded=" << p.rows_padded);
  if (qt_cols == 0 && p.rows == 0) return;
  DFLASH_CHECK(p.x != nullptr && (p.q == nullptr || p.scale != nullptr) && (p.qt == nullptr || p.scale_t != nullptr),
               "quantize_fp8_tiles: null pointer (x=" << p.x << " q=" << static_cast<const void*>(p.q) << " scale=" << p.scale
                                                      << " qt=" << static_cast<const void*>(p.qt) << " scale_t=" << p.scale_t
                                                      << ")");
  DFLASH_CHECK_HINT(aligned16(p.x) && (p.q == nullptr || (aligned16(p.q) && p.ldq >= p.cols && p.ldq % 16 == 0)) &&
                        (p.qt == nullptr || (aligned16(p.qt) && p.ldqt >= qt_cols && p.ldqt % 16 == 0 && qt_cols % 16 == 0)),
                    "quantize_fp8_tiles: x, q and qt must be 16-byte aligned, ldq >= cols and ldqt >= the transposed "
                    "columns multiples of 16 (block mode: rows rounded up to 16), got x="
                        << p.x << " q=" << static_cast<const void*>(p.q) << " ldq=" << p.ldq
                        << " qt=" << static_cast<const void*>(p.qt) << " ldqt=" << p.ldqt << " rows=" << p.rows
                        << " qt columns=" << qt_cols,
                    "these are what gemm_fp8 needs of its operands");
  DFLASH_CHECK(p.q == nullptr || p.lds >= (p.block ? fp8::blocks(p.cols) : act_scale_ld(p.rows)),
               "quantize_fp8_tiles: lds=" << p.lds << " is smaller than "
                                          << (p.block ? fp8::blocks(p.cols) : act_scale_ld(p.rows)));
  DFLASH_CHECK(p.qt == nullptr || p.ldst >= (p.block ? fp8::blocks(p.rows) : p.cols),
               "quantize_fp8_tiles: ldst=" << p.ldst << " is smaller than "
                                           << (p.block ? fp8::blocks(p.rows) : p.cols));
  const int64_t row_blocks = fp8::blocks(std::max(p.rows, p.block ? p.rows : qt_cols));
  DFLASH_CHECK(row_blocks < 65536, "quantize_fp8_tiles: rows=" << p.rows << " has more than 65535 row blocks");
  if (row_blocks == 0) return;
  const dim3 grid(static_cast<unsigned>(fp8::blocks(p.cols)), static_cast<unsigned>(row_blocks));
  launch_kernel(quantize_tiles_kernel, grid, dim3(kThreads), 0, static_cast<cudaStream_t>(s),
                static_cast<const bf16*>(p.x), p.ldx, p.rows, p.cols, p.block, p.q, p.ldq, p.scale, p.lds, p.qt, p.ldqt,
                qt_cols, p.scale_t, p.ldst);
}

void rms_norm_quant_fp8(const void* x, int64_t ldx, const void* w, int64_t rows, int64_t D, float eps, uint8_t* q,
                        int64_t ldq, float* scale, Stream s) {
  DFLASH_CHECK(rows >= 0 && rows < (int64_t{1} << 31) && D > 0,
               "rms_norm_quant_fp8: need 0 <= rows < 2^31 and D > 0, got rows=" << rows << " D=" << D);
  DFLASH_CHECK(ldx >= D, "rms_norm_quant_fp8: row stride ldx=" << ldx << " is smaller than D=" << D);
  if (rows == 0) return;
  check_quant_output("rms_norm_quant_fp8", q, ldq, scale, rows, D);
  DFLASH_CHECK(x != nullptr && w != nullptr, "rms_norm_quant_fp8: null pointer (x=" << x << " w=" << w << ")");
  DFLASH_CHECK_HINT(aligned16(x) && aligned16(w) && ldx % 8 == 0 && rows * ldx < (int64_t{1} << 31),
                    "rms_norm_quant_fp8: x and w must be 16-byte aligned with ldx % 8 == 0, got x="
                        << x << " w=" << w << " ldx=" << ldx,
                    "the unfused pair (rms_norm, quantize_fp8_act) takes any alignment of x");
  const int units = static_cast<int>(D / kUnit);
  DFLASH_CHECK_HINT(units <= kNormCache * kThreads, "rms_norm_quant_fp8: rows of D=" << D << " > " << kNormCache * kThreads * kUnit
                                                                                     << " are not supported",
                    "use rms_norm then quantize_fp8_act");
  const auto st = static_cast<cudaStream_t>(s);
  auto launch = [&](auto kernel, int G) {
    const int per_block = kThreads / G;
    const auto grid = static_cast<unsigned>((rows + per_block - 1) / per_block);
    launch_kernel(kernel, dim3(grid), dim3(kThreads), 0, st, static_cast<const bf16*>(x), ldx, static_cast<const bf16*>(w),
                  q, ldq, scale, act_scale_ld(rows), static_cast<int>(rows), units, static_cast<int>(D), eps);
  };
  // The group size rms_norm picks for this row length (norm.cu launch_row_norm, W = 8).
  if (units <= 16) launch(rms_norm_quant_kernel<16>, 16);
  else if (units <= 32 * kNormCache) launch(rms_norm_quant_kernel<32>, 32);
  else launch(rms_norm_quant_kernel<kThreads>, kThreads);
}

void swiglu_quant_fp8(const void* gu, int64_t N, int64_t I, uint8_t* q, int64_t ldq, float* scale, Stream s) {
  DFLASH_CHECK(N >= 0 && I > 0, "swiglu_quant_fp8: need N >= 0 and I > 0, got N=" << N << " I=" << I);
  if (N == 0) return;
  check_quant_output("swiglu_quant_fp8", q, ldq, scale, N, I);
  DFLASH_CHECK(gu != nullptr, "swiglu_quant_fp8: null gu");
  DFLASH_CHECK_HINT(aligned16(gu) && N * 2 * I < (int64_t{1} << 31),
                    "swiglu_quant_fp8: gu must be 16-byte aligned (and N * 2I < 2^31), got gu=" << gu << " N=" << N
                                                                                                  << " I=" << I,
                    "the unfused pair (swiglu, quantize_fp8_act) takes any alignment");
  launch_act(SwigluSource{static_cast<const bf16*>(gu), I}, q, ldq, scale, N, I, static_cast<cudaStream_t>(s));
}

void gated_rms_norm_quant_fp8(const void* core, const void* z, int64_t ldz, const void* w, int64_t N, int64_t Hv,
                              int64_t dv, float eps, uint8_t* q, int64_t ldq, float* scale, Stream s) {
  DFLASH_CHECK(N >= 0 && Hv > 0 && (dv == 128 || dv == 256) && N * Hv < (int64_t{1} << 30),
               "gated_rms_norm_quant_fp8: need N >= 0, Hv > 0, dv 128 or 256 and N*Hv < 2^30, got N="
                   << N << " Hv=" << Hv << " dv=" << dv);
  DFLASH_CHECK(ldz >= Hv * dv, "gated_rms_norm_quant_fp8: z row stride ldz=" << ldz << " is smaller than Hv*dv=" << Hv * dv);
  if (N == 0) return;
  check_quant_output("gated_rms_norm_quant_fp8", q, ldq, scale, N, Hv * dv);
  DFLASH_CHECK(core != nullptr && z != nullptr && w != nullptr,
               "gated_rms_norm_quant_fp8: null pointer (core=" << core << " z=" << z << " w=" << w << ")");
  DFLASH_CHECK_HINT(aligned16(core) && aligned16(z) && aligned16(w) && ldz % 8 == 0 && N * ldz < (int64_t{1} << 31),
                    "gated_rms_norm_quant_fp8: core, z and w must be 16-byte aligned with ldz % 8 == 0, got core="
                        << core << " z=" << z << " w=" << w << " ldz=" << ldz,
                    "the unfused pair (gated_rms_norm, quantize_fp8_act) takes any alignment");
  const auto st = static_cast<cudaStream_t>(s);
  auto launch = [&](auto kernel, int G) {
    const unsigned grid =
        persistent_grid(reinterpret_cast<const void*>(kernel), kThreads, 0, 0, N * Hv, kThreads / G);
    launch_kernel(kernel, dim3(grid), dim3(kThreads), 0, st, static_cast<const bf16*>(core), static_cast<const bf16*>(z),
                  ldz, static_cast<const bf16*>(w), q, ldq, scale, act_scale_ld(N), static_cast<int>(N), static_cast<int>(Hv),
                  eps);
  };
  if (dv == 128) launch(gated_rms_norm_quant_kernel<16>, 16);
  else launch(gated_rms_norm_quant_kernel<32>, 32);
}

bool sigmoid_gate_quant_fp8_supported(int64_t ldg, int64_t hsg, int64_t H, int64_t d) {
  return H > 0 && d > 0 && d % 8 == 0 && hsg % 8 == 0 && ldg % 8 == 0 && (H * d) % 16 == 0;
}

void sigmoid_gate_quant_fp8(const void* x, const void* gate, int64_t ldg, int64_t hsg, int64_t N, int64_t H, int64_t d,
                            uint8_t* q, int64_t ldq, float* scale, Stream s) {
  DFLASH_CHECK(N >= 0 && H > 0 && d > 0, "sigmoid_gate_quant_fp8: need N >= 0, H > 0 and d > 0, got N=" << N << " H=" << H
                                                                                                     << " d=" << d);
  if (N == 0) return;
  const int64_t K = H * d;
  check_quant_output("sigmoid_gate_quant_fp8", q, ldq, scale, N, K);
  DFLASH_CHECK(x != nullptr && gate != nullptr, "sigmoid_gate_quant_fp8: null pointer (x=" << x << " gate=" << gate << ")");
  DFLASH_CHECK(hsg >= d && ldg >= (H - 1) * hsg + d,
               "sigmoid_gate_quant_fp8: gate strides too small: hsg=" << hsg << " ldg=" << ldg << " for H=" << H << " d=" << d);
  DFLASH_CHECK_HINT(sigmoid_gate_quant_fp8_supported(ldg, hsg, H, d) && aligned16(x) && aligned16(gate) &&
                        N * std::max(K, ldg) < (int64_t{1} << 31),
                    "sigmoid_gate_quant_fp8: needs d, hsg and ldg multiples of 8, H d of 16 and 16-byte aligned x and "
                    "gate (and N * max(H d, ldg) < 2^31), got d=" << d << " hsg=" << hsg << " ldg=" << ldg << " H=" << H
                                                               << " x=" << x << " gate=" << gate,
                    "the unfused pair (sigmoid_gate, quantize_fp8_act) takes any alignment");
  launch_act(SigmoidGateSource{static_cast<const bf16*>(x), static_cast<const bf16*>(gate), ldg, hsg, K, static_cast<int>(d)},
             q, ldq, scale, N, K, static_cast<cudaStream_t>(s));
}
}  // namespace dflash::cuda
