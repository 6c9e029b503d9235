// Causal softmax attention (GQA, varlen) for the target's full-attention layers: bf16 q/k/v/out,
// fp32 softmax and accumulation.
//
// flash_attention_fwd: FlashAttention-2 forward. One CTA owns BLOCK_M query rows of one (sequence,
// query head); each of its warps owns 16 rows and keeps its O accumulator [16, d] in registers.
// Key/value tiles of BLOCK_N rows stream through shared memory (cp.async, two stages: tile j-1 is
// in flight while tile j is computed), from the diagonal tile down to tile 0, so only the first
// tiles need the causal mask, tiles fully above the diagonal are never loaded, and a warp skips the
// math of a loaded tile that lies entirely above its own rows. S = Q Kᵀ and O += P V run on the
// tensor cores (mma.sync m16n8k16 bf16, f32 accumulate; operands by ldmatrix, .trans for V); the
// row max / row sum of the online softmax stay in fp32, with the scale folded into exp2
// (p = 2^(s · scale · log2 e − m)); P is rounded to bf16 for P V. Shared tiles use an XOR swizzle
// of the 16-byte chunks of each row (chunk ^ (row & 7)), so ldmatrix and the cp.async writes are
// free of bank conflicts. No T×T matrix exists anywhere.
//   d = 64, 128: 4 warps (BLOCK_M 64), BLOCK_N 64, Q fragments in registers, 40 / 80 KB shared;
//   d = 256:     8 warps (BLOCK_M 128), BLOCK_N 32, Q re-read from shared memory, 128 KB shared.
// Grid: (Hq, ceil(max_seqlen / BLOCK_M), num_seqs), with the query-block index reversed so that
// the longest blocks (those at the end of a sequence) are scheduled first across all heads.
//
// Roofline (Qwen3.6-27B attention prefill, T = 8192 tokens, Hq = 24, Hkv = 4, d = 256, causal):
//   FLOPs = 4 · T²/2 · d · Hq = 0.82 TFLOP; H200 dense bf16 ≈ 990 TFLOP/s (wgmma) → ≥ 0.83 ms.
//   Bytes: q + out = 2 · T·Hq·d·2 = 201 MB, k + v = 34 MB, ≈ 0.24 GB at 4.8 TB/s → 0.05 ms.
//   Compute-bound; K/V re-reads (per query block and head) hit L2 (k + v = 34 MB < 50 MB L2).
//   With mma.sync the binding limit is shared-memory bandwidth: per warp and key tile of 32 keys
//   a warp reads Q (16·256), K and V (2·32·256) bf16 through ldmatrix = 40 KB for 0.52 MFLOP,
//   12.8 FLOP/B · 128 B/clk/SM · 132 SMs · 1.98 GHz ≈ 430 TFLOP/s, less the cp.async tile writes.
//   Measured (H200): d = 256 3.12 ms = 264 TFLOP/s; d = 128 1.35 ms = 306; d = 64 0.73 ms = 284
//   (tests/test_cuda_attention.cpp TimingPrintOnly). The fallback: 226 ms at d = 256 (3.7 TFLOP/s).
//   Going well beyond this needs wgmma (sm_90a) with operands straight from shared memory: that
//   kernel is attention_sm90.cu, which flash_attention_fwd runs instead of this one on sm_90 for
//   d = 128 and 256 (AttentionParams::impl forces either).
//
// attention_fallback: one CTA per (query token, query head); the key range of its sequence is
// walked in chunks of 64 keys: one warp per key computes the dot product (lanes over d), then the
// whole CTA does the online-softmax update and threads over d accumulate p · v in shared memory.
// Plain fp32 arithmetic, any d, any architecture; about T/2 · d · 4 FLOPs per (token, head) at
// CUDA-core speed with k/v rows re-read from L2 per query token.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda/check.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/flash_tile.cuh"
#include "kernels/cuda/ptx.cuh"
#include "core/error.h"

namespace dflash::cuda {

namespace {

using namespace ptx;
using namespace flash;

using bf16 = __nv_bfloat16;

// ---- validation shared by both launchers ---------------------------------------------------------
void validate(const AttentionParams& p, const char* op) {
  DFLASH_CHECK(p.N >= 0 && p.num_seqs >= 1 && p.Hq > 0 && p.Hkv > 0 && p.d > 0,
               op << ": bad sizes N=" << p.N << " num_seqs=" << p.num_seqs << " Hq=" << p.Hq << " Hkv=" << p.Hkv
                  << " d=" << p.d);
  DFLASH_CHECK(p.Hq % p.Hkv == 0,
               op << ": " << p.Hq << " query heads are not a multiple of " << p.Hkv << " kv heads");
  DFLASH_CHECK(std::isfinite(p.scale) && p.scale > 0.0f, op << ": scale must be finite and > 0, got " << p.scale);
  DFLASH_CHECK(p.max_seqlen >= 0 && p.max_seqlen <= p.N,
               op << ": max_seqlen " << p.max_seqlen << " must lie in [0, N = " << p.N << "]");
  DFLASH_CHECK(p.Hq <= 65535, op << ": " << p.Hq << " query heads exceed the grid limit 65535");
  DFLASH_CHECK(p.N * p.Hq * p.d < (int64_t(1) << 62), op << ": tensor too large");
  if (p.N > 0)
    DFLASH_CHECK(p.q && p.k && p.v && p.out && p.cu_seqlens, op << ": null pointer (q, k, v, out or cu_seqlens)");
  for (int64_t ld : {p.ldk, p.ldv})
    DFLASH_CHECK(ld == 0 || ld >= p.Hkv * p.d,
                 op << ": k / v row stride " << ld << " is below the row's Hkv·d = " << p.Hkv * p.d << " elements");
}

// ---- flash forward --------------------------------------------------------------------------------
// Tiling of one instantiation: D head dim, BN keys per step, WARPS warps of 16 query rows each,
// Q fragments in registers (QREGS) or re-read from shared memory every key tile.
template <int D_, int BN_, int WARPS_, bool QREGS_>
struct FlashTiling {
  static constexpr int D = D_, kBlockN = BN_, kWarps = WARPS_;
  static constexpr bool kQInRegs = QREGS_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = 16 * kWarps;  // query rows per CTA
  static constexpr int kChunks = D / 8;        // 16-byte chunks per row
  static constexpr int kMinBlocks = kWarps <= 4 ? 2 : 1;  // CTAs per SM the register budget aims at
  static constexpr size_t kSmemBytes = size_t(kBlockM + 4 * kBlockN) * D * 2;  // Q + 2 stages of K, V
  static_assert(D % 64 == 0 && kBlockN % 16 == 0, "d must be a multiple of 64, BLOCK_N of 16");
};

// The instantiated tilings, measured on an H200 at T = 8192, Hq = 24, Hkv = 4 against neighbours
// (BLOCK_N 32/128, 8 warps, Q from shared memory). d = 256: O [16, 256] takes 128 registers per
// thread, so Q is re-read from shared memory and BLOCK_N is 32 (64 spills); 255 registers allow 8
// warps per SM either way, and one CTA of 8 warps (128 query rows) beat two CTAs of 4 (3.12 vs
// 3.26 ms), as each K/V tile is loaded once for twice the rows; BLOCK_N 16 was 4.16 ms. d = 128:
// 8 warps tied, Q from shared memory 1.52 vs 1.35 ms, BLOCK_N 32 slower; d = 64: BLOCK_N 128 tied.
template <int D> struct FlashCfg;
template <> struct FlashCfg<64> : FlashTiling<64, 64, 4, true> {};
template <> struct FlashCfg<128> : FlashTiling<128, 64, 4, true> {};
template <> struct FlashCfg<256> : FlashTiling<256, 32, 8, false> {};


// Copies rows [0, ROWS) of a [*, D] global matrix (row stride ld elements) into a swizzled tile;
// rows >= valid are zero-filled (their source address is row 0, which is always valid).
template <int D, int ROWS, int kThreads>
__device__ __forceinline__ void load_tile(bf16* s, const bf16* g, int64_t ld, int valid, int tid) {
  constexpr int kChunks = D / 8;
  static_assert((ROWS * kChunks) % kThreads == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int step = 0; step < ROWS * kChunks / kThreads; ++step) {
    const int i = step * kThreads + tid;
    const int r = i / kChunks, c = i % kChunks;
    const bool ok = r < valid;
    cp_async_16(s + swz<D>(r, c), g + (ok ? r : 0) * ld + c * 8, ok ? 16 : 0);
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) flash_fwd_kernel(const FlashArgs a) {
  constexpr int D = Cfg::D, BN = Cfg::kBlockN, kBlockM = Cfg::kBlockM, kThreads = Cfg::kThreads;
  constexpr int KS = D / 16;  // k-steps of S = Q Kᵀ (over d)
  constexpr int NT = BN / 8;  // n-tiles of S (8 keys each)
  constexpr int DT = D / 8;   // n-tiles of O (8 dims each)

  const int h = blockIdx.x;
  const int m_block = gridDim.y - 1 - blockIdx.y;  // longest blocks first
  const int seq = blockIdx.z;
  const int begin = a.cu_seqlens[seq];
  const int seqlen = a.cu_seqlens[seq + 1] - begin;
  const int m_start = m_block * kBlockM;
  if (m_start >= seqlen) return;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sK = sQ + kBlockM * D;  // [2][BN * D]
  bf16* sV = sK + 2 * BN * D;   // [2][BN * D]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int kh = h / a.group;
  const int64_t ldq = int64_t(a.Hq) * D;
  const bf16* qg = a.q + (int64_t(begin + m_start) * a.Hq + h) * D;
  const bf16* kg = a.k + int64_t(begin) * a.ldk + int64_t(kh) * D;
  const bf16* vg = a.v + int64_t(begin) * a.ldv + int64_t(kh) * D;

  // Key tiles [0, n_blocks): up to the diagonal of the last query row of this block.
  const int n_blocks = min((seqlen + BN - 1) / BN, (m_start + kBlockM + BN - 1) / BN);
  auto load_kv = [&](int j, int stage) {
    const int valid = min(BN, seqlen - j * BN);
    load_tile<D, BN, kThreads>(sK + stage * BN * D, kg + int64_t(j) * BN * a.ldk, a.ldk, valid, tid);
    load_tile<D, BN, kThreads>(sV + stage * BN * D, vg + int64_t(j) * BN * a.ldv, a.ldv, valid, tid);
  };

  // cp.async groups: G0 = Q, G1 = tile n_blocks-1, G2 = tile n_blocks-2 (maybe empty); iteration
  // `it` waits for all but the newest group, then commits the tile two steps ahead.
  load_tile<D, kBlockM, kThreads>(sQ, qg, ldq, min(kBlockM, seqlen - m_start), tid);
  cp_async_commit();
  load_kv(n_blocks - 1, 0);
  cp_async_commit();
  if (n_blocks >= 2) load_kv(n_blocks - 2, 1);
  cp_async_commit();

  // ldmatrix lane roles: A operand (Q) rows/chunks, B operand (K) rows/chunks, V (.trans).
  const int a_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int a_chk = lane >> 4;
  const int k_row = (lane & 7) + (lane >> 4) * 8;
  const int k_chk = (lane >> 3) & 1;
  const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int v_chk = lane >> 4;

  uint32_t qf[Cfg::kQInRegs ? KS : 1][4];
  if constexpr (Cfg::kQInRegs) {
    cp_async_wait<2>();
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) ldmatrix_x4(qf[ks], sQ + swz<D>(a_row, ks * 2 + a_chk));
  }

  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY;  // running max of rows g and g+8, in log2 units (· scale · log2 e)
  float l0 = 0.0f, l1 = 0.0f;            // running sums (this thread's columns only; quad-reduced at the end)

  const int g = lane >> 2, t = lane & 3;
  const int q_row0 = m_start + warp * 16 + g;  // query position (within the sequence) of c0/c1; +8 for c2/c3

  for (int it = 0; it < n_blocks; ++it) {
    const int j = n_blocks - 1 - it, stage = it & 1;
    const int n_start = j * BN;
    const bf16* tK = sK + stage * BN * D;
    const bf16* tV = sV + stage * BN * D;
    cp_async_wait<1>();
    __syncthreads();

    // A tile whose first key lies past this warp's last row contributes nothing (p = 0, alpha = 1):
    // skip its math (the CTA still loads it for the other warps).
    if (n_start <= m_start + warp * 16 + 15) {
      // S = Q Kᵀ  [16, BN] per warp
      float s[NT][4];
      qk_scores<NT, KS, D, Cfg::kQInRegs>(s, qf, sQ, a_row, a_chk, tK, k_row, k_chk);

      // Causal mask (and the end of the sequence) only where a key can exceed the warp's first row.
      if (n_start + BN - 1 > m_start + warp * 16 || n_start + BN > seqlen) {
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = n_start + i * 8 + 2 * t + (e & 1);
            const int qpos = q_row0 + (e >> 1) * 8;
            if (key > qpos || key >= seqlen) s[i][e] = -INFINITY;
          }
      }

      flash::softmax_tile_pv<NT, DT, D>(s, o, m0, m1, l0, l1, a.scale_log2, tV, v_row, v_chk);
    }

    __syncthreads();  // every warp is done with this stage before it is refilled
    if (j >= 2) load_kv(j - 2, stage);
    cp_async_commit();
  }

  // Normalise, stage the warp's 16 rows in its own rows of sQ (only this warp reads them), and
  // write them out with 16-byte stores.
  float inv0, inv1;
  flash::finish_rows(l0, l1, inv0, inv1);
  const int r0 = warp * 16 + g, r1 = r0 + 8;
#pragma unroll
  for (int i = 0; i < DT; ++i) {
    *reinterpret_cast<uint32_t*>(sQ + swz<D>(r0, i) + 2 * t) = pack_bf16(o[i][0] * inv0, o[i][1] * inv0);
    *reinterpret_cast<uint32_t*>(sQ + swz<D>(r1, i) + 2 * t) = pack_bf16(o[i][2] * inv1, o[i][3] * inv1);
  }
  __syncwarp();
  bf16* og = a.out + (int64_t(begin + m_start) * a.Hq + h) * D;
#pragma unroll
  for (int step = 0; step < Cfg::kChunks / 2; ++step) {  // 16 rows · kChunks chunks over 32 lanes
    const int i = step * 32 + lane;
    const int r = warp * 16 + i / Cfg::kChunks, c = i % Cfg::kChunks;
    if (m_start + r < seqlen)
      *reinterpret_cast<uint4*>(og + r * ldq + c * 8) = *reinterpret_cast<const uint4*>(sQ + swz<D>(r, c));
  }
}

template <class Cfg>
void launch_flash(const AttentionParams& p, cudaStream_t stream) {
  const auto kernel = flash_fwd_kernel<Cfg>;
  DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(Cfg::kSmemBytes)));
  const FlashArgs a = flash_args(p);
  const dim3 grid(static_cast<unsigned>(p.Hq), static_cast<unsigned>((p.max_seqlen + Cfg::kBlockM - 1) / Cfg::kBlockM),
                  static_cast<unsigned>(p.num_seqs));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(a);
  DFLASH_CUDA_CHECK_LAST();
}

// ---- fallback ---------------------------------------------------------------------------------------
constexpr int kFbThreads = 128;
constexpr int kFbChunk = 64;  // keys per online-softmax step

// No __launch_bounds__: with it ptxas squeezed this kernel to 40 registers and spilled.
__global__ void attention_fallback_kernel(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                          const bf16* __restrict__ v, bf16* __restrict__ out,
                                          const int32_t* __restrict__ cu_seqlens, int num_seqs, int Hq, int Hkv,
                                          int d, int64_t ldk, int64_t ldv, float scale) {
  extern __shared__ float fb_smem[];
  float* sq = fb_smem;        // [d] query row (f32)
  float* acc = sq + d;        // [d] unnormalised output
  float* sc = acc + d;        // [kFbChunk] scores, then probabilities
  const int64_t n = blockIdx.x;
  const int h = blockIdx.y;
  const int kh = h / (Hq / Hkv);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  // Sequence holding token n: the largest s with cu_seqlens[s] <= n (skips empty sequences).
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_seqlens[mid] <= n) lo = mid; else hi = mid - 1;
  }
  const int64_t begin = cu_seqlens[lo];

  const bf16* qr = q + (n * Hq + h) * d;
  for (int i = tid; i < d; i += kFbThreads) {
    sq[i] = __bfloat162float(qr[i]);
    acc[i] = 0.0f;
  }
  __syncthreads();

  float m = -INFINITY, l = 0.0f;  // identical in every thread
  for (int64_t c = begin; c <= n; c += kFbChunk) {
    const int cnt = n - c + 1 < kFbChunk ? static_cast<int>(n - c + 1) : kFbChunk;
    for (int i = warp; i < cnt; i += kFbThreads / 32) {
      const bf16* kr = k + (c + i) * ldk + int64_t(kh) * d;
      float dot = 0.0f;
      for (int e = lane; e < d; e += 32) dot += sq[e] * __bfloat162float(kr[e]);
      for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      if (lane == 0) sc[i] = dot * scale;
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int i = 0; i < cnt; ++i) mx = fmaxf(mx, sc[i]);
    const float m_new = fmaxf(m, mx);  // finite: the chunk holds at least one key
    const float alpha = expf(m - m_new);
    __syncthreads();
    if (tid < cnt) sc[tid] = expf(sc[tid] - m_new);
    __syncthreads();
    float sum = 0.0f;
    for (int i = 0; i < cnt; ++i) sum += sc[i];
    l = l * alpha + sum;
    m = m_new;
    for (int e = tid; e < d; e += kFbThreads) {
      float a = acc[e] * alpha;
      const bf16* vc = v + c * ldv + int64_t(kh) * d + e;
      for (int i = 0; i < cnt; ++i) a += sc[i] * __bfloat162float(vc[int64_t(i) * ldv]);
      acc[e] = a;
    }
    __syncthreads();  // sc is rewritten by the next chunk
  }
  bf16* orow = out + (n * Hq + h) * d;
  for (int e = tid; e < d; e += kFbThreads) orow[e] = __float2bfloat16_rn(acc[e] / l);
}

}  // namespace

// attention_sm90.cu: the wgmma kernel (sm_90a code), for validated parameters.
void flash_attention_fwd_wgmma(const AttentionParams& p, Stream s);

const char* flash_attention_kernel_name(int64_t d, int device) {
  return flash_attention_wgmma_available(d, device) ? "wgmma sm_90a" : "mma.sync";
}

bool flash_attention_supported(int64_t d, int sm_major) {
  return (d == 64 || d == 128 || d == 256) && sm_major >= 8;
}

void flash_attention_fwd(const AttentionParams& p, Stream s) {
  validate(p, "flash_attention_fwd");
  DFLASH_CHECK(p.d == 64 || p.d == 128 || p.d == 256,
               "flash_attention_fwd: head dim " << p.d << " is not supported (64, 128 or 256); use attention_fallback");
  DFLASH_CHECK(p.num_seqs <= 65535, "flash_attention_fwd: " << p.num_seqs << " sequences exceed the grid limit 65535");
  DFLASH_CHECK(p.N <= INT32_MAX, "flash_attention_fwd: N = " << p.N << " tokens exceed the int32 cu_seqlens range");
  if (p.N == 0 || p.max_seqlen == 0) return;
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.out)})
    DFLASH_CHECK(reinterpret_cast<uintptr_t>(ptr) % 16 == 0,
                 "flash_attention_fwd: q, k, v and out must be 16-byte aligned");
  DFLASH_CHECK(p.ldk % 8 == 0 && p.ldv % 8 == 0,
               "flash_attention_fwd: k / v row strides (" << p.ldk << ", " << p.ldv << ") must be multiples of 8 elements");
  int device = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&device));
  if (p.impl == FlashImpl::Wgmma || (p.impl == FlashImpl::Auto && flash_attention_wgmma_available(p.d, device))) {
    flash_attention_fwd_wgmma(p, s);
    return;
  }
  const auto stream = static_cast<cudaStream_t>(s);
  switch (p.d) {
    case 64: launch_flash<FlashCfg<64>>(p, stream); break;
    case 128: launch_flash<FlashCfg<128>>(p, stream); break;
    default: launch_flash<FlashCfg<256>>(p, stream); break;
  }
}

void attention_fallback(const AttentionParams& p, Stream s) {
  validate(p, "attention_fallback");
  DFLASH_CHECK(p.d <= 4096, "attention_fallback: head dim " << p.d << " exceeds 4096 (shared-memory staging)");
  DFLASH_CHECK(p.N <= INT32_MAX, "attention_fallback: N = " << p.N << " tokens exceed the int32 cu_seqlens range");
  if (p.N == 0) return;
  const size_t smem = (2 * static_cast<size_t>(p.d) + kFbChunk) * sizeof(float);
  const auto kernel = attention_fallback_kernel;  // smem <= 33 KB: no opt-in needed
  const dim3 grid(static_cast<unsigned>(p.N), static_cast<unsigned>(p.Hq));
  kernel<<<grid, kFbThreads, smem, static_cast<cudaStream_t>(s)>>>(
      static_cast<const bf16*>(p.q), static_cast<const bf16*>(p.k), static_cast<const bf16*>(p.v),
      static_cast<bf16*>(p.out), p.cu_seqlens, static_cast<int>(p.num_seqs), static_cast<int>(p.Hq),
      static_cast<int>(p.Hkv), static_cast<int>(p.d), p.ldk ? p.ldk : p.Hkv * p.d, p.ldv ? p.ldv : p.Hkv * p.d,
      p.scale);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda
