// TargetConfig parsing: both config forms, defaults, and clear refusals.
#include <gtest/gtest.h>

#include "core/error.h"
#include "target_model/config.h"

using namespace dflash;
using namespace dflash::target;
using nlohmann::json;

namespace {

json text_fields() {
  return json{{"model_type", "qwen3_5_text"}, {"hidden_size", 64}, {"num_hidden_layers", 8}, {"intermediate_size", 96},
              {"vocab_size", 1000}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 32},
              {"linear_num_key_heads", 2}, {"linear_num_value_heads", 6}, {"linear_key_head_dim", 16},
              {"linear_value_head_dim", 16}, {"linear_conv_kernel_dim", 4}, {"rms_norm_eps", 1e-6},
              {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e7}, {"partial_rotary_factor", 0.25},
                                   {"mrope_interleaved", true}, {"mrope_section", {11, 11, 10}}}}};
}

std::string error_of(const json& doc) {
  try {
    TargetConfig::from_json(doc, "cfg.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Config, TextModelWithIntervalDefault) {
  TargetConfig c = TargetConfig::from_json(text_fields(), "cfg.json");
  EXPECT_EQ(c.hidden_size, 64);
  ASSERT_EQ(c.layer_types.size(), 8u);
  // full_attention_interval defaults to 4: layers 3 and 7 are attention.
  for (int i = 0; i < 8; ++i)
    EXPECT_EQ(c.layer_types[i], (i % 4 == 3) ? LayerType::FullAttention : LayerType::LinearAttention) << i;
  EXPECT_EQ(c.rotary_dim(), 8);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_EQ(c.gdn_conv_dim(), 2 * 2 * 16 + 6 * 16);
  EXPECT_EQ(c.count_layers(LayerType::LinearAttention), 6);
}

TEST(Config, MultimodalFormReadsTextConfig) {
  json doc{{"model_type", "qwen3_5"}, {"architectures", {"Qwen3_5ForConditionalGeneration"}},
           {"text_config", text_fields()}, {"vision_config", {{"depth", 2}}}, {"tie_word_embeddings", true}};
  doc["text_config"]["full_attention_interval"] = 2;
  doc["text_config"].erase("tie_word_embeddings");
  TargetConfig c = TargetConfig::from_json(doc, "cfg.json");
  EXPECT_EQ(c.model_type, "qwen3_5");
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.layer_types[1], LayerType::FullAttention);
  EXPECT_EQ(c.layer_types[2], LayerType::LinearAttention);
}

TEST(Config, ExplicitLayerTypesAndLegacyRope) {
  json t = text_fields();
  t.erase("rope_parameters");
  t["rope_theta"] = 5000.0;
  t["partial_rotary_factor"] = 0.5;
  t["num_hidden_layers"] = 3;
  t["layer_types"] = {"full_attention", "linear_attention", "full_attention"};
  TargetConfig c = TargetConfig::from_json(t, "cfg.json");
  EXPECT_EQ(c.layer_types[0], LayerType::FullAttention);
  EXPECT_EQ(c.rotary_dim(), 16);
  EXPECT_DOUBLE_EQ(c.rope_theta, 5000.0);
}

TEST(Config, RoundTripThroughToJson) {
  TargetConfig a = TargetConfig::from_json(text_fields(), "cfg.json");
  TargetConfig b = TargetConfig::from_json(a.to_json(), "round trip");
  EXPECT_EQ(a.layer_types, b.layer_types);
  EXPECT_EQ(a.gdn_conv_dim(), b.gdn_conv_dim());
  EXPECT_DOUBLE_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.parameter_count(), b.parameter_count());
  EXPECT_EQ(a.mamba_ssm_dtype, "float32");  // absent: what the checkpoints ask for
  EXPECT_EQ(b.mamba_ssm_dtype, "float32");
  // Another state dtype is read and kept (the runtime names it in a warning; the states stay float32).
  json j = text_fields();
  j["mamba_ssm_dtype"] = "bfloat16";
  const TargetConfig c = TargetConfig::from_json(j, "cfg.json");
  EXPECT_EQ(c.mamba_ssm_dtype, "bfloat16");
  EXPECT_EQ(TargetConfig::from_json(c.to_json(), "round trip").mamba_ssm_dtype, "bfloat16");
  EXPECT_NE(c.state_dtype_note().find("cfg.json: mamba_ssm_dtype is 'bfloat16'; dflash keeps"), std::string::npos)
      << c.state_dtype_note();
  EXPECT_EQ(a.state_dtype_note(), "");
}

TEST(Config, RefusesMoeAndUnknownTypesByName) {
  json moe = text_fields();
  moe["model_type"] = "qwen3_5_moe";
  EXPECT_NE(error_of(moe).find("qwen3_5_moe"), std::string::npos);
  EXPECT_NE(error_of(moe).find("not supported yet"), std::string::npos);
  json next = text_fields();
  next["model_type"] = "qwen3_next";
  EXPECT_NE(error_of(next).find("qwen3_next"), std::string::npos);
  json experts = text_fields();
  experts["num_experts"] = 64;
  EXPECT_NE(error_of(experts).find("num_experts"), std::string::npos);
  json llama = text_fields();
  llama["model_type"] = "llama";
  EXPECT_NE(error_of(llama).find("'llama' is not supported"), std::string::npos);
  json nested{{"model_type", "qwen3_5"}, {"text_config", text_fields()}};
  nested["text_config"]["model_type"] = "qwen3_5_moe_text";
  EXPECT_NE(error_of(nested).find("text_config.model_type"), std::string::npos);
}

TEST(Config, NamesTheBadField) {
  json missing = text_fields();
  missing.erase("linear_num_value_heads");
  EXPECT_NE(error_of(missing).find("'linear_num_value_heads' is missing"), std::string::npos);
  json nested{{"model_type", "qwen3_5"}, {"text_config", text_fields()}};
  nested["text_config"]["hidden_size"] = "big";
  EXPECT_NE(error_of(nested).find("'text_config.hidden_size' must be a positive integer"), std::string::npos);
  json bad_type = text_fields();
  bad_type["num_hidden_layers"] = 2;
  bad_type["layer_types"] = {"linear_attention", "mamba"};
  EXPECT_NE(error_of(bad_type).find("layer_types[1]"), std::string::npos);
  json count = text_fields();
  count["layer_types"] = {"linear_attention"};
  EXPECT_NE(error_of(count).find("num_hidden_layers"), std::string::npos);
  json heads = text_fields();
  heads["linear_num_value_heads"] = 5;
  EXPECT_NE(error_of(heads).find("linear_num_value_heads 5 is not a multiple"), std::string::npos);
  json rope = text_fields();
  rope["rope_parameters"]["rope_type"] = "yarn";
  EXPECT_NE(error_of(rope).find("rope_type"), std::string::npos);
  EXPECT_NE(error_of(json::array()).find("JSON object"), std::string::npos);
}

TEST(Config, MissingFileIsAClearError) {
  try {
    TargetConfig::from_file("/nonexistent/dir/config.json");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/config.json"), std::string::npos);
  }
}

// The shipped Qwen3.6-27B config (multimodal form, as the real checkpoint has it).
TEST(Config, Qwen36_27bShapes) {
  TargetConfig c = TargetConfig::from_file(std::string(DFLASH_TEST_DATA_DIR) + "/../../configs/qwen3.6-27b");
  EXPECT_EQ(c.count_layers(LayerType::LinearAttention), 48);
  EXPECT_EQ(c.count_layers(LayerType::FullAttention), 16);
  EXPECT_EQ(c.layer_types[3], LayerType::FullAttention);
  EXPECT_EQ(c.gdn_conv_dim(), 10240);  // the fused q|k|v conv channels of ../shared/ANCHORS.md
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_EQ(c.attn_q_proj_rows(), 24 * 256 * 2);
  // ~26.9B parameters in the text model (embedding and lm_head included).
  EXPECT_GT(c.parameter_count(), 26'500'000'000);
  EXPECT_LT(c.parameter_count(), 27'500'000'000);
}
