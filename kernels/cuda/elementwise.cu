// Embedding, norms and elementwise kernels of the target forward: bf16 in / out, fp32 math,
// round-to-nearest-even bf16 stores.
//
// Roofline. None of these does enough arithmetic to matter (a few FLOPs per element, one
// sincosf per (token, rotary frequency)); all are bound by HBM bandwidth (~4.8 TB/s on H200, about
// 18 bytes per SM per clock). Minimum traffic per token, bf16 = 2 bytes:
//   embedding       2·D read + 2·D written                       (D = 5120: 20 KB -> ~4.3 ns/token)
//   rms_norm        2·D + 2·D                                    (weight stays in L1/L2)
//   add_rms_norm    h, d read; h, y written: 8·D                 (the fusion saves a 4·D round trip)
//   swiglu          4·I read, 2·I written
//   qk_norm_rope    q: 2·Hq·d read (gate half skipped) + 2·Hq·d written; k: 4·Hkv·d
//   sigmoid_gate    x, gate read, x written: 6·H·d
//   gated_rms_norm  core, z read, y written: 6·Hv·dv
// So each kernel is written to move exactly those bytes once, with 16-byte accesses: a row's
// values stay in registers between the sum-of-squares pass and the output pass, and the row
// reduction uses warp shuffles (shared memory only across the warps of a block).
//
// Layout of the work:
//   * row norms: one group of G threads per row, G = 16 (rows of <= 16 units of 8), 32 (a warp,
//     rows up to 1024 elements) or 256 (a block, longer rows such as the 5120-wide hidden state);
//     (scalar path: a warp up to 512 elements, else a block)
//   * gated_rms_norm with 8 | dv <= 256: a persistent grid whose lane groups stream rows through
//     a cp.async ring (see gated_rms_norm_kernel); other dv take the row norm kernel;
//   * pointwise ops: a 2-D block (threads over 16-byte units of a row x rows);
//   * qk_norm_rope: one block per token; the block builds the token's cos/sin table once in
//     shared memory, then each warp normalises and rotates whole (token, head) rows, staging the
//     normalised row in shared memory to reach the rotary partner element (i <-> i ± rotary/2).
// Each op has a vectorised instantiation (W = 8 bf16 = 16 bytes per access; needs every row start
// 16-byte aligned: aligned base pointers, row lengths and strides multiples of 8) and a scalar one
// (W = 1) that handles any size and alignment. The launcher picks by looking at the pointers.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/grid.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ptx.cuh"
#include "kernels/error.h"

namespace dflash::cuda {

// Tuning knob for benchmarks/tests only: blocks of the persistent gated_rms_norm grid (0 = as many
// as fit on the GPU at once; tests use 1 to run every lane group through many rows).
namespace tuning {
int gated_norm_blocks = 0;
}

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;      // row-norm and pointwise blocks
constexpr int kQkWarps = 4;        // qk_norm_rope: warps per block (one block per token)
constexpr int kMaxRotaryHalf = 128;  // qk_norm_rope: rotary_dim <= 256 (inv_freq table is a kernel argument)

// ---- bf16 fragments -------------------------------------------------------------------------------

// W consecutive bf16 at p -> f32. W == 8 is one 16-byte load (p must be 16-byte aligned).
template <int W>
__device__ __forceinline__ void load(const bf16* p, float (&v)[W]) {
  if constexpr (W == 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  } else {
    static_assert(W == 1);
    v[0] = __bfloat162float(*p);
  }
}

template <int W>
__device__ __forceinline__ void store(bf16* p, const float (&v)[W]) {
  if constexpr (W == 8) {
    uint4 raw;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
    static_assert(W == 1);
    *p = __float2bfloat16_rn(v[0]);
  }
}

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
// __expf is exact enough for bf16 outputs (relative error ~1e-6 for |x| < 100) and keeps the
// pointwise kernels far below the instruction budget of a bandwidth-bound loop.
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x * sigmoid(x); }

// Sum over a group of G threads: G <= 32 are aligned lanes of one warp (every lane of the warp
// must call it), G == kThreads is the whole block (uses `red`, once per kernel).
template <int G>
__device__ __forceinline__ float group_sum(float v, float* red) {
  if constexpr (G <= 32) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  } else {
    static_assert(G == kThreads);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < G / 32; ++i) s += red[i];
    return s;
  }
}

__device__ __forceinline__ float warp_sum(float v) { return group_sum<32>(v, nullptr); }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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

template <class Op, int W, int G>
void launch_rows(const Op& op, int64_t rows, int64_t D, float eps, cudaStream_t st) {
  constexpr int kRowsPerBlock = kThreads / G;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  row_norm_kernel<Op, W, G><<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(op, rows, static_cast<int>(D / W),
                                                                               static_cast<int>(D), eps);
  DFLASH_CUDA_CHECK_LAST();
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

// ---- pointwise ------------------------------------------------------------------------------------

// blockDim = (threads over the units of a row, rows); grid-stride over rows.
template <class Op, int W>
__global__ void __launch_bounds__(kThreads) pointwise_kernel(const Op op, int64_t rows, int units) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; r < rows; r += stride)
    for (int u = threadIdx.x; u < units; u += blockDim.x) op.template apply<W>(r, u);
}

struct SwigluOp {
  const bf16* gu;  // (N, 2I)
  bf16* y;         // (N, I)
  int64_t I;
  template <int W> __device__ void apply(int64_t r, int u) const {
    float g[W], up[W];
    const bf16* src = gu + r * 2 * I + u * W;
    load(src, g);
    load(src + I, up);
#pragma unroll
    for (int e = 0; e < W; ++e) g[e] = silu(g[e]) * up[e];
    store(y + r * I + u * W, g);
  }
};

// Row r = (token n, head h) of x [N, H, d].
struct SigmoidGateOp {
  bf16* x;
  const bf16* gate;
  int64_t ldg, hsg, H, d;
  template <int W> __device__ void apply(int64_t r, int u) const {
    const int64_t n = r / H, h = r - n * H;
    float xv[W], gv[W];
    bf16* xp = x + r * d + u * W;
    load(xp, xv);
    load(gate + n * ldg + h * hsg + u * W, gv);
#pragma unroll
    for (int e = 0; e < W; ++e) xv[e] *= sigmoid(gv[e]);
    store(xp, xv);
  }
};

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
struct EmbeddingOp {
  const int32_t* ids;
  const bf16* table;
  bf16* y;
  int64_t D;
  template <int W> __device__ void apply(int64_t r, int u) const {
    const bf16* src = table + static_cast<int64_t>(ids[r]) * D + u * W;
    bf16* dst = y + r * D + u * W;
    if constexpr (W == 8) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    else *dst = *src;
  }
};

template <class Op>
void launch_pointwise(const Op& op, bool vec, int64_t rows, int64_t cols, cudaStream_t st) {
  if (rows == 0) return;
  const int units = static_cast<int>(vec ? cols / 8 : cols);
  int tx = 1;
  while (tx < units && tx < kThreads) tx *= 2;
  const int ty = kThreads / tx;
  const int64_t blocks = std::min<int64_t>((rows + ty - 1) / ty, int64_t(1) << 20);
  const dim3 block(static_cast<unsigned>(tx), static_cast<unsigned>(ty));
  if (vec) pointwise_kernel<Op, 8><<<static_cast<unsigned>(blocks), block, 0, st>>>(op, rows, units);
  else pointwise_kernel<Op, 1><<<static_cast<unsigned>(blocks), block, 0, st>>>(op, rows, units);
  DFLASH_CUDA_CHECK_LAST();
}

// ---- qk_norm_rope ---------------------------------------------------------------------------------

struct QkArgs {
  const bf16* q_in;  // token n, head h at n·ldq + h·hsq
  int64_t ldq, hsq;
  bf16* q_out;  // (N, Hq, d)
  bf16* k;      // token n, head h at n·ldk + h·d; in place
  int64_t ldk;
  const bf16* wq;  // (d)
  const bf16* wk;  // (d)
  const int32_t* pos;  // (N)
  int Hq, Hkv, d, rotary_dim;
  float eps;
  float inv_freq[kMaxRotaryHalf];  // computed on the host exactly as the CPU reference does
};

// Vectorised kernel: shared-memory arrays of length L (L % 8 == 0) are stored "split": the first
// four floats of every 8-element unit, then the last four of every unit, so a warp reading one
// unit per lane as two float4 touches consecutive 16-byte words (no bank conflicts).
__device__ __forceinline__ int split_index(int j, int L) { return ((j >> 2) & 1) * (L / 2) + (j >> 3) * 4 + (j & 3); }
__device__ __forceinline__ void read_split(const float* a, int u, int L, float (&v)[8]) {
  const float4 lo = reinterpret_cast<const float4*>(a)[u];
  const float4 hi = reinterpret_cast<const float4*>(a + L / 2)[u];
  v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
  v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
}
__device__ __forceinline__ void write_split(float* a, int u, int L, const float (&v)[8]) {
  reinterpret_cast<float4*>(a)[u] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(a + L / 2)[u] = make_float4(v[4], v[5], v[6], v[7]);
}

// One block per token. W == 8 needs d % 8 == 0, (rotary_dim / 2) % 8 == 0 and aligned rows; W == 1
// handles any d and even rotary_dim.
template <int W>
__global__ void __launch_bounds__(kQkWarps * 32) qk_norm_rope_kernel(const __grid_constant__ QkArgs a) {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const int d = a.d, half = a.rotary_dim / 2;
  float* cosb = smem;         // (half)
  float* sinb = smem + half;  // (half)
  float* rowbuf = smem + 2 * half + (threadIdx.x / 32) * d;  // (d) per warp: the raw row in f32
  const int64_t n = blockIdx.x;

  // cos / sin of the f32 angle pos · inv_freq (precise sincosf: angles reach ~3e4 rad).
  const float pos = static_cast<float>(a.pos[n]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    sincosf(pos * a.inv_freq[i], &s, &c);
    const int at = W == 8 ? split_index(i, half) : i;
    cosb[at] = c;
    sinb[at] = s;
  }
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int units = d / W;
  for (int hr = threadIdx.x / 32; hr < a.Hq + a.Hkv; hr += kQkWarps) {
    const bool is_q = hr < a.Hq;
    const bf16* src;
    bf16* dst;
    const bf16* w;
    if (is_q) {
      src = a.q_in + n * a.ldq + hr * a.hsq;
      dst = a.q_out + (n * a.Hq + hr) * d;
      w = a.wq;
    } else {
      dst = a.k + n * a.ldk + static_cast<int64_t>(hr - a.Hq) * d;
      src = dst;
      w = a.wk;
    }
    // Pass 1: sum of squares; keep the raw row in shared memory for the rotary partners.
    float ss = 0.0f;
    for (int u = lane; u < units; u += 32) {
      float v[W];
      load(src + u * W, v);
#pragma unroll
      for (int e = 0; e < W; ++e) ss += v[e] * v[e];
      if constexpr (W == 8) write_split(rowbuf, u, d, v);
      else rowbuf[u] = v[0];
    }
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / static_cast<float>(d) + a.eps);
    __syncwarp();
    // Pass 2: x̂ · (1 + w), then rotate the first rotary_dim dims (neox halves i and i + half).
    for (int u = lane; u < units; u += 32) {
      float o[W];
      if constexpr (W == 8) {
        float xv[8], wv[8];
        read_split(rowbuf, u, d, xv);
        load(w + u * 8, wv);
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = xv[e] * inv * (1.0f + wv[e]);
        if (u * 8 < a.rotary_dim) {  // whole unit rotated: half % 8 == 0
          const int hu = half / 8;
          const bool lo = u < hu;
          const int pu = lo ? u + hu : u - hu;
          const int iu = lo ? u : pu;
          float xp[8], wp[8], c[8], s[8];
          read_split(rowbuf, pu, d, xp);
          load(w + pu * 8, wp);
          read_split(cosb, iu, half, c);
          read_split(sinb, iu, half, s);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float partner = xp[e] * inv * (1.0f + wp[e]);
            o[e] = lo ? o[e] * c[e] - partner * s[e] : o[e] * c[e] + partner * s[e];
          }
        }
      } else {
        const int j = u;
        o[0] = rowbuf[j] * inv * (1.0f + __bfloat162float(w[j]));
        if (j < a.rotary_dim) {
          const bool lo = j < half;
          const int p = lo ? j + half : j - half;
          const int i = lo ? j : p;
          const float partner = rowbuf[p] * inv * (1.0f + __bfloat162float(w[p]));
          o[0] = lo ? o[0] * cosb[i] - partner * sinb[i] : o[0] * cosb[i] + partner * sinb[i];
        }
      }
      store(dst + u * W, o);
    }
    __syncwarp();  // the row buffer is reused by this warp's next row
  }
}

}  // namespace

// ---- launchers ------------------------------------------------------------------------------------

void embedding(const int32_t* ids, const void* table, void* y, int64_t N, int64_t D, Stream s) {
  DFLASH_CHECK(N >= 0 && D > 0 && D <= (int64_t(1) << 30),
               "embedding: need N >= 0 and 0 < D <= 2^30, got N=" << N << " D=" << D);
  if (N == 0) return;
  DFLASH_CHECK(ids && table && y, "embedding: null pointer (ids=" << ids << " table=" << table << " y=" << y << ")");
  const bool vec = D % 8 == 0 && aligned16(table) && aligned16(y);
  launch_pointwise(EmbeddingOp{ids, static_cast<const bf16*>(table), static_cast<bf16*>(y), D}, vec, N, D,
                   static_cast<cudaStream_t>(s));
}

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
  launch_row_norm(op, vec, rows, D, eps, st);
}

void swiglu(const void* gu, void* y, int64_t N, int64_t I, Stream s) {
  DFLASH_CHECK(N >= 0 && I > 0 && I <= (int64_t(1) << 30),
               "swiglu: need N >= 0 and 0 < I <= 2^30, got N=" << N << " I=" << I);
  if (N == 0) return;
  DFLASH_CHECK(gu && y, "swiglu: null pointer (gu=" << gu << " y=" << y << ")");
  const bool vec = I % 8 == 0 && aligned16(gu) && aligned16(y);
  launch_pointwise(SwigluOp{static_cast<const bf16*>(gu), static_cast<bf16*>(y), I}, vec, N, I,
                   static_cast<cudaStream_t>(s));
}

void qk_norm_rope(const QkPrepParams& p, Stream s) {
  DFLASH_CHECK(p.N >= 0 && p.N < (int64_t(1) << 31) && p.Hq >= 0 && p.Hkv >= 0 && p.Hq + p.Hkv < (1 << 20) &&
                   p.d > 0,
               "qk_norm_rope: need 0 <= N < 2^31, Hq >= 0, Hkv >= 0 and d > 0, got N="
                   << p.N << " Hq=" << p.Hq << " Hkv=" << p.Hkv << " d=" << p.d);
  DFLASH_CHECK(p.rotary_dim > 0 && p.rotary_dim % 2 == 0 && p.rotary_dim <= p.d &&
                   p.rotary_dim <= 2 * kMaxRotaryHalf,
               "qk_norm_rope: rotary_dim=" << p.rotary_dim << " must be even, in (0, d=" << p.d << "] and <= "
                                           << 2 * kMaxRotaryHalf);
  DFLASH_CHECK(p.Hq == 0 || (p.hsq >= p.d && p.ldq >= (p.Hq - 1) * p.hsq + p.d),
               "qk_norm_rope: q strides too small: hsq=" << p.hsq << " ldq=" << p.ldq << " for Hq=" << p.Hq
                                                         << " d=" << p.d);
  DFLASH_CHECK(p.Hkv == 0 || p.ldk >= p.Hkv * p.d,
               "qk_norm_rope: k row stride ldk=" << p.ldk << " is smaller than Hkv*d=" << p.Hkv * p.d);
  DFLASH_CHECK(p.theta > 0.0f, "qk_norm_rope: rope theta must be positive, got " << p.theta);
  const size_t smem = (static_cast<size_t>(p.rotary_dim) + static_cast<size_t>(kQkWarps) * p.d) * sizeof(float);
  DFLASH_CHECK(smem <= 48 * 1024, "qk_norm_rope: head dim d=" << p.d << " needs " << smem
                                                             << " bytes of shared memory, more than 48 KiB");
  if (p.N == 0 || p.Hq + p.Hkv == 0) return;
  DFLASH_CHECK(p.pos && (p.Hq == 0 || (p.q_in && p.q_out && p.wq)) && (p.Hkv == 0 || (p.k && p.wk)),
               "qk_norm_rope: null pointer (q_in=" << p.q_in << " q_out=" << p.q_out << " k=" << p.k << " wq=" << p.wq
                                                   << " wk=" << p.wk << " pos=" << p.pos << ")");

  QkArgs a{};
  a.q_in = static_cast<const bf16*>(p.q_in);
  a.ldq = p.ldq;
  a.hsq = p.hsq;
  a.q_out = static_cast<bf16*>(p.q_out);
  a.k = static_cast<bf16*>(p.k);
  a.ldk = p.ldk;
  a.wq = static_cast<const bf16*>(p.wq);
  a.wk = static_cast<const bf16*>(p.wk);
  a.pos = p.pos;
  a.Hq = static_cast<int>(p.Hq);
  a.Hkv = static_cast<int>(p.Hkv);
  a.d = static_cast<int>(p.d);
  a.rotary_dim = static_cast<int>(p.rotary_dim);
  a.eps = p.eps;
  // inv_freq_i = 1 / theta^(2i / rotary_dim), evaluated in double and rounded to f32 like the CPU
  // reference (ops::rope_neox_inplace); this is the f32 value transformers' table holds.
  const int half = a.rotary_dim / 2;
  for (int i = 0; i < half; ++i)
    a.inv_freq[i] = static_cast<float>(
        1.0 / std::pow(static_cast<double>(p.theta), static_cast<double>(2 * i) / static_cast<double>(a.rotary_dim)));

  const bool vec = p.d % 8 == 0 && half % 8 == 0 && (p.Hq == 0 || (p.ldq % 8 == 0 && p.hsq % 8 == 0 &&
                                                                   aligned16(p.q_in) && aligned16(p.q_out) &&
                                                                   aligned16(p.wq))) &&
                   (p.Hkv == 0 || (p.ldk % 8 == 0 && aligned16(p.k) && aligned16(p.wk)));
  const auto st = static_cast<cudaStream_t>(s);
  const auto grid = static_cast<unsigned>(p.N);
  if (vec) qk_norm_rope_kernel<8><<<grid, kQkWarps * 32, smem, st>>>(a);
  else qk_norm_rope_kernel<1><<<grid, kQkWarps * 32, smem, st>>>(a);
  DFLASH_CUDA_CHECK_LAST();
}

void sigmoid_gate(void* x, const void* gate, int64_t ldg, int64_t hsg, int64_t N, int64_t H, int64_t d, Stream s) {
  DFLASH_CHECK(N >= 0 && H > 0 && d > 0 && d <= (int64_t(1) << 30),
               "sigmoid_gate: need N >= 0, H > 0 and 0 < d <= 2^30, got N=" << N << " H=" << H << " d=" << d);
  DFLASH_CHECK(hsg >= d && ldg >= (H - 1) * hsg + d,
               "sigmoid_gate: gate strides too small: hsg=" << hsg << " ldg=" << ldg << " for H=" << H << " d=" << d);
  if (N == 0) return;
  DFLASH_CHECK(x && gate, "sigmoid_gate: null pointer (x=" << x << " gate=" << gate << ")");
  const bool vec = d % 8 == 0 && hsg % 8 == 0 && ldg % 8 == 0 && aligned16(x) && aligned16(gate);
  launch_pointwise(SigmoidGateOp{static_cast<bf16*>(x), static_cast<const bf16*>(gate), ldg, hsg, H, d}, vec, N * H, d,
                   static_cast<cudaStream_t>(s));
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
    const int G = pow2_at_least(static_cast<int>(dv / 8));
    auto launch = [&](auto kernel) {
      const unsigned grid = persistent_grid(reinterpret_cast<const void*>(kernel), kThreads, kGatedMaxBlocksPerSm,
                                            tuning::gated_norm_blocks, rows, kThreads / G);
      kernel<<<grid, kThreads, 0, st>>>(op, rows, eps);
    };
    switch (G) {
      case 1: launch(gated_rms_norm_kernel<1>); break;
      case 2: launch(gated_rms_norm_kernel<2>); break;
      case 4: launch(gated_rms_norm_kernel<4>); break;
      case 8: launch(gated_rms_norm_kernel<8>); break;
      case 16: launch(gated_rms_norm_kernel<16>); break;
      default: launch(gated_rms_norm_kernel<32>); break;
    }
    DFLASH_CUDA_CHECK_LAST();
    return;
  }
  launch_row_norm(op, vec, N * Hv, dv, eps, st);
}

}  // namespace dflash::cuda
