// Probe (issue 30): why do FP8 decode GEMMs (M <= 16, 128 x 128 weight block scales) stream the weight
// at 2.0-2.9 TB/s on an H200 where a copy reaches ~4.25? Standalone (nvcc -O3 -arch=sm_90 -std=c++17
// fp8_gemv_probe.cu), not part of the build; it times, on the Qwen3.6-27B decode shapes, with the
// weights rotated through enough copies that L2 never holds them:
//   - copy: cudaMemcpy device to device (bytes read + written), the roofline every tool uses;
//   - read: a plain read of the weight bytes (512 contiguous bytes per warp and load);
//   - the same warp-level GEMV kernel in variants: the weight in its checkpoint layout or repacked so
//     each warp's 2 KB unit (16 rows x 128 columns) is contiguous; a one-wave grid whose warps take
//     equal runs of (16-row tile, 128-column group) units (stream-K, partial tiles summed with fp32
//     atomics: fine for timing, not deterministic) or af49b75's grid (a warp a tile, all of K);
//     DEPTH groups of loads in flight per warp, with or without issuing the next batch's loads before
//     the math of this one; "nomath" keeps the loads and drops the MMAs;
//   - warp-specialized variants (session 28): one producer lane per block feeds each consumer warp's
//     shared-memory ring (mbarriers) with cp.async.bulk copies of repacked units ("bulk") or 2-D TMA
//     boxes from the checkpoint layout ("tma", swizzled or not); the consumers only multiply.
// Every GEMV variant's output is checked against a plain fp32 reference kernel (max relative error).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "probe_util.cuh"

__device__ __forceinline__ uint4 ld_stream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float bf16_value(const uint8_t* p) {
  const uint32_t v = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
  return __uint_as_float(v << 16);
}

// bf16 reference: y[m, n] = sum_k w[n, k] x[m, k] (K elements, 2 bytes each).
__global__ void ref_bf16_kernel(const uint8_t* x, const uint8_t* w, float* y, int M, int N, int K) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  for (int m = 0; m < M; ++m) {
    float acc = 0;
    for (int k = 0; k < K; ++k)
      acc += bf16_value(w + 2 * (static_cast<int64_t>(n) * K + k)) * bf16_value(x + 2 * (static_cast<int64_t>(m) * K + k));
    y[static_cast<int64_t>(m) * N + n] = acc;
  }
}

// Reference: y[m, n] = sum_g ws[n / 128, g] xs[g, m] sum_{k in g} w[n, k] x[m, k], fp32.
__global__ void ref_kernel(const uint8_t* x, const float* xs, int ldxs, const uint8_t* w, const float* ws, int ldws,
                           float* y, int M, int N, int K) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  for (int m = 0; m < M; ++m) {
    float acc = 0;
    for (int g = 0; g < K / 128; ++g) {
      float s = 0;
      for (int k = g * 128; k < g * 128 + 128; ++k)
        s += e4m3_value(w[static_cast<int64_t>(n) * K + k]) * e4m3_value(x[static_cast<int64_t>(m) * K + k]);
      acc += s * ws[(n / 128) * ldws + g] * xs[g * ldxs + m];
    }
    y[static_cast<int64_t>(m) * N + n] = acc;
  }
}

// The packed layout: unit (tile t, group gi) at (t * G + gi) * 2048; load j of lane L at j * 512 + 16 L holds
// row 16 t + L / 4 + 8 (j >= 2), columns 128 gi + 64 (j & 1) + 16 (L % 4) .. + 15 (what the checkpoint
// layout's lane loads as its a[j / 2][j & 1]).
__global__ void pack_kernel(const uint8_t* w, uint8_t* p, int N, int K) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // one 16-byte piece
  const int G = K / 128;
  const int64_t pieces = static_cast<int64_t>(N) * K / 16;
  if (i >= pieces) return;
  const int64_t unit = i / 128;
  const int within = static_cast<int>(i % 128), j = within / 32, L = within % 32;
  const int64_t t = unit / G, gi = unit % G;
  const int64_t row = 16 * t + L / 4 + 8 * (j >> 1), col = 128 * gi + 64 * (j & 1) + 16 * (L % 4);
  *reinterpret_cast<uint4*>(p + i * 16) = *reinterpret_cast<const uint4*>(w + row * K + col);
}

__global__ void read_kernel(const uint8_t* w, int64_t bytes, unsigned* sink) {
  const int64_t n = bytes / 16;
  uint32_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = ld_stream(w + 16 * i), b = ld_stream(w + 16 * (i + stride)), c = ld_stream(w + 16 * (i + 2 * stride)),
          d = ld_stream(w + 16 * (i + 3 * stride));
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    uint4 a = ld_stream(w + 16 * i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

struct Args {
  const uint8_t* x;
  int ldx;  // row bytes of x and w (K for FP8, 2 K for bf16)
  const float* xs;
  int ldxs;
  const uint8_t* w;
  const float* ws;
  int ldws;
  float* y;
  int M, N, K, G;
  int64_t units;
  int dist;  // 0: stream-K runs; 1: warp = tile (af49b75's grid)
  const uint8_t* xp;  // tma_kernel: x permuted so a lane's 8 B-fragment words of a group are 32 contiguous bytes
  unsigned* sink;
};

// One warp's share of a unit: the MMAs of 16 weight rows x 128 bytes (an FP8 scale group; 64 bf16 columns)
// against the M <= 16 tokens' x, scaled into acc0 (tokens 0-7) / acc1 (8-15); a tile change first flushes the
// finished tile's sums (fp32 atomics).
// Units come to a warp in order, so the (tile, group) of the next one is kept by increments, not 64-bit divisions
// (start() once at the warp's first unit).
struct Acc {
  float acc0[4] = {0, 0, 0, 0}, acc1[4] = {0, 0, 0, 0};
  int64_t cur = -1;
  uint32_t x_or = 0;
  int64_t t = 0;
  int gi = 0;
  __device__ void start(int64_t u, int G) { t = u / G, gi = static_cast<int>(u % G); }
  __device__ void advance(int G) {
    if (++gi == G) gi = 0, ++t;
  }
};

template <int NT>
__device__ __forceinline__ void flush(const Args& a, Acc& s, int64_t tile) {
  const int g = (threadIdx.x % 32) >> 2, c = threadIdx.x & 3;
  const int r0 = static_cast<int>(tile) * 16 + g;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = r0 + (i >> 1) * 8, tok = 2 * c + (i & 1);
    if (tok < a.M) atomicAdd(a.y + static_cast<int64_t>(tok) * a.N + row, s.acc0[i]);
    if (NT == 2 && tok + 8 < a.M) atomicAdd(a.y + static_cast<int64_t>(tok + 8) * a.N + row, s.acc1[i]);
    s.acc0[i] = 0, s.acc1[i] = 0;
  }
}

template <int NT, bool NOMATH, bool FP8>
__device__ __forceinline__ void unit_math(const Args& a, Acc& s, const uint4 (&wr)[4]) {
  const int lane = threadIdx.x % 32, g = lane >> 2, c = lane & 3;
  const int64_t t = s.t;
  const int gi = s.gi;
  s.advance(a.G);
  if (t != s.cur) {
    if (s.cur >= 0) flush<NT>(a, s, s.cur);
    s.cur = t;
  }
  if (NOMATH) {
    s.x_or ^= wr[0].x ^ wr[1].y ^ wr[2].z ^ wr[3].w;
    return;
  }
  const uint8_t* xp = a.x + static_cast<int64_t>(g) * a.ldx + 128 * gi + 16 * c;
  uint4 b0[2], b1[2];
  b0[0] = g < a.M ? __ldg(reinterpret_cast<const uint4*>(xp)) : make_uint4(0, 0, 0, 0);
  b0[1] = g < a.M ? __ldg(reinterpret_cast<const uint4*>(xp + 64)) : make_uint4(0, 0, 0, 0);
  if (NT == 2) {
    b1[0] = g + 8 < a.M ? __ldg(reinterpret_cast<const uint4*>(xp + 8 * a.ldx)) : make_uint4(0, 0, 0, 0);
    b1[1] = g + 8 < a.M ? __ldg(reinterpret_cast<const uint4*>(xp + 8 * a.ldx + 64)) : make_uint4(0, 0, 0, 0);
  }
  if (!FP8) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t A0 = word(wr[j], 2 * h), A1 = word(wr[2 + j], 2 * h);
        const uint32_t A2 = word(wr[j], 2 * h + 1), A3 = word(wr[2 + j], 2 * h + 1);
        mma_bf16(s.acc0, A0, A1, A2, A3, word(b0[j], 2 * h), word(b0[j], 2 * h + 1));
        if (NT == 2) mma_bf16(s.acc1, A0, A1, A2, A3, word(b1[j], 2 * h), word(b1[j], 2 * h + 1));
      }
    return;
  }
  float d0[4] = {0, 0, 0, 0}, d1[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t A0 = word(wr[j], 2 * h), A1 = word(wr[2 + j], 2 * h);
      const uint32_t A2 = word(wr[j], 2 * h + 1), A3 = word(wr[2 + j], 2 * h + 1);
      mma_e4m3(d0, A0, A1, A2, A3, word(b0[j], 2 * h), word(b0[j], 2 * h + 1));
      if (NT == 2) mma_e4m3(d1, A0, A1, A2, A3, word(b1[j], 2 * h), word(b1[j], 2 * h + 1));
    }
  const float sw = __ldg(a.ws + (t * 16 / 128) * a.ldws + gi);
  const float* xg = a.xs + static_cast<int64_t>(gi) * a.ldxs;
  const float s0 = sw * __ldg(xg + 2 * c), s1 = sw * __ldg(xg + 2 * c + 1);
  s.acc0[0] += d0[0] * s0, s.acc0[1] += d0[1] * s1, s.acc0[2] += d0[2] * s0, s.acc0[3] += d0[3] * s1;
  if (NT == 2) {
    const float s2 = sw * __ldg(xg + 2 * c + 8), s3 = sw * __ldg(xg + 2 * c + 9);
    s.acc1[0] += d1[0] * s2, s.acc1[1] += d1[1] * s3, s.acc1[2] += d1[2] * s2, s.acc1[3] += d1[3] * s3;
  }
}

template <int NT, int DEPTH, bool PACKED, bool PIPE, bool NOMATH, int WARPS, bool FP8 = true>
__global__ void __launch_bounds__(WARPS * 32) gemv_kernel(Args a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, c = lane & 3;
  const int64_t wg = static_cast<int64_t>(blockIdx.x) * WARPS + warp, W = static_cast<int64_t>(gridDim.x) * WARPS;
  int64_t u0, u1;
  if (a.dist == 0) {
    u0 = a.units * wg / W;
    u1 = a.units * (wg + 1) / W;
  } else {
    u0 = wg * a.G;
    u1 = min(u0 + a.G, a.units);
  }
  Acc s;
  s.start(u0, a.G);
  auto load = [&](int64_t u, uint4 (&wr)[4]) {
    if (PACKED) {
      const uint8_t* p = a.w + u * 2048 + 16 * lane;
#pragma unroll
      for (int j = 0; j < 4; ++j) wr[j] = ld_stream(p + 512 * j);
    } else {
      const int64_t t = u / a.G, gi = u % a.G;
      const uint8_t* p = a.w + (16 * t + g) * a.ldx + 128 * gi + 16 * c;
      wr[0] = ld_stream(p);
      wr[1] = ld_stream(p + 64);
      wr[2] = ld_stream(p + 8 * static_cast<int64_t>(a.ldx));
      wr[3] = ld_stream(p + 8 * static_cast<int64_t>(a.ldx) + 64);
    }
  };
  auto math = [&](int64_t, const uint4 (&wr)[4]) { unit_math<NT, NOMATH, FP8>(a, s, wr); };
  if (PIPE) {
    uint4 bufA[DEPTH][4], bufB[DEPTH][4];
    int64_t u = u0;
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
      if (u + d < u1) load(u + d, bufA[d]);
    while (u < u1) {
#pragma unroll
      for (int d = 0; d < DEPTH; ++d)
        if (u + DEPTH + d < u1) load(u + DEPTH + d, bufB[d]);
#pragma unroll
      for (int d = 0; d < DEPTH; ++d)
        if (u + d < u1) math(u + d, bufA[d]);
      u += DEPTH;
      if (u >= u1) break;
#pragma unroll
      for (int d = 0; d < DEPTH; ++d)
        if (u + DEPTH + d < u1) load(u + DEPTH + d, bufA[d]);
#pragma unroll
      for (int d = 0; d < DEPTH; ++d)
        if (u + d < u1) math(u + d, bufB[d]);
      u += DEPTH;
    }
  } else {
    for (int64_t u = u0; u < u1; u += DEPTH) {
      uint4 buf[DEPTH][4];
#pragma unroll
      for (int d = 0; d < DEPTH; ++d)
        if (u + d < u1) load(u + d, buf[d]);
#pragma unroll
      for (int d = 0; d < DEPTH; ++d)
        if (u + d < u1) math(u + d, buf[d]);
    }
  }
  if (s.cur >= 0) flush<NT>(a, s, s.cur);
  if (s.x_or == 0x12345678u) *a.sink = s.x_or;
}

// Warp-specialized variant (docs/fp8.md's next design): one producer warp's lane 0 streams the packed units with
// bulk copies (cp.async.bulk, completion counted on an mbarrier) into a shared ring of S chunks per consumer warp
// (a chunk: CH consecutive units of that warp's stream-K run); the CW consumer warps only wait, read their
// fragments from shared memory (lane L's 16-byte pieces at 512 j + 16 L: conflict-free) and do the MMAs, then
// free the slot. HINT: the copies carry an L2 evict-first policy (probe_util.cuh's bulk_g2s / tma_2d).
template <int CW, int S, int CH>
constexpr int bulk_smem() {
  return CW * S * CH * 2048 + 2 * CW * S * 8;
}

template <int NT, int CW, int S, int CH, bool HINT, bool FP8 = true>
__global__ void __launch_bounds__((CW + 1) * 32) bulk_kernel(Args a) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + CW * S * CH * 2048);
  uint64_t* empty = full + CW * S;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < CW * S; ++i) mbar_init(full + i, 1), mbar_init(empty + i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int64_t W = static_cast<int64_t>(gridDim.x) * CW;
  if (warp == CW) {
    if (lane != 0) return;
    uint64_t policy = 0;
    if (HINT) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    int64_t u0[CW], n[CW];
    int64_t most = 0;
#pragma unroll
    for (int w = 0; w < CW; ++w) {
      const int64_t wg = static_cast<int64_t>(blockIdx.x) * CW + w;
      u0[w] = a.units * wg / W;
      n[w] = a.units * (wg + 1) / W - u0[w];
      most = max(most, (n[w] + CH - 1) / CH);
    }
    for (int64_t i = 0; i < most; ++i) {
#pragma unroll
      for (int w = 0; w < CW; ++w) {
        if (i * CH >= n[w]) continue;
        const int slot = w * S + static_cast<int>(i % S);
        if (i >= S) mbar_wait(empty + slot, static_cast<unsigned>((i / S - 1) & 1));
        const unsigned bytes = static_cast<unsigned>(min(static_cast<int64_t>(CH), n[w] - i * CH)) * 2048u;
        mbar_expect_tx(full + slot, bytes);
        bulk_g2s<HINT>(smem + slot * (CH * 2048), a.w + (u0[w] + i * CH) * 2048, bytes, full + slot, policy);
      }
    }
    return;
  }
  const int64_t wg = static_cast<int64_t>(blockIdx.x) * CW + warp;
  const int64_t u0 = a.units * wg / W, u1 = a.units * (wg + 1) / W;
  Acc s;
  s.start(u0, a.G);
  for (int64_t i = 0; u0 + i * CH < u1; ++i) {
    const int slot = warp * S + static_cast<int>(i % S);
    mbar_wait(full + slot, static_cast<unsigned>((i / S) & 1));
    const uint8_t* buf = smem + slot * (CH * 2048) + 16 * lane;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int64_t u = u0 + i * CH + k;
      if (u >= u1) break;
      uint4 wr[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) wr[j] = *reinterpret_cast<const uint4*>(buf + k * 2048 + 512 * j);
      unit_math<NT, false, FP8>(a, s, wr);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + slot);
  }
  if (s.cur >= 0) flush<NT>(a, s, s.cur);
}

// TMA variant: no repacking. The producer lane fetches each unit straight from the checkpoint layout with a 2-D
// tensor copy (box 128 bytes x 16 rows, 128-byte swizzle: 16-byte chunk q of row r lands at chunk q ^ (r % 8)),
// so the consumers' ldmatrix.x4 (8 rows of one chunk a matrix) is conflict-free and gives the mma's natural A
// fragments; x comes permuted (xperm_kernel, in dflash the activation quantizer's output layout) so each lane's
// B words of a group are 32 contiguous bytes.
__global__ void xperm_kernel(const uint8_t* x, uint8_t* xp, int M, int K) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // one 4-byte word of xp
  if (i >= static_cast<int64_t>(M) * K / 4) return;
  const int64_t m = i / (K / 4);
  const int o = static_cast<int>(i % (K / 4)) * 4, gi = o / 128, w = (o % 128) / 4;  // w = 8 c + 2 s + h
  const int c = w / 8, st = (w % 8) / 2, h = w % 2;
  *reinterpret_cast<uint32_t*>(xp + m * K + o) =
      *reinterpret_cast<const uint32_t*>(x + m * K + 128 * gi + 32 * st + 16 * h + 4 * c);
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <int NT>
__device__ __forceinline__ void unit_math_tma(const Args& a, Acc& s, uint32_t unit) {
  const int lane = threadIdx.x % 32, g = lane >> 2, c = lane & 3;
  const int64_t t = s.t;
  const int gi = s.gi;
  s.advance(a.G);
  if (t != s.cur) {
    if (s.cur >= 0) flush<NT>(a, s, s.cur);
    s.cur = t;
  }
  const uint8_t* xq = a.xp + static_cast<int64_t>(g) * a.ldx + 128 * gi + 32 * c;
  uint4 b0[2], b1[2];
  b0[0] = g < a.M ? __ldg(reinterpret_cast<const uint4*>(xq)) : make_uint4(0, 0, 0, 0);
  b0[1] = g < a.M ? __ldg(reinterpret_cast<const uint4*>(xq + 16)) : make_uint4(0, 0, 0, 0);
  if (NT == 2) {
    b1[0] = g + 8 < a.M ? __ldg(reinterpret_cast<const uint4*>(xq + 8 * a.ldx)) : make_uint4(0, 0, 0, 0);
    b1[1] = g + 8 < a.M ? __ldg(reinterpret_cast<const uint4*>(xq + 8 * a.ldx + 16)) : make_uint4(0, 0, 0, 0);
  }
  const int mi = lane >> 3, r = lane & 7, row = r + 8 * (mi & 1);
  float d0[4] = {0, 0, 0, 0}, d1[4] = {0, 0, 0, 0};
#pragma unroll
  for (int st = 0; st < 4; ++st) {
    const int chunk = 2 * st + (mi >> 1);
    uint32_t A[4];
    ldsm_x4(A, unit + row * 128 + ((chunk ^ r) << 4));
    const uint4& x0 = b0[st >> 1];
    mma_e4m3(d0, A[0], A[1], A[2], A[3], word(x0, 2 * (st & 1)), word(x0, 2 * (st & 1) + 1));
    if (NT == 2) {
      const uint4& x1 = b1[st >> 1];
      mma_e4m3(d1, A[0], A[1], A[2], A[3], word(x1, 2 * (st & 1)), word(x1, 2 * (st & 1) + 1));
    }
  }
  const float sw = __ldg(a.ws + (t * 16 / 128) * a.ldws + gi);
  const float* xg = a.xs + static_cast<int64_t>(gi) * a.ldxs;
  const float s0 = sw * __ldg(xg + 2 * c), s1 = sw * __ldg(xg + 2 * c + 1);
  s.acc0[0] += d0[0] * s0, s.acc0[1] += d0[1] * s1, s.acc0[2] += d0[2] * s0, s.acc0[3] += d0[3] * s1;
  if (NT == 2) {
    const float s2 = sw * __ldg(xg + 2 * c + 8), s3 = sw * __ldg(xg + 2 * c + 9);
    s.acc1[0] += d1[0] * s2, s.acc1[1] += d1[1] * s3, s.acc1[2] += d1[2] * s2, s.acc1[3] += d1[3] * s3;
  }
}

template <int CW, int S, int CH>
constexpr int tma_smem() {
  return 1024 + CW * S * CH * 2048 + 2 * CW * S * 8;
}

// SWZ false: the map without swizzle, x unpermuted; each lane reads its four 16-byte pieces with ld.shared.v4 (row
// g and g + 8, chunks c and 4 + c: the k order of gemv_kernel's fragments), 2-way bank conflicts per quarter warp.
template <int NT, int CW, int S, int CH, bool HINT, bool SWZ = true>
__global__ void __launch_bounds__((CW + 1) * 32) tma_kernel(Args a, const __grid_constant__ CUtensorMap tm) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + CW * S * CH * 2048);
  uint64_t* empty = full + CW * S;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < CW * S; ++i) mbar_init(full + i, 1), mbar_init(empty + i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int64_t W = static_cast<int64_t>(gridDim.x) * CW;
  if (warp == CW) {
    if (lane != 0) return;
    uint64_t policy = 0;
    if (HINT) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    // (Per warp: units left, and the next unit's tile row / group column kept by increments: the one producer
    // thread must not spend its time in 64-bit divisions.)
    int n[CW], row[CW], col[CW];
    int most = 0;
#pragma unroll
    for (int w = 0; w < CW; ++w) {
      const int64_t wg = static_cast<int64_t>(blockIdx.x) * CW + w;
      const int64_t u0 = a.units * wg / W;
      n[w] = static_cast<int>(a.units * (wg + 1) / W - u0);
      row[w] = static_cast<int>(16 * (u0 / a.G)), col[w] = static_cast<int>(128 * (u0 % a.G));
      most = max(most, (n[w] + CH - 1) / CH);
    }
    const int K = 128 * a.G;
    for (int i = 0, stage = 0, phase = 0; i < most; ++i) {
#pragma unroll
      for (int w = 0; w < CW; ++w) {
        if (n[w] <= 0) continue;
        const int slot = w * S + stage;
        if (i >= S) mbar_wait(empty + slot, static_cast<unsigned>(phase ^ 1));
        const int cnt = min(CH, n[w]);
        n[w] -= cnt;
        mbar_expect_tx(full + slot, static_cast<unsigned>(cnt) * 2048u);
#pragma unroll
        for (int k = 0; k < CH; ++k) {
          if (k >= cnt) break;
          tma_2d<HINT>(smem + (slot * CH + k) * 2048, &tm, col[w], row[w], full + slot, policy);
          col[w] += 128;
          if (col[w] == K) col[w] = 0, row[w] += 16;
        }
      }
      if (++stage == S) stage = 0, phase ^= 1;
    }
    return;
  }
  const int64_t wg = static_cast<int64_t>(blockIdx.x) * CW + warp;
  const int64_t u0 = a.units * wg / W, u1 = a.units * (wg + 1) / W;
  Acc s;
  s.start(u0, a.G);
  for (int64_t i = 0; u0 + i * CH < u1; ++i) {
    const int slot = warp * S + static_cast<int>(i % S);
    mbar_wait(full + slot, static_cast<unsigned>((i / S) & 1));
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int64_t u = u0 + i * CH + k;
      if (u >= u1) break;
      if (SWZ) {
        unit_math_tma<NT>(a, s, saddr(smem + (slot * CH + k) * 2048));
      } else {
        const uint8_t* p = smem + (slot * CH + k) * 2048 + (lane >> 2) * 128 + 16 * (lane & 3);
        uint4 wr[4];
        wr[0] = *reinterpret_cast<const uint4*>(p);
        wr[1] = *reinterpret_cast<const uint4*>(p + 64);
        wr[2] = *reinterpret_cast<const uint4*>(p + 1024);
        wr[3] = *reinterpret_cast<const uint4*>(p + 1024 + 64);
        unit_math<NT, false, true>(a, s, wr);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + slot);
  }
  if (s.cur >= 0) flush<NT>(a, s, s.cur);
}

static bool g_map_swizzle = true;  // the next run's tensor maps (tma_kernel's SWZ)

static CUtensorMap weight_map(const uint8_t* w, int N, int K) { return byte_matrix_map(w, N, K, 16, g_map_swizzle); }

struct Shape {
  const char* name;
  int N, K;
};

static float time_ms(cudaEvent_t e0, cudaEvent_t e1) {
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  return ms;
}

int main(int argc, char** argv) {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  sms = prop.multiProcessorCount;
  std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
  const int reps = 20;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  unsigned* sink;
  CK(cudaMalloc(&sink, 4));
  // Copy roofline.
  {
    const size_t bytes = size_t{1} << 30;
    void *s, *d;
    CK(cudaMalloc(&s, bytes));
    CK(cudaMalloc(&d, bytes));
    CK(cudaMemset(s, 1, bytes));
    float best = 1e9;
    for (int r = 0; r < 6; ++r) {
      CK(cudaEventRecord(e0));
      CK(cudaMemcpy(d, s, bytes, cudaMemcpyDeviceToDevice));
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      best = std::min(best, time_ms(e0, e1));
    }
    std::printf("copy 1 GiB: %.0f GB/s (read + write)\n", 2.0 * bytes / best / 1e6);
    CK(cudaFree(s));
    CK(cudaFree(d));
  }
  const std::vector<Shape> shapes = {{"gate_up", 34816, 5120}, {"down", 5120, 17408}, {"gdn_in", 16384, 5120},
                                     {"attn_qkv", 14336, 5120}, {"gdn_out", 5120, 6144}};
  std::vector<int> Ms = {1, 16};
  if (argc > 1) Ms = {std::atoi(argv[1])};
  const size_t nshapes = argc > 2 ? static_cast<size_t>(std::atoi(argv[2])) : shapes.size();  // the first n shapes
  const bool do_bf16 = argc > 3 ? std::atoi(argv[3]) != 0 : true;
  for (int pass = 0; pass < (do_bf16 ? 2 : 1); ++pass) {
  const bool fp8 = pass == 0;
  std::printf("== %s weights\n", fp8 ? "e4m3 (128 x 128 block scales)" : "bf16");
  for (size_t si = 0; si < std::min(nshapes, shapes.size()); ++si) {
    const Shape& sh = shapes[si];
    const int N = sh.N, K = sh.K, RB = fp8 ? K : 2 * K, G = RB / 128;
    const size_t wbytes = static_cast<size_t>(N) * RB;
    const int copies = static_cast<int>(std::max<size_t>(2, (size_t{400} << 20) / wbytes + 1));
    uint8_t *w, *wp, *x;
    float *ws, *xs, *y, *yref;
    CK(cudaMalloc(&w, wbytes * copies));
    CK(cudaMalloc(&wp, wbytes * copies));
    const int ldws = (G + 3) / 4 * 4, ldxs = 16;
    CK(cudaMalloc(&ws, sizeof(float) * ldws * ((N + 127) / 128)));
    CK(cudaMalloc(&x, 16 * RB));
    uint8_t* xpm;
    CK(cudaMalloc(&xpm, 16 * RB));
    CK(cudaMalloc(&xs, sizeof(float) * ldxs * G));
    CK(cudaMalloc(&y, sizeof(float) * 16 * N));
    CK(cudaMalloc(&yref, sizeof(float) * 16 * N));
    {
      std::vector<uint8_t> hw(wbytes), hx(16 * RB);
      uint32_t s = 12345u + N;
      auto rnd = [&] {
        s = s * 1664525u + 1013904223u;
        return s >> 8;
      };
      auto code = [&] {
        uint8_t v = static_cast<uint8_t>(rnd());
        v &= 0xBF;  // e4m3: |value| < 2 (exponent bit 3 clear), no NaN codes
        return v;
      };
      auto fill = [&](std::vector<uint8_t>& v) {
        if (fp8) {
          for (auto& b : v) b = code();
        } else {  // bf16 in (-1, 1): sign, exponent 112..126, random mantissa
          for (size_t i = 0; i + 1 < v.size(); i += 2) {
            const uint32_t r = rnd();
            const uint32_t bits = ((r & 1u) << 15) | ((112u + (r >> 1) % 15u) << 7) | ((r >> 5) & 127u);
            v[i] = static_cast<uint8_t>(bits & 255u), v[i + 1] = static_cast<uint8_t>(bits >> 8);
          }
        }
      };
      fill(hw);
      fill(hx);
      std::vector<float> hws(ldws * ((N + 127) / 128)), hxs(ldxs * G);
      for (auto& v : hws) v = 0.5f + (rnd() % 1000) / 1000.0f;
      for (auto& v : hxs) v = 0.5f + (rnd() % 1000) / 1000.0f;
      for (int c = 0; c < copies; ++c) CK(cudaMemcpy(w + c * wbytes, hw.data(), wbytes, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(x, hx.data(), hx.size(), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(ws, hws.data(), hws.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(xs, hxs.data(), hxs.size() * 4, cudaMemcpyHostToDevice));
      for (int c = 0; c < copies; ++c)
        pack_kernel<<<static_cast<unsigned>((wbytes / 16 + 255) / 256), 256>>>(w + c * wbytes, wp + c * wbytes, N, RB);
      if (fp8) xperm_kernel<<<(16 * RB / 4 + 255) / 256, 256>>>(x, xpm, 16, K);
      CK(cudaGetLastError());
    }
    // Read roofline on these bytes.
    {
      float best = 1e9;
      for (int r = 0; r < reps; ++r) {
        const uint8_t* src = w + (r % copies) * wbytes;
        CK(cudaEventRecord(e0));
        read_kernel<<<sms * 8, 256>>>(src, static_cast<int64_t>(wbytes), sink);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        if (r > 1) best = std::min(best, time_ms(e0, e1));
      }
      std::printf("%-9s N %5d K %5d  %6.1f MB  read            %7.1f us  %5.0f GB/s\n", sh.name, N, K, wbytes / 1e6,
                  best * 1e3, wbytes / best / 1e6);
    }
    for (int M : Ms) {
      if (fp8)
        ref_kernel<<<(N + 127) / 128, 128>>>(x, xs, ldxs, w, ws, ldws, yref, M, N, K);
      else
        ref_bf16_kernel<<<(N + 127) / 128, 128>>>(x, w, yref, M, N, K);
      CK(cudaGetLastError());
      std::vector<float> href(static_cast<size_t>(M) * N), hy(static_cast<size_t>(M) * N);
      CK(cudaMemcpy(href.data(), yref, href.size() * 4, cudaMemcpyDeviceToHost));
      auto run = [&](const char* label, auto kernel, bool packed, int dist, int warps, bool check, int smem = 0) {
        Args a{};
        a.x = x, a.ldx = RB, a.xs = xs, a.ldxs = ldxs, a.ws = ws, a.ldws = ldws, a.y = y, a.M = M, a.N = N, a.K = K,
        a.G = G, a.units = static_cast<int64_t>(N / 16) * G, a.dist = dist, a.sink = sink, a.xp = xpm;
        constexpr bool tma = std::is_invocable_v<decltype(kernel), Args, CUtensorMap>;
        std::vector<CUtensorMap> maps;
        if constexpr (tma)
          for (int c = 0; c < copies; ++c) maps.push_back(weight_map(w + c * wbytes, N, K));
        int occ = 0;
        if (smem > 48 * 1024) CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, warps * 32, smem));
        const unsigned grid = dist == 0 ? static_cast<unsigned>(sms * occ) : static_cast<unsigned>((N / 16 + warps - 1) / warps);
        float best = 1e9, sum = 0;
        int cnt = 0;
        for (int r = 0; r < reps; ++r) {
          a.w = (packed ? wp : w) + (r % copies) * wbytes;
          CK(cudaMemsetAsync(y, 0, sizeof(float) * M * N));
          CK(cudaEventRecord(e0));
          if constexpr (tma)
            kernel<<<grid, warps * 32, smem>>>(a, maps[r % copies]);
          else
            kernel<<<grid, warps * 32, smem>>>(a);
          CK(cudaEventRecord(e1));
          CK(cudaEventSynchronize(e1));
          CK(cudaGetLastError());
          if (r > 1) {
            const float t = time_ms(e0, e1);
            best = std::min(best, t), sum += t, ++cnt;
          }
        }
        double err = -1;
        if (check) {
          CK(cudaMemcpy(hy.data(), y, hy.size() * 4, cudaMemcpyDeviceToHost));
          double num = 0, den = 0;
          for (size_t i = 0; i < hy.size(); ++i) {
            num = std::max(num, static_cast<double>(std::fabs(hy[i] - href[i])));
            den = std::max(den, static_cast<double>(std::fabs(href[i])));
          }
          err = num / std::max(den, 1e-30);
        }
        std::printf("%-9s N %5d K %5d  M %2d  %-34s occ %d grid %4u  best %7.1f us  %5.0f GB/s  mean %5.0f GB/s  err %.1e\n",
                    sh.name, N, K, M, label, occ, grid, best * 1e3, wbytes / best / 1e6, wbytes / (sum / cnt) / 1e6, err);
      };
      if (!fp8) {
        if (M <= 8) {
          run("af49b75 grid d4", gemv_kernel<1, 4, false, false, false, 8, false>, false, 1, 8, true);
          run("streamK d4", gemv_kernel<1, 4, false, false, false, 8, false>, false, 0, 8, true);
          run("streamK d2 pipe", gemv_kernel<1, 2, false, true, false, 8, false>, false, 0, 8, true);
          run("packed streamK d4", gemv_kernel<1, 4, true, false, false, 8, false>, true, 0, 8, true);
          run("packed streamK d2 pipe", gemv_kernel<1, 2, true, true, false, 8, false>, true, 0, 8, true);
        } else {
          run("af49b75 grid d4", gemv_kernel<2, 4, false, false, false, 8, false>, false, 1, 8, true);
          run("streamK d4", gemv_kernel<2, 4, false, false, false, 8, false>, false, 0, 8, true);
          run("streamK d2 pipe", gemv_kernel<2, 2, false, true, false, 8, false>, false, 0, 8, true);
          run("packed streamK d4", gemv_kernel<2, 4, true, false, false, 8, false>, true, 0, 8, true);
          run("packed streamK d2 pipe", gemv_kernel<2, 2, true, true, false, 8, false>, true, 0, 8, true);
          run("bulk cw8 s4 ch2", bulk_kernel<2, 8, 4, 2, false, false>, true, 0, 9, true, bulk_smem<8, 4, 2>());
        }
        continue;
      }
      if (M <= 8) {
        run("af49b75 grid d4", gemv_kernel<1, 4, false, false, false, 8>, false, 1, 8, true);
        run("streamK d4", gemv_kernel<1, 4, false, false, false, 8>, false, 0, 8, true);
        run("streamK d2 pipe", gemv_kernel<1, 2, false, true, false, 8>, false, 0, 8, true);
        run("streamK d4 pipe", gemv_kernel<1, 4, false, true, false, 8>, false, 0, 8, true);
        run("streamK d8", gemv_kernel<1, 8, false, false, false, 8>, false, 0, 8, true);
        run("packed streamK d4", gemv_kernel<1, 4, true, false, false, 8>, true, 0, 8, true);
        run("packed streamK d2 pipe", gemv_kernel<1, 2, true, true, false, 8>, true, 0, 8, true);
        run("packed streamK d4 pipe", gemv_kernel<1, 4, true, true, false, 8>, true, 0, 8, true);
        run("packed streamK d8", gemv_kernel<1, 8, true, false, false, 8>, true, 0, 8, true);
        run("nomath streamK d4", gemv_kernel<1, 4, false, false, true, 8>, false, 0, 8, false);
        run("nomath packed streamK d4", gemv_kernel<1, 4, true, false, true, 8>, true, 0, 8, false);
        run("packed streamK d4 w4", gemv_kernel<1, 4, true, false, false, 4>, true, 0, 4, true);
        run("bulk cw8 s4 ch2", bulk_kernel<1, 8, 4, 2, false>, true, 0, 9, true, bulk_smem<8, 4, 2>());
        run("tma cw8 s4 ch2", tma_kernel<1, 8, 4, 2, false>, false, 0, 9, true, tma_smem<8, 4, 2>());
        run("bulk cw8 s4 ch2 evict-first", bulk_kernel<1, 8, 4, 2, true>, true, 0, 9, true, bulk_smem<8, 4, 2>());
      } else {
        run("af49b75 grid d4", gemv_kernel<2, 4, false, false, false, 8>, false, 1, 8, true);
        run("streamK d4", gemv_kernel<2, 4, false, false, false, 8>, false, 0, 8, true);
        run("streamK d2 pipe", gemv_kernel<2, 2, false, true, false, 8>, false, 0, 8, true);
        run("streamK d4 pipe", gemv_kernel<2, 4, false, true, false, 8>, false, 0, 8, true);
        run("packed streamK d4", gemv_kernel<2, 4, true, false, false, 8>, true, 0, 8, true);
        run("packed streamK d2 pipe", gemv_kernel<2, 2, true, true, false, 8>, true, 0, 8, true);
        run("packed streamK d4 pipe", gemv_kernel<2, 4, true, true, false, 8>, true, 0, 8, true);
        run("packed streamK d8", gemv_kernel<2, 8, true, false, false, 8>, true, 0, 8, true);
        run("packed streamK d4 w4", gemv_kernel<2, 4, true, false, false, 4>, true, 0, 4, true);
        run("bulk cw8 s4 ch2", bulk_kernel<2, 8, 4, 2, false>, true, 0, 9, true, bulk_smem<8, 4, 2>());
        run("tma cw8 s4 ch2", tma_kernel<2, 8, 4, 2, false>, false, 0, 9, true, tma_smem<8, 4, 2>());
        run("tma cw8 s4 ch2 evict-first", tma_kernel<2, 8, 4, 2, true>, false, 0, 9, true, tma_smem<8, 4, 2>());
        g_map_swizzle = false;
        run("tma-noswz cw8 s4 ch2", tma_kernel<2, 8, 4, 2, false, false>, false, 0, 9, true, tma_smem<8, 4, 2>());
        run("tma-noswz cw8 s8 ch1", tma_kernel<2, 8, 8, 1, false, false>, false, 0, 9, true, tma_smem<8, 8, 1>());
        g_map_swizzle = true;
        run("tma cw8 s8 ch1", tma_kernel<2, 8, 8, 1, false>, false, 0, 9, true, tma_smem<8, 8, 1>());
        run("tma cw4 s4 ch4", tma_kernel<2, 4, 4, 4, false>, false, 0, 5, true, tma_smem<4, 4, 4>());
        run("tma cw12 s3 ch2", tma_kernel<2, 12, 3, 2, false>, false, 0, 13, true, tma_smem<12, 3, 2>());
        run("tma cw4 s3 ch2 (2+ blocks/SM)", tma_kernel<2, 4, 3, 2, false>, false, 0, 5, true, tma_smem<4, 3, 2>());
        run("bulk cw8 s4 ch2 evict-first", bulk_kernel<2, 8, 4, 2, true>, true, 0, 9, true, bulk_smem<8, 4, 2>());
        run("bulk cw8 s8 ch1", bulk_kernel<2, 8, 8, 1, false>, true, 0, 9, true, bulk_smem<8, 8, 1>());
        run("bulk cw4 s4 ch4", bulk_kernel<2, 4, 4, 4, false>, true, 0, 5, true, bulk_smem<4, 4, 4>());
        run("bulk cw4 s2 ch4 (2 blocks/SM)", bulk_kernel<2, 4, 2, 4, false>, true, 0, 5, true, bulk_smem<4, 2, 4>());
        run("bulk cw12 s3 ch2", bulk_kernel<2, 12, 3, 2, false>, true, 0, 13, true, bulk_smem<12, 3, 2>());
        run("bulk cw8 s2 ch2 (2 blocks/SM)", bulk_kernel<2, 8, 2, 2, false>, true, 0, 9, true, bulk_smem<8, 2, 2>());
      }
    }
    CK(cudaFree(w));
    CK(cudaFree(wp));
    CK(cudaFree(ws));
    CK(cudaFree(x));
    CK(cudaFree(xpm));
    CK(cudaFree(xs));
    CK(cudaFree(y));
    CK(cudaFree(yref));
  }
  }
  return 0;
}
