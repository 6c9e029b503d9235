#pragma once
// The DFlash training objective: anchor sampling, block labels and decay weights, the fused
// chunked LM-head cross-entropy, and the metrics. CPU reference, computed in double.
//
// Block b of a sequence has anchor a_b; block position k (k = 0..B-1) sits at position a_b + k.
// Position k >= 1 predicts token a_b + k (k = 0 holds the known anchor token and is never
// predicted), with weight w = [a_b+k < S] · loss_mask[a_b+k] · exp(-(k-1)/gamma).
// Loss = Σ w·CE / Σ w.
#include <cstdint>
#include <vector>

#include "kernels/cpu/train_ops.h"
#include "core/tensor.h"

namespace dflash::drafter {

// Anchor candidates of one sequence: positions t with loss_mask[t] and loss_mask[t+1]. Up to
// num_anchors of them drawn uniformly without replacement (a partial Fisher-Yates shuffle driven
// by the counter RNG at (seed, stream)), returned sorted. All of them when there are fewer.
std::vector<int64_t> sample_anchors(const uint8_t* loss_mask, int64_t seq_len, int64_t num_anchors, uint64_t seed,
                                    uint64_t stream);

// The label of block position k (k >= 1) and its weight; label_shift is a test hook (0 is right).
struct BlockLabel {
  int64_t position = -1;  // a + k + label_shift, the token it predicts; -1 when outside the sequence
  double weight = 0;      // 0 for k = 0, outside the sequence, or loss_mask 0
};
BlockLabel block_label(const uint8_t* loss_mask, int64_t seq_len, int64_t anchor, int64_t k, double gamma,
                       int64_t label_shift = 0);

// Σ over a step of what the metrics need; sums add across micro-batches and ranks.
struct StepStats {
  double weighted_ce_sum = 0;        // Σ w·CE
  double weight_sum = 0;             // Σ w
  std::vector<int64_t> correct;      // [B] rows (w > 0) whose top-1 is the label, per block position
  std::vector<int64_t> counted;      // [B] rows with w > 0, per block position
  double accept_len_sum = 0;         // Σ over blocks of 1 + leading correct predictions
  int64_t num_blocks = 0;

  double loss() const { return weight_sum > 0 ? weighted_ce_sum / weight_sum : 0.0; }
  double accuracy(int64_t k) const;  // top-1 accuracy at block position k (0 when nothing counted)
  double accept_len() const { return num_blocks ? accept_len_sum / static_cast<double>(num_blocks) : 0.0; }
  void add(const StepStats& o);
};

// The fused, chunked linear cross-entropy through the frozen LM head: the CPU reference of the loss
// family, kernels/cpu/train_ops.h (the drafter's CPU model and the gpu tests use it by these names).
using cpu::CeSums;
using cpu::fused_linear_ce;

}  // namespace dflash::drafter
