// DFlash block attention on Hopper warpgroup MMA (wgmma, sm_90a), head dim 128, with the tiling,
// tile walk, masks, softmax and dK/dV CTA roles of block_attention.cu (block_attention_tile.cuh)
// and every matrix product on wgmma: a CTA's 4 warps are one warpgroup, its 64-row tiles one m64
// operand. Shared tiles use wgmma.cuh's panel layout (128-byte swizzle), filled by cp.async and
// fenced to the async proxy.
//   forward : S = Q Kᵀ (Q from registers), online softmax, O += P V (P from registers, V MN-major);
//   pass 1  : per key tile (dK/dV CTAs, key-tile-major): Sᵀ = K Qᵀ, dPᵀ = V dOᵀ (SS),
//             dV += Pᵀ dO, dK += dSᵀ Q (dO, Q MN-major), and each dSᵀ tile (bf16, as dK consumed it)
//             goes to the workspace by a bulk (TMA engine) store;
//   pass 2  : per query tile: dQ = scale · Σ dS K over its key tiles in a fixed order (dS by
//             ldmatrix.trans from the stored dSᵀ tiles, K MN-major): one product per tile instead of
//             forming S and dP a second time (5 products in the backward, not 7), deterministic.
// block_attention_fwd / _bwd (block_attention.cu) run these on an sm_90 GPU at d = 128 unless
// BlockAttnParams::impl asks for mma.sync. The dSᵀ workspace is 8 KiB per (block, kv head, query
// tile, 64-key tile the block may attend): about 2.2 GB at the 27B drafter shape of kernel_bench.
//
// Measured (H200, that shape, 0630575): fwd 0.675 ms, bwd 1.577 ms (dK/dV pass 1.19, dQ pass 0.35 —
// bound by reading the dSᵀ tiles from DRAM —, δ 0.04), fwd+bwd 2.353 ms = 54.6% of the dense GEMM
// ceiling of the same run (50.0% of 798 TFLOP/s, the day's highest). The dK/dV pass is one
// warpgroup per CTA at 255 registers, two CTAs per SM, each item a dependent chain of four products;
// more needs a producer warp with TMA and two consumer warpgroups taking turns (bench/README.md).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/block_attention_tile.cuh"
#include "core/cuda/check.h"
#include "kernels/cuda/wgmma.cuh"
#include "core/error.h"

namespace dflash::cuda::battn {

namespace {

using flash::cp_async_wait;
using flash::fast_exp2;

template <int D>
struct WgSizes {
  static constexpr int kQ = kBM * D * 2, kK = kBN * D * 2;  // one query-row / key tile, bytes
  static constexpr uint32_t kPanelQ = kBM * 128, kPanelK = kBN * 128;  // panel strides
  static constexpr int kS = kBN * kBM * 2;                              // one dSᵀ tile, bytes
  static constexpr int kDqStages = 3;
  static constexpr size_t kFwd = 4 * size_t(kK) + 1024;                // + alignment slack (Q shares V stage 1)
  static constexpr size_t kDkv = 2 * size_t(kK) + 4 * kQ + kS + 4 * kBM * sizeof(float) + 1024;
  static constexpr size_t kDq = kDqStages * size_t(kS + kK) + 1024;
};

// Writes the CTA's staged 64 rows (panel tile) out, this warp's 16: row r goes to dst(r) when
// r < valid (16-byte stores).
template <int D, class Dst>
__device__ __forceinline__ void write_rows(const unsigned char* tile, int valid, Dst dst) {
  constexpr int CH = D / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int step = 0; step < CH / 2; ++step) {
    const int idx = step * 32 + lane;
    const int r = warp * 16 + idx / CH, c = idx % CH;
    if (r < valid)
      *reinterpret_cast<uint4*>(dst(r) + c * 8) = *reinterpret_cast<const uint4*>(tile + wgmma::panel_offset(64, r, c));
  }
}

// ---- forward ------------------------------------------------------------------------------------------
// Three CTAs per SM (the loop is latency-bound: more warpgroups to interleave): registers <= 168,
// and the query tile shares the second value stage (Q lives in registers once loaded), so a CTA
// holds only its two key / value stages.
template <int D>
__global__ void __launch_bounds__(kThreads, 3) ba_fwd_wg_kernel(const Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Z = WgSizes<D>;
  constexpr int P = D / 64, KS = D / 16, NT = kBN / 8;
  const int kh = blockIdx.x % a.Hkv, mt = blockIdx.x / a.Hkv;
  const int b = a.nb - 1 - blockIdx.y;
  const int m_start = mt * kBM;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* sK = wgmma::align1024(smem_raw);  // [2] key tiles
  unsigned char* sV = sK + 2 * Z::kK;               // [2] value tiles
  unsigned char* sQ = sV + Z::kK;                   // the query tile (and at the end O), in value stage 1

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const KeyPlan kp = key_plan(a, b, m_start);
  // cp.async groups: Q, key tile 0, then (once Q is in registers) key tile 1, as start_kv makes them.
  load_q_tile<D, true>(sQ, a.q, a, b, kh, m_start, tid);
  ptx::cp_async_commit();
  load_kv_tile<D, true>(a, kp, b, kh, 0, sK, sV, 0, tid);
  ptx::cp_async_commit();

  float o[P][32];
  wgmma::zero(o);
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  const int g = lane >> 2, t4 = lane & 3;
  const int i0 = m_start + warp * 16 + g, i1 = i0 + 8;  // packed rows of elements 0/1 and 2/3
  const int j0 = i0 / a.G, j1 = i1 / a.G;
  // Q stays in registers as wgmma A fragments: S = Q Kᵀ reads only K from shared memory.
  uint32_t qf[KS][4];
  cp_async_wait<1>();
  __syncthreads();
  wgmma::load_a_fragments<KS>(qf, sQ, kBM, 0);
  __syncthreads();  // every warp holds its Q fragments: value stage 1 may be filled
  if (kp.n_tiles >= 2) load_kv_tile<D, true>(a, kp, b, kh, 1, sK, sV, 1, tid);
  ptx::cp_async_commit();

  for (int it = 0; it < kp.n_tiles; ++it) {
    const int stage = it & 1;
    const KeyTile kt = key_tile<D>(a, kp, b, kh, it);
    cp_async_wait<1>();
    wgmma::fence_async_smem();
    __syncthreads();

    float s[NT][4];
    float(&sf)[NT * 4] = reinterpret_cast<float(&)[NT * 4]>(s);
    wgmma::issue_nt_rs<KS>(sf, qf, wgmma::descriptor(sK + stage * Z::kK, 0, 1024), Z::kPanelK);
    wgmma::wait<0>();
    wgmma::pin(sf);
    mask_scores<NT>(s, a, kt, kp.anc, j0, j1, t4);
    wgmma::softmax_pv<NT, P>(s, o, m0, m1, l0, l1, a.scale_log2,
                             wgmma::descriptor(sV + stage * Z::kK, Z::kPanelK, 1024), Z::kPanelK);

    __syncthreads();
    if (it + 2 < kp.n_tiles) load_kv_tile<D, true>(a, kp, b, kh, it + 2, sK, sV, stage, tid);
    ptx::cp_async_commit();
  }

  float inv0, inv1;
  flash::finish_rows(l0, l1, inv0, inv1);
  if (t4 == 0) {
    if (i0 < a.M) a.lse[qrow_idx(a, b, kh, i0)] = (m0 + __log2f(l0)) * kLn2;
    if (i1 < a.M) a.lse[qrow_idx(a, b, kh, i1)] = (m1 + __log2f(l1)) * kLn2;
  }
  __syncthreads();  // no warp still reads value stage 1
  wgmma::store_rows<P>(sQ, kBM, warp * 16 + g, o, inv0, inv1);
  __syncwarp();
  write_rows<D>(sQ, a.M - m_start, [&](int r) { return a.out + qrow_off(a, b, kh, m_start + r, D); });
#endif
}

// ---- backward, pass 1: dK, dV and the dSᵀ tiles (key-tile-major) ---------------------------------------
// The aligned 64-key context tiles [t_lo, t_lo + n) of a block with anchor anc, in the tiling of the
// dK/dV CTAs (dkv_items): those before the anchor, on sliding layers from the tile holding its first
// query's window start on. n is returned.
__device__ __forceinline__ int ds_ctx_tiles(const Args& a, int anc, int& t_lo) {
  t_lo = a.sliding ? max(0, anc - (a.window - 1)) / kBN : 0;
  return (anc + kBN - 1) / kBN - t_lo;
}
// dSᵀ tile t of (block b, kv head kh, query tile mt): [64 keys][64 packed query rows] bf16 as the
// bytes of a one-panel shared tile (swizzled), so a linear copy back gives the wgmma layout again.
__device__ __forceinline__ bf16* ds_tile(const Args& a, int b, int t, int kh, int mt) {
  const int m_tiles = (a.M + kBM - 1) / kBM;
  return a.ds + (((int64_t(b) * a.ds_tiles + t) * a.Hkv + kh) * m_tiles + mt) * (kBN * kBM);
}

template <int D, bool CTX>
__device__ __forceinline__ void dkv_wg_body(const Args& a, int kh, int key_tile, int z, unsigned char* smem) {
  using Z = WgSizes<D>;
  constexpr int P = D / 64, KS = D / 16, NT = kBM / 8, CH = D / 8;
  DkvItems di;
  if (!dkv_items<CTX>(a, key_tile, z, di)) return;

  unsigned char* sK = smem;
  unsigned char* sV = sK + Z::kK;
  unsigned char* sQ = sV + Z::kK;      // [2] query-row tiles
  unsigned char* sO = sQ + 2 * Z::kQ;  // [2] dO tiles
  unsigned char* sS = sO + 2 * Z::kQ;  // the dSᵀ tile on its way to the workspace (bulk store)
  float* sL = reinterpret_cast<float*>(sS + Z::kS);  // [2][kBM] lse
  float* sD = sL + 2 * kBM;                           // [2][kBM] δ

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t ldkv = int64_t(a.Hkv) * D;
  const int64_t koff = di.row0 * ldkv + int64_t(kh) * D;
  load_k_tile<D, true>(sK, (CTX ? a.kc : a.kb) + koff, ldkv, di.valid, tid);
  load_k_tile<D, true>(sV, (CTX ? a.vc : a.vb) + koff, ldkv, di.valid, tid);
  ptx::cp_async_commit();
  // Query-side tiles: thread tid copies chunk cq of packed rows r0 + 8·step (step < 8) of Q and dO
  // (the same offsets), row i at token i / G, head i % G of its block. With one query tile per
  // block and G dividing 8 (the drafters' shapes), a thread's rows sit at the same offsets in every
  // block, 8 / G tokens apart: one multiply-add per item. Otherwise the (token, head) of the row
  // advances by (8 / G, 8 % G) per step: one division per item.
  const int r0 = tid / CH, cq = tid % CH, g8 = 8 / a.G, h8 = 8 % a.G;
  const bool fixed_rows = di.m_tiles == 1 && h8 == 0;
  auto load_item = [&](int b, int mt, int stage) {
    unsigned char* tq = sQ + stage * Z::kQ;
    unsigned char* to = sO + stage * Z::kQ;
    const int64_t block_off = int64_t(b) * a.B * a.Hq;
    const int lg = __ffs(a.G) - 1;  // fixed_rows: G is a power of two, so shifts, no division
    if (fixed_rows) {
      const int64_t off = (block_off + (r0 >> lg) * a.Hq + kh * a.G + (r0 & (a.G - 1))) * D + cq * 8;
      const int row_step = g8 * a.Hq * D;  // < 2^31: validate() bounds R·Hq·d
#pragma unroll
      for (int step = 0; step < kBM * CH / kThreads; ++step) {
        const bool ok = r0 + 8 * step < a.M;
        const int so = tile_off<D, kBM, true>(r0 + 8 * step, cq);
        const int64_t o = ok ? off + int64_t(step) * row_step : 0;
        cp_async_16(tq + so, a.q + o, ok ? 16 : 0);
        cp_async_16(to + so, a.dout + o, ok ? 16 : 0);
      }
    } else {
      int i = mt * kBM + r0, j = i / a.G, hh = i - j * a.G;
      const int64_t base = (block_off + int64_t(kh) * a.G) * D + cq * 8;
#pragma unroll
      for (int step = 0; step < kBM * CH / kThreads; ++step) {
        const bool ok = i < a.M;
        const int64_t off = ok ? base + int64_t(j * a.Hq + hh) * D : 0;
        const int so = tile_off<D, kBM, true>(r0 + 8 * step, cq);
        cp_async_16(tq + so, a.q + off, ok ? 16 : 0);
        cp_async_16(to + so, a.dout + off, ok ? 16 : 0);
        i += 8, j += g8, hh += h8;
        if (hh >= a.G) hh -= a.G, ++j;
      }
    }
    if (tid < kBM) {
      const int r = mt * kBM + tid;
      const bool ok = r < a.M;
      const int64_t idx = !ok ? 0 : fixed_rows ? block_off + (r >> lg) * a.Hq + kh * a.G + (r & (a.G - 1))
                                               : qrow_idx(a, b, kh, r);
      cp_async_4(sL + stage * kBM + tid, a.lse + idx, ok ? 4 : 0);  // zero rows contribute 0 (q = dO = 0)
      cp_async_4(sD + stage * kBM + tid, a.delta + idx, ok ? 4 : 0);
    }
  };
  // The (block, query tile) of the item being computed and of the next one to load. Blocks are
  // walked from the last: every context key tile's CTA starts there at launch, so the CTAs of a kv
  // head read the same block's Q / dO at about the same time and all but the first find it in L2
  // (walked from each tile's first block, they drifted apart and read Q / dO from DRAM).
  int cur_b = di.b_end - 1, cur_mt = 0, next_b = di.b_end - 1, next_mt = 0;
  auto advance = [&](int& bb, int& mt) {
    if (++mt == di.m_tiles) mt = 0, --bb;
  };
  for (int item = 0; item < 2; ++item) {
    if (item < di.n_items) load_item(next_b, next_mt, item), advance(next_b, next_mt);
    ptx::cp_async_commit();
  }

  const int g = lane >> 2, t4 = lane & 3;
  const int kr0 = warp * 16 + g;  // key rows of elements 0/1 (and +8 for 2/3) within the tile
  const uint64_t desc_k = wgmma::descriptor(sK, 0, 1024), desc_v = wgmma::descriptor(sV, 0, 1024);
  float dk[P][32], dv[P][32];
  wgmma::zero(dk);
  wgmma::zero(dv);

  // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ ([64 keys, 64 query rows]) of the item in `stage`, two groups.
  float st[NT][4], dpt[NT][4];
  float(&stf)[NT * 4] = reinterpret_cast<float(&)[NT * 4]>(st);
  float(&dptf)[NT * 4] = reinterpret_cast<float(&)[NT * 4]>(dpt);
  auto issue_sdp = [&](int stage) {
    wgmma::issue_nt<KS>(stf, desc_k, Z::kPanelK, wgmma::descriptor(sQ + stage * Z::kQ, 0, 1024), Z::kPanelQ);
    wgmma::issue_nt<KS>(dptf, desc_v, Z::kPanelK, wgmma::descriptor(sO + stage * Z::kQ, 0, 1024), Z::kPanelQ);
  };
  // Each warp sends its own 16 rows of a dSᵀ tile (2 KiB of the staging tile) by bulk store, so no
  // CTA barrier guards the staging tile: lane 0 waits until its previous store has read the rows.
  const int w_rows = warp * 16 * 128;
  for (int item = 0; item < di.n_items; ++item) {
    const int stage = item & 1;
    const int b = cur_b, mt = cur_mt, m_start = mt * kBM;
    advance(cur_b, cur_mt);
    const int anc = CTX ? a.anchor[b] : di.anc_fixed;
    unsigned char* tQ = sQ + stage * Z::kQ;
    unsigned char* tO = sO + stage * Z::kQ;
    const float* tL = sL + stage * kBM;
    const float* tD = sD + stage * kBM;
    cp_async_wait<1>();
    wgmma::fence_async_smem();
    __syncthreads();
    issue_sdp(stage);
    // Groups in flight, oldest first: Sᵀ, dPᵀ; then dV (issued as soon as P is formed, while dPᵀ
    // may still run), then dK once dSᵀ is formed.
    wgmma::wait<1>();
    wgmma::pin(stf);
    // As in block_attention.cu: masked only on sliding layers or where the key tile crosses the
    // anchor; padded key rows (>= valid) are never written, so left unmasked.
    const bool need_mask = a.sliding || (CTX && di.key0 + di.valid > anc);
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const float2 l = ptx::lds_f2(tL + i * 8 + 2 * t4);  // this thread's two query columns
      const float nl[2] = {-l.x * kLog2e, -l.y * kLog2e};
#pragma unroll
      for (int e = 0; e < 4; ++e) st[i][e] = fast_exp2(fmaf(st[i][e], a.scale_log2, nl[e & 1]));
    }
    if (need_mask) {  // a separate pass: the common unmasked item runs no per-element branch
#pragma unroll
      for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = i * 8 + 2 * t4 + (e & 1);  // query column within the tile
          const int key = di.key0 + kr0 + (e >> 1) * 8;
          const int j = (m_start + c) / a.G;
          bool ok = CTX ? key < anc : true;
          ok = ok && allowed(a, CTX, anc, j, key);
          if (!ok) st[i][e] = 0.0f;
        }
    }
    // dV += Pᵀ dO and dK += dSᵀ Q: query rows are the k dimension (dO, Q as MN-major B).
    uint32_t pa[NT / 2][4], sa[NT / 2][4];
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) flash::p_fragment<NT>(st, kk, pa[kk]);
    wgmma::pin(dv);
    wgmma::pin(pa);
    wgmma::fence();
    wgmma::mma_nn_rs<NT / 2, P>(dv, pa, wgmma::descriptor(tO, Z::kPanelQ, 1024), Z::kPanelQ);
    wgmma::commit();
    wgmma::wait<1>();  // dPᵀ done (dV may still run)
    wgmma::pin(dptf);
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const float2 dl = ptx::lds_f2(tD + i * 8 + 2 * t4);
#pragma unroll
      for (int e = 0; e < 4; ++e) dpt[i][e] = st[i][e] * (dpt[i][e] - ((e & 1) ? dl.y : dl.x));  // dSᵀ
    }
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) flash::p_fragment<NT>(dpt, kk, sa[kk]);
    // dSᵀ (the bf16 values dK consumes) to the workspace for the dQ pass, before sa goes to the
    // tensor cores (an in-flight wgmma's registers must not be read).
    if (lane == 0) wgmma::bulk_wait_read<0>();
    __syncwarp();
    wgmma::store_a_fragments<NT / 2>(sS, sa);
    wgmma::fence_async_smem();
    __syncwarp();
    if (lane == 0) {
      int t_lo;
      const int nct = ds_ctx_tiles(a, anc, t_lo);
      wgmma::bulk_store(reinterpret_cast<unsigned char*>(ds_tile(a, b, CTX ? key_tile - t_lo : nct + key_tile, kh, mt)) +
                            w_rows, sS + w_rows, 16 * 128);
      wgmma::bulk_commit();
    }
    wgmma::pin(dk);
    wgmma::pin(sa);
    wgmma::fence();
    wgmma::mma_nn_rs<NT / 2, P>(dk, sa, wgmma::descriptor(tQ, Z::kPanelQ, 1024), Z::kPanelQ);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(dv);
    wgmma::pin(dk);
    wgmma::pin(pa);
    wgmma::pin(sa);

    __syncthreads();  // every warp is done with this item's stage: reload it
    if (item + 2 < di.n_items) load_item(next_b, next_mt, stage), advance(next_b, next_mt);
    ptx::cp_async_commit();
  }
  cp_async_wait<0>();
  __syncthreads();

  // Stage dK (scaled) in sK and dV in sV (each warp its own 16 rows), then 16-byte stores.
  wgmma::store_rows<P>(sK, kBN, kr0, dk, a.scale, a.scale);
  wgmma::store_rows<P>(sV, kBN, kr0, dv, 1.0f, 1.0f);
  __syncwarp();
  bf16* gk = (CTX ? a.dkc : a.dkb) + koff;
  bf16* gv = (CTX ? a.dvc : a.dvb) + koff;
  write_rows<D>(sK, di.valid, [&](int r) { return gk + r * ldkv; });
  write_rows<D>(sV, di.valid, [&](int r) { return gv + r * ldkv; });
  if (tid == 0) wgmma::bulk_wait<0>();  // sS stays valid until the last bulk store is done
}

template <int D>
__global__ void __launch_bounds__(kThreads, 2) ba_dkv_wg_kernel(const Args a, int num_seqs, int n_ctx_ctas) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = wgmma::align1024(smem_raw);
  const BwdRole r = bwd_role(a, blockIdx.x, num_seqs, n_ctx_ctas, 0);
  if (r.kind == BwdRole::CtxKV) dkv_wg_body<D, true>(a, r.kh, r.tile, r.z, smem);
  else dkv_wg_body<D, false>(a, r.kh, r.tile, r.z, smem);
#endif
}

// ---- backward, pass 2: dQ = scale · Σ dS K over the block's tiles (query-major) -------------------------
// One product per tile: the dSᵀ tiles of pass 1 (A operand by ldmatrix.trans) times the key tile
// (MN-major B), summed in a fixed order, so the result is deterministic.
template <int D>
__global__ void __launch_bounds__(kThreads, 3) ba_dq_wg_kernel(const Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Z = WgSizes<D>;
  constexpr int P = D / 64, KK = kBN / 16, ST = Z::kDqStages;
  const int kh = blockIdx.x % a.Hkv, mt = blockIdx.x / a.Hkv;
  const int b = a.nb - 1 - blockIdx.y;  // latest anchors (most tiles) first
  const int m_start = mt * kBM;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* sS = wgmma::align1024(smem_raw);  // [ST] dSᵀ tiles
  unsigned char* sK = sS + ST * Z::kS;             // [ST] key tiles

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int anc = a.anchor[b];
  int t_lo;
  const int nct = ds_ctx_tiles(a, anc, t_lo);
  const int n_tiles = nct + (a.B + kBN - 1) / kBN;
  const int64_t ldkv = int64_t(a.Hkv) * D;
  const int64_t begin = a.cu_seqlens[a.block_seq[b]];
  auto load = [&](int t, int stage) {
    const bf16* ds = ds_tile(a, b, t, kh, mt);
#pragma unroll
    for (int s = 0; s < Z::kS / 16 / kThreads; ++s) {
      const int c = s * kThreads + tid;
      cp_async_16(sS + stage * Z::kS + c * 16, ds + c * 8, 16);
    }
    // Key rows past the anchor have dS = 0 (masked in pass 1); rows past `valid` are zero-filled.
    const bool ctx = t < nct;
    const int key0 = (ctx ? t_lo + t : t - nct) * kBN;
    const int valid = min(kBN, (ctx ? anc : a.B) - key0);
    const bf16* k = ctx ? a.kc + (begin + key0) * ldkv : a.kb + (int64_t(b) * a.B + key0) * ldkv;
    load_k_tile<D, true>(sK + stage * Z::kK, k + int64_t(kh) * D, ldkv, valid, tid);
  };
  load(0, 0);
  ptx::cp_async_commit();
  if (n_tiles > 1) load(1, 1);
  ptx::cp_async_commit();

  float dq[P][32];
  wgmma::zero(dq);
  for (int t = 0; t < n_tiles; ++t) {
    const int stage = t % ST;
    cp_async_wait<1>();
    wgmma::fence_async_smem();
    __syncthreads();  // tile t is in; every warp is past tile t - 1, whose stage the next load reuses
    if (t + 2 < n_tiles) load(t + 2, (t + 2) % ST);
    ptx::cp_async_commit();
    uint32_t sa[KK][4];
    wgmma::load_a_fragments_trans<KK>(sa, sS + stage * Z::kS);
    wgmma::mma_nn_rs_sync<KK, P>(dq, sa, wgmma::descriptor(sK + stage * Z::kK, Z::kPanelK, 1024), Z::kPanelK);
  }
  cp_async_wait<0>();
  __syncthreads();
  const int g = lane >> 2;
  wgmma::store_rows<P>(sK, kBM, warp * 16 + g, dq, a.scale, a.scale);
  __syncwarp();
  write_rows<D>(sK, a.M - m_start, [&](int r) { return a.dq + qrow_off(a, b, kh, m_start + r, D); });
#endif
}

template <class K>
void set_smem(K kernel, size_t bytes) {
  DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace

bool wgmma_available(int64_t d, int device) { return d == 128 && wgmma::sm90a_code_runs_on(device); }

void launch_fwd_wgmma(const Args& a, cudaStream_t st) {
  auto kernel = ba_fwd_wg_kernel<128>;
  set_smem(kernel, WgSizes<128>::kFwd);
  const dim3 grid(static_cast<unsigned>(a.Hkv * ((a.M + kBM - 1) / kBM)), static_cast<unsigned>(a.nb));
  kernel<<<grid, kThreads, WgSizes<128>::kFwd, st>>>(a);
  DFLASH_CUDA_CHECK_LAST();
}

void launch_bwd_wgmma(const Args& a, int64_t num_seqs, int64_t max_seqlen, cudaStream_t st) {
  using Z = WgSizes<128>;
  const BwdGrid g = bwd_grid(a, num_seqs, max_seqlen);
  DFLASH_CHECK(g.n_ctx + g.n_blk < INT32_MAX, "block_attention_bwd: grid too large");
  auto kernel = ba_dkv_wg_kernel<128>;
  set_smem(kernel, Z::kDkv);
  kernel<<<static_cast<unsigned>(g.n_ctx + g.n_blk), kThreads, Z::kDkv, st>>>(a, static_cast<int>(num_seqs),
                                                                                static_cast<int>(g.n_ctx));
  DFLASH_CUDA_CHECK_LAST();
  set_smem(ba_dq_wg_kernel<128>, Z::kDq);
  const dim3 grid(static_cast<unsigned>(a.Hkv * ((a.M + kBM - 1) / kBM)), static_cast<unsigned>(a.nb));
  ba_dq_wg_kernel<128><<<grid, kThreads, Z::kDq, st>>>(a);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda::battn
