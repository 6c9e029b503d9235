// GatedDeltaNet pre-core kernels: the causal depthwise conv over the concatenated [q | k | v]
// channels (fast and fallback), and gdn_prep (q/k L2 normalisation + the g / beta gates).
//
// Roofline, causal_conv1d at the Qwen3.6-27B shape (C = 10240 = q 2048 | k 2048 | v 6144, K = 4):
//   bytes = N·C·2 (read x once) + N·C·2 (write y) (+ the K-1 halo rows per run of R tokens, which
//   the neighbouring run has just pulled into L2, so they cost L2 and not DRAM bandwidth);
//   FLOPs = 2·K·N·C (+ SiLU), ~0.3 FLOP/byte: memory-bound. At N = 8192 that is 335 MB, ~0.08 ms at
//   4.2 TB/s; the target is <= 0.12 ms.
//   Measured on an H200 (N = 8192, C = 10240, K = 4, x a strided view with ldx = 16480): 0.114 ms
//   (2.93 TB/s) at R = 64, the automatic choice there; 0.119 ms at R = 32, 0.134 at 16, 0.166 at 8;
//   a device-to-device copy of the same bytes takes 0.085 ms (3.95 TB/s); the fallback 0.62 ms.
// Roofline, gdn_prep: reads N·2·Hk·dk·2 bytes of q/k and writes as many, plus 2·N·Hv·2 in and
//   2·N·Hv·4 out for the gates: at N = 8192, Hk = 16, dk = 128, Hv = 48 that is 139 MB, ~0.035 ms.
//   Measured 0.089 ms (1.56 TB/s): one warp per 128-element row (16 lanes busy) and two passes
//   over the row leave it latency-bound; several rows per warp, kept in registers, would close it.
//
// Fast conv design: each thread owns 8 consecutive channels (one 16-byte bf16 load per token row)
// and a run of R consecutive tokens (R a multiple of 8, 8..64, chosen so the grid fills the GPU).
// The last K-1 inputs stay in registers as a sliding window (fp32), so every element is read once
// plus K-1 halo rows per run; the 8·K weights sit in registers; SiLU is fused; 8 rows are loaded
// before the first is used, so 8 independent 16-byte loads are in flight per thread. Runs are laid
// on the global token axis; a run that crosses a sequence boundary resets its window to zeros at
// the boundary (so no value ever leaks across sequences), and its first halo rows are taken only
// from the sequence that holds its first token (a binary search in cu_seqlens, once per thread).
// This needs no host-side run table, so the launcher never reads cu_seqlens.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ptx.cuh"
#include "kernels/error.h"
#include "kernels/device.h"

namespace dflash::cuda {

// Tuning knob for benchmarks/tests only: tokens per thread of the fast conv (0 = automatic).
namespace tuning {
int conv_tokens_per_thread = 0;
}

namespace {

using ptx::pack8;
using ptx::unpack8;

constexpr int kConvBatch = 8;  // rows loaded ahead per thread

// SiLU with the fast intrinsics (ex2.approx + approximate division, a few ulp in f32, far below the
// bf16 output rounding): the full-precision expf and IEEE division would make the fast conv
// instruction-bound (~90 instructions per 16-byte row and thread as written, ~150 with them).
// For x < -87, __expf(-x) = inf and the quotient is -0, silu's limit.
__device__ __forceinline__ float silu_f(float x) { return __fdividef(x, 1.0f + __expf(-x)); }


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
template <int K>
__global__ void __launch_bounds__(256) causal_conv1d_fast_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx,
                                                                 const __nv_bfloat16* __restrict__ w,
                                                                 __nv_bfloat16* __restrict__ y,
                                                                 const int32_t* __restrict__ cu, int64_t num_seqs,
                                                                 int64_t N, int64_t C, int R, bool silu) {
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

  // win[j] = x[t - (K-1) + j] for the next token t (j < K-1), zero before the sequence start.
  float win[K > 1 ? K - 1 : 1][8];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) {
    const int64_t src = t0 - (K - 1) + j;
    if (src >= seq_begin) {
      unpack8(__ldg(reinterpret_cast<const uint4*>(x + src * ldx + c0)), win[j]);
    } else {
#pragma unroll
      for (int c = 0; c < 8; ++c) win[j][c] = 0.0f;
    }
  }

  for (int64_t tb = t0; tb < t1; tb += kConvBatch) {
    uint4 raw[kConvBatch];
#pragma unroll
    for (int i = 0; i < kConvBatch; ++i)
      if (tb + i < t1) raw[i] = __ldg(reinterpret_cast<const uint4*>(x + (tb + i) * ldx + c0));
#pragma unroll
    for (int i = 0; i < kConvBatch; ++i) {
      const int64_t t = tb + i;
      if (t >= t1) break;
      if (t == seq_end) {  // a new sequence starts at t: zeros before it (block-uniform branch)
#pragma unroll
        for (int j = 0; j < K - 1; ++j)
#pragma unroll
          for (int c = 0; c < 8; ++c) win[j][c] = 0.0f;
        while (static_cast<int64_t>(__ldg(cu + s + 1)) <= t) ++s;
        seq_end = __ldg(cu + s + 1);
      }
      float cur[8], out[8];
      unpack8(raw[i], cur);
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        float acc = 0.0f;  // same order as the reference: taps j = 0..K-1
#pragma unroll
        for (int j = 0; j < K - 1; ++j) acc = fmaf(wr[c][j], win[j][c], acc);
        acc = fmaf(wr[c][K - 1], cur[c], acc);
        out[c] = silu ? silu_f(acc) : acc;
      }
#pragma unroll
      for (int j = 0; j + 1 < K - 1; ++j)
#pragma unroll
        for (int c = 0; c < 8; ++c) win[j][c] = win[j + 1][c];
      if constexpr (K > 1) {
#pragma unroll
        for (int c = 0; c < 8; ++c) win[K - 2][c] = cur[c];
      }
      *reinterpret_cast<uint4*>(y + t * C + c0) = pack8(out);
    }
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

void causal_conv1d_fast(const ConvParams& p, Stream s) {
  const char* op = "causal_conv1d_fast";
  check_conv_common(p, op);
  DFLASH_CHECK(causal_conv1d_fast_supported(p.C, p.K),
               op << ": needs C % 8 == 0 and K in [1, 4], got C " << p.C << ", K " << p.K
                  << " (use causal_conv1d_fallback)");
  DFLASH_CHECK(p.ldx % 8 == 0, op << ": row stride ldx " << p.ldx << " must be a multiple of 8 (16-byte rows)");
  if (p.N == 0) return;
  DFLASH_CHECK(aligned16(p.x) && aligned16(p.y),
               op << ": x and y must be 16-byte aligned (use causal_conv1d_fallback)");
  const int64_t groups = p.C / 8;
  // Tokens per thread: the longest run (fewest halo re-reads) that still gives ~2 waves of threads
  // (the K = 4 kernel takes 128 registers: 512 resident threads per SM). At N = 8192, C = 10240
  // this picks R = 64, the fastest measured (see the top of the file).
  int R = tuning::conv_tokens_per_thread;
  if (R <= 0) {
    int dev = 0;
    DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
    int sms = 0;
    DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const int64_t want_threads = static_cast<int64_t>(sms) * 512 * 2;
    R = 64;
    while (R > 8 && groups * ((p.N + R - 1) / R) < want_threads) R /= 2;
  }
  DFLASH_CHECK(R >= 1, op << ": tokens per thread must be positive");
  const int64_t runs = (p.N + R - 1) / R;
  const int bx = static_cast<int>(std::min<int64_t>(groups, 128));
  const int by = 256 / bx >= 1 ? static_cast<int>(std::min<int64_t>(256 / bx, runs)) : 1;
  const int64_t gx = (runs + by - 1) / by, gy = (groups + bx - 1) / bx;
  DFLASH_CHECK(gx < (1ll << 31) && gy < 65536, op << ": grid too large for N " << p.N << ", C " << p.C);
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), block(bx, by);
  auto stream = static_cast<cudaStream_t>(s);
  auto x = static_cast<const __nv_bfloat16*>(p.x);
  auto w = static_cast<const __nv_bfloat16*>(p.w);
  auto y = static_cast<__nv_bfloat16*>(p.y);
  switch (p.K) {
    case 1: causal_conv1d_fast_kernel<1><<<grid, block, 0, stream>>>(x, p.ldx, w, y, p.cu_seqlens, p.num_seqs, p.N, p.C, R, p.silu); break;
    case 2: causal_conv1d_fast_kernel<2><<<grid, block, 0, stream>>>(x, p.ldx, w, y, p.cu_seqlens, p.num_seqs, p.N, p.C, R, p.silu); break;
    case 3: causal_conv1d_fast_kernel<3><<<grid, block, 0, stream>>>(x, p.ldx, w, y, p.cu_seqlens, p.num_seqs, p.N, p.C, R, p.silu); break;
    default: causal_conv1d_fast_kernel<4><<<grid, block, 0, stream>>>(x, p.ldx, w, y, p.cu_seqlens, p.num_seqs, p.N, p.C, R, p.silu); break;
  }
  DFLASH_CUDA_CHECK_LAST();
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

constexpr int kPrepThreads = 256;  // 8 warps: one (token, q-or-k head) row per warp

// Blocks [0, row_blocks) normalise rows r = n·2Hk + j (j < Hk: q head j, else k head j - Hk);
// the remaining blocks compute the gates, one thread per (token, value head).
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
    if (i >= p.N * p.Hv) return;
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
  const int64_t row_blocks = (rows + kPrepThreads / 32 - 1) / (kPrepThreads / 32);
  const int64_t gate_blocks = (p.N * p.Hv + kPrepThreads - 1) / kPrepThreads;
  DFLASH_CHECK(row_blocks + gate_blocks < (1ll << 31), op << ": grid too large for N " << p.N);
  const bool vec = p.dk % 8 == 0 && p.ld_conv % 8 == 0 && aligned16(p.conv) && aligned16(p.q) && aligned16(p.k);
  const auto grid = static_cast<unsigned>(row_blocks + gate_blocks);
  auto stream = static_cast<cudaStream_t>(s);
  if (vec)
    gdn_prep_kernel<true><<<grid, kPrepThreads, 0, stream>>>(p, row_blocks);
  else
    gdn_prep_kernel<false><<<grid, kPrepThreads, 0, stream>>>(p, row_blocks);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda
