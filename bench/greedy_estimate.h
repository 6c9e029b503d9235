#pragma once
// The trainer's acceptance estimate on a greedy generation, as dflash_eval reports it per prompt and
// tests/test_speculative.cpp checks it against the measured acceptance. Header only.
#include <cstdint>
#include <vector>

#include "bench/speculative.h"
#include "target_model/decode.h"

namespace dflash::bench {

// training_estimate on prompt + greedy (every greedy token, `generated` of them counted as new),
// with the features of one forward of that sequence through `target` in slot 0 (reset first),
// capturing `capture` (the drafter's target_layer_ids).
inline AcceptEstimate greedy_training_estimate(target::Decoder& target, const std::vector<int64_t>& capture,
                                               const DrafterScorer& score, const std::vector<int32_t>& prompt,
                                               const std::vector<int32_t>& greedy, int64_t generated,
                                               const std::vector<int64_t>& block_starts) {
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), greedy.begin(), greedy.end());
  target::ExtendOptions eo;
  eo.capture = capture;
  target.reset(0);
  const target::ExtendResult whole = target.extend({0}, {seq}, eo);
  return training_estimate(score, whole.features, seq, static_cast<int64_t>(prompt.size()), generated, block_starts);
}

}  // namespace dflash::bench
