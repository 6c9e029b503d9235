#pragma once
// Batched generation on a Decoder's slot pool (continuous batching): the engine of
// `dflash_data regenerate` and of the generation benchmark.
//
//   while prompts wait or sequences run:
//     free slots take the next prompts, packed into one prefill extend (at most prefill_tokens
//       prompt tokens per extend, at least one prompt); each prompt's last row gives its first token
//     every running sequence decodes one token (one extend over all running slots)
//     a sequence ends at a stop token (kept) or after its max new tokens (the request's, else the
//       config's); its slot takes the next prompt
//
// With step_tokens > 0 (chunked prefill inside the decode steps, as vLLM's and SGLang's schedulers
// run it) the prompts do not stop the decoding: free slots take the next prompts at once, and every
// step is one extend of one token per decoding sequence plus pieces of the prompts still being
// prefilled (oldest first, a prompt cut wherever the budget ends) up to step_tokens tokens in all.
// A prompt's piece rides on the decode step's weight read; its last piece gives its first token.
// A step whose decoding sequences are not more than the prompts waiting with none of their tokens in
// (the start, a wave that ended together; nothing decoding) takes up to max(step_tokens,
// prefill_tokens) tokens in all, its decode rows included: it is mostly prefill, and a wave fed
// step_tokens a step would start, and end, its later prompts many steps after its first.
//
// Greedy decoding, or sampling with the Decoder's reproducible draws (ops::sample_rows): request
// `id` is the sampling stream, so a sequence's tokens depend on (seed, id, prompt) alone — not on
// the batch it ran in, the slot count or a restart. (Greedy tokens are the argmax of logits that
// a GPU computes with the batch's GEMM shapes; two runs with the same slots and requests give the
// same tokens, and data/regenerate.h runs its parts so that a restart repeats them.)
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "target_model/decode.h"

namespace dflash::target {

// The regeneration tools' step_tokens by default (dflash_data regenerate --step-tokens, the training
// config's data.regenerate.step_tokens): chunked prefill at 256 tokens a step. Measured on an H100 (Qwen3.6-27B
// shapes, 64 slots; bench/results/h100-pieces-d3101ae, h100-wave-733d00b): +2.7% (fp8) and +4.6% (bf16) generated
// tok/s on a stream of prompts, within 1% of separate prefills on one wave. GenerateConfig's own default stays 0.
constexpr int64_t kRegenerateStepTokens = 256;

struct GenerateConfig {
  int64_t max_new_tokens = 256;
  std::vector<int32_t> stop_tokens;          // a generation ends after the first of these (kept)
  std::optional<ops::SampleParams> sample;   // none: greedy
  int64_t prefill_tokens = 16384;            // prompt tokens per prefill extend (at least one prompt)
  // Tokens per step with chunked prefill inside the decode steps (decode rows first, then prompt
  // pieces; a step with nothing decoding takes up to prefill_tokens); 0: prompts are prefilled whole
  // in their own extends (prefill_tokens) between decode steps.
  int64_t step_tokens = 0;
};

struct GenRequest {
  uint64_t id = 0;               // the sampling stream (e.g. the sequence's index in its dataset)
  std::vector<int32_t> prompt;   // >= 1 token
  int64_t max_new_tokens = 0;    // this request's cap on new tokens (>= 1); 0: the config's max_new_tokens
};

struct GenResult {
  uint64_t id = 0;
  size_t index = 0;              // position of the request in the list given to generate_batch
  std::vector<int32_t> tokens;   // the new tokens (1 .. max_new_tokens)
  bool stopped = false;          // ended at a stop token (else at max_new_tokens)
};

struct GenStats {
  int64_t sequences = 0, prompt_tokens = 0, generated = 0;  // finished so far
  int64_t prefills = 0, decode_steps = 0;
  int64_t decode_rows = 0;       // sum over decode steps of the sequences in the step
  // step_tokens > 0: decode steps that carried prompt pieces too, and those pieces' tokens (a step of
  // prompt pieces alone counts as a prefill; its time is prefill_s, a mixed step's is decode_s).
  int64_t mixed_steps = 0, mixed_prompt_tokens = 0;
  double prefill_s = 0, decode_s = 0;
  double seconds() const { return prefill_s + decode_s; }
  double occupancy() const { return decode_steps ? static_cast<double>(decode_rows) / static_cast<double>(decode_steps) : 0.0; }
  void add(const GenStats& o);
};

// Checks the config (max_new_tokens >= 1, stop ids, prefill_tokens, step_tokens, sampling) and
// that every request fits a slot (prompt + its max new tokens <= the decoder's max_len), naming the
// request; then generates every request on the decoder's slots. on_done gets each sequence as it
// ends (in completion order, not request order); progress (optional) is called after every
// prefill and decode step with the running totals.
GenStats generate_batch(Decoder& decoder, const std::vector<GenRequest>& requests, const GenerateConfig& config,
                        const std::function<void(GenResult&&)>& on_done,
                        const std::function<void(const GenStats&)>& progress = {});

// The checks of generate_batch on the config alone (vocab: the target's vocabulary size).
void check_generate_config(const GenerateConfig& config, int64_t vocab);

}  // namespace dflash::target
