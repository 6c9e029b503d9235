// Attention of a few new queries per sequence over a KV-cache pool (attention.h; pool conventions in launch.h):
// kv_cache_append, the flash-decoding kernel with its split combine, and a plain fallback. The
// decode twin of attention.cu (prefill flash attention); it reuses that kernel's tile pieces
// (flash_tile.cuh: swizzled cp.async tiles, the online softmax and P·V on mma.sync).
//
// Roofline: the K / V bytes of the attended context, read once: per sequence and kv head
// 2 · ctx · d · 2 bytes. Target shape (Hq 24, Hkv 4, d 256): 4 MB per 1k of context, so at batch 1
// ctx 1k / 4k / 16k ≈ 1.0 / 3.9 / 15.6 us at 4.25 TB/s; the queries and outputs are small (T·Hq·d).
// FLOPs 4 · T · Hq · ctx · d: at T = 16, ctx 16k 6.4 GFLOP, ~25 us at the ~260 TFLOP/s that
// mma.sync reaches at d 256 (attention.cu), so T = 16 verify is compute bound on these kernels and
// T = 1 memory bound. Drafter (Hq 32, Hkv 8, d 128, block of 16): also 4 MB per 1k of context,
// 4.3 GFLOP at 16k.
//
// Fast kernel (flash-decoding): a CTA owns (split of the key range, kv head and block of up to 128
// query rows, sequence). Its query rows are the T_s tokens x the group's Hq / Hkv query heads
// (row m = t · group + head in group), so one K / V tile serves every query head of the kv head:
// K and V are read once per (kv head, split), not once per query head. Each of the first W warps
// owns 16 rows (T = 1 at group 6: one warp, 10 idle rows; T = 16: 6 warps) and runs the
// flash-attention-2 step per key tile: S = Q Kᵀ (mma.sync m16n8k16, bf16, f32 accumulate), the mask
// only on tiles that need it (the causal diagonal, the window's edge, the end of the range), online
// softmax in fp32, O += P V. Key tiles stream through kStages cp.async stages, S - 1 tiles ahead,
// loaded by at least 4 warps (loader-only warps when W < 4). The key range [lo, hi) of the CTA's
// rows is cut into `splits` chunks (whole tiles) computed on the device from past_len, so the split
// count is a host choice (enough CTAs to fill the GPU) and the chunks follow the actual context.
// With one split the CTA writes bf16 out directly; otherwise each split writes its rows' normalised
// fp32 output and log-sum-exp to the workspace and decode_combine_kernel merges them per row.
// Measured on an H200 (kernel_bench decode, bench/results/h200-decode-*; % of the copy bandwidth
// of the same run): target T = 1 batch 1 ctx 1k / 4k / 16k: 13 / 17 / 30 us (8 / 23 / 52%), batch 8
// ctx 16k 134 us (94%); target T = 16 batch 1 ctx 16k 49 us (compute bound, see above); drafter
// T = 16 batch 8 ctx 16k 161 us (78%). The first version (two stages, the one query warp loading
// alone, a combine loop that waited on each split's lse) took 58 us at target T = 1 batch 1 ctx 16k.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda/check.h"
#include "kernels/cuda/flash_tile.cuh"
#include "kernels/cuda/grid.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/ptx.cuh"
#include "core/error.h"

namespace dflash::cuda {

// Tuning knob for benchmarks/tests only: the split count of the fast kernel (0 = automatic; still
// capped by the workspace).
namespace tuning {
int attn_decode_splits = 0;
}

namespace {

using namespace ptx;
using namespace flash;
using bf16 = __nv_bfloat16;

constexpr int kMaxWarps = 8;
constexpr int kMaxRows = 16 * kMaxWarps;  // query rows per CTA
constexpr int kMaxSplits = 128;
constexpr int kMaxDevices = 16;

struct DecodeArgs {
  const bf16* q;
  const bf16* kc;
  const bf16* vc;
  bf16* out;
  float* part_o;    // [splits][N][Hq][d] (splits > 1)
  float* part_lse;  // [splits][N][Hq], log2 units
  const int32_t* slots;
  const int32_t* past_len;
  const int32_t* cu;
  int64_t N, max_len, num_slots;
  int Hq, Hkv, group, splits, window, split_keys;
  bool causal;
  float scale, scale_log2;
};

DecodeArgs decode_args(const AttentionDecodeParams& p, int splits) {
  DecodeArgs a{};
  a.q = static_cast<const bf16*>(p.q);
  a.kc = static_cast<const bf16*>(p.k_cache);
  a.vc = static_cast<const bf16*>(p.v_cache);
  a.out = static_cast<bf16*>(p.out);
  a.slots = p.slots;
  a.past_len = p.past_len;
  a.cu = p.cu_seqlens;
  a.N = p.N;
  a.max_len = p.max_len;
  a.num_slots = p.num_slots;
  a.Hq = static_cast<int>(p.Hq);
  a.Hkv = static_cast<int>(p.Hkv);
  a.group = static_cast<int>(p.Hq / p.Hkv);
  a.splits = splits;
  a.window = static_cast<int>(p.window);
  a.split_keys = static_cast<int>(p.split_keys);
  a.causal = p.causal;
  a.scale = p.scale;
  a.scale_log2 = p.scale * 1.4426950408889634f;
  if (splits > 1) {
    a.part_o = static_cast<float*>(p.workspace);
    a.part_lse = a.part_o + static_cast<int64_t>(splits) * p.N * p.Hq * p.d;
  }
  return a;
}

// Tilings: as attention.cu's (d 256: BN 32 and Q re-read from shared memory, O takes 128
// registers), with kStages key tiles in flight: a decode CTA computes little per tile, so the
// loads, not the math, must stay ahead (two stages left the pipe empty for a DRAM latency per tile).
template <int D_, int BN_, bool QREGS_, int STAGES_>
struct DecodeTiling {
  static constexpr int D = D_, kBlockN = BN_, kChunks = D / 8, kStages = STAGES_;
  static constexpr bool kQInRegs = QREGS_;
  // Q rows of the compute warps + kStages stages of K and V tiles.
  static size_t smem_bytes(int warps) { return size_t(16 * warps + 2 * kStages * kBlockN) * D * 2; }
};
template <int D> struct DecodeCfg;
template <> struct DecodeCfg<64> : DecodeTiling<64, 64, true, 4> {};
template <> struct DecodeCfg<128> : DecodeTiling<128, 64, true, 3> {};
template <> struct DecodeCfg<256> : DecodeTiling<256, 32, false, 3> {};

// Threads that load the key tiles: at least kLoadWarps warps per CTA even when one warp of query
// rows computes (T = 1): 32 threads issuing a 32 KB tile in 16-byte copies, with their index math,
// were the bottleneck.
constexpr int kLoadWarps = 4;

// Key row kp of (slot, kv head) in a cache [num_slots, max_len, Hkv, D].
__device__ __forceinline__ const bf16* cache_row(const bf16* c, int64_t slot, int64_t max_len, int Hkv, int kvh,
                                                 int64_t kp, int D) {
  return c + ((slot * max_len + kp) * Hkv + kvh) * D;
}

template <class Cfg>
__global__ void __launch_bounds__(32 * kMaxWarps) decode_fwd_kernel(const DecodeArgs a, int W) {
  constexpr int D = Cfg::D, BN = Cfg::kBlockN, kChunks = Cfg::kChunks, S = Cfg::kStages;
  constexpr int KS = D / 16, NT = BN / 8, DT = D / 8;
  // W warps own 16 query rows each; all blockDim.x / 32 >= W warps load.
  const int split = blockIdx.x, kvh = blockIdx.y % a.Hkv, rb = blockIdx.y / a.Hkv, seq = blockIdx.z;
  const int nthreads = blockDim.x, G = a.group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  const int32_t slot = a.slots[seq];
  const int begin = a.cu[seq], T = a.cu[seq + 1] - begin, past = a.past_len[seq];
  const int m_begin = rb * kMaxRows, M = T * G;
  if (m_begin >= M || slot < 0 || slot >= a.num_slots || past < 0 || past + T > a.max_len) return;
  const int m_last = min(M, m_begin + 16 * W) - 1;  // last real row of the CTA
  const int pos_min = past + m_begin / G, pos_max = past + m_last / G;
  // Keys any row of the CTA attends: [lo, hi); tiles inside [free_lo, free_hi) need no mask.
  const int lo = a.window > 0 ? max(0, pos_min - (a.window - 1)) : 0;
  const int hi = a.causal ? pos_max + 1 : past + T;
  const int free_lo = a.window > 0 ? pos_max - (a.window - 1) : 0;
  const int free_hi = a.causal ? pos_min + 1 : past + T;
  int k_begin, k_end;
  if (a.split_keys > 0) {  // absolute splits (batch invariance): tiles start at multiples of BN
    k_begin = max(split * a.split_keys, lo / BN * BN);
    k_end = min(hi, (split + 1) * a.split_keys);
  } else {
    const int chunk = ((hi - lo + a.splits - 1) / a.splits + BN - 1) / BN * BN;
    k_begin = lo + split * chunk;
    k_end = min(hi, k_begin + chunk);
  }

  // Row m of this kv head's block -> (token n, query head h).
  auto row_token = [&](int m) { return begin + m / G; };
  auto row_head = [&](int m) { return kvh * G + m % G; };

  if (k_begin >= k_end) {  // an empty split (short context): weight 0 and a zero row in the combine
    for (int i = tid; i < (m_last - m_begin + 1) * (D / 4); i += nthreads) {
      const int m = m_begin + i / (D / 4), c = i % (D / 4);
      const int64_t row = (int64_t(split) * a.N + row_token(m)) * a.Hq + row_head(m);
      reinterpret_cast<float4*>(a.part_o + row * D)[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (c == 0) a.part_lse[row] = -INFINITY;
    }
    return;
  }

  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // [16W][D]
  bf16* sK = sQ + 16 * W * D;                    // [S][BN][D]
  bf16* sV = sK + S * BN * D;                    // [S][BN][D]

  // Q rows (zeros past the last real row), then the first S - 1 key tiles, one commit group each.
  for (int i = tid; i < 16 * W * kChunks; i += nthreads) {
    const int r = i / kChunks, c = i % kChunks, m = m_begin + r;
    const bool ok = m <= m_last;
    const bf16* src = a.q + (ok ? (int64_t(row_token(m)) * a.Hq + row_head(m)) * D + c * 8 : 0);
    cp_async_16(sQ + swz<D>(r, c), src, ok ? 16 : 0);
  }
  cp_async_commit();
  const int n_tiles = (k_end - k_begin + BN - 1) / BN;
  // Rows of the slot's cache for this kv head are Hkv·D elements apart.
  const int64_t ld = int64_t(a.Hkv) * D;
  const bf16* kbase = cache_row(a.kc, slot, a.max_len, a.Hkv, kvh, 0, D);
  const bf16* vbase = cache_row(a.vc, slot, a.max_len, a.Hkv, kvh, 0, D);
  auto load_kv = [&](int j) {
    const int n0 = k_begin + j * BN, stage = j % S;
    for (int i = tid; i < BN * kChunks; i += nthreads) {
      const int r = i / kChunks, c = i % kChunks;
      const bool ok = n0 + r < k_end;
      const int64_t off = (ok ? n0 + r : k_begin) * ld + c * 8;  // a valid address either way
      cp_async_16(sK + stage * BN * D + swz<D>(r, c), kbase + off, ok ? 16 : 0);
      cp_async_16(sV + stage * BN * D + swz<D>(r, c), vbase + off, ok ? 16 : 0);
    }
  };
#pragma unroll
  for (int j = 0; j < S - 1; ++j) {
    if (j < n_tiles) load_kv(j);
    cp_async_commit();
  }

  const int a_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, a_chk = lane >> 4;
  const int k_row = (lane & 7) + (lane >> 4) * 8, k_chk = (lane >> 3) & 1;
  const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8, v_chk = lane >> 4;
  const int g = lane >> 2, t = lane & 3;
  // Loader-only warps and warps of padding rows only load.
  const bool warp_active = warp < W && m_begin + warp * 16 <= m_last;
  // Positions of this thread's rows g and g + 8 (padding rows get positions too; never stored).
  const int pos0 = past + (m_begin + warp * 16 + g) / G, pos1 = past + (m_begin + warp * 16 + g + 8) / G;

  uint32_t qf[Cfg::kQInRegs ? KS : 1][4];
  if constexpr (Cfg::kQInRegs) {
    cp_async_wait<S - 1>();  // the Q group
    __syncthreads();
    if (warp_active) {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) ldmatrix_x4(qf[ks], sQ + swz<D>(a_row, ks * 2 + a_chk));
    }
  }
  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it % S, n0 = k_begin + it * BN;
    const bf16* tK = sK + stage * BN * D;
    const bf16* tV = sV + stage * BN * D;
    cp_async_wait<S - 2>();  // tile it's group (S - 2 newer ones may still fly)
    // Tile it is visible to all, and every warp is done with tile it - 1, whose stage is refilled
    // now with tile it + S - 1: S - 1 tiles stay in flight while this one is computed.
    __syncthreads();
    if (it + S - 1 < n_tiles) load_kv(it + S - 1);
    cp_async_commit();
    if (warp_active) {
      float s[NT][4];
      qk_scores<NT, KS, D, Cfg::kQInRegs>(s, qf, sQ, a_row, a_chk, tK, k_row, k_chk);
      if (!(n0 >= free_lo && n0 + BN <= free_hi && n0 + BN <= k_end)) {
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = n0 + i * 8 + 2 * t + (e & 1), pos = (e >> 1) ? pos1 : pos0;
            if (key >= k_end || (a.causal && key > pos) || (a.window > 0 && key < pos - (a.window - 1)))
              s[i][e] = -INFINITY;
          }
      }
      softmax_tile_pv<NT, DT, D>(s, o, m0, m1, l0, l1, a.scale_log2, tV, v_row, v_chk);
    }
  }
  if (!warp_active) return;

  float inv0, inv1;
  finish_rows(l0, l1, inv0, inv1);
  const int r0 = warp * 16 + g;
  if (a.splits == 1) {
    // Normalised bf16 rows staged in the warp's own rows of sQ, then 16-byte stores.
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      *reinterpret_cast<uint32_t*>(sQ + swz<D>(r0, i) + 2 * t) = pack_bf16(o[i][0] * inv0, o[i][1] * inv0);
      *reinterpret_cast<uint32_t*>(sQ + swz<D>(r0 + 8, i) + 2 * t) = pack_bf16(o[i][2] * inv1, o[i][3] * inv1);
    }
    __syncwarp();
#pragma unroll
    for (int step = 0; step < kChunks / 2; ++step) {  // 16 rows · kChunks chunks over 32 lanes
      const int i = step * 32 + lane, r = warp * 16 + i / kChunks, c = i % kChunks, m = m_begin + r;
      if (m <= m_last)
        *reinterpret_cast<uint4*>(a.out + (int64_t(row_token(m)) * a.Hq + row_head(m)) * D + c * 8) =
            *reinterpret_cast<const uint4*>(sQ + swz<D>(r, c));
    }
    return;
  }
  // Split partials: the normalised fp32 rows and their log-sum-exp (log2 units; -inf: no key).
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int m = m_begin + r0 + 8 * half;
    if (m > m_last) continue;
    const int64_t row = (int64_t(split) * a.N + row_token(m)) * a.Hq + row_head(m);
    const float inv = half ? inv1 : inv0, l = half ? l1 : l0, mx = half ? m1 : m0;
    float* dst = a.part_o + row * D;
#pragma unroll
    for (int i = 0; i < DT; ++i)
      *reinterpret_cast<float2*>(dst + i * 8 + 2 * t) = make_float2(o[i][2 * half] * inv, o[i][2 * half + 1] * inv);
    if (t == 0) a.part_lse[row] = l > 0.0f ? mx + log2f(l) : -INFINITY;
  }
}

// One CTA per (token, query head) row: out = Σ_s 2^(lse_s - max) O_s / Σ_s 2^(lse_s - max). Warp w
// takes splits w, w + 4, ... (at most 32 each: splits <= kMaxSplits = 128): its lanes load their
// splits' lse at once, then the warp sums the O rows (lanes over d) with loads that depend on no
// earlier load; the four warps' sums meet in shared memory. Empty splits have lse = -inf and O = 0,
// so every split is summed without a branch (weight 2^-inf = 0).
template <int D>
__global__ void __launch_bounds__(128) decode_combine_kernel(const float* __restrict__ part_o,
                                                             const float* __restrict__ part_lse, bf16* __restrict__ out,
                                                             int64_t rows, int splits) {
  static_assert(kMaxSplits <= 4 * 32, "a warp's lanes hold its splits' weights");
  constexpr int E = D / 32;  // elements per lane (contiguous)
  __shared__ float acc_s[4][D];
  __shared__ float max_s[4], sum_s[4];
  const int64_t row = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int my_split = warp + 4 * lane, count = (splits - warp + 3) / 4;  // this warp's splits
  const float lse = my_split < splits ? part_lse[my_split * rows + row] : -INFINITY;
  float mx = lse;
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) max_s[warp] = mx;
  __syncthreads();
  mx = fmaxf(fmaxf(max_s[0], max_s[1]), fmaxf(max_s[2], max_s[3]));
  const float w = mx == -INFINITY ? 0.0f : fast_exp2(lse - mx);
  float wsum = w;
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, off);
  float acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.0f;
#pragma unroll 4
  for (int k = 0; k < count; ++k) {
    const float wk = __shfl_sync(0xffffffffu, w, k);
    const float* src = part_o + ((warp + 4 * k) * rows + row) * D + lane * E;
#pragma unroll
    for (int e = 0; e < E; e += 2) {
      const float2 v = *reinterpret_cast<const float2*>(src + e);
      acc[e] = fmaf(wk, v.x, acc[e]);
      acc[e + 1] = fmaf(wk, v.y, acc[e + 1]);
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) acc_s[warp][lane * E + e] = acc[e];
  if (lane == 0) sum_s[warp] = wsum;
  __syncthreads();
  const float total = sum_s[0] + sum_s[1] + sum_s[2] + sum_s[3];
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int e = threadIdx.x; e < D; e += 128)
    out[row * D + e] = __float2bfloat16_rn((acc_s[0][e] + acc_s[1][e] + acc_s[2][e] + acc_s[3][e]) * inv);
}

// ---- fallback ---------------------------------------------------------------------------------------
constexpr int kFbThreads = 128;
constexpr int kFbChunk = 64;  // keys per online-softmax step

// CTA (token t of sequence blockIdx.z, query head blockIdx.y); the attended keys [lo, hi] of its
// position walked in chunks: a warp per key's dot product, then the CTA's online-softmax update.
__global__ void decode_fallback_kernel(const DecodeArgs a, int d) {
  extern __shared__ float fb_smem[];
  float* sq = fb_smem;  // [d]
  float* acc = sq + d;  // [d]
  float* sc = acc + d;  // [kFbChunk]
  const int t = blockIdx.x, h = blockIdx.y, seq = blockIdx.z, kvh = h / a.group;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int32_t slot = a.slots[seq];
  const int begin = a.cu[seq], T = a.cu[seq + 1] - begin, past = a.past_len[seq];
  if (t >= T || slot < 0 || slot >= a.num_slots || past < 0 || past + T > a.max_len) return;
  const int64_t n = begin + t;
  const int pos = past + t;
  const int lo = a.window > 0 ? max(0, pos - (a.window - 1)) : 0;
  const int hi = a.causal ? pos : past + T - 1;  // inclusive
  const bf16* qr = a.q + (n * a.Hq + h) * d;
  for (int i = tid; i < d; i += kFbThreads) {
    sq[i] = __bfloat162float(qr[i]);
    acc[i] = 0.0f;
  }
  __syncthreads();
  float m = -INFINITY, l = 0.0f;  // identical in every thread
  for (int c = lo; c <= hi; c += kFbChunk) {
    const int cnt = min(kFbChunk, hi - c + 1);
    for (int i = warp; i < cnt; i += kFbThreads / 32) {
      const bf16* kr = cache_row(a.kc, slot, a.max_len, a.Hkv, kvh, c + i, d);
      float dot = 0.0f;
      for (int e = lane; e < d; e += 32) dot = fmaf(sq[e], __bfloat162float(kr[e]), dot);
      for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      if (lane == 0) sc[i] = dot * a.scale;
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int i = 0; i < cnt; ++i) mx = fmaxf(mx, sc[i]);
    const float m_new = fmaxf(m, mx), alpha = expf(m - m_new);
    __syncthreads();
    if (tid < cnt) sc[tid] = expf(sc[tid] - m_new);
    __syncthreads();
    float sum = 0.0f;
    for (int i = 0; i < cnt; ++i) sum += sc[i];
    l = l * alpha + sum;
    m = m_new;
    for (int e = tid; e < d; e += kFbThreads) {
      float x = acc[e] * alpha;
      for (int i = 0; i < cnt; ++i) x = fmaf(sc[i], __bfloat162float(cache_row(a.vc, slot, a.max_len, a.Hkv, kvh, c + i, d)[e]), x);
      acc[e] = x;
    }
    __syncthreads();  // sc is rewritten by the next chunk
  }
  bf16* orow = a.out + (n * a.Hq + h) * d;
  for (int e = tid; e < d; e += kFbThreads) orow[e] = __float2bfloat16_rn(l > 0.0f ? acc[e] / l : 0.0f);
}

// ---- KV-cache append ----------------------------------------------------------------------------------
template <bool VEC>
__global__ void kv_append_kernel(const KvAppendParams p) {
  const int64_t t = blockIdx.x, seq = blockIdx.y;
  const int32_t slot = p.slots[seq];
  const int64_t begin = p.cu_seqlens[seq], T = p.cu_seqlens[seq + 1] - begin, past = p.past_len[seq];
  if (t >= T || slot < 0 || slot >= p.num_slots || past < 0 || past + T > p.max_len) return;
  const int64_t row = p.Hkv * p.d, n = begin + t;
  const int64_t ldk = p.ldk ? p.ldk : row, ldv = p.ldv ? p.ldv : row;
  const int64_t dst = (slot * p.max_len + past + t) * row;
  const bf16* k = static_cast<const bf16*>(p.k) + n * ldk;
  const bf16* v = static_cast<const bf16*>(p.v) + n * ldv;
  bf16* kc = static_cast<bf16*>(p.k_cache) + dst;
  bf16* vc = static_cast<bf16*>(p.v_cache) + dst;
  if constexpr (VEC) {
    for (int64_t i = threadIdx.x; i < row / 8; i += blockDim.x) {
      reinterpret_cast<uint4*>(kc)[i] = __ldg(reinterpret_cast<const uint4*>(k) + i);
      reinterpret_cast<uint4*>(vc)[i] = __ldg(reinterpret_cast<const uint4*>(v) + i);
    }
  } else {
    for (int64_t i = threadIdx.x; i < row; i += blockDim.x) {
      kc[i] = k[i];
      vc[i] = v[i];
    }
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// Sizes only (attention_decode_workspace needs no pointers); the launchers add validate_pointers.
void validate(const AttentionDecodeParams& p, const char* op) {
  DFLASH_CHECK(p.N >= 0 && p.num_seqs >= 0 && p.Hq > 0 && p.Hkv > 0 && p.d > 0 && p.max_len >= 1 && p.num_slots >= 1,
               op << ": bad sizes N=" << p.N << " num_seqs=" << p.num_seqs << " Hq=" << p.Hq << " Hkv=" << p.Hkv
                  << " d=" << p.d << " max_len=" << p.max_len << " num_slots=" << p.num_slots);
  DFLASH_CHECK(p.Hq % p.Hkv == 0, op << ": " << p.Hq << " query heads are not a multiple of " << p.Hkv << " kv heads");
  DFLASH_CHECK(std::isfinite(p.scale) && p.scale > 0.0f, op << ": scale must be finite and > 0, got " << p.scale);
  DFLASH_CHECK(p.window >= 0 && p.window < INT32_MAX, op << ": window must be >= 0 (0 = none), got " << p.window);
  DFLASH_CHECK(p.max_len < INT32_MAX && p.N < INT32_MAX, op << ": max_len and N must fit in int32");
  DFLASH_CHECK(p.num_seqs < 65536 && p.Hq < 65536, op << ": num_seqs and Hq must be below 65536");
  DFLASH_CHECK(p.N == 0 || p.num_seqs >= 1, op << ": " << p.N << " tokens but no sequence");
  DFLASH_CHECK(p.max_new >= 0 && p.max_new <= p.N, op << ": max_new " << p.max_new << " must lie in [0, N = " << p.N << "]");
  DFLASH_CHECK(p.split_keys >= 0 && p.split_keys % 64 == 0 && p.split_keys < INT32_MAX,
               op << ": split_keys " << p.split_keys << " must be 0 or a positive multiple of 64");
  DFLASH_CHECK(p.split_keys == 0 || (p.key_bound >= 1 && p.key_bound <= p.max_len &&
                                     (p.key_bound + p.split_keys - 1) / p.split_keys <= kMaxSplits),
               op << ": with split_keys " << p.split_keys << ", key_bound " << p.key_bound << " must lie in [1, max_len = "
                  << p.max_len << "] and need at most " << kMaxSplits << " splits");
}
void validate_pointers(const AttentionDecodeParams& p, const char* op) {
  DFLASH_CHECK(p.N == 0 || (p.q && p.k_cache && p.v_cache && p.out && p.slots && p.past_len && p.cu_seqlens),
               op << ": null pointer (q, k_cache, v_cache, out, slots, past_len or cu_seqlens)");
}

// Query-row blocks per kv head and warps per CTA of the fast kernel.
void decode_shape(const AttentionDecodeParams& p, int& row_blocks, int& warps) {
  const int64_t rows = p.max_new * (p.Hq / p.Hkv);
  row_blocks = static_cast<int>((rows + kMaxRows - 1) / kMaxRows);
  warps = static_cast<int>(std::min<int64_t>(kMaxWarps, (rows + 15) / 16));
}

// The fast kernel of tiling Cfg with its shared-memory limit raised for 8 warps (once per device),
// and how many of its CTAs of `warps` warps are resident at once (cached: the launcher runs per
// decode step, and the occupancy query costs microseconds).
template <class Cfg>
const void* prepared_kernel(int device) {
  static bool ready[kMaxDevices] = {};
  const auto kernel = reinterpret_cast<const void*>(decode_fwd_kernel<Cfg>);
  if (!ready[device]) {
    DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(Cfg::smem_bytes(kMaxWarps))));
    ready[device] = true;
  }
  return kernel;
}
template <class Cfg>
int64_t resident_ctas(int device, int warps) {
  static int64_t cache[kMaxDevices][kMaxWarps + 1] = {};
  int64_t& r = cache[device][warps];
  if (r == 0)
    r = resident_blocks(prepared_kernel<Cfg>(device), 32 * std::max(warps, kLoadWarps), Cfg::smem_bytes(warps), 0);
  return r;
}
int current_device() {
  int device = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&device));
  DFLASH_CHECK(device >= 0 && device < kMaxDevices, "attention_decode: device " << device << " beyond " << kMaxDevices);
  return device;
}

// Splits: enough CTAs for one full wave of resident CTAs, at most one per key tile of the cache's
// capacity and kMaxSplits; then capped by the workspace (bytes >= 0 given, or unlimited when < 0).
template <class Cfg>
int choose_splits(const AttentionDecodeParams& p, int64_t workspace_bytes) {
  int row_blocks = 0, warps = 0;
  decode_shape(p, row_blocks, warps);
  const int64_t base = std::max<int64_t>(1, p.num_seqs * p.Hkv * row_blocks);
  if (p.split_keys > 0) {
    // Absolute splits: enough to cover key_bound, at least two so that every call combines.
    const int64_t splits = std::max<int64_t>(2, (p.key_bound + p.split_keys - 1) / p.split_keys);
    const int64_t per_split = p.N * p.Hq * (p.d + 1) * static_cast<int64_t>(sizeof(float));
    DFLASH_CHECK_HINT(workspace_bytes < 0 || splits * per_split <= workspace_bytes,
                      "attention_decode_fast: split_keys " << p.split_keys << " needs " << splits * per_split
                                                           << " workspace bytes, got " << workspace_bytes,
                      "allocate attention_decode_workspace(p) bytes");
    return static_cast<int>(splits);
  }
  int64_t splits = tuning::attn_decode_splits;
  // One full wave of resident CTAs (rounded down: a few CTAs past a wave cost a second one). The
  // compute-heavy blocks of >= 4 warps of query rows (T = 16 verify) measured faster with two waves,
  // but no more than 32 splits (H200, ctx 16k: target T16 batch 8: 8 splits 285 us, 4 splits 441;
  // batch 1: 32 splits 50 us, 66 splits 64; drafter T16 batch 1: 32 splits 33 us, 66 splits 46).
  if (splits <= 0) {
    const int64_t wave = resident_ctas<Cfg>(current_device(), warps);
    splits = warps >= 4 ? std::min<int64_t>(32, 2 * wave / base) : wave / base;
  }
  splits = std::clamp<int64_t>(splits, 1, std::min<int64_t>(kMaxSplits, (p.max_len + Cfg::kBlockN - 1) / Cfg::kBlockN));
  const int64_t per_split = p.N * p.Hq * (p.d + 1) * static_cast<int64_t>(sizeof(float));
  if (workspace_bytes >= 0 && splits > 1 && per_split > 0) splits = std::min<int64_t>(splits, workspace_bytes / per_split);
  return static_cast<int>(std::max<int64_t>(splits, 1));
}

template <class Cfg>
void launch_decode(const AttentionDecodeParams& p, cudaStream_t stream) {
  const int64_t ws = p.workspace ? static_cast<int64_t>(p.workspace_bytes) : 0;
  const int splits = choose_splits<Cfg>(p, ws);
  int row_blocks = 0, warps = 0;
  decode_shape(p, row_blocks, warps);
  DFLASH_CHECK(p.Hkv * row_blocks < 65536, "attention_decode_fast: Hkv x query-row blocks exceed the grid limit");
  const DecodeArgs a = decode_args(p, splits);
  const size_t smem = Cfg::smem_bytes(warps);
  const auto kernel = decode_fwd_kernel<Cfg>;
  prepared_kernel<Cfg>(current_device());
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(p.Hkv * row_blocks),
                  static_cast<unsigned>(p.num_seqs));
  kernel<<<grid, 32 * std::max(warps, kLoadWarps), smem, stream>>>(a, warps);
  DFLASH_CUDA_CHECK_LAST();
  if (splits == 1) return;
  const int64_t rows = p.N * p.Hq;
  DFLASH_CHECK(rows < (1ll << 31), "attention_decode_fast: " << rows << " output rows exceed the grid limit");
  decode_combine_kernel<Cfg::D><<<static_cast<unsigned>(rows), 128, 0, stream>>>(a.part_o, a.part_lse, a.out, rows,
                                                                                 splits);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace

bool attention_decode_fast_supported(int64_t d, int sm_major) { return (d == 64 || d == 128 || d == 256) && sm_major >= 8; }

const char* attention_decode_kernel_name(int64_t d, int sm_major) {
  return attention_decode_fast_supported(d, sm_major) ? "flash-decoding mma.sync" : "fallback";
}

size_t attention_decode_workspace(const AttentionDecodeParams& p) {
  validate(p, "attention_decode_workspace");
  if (p.N == 0) return 0;
  int splits = 1;
  switch (p.d) {
    case 64: splits = choose_splits<DecodeCfg<64>>(p, -1); break;
    case 128: splits = choose_splits<DecodeCfg<128>>(p, -1); break;
    case 256: splits = choose_splits<DecodeCfg<256>>(p, -1); break;
    default: return 0;  // the fallback needs none
  }
  return splits > 1 ? static_cast<size_t>(splits) * p.N * p.Hq * (p.d + 1) * sizeof(float) : 0;
}

void attention_decode_fast(const AttentionDecodeParams& p, Stream s) {
  const char* op = "attention_decode_fast";
  validate(p, op);
  validate_pointers(p, op);
  DFLASH_CHECK(p.d == 64 || p.d == 128 || p.d == 256,
               op << ": head dim " << p.d << " is not supported (64, 128 or 256); use attention_decode_fallback");
  if (p.N == 0 || p.max_new == 0) return;
  DFLASH_CHECK(aligned16(p.q) && aligned16(p.k_cache) && aligned16(p.v_cache) && aligned16(p.out) &&
                   aligned16(p.workspace),
               op << ": q, caches, out and workspace must be 16-byte aligned");
  const auto stream = static_cast<cudaStream_t>(s);
  switch (p.d) {
    case 64: launch_decode<DecodeCfg<64>>(p, stream); break;
    case 128: launch_decode<DecodeCfg<128>>(p, stream); break;
    default: launch_decode<DecodeCfg<256>>(p, stream); break;
  }
}

void attention_decode_fallback(const AttentionDecodeParams& p, Stream s) {
  const char* op = "attention_decode_fallback";
  validate(p, op);
  validate_pointers(p, op);
  DFLASH_CHECK(p.d <= 4096, op << ": head dim " << p.d << " exceeds 4096 (shared-memory staging)");
  if (p.N == 0 || p.max_new == 0) return;
  const size_t smem = (2 * static_cast<size_t>(p.d) + kFbChunk) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(p.max_new), static_cast<unsigned>(p.Hq), static_cast<unsigned>(p.num_seqs));
  decode_fallback_kernel<<<grid, kFbThreads, smem, static_cast<cudaStream_t>(s)>>>(decode_args(p, 1),
                                                                                   static_cast<int>(p.d));
  DFLASH_CUDA_CHECK_LAST();
}

void kv_cache_append(const KvAppendParams& p, Stream s) {
  const char* op = "kv_cache_append";
  DFLASH_CHECK(p.N >= 0 && p.num_seqs >= 0 && p.Hkv > 0 && p.d > 0 && p.max_len >= 1 && p.num_slots >= 1,
               op << ": bad sizes N=" << p.N << " num_seqs=" << p.num_seqs << " Hkv=" << p.Hkv << " d=" << p.d
                  << " max_len=" << p.max_len << " num_slots=" << p.num_slots);
  const int64_t row = p.Hkv * p.d;
  for (int64_t ld : {p.ldk, p.ldv})
    DFLASH_CHECK(ld == 0 || ld >= row, op << ": k / v row stride " << ld << " is below the row's Hkv·d = " << row);
  DFLASH_CHECK(p.max_new >= 0 && p.max_new <= p.N, op << ": max_new " << p.max_new << " must lie in [0, N = " << p.N << "]");
  DFLASH_CHECK(p.num_seqs < 65536 && p.max_new < (1ll << 31), op << ": grid too large");
  DFLASH_CHECK(p.N == 0 || p.num_seqs >= 1, op << ": " << p.N << " tokens but no sequence");
  if (p.N == 0 || p.max_new == 0) return;
  DFLASH_CHECK(p.k && p.v && p.k_cache && p.v_cache && p.slots && p.past_len && p.cu_seqlens,
               op << ": null pointer among k, v, caches, slots, past_len, cu_seqlens");
  const bool vec = row % 8 == 0 && p.ldk % 8 == 0 && p.ldv % 8 == 0 && aligned16(p.k) && aligned16(p.v) &&
                   aligned16(p.k_cache) && aligned16(p.v_cache);
  const dim3 grid(static_cast<unsigned>(p.max_new), static_cast<unsigned>(p.num_seqs));
  const int threads = static_cast<int>(std::clamp<int64_t>(vec ? row / 8 : row, 32, 256));
  if (vec)
    kv_append_kernel<true><<<grid, threads, 0, static_cast<cudaStream_t>(s)>>>(p);
  else
    kv_append_kernel<false><<<grid, threads, 0, static_cast<cudaStream_t>(s)>>>(p);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda
