// Training kernels other than GEMM, block attention and the fused linear CE (see train_launch.h):
// casts, the residual add, embedding into the fp32 stream, RMSNorm and per-head RMSNorm + RoPE
// forward / backward, SwiGLU backward, the deterministic sum of squares, AdamW and the clip factor.
//
// Roofline. All of these are bound by HBM bandwidth (~4.8 TB/s on H200); minimum traffic:
//   cast_bf16_f32 / cast_f32_bf16   6 bytes per element
//   add_into_f32                    h read + written, d read: 10 (bf16 d) or 12 (fp32 d) bytes
//   embedding_f32                   2·D read + 4·D written per row
//   rms_norm_fwd                    x (2 or 4)·D read, 2·D written
//   rms_norm_bwd                    x, dy read, dx read + written (fp32 accumulate): ~14·D per row,
//                                   plus the dw partials (P·D·4 bytes, P <= kDwParts CTAs)
//   head_norm_rope_fwd / bwd        4·heads·d (fwd), 6·heads·d (bwd) per row, + one sincosf per
//                                   (row, head, frequency)
//   swiglu_bwd                      gu 4·I + dm 2·I read, dgu 4·I written
//   sum_squares                     4 bytes per element
//   adamw_step                      master, m, v read + written, grad read, weight written: 30 bytes
// The kernels are simple coalesced loops (16-byte accesses where the pointers allow); the row
// kernels keep nothing in registers across passes and reread the row (from L1/L2) instead.
//
// Determinism. Weight gradients (dw of the norms) and sum_squares never use float atomics: a FIXED
// number of CTAs (a function of the shape only, not of the GPU) each own a fixed set of rows and
// write one partial vector; a second kernel adds the partials in index order. So two runs of the
// same shape give bitwise equal results on any GPU. The partial buffers of the norms come from the
// caching device allocator (stream-ordered: released right after the launches, reused only by
// later work on the same stream).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/cuda/train_launch.h"
#include "kernels/device.h"
#include "kernels/error.h"

namespace dflash::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kDwParts = 512;        // max CTAs (partials) of the norm backward kernels
constexpr int kSsParts = 1024;       // max CTAs (partials) of sum_squares
constexpr int kMaxHeadHalf = 128;    // head_norm_rope: d <= 256 (4 rotary pairs per lane)
constexpr int kPairsPerLane = kMaxHeadHalf / 32;
constexpr int kHeadWarps = kThreads / 32;
constexpr int64_t kMaxNormD = 12288;  // rms_norm_bwd: a thread keeps D / kThreads dw partials in registers

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

unsigned blocks_for(int64_t work, int64_t per_block, int64_t cap = int64_t{1} << 20) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((work + per_block - 1) / per_block, cap)));
}

__device__ __forceinline__ float ld_f(const float* p) { return *p; }
__device__ __forceinline__ float ld_f(const bf16* p) { return __bfloat162float(*p); }

// 8 consecutive elements (16-byte aligned for bf16, 32-byte region for fp32) as floats.
__device__ __forceinline__ void load8(const bf16* p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void store8(bf16* p, const float (&v)[8]) {
  uint4 raw;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}
__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block (kThreads threads, all must call); red holds kThreads/32 values. The leading
// barrier makes repeated calls (one per row) safe. Fixed order: deterministic.
template <class T>
__device__ __forceinline__ T block_sum(T v, T* red) {
  v = warp_sum(v);
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  T s = 0;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) s += red[i];
  return s;
}

// A stream-ordered scratch buffer from the caching allocator of the current device.
class Scratch {
 public:
  explicit Scratch(size_t bytes) {
    DFLASH_CUDA_CHECK(cudaGetDevice(&device_));
    ptr_ = device_alloc::allocate(bytes, device_);
  }
  ~Scratch() { device_alloc::release(ptr_, device_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  float* f32() const { return static_cast<float*>(ptr_); }

 private:
  int device_ = 0;
  void* ptr_ = nullptr;
};

// dw[c] += Σ_p partial[p, c] for p = 0 .. parts-1 in order.
__global__ void reduce_partials_kernel(const float* __restrict__ partial, int parts, int64_t D,
                                       float* __restrict__ dw) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= D) return;
  float s = 0.0f;
  for (int p = 0; p < parts; ++p) s += partial[p * D + c];
  dw[c] += s;
}

// ---- elementwise --------------------------------------------------------------------------------

// Units of 8 elements when VEC (pointers 16-byte aligned, n8 = number of full units), then the
// scalar tail; any n and alignment with VEC false (units of 1).
template <class Src, class Dst, class F>
__device__ __forceinline__ void pointwise(const Src* x, Dst* y, int64_t n, bool vec, F f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (vec) {
    const int64_t units = n / 8;
    for (int64_t u = t0; u < units; u += stride) {
      float v[8], o[8];
      load8(x + u * 8, v);
      f(u * 8, v, o);
      store8(y + u * 8, o);
    }
    done = units * 8;
  }
  for (int64_t i = done + t0; i < n; i += stride) {
    float v[8] = {ld_f(x + i)}, o[8];
    f(i, v, o);  // only element 0 is meaningful here
    if constexpr (sizeof(Dst) == 4) y[i] = o[0];
    else y[i] = __float2bfloat16_rn(o[0]);
  }
}

__global__ void cast_bf16_f32_kernel(const bf16* x, float* y, int64_t n, bool vec) {
  pointwise(x, y, n, vec, [](int64_t, const float (&v)[8], float (&o)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = v[e];
  });
}
__global__ void cast_f32_bf16_kernel(const float* x, bf16* y, int64_t n, bool vec) {
  pointwise(x, y, n, vec, [](int64_t, const float (&v)[8], float (&o)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = v[e];
  });
}
// h += d: pointwise reads d and h (through the lambda) and writes h.
template <class T>
__global__ void add_into_kernel(float* h, const T* d, int64_t n, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (vec) {
    const int64_t units = n / 8;
    for (int64_t u = t0; u < units; u += stride) {
      float a[8], b[8];
      load8(h + u * 8, a);
      load8(d + u * 8, b);
#pragma unroll
      for (int e = 0; e < 8; ++e) a[e] += b[e];
      store8(h + u * 8, a);
    }
    done = units * 8;
  }
  for (int64_t i = done + t0; i < n; i += stride) h[i] += ld_f(d + i);
}

__global__ void embedding_f32_kernel(const int32_t* __restrict__ ids, const bf16* __restrict__ table,
                                     float* __restrict__ h, int64_t rows, int64_t D, bool vec) {
  const int64_t r = blockIdx.x;
  const bf16* src = table + static_cast<int64_t>(ids[r]) * D;
  float* dst = h + r * D;
  if (vec) {
    for (int64_t u = threadIdx.x; u < D / 8; u += blockDim.x) {
      float v[8];
      load8(src + u * 8, v);
      store8(dst + u * 8, v);
    }
  } else {
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) dst[i] = __bfloat162float(src[i]);
  }
}

// ---- RMSNorm ------------------------------------------------------------------------------------

// W consecutive elements as floats: W == 8 uses 16-byte accesses (aligned), W == 1 is scalar.
template <int W, class T>
__device__ __forceinline__ void loadw(const T* p, float (&v)[W]) {
  if constexpr (W == 8) load8(p, v);
  else v[0] = ld_f(p);
}
template <int W, class T>
__device__ __forceinline__ void storew(T* p, const float (&v)[W]) {
  if constexpr (W == 8) store8(p, v);
  else if constexpr (sizeof(T) == 4) *p = v[0];
  else *p = __float2bfloat16_rn(v[0]);
}

// One block per row; thread t owns units t, t + kThreads, ... of W elements.
template <int W, class T>
__global__ void __launch_bounds__(kThreads) rms_norm_fwd_kernel(const T* __restrict__ x, int64_t ldx,
                                                                const bf16* __restrict__ w, bf16* __restrict__ y,
                                                                float* __restrict__ rstd, int64_t D, float eps) {
  __shared__ float red[kThreads / 32];
  const int64_t r = blockIdx.x, units = D / W;
  const T* xr = x + r * ldx;
  float ss = 0.0f;
  for (int64_t u = threadIdx.x; u < units; u += kThreads) {
    float v[W];
    loadw<W>(xr + u * W, v);
#pragma unroll
    for (int e = 0; e < W; ++e) ss += v[e] * v[e];
  }
  ss = block_sum(ss, red);
  const float rs = rsqrtf(ss / static_cast<float>(D) + eps);
  bf16* yr = y + r * D;
  for (int64_t u = threadIdx.x; u < units; u += kThreads) {
    float v[W], g[W];
    loadw<W>(xr + u * W, v);
    loadw<W>(w + u * W, g);
#pragma unroll
    for (int e = 0; e < W; ++e) v[e] = v[e] * rs * g[e];
    storew<W>(yr + u * W, v);
  }
  if (threadIdx.x == 0) rstd[r] = rs;
}

// Grid of `parts` CTAs; CTA b handles rows b, b + parts, ... in order and writes its dw partial
// (Σ over its rows of dy · x̂) to partial[b, :]. Thread t owns units t + k·kThreads (k < kU) of W
// columns, the same in every row, so it keeps its dw partial in registers.
template <int W, class T>
__global__ void __launch_bounds__(kThreads) rms_norm_bwd_kernel(const T* __restrict__ x, int64_t ldx,
                                                                const bf16* __restrict__ w,
                                                                const float* __restrict__ rstd,
                                                                const bf16* __restrict__ dy, float* dx,
                                                                bf16* dx_bf16, bf16* dx_copy,
                                                                float* __restrict__ partial, int64_t rows,
                                                                int64_t D) {
  constexpr int kU = static_cast<int>(kMaxNormD / (W * kThreads));
  __shared__ float red[kThreads / 32];
  const int64_t units = D / W;
  float dwr[kU][W];
#pragma unroll
  for (int k = 0; k < kU; ++k)
#pragma unroll
    for (int e = 0; e < W; ++e) dwr[k][e] = 0.0f;
  const float invD = 1.0f / static_cast<float>(D);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * ldx;
    const bf16* gr = dy + r * D;
    const float rs = rstd[r];
    float s = 0.0f;  // Σ x̂ · w·dy
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      const int64_t u = threadIdx.x + k * kThreads;
      if (u < units) {
        float xv[W], wv[W], gv[W];
        loadw<W>(xr + u * W, xv);
        loadw<W>(w + u * W, wv);
        loadw<W>(gr + u * W, gv);
#pragma unroll
        for (int e = 0; e < W; ++e) s += xv[e] * rs * wv[e] * gv[e];
      }
    }
    const float c = block_sum(s, red) * invD;
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      const int64_t u = threadIdx.x + k * kThreads;
      if (u < units) {
        float xv[W], wv[W], gv[W], d[W] = {};
        loadw<W>(xr + u * W, xv);
        loadw<W>(w + u * W, wv);
        loadw<W>(gr + u * W, gv);
        const int64_t at = r * D + u * W;
        if (dx != nullptr) loadw<W>(dx + at, d);
#pragma unroll
        for (int e = 0; e < W; ++e) {
          const float xh = xv[e] * rs;
          dwr[k][e] += gv[e] * xh;
          d[e] += rs * (wv[e] * gv[e] - xh * c);
        }
        if (dx != nullptr) storew<W>(dx + at, d);
        else storew<W>(dx_bf16 + at, d);
        if (dx_copy != nullptr) storew<W>(dx_copy + at, d);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kU; ++k) {
    const int64_t u = threadIdx.x + k * kThreads;
    if (u < units) storew<W>(partial + blockIdx.x * D + u * W, dwr[k]);
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

// ---- SwiGLU backward ------------------------------------------------------------------------------

__device__ __forceinline__ void swiglu_grad(float g, float u, float dm, float& dg, float& du) {
  const float sg = 1.0f / (1.0f + expf(-g));
  dg = dm * u * sg * (1.0f + g * (1.0f - sg));
  du = dm * g * sg;
}

// Units of W elements of a row (W = 8: I % 8 == 0 and aligned pointers).
template <int W>
__global__ void swiglu_bwd_kernel(const bf16* __restrict__ gu, const bf16* __restrict__ dm, bf16* __restrict__ dgu,
                                  int64_t rows, int64_t I) {
  const int64_t upr = I / W, units = rows * upr;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < units;
       u += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = u / upr, c = (u - r * upr) * W;
    const bf16* gr = gu + r * 2 * I;
    bf16* dr = dgu + r * 2 * I;
    if constexpr (W == 8) {
      float g[8], v[8], m[8], dg[8], du[8];
      load8(gr + c, g);
      load8(gr + I + c, v);
      load8(dm + r * I + c, m);
#pragma unroll
      for (int e = 0; e < 8; ++e) swiglu_grad(g[e], v[e], m[e], dg[e], du[e]);
      store8(dr + c, dg);
      store8(dr + I + c, du);
    } else {
      float dg, du;
      swiglu_grad(__bfloat162float(gr[c]), __bfloat162float(gr[I + c]), __bfloat162float(dm[r * I + c]), dg, du);
      dr[c] = __float2bfloat16_rn(dg);
      dr[I + c] = __float2bfloat16_rn(du);
    }
  }
}

// ---- optimizer --------------------------------------------------------------------------------------

// Block b sums x[i]² (in double) over i = b·kThreads + t + j·parts·kThreads, then reduces in fixed
// order and writes partial[b].
__global__ void __launch_bounds__(kThreads) sum_squares_kernel(const float* __restrict__ x, int64_t n,
                                                               double* __restrict__ partial) {
  __shared__ double red[kThreads / 32];
  double s = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const double v = x[i];
    s += v * v;
  }
  s = block_sum(s, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
__global__ void __launch_bounds__(kThreads) sum_partials_kernel(const double* __restrict__ partial, int parts,
                                                                float* __restrict__ out) {
  __shared__ double red[kThreads / 32];
  double s = 0.0;
  for (int i = threadIdx.x; i < parts; i += kThreads) s += partial[i];
  s = block_sum(s, red);
  if (threadIdx.x == 0) *out = static_cast<float>(s);
}

struct AdamArgs {
  float* master;
  const float* grad;
  float* m;
  float* v;
  bf16* weight;
  int64_t n;
  float lr, beta1, beta2, eps, wd;
  float bc1, bc2;  // 1 − β^step (host, double, rounded)
  const float* grad_scale;
  float grad_scale_host;
};
__global__ void adamw_kernel(const AdamArgs a) {
  const float scale = a.grad_scale_host * (a.grad_scale != nullptr ? *a.grad_scale : 1.0f);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = a.grad[i] * scale;
    const float m = a.beta1 * a.m[i] + (1.0f - a.beta1) * g;
    const float v = a.beta2 * a.v[i] + (1.0f - a.beta2) * g * g;
    a.m[i] = m;
    a.v[i] = v;
    float p = a.master[i];
    p -= a.lr * (a.wd * p + (m / a.bc1) / (sqrtf(v / a.bc2) + a.eps));
    a.master[i] = p;
    if (a.weight != nullptr) a.weight[i] = __float2bfloat16_rn(p);
  }
}

__global__ void clip_factor_kernel(const float* sumsq, float max_norm, float* scale, float* norm) {
  const float s = *sumsq;
  if (!isfinite(s)) {
    *scale = 0.0f;
    *norm = s;
    return;
  }
  const float nrm = sqrtf(s);
  *norm = nrm;
  *scale = max_norm <= 0.0f ? 1.0f : fminf(1.0f, max_norm / (nrm + 1e-6f));
}

// ---- helpers for gemm.cpp ----------------------------------------------------------------------------

template <class T>
__global__ void scale_matrix_kernel(T* d, int64_t M, int64_t N, int64_t ldd, float beta) {
  const int64_t total = M * N;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / N, c = i - r * N;
    T* p = d + r * ldd + c;
    const float v = beta == 0.0f ? 0.0f : ld_f(p) * beta;  // beta 0 never reads D
    if constexpr (sizeof(T) == 4) *p = v;
    else *p = __float2bfloat16_rn(v);
  }
}

}  // namespace

// D = beta · D over a row-major [M, N] view (row stride ldd); gemm_ex's K == 0 case.
namespace detail {
void scale_matrix(void* d, bool d_f32, int64_t M, int64_t N, int64_t ldd, float beta, Stream s) {
  if (M == 0 || N == 0 || beta == 1.0f) return;
  const auto st = static_cast<cudaStream_t>(s);
  const unsigned grid = blocks_for(M * N, kThreads, 4096);
  if (d_f32) scale_matrix_kernel<float><<<grid, kThreads, 0, st>>>(static_cast<float*>(d), M, N, ldd, beta);
  else scale_matrix_kernel<bf16><<<grid, kThreads, 0, st>>>(static_cast<bf16*>(d), M, N, ldd, beta);
  DFLASH_CUDA_CHECK_LAST();
}
}  // namespace detail

// ---- launchers -------------------------------------------------------------------------------------------

void cast_bf16_f32(const void* x, float* y, int64_t n, Stream s) {
  DFLASH_CHECK(n >= 0, "cast_bf16_f32: need n >= 0, got n=" << n);
  if (n == 0) return;
  DFLASH_CHECK(x != nullptr && y != nullptr, "cast_bf16_f32: null pointer (x=" << x << " y=" << y << ") for n=" << n);
  const bool vec = aligned16(x) && aligned16(y);
  cast_bf16_f32_kernel<<<blocks_for(n, kThreads * 8, 8192), kThreads, 0, static_cast<cudaStream_t>(s)>>>(
      static_cast<const bf16*>(x), y, n, vec);
  DFLASH_CUDA_CHECK_LAST();
}

void cast_f32_bf16(const float* x, void* y, int64_t n, Stream s) {
  DFLASH_CHECK(n >= 0, "cast_f32_bf16: need n >= 0, got n=" << n);
  if (n == 0) return;
  DFLASH_CHECK(x != nullptr && y != nullptr, "cast_f32_bf16: null pointer (x=" << x << " y=" << y << ") for n=" << n);
  const bool vec = aligned16(x) && aligned16(y);
  cast_f32_bf16_kernel<<<blocks_for(n, kThreads * 8, 8192), kThreads, 0, static_cast<cudaStream_t>(s)>>>(
      x, static_cast<bf16*>(y), n, vec);
  DFLASH_CUDA_CHECK_LAST();
}

void add_into_f32(float* h, const void* d, bool d_f32, int64_t n, Stream s) {
  DFLASH_CHECK(n >= 0, "add_into_f32: need n >= 0, got n=" << n);
  if (n == 0) return;
  DFLASH_CHECK(h != nullptr && d != nullptr, "add_into_f32: null pointer (h=" << h << " d=" << d << ") for n=" << n);
  const bool vec = aligned16(h) && aligned16(d);
  const auto st = static_cast<cudaStream_t>(s);
  const unsigned grid = blocks_for(n, kThreads * 8, 8192);
  if (d_f32) add_into_kernel<float><<<grid, kThreads, 0, st>>>(h, static_cast<const float*>(d), n, vec);
  else add_into_kernel<bf16><<<grid, kThreads, 0, st>>>(h, static_cast<const bf16*>(d), n, vec);
  DFLASH_CUDA_CHECK_LAST();
}

void embedding_f32(const int32_t* ids, const void* table, float* h, int64_t rows, int64_t D, Stream s) {
  DFLASH_CHECK(rows >= 0 && rows < (int64_t{1} << 31) && D > 0,
               "embedding_f32: need 0 <= rows < 2^31 and D > 0, got rows=" << rows << " D=" << D);
  if (rows == 0) return;
  DFLASH_CHECK(ids != nullptr && table != nullptr && h != nullptr,
               "embedding_f32: null pointer (ids=" << ids << " table=" << table << " h=" << h << ")");
  const bool vec = D % 8 == 0 && aligned16(table) && aligned16(h);
  embedding_f32_kernel<<<static_cast<unsigned>(rows), 128, 0, static_cast<cudaStream_t>(s)>>>(
      ids, static_cast<const bf16*>(table), h, rows, D, vec);
  DFLASH_CUDA_CHECK_LAST();
}

void rms_norm_fwd(const void* x, bool x_f32, int64_t ldx, const void* w, void* y, float* rstd, int64_t rows, int64_t D,
                  float eps, Stream s) {
  DFLASH_CHECK(rows >= 0 && rows < (int64_t{1} << 31) && D > 0,
               "rms_norm_fwd: need 0 <= rows < 2^31 and D > 0, got rows=" << rows << " D=" << D);
  DFLASH_CHECK(ldx >= D, "rms_norm_fwd: x row stride ldx=" << ldx << " is smaller than D=" << D);
  DFLASH_CHECK(eps >= 0.0f, "rms_norm_fwd: eps must be >= 0, got " << eps);
  if (rows == 0) return;
  DFLASH_CHECK(x != nullptr && w != nullptr && y != nullptr && rstd != nullptr,
               "rms_norm_fwd: null pointer (x=" << x << " w=" << w << " y=" << y << " rstd=" << rstd << ")");
  const auto st = static_cast<cudaStream_t>(s);
  const auto grid = static_cast<unsigned>(rows);
  const bool vec = D % 8 == 0 && ldx % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(y);
  const auto* xf = static_cast<const float*>(x);
  const auto* xb = static_cast<const bf16*>(x);
  const auto* wb = static_cast<const bf16*>(w);
  auto* yb = static_cast<bf16*>(y);
  if (x_f32 && vec) rms_norm_fwd_kernel<8><<<grid, kThreads, 0, st>>>(xf, ldx, wb, yb, rstd, D, eps);
  else if (x_f32) rms_norm_fwd_kernel<1><<<grid, kThreads, 0, st>>>(xf, ldx, wb, yb, rstd, D, eps);
  else if (vec) rms_norm_fwd_kernel<8><<<grid, kThreads, 0, st>>>(xb, ldx, wb, yb, rstd, D, eps);
  else rms_norm_fwd_kernel<1><<<grid, kThreads, 0, st>>>(xb, ldx, wb, yb, rstd, D, eps);
  DFLASH_CUDA_CHECK_LAST();
}

void rms_norm_bwd(const RmsNormBwdParams& p, Stream s) {
  DFLASH_CHECK(p.rows >= 0 && p.rows < (int64_t{1} << 31) && p.D > 0 && p.D <= kMaxNormD,
               "rms_norm_bwd: need 0 <= rows < 2^31 and 0 < D <= " << kMaxNormD << ", got rows=" << p.rows
                                                                    << " D=" << p.D);
  DFLASH_CHECK(p.ldx >= p.D, "rms_norm_bwd: x row stride ldx=" << p.ldx << " is smaller than D=" << p.D);
  DFLASH_CHECK((p.dx != nullptr) != (p.dx_bf16 != nullptr),
               "rms_norm_bwd: exactly one of dx (fp32, accumulate) and dx_bf16 (written) must be set, got dx="
                   << p.dx << " dx_bf16=" << p.dx_bf16);
  if (p.rows == 0) return;
  DFLASH_CHECK(p.x != nullptr && p.w != nullptr && p.rstd != nullptr && p.dy != nullptr && p.dw != nullptr,
               "rms_norm_bwd: null pointer (x=" << p.x << " w=" << p.w << " rstd=" << p.rstd << " dy=" << p.dy
                                                << " dw=" << p.dw << ")");
  const int parts = static_cast<int>(std::min<int64_t>(p.rows, kDwParts));
  Scratch partial(static_cast<size_t>(parts) * static_cast<size_t>(p.D) * sizeof(float));
  const auto st = static_cast<cudaStream_t>(s);
  auto launch = [&](auto kernel, const auto* x) {
    kernel<<<static_cast<unsigned>(parts), kThreads, 0, st>>>(
        x, p.ldx, static_cast<const bf16*>(p.w), p.rstd, static_cast<const bf16*>(p.dy), p.dx,
        static_cast<bf16*>(p.dx_bf16), static_cast<bf16*>(p.dx_copy_bf16), partial.f32(), p.rows, p.D);
  };
  const bool vec = p.D % 8 == 0 && p.ldx % 8 == 0 && aligned16(p.x) && aligned16(p.w) && aligned16(p.dy) &&
                   aligned16(p.dx) && aligned16(p.dx_bf16) && aligned16(p.dx_copy_bf16);
  const auto* xf = static_cast<const float*>(p.x);
  const auto* xb = static_cast<const bf16*>(p.x);
  if (p.x_f32 && vec) launch(rms_norm_bwd_kernel<8, float>, xf);
  else if (p.x_f32) launch(rms_norm_bwd_kernel<1, float>, xf);
  else if (vec) launch(rms_norm_bwd_kernel<8, bf16>, xb);
  else launch(rms_norm_bwd_kernel<1, bf16>, xb);
  DFLASH_CUDA_CHECK_LAST();
  reduce_partials_kernel<<<blocks_for(p.D, kThreads), kThreads, 0, st>>>(partial.f32(), parts, p.D, p.dw);
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
  reduce_partials_kernel<<<blocks_for(p.fwd.d, kThreads), kThreads, 0, st>>>(partial.f32(), static_cast<int>(parts),
                                                                            p.fwd.d, p.dw);
  DFLASH_CUDA_CHECK_LAST();
}

void swiglu_bwd(const void* gu, const void* dm, void* dgu, int64_t rows, int64_t I, Stream s) {
  DFLASH_CHECK(rows >= 0 && I > 0, "swiglu_bwd: need rows >= 0 and I > 0, got rows=" << rows << " I=" << I);
  if (rows == 0) return;
  DFLASH_CHECK(gu != nullptr && dm != nullptr && dgu != nullptr,
               "swiglu_bwd: null pointer (gu=" << gu << " dm=" << dm << " dgu=" << dgu << ")");
  const bool vec = I % 8 == 0 && aligned16(gu) && aligned16(dm) && aligned16(dgu);
  const auto st = static_cast<cudaStream_t>(s);
  const auto* g = static_cast<const bf16*>(gu);
  const auto* m = static_cast<const bf16*>(dm);
  auto* o = static_cast<bf16*>(dgu);
  if (vec) swiglu_bwd_kernel<8><<<blocks_for(rows * I / 8, kThreads, 8192), kThreads, 0, st>>>(g, m, o, rows, I);
  else swiglu_bwd_kernel<1><<<blocks_for(rows * I, kThreads, 8192), kThreads, 0, st>>>(g, m, o, rows, I);
  DFLASH_CUDA_CHECK_LAST();
}

namespace {
// Fixed partial count for n values (function of n only).
int64_t ss_parts(int64_t n) { return n <= 0 ? 0 : std::min<int64_t>((n + kThreads * 16 - 1) / (kThreads * 16), kSsParts); }
}  // namespace

int64_t sum_squares_workspace(int64_t n) { return std::max<int64_t>(ss_parts(n), 1) * static_cast<int64_t>(sizeof(double)); }

void sum_squares(const float* x, int64_t n, float* out, void* partial, Stream s) {
  DFLASH_CHECK(n >= 0, "sum_squares: need n >= 0, got n=" << n);
  DFLASH_CHECK(out != nullptr && partial != nullptr && (n == 0 || x != nullptr),
               "sum_squares: null pointer (x=" << x << " out=" << out << " partial=" << partial << ")");
  DFLASH_CHECK(reinterpret_cast<uintptr_t>(partial) % alignof(double) == 0,
               "sum_squares: partial workspace " << partial << " must be 8-byte aligned");
  const auto st = static_cast<cudaStream_t>(s);
  const int64_t parts = ss_parts(n);
  auto* ws = static_cast<double*>(partial);
  if (parts > 0) {
    sum_squares_kernel<<<static_cast<unsigned>(parts), kThreads, 0, st>>>(x, n, ws);
    DFLASH_CUDA_CHECK_LAST();
  }
  sum_partials_kernel<<<1, kThreads, 0, st>>>(ws, static_cast<int>(parts), out);
  DFLASH_CUDA_CHECK_LAST();
}

void adamw_step(const AdamWParams& p, Stream s) {
  DFLASH_CHECK(p.n >= 0, "adamw_step: need n >= 0, got n=" << p.n);
  DFLASH_CHECK(p.step >= 1, "adamw_step: step is 1-based, got step=" << p.step);
  DFLASH_CHECK(p.beta1 >= 0.0f && p.beta1 < 1.0f && p.beta2 >= 0.0f && p.beta2 < 1.0f,
               "adamw_step: betas must be in [0, 1), got beta1=" << p.beta1 << " beta2=" << p.beta2);
  if (p.n == 0) return;
  DFLASH_CHECK(p.master != nullptr && p.grad != nullptr && p.m != nullptr && p.v != nullptr,
               "adamw_step: null pointer (master=" << p.master << " grad=" << p.grad << " m=" << p.m
                                                   << " v=" << p.v << ")");
  AdamArgs a{};
  a.master = p.master;
  a.grad = p.grad;
  a.m = p.m;
  a.v = p.v;
  a.weight = static_cast<bf16*>(p.weight);
  a.n = p.n;
  a.lr = p.lr;
  a.beta1 = p.beta1;
  a.beta2 = p.beta2;
  a.eps = p.eps;
  a.wd = p.weight_decay;
  const auto step = static_cast<double>(p.step);
  a.bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(p.beta1), step));
  a.bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(p.beta2), step));
  a.grad_scale = p.grad_scale;
  a.grad_scale_host = p.grad_scale_host;
  adamw_kernel<<<blocks_for(p.n, kThreads * 4, 8192), kThreads, 0, static_cast<cudaStream_t>(s)>>>(a);
  DFLASH_CUDA_CHECK_LAST();
}

void clip_factor(const float* sumsq, float max_norm, float* scale, float* norm, Stream s) {
  DFLASH_CHECK(sumsq != nullptr && scale != nullptr && norm != nullptr,
               "clip_factor: null pointer (sumsq=" << sumsq << " scale=" << scale << " norm=" << norm << ")");
  clip_factor_kernel<<<1, 1, 0, static_cast<cudaStream_t>(s)>>>(sumsq, max_norm, scale, norm);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda
