// The expert GEMMs of a decode / verify step on a balanced one-wave grid (moe.h, moe_grouped_gemm_stream;
// issue 33): the grouped GEMM's arithmetic (gate|up with the row gather and SwiGLU fused, or down; the
// shared expert as MoeGemmParams' extra group) for calls where every expert holds <= 16 rows (a step of
// N <= 16 tokens: one MMA token tile an expert), laid out as gemm_stream.cu's stream-K kernel lays out a
// dense skinny GEMM. CPU reference: ops::moe_experts (and ops::linear / swiglu for the extra group).
//
// Why: the 16-row deep blocks (moe.cu) give a one-token call 0.6 waves of 160 blocks on an H100 (the SMs
// busy 55% of the kernel, ~1.6 TB/s: bench/results/h100-moe8-7ba8105); the dense stream-K kernel keeps
// every resident warp streaming to the end. Roofline at Qwen3.6-35B-A3B shapes (H 2048, I = Is 512, k 8),
// one token: gate|up 9 x 4 MB (8 experts + the shared one), down 9 x 2 MB, 37.7 MB a block's two calls,
// 14.5 us at 2.6 TB/s against ~24 at deep16's ~1.6.
//
// Work items: (group, tile, piece), group-major: a group is an active routed expert (the tile table's
// row tile g, tile_offsets[e] == g) or the extra group (last); a tile 64 weight rows (with SwiGLU 32 gate
// rows and the 32 up rows of the same act columns, moe_detail::weight_row); a piece a fixed run of the K
// columns: P = ceil(K / piece_cols) pieces of piece_cols = ceil(ceil(K / 128) / kPieces) · 128 columns
// (kPieces: tuning::moe_streamk_pieces, 8 by default: at K 2048 8 pieces of 256 columns, at K 512 4 of
// 128). U = (active experts + extra) · T · P items, T = ceil(Nout / 32) (SwiGLU) or ceil(Nout / 64).
// Every warp of the grid (all resident blocks, 4 warps each) takes an equal contiguous run of the items
// ([U w / W, U (w + 1) / W)) and streams their weights through one cp.async ring of kStages steps of 64
// bytes x 64 rows (gemm_stream.cu's ring: 16 bytes a lane and copy, each lane reading back only what it
// copied, so no barrier), continuously across item boundaries, with its tokens' x units (the gathered
// rows g, g + 8 of the group), and runs skinny_mma.cuh's step (weight rows as the MMA's M, tokens as its
// N). An item is never split: a warp sums a piece's k steps alone, in k order.
//
// Bits. The pieces are fixed by K (and the knob), the tiles by Nout: neither depends on N, on which
// experts are active or on the grid. A piece's f32 partial rows go to a per-device workspace indexed by
// the group's rows (the permuted row pos, the extra group's rows after offsets[E]: [rows][T][P][64]
// floats), then a counter per (group, tile) (at its first row) counts the pieces; the warp that brings
// the last one sums the P partials in piece order (from 0, its own from registers), applies SwiGLU (as
// the grouped kernel: silu(g) · u in f32, one bf16 rounding) or not, stores the bf16 rows and sets the
// counter back to zero, so the next launch (or graph replay) starts clean. With P = 1 the warp stores
// its piece directly. So a token row's outputs depend on its own x row and the weights alone: the same
// bits at N = 1 and N = 16 (decode == verify), on any grid, run after run. They are not the deep16
// tiling's bits (that kernel sums all of K in one MMA chain, in another k order inside a 64-byte step);
// the two agree to f32 rounding.
//
// PDL (pdl.cuh): with MoeGemmParams::routing_settled (moe_block's down GEMM) a warp finds its items and
// issues its first kStages - 1 steps' weight copies before the wait; otherwise (the gate|up GEMM: the
// routing is the previous kernel's) it waits first. The workspace is touched only after the wait (the
// previous kernel, which may be this kernel's other call, has completed by then). Dependents are
// signalled after the wait, as every kernel of the MoE block does.
//
// Only bf16 weights (FP8 codes keep the 16-row deep blocks). One workspace per device, used by one stream
// at a time (as gemm_stream.cu's). Off by default (tuning::moe_streamk): it loses to the 16-row deep blocks
// (H200: the one-token block 0.078 against 0.043 ms, bench/results/h200-fp8head-5d8af27); tests/test_moe_emulated.cpp runs it on the CPU,
// test_cuda_moe's CudaMoe.StreamK* on the device, its Bench35bA3b rows /streamk, /streamk_p16 time it.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <mutex>
#include <vector>

#include "core/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/emulatable.cuh"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/moe_topk.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/skinny_mma.cuh"

namespace dflash::cuda {

namespace tuning {
int moe_streamk = -1;
int moe_streamk_blocks = 0;
int moe_streamk_pieces = kMoeStreamkPieces;
}  // namespace tuning

namespace {
namespace streamk {  // (own names: the emulated test includes this file beside moe.cu)

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTiles = 4;            // m16 tiles of weight rows a warp: an item's 64 rows
constexpr int kRows = 16 * kTiles;
constexpr int kStepCols = 32;        // bf16 columns (64 bytes) of a weight row a step
constexpr int kGroupCols = 128;      // a piece is a whole number of these
constexpr int kStages = 4;           // ring depth (steps) a warp
constexpr int kWUnits = 2 * kTiles;  // 16-byte weight units a lane and step (rows g, g + 8 of each tile)
constexpr int kUnits = kWUnits + 2;  // and the x units of tokens g, g + 8
constexpr size_t kWarpRing = static_cast<size_t>(kStages) * kUnits * 32;  // uint4s
constexpr size_t kRingBytes = kWarps * kWarpRing * 16;                    // 80 KB

struct Args {
  MoeGemmParams p;
  int T = 0;           // tiles a group
  int P = 0;           // pieces a tile
  int piece_cols = 0;  // columns a piece (a multiple of kGroupCols)
  float* partial = nullptr;  // [rows][T][P][kRows]: rows = p.rows + the extra group's rows
  int* counters = nullptr;   // [rows][T], zero between launches
};

// One item of a warp's run (warp-uniform): where its weights, token rows and outputs are.
struct Item {
  const unsigned char* w = nullptr;  // the group's weight matrix, bf16 [rows, K]
  const bf16* xp[2] = {nullptr, nullptr};  // this lane's token rows g, g + 8, at its 8 columns of a step
  bool xv[2] = {false, false};
  bf16* y = nullptr;
  int y_row0 = 0;   // output row of the group's token j: y_row0 + j
  int ws_row0 = 0;  // workspace row of token j: ws_row0 + j
  int rows = 0, tile = 0, piece = 0, k0 = 0, steps = 0;
};

// Item u (every lane of the warp calls it: a warp collective). A routed group's expert is the one whose
// single row tile is the group index (every expert holds <= 16 rows, so at most one tile).
__device__ __forceinline__ Item item_of(const Args& a, int64_t u, int lane) {
  const MoeGemmParams& p = a.p;
  const int64_t per_group = static_cast<int64_t>(a.T) * a.P;
  const int gi = static_cast<int>(u / per_group), rem = static_cast<int>(u - gi * per_group);
  const int E = static_cast<int>(p.E), K = static_cast<int>(p.K);
  Item it;
  it.tile = rem / a.P;
  it.piece = rem - it.tile * a.P;
  it.k0 = it.piece * a.piece_cols;
  const int cols = K - it.k0 < a.piece_cols ? K - it.k0 : a.piece_cols;
  it.steps = (cols + kStepCols - 1) / kStepCols;
  int row0 = 0;
  const bf16* x;
  const int32_t* src = nullptr;
  if (gi < p.tile_offsets[E]) {
    int cand = INT_MAX;
#pragma unroll 4
    for (int i = lane; i < E; i += 32)
      if (p.tile_offsets[i] == gi && p.tile_offsets[i + 1] > gi) cand = i;  // exactly one expert
    const int e = moe_detail::warp_reduce_extreme<false>(cand);
    row0 = p.offsets[e];
    const int n = p.offsets[e + 1] - row0;
    it.rows = n < 16 ? n : 16;  // (<= 16: MoeGemmParams::max_expert_rows, the caller's word)
    it.w = static_cast<const unsigned char*>(p.w) + static_cast<int64_t>(e) * (p.swiglu ? 2 : 1) * p.Nout * p.K * 2;
    x = static_cast<const bf16*>(p.x);
    src = p.src_row;
    it.y = static_cast<bf16*>(p.y);
    it.y_row0 = it.ws_row0 = row0;
  } else {  // the extra group: rows [0, extra_rows) of extra_x, no gather
    it.rows = p.extra_rows < 16 ? static_cast<int>(p.extra_rows) : 16;
    it.w = static_cast<const unsigned char*>(p.extra_w);
    x = static_cast<const bf16*>(p.extra_x);
    it.y = static_cast<bf16*>(p.extra_y);
    it.ws_row0 = p.offsets[E];
  }
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = g + 8 * h;
    it.xv[h] = j < it.rows;
    const int xr = it.xv[h] ? (src ? src[row0 + j] : row0 + j) : 0;
    it.xp[h] = x + static_cast<int64_t>(xr) * p.ldx + 8 * t;
  }
  return it;
}

// Step s of item it: the lane's 8 weight units (rows 8j + g of the tile, its 16 bytes of the step) and
// x units into one ring slot (16-byte copies, zero-filled past K or past the weight rows).
__device__ __forceinline__ void issue_w(const Args& a, const Item& it, int s, int lane, uint4* slot) {
  const int g = lane >> 2, kk = it.k0 + s * kStepCols + 8 * (lane & 3);
  const bool kin = kk < a.p.K;
  const int col0 = it.tile * (a.p.swiglu ? kRows / 2 : kRows);
#pragma unroll
  for (int j = 0; j < kWUnits; ++j) {
    bool ok;
    const int wr = moe_detail::weight_row(a.p, 8 * j + g, col0, kRows, ok);
    const bool v = ok && kin;
    ptx::cp_async16_l2_256(slot + j * 32, v ? it.w + (static_cast<int64_t>(wr) * a.p.K + kk) * 2 : it.w, v);
  }
}
__device__ __forceinline__ void issue_x(const Args& a, const Item& it, int s, int lane, uint4* slot) {
  const int off = it.k0 + s * kStepCols, kk = off + 8 * (lane & 3);
  const bool kin = kk < a.p.K;
  ptx::cp_async16_l2_256(slot + kWUnits * 32, it.xp[0] + (it.xv[0] && kin ? off : 0), it.xv[0] && kin);
  if (it.rows > 8) ptx::cp_async16_l2_256(slot + (kWUnits + 1) * 32, it.xp[1] + (it.xv[1] && kin ? off : 0), it.xv[1] && kin);
}

using Acc = float[kTiles][2][4];  // skinny_mma.cuh's C fragments of the item's 4 tiles

// f(i, hf, c, token, tile row) for each of the lane's C fragment elements acc[i][hf][c] (unrolled: the
// indices are constants, the fragments stay in registers).
template <class F>
__device__ __forceinline__ void each_element(int lane, F&& f) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int c = 0; c < 4; ++c) f(i, hf, c, skinny::c_token(hf, c, lane & 3), skinny::c_row(i, c, lane >> 2));
}

// The bf16 outputs of a whole tile from its sums v: SwiGLU of the gate tiles 0, 1 and the up tiles 2, 3
// (the same act columns), or the 64 output columns.
__device__ __forceinline__ void store_tile(const MoeGemmParams& p, const Item& it, const Acc& v, int lane) {
  const int Nout = static_cast<int>(p.Nout), col0 = it.tile * (p.swiglu ? kRows / 2 : kRows);
  each_element(lane, [&](int i, int hf, int c, int tok, int row) {
    if ((p.swiglu && i >= kTiles / 2) || tok >= it.rows || col0 + row >= Nout) return;
    const float out = p.swiglu ? moe_detail::silu_expf(v[i][hf][c]) * v[i + kTiles / 2][hf][c] : v[i][hf][c];
    it.y[static_cast<int64_t>(it.y_row0 + tok) * p.ldy + col0 + row] = __float2bfloat16(out);
  });
}

// The end of an item: its tile stored (one piece), or its partial left in the workspace and, by the warp
// that brings the tile's last piece, the pieces summed in piece order and stored.
__device__ __forceinline__ void finish(const Args& a, const Item& it, const Acc& acc, int lane) {
  if (a.P == 1) return store_tile(a.p, it, acc, lane);
  auto at = [&](int tok, int q, int r) {
    return a.partial + ((static_cast<int64_t>(it.ws_row0 + tok) * a.T + it.tile) * a.P + q) * kRows + r;
  };
  each_element(lane, [&](int i, int hf, int c, int tok, int row) {
    if (tok < it.rows) __stcg(at(tok, it.piece, row), acc[i][hf][c]);
  });
  __threadfence();  // the partial is visible before the count says so
  __syncwarp();
  int* counter = a.counters + static_cast<int64_t>(it.ws_row0) * a.T + it.tile;
  const bool mine = lane == 0 && atomicAdd(counter, 1) == a.P - 1;
  if (__ballot_sync(0xffffffffu, mine) == 0) return;
  __threadfence();
  Acc tot;
  skinny::zero(tot);
  for (int q = 0; q < a.P; ++q)
    each_element(lane, [&](int i, int hf, int c, int tok, int row) {
      if (tok < it.rows) tot[i][hf][c] += q == it.piece ? acc[i][hf][c] : __ldcg(at(tok, q, row));
    });
  store_tile(a.p, it, tot, lane);
  if (lane == 0) *counter = 0;  // ready for the next launch
}

__global__ void __launch_bounds__(kThreads, 2) moe_stream_kernel(const Args a) {
  DFLASH_DYNAMIC_SMEM(uint4, ring);  // [kWarps][kStages][kUnits][32 lanes]
  const MoeGemmParams& p = a.p;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const bool early = p.routing_settled;  // the tile table was written two launches back
  if (!early) pdl_wait();
  const int64_t groups = p.tile_offsets[p.E] + (p.extra_w && p.extra_rows > 0 ? 1 : 0);
  const int64_t U = groups * a.T * a.P, W = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t wi = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  const int64_t u0 = U * wi / W, u1 = U * (wi + 1) / W;
  if (u0 == u1) {  // (no block barrier in this kernel: a warp with no items leaves)
    if (early) pdl_wait();
    pdl_launch_dependents();
    return;
  }
  uint4* my = ring + static_cast<size_t>(warp) * kWarpRing + lane;
  auto slot = [&](int q) { return my + static_cast<size_t>(q % kStages) * kUnits * 32; };
  // Cursors over the run's steps: item u, its step s (it: item u's operands).
  auto advance = [&](Item& it, int64_t& u, int& s) {
    if (++s < it.steps) return;
    s = 0;
    if (++u < u1) it = item_of(a, u, lane);
  };
  const Item first = item_of(a, u0, lane);
  Item iss = first;  // the issue cursor, kStages - 1 steps ahead of the compute cursor
  int64_t iu = u0;
  int is = 0;
  // Prologue: the first kStages - 1 steps, one commit group each (empty past the run, so the counts stay
  // fixed); with a settled tile table their weights before the wait (in the first group).
  if (early) {
    Item pre = first;
    int64_t pu = u0;
    int ps = 0;
#pragma unroll
    for (int q = 0; q < kStages - 1; ++q)
      if (pu < u1) {
        issue_w(a, pre, ps, lane, slot(q));
        advance(pre, pu, ps);
      }
    pdl_wait();
  }
  pdl_launch_dependents();
#pragma unroll
  for (int q = 0; q < kStages - 1; ++q) {
    if (iu < u1) {
      if (!early) issue_w(a, iss, is, lane, slot(q));
      issue_x(a, iss, is, lane, slot(q));
      advance(iss, iu, is);
    }
    ptx::cp_async_commit_ring();
  }
  Item cur = first;  // the compute cursor
  int64_t cu = u0;
  int cs = 0;
  Acc acc;
  skinny::zero(acc);
  for (int vs = 0; cu < u1; ++vs) {
    ptx::cp_async_wait_ring<kStages - 2>();  // step vs has landed (this lane's copies)
    const uint4* sl = slot(vs);
    uint4 wv[kWUnits];
#pragma unroll
    for (int j = 0; j < kWUnits; ++j) wv[j] = sl[j * 32];
    const bool two = cur.rows > 8;
    const uint4 xa0 = sl[kWUnits * 32];
    const uint4 xa1 = two ? sl[(kWUnits + 1) * 32] : make_uint4(0, 0, 0, 0);
    // Refill the slot consumed last step with step vs + kStages - 1.
    if (iu < u1) {
      issue_w(a, iss, is, lane, slot(vs + kStages - 1));
      issue_x(a, iss, is, lane, slot(vs + kStages - 1));
      advance(iss, iu, is);
    }
    ptx::cp_async_commit_ring();
    skinny::step_mmas<false, kTiles>(wv, xa0, xa1, two, acc);
    if (++cs < cur.steps) continue;
    finish(a, cur, acc, lane);
    skinny::zero(acc);
    cs = 0;
    if (++cu < u1) cur = item_of(a, cu, lane);
  }
  ptx::cp_async_wait_ring<0>();
}

// A call's shape: tiles a group, pieces a tile and their columns, workspace rows and the most items.
struct Shape {
  int T = 0, P = 0, piece_cols = 0;
  int64_t rows = 0, items = 0;
  size_t partial_floats() const { return static_cast<size_t>(rows) * T * P * kRows; }
  size_t counter_ints() const { return static_cast<size_t>(rows) * T; }
};
Shape shape_of(const MoeGemmParams& p) {
  Shape s;
  const int64_t groups_k = (p.K + kGroupCols - 1) / kGroupCols, pieces = std::max(1, tuning::moe_streamk_pieces);
  s.piece_cols = static_cast<int>((groups_k + pieces - 1) / pieces * kGroupCols);
  s.P = static_cast<int>((p.K + s.piece_cols - 1) / s.piece_cols);
  s.T = static_cast<int>(p.swiglu ? (p.Nout + kRows / 2 - 1) / (kRows / 2) : (p.Nout + kRows - 1) / kRows);
  const bool extra = p.extra_w && p.extra_rows > 0;
  s.rows = p.rows + (extra ? p.extra_rows : 0);
  s.items = (std::min(p.E, p.rows) + (extra ? 1 : 0)) * s.T * s.P;
  return s;
}

// The launch on a given workspace and grid (the emulated test passes host memory and any grid): at most
// one block per 4 items of the call's bound.
void launch(const MoeGemmParams& p, int blocks, float* partial, int* counters, cudaStream_t st) {
  const Shape s = shape_of(p);
  Args a;
  a.p = p;
  a.T = s.T;
  a.P = s.P;
  a.piece_cols = s.piece_cols;
  a.partial = partial;
  a.counters = counters;
  const int64_t grid = std::min<int64_t>(blocks, (s.items + kWarps - 1) / kWarps);
  if (grid <= 0) return;
  launch_kernel_pdl(moe_stream_kernel, dim3(static_cast<unsigned>(grid)), dim3(kThreads), kRingBytes, st, a);
}

// Per device: the blocks resident at once (the grid) and the workspace, grown to the largest call seen.
// A grown workspace's old buffers are kept (a CUDA graph captured before may still use them).
struct Workspace {
  int blocks = 0;
  size_t partial_floats = 0, counter_ints = 0;
  float* partial = nullptr;
  int* counters = nullptr;
#ifdef DFLASH_CUDA_EMULATION
  std::vector<float> host_partial;
  std::vector<int> host_counters;
#endif
};

Workspace& workspace(const Shape& s) {
  static std::mutex mu;
  static std::array<Workspace, 64> spaces;
  int device = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&device));
  DFLASH_CHECK(device >= 0 && device < static_cast<int>(spaces.size()), "moe_grouped_gemm_stream: device " << device << " out of range");
  std::lock_guard<std::mutex> lock(mu);
  Workspace& w = spaces[static_cast<size_t>(device)];
#ifdef DFLASH_CUDA_EMULATION  // (host memory; a few blocks unless the knob says)
  w.blocks = 3;
  if (w.host_partial.size() < s.partial_floats()) w.host_partial.resize(s.partial_floats());
  if (w.host_counters.size() < s.counter_ints()) w.host_counters.resize(s.counter_ints(), 0);
  w.partial = w.host_partial.data();
  w.counters = w.host_counters.data();
#else
  // cudaMalloc (and the synchronization below) are unsafe calls inside a stream capture unless the
  // thread's mode is relaxed: the allocation is the workspace's, not the graph's.
  struct Relaxed {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    Relaxed() { DFLASH_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode)); }
    ~Relaxed() { cudaThreadExchangeStreamCaptureMode(&mode); }
  };
  if (w.blocks == 0) {
    const Relaxed relaxed;
    DeviceGuard scope(device);
    int sms = 0, per_sm = 0;
    DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    DFLASH_CUDA_CHECK(cudaFuncSetAttribute(moe_stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kRingBytes)));
    DFLASH_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, moe_stream_kernel, kThreads, kRingBytes));
    DFLASH_CHECK(per_sm > 0, "moe_grouped_gemm_stream: the kernel does not fit an SM of device " << device);
    w.blocks = per_sm * sms;
  }
  if (w.partial_floats < s.partial_floats() || w.counter_ints < s.counter_ints()) {
    const Relaxed relaxed;
    DeviceGuard scope(device);
    const size_t pf = std::max(s.partial_floats(), 2 * w.partial_floats), ci = std::max(s.counter_ints(), 2 * w.counter_ints);
    // Lives until exit, like gemm_stream.cu's workspace (4.7 MB for a 16-token step at 35B-A3B shapes).
    DFLASH_CUDA_CHECK(cudaMalloc(&w.partial, pf * sizeof(float)));
    DFLASH_CUDA_CHECK(cudaMalloc(&w.counters, ci * sizeof(int)));
    // Zeroed now, on a stream of its own (the call's may be capturing: a graph node would zero them only
    // at its replays, and an eager call before the first replay would find garbage); the kernels leave
    // them zero.
    cudaStream_t side = nullptr;
    DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    DFLASH_CUDA_CHECK(cudaMemsetAsync(w.counters, 0, ci * sizeof(int), side));
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(side));
    DFLASH_CUDA_CHECK(cudaStreamDestroy(side));
    w.partial_floats = pf;
    w.counter_ints = ci;
  }
#endif
  return w;
}

}  // namespace streamk
}  // namespace

bool moe_streamk_supported(const MoeGemmParams& p) {
  return !p.w_scale && p.rows >= 0 && p.max_expert_rows >= 1 && p.max_expert_rows <= 16 &&
         (!p.extra_w || p.extra_rows <= 16) && p.K % 8 == 0 && p.Nout >= 1 && p.rows < (int64_t{1} << 24) &&
         p.K < (int64_t{1} << 30) && p.Nout < (int64_t{1} << 30);
}

bool moe_streamk(const MoeGemmParams& p) { return tuning::moe_streamk == 1 && moe_streamk_supported(p); }

void moe_grouped_gemm_stream(const MoeGemmParams& p, Stream s) {
  DFLASH_CHECK_HINT(moe_streamk_supported(p),
                    "moe_grouped_gemm_stream: needs bf16 weights, the routed rows known (rows " << p.rows
                        << "), every expert and the extra group <= 16 rows (max_expert_rows " << p.max_expert_rows
                        << ", extra_rows " << p.extra_rows << ") and K " << p.K << " a multiple of 8",
                    "moe_grouped_gemm takes the other calls (the 16-row deep blocks for FP8 codes)");
  const auto aligned16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  DFLASH_CHECK(p.x && p.w && p.y && p.offsets && p.tile_offsets && aligned16(p.x) && aligned16(p.w) && p.ldx % 8 == 0 &&
                   (!p.extra_w || (p.extra_x && p.extra_y && aligned16(p.extra_x) && aligned16(p.extra_w))),
               "moe_grouped_gemm_stream: null or not 16-byte aligned x / w / extra_x / extra_w, ldx " << p.ldx
                                                                                                       << " (a multiple of 8)");
  const streamk::Shape sh = streamk::shape_of(p);
  if (sh.items == 0) return;
  const auto st = static_cast<cudaStream_t>(s);
  streamk::Workspace& w = streamk::workspace(sh);
  streamk::launch(p, tuning::moe_streamk_blocks > 0 ? tuning::moe_streamk_blocks : w.blocks, w.partial, w.counters, st);
}

}  // namespace dflash::cuda
