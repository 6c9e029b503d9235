#pragma once
// The target forward on one GPU: bf16 weights and activations, fp32 accumulation, fp32
// GatedDeltaNet state, kernels chosen per layer by the fast-path plan and counted as they launch.
// (Built only with the CUDA backend; tensor parallelism comes with comm/.)
#include <vector>

#include "target_model/fast_path.h"
#include "target_model/model.h"

namespace dflash::target {

// A packed batch on the device: ids, per-token positions and sequence boundaries.
struct CudaBatch {
  std::vector<int64_t> offsets;  // host copy
  int64_t num_tokens = 0, num_seqs = 0, max_seqlen = 0;
  Tensor ids, pos, cu_seqlens;   // int32 on the device: [N], [N], [S + 1]
};

class CudaTargetModel {
 public:
  // `weights` must be bf16 on a CUDA device; the in-projections are fused in place (q|k|v|z|b|a,
  // q|k|v, gate|up) so each mixer and MLP starts with one GEMM.
  // With `tp`, config / weights / plan are this rank's shard (tp.h) and the output of each mixer
  // and MLP is all-reduced over the group (NCCL).
  CudaTargetModel(TargetConfig config, TargetWeights weights, FastPathPlan plan, comm::Communicator* tp = nullptr);

  const TargetConfig& config() const { return config_; }
  const FastPathPlan& plan() const { return plan_; }
  // Switches kernels (e.g. to time the fallback with the same weights); must match the config.
  void set_plan(FastPathPlan plan);
  PathCounters& counters() { return counters_; }
  Device device() const { return device_; }

  // Validates the sequences (as TargetModel::forward does) and uploads them.
  CudaBatch make_batch(const std::vector<std::vector<int32_t>>& sequences) const;

  // Captured layers come back as bf16 (N, H) device tensors; final_hidden likewise.
  ForwardResult forward(const std::vector<std::vector<int32_t>>& sequences, const ForwardOptions& options);
  ForwardResult forward(const CudaBatch& batch, const ForwardOptions& options);

  // One decoder layer in place on h (bf16 (N, H) on the device) with the kernels of `layer_plan`
  // (the model's own plan, or another one to compare paths). Enqueued on the device stream.
  void run_layer(int64_t i, Tensor& h, const CudaBatch& batch, const LayerPlan& layer_plan);

 private:
  struct Fused {
    Tensor in_proj;   // GDN: (P, H) rows [qkv | z | b | a | pad]; attention: [q(+gate) | k | v | pad]
    int64_t rows = 0; // P (a multiple of 8 so every row of the GEMM output stays 16-byte aligned)
    Tensor gate_up;   // (2I, H)
  };
  // Mixer and MLP of layer i on h, from `normed` = input_norm(h) (overwritten as scratch); ends with
  // the residual add fused with `next_norm` into *next_out when next_norm is set.
  void layer_body(int64_t i, Tensor& h, Tensor& normed, const CudaBatch& b, const LayerPlan& lp, const Tensor* next_norm,
                  Tensor* next_out);
  void gdn_mixer(int64_t i, const Tensor& x, const CudaBatch& b, const LayerPlan& lp, Tensor& out);
  void attention_mixer(int64_t i, const Tensor& x, const CudaBatch& b, const LayerPlan& lp, Tensor& out);
  void mlp(int64_t i, const Tensor& x, Tensor& out);
  void gemm(const Tensor& x, int64_t ldx, const Tensor& w, Tensor& y, int64_t ldy, int64_t M, int64_t N, int64_t K,
            bool accumulate = false);

  TargetConfig config_;
  TargetWeights weights_;
  FastPathPlan plan_;
  std::vector<Fused> fused_;
  PathCounters counters_;
  Device device_;
  void* stream_ = nullptr;
  comm::Communicator* tp_ = nullptr;
};

}  // namespace dflash::target
