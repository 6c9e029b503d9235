// The mixture-of-experts family's kernels (moe.h): top-k routing, the permutation by expert, the
// grouped expert GEMM (mma.sync m16n8k16 bf16, fp32 accumulation, cp.async 3-stage pipeline; the
// row gather and SwiGLU fused), the gather and the weighted un-permute with the shared expert's
// sigmoid gate; and moe_block, which chains them (or the per-expert gemm_bf16 fallback).
//
// Roofline at Qwen3.6-35B-A3B shapes (H 2048, E 256, k 8, I 512), per token: routed experts
// 2·k·(2I·H + H·I) = 50.3 MFLOP, shared expert 2·(2Is·H + H·Is) = 6.3 MFLOP, router 2·E·H = 1 MFLOP.
// At 8192 tokens a block is ~470 GFLOP (~0.5 ms at 989 TFLOP/s dense bf16): compute bound; the
// weights (E·3·I·H·2 = 1.6 GB per layer) are read once per column tile. At decode (N = 1..16) it is
// bound by reading the chosen experts' weights (k·3·I·H·2 = 50 MB for N = 1).
// Emulatable (kernels/cuda/emulatable.cuh): test_moe_emulated runs these kernels on the CPU in CI.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/cuda/check.h"
#include "core/device.h"
#include "core/fp8.h"
#include "core/error.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/emulatable.cuh"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_dots.cuh"
#include "kernels/cuda/moe_fp8.cuh"
#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/moe_topk.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/vec.cuh"

namespace dflash::cuda {

namespace {

using vec::bf16;

// ---- top-k ----------------------------------------------------------------------------------------
using moe_detail::kMaxE;
constexpr int kTopkWarps = 4;

// One warp per token (moe_topk.cuh's warp_topk), then the per-expert counts.
__global__ void topk_kernel(const float* __restrict__ logits, int N, int E, int k, bool renorm,
                            int32_t* __restrict__ experts, float* __restrict__ weights, int32_t* __restrict__ counts) {
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * kTopkWarps + (threadIdx.x >> 5);
  if (n >= N) return;
  int my_e = -1;
  float my_w = 0;
  moe_detail::warp_topk(logits + static_cast<int64_t>(n) * E, E, k, renorm, lane, my_e, my_w);
  if (lane < k) {
    experts[static_cast<int64_t>(n) * k + lane] = my_e;
    weights[static_cast<int64_t>(n) * k + lane] = my_w;
    atomicAdd(&counts[my_e], 1);
  }
}

// The scans of El experts' row counts and row tiles by one warp (every lane calls it): lane l sums its
// run of ceil(El / 32) experts, a shuffle scan over the runs, then each lane its run in order:
// offsets[e + 1] and tile_offsets[e + 1] inclusive (offsets[0] = tile_offsets[0] = 0), and
// done(e, count, inclusive offset) for the caller's own use of them. count(e): expert e's rows.
template <class Count, class Done>
__device__ __forceinline__ void warp_scan_experts(int El, int lane, Count count, int32_t* offsets, int32_t* tile_offsets,
                                                  Done done) {
  const int per = (El + 31) / 32, lo = lane * per, hi = lo + per < El ? lo + per : El;
  int c_sum = 0, t_sum = 0;
  for (int e = lo; e < hi; ++e) {
    const int c = count(e);
    c_sum += c;
    t_sum += (c + kMoeTileRows - 1) / kMoeTileRows;
  }
  int c_inc = c_sum, t_inc = t_sum;
  for (int d = 1; d < 32; d <<= 1) {
    const int a = __shfl_up_sync(0xffffffffu, c_inc, d), b = __shfl_up_sync(0xffffffffu, t_inc, d);
    if (lane >= d) {
      c_inc += a;
      t_inc += b;
    }
  }
  int run_off = c_inc - c_sum, run_tiles = t_inc - t_sum;
  for (int e = lo; e < hi; ++e) {
    const int c = count(e);
    run_off += c;
    run_tiles += (c + kMoeTileRows - 1) / kMoeTileRows;
    offsets[e + 1] = run_off;
    tile_offsets[e + 1] = run_tiles;
    done(e, c, run_off);
  }
  if (lane == 0) {
    offsets[0] = 0;
    tile_offsets[0] = 0;
  }
}

// One warp: the scans of counts and of their row tiles; the scatter's cursors at each expert's start.
__global__ void scan_kernel(const int32_t* __restrict__ counts, int E, int32_t* __restrict__ offsets,
                            int32_t* __restrict__ tile_offsets, int32_t* __restrict__ cursor) {
  warp_scan_experts(E, static_cast<int>(threadIdx.x), [&](int e) { return counts[e]; }, offsets, tile_offsets,
                    [&](int e, int c, int off) { cursor[e] = off - c; });
}

// Choices of experts outside [e0, e0 + El) (another rank's) get no row: slot_pos -1.
__global__ void scatter_kernel(const int32_t* __restrict__ experts, int64_t rows, int k, int e0, int El,
                               int32_t* __restrict__ cursor, int32_t* __restrict__ src_row, int32_t* __restrict__ slot_pos) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows) return;
  const int e = experts[i] - e0;
  if (e < 0 || e >= El) {
    slot_pos[i] = -1;
    return;
  }
  const int pos = atomicAdd(&cursor[e], 1);
  src_row[pos] = static_cast<int32_t>(i / k);
  slot_pos[i] = pos;
}

// ---- routing of a decode / verify step in one block --------------------------------------------------
// topk_kernel + counts + scan_kernel + scatter_kernel (and the counts' memset) in one block, for N·k
// <= kMoeRouteSmallRows rows: a warp a token's top-k, the counts in shared memory, the scans by one
// warp (a lane a run of experts, a shuffle scan over the runs), then a thread a row. Rows take their
// place inside an expert's range in (token, choice) order (the multi-kernel path's order is atomic
// arrival: a row's result never depends on it): a row's rank among its expert's rows is the number
// of earlier tokens that chose the expert (a token chooses an expert once), from a bitmask of the
// tokens a expert for N <= 32 (a decode or verify step), else by counting.
struct RouteOut {
  int32_t* experts;
  float* weights;
  int32_t* counts;
  int32_t* offsets;
  int32_t* tile_offsets;
  int32_t* cursor;
  int32_t* src_row;
  int32_t* slot_pos;
};

constexpr int kRouteThreads = 512;
__global__ void __launch_bounds__(kRouteThreads)
    route_small_kernel(const float* __restrict__ logits, int N, int E, int k, bool renorm, int e0, int El, RouteOut o) {
  __shared__ int32_t s_count[kMaxE], s_off[kMaxE];
  __shared__ uint32_t s_tokens[kMaxE];  // (N <= 32) bit n: token n chose the expert
  __shared__ int32_t s_expert[kMoeRouteSmallRows];
  const int t = static_cast<int>(threadIdx.x), nt = static_cast<int>(blockDim.x), lane = t & 31, warp = t >> 5;
  const bool masks = N <= 32;
  for (int e = t; e < E; e += nt) {
    s_count[e] = 0;
    s_tokens[e] = 0;
  }
  pdl_wait();  // (the router's logits)
  pdl_launch_dependents();
  __syncthreads();
  for (int n = warp; n < N; n += nt / 32) {
    int my_e = -1;
    float my_w = 0;
    moe_detail::warp_topk(logits + static_cast<int64_t>(n) * E, E, k, renorm, lane, my_e, my_w);
    if (lane < k) {
      o.experts[n * k + lane] = my_e;
      o.weights[n * k + lane] = my_w;
      s_expert[n * k + lane] = my_e;
      atomicAdd(&s_count[my_e], 1);
      if (masks) atomicOr(&s_tokens[my_e], 1u << n);
    }
  }
  __syncthreads();
  for (int e = t; e < E; e += nt) o.counts[e] = s_count[e];
  // The scans of the local experts' counts and row tiles by warp 0 (the scatter's cursors as they end).
  if (warp == 0)
    warp_scan_experts(El, lane, [&](int e) { return s_count[e0 + e]; }, o.offsets, o.tile_offsets, [&](int e, int, int off) {
      s_off[e] = off;  // inclusive
      o.cursor[e] = off;
    });
  __syncthreads();
  for (int i = t; i < N * k; i += nt) {
    const int ex = s_expert[i], e = ex - e0, n = i / k;
    if (e < 0 || e >= El) {
      o.slot_pos[i] = -1;
      continue;
    }
    int rank = 0;
    if (masks) {
      rank = __popc(s_tokens[ex] & ((1u << n) - 1u));
    } else {
      for (int j = 0; j < n * k; ++j) rank += s_expert[j] == ex;
    }
    const int pos = s_off[e] - s_count[ex] + rank;
    o.src_row[pos] = n;
    o.slot_pos[i] = pos;
  }
}

// ---- combine ---------------------------------------------------------------------------------------
// out[n, c .. c + 7] of the combine: the token's kn choices' down rows weighted in choice order (slot
// -1: another rank's expert, nothing), then the gated shared row; fp32 sums, bf16 out.
__device__ __forceinline__ void combine8(const bf16* y, const int32_t* sp, const float* sw, int kn, int64_t H,
                                         const bf16* shared, float gate, int64_t n, int64_t c, bf16* out) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int j = 0; j < kn; ++j) {
    if (sp[j] < 0) continue;  // another rank's expert
    float v[8];
    vec::load8(y + static_cast<int64_t>(sp[j]) * H + c, v);
#pragma unroll
    for (int q = 0; q < 8; ++q) acc[q] += v[q] * sw[j];
  }
  if (shared) {
    float v[8];
    vec::load8(shared + n * H + c, v);
#pragma unroll
    for (int q = 0; q < 8; ++q) acc[q] += gate * v[q];
  }
  vec::store8(out + n * H + c, acc);
}
__device__ __forceinline__ float sigmoid_gate(float logit) { return 1.0f / (1.0f + expf(-logit)); }


// ---- grouped GEMM -----------------------------------------------------------------------------------
// Three tilings of one kernel (BN weight rows x BK columns a k tile, kStages of them in flight):
//   wide   128 x 32, 3 stages: the prefill's, fewer blocks reading each A tile;
//   narrow  64 x 32, 5 stages: few routed rows, twice the blocks;
//   deep    64 x 128, 3 stages (FP8 weights 4): decode / verify steps (moe_deep_tiles), where a call
//           is a few hundred blocks streaming the experts' weights and nothing else: 32 KB of weights
//           in flight a block (48 KB FP8 codes) where narrow has 16 KB, two blocks an SM (104 KB of
//           shared memory each: a one-token step's gate|up, 144 blocks at 35B-A3B shapes, in one wave;
//           4 bf16 stages would hold one block an SM and take two). At 35B-A3B shapes narrow's expert
//           GEMMs ran at ~1.1 TB/s.
// Every output element is the same mma.sync k16 steps in the same K order in each, so all give the
// same bits (k16 steps past K add zero products: they change nothing but an all-(-0) sum's sign).
constexpr int kThreads = 128;
// Shared-memory rows: bf16 rows of BK + 8 elements (ldmatrix's 8 row addresses hit distinct banks:
// the row pitch is an odd number of 16-byte units) and FP8 weight rows of BK + 16 bytes (a
// fragment's 8 rows x 4 byte pairs hit distinct banks).
template <int BK>
constexpr int lds() { return BK + 8; }
template <int BK>
constexpr int ldq() { return BK + 16; }

// Block: BM rows of one expert x (swiglu ? BN/2 act columns (BN/2 gate + BN/2 up weight rows) : BN
// output columns). 4 warps: BM 64, 2 (rows) x 2 (columns), a warp 32 rows (two m16 tiles) x NT =
// BN/16 n8 tiles; BM 16 (a 64-row tile's rows in blockIdx.z's sub-tile: a decode step, where an
// expert has at most 16 rows), 1 x 4, a warp 16 rows x NT = BN/32 n8 tiles. In swiglu mode the
// warp's tiles [0, NT/2) are gate columns and [NT/2, NT) the up columns of the same act columns.
// kFp8: the weights are e4m3 codes with 128 x 128 block scales (p.w_scale, moe_fp8.cuh's layout):
// their tiles come into shared memory as codes (half the bytes of bf16) and each thread builds its
// mma B fragments from them, every weight the bf16-rounded code · scale: the bf16 experts' values,
// so the products are the bf16 kernel's bits on those experts.
template <int BM, int BN, int BK, int kStages, bool kFp8>
__global__ void __launch_bounds__(kThreads) grouped_gemm_kernel(MoeGemmParams p) {
  static_assert(BM == 64 || BM == 16, "a 64-row tile, or a 16-row sub-tile of one");
  constexpr int WM = BM == 64 ? 2 : 1, WN = 4 / WM, MI = BM / (16 * WM);  // warps along rows / columns, m16 tiles a warp
  constexpr int NT = BN / (8 * WN), HT = NT / 2;  // n8 tiles, half of them
  constexpr int kLds = lds<BK>(), kLdq = ldq<BK>();
  // A and B chunks of 16 bytes a thread per k tile (8 bf16 or 16 e4m3 values); fp8 rows of kLdq bytes.
  constexpr int GPA = BK / 8, ACH = BM * GPA / kThreads;
  constexpr int BCH = BN * BK * (kFp8 ? 1 : 2) / 16 / kThreads, CW = kFp8 ? 16 : 8;
  static_assert(NT % 2 == 0 && (HT % 2 == 0 || HT == 1) && BCH >= 1 && (BN & (BN - 1)) == 0,
                "tile pairs for ldmatrix_x4, whole B chunks, BN a power of 2");
  static_assert(BK % 32 == 0 && ACH * kThreads == BM * GPA, "k tiles of whole fp8 chunk pairs, whole A chunks");
  static_assert(BN <= 128 && 128 % BK == 0, "a block's weight rows of a part and a k tile lie in one 128 x 128 scale block");
  DFLASH_DYNAMIC_SMEM(unsigned char, smem_raw);
  bf16* sa = reinterpret_cast<bf16*>(smem_raw);  // [kStages][BM][kLds]
  bf16* sb = sa + kStages * BM * kLds;            // [kStages][BN][kLds] (bf16) or [kStages][BN][kLdq] (bytes)
  constexpr int kRowB = kFp8 ? kLdq : kLds * 2;   // a B smem row's bytes
  // PDL: a block whose operands are known before the previous kernel ends (the extra group's
  // blocks; every block where the tile table is settled, MoeGemmParams::routing_settled) issues its
  // first stages' weight loads before pdl_wait; every block waits (once) before it reads x or exits.
  const bool early = p.routing_settled || static_cast<int64_t>(blockIdx.x) >= p.max_tiles;
  if (!early) pdl_wait();
  moe_detail::TileOperands op;
  const bool has_tile = moe_detail::tile_operands<kFp8 ? 1 : 2>(p, kMoeTileRows, op);
  const int e = op.e, row0 = op.row0 + static_cast<int>(blockIdx.z) * BM, row_end = op.row_end;
  if (!has_tile || row0 >= row_end) {  // a spare block, or an empty sub-tile (the same for the whole block)
    if (early) pdl_wait();
    pdl_launch_dependents();
    return;
  }
  const int K = static_cast<int>(p.K), Nout = static_cast<int>(p.Nout);
  const int col0 = blockIdx.y * (p.swiglu ? BN / 2 : BN);
  const bf16* X = op.x;
  const int R = (p.swiglu ? 2 : 1) * Nout;  // the expert's weight rows
  const unsigned char* W = op.w;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp / WN, wn = warp % WN;

  // Each thread's load assignments: A ACH chunks (row, 8-col group), B BCH chunks.
  const bf16* a_src[ACH];
  bool a_ok[ACH];
  int a_off[ACH];
#pragma unroll
  for (int c = 0; c < ACH; ++c) {
    const int idx = tid + c * kThreads, r = idx / GPA, g = idx % GPA;
    const int pos = row0 + r;
    a_ok[c] = pos < row_end;
    const int src = a_ok[c] ? (op.src_row ? op.src_row[pos] : pos) : 0;
    a_src[c] = X + static_cast<int64_t>(src) * p.ldx + g * 8;
    a_off[c] = r * kLds + g * 8;
  }
  const unsigned char* b_src[BCH];
  bool b_ok[BCH];
  int b_off[BCH];
  constexpr int GPR = BK / CW;  // chunks a B row per k tile
#pragma unroll
  for (int c = 0; c < BCH; ++c) {
    const int idx = tid + c * kThreads, r = idx / GPR, g = idx % GPR;
    bool ok;
    const int wrow = moe_detail::weight_row(p, r, col0, BN, ok);
    b_ok[c] = ok;
    b_src[c] = W + (static_cast<int64_t>(ok ? wrow : 0) * K + g * CW) * (kFp8 ? 1 : 2);
    b_off[c] = r * kRowB + g * 16;
  }
  // FP8: the scale rows of the block's gate (or down) rows and of its up rows; one 128-column block
  // holds a whole k tile.
  const float* s_lo = nullptr;
  const float* s_hi = nullptr;
  if constexpr (kFp8) {
    const int kb = (K + 127) / 128;
    const float* se = p.w_scale + static_cast<int64_t>(e) * moe_detail::fp8_row_blocks(R, Nout) * kb;
    s_lo = se + static_cast<int64_t>(moe_detail::fp8_row_block(col0, Nout)) * kb;
    s_hi = p.swiglu ? se + static_cast<int64_t>(moe_detail::fp8_row_block(Nout + col0, Nout)) * kb : s_lo;
  }
  const int KT = (K + BK - 1) / BK;
  auto load_a = [&](int stage, int kt) {
    const int k0 = kt * BK;
    bf16* A = sa + stage * BM * kLds;
#pragma unroll
    for (int c = 0; c < ACH; ++c) {
      const int kk = k0 + ((tid + c * kThreads) % GPA) * 8;
      const bool v = a_ok[c] && kk < K;
      ptx::cp_async16_zfill(A + a_off[c], v ? a_src[c] + k0 : X, v);
    }
  };
  auto load_b = [&](int stage, int kt) {
    const int k0 = kt * BK;
    unsigned char* B = reinterpret_cast<unsigned char*>(sb) + stage * BN * kRowB;
#pragma unroll
    for (int c = 0; c < BCH; ++c) {
      const int kk = k0 + ((tid + c * kThreads) % GPR) * CW;
      const bool v = b_ok[c] && kk < K;
      ptx::cp_async16_zfill(B + b_off[c], v ? b_src[c] + k0 * (kFp8 ? 1 : 2) : W, v);
    }
  };

  float acc[MI][NT][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

  // The warp's B smem row of its n8 tile j (j even: tiles j, j + 1 are 16 consecutive rows, but for
  // HT 1: tile 0 the gate rows, tile 1 the up rows of the same act columns).
  auto brow = [&](int j) {
    return p.swiglu ? ((j < HT ? 0 : BN / 2) + wn * (BN / (2 * WN)) + (j % HT) * 8) : (wn * (BN / WN) + j * 8);
  };

  // Prologue: the first kStages - 1 k tiles, one commit group each (empty past KT, so the counts
  // stay fixed); an early block's weights of all of them before the wait (in the first group).
  if (early) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s)
      if (s < KT) load_b(s, s);
    pdl_wait();
  }
  pdl_launch_dependents();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) {
      if (!early) load_b(s, s);  // (the weights first: A's addresses wait on the gathered rows' src_row)
      load_a(s, s);
    }
    ptx::cp_async_commit_ring();
  }
  for (int kt = 0; kt < KT; ++kt) {
    ptx::cp_async_wait_ring<kStages - 2>();
    __syncthreads();
    if (kt + kStages - 1 < KT) {
      load_b((kt + kStages - 1) % kStages, kt + kStages - 1);
      load_a((kt + kStages - 1) % kStages, kt + kStages - 1);
    }
    ptx::cp_async_commit_ring();
    const bf16* A = sa + (kt % kStages) * BM * kLds;
    const unsigned char* Bs = reinterpret_cast<const unsigned char*>(sb) + (kt % kStages) * BN * kRowB;
    float sc_lo = 0.0f, sc_hi = 0.0f;
    if constexpr (kFp8) {
      sc_lo = s_lo[kt * BK / 128];
      sc_hi = s_hi[kt * BK / 128];
    }
#pragma unroll
    for (int ks = 0; ks < BK; ks += 16) {
      uint32_t af[MI][4];
#pragma unroll
      for (int i = 0; i < MI; ++i)
        ptx::ldmatrix_x4(af[i], A + (wm * (16 * MI) + i * 16 + (lane & 15)) * kLds + ks + (lane >> 4) * 8);
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        uint32_t bfr[4];
        if constexpr (kFp8) {
          // The m16n8k16 B fragment of n8 tile t: weight row brow(t) + lane / 4, k pairs ks + 2 (lane % 4)
          // (register 0) and 8 further (register 1).
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            const float sc = p.swiglu && j + t >= HT ? sc_hi : sc_lo;
            const unsigned char* q = Bs + (brow(j + t) + (lane >> 2)) * kLdq + ks + (lane & 3) * 2;
            bfr[2 * t] = moe_detail::e4m3x2_to_bf16x2(*reinterpret_cast<const uint16_t*>(q), sc);
            bfr[2 * t + 1] = moe_detail::e4m3x2_to_bf16x2(*reinterpret_cast<const uint16_t*>(q + 8), sc);
          }
        } else {
          const bf16* B = reinterpret_cast<const bf16*>(Bs);
          // Lanes 16-31 address tile j + 1 (8 rows on from tile j's, but for BM 16's gate / up pair).
          ptx::ldmatrix_x4(bfr, B + (brow(j + (lane >> 4)) + (lane & 7)) * kLds + ks + ((lane >> 3) & 1) * 8);
        }
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          ptx::mma_bf16(acc[i][j], af[i], bfr[0], bfr[1]);
          ptx::mma_bf16(acc[i][j + 1], af[i], bfr[2], bfr[3]);
        }
      }
    }
  }
  ptx::cp_async_wait_ring<0>();

  bf16* Y = op.y;
  // Paired (4-byte) stores only where every row start is 4-byte aligned (odd ldy: scalar stores).
  const bool pairs = p.ldy % 2 == 0 && reinterpret_cast<uintptr_t>(Y) % 4 == 0;
#pragma unroll
  for (int i = 0; i < MI; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int pos = row0 + wm * (16 * MI) + i * 16 + (lane >> 2) + h * 8;
      if (pos >= row_end) continue;
      bf16* yr = Y + static_cast<int64_t>(pos) * p.ldy;
      if (p.swiglu) {
#pragma unroll
        for (int j = 0; j < HT; ++j) {
          const int c = col0 + wn * (BN / (2 * WN)) + j * 8 + (lane & 3) * 2;
          moe_detail::store2(yr, c, Nout, moe_detail::silu_expf(acc[i][j][2 * h]) * acc[i][j + HT][2 * h],
                             moe_detail::silu_expf(acc[i][j][2 * h + 1]) * acc[i][j + HT][2 * h + 1], pairs);
        }
      } else {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int c = col0 + wn * (BN / WN) + j * 8 + (lane & 3) * 2;
          moe_detail::store2(yr, c, Nout, acc[i][j][2 * h], acc[i][j][2 * h + 1], pairs);
        }
      }
    }
  }
}

template <int BM, int BN, int BK, int kStages, bool kFp8>
constexpr size_t gemm_smem() {
  return static_cast<size_t>(kStages) * (BM * lds<BK>() * sizeof(bf16) + BN * (kFp8 ? ldq<BK>() : lds<BK>() * sizeof(bf16)));
}

// Launches one tiling (its shared-memory opt-in once per device).
template <int BM, int BN, int BK, int kStages, bool kFp8>
void launch_grouped(const MoeGemmParams& p, Stream s) {
  static bool attr[64] = {};
  constexpr size_t smem = gemm_smem<BM, BN, BK, kStages, kFp8>();
  int dev = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 64 || !attr[dev]) {
    DFLASH_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel<BM, BN, BK, kStages, kFp8>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    if (dev < 64) attr[dev] = true;
  }
  const int64_t cols = p.swiglu ? BN / 2 : BN;
  // BM 16: the sub-tiles of a 64-row tile that can hold rows (MoeGemmParams::max_expert_rows).
  const int64_t rows = p.max_expert_rows >= 1 ? std::min<int64_t>(p.max_expert_rows, kMoeTileRows) : kMoeTileRows;
  const unsigned sub = static_cast<unsigned>((rows + BM - 1) / BM);
  const dim3 grid(static_cast<unsigned>(p.max_tiles + moe_extra_tiles(p)), static_cast<unsigned>((p.Nout + cols - 1) / cols), sub);
  launch_kernel_pdl(grouped_gemm_kernel<BM, BN, BK, kStages, kFp8>, grid, dim3(kThreads), smem, static_cast<cudaStream_t>(s), p);
}

// ---- gather / combine -------------------------------------------------------------------------------
__global__ void gather_kernel(const bf16* __restrict__ x, const int32_t* __restrict__ src_row, int64_t rows, int H,
                              bf16* __restrict__ y) {
  const int64_t pos = blockIdx.x;
  if (pos >= rows) return;
  const uint4* s = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(src_row[pos]) * H);
  uint4* d = reinterpret_cast<uint4*>(y + pos * H);
  for (int c = threadIdx.x; c < H / 8; c += blockDim.x) d[c] = s[c];
}

// One block per token: the shared gate's dot product (block reduction; or its logit given), then 8
// columns a thread. Rows n >= routed have no routed term (kn = 0).
__global__ void combine_kernel(const bf16* __restrict__ y, const int32_t* __restrict__ slot_pos,
                               const float* __restrict__ weights, int k, int H, const bf16* __restrict__ shared,
                               const bf16* __restrict__ x, const bf16* __restrict__ gate_w,
                               bf16* __restrict__ out, int64_t routed, bool settled) {
  const int64_t n = blockIdx.x;
  const int kn = n < routed ? k : 0;
  __shared__ float red[32];
  __shared__ int32_t sp[32];
  __shared__ float sw[32];
  if (!settled) pdl_wait();  // (settled: the choices and the gate's dot product before the wait)
  if (threadIdx.x < kn) {
    sp[threadIdx.x] = slot_pos[n * k + threadIdx.x];
    sw[threadIdx.x] = weights[n * k + threadIdx.x];
  }
  float gate = 0;
  if (shared) {
    float d = 0;
    for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
      float a[8], b[8];
      vec::load8(x + n * H + c, a);
      vec::load8(gate_w + c, b);
#pragma unroll
      for (int q = 0; q < 8; ++q) d += a[q] * b[q];
    }
    for (int o = 16; o; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = d;
    __syncthreads();
    if (threadIdx.x < 32) {
      float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.0f;
      for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (threadIdx.x == 0) red[0] = v;
    }
  }
  __syncthreads();
  if (shared) gate = sigmoid_gate(red[0]);
  if (settled) pdl_wait();  // (y and shared: the GEMMs before)
  pdl_launch_dependents();
  for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) combine8(y, sp, sw, kn, H, shared, gate, n, c, out);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 8 values a thread: FP8 expert rows to their bf16 values (moe_fp8.cuh).
__global__ void dequant_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale, int64_t units, int R, int K,
                               int split, bf16* __restrict__ y) {
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < units;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float s = moe_detail::fp8_unit_scale(scale, u, R, K, split);
    float f[8];
    moe_detail::unpack_e4m3x8(*reinterpret_cast<const uint2*>(q + 8 * u), s, f);
    vec::store8(y + 8 * u, f);
  }
}

// 8 values a thread: bf16 expert rows to the e4m3 codes nearest to value / its block scale.
__global__ void requant_kernel(const bf16* __restrict__ w, const float* __restrict__ scale, int64_t units, int R, int K,
                               int split, uint8_t* __restrict__ q) {
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < units;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float s = moe_detail::fp8_unit_scale(scale, u, R, K, split);
    float f[8];
    vec::load8(w + 8 * u, f);
    uint8_t c[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i] = fp8::e4m3_from_float(f[i] / s);
    std::memcpy(q + 8 * u, c, 8);
  }
}

}  // namespace

void moe_quantize_experts_scaled(const void* w, int64_t El, int64_t R, int64_t K, int64_t split, const float* scale,
                                 void* q, Stream s) {
  DFLASH_CHECK(El >= 1 && R >= 1 && K >= 8 && K % 8 == 0 && split >= 1 && split <= R && R < INT32_MAX && K < INT32_MAX &&
                   scale && aligned16(w) && reinterpret_cast<uintptr_t>(q) % 8 == 0,
               "moe_quantize_experts_scaled: El " << El << ", R " << R << ", K " << K << " (a multiple of 8), split "
                                                  << split << ", aligned w / q");
  const int64_t units = El * R * K / 8;
  const int64_t blocks = std::min<int64_t>((units + 255) / 256, 132 * 16);
  launch_kernel(requant_kernel, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, static_cast<cudaStream_t>(s),
                static_cast<const bf16*>(w), scale, units, static_cast<int>(R), static_cast<int>(K), static_cast<int>(split),
                static_cast<uint8_t*>(q));
}

void moe_quantize_experts(const void* w, int64_t El, int64_t R, int64_t K, int64_t split, void* q, float* scale, Stream s) {
  DFLASH_CHECK(El >= 1 && split >= 1 && split <= R && K % 16 == 0 && R < INT32_MAX && K < INT32_MAX,
               "moe_quantize_experts: El " << El << ", R " << R << ", K " << K << " (a multiple of 16), split " << split);
  const int64_t kb = (K + 127) / 128, rb = moe_detail::fp8_row_blocks(static_cast<int>(R), static_cast<int>(split));
  const int64_t parts[2][2] = {{0, split}, {split, R - split}};  // row offset, rows
  for (int64_t e = 0; e < El; ++e)
    for (int part = 0; part < 2; ++part) {
      const int64_t r0 = parts[part][0], rows = parts[part][1];
      if (rows == 0) continue;
      quantize_fp8_weight(static_cast<const bf16*>(w) + (e * R + r0) * K, rows, K, static_cast<uint8_t*>(q) + (e * R + r0) * K,
                          scale + (e * rb + (part == 0 ? 0 : (split + 127) / 128)) * kb, kb, s);
    }
}

size_t moe_experts_scratch_bytes(int64_t El, int64_t I, int64_t H) {
  return static_cast<size_t>(El) * 3 * static_cast<size_t>(I) * static_cast<size_t>(H) * 2;
}

void moe_dequantize_experts(const void* q, const float* scale, int64_t El, int64_t R, int64_t K, int64_t split, void* y,
                            Stream s) {
  DFLASH_CHECK(El >= 1 && R >= 1 && K >= 8 && K % 8 == 0 && split >= 1 && split <= R && R < INT32_MAX &&
                   K < INT32_MAX && q && scale && aligned16(y) && reinterpret_cast<uintptr_t>(q) % 8 == 0,
               "moe_dequantize_experts: El " << El << ", R " << R << ", K " << K << " (a multiple of 8), split " << split
                                             << ", aligned q / y");
  const int64_t units = El * R * K / 8;
  const int64_t blocks = std::min<int64_t>((units + 255) / 256, 132 * 16);
  launch_kernel(dequant_kernel, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, static_cast<cudaStream_t>(s),
                static_cast<const uint8_t*>(q), scale, units, static_cast<int>(R), static_cast<int>(K),
                static_cast<int>(split), static_cast<bf16*>(y));
}

int64_t moe_max_tiles(int64_t rows, int64_t E) { return (rows + kMoeTileRows - 1) / kMoeTileRows + std::min(E, rows); }

void moe_topk(const float* logits, int64_t N, int64_t E, int64_t k, bool renormalize, int32_t* experts,
              float* weights, int32_t* counts, Stream s) {
  DFLASH_CHECK(E >= 1 && E <= kMaxE && k >= 1 && k <= E && k <= 32 && N >= 0 && N < INT32_MAX,
               "moe_topk: E " << E << " (1..1024), k " << k << " (1..min(E, 32)), N " << N << " out of range");
  auto st = static_cast<cudaStream_t>(s);
  DFLASH_CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<size_t>(E) * sizeof(int32_t), st));
  if (N == 0) return;
  DFLASH_CHECK(logits && experts && weights && counts, "moe_topk: null pointer");
  launch_kernel(topk_kernel, dim3(static_cast<unsigned>((N + kTopkWarps - 1) / kTopkWarps)), dim3(kTopkWarps * 32), 0, st,
                logits, static_cast<int>(N), static_cast<int>(E), static_cast<int>(k), renormalize, experts, weights, counts);
}

void moe_permute(const int32_t* experts, const int32_t* counts, int64_t N, int64_t E, int64_t k, int32_t* offsets,
                 int32_t* tile_offsets, int32_t* cursor, int32_t* src_row, int32_t* slot_pos, Stream s,
                 int64_t expert_begin, int64_t local_experts) {
  const int64_t El = local_experts < 0 ? E : local_experts;
  DFLASH_CHECK(E >= 1 && E <= kMaxE && k >= 1 && N >= 0 && N * k < INT32_MAX && expert_begin >= 0 && El >= 1 &&
                   expert_begin + El <= E,
               "moe_permute: E " << E << " (1..1024), k " << k << ", N " << N << ", experts [" << expert_begin << ", "
                                 << expert_begin + El << ") out of range");
  auto st = static_cast<cudaStream_t>(s);
  launch_kernel(scan_kernel, dim3(1), dim3(32), 0, st, counts + expert_begin, static_cast<int>(El), offsets, tile_offsets,
                cursor);
  const int64_t rows = N * k;
  if (rows == 0) return;
  launch_kernel(scatter_kernel, dim3(static_cast<unsigned>((rows + 255) / 256)), dim3(256), 0, st, experts, rows,
                static_cast<int>(k), static_cast<int>(expert_begin), static_cast<int>(El), cursor, src_row, slot_pos);
}

namespace {
void check_route(int64_t N, int64_t E, int64_t k, int64_t expert_begin, int64_t El, const char* what) {
  DFLASH_CHECK(E >= 1 && E <= kMaxE && k >= 1 && k <= E && k <= 32 && N >= 1 && N * k <= kMoeRouteSmallRows &&
                   expert_begin >= 0 && El >= 1 && expert_begin + El <= E,
               what << ": E " << E << " (1..1024), k " << k << " (1..min(E, 32)), N " << N << " (N k <= "
                    << kMoeRouteSmallRows << "), experts [" << expert_begin << ", " << expert_begin + El
                    << ") out of range");
}
RouteOut route_out(int32_t* experts, float* weights, int32_t* counts, int32_t* offsets, int32_t* tile_offsets,
                   int32_t* cursor, int32_t* src_row, int32_t* slot_pos) {
  DFLASH_CHECK(experts && weights && counts && offsets && tile_offsets && cursor && src_row && slot_pos,
               "moe routing: null output pointer");
  return RouteOut{experts, weights, counts, offsets, tile_offsets, cursor, src_row, slot_pos};
}
}  // namespace

void moe_route_small(const float* logits, int64_t N, int64_t E, int64_t k, bool renormalize, int32_t* experts,
                     float* weights, int32_t* counts, int32_t* offsets, int32_t* tile_offsets, int32_t* cursor,
                     int32_t* src_row, int32_t* slot_pos, Stream s, int64_t expert_begin, int64_t local_experts) {
  const int64_t El = local_experts < 0 ? E : local_experts;
  check_route(N, E, k, expert_begin, El, "moe_route_small");
  DFLASH_CHECK(logits, "moe_route_small: null logits");
  launch_kernel_pdl(route_small_kernel, dim3(1), dim3(kRouteThreads), 0, static_cast<cudaStream_t>(s), logits,
                static_cast<int>(N), static_cast<int>(E), static_cast<int>(k), renormalize, static_cast<int>(expert_begin),
                static_cast<int>(El), route_out(experts, weights, counts, offsets, tile_offsets, cursor, src_row, slot_pos));
}

namespace {
// Whether a grouped call on bf16 weights takes the wgmma kernel: the call's own choice
// (MoeGemmParams::wgmma) or tuning::moe_wgmma's, by default the wide tiling's calls, on a device that
// runs the sm_90a code.
bool takes_wgmma(int choice, bool narrow, int device) {
  const int wg = choice >= 0 ? choice : tuning::moe_wgmma;
  return wg != 0 && (wg == 1 || !narrow) && moe_wgmma_supported(device);
}
}  // namespace

void moe_grouped_gemm(const MoeGemmParams& p, Stream s) {
  DFLASH_CHECK(p.E >= 1 && p.Nout > 0 && p.K > 0 && p.K % 8 == 0 && p.ldx % 8 == 0 && p.ldx >= p.K &&
                   p.ldy >= p.Nout && p.K < INT32_MAX && p.Nout < INT32_MAX,
               "moe_grouped_gemm: E " << p.E << ", Nout " << p.Nout << ", K " << p.K << " (a multiple of 8), ldx "
                                      << p.ldx << " (a multiple of 8, >= K), ldy " << p.ldy << " (>= Nout)");
  DFLASH_CHECK(p.x && p.w && p.y && p.offsets && p.tile_offsets && aligned16(p.x) && aligned16(p.w),
               "moe_grouped_gemm: null or not 16-byte aligned x / w, or no offsets");
  DFLASH_CHECK(!p.w_scale || p.K % 16 == 0, "moe_grouped_gemm: FP8 weights need K " << p.K << " a multiple of 16");
  DFLASH_CHECK(!p.extra_w || (!p.w_scale && p.extra_x && p.extra_y && p.extra_rows >= 0 && aligned16(p.extra_x) &&
                              aligned16(p.extra_w) && p.max_tiles + moe_extra_tiles(p) < INT32_MAX),
               "moe_grouped_gemm: the extra group needs bf16 weights (no w_scale), 16-byte aligned extra_x / extra_w, "
               "an extra_y and extra_rows >= 0");
  if (p.max_tiles + moe_extra_tiles(p) == 0) return;
  if (moe_streamk(p)) return moe_grouped_gemm_stream(p, s);
  const bool narrow = moe_narrow_tiles(p);
#ifndef DFLASH_CUDA_EMULATION  // (the emulated tests run the wgmma kernel by itself)
  if (!p.w_scale) {
    int dev = 0;
    DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
    if (takes_wgmma(p.wgmma, narrow, dev)) return moe_grouped_gemm_wgmma(p, s);
  }
#endif
  const bool deep = narrow && moe_deep_tiles(p), deep16 = deep && moe_deep16_tiles(p);
  if (p.w_scale) {
    if (deep16 && moe_deep16_short(p)) launch_grouped<16, 64, 128, 4, true>(p, s);
    else if (deep16) launch_grouped<16, 64, 128, 8, true>(p, s);
    else if (deep) launch_grouped<64, 64, 128, 4, true>(p, s);
    else narrow ? launch_grouped<64, 64, 32, 5, true>(p, s) : launch_grouped<64, 128, 32, 3, true>(p, s);
  } else {
    if (deep16 && moe_deep16_short(p)) launch_grouped<16, 64, 128, 3, false>(p, s);
    else if (deep16) launch_grouped<16, 64, 128, 5, false>(p, s);
    else if (deep) launch_grouped<64, 64, 128, 3, false>(p, s);
    else narrow ? launch_grouped<64, 64, 32, 5, false>(p, s) : launch_grouped<64, 128, 32, 3, false>(p, s);
  }
}

bool moe_fp8_scratch(MoeImpl impl, int64_t routed_rows, int wgmma, int device) {
  if (impl != MoeImpl::Grouped) return impl == MoeImpl::Fallback;
  if (tuning::moe_fp8_dequantize_first >= 0) return tuning::moe_fp8_dequantize_first == 1;
  MoeGemmParams g;  // the grouped calls' tiling, as moe_block sets it
  g.rows = routed_rows;
  return routed_rows >= kMoeFp8ScratchRows && takes_wgmma(wgmma, moe_narrow_tiles(g), device);
}

bool moe_fuse_shared(bool shared, int64_t I, int64_t Is, int64_t routed_rows, bool fp8_codes) {
  if (tuning::moe_fuse_shared >= 0 && tuning::moe_fuse_shared != 1) return false;
  return shared && Is == I && !fp8_codes && routed_rows >= 1 && (tuning::moe_fuse_shared == 1 || routed_rows <= kMoeNarrowRows);
}

bool moe_narrow_tiles(const MoeGemmParams& p) {
  if (tuning::moe_narrow_tiles >= 0) return tuning::moe_narrow_tiles >= 1;
  return p.rows >= 0 && p.rows <= kMoeNarrowRows;
}

bool moe_deep_tiles(const MoeGemmParams& p) {
  if (tuning::moe_narrow_tiles >= 0) return tuning::moe_narrow_tiles >= 2;
  return p.rows >= 0 && p.rows <= kMoeDeepRows;
}

bool moe_deep16_short(const MoeGemmParams& p) {
  if (tuning::moe_deep16_short >= 0) return tuning::moe_deep16_short == 1;
  return p.K <= kMoeDeep16ShortK;
}

bool moe_deep16_tiles(const MoeGemmParams& p) {
  if (tuning::moe_narrow_tiles >= 0) return tuning::moe_narrow_tiles == 3;
  return moe_deep_tiles(p) && p.max_expert_rows >= 1 && p.max_expert_rows <= 16;
}

namespace tuning {
int moe_deep16_short = -1;
int moe_fuse_shared = -1;
int moe_narrow_tiles = -1;
int moe_wgmma = -1;
int moe_fp8_dequantize_first = -1;
}  // namespace tuning

void moe_gather(const void* x, const int32_t* src_row, int64_t rows, int64_t H, void* y, Stream s) {
  DFLASH_CHECK(H > 0 && H % 8 == 0 && aligned16(x) && aligned16(y), "moe_gather: H " << H
                                                                       << " must be a multiple of 8, x and y 16-byte aligned");
  if (rows == 0) return;
  launch_kernel(gather_kernel, dim3(static_cast<unsigned>(rows)), dim3(128), 0, static_cast<cudaStream_t>(s),
                static_cast<const bf16*>(x), src_row, rows, static_cast<int>(H), static_cast<bf16*>(y));
}

void moe_combine(const void* y, const int32_t* slot_pos, const float* weights, int64_t N, int64_t k, int64_t H,
                 const void* shared, const void* x, const void* gate_w, void* out, Stream s, int64_t routed,
                 bool settled) {
  if (routed < 0) routed = N;
  DFLASH_CHECK(routed <= N, "moe_combine: " << routed << " routed rows of " << N);
  DFLASH_CHECK(H > 0 && H % 8 == 0 && k >= 1 && k <= 32 && aligned16(y) && aligned16(out) &&
                   (!shared || (aligned16(shared) && aligned16(x) && aligned16(gate_w))),
               "moe_combine: H " << H << " (a multiple of 8), k " << k << " (1..32), 16-byte aligned operands");
  if (N == 0) return;
  launch_kernel_pdl(combine_kernel, dim3(static_cast<unsigned>(N)), dim3(256), 0, static_cast<cudaStream_t>(s),
                static_cast<const bf16*>(y), slot_pos, weights, static_cast<int>(k), static_cast<int>(H),
                static_cast<const bf16*>(shared), static_cast<const bf16*>(x), static_cast<const bf16*>(gate_w),
                static_cast<bf16*>(out), routed, settled);
}

const char* moe_impl_name(MoeImpl impl) {
  switch (impl) {
    case MoeImpl::Grouped: return "moe_grouped_mma";
    case MoeImpl::Fallback: return "moe_loop_gemm_bf16";
    case MoeImpl::Decode: return "moe_decode_gemv";
  }
  return "?";
}

namespace {

// The workspace's pieces, each 256-byte aligned, in order.
struct Layout {
  size_t logits, glogit, experts, weights, counts, offsets, tiles, cursor, src, slot, act, y, xg, gu, sgu, sact, sout,
      total;
};
Layout layout(int64_t N, int64_t H, int64_t E, int64_t k, int64_t I, int64_t Is, MoeImpl impl) {
  Layout l{};
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += (bytes + 255) / 256 * 256;
    return here;
  };
  const size_t R = static_cast<size_t>(N * k);
  l.logits = take(static_cast<size_t>(N * E) * 4);
  l.experts = take(R * 4);
  l.weights = take(R * 4);
  if (impl == MoeImpl::Decode) {  // the router's and the shared gate's logits, the routed and shared acts
    l.glogit = take(static_cast<size_t>(N) * 4);
    l.act = take(R * static_cast<size_t>(I) * 2);
    l.sact = take(static_cast<size_t>(N * Is) * 2);
    l.total = at;
    return l;
  }
  l.counts = take(static_cast<size_t>(E) * 4);
  l.offsets = take(static_cast<size_t>(E + 1) * 4);
  l.tiles = take(static_cast<size_t>(E + 1) * 4);
  l.cursor = take(static_cast<size_t>(E) * 4);
  l.src = take(R * 4);
  l.slot = take(R * 4);
  l.act = take(R * static_cast<size_t>(I) * 2);
  l.y = take(R * static_cast<size_t>(H) * 2);
  const bool fb = impl == MoeImpl::Fallback;
  l.xg = take(fb ? R * static_cast<size_t>(H) * 2 : 0);
  l.gu = take(fb ? R * static_cast<size_t>(2 * I) * 2 : 0);
  l.sgu = take(static_cast<size_t>(N * 2 * Is) * 2);
  l.sact = take(static_cast<size_t>(N * Is) * 2);
  l.sout = take(static_cast<size_t>(N * H) * 2);
  l.total = at;
  return l;
}

}  // namespace

size_t moe_workspace_bytes(int64_t N, int64_t H, int64_t E, int64_t k, int64_t I, int64_t Is, MoeImpl impl) {
  return layout(N, H, E, k, I, Is, impl).total;
}

void moe_block(const MoeBlockParams& p, MoeImpl impl, int device) {
  DFLASH_CHECK(p.N >= 0 && p.H > 0 && p.E >= 1 && p.k >= 1 && p.I > 0 && p.H % 8 == 0 && p.I % 8 == 0 &&
                   (!p.shared_gate_up || p.Is > 0) && (p.Is % 8 == 0),
               "moe_block: N " << p.N << ", H " << p.H << ", E " << p.E << ", k " << p.k << ", I " << p.I << ", Is "
                               << p.Is << " (H, I, Is multiples of 8)");
  DFLASH_CHECK(p.x && p.router && p.experts_gate_up && p.experts_down && p.out && p.workspace &&
                   reinterpret_cast<uintptr_t>(p.workspace) % 16 == 0,
               "moe_block: null operand or a workspace that is not 16-byte aligned");
  DFLASH_CHECK(!p.shared_gate_up || (p.shared_down && p.shared_gate),
               "moe_block: a shared expert needs shared_gate_up, shared_down and shared_gate");
  const int64_t Nr = p.routed < 0 ? p.N : p.routed;  // routed rows
  DFLASH_CHECK(Nr <= p.N, "moe_block: " << Nr << " routed rows of " << p.N);
  const int64_t El = p.local_experts < 0 ? p.E : p.local_experts, e0 = p.expert_begin;  // this rank's experts
  DFLASH_CHECK(e0 >= 0 && El >= 1 && e0 + El <= p.E,
               "moe_block: local experts [" << e0 << ", " << e0 + El << ") of " << p.E);
  if (p.N == 0) return;
  Stream s = DeviceContext::get(device).stream();
  const Layout l = layout(p.N, p.H, p.E, p.k, p.I, p.Is, impl);
  char* ws = static_cast<char*>(p.workspace);
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  auto i32 = [&](size_t off) { return reinterpret_cast<int32_t*>(ws + off); };
  const int64_t R = Nr * p.k;
  if (impl == MoeImpl::Decode) {
    MoeDecodeBuffers b;
    b.logits = p.logits_out ? p.logits_out : f32(l.logits);
    b.gate_logit = f32(l.glogit);
    b.experts = p.experts_out ? p.experts_out : i32(l.experts);
    b.weights = p.weights_out ? p.weights_out : f32(l.weights);
    b.act = ws + l.act;
    b.sact = ws + l.sact;
    moe_decode_block(p, b, s);
    return;
  }

  int32_t* experts = p.experts_out ? p.experts_out : i32(l.experts);
  float* weights = p.weights_out ? p.weights_out : f32(l.weights);
  float* logits = p.logits_out ? p.logits_out : f32(l.logits);
  const float* route_by = p.logits_in ? p.logits_in : logits;
  // The router GEMM (cuBLASLt), then the routing: one launch for few rows (a decode / verify step),
  // else top-k + permute.
  GemmExParams rg;  // router logits, fp32
  rg.a = p.x;
  rg.lda = p.H;
  rg.b = p.router;
  rg.ldb = p.H;
  rg.trans_b = true;
  rg.d = logits;
  rg.ldd = p.E;
  rg.d_f32 = true;
  rg.M = p.N;
  rg.N = p.E;
  rg.K = p.H;
  rg.unaligned = p.E % 4 != 0;
  gemm_ex(rg, device);
  if (R >= 1 && R <= kMoeRouteSmallRows) {  // few rows: one launch where there were four
    moe_route_small(route_by, Nr, p.E, p.k, p.renormalize, experts, weights, i32(l.counts), i32(l.offsets),
                    i32(l.tiles), i32(l.cursor), i32(l.src), i32(l.slot), s, e0, El);
  } else {
    moe_topk(route_by, Nr, p.E, p.k, p.renormalize, experts, weights, i32(l.counts), s);
    moe_permute(experts, i32(l.counts), Nr, p.E, p.k, i32(l.offsets), i32(l.tiles), i32(l.cursor), i32(l.src),
                i32(l.slot), s, e0, El);
  }
  void* act = ws + l.act;
  void* y = ws + l.y;
  // FP8 experts: the grouped GEMMs read the codes, or (moe_fp8_scratch: the fallback's gemm_bf16, the
  // wgmma kernel) their bf16 values, written into the scratch first.
  const void* gate_up_w = p.experts_gate_up;
  const void* down_w = p.experts_down;
  const bool fp8 = p.experts_gate_up_scale != nullptr;
  DFLASH_CHECK(!fp8 || p.experts_down_scale, "moe_block: FP8 experts need both block scales");
  const bool scratch = fp8 && moe_fp8_scratch(impl, R, p.wgmma, device);
  if (scratch) {
    DFLASH_CHECK(p.experts_scratch && aligned16(p.experts_scratch),
                 "moe_block: FP8 experts on the " << moe_impl_name(impl) << " path need a 16-byte aligned experts_scratch");
    bf16* gu_b = static_cast<bf16*>(p.experts_scratch);
    bf16* dn_b = gu_b + El * 2 * p.I * p.H;
    moe_dequantize_experts(p.experts_gate_up, p.experts_gate_up_scale, El, 2 * p.I, p.H, p.I, gu_b, s);
    moe_dequantize_experts(p.experts_down, p.experts_down_scale, El, p.H, p.I, p.H, dn_b, s);
    gate_up_w = gu_b;
    down_w = dn_b;
  }
  const bool codes = fp8 && !scratch;  // the grouped GEMMs read the FP8 codes
  // A decode / verify step's shared expert rides in the grouped GEMMs' launches as their extra group
  // (moe_fuse_shared): two launches fewer on the step's critical path, and its weights stream beside
  // the routed experts'.
  const bool fuse_shared = impl == MoeImpl::Grouped && moe_fuse_shared(p.shared_gate_up != nullptr, p.I, p.Is, R, codes);
  if (impl == MoeImpl::Grouped) {
    MoeGemmParams g;
    g.x = p.x;
    g.ldx = p.H;
    g.src_row = i32(l.src);
    g.w = gate_up_w;
    g.y = act;
    g.ldy = p.I;
    g.offsets = i32(l.offsets);
    g.tile_offsets = i32(l.tiles);
    g.E = El;
    g.Nout = p.I;
    g.K = p.H;
    g.max_tiles = moe_max_tiles(R, El);
    g.swiglu = true;
    g.rows = R;
    g.max_expert_rows = std::max<int64_t>(Nr, fuse_shared ? p.N : 0);  // (a token chooses an expert once)
    g.wgmma = p.wgmma;
    g.w_scale = codes ? p.experts_gate_up_scale : nullptr;
    if (fuse_shared) {
      g.extra_x = p.x;
      g.extra_w = p.shared_gate_up;
      g.extra_y = ws + l.sact;
      g.extra_rows = p.N;
    }
    moe_grouped_gemm(g, s);
    if (fuse_shared) {
      g.extra_x = ws + l.sact;
      g.extra_w = p.shared_down;
      g.extra_y = ws + l.sout;
    }
    g.routing_settled = true;  // (written by the routing, before the gate|up GEMM's launch)
    g.x = act;
    g.ldx = p.I;
    g.src_row = nullptr;
    g.w = down_w;
    g.y = y;
    g.ldy = p.H;
    g.Nout = p.H;
    g.K = p.I;
    g.swiglu = false;
    g.w_scale = codes ? p.experts_down_scale : nullptr;
    moe_grouped_gemm(g, s);
  } else {
    // The explicit fallback: gathered rows (the local experts' offsets[El] of them), then per expert
    // gemm_bf16 (gate|up), swiglu, gemm_bf16 (down).
    std::vector<int32_t> off(static_cast<size_t>(El + 1));
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(off.data(), i32(l.offsets), off.size() * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                      static_cast<cudaStream_t>(s)));
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(s)));
    moe_gather(p.x, i32(l.src), off.back(), p.H, ws + l.xg, s);
    const auto* gu_w = static_cast<const bf16*>(gate_up_w);
    const auto* dn_w = static_cast<const bf16*>(down_w);
    for (int64_t e = 0; e < El; ++e) {
      const int64_t o = off[static_cast<size_t>(e)], c = off[static_cast<size_t>(e + 1)] - o;
      if (c == 0) continue;
      GemmParams a;
      a.x = static_cast<const bf16*>(static_cast<const void*>(ws + l.xg)) + o * p.H;
      a.ldx = p.H;
      a.w = gu_w + e * 2 * p.I * p.H;
      a.y = ws + l.gu;
      a.ldy = 2 * p.I;
      a.M = c;
      a.N = 2 * p.I;
      a.K = p.H;
      gemm_bf16(a, device);
      swiglu(ws + l.gu, static_cast<bf16*>(act) + o * p.I, c, p.I, s);
      GemmParams d;
      d.x = static_cast<const bf16*>(act) + o * p.I;
      d.ldx = p.I;
      d.w = dn_w + e * p.H * p.I;
      d.y = static_cast<bf16*>(y) + o * p.H;
      d.ldy = p.H;
      d.M = c;
      d.N = p.H;
      d.K = p.I;
      gemm_bf16(d, device);
    }
  }
  const void* shared = fuse_shared ? ws + l.sout : nullptr;
  if (p.shared_gate_up && !fuse_shared) {
    GemmParams a;
    a.x = p.x;
    a.ldx = p.H;
    a.w = p.shared_gate_up;
    a.y = ws + l.sgu;
    a.ldy = 2 * p.Is;
    a.M = p.N;
    a.N = 2 * p.Is;
    a.K = p.H;
    gemm_bf16(a, device);
    swiglu(ws + l.sgu, ws + l.sact, p.N, p.Is, s);
    GemmParams d;
    d.x = ws + l.sact;
    d.ldx = p.Is;
    d.w = p.shared_down;
    d.y = ws + l.sout;
    d.ldy = p.H;
    d.M = p.N;
    d.N = p.H;
    d.K = p.Is;
    gemm_bf16(d, device);
    shared = ws + l.sout;
  }
  // (settled: x came before the router, the choices before the expert GEMMs)
  moe_combine(y, i32(l.slot), weights, p.N, p.k, p.H, shared, p.x, p.shared_gate, p.out, s, Nr, true);
}

}  // namespace dflash::cuda
