// The RoPE family's kernels (rope.h): the target's q/k preparation (zero-centred RMSNorm + partial
// neox RoPE, q read out of the gated q|gate projection) and the drafter's per-head plain RMSNorm +
// full-head neox RoPE forward / backward.
//
// Roofline. Bound by HBM bandwidth (~4.8 TB/s on H200); minimum traffic per token:
//   qk_norm_rope             q: 2·Hq·d read (gate half skipped) + 2·Hq·d written; k: 4·Hkv·d
//   head_norm_rope_fwd / bwd 4·heads·d (fwd), 6·heads·d (bwd), + one sincosf per (row, head, frequency)
//
// Layout of the work:
//   * qk_norm_rope: one block per token; the block builds the token's cos/sin table once in
//     shared memory, then each warp normalises and rotates whole (token, head) rows, staging the
//     normalised row in shared memory to reach the rotary partner element (i <-> i ± rotary/2).
//   * head_norm_rope: a warp per (row, head), 4 rotary pairs per lane; the backward's dw as the
//     norm family's deterministic partials (norm.cu detail::reduce_partials).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda/check.h"
#include "kernels/cuda/grid.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/vec.cuh"
#include "core/error.h"

namespace dflash::cuda {

namespace {

using namespace vec;

constexpr int kQkWarps = 4;        // qk_norm_rope: warps per block (one block per token)
constexpr int kMaxRotaryHalf = 128;  // qk_norm_rope: rotary_dim <= 256 (inv_freq table is a kernel argument)
constexpr int kThreads = 256;
constexpr int kDwParts = 512;        // max CTAs (partials) of the norm backward kernels
constexpr int kMaxHeadHalf = 128;    // head_norm_rope: d <= 256 (4 rotary pairs per lane)
constexpr int kPairsPerLane = kMaxHeadHalf / 32;
constexpr int kHeadWarps = kThreads / 32;

// ---- qk_norm_rope ---------------------------------------------------------------------------------

struct QkArgs {
  const bf16* q_in;  // token n, head h at n·ldq + h·hsq
  int64_t ldq, hsq;
  bf16* q_out;  // (N, Hq, d)
  bf16* k;      // token n, head h at n·ldk + h·d; in place
  int64_t ldk;
  const bf16* wq;  // (d)
  const bf16* wk;  // (d)
  const int32_t* pos;  // (N)
  int Hq, Hkv, d, rotary_dim;
  float eps;
  float inv_freq[kMaxRotaryHalf];  // computed on the host exactly as the CPU reference does
};

// Vectorised kernel: shared-memory arrays of length L (L % 8 == 0) are stored "split": the first
// four floats of every 8-element unit, then the last four of every unit, so a warp reading one
// unit per lane as two float4 touches consecutive 16-byte words (no bank conflicts).
__device__ __forceinline__ int split_index(int j, int L) { return ((j >> 2) & 1) * (L / 2) + (j >> 3) * 4 + (j & 3); }
__device__ __forceinline__ void read_split(const float* a, int u, int L, float (&v)[8]) {
  const float4 lo = reinterpret_cast<const float4*>(a)[u];
  const float4 hi = reinterpret_cast<const float4*>(a + L / 2)[u];
  v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
  v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
}
__device__ __forceinline__ void write_split(float* a, int u, int L, const float (&v)[8]) {
  reinterpret_cast<float4*>(a)[u] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(a + L / 2)[u] = make_float4(v[4], v[5], v[6], v[7]);
}

// One block per token. W == 8 needs d % 8 == 0, (rotary_dim / 2) % 8 == 0 and aligned rows; W == 1
// handles any d and even rotary_dim.
template <int W>
__global__ void __launch_bounds__(kQkWarps * 32) qk_norm_rope_kernel(const __grid_constant__ QkArgs a) {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const int d = a.d, half = a.rotary_dim / 2;
  float* cosb = smem;         // (half)
  float* sinb = smem + half;  // (half)
  float* rowbuf = smem + 2 * half + (threadIdx.x / 32) * d;  // (d) per warp: the raw row in f32
  const int64_t n = blockIdx.x;

  // cos / sin of the f32 angle pos · inv_freq (precise sincosf: angles reach ~3e4 rad).
  const float pos = static_cast<float>(a.pos[n]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    sincosf(pos * a.inv_freq[i], &s, &c);
    const int at = W == 8 ? split_index(i, half) : i;
    cosb[at] = c;
    sinb[at] = s;
  }
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int units = d / W;
  for (int hr = threadIdx.x / 32; hr < a.Hq + a.Hkv; hr += kQkWarps) {
    const bool is_q = hr < a.Hq;
    const bf16* src;
    bf16* dst;
    const bf16* w;
    if (is_q) {
      src = a.q_in + n * a.ldq + hr * a.hsq;
      dst = a.q_out + (n * a.Hq + hr) * d;
      w = a.wq;
    } else {
      dst = a.k + n * a.ldk + static_cast<int64_t>(hr - a.Hq) * d;
      src = dst;
      w = a.wk;
    }
    // Pass 1: sum of squares; keep the raw row in shared memory for the rotary partners.
    float ss = 0.0f;
    for (int u = lane; u < units; u += 32) {
      float v[W];
      load(src + u * W, v);
#pragma unroll
      for (int e = 0; e < W; ++e) ss += v[e] * v[e];
      if constexpr (W == 8) write_split(rowbuf, u, d, v);
      else rowbuf[u] = v[0];
    }
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / static_cast<float>(d) + a.eps);
    __syncwarp();
    // Pass 2: x̂ · (1 + w), then rotate the first rotary_dim dims (neox halves i and i + half).
    for (int u = lane; u < units; u += 32) {
      float o[W];
      if constexpr (W == 8) {
        float xv[8], wv[8];
        read_split(rowbuf, u, d, xv);
        load(w + u * 8, wv);
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = xv[e] * inv * (1.0f + wv[e]);
        if (u * 8 < a.rotary_dim) {  // whole unit rotated: half % 8 == 0
          const int hu = half / 8;
          const bool lo = u < hu;
          const int pu = lo ? u + hu : u - hu;
          const int iu = lo ? u : pu;
          float xp[8], wp[8], c[8], s[8];
          read_split(rowbuf, pu, d, xp);
          load(w + pu * 8, wp);
          read_split(cosb, iu, half, c);
          read_split(sinb, iu, half, s);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float partner = xp[e] * inv * (1.0f + wp[e]);
            o[e] = lo ? o[e] * c[e] - partner * s[e] : o[e] * c[e] + partner * s[e];
          }
        }
      } else {
        const int j = u;
        o[0] = rowbuf[j] * inv * (1.0f + __bfloat162float(w[j]));
        if (j < a.rotary_dim) {
          const bool lo = j < half;
          const int p = lo ? j + half : j - half;
          const int i = lo ? j : p;
          const float partner = rowbuf[p] * inv * (1.0f + __bfloat162float(w[p]));
          o[0] = lo ? o[0] * cosb[i] - partner * sinb[i] : o[0] * cosb[i] + partner * sinb[i];
        }
      }
      store(dst + u * W, o);
    }
    __syncwarp();  // the row buffer is reused by this warp's next row
  }
}

// ---- per-head RMSNorm + neox RoPE ----------------------------------------------------------------

struct HeadArgs {
  const bf16* x;
  int64_t ldx;
  const bf16* w;
  const int32_t* pos;
  const bf16* dy;  // backward only
  bf16* out;       // forward: y; backward: dx
  int64_t ldo;     // row stride of out
  float* rstd;
  float* partial;  // backward: (gridDim.x, d)
  int64_t rows;
  int heads, d;
  float eps;
  float inv_freq[kMaxHeadHalf];  // host-computed like the CPU reference (double, rounded to f32)
};

// One warp per (row, head) item; item k = blockIdx.x·kHeadWarps + warp + j·gridDim.x·kHeadWarps.
// Lane l owns the rotary pairs (i, i + half) for i = l, l + 32, ...: both partners of a rotation
// are in the same lane, so no shared memory is needed.
template <bool kBwd>
__global__ void __launch_bounds__(kThreads) head_norm_rope_kernel(const __grid_constant__ HeadArgs a) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int half = a.d / 2;
  const int64_t items = a.rows * a.heads;
  float dwacc[2 * kPairsPerLane];
#pragma unroll
  for (int k = 0; k < 2 * kPairsPerLane; ++k) dwacc[k] = 0.0f;

  for (int64_t it = static_cast<int64_t>(blockIdx.x) * kHeadWarps + warp; it < items;
       it += static_cast<int64_t>(gridDim.x) * kHeadWarps) {
    const int64_t r = it / a.heads;
    const int h = static_cast<int>(it - r * a.heads);
    const bf16* xr = a.x + r * a.ldx + static_cast<int64_t>(h) * a.d;
    const float p = static_cast<float>(a.pos[r]);
    float x1[kPairsPerLane], x2[kPairsPerLane], cs[kPairsPerLane], sn[kPairsPerLane];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < kPairsPerLane; ++k) {
      const int i = lane + 32 * k;
      x1[k] = x2[k] = 0.0f;
      cs[k] = sn[k] = 0.0f;
      if (i < half) {
        x1[k] = __bfloat162float(xr[i]);
        x2[k] = __bfloat162float(xr[i + half]);
        sincosf(p * a.inv_freq[i], &sn[k], &cs[k]);
        ss += x1[k] * x1[k] + x2[k] * x2[k];
      }
    }
    bf16* orow = a.out + r * a.ldo + static_cast<int64_t>(h) * a.d;
    if constexpr (!kBwd) {
      ss = warp_sum(ss);
      const float rs = rsqrtf(ss / static_cast<float>(a.d) + a.eps);
#pragma unroll
      for (int k = 0; k < kPairsPerLane; ++k) {
        const int i = lane + 32 * k;
        if (i < half) {
          const float n1 = x1[k] * rs * __bfloat162float(a.w[i]);
          const float n2 = x2[k] * rs * __bfloat162float(a.w[i + half]);
          orow[i] = __float2bfloat16_rn(n1 * cs[k] - n2 * sn[k]);
          orow[i + half] = __float2bfloat16_rn(n2 * cs[k] + n1 * sn[k]);
        }
      }
      if (lane == 0) a.rstd[it] = rs;
    } else {
      const float rs = a.rstd[it];
      const bf16* gr = a.dy + it * a.d;  // dy contiguous [rows, heads, d]
      // dn = rotation of dy by −angle (the transpose of the forward rotation).
      float g1[kPairsPerLane], g2[kPairsPerLane];
      float s = 0.0f;  // Σ x̂ · w·dn
#pragma unroll
      for (int k = 0; k < kPairsPerLane; ++k) {
        const int i = lane + 32 * k;
        g1[k] = g2[k] = 0.0f;
        if (i < half) {
          const float d1 = __bfloat162float(gr[i]), d2 = __bfloat162float(gr[i + half]);
          g1[k] = d1 * cs[k] + d2 * sn[k];
          g2[k] = d2 * cs[k] - d1 * sn[k];
          s += x1[k] * rs * __bfloat162float(a.w[i]) * g1[k] + x2[k] * rs * __bfloat162float(a.w[i + half]) * g2[k];
        }
      }
      const float c = warp_sum(s) / static_cast<float>(a.d);
#pragma unroll
      for (int k = 0; k < kPairsPerLane; ++k) {
        const int i = lane + 32 * k;
        if (i < half) {
          const float xh1 = x1[k] * rs, xh2 = x2[k] * rs;
          orow[i] = __float2bfloat16_rn(rs * (__bfloat162float(a.w[i]) * g1[k] - xh1 * c));
          orow[i + half] = __float2bfloat16_rn(rs * (__bfloat162float(a.w[i + half]) * g2[k] - xh2 * c));
          dwacc[2 * k] += g1[k] * xh1;
          dwacc[2 * k + 1] += g2[k] * xh2;
        }
      }
    }
  }
  if constexpr (kBwd) {
    // The CTA's partial: warps' accumulators summed in warp order.
    __shared__ float buf[kHeadWarps][2 * kMaxHeadHalf];
#pragma unroll
    for (int k = 0; k < kPairsPerLane; ++k) {
      const int i = lane + 32 * k;
      if (i < half) {
        buf[warp][i] = dwacc[2 * k];
        buf[warp][i + half] = dwacc[2 * k + 1];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < a.d; i += kThreads) {
      float t = 0.0f;
#pragma unroll
      for (int wi = 0; wi < kHeadWarps; ++wi) t += buf[wi][i];
      a.partial[static_cast<int64_t>(blockIdx.x) * a.d + i] = t;
    }
  }
}

}  // namespace

// ---- launchers ------------------------------------------------------------------------------------

void qk_norm_rope(const QkPrepParams& p, Stream s) {
  DFLASH_CHECK(p.N >= 0 && p.N < (int64_t(1) << 31) && p.Hq >= 0 && p.Hkv >= 0 && p.Hq + p.Hkv < (1 << 20) &&
                   p.d > 0,
               "qk_norm_rope: need 0 <= N < 2^31, Hq >= 0, Hkv >= 0 and d > 0, got N="
                   << p.N << " Hq=" << p.Hq << " Hkv=" << p.Hkv << " d=" << p.d);
  DFLASH_CHECK(p.rotary_dim > 0 && p.rotary_dim % 2 == 0 && p.rotary_dim <= p.d &&
                   p.rotary_dim <= 2 * kMaxRotaryHalf,
               "qk_norm_rope: rotary_dim=" << p.rotary_dim << " must be even, in (0, d=" << p.d << "] and <= "
                                           << 2 * kMaxRotaryHalf);
  DFLASH_CHECK(p.Hq == 0 || (p.hsq >= p.d && p.ldq >= (p.Hq - 1) * p.hsq + p.d),
               "qk_norm_rope: q strides too small: hsq=" << p.hsq << " ldq=" << p.ldq << " for Hq=" << p.Hq
                                                         << " d=" << p.d);
  DFLASH_CHECK(p.Hkv == 0 || p.ldk >= p.Hkv * p.d,
               "qk_norm_rope: k row stride ldk=" << p.ldk << " is smaller than Hkv*d=" << p.Hkv * p.d);
  DFLASH_CHECK(p.theta > 0.0f, "qk_norm_rope: rope theta must be positive, got " << p.theta);
  const size_t smem = (static_cast<size_t>(p.rotary_dim) + static_cast<size_t>(kQkWarps) * p.d) * sizeof(float);
  DFLASH_CHECK(smem <= 48 * 1024, "qk_norm_rope: head dim d=" << p.d << " needs " << smem
                                                             << " bytes of shared memory, more than 48 KiB");
  if (p.N == 0 || p.Hq + p.Hkv == 0) return;
  DFLASH_CHECK(p.pos && (p.Hq == 0 || (p.q_in && p.q_out && p.wq)) && (p.Hkv == 0 || (p.k && p.wk)),
               "qk_norm_rope: null pointer (q_in=" << p.q_in << " q_out=" << p.q_out << " k=" << p.k << " wq=" << p.wq
                                                   << " wk=" << p.wk << " pos=" << p.pos << ")");

  QkArgs a{};
  a.q_in = static_cast<const bf16*>(p.q_in);
  a.ldq = p.ldq;
  a.hsq = p.hsq;
  a.q_out = static_cast<bf16*>(p.q_out);
  a.k = static_cast<bf16*>(p.k);
  a.ldk = p.ldk;
  a.wq = static_cast<const bf16*>(p.wq);
  a.wk = static_cast<const bf16*>(p.wk);
  a.pos = p.pos;
  a.Hq = static_cast<int>(p.Hq);
  a.Hkv = static_cast<int>(p.Hkv);
  a.d = static_cast<int>(p.d);
  a.rotary_dim = static_cast<int>(p.rotary_dim);
  a.eps = p.eps;
  // inv_freq_i = 1 / theta^(2i / rotary_dim), evaluated in double and rounded to f32 like the CPU
  // reference (ops::rope_neox_inplace); this is the f32 value transformers' table holds.
  const int half = a.rotary_dim / 2;
  for (int i = 0; i < half; ++i)
    a.inv_freq[i] = static_cast<float>(
        1.0 / std::pow(static_cast<double>(p.theta), static_cast<double>(2 * i) / static_cast<double>(a.rotary_dim)));

  const bool vec = p.d % 8 == 0 && half % 8 == 0 && (p.Hq == 0 || (p.ldq % 8 == 0 && p.hsq % 8 == 0 &&
                                                                   aligned16(p.q_in) && aligned16(p.q_out) &&
                                                                   aligned16(p.wq))) &&
                   (p.Hkv == 0 || (p.ldk % 8 == 0 && aligned16(p.k) && aligned16(p.wk)));
  const auto st = static_cast<cudaStream_t>(s);
  const auto grid = static_cast<unsigned>(p.N);
  if (vec) qk_norm_rope_kernel<8><<<grid, kQkWarps * 32, smem, st>>>(a);
  else qk_norm_rope_kernel<1><<<grid, kQkWarps * 32, smem, st>>>(a);
  DFLASH_CUDA_CHECK_LAST();
}

namespace {

void check_head_params(const HeadNormRopeParams& p, const char* who) {
  DFLASH_CHECK(p.rows >= 0 && p.rows < (int64_t{1} << 31) && p.heads > 0 && p.heads * p.rows < (int64_t{1} << 40),
               who << ": need 0 <= rows < 2^31 and heads > 0, got rows=" << p.rows << " heads=" << p.heads);
  DFLASH_CHECK(p.d > 0 && p.d % 2 == 0 && p.d <= 2 * kMaxHeadHalf,
               who << ": head dim d=" << p.d << " must be even and in (0, " << 2 * kMaxHeadHalf << "]");
  DFLASH_CHECK(p.ldx >= p.heads * p.d,
               who << ": x row stride ldx=" << p.ldx << " is smaller than heads*d=" << p.heads * p.d);
  DFLASH_CHECK(p.theta > 0.0f, who << ": rope theta must be positive, got " << p.theta);
  DFLASH_CHECK(p.eps >= 0.0f, who << ": eps must be >= 0, got " << p.eps);
}

HeadArgs head_args(const HeadNormRopeParams& p) {
  HeadArgs a{};
  a.x = static_cast<const bf16*>(p.x);
  a.ldx = p.ldx;
  a.w = static_cast<const bf16*>(p.w);
  a.pos = p.pos;
  a.rstd = p.rstd;
  a.rows = p.rows;
  a.heads = static_cast<int>(p.heads);
  a.d = static_cast<int>(p.d);
  a.eps = p.eps;
  // inv_freq_i = 1 / theta^(2i / d) evaluated in double and rounded to f32 (as qk_norm_rope).
  for (int i = 0; i < a.d / 2; ++i)
    a.inv_freq[i] = static_cast<float>(
        1.0 / std::pow(static_cast<double>(p.theta), static_cast<double>(2 * i) / static_cast<double>(a.d)));
  return a;
}

// Fixed CTA count for `items` (row, head) items: a function of the shape only (determinism).
unsigned head_parts(int64_t items) { return blocks_for(items, kHeadWarps * 4, kDwParts); }

}  // namespace

void head_norm_rope_fwd(const HeadNormRopeParams& p, Stream s) {
  check_head_params(p, "head_norm_rope_fwd");
  if (p.rows == 0) return;
  DFLASH_CHECK(p.x != nullptr && p.w != nullptr && p.pos != nullptr && p.y != nullptr && p.rstd != nullptr,
               "head_norm_rope_fwd: null pointer (x=" << p.x << " w=" << p.w << " pos=" << p.pos << " y=" << p.y
                                                      << " rstd=" << p.rstd << ")");
  HeadArgs a = head_args(p);
  a.out = static_cast<bf16*>(p.y);
  a.ldo = p.heads * p.d;
  const int64_t items = p.rows * p.heads;
  head_norm_rope_kernel<false><<<blocks_for(items, kHeadWarps, 1 << 30), kThreads, 0, static_cast<cudaStream_t>(s)>>>(a);
  DFLASH_CUDA_CHECK_LAST();
}

void head_norm_rope_bwd(const HeadNormRopeBwdParams& p, Stream s) {
  check_head_params(p.fwd, "head_norm_rope_bwd");
  DFLASH_CHECK(p.lddx >= p.fwd.heads * p.fwd.d,
               "head_norm_rope_bwd: dx row stride lddx=" << p.lddx << " is smaller than heads*d="
                                                         << p.fwd.heads * p.fwd.d);
  if (p.fwd.rows == 0) return;
  DFLASH_CHECK(p.fwd.x != nullptr && p.fwd.w != nullptr && p.fwd.pos != nullptr && p.fwd.rstd != nullptr &&
                   p.dy != nullptr && p.dx != nullptr && p.dw != nullptr,
               "head_norm_rope_bwd: null pointer (x=" << p.fwd.x << " w=" << p.fwd.w << " pos=" << p.fwd.pos
                                                      << " rstd=" << p.fwd.rstd << " dy=" << p.dy << " dx=" << p.dx
                                                      << " dw=" << p.dw << ")");
  HeadArgs a = head_args(p.fwd);
  a.dy = static_cast<const bf16*>(p.dy);
  a.out = static_cast<bf16*>(p.dx);
  a.ldo = p.lddx;
  const int64_t items = p.fwd.rows * p.fwd.heads;
  const unsigned parts = head_parts(items);
  Scratch partial(static_cast<size_t>(parts) * static_cast<size_t>(p.fwd.d) * sizeof(float));
  a.partial = partial.f32();
  const auto st = static_cast<cudaStream_t>(s);
  head_norm_rope_kernel<true><<<parts, kThreads, 0, st>>>(a);
  DFLASH_CUDA_CHECK_LAST();
  detail::reduce_partials(partial.f32(), static_cast<int>(parts), p.fwd.d, p.dw, st);
}
}  // namespace dflash::cuda
