// Token-recurrent gated delta rule: the simple, explicit fallback of the GatedDeltaNet core (the
// chunked tensor-core kernel in gdn_chunk.cu is the fast path).
//
// Per sequence and value head h (key head h / (Hv / Hk)), state S fp32 [dk, dv], per token t:
//   S = exp(g_t) S;  kv = Sᵀ k_t;  delta = beta_t (v_t - kv);  S += k_t deltaᵀ;  o_t = Sᵀ q_t.
// Columns of S are independent (k, q, g, beta are shared by all columns), so a block owns one
// (sequence, value head, slice of DV_T columns) and needs no other block.
//
// Cost at T = 8192, Hv = 48, dk = dv = 128: ~5 FLOPs per state element per token = 4 GFLOP, and
// ~60 MB of q/k/v/out traffic (q/k are re-read by each of the dv/DV_T slices of each of the Hv/Hk
// value heads sharing a key head, from L2). Neither bounds it: the recurrence is a chain of T
// dependent steps per block, each a short dot product + a reduction across RP lanes, so the time is
// T · (per-step latency) / (overlap from other blocks on the same SM), and with enough blocks by
// the instruction rate (~9 instructions per state element and token: bf16 unpacking of k and q,
// two dot-product FMAs, the decayed update).
// Measured on an H200 at T = 8192 (one sequence), Hk = 16, Hv = 48, dk = dv = 128: 4.6 ms with
// 16 rows per thread (the automatic choice for dk <= 128), 5.1 ms with 32, 6.2 ms with 8;
// 8 sequences of 1024 tokens: 3.8 ms. This is the explicit slow path; gdn_chunk.cu is the fast one.
//
// Design: 128 threads; thread (col = tid / RP, part p = tid % RP) keeps rows [p·NR, p·NR + NR) of
// column c0 + col of S in registers (NR = 8/16/32 rows, RP = power of two with RP·NR >= dk, so
// DV_T = 128 / RP columns per block). Per step it forms the partial sums of S_oldᵀ k and S_oldᵀ q
// over its rows, reduces both over its RP lanes with xor shuffles, and uses
//   o = exp(g) (S_oldᵀ q) + delta (k · q)
// (k · q precomputed once per token and shared by all columns) so one reduction round serves the
// step. Tokens are staged in chunks of TC (<= 64) into shared memory: q/k as bf16 with each
// thread's 8-row groups interleaved across parts (conflict-free 16-byte reads), v / exp(g) / beta /
// k·q as fp32; outputs are staged and written per chunk as contiguous bf16 rows of the slice.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda/check.h"
#include "kernels/cuda/gdn.h"
#include "kernels/cuda/ptx.cuh"
#include "core/error.h"

namespace dflash::cuda {

// Tuning knob for benchmarks/tests only: state rows per thread, 8, 16 or 32 (0 = automatic).
namespace tuning {
int recurrent_rows_per_thread = 0;
}

namespace {

using ptx::unpack8;

constexpr int kThreads = 128;
constexpr int kMaxChunk = 64;
constexpr size_t kSmemBudget = 48 * 1024;

struct RecurrentGeom {
  int RP, DV_T, dk_pad, TC;
};

// Shared-memory slot of element a of a q/k row: thread part p reads its g-th 8-row group at
// slot group g·RP + p, so the RP parts read consecutive 16-byte words.
template <int NR>
__device__ __forceinline__ int qk_slot(int a, int RP) {
  const int p = a / NR, r = a - p * NR;
  return ((r / 8) * RP + p) * 8 + (r % 8);
}

template <int NR>
__global__ void __launch_bounds__(kThreads) recurrent_gdr_kernel(DeltaRuleParams prm, RecurrentGeom geo, bool vec) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int RP = geo.RP, DV_T = geo.DV_T, dk_pad = geo.dk_pad, TC = geo.TC;
  __nv_bfloat16* k_s = reinterpret_cast<__nv_bfloat16*>(smem);           // [TC, dk_pad] permuted
  __nv_bfloat16* q_s = k_s + static_cast<size_t>(TC) * dk_pad;           // [TC, dk_pad] permuted
  float* v_s = reinterpret_cast<float*>(q_s + static_cast<size_t>(TC) * dk_pad);  // [TC, DV_T]
  float* o_s = v_s + TC * DV_T;                                          // [TC, DV_T]
  float* decay_s = o_s + TC * DV_T;                                      // [TC]
  float* beta_s = decay_s + TC;                                          // [TC]
  float* kq_s = beta_s + TC;                                             // [TC]

  const int tid = threadIdx.x, p = tid % RP, col = tid / RP;
  const int64_t dk = prm.dk, dv = prm.dv, Hk = prm.Hk, Hv = prm.Hv;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * DV_T, h = blockIdx.y, seq = blockIdx.z;
  const int64_t kh = h / (Hv / Hk);
  const int64_t c = c0 + col;
  const bool col_ok = c < dv;
  const int64_t begin = prm.cu_seqlens[seq], end = prm.cu_seqlens[seq + 1];
  const __nv_bfloat16* Q = static_cast<const __nv_bfloat16*>(prm.q);
  const __nv_bfloat16* K = static_cast<const __nv_bfloat16*>(prm.k);
  const __nv_bfloat16* V = static_cast<const __nv_bfloat16*>(prm.v);
  __nv_bfloat16* O = static_cast<__nv_bfloat16*>(prm.out);
  const int64_t state_off = (seq * Hv + h) * dk * dv;

  float S[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const int64_t a = static_cast<int64_t>(p) * NR + r;
    S[r] = (prm.initial_state != nullptr && col_ok && a < dk) ? prm.initial_state[state_off + a * dv + c] : 0.0f;
  }

  for (int64_t t0 = begin; t0 < end; t0 += TC) {
    const int L = static_cast<int>(end - t0 < TC ? end - t0 : static_cast<int64_t>(TC));
    // ---- stage the chunk
    if (vec) {
      const int gpr = dk_pad / 8;  // 8-element groups per row
      for (int idx = tid; idx < L * 2 * gpr; idx += kThreads) {
        const int i = idx / (2 * gpr), rem = idx - i * 2 * gpr, which = rem / gpr, ga = rem - which * gpr;
        uint4 u = make_uint4(0, 0, 0, 0);
        if (ga * 8 < dk) {
          const __nv_bfloat16* src = (which ? Q : K) + ((t0 + i) * Hk + kh) * dk + ga * 8;
          u = __ldg(reinterpret_cast<const uint4*>(src));
        }
        __nv_bfloat16* dst = (which ? q_s : k_s) + static_cast<size_t>(i) * dk_pad + qk_slot<NR>(ga * 8, RP);
        *reinterpret_cast<uint4*>(dst) = u;
      }
    } else {
      for (int idx = tid; idx < L * 2 * dk_pad; idx += kThreads) {
        const int i = idx / (2 * dk_pad), rem = idx - i * 2 * dk_pad, which = rem / dk_pad, a = rem - which * dk_pad;
        __nv_bfloat16 val = __float2bfloat16_rn(0.0f);
        if (a < dk) val = (which ? Q : K)[((t0 + i) * Hk + kh) * dk + a];
        (which ? q_s : k_s)[static_cast<size_t>(i) * dk_pad + qk_slot<NR>(a, RP)] = val;
      }
    }
    for (int idx = tid; idx < L * DV_T; idx += kThreads) {
      const int i = idx / DV_T, cc = idx - i * DV_T;
      v_s[idx] = (c0 + cc < dv) ? __bfloat162float(V[(t0 + i) * prm.ldv + h * dv + c0 + cc]) : 0.0f;
    }
    for (int i = tid; i < L; i += kThreads) {
      decay_s[i] = expf(prm.g[(t0 + i) * Hv + h]);
      beta_s[i] = prm.beta[(t0 + i) * Hv + h];
    }
    __syncthreads();
    // k · q per token (same permutation for both rows, pads are zero).
    {
      const int warp = tid / 32, lane = tid % 32;
      for (int i = warp; i < L; i += kThreads / 32) {
        float acc = 0.0f;
        for (int a = lane; a < dk_pad; a += 32)
          acc = fmaf(__bfloat162float(k_s[static_cast<size_t>(i) * dk_pad + a]),
                     __bfloat162float(q_s[static_cast<size_t>(i) * dk_pad + a]), acc);
#pragma unroll
        for (int off = 16; off >= 1; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) kq_s[i] = acc;
      }
    }
    __syncthreads();
    // ---- the recurrence over the chunk
    for (int i = 0; i < L; ++i) {
      const uint4* kr = reinterpret_cast<const uint4*>(k_s + static_cast<size_t>(i) * dk_pad);
      const uint4* qr = reinterpret_cast<const uint4*>(q_s + static_cast<size_t>(i) * dk_pad);
      float kf[NR];
      float kv0 = 0.0f, kv1 = 0.0f, oq0 = 0.0f, oq1 = 0.0f;
#pragma unroll
      for (int gidx = 0; gidx < NR / 8; ++gidx) {
        float qf[8];
        unpack8(kr[gidx * RP + p], kf + gidx * 8);
        unpack8(qr[gidx * RP + p], qf);
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
          kv0 = fmaf(S[gidx * 8 + e], kf[gidx * 8 + e], kv0);
          kv1 = fmaf(S[gidx * 8 + e + 1], kf[gidx * 8 + e + 1], kv1);
          oq0 = fmaf(S[gidx * 8 + e], qf[e], oq0);
          oq1 = fmaf(S[gidx * 8 + e + 1], qf[e + 1], oq1);
        }
      }
      float kv = kv0 + kv1, oq = oq0 + oq1;
      for (int off = RP / 2; off >= 1; off /= 2) {
        kv += __shfl_xor_sync(0xffffffffu, kv, off);
        oq += __shfl_xor_sync(0xffffffffu, oq, off);
      }
      const float decay = decay_s[i];
      const float delta = (v_s[i * DV_T + col] - kv * decay) * beta_s[i];
#pragma unroll
      for (int r = 0; r < NR; ++r) S[r] = fmaf(kf[r], delta, S[r] * decay);
      if (p == 0) o_s[i * DV_T + col] = fmaf(delta, kq_s[i], oq * decay);
    }
    __syncthreads();
    for (int idx = tid; idx < L * DV_T; idx += kThreads) {
      const int i = idx / DV_T, cc = idx - i * DV_T;
      if (c0 + cc < dv) O[((t0 + i) * Hv + h) * dv + c0 + cc] = __float2bfloat16_rn(o_s[idx]);
    }
    // The next chunk's staging writes k_s/q_s/v_s only, which every thread finished reading before
    // the barrier above; o_s is rewritten only after the next chunk's two barriers.
  }

  if (prm.final_state != nullptr && col_ok) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const int64_t a = static_cast<int64_t>(p) * NR + r;
      if (a < dk) prm.final_state[state_off + a * dv + c] = S[r];
    }
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

int next_pow2(int64_t x) {
  int r = 1;
  while (r < x) r *= 2;
  return r;
}

}  // namespace

void recurrent_gated_delta_rule(const DeltaRuleParams& p, Stream s) {
  const char* op = "recurrent_gated_delta_rule";
  DFLASH_CHECK(p.N >= 0 && p.Hk >= 1 && p.Hv >= 1 && p.dk >= 1 && p.dv >= 1,
               op << ": needs N >= 0 and Hk, Hv, dk, dv >= 1, got N " << p.N << ", Hk " << p.Hk << ", Hv " << p.Hv
                  << ", dk " << p.dk << ", dv " << p.dv);
  DFLASH_CHECK(p.Hv % p.Hk == 0, op << ": " << p.Hv << " value heads are not a multiple of " << p.Hk << " key heads");
  DFLASH_CHECK(p.dk <= 1024, op << ": dk " << p.dk << " is above the supported 1024");
  DFLASH_CHECK(p.ldv >= p.Hv * p.dv, op << ": v row stride " << p.ldv << " is smaller than Hv*dv = " << p.Hv * p.dv);
  DFLASH_CHECK(p.num_seqs >= 1 && p.num_seqs < 65536 && p.Hv < 65536,
               op << ": needs 1 <= num_seqs < 65536 and Hv < 65536, got num_seqs " << p.num_seqs << ", Hv " << p.Hv);
  DFLASH_CHECK(p.cu_seqlens != nullptr, op << ": cu_seqlens is null");
  DFLASH_CHECK(p.N == 0 || (p.q && p.k && p.v && p.g && p.beta && p.out),
               op << ": null pointer among q, k, v, g, beta, out");

  // Rows per thread: 16 for dk <= 128 (RP = 8 parts, 16 columns per block: more blocks to hide the
  // per-step latency), 32 above; never so few that more than 32 parts would be needed.
  int NR = tuning::recurrent_rows_per_thread;
  if (NR != 8 && NR != 16 && NR != 32) NR = p.dk <= 128 ? 16 : 32;
  while (NR < 32 && (p.dk + NR - 1) / NR > 32) NR *= 2;
  RecurrentGeom geo{};
  geo.RP = next_pow2((p.dk + NR - 1) / NR);
  geo.DV_T = kThreads / geo.RP;
  geo.dk_pad = geo.RP * NR;
  const size_t per_token = 2 * sizeof(uint16_t) * geo.dk_pad + 2 * sizeof(float) * geo.DV_T + 3 * sizeof(float);
  geo.TC = static_cast<int>(std::min<size_t>(kMaxChunk, kSmemBudget / per_token));
  const size_t smem = per_token * geo.TC;
  const bool vec = p.dk % 8 == 0 && aligned16(p.q) && aligned16(p.k);
  const dim3 grid(static_cast<unsigned>((p.dv + geo.DV_T - 1) / geo.DV_T), static_cast<unsigned>(p.Hv),
                  static_cast<unsigned>(p.num_seqs));
  auto stream = static_cast<cudaStream_t>(s);
  switch (NR) {
    case 8: recurrent_gdr_kernel<8><<<grid, kThreads, smem, stream>>>(p, geo, vec); break;
    case 16: recurrent_gdr_kernel<16><<<grid, kThreads, smem, stream>>>(p, geo, vec); break;
    default: recurrent_gdr_kernel<32><<<grid, kThreads, smem, stream>>>(p, geo, vec); break;
  }
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda
