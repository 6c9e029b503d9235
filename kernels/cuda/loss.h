#pragma once
// Loss family: the fused linear cross-entropy through the frozen LM head, forward and backward
// (kernels/cuda/linear_ce.cu). CPU reference: cpu::fused_linear_ce (kernels/cpu/train_ops.h).
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// ---- Fused linear cross-entropy (LM head) -------------------------------------------------------------
// For each of the R rows of hidden [R, H] bf16 (the final-normed drafter states), with the frozen
// lm_head [V, H] bf16: logits = hidden · lm_headᵀ; ce[r] = logsumexp(logits_r) − logits_r[label_r];
// argmax[r] = top-1 id (lowest id on ties); and, when dhidden is set,
//   dhidden[r, :] = grad_scale · weight[r] · (softmax(logits_r) − onehot(label_r)) · lm_head   (fp32, written)
// Rows are processed chunk_rows at a time: the logits of one chunk live in the workspace and are
// dropped; the R × V logits never exist. Rows with weight 0 still get ce / argmax (dhidden 0).
// workspace: linear_ce_workspace(chunk_rows, V) bytes. labels int32 [R] in [0, V).
struct LinearCeParams {
  const void* hidden = nullptr;
  const void* lm_head = nullptr;
  const int32_t* labels = nullptr;
  const float* weights = nullptr;  // [R]
  int64_t R = 0, H = 0, V = 0, chunk_rows = 0;
  float grad_scale = 1.0f;
  float* ce = nullptr;        // [R] written
  int32_t* argmax = nullptr;  // [R] written
  float* dhidden = nullptr;   // [R, H] written when non-null
  void* workspace = nullptr;
};
int64_t linear_ce_workspace(int64_t chunk_rows, int64_t V);
void linear_ce(const LinearCeParams& p, int device);

}  // namespace dflash::cuda
