// Chunked gated delta rule forward (GatedDeltaNet core) on tensor cores: mma.sync m16n8k16 bf16
// with fp32 accumulation, ldmatrix operand loads, cp.async double-buffered inputs, fp32 state.
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
//  (1) gdn_chunk_prep: one CTA (4 warps) per (chunk slot, value head). K K^T and Q K^T (lower
//      block-triangle only, 20 m16n8 tiles) on tensor cores, kept in registers; the decays and beta
//      are applied; T is computed in fp32 in shared memory (16x16 diagonal blocks by forward
//      substitution, then the off-diagonal blocks T_ij = -T_ii sum_k A_ik T_kj, block row by block
//      row); T, P (bf16 64x64) and G, beta (fp32) go to a scratch buffer. Parallel over chunks.
//  (2) gdn_chunk_state: one CTA (8 warps) per (sequence, value head, 64-column dv slice), running
//      sequentially over the sequence's chunks with the fp32 state slice S [dk, 64] in registers
//      (each warp owns 16 dk rows x 64 cols, or 16 x 32 for dk = 64) and a bf16 copy in shared
//      memory as the mma operand. Per chunk: [K; Q] S (one 128-row product), Y = beta (V - e^G K S),
//      V' = T Y, O = e^G Q S + P V' (staged in smem, written with 16-byte stores), S update. The
//      next chunk's K, Q, V, T, P, G, beta stream in with cp.async (double buffer) meanwhile.
//      Warp w works on token rows 16 mt.. (mt = w < 4 ? w : 7 - w) and value columns 32 (w / 4)..
//
// Precision: every tensor-core operand is bf16 (K, Q, V, S, Y, T, P, V'), accumulation and the
// state are fp32. Feeding S to the mma as bf16 hi + lo (two products) was measured on the H200 and
// did not reduce the error (the other bf16 operands dominate: out ~5e-3, final state ~4e-3
// normalized vs the fp32 reference) while costing 10%, so it was dropped.
//
// Chunk slots: chunk c of sequence s (tokens bos_s + 64 c ..) uses scratch slot bos_s / 64 + s + c.
// These never collide (ceil(l / 64) <= floor((b + l) / 64) - floor(b / 64) + 1) and stay below
// N / 64 + num_seqs + 1, so neither kernel needs a prefix sum over the device-side cu_seqlens.
//
// Roofline (Qwen3.6-27B GDN layer: Hk = 16, Hv = 48, dk = dv = d = 128, C = 64, H200):
//  FLOPs, dense-equivalent count of the chunked form (as fla counts it), per token and value head:
//    2 C (3 dk + 2 dv) + 6 dk dv   = 180,224  ->  T = 8192: 70.9 GFLOP; T = 2048: 17.7 GFLOP.
//  This implementation does 4 C dk + 4 C dv + 6 dk dv per token-head (K K^T and Q K^T per value
//  head, W and U never formed; triangles counted dense) = 164k, 64.4 GFLOP at T = 8192. At ~600
//  TFLOP/s (mma.sync bf16) that is ~0.11 ms; kernel (2) has only Hv * dv / 64 = 96 CTAs for one
//  sequence, so it runs on 96 of the 132 SMs.
//  Bytes (each input read once, output written once): q, k 2 N Hk dk 2 B, v and out N Hv dv 2 B
//  each, g and beta N Hv 4 B each (+ states): T = 8192: 271.6 MB -> 0.063 ms at 4.3 TB/s.
//  Scratch: T and P bf16 (16 KB) + G, beta (512 B) per chunk and value head, written once by (1) and
//  read by each dv slice of (2) (mostly from L2): 102 MB at T = 8192.
//  So the op is bound by the latency of the chunk recurrence and by shared memory, not by DRAM.
//
// Measured on the H200 (Hk = 16, Hv = 48, d = 128; ms; TFLOP/s by the dense-equivalent count):
//    1 x 2048: 0.157 (prep 0.060, state 0.098)     113 TFLOP/s, 0.43 TB/s
//    1 x 8192: 0.595 (prep 0.217, state 0.378)     119 TFLOP/s, 0.46 TB/s   (fla Triton: 1.28)
//   1 x 32768: 2.36  (prep 0.84,  state 1.50)      120 TFLOP/s
//    8 x 1024: 0.512 (prep 0.218, state 0.294)     138 TFLOP/s
// Where the time goes (ncu at T = 2048): prep is shared-memory bound (L1/smem pipe 83% busy: the
// scalar fp32 block inverse reads two smem words per FMA; 4 CTAs per SM, issue 0.44 per scheduler);
// state is latency bound (96 CTAs of 8 warps on 96 of 132 SMs, 2 warps per scheduler, no eligible
// warp 72% of cycles, ~5,400 cycles per 64-token chunk for ~128 mma per warp plus 3 barriers).
// Next steps: the off-diagonal inverse blocks on tensor cores (or register-blocked), and a shorter
// recurrence (wgmma for [K; Q] S, or moving Q S and P V' to a chunk-parallel output kernel).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ptx.cuh"
#include "kernels/device.h"
#include "kernels/error.h"

namespace dflash::cuda {

namespace {

using namespace ptx;

using bf16 = __nv_bfloat16;

constexpr int kC = 64;            // chunk length (tokens)
constexpr int kDvs = 64;          // value columns per CTA of the state kernel
constexpr int kLd = kC + 8;       // row stride (elements) of the 64-wide bf16 tiles: 144 B, ldmatrix conflict-free
constexpr int kLdA = kC + 1;      // row stride of the fp32 64x64 tiles of the prep kernel
constexpr int kPrepThreads = 128;
constexpr int kStateThreads = 256;
constexpr int64_t kTileElems = int64_t{kC} * kC;  // one T or P tile in the scratch

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

__device__ __forceinline__ float2 unpack_bf16(uint32_t u) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
}
__device__ __forceinline__ void st_u32(bf16* p, uint32_t v) { *reinterpret_cast<uint32_t*>(p) = v; }
__device__ __forceinline__ uint32_t ld_u32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

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
  bf16* Tg;             // [slots, Hv, 64, 64] scratch: T = (I + A)^-1
  bf16* Pg;             // [slots, Hv, 64, 64] scratch: P
  float* GBg;           // [slots, Hv, 2, 64] scratch: G (cumulative), beta (0 past the chunk end)
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


// ---- Kernel 1: per (chunk slot, value head): T, P, G, beta of the chunk --------------------------
// K K^T and Q K^T are recomputed for each value head of a key head (cheap) so that the fp32
// inverses run in separate CTAs. Shared memory (48.7 KB, 4 CTAs per SM): the K / Q tiles of the
// products and, after them, the fp32 A and T tiles share one region.
template <int DK>
constexpr int prep_union_bytes() {
  return 2 * kC * (DK + 8) * 2 > 2 * kC * kLdA * 4 ? 2 * kC * (DK + 8) * 2 : 2 * kC * kLdA * 4;
}
template <int DK>
constexpr int prep_smem_bytes() {
  return prep_union_bytes<DK>() + kC * kLd * 2 + 16 * kLdA * 4 + 2 * kC * 4;  // + P staging, R, G, beta
}

template <int DK>
__global__ void __launch_bounds__(kPrepThreads, 4) gdn_chunk_prep_kernel(const ChunkArgs a) {
  constexpr int LDK = DK + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Ks = reinterpret_cast<bf16*>(smem);                                // [64][LDK] (products)
  bf16* Qs = Ks + kC * LDK;                                                // [64][LDK] (products)
  float* Am = reinterpret_cast<float*>(smem);                              // [64][65] strictly lower A
  float* Tm = Am + kC * kLdA;                                              // [64][65] T, fp32
  bf16* Pst = reinterpret_cast<bf16*>(smem + prep_union_bytes<DK>());     // [64][kLd] P staging
  float* Rm = reinterpret_cast<float*>(Pst + kC * kLd);                    // [16][65]
  float* Gs = Rm + 16 * kLdA;                                              // [64]
  float* Bs = Gs + kC;                                                     // [64]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t slot = blockIdx.x;
  const int h = blockIdx.y, kh = h / (a.Hv / a.Hk);

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
  if (warp == 0) {  // G (inclusive cumsum of g, constant past L) and beta (0 past L) meanwhile
    const int i0 = 2 * lane, i1 = i0 + 1;
    float g0 = 0.0f, g1 = 0.0f, b0 = 0.0f, b1 = 0.0f;
    if (i0 < L) {
      g0 = a.g[(t0 + i0) * a.Hv + h];
      b0 = a.beta[(t0 + i0) * a.Hv + h];
    }
    if (i1 < L) {
      g1 = a.g[(t0 + i1) * a.Hv + h];
      b1 = a.beta[(t0 + i1) * a.Hv + h];
    }
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
  }
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
      uint32_t ak[4], aq[4], b0, b1;
      const int arow = 16 * mt + (lane & 15), acol = 16 * ks + (lane >> 4) * 8;
      ldmatrix_x4(ak, Ks + arow * LDK + acol);
      ldmatrix_x4(aq, Qs + arow * LDK + acol);
      ldmatrix_x2(b0, b1, Ks + (8 * nt + (lane & 7)) * LDK + 16 * ks + ((lane >> 3) & 1) * 8);
      mma_bf16(kk[u], ak, b0, b1);
      mma_bf16(qk[u], aq, b0, b1);
    }
  }
  __syncthreads();  // the K / Q region becomes A / T

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
      Am[i * kLdA + j] = j < i ? Bs[i] * kk[u][e] * dec : 0.0f;
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
    const float* Ab = Am + 16 * b * kLdA + 16 * b;
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float acc = i == col ? 1.0f : 0.0f;
#pragma unroll
      for (int j = 0; j < i; ++j) acc -= Ab[i * kLdA + j] * x[j];
      x[i] = acc;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) Tm[(16 * b + i) * kLdA + 16 * b + col] = x[i];
  } else {
    // Meanwhile: P (zero above the diagonal blocks), G and beta to the scratch.
    for (int idx = tid - 64; idx < kC * 8; idx += 64) {
      const int i = idx >> 3, cc = idx & 7;
      uint4 pv = make_uint4(0, 0, 0, 0);
      if (cc < 2 * ((i >> 4) + 1)) pv = *reinterpret_cast<const uint4*>(Pst + i * kLd + cc * 8);
      *reinterpret_cast<uint4*>(a.Pg + base + i * kC + cc * 8) = pv;
    }
    for (int idx = tid - 64; idx < 2 * kC; idx += 64)
      a.GBg[(slot * a.Hv + h) * 2 * kC + idx] = idx < kC ? Gs[idx] : Bs[idx - kC];
  }
  __syncthreads();

  // Off-diagonal blocks, block row bi = 1..3: R_ij = sum_{k=j}^{i-1} A_ik T_kj, T_ij = -T_ii R_ij.
  for (int bi = 1; bi < 4; ++bi) {
    const int nel = bi * 256;
    for (int e = tid; e < nel; e += kPrepThreads) {
      const int bj = e >> 8, rr = (e >> 4) & 15, cc = e & 15;
      const float* arow = Am + (16 * bi + rr) * kLdA;
      const float* tcol = Tm + 16 * bj + cc;
      float acc0 = 0.0f, acc1 = 0.0f;
      for (int kb = bj; kb < bi; ++kb) {
#pragma unroll
        for (int x = 0; x < 16; x += 2) {
          acc0 += arow[16 * kb + x] * tcol[(16 * kb + x) * kLdA];
          acc1 += arow[16 * kb + x + 1] * tcol[(16 * kb + x + 1) * kLdA];
        }
      }
      Rm[rr * kLdA + 16 * bj + cc] = acc0 + acc1;
    }
    __syncthreads();
    for (int e = tid; e < nel; e += kPrepThreads) {
      const int bj = e >> 8, rr = (e >> 4) & 15, cc = e & 15;
      const float* trow = Tm + (16 * bi + rr) * kLdA + 16 * bi;  // zero right of the diagonal
      float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
      for (int s2 = 0; s2 < 16; s2 += 2) {
        acc0 += trow[s2] * Rm[s2 * kLdA + 16 * bj + cc];
        acc1 += trow[s2 + 1] * Rm[(s2 + 1) * kLdA + 16 * bj + cc];
      }
      Tm[(16 * bi + rr) * kLdA + 16 * bj + cc] = -(acc0 + acc1);
    }
    __syncthreads();
  }

  for (int idx = tid; idx < kC * 8; idx += kPrepThreads) {
    const int i = idx >> 3, cc = idx & 7;
    uint4 tv = make_uint4(0, 0, 0, 0);
    if (cc < 2 * ((i >> 4) + 1)) {
      const float* tr = Tm + i * kLdA + cc * 8;
      tv = make_uint4(pack_bf16(tr[0], tr[1]), pack_bf16(tr[2], tr[3]), pack_bf16(tr[4], tr[5]),
                      pack_bf16(tr[6], tr[7]));
    }
    *reinterpret_cast<uint4*>(a.Tg + base + i * kC + cc * 8) = tv;
  }
}

// ---- Kernel 2: per (sequence, value head, dv slice): the sequential chunk recurrence ------------
// Loads use per-thread offsets computed once; the token m-tiles are assigned so that the two warps
// sharing a scheduler (w, w + 4) hold mt and 3 - mt (the triangular phases 2 and 3a balance).
template <int DK>
constexpr int state_stage_bytes() {
  return 2 * kC * (DK + 8) * 2 + 3 * kC * kLd * 2 + 2 * kC * 4;  // K, Q, T, P, V, G + beta
}
template <int DK>
constexpr int state_smem_bytes() {
  return 2 * state_stage_bytes<DK>() + DK * kLd * 2 + 3 * kC * kLd * 2;  // stages, S, Y, V', V'd
}

template <int DK>
__global__ void __launch_bounds__(kStateThreads, 1) gdn_chunk_state_kernel(const ChunkArgs a) {
  constexpr int LDK = DK + 8;
  constexpr int STAGE = state_stage_bytes<DK>();
  constexpr int SMT = DK / 16;
  constexpr int SNT = SMT;
  constexpr int CPR = DK / 8;                // 16-byte chunks per K / Q row
  constexpr int RPP = kStateThreads / CPR;   // K / Q rows per pass (16 or 32)
  constexpr int OFF_Q = kC * LDK * 2, OFF_T = 2 * kC * LDK * 2;  // byte offsets inside a stage
  constexpr int OFF_P = OFF_T + kC * kLd * 2, OFF_V = OFF_P + kC * kLd * 2, OFF_GB = OFF_V + kC * kLd * 2;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Sb = reinterpret_cast<bf16*>(smem + 2 * STAGE);  // [DK][kLd] bf16(S)
  bf16* Yb = Sb + DK * kLd;                               // [64][kLd] Y, then the O staging
  bf16* Vp = Yb + kC * kLd;                               // [64][kLd] V'
  bf16* Vd = Vp + kC * kLd;                               // [64][kLd] exp(G_last - G) V'

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int mt = warp < 4 ? warp : 7 - warp, nh = warp >> 2;
  const int sm = warp % SMT, sn0 = (warp / SMT) * SNT;
  const int64_t s = blockIdx.x;
  const int h = blockIdx.y, slice = blockIdx.z;
  const int kh = h / (a.Hv / a.Hk);
  const int col0 = slice * kDvs;

  int64_t bos, eos;
  seq_bounds(a, s, bos, eos);
  const int nc = static_cast<int>((eos - bos + kC - 1) / kC);
  const int64_t slot0 = first_slot(a, s);

  float S[SNT][4];
  const int64_t state_off = (s * a.Hv + h) * int64_t{DK} * a.dv + col0;
#pragma unroll
  for (int nt = 0; nt < SNT; ++nt) {
    const int r0 = 16 * sm + gq, cl = 8 * (sn0 + nt) + 2 * tq;
    if (a.init != nullptr) {
      const float2 x0 = *reinterpret_cast<const float2*>(a.init + state_off + int64_t{r0} * a.dv + cl);
      const float2 x1 = *reinterpret_cast<const float2*>(a.init + state_off + int64_t{r0 + 8} * a.dv + cl);
      S[nt][0] = x0.x, S[nt][1] = x0.y, S[nt][2] = x1.x, S[nt][3] = x1.y;
    } else {
      S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
    }
  }
  auto store_state_operand = [&]() {
#pragma unroll
    for (int nt = 0; nt < SNT; ++nt) {
      const int r0 = 16 * sm + gq, cl = 8 * (sn0 + nt) + 2 * tq;
      st_u32(Sb + r0 * kLd + cl, pack_bf16(S[nt][0], S[nt][1]));
      st_u32(Sb + (r0 + 8) * kLd + cl, pack_bf16(S[nt][2], S[nt][3]));
    }
  };
  store_state_operand();

  // Per-thread load plan: K / Q rows kq_r + m RPP, chunk kq_c; V / T / P rows vr, vr + 32, chunk vc.
  const int kq_r = tid / CPR, kq_c = tid % CPR, vr = tid >> 3, vc = tid & 7;
  const int64_t kq_off = (int64_t{kq_r} * a.Hk + kh) * DK + kq_c * 8, kq_step = int64_t{RPP} * a.Hk * DK;
  const int64_t v_off = int64_t{vr} * a.ldv + int64_t{h} * a.dv + col0 + vc * 8, v_step = 32 * a.ldv;
  const uint32_t smem0 = smem_addr(smem);
  const uint32_t kq_dst = (kq_r * LDK + kq_c * 8) * 2, v_dst = (vr * kLd + vc * 8) * 2;
  auto load_chunk = [&](int c, int st) {
    const int64_t t0 = bos + int64_t{c} * kC;
    const int L = static_cast<int>(std::min<int64_t>(kC, eos - t0));
    const uint32_t sb = smem0 + st * STAGE;
    const bf16* kp = a.k + t0 * a.Hk * DK + kq_off;
    const bf16* qp = a.q + t0 * a.Hk * DK + kq_off;
#pragma unroll
    for (int m = 0; m < kC / RPP; ++m) {
      const bool valid = kq_r + m * RPP < L;
      cp_async16_s(sb + kq_dst + m * RPP * LDK * 2, valid ? kp + m * kq_step : a.k, valid);
      cp_async16_s(sb + OFF_Q + kq_dst + m * RPP * LDK * 2, valid ? qp + m * kq_step : a.q, valid);
    }
    const bf16* vp = a.v + t0 * a.ldv + v_off;
    const int64_t tile = ((slot0 + c) * a.Hv + h) * kTileElems + tid * 8;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const bool valid = vr + 32 * m < L;
      cp_async16_s(sb + OFF_V + v_dst + m * 32 * kLd * 2, valid ? vp + m * v_step : a.v, valid);
      cp_async16_s(sb + OFF_T + v_dst + m * 32 * kLd * 2, a.Tg + tile + m * 32 * kC, true);
      cp_async16_s(sb + OFF_P + v_dst + m * 32 * kLd * 2, a.Pg + tile + m * 32 * kC, true);
    }
    if (tid < 2 * kC / 4)
      cp_async16_s(sb + OFF_GB + 16 * tid, a.GBg + ((slot0 + c) * a.Hv + h) * 2 * kC + 4 * tid, true);
    cp_async_commit();
  };

  if (nc > 0) load_chunk(0, 0);
  for (int c = 0; c < nc; ++c) {
    const int st = c & 1;
    cp_async_wait_all();
    __syncthreads();  // chunk c landed; the previous chunk (S operand, stage st ^ 1) is done
    if (c + 1 < nc) load_chunk(c + 1, st ^ 1);

    const bf16* ks = reinterpret_cast<const bf16*>(smem + st * STAGE);
    const bf16* qs = ks + kC * LDK;
    const bf16* ts = qs + kC * LDK;
    const bf16* ps = ts + kC * kLd;
    const bf16* vs = ps + kC * kLd;
    const float* Gc = reinterpret_cast<const float*>(vs + kC * kLd);
    const float* Bc = Gc + kC;
    const int64_t t0 = bos + int64_t{c} * kC;
    const int L = static_cast<int>(std::min<int64_t>(kC, eos - t0));
    const int i0 = 16 * mt + gq, i1 = i0 + 8;

    // Phase 1: X = K S and O = Q S for token rows i0 / i1, columns 32 nh .. 32 nh + 31.
    float xk[4][4], oq[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) xk[nt][e] = oq[nt][e] = 0.0f;
#pragma unroll
    for (int kx = 0; kx < DK / 16; ++kx) {
      uint32_t ak[4], aq[4];
      const int arow = 16 * mt + (lane & 15), acol = 16 * kx + (lane >> 4) * 8;
      ldmatrix_x4(ak, ks + arow * LDK + acol);
      ldmatrix_x4(aq, qs + arow * LDK + acol);
      const int brow = 16 * kx + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, Sb + brow * kLd + 32 * nh + 16 * np + (lane >> 4) * 8);
        mma_bf16(xk[2 * np], ak, b[0], b[1]);
        mma_bf16(xk[2 * np + 1], ak, b[2], b[3]);
        mma_bf16(oq[2 * np], aq, b[0], b[1]);
        mma_bf16(oq[2 * np + 1], aq, b[2], b[3]);
      }
    }
    {
      const float e0 = expf(Gc[i0]), e1 = expf(Gc[i1]), b0 = Bc[i0], b1 = Bc[i1];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int cl = 32 * nh + 8 * nt + 2 * tq;
        const float2 v0 = unpack_bf16(ld_u32(vs + i0 * kLd + cl)), v1 = unpack_bf16(ld_u32(vs + i1 * kLd + cl));
        st_u32(Yb + i0 * kLd + cl, pack_bf16(b0 * (v0.x - e0 * xk[nt][0]), b0 * (v0.y - e0 * xk[nt][1])));
        st_u32(Yb + i1 * kLd + cl, pack_bf16(b1 * (v1.x - e1 * xk[nt][2]), b1 * (v1.y - e1 * xk[nt][3])));
        oq[nt][0] *= e0, oq[nt][1] *= e0, oq[nt][2] *= e1, oq[nt][3] *= e1;
      }
    }
    __syncthreads();

    // Phase 2: V' = T Y (T unit lower: k-tiles 0..mt).
    const float glast = Gc[kC - 1];
    {
      float vp[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) vp[nt][e] = 0.0f;
#pragma unroll
      for (int kx = 0; kx < 4; ++kx) {
        if (kx > mt) break;
        uint32_t at[4];
        ldmatrix_x4(at, ts + (16 * mt + (lane & 15)) * kLd + 16 * kx + (lane >> 4) * 8);
        const int brow = 16 * kx + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, Yb + brow * kLd + 32 * nh + 16 * np + (lane >> 4) * 8);
          mma_bf16(vp[2 * np], at, b[0], b[1]);
          mma_bf16(vp[2 * np + 1], at, b[2], b[3]);
        }
      }
      const float d0 = expf(glast - Gc[i0]), d1 = expf(glast - Gc[i1]);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int cl = 32 * nh + 8 * nt + 2 * tq;
        st_u32(Vp + i0 * kLd + cl, pack_bf16(vp[nt][0], vp[nt][1]));
        st_u32(Vp + i1 * kLd + cl, pack_bf16(vp[nt][2], vp[nt][3]));
        st_u32(Vd + i0 * kLd + cl, pack_bf16(d0 * vp[nt][0], d0 * vp[nt][1]));
        st_u32(Vd + i1 * kLd + cl, pack_bf16(d1 * vp[nt][2], d1 * vp[nt][3]));
      }
    }
    __syncthreads();

    // Phase 3a: O += P V', staged in this warp's block of Yb, then 16-byte stores of rows < L.
#pragma unroll
    for (int kx = 0; kx < 4; ++kx) {
      if (kx > mt) break;
      uint32_t ap[4];
      ldmatrix_x4(ap, ps + (16 * mt + (lane & 15)) * kLd + 16 * kx + (lane >> 4) * 8);
      const int brow = 16 * kx + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, Vp + brow * kLd + 32 * nh + 16 * np + (lane >> 4) * 8);
        mma_bf16(oq[2 * np], ap, b[0], b[1]);
        mma_bf16(oq[2 * np + 1], ap, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int cl = 32 * nh + 8 * nt + 2 * tq;
      st_u32(Yb + i0 * kLd + cl, pack_bf16(oq[nt][0], oq[nt][1]));
      st_u32(Yb + i1 * kLd + cl, pack_bf16(oq[nt][2], oq[nt][3]));
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int idx = lane + 32 * u;
      const int r = 16 * mt + (idx >> 2), cl = 32 * nh + (idx & 3) * 8;
      if (r < L)
        *reinterpret_cast<uint4*>(a.out + ((t0 + r) * a.Hv + h) * a.dv + col0 + cl) =
            *reinterpret_cast<const uint4*>(Yb + r * kLd + cl);
    }

    // Phase 3b: S = exp(G_last) S + K^T (exp(G_last - G) V').
    {
      const float eg = expf(glast);
#pragma unroll
      for (int nt = 0; nt < SNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[nt][e] *= eg;
#pragma unroll
      for (int kx = 0; kx < 4; ++kx) {
        uint32_t ak[4];
        ldmatrix_x4_trans(ak, ks + (16 * kx + (lane & 7) + ((lane >> 4) << 3)) * LDK + 16 * sm + ((lane >> 3) & 1) * 8);
        const int brow = 16 * kx + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int np = 0; np < SNT / 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, Vd + brow * kLd + 8 * sn0 + 16 * np + (lane >> 4) * 8);
          mma_bf16(S[2 * np], ak, b[0], b[1]);
          mma_bf16(S[2 * np + 1], ak, b[2], b[3]);
        }
      }
    }
    store_state_operand();
  }

  if (a.final_state != nullptr) {
#pragma unroll
    for (int nt = 0; nt < SNT; ++nt) {
      const int r0 = 16 * sm + gq, cl = 8 * (sn0 + nt) + 2 * tq;
      *reinterpret_cast<float2*>(a.final_state + state_off + int64_t{r0} * a.dv + cl) = make_float2(S[nt][0], S[nt][1]);
      *reinterpret_cast<float2*>(a.final_state + state_off + int64_t{r0 + 8} * a.dv + cl) =
          make_float2(S[nt][2], S[nt][3]);
    }
  }
}

// ---- Host side ----------------------------------------------------------------------------------

bool aligned(const void* p, size_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

// Scratch for T, P, G/beta from the caching allocator. It is released when the launcher returns,
// before the kernels run: device_alloc hands blocks out again in stream order, which is safe as
// long as all dflash work is issued on the device context's stream (kernels/device.h).
struct Scratch {
  void* ptr = nullptr;
  int device = 0;
  Scratch(size_t bytes, int dev) : device(dev) { ptr = device_alloc::allocate(bytes, dev); }
  ~Scratch() { device_alloc::release(ptr, device); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

template <int DK>
void launch_dk(const ChunkArgs& a, int64_t slots, cudaStream_t stream, bool run_prep, bool run_state) {
  if (run_prep && a.N > 0) {
    constexpr int smem = prep_smem_bytes<DK>();
    DFLASH_CUDA_CHECK(
        cudaFuncSetAttribute(gdn_chunk_prep_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    gdn_chunk_prep_kernel<DK><<<dim3(static_cast<unsigned>(slots), static_cast<unsigned>(a.Hv)), kPrepThreads, smem,
                                stream>>>(a);
    DFLASH_CUDA_CHECK_LAST();
  }
  if (run_state) {
    const dim3 grid(static_cast<unsigned>(a.num_seqs), static_cast<unsigned>(a.Hv), static_cast<unsigned>(a.dv / kDvs));
    constexpr int smem = state_smem_bytes<DK>();
    DFLASH_CUDA_CHECK(
        cudaFuncSetAttribute(gdn_chunk_state_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    gdn_chunk_state_kernel<DK><<<grid, kStateThreads, smem, stream>>>(a);
    DFLASH_CUDA_CHECK_LAST();
  }
}

}  // namespace

bool chunk_gated_delta_rule_supported(int64_t dk, int64_t dv, int sm_major) {
  return sm_major >= 8 && (dk == 64 || dk == 128) && dv >= kDvs && dv % kDvs == 0 && dv <= 4096;
}

// Test hook (not in launch.h) for timing breakdowns: flags bit 1 = skip the prep kernel, bit 2 =
// skip the state kernel (bit 0 is unused). 0 is the full op.
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
  int dev = 0, major = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
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
  const size_t gb_bytes = static_cast<size_t>(slots * p.Hv) * 2 * kC * sizeof(float);
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
  const bool run_prep = !(flags & 2), run_state = !(flags & 4);
  if (p.dk == 128) launch_dk<128>(a, slots, stream, run_prep, run_state);
  else launch_dk<64>(a, slots, stream, run_prep, run_state);
}

void chunk_gated_delta_rule(const DeltaRuleParams& p, Stream s) { chunk_gated_delta_rule_variant(p, s, 0); }

}  // namespace dflash::cuda
