#pragma once
// A drafter micro-batch made from whole sequences: their tokens and loss masks packed, and the
// anchor blocks drawn for each sequence, split round-robin among the ranks of a TP group. The
// trainer (trainer/train.cpp) builds every micro-batch here; the tests build theirs the same way.
//
// Determinism: a sequence's anchors come from Philox at (seed, its anchor stream) alone, so they do
// not depend on which rank, micro-batch or batch position handles it. The blocks of a batch are
// numbered in order (sequence by sequence, anchors ascending); block i belongs to shard
// i % num_shards. Resume and the CPU-vs-reference tests rely on both rules.
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "drafter/model.h"
#include "kernels/ops.h"

namespace dflash::drafter {

struct BatchSequence {
  std::span<const int32_t> ids;  // [S] token ids
  std::span<const uint8_t> mask;  // [S] 0/1 loss mask
  uint64_t anchor_stream = 0;     // Philox stream of its anchors (dflash_train: step·2^32 + the
                                  // sequence's global index in the dataset)
};

struct BlockSampling {
  int64_t num_anchors = 0;  // per sequence, at most (sample_anchors)
  uint64_t seed = 0;
  int shard = 0, num_shards = 1;  // this rank's share: the blocks i with i % num_shards == shard
};

// The blocks of a packed batch (loss_mask over the offsets of `seqs`): sequence s draws its anchors
// with sample_anchors(mask_s, S_s, num_anchors, seed, streams[s]); sorted by (seq, anchor).
std::vector<Block> sample_blocks(const std::vector<uint8_t>& loss_mask, const ops::SeqOffsets& seqs,
                                 const std::vector<uint64_t>& streams, const BlockSampling& sampling);

// A batch of `seqs` in order: tokens, loss_mask and offsets packed, this shard's blocks from
// sample_blocks (context left undefined: the caller's target forward fills it).
DrafterBatch make_batch(const std::vector<BatchSequence>& seqs, const BlockSampling& sampling);

// `sum` plus Σ w of the batch's block rows k = 1..block_size-1 (block_label's weights), added one
// by one in block order: a sum over micro-batches is the same number however they are grouped.
double add_block_weights(const DrafterBatch& batch, int64_t block_size, double gamma, double sum);

// A micro-batch's blocks in passes of at most `per_pass` blocks over the same context (0, or at least
// as many as there are: one pass of all): `pass(last)` runs with batch.blocks set to the pass's blocks
// (in order) and returns its stats; their sum is returned, and batch.blocks is restored. Every block
// depends on the context and its own tokens only, so the passes' gradients sum to those of one pass
// over all blocks (in another order of summation) when the loss normalisation is fixed beforehand:
// grad_scale > 0 is required for more than one pass (0 would normalise each pass by its own Σw).
// What it buys: the drafter's activations and block-attention workspace of per_pass blocks instead of
// all (training.blocks_per_pass; long sequences with many anchors), for the context rows' work
// (fc, the context K/V) once per pass.
StepStats for_each_block_pass(DrafterBatch& batch, int64_t per_pass, double grad_scale,
                              const std::function<StepStats(bool last)>& pass);

}  // namespace dflash::drafter
