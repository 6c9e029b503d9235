#pragma once
// Greedy decoding with the target alone and speculative decoding with a DFlash drafter, on any
// target::Decoder (CPU reference or CUDA) and drafter::Proposer — the loop of z-lab's reference
// dflash_generate and of the serving engines, written once:
//
//   prefill the prompt (features of its positions -> the drafter's context); x0 = argmax
//   loop: drafts d1..d(B-1) = propose([x_start, mask × (B-1)])
//         verify: the target runs [x_start, d1..d(B-1)] on its state (one extend, commit = false)
//         k = the longest prefix with d(i) == target argmax after position i-1
//         accept x_start, d1..dk and the bonus argmax after dk: commit(k + 1) on the target,
//         the k + 1 positions' features to the drafter's context; the step's acceptance length is k + 1
//
// Verification is greedy, so the tokens equal the target's own greedy decoding, token for token;
// dflash_eval checks that on every prompt. tau = the mean acceptance length over steps.
#include <cstdint>
#include <functional>
#include <vector>

#include "drafter/decode.h"
#include "drafter/model.h"
#include "target_model/decode.h"

namespace dflash::bench {

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  std::vector<int32_t> stop_tokens;  // generation ends after the first of these (kept in the output)
  int64_t block_size = 16;           // speculative decoding: tokens per verify (x_start + B-1 drafts)
};

// Seconds spent per phase (host clocks around calls that return host results, so device work is in).
struct PhaseTimes {
  double prefill = 0, decode = 0;            // target-only: the prompt, then one token per step
  double propose = 0, verify = 0, commit = 0;  // speculative (prefill as above)
  double steps() const { return decode + propose + verify + commit; }  // everything after the prefill
  // Each step's seconds, in order (their sums are the totals above): the medians and p20 / p80 of
  // dflash_eval's step rows, apart from the one-off costs the means carry (a shape's first, eager step
  // and its CUDA graph capture).
  std::vector<double> decode_steps, propose_steps, verify_steps, commit_steps;
  void add(const PhaseTimes& o);  // totals added, step lists appended
};

struct Generation {
  std::vector<int32_t> tokens;       // the new tokens: at most max_new_tokens, ending at a stop token if one came
  std::vector<int64_t> accept;       // speculative: acceptance length (k + 1) of each step
  std::vector<int64_t> block_starts; // speculative: position of each step's x_start in the sequence
  PhaseTimes times;
};

// Target-only greedy decoding of `prompt` in `slot` (reset first). `extra` more greedy tokens are
// made after the timed ones (labels for the acceptance estimate; not in `times`, ignoring stops).
Generation greedy_generate(target::Decoder& target, int32_t slot, const std::vector<int32_t>& prompt,
                           const GenerateOptions& options, int64_t extra = 0);

// Speculative decoding of `prompt` in `slot` of both (reset first); `capture` = the drafter's
// target_layer_ids.
Generation speculative_generate(target::Decoder& target, drafter::Proposer& proposer, int32_t slot,
                                const std::vector<int32_t>& prompt, const GenerateOptions& options);

// The trainer's acceptance-length estimate (StepStats::accept_len: 1 + the leading correct
// predictions of a block, labels = the target's greedy tokens) on one prompt's sequence
// `sequence` = prompt + greedy tokens (+ B-1 more), with the target's features of every position
// [N, k·H] (host): at the given block starts (the speculative steps': equal to the measured
// acceptance when training and inference compute the same thing) and at every generated position.
struct AcceptEstimate {
  drafter::StepStats at_steps, at_all;
};
// The drafter's training forward on a batch (no backward): forward_backward on the CPU reference,
// CudaDrafter::step on a GPU. Its blocks have the evaluated block size.
using DrafterScorer = std::function<drafter::StepStats(const drafter::DrafterBatch&)>;
AcceptEstimate training_estimate(const DrafterScorer& score, const Tensor& features, const std::vector<int32_t>& sequence,
                                 int64_t prompt_len, int64_t generated, const std::vector<int64_t>& block_starts);
// The CPU scorer of a drafter with blocks of block_size, in the proposer's arithmetic (math).
DrafterScorer cpu_scorer(const drafter::DrafterConfig& config, const drafter::DrafterWeights& weights,
                         const drafter::FrozenTarget& target, int64_t block_size,
                         drafter::DrafterMath math = drafter::DrafterMath::F64);

}  // namespace dflash::bench
