// configs/text-target (the small target trained on real text by scripts/make_text_target.py, issue 29)
// against Hugging Face: every decoder layer's output for real held-out text (1, 37 and 130 tokens)
// equals transformers' on the GPU machine's CPU in float32 (and float64) from the same bf16
// checkpoint, within the bound of the other HF goldens (test_golden.cpp, 1e-5); with the tokenizer
// built (text/), its tokenizer.json gives the ids of Hugging Face tokenizers 0.23 on texts, rendered
// chat prompts and edge strings (tests/data/hf/text_target/tokens.jsonl, written by the same script).
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/io/safetensors.h"
#include "target_model/model.h"
#include "test_util.h"
#ifdef DFLASH_WITH_TEXT
#include "text/tokenizer.h"
#endif

using namespace dflash;
using namespace dflash::target;

namespace {

const std::string kModel = DFLASH_TEXT_TARGET_DIR;
const std::string kGolden = std::string(DFLASH_TEST_DATA_DIR) + "/hf/text_target/";
constexpr double kBound = 1e-5;  // as test_golden.cpp

}  // namespace

TEST(TextTarget, ConfigIsTheHybridShape) {
  TargetConfig cfg = TargetConfig::from_file(kModel);
  EXPECT_EQ(cfg.model_type, "qwen3_5_text");
  EXPECT_EQ(cfg.vocab_size, 4096);
  EXPECT_EQ(cfg.hidden_size, 256);
  ASSERT_EQ(cfg.layer_types.size(), 4u);
  EXPECT_EQ(cfg.layer_types[3], LayerType::FullAttention);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(cfg.layer_types[i], LayerType::LinearAttention) << i;
}

TEST(TextTarget, EveryLayerMatchesTransformers) {
  TargetConfig cfg = TargetConfig::from_file(kModel);
  TargetModel model(cfg, load_weights(cfg, kModel, DType::F32, Device::cpu()));
  io::SafetensorsFile golden(kGolden + "golden.safetensors");
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
        EXPECT_LE(e, kBound) << "T=" << T << " layer " << i;
        EXPECT_LE(ex, kBound) << "T=" << T << " layer " << i << " vs float64";
        worst = std::max(worst, e);
        worst_exact = std::max(worst_exact, ex);
      }
      const double ef = max_rel_err(r.final_hidden, golden.tensor("final." + t));
      EXPECT_LE(ef, kBound) << "T=" << T << " final norm";
      std::printf("text-target %-9s T=%3d: max rel err vs transformers f32 %.2e (f64 %.2e), final norm %.2e\n",
                  algo == ops::DeltaRuleAlgo::Chunked ? "chunked" : "recurrent", T, worst, worst_exact, ef);
    }
  }
}

#ifdef DFLASH_WITH_TEXT
TEST(TextTarget, TokenizerGivesHuggingFaceIds) {
  const text::Tokenizer tok = text::Tokenizer::from_file(kModel + "/tokenizer.json");
  std::ifstream in(kGolden + "tokens.jsonl");
  ASSERT_TRUE(in.good()) << kGolden << "tokens.jsonl";
  std::string line;
  int rows = 0, chats = 0;
  while (std::getline(in, line)) {
    const nlohmann::json r = nlohmann::json::parse(line);
    const std::vector<uint32_t> want = r["ids"].get<std::vector<uint32_t>>();
    EXPECT_EQ(tok.encode(r["text"].get<std::string>()), want) << r["name"].get<std::string>();
    ++rows;
    chats += r["name"].get<std::string>().rfind("chat", 0) == 0;
  }
  EXPECT_GE(rows, 16);
  EXPECT_GE(chats, 3);  // rendered chat prompts: the ChatML and think tokens inside text
}
#endif
