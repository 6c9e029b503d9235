#pragma once
// Optimizer family: gradient norm, clip factor and AdamW on fp32 masters
// (kernels/cuda/optimizer.cu). CPU reference: trainer/optimizer.cpp's AdamW.
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// ---- Optimizer ------------------------------------------------------------------------------------------
// Σ x² over n fp32 values into *out (fp32 device scalar, written), deterministic: fixed-size block
// partials reduced in a fixed order. partial: sum_squares_workspace(n) bytes.
int64_t sum_squares_workspace(int64_t n);
void sum_squares(const float* x, int64_t n, float* out, void* partial, Stream s);
// AdamW on fp32 masters, decoupled weight decay, bias-corrected (PyTorch's AdamW):
//   g = grad · grad_scale;  m = β1 m + (1−β1) g;  v = β2 v + (1−β2) g²;
//   master −= lr · (wd · master + (m / (1 − β1^step)) / (sqrt(v / (1 − β2^step)) + eps));
//   weight = bf16(master) (when weight is non-null).
// grad_scale comes from the device (the clip factor, computed on the device from the grad norm)
// times grad_scale_host, so the host never waits for the norm.
struct AdamWParams {
  float* master = nullptr;
  const float* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  void* weight = nullptr;  // bf16 copy, optional
  int64_t n = 0;
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;  // 1-based
  const float* grad_scale = nullptr;  // device scalar, optional (1 when null)
  float grad_scale_host = 1.0f;
};
void adamw_step(const AdamWParams& p, Stream s);
// The clip factor on the device: scale = min(1, max_norm / (sqrt(sumsq) + 1e-6)); norm = sqrt(sumsq).
// max_norm <= 0 means no clipping (scale 1). A non-finite sumsq gives scale 0 and norm = that
// value (the trainer reads the norm and skips the update of a non-finite step).
void clip_factor(const float* sumsq, float max_norm, float* scale, float* norm, Stream s);

}  // namespace dflash::cuda
