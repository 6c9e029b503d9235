#include "drafter/batch.h"

#include <algorithm>

#include "drafter/loss.h"
#include "core/error.h"

namespace dflash::drafter {

std::vector<Block> sample_blocks(const std::vector<uint8_t>& loss_mask, const ops::SeqOffsets& seqs,
                                 const std::vector<uint64_t>& streams, const BlockSampling& sampling) {
  seqs.validate(static_cast<int64_t>(loss_mask.size()), "sample_blocks");
  DFLASH_CHECK(static_cast<int64_t>(streams.size()) == seqs.num_sequences(),
               "sample_blocks: " << streams.size() << " anchor streams for " << seqs.num_sequences() << " sequences");
  DFLASH_CHECK(sampling.num_shards >= 1 && sampling.shard >= 0 && sampling.shard < sampling.num_shards,
               "sample_blocks: shard " << sampling.shard << " of " << sampling.num_shards);
  std::vector<Block> blocks;
  int64_t blk = 0;  // the batch's blocks, numbered over all its sequences
  for (int64_t s = 0; s < seqs.num_sequences(); ++s) {
    const int64_t off = seqs.offsets[s], S = seqs.offsets[s + 1] - off;
    for (int64_t a : sample_anchors(loss_mask.data() + off, S, sampling.num_anchors, sampling.seed,
                                    streams[static_cast<size_t>(s)])) {
      if (blk++ % sampling.num_shards != sampling.shard) continue;  // round-robin among the shards
      blocks.push_back({s, a});
    }
  }
  return blocks;
}

DrafterBatch make_batch(const std::vector<BatchSequence>& seqs, const BlockSampling& sampling) {
  DrafterBatch b;
  b.seqs.offsets = {0};
  std::vector<uint64_t> streams;
  for (const BatchSequence& sq : seqs) {
    DFLASH_CHECK(sq.ids.size() == sq.mask.size(),
                 "make_batch: a sequence of " << sq.ids.size() << " tokens has " << sq.mask.size() << " mask entries");
    b.tokens.insert(b.tokens.end(), sq.ids.begin(), sq.ids.end());
    b.loss_mask.insert(b.loss_mask.end(), sq.mask.begin(), sq.mask.end());
    b.seqs.offsets.push_back(b.seqs.offsets.back() + static_cast<int64_t>(sq.ids.size()));
    streams.push_back(sq.anchor_stream);
  }
  if (!seqs.empty()) b.blocks = sample_blocks(b.loss_mask, b.seqs, streams, sampling);  // (an empty batch: no blocks)
  return b;
}

double add_block_weights(const DrafterBatch& batch, int64_t block_size, double gamma, double sum) {
  for (const Block& bl : batch.blocks) {
    const int64_t off = batch.seqs.offsets[bl.seq], S = batch.seqs.offsets[bl.seq + 1] - off;
    for (int64_t k = 1; k < block_size; ++k) sum += block_label(batch.loss_mask.data() + off, S, bl.anchor, k, gamma).weight;
  }
  return sum;
}

StepStats for_each_block_pass(DrafterBatch& batch, int64_t per_pass, double grad_scale,
                              const std::function<StepStats(bool last)>& pass) {
  const int64_t n = static_cast<int64_t>(batch.blocks.size());
  DFLASH_CHECK(per_pass >= 0, "for_each_block_pass: " << per_pass << " blocks per pass");
  if (per_pass == 0 || n <= per_pass) return pass(true);
  DFLASH_CHECK(grad_scale > 0, "for_each_block_pass: " << n << " blocks in passes of " << per_pass
                                                       << " need a fixed loss normalisation (grad_scale > 0)");
  std::vector<Block> all = std::move(batch.blocks);
  StepStats sum;
  try {
    for (int64_t b0 = 0; b0 < n; b0 += per_pass) {
      const int64_t b1 = std::min(n, b0 + per_pass);
      batch.blocks.assign(all.begin() + b0, all.begin() + b1);
      sum.add(pass(b1 == n));
    }
  } catch (...) {
    batch.blocks = std::move(all);
    throw;
  }
  batch.blocks = std::move(all);
  return sum;
}

}  // namespace dflash::drafter
