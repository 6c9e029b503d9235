#pragma once
// A deterministic synthetic corpus with learnable structure, for demos and tests.
//
// Sequence i is a pure function of (seed, i), drawn from Philox, so any subset can be regenerated
// and two runs with one seed write identical files. Each sequence is one of three kinds:
//   progression: t_k = (a + k*d) mod V                    (d in 1..16)
//   pattern:     t_k = p[k mod P]                         (P in 2..8 random tokens)
//   drift:       t_k = (p[k mod P] + (k div P)*d) mod V   (a pattern that shifts each repetition)
// Once a few tokens have been seen, the next ones follow from the ones before, so a drafter can
// learn to predict whole blocks. loss_mask is 0 on a short "prompt" prefix (1..min(len/4, 16)
// tokens) and 1 after it, so every sequence has at least two consecutive supervised tokens.
#include <cstdint>
#include <string>

#include "data/dataset.h"

namespace dflash::data {

struct SynthOptions {
  int64_t sequences = 1000;
  int64_t min_length = 32, max_length = 256;  // tokens, inclusive (min_length >= 3)
  int64_t vocab_size = 1024;                  // >= 2
  uint64_t seed = 0;
};

// Throws naming the option when the options are inconsistent.
void check_synth_options(const SynthOptions& o);
// Sequence i of the corpus.
Sequence synth_sequence(const SynthOptions& o, int64_t i);
// Writes the whole corpus to `path` (dflash.tokens.v1).
void write_synth(const std::string& path, const SynthOptions& o, WriterOptions writer = {});

}  // namespace dflash::data
