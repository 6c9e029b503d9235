#include "target_model/cli.h"

namespace dflash::target {

TargetSource TargetOptions::source() const {
  TargetSource s = src;
  s.precision = parse_precision(precision, "--precision");
  return s;
}

void add_target_options(CLI::App& app, TargetOptions& o, const TargetOptionHelp& help) {
  auto* model = app.add_option("--model", o.src.model_dir, help.model);
  auto* config = app.add_option("--config", o.src.config_path, help.config);
  model->excludes(config);
  app.add_flag("--random-weights", o.src.random_weights, help.random)->needs(config);
  app.add_option(help.seed_flag, o.src.seed, help.seed)->capture_default_str();
  app.add_option("--precision", o.precision, kPrecisionHelp)->capture_default_str();
  app.add_flag("--fp8-experts", o.src.fp8_experts,
               "MoE targets on a GPU: store the routed experts in FP8 (e4m3 with 128 x 128 block scales, read as bf16: "
               "half their memory and of a decode step's expert reads; bf16 experts are quantized at load)");
}

}  // namespace dflash::target
