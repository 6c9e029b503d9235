#pragma once
// The FP8 drafter's linear layers on the GPU (model.drafter.precision: fp8; issue 31): every GEMM of
// fc, q/k/v/o and gate/up/down with block-scaled e4m3 operands and fp32 accumulation, in the tiles
// of DeepSeek-V3's recipe (Transformer Engine's Float8BlockScaling), as the CPU backend simulates them
// (drafter/ref_math.h linear_fp8 / linear_bwd_fp8, the reference the tests hold this to):
//   forward  y = x·wᵀ     x 1 x 128 (per token, along K), w 128 x 128       gemm_fp8 VEC128 x BLK128x128
//   dgrad    dx = dy·w    dy 1 x 128 (along the output dim), wᵀ 128 x 128  the same, on wᵀ's codes
//   wgrad    dw += dyᵀ·x  dy and x 128 x 1 (along the tokens), fp32 dw     gemm_fp8 VEC128 x VEC128
//            (model.drafter.fp8_wgrad_x_tiles: 128x128: x in 128 x 128 blocks, VEC128 x BLK128x128)
// The activations and gradients between the GEMMs stay bf16 as in the bf16 step; each GEMM quantizes
// its operands (kernels/cuda/gemm.h quantize_fp8_act, quantize_fp8_tiles) into temporaries. The
// weights' codes (128 x 128, and their transposes for dgrad) are made from the bf16 weights by
// quantize() at the first CudaDrafter::step after the weights changed (refresh_weights() or a write
// through CudaDrafter::weights(), which the optimizer's update is), so once per optimizer step
// whatever the micro-batches and drafter passes of training.blocks_per_pass: ~2 bytes per parameter
// (3.4 GB for the 27B recipe's 1.7B-parameter drafter), reading 2 and writing 2 bytes per parameter
// (3.7 ms on an H200: kernel_bench --only fp8train's quant_weight rows).
//
// Sizes (check_fp8_drafter_sizes, drafter/fast_path.h): hidden_size, q_dim, kv_dim and
// intermediate_size multiples of 128, so that the fused q|k|v and gate|up matrices' 128-row blocks
// never straddle two projections (each projection's tiles are the CPU reference's) and every
// sub-range of them starts at a block row. Needs sm_90 (cuBLASLt's block-scaled FP8 kernels).
#include <cstdint>
#include <map>
#include <string>

#include "core/tensor.h"
#include "drafter/config.h"

#include "kernels/cuda/loss.h"

namespace dflash::drafter {

// The frozen LM head's codes for the FP8 cross-entropy (model.drafter.lm_head_precision: fp8; the
// contract is kernels/cuda/loss.h's FP8 form of linear_ce): the head [V, H] bf16 as 128 x 128 e4m3 tiles,
// q [Vq, H] and its transpose qt [H, Vq] (Vq = V rounded up to 16, the padding 0) with their scales,
// made once on the head's device and stream (2 bytes a parameter: 2.5 GB for a 248,320 x 5,120 head,
// which the memory plan counts). Needs H % 16 == 0.
struct Fp8LmHead {
  explicit Fp8LmHead(const Tensor& lm_head);
  cuda::LinearCeFp8Head codes() const;
  void fill(cuda::LinearCeParams& p) const;  // the four FP8 fields
  Tensor q, s, qt, st;
};

class Fp8Linears {
 public:
  Fp8Linears(const DrafterConfig& c, Device device);

  // The codes of every linear from the bf16 weights (weight(name): the device pointer of a parameter
  // of the flat bf16 buffer; q|k|v and gate|up adjacent), on the device's stream.
  template <class WeightOf>
  void quantize(const WeightOf& weight) {
    for (auto& [name, m] : mats_) quantize_one(m, weight(name));
  }

  // y[M, n] = x[M, K] · w[row0 : row0 + n, :]ᵀ, bf16 y (row stride ldy), or fp32 y += when acc_f32.
  // w names a parameter holding a forward matrix (fc, q_proj = the fused q|k|v, o_proj, gate_proj =
  // the fused gate|up, down_proj); row0 a multiple of 128.
  void forward(const void* x, int64_t ldx, int64_t M, int64_t K, const std::string& w, int64_t row0, int64_t n, void* y,
               int64_t ldy, bool acc_f32) const;
  // A linear's backward from one quantization of its output gradient dy [M, n] (both encodings from
  // one read: 1 x 128 codes for dx, transposed 128 x 1 codes for dw):
  //   dx[M, K] = dy · w  (bf16 dx, or fp32 dx += when acc_f32; skipped when dx is null) for w's whole
  //     dgrad matrix of n rows: q_proj (q|k|v), k_proj (the context's k|v), o_proj, gate_proj (gate|up),
  //     down_proj;
  //   dw[n, K] (fp32, row stride K) += dyᵀ · x[M, K]: x as 128 x 1 tiles along the tokens (VEC128 x VEC128),
  //     or with x_blocks as 128 x 128 blocks (VEC128 x BLK128x128, the forward's mode; StepOptions::
  //     fp8_wgrad_x_blocks, ref_math.h linear_bwd_fp8's x_blocks).
  void backward(const void* dy, int64_t lddy, int64_t M, int64_t n, const std::string& w, const void* x, int64_t ldx,
                int64_t K, void* dx, int64_t lddx, bool acc_f32, float* dw, bool x_blocks = false) const;

 private:
  struct Mat {  // one bf16 weight [rows, cols] as 128 x 128 codes: forward (q) and / or transposed (qt)
    int64_t rows = 0, cols = 0;
    bool fwd = false, tr = false;
    Tensor q, s, qt, st;
  };
  void quantize_one(Mat& m, const void* w_bf16);
  // The GEMM on quantized operands, M rows of y (padded to 4 through a temporary when M % 4 != 0).
  void gemm(const uint8_t* xq, const float* xs, int64_t M, int64_t K, const uint8_t* wq, const float* ws, bool w_vec, int64_t N, void* y, int64_t ldy, bool y_f32, bool acc) const;

  Device device_;
  std::map<std::string, Mat> mats_;
};

}  // namespace dflash::drafter
