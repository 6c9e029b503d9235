#pragma once
// The per-layer check of the CPU reference against an HF-made model's goldens (test_golden's tiny
// models, test_text_target's real-text target): the hidden states after every layer and after the
// final norm, with the chunked and the recurrent delta rule, at T = 1 / 37 / 130, against
// transformers' f32 outputs ("layer.T.i", "final.T") and its float64 run ("exact.T.i"), each within
// `bound` (max rel err); one line a (delta rule, T) with the worst errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "core/io/safetensors.h"
#include "target_model/model.h"
#include "test_util.h"

inline void expect_every_layer_matches_golden(const std::string& model_dir, const std::string& golden_file,
                                              const std::string& label, double bound) {
  using namespace dflash;
  using namespace dflash::target;
  TargetConfig cfg = TargetConfig::from_file(model_dir);
  TargetModel model(cfg, load_weights(cfg, model_dir, DType::F32, Device::cpu()));
  io::SafetensorsFile golden(golden_file);
  ForwardOptions opt;
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) opt.capture.push_back(i);
  opt.final_norm = true;
  for (auto algo : {ops::DeltaRuleAlgo::Chunked, ops::DeltaRuleAlgo::Recurrent}) {
    opt.delta_rule = algo;
    for (int T : {1, 37, 130}) {
      const std::string t = std::to_string(T);
      ForwardResult r = model.forward({ids_of(golden.tensor("ids." + t))}, opt);
      double worst = 0, worst_exact = 0;
      for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
        const std::string li = t + "." + std::to_string(i);
        const double e = max_rel_err(r.layers.at(i), golden.tensor("layer." + li));
        const double ex = max_rel_err(r.layers.at(i), golden.tensor("exact." + li));
        EXPECT_LE(e, bound) << label << " T=" << T << " layer " << i;
        EXPECT_LE(ex, bound) << label << " T=" << T << " layer " << i << " vs float64";
        worst = std::max(worst, e);
        worst_exact = std::max(worst_exact, ex);
      }
      const double ef = max_rel_err(r.final_hidden, golden.tensor("final." + t));
      EXPECT_LE(ef, bound) << label << " T=" << T << " final norm";
      std::printf("%s %-9s T=%3d: max rel err vs transformers f32 %.2e (f64 %.2e), final norm %.2e\n", label.c_str(),
                  algo == ops::DeltaRuleAlgo::Chunked ? "chunked" : "recurrent", T, worst, worst_exact, ef);
    }
  }
}
