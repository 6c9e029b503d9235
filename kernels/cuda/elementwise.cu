// The elementwise family's kernels (elementwise.h): the target's embedding, SwiGLU and sigmoid
// output gate (bf16 in / out through the 2-D pointwise launcher, pointwise.cuh), the drafter's casts,
// residual adds, embedding into the fp32 stream and SwiGLU backward, and gemm_ex's beta scaling.
//
// Roofline. None does enough arithmetic to matter; all are bound by HBM bandwidth (~4.8 TB/s on
// H200). Minimum traffic (bf16 = 2 bytes):
//   embedding        2·D read + 2·D written per token            (D = 5120: 20 KB -> ~4.3 ns/token)
//   swiglu           4·I read, 2·I written
//   sigmoid_gate     x, gate read, x written: 6·H·d
//   cast_bf16_f32 / cast_f32_bf16   6 bytes per element
//   add_into_f32     h read + written, d read: 10 (bf16 d) or 12 (fp32 d) bytes
//   embedding_f32    2·D read + 4·D written per row
//   scatter_rows_f32 4·D read + 4·D written per row
//   swiglu_bwd       gu 4·I + dm 2·I read, dgu 4·I written
// Each has a 16-byte (8 elements) instantiation, taken when the pointers and sizes allow, and a
// scalar one for any size and alignment.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/cuda/check.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/pointwise.cuh"
#include "kernels/cuda/vec.cuh"
#include "core/error.h"

namespace dflash::cuda {

namespace tuning {
// 1 (default): the CUDA target model runs sigmoid_gate_quant_fp8 where an FP8 o_proj reads the gate's output
// (the same bits as sigmoid_gate then quantize_fp8_act: one launch less an attention layer). On since session 41:
// its GPU tests passed on an H100 and the 27B fp8 decode step gained 0.4-0.8% (13.72 / 13.67 / 13.73 ms without,
// 13.66 / 13.64 / 13.61 with, alternated; bench/results/h100-stream-f683da9). DFLASH_GATE_QUANT=0 turns it off.
int gate_quant = [] {
  const char* e = std::getenv("DFLASH_GATE_QUANT");
  return e && std::strcmp(e, "0") == 0 ? 0 : 1;
}();
}  // namespace tuning

namespace {

using namespace vec;

constexpr int kThreads = 256;

struct SwigluOp {
  const bf16* gu;  // (N, 2I)
  bf16* y;         // (N, I)
  int64_t I;
  template <int W> __device__ void apply(int64_t r, int u) const {
    float g[W], up[W];
    const bf16* src = gu + r * 2 * I + u * W;
    load(src, g);
    load(src + I, up);
#pragma unroll
    for (int e = 0; e < W; ++e) g[e] = silu(g[e]) * up[e];
    store(y + r * I + u * W, g);
  }
};

// Row r = (token n, head h) of x [N, H, d].
struct SigmoidGateOp {
  bf16* x;
  const bf16* gate;
  int64_t ldg, hsg, H, d;
  template <int W> __device__ void apply(int64_t r, int u) const {
    const int64_t n = r / H, h = r - n * H;
    float xv[W], gv[W];
    bf16* xp = x + r * d + u * W;
    load(xp, xv);
    load(gate + n * ldg + h * hsg + u * W, gv);
#pragma unroll
    for (int e = 0; e < W; ++e) xv[e] *= sigmoid(gv[e]);
    store(xp, xv);
  }
};

struct EmbeddingOp {
  const int32_t* ids;
  const bf16* table;
  bf16* y;
  int64_t D;
  template <int W> __device__ void apply(int64_t r, int u) const {
    const bf16* src = table + static_cast<int64_t>(ids[r]) * D + u * W;
    bf16* dst = y + r * D + u * W;
    if constexpr (W == 8) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    else *dst = *src;
  }
};

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

__global__ void scatter_rows_f32_kernel(const float* __restrict__ x, const int32_t* __restrict__ dst_rows,
                                        float* __restrict__ y, int64_t D, bool vec) {
  const int64_t r = blockIdx.x;
  const float* src = x + r * D;
  float* dst = y + static_cast<int64_t>(dst_rows[r]) * D;
  if (vec) {
    for (int64_t u = threadIdx.x; u < D / 4; u += blockDim.x)
      reinterpret_cast<float4*>(dst)[u] = reinterpret_cast<const float4*>(src)[u];
  } else {
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) dst[i] = src[i];
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

// ---- launchers ------------------------------------------------------------------------------------

void embedding(const int32_t* ids, const void* table, void* y, int64_t N, int64_t D, Stream s) {
  DFLASH_CHECK(N >= 0 && D > 0 && D <= (int64_t(1) << 30),
               "embedding: need N >= 0 and 0 < D <= 2^30, got N=" << N << " D=" << D);
  if (N == 0) return;
  DFLASH_CHECK(ids && table && y, "embedding: null pointer (ids=" << ids << " table=" << table << " y=" << y << ")");
  const bool vec = D % 8 == 0 && aligned16(table) && aligned16(y);
  launch_pointwise(EmbeddingOp{ids, static_cast<const bf16*>(table), static_cast<bf16*>(y), D}, vec, N, D,
                   static_cast<cudaStream_t>(s));
}

void swiglu(const void* gu, void* y, int64_t N, int64_t I, Stream s) {
  DFLASH_CHECK(N >= 0 && I > 0 && I <= (int64_t(1) << 30),
               "swiglu: need N >= 0 and 0 < I <= 2^30, got N=" << N << " I=" << I);
  if (N == 0) return;
  DFLASH_CHECK(gu && y, "swiglu: null pointer (gu=" << gu << " y=" << y << ")");
  const bool vec = I % 8 == 0 && aligned16(gu) && aligned16(y);
  launch_pointwise(SwigluOp{static_cast<const bf16*>(gu), static_cast<bf16*>(y), I}, vec, N, I,
                   static_cast<cudaStream_t>(s));
}

void sigmoid_gate(void* x, const void* gate, int64_t ldg, int64_t hsg, int64_t N, int64_t H, int64_t d, Stream s) {
  DFLASH_CHECK(N >= 0 && H > 0 && d > 0 && d <= (int64_t(1) << 30),
               "sigmoid_gate: need N >= 0, H > 0 and 0 < d <= 2^30, got N=" << N << " H=" << H << " d=" << d);
  DFLASH_CHECK(hsg >= d && ldg >= (H - 1) * hsg + d,
               "sigmoid_gate: gate strides too small: hsg=" << hsg << " ldg=" << ldg << " for H=" << H << " d=" << d);
  if (N == 0) return;
  DFLASH_CHECK(x && gate, "sigmoid_gate: null pointer (x=" << x << " gate=" << gate << ")");
  const bool vec = d % 8 == 0 && hsg % 8 == 0 && ldg % 8 == 0 && aligned16(x) && aligned16(gate);
  launch_pointwise(SigmoidGateOp{static_cast<bf16*>(x), static_cast<const bf16*>(gate), ldg, hsg, H, d}, vec, N * H, d,
                   static_cast<cudaStream_t>(s));
}

namespace {

// The casts' launcher: n elements of x into y, by units of 8 when both are 16-byte aligned.
template <class Src, class Dst>
void launch_cast(const char* op, void (*kernel)(const Src*, Dst*, int64_t, bool), const void* x, void* y, int64_t n,
                 Stream s) {
  DFLASH_CHECK(n >= 0, op << ": need n >= 0, got n=" << n);
  if (n == 0) return;
  DFLASH_CHECK(x != nullptr && y != nullptr, op << ": null pointer (x=" << x << " y=" << y << ") for n=" << n);
  const bool vec = aligned16(x) && aligned16(y);
  kernel<<<blocks_for(n, kThreads * 8, 8192), kThreads, 0, static_cast<cudaStream_t>(s)>>>(
      static_cast<const Src*>(x), static_cast<Dst*>(y), n, vec);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace

void cast_bf16_f32(const void* x, float* y, int64_t n, Stream s) {
  launch_cast("cast_bf16_f32", cast_bf16_f32_kernel, x, y, n, s);
}

void cast_f32_bf16(const float* x, void* y, int64_t n, Stream s) {
  launch_cast("cast_f32_bf16", cast_f32_bf16_kernel, x, y, n, s);
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

void scatter_rows_f32(const float* x, const int32_t* dst_rows, float* y, int64_t rows, int64_t D, Stream s) {
  DFLASH_CHECK(rows >= 0 && rows < (int64_t{1} << 31) && D > 0,
               "scatter_rows_f32: need 0 <= rows < 2^31 and D > 0, got rows=" << rows << " D=" << D);
  if (rows == 0) return;
  DFLASH_CHECK(x != nullptr && dst_rows != nullptr && y != nullptr,
               "scatter_rows_f32: null pointer (x=" << x << " dst_rows=" << dst_rows << " y=" << y << ")");
  const bool vec = D % 4 == 0 && aligned16(x) && aligned16(y);
  scatter_rows_f32_kernel<<<static_cast<unsigned>(rows), 128, 0, static_cast<cudaStream_t>(s)>>>(x, dst_rows, y, D, vec);
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
}  // namespace dflash::cuda
