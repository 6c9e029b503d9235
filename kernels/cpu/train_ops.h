#pragma once
// CPU references of the drafter's training ops whose CUDA kernels are in kernels/cuda/norm.h,
// rope.h, block_attention.h and loss.h (rms_norm_fwd / _bwd, head_norm_rope_fwd / _bwd, block attention,
// the fused linear cross-entropy), in double on contiguous row-major
// vectors: the oracles of the gpu tests (tests/test_cuda_train_ops.cpp), themselves checked against
// central finite differences (tests/test_ops_train.cpp). The drafter's whole-model reference
// (drafter/model.cpp) is written with its own double-precision building blocks (drafter/ref_math.h).
#include <cstdint>
#include <functional>
#include <vector>

#include "core/tensor.h"

namespace dflash::cpu {

// out[j] = Σ_i a[i]·b_j[i] for four rows b_j, each one sum in ascending i with one accumulator (bit
// for bit what a plain loop gives); four independent chains overlap where a single serial double
// sum waits on each add. Used by drafter/ref_math.h's linear and fused_linear_ce's logits.
inline void dot4(const double* a, const double* b0, const double* b1, const double* b2, const double* b3, int64_t n,
                 double* out) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = a[i];
    s0 += x * b0[i];
    s1 += x * b1[i];
    s2 += x * b2[i];
    s3 += x * b3[i];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

// y = x · rstd · w per row of D (x contiguous [rows, D]); rstd[r] = 1 / sqrt(mean(x²) + eps) out.
void rms_norm_fwd(const std::vector<double>& x, const std::vector<double>& w, int64_t rows, int64_t D, double eps,
                  std::vector<double>& y, std::vector<double>& rstd);
// dx = rstd · (w·dy − x̂ · mean(x̂ · w·dy)) (written), dw += Σ dy · x̂, with the given rstd.
void rms_norm_bwd(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& rstd,
                  const std::vector<double>& dy, int64_t rows, int64_t D, std::vector<double>& dx,
                  std::vector<double>& dw);
// The rotary angles of position pos as the kernels compute them: inv_freq_i = f32(theta^(-2i/d)),
// angle = f32(f32(pos) · inv_freq_i); d / 2 values.
std::vector<double> rope_angles_f32(int64_t d, double theta, int32_t pos);
// Per (row, head) of x contiguous [rows, heads, d]: n = x̂ · w (plain RMSNorm over d, rstd out
// [rows, heads]), y = neox rope(n) over the full head at position pos[row].
void head_norm_rope_fwd(const std::vector<double>& x, const std::vector<double>& w, const std::vector<int32_t>& pos,
                        int64_t rows, int64_t heads, int64_t d, double eps, double theta, std::vector<double>& y,
                        std::vector<double>& rstd);
// Backward from dy: dn = rotation of dy by −angle, then the plain RMSNorm backward per head
// (dx written, dw +=).
void head_norm_rope_bwd(const std::vector<double>& x, const std::vector<double>& w, const std::vector<int32_t>& pos,
                        const std::vector<double>& rstd, const std::vector<double>& dy, int64_t rows, int64_t heads,
                        int64_t d, double theta, std::vector<double>& dx, std::vector<double>& dw);

// DFlash block attention forward and backward (kernels/cuda/block_attention.h for the layout): the
// R = nb·B block rows attend, per query head h (kv head h / (Hq / Hkv)), to the keys `allowed`
// admits, in order: the sequence's context rows t (allowed(anchor, j, false, t)) and the block's own
// rows jj (allowed(anchor, j, true, jj)); softmax at scale 1/sqrt(d); out and the natural-log lse;
// then the backward from dout with δ = Σ dO·O. The mask is the caller's (the drafter's
// drafter::mask_allows in the tests), so the reference does not restate it.
struct BlockAttentionShape {
  std::vector<int32_t> cu_seqlens;  // [num_seqs + 1] context rows
  std::vector<int32_t> anchor, block_seq;  // [nb]
  int64_t B = 0, Hq = 0, Hkv = 0, d = 0;
};
struct BlockAttentionRef {
  std::vector<double> out, lse, dq, dkc, dvc, dkb, dvb;
  std::vector<char> ctx_attended;  // [N]: some query attends this context row
};
using BlockKeyAllowed = std::function<bool(int64_t anchor, int64_t j, bool key_in_block, int64_t t)>;
// q, dout [R, Hq, d]; kc, vc [N, Hkv, d]; kb, vb [R, Hkv, d] (contiguous).
BlockAttentionRef block_attention(const BlockAttentionShape& s, const std::vector<double>& q,
                                  const std::vector<double>& kc, const std::vector<double>& vc,
                                  const std::vector<double>& kb, const std::vector<double>& vb,
                                  const std::vector<double>& dout, const BlockKeyAllowed& allowed);

// Fused, chunked linear cross-entropy. hidden [R, H] (row-major doubles), lm_head [V, H] (any
// float dtype, contiguous host tensor). Rows are processed chunk_rows at a time: the logits of
// one chunk ([chunk_rows, V]) are made, used and dropped. Rows with weight 0 are skipped.
// Returns Σ w·CE and Σ w; writes the top-1 id of every row with w > 0 (-1 for skipped rows) to
// argmax when given, and ADDS grad_scale · d(Σ w·CE)/d hidden to dhidden [R, H] when given.
struct CeSums {
  double weighted_ce_sum = 0, weight_sum = 0;
};
CeSums fused_linear_ce(const double* hidden, int64_t rows, int64_t H, const Tensor& lm_head,
                       const std::vector<int32_t>& labels, const std::vector<double>& weights, int64_t chunk_rows,
                       double grad_scale, double* dhidden, std::vector<int32_t>* argmax);

// Its f32 twin for the CPU backend's fast drafter step (DrafterMath::F32): the same contract on f32
// hidden states and gradients, lm_head F32 [V, H] contiguous; the two products of each chunk (logits and
// the hidden-state gradient) on the GEMM of kernels/cpu/gemm.h, the rows' softmax on the worker threads,
// the sums in double in row order (the same result on any thread count).
// Simulated FP8 (the FP8 drafter's recipe on the CPU, drafter/ref_math.h linear_fp8): x [rows, cols]
// (row-major, in place) rounded to e4m3 with one scale per tile_rows x tile_cols tile (1 x 128, 128 x 1
// or 128 x 128; edge tiles smaller), as the FP8 kernels quantize: scale = max(amax, 1e-10) / 448,
// code = e4m3(clamp(x * (1 / scale), +-448)), x <- code * scale. Threaded, deterministic.
void fake_quantize_e4m3(float* x, int64_t rows, int64_t cols, int64_t tile_rows, int64_t tile_cols);

// fp8: the FP8 form of the GPU's linear_ce (simulated): each chunk's hidden rows and the logits'
// gradient rows are rounded to e4m3 in 1 x 128 tiles along H and V before their products (the caller
// passes the head already rounded in its 128 x 128 tiles: drafter/model.cpp head_ce).
CeSums fused_linear_ce_f32(const float* hidden, int64_t rows, int64_t H, const Tensor& lm_head,
                           const std::vector<int32_t>& labels, const std::vector<double>& weights, int64_t chunk_rows,
                           double grad_scale, float* dhidden, std::vector<int32_t>* argmax, bool fp8 = false);

}  // namespace dflash::cpu
