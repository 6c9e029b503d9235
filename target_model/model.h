#pragma once
// The Qwen3.5 hybrid target forward (decoder stack, frozen, no KV cache) with hidden-state capture.
#include <cstdint>
#include <functional>
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
  // Run only the layers an output needs: with final_norm and capture_routing off, the layers after
  // the last `capture` id are skipped (their outputs would be dropped). The trainer sets it: the 27B
  // recipe captures layers 1..61 of 64, so layers 62 and 63 do not run. Off by default, so a forward
  // with no outputs asked (target_bench) still runs the whole stack.
  bool skip_unused_layers = false;
  ops::DeltaRuleAlgo delta_rule = ops::DeltaRuleAlgo::Chunked;
  PathCounters* counters = nullptr;  // when set, the CPU forward counts its conv / delta-rule / attention steps
  bool capture_routing = false;      // MoE targets: also return each layer's router choices
  // Tests (MoE targets): layer i routes by router_logits->at(i) ([N, E] f32, host) instead of its
  // router's logits where the map has layer i: a reference's routing forced onto this model. With
  // capture_routing such a layer returns the forced choices and weights beside its router's own logits.
  const std::map<int64_t, Tensor>* router_logits = nullptr;
};

struct ForwardResult {
  std::vector<int64_t> offsets;       // packed sequence boundaries, offsets.back() = total tokens
  std::map<int64_t, Tensor> layers;   // layer id -> (N, H) f32
  Tensor final_hidden;                // (N, H) when ForwardOptions::final_norm
  std::map<int64_t, ops::MoeRouting> routing;  // layer -> top-k experts / weights (N, k), when capture_routing
};

// How many decoder layers (0..n-1) a forward with `options` runs: num_hidden_layers unless
// skip_unused_layers lets it stop after the last captured layer.
int64_t layers_to_run(const TargetConfig& c, const ForwardOptions& options);

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

  // ---- The pieces of a layer that the forward and the decoder (decode.cpp) share; they differ
  // only in the conv, the delta rule, RoPE positions and attention, which run on slot states there.
  // One layer's token mixer: out = mixer(input_norm(h)), all-reduced under tp.
  using Mixer = std::function<void(int64_t layer, const LayerWeights& L, const Tensor& normed, Tensor& out)>;
  // Embeds ids [N] (int32, checked) and runs the decoder stack with `mixer` (residuals, norms, MLP);
  // copies the outputs of the `capture` layers into `layers` (and, when `routing` is given, an MoE
  // target's router choices of every layer into it); returns the last layer's output [N, H].
  // `router_logits`: ForwardOptions::router_logits. num_layers >= 0 runs layers 0..num_layers-1 only.
  Tensor run_stack(const Tensor& ids, const Mixer& mixer, const std::vector<int64_t>& capture,
                   std::map<int64_t, Tensor>& layers, std::map<int64_t, ops::MoeRouting>* routing = nullptr,
                   const std::map<int64_t, Tensor>* router_logits = nullptr, int64_t num_layers = -1) const;
  // The sparse MoE block (config().is_moe()) on x [N, H] -> out [N, H]; the router's choices in
  // `routing`; routed by `logits` [N, E] instead of the router's when given.
  void moe(const LayerWeights& L, const Tensor& x, Tensor& out, ops::MoeRouting& routing,
           const Tensor* logits = nullptr) const;
  // GatedDeltaNet mixer: the in-projections [q|k|v] (conv input), z, a, b ...
  struct GdnInputs {
    Tensor mixed;  // [N, conv_dim]
    Tensor z;      // [N, Hv·dv]
    Tensor a, b;   // [N, Hv]
  };
  GdnInputs gdn_inputs(const LayerWeights& L, const Tensor& x) const;
  // ... the delta rule's q, k, v from the conv output [N, conv_dim] and its gates (l2norm_qk set) ...
  ops::DeltaRuleParams gdn_core_params(const LayerWeights& L, const Tensor& conv, const GdnInputs& in) const;
  // ... and the gated RMSNorm + out_proj of the core's output [N, Hv, dv].
  void gdn_output(const LayerWeights& L, const Tensor& core, const Tensor& z, Tensor& out) const;
  // Gated attention mixer: q [N, Hq, d] and k [N, Hkv, d] after their norms (RoPE not applied), v,
  // and the output gate [N, Hq·d] (undefined without attn_output_gate) ...
  struct AttnInputs {
    Tensor q, k, v, gate;
  };
  AttnInputs attn_inputs(const LayerWeights& L, const Tensor& x) const;
  // ... and the gate + o_proj of the attention output [N, Hq, d] (overwritten).
  void attn_output(const LayerWeights& L, Tensor& attn, const Tensor& gate, Tensor& out) const;
  // y = final norm(h); logits [N, V] = y · lm_headᵀ.
  void final_norm(const Tensor& h, Tensor& y) const;
  void lm_head(const Tensor& normed, Tensor& logits) const;
  comm::Communicator* tp() const { return tp_; }
  // MoE: this rank's expert group (tp.h: rank / (tp / ep)), and the (token, expert) pairs routed to
  // each of the ep_size groups, summed over every layer and call since construction (the routing is
  // replicated, so every rank knows every group's load; a forward of N tokens adds N·k·L in all).
  int64_t expert_group() const;
  const std::vector<int64_t>& expert_load() const { return expert_load_; }

 private:
  void mlp(const LayerWeights& L, const Tensor& x, Tensor& out) const;

  TargetConfig config_;
  TargetWeights weights_;
  comm::Communicator* tp_ = nullptr;
  mutable std::vector<int64_t> expert_load_;  // [ep_size]; counted by the (const) forward, single-threaded
};

}  // namespace dflash::target
