// Sampling ops (sampling.h): the greedy argmax and temperature / top-p sampling over rows
// of logits, on the device so that a decode step brings back token ids, not R × V logits.
//
// argmax_rows roofline: reads the R·V logits once (4 B each in fp32, 2 B in bf16), writes R ids; no FLOPs to
// speak of, so memory bound. One CTA per row streams its row with 16-byte loads, kUnroll of them
// in flight per thread: at the drafter's block (R = 16, V = 248320, fp32: 16 MB) the 16 CTAs sit
// on 16 SMs, each limited by what one SM can pull (~100-200 GB/s), so ~5-10 us; with more rows
// (several slots) the grid fills the GPU and approaches DRAM bandwidth (~4 TB/s).
// Ties: every thread keeps the lowest index attaining its maximum, and each combine (warp
// shuffles, then across warps) prefers the lower index on equal values, so the result is the
// lowest id of the row's maximum whatever the thread layout.
//
// sample_rows: see the comment above sample_rows_kernel below.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "core/cuda/check.h"
#include "kernels/cuda/sampling.h"
#include "core/error.h"
#include "core/rng.h"

namespace dflash::cuda {

namespace tuning {
// sample_rows' CTA size: 0 = the default (1024 threads, 2 loads in flight each in the Gumbel pass),
// 512 = 512 threads with 4 (kernel_bench times both).
int sample_threads = 0;
}  // namespace tuning

namespace {

using bf16 = __nv_bfloat16;

constexpr int kMaxThreads = 1024;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread

// The best (value, index) seen; index INT_MAX = none yet.
struct Best {
  float v;
  int i;
};

__device__ __forceinline__ void consider(Best& b, float v, int i) {
  if (!isnan(v) && (v > b.v || (v == b.v && i < b.i))) b = {v, i};
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }

// The 16 bytes q hold elements i0, i0 + 1, ... of the row.
__device__ __forceinline__ void consider16(Best& b, const uint4& q, int i0, float) {
  const float4 f = *reinterpret_cast<const float4*>(&q);
  consider(b, f.x, i0);
  consider(b, f.y, i0 + 1);
  consider(b, f.z, i0 + 2);
  consider(b, f.w, i0 + 3);
}
__device__ __forceinline__ void consider16(Best& b, const uint4& q, int i0, bf16) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    consider(b, f.x, i0 + 2 * k);
    consider(b, f.y, i0 + 2 * k + 1);
  }
}

__device__ __forceinline__ void warp_best(Best& b) {
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, b.v, o);
    const int i = __shfl_xor_sync(0xffffffffu, b.i, o);
    consider(b, v, i);
  }
}

// Row blockIdx.x: the elements before the row's first 16-byte boundary, then whole 16-byte vectors
// (kUnroll at a time per thread), then the tail.
template <typename T>
__global__ void __launch_bounds__(kMaxThreads) argmax_rows_kernel(const T* __restrict__ logits, int64_t ld, int V,
                                                                  int32_t* __restrict__ out) {
  constexpr int kVec = 16 / sizeof(T);
  const T* row = logits + static_cast<int64_t>(blockIdx.x) * ld;
  const int nt = static_cast<int>(blockDim.x);
  const int head = min(V, static_cast<int>(((16u - (reinterpret_cast<uintptr_t>(row) & 15u)) & 15u) / sizeof(T)));
  const int nvec = (V - head) / kVec;
  const uint4* vec = reinterpret_cast<const uint4*>(row + head);
  Best b{-INFINITY, INT_MAX};
  for (int v = threadIdx.x; v < head; v += nt) consider(b, to_float(row[v]), v);
  int k = threadIdx.x;
  for (; k + (kUnroll - 1) * nt < nvec; k += kUnroll * nt) {
    uint4 q[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) q[u] = __ldg(vec + k + u * nt);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) consider16(b, q[u], head + (k + u * nt) * kVec, T{});
  }
  for (; k < nvec; k += nt) consider16(b, __ldg(vec + k), head + k * kVec, T{});
  for (int v = head + nvec * kVec + static_cast<int>(threadIdx.x); v < V; v += nt) consider(b, to_float(row[v]), v);

  __shared__ Best warps[kMaxThreads / 32];
  warp_best(b);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warps[warp] = b;
  __syncthreads();
  if (warp == 0) {
    b = lane < nt / 32 ? warps[lane] : Best{-INFINITY, INT_MAX};
    warp_best(b);
    if (lane == 0) out[blockIdx.x] = b.i == INT_MAX ? 0 : b.i;
  }
}

// ---- temperature / top-p sampling ------------------------------------------------------------------
// One CTA of 1024 (or 512) threads per row; a row's token is ops::sample_rows' draw (kernels/ops.h),
// found in passes that each read the row once (from L2 after the first when the rows fit there):
//
//   top_p >= 1, or a row whose max z is +-inf or that is all NaN: the Gumbel pass (4) alone.
//   top_p <  1: (1) the max m and the smallest finite z. (2) The mass e_v = exp(z_v - m) of each
//     token into kBins bins linear in m - z over [m - W, m], W = min(40, m - min z), a tail bin for
//     the rest: the bin where the mass summed from the top reaches top_p x total holds z_c. (z_c lies
//     in the window: the mass below m - 40 is < V e^-40 of the total, less than 1 - top_p >= 2^-24
//     for V < 2^31; the tail is searched like any bin if the sums ever say otherwise.) (3) While that
//     bin holds more than kCap tokens and more than one value, the same over kBins sub-ranges of the
//     bin's order-preserving integer keys (at most 3 such passes for 32-bit keys; rows of many equal
//     values need them). (4) The Gumbel pass: the tokens above the bin compete, the bin's tokens are
//     gathered into shared memory, sorted and walked value group by value group to find z_c exactly,
//     and those >= z_c compete too. A typical top-p row takes passes 1, 2 and 4.
//   Masses are summed in 64-bit fixed point (unit 2^-(64 - L) for V < 2^L): integer sums are exact,
//   so no result depends on the order of the shared-memory atomics (draws are batch invariant and
//   reproducible); the total's relative error is < V 2^-(65 - L) (2^-29 at V = 248320). e_v =
//   expf(z_v - m) in f32 where the reference takes exp in double, so z_c can differ from the
//   reference's only on a row whose nucleus mass is within ~1e-6 of top_p x total. Histogram atomics
//   are aggregated per thread over runs of one bin (a row of equal values: one atomic per thread).
//
// The Gumbel pass evaluates score_v = double(z_v) - log(-log(u_v)) in double only where it can win:
// each lane forms the f32 estimate s~ = z + G~ (G~ from MUFU logs, and the series of -log(1 - w)
// where u is near 1: |G~ - G| < 1e-5), the warp keeps the max of s~ over what it has seen, and only
// an element with s~ >= max - (1e-3 + 1e-6 |max|) gets its exact score (a handful per warp and row).
// An element with z + max G below that bound skips its Philox block too. Ties go to the lowest id in every combine: the result is the lowest id of the row's best
// score whatever the thread layout, as in the reference.
//
// Cost per row (V = 248320 fp32, 0.99 MB): 1 read of the row (top_p = 1) or 3 (top_p < 1, typical);
// per token one IEEE division, a quarter of a Philox4x32-10 block (~20 integer ops), 2 MUFU logs
// and a few FMAs in the Gumbel pass, a division, an expf and two 64-bit shared atomics in the
// histogram pass. Each row runs on one SM and is compute bound there. Measured on an H200
// (kernel_bench --only sample, V 248320, T 0.7): ~0.125 ms per call at top_p 1 and 0.24-0.34 ms at
// top_p 0.9 for any R up to the SM count, so R = 128 reads 0.98 TB/s (23 % of the copy bandwidth)
// at top_p 1 and 0.37-0.48 TB/s at 0.9, where argmax_rows reads the same rows in 0.018-0.034 ms.
// The Philox skip hardly helps as written (a peaked row costs what a flat one does): the bound is
// per warp, and most warps never see a peaked row's top tokens. Left to do: a block-wide bound
// (seeded with m - 2.86 where m is known: the best score is >= m + min G), and several CTAs per row
// (a cluster) when R is below the SM count. The 512-thread layout (tuning::sample_threads) was
// 14-32 % slower everywhere; it is kept for the tests and the benchmark.

constexpr int kBins = 2048;  // histogram bins (level 1: linear in m - z; later levels: key ranges)
constexpr int kCap = 4096;   // tokens of the threshold's bin gathered into shared memory
constexpr float kWindow = 40.0f;
constexpr float kGumbelMax = 17.34f;          // > -log(-log(1 - 2^-25)) = 17.3287, the largest G of a draw
constexpr uint32_t kKeyNegInf = 0x007FFFFFu;  // key_of(-inf): the smallest key of a non-NaN float

// Order-preserving map of non-NaN floats to uint32 (-0 maps as +0: equal floats have equal keys).
__device__ __forceinline__ uint32_t key_of(float z) {
  const uint32_t b = __float_as_uint(z == 0.0f ? 0.0f : z);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float z_of(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// The exact score of ops::sample_rows (same expression, in double).
__device__ __forceinline__ double exact_score(float z, uint32_t bits) {
  const double u = (static_cast<double>(bits >> 8) + 0.5) * (1.0 / 16777216.0);
  return static_cast<double>(z) - log(-log(u));
}
// f32 G = -log(-log u), |error| < 1e-5. L = -log u: by __logf (abs error 2^-21.4 on [0.5, 2], 3 ulp
// elsewhere; u is rounded to f32 by <= 2^-25) where u <= 7/8, so L >= 0.13 and its relative error
// is < 4e-6; by the series of -log(1 - w) where u > 7/8 (w = 1 - u is exact in f32; truncation
// < w^6 / 6 relative). Then G = -__logf(L): 3 ulp of |log L| <= 17.4.
__device__ __forceinline__ float approx_gumbel(uint32_t bits) {
  const uint32_t b = bits >> 8;
  const float w = static_cast<float>(0xFFFFFFu - b) * 0x1p-24f + 0x1p-25f;
  float L;
  if (w <= 0.125f)
    L = w * (1.0f + w * (0.5f + w * (1.0f / 3 + w * (0.25f + w * (0.2f + w * (1.0f / 6))))));
  else
    L = -__logf(static_cast<float>(b) * 0x1p-24f + 0x1p-25f);
  return -__logf(L);
}

struct SBest {
  double s;
  int i;  // INT_MAX: none yet
};
__device__ __forceinline__ void consider(SBest& b, double s, int i) {
  if (b.i == INT_MAX || s > b.s || (s == b.s && i < b.i)) b = {s, i};
}
__device__ __forceinline__ void consider(SBest& b, const SBest& o) {
  if (o.i != INT_MAX) consider(b, o.s, o.i);
}

struct SampleArgs {
  const float* logits;
  int64_t ld;
  int V;
  float temperature, top_p;
  float unit;  // 2^(64 - L), V < 2^L: mass e in fixed point is round(e * unit)
  uint64_t seed;
  const uint64_t* streams;
  const int64_t* positions;
  int32_t* out;
};

using u64 = unsigned long long;

union SampleSmem {
  struct {
    u64 q[kBins];  // mass per bin (fixed point)
    unsigned n[kBins];  // tokens per bin
  } h;
  u64 g[kCap];  // gathered tokens: key << 32 | id
};

// Calls f(x, v) for every element v of the row: 16-byte loads in the body, as argmax_rows.
template <int NT, typename F>
__device__ __forceinline__ void for_each_logit(const float* row, int V, F&& f) {
  constexpr int nt = NT;
  const int head = min(V, static_cast<int>(((16u - (reinterpret_cast<uintptr_t>(row) & 15u)) & 15u) / 4));
  const int nvec = (V - head) / 4;
  const float4* vec = reinterpret_cast<const float4*>(row + head);
  for (int v = threadIdx.x; v < head; v += nt) f(row[v], v);
  int k = threadIdx.x;
  for (; k + (kUnroll - 1) * nt < nvec; k += kUnroll * nt) {
    float4 q[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) q[u] = __ldg(vec + k + u * nt);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = head + (k + u * nt) * 4;
      f(q[u].x, v), f(q[u].y, v + 1), f(q[u].z, v + 2), f(q[u].w, v + 3);
    }
  }
  for (; k < nvec; k += nt) {
    const float4 q = __ldg(vec + k);
    const int v = head + k * 4;
    f(q.x, v), f(q.y, v + 1), f(q.z, v + 2), f(q.w, v + 3);
  }
  for (int v = head + nvec * 4 + static_cast<int>(threadIdx.x); v < V; v += nt) f(row[v], v);
}

// Block-wide exclusive prefix sum of one value per thread; *total gets the sum of all. Uses
// scratch[0..32] and ends with a barrier (so it also orders shared-memory writes before it).
template <int NT>
__device__ u64 block_exclusive_scan(u64 x, u64* scratch, u64* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  u64 inc = x;
  for (int o = 1; o < 32; o <<= 1) {
    const u64 y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const u64 w = lane < NT / 32 ? scratch[lane] : 0;
    u64 wi = w;
    for (int o = 1; o < 32; o <<= 1) {
      const u64 y = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += y;
    }
    scratch[lane] = wi - w;  // exclusive prefix of warp `lane`
    if (lane == 31) scratch[32] = wi;
  }
  __syncthreads();
  *total = scratch[32];
  return scratch[warp] + inc - x;
}

// The block's best (thread 0 gets it).
template <int NT>
__device__ SBest block_best(SBest b, SBest* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o >>= 1) consider(b, SBest{__shfl_xor_sync(0xffffffffu, b.s, o), __shfl_xor_sync(0xffffffffu, b.i, o)});
  if (lane == 0) scratch[warp] = b;
  __syncthreads();
  if (warp == 0) {
    b = lane < NT / 32 ? scratch[lane] : SBest{-INFINITY, INT_MAX};
    for (int o = 16; o > 0; o >>= 1)
      consider(b, SBest{__shfl_xor_sync(0xffffffffu, b.s, o), __shfl_xor_sync(0xffffffffu, b.i, o)});
  }
  return b;
}

// Per-thread aggregation of the histogram atomics over runs of one bin.
struct BinRun {
  int bin = -1;
  u64 q = 0;
  unsigned n = 0;
  __device__ __forceinline__ void add(SampleSmem& sm, int b, u64 mass) {
    if (b != bin) {
      flush(sm);
      bin = b;
    }
    q += mass;
    ++n;
  }
  __device__ __forceinline__ void flush(SampleSmem& sm) {
    if (n > 0) {
      atomicAdd(&sm.h.q[bin], q);
      atomicAdd(&sm.h.n[bin], n);
    }
    q = 0;
    n = 0;
  }
};

// After a histogram pass (bins ordered from the largest z down): the bin where the mass from the
// top, `above` + the bins before it, first reaches `want`, with the mass above it and its token
// count, into *pick (-1: none), *above_out, *count_out. want < 0: want = top_p x (all bins + extra),
// written to *want_out; *grand_out = the sum of all bins. Begins and ends with a barrier.
template <int NT>
__device__ void pick_bin(SampleSmem& sm, u64 above, double want, float top_p, u64 extra, u64* scratch,
                         int* pick, u64* above_out, unsigned* count_out, double* want_out, u64* grand_out) {
  constexpr int per = kBins / NT;
  static_assert(kBins % NT == 0);
  __syncthreads();  // the histogram's atomics are done
  const int b0 = threadIdx.x * per;
  u64 local = 0;
#pragma unroll
  for (int j = 0; j < per; ++j) local += sm.h.q[b0 + j];
  if (threadIdx.x == 0) *pick = -1;
  u64 grand;
  u64 prev = block_exclusive_scan<NT>(local, scratch, &grand) + above;
  if (want < 0) want = static_cast<double>(top_p) * static_cast<double>(grand + extra);
#pragma unroll
  for (int j = 0; j < per; ++j) {
    const u64 cur = prev + sm.h.q[b0 + j];
    if (static_cast<double>(cur) >= want && static_cast<double>(prev) < want) {
      *pick = b0 + j;
      *above_out = prev;
      *count_out = sm.h.n[b0 + j];
    }
    prev = cur;
  }
  if (threadIdx.x == 0) *want_out = want;
  *grand_out = grand;
  __syncthreads();
}

// NT threads; GU 16-byte loads in flight per thread in the Gumbel pass (registers: 1024 x 2 or 512 x 4).
template <int NT, int GU>
__global__ void __launch_bounds__(NT) sample_rows_kernel(SampleArgs a) {
  __shared__ SampleSmem sm;
  __shared__ u64 scan_scratch[33];
  __shared__ SBest best_scratch[NT / 32];
  __shared__ float red[2][NT / 32];
  __shared__ u64 s_above;
  __shared__ unsigned s_count, s_klo, s_khi;
  __shared__ int s_pick, s_gcount, s_first;
  __shared__ double s_want;

  constexpr int nt = NT;
  const int V = a.V, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const float* row = a.logits + static_cast<int64_t>(blockIdx.x) * a.ld;
  const float T = a.temperature;
  const uint64_t seed = a.seed, stream = a.streams[blockIdx.x];
  const uint64_t base = static_cast<uint64_t>(a.positions[blockIdx.x]) * static_cast<uint64_t>(V);
  const float unit = a.unit;
  auto zval = [T](float x) { return __fdiv_rn(x, T); };  // z = logit / temperature, as the reference
  float m = 0;
  auto mass = [&m, unit](float z) { return __float2ull_rn(expf(__fsub_rn(z, m)) * unit); };

  // The final pass's sets: z >= z_in compete; with `gathering`, z_glo <= z < z_in are gathered.
  float z_in = -INFINITY, z_glo = INFINITY;
  bool gathering = false;
  double want = 0;
  u64 above = 0;

  if (a.top_p < 1.0f) {
    // (1) max and smallest finite z.
    float mx = -INFINITY, mn = INFINITY;
    for_each_logit<NT>(row, V, [&](float x, int) {
      const float z = zval(x);
      mx = fmaxf(mx, z);
      if (isfinite(z)) mn = fminf(mn, z);
    });
    for (int o = 16; o > 0; o >>= 1) {
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
    }
    if (lane == 0) red[0][warp] = mx, red[1][warp] = mn;
    __syncthreads();
    mx = red[0][0], mn = red[1][0];
    for (int w = 1; w < nt / 32; ++w) mx = fmaxf(mx, red[0][w]), mn = fminf(mn, red[1][w]);
    m = mx;
    if (isfinite(m)) {
      // (2) level 1: bins linear in m - z.
      float W = fminf(kWindow, __fsub_rn(m, mn));
      if (!(W >= 1e-30f)) W = 1.0f;  // one finite value (W = 0): any width
      const float inv_w = static_cast<float>(kBins) / W;
      auto bin1 = [m, inv_w](float z) {  // nonincreasing in z; kBins = the tail
        const float t = __fmul_rn(__fsub_rn(m, z), inv_w);
        return t < static_cast<float>(kBins) ? static_cast<int>(t) : kBins;
      };
      for (int i = tid; i < kBins; i += nt) sm.h.q[i] = 0, sm.h.n[i] = 0;
      __syncthreads();
      BinRun run;
      u64 tail_q = 0, tail_n = 0;
      for_each_logit<NT>(row, V, [&](float x, int) {
        const float z = zval(x);
        if (isnan(z)) return;
        const int b = bin1(z);
        const u64 q = mass(z);
        if (b < kBins) run.add(sm, b, q);
        else tail_q += q, ++tail_n;
      });
      run.flush(sm);
      u64 tail_q_all, tail_n_all, grand;
      block_exclusive_scan<NT>(tail_q, scan_scratch, &tail_q_all);
      block_exclusive_scan<NT>(tail_n, scan_scratch, &tail_n_all);
      pick_bin<NT>(sm, 0, -1.0, a.top_p, tail_q_all, scan_scratch, &s_pick, &s_above, &s_count, &s_want, &grand);
      want = s_want;
      int pick = s_pick;
      unsigned count;
      if (pick >= 0) {
        above = s_above, count = s_count;
      } else {  // the tail (not expected: see above)
        pick = kBins, above = grand, count = tail_n_all > kCap ? UINT_MAX : static_cast<unsigned>(tail_n_all);
      }
      // The bin's key range, by bisection over keys (bin1 is monotone in the key).
      if (tid == 0) {
        auto B = [&](uint32_t k) { return bin1(z_of(k)); };
        const uint32_t kmax = key_of(m);
        uint32_t lo = kKeyNegInf, hi = kmax;  // smallest key with B <= pick
        while (lo < hi) {
          const uint32_t mid = lo + (hi - lo) / 2;
          if (B(mid) <= pick) hi = mid;
          else lo = mid + 1;
        }
        s_klo = lo;
        lo = kKeyNegInf, hi = kmax;  // largest key with B >= pick
        while (lo < hi) {
          const uint32_t mid = lo + static_cast<uint32_t>((static_cast<uint64_t>(hi) - lo + 1) / 2);
          if (B(mid) >= pick) lo = mid;
          else hi = mid - 1;
        }
        s_khi = lo;
      }
      __syncthreads();
      uint32_t klo = s_klo, khi = s_khi;
      // (3) key levels while the bin is too big to gather.
      while (count > static_cast<unsigned>(kCap) && klo < khi) {
        int sh = 0;
        while (((khi - klo) >> sh) >= static_cast<uint32_t>(kBins)) ++sh;
        const int ctop = static_cast<int>((khi - klo) >> sh);
        for (int i = tid; i < kBins; i += nt) sm.h.q[i] = 0, sm.h.n[i] = 0;
        __syncthreads();
        BinRun r2;
        for_each_logit<NT>(row, V, [&](float x, int) {
          const float z = zval(x);
          if (isnan(z)) return;
          const uint32_t k = key_of(z);
          if (k < klo || k > khi) return;
          r2.add(sm, ctop - static_cast<int>((k - klo) >> sh), mass(z));
        });
        r2.flush(sm);
        u64 g2;
        pick_bin<NT>(sm, above, want, a.top_p, 0, scan_scratch, &s_pick, &s_above, &s_count, &s_want, &g2);
        int j = s_pick;
        if (j >= 0) {
          above = s_above, count = s_count;
        } else {  // not expected (the sums are exact): the lowest sub-range
          j = ctop, above += g2 - sm.h.q[ctop], count = sm.h.n[ctop];
        }
        const uint32_t nlo = klo + (static_cast<uint32_t>(ctop - j) << sh);
        khi = min(khi, nlo + ((1u << sh) - 1u));
        klo = nlo;
        __syncthreads();  // everyone has read the histogram before the next level clears it
      }
      if (klo == khi) {
        z_in = z_of(klo);
      } else {
        gathering = true;
        z_in = z_of(khi + 1);
        z_glo = z_of(klo);
      }
    }
  }

  // (4) the Gumbel pass.
  if (tid == 0) s_gcount = 0, s_first = INT_MAX;
  __syncthreads();
  SBest best{-INFINITY, INT_MAX};
  auto exact = [&](int v) { consider(best, exact_score(zval(row[v]), rng::bits(seed, stream, base + static_cast<uint64_t>(v))), v); };
  auto gather = [&](float z, int v) {
    const int i = atomicAdd(&s_gcount, 1);
    if (i < kCap) sm.g[i] = (static_cast<u64>(key_of(z)) << 32) | static_cast<unsigned>(v);
  };
  auto scalar = [&](float x, int v) {
    const float z = zval(x);
    if (z >= z_in) exact(v);
    else if (gathering && z >= z_glo) gather(z, v);
  };
  {
    const int head = min(V, static_cast<int>(((16u - (reinterpret_cast<uintptr_t>(row) & 15u)) & 15u) / 4));
    const int nvec = (V - head) / 4;
    const float4* vec = reinterpret_cast<const float4*>(row + head);
    for (int v = tid; v < head; v += nt) scalar(row[v], v);
    for (int v = head + nvec * 4 + tid; v < V; v += nt) scalar(row[v], v);
    float wb = -INFINITY, thr = -INFINITY;  // the warp's best estimate so far, and the bound below it
    const int off = static_cast<int>((base + static_cast<uint64_t>(head)) & 3);  // Philox word of a vector's first element
    for (int k0 = 0; k0 < nvec; k0 += GU * nt) {  // the same trip count in every thread
      float4 x[GU];
#pragma unroll
      for (int u = 0; u < GU; ++u) {
        const int k = k0 + u * nt + tid;
        x[u] = k < nvec ? __ldg(vec + k) : make_float4(NAN, NAN, NAN, NAN);
      }
      float s[GU * 4];
      float smax = -INFINITY;
#pragma unroll
      for (int u = 0; u < GU; ++u) {
        const int v0 = head + (k0 + u * nt + tid) * 4;
        const float z[4] = {zval(x[u].x), zval(x[u].y), zval(x[u].z), zval(x[u].w)};
        bool need_a = false, need_b = false;
        unsigned cand = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool in = z[e] >= z_in;
          const bool c = in && __fadd_rn(z[e], kGumbelMax) >= thr;
          cand |= c ? 1u << e : 0u;
          need_a |= c && off + e < 4;
          need_b |= c && off + e >= 4;
          if (!in && gathering && z[e] >= z_glo) gather(z[e], v0 + e);
        }
        const uint64_t blk = (base + static_cast<uint64_t>(v0)) >> 2;
        rng::U32x4 A{0, 0, 0, 0}, Bk{0, 0, 0, 0};
        if (need_a) A = rng::block(seed, stream, blk);
        if (need_b) Bk = rng::block(seed, stream, blk + 1);
        const uint32_t wd[8] = {A.x, A.y, A.z, A.w, Bk.x, Bk.y, Bk.z, Bk.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          uint32_t bits = wd[e];  // wd[off + e], by selects (no local memory)
#pragma unroll
          for (int o = 1; o < 4; ++o) bits = off == o ? wd[o + e] : bits;
          s[u * 4 + e] = (cand >> e & 1u) ? __fadd_rn(z[e], approx_gumbel(bits)) : NAN;
          smax = fmaxf(smax, s[u * 4 + e]);
        }
      }
      for (int o = 16; o > 0; o >>= 1) smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, o));
      wb = fmaxf(wb, smax);
      thr = isinf(wb) ? wb : wb - (1e-3f + 1e-6f * fabsf(wb));
      unsigned pass = 0;
#pragma unroll
      for (int i = 0; i < GU * 4; ++i) pass |= s[i] >= thr ? 1u << i : 0u;
      while (pass) {  // rare: the exact scores
        const int i = __ffs(pass) - 1;
        pass &= pass - 1;
        exact(head + (k0 + (i / 4) * nt + tid) * 4 + i % 4);
      }
    }
  }
  __syncthreads();
  if (gathering) {
    // z_c among the gathered tokens: sort by key (descending), walk the value groups from the top.
    const int n = min(s_gcount, kCap);
    int P = 1;
    while (P < n) P <<= 1;
    for (int i = n + tid; i < P; i += nt) sm.g[i] = 0;
    __syncthreads();
    for (int size = 2; size <= P; size <<= 1)
      for (int stride = size / 2; stride > 0; stride >>= 1) {
        for (int i = tid; i < P / 2; i += nt) {
          const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
          const bool desc = (lo & size) == 0;
          const u64 p = sm.g[lo], q = sm.g[hi];
          if ((p < q) == desc && p != q) sm.g[lo] = q, sm.g[hi] = p;
        }
        __syncthreads();
      }
    const int chunk = (n + nt - 1) / nt, i0 = min(n, tid * chunk), i1 = min(n, i0 + chunk);
    u64 local = 0;
    for (int i = i0; i < i1; ++i) local += mass(z_of(static_cast<uint32_t>(sm.g[i] >> 32)));
    u64 total;
    u64 cum = above + block_exclusive_scan<NT>(local, scan_scratch, &total);
    for (int i = i0; i < i1; ++i) {
      const uint32_t k = static_cast<uint32_t>(sm.g[i] >> 32);
      cum += mass(z_of(k));
      if ((i == n - 1 || static_cast<uint32_t>(sm.g[i + 1] >> 32) != k) && static_cast<double>(cum) >= want) {
        atomicMin(&s_first, i);
        break;
      }
    }
    __syncthreads();
    if (n > 0) {
      const uint32_t kc = static_cast<uint32_t>(sm.g[s_first == INT_MAX ? n - 1 : s_first] >> 32);
      for (int i = tid; i < n; i += nt)
        if (static_cast<uint32_t>(sm.g[i] >> 32) >= kc) exact(static_cast<int>(sm.g[i] & 0xffffffffu));
    }
  }
  const SBest b = block_best<NT>(best, best_scratch);
  if (tid == 0) a.out[blockIdx.x] = b.i == INT_MAX ? 0 : b.i;
}

}  // namespace

void argmax_rows(const void* logits, bool bf16_logits, int64_t ld, int64_t R, int64_t V, int32_t* out, Stream s) {
  DFLASH_CHECK(R >= 0 && R < INT_MAX && V >= 1 && V < INT_MAX,
               "argmax_rows: need 0 <= R < 2^31 and 1 <= V < 2^31, got R=" << R << " V=" << V);
  DFLASH_CHECK(ld >= V, "argmax_rows: row stride ld=" << ld << " is smaller than V=" << V);
  if (R == 0) return;
  const size_t es = bf16_logits ? 2 : 4;
  DFLASH_CHECK(logits != nullptr && out != nullptr, "argmax_rows: null pointer (logits=" << logits << " out=" << out << ")");
  DFLASH_CHECK(reinterpret_cast<uintptr_t>(logits) % es == 0,
               "argmax_rows: logits " << logits << " are not aligned to their " << es << "-byte elements");
  // Threads: enough for kUnroll vectors each over the row, in whole warps, at most kMaxThreads.
  const int64_t per_thread = static_cast<int64_t>(16 / es) * kUnroll;
  const int threads = static_cast<int>(std::clamp<int64_t>((V + per_thread - 1) / per_thread + 31, 32, kMaxThreads) / 32 * 32);
  const auto st = static_cast<cudaStream_t>(s);
  const auto grid = static_cast<unsigned>(R);
  if (bf16_logits)
    argmax_rows_kernel<bf16><<<grid, threads, 0, st>>>(static_cast<const bf16*>(logits), ld, static_cast<int>(V), out);
  else
    argmax_rows_kernel<float><<<grid, threads, 0, st>>>(static_cast<const float*>(logits), ld, static_cast<int>(V), out);
  DFLASH_CUDA_CHECK_LAST();
}


void sample_rows(const float* logits, int64_t ld, int64_t R, int64_t V, float temperature, float top_p, uint64_t seed,
                 const uint64_t* streams, const int64_t* positions, int32_t* out, Stream s) {
  DFLASH_CHECK(R >= 0 && R < INT_MAX && V >= 1 && V < INT_MAX,
               "sample_rows: need 0 <= R < 2^31 and 1 <= V < 2^31, got R=" << R << " V=" << V);
  DFLASH_CHECK(ld >= V, "sample_rows: row stride ld=" << ld << " is smaller than V=" << V);
  DFLASH_CHECK_HINT(std::isfinite(temperature) && temperature > 0,
                    "sample_rows: temperature = " << temperature << " must be > 0",
                    "temperature 0 is greedy decoding: argmax_rows");
  DFLASH_CHECK(std::isfinite(top_p) && top_p > 0 && top_p <= 1, "sample_rows: top_p = " << top_p << " must be in (0, 1]");
  if (R == 0) return;
  DFLASH_CHECK(logits != nullptr && streams != nullptr && positions != nullptr && out != nullptr,
               "sample_rows: null pointer (logits=" << logits << " streams=" << streams << " positions=" << positions
                                                    << " out=" << out << ")");
  DFLASH_CHECK(reinterpret_cast<uintptr_t>(logits) % 4 == 0,
               "sample_rows: logits " << logits << " are not aligned to their 4-byte elements");
  int L = 1;
  while ((int64_t{1} << L) <= V) ++L;  // V < 2^L: V masses of at most 2^(64 - L) sum below 2^64
  const SampleArgs args{logits, ld, static_cast<int>(V), temperature, top_p, std::ldexp(1.0f, 64 - L), seed, streams,
                        positions, out};
  const auto grid = static_cast<unsigned>(R);
  const auto st = static_cast<cudaStream_t>(s);
  if (tuning::sample_threads == 512)
    sample_rows_kernel<512, 4><<<grid, 512, 0, st>>>(args);
  else
    sample_rows_kernel<1024, 2><<<grid, 1024, 0, st>>>(args);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda
