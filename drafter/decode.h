#pragma once
// The DFlash drafter at inference: proposing a block of draft tokens on top of a per-sequence
// context KV cache, the same math as the training forward (model.h) for one block whose anchor is
// the sequence's current end.
//
// For a sequence whose context holds the target features of positions 0..n-1 (n = context_length),
// propose(x_start) runs the block [x_start, mask × (B-1)] at positions n..n+B-1: every layer's
// queries attend the cached context keys (k/v_proj of hidden_norm(fc(features)), k_norm, RoPE at
// their positions) under the training mask (drafter/model.h mask_allows with anchor = n: all
// context keys of a full layer, the window of a sliding one) and the block's own keys (both ways in
// a full layer, causally in a sliding one); the logits of block rows 1..B-1 through the target's
// lm_head give the drafts d1..d(B-1) (greedy argmax; ties go to the lowest id). Then, once the
// target has verified them, add_context appends the features of the accepted positions n..n+k, and
// the next block starts at n + k + 1.
//
// One pool of `num_slots` sequences of up to `max_len` context positions each; several sequences
// go through one call (packed, in `slots` order). The CPU reference (make_cpu_proposer, double
// inside like forward_backward, or its float twin) is the oracle; the CUDA proposer (bf16 weights, fp32 softmax and
// norms) is tested against it.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "drafter/config.h"
#include "drafter/model.h"
#include "drafter/weights.h"
#include "kernels/ops.h"
#include "core/tensor.h"

namespace dflash::drafter {

class Proposer {
 public:
  virtual ~Proposer() = default;
  virtual const DrafterConfig& config() const = 0;
  virtual Device device() const = 0;
  virtual int64_t num_slots() const = 0;
  virtual int64_t max_len() const = 0;

  // Empties slot `slot` (context length 0).
  virtual void reset(int32_t slot) = 0;
  virtual int64_t context_length(int32_t slot) const = 0;
  // How the proposer launched its propose and add_context steps ("" where that does not apply, e.g. the
  // CPU proposer).
  virtual std::string graph_stats() const { return {}; }

  // Appends to each slots[s] the context rows features[seqs.offsets[s] .. seqs.offsets[s+1]) (the
  // target's captured layers of the next positions, [N, k·H], on this proposer's device; any float
  // dtype on the CPU, bf16 on CUDA). Throws when a slot would exceed max_len.
  virtual void add_context(const std::vector<int32_t>& slots, const Tensor& features, const ops::SeqOffsets& seqs) = 0;

  // For each slots[s] (distinct), the block [x_start[s], mask × (block_size - 1)] at its context's
  // end; returns block_size - 1 drafts per slot. 2 <= block_size <= config().block_size; the slot's
  // context length + block_size must be <= max_len. When `logits` is given it is set to the
  // [S · block_size, V] f32 host logits of every block row (row 0 too; tests compare them with the
  // training forward's).
  virtual std::vector<std::vector<int32_t>> propose(const std::vector<int32_t>& slots, const std::vector<int32_t>& x_start,
                                                    int64_t block_size, Tensor* logits = nullptr) = 0;
};

// The CPU proposer. `weights` in any float dtype (read into double, or float with DrafterMath::F32);
// the frozen target's embed_tokens / lm_head as in forward_backward. Its drafts are those of
// forward_backward with the same math (StepOptions::math) on the same block, bit for bit.
std::unique_ptr<Proposer> make_cpu_proposer(const DrafterConfig& config, const DrafterWeights& weights,
                                            const FrozenTarget& target, int64_t num_slots, int64_t max_len,
                                            DrafterMath math = DrafterMath::F64);

}  // namespace dflash::drafter
