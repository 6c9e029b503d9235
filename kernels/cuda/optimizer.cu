// The optimizer family's kernels (optimizer.h): the deterministic sum of squares (gradient norm),
// the clip factor on the device, and AdamW on fp32 masters.
//
// Roofline. Bound by HBM bandwidth (~4.8 TB/s on H200): sum_squares reads 4 bytes per element;
// adamw_step reads and writes master, m, v, reads grad and writes the bf16 weight: 30 bytes (16-byte
// accesses where the buffers allow: the 27B recipe's 1.73 B-parameter drafter took 17 ms a step with
// 4-byte ones, ~3.0 TB/s on an H200).
//
// Determinism. sum_squares never uses float atomics: a FIXED number of CTAs (a function of n only)
// each sum a fixed set of elements in double and write one partial; a second kernel adds the
// partials in index order. Two runs give bitwise equal norms on any GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda/check.h"
#include "kernels/cuda/optimizer.h"
#include "kernels/cuda/vec.cuh"
#include "core/error.h"

namespace dflash::cuda {

namespace {

using namespace vec;

constexpr int kThreads = 256;
constexpr int kSsParts = 1024;       // max CTAs (partials) of sum_squares

// ---- optimizer --------------------------------------------------------------------------------------

// Block b sums x[i]² (in double) over the 4-element chunks c = b·kThreads + t + j·parts·kThreads (elements
// 4c .. 4c + 3, in order), then reduces in fixed order and writes partial[b]. A chunk is one 16-byte load
// where x is 16-byte aligned and four 4-byte loads otherwise: the same sums in the same order either way.
__global__ void __launch_bounds__(kThreads) sum_squares_kernel(const float* __restrict__ x, int64_t n,
                                                               double* __restrict__ partial) {
  __shared__ double red[kThreads / 32];
  const bool vec = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const int64_t chunks = (n + 3) / 4;
  double s = 0.0;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * kThreads) {
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (vec && 4 * c + 3 < n) {
      const float4 f = reinterpret_cast<const float4*>(x)[c];
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
      for (int e = 0; e < 4 && 4 * c + e < n; ++e) v[e] = x[4 * c + e];
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) s += static_cast<double>(v[e]) * v[e];
  }
  s = block_sum<kThreads>(s, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
__global__ void __launch_bounds__(kThreads) sum_partials_kernel(const double* __restrict__ partial, int parts,
                                                                float* __restrict__ out) {
  __shared__ double red[kThreads / 32];
  double s = 0.0;
  for (int i = threadIdx.x; i < parts; i += kThreads) s += partial[i];
  s = block_sum<kThreads>(s, red);
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
// One element's update (the same arithmetic for the vector and the scalar loop): m, v, p in place.
__device__ __forceinline__ void adam_one(const AdamArgs& a, float scale, float g, float& m, float& v, float& p) {
  g *= scale;
  m = a.beta1 * m + (1.0f - a.beta1) * g;
  v = a.beta2 * v + (1.0f - a.beta2) * g * g;
  p -= a.lr * (a.wd * p + (m / a.bc1) / (sqrtf(v / a.bc2) + a.eps));
}
// vec4: master, grad, m, v 16-byte aligned and the weight (if any) 8-byte aligned: elements [0, n4 · 4)
// four at a time (one 16-byte load / store per array: ~30% more of the bandwidth than 4-byte accesses),
// the rest one at a time.
template <bool kVec4>
__global__ void adamw_kernel(const AdamArgs a) {
  const float scale = a.grad_scale_host * (a.grad_scale != nullptr ? *a.grad_scale : 1.0f);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if constexpr (kVec4) {
    const int64_t n4 = a.n / 4;
    for (int64_t j = i; j < n4; j += stride) {
      const float4 g = reinterpret_cast<const float4*>(a.grad)[j];
      float4 m = reinterpret_cast<const float4*>(a.m)[j], v = reinterpret_cast<const float4*>(a.v)[j];
      float4 p = reinterpret_cast<const float4*>(a.master)[j];
      adam_one(a, scale, g.x, m.x, v.x, p.x);
      adam_one(a, scale, g.y, m.y, v.y, p.y);
      adam_one(a, scale, g.z, m.z, v.z, p.z);
      adam_one(a, scale, g.w, m.w, v.w, p.w);
      reinterpret_cast<float4*>(a.m)[j] = m;
      reinterpret_cast<float4*>(a.v)[j] = v;
      reinterpret_cast<float4*>(a.master)[j] = p;
      if (a.weight != nullptr) {
        uint2 w;
        w.x = ptx::pack_bf16(p.x, p.y);
        w.y = ptx::pack_bf16(p.z, p.w);
        reinterpret_cast<uint2*>(a.weight)[j] = w;
      }
    }
    tail = n4 * 4;
  }
  for (i += tail; i < a.n; i += stride) {
    float m = a.m[i], v = a.v[i], p = a.master[i];
    adam_one(a, scale, a.grad[i], m, v, p);
    a.m[i] = m;
    a.v[i] = v;
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

}  // namespace

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
  const bool vec4 = aligned16(a.master) && aligned16(a.grad) && aligned16(a.m) && aligned16(a.v) &&
                    reinterpret_cast<uintptr_t>(a.weight) % 8 == 0;
  const unsigned blocks = blocks_for(p.n, kThreads * (vec4 ? 8 : 4), 8192);
  if (vec4)
    adamw_kernel<true><<<blocks, kThreads, 0, static_cast<cudaStream_t>(s)>>>(a);
  else
    adamw_kernel<false><<<blocks, kThreads, 0, static_cast<cudaStream_t>(s)>>>(a);
  DFLASH_CUDA_CHECK_LAST();
}

void clip_factor(const float* sumsq, float max_norm, float* scale, float* norm, Stream s) {
  DFLASH_CHECK(sumsq != nullptr && scale != nullptr && norm != nullptr,
               "clip_factor: null pointer (sumsq=" << sumsq << " scale=" << scale << " norm=" << norm << ")");
  clip_factor_kernel<<<1, 1, 0, static_cast<cudaStream_t>(s)>>>(sumsq, max_norm, scale, norm);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda
