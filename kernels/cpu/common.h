#pragma once
// Validation helpers shared by the op entry points (kernels/ops.h).
#include <cmath>
#include <string>

#include "kernels/ops.h"

namespace dflash::ops::detail {

// The reference backend computes in f32 on the host; other devices/dtypes are routed elsewhere.
inline void require_host_f32(const Tensor& t, const char* op, const char* name) {
  DFLASH_CHECK(t.defined(), op << ": tensor '" << name << "' is undefined");
  DFLASH_CHECK(t.device().is_cpu(),
               op << ": '" << name << "' is on " << t.device().str()
                  << "; the CUDA kernels for this op are not built into this version, run it on cpu");
  DFLASH_CHECK(t.dtype() == DType::F32, op << ": '" << name << "' must be f32 on the CPU reference, got "
                                            << t.describe());
  DFLASH_CHECK(t.is_contiguous(), op << ": '" << name << "' must be contiguous, got " << t.describe());
}

inline void require_shape(const Tensor& t, const Shape& want, const char* op, const char* name) {
  DFLASH_CHECK(t.shape() == want, op << ": '" << name << "' has shape " << shape_str(t.shape()) << ", expected "
                                     << shape_str(want));
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
// torch.nn.functional.softplus with beta 1 and threshold 20.
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

}  // namespace dflash::ops::detail
