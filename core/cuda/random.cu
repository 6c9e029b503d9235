// GPU fills from the counter-based RNG. Each element calls the same core/rng.h functions as the
// CPU path (core/random.cpp), so uniform fills are bit-identical to the CPU and normal fills
// agree to about one f32 ulp (the device's double log/sin/cos may differ from the host's in the
// last double bit). The affine step is written with explicitly rounded operations because the CPU
// computes `lo + (hi - lo) * u` in f32 without FMA contraction; nvcc would otherwise fuse it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda/check.h"
#include "core/device.h"
#include "core/random.h"
#include "core/rng.h"

namespace dflash::cuda {

namespace {

// Converts the f32 value the CPU path would produce to the output type, rounding as the CPU does.
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_f32<double>(float v) { return static_cast<double>(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

struct UniformDraw {
  float lo, span;  // span = hi - lo, computed on the host in f32 exactly as the CPU path does
  __device__ __forceinline__ float operator()(uint64_t seed, uint64_t stream, uint64_t i) const {
    return __fadd_rn(lo, __fmul_rn(span, rng::uniform(seed, stream, i)));
  }
};

struct NormalDraw {
  float mean, stddev;
  __device__ __forceinline__ float operator()(uint64_t seed, uint64_t stream, uint64_t i) const {
    return __fadd_rn(mean, __fmul_rn(stddev, rng::normal(seed, stream, i)));
  }
};

// out[j] = draw(index_offset + j) for j in [0, n) (with row_stride > 0: element (i, c) of rows of
// `cols` draws index_offset + i * row_stride + c); grid-stride so any grid size covers any n.
template <typename T, typename Draw>
__global__ void fill_kernel(T* __restrict__ out, int64_t n, uint64_t seed, uint64_t stream, uint64_t index_offset,
                            int64_t cols, int64_t row_stride, Draw draw) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += step) {
    const int64_t src = row_stride > 0 ? (j / cols) * row_stride + j % cols : j;
    out[j] = from_f32<T>(draw(seed, stream, index_offset + static_cast<uint64_t>(src)));
  }
}

void check_fillable(const Tensor& t, const char* op) {
  DFLASH_CHECK(t.defined() && dtype_is_float(t.dtype()), op << ": needs a floating tensor, got " << t.describe());
  DFLASH_CHECK(t.is_contiguous(), op << ": needs a contiguous tensor, got " << t.describe());
  DFLASH_CHECK(t.device().is_cuda(), op << ": cuda::" << op << " needs a CUDA tensor, got " << t.describe());
}

template <typename Draw>
void launch_fill(Tensor& t, const RandomParams& p, Draw draw) {
  const int64_t n = t.numel();
  if (n == 0) return;
  DeviceContext& ctx = DeviceContext::get(t.device().index);
  auto stream = static_cast<cudaStream_t>(ctx.stream());
  constexpr int kThreads = 256;
  // Enough blocks to fill the GPU several times over; the grid-stride loop does the rest.
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65536);
  const auto g = static_cast<unsigned>(blocks);
  const auto off = static_cast<uint64_t>(p.index_offset);
  const int64_t cols = t.dim() > 0 && t.size(-1) > 0 ? t.size(-1) : 1;
  const int64_t rs = p.row_stride;
  int prev = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&prev));
  if (prev != t.device().index) DFLASH_CUDA_CHECK(cudaSetDevice(t.device().index));
  switch (t.dtype()) {
    case DType::F32:
      fill_kernel<<<g, kThreads, 0, stream>>>(t.data<float>(), n, p.seed, p.stream, off, cols, rs, draw);
      break;
    case DType::F64:
      fill_kernel<<<g, kThreads, 0, stream>>>(t.data<double>(), n, p.seed, p.stream, off, cols, rs, draw);
      break;
    case DType::BF16:
      fill_kernel<<<g, kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(t.raw_data()), n, p.seed, p.stream, off,
                                              cols, rs, draw);
      break;
    case DType::F16:
      fill_kernel<<<g, kThreads, 0, stream>>>(static_cast<__half*>(t.raw_data()), n, p.seed, p.stream, off, cols, rs, draw);
      break;
    default:
      break;  // rejected by check_fillable
  }
  const cudaError_t launch = cudaGetLastError();
  if (prev != t.device().index) DFLASH_CUDA_WARN(cudaSetDevice(prev));
  if (launch != cudaSuccess) throw_cuda_error(launch, "fill_kernel<<<...>>>", __FILE__, __LINE__);
}

}  // namespace

void fill_uniform(Tensor& t, const RandomParams& p, float lo, float hi) {
  check_fillable(t, "fill_uniform");
  launch_fill(t, p, UniformDraw{lo, hi - lo});
}

void fill_normal(Tensor& t, const RandomParams& p, float mean, float stddev) {
  check_fillable(t, "fill_normal");
  launch_fill(t, p, NormalDraw{mean, stddev});
}

}  // namespace dflash::cuda
