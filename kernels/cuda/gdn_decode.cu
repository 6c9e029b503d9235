// GatedDeltaNet decode / verify kernels on a state pool (conv.h, gdn.h; pool conventions in launch.h): the causal
// conv update (the twin of gdn_conv.cu's prefill conv) and the gated delta rule over T = 1..16 new
// tokens per sequence from its slot's fp32 state (the twin of gdn_chunk.cu / gdn_recurrent.cu).
// They live together, apart from the prefill kernels, because both are bound by the same thing:
// reading (and writing back) the per-slot state once per call, not by the tokens.
//
// Roofline, delta rule at the Qwen3.6-27B shape (Hk 16, Hv 48, dk = dv = 128), batch B, T tokens:
//   state bytes = B·Hv·dk·dv·4 read + as many written (update_state) = B · 6.29 MB; q/k/v/out add
//   B·T·(2·Hk·dk + 2·Hv·dv)·2 = B·T·33 KB (0.5% at T = 1, 8% at T = 16). At B = 64 that is 403 MB
//   of state traffic, ~95 us at 4.25 TB/s (the copy bandwidth of an H200). FLOPs ~ 8·dk·dv per
//   value head and token (Sᵀk, Sᵀq, the decay and the rank-1 update, as FMAs): at B = 64, T = 16
//   3.2 GFLOP, ~50 us of fp32 FMA at 67 TFLOP/s, but ~4 warp instructions per state element and
//   token plus the reductions make T = 16 about as long as the memory time.
// Roofline, conv update at C = 10240, K = 4: per sequence (K-1)·C·2 state read + T·C·2 x read +
//   T·C·2 y written + (K-1)·C·2 state written: 0.16 MB per sequence at T = 1; launch-bound below
//   batch ~64.
//
// Delta rule fast kernel: a warp owns (sequence, value head, 4·CG columns of dv) and all dk rows:
// lane = row part rp (lane / CG) x column group cg (lane % CG, 4 columns), so thread (rp, cg) keeps
// S[rp·R .. rp·R + R)[4 columns] in registers (R = dk·CG / 32; CG = 4 at dk 128: 16 rows, 64
// floats), loaded once with float4 reads (a warp request covers 8 rows x 64 bytes) and stored once.
// Per token it forms the partial sums of S_oldᵀk, S_oldᵀq (4 columns each) and k·q over its rows,
// reduces the 9 values over the row parts with xor shuffles (no shared memory, no barrier), and
// uses o = exp(g)·(S_oldᵀq) + delta·(k·q) with delta = beta·(v - exp(g)·S_oldᵀk), so one reduction
// serves the step. The tokens' q/k (bf16), v slice, exp(g) and beta are staged in shared memory
// per chunk of 16 tokens (shared by the W <= 4 warps of a CTA), loaded while the state loads are in
// flight. W shrinks at small batches so the grid still gives >= 4 CTAs per SM (batch 1: 384
// one-warp CTAs).
// Measured on an H200 (kernel_bench decode, bench/results/h200-decode-*), Hk 16 / Hv 48 / d 128,
// update_state, copy bandwidth 4.26 TB/s in the same run: batch 64, T = 1: 110.5 us = 85.5% of the
// copy bandwidth (87.6% replayed from a CUDA graph); T = 2 / 4 / 8 / 16: 115 / 140 / 186 / 280 us
// (T >= 4 is bound by the ~6 instructions per state element and token, not by memory). Batch 1
// (graph): 4.5 / 5.0 / 6.3 / 8.7 / 13.8 us at T = 1 / 2 / 4 / 8 / 16. The first version (CG 2 only: 16 rows
// x 32 bytes per request, 94 registers) ran batch 64 T = 1 at 309 us (30%); CG 8 (whole 128-byte
// lines, 208 registers) ties CG 4 at T = 1 and loses up to 40% at T = 16.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "core/cuda/check.h"
#include "kernels/cuda/conv.h"
#include "kernels/cuda/conv_tile.cuh"
#include "kernels/cuda/gdn.h"
#include "kernels/cuda/ptx.cuh"
#include "core/error.h"

namespace dflash::cuda {

// Tuning knobs for benchmarks/tests only (0 = automatic): the fast delta-rule pool kernel's warps
// per CTA (1, 2 or 4) and column groups per warp (2, 4 or 8; at most 4 for dk 256).
namespace tuning {
int gdn_pool_warps = 0;
int gdn_pool_cg = 0;
}

namespace {

using bf16 = __nv_bfloat16;
using ptx::pack8;
using ptx::unpack8;

using conv::conv8_step;
using conv::silu_f;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- conv update --------------------------------------------------------------------------------
// A vec8 thread's sequence and channels: (sequence blockIdx.y, channels c0 .. c0 + 7), its tokens'
// first row and count, and its slot's state rows (K - 1 of them); false for a thread past C or a
// sequence without a valid slot (it does nothing).
struct Vec8Thread {
  int64_t c0, begin, T;
  bf16* st;
};
template <int K>
__device__ __forceinline__ bool vec8_thread(const ConvUpdateParams& p, Vec8Thread& v) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, s = blockIdx.y;
  if (g >= p.C / 8) return false;
  const int32_t slot = p.slots[s];
  if (slot < 0 || slot >= p.num_slots) return false;
  v.c0 = g * 8;
  v.begin = p.cu_seqlens[s];
  v.T = p.cu_seqlens[s + 1] - v.begin;
  v.st = static_cast<bf16*>(p.state) + static_cast<int64_t>(slot) * (K - 1) * p.C + v.c0;
  return true;
}

// Thread (sequence blockIdx.y, channels 8g .. 8g + 7).
template <int K>
__global__ void __launch_bounds__(128) conv_update_fast_kernel(const ConvUpdateParams p) {
  Vec8Thread v;
  if (!vec8_thread<K>(p, v)) return;
  const int64_t begin = v.begin, T = v.T, c0 = v.c0;
  const bf16* __restrict__ x = static_cast<const bf16*>(p.x) + begin * p.ldx + c0;
  bf16* __restrict__ y = static_cast<bf16*>(p.y) + begin * p.C + c0;
  bf16* __restrict__ st = v.st;
  const bf16* w = static_cast<const bf16*>(p.w);
  float wr[8][K];
#pragma unroll
  for (int c = 0; c < 8; ++c)
#pragma unroll
    for (int j = 0; j < K; ++j) wr[c][j] = __bfloat162float(w[(c0 + c) * K + j]);
  // win[j] = window row t + j for the next token t (j < K-1): the state rows first.
  float win[K > 1 ? K - 1 : 1][8];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) unpack8(*reinterpret_cast<const uint4*>(st + j * p.C), win[j]);
#pragma unroll 4
  for (int64_t t = 0; t < T; ++t) {
    float cur[8], out[8];
    unpack8(__ldg(reinterpret_cast<const uint4*>(x + t * p.ldx)), cur);
    conv8_step<K>(wr, win, cur, p.silu, out);
    *reinterpret_cast<uint4*>(y + t * p.C) = pack8(out);
  }
  // The window's last K-1 rows: with T < K-1 some are still old state rows, which is right.
  if (p.update_state && T > 0) {
#pragma unroll
    for (int j = 0; j < K - 1; ++j) *reinterpret_cast<uint4*>(st + j * p.C) = pack8(win[j]);
  }
}

// Thread (sequence blockIdx.y, channel c): window row i is state row i (i < K-1), else x row
// i - (K-1) of the sequence.
__global__ void conv_update_fallback_kernel(const ConvUpdateParams p) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, s = blockIdx.y;
  if (c >= p.C) return;
  const int32_t slot = p.slots[s];
  if (slot < 0 || slot >= p.num_slots) return;
  const int64_t begin = p.cu_seqlens[s], T = p.cu_seqlens[s + 1] - begin, K = p.K;
  const bf16* x = static_cast<const bf16*>(p.x) + begin * p.ldx + c;
  const bf16* w = static_cast<const bf16*>(p.w) + c * K;
  bf16* st = static_cast<bf16*>(p.state) + slot * (K - 1) * p.C + c;
  auto window = [&](int64_t i) { return __bfloat162float(i < K - 1 ? st[i * p.C] : x[(i - (K - 1)) * p.ldx]); };
  bf16* y = static_cast<bf16*>(p.y) + begin * p.C + c;
  for (int64_t t = 0; t < T; ++t) {
    float acc = 0.0f;
    for (int64_t j = 0; j < K; ++j) acc = fmaf(__bfloat162float(w[j]), window(t + j), acc);
    y[t * p.C] = __float2bfloat16_rn(p.silu ? silu_f(acc) : acc);
  }
  // In place, rows in ascending order: row r reads window row T + r >= r + 1, not yet rewritten.
  if (p.update_state && T > 0)
    for (int64_t r = 0; r < K - 1; ++r) st[r * p.C] = __float2bfloat16_rn(window(T + r));
}

// causal_conv1d_update_runs' second launch: thread (sequence blockIdx.y, channels 8g .. 8g + 7) sets
// its slot's state to the window's last K-1 rows (window row i: state row i < K-1, else x row
// i - (K-1) of the sequence), all read before any is written; the bf16 bits as the vec8 kernel's.
template <int K>
__global__ void __launch_bounds__(128) conv_state_write_kernel(const ConvUpdateParams p) {
  Vec8Thread v;
  if (!vec8_thread<K>(p, v) || v.T <= 0) return;
  const int64_t T = v.T;
  bf16* st = v.st;
  const bf16* x = static_cast<const bf16*>(p.x) + v.begin * p.ldx + v.c0;
  uint4 rows[K - 1];
#pragma unroll
  for (int r = 0; r < K - 1; ++r) {
    const int64_t i = T + r;
    rows[r] = i < K - 1 ? *reinterpret_cast<const uint4*>(st + i * p.C)
                        : __ldg(reinterpret_cast<const uint4*>(x + (i - (K - 1)) * p.ldx));
  }
#pragma unroll
  for (int r = 0; r < K - 1; ++r) *reinterpret_cast<uint4*>(st + r * p.C) = rows[r];
}

void check_conv_update(const ConvUpdateParams& p, const char* op) {
  DFLASH_CHECK(p.N >= 0 && p.C >= 1 && p.K >= 1 && p.num_seqs >= 0 && p.num_slots >= 1,
               op << ": needs N >= 0, C >= 1, K >= 1, num_seqs >= 0, num_slots >= 1, got N " << p.N << ", C " << p.C
                  << ", K " << p.K << ", num_seqs " << p.num_seqs << ", num_slots " << p.num_slots);
  DFLASH_CHECK(p.ldx >= p.C, op << ": row stride ldx " << p.ldx << " is smaller than C " << p.C);
  DFLASH_CHECK(p.num_seqs < 65536, op << ": " << p.num_seqs << " sequences exceed the grid limit 65535");
  DFLASH_CHECK(p.N == 0 || p.num_seqs >= 1, op << ": " << p.N << " tokens but no sequence");
  DFLASH_CHECK(p.num_seqs == 0 || (p.x && p.w && p.y && p.slots && p.cu_seqlens && (p.K == 1 || p.state)),
               op << ": null pointer among x, w, y, state, slots, cu_seqlens");
}

}  // namespace

// The vec8 kernel of the prefill conv takes the same shapes.
bool causal_conv1d_update_fast_supported(int64_t C, int64_t K) { return causal_conv1d_fast_supported(C, K); }

const char* causal_conv1d_update_kernel_name(int64_t C, int64_t K) {
  return causal_conv1d_update_fast_supported(C, K) ? "vec8" : "fallback";
}

void causal_conv1d_update_fast(const ConvUpdateParams& p, Stream s) {
  const char* op = "causal_conv1d_update_fast";
  check_conv_update(p, op);
  detail::check_conv_vec8_shape(op, p.C, p.K, p.ldx, "causal_conv1d_update_fallback");
  if (p.num_seqs == 0) return;
  DFLASH_CHECK(aligned16(p.x) && aligned16(p.y) && aligned16(p.state),
               op << ": x, y and state must be 16-byte aligned (use causal_conv1d_update_fallback)");
  const dim3 grid(static_cast<unsigned>((p.C / 8 + 127) / 128), static_cast<unsigned>(p.num_seqs));
  auto stream = static_cast<cudaStream_t>(s);
  switch (p.K) {
    case 1: conv_update_fast_kernel<1><<<grid, 128, 0, stream>>>(p); break;
    case 2: conv_update_fast_kernel<2><<<grid, 128, 0, stream>>>(p); break;
    case 3: conv_update_fast_kernel<3><<<grid, 128, 0, stream>>>(p); break;
    default: conv_update_fast_kernel<4><<<grid, 128, 0, stream>>>(p); break;
  }
  DFLASH_CUDA_CHECK_LAST();
}

void causal_conv1d_update_runs(const ConvUpdateParams& p, Stream s) {
  const char* op = "causal_conv1d_update_runs";
  check_conv_update(p, op);
  detail::check_conv_vec8_shape(op, p.C, p.K, p.ldx, "causal_conv1d_update_fallback");
  if (p.num_seqs == 0 || p.N == 0) return;
  DFLASH_CHECK(aligned16(p.x) && aligned16(p.y) && (p.K == 1 || aligned16(p.state)),
               op << ": x, y and state must be 16-byte aligned (use causal_conv1d_update_fallback)");
  ConvParams cp;
  cp.x = p.x;
  cp.ldx = p.ldx;
  cp.w = p.w;
  cp.y = p.y;
  cp.cu_seqlens = p.cu_seqlens;
  cp.num_seqs = p.num_seqs;
  cp.N = p.N;
  cp.C = p.C;
  cp.K = p.K;
  cp.silu = p.silu;
  // K = 1 keeps no state: the plain conv (a null state reads zeros, and there are no rows to read).
  detail::causal_conv1d_runs_with_states(cp, p.K > 1 ? p.state : nullptr, p.slots, p.num_slots, s);
  if (!p.update_state || p.K == 1) return;
  const dim3 grid(static_cast<unsigned>((p.C / 8 + 127) / 128), static_cast<unsigned>(p.num_seqs));
  auto stream = static_cast<cudaStream_t>(s);
  switch (p.K) {
    case 2: conv_state_write_kernel<2><<<grid, 128, 0, stream>>>(p); break;
    case 3: conv_state_write_kernel<3><<<grid, 128, 0, stream>>>(p); break;
    default: conv_state_write_kernel<4><<<grid, 128, 0, stream>>>(p); break;
  }
  DFLASH_CUDA_CHECK_LAST();
}

void causal_conv1d_update_fallback(const ConvUpdateParams& p, Stream s) {
  check_conv_update(p, "causal_conv1d_update_fallback");
  if (p.num_seqs == 0) return;
  DFLASH_CHECK((p.C + 255) / 256 < (1ll << 31), "causal_conv1d_update_fallback: C " << p.C << " too large");
  const dim3 grid(static_cast<unsigned>((p.C + 255) / 256), static_cast<unsigned>(p.num_seqs));
  conv_update_fallback_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(s)>>>(p);
  DFLASH_CUDA_CHECK_LAST();
}

// ---- gated delta rule on a state pool -------------------------------------------------------------
namespace {

constexpr int kPoolChunk = 16;  // tokens staged in shared memory at a time

// Loads R consecutive bf16 of shared memory (R = 4, 8, 16; 8-byte aligned) as floats.
template <int R>
__device__ __forceinline__ void load_row_part(const bf16* src, float (&f)[R]) {
  if constexpr (R == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(src);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
  } else {
#pragma unroll
    for (int i = 0; i < R / 8; ++i) unpack8(reinterpret_cast<const uint4*>(src)[i], f + 8 * i);
  }
}

// Thread layout: lane = row part rp (lane / CG) x column group cg (lane % CG, 4 columns each), so
// a warp owns 4·CG columns and all DK rows, R = DK·CG / 32 rows per thread; warp w of the CTA the
// next 4·CG columns. CG = 8: each state load / store instruction of a warp covers 4 rows x 128
// bytes (whole lines), 128 floats per thread; CG = 2: 16 rows x 32 bytes, 32 floats per thread
// (for small batches: 4x the warps). Grid (dv / (W·4·CG), Hv, num_seqs), W = blockDim / 32 <= 4.
template <int DK, int CG>
__global__ void __launch_bounds__(128) gdr_pool_fast_kernel(const DeltaRulePoolParams p) {
  constexpr int RPW = 32 / CG, R = DK / RPW, RC = R < 8 ? R : 8, MAXC = 16 * CG;
  static_assert(R >= 4 && R % RC == 0, "rows per thread must be a multiple of 4 (8 above 8)");
  __shared__ __align__(16) bf16 k_s[kPoolChunk][DK];
  __shared__ __align__(16) bf16 q_s[kPoolChunk][DK];
  __shared__ float v_s[kPoolChunk][MAXC];
  __shared__ float decay_s[kPoolChunk], beta_s[kPoolChunk];

  const int nthreads = blockDim.x, cols_cta = (nthreads / 32) * 4 * CG;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rp = lane / CG, cg = lane % CG;
  const int64_t h = blockIdx.y, seq = blockIdx.z, Hv = p.Hv, dv = p.dv;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * cols_cta;
  const int cc = warp * 4 * CG + cg * 4;  // first of this thread's 4 columns, within the CTA's
  const int64_t col = c0 + cc;
  const bool active = col < dv;  // dv % 4 == 0: a thread's 4 columns are all in or all out
  const int32_t slot = p.slots[seq];
  if (slot < 0 || slot >= p.num_slots) return;  // (uniform over the CTA)
  const int64_t begin = p.cu_seqlens[seq], end = p.cu_seqlens[seq + 1];
  if (end <= begin) return;  // no token: the state stays as it is
  const int64_t kh = h / (Hv / p.Hk);

  float* state = p.state + ((static_cast<int64_t>(slot) * Hv + h) * DK + rp * R) * dv + col;
  float S[R][4];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float4 u = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (active) u = *reinterpret_cast<const float4*>(state + r * dv);
    S[r][0] = u.x, S[r][1] = u.y, S[r][2] = u.z, S[r][3] = u.w;
  }
  const bf16* Q = static_cast<const bf16*>(p.q);
  const bf16* Kp = static_cast<const bf16*>(p.k);
  const bf16* V = static_cast<const bf16*>(p.v);
  bf16* O = static_cast<bf16*>(p.out);

  for (int64_t t0 = begin; t0 < end; t0 += kPoolChunk) {
    const int L = static_cast<int>(min(static_cast<int64_t>(kPoolChunk), end - t0));
    if (t0 > begin) __syncthreads();  // every thread is done with the previous chunk
    // Stage q / k rows (16-byte chunks), the v slice, exp(g) and beta of the chunk.
    constexpr int kChunksPerRow = DK / 8;
    for (int i = tid; i < 2 * L * kChunksPerRow; i += nthreads) {
      const int which = i / (L * kChunksPerRow), rem = i - which * L * kChunksPerRow;
      const int tok = rem / kChunksPerRow, ch = rem - tok * kChunksPerRow;
      const bf16* src = (which ? Q : Kp) + ((t0 + tok) * p.Hk + kh) * DK + ch * 8;
      *reinterpret_cast<uint4*>(&(which ? q_s : k_s)[tok][ch * 8]) = __ldg(reinterpret_cast<const uint4*>(src));
    }
    for (int i = tid; i < L * cols_cta; i += nthreads) {
      const int tok = i / cols_cta, c = i - tok * cols_cta;
      v_s[tok][c] = c0 + c < dv ? __bfloat162float(V[(t0 + tok) * p.ldv + h * dv + c0 + c]) : 0.0f;
    }
    if (tid < L) {
      decay_s[tid] = expf(p.g[(t0 + tid) * Hv + h]);
      beta_s[tid] = p.beta[(t0 + tid) * Hv + h];
    }
    __syncthreads();
    for (int i = 0; i < L; ++i) {
      // red[0..3] = (S_oldᵀk)[c], red[4..7] = (S_oldᵀq)[c], red[8] = k·q, over this thread's rows.
      float red[9];
#pragma unroll
      for (int j = 0; j < 9; ++j) red[j] = 0.0f;
#pragma unroll
      for (int r0 = 0; r0 < R; r0 += RC) {
        float kf[RC], qf[RC];
        load_row_part<RC>(&k_s[i][rp * R + r0], kf);
        load_row_part<RC>(&q_s[i][rp * R + r0], qf);
#pragma unroll
        for (int r = 0; r < RC; ++r) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            red[c] = fmaf(S[r0 + r][c], kf[r], red[c]);
            red[4 + c] = fmaf(S[r0 + r][c], qf[r], red[4 + c]);
          }
          red[8] = fmaf(kf[r], qf[r], red[8]);
        }
      }
      // Sum over the row parts (lane bits above the column group's).
#pragma unroll
      for (int off = CG; off < 32; off <<= 1)
#pragma unroll
        for (int j = 0; j < 9; ++j) red[j] += __shfl_xor_sync(0xffffffffu, red[j], off);
      const float decay = decay_s[i], beta = beta_s[i];
      float delta[4], o[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        delta[c] = (v_s[i][cc + c] - decay * red[c]) * beta;
        o[c] = fmaf(delta[c], red[8], decay * red[4 + c]);
      }
#pragma unroll
      for (int r0 = 0; r0 < R; r0 += RC) {
        float kf[RC];
        load_row_part<RC>(&k_s[i][rp * R + r0], kf);
#pragma unroll
        for (int r = 0; r < RC; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c) S[r0 + r][c] = fmaf(kf[r], delta[c], S[r0 + r][c] * decay);
      }
      if (O != nullptr && rp == 0 && active) {
        uint2 u;
        u.x = ptx::pack_bf16(o[0], o[1]);
        u.y = ptx::pack_bf16(o[2], o[3]);
        *reinterpret_cast<uint2*>(O + ((t0 + i) * Hv + h) * dv + col) = u;
      }
    }
  }
  if (p.update_state && active) {
#pragma unroll
    for (int r = 0; r < R; ++r) *reinterpret_cast<float4*>(state + r * dv) = make_float4(S[r][0], S[r][1], S[r][2], S[r][3]);
  }
}

// Fallback: CTA (column tile of CT columns, value head, sequence), the state tile [dk, CT] in
// shared memory, each token's steps as the formula reads, with a barrier between them.
constexpr int kFbThreads = 256;

__global__ void gdr_pool_fallback_kernel(const DeltaRulePoolParams p, int CT) {
  extern __shared__ float fb[];
  const int64_t dk = p.dk, dv = p.dv, Hv = p.Hv;
  float* S = fb;                // [dk][CT]
  float* kf = S + dk * CT;      // [dk]
  float* qf = kf + dk;          // [dk]
  float* vd = qf + dk;          // [CT]: v, then delta
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * CT, h = blockIdx.y, seq = blockIdx.z;
  const int ncols = static_cast<int>(min(static_cast<int64_t>(CT), dv - c0));
  const int32_t slot = p.slots[seq];
  if (slot < 0 || slot >= p.num_slots) return;
  const int64_t begin = p.cu_seqlens[seq], end = p.cu_seqlens[seq + 1];
  if (end <= begin) return;
  const int64_t kh = h / (Hv / p.Hk);
  float* pool = p.state + (static_cast<int64_t>(slot) * Hv + h) * dk * dv + c0;
  for (int64_t i = tid; i < dk * ncols; i += kFbThreads) S[(i / ncols) * CT + i % ncols] = pool[(i / ncols) * dv + i % ncols];
  const bf16* Q = static_cast<const bf16*>(p.q);
  const bf16* Kp = static_cast<const bf16*>(p.k);
  const bf16* V = static_cast<const bf16*>(p.v);
  // out[c] = Σ_a S[a][c] w[a] for the tile's columns, one warp per column.
  auto column_dot = [&](const float* w, int c) {
    float acc = 0.0f;
    for (int64_t a = lane; a < dk; a += 32) acc = fmaf(S[a * CT + c], w[a], acc);
    for (int off = 16; off >= 1; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    return acc;
  };
  for (int64_t t = begin; t < end; ++t) {
    for (int64_t a = tid; a < dk; a += kFbThreads) {
      kf[a] = __bfloat162float(Kp[(t * p.Hk + kh) * dk + a]);
      qf[a] = __bfloat162float(Q[(t * p.Hk + kh) * dk + a]);
    }
    for (int c = tid; c < ncols; c += kFbThreads) vd[c] = __bfloat162float(V[t * p.ldv + h * dv + c0 + c]);
    const float decay = expf(p.g[t * Hv + h]), beta = p.beta[t * Hv + h];
    for (int64_t i = tid; i < dk * ncols; i += kFbThreads) S[(i / ncols) * CT + i % ncols] *= decay;  // S = exp(g) S
    __syncthreads();
    for (int c = warp; c < ncols; c += kFbThreads / 32) {  // delta = beta (v - Sᵀk)
      const float kv = column_dot(kf, c);
      if (lane == 0) vd[c] = beta * (vd[c] - kv);
    }
    __syncthreads();
    for (int64_t i = tid; i < dk * ncols; i += kFbThreads) {  // S += k deltaᵀ
      const int64_t a = i / ncols;
      const int c = static_cast<int>(i % ncols);
      S[a * CT + c] = fmaf(kf[a], vd[c], S[a * CT + c]);
    }
    __syncthreads();
    if (p.out != nullptr)
      for (int c = warp; c < ncols; c += kFbThreads / 32) {  // o = Sᵀq
        const float o = column_dot(qf, c);
        if (lane == 0) static_cast<bf16*>(p.out)[(t * Hv + h) * dv + c0 + c] = __float2bfloat16_rn(o);
      }
    __syncthreads();  // k / q / v of the next token overwrite what this one read
  }
  if (p.update_state)
    for (int64_t i = tid; i < dk * ncols; i += kFbThreads) pool[(i / ncols) * dv + i % ncols] = S[(i / ncols) * CT + i % ncols];
}

void check_pool(const DeltaRulePoolParams& p, const char* op) {
  DFLASH_CHECK(p.N >= 0 && p.num_seqs >= 0 && p.Hk >= 1 && p.Hv >= 1 && p.dk >= 1 && p.dv >= 1 && p.num_slots >= 1,
               op << ": needs N, num_seqs >= 0 and Hk, Hv, dk, dv, num_slots >= 1, got N " << p.N << ", num_seqs "
                  << p.num_seqs << ", Hk " << p.Hk << ", Hv " << p.Hv << ", dk " << p.dk << ", dv " << p.dv
                  << ", num_slots " << p.num_slots);
  DFLASH_CHECK(p.Hv % p.Hk == 0, op << ": " << p.Hv << " value heads are not a multiple of " << p.Hk << " key heads");
  DFLASH_CHECK(p.ldv >= p.Hv * p.dv, op << ": v row stride " << p.ldv << " is smaller than Hv*dv = " << p.Hv * p.dv);
  DFLASH_CHECK(p.num_seqs < 65536 && p.Hv < 65536,
               op << ": needs num_seqs < 65536 and Hv < 65536, got num_seqs " << p.num_seqs << ", Hv " << p.Hv);
  DFLASH_CHECK(p.N == 0 || p.num_seqs >= 1, op << ": " << p.N << " tokens but no sequence");
  DFLASH_CHECK(p.num_seqs == 0 || (p.state && p.slots && p.cu_seqlens), op << ": null state, slots or cu_seqlens");
  DFLASH_CHECK(p.N == 0 || (p.q && p.k && p.v && p.g && p.beta), op << ": null pointer among q, k, v, g, beta");
}

}  // namespace

bool gated_delta_rule_pool_fast_supported(int64_t dk, int64_t dv, int sm_major) {
  return (dk == 64 || dk == 128 || dk == 256) && dv >= 8 && dv % 8 == 0 && sm_major >= 8;
}

const char* gated_delta_rule_pool_kernel_name(int64_t dk, int64_t dv, int sm_major) {
  return gated_delta_rule_pool_fast_supported(dk, dv, sm_major) ? "register-resident" : "fallback";
}

void gated_delta_rule_pool_fast(const DeltaRulePoolParams& p, Stream s) {
  const char* op = "gated_delta_rule_pool_fast";
  check_pool(p, op);
  DFLASH_CHECK((p.dk == 64 || p.dk == 128 || p.dk == 256) && p.dv % 8 == 0,
               op << ": needs dk in {64, 128, 256} and dv % 8 == 0, got dk " << p.dk << ", dv " << p.dv
                  << " (use gated_delta_rule_pool_fallback)");
  if (p.num_seqs == 0) return;
  DFLASH_CHECK(aligned16(p.q) && aligned16(p.k) && aligned16(p.state),
               op << ": q, k and state must be 16-byte aligned (use gated_delta_rule_pool_fallback)");
  DFLASH_CHECK(p.out == nullptr || (reinterpret_cast<uintptr_t>(p.out) & 7u) == 0,
               op << ": out must be 8-byte aligned");
  // Column groups per warp (CG: 4·CG columns) and warps per CTA (W). CG 4 (8 rows x 64 bytes per
  // warp access, 64 floats per thread) was the fastest or within 2% of it at every batch (1..64) and
  // T (1..16) on an H200 (bench/results/h200-decode-*): CG 8 (whole lines, 208 registers) ties at
  // T = 1 and loses up to 40% at T = 16 (12% occupancy), CG 2 loses up to 15% (more shuffles per
  // element). W: the most (sharing the staged q / k) that still leaves >= 4 CTAs per SM.
  int dev = 0, sms = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  auto units = [&](int64_t cols) { return p.num_seqs * p.Hv * ((p.dv + cols - 1) / cols); };
  int CG = tuning::gdn_pool_cg;
  if (CG != 2 && CG != 4 && CG != 8) CG = 4;
  CG = std::min(CG, p.dk == 256 ? 4 : 8);  // dk 256 at CG 8 would need 256 state floats per thread
  int W = tuning::gdn_pool_warps;
  if (W != 1 && W != 2 && W != 4) {
    W = 4;
    while (W > 1 && units(W * 4 * CG) < 4 * sms) W /= 2;
  }
  const int64_t cols_cta = W * 4 * CG;
  const dim3 grid(static_cast<unsigned>((p.dv + cols_cta - 1) / cols_cta), static_cast<unsigned>(p.Hv),
                  static_cast<unsigned>(p.num_seqs));
  auto stream = static_cast<cudaStream_t>(s);
  auto launch = [&](auto dk_tag) {
    constexpr int DK = decltype(dk_tag)::value;
    switch (CG) {
      case 2: gdr_pool_fast_kernel<DK, 2><<<grid, 32 * W, 0, stream>>>(p); break;
      case 4: gdr_pool_fast_kernel<DK, 4><<<grid, 32 * W, 0, stream>>>(p); break;
      default:
        if constexpr (DK <= 128) gdr_pool_fast_kernel<DK, 8><<<grid, 32 * W, 0, stream>>>(p);
        break;
    }
  };
  switch (p.dk) {
    case 64: launch(std::integral_constant<int, 64>{}); break;
    case 128: launch(std::integral_constant<int, 128>{}); break;
    default: launch(std::integral_constant<int, 256>{}); break;
  }
  DFLASH_CUDA_CHECK_LAST();
}

void gated_delta_rule_pool_fallback(const DeltaRulePoolParams& p, Stream s) {
  const char* op = "gated_delta_rule_pool_fallback";
  check_pool(p, op);
  DFLASH_CHECK(p.dk <= 1024, op << ": dk " << p.dk << " is above the supported 1024");
  if (p.num_seqs == 0) return;
  const int CT = static_cast<int>(std::clamp<int64_t>(4096 / p.dk, 1, std::min<int64_t>(32, p.dv)));
  const size_t smem = (static_cast<size_t>(p.dk) * CT + 2 * p.dk + CT) * sizeof(float);  // <= 24 KB
  const dim3 grid(static_cast<unsigned>((p.dv + CT - 1) / CT), static_cast<unsigned>(p.Hv),
                  static_cast<unsigned>(p.num_seqs));
  gdr_pool_fallback_kernel<<<grid, kFbThreads, smem, static_cast<cudaStream_t>(s)>>>(p, CT);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda
