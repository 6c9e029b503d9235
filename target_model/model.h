#pragma once
// The Qwen3.5 hybrid target forward (decoder stack, frozen, no KV cache) with hidden-state capture.
#include <cstdint>
#include <map>
#include <vector>

#include "comm/comm.h"
#include "kernels/ops.h"
#include "target_model/config.h"
#include "target_model/fast_path.h"
#include "target_model/weights.h"

namespace dflash::target {

struct ForwardOptions {
  // Decoder layers whose outputs are returned: id i is the output of layer i, which transformers
  // calls hidden_states[i + 1] (for i < L - 1; transformers' last entry is after the final norm).
  std::vector<int64_t> capture;
  bool final_norm = false;  // also return norm(output of the last layer)
  ops::DeltaRuleAlgo delta_rule = ops::DeltaRuleAlgo::Chunked;
  PathCounters* counters = nullptr;  // when set, the CPU forward counts its conv / delta-rule / attention steps
};

struct ForwardResult {
  std::vector<int64_t> offsets;       // packed sequence boundaries, offsets.back() = total tokens
  std::map<int64_t, Tensor> layers;   // layer id -> (N, H) f32
  Tensor final_hidden;                // (N, H) when ForwardOptions::final_norm
};

// The CPU reference holds f32 weights: throws, naming both sizes and `hint`, when this rank's
// share `local` of the target `full` would need more than 80% of this machine's memory.
void check_cpu_reference_fits(const TargetConfig& local, const TargetConfig& full, const std::string& hint);

class TargetModel {
 public:
  // With `tp` set (a tensor-parallel group), `config` and `weights` are this rank's shard
  // (local_config / *_weights_tp in tp.h) and each mixer's and MLP's output is all-reduced.
  TargetModel(TargetConfig config, TargetWeights weights, comm::Communicator* tp = nullptr);
  const TargetConfig& config() const { return config_; }
  const TargetWeights& weights() const { return weights_; }

  // Runs a batch of token sequences (each non-empty; ids in [0, vocab_size)).
  ForwardResult forward(const std::vector<std::vector<int32_t>>& sequences, const ForwardOptions& options) const;

 private:
  void gdn_mixer(const LayerWeights& L, const Tensor& x, const ops::SeqOffsets& seqs, ops::DeltaRuleAlgo algo,
                 Tensor& out) const;
  void attention_mixer(const LayerWeights& L, const Tensor& x, const ops::SeqOffsets& seqs, Tensor& out) const;
  void mlp(const LayerWeights& L, const Tensor& x, Tensor& out) const;

  TargetConfig config_;
  TargetWeights weights_;
  comm::Communicator* tp_ = nullptr;
};

}  // namespace dflash::target
