#pragma once
// What one rank of a GPU training run will hold, estimated from the configs before anything is
// loaded, so a run that cannot fit is refused at start-up with the numbers instead of failing with
// an out-of-memory error at its first step.
#include <cstdint>
#include <string>

#include "drafter/config.h"
#include "target_model/config.h"
#include "trainer/config.h"

namespace dflash::trainer {

struct MemoryPlan {
  double target_weights = 0;       // bf16 shard of the target (embedding and LM head replicated)
  double target_experts = 0;       // of target_weights: this rank's routed experts (MoE; num_experts / ep of them)
  double target_activations = 0;   // one forward of the micro-batch, with the captured layers
  double drafter_state = 0;        // bf16 weights + fp32 masters, Adam moments and gradients (18 B/param)
  double drafter_activations = 0;  // what forward saves for backward, plus backward's temporaries
  double ce_workspace = 0;         // one chunk of fp32 logits + bf16 logit gradients
  double attn_workspace = 0;       // block-attention backward: δ and the wgmma path's dSᵀ tiles
  double total() const {
    return target_weights + target_activations + drafter_state + drafter_activations + ce_workspace + attn_workspace;
  }
  std::string table(double device_bytes) const;  // one line per item, GiB, and the share of the device
};

// local_target: this rank's shard (target::local_config); tokens: context rows of a micro-batch
// (batch_size · max_length); max_seqlen: the longest sequence (max_length); blocks: anchor blocks
// this rank trains per micro-batch. fp8_target: the projections held as e4m3 codes (1 byte per
// weight, plus a 4-byte scale per 128 x 128 block) instead of bf16. fp8_drafter (model.drafter.precision:
// fp8): the drafter state adds its linears' e4m3 codes and their transposes (drafter/fp8_cuda.h).
// fp8_experts (model.target.fp8_experts): an MoE target's routed experts as e4m3 codes plus their
// block scales, and one layer's experts in bf16 (the grouped GEMMs' copy) among the activations.
// fp8_lm_head (model.drafter.lm_head_precision: fp8): the CE workspace is the FP8 form's (the chunk's
// fp32 logits, its hidden rows' and gradient's codes) and holds the frozen head's codes (2 bytes a value).
MemoryPlan gpu_memory_plan(const target::TargetConfig& local_target, const drafter::DrafterConfig& d, int64_t tokens,
                           int64_t max_seqlen, int64_t blocks, int64_t ce_chunk_rows, bool fp8_target = false,
                           bool fp8_drafter = false, bool fp8_experts = false, bool fp8_lm_head = false);

// The anchor blocks of one drafter pass on a rank of a TP group of `tp` (what gpu_memory_plan's `blocks`
// is): a micro-batch's share, batch_size · num_anchors / tp rounded up, at most training.blocks_per_pass.
int64_t blocks_per_drafter_pass(const TrainConfig& cfg, int64_t tp);

// Bytes per token of the target's widest MLP-block buffers (dense: gate|up and product; MoE: router
// scores, top-k ids and weights, per chosen expert its gathered input, gate|up, product and output,
// the shared expert's), as target_activations counts them.
double mlp_activation_bytes_per_token(const target::TargetConfig& t);

}  // namespace dflash::trainer
