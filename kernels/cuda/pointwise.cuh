#pragma once
// The 2-D pointwise launcher of the target's elementwise ops (elementwise.cu) and of the residual
// add of add_rms_norm (norm.cu): an Op supplies apply<W>(row, unit) over units of W = 8 (16 bytes)
// or 1 elements.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/emulatable.cuh"

namespace dflash::cuda {
namespace {

constexpr int kPointwiseThreads = 256;

// blockDim = (threads over the units of a row, rows), blockIdx.y = which blockDim.x units of the row
// (each thread one unit per row: a decode step's 16 rows of 2176 units spread over 144 blocks instead
// of 16 blocks whose threads walked 9 units one dependent DRAM round trip after another); grid-stride
// over rows. Launched as a programmatic dependent launch (pdl.cuh). Measured on an H200 (kernel_bench
// --only fused, swiglu + cuBLASLt down_proj minus down_proj alone, CUDA graphs): swiglu 10.8 us
// before (bench/results/h200-decode4-aaaaa54), 1.6 us after (-a84d6d9), at 16 x 17408.
template <class Op, int W>
__global__ void __launch_bounds__(kPointwiseThreads) pointwise_kernel(const Op op, int64_t rows, int units) {
  pdl_launch_dependents();
  pdl_wait();
  const int u = static_cast<int>(blockIdx.y * blockDim.x + threadIdx.x);
  if (u >= units) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; r < rows; r += stride)
    op.template apply<W>(r, u);
}

template <class Op>
void launch_pointwise(const Op& op, bool vec, int64_t rows, int64_t cols, cudaStream_t st) {
  if (rows == 0) return;
  const int units = static_cast<int>(vec ? cols / 8 : cols);
  int tx = 1;
  while (tx < units && tx < kPointwiseThreads) tx *= 2;
  const int ty = kPointwiseThreads / tx;
  const int64_t chunks = (units + tx - 1) / tx;
  DFLASH_CHECK(chunks < 65536, "pointwise: " << cols << " columns are too many for the grid");
  const int64_t blocks = std::min<int64_t>((rows + ty - 1) / ty, std::max<int64_t>(1, (int64_t(1) << 20) / chunks));
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(chunks)), block(static_cast<unsigned>(tx), static_cast<unsigned>(ty));
  if (vec) launch_kernel_pdl(pointwise_kernel<Op, 8>, grid, block, 0, st, op, rows, units);
  else launch_kernel_pdl(pointwise_kernel<Op, 1>, grid, block, 0, st, op, rows, units);
}

}  // namespace
}  // namespace dflash::cuda
