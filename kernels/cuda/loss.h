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
  // FP8 (model.drafter.lm_head_precision: fp8; issue 31): both GEMMs on block-scaled e4m3 operands
  // with fp32 accumulation (gemm_fp8, cuBLASLt), in the FP8 drafter's tiles. The frozen LM head's
  // codes are made once by the caller (quantize_fp8_tiles, block mode, from lm_head):
  //   lm_head_q [Vq, H] (Vq = linear_ce_fp8_vocab_ld(V); the padding rows [V, Vq) 0) with 128 x 128
  //     scales lm_head_scale[vb * fp8_weight_scale_ld(H) + hb] (the logits' weight), and its transpose
  //     lm_head_qt [H, Vq] (the padding columns 0) with lm_head_scale_t[hb * fp8_weight_scale_ld(V) + vb]
  //     (dhidden's): every dimension of both GEMMs a multiple of 16, whatever V;
  // each chunk's hidden rows are quantized 1 x 128 along H (quantize_fp8_act), and the gradient of
  // the logits 1 x 128 along V straight from the fp32 logits by the row kernel (no bf16 rounding
  // first): its codes replace the bf16 grad of the bf16 form. The logits stay fp32, so ce / argmax /
  // the softmax are exact for the FP8 logits; what FP8 changes is the logits themselves (e4m3
  // rounding of both operands: the GPU test states the distance). Needs H % 16 == 0 and sm_90.
  const uint8_t* lm_head_q = nullptr;
  const float* lm_head_scale = nullptr;
  const uint8_t* lm_head_qt = nullptr;
  const float* lm_head_scale_t = nullptr;
  bool fp8() const { return lm_head_q != nullptr; }
};
// Workspace bytes of the bf16 form, and of the form p asks for (p.fp8(): the padded fp32 logits, the
// hidden rows' and the gradient's codes and scales, an fp32 [chunk, H] staging buffer).
int64_t linear_ce_workspace(int64_t chunk_rows, int64_t V);
int64_t linear_ce_workspace(const LinearCeParams& p);
// Row stride of the FP8 form's transposed LM-head codes (and of its gradient codes): V rounded up to 16.
int64_t linear_ce_fp8_vocab_ld(int64_t V);
// The FP8 form's head codes from the bf16 head [V, H] (contiguous) on stream s: q [Vq, H] (its padding
// rows written 0), scale [ceil(V / 128), fp8_weight_scale_ld(H)], qt [H, Vq] (padding columns 0),
// scale_t [ceil(H / 128), fp8_weight_scale_ld(V)] (Vq = linear_ce_fp8_vocab_ld(V)); every buffer
// 16-byte aligned; H % 16 == 0. Sets the four FP8 fields of p to them.
struct LinearCeFp8Head {
  uint8_t* q = nullptr;
  float* scale = nullptr;
  uint8_t* qt = nullptr;
  float* scale_t = nullptr;
};
void linear_ce_quantize_head(const void* lm_head, int64_t V, int64_t H, const LinearCeFp8Head& out, Stream s);
void linear_ce_use_fp8_head(LinearCeParams& p, const LinearCeFp8Head& head);
void linear_ce(const LinearCeParams& p, int device);

}  // namespace dflash::cuda
