#pragma once
// The 2-D pointwise launcher of the target's elementwise ops (elementwise.cu) and of the residual
// add of add_rms_norm (norm.cu): an Op supplies apply<W>(row, unit) over units of W = 8 (16 bytes)
// or 1 elements.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/check.h"

namespace dflash::cuda {
namespace {

constexpr int kPointwiseThreads = 256;

// blockDim = (threads over the units of a row, rows); grid-stride over rows.
template <class Op, int W>
__global__ void __launch_bounds__(kPointwiseThreads) pointwise_kernel(const Op op, int64_t rows, int units) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; r < rows; r += stride)
    for (int u = threadIdx.x; u < units; u += blockDim.x) op.template apply<W>(r, u);
}

template <class Op>
void launch_pointwise(const Op& op, bool vec, int64_t rows, int64_t cols, cudaStream_t st) {
  if (rows == 0) return;
  const int units = static_cast<int>(vec ? cols / 8 : cols);
  int tx = 1;
  while (tx < units && tx < kPointwiseThreads) tx *= 2;
  const int ty = kPointwiseThreads / tx;
  const int64_t blocks = std::min<int64_t>((rows + ty - 1) / ty, int64_t(1) << 20);
  const dim3 block(static_cast<unsigned>(tx), static_cast<unsigned>(ty));
  if (vec) pointwise_kernel<Op, 8><<<static_cast<unsigned>(blocks), block, 0, st>>>(op, rows, units);
  else pointwise_kernel<Op, 1><<<static_cast<unsigned>(blocks), block, 0, st>>>(op, rows, units);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace
}  // namespace dflash::cuda
