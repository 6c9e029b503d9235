// The GatedDeltaNet decode chain as one kernel per layer, and commit as one kernel for every layer
// (gdn.h, issue 30). Twins: causal_conv1d_update_fast + gdn_prep + gated_delta_rule_pool_fast +
// gated_rms_norm (the decode step), causal_conv1d_update_fast + gated_delta_rule_pool_fast per layer
// (commit). Each stage below repeats its twin's device arithmetic expression for expression (the
// conv through conv_tile.cuh's conv8_step, the l2norm's fmaf chain and 16-lane xor tree, the gates,
// the delta rule's per-token step with the same lane layout and shuffle order, the gated norm's
// sum and tree), so the fused kernels give the unfused kernels' values bit for bit; the tests
// compare them so (tests/test_cuda_decode.cpp).
//
// Why: at batch 1 a decode step ran 4 kernels per GatedDeltaNet layer (48 layers) for ~50 KB of
// activations and a 3.1 MB state each; each kernel costs its launch and a few dependent DRAM round
// trips (~4-8 us, h200-graphs-b7c45b1), where the state's bytes alone take ~1.5 us. Fused: one
// launch per layer whose state load is issued before the wait on the in-projection (PDL), with the
// conv, gates and l2norm computed while it is in flight. Commit re-ran 96 kernels of ~8 us; fused
// it is one kernel over all layers, bound by the states' bytes (48 x 6.3 MB read + written ~ 70 us
// at the copy bandwidth).
//
// Decode kernel layout: one block of 8 warps per (value head h, sequence); a cluster of the
// ratio = Hv / Hk blocks that share key head h / ratio (cluster rank = h % ratio). Thread (warp w,
// lane = rp·4 + cg) keeps state rows rp·16 .. rp·16 + 15 of columns 16w + 4cg .. + 3 in registers
// (the pool kernel's CG = 4 layout with 8 warps covering dv = 128). Stages:
//   1. state rows -> registers (before the PDL wait: nothing in the step writes them before this kernel);
//   2. conv: items (8-channel unit u, token t) over the block's 48 units (q and k of the key head,
//      v of the value head), each from its K window rows (old conv state or the in-projection);
//   3. l2norm of the q / k rows (16 lanes per row), the gates of (t, h);
//   4. the delta rule per token (o rounded to bf16 into shared memory);
//   5. the gated RMSNorm of each token's o with z; 6. the states written back (decode only): the
//      recurrent state by each block, the conv state of the v channels by each block and of the q / k
//      channels by the cluster's first block after a cluster barrier (every block has read them).
//
// Measured on an H200 (bench/results/h200-decode4-a84d6d9, kernel_bench --only fused, Qwen3.6-27B
// heads, one sequence, CUDA-graph replays): the chain at T = 1 5.2 us against 11.0 us for the four
// unfused kernels, a verify (T = 16) 21.7 against 27.2 us; commit over 48 layers 136 us at n = 1 and
// 151 us at n = 16 against 410 us / 1.57 ms for the 96 unfused launches (2.2 / 2.0 TB/s of state
// traffic: the commit grid's 5,000 short blocks, not the bytes, set its time); one GatedDeltaNet
// layer of the decode step (in_proj, chain, out_proj, norms, MLP on cuBLASLt) 218.3 us fused
// against 226.8 unfused.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>

#include "core/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/conv_tile.cuh"
#include "kernels/cuda/fp8_act.cuh"
#include "kernels/cuda/gdn.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/vec.cuh"

namespace dflash::cuda {

namespace {

namespace cg = cooperative_groups;
using bf16 = __nv_bfloat16;
using ptx::pack8;
using ptx::unpack8;

constexpr int kDK = 128, kDV = 128;
constexpr int kCG = 4;                      // column groups per warp (4 columns each): the pool kernel's CG
constexpr int kRPW = 32 / kCG;              // row parts per warp
constexpr int kR = kDK / kRPW;              // state rows per thread (16)
constexpr int kRC = kR < 8 ? kR : 8;        // rows per staged load
constexpr int kMaxT = 16;                   // tokens per sequence
constexpr int kThreads = 256;               // 8 warps x 16 columns = dv
constexpr int kUnits = 2 * kDK / 8 + kDV / 8;  // 8-channel conv units of a block: q 16, k 16, v 16

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// gdn_prep's gate (gdn_conv.cu gdn_gate): g = -exp(A_log) · softplus(a + dt_bias), beta = sigmoid(b).
__device__ __forceinline__ void gate_of(float a, float b, float A_log, float dt_bias, float& g, float& beta) {
  const float xs = a + dt_bias;
  const float softplus = xs > 20.0f ? xs : log1pf(expf(xs));  // torch softplus, threshold 20
  g = -expf(A_log) * softplus;
  beta = 1.0f / (1.0f + expf(-b));
}

// One token of the pool kernel's delta rule (gdn_decode.cu gdr_pool_fast_kernel, DK 128, CG 4) for
// this thread's rows and 4 columns: red over its rows, the xor tree over the row parts, delta, o,
// and the state update. kq: also o (q given).
template <bool kO>
__device__ __forceinline__ void delta_token(float (&S)[kR][4], const bf16* k_row, const bf16* q_row, const float* v4,
                                            float decay, float beta, float (&o)[4]) {
  float red[9];
#pragma unroll
  for (int j = 0; j < 9; ++j) red[j] = 0.0f;
#pragma unroll
  for (int r0 = 0; r0 < kR; r0 += kRC) {
    float kf[kRC], qf[kRC];
    unpack8(*reinterpret_cast<const uint4*>(k_row + r0), kf);
    if constexpr (kO) unpack8(*reinterpret_cast<const uint4*>(q_row + r0), qf);
#pragma unroll
    for (int r = 0; r < kRC; ++r) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        red[c] = fmaf(S[r0 + r][c], kf[r], red[c]);
        if constexpr (kO) red[4 + c] = fmaf(S[r0 + r][c], qf[r], red[4 + c]);
      }
      if constexpr (kO) red[8] = fmaf(kf[r], qf[r], red[8]);
    }
  }
#pragma unroll
  for (int off = kCG; off < 32; off <<= 1)
#pragma unroll
    for (int j = 0; j < 9; ++j)
      if (kO || j < 4) red[j] += __shfl_xor_sync(0xffffffffu, red[j], off);
  float delta[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    delta[c] = (v4[c] - decay * red[c]) * beta;
    if constexpr (kO) o[c] = fmaf(delta[c], red[8], decay * red[4 + c]);
  }
#pragma unroll
  for (int r0 = 0; r0 < kR; r0 += kRC) {
    float kf[kRC];
    unpack8(*reinterpret_cast<const uint4*>(k_row + r0), kf);
#pragma unroll
    for (int r = 0; r < kRC; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) S[r0 + r][c] = fmaf(kf[r], delta[c], S[r0 + r][c] * decay);
  }
}

// ---- decode / verify chain -------------------------------------------------------------------------

template <int KC>
__global__ void __launch_bounds__(kThreads, 1) gdn_decode_fused_kernel(const GdnDecodeFusedParams p) {
  __shared__ __align__(16) bf16 qk_raw[kMaxT][2 * kDK];  // conv outputs of q | k
  __shared__ __align__(16) bf16 q_s[kMaxT][kDK], k_s[kMaxT][kDK];
  __shared__ __align__(16) float v_s[kMaxT][kDV];
  __shared__ __align__(16) float o_s[kMaxT][kDV];
  __shared__ float decay_s[kMaxT], beta_s[kMaxT];

  pdl_launch_dependents();
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int rp = lane / kCG, cg_ = lane % kCG;
  const int h = static_cast<int>(blockIdx.x), seq = static_cast<int>(blockIdx.y);
  const int Hk = static_cast<int>(p.Hk), Hv = static_cast<int>(p.Hv), ratio = Hv / Hk, kh = h / ratio;
  const bool leader = h % ratio == 0;  // the cluster's first block (clusters of `ratio` along x)
  const int64_t C = 2 * p.Hk * kDK + p.Hv * kDV, V = p.Hv * kDV;
  const int32_t slot = p.slots[seq];
  const int64_t begin = p.cu_seqlens[seq];
  const int T = static_cast<int>(p.cu_seqlens[seq + 1] - begin);
  if (p.out_q && seq == static_cast<int>(p.num_seqs) - 1) {
    // FP8 out: the pad rows of this head's group (zero codes) and the scales of rows [N, lds) (1), after
    // the wait (the buffers may be the previous kernel's, recycled).
    pdl_wait();
    for (int64_t m = p.N + tid / 8; m < p.rows; m += kThreads / 8)
      *reinterpret_cast<uint4*>(p.out_q + m * p.ldq + h * kDV + (tid % 8) * 16) = make_uint4(0, 0, 0, 0);
    for (int64_t m = p.N + tid; m < p.lds; m += kThreads) p.out_scale[h * p.lds + m] = 1.0f;
  }
  // Uniform over the cluster (one sequence): a skipped sequence skips every barrier.
  if (slot < 0 || slot >= p.num_slots || T <= 0 || T > kMaxT) return;
  const int cc = warp * 4 * kCG + cg_ * 4;  // this thread's first column

  // 1. The recurrent state (before the wait: written only by this layer's own kernels, which all
  // completed before this step's first kernel).
  float* state = p.state + ((static_cast<int64_t>(slot) * Hv + h) * kDK + rp * kR) * kDV + cc;
  float S[kR][4];
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    const float4 u = *reinterpret_cast<const float4*>(state + r * kDV);
    S[r][0] = u.x, S[r][1] = u.y, S[r][2] = u.z, S[r][3] = u.w;
  }
  pdl_wait();

  const bf16* proj = static_cast<const bf16*>(p.proj);
  const bf16* conv_w = static_cast<const bf16*>(p.conv_w);
  bf16* cstate = static_cast<bf16*>(p.conv_state) + static_cast<int64_t>(slot) * (KC - 1) * C;
  auto unit_channel = [&](int u) -> int64_t {  // first channel of conv unit u
    return u < 16 ? kh * kDK + 8 * u : u < 32 ? p.Hk * kDK + kh * kDK + 8 * (u - 16) : 2 * p.Hk * kDK + h * kDV + 8 * (u - 32);
  };
  // 2. Conv: item (u, t): window rows t .. t + K-1 of [old state rows; the sequence's x rows].
  for (int it = tid; it < kUnits * T; it += kThreads) {
    const int u = it % kUnits, t = it / kUnits;
    const int64_t c0 = unit_channel(u);
    float wr[8][KC];
#pragma unroll
    for (int c = 0; c < 8; ++c)
#pragma unroll
      for (int j = 0; j < KC; ++j) wr[c][j] = __bfloat162float(conv_w[(c0 + c) * KC + j]);
    auto row = [&](int i) -> const bf16* {  // window row i of this channel unit
      return i < KC - 1 ? cstate + static_cast<int64_t>(i) * C + c0 : proj + (begin + i - (KC - 1)) * p.ldp + c0;
    };
    float win[KC > 1 ? KC - 1 : 1][8], cur[8], out[8];
#pragma unroll
    for (int j = 0; j < KC - 1; ++j) unpack8(*reinterpret_cast<const uint4*>(row(t + j)), win[j]);
    unpack8(*reinterpret_cast<const uint4*>(row(t + KC - 1)), cur);
    conv::conv8_step<KC>(wr, win, cur, true, out);
    const uint4 packed = pack8(out);  // the conv output as causal_conv1d_update stores it
    if (u < 32) {
      *reinterpret_cast<uint4*>(&qk_raw[t][8 * u]) = packed;
    } else {
      float back[8];
      unpack8(packed, back);
#pragma unroll
      for (int e = 0; e < 8; ++e) v_s[t][8 * (u - 32) + e] = back[e];
    }
    if (p.conv_out && (u >= 32 || leader))
      *reinterpret_cast<uint4*>(static_cast<bf16*>(p.conv_out) + (begin + t) * C + c0) = packed;
  }
  // The conv state's new rows, read now (before the cluster's blocks may overwrite the q / k
  // channels' rows): window rows T .. T + K-2, by the owner of each unit.
  uint4 new_rows[KC > 1 ? KC - 1 : 1];
  const bool writes_state = p.update_state && tid < kUnits && (tid >= 32 || leader);
  if (writes_state) {
    const int64_t c0 = unit_channel(tid);
#pragma unroll
    for (int r = 0; r < KC - 1; ++r) {
      const int i = T + r;
      new_rows[r] = *reinterpret_cast<const uint4*>(i < KC - 1 ? cstate + static_cast<int64_t>(i) * C + c0
                                                               : proj + (begin + i - (KC - 1)) * p.ldp + c0);
    }
  }
  if (p.update_state && ratio > 1) cg::this_cluster().sync();  // every block has read the old conv state
  else __syncthreads();

  // 3. l2norm of the q / k rows (gdn_prep_rows_kernel, G = 16: row r = 2t + which, lane j holds
  // elements 8j .. 8j + 7) and the gates.
  for (int base = 0; base < 2 * T * 16; base += kThreads) {  // uniform trip count: every lane joins the shuffles
    const int item = base + tid, r = item / 16, j = item % 16, t = r / 2, which = r % 2;
    const bool on = r < 2 * T;
    float f[8];
    if (on) unpack8(*reinterpret_cast<const uint4*>(&qk_raw[t][which * kDK + 8 * j]), f);
    else
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = 0.0f;
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) ss = fmaf(f[e], f[e], ss);
#pragma unroll
    for (int off = 8; off >= 1; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (on) {
      const float inv = rsqrtf(ss + 1e-6f);
      const float mul = which == 0 ? p.scale : 1.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = (f[e] * inv) * mul;  // l2norm, then `q * scale` as transformers
      const uint4 packed = pack8(f);
      *reinterpret_cast<uint4*>(which == 0 ? &q_s[t][8 * j] : &k_s[t][8 * j]) = packed;
      if (p.q && leader)
        *reinterpret_cast<uint4*>(static_cast<bf16*>(which == 0 ? p.q : p.k) + ((begin + t) * p.Hk + kh) * kDK + 8 * j) =
            packed;
    }
  }
  if (tid < T) {
    const int64_t n = begin + tid;
    const float a = __bfloat162float(proj[n * p.ldp + C + V + Hv + h]);
    const float b = __bfloat162float(proj[n * p.ldp + C + V + h]);
    float g, beta;
    gate_of(a, b, __bfloat162float(static_cast<const bf16*>(p.A_log)[h]),
            __bfloat162float(static_cast<const bf16*>(p.dt_bias)[h]), g, beta);
    decay_s[tid] = expf(g);  // as the pool kernel stages exp(g)
    beta_s[tid] = beta;
    if (p.g) {
      p.g[n * Hv + h] = g;
      p.beta[n * Hv + h] = beta;
    }
  }
  __syncthreads();

  // 4. The delta rule, token by token; o (bf16-rounded, as the pool kernel stores it) to shared memory.
  for (int i = 0; i < T; ++i) {
    float o[4];
    delta_token<true>(S, &k_s[i][rp * kR], &q_s[i][rp * kR], &v_s[i][cc], decay_s[i], beta_s[i], o);
    if (rp == 0) {
#pragma unroll
      for (int c = 0; c < 4; ++c) o_s[i][cc + c] = vec::round_bf16(o[c]);
    }
  }
  __syncthreads();

  // 5. The gated RMSNorm (norm.cu gated_rms_norm_kernel, G = 16): token t = tid / 16, lane j.
  {
    const int t = tid / 16, j = tid % 16;
    const bool on = t < T;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = on ? o_s[t][8 * j + e] : 0.0f;
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += v[e] * v[e];
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (on) {
      float wv[8], zv[8];
      unpack8(*reinterpret_cast<const uint4*>(static_cast<const bf16*>(p.norm_w) + 8 * j), wv);
      unpack8(*reinterpret_cast<const uint4*>(proj + (begin + t) * p.ldp + C + h * kDV + 8 * j), zv);
      const float inv = rsqrtf(ss / static_cast<float>(kDV) + p.eps);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        v[e] *= inv;
        v[e] *= wv[e] * vec::silu(zv[e]);
      }
      if (p.out_q) {  // fp8.cu gated_rms_norm_quant_kernel: the bf16-rounded values, one group per head
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = vec::round_bf16(v[e]);
        // (M = INT_MAX: the scale padding is the pad writer's above)
        fp8_act::quantize_group(v, true, 0xFFFFu << (16 * (t % 2)), j, static_cast<int>(begin + t), INT_MAX, h,
                                p.out_q + (begin + t) * p.ldq + h * kDV + 8 * j, p.out_scale, p.lds);
      } else {
        vec::store8(static_cast<bf16*>(p.out) + (begin + t) * p.ldo + h * kDV + 8 * j, v);
      }
    }
  }

  // 6. The states (decode).
  if (p.update_state) {
#pragma unroll
    for (int r = 0; r < kR; ++r)
      *reinterpret_cast<float4*>(state + r * kDV) = make_float4(S[r][0], S[r][1], S[r][2], S[r][3]);
    if (writes_state) {
      const int64_t c0 = unit_channel(tid);
#pragma unroll
      for (int r = 0; r < KC - 1; ++r) *reinterpret_cast<uint4*>(cstate + static_cast<int64_t>(r) * C + c0) = new_rows[r];
    }
  }
}

// ---- commit: every layer in one grid ---------------------------------------------------------------
// Grid (delta blocks + conv blocks, layers). Delta block b < Hv·2: value head b / 2, columns
// 64 (b % 2) .. + 63 (4 warps x 16 columns, the pool kernel's layout); conv block: 128 threads x
// 8 channels.
constexpr int kCommitThreads = 128;
constexpr int kCommitCols = (kCommitThreads / 32) * 4 * kCG;  // 64

__global__ void __launch_bounds__(kCommitThreads) gdn_commit_fused_kernel(const __grid_constant__ GdnCommitParams p) {
  __shared__ __align__(16) bf16 k_s[kMaxT][kDK];
  __shared__ float v_s[kMaxT][kCommitCols];
  __shared__ float decay_s[kMaxT], beta_s[kMaxT];
  const GdnCommitLayer& L = p.layers[blockIdx.y];
  const int tid = static_cast<int>(threadIdx.x);
  const int32_t slot = *p.slot;
  if (slot < 0 || slot >= p.num_slots || p.n <= 0) return;
  const int n = p.n;
  const int Hv = static_cast<int>(p.Hv), col_blocks = static_cast<int>(p.dv / kCommitCols);
  const int delta_blocks = Hv * col_blocks;
  const int b = static_cast<int>(blockIdx.x);
  if (b >= delta_blocks) {
    // The conv state: the last K-1 rows of [state; x] (causal_conv1d_update_fast's state update).
    const int64_t c0 = (static_cast<int64_t>(b - delta_blocks) * kCommitThreads + tid) * 8;
    if (c0 >= p.C) return;
    const int K1 = static_cast<int>(p.K) - 1;
    bf16* st = static_cast<bf16*>(L.conv_state) + static_cast<int64_t>(slot) * K1 * p.C + c0;
    const bf16* x = static_cast<const bf16*>(L.x) + c0;
    uint4 rows[3];
#pragma unroll
    for (int r = 0; r < 3; ++r) {
      const int i = n + r;  // window row
      if (r < K1)
        rows[r] = *reinterpret_cast<const uint4*>(i < K1 ? st + static_cast<int64_t>(i) * p.C : x + (i - K1) * p.ldx);
    }
#pragma unroll
    for (int r = 0; r < 3; ++r)
      if (r < K1) *reinterpret_cast<uint4*>(st + static_cast<int64_t>(r) * p.C) = rows[r];
    return;
  }
  const int h = b / col_blocks, c0 = (b % col_blocks) * kCommitCols;
  const int lane = tid & 31, warp = tid >> 5, rp = lane / kCG, cg_ = lane % kCG;
  const int cc = warp * 4 * kCG + cg_ * 4;
  const int kh = h / (Hv / static_cast<int>(p.Hk));
  float* state = L.state + ((static_cast<int64_t>(slot) * Hv + h) * kDK + rp * kR) * p.dv + c0 + cc;
  float S[kR][4];
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    const float4 u = *reinterpret_cast<const float4*>(state + r * p.dv);
    S[r][0] = u.x, S[r][1] = u.y, S[r][2] = u.z, S[r][3] = u.w;
  }
  const bf16* Kp = static_cast<const bf16*>(L.k);
  const bf16* V = static_cast<const bf16*>(L.v);
  for (int i = tid; i < n * (kDK / 8); i += kCommitThreads) {
    const int tok = i / (kDK / 8), ch = i % (kDK / 8);
    *reinterpret_cast<uint4*>(&k_s[tok][ch * 8]) =
        *reinterpret_cast<const uint4*>(Kp + (static_cast<int64_t>(tok) * p.Hk + kh) * kDK + ch * 8);
  }
  for (int i = tid; i < n * kCommitCols; i += kCommitThreads) {
    const int tok = i / kCommitCols, c = i % kCommitCols;
    v_s[tok][c] = __bfloat162float(V[tok * p.ldv + h * p.dv + c0 + c]);
  }
  if (tid < n) {
    decay_s[tid] = expf(L.g[tid * p.Hv + h]);
    beta_s[tid] = L.beta[tid * p.Hv + h];
  }
  __syncthreads();
  for (int i = 0; i < n; ++i) {
    float o[4];
    delta_token<false>(S, &k_s[i][rp * kR], nullptr, &v_s[i][cc], decay_s[i], beta_s[i], o);
  }
#pragma unroll
  for (int r = 0; r < kR; ++r) *reinterpret_cast<float4*>(state + r * p.dv) = make_float4(S[r][0], S[r][1], S[r][2], S[r][3]);
}

}  // namespace

bool gdn_decode_fused_supported(int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t K) {
  return dk == kDK && dv == kDV && K >= 1 && K <= 4 && Hk >= 1 && Hv % Hk == 0 && Hv / Hk <= 8 && Hv < 65536;
}

void gdn_decode_fused(const GdnDecodeFusedParams& p, Stream s) {
  const char* op = "gdn_decode_fused";
  DFLASH_CHECK(gdn_decode_fused_supported(p.Hk, p.Hv, p.dk, p.dv, p.K),
               op << ": serves dk = dv = 128, K in 1..4, Hv a multiple of Hk with Hv / Hk <= 8; got Hk " << p.Hk
                  << ", Hv " << p.Hv << ", dk " << p.dk << ", dv " << p.dv << ", K " << p.K
                  << " (use the unfused decode kernels)");
  DFLASH_CHECK(p.num_seqs >= 0 && p.num_seqs < 65536 && p.N >= 0 && p.num_slots >= 1,
               op << ": needs 0 <= num_seqs < 65536, N >= 0, num_slots >= 1, got num_seqs " << p.num_seqs << ", N "
                  << p.N << ", num_slots " << p.num_slots);
  DFLASH_CHECK(p.max_new >= 0 && p.max_new <= kMaxT,
               op << ": at most " << kMaxT << " tokens per sequence, got max_new " << p.max_new);
  const int64_t C = 2 * p.Hk * p.dk + p.Hv * p.dv, V = p.Hv * p.dv;
  DFLASH_CHECK(p.ldp >= C + V + 2 * p.Hv && p.ldp % 8 == 0,
               op << ": the in-projection's row stride " << p.ldp << " must be a multiple of 8 and >= " << C + V + 2 * p.Hv);
  DFLASH_CHECK((p.out != nullptr) != (p.out_q != nullptr), op << ": exactly one of out (bf16) and out_q (fp8) is written");
  if (p.out_q) {
    DFLASH_CHECK(p.rows >= p.N && p.lds == fp8_act_scale_ld(p.rows),
                 op << ": fp8 out needs rows >= N and lds = fp8_act_scale_ld(rows), got rows " << p.rows << ", N " << p.N
                    << ", lds " << p.lds);
    fp8_act::check_quant_output(op, p.out_q, p.ldq, p.out_scale, p.rows, V);
  } else {
    DFLASH_CHECK(p.ldo >= V && p.ldo % 8 == 0, op << ": out row stride " << p.ldo << " must be a multiple of 8 and >= " << V);
  }
  DFLASH_CHECK((p.conv_out && p.q && p.k && p.g && p.beta) || (!p.conv_out && !p.q && !p.k && !p.g && !p.beta),
               op << ": the saved inputs (conv_out, q, k, g, beta) are written all or none");
  if (p.num_seqs == 0 || p.N == 0) return;
  DFLASH_CHECK(p.proj && p.conv_w && p.A_log && p.dt_bias && p.norm_w && p.state && p.slots && p.cu_seqlens &&
                   (p.K == 1 || p.conv_state),
               op << ": null pointer among the inputs / outputs");
  DFLASH_CHECK(aligned16(p.proj) && aligned16(p.conv_w) && aligned16(p.norm_w) && aligned16(p.state) &&
                   (!p.out || aligned16(p.out)) && (p.K == 1 || aligned16(p.conv_state)) &&
                   (!p.conv_out || (aligned16(p.conv_out) && aligned16(p.q) && aligned16(p.k))),
               op << ": proj, conv_w, norm_w, state, conv_state, out and the saved q / k / conv must be 16-byte aligned");
  const int ratio = static_cast<int>(p.Hv / p.Hk);
  const dim3 grid(static_cast<unsigned>(p.Hv), static_cast<unsigned>(p.num_seqs));
  const auto st = static_cast<cudaStream_t>(s);
  const unsigned cluster = static_cast<unsigned>(ratio);
  switch (p.K) {
    case 1: launch_pdl_cluster(gdn_decode_fused_kernel<1>, grid, dim3(kThreads), 0, st, cluster, p); break;
    case 2: launch_pdl_cluster(gdn_decode_fused_kernel<2>, grid, dim3(kThreads), 0, st, cluster, p); break;
    case 3: launch_pdl_cluster(gdn_decode_fused_kernel<3>, grid, dim3(kThreads), 0, st, cluster, p); break;
    default: launch_pdl_cluster(gdn_decode_fused_kernel<4>, grid, dim3(kThreads), 0, st, cluster, p); break;
  }
}

void gdn_commit_fused(const GdnCommitParams& p, Stream s) {
  const char* op = "gdn_commit_fused";
  DFLASH_CHECK(p.dk == kDK && p.dv == kDV && p.K >= 1 && p.K <= 4 && p.Hk >= 1 && p.Hv % p.Hk == 0,
               op << ": serves dk = dv = 128, K in 1..4, Hv a multiple of Hk; got dk " << p.dk << ", dv " << p.dv
                  << ", K " << p.K << ", Hk " << p.Hk << ", Hv " << p.Hv);
  DFLASH_CHECK(p.num_layers >= 0 && p.num_layers <= kCommitMaxLayers,
               op << ": " << p.num_layers << " layers, at most " << kCommitMaxLayers);
  DFLASH_CHECK(p.n >= 0 && p.n <= kMaxT, op << ": " << p.n << " accepted tokens, at most " << kMaxT);
  if (p.num_layers == 0 || p.n == 0) return;
  DFLASH_CHECK(p.C == 2 * p.Hk * p.dk + p.Hv * p.dv && p.ldx >= p.C && p.ldx % 8 == 0 && p.ldv >= p.Hv * p.dv,
               op << ": C " << p.C << ", ldx " << p.ldx << ", ldv " << p.ldv << " do not fit the heads");
  DFLASH_CHECK(p.slot, op << ": null slot");
  for (int i = 0; i < p.num_layers; ++i) {
    const GdnCommitLayer& L = p.layers[i];
    DFLASH_CHECK(L.state && L.x && L.k && L.v && L.g && L.beta && (p.K == 1 || L.conv_state),
                 op << ": layer " << i << " has a null pointer");
    DFLASH_CHECK(aligned16(L.state) && aligned16(L.x) && aligned16(L.k) && (p.K == 1 || aligned16(L.conv_state)),
                 op << ": layer " << i << ": state, x, k and conv_state must be 16-byte aligned");
  }
  const int64_t delta_blocks = p.Hv * (p.dv / kCommitCols);
  const int64_t conv_blocks = p.K > 1 ? (p.C / 8 + kCommitThreads - 1) / kCommitThreads : 0;
  const dim3 grid(static_cast<unsigned>(delta_blocks + conv_blocks), static_cast<unsigned>(p.num_layers));
  gdn_commit_fused_kernel<<<grid, kCommitThreads, 0, static_cast<cudaStream_t>(s)>>>(p);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda
