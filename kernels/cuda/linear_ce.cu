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
//
// The FP8 form (loss.h's FP8 fields, issue 31): the same steps with both GEMMs on gemm_fp8 (cuBLASLt's
// block-scaled e4m3 kernels, fp32 output): the chunk's hidden rows quantized 1 x 128 first, the head's
// codes made once by the caller (linear_ce_quantize_head), and step 2 writing the logits' gradient as
// 1 x 128 e4m3 codes and scales from the fp32 values (grad_row_fp8: quantize_fp8_act's arithmetic, a
// half warp per 128-column group) instead of bf16. Rows and vocabulary are padded to the GEMMs' needs:
// the chunk's rows to 4 (the row kernel codes the padding rows 0, scales 1; dhidden of a chunk of
// other row counts goes through a staging buffer), V to 16 (the head's padding rows and columns 0).
// Measured (H200, R 8192, H 5120, V 248320): 43.1 ms against the bf16 form's 66.7 (967 TFLOP/s;
// bench/results/h200-fp8head-5d8af27).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "core/cuda/check.h"
#include "core/device.h"
#include "core/error.h"
#include "kernels/cuda/emulatable.cuh"
#include "kernels/cuda/fp8_act.cuh"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/loss.h"

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
  r.idx = a.m > b.m ? a.idx : (b.m > a.m ? b.idx : (a.idx < b.idx ? a.idx : b.idx));
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

// What the row kernel writes besides ce / argmax: nothing (no dhidden), the bf16 gradient of the
// logits, or its FP8 codes (1 x 128 along V, quantize_fp8_act's arithmetic on the fp32 values).
enum class GradOut { None, Bf16, Fp8 };

// The gradient's destination: bf16 [rows, ld] (Bf16), or e4m3 codes [rows, ld] with their scales at
// scale[g * lds + row] (Fp8: gemm_fp8's activation layout).
struct GradDst {
  void* g = nullptr;
  int64_t ld = 0;
  float* scale = nullptr;
  int64_t lds = 0;
};

// The FP8 gradient of one row (block i of the chunk): a half warp per 128-column group, 8 values a
// lane (scale * (softmax - onehot), or exact zeros when scale == 0), the group's codes and scale as
// quantize_fp8_act writes them; columns [V, ld) get codes 0. Every thread runs the same number of
// iterations (the shuffles are full-warp); groups past the row's last only compute zeros.
__device__ __forceinline__ void grad_row_fp8(const float* __restrict__ z, int V, float lse, int label, float scale,
                                             const GradDst& d, int64_t i) {
  const int G = (V + 127) / 128;
  const int lane16 = threadIdx.x % fp8_act::kGroupLanes, half = threadIdx.x / fp8_act::kGroupLanes;
  constexpr int kHalves = kThreads / fp8_act::kGroupLanes;
  auto* q = static_cast<uint8_t*>(d.g) + i * d.ld;
  for (int g0 = 0; g0 < G; g0 += kHalves) {
    const int g = g0 + half;
    const int v = g * 128 + lane16 * fp8_act::kUnit;
    float x[fp8_act::kUnit];
    if (g < G && v + fp8_act::kUnit <= V) {  // 32-byte aligned: v % 8 == 0 and the row stride % 8 == 0
      const float4 a = *reinterpret_cast<const float4*>(z + v), b = *reinterpret_cast<const float4*>(z + v + 4);
      x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
    } else {
#pragma unroll
      for (int j = 0; j < fp8_act::kUnit; ++j) x[j] = g < G && v + j < V ? z[v + j] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < fp8_act::kUnit; ++j)
      x[j] = g < G && v + j < V && scale != 0.0f ? scale * (expf(x[j] - lse) - (v + j == label ? 1.0f : 0.0f)) : 0.0f;
    float amax = fp8_act::unit_amax(x);
#pragma unroll
    for (int o = fp8_act::kGroupLanes / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = fp8_act::scale_of(amax);
    if (g < G && v < d.ld) *reinterpret_cast<uint2*>(q + v) = fp8_act::encode_act(x, s);
    if (g < G && lane16 == 0) d.scale[g * d.lds + i] = s;
  }
}

// One block per row of the chunk. logits: [n, Vp] fp32. Rows r0 + blockIdx.x of labels / weights /
// ce / argmax; with the FP8 gradient, blocks [n, gridDim.x) are the GEMM's padding rows: codes 0,
// scales 1.
template <GradOut kOut>
__global__ void __launch_bounds__(kThreads) ce_rows_kernel(const float* __restrict__ logits, GradDst grad,
                                                           const int32_t* __restrict__ labels,
                                                           const float* __restrict__ weights, float grad_scale,
                                                           float* __restrict__ ce, int32_t* __restrict__ argmax,
                                                           int64_t r0, int64_t n, int V, int64_t Vp) {
  const int64_t i = blockIdx.x;
  const int64_t r = r0 + i;
  if constexpr (kOut == GradOut::Fp8) {
    if (i >= n) {
      auto* q = static_cast<uint8_t*>(grad.g) + i * grad.ld;
      for (int64_t v = threadIdx.x * 16; v < grad.ld; v += kThreads * 16) *reinterpret_cast<uint4*>(q + v) = make_uint4(0, 0, 0, 0);
      for (int g = threadIdx.x; g < (V + 127) / 128; g += kThreads) grad.scale[g * grad.lds + i] = 1.0f;
      return;
    }
  }
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
  if constexpr (kOut == GradOut::Fp8) {
    __syncthreads();
    grad_row_fp8(z, V, s_lse, labels[r], grad_scale * weights[r], grad, i);
  }
  if constexpr (kOut == GradOut::Bf16) {
    __syncthreads();
    const float lse = s_lse;
    const int label = labels[r];
    const float scale = grad_scale * weights[r];
    bf16* g = static_cast<bf16*>(grad.g) + i * grad.ld;
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

int64_t linear_ce_fp8_vocab_ld(int64_t V) { return align_up(V, 16); }

void linear_ce_quantize_head(const void* lm_head, int64_t V, int64_t H, const LinearCeFp8Head& out, Stream s) {
  DFLASH_CHECK_HINT(V > 0 && H > 0 && H % 16 == 0,
                    "linear_ce: the FP8 LM head needs V > 0 and a hidden size H that is a multiple of 16, got V="
                        << V << " H=" << H,
                    "run the LM head in bf16 (model.drafter.lm_head_precision: bf16)");
  const int64_t Vq = linear_ce_fp8_vocab_ld(V);
  if (Vq > V)  // q's padding rows (codes 0: logits 0); quantize_fp8_tiles writes qt's padding columns as 0
    DFLASH_CUDA_CHECK(cudaMemsetAsync(out.q + V * H, 0, static_cast<size_t>((Vq - V) * H), static_cast<cudaStream_t>(s)));
  Fp8TileQuantParams p;
  p.x = lm_head, p.ldx = H, p.rows = V, p.cols = H, p.block = true;
  p.q = out.q, p.ldq = H, p.scale = out.scale, p.lds = fp8_weight_scale_ld(H);
  p.qt = out.qt, p.ldqt = Vq, p.scale_t = out.scale_t, p.ldst = fp8_weight_scale_ld(V);
  quantize_fp8_tiles(p, s);
}

void linear_ce_use_fp8_head(LinearCeParams& p, const LinearCeFp8Head& head) {
  p.lm_head_q = head.q, p.lm_head_scale = head.scale, p.lm_head_qt = head.qt, p.lm_head_scale_t = head.scale_t;
}

namespace {

// The FP8 form's workspace, for chunks of up to chunk_rows rows (the GEMMs run them rounded up to 4).
struct Fp8Ws {
  float* logits;    // [np, Vq] fp32 (the logits GEMM's N is Vq: lm_head_q's padding rows give 0)
  uint8_t* hq;      // [np, H]
  float* hs;        // fp8_act_scale_elems(np, H)
  uint8_t* gq;      // [np, Vq]
  float* gs;        // fp8_act_scale_elems(np, Vq)
  float* dh;        // [np, H]: the last chunk's dhidden when its rows are not a multiple of 4
  int64_t bytes;
};
Fp8Ws fp8_ws(void* base, int64_t chunk_rows, int64_t V, int64_t H) {
  const int64_t np = align_up(chunk_rows, 4), Vq = linear_ce_fp8_vocab_ld(V);
  auto* b = static_cast<char*>(base);
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    char* p = b ? b + off : nullptr;
    off += align_up(bytes, kWsAlign);
    return p;
  };
  Fp8Ws w;
  w.logits = reinterpret_cast<float*>(take(np * Vq * 4));
  w.hq = reinterpret_cast<uint8_t*>(take(np * H));
  w.hs = reinterpret_cast<float*>(take(static_cast<int64_t>(fp8_act_scale_elems(np, H)) * 4));
  w.gq = reinterpret_cast<uint8_t*>(take(np * Vq));
  w.gs = reinterpret_cast<float*>(take(static_cast<int64_t>(fp8_act_scale_elems(np, Vq)) * 4));
  w.dh = reinterpret_cast<float*>(take(np * H * 4));
  w.bytes = off;
  return w;
}

// The FP8 form (LinearCeParams' FP8 fields), chunk by chunk on the device's stream.
void linear_ce_fp8(const LinearCeParams& p, int device, cudaStream_t stream) {
  const int64_t Vq = linear_ce_fp8_vocab_ld(p.V);
  const Fp8Ws w = fp8_ws(p.workspace, p.chunk_rows, p.V, p.H);
  const int V = static_cast<int>(p.V);
  for (int64_t r0 = 0; r0 < p.R; r0 += p.chunk_rows) {
    const int64_t n = std::min(p.chunk_rows, p.R - r0), np = align_up(n, 4);
    // The hidden rows, 1 x 128 along H (the padding rows' stale codes only make logits rows nobody reads).
    Fp8ActQuantParams qa;
    qa.x = static_cast<const bf16*>(p.hidden) + r0 * p.H, qa.ldx = p.H;
    qa.q = w.hq, qa.ldq = p.H, qa.scale = w.hs, qa.M = n, qa.K = p.H;
    quantize_fp8_act(qa, stream);
    GemmFp8Params g;  // logits [np, Vq] (fp32) = hidden codes [np, H] · lm_head_q [Vq, H]ᵀ
    g.x = w.hq, g.ldx = p.H, g.x_scale = w.hs, g.w = p.lm_head_q, g.w_scale = p.lm_head_scale;
    g.y = w.logits, g.ldy = Vq, g.y_f32 = true, g.M = np, g.N = Vq, g.K = p.H;
    gemm_fp8(g, device);
    if (!p.dhidden) {
      launch_kernel(ce_rows_kernel<GradOut::None>, dim3(static_cast<unsigned>(n)), dim3(kThreads), 0, stream,
                    static_cast<const float*>(w.logits), GradDst{}, p.labels, static_cast<const float*>(nullptr),
                    0.0f, p.ce, p.argmax, r0, n, V, Vq);
      continue;
    }
    const GradDst gd{w.gq, Vq, w.gs, fp8_act_scale_ld(np)};
    launch_kernel(ce_rows_kernel<GradOut::Fp8>, dim3(static_cast<unsigned>(np)), dim3(kThreads), 0, stream,
                  static_cast<const float*>(w.logits), gd, p.labels, p.weights, p.grad_scale, p.ce, p.argmax, r0, n,
                  V, Vq);
    // dhidden [np, H] (fp32) = grad codes [np, Vq] · lm_head_qt [H, Vq]ᵀ, through the staging buffer
    // when the chunk's rows are not a multiple of 4 (dhidden has only n rows here)
    float* dh = p.dhidden + r0 * p.H;
    GemmFp8Params d;
    d.x = w.gq, d.ldx = Vq, d.x_scale = w.gs, d.w = p.lm_head_qt, d.w_scale = p.lm_head_scale_t;
    d.y = np == n ? dh : w.dh, d.ldy = p.H, d.y_f32 = true, d.M = np, d.N = p.H, d.K = Vq;
    gemm_fp8(d, device);
    if (np != n) DFLASH_CUDA_CHECK(cudaMemcpyAsync(dh, w.dh, static_cast<size_t>(n * p.H) * 4, cudaMemcpyDeviceToDevice, stream));
  }
}

}  // namespace

int64_t linear_ce_workspace(const LinearCeParams& p) {
  if (!p.fp8()) return linear_ce_workspace(p.chunk_rows, p.V);
  DFLASH_CHECK(p.chunk_rows > 0 && p.V > 0 && p.H > 0, "linear_ce_workspace: need chunk_rows, V and H > 0, got chunk_rows="
                                                           << p.chunk_rows << " V=" << p.V << " H=" << p.H);
  return fp8_ws(nullptr, p.chunk_rows, p.V, p.H).bytes;
}

void linear_ce(const LinearCeParams& p, int device) {
  DFLASH_CHECK(p.R >= 0 && p.H > 0 && p.V > 0 && p.chunk_rows > 0,
               "linear_ce: need R >= 0, H > 0, V > 0, chunk_rows > 0, got R=" << p.R << " H=" << p.H << " V=" << p.V
                                                                              << " chunk_rows=" << p.chunk_rows);
  DFLASH_CHECK(p.V <= INT_MAX, "linear_ce: vocabulary V=" << p.V << " does not fit the int32 argmax ids");
  DFLASH_CHECK_HINT(p.H % 8 == 0,
                    "linear_ce: hidden size H=" << p.H << " must be a multiple of 8 (16-byte rows for cuBLASLt)",
                    "pad the hidden size to a multiple of 8; every Qwen3.5 / DFlash hidden size is one");
  DFLASH_CHECK_HINT(!p.fp8() || p.H % 16 == 0,
                    "linear_ce: the FP8 LM head needs the hidden size H a multiple of 16, got H=" << p.H,
                    "run the LM head in bf16 (model.drafter.lm_head_precision: bf16)");
  if (p.R == 0) return;
  DFLASH_CHECK(p.hidden && (p.lm_head || p.fp8()) && p.labels && p.ce && p.argmax && p.workspace &&
                   (p.weights || !p.dhidden),
               "linear_ce: null pointer (hidden=" << p.hidden << " lm_head=" << p.lm_head << " labels=" << p.labels
                                                  << " weights=" << p.weights << " ce=" << p.ce << " argmax="
                                                  << p.argmax << " workspace=" << p.workspace
                                                  << "; weights are needed only with dhidden)");
  DFLASH_CHECK(!p.fp8() || (p.lm_head_scale && (!p.dhidden || (p.lm_head_qt && p.lm_head_scale_t))),
               "linear_ce: the FP8 LM head needs lm_head_scale, and with dhidden lm_head_qt and lm_head_scale_t (got "
                   << p.lm_head_scale << ", " << static_cast<const void*>(p.lm_head_qt) << ", " << p.lm_head_scale_t << ")");
  DFLASH_CHECK(aligned16(p.hidden) && (p.fp8() || aligned16(p.lm_head)) && aligned16(p.workspace) &&
                   (!p.dhidden || aligned16(p.dhidden)),
               "linear_ce: hidden, lm_head, dhidden and workspace must be 16-byte aligned, got hidden="
                   << p.hidden << " lm_head=" << p.lm_head << " dhidden=" << p.dhidden
                   << " workspace=" << p.workspace);

  DeviceContext& ctx = DeviceContext::get(device);
  DeviceGuard scope(device);
  const auto stream = static_cast<cudaStream_t>(ctx.stream());
  if (p.fp8()) {
    linear_ce_fp8(p, device, stream);
    return;
  }
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
      launch_kernel(ce_rows_kernel<GradOut::None>, dim3(static_cast<unsigned>(n)), dim3(kThreads), 0, stream,
                    static_cast<const float*>(logits), GradDst{}, p.labels, static_cast<const float*>(nullptr), 0.0f,
                    p.ce, p.argmax, r0, n, V, Vp);
      continue;
    }
    launch_kernel(ce_rows_kernel<GradOut::Bf16>, dim3(static_cast<unsigned>(n)), dim3(kThreads), 0, stream,
                  static_cast<const float*>(logits), GradDst{grad, Vp, nullptr, 0}, p.labels, p.weights, p.grad_scale,
                  p.ce, p.argmax, r0, n, V, Vp);
    float* dh = p.dhidden + r0 * p.H;
    // dhidden [n, H] (fp32) = grad [n, V] (bf16, row stride Vp) · lm_head [V, H]
    GemmExParams g;
    g.a = grad, g.lda = Vp, g.b = p.lm_head, g.ldb = p.H;
    g.d = dh, g.ldd = p.H, g.d_f32 = true, g.M = n, g.N = p.H, g.K = p.V;
    gemm_ex(g, device);
  }
}

}  // namespace dflash::cuda
