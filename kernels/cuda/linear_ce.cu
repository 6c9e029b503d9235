// Fused, chunked linear cross-entropy of the DFlash LM head (see loss.h for the contract).
//
// Per chunk of n <= chunk_rows rows (all on the device's DeviceContext stream, in order):
//   1. logits [n, V] fp32 = hidden_chunk · lm_headᵀ        cuBLASLt, bf16 A/B, fp32 accumulate and OUTPUT
//   2. one block per row: max, argmax (lowest id on ties), lse = max + log Σ exp(z − max),
//      ce = lse − z[label]; then, with dhidden, in one more pass over the row:
//      grad [n, V] bf16 = grad_scale · weight · (softmax − onehot)   (weight 0 → exact zeros)
//   3. dhidden_chunk [n, H] fp32 = grad · lm_head             cuBLASLt, bf16 A/B, fp32 output
//
// Precision choice: the logits are kept in fp32 (not bf16). At V = 248320 and |logit| ~ 10-30, a
// bf16 logit carries an absolute error of up to 0.06 per element, which would move the CE of a row
// by that much (and its softmax by ~6 % per element); fp32 logits leave only the GEMM's fp32
// accumulation error (~1e-6 relative), so ce agrees with the double reference to ~1e-5. The
// gradient of the logits is stored as bf16 (the dhidden GEMM's input, as the contract says): a
// relative error of 2^-9 per element, averaging out in the sum over V. Measured on H200 against
// the double oracle (tests/test_cuda_linear_ce.cpp): ce max abs error <= 3.6e-6, Σ w·ce relative
// <= 1.4e-7, dhidden max_rel_err 1.5e-3 .. 1.9e-3.
//
// Alignment: the logits / grad rows are padded to Vp = round_up(V, 8) elements so that every
// cuBLASLt operand has a 16-byte aligned leading dimension whatever V is (odd V is fine; the pad
// columns are never read: the dhidden GEMM's K is V). H must be a multiple of 8 (the row stride of
// hidden / lm_head in bf16) and the pointers 16-byte aligned, checked by the launcher.
//
// Cost (R rows): FLOPs 2·R·H·V (logits) + 2·R·H·V (dhidden) on tensor cores; extra traffic over
// the GEMMs' own operands: the fp32 logits written and read twice, the bf16 grad written and read,
// ~14·R·V bytes (R = 8192, V = 248320: 28 GB, ~7 ms at 4 TB/s, against ~45 ms of GEMM at
// ~900 TFLOP/s). Without dhidden: 2·R·H·V FLOPs and ~8·R·V bytes.
// Measured (kernel_bench --only ce, H200): fwd+bwd at R 8192, H 5120, V 248320 takes 67.8 ms =
// 614 TFLOP/s with chunk_rows 2048 (1024: 609, 4096: 615), 85.8 % of the 8192³ bf16 GEMM measured
// in the same run (716 TFLOP/s). chunk_rows 2048 is the choice: 3.0 GB of workspace, within 0.2 %
// of 4096 (6.1 GB).
//
// Both GEMMs go through gemm_ex (gemm.h; cuBLASLt, plans cached per shape):
//   logits [n, V] (row stride Vp, fp32) = hidden [n, H] · lm_headᵀ;  dhidden [n, H] (fp32) = grad [n, V] · lm_head
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "core/cuda/check.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/loss.h"
#include "core/device.h"
#include "core/error.h"

namespace dflash::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr uint32_t kAlignBytes = 16;
constexpr int64_t kWsAlign = 256;
constexpr int kThreads = 512;  // per row; V = 248320 is ~121 float4 per thread

int64_t padded_vocab(int64_t V) { return (V + 7) / 8 * 8; }
int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
// Byte offset of the bf16 grad buffer in the workspace (after the fp32 logits).
int64_t logits_bytes(int64_t chunk_rows, int64_t V) { return align_up(chunk_rows * padded_vocab(V) * 4, kWsAlign); }
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) % kAlignBytes) == 0; }

// ---- Row kernel ------------------------------------------------------------------------------------

// Running softmax statistics of a set of logits: max m, Σ exp(z − m), lowest id attaining m.
struct RowStat {
  float m;
  float s;
  int idx;
};

__device__ __forceinline__ void push(RowStat& st, float x, int v) {
  // Elements arrive in increasing v per thread, so a strict > keeps the lowest id on ties.
  if (x > st.m) {
    st.s = st.s * expf(st.m - x) + 1.0f;  // st.m = -inf at first: 0 · 0 + 1
    st.m = x;
    st.idx = v;
  } else if (x != -INFINITY) {  // a -inf logit adds nothing (and would give -inf − -inf = NaN); a NaN propagates
    st.s += expf(x - st.m);
  }
}

__device__ __forceinline__ RowStat combine(const RowStat& a, const RowStat& b) {
  RowStat r;
  r.m = fmaxf(a.m, b.m);
  if (r.m == -INFINITY) {
    r.s = 0.0f;
  } else {
    r.s = (a.s == 0.0f ? 0.0f : a.s * expf(a.m - r.m)) + (b.s == 0.0f ? 0.0f : b.s * expf(b.m - r.m));
  }
  r.idx = a.m > b.m ? a.idx : (b.m > a.m ? b.idx : min(a.idx, b.idx));
  return r;
}

__device__ __forceinline__ RowStat warp_combine(RowStat st) {
  for (int o = 16; o > 0; o >>= 1) {
    RowStat other;
    other.m = __shfl_xor_sync(0xffffffffu, st.m, o);
    other.s = __shfl_xor_sync(0xffffffffu, st.s, o);
    other.idx = __shfl_xor_sync(0xffffffffu, st.idx, o);
    st = combine(st, other);
  }
  return st;
}

// One block per row of the chunk. logits: [n, Vp] fp32; grad: [n, Vp] bf16 (kGrad only).
// Rows r0 + blockIdx.x of labels / weights / ce / argmax.
template <bool kGrad>
__global__ void __launch_bounds__(kThreads) ce_rows_kernel(const float* __restrict__ logits, bf16* __restrict__ grad,
                                                           const int32_t* __restrict__ labels,
                                                           const float* __restrict__ weights, float grad_scale,
                                                           float* __restrict__ ce, int32_t* __restrict__ argmax,
                                                           int64_t r0, int V, int64_t Vp) {
  const int64_t i = blockIdx.x;
  const int64_t r = r0 + i;
  const float* z = logits + i * Vp;
  const int V4 = V / 4 * 4;  // [0, V4) as float4 (row start 16-byte aligned: Vp % 8 == 0), the rest scalar

  RowStat st{-INFINITY, 0.0f, INT_MAX};
  for (int v = threadIdx.x * 4; v < V4; v += kThreads * 4) {
    const float4 q = *reinterpret_cast<const float4*>(z + v);
    push(st, q.x, v);
    push(st, q.y, v + 1);
    push(st, q.z, v + 2);
    push(st, q.w, v + 3);
  }
  for (int v = V4 + threadIdx.x; v < V; v += kThreads) push(st, z[v], v);

  __shared__ RowStat warp_stats[kThreads / 32];
  __shared__ float s_lse;
  st = warp_combine(st);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_stats[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < kThreads / 32 ? warp_stats[lane] : RowStat{-INFINITY, 0.0f, INT_MAX};
    st = warp_combine(st);
    if (lane == 0) {
      const float lse = st.m + logf(st.s);
      const int label = labels[r];
      // An out-of-range label cannot be reported from here without a host sync: its ce is NaN
      // (and its gradient has no onehot term), which the trainer's finite-loss check catches.
      const float zl = (label >= 0 && label < V) ? z[label] : NAN;
      ce[r] = lse - zl;
      argmax[r] = st.idx == INT_MAX ? -1 : st.idx;  // -1 only when no logit of the row compares (NaN row)
      s_lse = lse;
    }
  }
  if constexpr (kGrad) {
    __syncthreads();
    const float lse = s_lse;
    const int label = labels[r];
    const float scale = grad_scale * weights[r];
    bf16* g = grad + i * Vp;
    if (scale == 0.0f) {
      // Exact zeros (not 0 · softmax, which would keep a NaN of a broken row).
      const __nv_bfloat162 zero2 = __floats2bfloat162_rn(0.0f, 0.0f);
      for (int v = threadIdx.x * 4; v < V4; v += kThreads * 4) {
        __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(g + v);
        p[0] = zero2;
        p[1] = zero2;
      }
      for (int v = V4 + threadIdx.x; v < V; v += kThreads) g[v] = __float2bfloat16_rn(0.0f);
      return;
    }
    for (int v = threadIdx.x * 4; v < V4; v += kThreads * 4) {
      const float4 q = *reinterpret_cast<const float4*>(z + v);
      const float a = scale * (expf(q.x - lse) - (v == label ? 1.0f : 0.0f));
      const float b = scale * (expf(q.y - lse) - (v + 1 == label ? 1.0f : 0.0f));
      const float c = scale * (expf(q.z - lse) - (v + 2 == label ? 1.0f : 0.0f));
      const float d = scale * (expf(q.w - lse) - (v + 3 == label ? 1.0f : 0.0f));
      union {
        __nv_bfloat162 h[2];
        uint2 u;
      } pack;
      pack.h[0] = __floats2bfloat162_rn(a, b);
      pack.h[1] = __floats2bfloat162_rn(c, d);
      *reinterpret_cast<uint2*>(g + v) = pack.u;  // 8-byte store, aligned (v % 4 == 0, Vp % 8 == 0)
    }
    for (int v = V4 + threadIdx.x; v < V; v += kThreads)
      g[v] = __float2bfloat16_rn(scale * (expf(z[v] - lse) - (v == label ? 1.0f : 0.0f)));
  }
}

}  // namespace

int64_t linear_ce_workspace(int64_t chunk_rows, int64_t V) {
  DFLASH_CHECK(chunk_rows > 0 && V > 0,
               "linear_ce_workspace: need chunk_rows > 0 and V > 0, got chunk_rows=" << chunk_rows << " V=" << V);
  return logits_bytes(chunk_rows, V) + align_up(chunk_rows * padded_vocab(V) * 2, kWsAlign);
}

void linear_ce(const LinearCeParams& p, int device) {
  DFLASH_CHECK(p.R >= 0 && p.H > 0 && p.V > 0 && p.chunk_rows > 0,
               "linear_ce: need R >= 0, H > 0, V > 0, chunk_rows > 0, got R=" << p.R << " H=" << p.H << " V=" << p.V
                                                                              << " chunk_rows=" << p.chunk_rows);
  DFLASH_CHECK(p.V <= INT_MAX, "linear_ce: vocabulary V=" << p.V << " does not fit the int32 argmax ids");
  DFLASH_CHECK_HINT(p.H % 8 == 0,
                    "linear_ce: hidden size H=" << p.H << " must be a multiple of 8 (16-byte rows for cuBLASLt)",
                    "pad the hidden size to a multiple of 8; every Qwen3.5 / DFlash hidden size is one");
  if (p.R == 0) return;
  DFLASH_CHECK(p.hidden && p.lm_head && p.labels && p.ce && p.argmax && p.workspace && (p.weights || !p.dhidden),
               "linear_ce: null pointer (hidden=" << p.hidden << " lm_head=" << p.lm_head << " labels=" << p.labels
                                                  << " weights=" << p.weights << " ce=" << p.ce << " argmax="
                                                  << p.argmax << " workspace=" << p.workspace
                                                  << "; weights are needed only with dhidden)");
  DFLASH_CHECK(aligned16(p.hidden) && aligned16(p.lm_head) && aligned16(p.workspace) &&
                   (!p.dhidden || aligned16(p.dhidden)),
               "linear_ce: hidden, lm_head, dhidden and workspace must be 16-byte aligned, got hidden="
                   << p.hidden << " lm_head=" << p.lm_head << " dhidden=" << p.dhidden
                   << " workspace=" << p.workspace);

  DeviceContext& ctx = DeviceContext::get(device);
  DeviceGuard scope(device);
  const auto stream = static_cast<cudaStream_t>(ctx.stream());
  const int64_t Vp = padded_vocab(p.V);
  auto* logits = static_cast<float*>(p.workspace);
  auto* grad = reinterpret_cast<bf16*>(static_cast<char*>(p.workspace) + logits_bytes(p.chunk_rows, p.V));

  for (int64_t r0 = 0; r0 < p.R; r0 += p.chunk_rows) {
    const int64_t n = std::min(p.chunk_rows, p.R - r0);
    const bf16* h = static_cast<const bf16*>(p.hidden) + r0 * p.H;
    {
      // logits [n, V] (row stride Vp, fp32) = hidden [n, H] · lm_head [V, H]ᵀ
      GemmExParams g;
      g.a = h, g.lda = p.H, g.b = p.lm_head, g.ldb = p.H, g.trans_b = true;
      g.d = logits, g.ldd = Vp, g.d_f32 = true, g.M = n, g.N = p.V, g.K = p.H;
      gemm_ex(g, device);
    }
    const int V = static_cast<int>(p.V);
    if (!p.dhidden) {
      ce_rows_kernel<false><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
          logits, nullptr, p.labels, nullptr, 0.0f, p.ce, p.argmax, r0, V, Vp);
      DFLASH_CUDA_CHECK_LAST();
      continue;
    }
    ce_rows_kernel<true><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
        logits, grad, p.labels, p.weights, p.grad_scale, p.ce, p.argmax, r0, V, Vp);
    DFLASH_CUDA_CHECK_LAST();
    float* dh = p.dhidden + r0 * p.H;
    // dhidden [n, H] (fp32) = grad [n, V] (bf16, row stride Vp) · lm_head [V, H]
    GemmExParams g;
    g.a = grad, g.lda = Vp, g.b = p.lm_head, g.ldb = p.H;
    g.d = dh, g.ldd = p.H, g.d_f32 = true, g.M = n, g.N = p.H, g.K = p.V;
    gemm_ex(g, device);
  }
}

}  // namespace dflash::cuda
