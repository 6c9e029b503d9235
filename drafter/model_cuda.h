#pragma once
// The DFlash drafter on one GPU: forward and hand-written backward with the training kernels of
// kernels/cuda/ (gemm.h, norm.h, rope.h, elementwise.h, block_attention.h, loss.h, optimizer.h), and
// the optimizer state, all in flat device buffers.
//
// Precision: bf16 weights and activations, fp32 residual stream and its gradient, fp32 weight
// gradients (accumulated by the GEMMs: dW (+)= dYᵀ·X in fp32), fp32 master weights and AdamW
// moments. The CPU reference (model.h) computes the same step in double; tests/test_cuda_drafter
// compares the two. With StepOptions::fp8_linears (model.drafter.precision: fp8) every linear's GEMMs
// take block-scaled e4m3 operands instead (drafter/fp8_cuda.h), held to the CPU's f32 step with the
// same option; with StepOptions::fp8_lm_head the LM-head cross-entropy's two GEMMs do (Fp8LmHead, the
// FP8 form of cuda::linear_ce).
//
// Parameters live in three flat device buffers in DrafterWeights::entries order (each tensor at a
// 16-byte aligned offset): masters (fp32), weights (bf16, refreshed from the masters by the
// optimizer) and grads (fp32). A layer's q|k|v and gate|up are adjacent, so they serve as the fused
// [q+k+v, H] and [2I, H] GEMM operands. Gradient buckets: one per drafter layer plus one for
// fc / hidden_norm / norm; backward reports each bucket as soon as its gradient is final, so a
// data-parallel trainer can start its all-reduce while the remaining layers run.
//
// Per micro-batch, with R = blocks·B rows and N context rows (27B drafter: R 8192, N 4096):
//   forward: fc + hidden_norm on the context; per layer q|k, v GEMMs of the block rows, k, v GEMMs
//   of the context, head norms + RoPE, block attention, o_proj, RMSNorm, gate|up, SwiGLU, down;
//   final norm; fused chunked linear CE (the R × V logits never exist).
//   backward: the same in reverse, activation gradients bf16 between GEMMs, fp32 where they sum.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "drafter/config.h"
#include "drafter/loss.h"
#include "drafter/model.h"
#include "drafter/weights.h"
#include "core/tensor.h"

namespace dflash::drafter {

class Fp8Linears;  // drafter/fp8_cuda.h
struct Fp8LmHead;

class CudaDrafter {
 public:
  // Rows of LM-head logits made at a time, at least (the CPU default of 256 is too small for the
  // GPU's GEMMs); StepOptions::ce_chunk_rows may ask for more.
  static constexpr int64_t kMinCeChunkRows = 2048;

  // `init`: host weights (any float dtype) for the masters; embed_tokens / lm_head: the target's
  // frozen [V, H] tensors, bf16 on `device` (shared, never written).
  CudaDrafter(DrafterConfig c, const DrafterWeights& init, Tensor embed_tokens, Tensor lm_head, Device device);

  const DrafterConfig& config() const { return c_; }
  Device device() const { return device_; }

  struct Span {
    std::string name;
    int64_t offset = 0, numel = 0;  // in elements of the flat buffers
  };
  const std::vector<Span>& spans() const { return spans_; }
  int64_t num_params() const;  // trainable parameters (without padding)
  int64_t flat_size() const { return flat_; }

  // Flat buffers [flat_size()] on the device.
  Tensor& masters() { return masters_; }
  // The bf16 weights. The mutable form is how the optimizer writes them: it marks the FP8 weight
  // codes stale (remade by the next fp8 step), as refresh_weights() does.
  Tensor& weights() {
    fp8_stale_ = true;
    return weights_;
  }
  const Tensor& weights() const { return weights_; }
  Tensor& grads() { return grads_; }

  // Buckets: [first, end) element ranges of the flat buffers, in the order backward finishes them.
  struct Bucket {
    std::string name;
    int64_t first = 0, end = 0;
  };
  const std::vector<Bucket>& buckets() const { return buckets_; }
  using BucketReady = std::function<void(int64_t bucket)>;  // called on the host after the bucket's last
                                                             // kernel was enqueued on the device stream

  void zero_grads();
  // Forward, and backward when `backward`: grads (+)= grad_scale · ∂(Σ w·CE)/∂θ (grad_scale as in
  // StepOptions; 0 means 1 / Σw of this call). batch.context is [N, k·H] bf16 on this device.
  // `on_bucket` (optional) is called for every bucket when `backward` and `last_micro_batch`.
  StepStats step(const DrafterBatch& batch, const StepOptions& opt, bool backward, bool last_micro_batch = true,
                 const BucketReady& on_bucket = {});

  // The drafter's context input [N, k·H] bf16 from the k captured target layers ([N, H] bf16 each,
  // on one device), in target_layer_ids order.
  static Tensor pack_context(const std::vector<Tensor>& layers);

  // bf16 weights = masters (after loading masters from elsewhere).
  void refresh_weights();
  // A flat fp32 buffer (masters, grads, or an optimizer's moments of the same layout) <-> one tensor
  // per parameter in DrafterWeights::entries order: to_host makes F32 host copies; from_tensors
  // fills the buffer from tensors of any float dtype and device (padding zeroed).
  std::vector<Tensor> to_host(const Tensor& flat) const;
  // The same into existing contiguous F32 host tensors (one per parameter, entries order): one
  // device-to-host copy per parameter, no staging.
  void to_host(const Tensor& flat, const std::vector<Tensor*>& dst) const;
  void from_tensors(const std::vector<const Tensor*>& src, Tensor& flat) const;
  // Host copies (F32) of the masters / the gradients, in the DrafterWeights layout.
  DrafterWeights download_masters() const;
  DrafterWeights download_grads() const;
  // masters = w, and the bf16 weights refreshed.
  void upload_masters(const DrafterWeights& w);

 private:
  // step() in its parts, called in this order; every kernel runs on the device's stream, in the
  // order the one function had. StepState (model_cuda.cpp) carries what one part leaves for the next.
  struct StepState;
  void layout(StepState& st, const StepOptions& opt) const;  // block targets, ids, positions, offsets: uploaded
  void forward(StepState& st) const;                          // fc + hidden_norm, the layers, the final norm
  StepStats loss(StepState& st, const StepOptions& opt, bool backward) const;  // fused LM-head CE (synchronizes)
  void backward(StepState& st, bool last_micro_batch, const BucketReady& on_bucket);  // grads (+)=, buckets reported

  const Span& span(const std::string& name) const;
  void* wptr(const std::string& name) const;   // bf16 weight
  float* gptr(const std::string& name) const;  // fp32 grad
  DrafterWeights download(const Tensor& flat) const;
  static std::vector<const Tensor*> tensors_of(const DrafterConfig& c, const DrafterWeights& w);

  DrafterConfig c_;
  Device device_;
  Tensor embed_, lm_head_;
  bool gemm_unaligned_ = false;  // cuda_drafter_gemm_unaligned (fast_path.h): every GEMM passes GemmExParams::unaligned
  std::shared_ptr<Fp8Linears> fp8_;  // the FP8 linears' weight codes (StepOptions::fp8_linears), made by the first such step
  bool fp8_stale_ = true;            // the bf16 weights changed since fp8_'s codes were made
  std::shared_ptr<Fp8LmHead> lm_fp8_;  // the frozen head's codes (StepOptions::fp8_lm_head), made by the first such step
  std::vector<Span> spans_;
  std::vector<Bucket> buckets_;
  int64_t flat_ = 0;
  Tensor masters_, weights_, grads_;
};

}  // namespace dflash::drafter
