// Chunked gated delta rule forward (GatedDeltaNet core) on tensor cores: mma.sync m16n8k16 bf16
// with fp32 accumulation, ldmatrix operand loads, a cp.async ring of input stages, fp32 state.
//
// Math (kernels/cpu/gdn.cpp chunked_head is the fp32 oracle). Per sequence, value head h (key head
// h / (Hv / Hk)) and chunk of C = 64 tokens with cumulative log decay G_i = g_0 + ... + g_i:
//   A   = strictly-lower( beta_i (k_i . k_j) exp(G_i - G_j) ),   T = (I + A)^-1 (unit lower)
//   P   = lower( (q_i . k_j) exp(G_i - G_j) )                     (j <= i)
//   V'  = T diag(beta) (V - diag(exp G) K S)      (= U - W S of the WY / UT form)
//   O   = diag(exp G) Q S + P V'
//   S  <- exp(G_last) S + K^T diag(exp(G_last - G)) V'
//
// Two kernels:
//  (1) gdn_chunk_prep: one CTA (4 warps) per (chunk slot, key head), going through the key head's
//      value heads one after the other. K K^T and Q K^T (lower block-triangle only, 20 m16n8
//      tiles) on tensor cores once, kept in registers; per value head the decays and beta are
//      applied and T is computed in fp32 in shared memory (16x16 diagonal blocks by forward
//      substitution, then the off-diagonal blocks T_ij = -T_ii sum_k A_ik T_kj, block row by block
//      row, as tf32 m16n8k8 mma with fp32 accumulation); T and P (bf16, lower block triangle) and
//      the gates e^G, beta, e^(G_last - G) (fp32) go to a scratch buffer. Parallel over chunks.
//  (2) gdn_chunk_state: one CTA of NC / 16 warps (4 for NC = 64; 32 columns only through the test
//      hook) per (sequence, value head, NC-column dv slice), running sequentially over the
//      sequence's chunks. Each warp owns 16 value columns and keeps their state transposed, S^T
//      [16, dk] fp32, in mma accumulator registers, so S, Y, V' and O never leave registers
//      (accumulator -> bf16 A fragment) and there is no barrier inside a chunk step (Kernel 2's
//      comment below). Inputs (K, Q, V, T, P, gates) stream in through a 3-stage cp.async ring
//      (2 where shared memory is smaller), one CTA barrier per chunk.
//
// Precision: every tensor-core operand is bf16 (K, Q, V, S, Y, T, P, V'), accumulation and the
// state are fp32; the off-diagonal blocks of T are formed from tf32 operands (A and fp32 T
// blocks). Feeding S to the mma as bf16 hi + lo (two products) was measured on the H200 and did not
// reduce the error (the other bf16 operands dominate: out ~5e-3, final state ~4e-3
// normalized vs the fp32 reference) while costing 10%, so it was dropped.
//
// Chunk slots: chunk c of sequence s (tokens bos_s + 64 c ..) uses scratch slot bos_s / 64 + s + c.
// These never collide (ceil(l / 64) <= floor((b + l) / 64) - floor(b / 64) + 1) and stay below
// N / 64 + num_seqs + 1, so neither kernel needs a prefix sum over the device-side cu_seqlens.
//
// Roofline (Qwen3.6-27B GDN layer: Hk = 16, Hv = 48, dk = dv = d = 128, C = 64, H200):
//  FLOPs, dense-equivalent count of the chunked form (as fla counts it), per token and value head:
//    2 C (3 dk + 2 dv) + 6 dk dv   = 180,224  ->  T = 8192: 70.9 GFLOP; T = 2048: 17.7 GFLOP.
//  This implementation does 4 C dk / (Hv / Hk) + 4 C dv + 6 dk dv per token-head (K K^T and Q K^T
//  once per key head, W and U never formed; triangles counted dense) = 142k, 55.8 GFLOP at
//  T = 8192. At ~600 TFLOP/s (mma.sync bf16) that is ~0.1 ms; kernel (2) has only Hv * dv / 64 = 96
//  CTAs for one sequence, so it runs on 96 of the 132 SMs.
//  Bytes (each input read once, output written once): q, k 2 N Hk dk 2 B, v and out N Hv dv 2 B
//  each, g and beta N Hv 4 B each (+ states): T = 8192: 271.6 MB -> 0.063 ms at 4.3 TB/s.
//  Scratch: T and P bf16 (10 of 16 16x16 blocks: 10 KB) + gates (768 B) per chunk and value head,
//  written once by (1) and read by each dv slice of (2) (mostly from L2): 66 MB at T = 8192.
//  So the op is bound by the latency of the chunk recurrence and by shared memory, not by DRAM.
//
// Measured on the H200 (Hk = 16, Hv = 48, d = 128; ms; TFLOP/s by the dense-equivalent count;
// prep / state from the test hook, ChunkedTimings in tests/test_cuda_delta_rule.cpp, one run; the
// full op is taken as their sum: in the same run the whole op with the paired variant below was
// within -0.006 .. +0.002 ms of its prep + state at every shape):
//    1 x 2048: 0.109 (prep 0.032, state 0.077)      162 TFLOP/s    (was 0.127: prep 0.037, state 0.090)
//    1 x 8192: 0.411 (prep 0.115, state 0.295)      172 TFLOP/s    (was 0.476: prep 0.128, state 0.348)
//   1 x 32768: 1.58  (prep 0.42,  state 1.16)       179 TFLOP/s    (was 1.87: prep 0.49, state 1.38)
//    8 x 1024: 0.348 (prep 0.115, state 0.231)      204 TFLOP/s    (was 0.398: prep 0.130, state 0.269)
//  (fla Triton at 1 x 8192: 1.28; FlashInfer 0.39.) The "was" column is the previous state kernel
//  (8 warps per 64 columns, S as the B operand through a bf16 copy in shared memory, 3 barriers
//  per chunk, ~5,400 cycles per chunk). What the change measured, state kernel, same four rows:
//  - S^T in registers, one warp per 16 columns, gates exponentiated in-kernel: 0.085 / 0.326 /
//    1.28 / 0.253; ncu at T = 8192: 1 warp per scheduler issuing every 3.0 cycles, ~1,530 SASS
//    instructions per chunk step (~390 of them cp.async address arithmetic), ~4,500 cycles per
//    chunk, L1 / shared-memory throughput ~80% on the 96 active SMs, tensor pipe ~30%.
//  - + exponentials moved to prep, cp.async addresses computed once, zero-accumulator mma (this
//    kernel): 0.077 / 0.295 / 1.16 / 0.231; two input stages instead of three: 0.083 / 0.313 /
//    1.24 / 0.248.
//  - A "state warp" (the recurrence) and an "output warp" (Q S, P V', stores) per 16 columns,
//    handing S^T and V'^T fragments over shared memory behind named barriers (8 warps per CTA):
//    0.088 / 0.333 / 1.32 / 0.260 (0.083 / 0.319 / 1.26 / 0.251 with two stages): slower; ncu:
//    short-scoreboard (shared-memory latency) and barrier stalls dominate. Removed.
//  - 32-column slices (2 warps per CTA, 192 CTAs, one per SM: two waves): twice the time.
//  Prep per key head instead of per value head (K K^T, Q K^T and the K / Q loads shared by 3 value
//  heads): 0.032 / 0.115 / 0.42 / 0.115 against 0.044 / 0.151 / 0.58 / 0.153 (both with the
//  exponentials). The state kernel as a programmatic dependent launch of prep (test hook 128)
//  measured 0.002 - 0.004 ms less on the whole op at 2048, 8192 and 8 x 1024 and 0.003 more at
//  32768 (with the paired variant; not the default).
// Where the time goes: the state kernel (~72%) is latency bound per warp (96 CTAs of 4 warps, one
// warp per scheduler; halving the warps per SM did not shorten a chunk step), with shared memory
// ~80% busy: each warp reads all of K (twice), Q, T and P per chunk through ldmatrix for its 16
// columns. Next steps: wgmma (sm_90a) for S^T [K; Q]^T and the state update with S^T as the
// register A operand (a warpgroup = the 4 warps of a CTA, B read from shared memory once per
// warpgroup instead of once per warp); prep (~28%) is still one CTA per chunk and key head with
// a scalar forward substitution for the diagonal blocks.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/check.h"
#include "kernels/cuda/gdn.h"
#include "kernels/cuda/ptx.cuh"
#include "core/device.h"
#include "core/error.h"

namespace dflash::cuda {

namespace {

using namespace ptx;

using bf16 = __nv_bfloat16;

constexpr int kC = 64;            // chunk length (tokens)
constexpr int kDvs = 64;          // dv granularity (the state kernel runs 64-column slices, 32 on request)
constexpr int kLd = kC + 8;       // row stride (elements) of the 64-wide bf16 tiles: 144 B, ldmatrix conflict-free
constexpr int kLdAm = kC + 4;     // row strides of the prep kernel's fp32 tiles A (64 x 64), T (64 x 64) and
constexpr int kLdT = kC + 8;      // R (16 x 48): the tf32 mma fragment loads of A, T and R as B are conflict-free
constexpr int kLdR = 56;
constexpr int kPrepThreads = 128;
constexpr int64_t kTileElems = int64_t{kC} * kC;  // one T or P tile in the scratch
constexpr int kGB = 3 * kC;  // per chunk and value head in the scratch: e^G, beta, e^(G_last - G) (fp32)

// ---- PTX wrappers -------------------------------------------------------------------------------

// 16-byte global -> shared copy; zero-fills the destination when !valid (src is not read then).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async16_s(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Programmatic dependent launch (sm_90): let the next kernel in the stream start launching / wait
// until the previous one has completed and its writes are visible. No-ops without such a launch.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ float2 unpack_bf16(uint32_t u) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
}
__device__ __forceinline__ void st_u32(bf16* p, uint32_t v) { *reinterpret_cast<uint32_t*>(p) = v; }

// ---- Arguments ----------------------------------------------------------------------------------

struct ChunkArgs {
  const bf16* q;        // [N, Hk, dk]
  const bf16* k;        // [N, Hk, dk]
  const bf16* v;        // token n, head h at v + n * ldv + h * dv
  int64_t ldv;
  const float* g;       // [N, Hv]
  const float* beta;    // [N, Hv]
  const float* init;    // [S, Hv, dk, dv] or null
  float* final_state;   // [S, Hv, dk, dv] or null
  bf16* out;            // [N, Hv, dv]
  const int32_t* cu;    // [S + 1] or null (one sequence of N tokens)
  int64_t num_seqs, N;
  int Hk, Hv, dv;
  bf16* Tg;             // [slots, Hv, 64, 64] scratch: T = (I + A)^-1 (lower block triangle written)
  bf16* Pg;             // [slots, Hv, 64, 64] scratch: P (lower block triangle written)
  float* GBg;           // [slots, Hv, 3, 64] scratch: e^G (G cumulative), beta (0 past the chunk end),
                        // e^(G_last - G)
};

__device__ __forceinline__ void seq_bounds(const ChunkArgs& a, int64_t s, int64_t& bos, int64_t& eos) {
  if (a.cu != nullptr) {
    bos = a.cu[s];
    eos = a.cu[s + 1];
  } else {
    bos = 0;
    eos = a.N;
  }
}
__device__ __forceinline__ int64_t first_slot(const ChunkArgs& a, int64_t s) {
  return (a.cu != nullptr ? int64_t{a.cu[s]} : 0) / kC + s;
}


// ---- Kernel 1: per (chunk slot, key head or value head): T, P and the gates of the chunk -----------
// One CTA per chunk slot and key head runs the key head's value heads one after the other: K K^T
// and Q K^T are formed once (kept in registers) and the decays, beta, the fp32 inverse and the
// stores are per value head. (gridDim.y == Hv instead gives one value head per CTA: the test
// hook's variant.) Shared memory (48 KB, 4 CTAs per SM): the K / Q tiles of the products and,
// after them, the fp32 A and T tiles share one region.
template <int DK>
constexpr int prep_union_bytes() {
  return 2 * kC * (DK + 8) * 2 > kC * (kLdAm + kLdT) * 4 ? 2 * kC * (DK + 8) * 2 : kC * (kLdAm + kLdT) * 4;
}
template <int DK>
constexpr int prep_smem_bytes() {
  return prep_union_bytes<DK>() + kC * kLd * 2 + 16 * kLdR * 4 + 2 * kC * 4;  // + P staging, R, G, beta
}

template <int DK>
__global__ void __launch_bounds__(kPrepThreads, 4) gdn_chunk_prep_kernel(const ChunkArgs a) {
  constexpr int LDK = DK + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Ks = reinterpret_cast<bf16*>(smem);                                // [64][LDK] (products)
  bf16* Qs = Ks + kC * LDK;                                                // [64][LDK] (products)
  float* Am = reinterpret_cast<float*>(smem);                              // [64][68] strictly lower A
  float* Tm = Am + kC * kLdAm;                                             // [64][72] T, fp32
  bf16* Pst = reinterpret_cast<bf16*>(smem + prep_union_bytes<DK>());     // [64][kLd] P staging
  float* Rm = reinterpret_cast<float*>(Pst + kC * kLd);                    // [16][56]
  float* Gs = Rm + 16 * kLdR;                                              // [64]
  float* Bs = Gs + kC;                                                     // [64]

  pdl_launch_dependents();  // a state kernel launched as its dependent waits for our completion anyway
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t slot = blockIdx.x;
  const int hpc = a.Hv / static_cast<int>(gridDim.y);  // value heads per CTA: Hv / Hk, or 1
  const int h0 = blockIdx.y * hpc, kh = h0 / (a.Hv / a.Hk);

  int64_t lo = 0, hi = a.num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (first_slot(a, mid) <= slot) lo = mid;
    else hi = mid - 1;
  }
  int64_t bos, eos;
  seq_bounds(a, lo, bos, eos);
  const int64_t c = slot - first_slot(a, lo);
  if (c < 0 || c * kC >= eos - bos) return;  // an unused slot (uniform over the CTA)
  const int64_t t0 = bos + c * kC;
  const int L = static_cast<int>(std::min<int64_t>(kC, eos - t0));

  for (int idx = tid; idx < kC * (DK / 8); idx += kPrepThreads) {
    const int r = idx / (DK / 8), cc = idx % (DK / 8);
    const bool valid = r < L;
    const int64_t off = ((t0 + (valid ? r : 0)) * a.Hk + kh) * DK + cc * 8;
    cp_async16(Ks + r * LDK + cc * 8, a.k + off, valid);
    cp_async16(Qs + r * LDK + cc * 8, a.q + off, valid);
  }
  cp_async_commit();
  // Warp 0: g and beta of tokens 2 lane, 2 lane + 1 for one value head (0 past L), fetched a head
  // ahead of their use.
  const int i0 = 2 * lane, i1 = i0 + 1;
  float g0 = 0.0f, g1 = 0.0f, b0 = 0.0f, b1 = 0.0f;
  auto fetch_gates = [&](int h) {
    g0 = g1 = b0 = b1 = 0.0f;
    if (i0 < L) {
      g0 = a.g[(t0 + i0) * a.Hv + h];
      b0 = a.beta[(t0 + i0) * a.Hv + h];
    }
    if (i1 < L) {
      g1 = a.g[(t0 + i1) * a.Hv + h];
      b1 = a.beta[(t0 + i1) * a.Hv + h];
    }
  };
  if (warp == 0) fetch_gates(h0);
  cp_async_wait_all();
  __syncthreads();

  float kk[5][4], qk[5][4];
#pragma unroll
  for (int u = 0; u < 5; ++u) {
    const int ti = warp + 4 * u;
    const int mt = ti < 2 ? 0 : ti < 6 ? 1 : ti < 12 ? 2 : 3;
    const int nt = ti - mt * (mt + 1);
#pragma unroll
    for (int e = 0; e < 4; ++e) kk[u][e] = qk[u][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks) {
      uint32_t ak[4], aq[4], bk0, bk1;
      const int arow = 16 * mt + (lane & 15), acol = 16 * ks + (lane >> 4) * 8;
      ldmatrix_x4(ak, Ks + arow * LDK + acol);
      ldmatrix_x4(aq, Qs + arow * LDK + acol);
      ldmatrix_x2(bk0, bk1, Ks + (8 * nt + (lane & 7)) * LDK + 16 * ks + ((lane >> 3) & 1) * 8);
      mma_bf16(kk[u], ak, bk0, bk1);
      mma_bf16(qk[u], aq, bk0, bk1);
    }
  }

  for (int hx = 0; hx < hpc; ++hx) {
    const int h = h0 + hx;
    if (warp == 0) {  // G (inclusive cumsum of g, constant past L) and beta (0 past L)
      float s = g0 + g1;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float o = __shfl_up_sync(0xffffffffu, s, off);
        if (lane >= off) s += o;
      }
      Gs[i1] = s;
      Gs[i0] = s - g1;
      Bs[i0] = b0;
      Bs[i1] = b1;
      if (hx + 1 < hpc) fetch_gates(h + 1);
    }
    __syncthreads();  // G, beta ready; the K / Q region (first head) or the last head's T is free

#pragma unroll
    for (int u = 0; u < 5; ++u) {
      const int ti = warp + 4 * u;
      const int mt = ti < 2 ? 0 : ti < 6 ? 1 : ti < 12 ? 2 : 3;
      const int nt = ti - mt * (mt + 1);
      float pv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * mt + (lane >> 2) + (e >> 1) * 8;
        const int j = 8 * nt + 2 * (lane & 3) + (e & 1);
        const float dec = j <= i ? expf(Gs[i] - Gs[j]) : 0.0f;
        Am[i * kLdAm + j] = j < i ? Bs[i] * kk[u][e] * dec : 0.0f;
        pv[e] = j <= i ? qk[u][e] * dec : 0.0f;
      }
      const int i = 16 * mt + (lane >> 2), j = 8 * nt + 2 * (lane & 3);
      st_u32(Pst + i * kLd + j, pack_bf16(pv[0], pv[1]));
      st_u32(Pst + (i + 8) * kLd + j, pack_bf16(pv[2], pv[3]));
    }
    __syncthreads();

    const int64_t base = (slot * a.Hv + h) * kTileElems;
    if (tid < 64) {
      // Diagonal 16x16 blocks of T by forward substitution, one column per thread.
      const int b = tid >> 4, col = tid & 15;
      const float* Ab = Am + 16 * b * kLdAm + 16 * b;
      float x[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float acc = i == col ? 1.0f : 0.0f;
#pragma unroll
        for (int j = 0; j < i; ++j) acc -= Ab[i * kLdAm + j] * x[j];
        x[i] = acc;
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) Tm[(16 * b + i) * kLdT + 16 * b + col] = x[i];
    } else {
      // Meanwhile: P's lower block triangle (the state kernel reads no other block) and the gates
      // e^G, beta, e^(G_last - G) to the scratch.
      for (int idx = tid - 64; idx < kC * 8; idx += 64) {
        const int i = idx >> 3, cc = idx & 7;
        if (cc < 2 * ((i >> 4) + 1))
          *reinterpret_cast<uint4*>(a.Pg + base + i * kC + cc * 8) =
              *reinterpret_cast<const uint4*>(Pst + i * kLd + cc * 8);
      }
      float* gb = a.GBg + (slot * a.Hv + h) * kGB;
      for (int idx = tid - 64; idx < kC; idx += 64) {
        gb[idx] = expf(Gs[idx]);
        gb[kC + idx] = Bs[idx];
        gb[2 * kC + idx] = expf(Gs[kC - 1] - Gs[idx]);
      }
    }
    __syncthreads();

    // Off-diagonal blocks on tensor cores (tf32 m16n8k8, fp32 accumulate), block row bi = 1..3, one
    // 16 x 8 tile (bj = t / 2, columns n0..n0 + 7) per warp and step: R = sum_{k=bj}^{bi-1} A_ik T_kj,
    // then T_ij = -T_ii R with R passed through this warp's own columns of Rm.
    {
      const int gq = lane >> 2, tq = lane & 3;
      for (int bi = 1; bi < 4; ++bi) {
        for (int t = warp; t < 2 * bi; t += 4) {
          const int bj = t >> 1, n0 = 16 * bj + 8 * (t & 1);
          float r[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          for (int k0 = 16 * bj; k0 < 16 * bi; k0 += 8) {
            const float* ab = Am + (16 * bi + gq) * kLdAm + k0 + tq;
            const uint32_t af[4] = {tf32(ab[0]), tf32(ab[8 * kLdAm]), tf32(ab[4]), tf32(ab[8 * kLdAm + 4])};
            const float* tb = Tm + (k0 + tq) * kLdT + n0 + gq;
            mma_tf32(r, af, tf32(tb[0]), tf32(tb[4 * kLdT]));
          }
          float* rt = Rm + n0;
          rt[gq * kLdR + 2 * tq] = r[0];
          rt[gq * kLdR + 2 * tq + 1] = r[1];
          rt[(gq + 8) * kLdR + 2 * tq] = r[2];
          rt[(gq + 8) * kLdR + 2 * tq + 1] = r[3];
          __syncwarp();
          float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int k0 = 0; k0 < 16; k0 += 8) {
            const float* ab = Tm + (16 * bi + gq) * kLdT + 16 * bi + k0 + tq;
            const uint32_t af[4] = {tf32(ab[0]), tf32(ab[8 * kLdT]), tf32(ab[4]), tf32(ab[8 * kLdT + 4])};
            const float* rb = rt + (k0 + tq) * kLdR + gq;
            mma_tf32(o, af, tf32(rb[0]), tf32(rb[4 * kLdR]));
          }
          float* to = Tm + (16 * bi + gq) * kLdT + n0 + 2 * tq;
          to[0] = -o[0];
          to[1] = -o[1];
          to[8 * kLdT] = -o[2];
          to[8 * kLdT + 1] = -o[3];
        }
        __syncthreads();
      }
    }

    for (int idx = tid; idx < kC * 8; idx += kPrepThreads) {  // T's lower block triangle
      const int i = idx >> 3, cc = idx & 7;
      if (cc < 2 * ((i >> 4) + 1)) {
        const float4 x0 = *reinterpret_cast<const float4*>(Tm + i * kLdT + cc * 8);
        const float4 x1 = *reinterpret_cast<const float4*>(Tm + i * kLdT + cc * 8 + 4);
        *reinterpret_cast<uint4*>(a.Tg + base + i * kC + cc * 8) =
            make_uint4(pack_bf16(x0.x, x0.y), pack_bf16(x0.z, x0.w), pack_bf16(x1.x, x1.y), pack_bf16(x1.z, x1.w));
      }
    }
  }
}

// ---- Kernel 2: per (sequence, value head, NC-column dv slice): the sequential chunk recurrence ----
// The value columns of the delta rule evolve independently (S[:, j] depends only on V[:, j]), so
// each warp owns 16 value columns and runs the chunk steps alone, with its slice of the state kept
// transposed, S^T [16, DK] fp32, in mma accumulator registers (rows = value columns, columns = dk).
// Every product has M = the warp's 16 value columns, so whatever depends on S (S itself, Y, V', O)
// stays in registers (accumulator -> bf16 A fragment) and only the inputs that the CTA's warps
// share come from shared memory (B fragments by ldmatrix). Per chunk:
//   X^T = S^T K^T,  O^T = (S^T Q^T) diag(e^G)                B = K, Q rows (k = dk)
//   Y^T = (V^T - X^T diag(e^G)) diag(beta)                   V^T by ldmatrix.trans
//   V'^T = Y^T T^T,  O^T += V'^T P^T                          B = T, P rows (lower block triangle)
//   S^T = e^G_last S^T + V'^T diag(e^(G_last - G)) K           B = K by ldmatrix.trans (k = tokens)
// O^T goes out through the warp's own columns of the V tile (stmatrix.trans, 16-byte stores). No
// barrier inside a chunk step: one per chunk guards the STAGES-deep cp.async ring of inputs (K,
// Q, V, T, P and the gates e^G, beta, e^(G_last - G) of one chunk per stage; the exponentials
// come from the prep kernel).
template <int DK, int NC, int STAGES_>
struct StateLayout {
  static constexpr int LDK = DK + 8, LDV = NC + 8;  // row strides (elements): ldmatrix conflict-free
  static constexpr int K_BYTES = kC * LDK * 2, V_BYTES = kC * LDV * 2, TP_BYTES = kC * kLd * 2;
  static constexpr int OFF_K = 0, OFF_Q = K_BYTES, OFF_V = 2 * K_BYTES, OFF_T = OFF_V + V_BYTES;
  static constexpr int OFF_P = OFF_T + TP_BYTES, OFF_GB = OFF_P + TP_BYTES;
  static constexpr int STAGE = OFF_GB + kGB * 4;
  static constexpr int STAGES = STAGES_;
  static constexpr int BYTES = STAGES * STAGE;  // 185 KB (3 stages) / 123.5 KB (2) for DK = 128, NC = 64
};

template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// c = a · b with a zero accumulator (no zeroing of c beforehand).
__device__ __forceinline__ void mma_bf16_z(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}

// Four 8x8 b16 matrices to shared memory, each stored transposed (row addresses from lanes 0-31).
__device__ __forceinline__ void stmatrix_x4_trans(void* p, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(p)),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
#else
  // Element (row g, cols 2t, 2t + 1) of matrix i in lane 4 g + t goes to row 2t (+1), column g of
  // the rows that lanes 8 i .. 8 i + 7 address.
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint32_t r[4] = {r0, r1, r2, r3};
  const uint64_t base = reinterpret_cast<uint64_t>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const uint64_t row = __shfl_sync(0xffffffffu, base, 8 * i + 2 * t + e);
      reinterpret_cast<uint16_t*>(row)[g] = static_cast<uint16_t>(r[i] >> (16 * e));
    }
  }
#endif
}

// The cp.async plan of one thread (NTH threads load a chunk's inputs into one stage): source
// pointers of chunk 0 and per-chunk strides computed once. Rows >= the chunk's length are
// zero-filled; T and P only in their lower block triangle (the rest is never read).
template <int DK, int NC, int STAGES, int NTH>
struct StateLoader {
  using Lay = StateLayout<DK, NC, STAGES>;
  static constexpr int CPR = DK / 8, RPP = NTH / CPR;    // K / Q: 16-byte pieces per row, rows per pass
  static constexpr int VCPR = NC / 8, VRPP = NTH / VCPR;  // V
  static constexpr int TRPP = NTH / 8;                    // T / P (8 pieces per row)
  static_assert(NTH % CPR == 0 && NTH % VCPR == 0 && kC % RPP == 0 && kC % VRPP == 0 && kC % TRPP == 0 &&
                NTH >= kGB / 4, "load plan");
  const bf16 *k0, *q0, *v0, *kq, *qq, *vq, *tq, *pq;
  const float* gq;
  int64_t kq_row, kq_chunk, v_row, v_chunk, tile_chunk, gb_chunk;
  uint32_t kq_dst, v_dst, t_dst;
  int kq_r, v_r, t_r, t_c, tid;

  __device__ StateLoader(const ChunkArgs& a, int tid_, int64_t bos, int64_t slot0, int h, int kh, int col0) : tid(tid_) {
    kq_r = tid / CPR, v_r = tid / VCPR, t_r = tid >> 3, t_c = tid & 7;
    const int kq_c = tid % CPR, v_c = tid % VCPR;
    k0 = a.k, q0 = a.q, v0 = a.v;
    kq_row = int64_t{a.Hk} * DK, kq_chunk = kC * kq_row;
    kq = a.k + (bos + kq_r) * kq_row + int64_t{kh} * DK + kq_c * 8;
    qq = a.q + (kq - a.k);
    v_row = a.ldv, v_chunk = kC * a.ldv;
    vq = a.v + (bos + v_r) * a.ldv + int64_t{h} * a.dv + col0 + v_c * 8;
    tile_chunk = int64_t{a.Hv} * kTileElems;
    tq = a.Tg + (slot0 * a.Hv + h) * kTileElems + t_r * kC + t_c * 8;
    pq = a.Pg + (tq - a.Tg);
    gb_chunk = int64_t{a.Hv} * kGB;
    gq = a.GBg + (slot0 * a.Hv + h) * kGB + 4 * tid;
    kq_dst = (kq_r * Lay::LDK + kq_c * 8) * 2, v_dst = (v_r * Lay::LDV + v_c * 8) * 2, t_dst = (t_r * kLd + t_c * 8) * 2;
  }

  // All inputs of chunk c (L tokens) into the stage at shared address `stage`.
  __device__ __forceinline__ void load(int c, int L, uint32_t stage) const {
    const bf16* kp = kq + c * kq_chunk;
    const bf16* qp = qq + c * kq_chunk;
#pragma unroll
    for (int i = 0; i < kC / RPP; ++i) {
      const bool valid = kq_r + i * RPP < L;
      const uint32_t dst = stage + kq_dst + i * RPP * Lay::LDK * 2;
      cp_async16_s(dst + Lay::OFF_K, valid ? kp + i * RPP * kq_row : k0, valid);
      cp_async16_s(dst + Lay::OFF_Q, valid ? qp + i * RPP * kq_row : q0, valid);
    }
    const bf16* vp = vq + c * v_chunk;
#pragma unroll
    for (int i = 0; i < kC / VRPP; ++i) {
      const bool valid = v_r + i * VRPP < L;
      cp_async16_s(stage + Lay::OFF_V + v_dst + i * VRPP * Lay::LDV * 2, valid ? vp + i * VRPP * v_row : v0, valid);
    }
    const bf16* tp = tq + c * tile_chunk;
    const bf16* pp = pq + c * tile_chunk;
#pragma unroll
    for (int i = 0; i < kC / TRPP; ++i) {
      if (t_c < 2 * (((t_r + i * TRPP) >> 4) + 1)) {
        const uint32_t dst = stage + t_dst + i * TRPP * kLd * 2;
        cp_async16_s(dst + Lay::OFF_T, tp + i * TRPP * kC, true);
        cp_async16_s(dst + Lay::OFF_P, pp + i * TRPP * kC, true);
      }
    }
    if (tid < kGB / 4) cp_async16_s(stage + Lay::OFF_GB + 16 * tid, gq + c * gb_chunk, true);
  }
};

// S^T tile nt of a warp holds rows (value columns) vw + gq, vw + gq + 8 and columns (dk)
// 8 nt + 2 tq, + 1; S^T[v][d] is state[d dv + v]. `off` is the state offset of (d = 0, v = vw + gq).
template <int DT>
__device__ __forceinline__ void load_state(float (&S)[DT][4], const float* init, int64_t off, int64_t dv, int tq) {
#pragma unroll
  for (int nt = 0; nt < DT; ++nt) {
    const int64_t o0 = off + int64_t{8 * nt + 2 * tq} * dv;
    if (init != nullptr) {
      S[nt][0] = init[o0], S[nt][1] = init[o0 + dv], S[nt][2] = init[o0 + 8], S[nt][3] = init[o0 + dv + 8];
    } else {
      S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
    }
  }
}
template <int DT>
__device__ __forceinline__ void store_state(const float (&S)[DT][4], float* out, int64_t off, int64_t dv, int tq) {
#pragma unroll
  for (int nt = 0; nt < DT; ++nt) {
    const int64_t o0 = off + int64_t{8 * nt + 2 * tq} * dv;
    out[o0] = S[nt][0], out[o0 + dv] = S[nt][1], out[o0 + 8] = S[nt][2], out[o0 + dv + 8] = S[nt][3];
  }
}

// The pieces of one chunk step for one warp's 16 value columns (vw ..), lane (gq, tq). ra / ca:
// this lane's row / column in a 16 x 16 block for ldmatrix / stmatrix x4 with the matrices in the
// order (r 0-7, c 0-7), (r 0-7, c 8-15), (r 8-15, c 0-7), (r 8-15, c 8-15); rb / cb the same for
// (r 0-7, c 0-7), (r 8-15, c 0-7), (r 0-7, c 8-15), (r 8-15, c 8-15).
struct Lane {
  int lane, gq, tq, ra, ca, rb, cb;
  __device__ explicit Lane(int l)
      : lane(l), gq(l >> 2), tq(l & 3), ra((l & 7) + ((l >> 4) << 3)), ca(((l >> 3) & 1) << 3),
        rb((l & 7) + (((l >> 3) & 1) << 3)), cb((l >> 4) << 3) {}
};

// A fragment (k-step kx) of S^T from its accumulator tiles 2 kx, 2 kx + 1.
template <int DT>
__device__ __forceinline__ void state_fragment(uint32_t (&af)[4], const float (&S)[DT][4], int kx) {
  af[0] = pack_bf16(S[2 * kx][0], S[2 * kx][1]);
  af[1] = pack_bf16(S[2 * kx][2], S[2 * kx][3]);
  af[2] = pack_bf16(S[2 * kx + 1][0], S[2 * kx + 1][1]);
  af[3] = pack_bf16(S[2 * kx + 1][2], S[2 * kx + 1][3]);
}

// acc^T[16 v, 64 tokens] = S^T (A fragments af[kx]) · X^T for X = K or Q rows (row stride LDX).
template <int DK, int LDX, class Frag>
__device__ __forceinline__ void times_rows_t(float (&acc)[8][4], Frag&& af, const bf16* X, const Lane& ln) {
#pragma unroll
  for (int kx = 0; kx < DK / 16; ++kx) {
    uint32_t a[4];
    af(a, kx);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, X + (16 * np + ln.ra) * LDX + 16 * kx + ln.ca);
      if (kx == 0) {
        mma_bf16_z(acc[2 * np], a, b[0], b[1]);
        mma_bf16_z(acc[2 * np + 1], a, b[2], b[3]);
      } else {
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
  }
}

// acc^T (+)= A^T · M^T for a lower block-triangular 64 x 64 M (T or P, row stride kLd); A^T as
// bf16 A fragments af[kt] (k = tokens 16 kt ..). ZERO: acc starts at zero.
template <bool ZERO>
__device__ __forceinline__ void times_tri_t(float (&acc)[8][4], const uint32_t (&af)[4][4], const bf16* M, const Lane& ln) {
#pragma unroll
  for (int ni = 0; ni < 4; ++ni)
#pragma unroll
    for (int kt = 0; kt <= ni; ++kt) {
      uint32_t b[4];
      ldmatrix_x4(b, M + (16 * ni + ln.ra) * kLd + 16 * kt + ln.ca);
      if (ZERO && kt == 0) {
        mma_bf16_z(acc[2 * ni], af[kt], b[0], b[1]);
        mma_bf16_z(acc[2 * ni + 1], af[kt], b[2], b[3]);
      } else {
        mma_bf16(acc[2 * ni], af[kt], b[0], b[1]);
        mma_bf16(acc[2 * ni + 1], af[kt], b[2], b[3]);
      }
    }
}

// Y^T = beta (V^T - e^G X^T) as bf16 A fragments (k = tokens 16 np ..), V the stage's tile.
template <int LDV>
__device__ __forceinline__ void form_y(uint32_t (&ya)[4][4], const float (&x)[8][4], const bf16* Vs, int vw,
                                       const float* Eg, const float* Bt, const Lane& ln) {
#pragma unroll
  for (int np = 0; np < 4; ++np) {
    uint32_t vf[4];
    ldmatrix_x4_trans(vf, Vs + (16 * np + ln.ra) * LDV + vw + ln.ca);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int j = 2 * np + hh;
      const float2 e2 = *reinterpret_cast<const float2*>(Eg + 8 * j + 2 * ln.tq);
      const float2 b2 = *reinterpret_cast<const float2*>(Bt + 8 * j + 2 * ln.tq);
      const float2 v0 = unpack_bf16(vf[2 * hh]), v1 = unpack_bf16(vf[2 * hh + 1]);
      ya[np][2 * hh] = pack_bf16(b2.x * (v0.x - e2.x * x[j][0]), b2.y * (v0.y - e2.y * x[j][1]));
      ya[np][2 * hh + 1] = pack_bf16(b2.x * (v1.x - e2.x * x[j][2]), b2.y * (v1.y - e2.y * x[j][3]));
    }
  }
}

// V'^T and V'^T diag(e^(G_last - G)) as bf16 A fragments.
__device__ __forceinline__ void form_vp(uint32_t (&va)[4][4], uint32_t (&vd)[4][4], const float (&vp)[8][4],
                                        const float* Ed, const Lane& ln) {
#pragma unroll
  for (int np = 0; np < 4; ++np)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int j = 2 * np + hh;
      const float2 d2 = *reinterpret_cast<const float2*>(Ed + 8 * j + 2 * ln.tq);
      va[np][2 * hh] = pack_bf16(vp[j][0], vp[j][1]);
      va[np][2 * hh + 1] = pack_bf16(vp[j][2], vp[j][3]);
      vd[np][2 * hh] = pack_bf16(d2.x * vp[j][0], d2.y * vp[j][1]);
      vd[np][2 * hh + 1] = pack_bf16(d2.x * vp[j][2], d2.y * vp[j][3]);
    }
}

// S^T = e^G_last S^T + Vd^T K (B = K by ldmatrix.trans, k = tokens).
template <int DK, int LDK, int DT>
__device__ __forceinline__ void update_state(float (&S)[DT][4], const uint32_t (&vd)[4][4], float eg, const bf16* Ks,
                                             const Lane& ln) {
#pragma unroll
  for (int nt = 0; nt < DT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) S[nt][e] *= eg;
#pragma unroll
  for (int kt = 0; kt < 4; ++kt)
#pragma unroll
    for (int nd = 0; nd < DK / 16; ++nd) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, Ks + (16 * kt + ln.rb) * LDK + 16 * nd + ln.cb);
      mma_bf16(S[2 * nd], vd[kt], b[0], b[1]);
      mma_bf16(S[2 * nd + 1], vd[kt], b[2], b[3]);
    }
}

// O^T (16 v x 64 tokens) to out rows t0 .. t0 + L - 1, columns col (16), staged through columns
// vw .. vw + 15 of the stage's V tile (which only this warp reads).
template <int LDV>
__device__ __forceinline__ void store_out(const float (&o)[8][4], bf16* Vs, int vw, bf16* out, int64_t row_stride, int L,
                                          const Lane& ln) {
#pragma unroll
  for (int np = 0; np < 4; ++np)
    stmatrix_x4_trans(Vs + (16 * np + ln.ra) * LDV + vw + ln.ca, pack_bf16(o[2 * np][0], o[2 * np][1]),
                      pack_bf16(o[2 * np][2], o[2 * np][3]), pack_bf16(o[2 * np + 1][0], o[2 * np + 1][1]),
                      pack_bf16(o[2 * np + 1][2], o[2 * np + 1][3]));
  __syncwarp();
#pragma unroll
  for (int u = 0; u < 4; ++u) {  // 16 token rows of 32 bytes per step
    const int r = 16 * u + (ln.lane >> 1), cl = 8 * (ln.lane & 1);
    if (r < L)
      *reinterpret_cast<uint4*>(out + r * row_stride + cl) = *reinterpret_cast<const uint4*>(Vs + r * LDV + vw + cl);
  }
}

template <int DK, int NC, int STAGES>
__global__ void __launch_bounds__(2 * NC, 1) gdn_chunk_state_kernel(const ChunkArgs a) {
  using Lay = StateLayout<DK, NC, STAGES>;
  constexpr int LDK = Lay::LDK, LDV = Lay::LDV, NTH = 2 * NC, DT = DK / 8;
  extern __shared__ __align__(16) unsigned char smem[];

  const int tid = threadIdx.x;
  const Lane ln(tid & 31);
  const int vw = 16 * (tid >> 5);
  const int64_t s = blockIdx.x;
  const int h = blockIdx.y, kh = h / (a.Hv / a.Hk);
  const int col0 = blockIdx.z * NC;

  int64_t bos, eos;
  seq_bounds(a, s, bos, eos);
  const int nc = static_cast<int>((eos - bos + kC - 1) / kC);
  const int64_t slot0 = first_slot(a, s);
  const int64_t state_off = (s * a.Hv + h) * int64_t{DK} * a.dv + col0 + vw + ln.gq;

  float S[DT][4];
  load_state(S, a.init, state_off, a.dv, ln.tq);
  pdl_wait();

  const uint32_t smem0 = smem_addr(smem);
  const StateLoader<DK, NC, STAGES, NTH> loader(a, tid, bos, slot0, h, kh, col0);
  auto chunk_len = [&](int c) { return static_cast<int>(std::min<int64_t>(kC, eos - (bos + int64_t{c} * kC))); };
#pragma unroll
  for (int c = 0; c < STAGES - 1; ++c) {
    if (c < nc) loader.load(c, chunk_len(c), smem0 + c * Lay::STAGE);
    cp_async_commit();
  }
  for (int c = 0; c < nc; ++c) {
    cp_async_wait_group<STAGES - 2>();
    __syncthreads();
    if (c + STAGES - 1 < nc) loader.load(c + STAGES - 1, chunk_len(c + STAGES - 1), smem0 + ((c + STAGES - 1) % STAGES) * Lay::STAGE);
    cp_async_commit();

    unsigned char* sb = smem + (c % STAGES) * Lay::STAGE;
    const bf16* Ks = reinterpret_cast<const bf16*>(sb + Lay::OFF_K);
    bf16* Vs = reinterpret_cast<bf16*>(sb + Lay::OFF_V);
    const float* Eg = reinterpret_cast<const float*>(sb + Lay::OFF_GB);
    const float* Bt = Eg + kC;
    const float* Ed = Eg + 2 * kC;

    float x[8][4], o[8][4];
    times_rows_t<DK, LDK>(x, [&](uint32_t (&af)[4], int kx) { state_fragment(af, S, kx); }, Ks, ln);
    times_rows_t<DK, LDK>(o, [&](uint32_t (&af)[4], int kx) { state_fragment(af, S, kx); },
                          reinterpret_cast<const bf16*>(sb + Lay::OFF_Q), ln);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 e2 = *reinterpret_cast<const float2*>(Eg + 8 * j + 2 * ln.tq);
      o[j][0] *= e2.x, o[j][1] *= e2.y, o[j][2] *= e2.x, o[j][3] *= e2.y;
    }
    uint32_t ya[4][4];
    form_y<LDV>(ya, x, Vs, vw, Eg, Bt, ln);
    float vp[8][4];
    times_tri_t<true>(vp, ya, reinterpret_cast<const bf16*>(sb + Lay::OFF_T), ln);
    uint32_t va[4][4], vd[4][4];
    form_vp(va, vd, vp, Ed, ln);
    times_tri_t<false>(o, va, reinterpret_cast<const bf16*>(sb + Lay::OFF_P), ln);
    store_out<LDV>(o, Vs, vw, a.out + ((bos + int64_t{c} * kC) * a.Hv + h) * a.dv + col0 + vw, int64_t{a.Hv} * a.dv,
                   chunk_len(c), ln);
    update_state<DK, LDK>(S, vd, Eg[kC - 1], Ks, ln);
  }
  cp_async_wait_group<0>();
  if (a.final_state != nullptr) store_state(S, a.final_state, state_off, a.dv, ln.tq);
}

// ---- Host side ----------------------------------------------------------------------------------

bool aligned(const void* p, size_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

// Scratch for T, P, G/beta from the caching allocator. It is released when the launcher returns,
// before the kernels run: device_alloc hands blocks out again in stream order, which is safe as
// long as all dflash work is issued on the device context's stream (core/device.h).
struct Scratch {
  void* ptr = nullptr;
  int device = 0;
  Scratch(size_t bytes, int dev) : device(dev) { ptr = device_alloc::allocate(bytes, dev); }
  ~Scratch() { device_alloc::release(ptr, device); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// Variants of the test hook (chunk_gated_delta_rule_variant's flags).
struct Variant {
  bool prep = true, state = true;
  bool two_stages = false;       // two input stages in the state kernel (else three where they fit)
  bool cols32 = false;           // 32-column state slices (else 64)
  bool prep_per_value = false;   // one prep CTA per value head (else per key head)
  bool pdl = false;              // state kernel as a programmatic dependent launch of prep
};

template <class Kernel>
void launch_state_kernel(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream, bool pdl,
                         const ChunkArgs& a) {
  DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  DFLASH_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, a));
}

template <int DK, int NC, int STAGES>
void launch_state(const ChunkArgs& a, cudaStream_t stream, const Variant& v) {
  using Lay = StateLayout<DK, NC, STAGES>;
  const dim3 grid(static_cast<unsigned>(a.num_seqs), static_cast<unsigned>(a.Hv), static_cast<unsigned>(a.dv / NC));
  launch_state_kernel(gdn_chunk_state_kernel<DK, NC, STAGES>, grid, 2 * NC, Lay::BYTES, stream, v.pdl, a);
}

// Three input stages where the device's shared memory per block allows (H100 / H200: 227 KB),
// else two (A100: 163 KB).
template <int DK, int NC>
void launch_state_stages(const ChunkArgs& a, cudaStream_t stream, int smem_optin, const Variant& v) {
  if (!v.two_stages && smem_optin >= StateLayout<DK, NC, 3>::BYTES) launch_state<DK, NC, 3>(a, stream, v);
  else launch_state<DK, NC, 2>(a, stream, v);
}

template <int DK>
void launch_dk(const ChunkArgs& a, int64_t slots, cudaStream_t stream, int smem_optin, const Variant& v) {
  if (v.prep && a.N > 0) {
    constexpr int smem = prep_smem_bytes<DK>();
    DFLASH_CUDA_CHECK(
        cudaFuncSetAttribute(gdn_chunk_prep_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 grid(static_cast<unsigned>(slots), static_cast<unsigned>(v.prep_per_value ? a.Hv : a.Hk));
    gdn_chunk_prep_kernel<DK><<<grid, kPrepThreads, smem, stream>>>(a);
    DFLASH_CUDA_CHECK_LAST();
  }
  if (v.state) {
    if (v.cols32) launch_state_stages<DK, 32>(a, stream, smem_optin, v);
    else launch_state_stages<DK, 64>(a, stream, smem_optin, v);
  }
}

}  // namespace

bool chunk_gated_delta_rule_supported(int64_t dk, int64_t dv, int sm_major) {
  return sm_major >= 8 && (dk == 64 || dk == 128) && dv >= kDvs && dv % kDvs == 0 && dv <= 4096;
}

// Test hook (not in gdn.h) for timing breakdowns and variants: flags 2 = skip the prep kernel,
// 4 = skip the state kernel, 8 = two input stages in the state kernel, 16 = 32-column state
// slices, 64 = one prep CTA per value head, 128 = state kernel as a programmatic dependent launch
// of prep (bits 0 and 5 are unused). 0 is the full op.
void chunk_gated_delta_rule_variant(const DeltaRuleParams& p, Stream s, int flags) {
  const char* op = "chunk_gated_delta_rule";
  DFLASH_CHECK(p.N >= 0 && p.num_seqs >= 0, op << ": N = " << p.N << " and num_seqs = " << p.num_seqs
                                                << " must be non-negative");
  if (p.num_seqs == 0) {
    DFLASH_CHECK(p.N == 0, op << ": " << p.N << " tokens but no sequences");
    return;
  }
  DFLASH_CHECK(p.Hk >= 1 && p.Hv >= p.Hk && p.Hv % p.Hk == 0 && p.Hv <= 65535,
               op << ": " << p.Hv << " value heads must be a positive multiple of " << p.Hk << " key heads (<= 65535)");
  int dev = 0, major = 0, smem_optin = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  DFLASH_CHECK(chunk_gated_delta_rule_supported(p.dk, p.dv, major),
               op << ": dk = " << p.dk << ", dv = " << p.dv << " on sm_" << major
                  << "x is not supported (dk in {64, 128}, dv a multiple of 64, sm >= 80); use "
                     "recurrent_gated_delta_rule");
  DFLASH_CHECK(p.ldv >= p.Hv * p.dv && p.ldv % 8 == 0,
               op << ": v row stride ldv = " << p.ldv << " must be >= Hv * dv = " << p.Hv * p.dv
                  << " and a multiple of 8 elements");
  DFLASH_CHECK(p.num_seqs == 1 || p.cu_seqlens != nullptr,
               op << ": cu_seqlens is required for " << p.num_seqs << " sequences");
  DFLASH_CHECK(p.num_seqs <= INT32_MAX, op << ": " << p.num_seqs << " sequences is too many");
  if (p.N > 0)
    DFLASH_CHECK(p.q && p.k && p.v && p.g && p.beta && p.out, op << ": q, k, v, g, beta and out must be non-null");
  DFLASH_CHECK(aligned(p.q, 16) && aligned(p.k, 16) && aligned(p.v, 16) && aligned(p.out, 16),
               op << ": q, k, v and out must be 16-byte aligned");
  DFLASH_CHECK(aligned(p.initial_state, 8) && aligned(p.final_state, 8),
               op << ": initial_state / final_state must be 8-byte aligned");

  const int64_t slots = p.N / kC + p.num_seqs + 1;
  DFLASH_CHECK(slots <= INT32_MAX, op << ": " << p.N << " tokens is too many");
  const size_t tile_bytes = static_cast<size_t>(slots * p.Hv) * kTileElems * sizeof(bf16);
  const size_t gb_bytes = static_cast<size_t>(slots * p.Hv) * kGB * sizeof(float);
  Scratch scratch(2 * tile_bytes + gb_bytes, dev);

  ChunkArgs a{};
  a.q = static_cast<const bf16*>(p.q);
  a.k = static_cast<const bf16*>(p.k);
  a.v = static_cast<const bf16*>(p.v);
  a.ldv = p.ldv;
  a.g = p.g;
  a.beta = p.beta;
  a.init = p.initial_state;
  a.final_state = p.final_state;
  a.out = static_cast<bf16*>(p.out);
  a.cu = p.cu_seqlens;
  a.num_seqs = p.num_seqs;
  a.N = p.N;
  a.Hk = static_cast<int>(p.Hk);
  a.Hv = static_cast<int>(p.Hv);
  a.dv = static_cast<int>(p.dv);
  a.Tg = static_cast<bf16*>(scratch.ptr);
  a.Pg = reinterpret_cast<bf16*>(static_cast<char*>(scratch.ptr) + tile_bytes);
  a.GBg = reinterpret_cast<float*>(static_cast<char*>(scratch.ptr) + 2 * tile_bytes);

  auto stream = static_cast<cudaStream_t>(s);
  Variant v;
  v.prep = !(flags & 2);
  v.state = !(flags & 4);
  v.two_stages = (flags & 8) != 0;
  v.cols32 = (flags & 16) != 0;
  v.prep_per_value = (flags & 64) != 0;
  v.pdl = (flags & 128) != 0;
  if (p.dk == 128) launch_dk<128>(a, slots, stream, smem_optin, v);
  else launch_dk<64>(a, slots, stream, smem_optin, v);
}

void chunk_gated_delta_rule(const DeltaRuleParams& p, Stream s) { chunk_gated_delta_rule_variant(p, s, 0); }

}  // namespace dflash::cuda
