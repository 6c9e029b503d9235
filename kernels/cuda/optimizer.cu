// The optimizer family's kernels (optimizer.h): the deterministic sum of squares (gradient norm),
// the clip factor on the device, and AdamW on fp32 masters.
//
// Roofline. Bound by HBM bandwidth (~4.8 TB/s on H200): sum_squares reads 4 bytes per element;
// adamw_step reads and writes master, m, v, reads grad and writes the bf16 weight: 30 bytes.
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
