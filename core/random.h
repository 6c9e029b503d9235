#pragma once
// Filling tensors from the counter-based RNG (core/rng.h). Element j of `t` (row-major) draws
// index `index_offset + j` of stream `stream`, so a shard of a tensor is filled with exactly the
// values the whole tensor would hold at those positions (pass the shard's flat offset, for a
// contiguous row range). Same values on the CPU and the GPU.
#include <cstdint>

#include "core/tensor.h"

namespace dflash {

struct RandomParams {
  uint64_t seed = 0;
  uint64_t stream = 0;
  int64_t index_offset = 0;
  // When > 0: t is the column block [c0, c0 + cols) of rows of a wider matrix with row_stride
  // columns; element (i, j) of t draws index_offset + i * row_stride + j (pass index_offset =
  // row0 * row_stride + c0). A tensor-parallel row-parallel weight shard is drawn this way.
  int64_t row_stride = 0;
};

// Floating dtypes only (bf16/f16/f32/f64); t must be contiguous.
void fill_uniform(Tensor& t, const RandomParams& p, float lo, float hi);
void fill_normal(Tensor& t, const RandomParams& p, float mean, float stddev);

namespace cuda {
void fill_uniform(Tensor& t, const RandomParams& p, float lo, float hi);
void fill_normal(Tensor& t, const RandomParams& p, float mean, float stddev);
}  // namespace cuda

}  // namespace dflash
