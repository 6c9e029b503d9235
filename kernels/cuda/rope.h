#pragma once
// RoPE family: per-head RMSNorm + neox rotary embedding, the target's q/k preparation and the
// drafter's q_norm / k_norm forward and backward (kernels/cuda/rope.cu). CPU reference:
// ops::rms_norm + ops::rope_neox_inplace (kernels/ops.h), cpu::head_norm_rope_fwd / _bwd (kernels/cpu/train_ops.h).
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// ---- Target q/k preparation ------------------------------------------------------------------------
// Attention q/k preparation, one (token, head) row at a time: zero-centred RMSNorm over d with
// wq / wk, then neox RoPE on the first rotary_dim dims at position pos[n] (inv_freq and angle in
// f32 as transformers computes them: inv_freq_i = 1 / theta^(2i / rotary_dim)).
// q is read from q_in (row stride ldq, head stride hsq: per head [q | gate] when gated) and written
// contiguous to q_out [N, Hq, d]; k [N, Hkv, d] (row stride ldk) is normalised and rotated in place.
struct QkPrepParams {
  const void* q_in = nullptr;
  int64_t ldq = 0, hsq = 0;
  void* q_out = nullptr;
  void* k = nullptr;
  int64_t ldk = 0;
  const void* wq = nullptr;  // [d]
  const void* wk = nullptr;  // [d]
  const int32_t* pos = nullptr;  // [N] position of each token within its sequence
  int64_t N = 0, Hq = 0, Hkv = 0, d = 0, rotary_dim = 0;
  float eps = 1e-6f;
  float theta = 10000.0f;
};
void qk_norm_rope(const QkPrepParams& p, Stream s);

// ---- Per-head plain RMSNorm + full-head neox RoPE (drafter q_norm / k_norm) -------------------------
// For each row r and head h of x [rows, heads, d] (row stride ldx, heads contiguous with stride d):
//   n = x̂ · w (plain RMSNorm over d, rstd saved [rows, heads]); y = rope(n) at position pos[r]:
//   neox halves over the full head dim, inv_freq_i = 1 / theta^(2i / d) in fp32, angle in fp32.
// y bf16 contiguous [rows, heads, d].
struct HeadNormRopeParams {
  const void* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;  // [d] bf16
  const int32_t* pos = nullptr;  // [rows]
  void* y = nullptr;
  float* rstd = nullptr;  // [rows, heads]
  int64_t rows = 0, heads = 0, d = 0;
  float eps = 1e-6f, theta = 1e6f;
};
void head_norm_rope_fwd(const HeadNormRopeParams& p, Stream s);
// Backward: from dy bf16 [rows, heads, d] (the gradient of y), dx = d/dx written bf16 to dx
// (row stride lddx, heads contiguous), dw (+)= fp32 [d] (deterministic as rms_norm_bwd).
struct HeadNormRopeBwdParams {
  HeadNormRopeParams fwd;  // x, ldx, w, pos, rstd (as saved), rows, heads, d, theta; y unused
  const void* dy = nullptr;
  void* dx = nullptr;
  int64_t lddx = 0;
  float* dw = nullptr;
};
void head_norm_rope_bwd(const HeadNormRopeBwdParams& p, Stream s);

}  // namespace dflash::cuda
