// GatedDeltaNet pre-core kernels: the causal depthwise conv over the concatenated [q | k | v]
// channels (fast and fallback), and gdn_prep (q/k L2 normalisation + the g / beta gates).
//
// Roofline, causal_conv1d at the Qwen3.6-27B shape (C = 10240 = q 2048 | k 2048 | v 6144, K = 4):
//   bytes = N·C·2 (read x once) + N·C·2 (write y) (+ the K-1 halo rows per run of R tokens, which
//   the neighbouring run has just pulled into L2, so they cost L2 and not DRAM bandwidth);
//   FLOPs = 2·K·N·C (+ SiLU), ~0.3 FLOP/byte: memory-bound. At N = 8192 that is 335 MB, ~0.08 ms at
//   4.2 TB/s.
//   Measured on an H200 (N = 8192, C = 10240, K = 4, x a strided view with ldx = 16480): 0.107 ms
//   (3.15 TB/s) at the automatic R = 160; 0.121 ms in the forward (2.78 TB/s: the previous ops leave
//   dirty lines in L2 to write back). A device-to-device copy of the same bytes takes 0.085 ms
//   (3.93 TB/s); the fallback 0.62 ms. The previous kernel (8-row register batches, R = 64: 640
//   blocks in 2.4 waves) took 0.116 ms alone, 0.131 in the forward; the same at R = 160, 0.109.
//   What is left (estimated): the warps' instruction issue (~90 instructions per 16-byte row,
//   ~45% of the issue slots at this rate) and the mixed read/write stream; 3 blocks per SM
//   (registers capped at 80, a few spilled) measured slower (0.132 ms).
// Roofline, gdn_prep: reads N·2·Hk·dk·2 bytes of q/k and writes as many, plus 2·N·Hv·2 in and
//   2·N·Hv·4 out for the gates: at N = 8192, Hk = 16, dk = 128, Hv = 48 that is 139 MB, ~0.035 ms.
//   Measured on an H200: 0.044 ms alone (3.1 TB/s), 0.051 ms in the forward (2.7 TB/s); the
//   previous kernel (a warp per 128-element row, 16 lanes busy, two passes) took 0.090 / 0.112 ms.
//
// Fast conv design: each thread owns 8 consecutive channels (one 16-byte bf16 load per token row)
// and a run of R consecutive tokens (chosen by the launcher so the blocks fill one wave or a whole
// number of them). The last K-1 inputs stay in registers as a sliding window (fp32), so every
// element is read once plus K-1 halo rows per run; the 8·K weights sit in registers; SiLU is fused.
// The rows stream through a per-thread ring of kConvStages 16-byte slots in shared memory
// (cp.async; each thread reads only the slots it filled itself, so no block barrier): the slot of
// row t is read, the row computed and stored, then the slot refilled with row t + kConvStages, so
// kConvStages loads are in flight at every step. (A ring in registers measured slower, 0.138 ms,
// probably because refilling a register as it is consumed waits on shared load scoreboards.)
// Runs are laid on the global token axis; a run that crosses a sequence boundary resets its window
// to zeros at the boundary (so no value ever leaks across sequences), and its first halo rows are
// taken only from the sequence that holds its first token (a binary search in cu_seqlens, once per
// thread). This needs no host-side run table, so the launcher never reads cu_seqlens.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda/check.h"
#include "kernels/cuda/grid.h"
#include "kernels/cuda/conv.h"
#include "kernels/cuda/conv_tile.cuh"
#include "kernels/cuda/gdn.h"
#include "kernels/cuda/ptx.cuh"
#include "core/error.h"
#include "core/device.h"

namespace dflash::cuda {

// Tuning knob for benchmarks/tests only: tokens per thread of the fast conv (0 = automatic).
namespace tuning {
int conv_tokens_per_thread = 0;
int prep_blocks = 0;  // blocks of gdn_prep's persistent grid (0 = as many as fit on the GPU at once)
}

namespace {

using ptx::pack8;
using ptx::unpack8;

constexpr int kConvStages = 8;  // rows in flight per thread (power of two): 32 KB of ring per block

using ptx::cp_async16_ring;
using ptx::cp_async_wait_ring;

using conv::conv8_step;
using conv::silu_f;


// Largest s with cu[s] <= t (so cu[s] <= t < cu[s + 1] when t < cu[num_seqs]); skips empty sequences.
__device__ __forceinline__ int64_t find_sequence(const int32_t* __restrict__ cu, int64_t num_seqs, int64_t t) {
  int64_t lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (static_cast<int64_t>(__ldg(cu + mid)) <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Thread (group g = 8 channels, run r = tokens [r·R, min((r+1)·R, N))). Threads x: channel groups
// (fastest, so a warp reads a contiguous stretch of a row), y: runs.
// With kState (causal_conv1d_update_runs: prompt pieces continuing from their slots), the rows before
// a sequence's first token are its slot's conv state rows (state [num_slots, K-1, C], read only)
// instead of zeros; a slot outside [0, num_slots) reads zeros.
template <int K, bool kState>
__global__ void __launch_bounds__(256, 2) causal_conv1d_fast_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx,
                                                                 const __nv_bfloat16* __restrict__ w,
                                                                 __nv_bfloat16* __restrict__ y,
                                                                 const int32_t* __restrict__ cu, int64_t num_seqs,
                                                                 int64_t N, int64_t C, int R, bool silu,
                                                                 const __nv_bfloat16* __restrict__ state,
                                                                 const int32_t* __restrict__ slots, int64_t num_slots) {
  const int64_t groups = C / 8;
  const int64_t g = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t run = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t t0 = run * R;
  if (g >= groups || t0 >= N) return;
  const int64_t t1 = min(t0 + R, N);
  const int64_t c0 = g * 8;

  float wr[8][K];
#pragma unroll
  for (int c = 0; c < 8; ++c)
#pragma unroll
    for (int j = 0; j < K; ++j) wr[c][j] = __bfloat162float(w[(c0 + c) * K + j]);

  int64_t s = find_sequence(cu, num_seqs, t0);
  const int64_t seq_begin = __ldg(cu + s);
  int64_t seq_end = __ldg(cu + s + 1);

  // Row r (< K-1) of sequence s's initial window: its slot's state row (kState), else zero.
  auto initial_row = [&](int64_t seq, int r, float (&row)[8]) {
    const int32_t slot = kState ? __ldg(slots + seq) : -1;
    if (kState && slot >= 0 && slot < num_slots) {
      unpack8(__ldg(reinterpret_cast<const uint4*>(state + (static_cast<int64_t>(slot) * (K - 1) + r) * C + c0)), row);
    } else {
#pragma unroll
      for (int c = 0; c < 8; ++c) row[c] = 0.0f;
    }
  };
  // win[j] = x[t - (K-1) + j] for the next token t (j < K-1); before the sequence start, the
  // initial window's rows.
  float win[K > 1 ? K - 1 : 1][8];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) {
    const int64_t src = t0 - (K - 1) + j;
    if (src >= seq_begin)
      unpack8(__ldg(reinterpret_cast<const uint4*>(x + src * ldx + c0)), win[j]);
    else
      initial_row(s, static_cast<int>(src - seq_begin + (K - 1)), win[j]);
  }

  // One output row: t's input is cur_raw; the window holds the K-1 rows before it.
  auto step = [&](int64_t t, const uint4& cur_raw) {
    if (t == seq_end) {  // a new sequence starts at t: its initial window before it
      while (static_cast<int64_t>(__ldg(cu + s + 1)) <= t) ++s;
      seq_end = __ldg(cu + s + 1);
#pragma unroll
      for (int j = 0; j < K - 1; ++j) initial_row(s, j, win[j]);
    }
    float cur[8], out[8];
    unpack8(cur_raw, cur);
    conv8_step<K>(wr, win, cur, silu, out);
    *reinterpret_cast<uint4*>(y + t * C + c0) = pack8(out);
  };

  // The run's rows stream through this thread's ring (see the top of the file).
  __shared__ uint4 ring[kConvStages][256];  // [slot][thread]
  const int tid = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
#pragma unroll
  for (int k = 0; k < kConvStages; ++k) {
    if (t0 + k < t1) cp_async16_ring(&ring[k][tid], x + (t0 + k) * ldx + c0);
    ptx::cp_async_commit();
  }
  int slot = 0;
  for (int64_t t = t0; t < t1; ++t) {
    cp_async_wait_ring<kConvStages - 1>();  // row t's group (kConvStages - 1 newer ones may still fly)
    step(t, ring[slot][tid]);
    if (t + kConvStages < t1) cp_async16_ring(&ring[slot][tid], x + (t + kConvStages) * ldx + c0);
    ptx::cp_async_commit();  // (empty past the run: keeps one group per row)
    slot = (slot + 1) & (kConvStages - 1);
  }
}

// One thread per (token, channel); grid-stride over N·C.
__global__ void causal_conv1d_fallback_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx,
                                              const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y,
                                              const int32_t* __restrict__ cu, int64_t num_seqs, int64_t N, int64_t C,
                                              int64_t K, bool silu) {
  const int64_t total = N * C;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
    const int64_t t = idx / C, c = idx - t * C;
    const int64_t begin = __ldg(cu + find_sequence(cu, num_seqs, t));
    float acc = 0.0f;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t src = t - (K - 1) + j;
      if (src >= begin) acc = fmaf(__bfloat162float(w[c * K + j]), __bfloat162float(x[src * ldx + c]), acc);
    }
    y[idx] = __float2bfloat16_rn(silu ? silu_f(acc) : acc);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

void check_conv_common(const ConvParams& p, const char* op) {
  DFLASH_CHECK(p.N >= 0 && p.C >= 1 && p.K >= 1,
               op << ": needs N >= 0, C >= 1, K >= 1, got N " << p.N << ", C " << p.C << ", K " << p.K);
  DFLASH_CHECK(p.ldx >= p.C, op << ": row stride ldx " << p.ldx << " is smaller than C " << p.C);
  DFLASH_CHECK(p.N == 0 || p.num_seqs >= 1, op << ": " << p.N << " tokens but num_seqs " << p.num_seqs);
  DFLASH_CHECK(p.N == 0 || (p.x && p.w && p.y && p.cu_seqlens), op << ": null pointer among x, w, y, cu_seqlens");
}

}  // namespace

bool causal_conv1d_fast_supported(int64_t C, int64_t K) { return C >= 8 && C % 8 == 0 && K >= 1 && K <= 4; }

void detail::check_conv_vec8_shape(const char* op, int64_t C, int64_t K, int64_t ldx, const char* fallback) {
  DFLASH_CHECK(causal_conv1d_fast_supported(C, K),
               op << ": needs C % 8 == 0 and K in [1, 4], got C " << C << ", K " << K << " (use " << fallback << ")");
  DFLASH_CHECK(ldx % 8 == 0, op << ": row stride ldx " << ldx << " must be a multiple of 8 (16-byte rows)");
}

namespace {

// The fast kernel over p's rows (runs of R tokens, R chosen below), with the slots' states as the
// sequences' initial windows when `state` is set (causal_conv1d_update_runs), else zeros.
void launch_conv_runs(const ConvParams& p, const void* state, const int32_t* slots, int64_t num_slots, Stream s) {
  const char* op = state ? "causal_conv1d_update_runs" : "causal_conv1d_fast";
  const int64_t groups = p.C / 8;
  // Block: bx threads over channel groups (a warp reads a contiguous 512-byte stretch of a row) x
  // by runs. blocks(R) = gy · ceil(runs / by).
  const int bx = static_cast<int>(std::min<int64_t>(groups, 128));
  const int64_t gy = (groups + bx - 1) / bx;
  auto shape = [&](int64_t R, int& by, int64_t& gx) {
    const int64_t runs = (p.N + R - 1) / R;
    by = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(256 / bx, runs)));
    gx = (runs + by - 1) / by;
  };
  // Tokens per thread R. Every thread walks its run with the load ring full, so a wave of blocks
  // takes ~ R + kRamp row steps (kRamp ~ ring fill + K-1 halo rows) and the launch ~ waves ·
  // (R + kRamp), waves = ceil(blocks / resident blocks): pick the R in [8, 512] minimising that. At
  // N = 8192, C = 10240 (2 blocks of 256 per SM, 132 SMs) that is R = 160: 260 blocks, one wave; the
  // old rule (R = 64, 640 blocks = 2.4 waves) idled ~20% of the machine in the last wave.
  int R = tuning::conv_tokens_per_thread;
  if (R <= 0) {
    const int64_t slots_resident = resident_blocks(reinterpret_cast<const void*>(causal_conv1d_fast_kernel<4, false>), 256, 0, 0);
    constexpr int64_t kRamp = 16;
    int64_t best = -1;
    for (int64_t r = 8; r <= 512; r += 8) {
      int by = 1;
      int64_t gx = 0;
      shape(r, by, gx);
      const int64_t cost = (gx * gy + slots_resident - 1) / slots_resident * (r + kRamp);
      if (best < 0 || cost < best) best = cost, R = static_cast<int>(r);
      if (r >= p.N) break;
    }
  }
  DFLASH_CHECK(R >= 1, op << ": tokens per thread must be positive");
  int by = 1;
  int64_t gx = 0;
  shape(R, by, gx);
  DFLASH_CHECK(gx < (1ll << 31) && gy < 65536, op << ": grid too large for N " << p.N << ", C " << p.C);
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), block(bx, by);
  auto stream = static_cast<cudaStream_t>(s);
  auto x = static_cast<const __nv_bfloat16*>(p.x);
  auto w = static_cast<const __nv_bfloat16*>(p.w);
  auto y = static_cast<__nv_bfloat16*>(p.y);
  auto st = static_cast<const __nv_bfloat16*>(state);
  auto launch = [&](auto kernel) {
    kernel<<<grid, block, 0, stream>>>(x, p.ldx, w, y, p.cu_seqlens, p.num_seqs, p.N, p.C, R, p.silu, st, slots, num_slots);
  };
  if (state) {
    switch (p.K) {
      case 1: launch(causal_conv1d_fast_kernel<1, true>); break;
      case 2: launch(causal_conv1d_fast_kernel<2, true>); break;
      case 3: launch(causal_conv1d_fast_kernel<3, true>); break;
      default: launch(causal_conv1d_fast_kernel<4, true>); break;
    }
  } else {
    switch (p.K) {
      case 1: launch(causal_conv1d_fast_kernel<1, false>); break;
      case 2: launch(causal_conv1d_fast_kernel<2, false>); break;
      case 3: launch(causal_conv1d_fast_kernel<3, false>); break;
      default: launch(causal_conv1d_fast_kernel<4, false>); break;
    }
  }
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace

void causal_conv1d_fast(const ConvParams& p, Stream s) {
  const char* op = "causal_conv1d_fast";
  check_conv_common(p, op);
  detail::check_conv_vec8_shape(op, p.C, p.K, p.ldx, "causal_conv1d_fallback");
  if (p.N == 0) return;
  DFLASH_CHECK(aligned16(p.x) && aligned16(p.y),
               op << ": x and y must be 16-byte aligned (use causal_conv1d_fallback)");
  launch_conv_runs(p, nullptr, nullptr, 0, s);
}

void detail::causal_conv1d_runs_with_states(const ConvParams& p, const void* state, const int32_t* slots,
                                            int64_t num_slots, Stream s) {
  launch_conv_runs(p, state, slots, num_slots, s);
}

void causal_conv1d_fallback(const ConvParams& p, Stream s) {
  check_conv_common(p, "causal_conv1d_fallback");
  if (p.N == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((p.N * p.C + kThreads - 1) / kThreads, 1 << 20);
  causal_conv1d_fallback_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(s)>>>(
      static_cast<const __nv_bfloat16*>(p.x), p.ldx, static_cast<const __nv_bfloat16*>(p.w),
      static_cast<__nv_bfloat16*>(p.y), p.cu_seqlens, p.num_seqs, p.N, p.C, p.K, p.silu);
  DFLASH_CUDA_CHECK_LAST();
}

// ---- gdn_prep -----------------------------------------------------------------------------------
namespace {

constexpr int kPrepThreads = 256;
constexpr int kPrepStages = 8;  // fast kernel: rows in flight per lane group (power of two); 32 KB per block
// Cap on the persistent grid's blocks per SM (0: as many as fit). 6, the best of the sweep on an
// H200 (0.044 ms; 0.046 uncapped, where 6 also fit; 0.049 at 2, 0.071 at 1).
constexpr int kPrepMaxBlocksPerSm = 6;

// g = -exp(A_log) · softplus(a + dt_bias), beta = sigmoid(b) for gate index i = n·Hv + h.
__device__ __forceinline__ void gdn_gate(const GdnPrepParams& p, int64_t i) {
  const int64_t n = i / p.Hv, h = i - n * p.Hv;
  const float a = __bfloat162float(static_cast<const __nv_bfloat16*>(p.a)[n * p.ld_ab + h]);
  const float b = __bfloat162float(static_cast<const __nv_bfloat16*>(p.b)[n * p.ld_ab + h]);
  const float A_log = __bfloat162float(static_cast<const __nv_bfloat16*>(p.A_log)[h]);
  const float dt_bias = __bfloat162float(static_cast<const __nv_bfloat16*>(p.dt_bias)[h]);
  const float xs = a + dt_bias;
  const float softplus = xs > 20.0f ? xs : log1pf(expf(xs));  // torch softplus, threshold 20
  p.g[i] = -expf(A_log) * softplus;
  p.beta[i] = 1.0f / (1.0f + expf(-b));
}

// Fast kernel, 8 | dk <= 256: a persistent grid of lane groups streams the q|k rows r = n·2Hk + j
// (j < Hk: q head j, else k head j - Hk). A group of G lanes (G = the power of two >= dk/8, one
// 16-byte unit per lane, lanes past dk/8 idle) takes rows first, first + stride, ... and keeps
// kPrepStages of them in flight through a per-thread cp.async ring in shared memory (each thread
// reads only the slots it filled: no block barrier); a slot is refilled as soon as its row is
// written. The row's sum of squares is reduced with log2(G) xor shuffles: the same tree, hence
// bit-identical results, as the warp-per-row kernel (its lanes past dk/8 add exact zeros). The
// gates are computed while the first rows are in flight (grid-stride over N·Hv).
template <int G>
__global__ void __launch_bounds__(kPrepThreads) gdn_prep_rows_kernel(GdnPrepParams p) {
  constexpr int kGroups = kPrepThreads / G;
  __shared__ uint4 ring[kPrepStages][kPrepThreads];  // [slot][thread]
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % G, grp = tid / G;
  const int two_hk = static_cast<int>(2 * p.Hk), units = static_cast<int>(p.dk / 8);
  const int64_t rows = p.N * two_hk;  // < 2^31: checked by the launcher
  const bool on = lane < units;
  const auto* conv = static_cast<const __nv_bfloat16*>(p.conv);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kGroups;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kGroups + grp;
  // The loop runs while the warp's first group has a row, so every lane joins each shuffle.
  const int64_t warp_first = static_cast<int64_t>(blockIdx.x) * kGroups + (tid / 32) * (32 / G);
  auto issue = [&](int slot, int64_t r) {
    if (on && r < rows) {
      const int n = static_cast<int>(r) / two_hk, j = static_cast<int>(r) - n * two_hk;
      cp_async16_ring(&ring[slot][tid], conv + static_cast<int64_t>(n) * p.ld_conv + j * p.dk + lane * 8);
    }
    ptx::cp_async_commit();  // (possibly empty: one group per row keeps the wait count fixed)
  };
#pragma unroll
  for (int k = 0; k < kPrepStages; ++k) issue(k, first + k * stride);

  const int64_t gates = p.N * p.Hv;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kPrepThreads + tid; i < gates;
       i += static_cast<int64_t>(gridDim.x) * kPrepThreads)
    gdn_gate(p, i);

  int slot = 0;
  for (int64_t k = 0; warp_first + k * stride < rows; ++k) {
    const int64_t r = first + k * stride;
    cp_async_wait_ring<kPrepStages - 1>();
    float f[8];
    unpack8(on ? ring[slot][tid] : make_uint4(0u, 0u, 0u, 0u), f);
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) ss = fmaf(f[e], f[e], ss);
#pragma unroll
    for (int off = G / 2; off >= 1; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (on && r < rows) {
      const int n = static_cast<int>(r) / two_hk, j = static_cast<int>(r) - n * two_hk;
      const bool is_q = j < p.Hk;
      const int head = is_q ? j : j - static_cast<int>(p.Hk);
      const float inv = rsqrtf(ss + 1e-6f);
      const float mul = is_q ? p.scale : 1.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = (f[e] * inv) * mul;  // l2norm, then `q * scale` as transformers
      __nv_bfloat16* dst =
          static_cast<__nv_bfloat16*>(is_q ? p.q : p.k) + (static_cast<int64_t>(n) * p.Hk + head) * p.dk;
      *reinterpret_cast<uint4*>(dst + lane * 8) = pack8(f);
    }
    issue(slot, r + kPrepStages * stride);
    slot = (slot + 1) & (kPrepStages - 1);
  }
}

// General kernel (any dk): blocks [0, row_blocks) normalise rows r = n·2Hk + j, one warp per row,
// two passes over the row; the remaining blocks compute the gates, one thread per (token, value head).
template <bool kVec>
__global__ void __launch_bounds__(kPrepThreads) gdn_prep_kernel(GdnPrepParams p, int64_t row_blocks) {
  if (static_cast<int64_t>(blockIdx.x) < row_blocks) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * (kPrepThreads / 32) + warp;
    if (row >= p.N * 2 * p.Hk) return;
    const int64_t n = row / (2 * p.Hk), j = row - n * 2 * p.Hk;
    const bool is_q = j < p.Hk;
    const int64_t head = is_q ? j : j - p.Hk;
    const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(p.conv) + n * p.ld_conv + j * p.dk;
    __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(is_q ? p.q : p.k) + (n * p.Hk + head) * p.dk;
    float ss = 0.0f;
    if constexpr (kVec) {
      for (int64_t d = lane * 8; d < p.dk; d += 256) {
        float f[8];
        unpack8(*reinterpret_cast<const uint4*>(src + d), f);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
      }
    } else {
      for (int64_t d = lane; d < p.dk; d += 32) {
        const float f = __bfloat162float(src[d]);
        ss = fmaf(f, f, ss);
      }
    }
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float inv = rsqrtf(ss + 1e-6f);
    const float mul = is_q ? p.scale : 1.0f;
    // x · inv first, then the scale, as l2norm followed by `q * scale` in transformers.
    if constexpr (kVec) {
      for (int64_t d = lane * 8; d < p.dk; d += 256) {
        float f[8];
        unpack8(*reinterpret_cast<const uint4*>(src + d), f);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = (f[i] * inv) * mul;
        *reinterpret_cast<uint4*>(dst + d) = pack8(f);
      }
    } else {
      for (int64_t d = lane; d < p.dk; d += 32) dst[d] = __float2bfloat16_rn((__bfloat162float(src[d]) * inv) * mul);
    }
  } else {
    const int64_t i = (static_cast<int64_t>(blockIdx.x) - row_blocks) * kPrepThreads + threadIdx.x;
    if (i < p.N * p.Hv) gdn_gate(p, i);
  }
}

}  // namespace

void gdn_prep(const GdnPrepParams& p, Stream s) {
  const char* op = "gdn_prep";
  DFLASH_CHECK(p.N >= 0 && p.Hk >= 1 && p.Hv >= 1 && p.dk >= 1,
               op << ": needs N >= 0, Hk, Hv, dk >= 1, got N " << p.N << ", Hk " << p.Hk << ", Hv " << p.Hv
                  << ", dk " << p.dk);
  DFLASH_CHECK(p.ld_conv >= 2 * p.Hk * p.dk,
               op << ": conv row stride " << p.ld_conv << " is smaller than the q|k width 2*Hk*dk = "
                  << 2 * p.Hk * p.dk);
  DFLASH_CHECK(p.ld_ab >= p.Hv, op << ": a/b row stride " << p.ld_ab << " is smaller than Hv " << p.Hv);
  DFLASH_CHECK(p.scale > 0.0f, op << ": scale must be positive, got " << p.scale);
  if (p.N == 0) return;
  DFLASH_CHECK(p.conv && p.a && p.b && p.A_log && p.dt_bias && p.q && p.k && p.g && p.beta,
               op << ": null pointer among the inputs/outputs");
  const int64_t rows = p.N * 2 * p.Hk;
  auto stream = static_cast<cudaStream_t>(s);
  const bool vec = p.dk % 8 == 0 && p.ld_conv % 8 == 0 && aligned16(p.conv) && aligned16(p.q) && aligned16(p.k);
  if (vec && p.dk <= 256 && rows < (1ll << 31) - (1ll << 20)) {
    dispatch_lanes(pow2_at_least(static_cast<int>(p.dk / 8)), [&](auto G) {
      const auto kernel = gdn_prep_rows_kernel<G>;
      const unsigned grid = persistent_grid(reinterpret_cast<const void*>(kernel), kPrepThreads, kPrepMaxBlocksPerSm,
                                            tuning::prep_blocks, rows, kPrepThreads / G);
      kernel<<<grid, kPrepThreads, 0, stream>>>(p);
    });
    DFLASH_CUDA_CHECK_LAST();
    return;
  }
  const int64_t row_blocks = (rows + kPrepThreads / 32 - 1) / (kPrepThreads / 32);
  const int64_t gate_blocks = (p.N * p.Hv + kPrepThreads - 1) / kPrepThreads;
  DFLASH_CHECK(row_blocks + gate_blocks < (1ll << 31), op << ": grid too large for N " << p.N);
  const auto grid = static_cast<unsigned>(row_blocks + gate_blocks);
  if (vec)
    gdn_prep_kernel<true><<<grid, kPrepThreads, 0, stream>>>(p, row_blocks);
  else
    gdn_prep_kernel<false><<<grid, kPrepThreads, 0, stream>>>(p, row_blocks);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda
