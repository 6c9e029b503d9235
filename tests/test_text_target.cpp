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
#include "golden_layers.h"
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
  expect_every_layer_matches_golden(kModel, kGolden + "golden.safetensors", "text-target", kBound);
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
