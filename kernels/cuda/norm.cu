// The norm family's kernels (norm.h): the target's row norms (rms_norm, add_rms_norm,
// gated_rms_norm; bf16 in / out, fp32 math, round-to-nearest-even stores) and the drafter's plain
// RMSNorm forward / backward with saved statistics. The FP8-quantizing twins are in fp8.cu, on the
// same device arithmetic (vec.cuh).
//
// Roofline. All are bound by HBM bandwidth (~4.8 TB/s on H200, about 18 bytes per SM per clock);
// minimum traffic per row (bf16 = 2 bytes):
//   rms_norm        2·D + 2·D                                    (weight stays in L1/L2)
//   add_rms_norm    h, d read; h, y written: 8·D                 (the fusion saves a 4·D round trip)
//   gated_rms_norm  core, z read, y written: 6·Hv·dv
//   rms_norm_fwd    x (2 or 4)·D read, 2·D written
//   rms_norm_bwd    x, dy read, dx read + written (fp32 accumulate): ~14·D, plus the dw partials
//                   (P·D·4 bytes, P <= kDwParts CTAs)
// The target's norms move exactly those bytes once, with 16-byte accesses: a row's values stay in
// registers between the sum-of-squares pass and the output pass, and the row reduction uses warp
// shuffles (shared memory only across the warps of a block). The drafter's are simple coalesced
// loops that reread the row (from L1/L2) instead of keeping it in registers.
//
// Layout of the work (target):
//   * row norms: one group of G threads per row, G = 16 (rows of <= 16 units of 8), 32 (a warp,
//     rows up to 1024 elements) or 256 (a block, longer rows such as the 5120-wide hidden state);
//     (scalar path: a warp up to 512 elements, else a block)
//   * gated_rms_norm with 8 | dv <= 256: a persistent grid whose lane groups stream rows through
//     a cp.async ring (see gated_rms_norm_kernel); other dv take the row norm kernel.
// Each op has a vectorised instantiation (W = 8 bf16 = 16 bytes per access; needs every row start
// 16-byte aligned: aligned base pointers, row lengths and strides multiples of 8) and a scalar one
// (W = 1) that handles any size and alignment. The launcher picks by looking at the pointers.
//
// Determinism (drafter). The weight gradient dw never uses float atomics: a FIXED number of CTAs (a
// function of the shape only, not of the GPU) each own a fixed set of rows and write one partial
// vector; a second kernel (detail::reduce_partials, also used by rope.cu) adds the partials in index
// order. So two runs of the same shape give bitwise equal results on any GPU. The partial buffers
// come from the caching device allocator (stream-ordered: released right after the launches, reused
// only by later work on the same stream).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/cuda/check.h"
#include "kernels/cuda/grid.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/emulatable.cuh"
#include "kernels/cuda/fp8_act.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/pointwise.cuh"
#include "kernels/cuda/vec.cuh"
#include "core/error.h"

namespace dflash::cuda {

// Tuning knob for benchmarks/tests only: blocks of the persistent gated_rms_norm grid (0 = as many
// as fit on the GPU at once; tests use 1 to run every lane group through many rows).
namespace tuning {
int gated_norm_blocks = 0;
int add_norm_rows = 1;  // add_rms_norm's block-per-row kernel with its loads first (0: the generic row kernel, its twin)
// 1: the CUDA target model runs add_rms_norm_quant_fp8 where an FP8 projection reads the norm (the same
// bits as add_rms_norm then quantize_fp8_act; the 27B fp8 decode step 14.33 -> 14.19 ms on an H100,
// bench/results/h100-fused-6bf6ff4). DFLASH_ADD_NORM_QUANT=0 in the environment turns it off at start-up.
int add_norm_quant = [] {
  const char* e = std::getenv("DFLASH_ADD_NORM_QUANT");
  return e && std::strcmp(e, "0") == 0 ? 0 : 1;
}();
}

namespace {

using namespace vec;

constexpr int kThreads = 256;      // row-norm blocks
constexpr int kDwParts = 512;        // max CTAs (partials) of the norm backward kernels
constexpr int64_t kMaxNormD = 12288;  // rms_norm_bwd: a thread keeps D / kThreads dw partials in registers

// ---- row norms ------------------------------------------------------------------------------------

// An Op supplies, for row r and unit u (elements [u·W, u·W + W) of the row):
//   first(r, u, v)   the values to normalise (may also write, e.g. the residual add);
//   reload(r, u, v)  the same values again, for units beyond the register cache (long rows only);
//   finish(r, u, v)  given v = x̂ (normalised), apply the weight / gate and store.
// Each thread owns units lane, lane + G, ...: the same thread reads and writes a unit, so the ops
// are safe in place (x == y).
template <class Op, int W, int G>
__global__ void __launch_bounds__(kThreads) row_norm_kernel(const Op op, int64_t rows, int units, int D, float eps) {
  constexpr int kCache = W == 8 ? 4 : 16;  // units kept in registers per thread (32 or 16 floats)
  __shared__ float red[kThreads / 32];
  pdl_launch_dependents();
  pdl_wait();  // launched as a programmatic dependent launch (pdl.cuh): the previous kernel wrote the rows
  const int lane = static_cast<int>(threadIdx.x) % G;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / G) + threadIdx.x / G;
  const bool active = row < rows;  // inactive groups still join the shuffles

  float v[kCache][W];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kCache; ++i) {
    const int u = lane + i * G;
    if (active && u < units) {
      op.first(row, u, v[i]);
#pragma unroll
      for (int e = 0; e < W; ++e) ss += v[i][e] * v[i][e];
    }
  }
  for (int u = lane + kCache * G; active && u < units; u += G) {
    float t[W];
    op.first(row, u, t);
#pragma unroll
    for (int e = 0; e < W; ++e) ss += t[e] * t[e];
  }
  ss = group_sum<G>(ss, red);
  if (!active) return;
  const float inv = rsqrtf(ss / static_cast<float>(D) + eps);

#pragma unroll
  for (int i = 0; i < kCache; ++i) {
    const int u = lane + i * G;
    if (u < units) {
#pragma unroll
      for (int e = 0; e < W; ++e) v[i][e] *= inv;
      op.finish(row, u, v[i]);
    }
  }
  for (int u = lane + kCache * G; u < units; u += G) {
    float t[W];
    op.reload(row, u, t);
#pragma unroll
    for (int e = 0; e < W; ++e) t[e] *= inv;
    op.finish(row, u, t);
  }
}

struct RmsNormOp {
  const bf16* x;  // (rows, ldx)
  int64_t ldx;
  const bf16* w;  // (D)
  bf16* y;        // (rows, ldy)
  int64_t ldy;
  bool zero_centered;
  template <int W> __device__ void first(int64_t r, int u, float (&v)[W]) const { load(x + r * ldx + u * W, v); }
  template <int W> __device__ void reload(int64_t r, int u, float (&v)[W]) const { load(x + r * ldx + u * W, v); }
  template <int W> __device__ void finish(int64_t r, int u, float (&v)[W]) const {
    float wv[W];
    load(w + u * W, wv);
#pragma unroll
    for (int e = 0; e < W; ++e) v[e] *= zero_centered ? 1.0f + wv[e] : wv[e];
    store(y + r * ldy + u * W, v);
  }
};

// h += d (stored as bf16), then y = rmsnorm(h) · (1 + w) of the stored (rounded) h, which is what
// the next layer reads: the fused kernel equals add-then-norm through memory.
struct AddRmsNormOp {
  bf16* h;        // (rows, D)
  const bf16* d;  // (rows, D)
  const bf16* w;  // (D)
  bf16* y;        // (rows, D)
  int64_t D;
  template <int W> __device__ void first(int64_t r, int u, float (&v)[W]) const {
    const int64_t off = r * D + u * W;
    float dv[W];
    load(h + off, v);
    load(d + off, dv);
#pragma unroll
    for (int e = 0; e < W; ++e) v[e] += dv[e];
    store(h + off, v);
#pragma unroll
    for (int e = 0; e < W; ++e) v[e] = round_bf16(v[e]);
  }
  // h was already updated by this same thread.
  template <int W> __device__ void reload(int64_t r, int u, float (&v)[W]) const { load(h + r * D + u * W, v); }
  template <int W> __device__ void finish(int64_t r, int u, float (&v)[W]) const {
    float wv[W];
    load(w + u * W, wv);
#pragma unroll
    for (int e = 0; e < W; ++e) v[e] *= 1.0f + wv[e];
    store(y + r * D + u * W, v);
  }
};

// Row r = (token n, value head h) of core [N, Hv, dv]; z of that row at n·ldz + h·dv.
struct GatedRmsNormOp {
  const bf16* core;  // (N·Hv, dv)
  const bf16* z;     // (N, ldz)
  int64_t ldz;
  int64_t Hv, dv;
  const bf16* w;  // (dv)
  bf16* y;        // (N·Hv, dv)
  template <int W> __device__ void first(int64_t r, int u, float (&v)[W]) const { load(core + r * dv + u * W, v); }
  template <int W> __device__ void reload(int64_t r, int u, float (&v)[W]) const { load(core + r * dv + u * W, v); }
  template <int W> __device__ void finish(int64_t r, int u, float (&v)[W]) const {
    const int64_t n = r / Hv, h = r - n * Hv;
    float wv[W], zv[W];
    load(w + u * W, wv);
    load(z + n * ldz + h * dv + u * W, zv);
#pragma unroll
    for (int e = 0; e < W; ++e) v[e] *= wv[e] * silu(zv[e]);
    store(y + r * dv + u * W, v);
  }
};

// Fast gated_rms_norm for 8 | dv <= 256 (Qwen3.6-27B: 48 heads of 128 per token). The generic row
// kernel gives each row a group of threads that loads core, reduces, and only then loads z: two
// dependent DRAM round trips per row and 16 bytes in flight per thread (1.6 TB/s measured).
// Here a persistent grid of lane groups streams rows: a group of G lanes (G = the power of two
// >= dv/8, one 16-byte unit per lane, lanes past dv/8 idle) takes rows first, first + stride, ...
// and keeps kGatedStages rows (core and z) in flight through a per-thread cp.async ring in shared
// memory (each thread reads only the slots it filled, so no block barrier), refilling a slot as
// soon as its row is computed. The row's sum of squares is reduced with log2(G) xor shuffles.
// Bytes per row: 2·dv core + 2·dv z read, 2·dv y written (w stays in L1); at N = 8192, Hv = 48,
// dv = 128: 302 MB, 0.075 ms at 4 TB/s. Same arithmetic, in the same order, as row_norm_kernel
// (idle lanes add exact zeros), so the two give bit-identical results.
// Measured on an H200 at that shape (z inside the 16480-wide in-projection output): 0.095 ms alone
// (3.2 TB/s; a device-to-device copy runs at 4.1), 0.113 ms in the forward (2.7 TB/s, after the
// delta rule's writes); the row norm kernel took 0.164 / 0.186 ms, a multi-row kernel without the
// ring 0.114 / 0.124. 54 registers: 4 blocks per SM, 1024 threads x 4 rows x 32 bytes = 128 KB in
// flight per SM; grids of 1, 2, 3 blocks per SM took 0.190, 0.114, 0.097 ms.
constexpr int kGatedStages = 4;  // rows in flight per lane group (power of two); 32 KB per block
constexpr int kGatedMaxBlocksPerSm = 0;  // cap on the persistent grid's blocks per SM (0: as many as fit)

using ptx::cp_async16_ring;
using ptx::cp_async_commit_ring;
using ptx::cp_async_wait_ring;

template <int G>
__global__ void __launch_bounds__(kThreads) gated_rms_norm_kernel(const GatedRmsNormOp op, int rows, float eps) {
  constexpr int kGroups = kThreads / G;
  __shared__ uint4 ring[kGatedStages][2][kThreads];  // [slot][core, z][thread]
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % G, grp = tid / G;
  const int hv = static_cast<int>(op.Hv), units = static_cast<int>(op.dv / 8);
  const bool on = lane < units;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kGroups;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kGroups + grp;
  // The loop runs while the warp's first group has a row, so every lane of a warp joins each
  // shuffle; groups past the end compute on stale slots and store nothing.
  const int64_t warp_first = static_cast<int64_t>(blockIdx.x) * kGroups + (tid / 32) * (32 / G);
  auto issue = [&](int slot, int64_t r) {
    if (on && r < rows) {
      const int n = static_cast<int>(r) / hv, h = static_cast<int>(r) - n * hv;
      cp_async16_ring(&ring[slot][0][tid], op.core + r * op.dv + lane * 8);
      cp_async16_ring(&ring[slot][1][tid], op.z + static_cast<int64_t>(n) * op.ldz + h * op.dv + lane * 8);
    }
    cp_async_commit_ring();  // (possibly empty: one group per row keeps the wait count fixed)
  };
#pragma unroll
  for (int k = 0; k < kGatedStages; ++k) issue(k, first + k * stride);
  float wv[8];
  ptx::unpack8(on ? *reinterpret_cast<const uint4*>(op.w + lane * 8) : make_uint4(0u, 0u, 0u, 0u), wv);
  int slot = 0;
  for (int64_t k = 0; warp_first + k * stride < rows; ++k) {
    const int64_t r = first + k * stride;
    cp_async_wait_ring<kGatedStages - 1>();
    float v[8], zv[8];
    ptx::unpack8(on ? ring[slot][0][tid] : make_uint4(0u, 0u, 0u, 0u), v);
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += v[e] * v[e];
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (on && r < rows) {
      ptx::unpack8(ring[slot][1][tid], zv);
      const float inv = rsqrtf(ss / static_cast<float>(op.dv) + eps);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        v[e] *= inv;
        v[e] *= wv[e] * silu(zv[e]);
      }
      store(op.y + r * op.dv + lane * 8, v);
    }
    issue(slot, r + kGatedStages * stride);
    slot = (slot + 1) & (kGatedStages - 1);
  }
}

// add_rms_norm with 16-byte rows longer than 1024 (a block of kThreads per row; the 5120-wide hidden
// state), the row_norm_kernel<AddRmsNormOp, 8, kThreads> arithmetic in the same order, with every
// load of the row issued before the first store: through the generic kernel each unit's store to h
// (which may alias the next unit's loads) waited for that unit's loads, so a row took one DRAM round
// trip per unit (~7 us at 16 rows in h200-graphs-b7c45b1's profile). The norm weight is read before
// the programmatic-dependent-launch wait (no kernel writes it). Measured (H200, 16 x 5120, CUDA
// graph, bench/results/h200-decode4-*): 1.6 us against the generic kernel's 2.7 us.
// kQuant (add_rms_norm_quant_fp8): the same row then quantized per 128 columns (16 units: the 16
// lanes of a half warp) as quantize_fp8_act quantizes the stored y (fp8_act.cuh), y itself stored only
// where op.y is set; the same arithmetic, so the codes equal add_rms_norm then quantize_fp8_act's.
struct QuantOut {
  uint8_t* q = nullptr;  // [rows, ldq] codes
  int64_t ldq = 0;
  float* scale = nullptr;  // fp8_act_scale_elems(rows, D), row stride lds
  int64_t lds = 0;
};
constexpr int kAddCache = 4;  // units per thread: rows up to 4 · 8 · kThreads = 8192 elements
template <bool kQuant>
__global__ void __launch_bounds__(kThreads) add_rms_norm_rows_kernel(const AddRmsNormOp op, int64_t rows, int units,
                                                                     float eps, const QuantOut qo) {
  __shared__ float red[kThreads / 32];
  pdl_launch_dependents();
  const int lane = static_cast<int>(threadIdx.x);
  const int64_t row = blockIdx.x;
  float wv[kAddCache][8];
#pragma unroll
  for (int i = 0; i < kAddCache; ++i) {
    const int u = lane + i * kThreads;
    if (u < units) load(op.w + u * 8, wv[i]);
  }
  pdl_wait();
  float v[kAddCache][8], dv[kAddCache][8];
#pragma unroll
  for (int i = 0; i < kAddCache; ++i) {
    const int u = lane + i * kThreads;
    if (u < units) {
      load(op.h + row * op.D + u * 8, v[i]);
      load(op.d + row * op.D + u * 8, dv[i]);
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kAddCache; ++i) {
    const int u = lane + i * kThreads;
    if (u < units) {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[i][e] += dv[i][e];
      store(op.h + row * op.D + u * 8, v[i]);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[i][e] = round_bf16(v[i][e]);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss += v[i][e] * v[i][e];
    }
  }
  ss = group_sum<kThreads>(ss, red);
  const float inv = rsqrtf(ss / static_cast<float>(op.D) + eps);
  const unsigned mask = 0xFFFFu << (16 * ((threadIdx.x / fp8_act::kGroupLanes) % 2));  // (kQuant: this half warp)
#pragma unroll
  for (int i = 0; i < kAddCache; ++i) {
    const int u = lane + i * kThreads;
    if (u < units) {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[i][e] *= inv;
#pragma unroll
      for (int e = 0; e < 8; ++e) v[i][e] *= 1.0f + wv[i][e];
      if (!kQuant || op.y) store(op.y + row * op.D + u * 8, v[i]);
    }
    if constexpr (kQuant) {
      if ((u & ~(fp8_act::kGroupLanes - 1)) >= units) continue;  // the half warp's group starts past the row
      const bool on = u < units;
      float yv[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) yv[e] = on ? round_bf16(v[i][e]) : 0.0f;  // y as stored
      fp8_act::quantize_group(yv, on, mask, lane % fp8_act::kGroupLanes, static_cast<int>(row), static_cast<int>(rows),
                              u / fp8_act::kGroupLanes, qo.q + row * qo.ldq + u * 8, qo.scale, qo.lds);
    }
  }
  (void)mask;
}

// Whether add_rms_norm takes its block-per-row kernel at width D (16-byte rows of 1024 < D <= 8192).
bool rows_kernel_takes(int64_t D) {
  return tuning::add_norm_rows != 0 && D % 8 == 0 && D / 8 > 32 * 4 && D / 8 <= int64_t{kAddCache} * kThreads;
}

template <class Op, int W, int G>
void launch_rows(const Op& op, int64_t rows, int64_t D, float eps, cudaStream_t st) {
  constexpr int kRowsPerBlock = kThreads / G;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  launch_kernel_pdl(row_norm_kernel<Op, W, G>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, st, op, rows,
                    static_cast<int>(D / W), static_cast<int>(D), eps);
}

// Picks the group size from the row length: the smallest group whose register cache holds a row.
template <class Op>
void launch_row_norm(const Op& op, bool vec, int64_t rows, int64_t D, float eps, cudaStream_t st) {
  if (rows == 0) return;
  if (vec) {
    const int64_t units = D / 8;
    if (units <= 16) launch_rows<Op, 8, 16>(op, rows, D, eps, st);
    else if (units <= 32 * 4) launch_rows<Op, 8, 32>(op, rows, D, eps, st);
    else launch_rows<Op, 8, kThreads>(op, rows, D, eps, st);
  } else {
    if (D <= 32 * 16) launch_rows<Op, 1, 32>(op, rows, D, eps, st);
    else launch_rows<Op, 1, kThreads>(op, rows, D, eps, st);
  }
}

struct AddOp {
  bf16* h;
  const bf16* d;
  int64_t D;
  template <int W> __device__ void apply(int64_t r, int u) const {
    float a[W], b[W];
    bf16* hp = h + r * D + u * W;
    load(hp, a);
    load(d + r * D + u * W, b);
#pragma unroll
    for (int e = 0; e < W; ++e) a[e] += b[e];
    store(hp, a);
  }
};

// A bit-exact copy of the rows (no conversion).

// dw[c] += Σ_p partial[p, c] for p = 0 .. parts-1 in order.
__global__ void reduce_partials_kernel(const float* __restrict__ partial, int parts, int64_t D,
                                       float* __restrict__ dw) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= D) return;
  float s = 0.0f;
  for (int p = 0; p < parts; ++p) s += partial[p * D + c];
  dw[c] += s;
}

// ---- RMSNorm ------------------------------------------------------------------------------------

// One block per row; thread t owns units t, t + kThreads, ... of W elements.
template <int W, class T>
__global__ void __launch_bounds__(kThreads) rms_norm_fwd_kernel(const T* __restrict__ x, int64_t ldx,
                                                                const bf16* __restrict__ w, bf16* __restrict__ y,
                                                                float* __restrict__ rstd, int64_t D, float eps) {
  __shared__ float red[kThreads / 32];
  const int64_t r = blockIdx.x, units = D / W;
  const T* xr = x + r * ldx;
  float ss = 0.0f;
  for (int64_t u = threadIdx.x; u < units; u += kThreads) {
    float v[W];
    load<W>(xr + u * W, v);
#pragma unroll
    for (int e = 0; e < W; ++e) ss += v[e] * v[e];
  }
  ss = block_sum<kThreads>(ss, red);
  const float rs = rsqrtf(ss / static_cast<float>(D) + eps);
  bf16* yr = y + r * D;
  for (int64_t u = threadIdx.x; u < units; u += kThreads) {
    float v[W], g[W];
    load<W>(xr + u * W, v);
    load<W>(w + u * W, g);
#pragma unroll
    for (int e = 0; e < W; ++e) v[e] = v[e] * rs * g[e];
    store<W>(yr + u * W, v);
  }
  if (threadIdx.x == 0) rstd[r] = rs;
}

// Grid of `parts` CTAs; CTA b handles rows b, b + parts, ... in order and writes its dw partial
// (Σ over its rows of dy · x̂) to partial[b, :]. Thread t owns units t + k·kThreads (k < kU) of W
// columns, the same in every row, so it keeps its dw partial in registers.
template <int W, class T>
__global__ void __launch_bounds__(kThreads) rms_norm_bwd_kernel(const T* __restrict__ x, int64_t ldx,
                                                                const bf16* __restrict__ w,
                                                                const float* __restrict__ rstd,
                                                                const bf16* __restrict__ dy, float* dx,
                                                                bf16* dx_bf16, bf16* dx_copy,
                                                                float* __restrict__ partial, int64_t rows,
                                                                int64_t D) {
  constexpr int kU = static_cast<int>(kMaxNormD / (W * kThreads));
  __shared__ float red[kThreads / 32];
  const int64_t units = D / W;
  float dwr[kU][W];
#pragma unroll
  for (int k = 0; k < kU; ++k)
#pragma unroll
    for (int e = 0; e < W; ++e) dwr[k][e] = 0.0f;
  const float invD = 1.0f / static_cast<float>(D);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * ldx;
    const bf16* gr = dy + r * D;
    const float rs = rstd[r];
    float s = 0.0f;  // Σ x̂ · w·dy
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      const int64_t u = threadIdx.x + k * kThreads;
      if (u < units) {
        float xv[W], wv[W], gv[W];
        load<W>(xr + u * W, xv);
        load<W>(w + u * W, wv);
        load<W>(gr + u * W, gv);
#pragma unroll
        for (int e = 0; e < W; ++e) s += xv[e] * rs * wv[e] * gv[e];
      }
    }
    const float c = block_sum<kThreads>(s, red) * invD;
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      const int64_t u = threadIdx.x + k * kThreads;
      if (u < units) {
        float xv[W], wv[W], gv[W], d[W] = {};
        load<W>(xr + u * W, xv);
        load<W>(w + u * W, wv);
        load<W>(gr + u * W, gv);
        const int64_t at = r * D + u * W;
        if (dx != nullptr) load<W>(dx + at, d);
#pragma unroll
        for (int e = 0; e < W; ++e) {
          const float xh = xv[e] * rs;
          dwr[k][e] += gv[e] * xh;
          d[e] += rs * (wv[e] * gv[e] - xh * c);
        }
        if (dx != nullptr) store<W>(dx + at, d);
        else store<W>(dx_bf16 + at, d);
        if (dx_copy != nullptr) store<W>(dx_copy + at, d);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kU; ++k) {
    const int64_t u = threadIdx.x + k * kThreads;
    if (u < units) store<W>(partial + blockIdx.x * D + u * W, dwr[k]);
  }
}

}  // namespace

// ---- launchers ------------------------------------------------------------------------------------

void rms_norm(const void* x, int64_t ldx, const void* w, void* y, int64_t ldy, int64_t rows, int64_t D, float eps,
              bool zero_centered, Stream s) {
  DFLASH_CHECK(rows >= 0 && rows < (int64_t(1) << 31) && D > 0 && D <= (int64_t(1) << 30),
               "rms_norm: need 0 <= rows < 2^31 and 0 < D <= 2^30, got rows=" << rows << " D=" << D);
  DFLASH_CHECK(ldx >= D && ldy >= D, "rms_norm: row strides ldx=" << ldx << " ldy=" << ldy << " must be >= D=" << D);
  if (rows == 0) return;
  DFLASH_CHECK(x && w && y, "rms_norm: null pointer (x=" << x << " w=" << w << " y=" << y << ")");
  const bool vec = D % 8 == 0 && ldx % 8 == 0 && ldy % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(y);
  const RmsNormOp op{static_cast<const bf16*>(x), ldx, static_cast<const bf16*>(w), static_cast<bf16*>(y), ldy,
                     zero_centered};
  launch_row_norm(op, vec, rows, D, eps, static_cast<cudaStream_t>(s));
}

void add_rms_norm(void* h, const void* d, const void* w, void* y, int64_t rows, int64_t D, float eps, Stream s) {
  DFLASH_CHECK(rows >= 0 && rows < (int64_t(1) << 31) && D > 0 && D <= (int64_t(1) << 30),
               "add_rms_norm: need 0 <= rows < 2^31 and 0 < D <= 2^30, got rows=" << rows << " D=" << D);
  if (rows == 0) return;
  DFLASH_CHECK(h && d && (w || !y), "add_rms_norm: null pointer (h=" << h << " d=" << d << " w=" << w << ")");
  const bool vec = D % 8 == 0 && aligned16(h) && aligned16(d) && (!y || (aligned16(w) && aligned16(y)));
  const auto st = static_cast<cudaStream_t>(s);
  if (!y) {
    launch_pointwise(AddOp{static_cast<bf16*>(h), static_cast<const bf16*>(d), D}, vec, rows, D, st);
    return;
  }
  const AddRmsNormOp op{static_cast<bf16*>(h), static_cast<const bf16*>(d), static_cast<const bf16*>(w),
                        static_cast<bf16*>(y), D};
  if (vec && rows_kernel_takes(D)) {  // a block per row
    launch_kernel_pdl(add_rms_norm_rows_kernel<false>, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0, st, op,
                      rows, static_cast<int>(D / 8), eps, QuantOut{});
    return;
  }
  launch_row_norm(op, vec, rows, D, eps, st);
}

bool add_rms_norm_quant_fp8_supported(int64_t D) {
  return D % 16 == 0 && rows_kernel_takes(D);  // (16: the quantized operand's rule, check_quant_output)
}

void add_rms_norm_quant_fp8(void* h, const void* d, const void* w, void* y, int64_t rows, int64_t D, float eps,
                            uint8_t* q, int64_t ldq, float* scale, Stream s) {
  DFLASH_CHECK(rows >= 0 && rows < (int64_t{1} << 31),
               "add_rms_norm_quant_fp8: need 0 <= rows < 2^31, got rows=" << rows);
  DFLASH_CHECK_HINT(add_rms_norm_quant_fp8_supported(D),
                    "add_rms_norm_quant_fp8: rows of D=" << D << " do not take add_rms_norm's block-per-row kernel "
                                                         << "(1024 < D <= 8192, D % 16 == 0, tuning::add_norm_rows)",
                    "run add_rms_norm then quantize_fp8_act");
  if (rows == 0) return;
  fp8_act::check_quant_output("add_rms_norm_quant_fp8", q, ldq, scale, rows, D);
  DFLASH_CHECK(h != nullptr && d != nullptr && w != nullptr,
               "add_rms_norm_quant_fp8: null pointer (h=" << h << " d=" << d << " w=" << w << ")");
  DFLASH_CHECK_HINT(aligned16(h) && aligned16(d) && aligned16(w) && (!y || aligned16(y)) && rows * D < (int64_t{1} << 31),
                    "add_rms_norm_quant_fp8: h, d, w and y must be 16-byte aligned, got h=" << h << " d=" << d << " w="
                                                                                             << w << " y=" << y,
                    "the unfused pair (add_rms_norm, quantize_fp8_act) takes any alignment");
  const AddRmsNormOp op{static_cast<bf16*>(h), static_cast<const bf16*>(d), static_cast<const bf16*>(w),
                        static_cast<bf16*>(y), D};
  launch_kernel_pdl(add_rms_norm_rows_kernel<true>, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0,
                    static_cast<cudaStream_t>(s), op, rows, static_cast<int>(D / 8), eps,
                    QuantOut{q, ldq, scale, fp8_act_scale_ld(rows)});
}

void gated_rms_norm(const void* core, const void* z, int64_t ldz, const void* w, void* y, int64_t N, int64_t Hv,
                    int64_t dv, float eps, Stream s) {
  DFLASH_CHECK(N >= 0 && Hv > 0 && dv > 0 && dv <= (int64_t(1) << 30) && N * Hv < (int64_t(1) << 31),
               "gated_rms_norm: need N >= 0, Hv > 0, dv > 0 and N*Hv < 2^31, got N=" << N << " Hv=" << Hv
                                                                                     << " dv=" << dv);
  DFLASH_CHECK(ldz >= Hv * dv, "gated_rms_norm: z row stride ldz=" << ldz << " is smaller than Hv*dv=" << Hv * dv);
  if (N == 0) return;
  DFLASH_CHECK(core && z && w && y,
               "gated_rms_norm: null pointer (core=" << core << " z=" << z << " w=" << w << " y=" << y << ")");
  const bool vec = dv % 8 == 0 && ldz % 8 == 0 && aligned16(core) && aligned16(z) && aligned16(w) && aligned16(y);
  const GatedRmsNormOp op{static_cast<const bf16*>(core), static_cast<const bf16*>(z), ldz, Hv, dv,
                          static_cast<const bf16*>(w), static_cast<bf16*>(y)};
  const auto st = static_cast<cudaStream_t>(s);
  if (vec && dv <= 256 && N * Hv < (int64_t(1) << 31) - (int64_t(1) << 20)) {  // int row index + a block
    const int rows = static_cast<int>(N * Hv);
    dispatch_lanes(pow2_at_least(static_cast<int>(dv / 8)), [&](auto G) {
      const auto kernel = gated_rms_norm_kernel<G>;
      const unsigned grid = persistent_grid(reinterpret_cast<const void*>(kernel), kThreads, kGatedMaxBlocksPerSm,
                                            tuning::gated_norm_blocks, rows, kThreads / G);
      launch_kernel(kernel, dim3(grid), dim3(kThreads), 0, st, op, rows, eps);
    });
    return;
  }
  launch_row_norm(op, vec, N * Hv, dv, eps, st);
}

void rms_norm_fwd(const void* x, bool x_f32, int64_t ldx, const void* w, void* y, float* rstd, int64_t rows, int64_t D,
                  float eps, Stream s) {
  DFLASH_CHECK(rows >= 0 && rows < (int64_t{1} << 31) && D > 0,
               "rms_norm_fwd: need 0 <= rows < 2^31 and D > 0, got rows=" << rows << " D=" << D);
  DFLASH_CHECK(ldx >= D, "rms_norm_fwd: x row stride ldx=" << ldx << " is smaller than D=" << D);
  DFLASH_CHECK(eps >= 0.0f, "rms_norm_fwd: eps must be >= 0, got " << eps);
  if (rows == 0) return;
  DFLASH_CHECK(x != nullptr && w != nullptr && y != nullptr && rstd != nullptr,
               "rms_norm_fwd: null pointer (x=" << x << " w=" << w << " y=" << y << " rstd=" << rstd << ")");
  const auto st = static_cast<cudaStream_t>(s);
  const auto grid = static_cast<unsigned>(rows);
  const bool vec = D % 8 == 0 && ldx % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(y);
  const auto* xf = static_cast<const float*>(x);
  const auto* xb = static_cast<const bf16*>(x);
  const auto* wb = static_cast<const bf16*>(w);
  auto* yb = static_cast<bf16*>(y);
  const dim3 g(grid), b(kThreads);
  if (x_f32 && vec) launch_kernel(rms_norm_fwd_kernel<8, float>, g, b, 0, st, xf, ldx, wb, yb, rstd, D, eps);
  else if (x_f32) launch_kernel(rms_norm_fwd_kernel<1, float>, g, b, 0, st, xf, ldx, wb, yb, rstd, D, eps);
  else if (vec) launch_kernel(rms_norm_fwd_kernel<8, bf16>, g, b, 0, st, xb, ldx, wb, yb, rstd, D, eps);
  else launch_kernel(rms_norm_fwd_kernel<1, bf16>, g, b, 0, st, xb, ldx, wb, yb, rstd, D, eps);
}

#ifndef DFLASH_CUDA_EMULATION  // (its partials come from the device allocator)
void rms_norm_bwd(const RmsNormBwdParams& p, Stream s) {
  DFLASH_CHECK(p.rows >= 0 && p.rows < (int64_t{1} << 31) && p.D > 0 && p.D <= kMaxNormD,
               "rms_norm_bwd: need 0 <= rows < 2^31 and 0 < D <= " << kMaxNormD << ", got rows=" << p.rows
                                                                    << " D=" << p.D);
  DFLASH_CHECK(p.ldx >= p.D, "rms_norm_bwd: x row stride ldx=" << p.ldx << " is smaller than D=" << p.D);
  DFLASH_CHECK((p.dx != nullptr) != (p.dx_bf16 != nullptr),
               "rms_norm_bwd: exactly one of dx (fp32, accumulate) and dx_bf16 (written) must be set, got dx="
                   << p.dx << " dx_bf16=" << p.dx_bf16);
  if (p.rows == 0) return;
  DFLASH_CHECK(p.x != nullptr && p.w != nullptr && p.rstd != nullptr && p.dy != nullptr && p.dw != nullptr,
               "rms_norm_bwd: null pointer (x=" << p.x << " w=" << p.w << " rstd=" << p.rstd << " dy=" << p.dy
                                                << " dw=" << p.dw << ")");
  const int parts = static_cast<int>(std::min<int64_t>(p.rows, kDwParts));
  Scratch partial(static_cast<size_t>(parts) * static_cast<size_t>(p.D) * sizeof(float));
  const auto st = static_cast<cudaStream_t>(s);
  auto launch = [&](auto kernel, const auto* x) {
    kernel<<<static_cast<unsigned>(parts), kThreads, 0, st>>>(
        x, p.ldx, static_cast<const bf16*>(p.w), p.rstd, static_cast<const bf16*>(p.dy), p.dx,
        static_cast<bf16*>(p.dx_bf16), static_cast<bf16*>(p.dx_copy_bf16), partial.f32(), p.rows, p.D);
  };
  const bool vec = p.D % 8 == 0 && p.ldx % 8 == 0 && aligned16(p.x) && aligned16(p.w) && aligned16(p.dy) &&
                   aligned16(p.dx) && aligned16(p.dx_bf16) && aligned16(p.dx_copy_bf16);
  const auto* xf = static_cast<const float*>(p.x);
  const auto* xb = static_cast<const bf16*>(p.x);
  if (p.x_f32 && vec) launch(rms_norm_bwd_kernel<8, float>, xf);
  else if (p.x_f32) launch(rms_norm_bwd_kernel<1, float>, xf);
  else if (vec) launch(rms_norm_bwd_kernel<8, bf16>, xb);
  else launch(rms_norm_bwd_kernel<1, bf16>, xb);
  DFLASH_CUDA_CHECK_LAST();
  reduce_partials_kernel<<<blocks_for(p.D, kThreads), kThreads, 0, st>>>(partial.f32(), parts, p.D, p.dw);
  DFLASH_CUDA_CHECK_LAST();
}

namespace detail {
// dw[c] += Σ_p partial[p, c], p in order (the norm backward kernels' partials; rope.cu too).
void reduce_partials(const float* partial, int parts, int64_t D, float* dw, Stream s) {
  reduce_partials_kernel<<<blocks_for(D, kThreads), kThreads, 0, static_cast<cudaStream_t>(s)>>>(partial, parts, D, dw);
  DFLASH_CUDA_CHECK_LAST();
}
}  // namespace detail
#endif

}  // namespace dflash::cuda
