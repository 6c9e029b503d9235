#pragma once
// Pieces of the DFlash block-attention kernels shared by the mma.sync kernels (block_attention.cu)
// and the wgmma ones (block_attention_sm90.cu): kernel arguments, the packed query-row indexing,
// the key-tile plan of a query tile and its mask, the dK/dV item range of a key tile, the tile
// loaders (either shared layout) and the dK/dV CTA roles of the backward (block_attention.cu runs
// them with its dQ CTAs in one launch, block_attention_sm90.cu alone as its first pass). See
// block_attention.cu for the algorithm.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/flash_tile.cuh"
#include "kernels/cuda/ptx.cuh"

namespace dflash::cuda::battn {

using bf16 = __nv_bfloat16;
using flash::cp_async_16;
using flash::swz;
using ptx::smem_addr;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Args {
  const bf16* q;
  const bf16* kc;
  const bf16* vc;
  const bf16* kb;
  const bf16* vb;
  bf16* out;
  float* lse;
  const bf16* dout;
  bf16* dq;
  bf16* dkc;
  bf16* dvc;
  bf16* dkb;
  bf16* dvb;
  float* delta;  // [R, Hq] workspace
  bf16* ds;      // wgmma backward: the dSᵀ tiles (workspace; block_attention_sm90.cu)
  int ds_tiles;  // dSᵀ tiles per (block, kv head, query tile): ds_tiles_per_block()
  const int32_t* anchor;
  const int32_t* block_seq;
  const int32_t* cu_seqlens;
  const int32_t* cu_blocks;
  int nb, B, Hq, Hkv, G, M;  // M = B·G packed query rows per (block, kv head)
  int sliding, window;
  float scale, scale_log2;
};

__device__ __forceinline__ void cp_async_4(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}


constexpr int kThreads = 128;  // 4 warps
constexpr int kBM = 64;        // packed query rows per tile
constexpr int kBN = 64;        // keys per tile

// Element offset of packed query row i of block b, kv head kh, in a [R, Hq, D] tensor.
__device__ __forceinline__ int64_t qrow_off(const Args& a, int b, int kh, int i, int D) {
  const int j = i / a.G, hh = i - j * a.G;
  return (int64_t(b) * a.B + j) * a.Hq * D + int64_t(kh * a.G + hh) * D;
}
__device__ __forceinline__ int64_t qrow_idx(const Args& a, int b, int kh, int i) {  // into [R, Hq]
  const int j = i / a.G, hh = i - j * a.G;
  return (int64_t(b) * a.B + j) * a.Hq + kh * a.G + hh;
}

// Byte offset of (row, 16-byte chunk) in a shared tile of ROWS rows: XOR-swizzled [ROWS, D] rows
// (mma.sync kernels, flash_tile.cuh) or wgmma panels (wgmma.cuh).
template <int D, int ROWS, bool PANELS>
__device__ __forceinline__ int tile_off(int r, int c) {
  if constexpr (PANELS) return (c >> 3) * ROWS * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
  else return 2 * swz<D>(r, c);
}

// 64 packed query rows [m_start, m_start + 64) of (b, kh) from a [R, Hq, D] tensor into a shared
// tile; rows >= M are zero-filled.
template <int D, bool PANELS = false>
__device__ __forceinline__ void load_q_tile(void* s, const bf16* g, const Args& a, int b, int kh, int m_start,
                                            int tid) {
  constexpr int CH = D / 8;
#pragma unroll
  for (int step = 0; step < kBM * CH / kThreads; ++step) {
    const int idx = step * kThreads + tid;
    const int r = idx / CH, c = idx % CH;
    const int i = m_start + r;
    const bool ok = i < a.M;
    const bf16* src = ok ? g + qrow_off(a, b, kh, i, D) + c * 8 : g;
    cp_async_16(static_cast<char*>(s) + tile_off<D, kBM, PANELS>(r, c), src, ok ? 16 : 0);
  }
}

// 64 key rows (stride ld elements) into a shared tile; rows >= valid are zero-filled.
// Thread tid copies chunk tid % CH of rows tid / CH + step · (kThreads / CH): one pointer, advanced.
template <int D, bool PANELS = false>
__device__ __forceinline__ void load_k_tile(void* s, const bf16* g, int64_t ld, int valid, int tid) {
  constexpr int CH = D / 8, RS = kThreads / CH;
  static_assert(kThreads % CH == 0, "a thread keeps its chunk column");
  const int r0 = tid / CH, c = tid % CH;
  const bf16* src = g + r0 * ld + c * 8;
  if (valid >= kBN) {  // a full tile (most of them): no per-row test
#pragma unroll
    for (int step = 0; step < kBN / RS; ++step, src += RS * ld)
      cp_async_16(static_cast<char*>(s) + tile_off<D, kBN, PANELS>(r0 + step * RS, c), src, 16);
    return;
  }
#pragma unroll
  for (int step = 0; step < kBN / RS; ++step) {
    const int r = r0 + step * RS;
    const bool ok = r < valid;
    cp_async_16(static_cast<char*>(s) + tile_off<D, kBN, PANELS>(r, c), ok ? src : g, ok ? 16 : 0);
    src += RS * ld;
  }
}

// The key tiles a query tile of block b walks: context tiles [ctx_lo + 64·t, ...) up to the
// anchor, then own-block tiles [64·t, ...) up to blk_hi.
struct KeyPlan {
  int anc, ctx_lo, blk_hi, nct, n_tiles;
  int64_t begin;  // first context row of the block's sequence
};
__device__ __forceinline__ KeyPlan key_plan(const Args& a, int b, int m_start) {
  KeyPlan k;
  k.anc = a.anchor[b];
  k.begin = a.cu_seqlens[a.block_seq[b]];
  const int jlo = m_start / a.G, jhi = (min(a.M, m_start + kBM) - 1) / a.G;
  k.ctx_lo = 0;
  k.blk_hi = a.B;
  if (a.sliding) {
    k.ctx_lo = max(0, k.anc + jlo - (a.window - 1));
    k.blk_hi = min(a.B, jhi + 1);
  }
  k.nct = k.anc > k.ctx_lo ? (k.anc - k.ctx_lo + kBN - 1) / kBN : 0;
  k.n_tiles = k.nct + (k.blk_hi + kBN - 1) / kBN;
  return k;
}

// Key tile `it` of the plan: its k / v rows (already at kv head kh), first key index (context
// position or block offset), valid rows, and whether it is a context tile.
struct KeyTile {
  const bf16* k;
  const bf16* v;
  int key0, valid;
  bool ctx;
};
template <int D>
__device__ __forceinline__ KeyTile key_tile(const Args& a, const KeyPlan& kp, int b, int kh, int it) {
  KeyTile t;
  const int64_t ldkv = int64_t(a.Hkv) * D;
  if (it < kp.nct) {
    t.ctx = true;
    t.key0 = kp.ctx_lo + it * kBN;
    t.valid = min(kBN, kp.anc - t.key0);
    const int64_t off = (kp.begin + t.key0) * ldkv + int64_t(kh) * D;
    t.k = a.kc + off;
    t.v = a.vc + off;
  } else {
    t.ctx = false;
    t.key0 = (it - kp.nct) * kBN;
    t.valid = min(kBN, kp.blk_hi - t.key0);
    const int64_t off = (int64_t(b) * a.B + t.key0) * ldkv + int64_t(kh) * D;
    t.k = a.kb + off;
    t.v = a.vb + off;
  }
  return t;
}

// Loads key tile `it` of the plan (K and V rows at kv head kh) into stage `stage` of the shared
// arrays sK / sV (tiles of kBN rows, D columns, in either layout).
template <int D, bool PANELS>
__device__ __forceinline__ void load_kv_tile(const Args& a, const KeyPlan& kp, int b, int kh, int it, void* sK,
                                             void* sV, int stage, int tid) {
  constexpr int kTile = kBN * D * 2;
  const KeyTile t = key_tile<D>(a, kp, b, kh, it);
  const int64_t ldkv = int64_t(a.Hkv) * D;
  load_k_tile<D, PANELS>(static_cast<char*>(sK) + stage * kTile, t.k, ldkv, t.valid, tid);
  load_k_tile<D, PANELS>(static_cast<char*>(sV) + stage * kTile, t.v, ldkv, t.valid, tid);
}

// The cp.async prologue of a query-major pass (forward, dQ), after the caller issued its query-side
// tiles: those close group 0, key tiles 0 and 1 form groups 1 and 2 (2 maybe empty). Iteration it
// then waits for all but the newest group and, after its barrier, loads tile it + 2.
template <int D, bool PANELS>
__device__ __forceinline__ void start_kv(const Args& a, const KeyPlan& kp, int b, int kh, void* sK, void* sV, int tid) {
  ptx::cp_async_commit();
  load_kv_tile<D, PANELS>(a, kp, b, kh, 0, sK, sV, 0, tid);
  ptx::cp_async_commit();
  if (kp.n_tiles >= 2) load_kv_tile<D, PANELS>(a, kp, b, kh, 1, sK, sV, 1, tid);
  ptx::cp_async_commit();
}

// Whether query row with block offset j may attend key `key` (context position or block offset)
// of a tile, given the key lies inside the tile's valid range.
__device__ __forceinline__ bool allowed(const Args& a, bool ctx, int anc, int j, int key) {
  if (!a.sliding) return true;
  if (ctx) return key >= anc + j - (a.window - 1);
  return key <= j && key >= j - (a.window - 1);
}

// The forward's mask of one key tile on a warp's scores s[NT][4] (the m16n8 / wgmma accumulator
// layout: n-tile i, element e at column 8i + 2·t4 + (e & 1) of rows j0 / j1 for e < 2 / e >= 2):
// -inf past the tile's valid keys and outside the sliding window. A full tile on a full-attention
// layer needs none.
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], const Args& a, const KeyTile& kt, int anc, int j0,
                                            int j1, int t4) {
  if (kt.valid < kBN || a.sliding) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = i * 8 + 2 * t4 + (e & 1);
        if (c >= kt.valid || !allowed(a, kt.ctx, anc, (e >> 1) ? j1 : j0, kt.key0 + c)) s[i][e] = -INFINITY;
      }
  }
}

// The query tiles a dK/dV CTA walks: blocks [b_first, b_end) x m_tiles packed-row tiles, for its
// key tile (`valid` rows from row0 of kc/vc or kb/vb). CTX: key tile `key_tile` of sequence z
// (context keys: the blocks of the sequence with anchor > the tile's first key, anchors ascending;
// on sliding layers only those whose window still reaches the tile); else key tile `key_tile` of
// block z's own keys. False when the tile is past the end (the CTA has nothing to do).
struct DkvItems {
  int key0, valid, b_first, b_end, anc_fixed, m_tiles, n_items;
  int64_t row0;
};
template <bool CTX>
__device__ __forceinline__ bool dkv_items(const Args& a, int key_tile, int z, DkvItems& r) {
  r.key0 = key_tile * kBN;
  r.anc_fixed = 0;
  if constexpr (CTX) {
    const int s = z;
    const int begin = a.cu_seqlens[s], len = a.cu_seqlens[s + 1] - begin;
    if (r.key0 >= len) return false;
    r.valid = min(kBN, len - r.key0);
    r.row0 = begin + r.key0;
    int lo = a.cu_blocks[s], hi = a.cu_blocks[s + 1];
    r.b_end = hi;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (a.anchor[mid] > r.key0) hi = mid; else lo = mid + 1;
    }
    r.b_first = lo;
    if (a.sliding) {  // the window of the block's query j = 0 starts at anchor − (window − 1)
      const int last_key = r.key0 + r.valid - 1;
      int lo2 = r.b_first, hi2 = r.b_end;
      while (lo2 < hi2) {
        const int mid = (lo2 + hi2) / 2;
        if (a.anchor[mid] - (a.window - 1) > last_key) hi2 = mid; else lo2 = mid + 1;
      }
      r.b_end = lo2;
    }
  } else {
    const int b = z;
    if (r.key0 >= a.B) return false;
    r.valid = min(kBN, a.B - r.key0);
    r.row0 = int64_t(b) * a.B + r.key0;
    r.b_first = b;
    r.b_end = b + 1;
    r.anc_fixed = a.anchor[b];
  }
  r.m_tiles = (a.M + kBM - 1) / kBM;
  r.n_items = (r.b_end - r.b_first) * r.m_tiles;
  return true;
}

// The backward's CTA roles, in launch order (the wgmma pass 1 has no dQ CTAs: n_dq_ctas = 0): the uneven context dK/dV CTAs first,
// heaviest first (key tile outermost), then the many short dQ CTAs (latest anchors first), then
// the own-block dK/dV CTAs, so they fill the SMs around the long ones.
struct BwdRole {
  enum Kind { CtxKV, DQ, BlockKV } kind;
  int kh, tile, z;  // kv head; key tile or query tile; sequence or block
};
__device__ __forceinline__ BwdRole bwd_role(const Args& a, int idx, int num_seqs, int n_ctx_ctas, int n_dq_ctas) {
  BwdRole r;
  if (idx < n_ctx_ctas) {
    r.kind = BwdRole::CtxKV;
    r.kh = idx % a.Hkv;
    idx /= a.Hkv;
    r.tile = idx / num_seqs;
    r.z = idx % num_seqs;
    return r;
  }
  idx -= n_ctx_ctas;
  if (idx < n_dq_ctas) {
    const int per_block = a.Hkv * ((a.M + kBM - 1) / kBM);
    const int q = idx % per_block;
    r.kind = BwdRole::DQ;
    r.kh = q % a.Hkv;
    r.tile = q / a.Hkv;
    r.z = a.nb - 1 - idx / per_block;
    return r;
  }
  idx -= n_dq_ctas;
  r.kind = BwdRole::BlockKV;
  r.kh = idx % a.Hkv;
  idx /= a.Hkv;
  const int b_tiles = (a.B + kBN - 1) / kBN;
  r.tile = idx % b_tiles;
  r.z = idx / b_tiles;
  return r;
}

// Host: the launch sizes of the backward's roles.
struct BwdGrid {
  int64_t n_ctx, n_dq, n_blk;
};
inline BwdGrid bwd_grid(const Args& a, int64_t num_seqs, int64_t max_seqlen) {
  return {int64_t(a.Hkv) * ((max_seqlen + kBN - 1) / kBN) * num_seqs, int64_t(a.Hkv) * ((a.M + kBM - 1) / kBM) * a.nb,
          int64_t(a.Hkv) * ((a.B + kBN - 1) / kBN) * a.nb};
}

// Host: the wgmma backward's dSᵀ tiles per (block, kv head, query tile) — an upper bound on the
// 64-key tiles a block attends: every context tile of the longest sequence and its own keys'.
inline int64_t ds_tiles_per_block(int64_t max_seqlen, int64_t B) { return (max_seqlen + kBN - 1) / kBN + (B + kBN - 1) / kBN; }

// block_attention_sm90.cu: the wgmma kernels (d = 128), and whether they can run on `device`.
bool wgmma_available(int64_t d, int device);
void launch_fwd_wgmma(const Args& a, cudaStream_t st);
void launch_bwd_wgmma(const Args& a, int64_t num_seqs, int64_t max_seqlen, cudaStream_t st);

}  // namespace dflash::cuda::battn
