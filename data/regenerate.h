#pragma once
// Regeneration: the responses of a token dataset replaced by the target's own (dflash_data
// regenerate, and dflash_train's data.regenerate on first use). DFlash drafters reach their
// acceptance lengths when they learn the target's distribution, not the corpus author's.
//
// The prompt of a sequence is its tokens before the first loss_mask = 1 (a sequence without
// supervised tokens is a whole prompt). The output holds, per input sequence in input order,
// prompt (loss_mask 0) + the target's response (loss_mask 1), as dflash.tokens.v1.
//
// Work is cut into parts of `part_size` input sequences, the unit of parallelism and of resumption:
// part k goes to TP group k mod num_groups, which generates it with continuous batching on its slot
// pool (target/generate.h) and writes `<out>.parts/part-<k>.h5` atomically. A part is generated from
// its own prompts alone, so its tokens do not depend on the world size, on which parts ran before
// it or on a restart: killed and started again, a run skips the parts on disk and makes the same
// file. `<out>.parts/manifest.json` records what the parts were made with (inputs, target,
// decoding); a restart with other settings is refused, naming the difference. When every part is
// there, world rank 0 joins them into `out` (written atomically), keeps the manifest beside it as
// `<out>.json` and removes `<out>.parts`. A complete `out` whose manifest matches is not made again;
// one made with other settings is refused.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "target_model/generate.h"

namespace dflash::data {

struct RegenerateOptions {
  std::vector<std::string> inputs;  // dataset files, directories or globs (expand_paths)
  std::string out;                  // the output .h5 file
  int64_t num_prompts = -1;         // the first N sequences of the inputs (-1: all)
  // Prompts longer than this are skipped and counted (-1: none; the slots are sized for the longest
  // sequence of the inputs + max_new_tokens).
  int64_t max_prompt_len = -1;
  target::GenerateConfig gen = [] {
    target::GenerateConfig g;
    g.step_tokens = target::kRegenerateStepTokens;  // chunked prefill (generate.h)
    return g;
  }();
  int64_t slots = 64;               // sequences in flight per TP group
  int64_t part_size = 512;          // input sequences per part
  bool progress = true;             // progress on stderr (world rank 0)
  WriterOptions writer;
  // What the target is (its source and architecture): recorded in the manifest, so parts made by
  // another target are never joined with these.
  std::string target_identity;
};

// The parallel layout of the caller: which parts this TP group makes, who writes.
struct RegenerateLayout {
  int group = 0, num_groups = 1;  // TP groups
  bool writer = true;             // this rank writes its group's parts (TP rank 0)
  bool leader = true;             // world rank 0: manifest, the join, the summary, progress
  std::function<void()> barrier;  // all ranks (null: one process)
};

struct RegenerateSummary {
  int64_t sequences = 0;     // input sequences considered (num_prompts)
  int64_t written = 0;       // sequences in the output
  int64_t skipped_long = 0, skipped_empty = 0;  // prompts longer than max_prompt_len; sequences supervised from token 0
  int64_t prompt_tokens = 0, generated = 0;     // in the output
  int64_t stopped = 0;       // responses that end with a stop token
  int64_t parts = 0, parts_resumed = 0;          // all parts; parts found on disk at the start
  target::GenStats gen;      // this group's generation in this run
  double seconds = 0;        // this run, wall clock
  bool joined = false;       // the output was written by this call (leader)
  bool reused = false;       // the output was already complete with these settings: nothing was done
};

// Whether options.out exists and was made with these options (its <out>.json manifest matches).
bool regenerated_file_matches(const RegenerateOptions& options);

// Slots sized for the inputs: the longest input sequence (or max_prompt_len) + max_new_tokens.
int64_t regenerate_max_len(const RegenerateOptions& options);

// Runs this group's parts on `decoder` (made with regenerate_max_len(options) tokens per slot) and,
// on the leader, joins the output. Every rank of a TP group calls it with its decoder.
RegenerateSummary regenerate(target::Decoder& decoder, const RegenerateOptions& options, const RegenerateLayout& layout);

// The summary as printed by dflash_data regenerate and logged by dflash_train.
std::string format_summary(const RegenerateSummary& s, const RegenerateOptions& options);

}  // namespace dflash::data
