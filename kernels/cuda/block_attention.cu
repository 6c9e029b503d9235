// DFlash block attention, forward and backward (see block_attention.h for the mask): the drafter's
// block queries attend the context keys strictly before their anchor plus their own block's keys.
// bf16 q/k/v/out and gradients, fp32 softmax, accumulation and LSE.
//
// GQA packing: the B queries of a block times the G = Hq / Hkv query heads of one kv head share
// every key, so a CTA owns (block, kv head) and packs those M = B·G query rows (packed row
// i = j·G + hh, block offset j, head kv·G + hh) into 64-row tiles: for the drafter (B 16, G 4)
// exactly one tile. Its keys are walked in tiles of 64: the context keys [lo, anchor) (lo = 0 on
// full layers, the window's start on sliding ones), then the block's own keys. Masked tiles are
// never loaded; a tile gets the per-element mask only where it can cut (a partial tile, sliding).
// The tensor-core code is attention.cu's: 4 warps of 16 rows, mma.sync m16n8k16 bf16 with fp32
// accumulation, operands by ldmatrix from XOR-swizzled shared tiles, two-stage cp.async pipeline,
// online softmax in fp32 with the scale folded into exp2, P rounded to bf16 for P·V.
//
// Backward (deterministic, no atomics):
//   ba_delta:  δ_i = Σ_e dO_ie · O_ie per (row, head) into the workspace (fp32 [R, Hq]).
//   ba_dq:     query-major like the forward: P = exp2(S·scale·log2e − lse·log2e) recomputed from the
//              saved LSE, dP = dO Vᵀ, dS = P ∘ (dP − δ), dQ = scale · Σ dS K.
//   ba_dkv:    key-tile-major: a CTA owns 64 keys of one kv head (K and V tiles resident) and walks
//              every (block, 64-row query tile) that can see them, accumulating dV = Σ Pᵀ dO and
//              dK = scale · Σ dSᵀ Q in registers; the (Q, dO, lse, δ) tiles stream through two
//              cp.async stages. Context keys: the blocks of the key's sequence with anchor > the
//              tile's first key (sorted: a binary search finds the first; on sliding layers a
//              second one the last whose window still reaches the tile). Own-block keys: one CTA
//              per (block, kv head), its block only. A context row no block sees is written 0.
//   ba_dq and both ba_dkv roles run as one launch (ba_bwd_kernel): the uneven context dK/dV CTAs
//   first, heaviest first, the short dQ CTAs filling the SMs around them.
//
// FLOPs (drafter shape: Hq 32, Hkv 8, d 128, 512 blocks of 16 over 4096 context tokens, anchors
// uniform; mean attended keys ≈ 2064 per query row): fwd = 4·d·keys per (row, head)
// = 4·128·2064·8192·32 = 0.28 TFLOP; bwd = 2.5× (S and dP recomputed/formed, dV, dK, dQ: 5 GEMMs
// vs 2) = 0.69 TFLOP. Bytes are small (k/v of one head 2 MB, L2-resident): compute-bound; with
// mma.sync the limit is shared-memory bandwidth, as in attention.cu (≈ 13–15 FLOP/B of ldmatrix).
// Measured (H200, that shape, bench/kernel_bench --only dattn): fwd 1.01 ms = 265 TFLOP/s; bwd
// 5.43 ms = 124 TFLOP/s counted (2.5× fwd); fwd+bwd 6.45 ms = 146 TFLOP/s. Without atomics, S and
// dP are formed twice (in the dQ pass and in the dK/dV pass): 7 GEMMs run where 5 are counted, so
// the bwd executes ≈ 173 TFLOP/s, and its kernels hold 255 registers (dK + dV accumulators, or
// dQ + Q fragments, next to S and dP) at 8 warps per SM. One launch instead of three gained 5 %;
// two 32-query passes in dK/dV (fewer spills) gained nothing. Beyond this: wgmma (sm_90a), which
// block_attention_sm90.cu does with this same structure and block_attention_fwd / _bwd run on
// sm_90 at d = 128 (BlockAttnParams::impl forces either).
//
// Fallback (any d, any arch): plain fp32 kernels, one CTA per (query row, head) for out/lse and
// dq, one per (key row, kv head) for dK/dV; warps compute dot products, threads over d accumulate.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/block_attention_tile.cuh"
#include "core/cuda/check.h"
#include "kernels/cuda/flash_tile.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/block_attention.h"
#include "core/error.h"

namespace dflash::cuda {

namespace {

using namespace ptx;
using namespace flash;
using namespace battn;

// ---- forward ------------------------------------------------------------------------------------------
// grid: (Hkv · m-tiles, nb); blocks in reverse order (the longest, latest anchors, first).
template <int D>
__global__ void __launch_bounds__(kThreads, 2) ba_fwd_kernel(const Args a) {
  constexpr int KS = D / 16, NT = kBN / 8, DT = D / 8, CH = D / 8;
  const int kh = blockIdx.x % a.Hkv, mt = blockIdx.x / a.Hkv;
  const int b = a.nb - 1 - blockIdx.y;
  const int m_start = mt * kBM;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sK = sQ + kBM * D;     // [2][kBN · D]
  bf16* sV = sK + 2 * kBN * D;  // [2][kBN · D]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const KeyPlan kp = key_plan(a, b, m_start);

  load_q_tile<D>(sQ, a.q, a, b, kh, m_start, tid);
  start_kv<D, false>(a, kp, b, kh, sK, sV, tid);

  const int a_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int a_chk = lane >> 4;
  const int k_row = (lane & 7) + (lane >> 4) * 8;
  const int k_chk = (lane >> 3) & 1;
  const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int v_chk = lane >> 4;

  uint32_t qf[KS][4];
  cp_async_wait<2>();
  __syncthreads();
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) ldmatrix_x4(qf[ks], sQ + swz<D>(a_row, ks * 2 + a_chk));

  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  const int g = lane >> 2, t4 = lane & 3;
  const int i0 = m_start + warp * 16 + g, i1 = i0 + 8;  // packed rows of c0/c1 and c2/c3
  const int j0 = i0 / a.G, j1 = i1 / a.G;

  for (int it = 0; it < kp.n_tiles; ++it) {
    const int stage = it & 1;
    const bf16* tK = sK + stage * kBN * D;
    const bf16* tV = sV + stage * kBN * D;
    const KeyTile kt = key_tile<D>(a, kp, b, kh, it);
    cp_async_wait<1>();
    __syncthreads();

    float s[NT][4];
    qk_scores<NT, KS, D, true>(s, qf, nullptr, 0, 0, tK, k_row, k_chk);
    mask_scores<NT>(s, a, kt, kp.anc, j0, j1, t4);

    flash::softmax_tile_pv<NT, DT, D>(s, o, m0, m1, l0, l1, a.scale_log2, tV, v_row, v_chk);
    __syncthreads();
    if (it + 2 < kp.n_tiles) load_kv_tile<D, false>(a, kp, b, kh, it + 2, sK, sV, stage, tid);
    cp_async_commit();
  }

  float inv0, inv1;
  flash::finish_rows(l0, l1, inv0, inv1);
  if (t4 == 0) {
    if (i0 < a.M) a.lse[qrow_idx(a, b, kh, i0)] = (m0 + __log2f(l0)) * kLn2;
    if (i1 < a.M) a.lse[qrow_idx(a, b, kh, i1)] = (m1 + __log2f(l1)) * kLn2;
  }
  const int r0 = warp * 16 + g, r1 = r0 + 8;
#pragma unroll
  for (int i = 0; i < DT; ++i) {
    *reinterpret_cast<uint32_t*>(sQ + swz<D>(r0, i) + 2 * t4) = pack_bf16(o[i][0] * inv0, o[i][1] * inv0);
    *reinterpret_cast<uint32_t*>(sQ + swz<D>(r1, i) + 2 * t4) = pack_bf16(o[i][2] * inv1, o[i][3] * inv1);
  }
  __syncwarp();
#pragma unroll
  for (int step = 0; step < CH / 2; ++step) {
    const int idx = step * 32 + lane;
    const int r = warp * 16 + idx / CH, c = idx % CH;
    const int i = m_start + r;
    if (i < a.M)
      *reinterpret_cast<uint4*>(a.out + qrow_off(a, b, kh, i, D) + c * 8) =
          *reinterpret_cast<const uint4*>(sQ + swz<D>(r, c));
  }
}

// ---- backward: δ = rowsum(dO · O) --------------------------------------------------------------------
// One warp per (row, head); lanes over d.
__global__ void ba_delta_kernel(const bf16* __restrict__ out, const bf16* __restrict__ dout, float* __restrict__ delta,
                                int64_t rows, int d) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= rows) return;
  const bf16* o = out + w * d;
  const bf16* g = dout + w * d;
  float acc = 0.0f;
  for (int e = lane; e < d; e += 32) acc += __bfloat162float(o[e]) * __bfloat162float(g[e]);
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) delta[w] = acc;
}

// ---- backward: dQ (query-major) ---------------------------------------------------------------------
template <int D>
__device__ __forceinline__ void dq_body(const Args& a, int kh, int mt, int b, unsigned char* smem_raw) {
  constexpr int KS = D / 16, NT = kBN / 8, DT = D / 8, CH = D / 8;
  const int m_start = mt * kBM;

  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sO = sQ + kBM * D;      // dO tile
  bf16* sK = sO + kBM * D;      // [2][kBN · D]
  bf16* sV = sK + 2 * kBN * D;  // [2][kBN · D]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const KeyPlan kp = key_plan(a, b, m_start);
  load_q_tile<D>(sQ, a.q, a, b, kh, m_start, tid);
  load_q_tile<D>(sO, a.dout, a, b, kh, m_start, tid);
  start_kv<D, false>(a, kp, b, kh, sK, sV, tid);

  const int a_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int a_chk = lane >> 4;
  const int k_row = (lane & 7) + (lane >> 4) * 8;
  const int k_chk = (lane >> 3) & 1;
  const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int v_chk = lane >> 4;
  const int g = lane >> 2, t4 = lane & 3;
  const int i0 = m_start + warp * 16 + g, i1 = i0 + 8;
  const int j0 = i0 / a.G, j1 = i1 / a.G;
  // Rows past M: lse2 = +inf gives p = 0.
  const float lse0 = i0 < a.M ? a.lse[qrow_idx(a, b, kh, i0)] * kLog2e : INFINITY;
  const float lse1 = i1 < a.M ? a.lse[qrow_idx(a, b, kh, i1)] * kLog2e : INFINITY;
  const float dl0 = i0 < a.M ? a.delta[qrow_idx(a, b, kh, i0)] : 0.0f;
  const float dl1 = i1 < a.M ? a.delta[qrow_idx(a, b, kh, i1)] : 0.0f;

  // Q fragments live in registers; dO's too at d = 64 (at d = 128 they would spill: re-read).
  constexpr bool kORegs = D <= 64;
  uint32_t qf[KS][4], of[kORegs ? KS : 1][4];
  cp_async_wait<2>();
  __syncthreads();
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    ldmatrix_x4(qf[ks], sQ + swz<D>(a_row, ks * 2 + a_chk));
    if constexpr (kORegs) ldmatrix_x4(of[ks], sO + swz<D>(a_row, ks * 2 + a_chk));
  }

  float dq[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.0f;

  for (int it = 0; it < kp.n_tiles; ++it) {
    const int stage = it & 1;
    const bf16* tK = sK + stage * kBN * D;
    const bf16* tV = sV + stage * kBN * D;
    const KeyTile kt = key_tile<D>(a, kp, b, kh, it);
    cp_async_wait<1>();
    __syncthreads();

    float s[NT][4], dp[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t oa[4];
      if constexpr (kORegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) oa[e] = of[ks][e];
      } else {
        ldmatrix_x4(oa, sO + swz<D>(a_row, ks * 2 + a_chk));
      }
#pragma unroll
      for (int n2 = 0; n2 < NT / 2; ++n2) {
        uint32_t kb[4], vb[4];
        ldmatrix_x4(kb, tK + swz<D>(n2 * 16 + k_row, ks * 2 + k_chk));
        mma_bf16(s[2 * n2], qf[ks], kb[0], kb[1]);
        mma_bf16(s[2 * n2 + 1], qf[ks], kb[2], kb[3]);
        ldmatrix_x4(vb, tV + swz<D>(n2 * 16 + k_row, ks * 2 + k_chk));
        mma_bf16(dp[2 * n2], oa, vb[0], vb[1]);
        mma_bf16(dp[2 * n2 + 1], oa, vb[2], vb[3]);
      }
    }
    const bool need_mask = kt.valid < kBN || a.sliding;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = i * 8 + 2 * t4 + (e & 1);
        const bool hi = e >> 1;
        float p = fast_exp2(fmaf(s[i][e], a.scale_log2, -(hi ? lse1 : lse0)));
        if (need_mask && (c >= kt.valid || !allowed(a, kt.ctx, kp.anc, hi ? j1 : j0, kt.key0 + c))) p = 0.0f;
        s[i][e] = p * (dp[i][e] - (hi ? dl1 : dl0));  // dS (scale applied at the end)
      }
    // dQ += dS K: K tile read transposed (keys are the k dimension).
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      const uint32_t pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int d2 = 0; d2 < DT / 2; ++d2) {
        uint32_t kb[4];
        ldmatrix_x4_trans(kb, tK + swz<D>(kk * 16 + v_row, d2 * 2 + v_chk));
        mma_bf16(dq[2 * d2], pa, kb[0], kb[1]);
        mma_bf16(dq[2 * d2 + 1], pa, kb[2], kb[3]);
      }
    }
    __syncthreads();
    if (it + 2 < kp.n_tiles) load_kv_tile<D, false>(a, kp, b, kh, it + 2, sK, sV, stage, tid);
    cp_async_commit();
  }

  const int r0 = warp * 16 + g, r1 = r0 + 8;
#pragma unroll
  for (int i = 0; i < DT; ++i) {
    *reinterpret_cast<uint32_t*>(sQ + swz<D>(r0, i) + 2 * t4) = pack_bf16(dq[i][0] * a.scale, dq[i][1] * a.scale);
    *reinterpret_cast<uint32_t*>(sQ + swz<D>(r1, i) + 2 * t4) = pack_bf16(dq[i][2] * a.scale, dq[i][3] * a.scale);
  }
  __syncwarp();
#pragma unroll
  for (int step = 0; step < CH / 2; ++step) {
    const int idx = step * 32 + lane;
    const int r = warp * 16 + idx / CH, c = idx % CH;
    const int i = m_start + r;
    if (i < a.M)
      *reinterpret_cast<uint4*>(a.dq + qrow_off(a, b, kh, i, D) + c * 8) =
          *reinterpret_cast<const uint4*>(sQ + swz<D>(r, c));
  }
}

// ---- backward: dK, dV (key-tile-major) ---------------------------------------------------------------
// CTX: key tile key_tile of sequence z (context keys); else key tile key_tile of block z's own keys.
template <int D, bool CTX>
__device__ __forceinline__ void dkv_body(const Args& a, int kh, int key_tile, int z, unsigned char* smem_raw) {
  constexpr int KS = D / 16, NT = kBM / 8, DT = D / 8, CH = D / 8;
  DkvItems di;
  if (!dkv_items<CTX>(a, key_tile, z, di)) return;
  const int key0 = di.key0, valid = di.valid, b_first = di.b_first, anc_fixed = di.anc_fixed;
  const int m_tiles = di.m_tiles, n_items = di.n_items;
  const int64_t row0 = di.row0;

  bf16* sK = reinterpret_cast<bf16*>(smem_raw);
  bf16* sV = sK + kBN * D;
  bf16* sQ = sV + kBN * D;       // [2][kBM · D]
  bf16* sO = sQ + 2 * kBM * D;   // [2][kBM · D]  dO
  float* sL = reinterpret_cast<float*>(sO + 2 * kBM * D);  // [2][kBM] lse
  float* sD = sL + 2 * kBM;                                 // [2][kBM] δ

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t ldkv = int64_t(a.Hkv) * D;
  const int64_t koff = row0 * ldkv + int64_t(kh) * D;
  load_k_tile<D>(sK, (CTX ? a.kc : a.kb) + koff, ldkv, valid, tid);
  load_k_tile<D>(sV, (CTX ? a.vc : a.vb) + koff, ldkv, valid, tid);
  cp_async_commit();
  auto load_item = [&](int item, int stage) {
    const int b = b_first + item / m_tiles, m_start = (item % m_tiles) * kBM;
    load_q_tile<D>(sQ + stage * kBM * D, a.q, a, b, kh, m_start, tid);
    load_q_tile<D>(sO + stage * kBM * D, a.dout, a, b, kh, m_start, tid);
    if (tid < kBM) {
      const int i = m_start + tid;
      const bool ok = i < a.M;
      const int64_t idx = ok ? qrow_idx(a, b, kh, i) : 0;
      cp_async_4(sL + stage * kBM + tid, a.lse + idx, ok ? 4 : 0);  // zero rows contribute 0 (q = dO = 0)
      cp_async_4(sD + stage * kBM + tid, a.delta + idx, ok ? 4 : 0);
    }
  };
  if (n_items > 0) load_item(0, 0);
  cp_async_commit();
  if (n_items > 1) load_item(1, 1);
  cp_async_commit();

  const int a_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int a_chk = lane >> 4;
  const int k_row = (lane & 7) + (lane >> 4) * 8;
  const int k_chk = (lane >> 3) & 1;
  const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int v_chk = lane >> 4;
  const int g = lane >> 2, t4 = lane & 3;
  const int kr0 = warp * 16 + g;  // key rows of c0/c1 (and +8 for c2/c3) within the tile

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;

  for (int item = 0; item < n_items; ++item) {
    const int stage = item & 1;
    const int b = b_first + item / m_tiles, m_start = (item % m_tiles) * kBM;
    const int anc = CTX ? a.anchor[b] : anc_fixed;
    const bf16* tQ = sQ + stage * kBM * D;
    const bf16* tO = sO + stage * kBM * D;
    const float* tL = sL + stage * kBM;
    const float* tD = sD + stage * kBM;
    cp_async_wait<1>();
    __syncthreads();

    // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: [16 keys, 64 queries] per warp.
    float st[NT][4], dpt[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t ka[4], va[4];
      ldmatrix_x4(ka, sK + swz<D>(a_row, ks * 2 + a_chk));
      ldmatrix_x4(va, sV + swz<D>(a_row, ks * 2 + a_chk));
#pragma unroll
      for (int n2 = 0; n2 < NT / 2; ++n2) {
        uint32_t qb[4], ob[4];
        ldmatrix_x4(qb, tQ + swz<D>(n2 * 16 + k_row, ks * 2 + k_chk));
        mma_bf16(st[2 * n2], ka, qb[0], qb[1]);
        mma_bf16(st[2 * n2 + 1], ka, qb[2], qb[3]);
        ldmatrix_x4(ob, tO + swz<D>(n2 * 16 + k_row, ks * 2 + k_chk));
        mma_bf16(dpt[2 * n2], va, ob[0], ob[1]);
        mma_bf16(dpt[2 * n2 + 1], va, ob[2], ob[3]);
      }
    }
    // The mask cuts this item only on sliding layers or where the key tile crosses the anchor
    // (context keys >= anchor); padded key rows (>= valid) are never written, so left unmasked.
    const bool need_mask = a.sliding || (CTX && key0 + valid > anc);
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = i * 8 + 2 * t4 + (e & 1);  // query column within the tile
        float p = fast_exp2(fmaf(st[i][e], a.scale_log2, -tL[c] * kLog2e));
        if (need_mask) {
          const int key = key0 + kr0 + (e >> 1) * 8;
          const int j = (m_start + c) / a.G;
          bool ok = CTX ? key < anc : true;
          ok = ok && allowed(a, CTX, anc, j, key);
          if (!ok) p = 0.0f;
        }
        st[i][e] = p;
        dpt[i][e] = p * (dpt[i][e] - tD[c]);  // dSᵀ
      }
    // dV += Pᵀ dO and dK += dSᵀ Q: queries are the k dimension (dO, Q read transposed).
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk) {
      const uint32_t pa[4] = {pack_bf16(st[2 * kk][0], st[2 * kk][1]), pack_bf16(st[2 * kk][2], st[2 * kk][3]),
                              pack_bf16(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                              pack_bf16(st[2 * kk + 1][2], st[2 * kk + 1][3])};
      const uint32_t sa[4] = {pack_bf16(dpt[2 * kk][0], dpt[2 * kk][1]), pack_bf16(dpt[2 * kk][2], dpt[2 * kk][3]),
                              pack_bf16(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                              pack_bf16(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
#pragma unroll
      for (int d2 = 0; d2 < DT / 2; ++d2) {
        uint32_t ob[4], qb[4];
        ldmatrix_x4_trans(ob, tO + swz<D>(kk * 16 + v_row, d2 * 2 + v_chk));
        mma_bf16(dv[2 * d2], pa, ob[0], ob[1]);
        mma_bf16(dv[2 * d2 + 1], pa, ob[2], ob[3]);
        ldmatrix_x4_trans(qb, tQ + swz<D>(kk * 16 + v_row, d2 * 2 + v_chk));
        mma_bf16(dk[2 * d2], sa, qb[0], qb[1]);
        mma_bf16(dk[2 * d2 + 1], sa, qb[2], qb[3]);
      }
    }
    __syncthreads();
    if (item + 2 < n_items) load_item(item + 2, stage);
    cp_async_commit();
  }
  cp_async_wait<0>();
  __syncthreads();

  // Stage dK (scaled) in sK and dV in sV (each warp its own 16 rows), then 16-byte stores.
  const int r0 = kr0, r1 = kr0 + 8;
#pragma unroll
  for (int i = 0; i < DT; ++i) {
    *reinterpret_cast<uint32_t*>(sK + swz<D>(r0, i) + 2 * t4) = pack_bf16(dk[i][0] * a.scale, dk[i][1] * a.scale);
    *reinterpret_cast<uint32_t*>(sK + swz<D>(r1, i) + 2 * t4) = pack_bf16(dk[i][2] * a.scale, dk[i][3] * a.scale);
    *reinterpret_cast<uint32_t*>(sV + swz<D>(r0, i) + 2 * t4) = pack_bf16(dv[i][0], dv[i][1]);
    *reinterpret_cast<uint32_t*>(sV + swz<D>(r1, i) + 2 * t4) = pack_bf16(dv[i][2], dv[i][3]);
  }
  __syncwarp();
  bf16* gk = (CTX ? a.dkc : a.dkb) + koff;
  bf16* gv = (CTX ? a.dvc : a.dvb) + koff;
#pragma unroll
  for (int step = 0; step < CH / 2; ++step) {
    const int idx = step * 32 + lane;
    const int r = warp * 16 + idx / CH, c = idx % CH;
    if (r < valid) {
      *reinterpret_cast<uint4*>(gk + r * ldkv + c * 8) = *reinterpret_cast<const uint4*>(sK + swz<D>(r, c));
      *reinterpret_cast<uint4*>(gv + r * ldkv + c * 8) = *reinterpret_cast<const uint4*>(sV + swz<D>(r, c));
    }
  }
}

// ---- backward: one launch for dK/dV and dQ ----------------------------------------------------------------
// The context dK/dV CTAs are very uneven (the first key tile of a sequence is seen by every block,
// the last by few), so they go first, heaviest first (key tile outermost), and the many short dQ
// CTAs (latest anchors first) and the own-block dK/dV CTAs fill the SMs around them: one grid,
// no tail of idle SMs behind the longest context CTA. Same shared-memory size and register budget
// for all three roles.
template <int D>
__global__ void __launch_bounds__(kThreads, 2)
    ba_bwd_kernel(const Args a, int num_seqs, int n_ctx_ctas, int n_dq_ctas) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const BwdRole r = bwd_role(a, blockIdx.x, num_seqs, n_ctx_ctas, n_dq_ctas);
  if (r.kind == BwdRole::CtxKV) dkv_body<D, true>(a, r.kh, r.tile, r.z, smem_raw);
  else if (r.kind == BwdRole::DQ) dq_body<D>(a, r.kh, r.tile, r.z, smem_raw);
  else dkv_body<D, false>(a, r.kh, r.tile, r.z, smem_raw);
}

// ---- fallback -----------------------------------------------------------------------------------------
constexpr int kFbThreads = 128;
constexpr int kFbChunk = 64;

// The keys of query (b, j): context positions [c_lo, c_hi) then block offsets [k_lo, k_hi).
struct FbKeys {
  int c_lo, c_hi, k_lo, k_hi;
  __device__ int count() const { return (c_hi - c_lo) + (k_hi - k_lo); }
};
__device__ FbKeys fb_keys(const Args& a, int anc, int j) {
  FbKeys k;
  k.c_hi = anc;
  k.c_lo = a.sliding ? max(0, anc + j - (a.window - 1)) : 0;
  k.c_lo = min(k.c_lo, k.c_hi);
  k.k_lo = a.sliding ? max(0, j - (a.window - 1)) : 0;
  k.k_hi = a.sliding ? j + 1 : a.B;
  return k;
}

// grid (R, Hq). Writes out and lse (bwd = false), or dq from (dout, lse, δ) (bwd = true).
__global__ void ba_fb_query_kernel(const Args a, int d, bool bwd) {
  extern __shared__ float fb_smem[];
  float* sq = fb_smem;        // [d] query row
  float* sg = sq + d;         // [d] dO row (bwd)
  float* acc = sg + d;        // [d]
  float* sc = acc + d;        // [kFbChunk]
  const int row = blockIdx.x, h = blockIdx.y;
  const int b = row / a.B, j = row % a.B, kh = h / a.G;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int anc = a.anchor[b];
  const int64_t begin = a.cu_seqlens[a.block_seq[b]];
  const FbKeys ks = fb_keys(a, anc, j);
  const int nk = ks.count();
  const int64_t qo = (int64_t(row) * a.Hq + h) * d;
  for (int e = tid; e < d; e += kFbThreads) {
    sq[e] = __bfloat162float(a.q[qo + e]);
    sg[e] = bwd ? __bfloat162float(a.dout[qo + e]) : 0.0f;
    acc[e] = 0.0f;
  }
  const float lse = bwd ? a.lse[int64_t(row) * a.Hq + h] : 0.0f;
  const float dl = bwd ? a.delta[int64_t(row) * a.Hq + h] : 0.0f;
  __syncthreads();
  auto key_ptr = [&](int k, bool v) -> const bf16* {
    const int nc = ks.c_hi - ks.c_lo;
    if (k < nc) return (v ? a.vc : a.kc) + ((begin + ks.c_lo + k) * a.Hkv + kh) * d;
    return (v ? a.vb : a.kb) + ((int64_t(b) * a.B + ks.k_lo + (k - nc)) * a.Hkv + kh) * d;
  };
  float m = -INFINITY, l = 0.0f;
  for (int c = 0; c < nk; c += kFbChunk) {
    const int cnt = min(kFbChunk, nk - c);
    for (int i = warp; i < cnt; i += kFbThreads / 32) {
      const bf16* kr = key_ptr(c + i, false);
      const bf16* vr = key_ptr(c + i, true);
      float dot = 0.0f, dpv = 0.0f;
      for (int e = lane; e < d; e += 32) {
        dot += sq[e] * __bfloat162float(kr[e]);
        if (bwd) dpv += sg[e] * __bfloat162float(vr[e]);
      }
      for (int off = 16; off > 0; off >>= 1) {
        dot += __shfl_xor_sync(0xffffffffu, dot, off);
        dpv += __shfl_xor_sync(0xffffffffu, dpv, off);
      }
      if (lane == 0) sc[i] = bwd ? expf(dot * a.scale - lse) * (dpv - dl) : dot * a.scale;  // dS or score
    }
    __syncthreads();
    if (bwd) {
      for (int e = tid; e < d; e += kFbThreads) {
        float s = acc[e];
        for (int i = 0; i < cnt; ++i) s += sc[i] * __bfloat162float(key_ptr(c + i, false)[e]);
        acc[e] = s;
      }
    } else {
      float mx = -INFINITY;
      for (int i = 0; i < cnt; ++i) mx = fmaxf(mx, sc[i]);
      const float m_new = fmaxf(m, mx);
      const float alpha = expf(m - m_new);
      __syncthreads();
      if (tid < cnt) sc[tid] = expf(sc[tid] - m_new);
      __syncthreads();
      float sum = 0.0f;
      for (int i = 0; i < cnt; ++i) sum += sc[i];
      l = l * alpha + sum;
      m = m_new;
      for (int e = tid; e < d; e += kFbThreads) {
        float s = acc[e] * alpha;
        for (int i = 0; i < cnt; ++i) s += sc[i] * __bfloat162float(key_ptr(c + i, true)[e]);
        acc[e] = s;
      }
    }
    __syncthreads();
  }
  if (bwd) {
    for (int e = tid; e < d; e += kFbThreads) a.dq[qo + e] = __float2bfloat16_rn(acc[e] * a.scale);
  } else {
    for (int e = tid; e < d; e += kFbThreads) a.out[qo + e] = __float2bfloat16_rn(acc[e] / l);
    if (tid == 0) a.lse[int64_t(row) * a.Hq + h] = m + logf(l);
  }
}

// grid (N + R, Hkv): rows < N are context keys, the rest own-block keys. The candidate queries
// (block, j, hh) are walked in chunks; warps compute p and dS, threads over d accumulate.
__global__ void ba_fb_key_kernel(const Args a, int d, int64_t N, int num_seqs) {
  extern __shared__ float fb_smem[];
  float* sk = fb_smem;   // [d]
  float* sv = sk + d;    // [d]
  float* ak = sv + d;    // [d] dK accumulator
  float* av = ak + d;    // [d] dV accumulator
  float* sp = av + d;    // [kFbChunk] p
  float* ss = sp + kFbChunk;  // [kFbChunk] dS
  int* sidx = reinterpret_cast<int*>(ss + kFbChunk);  // [kFbChunk] query (row·Hq + h), −1 masked
  const int64_t key = blockIdx.x;
  const int kh = blockIdx.y;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const bool ctx = key < N;
  int b_first, b_end, t = 0, jj = 0;
  const bf16 *kr, *vr;
  bf16 *gk, *gv;
  if (ctx) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (a.cu_seqlens[mid] <= key) lo = mid; else hi = mid - 1;
    }
    t = static_cast<int>(key - a.cu_seqlens[lo]);
    b_first = a.cu_blocks[lo];
    b_end = a.cu_blocks[lo + 1];
    const int64_t off = (key * a.Hkv + kh) * d;
    kr = a.kc + off; vr = a.vc + off; gk = a.dkc + off; gv = a.dvc + off;
  } else {
    const int64_t r = key - N;
    b_first = static_cast<int>(r / a.B);
    b_end = b_first + 1;
    jj = static_cast<int>(r % a.B);
    const int64_t off = (r * a.Hkv + kh) * d;
    kr = a.kb + off; vr = a.vb + off; gk = a.dkb + off; gv = a.dvb + off;
  }
  for (int e = tid; e < d; e += kFbThreads) {
    sk[e] = __bfloat162float(kr[e]);
    sv[e] = __bfloat162float(vr[e]);
    ak[e] = av[e] = 0.0f;
  }
  __syncthreads();
  const int64_t nq = int64_t(b_end - b_first) * a.M;
  for (int64_t c = 0; c < nq; c += kFbChunk) {
    const int cnt = static_cast<int>(min(int64_t(kFbChunk), nq - c));
    for (int i = warp; i < cnt; i += kFbThreads / 32) {
      const int64_t qi = c + i;
      const int b = b_first + static_cast<int>(qi / a.M);
      const int rem = static_cast<int>(qi % a.M);
      const int j = rem / a.G, h = kh * a.G + rem % a.G;
      const int anc = a.anchor[b];
      bool ok;
      if (ctx) ok = t < anc && (!a.sliding || t >= anc + j - (a.window - 1));
      else ok = !a.sliding || (jj <= j && jj >= j - (a.window - 1));
      if (!ok) {
        if (lane == 0) sidx[i] = -1;
        continue;
      }
      const int64_t qrow = int64_t(b) * a.B + j;
      const bf16* qr = a.q + (qrow * a.Hq + h) * d;
      const bf16* gr = a.dout + (qrow * a.Hq + h) * d;
      float dot = 0.0f, dpv = 0.0f;
      for (int e = lane; e < d; e += 32) {
        dot += sk[e] * __bfloat162float(qr[e]);
        dpv += sv[e] * __bfloat162float(gr[e]);
      }
      for (int off = 16; off > 0; off >>= 1) {
        dot += __shfl_xor_sync(0xffffffffu, dot, off);
        dpv += __shfl_xor_sync(0xffffffffu, dpv, off);
      }
      if (lane == 0) {
        const float p = expf(dot * a.scale - a.lse[qrow * a.Hq + h]);
        sp[i] = p;
        ss[i] = p * (dpv - a.delta[qrow * a.Hq + h]);
        sidx[i] = static_cast<int>(qrow * a.Hq + h);
      }
    }
    __syncthreads();
    for (int e = tid; e < d; e += kFbThreads) {
      float k_acc = ak[e], v_acc = av[e];
      for (int i = 0; i < cnt; ++i) {
        if (sidx[i] < 0) continue;
        const int64_t o = int64_t(sidx[i]) * d + e;
        v_acc += sp[i] * __bfloat162float(a.dout[o]);
        k_acc += ss[i] * __bfloat162float(a.q[o]);
      }
      ak[e] = k_acc;
      av[e] = v_acc;
    }
    __syncthreads();
  }
  for (int e = tid; e < d; e += kFbThreads) {
    gk[e] = __float2bfloat16_rn(ak[e] * a.scale);
    gv[e] = __float2bfloat16_rn(av[e]);
  }
}

// ---- host side ----------------------------------------------------------------------------------------
void validate(const BlockAttnParams& p, const char* op) {
  DFLASH_CHECK(p.nb >= 0 && p.B >= 1 && p.N >= 0 && p.num_seqs >= 1 && p.Hq > 0 && p.Hkv > 0 && p.d > 0,
               op << ": bad sizes nb=" << p.nb << " B=" << p.B << " N=" << p.N << " num_seqs=" << p.num_seqs
                  << " Hq=" << p.Hq << " Hkv=" << p.Hkv << " d=" << p.d);
  DFLASH_CHECK(p.Hq % p.Hkv == 0, op << ": " << p.Hq << " query heads are not a multiple of " << p.Hkv << " kv heads");
  DFLASH_CHECK(!p.sliding || p.window > 0, op << ": sliding window must be > 0, got " << p.window);
  DFLASH_CHECK(std::isfinite(p.scale) && p.scale >= 0.0f, op << ": scale must be finite and >= 0, got " << p.scale);
  DFLASH_CHECK(p.max_seqlen >= 0 && p.max_seqlen <= p.N,
               op << ": max_seqlen " << p.max_seqlen << " must lie in [0, N = " << p.N << "]");
  DFLASH_CHECK(p.nb <= 65535 && p.num_seqs <= 65535, op << ": nb " << p.nb << " or num_seqs " << p.num_seqs
                                                        << " exceeds the grid limit 65535");
  const int64_t R = p.nb * p.B;
  DFLASH_CHECK(R * p.Hq * p.d < (int64_t(1) << 31) && (p.N + R) * p.Hkv * p.d < (int64_t(1) << 62) &&
                   p.N + R < INT32_MAX && p.B * p.Hq < (int64_t(1) << 24),
               op << ": tensors too large (R=" << R << ", N=" << p.N << ")");
  if (p.nb > 0)
    DFLASH_CHECK(p.q && p.kb && p.vb && p.out && p.lse && p.anchor && p.block_seq && p.cu_seqlens && p.cu_blocks,
                 op << ": null pointer (q, kb, vb, out, lse, anchor, block_seq, cu_seqlens or cu_blocks)");
  if (p.N > 0) DFLASH_CHECK(p.kc && p.vc, op << ": null context k / v with N = " << p.N);
}

Args args_of(const BlockAttnParams& p) {
  Args a{};
  a.q = static_cast<const bf16*>(p.q);
  a.kc = static_cast<const bf16*>(p.kc);
  a.vc = static_cast<const bf16*>(p.vc);
  a.kb = static_cast<const bf16*>(p.kb);
  a.vb = static_cast<const bf16*>(p.vb);
  a.out = static_cast<bf16*>(p.out);
  a.lse = p.lse;
  a.anchor = p.anchor;
  a.block_seq = p.block_seq;
  a.cu_seqlens = p.cu_seqlens;
  a.cu_blocks = p.cu_blocks;
  a.nb = static_cast<int>(p.nb);
  a.B = static_cast<int>(p.B);
  a.Hq = static_cast<int>(p.Hq);
  a.Hkv = static_cast<int>(p.Hkv);
  a.G = static_cast<int>(p.Hq / p.Hkv);
  a.M = a.B * a.G;
  a.sliding = p.sliding ? 1 : 0;
  a.window = static_cast<int>(std::min<int64_t>(p.window, INT32_MAX / 4));
  a.scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(p.d));
  a.scale_log2 = a.scale * kLog2e;
  return a;
}

bool use_fast(const BlockAttnParams& p) {
  if (p.force_fallback || !(p.d == 64 || p.d == 128)) return false;
  int dev = 0, major = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major < 8) return false;
  for (const void* ptr : {p.q, p.kc, p.vc, p.kb, p.vb, static_cast<const void*>(p.out)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
  return true;
}

// Whether the tensor-core path runs the wgmma kernels (block_attention_sm90.cu).
bool use_wgmma(const BlockAttnParams& p) {
  int dev = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  const bool available = battn::wgmma_available(p.d, dev);
  DFLASH_CHECK_HINT(p.impl != FlashImpl::Wgmma || available,
                    "block attention: the wgmma kernels cannot run head dim " << p.d << " on CUDA device " << dev,
                    "they need head dim 128, an sm_90 GPU and a build with sm_90a code; use FlashImpl::Auto");
  return p.impl != FlashImpl::MmaSync && available;
}

template <class K>
void set_smem(K kernel, size_t bytes) {
  DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <int D>
void launch_fwd(const Args& a, cudaStream_t st) {
  const size_t smem = size_t(kBM + 4 * kBN) * D * 2;
  set_smem(ba_fwd_kernel<D>, smem);
  const dim3 grid(static_cast<unsigned>(a.Hkv * ((a.M + kBM - 1) / kBM)), static_cast<unsigned>(a.nb));
  ba_fwd_kernel<D><<<grid, kThreads, smem, st>>>(a);
  DFLASH_CUDA_CHECK_LAST();
}

template <int D>
void launch_bwd(const Args& a, int64_t num_seqs, int64_t max_seqlen, cudaStream_t st) {
  const size_t smem_q = size_t(2 * kBM + 4 * kBN) * D * 2;
  const size_t smem_kv = size_t(2 * kBN + 4 * kBM) * D * 2 + 4 * kBM * sizeof(float);
  const size_t smem = std::max(smem_q, smem_kv);
  set_smem(ba_bwd_kernel<D>, smem);
  const BwdGrid g = bwd_grid(a, num_seqs, max_seqlen);
  DFLASH_CHECK(g.n_ctx + g.n_dq + g.n_blk < INT32_MAX, "block_attention_bwd: grid too large");
  ba_bwd_kernel<D><<<static_cast<unsigned>(g.n_ctx + g.n_dq + g.n_blk), kThreads, smem, st>>>(
      a, static_cast<int>(num_seqs), static_cast<int>(g.n_ctx), static_cast<int>(g.n_dq));
  DFLASH_CUDA_CHECK_LAST();
}

size_t fb_query_smem(int64_t d) { return (3 * static_cast<size_t>(d) + kFbChunk) * sizeof(float); }
size_t fb_key_smem(int64_t d) { return (4 * static_cast<size_t>(d) + 3 * kFbChunk) * sizeof(float); }

}  // namespace

bool block_attention_supported(int64_t d, int sm_major) { return (d == 64 || d == 128) && sm_major >= 8; }

const char* block_attention_kernel_name(int64_t d, int device) {
  return battn::wgmma_available(d, device) ? "wgmma sm_90a" : "mma.sync";
}

void block_attention_fwd(const BlockAttnParams& p, Stream s) {
  validate(p, "block_attention_fwd");
  if (p.nb == 0) return;
  const Args a = args_of(p);
  const auto st = static_cast<cudaStream_t>(s);
  if (use_fast(p)) {
    if (use_wgmma(p)) launch_fwd_wgmma(a, st);
    else if (p.d == 64) launch_fwd<64>(a, st);
    else launch_fwd<128>(a, st);
    return;
  }
  DFLASH_CHECK(p.d <= 8192, "block_attention_fwd: head dim " << p.d << " exceeds the fallback's 8192");
  const size_t smem = fb_query_smem(p.d);
  set_smem(ba_fb_query_kernel, smem);
  ba_fb_query_kernel<<<dim3(static_cast<unsigned>(p.nb * p.B), static_cast<unsigned>(p.Hq)), kFbThreads, smem, st>>>(
      a, static_cast<int>(p.d), false);
  DFLASH_CUDA_CHECK_LAST();
}

namespace {

// δ [R, Hq] floats; then, where the wgmma backward may run, its dSᵀ tiles (64 x 64 bf16 per block,
// kv head, query tile and 64-key tile the block may attend, ds_tiles_per_block).
int64_t delta_bytes(const BlockAttnParams& p) {
  return (p.nb * p.B * p.Hq * static_cast<int64_t>(sizeof(float)) + 255) / 256 * 256;
}
int64_t ds_bytes(const BlockAttnParams& p) {
  if (p.force_fallback || p.impl == FlashImpl::MmaSync || p.nb == 0) return 0;
  int dev = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  if (!battn::wgmma_available(p.d, dev)) return 0;
  const int64_t m_tiles = (p.B * (p.Hq / p.Hkv) + kBM - 1) / kBM;
  return p.nb * battn::ds_tiles_per_block(p.max_seqlen, p.B) * p.Hkv * m_tiles * kBN * kBM * 2;
}

}  // namespace

int64_t block_attention_bwd_workspace(const BlockAttnParams& p) { return delta_bytes(p) + ds_bytes(p); }

void block_attention_bwd(const BlockAttnBwdParams& bp, Stream s) {
  const BlockAttnParams& p = bp.fwd;
  validate(p, "block_attention_bwd");
  DFLASH_CHECK(bp.dout && bp.dkb && bp.dvb && (p.nb == 0 || bp.dq) && (p.N == 0 || (bp.dkc && bp.dvc)),
               "block_attention_bwd: null pointer (dout, dq, dkc, dvc, dkb or dvb)");
  DFLASH_CHECK(bp.workspace || block_attention_bwd_workspace(p) == 0, "block_attention_bwd: null workspace");
  Args a = args_of(p);
  a.dout = static_cast<const bf16*>(bp.dout);
  a.dq = static_cast<bf16*>(bp.dq);
  a.dkc = static_cast<bf16*>(bp.dkc);
  a.dvc = static_cast<bf16*>(bp.dvc);
  a.dkb = static_cast<bf16*>(bp.dkb);
  a.dvb = static_cast<bf16*>(bp.dvb);
  a.delta = static_cast<float*>(bp.workspace);
  const auto st = static_cast<cudaStream_t>(s);
  if (p.nb == 0) {  // nothing attends: every context gradient is zero
    if (p.N > 0) {
      DFLASH_CUDA_CHECK(cudaMemsetAsync(bp.dkc, 0, p.N * p.Hkv * p.d * 2, st));
      DFLASH_CUDA_CHECK(cudaMemsetAsync(bp.dvc, 0, p.N * p.Hkv * p.d * 2, st));
    }
    return;
  }
  const int64_t rows = p.nb * p.B * p.Hq;
  ba_delta_kernel<<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, st>>>(a.out, a.dout, a.delta, rows,
                                                                                  static_cast<int>(p.d));
  DFLASH_CUDA_CHECK_LAST();
  bool fast = use_fast(p);
  for (const void* ptr : {bp.dout, static_cast<const void*>(bp.dq), static_cast<const void*>(bp.dkc),
                          static_cast<const void*>(bp.dvc), static_cast<const void*>(bp.dkb),
                          static_cast<const void*>(bp.dvb)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) fast = false;
  if (fast) {
    if (use_wgmma(p)) {  // the workspace holds ds_bytes(p) after δ (block_attention_bwd_workspace of the same p)
      a.ds = reinterpret_cast<bf16*>(static_cast<unsigned char*>(bp.workspace) + delta_bytes(p));
      a.ds_tiles = static_cast<int>(battn::ds_tiles_per_block(p.max_seqlen, p.B));
      launch_bwd_wgmma(a, p.num_seqs, p.max_seqlen, st);
    } else if (p.d == 64) launch_bwd<64>(a, p.num_seqs, p.max_seqlen, st);
    else launch_bwd<128>(a, p.num_seqs, p.max_seqlen, st);
    return;
  }
  DFLASH_CHECK(p.d <= 8192, "block_attention_bwd: head dim " << p.d << " exceeds the fallback's 8192");
  const size_t smem_q = fb_query_smem(p.d);
  set_smem(ba_fb_query_kernel, smem_q);
  ba_fb_query_kernel<<<dim3(static_cast<unsigned>(p.nb * p.B), static_cast<unsigned>(p.Hq)), kFbThreads, smem_q, st>>>(
      a, static_cast<int>(p.d), true);
  DFLASH_CUDA_CHECK_LAST();
  const size_t smem_k = fb_key_smem(p.d);
  set_smem(ba_fb_key_kernel, smem_k);
  ba_fb_key_kernel<<<dim3(static_cast<unsigned>(p.N + p.nb * p.B), static_cast<unsigned>(p.Hkv)), kFbThreads, smem_k,
                      st>>>(a, static_cast<int>(p.d), p.N, static_cast<int>(p.num_seqs));
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda
