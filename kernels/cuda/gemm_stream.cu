// Streaming skinny GEMMs for decode / verify steps (issue 30): y[M, N] = x[M, K] · w[N, K]^T for
// 1 <= M <= 16, fp32 accumulation, bf16 out, each weight byte read once, on a one-wave stream-K grid.
// Two element types, one kernel:
//   - FP8 (gemm_fp8_stream): gemm_fp8's operands (e4m3 codes, per-token 1 x 128 activation scales,
//     128 x 128 weight block scales; layouts in gemm.h "FP8"), mma.sync m16n8k32 e4m3, per 128-column
//     group the code-product sums times the weight block's and the token's scale (as
//     ops::gemm_fp8_blockwise). gemm_fp8 runs it for M % 4 != 0 (cuBLASLt has no block-scaled kernel
//     there) or when tuning::gemm_fp8_stream == 1; the model's decode / verify steps call it where
//     the decode plan's skinny GEMMs are on (FastPathPlan::DecodeFusion::skinny_gemm).
//   - bf16 (gemm_skinny with tuning::gemm_skinny_streamk = 1, K % 128 == 0, no SwiGLU prologue):
//     mma.sync m16n8k16 bf16, as gemm_skinny's cluster kernel but on this grid.
// CPU references: ops::gemm_fp8_blockwise, ops::linear.
//
// Roofline: the weight read once (x, its scales and y are < 1% at M = 16): at the Qwen3.6-27B decode
// shapes in FP8 31 MB (out_proj 5120 x 6144) to 178 MB (gate/up 34816 x 5120), 7-42 us at an H200's
// copy bandwidth (~4.25 TB/s); bf16 twice that. The FP8 kernel before this one (af49b75: 8-warp
// blocks over fixed runs of rows, a batch of loads then the math) streamed 2.0-2.9 TB/s and made the
// fp8 decode step slower than cuBLASLt (14.72 vs 12.11 ms, bench/results/h200-fp8dec-af49b75);
// gemm_skinny's cluster grids lost to wave quantization at N = 5120 (2,640-2,862 GB/s, h200-decode4-*).
//
// Design (second version, session 27). The work is a list of units (a 16-row tile x 128 bytes of its
// rows: FP8 one scale group, bf16 64 columns), tile-major: U = ceil(N / 16) · K · elem / 128. A grid of
// B = min(U, resident blocks) blocks takes equal contiguous runs ([U b / B, U (b + 1) / B)) and each
// block's 8 warps take equal contiguous runs of the block's, so every warp streams the same bytes
// whatever N and K (no partial last wave). A warp walks its run unit by unit, continuously across tile
// boundaries, with its weight bytes loaded straight into registers (16-byte non-coherent loads that
// skip L1: per unit and lane rows g and g + 8 of the tile, bytes 16t and 64 + 16t of the unit, so a
// load instruction reads 64 contiguous bytes of each of 8 rows) through a register ring of kDepth
// units: a unit's slot is refilled with the unit kDepth ahead as soon as its MMAs have read it, so
// kDepth - 1 to kDepth units (6-8 KB a warp, 16 warps an SM) are always in flight (the FP8 kernel's depth is
// tuning::gemm_fp8_stream_depth, 2 by default, 3 and 4 built too: at 4 ptxas spills 36 / 92 bytes under the 128
// registers two blocks an SM allow, at 2 and 3 nothing; the same bits at every depth; 2 is the fastest). x is read at the
// math (L1 / L2: every warp of an SM reads the same rows). The MMAs take the weight rows as the MMA's
// M and the tokens as its N (one token half for M <= 8, two for M <= 16), the k order permuted alike
// for both operands so the 16-byte units are used as loaded (skinny_mma.cuh: fp8 lane t's bytes
// 16t + 8h .. + 3 serve logical k 4t.., bytes + 4 .. + 7 serve k 16 + 4t.. of MMA h; bf16 words 2h /
// 2h + 1 serve k 2t.. / 2t + 8..). The first version (635606c: 4-warp blocks, 64-row tiles, a cp.async
// ring in shared memory, 8 warps an SM) streamed 0.98-1.39 TB/s on an H100 (FP8; bf16 1.05-2.03).
// A warp's run covers whole tiles, which it stores itself, and at most two pieces: one of a tile
// begun before its run (part0) and one of a tile continued after it (kept in registers to the end,
// then part1; both in shared memory). After a barrier the block sums the pieces of each tile its
// warps share, in warp order; a tile whole in the block is stored; a tile shared with other blocks
// (at most the block's first and last) leaves the block's sum in a workspace slot (global memory,
// L2-resident, 16 x 16 floats; slot 0: begun in an earlier block, 1: continued in a later one), and
// the block that arrives last (a counter per shared tile, at its first block) sums the slots in block
// order, stores the tile and resets the counter, so the next launch (or graph replay) starts from
// zero. No block waits for another: any grid size is correct.
// Every sum has a fixed order (k, warp, block order, set by N, K and the grid), so the result is
// deterministic and each output depends only on its own x row and weight row, not on M: a row of
// a T = 1 decode and of a T = 16 verify are computed alike (batch invariance). With programmatic
// dependent launch (pdl.cuh) the first kDepth units' weight loads are issued before waiting on the
// previous kernel, which wrote x.
//
// Measured (H100, M 16): the first version 0.98-1.39 TB/s FP8 against cuBLASLt's 1.62-2.27 (bf16 1.05-2.03
// against 2.54-2.90, bench/results/h100-fused-6bf6ff4), this one 1.03-1.83 FP8 against 1.62-2.25 and bf16
// 1.91-2.36 against 2.59-2.83 (bench/results/h100-stream2-7ce8e65): still slower, so both stay off by default.
// The probe there says why (the loads and the math share warps; docs/fp8.md). On packed weights (session 31,
// pack_stream_weight: a unit's 2 KB contiguous) with no division a unit: 1.10-2.09 TB/s FP8 against cuBLASLt's
// 1.60-2.25, the fp8 decode step 16.56 against 13.75 ms (bench/results/h100-packed-effd9fd).
// On a packed weight the FP8 kernel can take its units through shared memory instead (session 38, kBulk;
// DFLASH_FP8_STREAM_STAGES=2 turns it on; off by default: its best ring, 2 x 1, streams 1.21-2.08 TB/s at M 16 on
// an H100, 4-15% above the packed register ring and 8-27% below cuBLASLt, bench/results/h100-bulkring-384ebce):
// each warp's run of units is contiguous in the packed layout, so lane 0 streams it with cp.async.bulk
// copies of tuning::gemm_fp8_stream_chunk units (default 2: 4 KB) into a ring of gemm_fp8_stream_stages
// slots (2 to try first) completed on one mbarrier a slot, with an L2 evict-first hint; the lanes wait on the
// slot, read their 16-byte pieces from shared memory (the packed order: 512 contiguous bytes a load, no
// bank conflicts), and lane 0 refills the slot as soon as its last unit is in registers, before that
// unit's math. The loads no longer take the warps' issue slots or registers (the probe's finding), the
// math, the sums and the fix-up are the register ring's, so the bits are the same. The first slots go
// out before the programmatic-launch wait.
// tests/test_gemm_stream_emulated.cpp runs it on the CPU; kernel_bench --only fp8
// (stream_e4m3 rows, DFLASH_BENCH_FP8_DECODE=1) and --only decode_gemm (skinny_streamk rows), and
// dflash_eval --decode-variants fused,skinny (fp8) / skinny_streamk (bf16) measure it against cuBLASLt;
// bench/probes/fp8_gemv_probe.cu times the load patterns it was chosen from.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "core/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/emulatable.cuh"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/skinny_mma.cuh"

namespace dflash::cuda {

namespace {
// The bulk kernel's ring unless DFLASH_FP8_STREAM_STAGES / _CHUNK say otherwise. Stages 0: off, since it loses
// to cuBLASLt (bench/results/h100-bulkring-384ebce: of 2 x 1, 2 x 2 and 5 x 1, 2 x 1 was best; chunk 2 stays the
// default a ring gets when only the stages are set).
constexpr int kDefaultBulkStages = 0;
constexpr int kDefaultBulkChunk = 2;
constexpr int kMaxRingDepth = 4;      // the deepest register ring built (kDepth: the bf16 kernel's, FP8 depth 4)
constexpr int kDefaultFp8RingDepth = 2;  // tuning::gemm_fp8_stream_depth's default

int env_or(const char* name, int fallback) {
  const char* e = std::getenv(name);
  return e && *e ? std::atoi(e) : fallback;
}

// DFLASH_STREAM_FIXUP: block (default), warp or atomic (tuning::gemm_stream_fixup); an unknown name is
// refused where the kernel launches.
int fixup_from_env() {
  const char* e = std::getenv("DFLASH_STREAM_FIXUP");
  if (!e || !*e || std::strcmp(e, "block") == 0) return 0;
  if (std::strcmp(e, "atomic") == 0) return 1;
  if (std::strcmp(e, "warp") == 0) return 2;
  return -1;
}
}  // namespace

namespace tuning {
int gemm_fp8_stream = -1;     // -1: only where cuBLASLt has no kernel (M % 4 != 0); 0: never; 1: whenever supported
int gemm_skinny_streamk = 0;  // 1: gemm_skinny runs the stream-K kernel where it can (no SwiGLU, K % 128 == 0)
int gemm_fp8_stream_stages = env_or("DFLASH_FP8_STREAM_STAGES", kDefaultBulkStages);
int gemm_fp8_stream_chunk = env_or("DFLASH_FP8_STREAM_CHUNK", kDefaultBulkChunk);
int gemm_fp8_stream_evict_first = env_or("DFLASH_FP8_STREAM_EVICT_FIRST", 1);
// 2 by default since session 41: depths 2 > 3 > 4 on every decode shape of kernel_bench on an H100 (packed
// gate|up at M 16 2,145 -> 2,269 GB/s, o_proj 1,120 -> 1,246; bench/results/h100-stream-f683da9).
int gemm_fp8_stream_depth = env_or("DFLASH_FP8_STREAM_DEPTH", kDefaultFp8RingDepth);
int gemm_stream_fixup = fixup_from_env();
}  // namespace tuning

namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTiles = 1;              // m16 tiles of weight rows per warp (a tile of work: 16 rows)
constexpr int kRows = 16 * kTiles;
constexpr int kUnitBytes = 128;        // bytes of a weight row per unit (FP8: one scale group; bf16: 64 columns)
constexpr int kDepth = kMaxRingDepth;  // units whose weight loads are in flight per warp (FP8: tuning::gemm_fp8_stream_depth)
constexpr int kWLoads = 4 * kTiles;    // 16-byte weight loads per lane and unit (rows g, g + 8; bytes 16t, 64 + 16t)
constexpr int kRedLd = kRows + 4;      // padded rows of a piece buffer [16 tokens][kRedLd]: conflict-free stores
constexpr int kSlots = 2;              // workspace slots per block
constexpr int64_t kSlotFloats = 16 * kRows;
// The workspace a launch of `blocks` blocks needs: the block fix-up's kSlots slots and one counter a block, the
// warp fix-up's two slots and one counter a warp.
constexpr int64_t workspace_floats(int64_t blocks) { return blocks * kWarps * 2 * kSlotFloats; }
constexpr int64_t workspace_counters(int64_t blocks) { return blocks * kWarps; }

struct StreamParams {
  const uint8_t* x;   // [M, ldx] elements
  int64_t ldx_bytes;
  const float* xs;    // FP8: x scales, (token m, group g) at xs[g * ldxs + m]
  int64_t ldxs;
  const uint8_t* w;   // [N, K] elements
  const uint8_t* wp;  // or nullptr: w in the packed unit layout (pack_stream_weight), read instead of w
  int64_t row_bytes;  // K · element size
  const float* ws;    // FP8: weight scales, (block nb, kb) at ws[nb * ldws + kb]
  int64_t ldws;
  void* y;            // [M, ldy]: bf16, or (FP8's y_f32) f32, added into where accumulate
  int64_t ldy;
  bool y_f32, accumulate;
  int M, N, G;        // G: units (128-byte column runs) per tile
  int tiles, blocks;
  float* partial;     // [blocks][kSlots][16][kRows]
  int* counters;      // [blocks], zero between launches
};

// The bulk kernel's ring (FP8 on a packed weight): stages > 0 slots per warp of chunk units each; the copies
// leave L2 first where evict_first. A kernel parameter of its own: with these fields in StreamParams, ptxas
// allocated the register-ring kernels' registers differently (FP8: 90-byte spill stores against 36) and they
// streamed 4-10% slower on an H100 (bench/results/h100-bulkring-384ebce).
struct BulkRing {
  int stages = 0, chunk = 0;
  int evict_first = 0;
};

// Run r of `parts` equal contiguous runs of n items is [run_begin(n, parts, r), run_begin(n, parts, r + 1)).
__host__ __device__ __forceinline__ int run_begin(int64_t n, int64_t parts, int64_t r) {
  return static_cast<int>(n * r / parts);
}
// The (non-empty) run holding item i, 0 <= i < n.
__host__ __device__ __forceinline__ int run_of(int64_t n, int64_t parts, int64_t i) {
  int64_t r = i * parts / n;
  while (r + 1 < parts && run_begin(n, parts, r + 1) <= i) ++r;
  while (r > 0 && run_begin(n, parts, r) > i) --r;
  return static_cast<int>(r);
}

// The packed unit layout (pack_stream_weight): unit u = (tile, 128-byte run) at u · 2 KB, its lane L's
// 16-byte load j (the kernel's wv[j]: row 16 tile + L / 4 + 8 (j / 2), bytes 128 run + 64 (j % 2) + 16 (L % 4))
// at 512 j + 16 L, so a warp's four loads of a unit read 2 KB of contiguous memory. The byte offset in the
// row-major weight of packed piece i (16 bytes), or -1 for a row past N (a zero piece).
constexpr int64_t kPackedUnitBytes = kRows * kUnitBytes;
__host__ __device__ __forceinline__ int64_t packed_source(int64_t i, int64_t N, int64_t row_bytes) {
  const int64_t G = row_bytes / kUnitBytes, unit = i / 128;
  const int within = static_cast<int>(i % 128), j = within / 32, L = within % 32;
  const int64_t tile = unit / G, run = unit % G;
  const int64_t row = 16 * tile + L / 4 + 8 * (j >> 1);
  return row < N ? row * row_bytes + run * kUnitBytes + 64 * (j & 1) + 16 * (L % 4) : -1;
}

// One output: y[tok, row] = v as bf16, or as f32 (y_f32), or y[tok, row] += v (accumulate, f32).
__device__ __forceinline__ void store_one(const StreamParams& p, int tok, int row, float v) {
  const int64_t at = static_cast<int64_t>(tok) * p.ldy + row;
  if (!p.y_f32) static_cast<bf16*>(p.y)[at] = __float2bfloat16(v);
  else if (p.accumulate) static_cast<float*>(p.y)[at] += v;
  else static_cast<float*>(p.y)[at] = v;
}

// Rows row .. row + 3 of token tok (< M) from a sum; rows past N are not stored.
__device__ __forceinline__ void store_quad(const StreamParams& p, int tok, int row, const float4& v) {
  if (row + 3 < p.N && !p.y_f32) {  // (ldy % 4 == 0: 8-byte aligned)
    uint2 u;
    u.x = ptx::pack_bf16(v.x, v.y);
    u.y = ptx::pack_bf16(v.z, v.w);
    *reinterpret_cast<uint2*>(static_cast<bf16*>(p.y) + static_cast<int64_t>(tok) * p.ldy + row) = u;
    return;
  }
  if (row + 3 < p.N && !p.accumulate) {  // (f32: ldy % 4 == 0, 16-byte aligned)
    *reinterpret_cast<float4*>(static_cast<float*>(p.y) + static_cast<int64_t>(tok) * p.ldy + row) = v;
    return;
  }
  const float f[4] = {v.x, v.y, v.z, v.w};
  for (int i = 0; i < 4 && row + i < p.N; ++i) store_one(p, tok, row + i, f[i]);
}

// A warp's accumulators: skinny_mma.cuh's C fragments (skinny::c_row / c_token) of its kTiles tiles.
using Acc = float[kTiles][2][4];

// The warp fix-up (kFix 2, tuning::gemm_stream_fixup = warp): no block barrier and no block sums. A warp
// that ends a piece of a tile other warps share writes it to its own workspace slot (global warp gw's slot 0
// for the piece its run begins with, 1 for the one it ends with: p.partial[2 gw + slot], 16 tokens x 16 rows),
// then counts it on the tile's counter (p.counters[the tile's first warp]; the first warp of a shared tile
// is the one whose run it starts in, so no two tiles share a counter); the warp that brings the count to the
// tile's number of pieces sums them in global warp order, stores the tile and zeroes the counter for the next
// launch. The order is set by N, K and the grid, so the bits are deterministic and batch invariant (another
// order than the block fix-up's where a tile spans more than two blocks' warps).
// The global warp holding unit u (a non-empty run): block run_of(U, B, u), then its warp.
__device__ __forceinline__ int warp_of_unit(int U, int B, int u) {
  const int blk = run_of(U, B, u), ub = run_begin(U, B, blk), bn = run_begin(U, B, blk + 1) - ub;
  return blk * kWarps + run_of(bn, kWarps, u - ub);
}
// The first unit of global warp gw's run, and whether the run is empty.
__device__ __forceinline__ int warp_first_unit(int U, int B, int gw, bool& empty) {
  const int blk = gw / kWarps, w = gw % kWarps, ub = run_begin(U, B, blk), bn = run_begin(U, B, blk + 1) - ub;
  const int a = run_begin(bn, kWarps, w);
  empty = a == run_begin(bn, kWarps, w + 1);
  return ub + a;
}
__device__ __forceinline__ void warp_fixup(const StreamParams& p, const Acc& acc, int tile, int slot, int gw, int lane) {
  const int G = p.G, U = p.tiles * G, B = p.blocks;
  float* mine = p.partial + (2 * static_cast<int64_t>(gw) + slot) * kSlotFloats;
  skinny::store_fragments(acc, reinterpret_cast<float(*)[kRows]>(mine), lane >> 2, lane & 3);
  __threadfence();  // the piece is visible before the count says so
  __syncwarp();
  const int first = warp_of_unit(U, B, tile * G), last_w = warp_of_unit(U, B, (tile + 1) * G - 1);
  int done = 0;
  if (lane == 0) {
    int pieces = 0;
    for (int w = first; w <= last_w; ++w) {
      bool empty = false;
      warp_first_unit(U, B, w, empty);
      pieces += !empty;
    }
    done = atomicAdd(p.counters + first, 1) == pieces - 1;
  }
  done = __shfl_sync(0xffffffffu, done, 0);
  if (!done) return;
  __threadfence();
  for (int q = lane; q < 16 * kRows / 4; q += 32) {  // a quad of rows of a token per lane and step
    const int tok = q / (kRows / 4), r4 = (q % (kRows / 4)) * 4;
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int w = first; w <= last_w; ++w) {
      bool empty = false;
      const int w0 = warp_first_unit(U, B, w, empty);
      if (empty) continue;
      const float* src = p.partial + (2 * static_cast<int64_t>(w) + (tile * G <= w0 ? 0 : 1)) * kSlotFloats;
      const float4 v = __ldcg(reinterpret_cast<const float4*>(src + tok * kRows + r4));
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    if (tok < p.M) store_quad(p, tok, tile * kRows + r4, sum);
  }
  if (lane == 0) p.counters[first] = 0;  // ready for the next launch
}

// kFix: how the pieces of tiles shared by warps are summed (FixUp: 0 block, 1 atomic, 2 warp).
template <bool kFp8, bool kBulk, int kRing = kDepth, int kFix = 0>
__global__ void __launch_bounds__(kThreads, 2) gemm_stream_kernel(const StreamParams p, const BulkRing ring) {
  __shared__ __align__(16) float part0[kWarps][16][kRedLd];  // a warp's piece of a tile begun before its run
  __shared__ __align__(16) float part1[kWarps][16][kRedLd];  // ... of a tile continued after its run
  __shared__ int last;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int G = p.G, U = p.tiles * G, B = p.blocks, b = static_cast<int>(blockIdx.x);
  const int ub = run_begin(U, B, b), ue = run_begin(U, B, b + 1), bn = ue - ub;
  const int wu0 = ub + run_begin(bn, kWarps, warp), wu1 = ub + run_begin(bn, kWarps, warp + 1);
  const bool two = p.M > 8;
  const bool xv[2] = {g < p.M, g + 8 < p.M};
  const uint8_t* xp[2] = {p.x + static_cast<int64_t>(xv[0] ? g : 0) * p.ldx_bytes + 16 * t,
                          p.x + static_cast<int64_t>(xv[1] ? g + 8 : 0) * p.ldx_bytes + 16 * t};

  // Unit u's weight bytes of this lane: rows g and g + 8 of each tile, bytes 16t and 64 + 16t of the
  // unit's 128 (wv[4i + 2r + j]: tile i, row g + 8r, half j); rows past N read as zeros.
  // (tile, grp) = (u / G, u % G), kept by increments where units come in order (no division a unit).
  auto load_w = [&](int u, int tile, int grp, uint4 (&wv)[kWLoads]) {
    static_assert(kTiles == 1, "the packed layout holds 16-row tiles");
    if (p.wp) {  // the packed copy: rows past N are zero there
      const uint8_t* src = p.wp + static_cast<int64_t>(u) * kPackedUnitBytes + 16 * lane;
#pragma unroll
      for (int j = 0; j < kWLoads; ++j) wv[j] = ptx::ldg_stream16(src + 512 * j);
      return;
    }
    const int64_t col = static_cast<int64_t>(grp) * kUnitBytes + 16 * t;
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = tile * kRows + 16 * i + 8 * r + g;
        const uint8_t* src = p.w + static_cast<int64_t>(row) * p.row_bytes + col;
        const bool v = row < p.N;
        wv[4 * i + 2 * r] = v ? ptx::ldg_stream16(src) : make_uint4(0, 0, 0, 0);
        wv[4 * i + 2 * r + 1] = v ? ptx::ldg_stream16(src + 64) : make_uint4(0, 0, 0, 0);
      }
  };

  Acc acc, d;  // d: FP8's code sums of the current group (unused for bf16)
  skinny::zero(acc);
  skinny::zero(d);

  int tile_at = wu0 / G, grp_at = wu0 - tile_at * G;  // the unit of the math
  int piece0 = wu0;    // the first unit of the piece being summed
  bool keep = false;   // acc holds a piece of a tile continued after this run (part1)
  // Unit u's math on its weight registers wv; refill() (issued between the MMAs and the scales) puts the
  // next loads of the ring in flight. Ends a piece of a tile where the unit ends one.
  auto unit = [&](const int u, const uint4(&wv)[kWLoads], auto&& refill) {
    const int tile = tile_at, grp = grp_at, n0 = tile * kRows;
    if (++grp_at == G) grp_at = 0, ++tile_at;
    const int64_t col = static_cast<int64_t>(grp) * kUnitBytes;
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // the unit's two 64-byte halves: skinny_mma's steps
      const uint4 xa0 = xv[0] ? __ldg(reinterpret_cast<const uint4*>(xp[0] + col + 64 * j)) : make_uint4(0, 0, 0, 0);
      const uint4 xa1 = two && xv[1] ? __ldg(reinterpret_cast<const uint4*>(xp[1] + col + 64 * j)) : make_uint4(0, 0, 0, 0);
      uint4 ws[2 * kTiles];
#pragma unroll
      for (int i = 0; i < kTiles; ++i) ws[2 * i] = wv[4 * i + j], ws[2 * i + 1] = wv[4 * i + 2 + j];
      skinny::step_mmas<kFp8, kTiles>(ws, xa0, xa1, two, kFp8 ? d : acc);
    }
    refill();
    if constexpr (kFp8) {  // the group's code sums times the weight block's and each token's scale
      const float sw = __ldg(p.ws + static_cast<int64_t>(n0 / 128) * p.ldws + grp);
      const float* xg = p.xs + static_cast<int64_t>(grp) * p.ldxs;
      float sc[4];  // tokens c_token(e / 2, e % 2, t): sc[2 hf + (c & 1)] scales acc[.][hf][c]
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = skinny::c_token(e >> 1, e & 1, t);
        sc[e] = tok < p.M ? sw * __ldg(xg + tok) : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kTiles; ++i)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            acc[i][hf][c] += d[i][hf][c] * sc[2 * hf + (c & 1)];
            d[i][hf][c] = 0.0f;
          }
    }
    if (grp != G - 1 && u != wu1 - 1) return;
    // f(token, row, value) for each of the lane's outputs of `tile` (tokens < M, rows < N)
    const auto each_output = [&](auto&& f) {
#pragma unroll
      for (int i = 0; i < kTiles; ++i)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int tok = skinny::c_token(hf, c, t), row = n0 + skinny::c_row(i, c, g);
            if (tok < p.M && row < p.N) f(tok, row, acc[i][hf][c]);
          }
    };
    if constexpr (kFix == 1) {  // timing experiment (f32 accumulate outputs): every piece added with atomics
      each_output([&](int tok, int row, float v) { atomicAdd(static_cast<float*>(p.y) + static_cast<int64_t>(tok) * p.ldy + row, v); });
      skinny::zero(acc);
      piece0 = u + 1;
      return;
    }
    // The end of a piece of `tile`.
    const bool from_start = piece0 == tile * G;
    if constexpr (kFix == 2) {
      if (!(from_start && grp == G - 1)) {  // a piece of a tile shared with other warps: the warp fix-up
        warp_fixup(p, acc, tile, piece0 == wu0 ? 0 : 1, b * kWarps + warp, lane);
        skinny::zero(acc);
        piece0 = u + 1;
        return;
      }
    }
    if (from_start && grp == G - 1) {  // the whole tile: store it
      each_output([&](int tok, int row, float v) { store_one(p, tok, row, v); });
    } else if (!from_start) {  // a tile begun before this run (its first piece)
      skinny::store_fragments(acc, part0[warp], g, t);
    } else {  // a tile continued after this run: the run's last unit (u == wu1 - 1)
      keep = true;
      return;
    }
    skinny::zero(acc);
    piece0 = u + 1;
  };

  if constexpr (kBulk) {
    // The packed copy's units through a ring of ring.stages slots of ring.chunk 2-KB units in shared memory per
    // warp, filled by the copy engine (one cp.async.bulk a slot of the warp's next units, contiguous in the
    // packed layout, issued by lane 0 and completed on the slot's mbarrier): a slot is refilled with the
    // units ring.stages slots ahead as soon as the lanes have its last unit in registers, so (ring.stages - 1)
    // to ring.stages slots are in flight while the warp does its math.
    DFLASH_DYNAMIC_SMEM(uint8_t, bulk);
    const int S = ring.stages, C = ring.chunk;
    const int64_t slot_bytes = static_cast<int64_t>(C) * kPackedUnitBytes;
    uint8_t* slots = bulk + static_cast<int64_t>(warp) * S * slot_bytes;
    uint64_t* bars = reinterpret_cast<uint64_t*>(bulk + static_cast<int64_t>(kWarps) * S * slot_bytes) + warp * S;
    const bool evict_first = ring.evict_first != 0;
    const uint64_t policy = evict_first ? ptx::l2_evict_first_policy() : 0;
    const auto slot_units = [&](int u) { return wu1 - u < C ? wu1 - u : C; };  // a slot from unit u: fewer at the run's end
    const auto fill = [&](int slot, int u) {
      ptx::bulk_load(slots + slot * slot_bytes, p.wp + static_cast<int64_t>(u) * kPackedUnitBytes,
                     static_cast<uint32_t>(slot_units(u) * kPackedUnitBytes), bars + slot, evict_first, policy);
    };
    if (lane == 0) {
      for (int q = 0; q < S; ++q) ptx::mbar_init(bars + q, 1);
      ptx::mbar_init_fence();
      for (int q = 0; q < S && wu0 + q * C < wu1; ++q) fill(q, wu0 + q * C);  // before the wait: weights are not written
    }
    __syncwarp();
    pdl_launch_dependents();
    pdl_wait();
    int slot = 0;
    uint32_t phase = 0;
    for (int u0 = wu0; u0 < wu1; u0 += C) {
      ptx::mbar_wait(bars + slot, phase);
      const int n = slot_units(u0);
      for (int i = 0; i < n; ++i) {
        uint4 wv[kWLoads];
        const uint8_t* src = slots + slot * slot_bytes + i * kPackedUnitBytes + 16 * lane;
#pragma unroll
        for (int j = 0; j < kWLoads; ++j) wv[j] = *reinterpret_cast<const uint4*>(src + 512 * j);
        if (i == n - 1) {
          __syncwarp();  // every lane has read the slot before it is refilled
          if (lane == 0 && u0 + S * C < wu1) {
            ptx::proxy_async_fence();  // the generic reads of the slot before the copy engine's writes
            fill(slot, u0 + S * C);
          }
          if (++slot == S) slot = 0, phase ^= 1u;
        }
        unit(u0 + i, wv, [] {});
      }
    }
  } else {
    // A register ring of kRing units per lane: unit wu0 + q sits in buf[q % kRing] from its load (kRing
    // units ahead of its math) until its math. The first loads go before the wait on the previous kernel
    // (nothing in the step writes weights); x is read at the math, after it.
    uint4 buf[kRing][kWLoads];
    pdl_launch_dependents();
#pragma unroll
    for (int q = 0; q < kRing; ++q)
      if (wu0 + q < wu1) load_w(wu0 + q, (wu0 + q) / G, (wu0 + q) % G, buf[q]);
    pdl_wait();
    int tile_ld = (wu0 + kRing) / G, grp_ld = (wu0 + kRing) - tile_ld * G;  // the next unit loaded
    for (int u0 = wu0; u0 < wu1; u0 += kRing) {
#pragma unroll
      for (int q = 0; q < kRing; ++q) {
        const int u = u0 + q;
        if (u >= wu1) break;
        unit(u, buf[q], [&] {  // refill the slot: kRing units ahead
          if (u + kRing < wu1) {
            load_w(u + kRing, tile_ld, grp_ld, buf[q]);
            if (++grp_ld == G) grp_ld = 0, ++tile_ld;
          }
        });
      }
    }
  }
  if constexpr (kFix != 0) return;  // no pieces left: no block fix-up
  if (keep) skinny::store_fragments(acc, part1[warp], g, t);
  __syncthreads();

  // The tiles the block's warps share or share with other blocks: the block's sum of their pieces
  // (warp order), stored, or left for the tile's last block. One thread per 4 rows of a token.
  if (bn == 0) return;
  constexpr int kQuads = 16 * kRows / 4;
  static_assert(kQuads <= kThreads, "one quad per thread");
  const int q = static_cast<int>(threadIdx.x), tok = q / (kRows / 4), r4 = (q % (kRows / 4)) * 4;
  const bool mine_q = q < kQuads && tok < p.M;
  for (int T = ub / G; T <= (ue - 1) / G; ++T) {
    const int u0 = ub > T * G ? ub : T * G, u1 = ue < (T + 1) * G ? ue : (T + 1) * G;
    const int wa = run_of(bn, kWarps, u0 - ub), wb = run_of(bn, kWarps, u1 - 1 - ub);
    const bool whole = u0 == T * G && u1 == (T + 1) * G;
    if (whole && wa == wb) continue;  // stored by its warp
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (mine_q) {
      for (int w = wa; w <= wb; ++w) {
        const int w0 = ub + run_begin(bn, kWarps, w);
        if (w0 == ub + run_begin(bn, kWarps, w + 1)) continue;  // an empty run
        const float* src = w0 <= T * G ? &part1[w][tok][r4] : &part0[w][tok][r4];
        const float4 v = *reinterpret_cast<const float4*>(src);
        sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
      }
    }
    if (whole) {
      if (mine_q) store_quad(p, tok, T * kRows + r4, sum);
      continue;
    }
    // Shared with other blocks c0..c1: this block's sum into its slot, then the last block sums
    // them all in block order.
    const int c0 = run_of(U, B, T * G), c1 = run_of(U, B, (T + 1) * G - 1);
    float* mine = p.partial + (static_cast<int64_t>(b) * kSlots + (u0 == T * G ? 1 : 0)) * kSlotFloats;
    if (mine_q) __stcg(reinterpret_cast<float4*>(mine + tok * kRows + r4), sum);
    __threadfence();  // the slot is visible before the count says so
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(p.counters + c0, 1) == c1 - c0;
    __syncthreads();
    if (!last) continue;
    __threadfence();
    if (mine_q) {
      float4 tot = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int c = c0; c <= c1; ++c) {
        const float* slot = p.partial + (static_cast<int64_t>(c) * kSlots + (c == c0 ? 1 : 0)) * kSlotFloats;
        const float4 v = __ldcg(reinterpret_cast<const float4*>(slot + tok * kRows + r4));
        tot.x += v.x, tot.y += v.y, tot.z += v.z, tot.w += v.w;
      }
      store_quad(p, tok, T * kRows + r4, tot);
    }
    if (threadIdx.x == 0) p.counters[c0] = 0;  // ready for the next launch
  }
}

// The bulk kernel's dynamic shared memory: every warp's ring of `stages` slots of `chunk` 2-KB units, then
// their barriers.
constexpr size_t bulk_smem_bytes(int stages, int chunk) {
  return static_cast<size_t>(kWarps) * static_cast<size_t>(stages) *
         (static_cast<size_t>(chunk) * kPackedUnitBytes + sizeof(uint64_t));
}

// The grid of a launch with `blocks` resident: at most one block a unit (16 rows x 128 bytes).
int launch_blocks(int blocks, int64_t N, int64_t row_bytes) {
  return static_cast<int>(std::min<int64_t>(blocks, (N + kRows - 1) / kRows * (row_bytes / kUnitBytes)));
}

// The launch on a given workspace (the emulated test passes host memory and any grid). FP8 on a packed
// weight with ring.stages > 0 runs the bulk kernel (its grid from the caller, sized for its shared memory).
template <bool kFp8>
void launch_stream(StreamParams k, int64_t K, int blocks, float* partial, int* counters, cudaStream_t st,
                   const BulkRing& ring = {}) {
  k.G = static_cast<int>(K * (kFp8 ? 1 : 2) / kUnitBytes);
  k.tiles = static_cast<int>((k.N + kRows - 1) / kRows);
  k.blocks = launch_blocks(blocks, k.N, k.row_bytes);
  k.partial = partial;
  k.counters = counters;
  const dim3 grid(static_cast<unsigned>(k.blocks));
  if constexpr (kFp8) {
    if (k.wp != nullptr && ring.stages > 0) {
      DFLASH_CHECK_HINT(ring.chunk >= 1, "gemm_fp8_stream: the bulk ring's slots need >= 1 unit, got " << ring.chunk,
                        "leave DFLASH_FP8_STREAM_CHUNK unset (default " << kDefaultBulkChunk << ")");
      DFLASH_REQUIRE_HINT(tuning::gemm_stream_fixup == 0,
                          "gemm_fp8_stream: the bulk ring (DFLASH_FP8_STREAM_STAGES=" << ring.stages
                                                                                  << ") has the block fix-up only, not DFLASH_STREAM_FIXUP's",
                          "unset DFLASH_STREAM_FIXUP or DFLASH_FP8_STREAM_STAGES");
      launch_kernel_pdl(gemm_stream_kernel<true, true>, grid, dim3(kThreads), bulk_smem_bytes(ring.stages, ring.chunk), st, k,
                        ring);
      return;
    }
  }
  if constexpr (kFp8) {
    // The register ring's depth (the same loads, math and sums in the same order: the same bits):
    // tuning::gemm_fp8_stream_depth, 2 by default (no spills; 3 none either, 4 spills; kernel_bench times all).
    // tuning::gemm_stream_fixup: the shared tiles' pieces summed by the block fix-up (0, default), by
    // the warp fix-up (2) or added into an f32 accumulate output with atomics (1: not deterministic, a
    // timing experiment: what a fix-up costs).
    const int depth = tuning::gemm_fp8_stream_depth, fix = tuning::gemm_stream_fixup;
    DFLASH_REQUIRE_HINT(depth >= 2 && depth <= kDepth, "gemm_fp8_stream: register ring depth " << depth << " is not built",
                        "set DFLASH_FP8_STREAM_DEPTH to 2, 3 or 4 (default " << kDefaultFp8RingDepth << ")");
    DFLASH_REQUIRE_HINT(fix >= 0 && fix <= 2,
                        "gemm_fp8_stream: DFLASH_STREAM_FIXUP='" << (std::getenv("DFLASH_STREAM_FIXUP") ? std::getenv("DFLASH_STREAM_FIXUP") : "")
                                                                     << "' is not a fix-up (tuning::gemm_stream_fixup " << fix << ")",
                        "set DFLASH_STREAM_FIXUP to block (default), warp or atomic");
    DFLASH_REQUIRE_HINT(fix != 1 || (k.y_f32 && k.accumulate),
                        "gemm_fp8_stream: the atomic fix-up (DFLASH_STREAM_FIXUP=atomic, a timing experiment) adds "
                        "into an f32 output (y_f32 with accumulate); this call writes "
                            << (k.y_f32 ? "f32 without accumulate" : "bf16"),
                        "unset DFLASH_STREAM_FIXUP, or set it to block or warp");
    using Kernel = void (*)(const StreamParams, const BulkRing);
    static const Kernel kKernels[3][3] = {
        {gemm_stream_kernel<true, false, 2, 0>, gemm_stream_kernel<true, false, 3, 0>, gemm_stream_kernel<true, false, 4, 0>},
        {gemm_stream_kernel<true, false, 2, 1>, gemm_stream_kernel<true, false, 3, 1>, gemm_stream_kernel<true, false, 4, 1>},
        {gemm_stream_kernel<true, false, 2, 2>, gemm_stream_kernel<true, false, 3, 2>, gemm_stream_kernel<true, false, 4, 2>}};
    launch_kernel_pdl(kKernels[fix][depth - 2], grid, dim3(kThreads), 0, st, k, BulkRing{});
    return;
  }
  // bf16 (no spills at depth 4): the block or the warp fix-up (atomics need an f32 output, which bf16 has not)
  const int fix = tuning::gemm_stream_fixup;
  DFLASH_REQUIRE_HINT(fix == 0 || fix == 2,
                      (fix == 1 ? "gemm_bf16_stream: the atomic fix-up (DFLASH_STREAM_FIXUP=atomic) adds into an f32 output, "
                                  "which the bf16 kernel does not write"
                                : "gemm_bf16_stream: DFLASH_STREAM_FIXUP is not block, warp or atomic"),
                      "set DFLASH_STREAM_FIXUP to block (default) or warp");
  launch_kernel_pdl(fix == 2 ? gemm_stream_kernel<false, false, kDepth, 2> : gemm_stream_kernel<false, false>, grid,
                    dim3(kThreads), 0, st, k, BulkRing{});
}

StreamParams fp8_params(const GemmFp8Params& p) {
  StreamParams k{};
  k.x = p.x;
  k.ldx_bytes = p.ldx;
  k.xs = p.x_scale;
  k.ldxs = fp8_act_scale_ld(p.M);
  k.w = p.w;
  k.wp = p.w_packed;
  k.row_bytes = p.K;
  k.ws = p.w_scale;
  k.ldws = fp8_weight_scale_ld(p.K);
  k.y = p.y;
  k.ldy = p.ldy;
  k.y_f32 = p.y_f32;
  k.accumulate = p.accumulate;
  k.M = static_cast<int>(p.M);
  k.N = static_cast<int>(p.N);
  return k;
}

StreamParams bf16_params(const GemmSkinnyParams& p) {
  StreamParams k{};
  k.x = static_cast<const uint8_t*>(p.x);
  k.ldx_bytes = 2 * p.ldx;
  k.w = static_cast<const uint8_t*>(p.w);
  k.row_bytes = 2 * p.K;
  k.y = p.y;
  k.ldy = p.ldy;
  k.M = static_cast<int>(p.M);
  k.N = static_cast<int>(p.N);
  return k;
}

#ifndef DFLASH_CUDA_EMULATION
__global__ void pack_kernel(const uint8_t* w, int64_t N, int64_t row_bytes, int64_t pieces, uint8_t* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= pieces) return;
  const int64_t src = packed_source(i, N, row_bytes);
  *reinterpret_cast<uint4*>(out + 16 * i) = src >= 0 ? *reinterpret_cast<const uint4*>(w + src) : make_uint4(0, 0, 0, 0);
}

// Per device: the blocks of the register-ring kernels resident at once (their grid; both have the same
// resources), the bulk kernel's for the last ring depth asked, and a workspace for the most blocks an SM
// can hold (kThreads-thread blocks).
struct Workspace {
  int sms = 0;
  int blocks = 0;
  int bulk_stages = 0, bulk_chunk = 0, bulk_blocks = 0;
  float* partial = nullptr;
  int* counters = nullptr;
};
constexpr int kMaxBlocksPerSm = 2048 / kThreads;

std::mutex& workspace_mutex() {
  static std::mutex mu;
  return mu;
}

Workspace& workspace_locked(int device, cudaStream_t st) {
  static std::array<Workspace, 64> spaces;
  DFLASH_CHECK(device >= 0 && device < static_cast<int>(spaces.size()), "gemm_stream: device " << device << " out of range");
  Workspace& w = spaces[static_cast<size_t>(device)];
  if (w.blocks > 0) return w;
  DeviceGuard scope(device);
  int sms = 0, per_sm = 1 << 30;
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  for (const auto kernel : {gemm_stream_kernel<true, false>, gemm_stream_kernel<false, false>}) {
    int n = 0;
    DFLASH_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0));
    per_sm = std::min(per_sm, n);
  }
  DFLASH_CHECK(per_sm > 0, "gemm_stream: the kernels do not fit an SM of device " << device);
  const int most = kMaxBlocksPerSm * sms;
  // Lives until exit, like the device context's cuBLASLt workspace (16 KB per block: the warp fix-up's slots).
  DFLASH_CUDA_CHECK(cudaMalloc(&w.partial, static_cast<size_t>(workspace_floats(most)) * sizeof(float)));
  DFLASH_CUDA_CHECK(cudaMalloc(&w.counters, static_cast<size_t>(workspace_counters(most)) * sizeof(int)));
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  DFLASH_CUDA_CHECK(cudaStreamIsCapturing(st, &cap));
  if (cap == cudaStreamCaptureStatusNone) {
    DFLASH_CUDA_CHECK(cudaMemset(w.counters, 0, static_cast<size_t>(workspace_counters(most)) * sizeof(int)));
  } else {  // first used inside a capture: the graph zeroes them before its kernels, at every replay
    DFLASH_CUDA_CHECK(cudaMemsetAsync(w.counters, 0, static_cast<size_t>(workspace_counters(most)) * sizeof(int), st));
  }
  w.sms = sms;
  w.blocks = per_sm * sms;
  return w;
}

const Workspace& workspace(int device, cudaStream_t st) {
  std::lock_guard<std::mutex> lock(workspace_mutex());
  return workspace_locked(device, st);
}

// The workspace with the bulk kernel's grid for its ring (its shared memory opted in).
const Workspace& bulk_workspace(int device, cudaStream_t st, int stages, int chunk) {
  std::lock_guard<std::mutex> lock(workspace_mutex());
  Workspace& w = workspace_locked(device, st);
  if (w.bulk_stages == stages && w.bulk_chunk == chunk) return w;
  DeviceGuard scope(device);
  const auto kernel = gemm_stream_kernel<true, true>;
  const size_t smem = bulk_smem_bytes(stages, chunk);
  int n = 0, optin = 0;
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attr{};
  DFLASH_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  if (smem + attr.sharedSizeBytes <= static_cast<size_t>(optin)) {
    DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    DFLASH_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem));
  }
  DFLASH_CHECK_HINT(n > 0, "gemm_fp8_stream: a ring of " << stages << " slots of " << chunk << " units a warp ("
                                                         << smem << " bytes of shared memory a block beside "
                                                         << attr.sharedSizeBytes << " static) does not fit an SM of device "
                                                         << device,
                    "set DFLASH_FP8_STREAM_STAGES / DFLASH_FP8_STREAM_CHUNK lower (defaults " << kDefaultBulkStages << " / "
                                                                                               << kDefaultBulkChunk << ")");
  w.bulk_stages = stages;
  w.bulk_chunk = chunk;
  w.bulk_blocks = std::min(n, kMaxBlocksPerSm) * w.sms;
  return w;
}

// What gemm_fp8_stream launches for p: the bulk ring on a packed weight where tuning asks for one (its
// blocks resident for the ring's shared memory), else the register ring on the register kernels' blocks.
struct Fp8Launch {
  BulkRing ring;
  const Workspace* w = nullptr;
  int blocks = 0;  // resident (launch_blocks caps them at the units)
};
Fp8Launch fp8_launch(const GemmFp8Params& p, int device, cudaStream_t st) {
  Fp8Launch l;
  if (p.w_packed != nullptr && tuning::gemm_fp8_stream_stages > 0) {
    l.ring.stages = tuning::gemm_fp8_stream_stages;
    l.ring.chunk = tuning::gemm_fp8_stream_chunk;
    l.ring.evict_first = tuning::gemm_fp8_stream_evict_first != 0;
    l.w = &bulk_workspace(device, st, l.ring.stages, l.ring.chunk);
    l.blocks = l.w->bulk_blocks;
  } else {
    l.w = &workspace(device, st);
    l.blocks = l.w->blocks;
  }
  return l;
}
#endif

}  // namespace

int64_t stream_packed_bytes(int64_t N, int64_t row_bytes) { return (N + kRows - 1) / kRows * kRows * row_bytes; }

#ifndef DFLASH_CUDA_EMULATION
void pack_stream_weight(const void* w, int64_t N, int64_t row_bytes, void* packed, Stream s) {
  DFLASH_CHECK(N >= 1 && row_bytes >= kUnitBytes && row_bytes % kUnitBytes == 0,
               "pack_stream_weight: needs N >= 1 rows of a multiple of " << kUnitBytes << " bytes, got N=" << N
                                                                         << " row_bytes=" << row_bytes);
  DFLASH_CHECK(w && packed && reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(packed) % 16 == 0,
               "pack_stream_weight: w and packed must be non-null and 16-byte aligned (w=" << w << " packed=" << packed << ")");
  const int64_t pieces = stream_packed_bytes(N, row_bytes) / 16;
  pack_kernel<<<static_cast<unsigned>((pieces + 255) / 256), 256, 0, static_cast<cudaStream_t>(s)>>>(
      static_cast<const uint8_t*>(w), N, row_bytes, pieces, static_cast<uint8_t*>(packed));
  DFLASH_CUDA_CHECK_LAST();
}
#endif

bool gemm_fp8_stream_supported(const GemmFp8Params& p) {
  return !p.tensor_scales && !p.w_vec_scales && (p.y_f32 || !p.accumulate) && p.M >= 1 && p.M <= 16 && p.K % 128 == 0 &&
         p.N >= 1 && p.N * p.K < (int64_t{1} << 40) && p.K < (int64_t{1} << 30) && p.N < (int64_t{1} << 30);
}

bool gemm_bf16_stream_supported(const GemmSkinnyParams& p) {
  return !p.swiglu && p.M >= 1 && p.M <= 16 && p.K % 128 == 0 && p.N >= 1 && p.N % 8 == 0 && p.ldx >= p.K &&
         p.ldx % 8 == 0 && p.ldy >= p.N && p.ldy % 8 == 0 && p.N * p.K < (int64_t{1} << 40) &&
         p.K < (int64_t{1} << 30) && p.N < (int64_t{1} << 30);
}

#ifndef DFLASH_CUDA_EMULATION
void gemm_fp8_stream(const GemmFp8Params& p, int device, Stream s) {
  DFLASH_CHECK_HINT(gemm_fp8_stream_supported(p),
                    "gemm_fp8_stream: the streaming FP8 GEMM needs block scales, 1 <= M <= 16 and K a multiple "
                    "of 128, got M=" << p.M << " N=" << p.N << " K=" << p.K
                                     << (p.tensor_scales ? " (tensor scales)" : ""),
                    "run gemm_fp8 (cuBLASLt) for other shapes; checkpoints' FP8 projections have K a multiple of 128");
  DFLASH_CHECK(p.x != nullptr && p.w != nullptr && p.y != nullptr && p.x_scale != nullptr && p.w_scale != nullptr,
               "gemm_fp8_stream: null pointer for M=" << p.M << " N=" << p.N << " K=" << p.K);
  DFLASH_CHECK(reinterpret_cast<uintptr_t>(p.w_packed) % 16 == 0,
               "gemm_fp8_stream: the packed weight must be 16-byte aligned, got " << static_cast<const void*>(p.w_packed));
  DFLASH_CHECK(p.ldx >= p.K && p.ldx % 16 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.w) % 16 == 0 && reinterpret_cast<uintptr_t>(p.y) % (p.y_f32 ? 16 : 8) == 0 &&
                   p.ldy >= p.N && p.ldy % 4 == 0,
               "gemm_fp8_stream: needs 16-byte aligned codes with ldx a multiple of 16 (>= K), an 8-byte aligned y "
               "(16 for an f32 y) and ldy a multiple of 4 (>= N), got ldx="
                   << p.ldx << " ldy=" << p.ldy << " K=" << p.K << " N=" << p.N);
  DeviceGuard scope(device);
  const auto st = static_cast<cudaStream_t>(s);
  const Fp8Launch l = fp8_launch(p, device, st);
  launch_stream<true>(fp8_params(p), p.K, l.blocks, l.w->partial, l.w->counters, st, l.ring);
}

int gemm_fp8_stream_grid(const GemmFp8Params& p, int device, Stream s) {
  DeviceGuard scope(device);
  return launch_blocks(fp8_launch(p, device, static_cast<cudaStream_t>(s)).blocks, p.N, p.K);
}

void gemm_bf16_stream(const GemmSkinnyParams& p, int device, Stream s) {
  DFLASH_CHECK_HINT(gemm_bf16_stream_supported(p),
                    "gemm_bf16_stream: the stream-K skinny GEMM needs 1 <= M <= 16, K a multiple of 128, N, ldx and "
                    "ldy multiples of 8 and no SwiGLU prologue, got M=" << p.M << " N=" << p.N << " K=" << p.K
                                                                        << " ldx=" << p.ldx << " ldy=" << p.ldy
                                                                        << (p.swiglu ? " swiglu" : ""),
                    "gemm_skinny's cluster kernel takes the other decode shapes");
  const auto aligned16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  DFLASH_CHECK(p.x && p.w && p.y && aligned16(p.x) && aligned16(p.w) && aligned16(p.y),
               "gemm_bf16_stream: x, w and y must be non-null and 16-byte aligned (x=" << p.x << " w=" << p.w
                                                                                       << " y=" << p.y << ")");
  DeviceGuard scope(device);
  const auto st = static_cast<cudaStream_t>(s);
  const Workspace& w = workspace(device, st);
  launch_stream<false>(bf16_params(p), p.K, w.blocks, w.partial, w.counters, st);
}
#endif

const char* gemm_fp8_stream_kernel_name() { return "dflash e4m3 stream-K (mma m16n8k32, M <= 16, one wave)"; }

}  // namespace dflash::cuda
