#pragma once
// The command-line options that name a target, one declaration for every tool that loads one
// (dflash_features, dflash_eval, dflash_data regenerate, target_bench):
//   --model DIR                     a Hugging Face model directory, or
//   --config FILE --random-weights  seeded random weights of that architecture (--seed S)
//   --precision auto|bf16|fp8       what the projections run in
//   --fp8-experts                   MoE targets on a GPU: the routed experts stored in FP8
// --model excludes --config and --random-weights needs --config (CLI11 says so, naming both).
#include <CLI/CLI.hpp>

#include <string>

#include "target_model/runtime.h"

namespace dflash::target {

struct TargetOptions {
  TargetSource src;  // model_dir, config_path, random_weights, seed as given
  std::string precision = "auto";
  // src with --precision parsed (an unknown value throws naming --precision and the choices).
  TargetSource source() const;
};

// The help texts that differ between the tools, and the name of the seed option.
struct TargetOptionHelp {
  const char* model = "the target: a Hugging Face model directory";
  const char* config = "the target: a config.json (with --random-weights)";
  const char* random = "seeded random target weights instead of a checkpoint";
  const char* seed_flag = "--seed";
  const char* seed = "seed of --random-weights";
};

void add_target_options(CLI::App& app, TargetOptions& o, const TargetOptionHelp& help = {});

}  // namespace dflash::target
