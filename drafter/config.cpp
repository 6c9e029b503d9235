#include "drafter/config.h"

#include <cfenv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "target_model/config.h"
#include "core/io/json_fields.h"

namespace dflash::drafter {

using nlohmann::json;

const char* attn_type_name(AttnType t) { return t == AttnType::Full ? "full_attention" : "sliding_attention"; }

std::vector<int64_t> default_target_layer_ids(int64_t num_target_layers, int64_t n) {
  DFLASH_REQUIRE(num_target_layers > 0 && n > 0,
               "default target_layer_ids: need num_target_layers > 0 and n > 0, got " << num_target_layers << ", " << n);
  if (n == 1) return {num_target_layers / 2};
  const double start = 1, end = static_cast<double>(num_target_layers - 3), span = end - start;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < n; ++i) {
    // Python's round() rounds halves to even, as std::nearbyint does in the default rounding mode.
    const double x = start + static_cast<double>(i) * span / static_cast<double>(n - 1);
    ids.push_back(static_cast<int64_t>(std::nearbyint(x)));
  }
  return ids;
}

namespace {

using Fields = io::JsonFields;
constexpr const char* kMissingHint = "is this a DFlash drafter config.json (architectures [\"DFlashDraftModel\"])?";

}  // namespace

DrafterConfig DrafterConfig::from_json(const json& doc, const std::string& source) {
  DFLASH_REQUIRE(doc.is_object(), source << ": config must be a JSON object");
  Fields f(doc, source, "", kMissingHint);
  if (f.has("architectures")) {
    const json& a = doc["architectures"];
    bool ok = a.is_array();
    bool found = false;
    if (ok)
      for (const json& x : a) found = found || (x.is_string() && x.get<std::string>() == "DFlashDraftModel");
    DFLASH_REQUIRE_HINT(ok && found, source << ": field 'architectures' is " << a.dump() << ", expected [\"DFlashDraftModel\"]",
                      "this looks like a different kind of model; a DFlash drafter config names DFlashDraftModel");
  }
  const std::string model_type = f.string_or("model_type", "qwen3");
  DFLASH_REQUIRE(model_type == "qwen3",
               source << ": field 'model_type' is '" << model_type << "'; the DFlash drafter is a 'qwen3' model");
  const std::string act = f.string_or("hidden_act", "silu");
  DFLASH_REQUIRE(act == "silu", source << ": field 'hidden_act' is '" << act << "'; only 'silu' is supported");
  if (f.has("attention_bias"))
    DFLASH_REQUIRE(doc["attention_bias"].is_boolean() && !doc["attention_bias"].get<bool>(),
                 source << ": field 'attention_bias' must be false (biased projections are not supported)");

  DrafterConfig c;
  c.source = source;
  c.hidden_size = f.integer("hidden_size", 1);
  c.num_hidden_layers = f.integer("num_hidden_layers", 1);
  c.num_attention_heads = f.integer("num_attention_heads", 1);
  c.num_key_value_heads = f.integer_or("num_key_value_heads", 1, c.num_attention_heads);
  c.head_dim = f.integer_or("head_dim", 1, c.hidden_size / c.num_attention_heads);
  c.intermediate_size = f.integer("intermediate_size", 1);
  c.vocab_size = f.integer("vocab_size", 1);
  c.rms_norm_eps = f.positive_or("rms_norm_eps", 1e-6);
  c.rope_theta = f.positive_or("rope_theta", 1000000.0);
  if (f.has("rope_parameters")) {
    DFLASH_REQUIRE(doc["rope_parameters"].is_object(), source << ": field 'rope_parameters' must be an object");
    Fields r(doc["rope_parameters"], source, "rope_parameters.", kMissingHint);
    const std::string type = r.string_or("rope_type", "default");
    DFLASH_REQUIRE(type == "default", source << ": field 'rope_parameters.rope_type' is '" << type
                                           << "'; only 'default' RoPE is supported");
    c.rope_theta = r.positive_or("rope_theta", c.rope_theta);
  }
  if (f.has("rope_scaling")) {
    const json& rs = doc["rope_scaling"];
    const bool plain = rs.is_object() && (!rs.contains("rope_type") || rs["rope_type"] == "default");
    DFLASH_REQUIRE(plain, source << ": field 'rope_scaling' is " << rs.dump() << "; only default RoPE is supported");
  }
  c.max_position_embeddings = f.integer_or("max_position_embeddings", 1, c.max_position_embeddings);
  c.block_size = f.integer_or("block_size", 2, 16);
  c.sliding_window = f.integer_or("sliding_window", 1, 0);
  if (f.has("layer_types")) {
    const json& lt = doc["layer_types"];
    DFLASH_REQUIRE(lt.is_array(), source << ": field 'layer_types' must be a list");
    for (size_t i = 0; i < lt.size(); ++i) {
      const std::string s = lt[i].is_string() ? lt[i].get<std::string>() : lt[i].dump();
      if (s == "full_attention") c.layer_types.push_back(AttnType::Full);
      else if (s == "sliding_attention") c.layer_types.push_back(AttnType::Sliding);
      else
        DFLASH_REJECT(source << ": field 'layer_types[" << i << "]' is '" << s
                           << "'; expected 'full_attention' or 'sliding_attention'");
    }
  } else {
    c.layer_types.assign(static_cast<size_t>(c.num_hidden_layers), AttnType::Full);
  }
  c.num_target_layers = f.integer("num_target_layers", 1);

  const json& dc = f.require("dflash_config");
  DFLASH_REQUIRE(dc.is_object(), source << ": field 'dflash_config' must be an object");
  Fields d(dc, source, "dflash_config.", kMissingHint);
  c.mask_token_id = d.integer("mask_token_id", 0);
  if (d.has("target_layer_ids")) {
    const json& ids = dc["target_layer_ids"];
    DFLASH_REQUIRE(ids.is_array() && !ids.empty(),
                 source << ": field 'dflash_config.target_layer_ids' must be a non-empty list, got " << ids.dump());
    for (size_t i = 0; i < ids.size(); ++i) {
      DFLASH_REQUIRE(ids[i].is_number_integer(), source << ": field 'dflash_config.target_layer_ids[" << i
                                                      << "]' must be an integer, got " << ids[i].dump());
      c.target_layer_ids.push_back(ids[i].get<int64_t>());
    }
  } else {
    c.target_layer_ids = default_target_layer_ids(c.num_target_layers, c.num_hidden_layers);
  }
  c.validate();
  return c;
}

DrafterConfig DrafterConfig::from_file(const std::string& path) {
  namespace fs = std::filesystem;
  const std::string file = fs::is_directory(path) ? (fs::path(path) / "config.json").string() : path;
  std::ifstream in(file);
  DFLASH_CHECK_IO(in.good(), "open", file);
  json doc;
  try {
    doc = json::parse(in);
  } catch (const json::exception& e) {
    DFLASH_REJECT(file << ": not valid JSON: " << e.what());
  }
  return from_json(doc, file);
}

void DrafterConfig::validate() const {
  const std::string& s = source.empty() ? std::string("drafter config") : source;
  auto positive = [&](int64_t v, const char* name) {
    DFLASH_REQUIRE(v > 0, s << ": field '" << name << "' must be positive, got " << v);
  };
  positive(hidden_size, "hidden_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_attention_heads, "num_attention_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  positive(intermediate_size, "intermediate_size");
  positive(vocab_size, "vocab_size");
  positive(num_target_layers, "num_target_layers");
  DFLASH_REQUIRE(rms_norm_eps > 0, s << ": field 'rms_norm_eps' must be positive, got " << rms_norm_eps);
  DFLASH_REQUIRE(rope_theta > 0, s << ": field 'rope_theta' must be positive, got " << rope_theta);
  DFLASH_REQUIRE(num_attention_heads % num_key_value_heads == 0,
               s << ": field 'num_attention_heads' (" << num_attention_heads
                 << ") must be a multiple of 'num_key_value_heads' (" << num_key_value_heads << ")");
  DFLASH_REQUIRE(head_dim % 2 == 0, s << ": field 'head_dim' must be even for RoPE, got " << head_dim);
  DFLASH_REQUIRE(block_size >= 2, s << ": field 'block_size' must be >= 2, got " << block_size);
  DFLASH_REQUIRE(static_cast<int64_t>(layer_types.size()) == num_hidden_layers,
               s << ": field 'layer_types' has " << layer_types.size() << " entries but num_hidden_layers is "
                 << num_hidden_layers);
  for (size_t i = 0; i < layer_types.size(); ++i)
    DFLASH_REQUIRE(layer_types[i] != AttnType::Sliding || sliding_window > 0,
                 s << ": field 'layer_types[" << i << "]' is sliding_attention but 'sliding_window' is not set (> 0)");
  DFLASH_REQUIRE(mask_token_id >= 0 && mask_token_id < vocab_size,
               s << ": field 'dflash_config.mask_token_id' is " << mask_token_id << ", outside the vocabulary [0, "
                 << vocab_size << ")");
  DFLASH_REQUIRE(!target_layer_ids.empty(), s << ": field 'dflash_config.target_layer_ids' must not be empty");
  for (size_t i = 0; i < target_layer_ids.size(); ++i)
    DFLASH_REQUIRE(target_layer_ids[i] >= 0 && target_layer_ids[i] < num_target_layers,
                 s << ": field 'dflash_config.target_layer_ids[" << i << "]' is " << target_layer_ids[i]
                   << ", outside the target's layers [0, " << num_target_layers << ")");
}

void DrafterConfig::check_target(const target::TargetConfig& target) const {
  auto same = [&](int64_t mine, int64_t theirs, const char* what) {
    DFLASH_REQUIRE_HINT(mine == theirs, "the drafter's " << what << " " << mine << " does not match the target's " << theirs,
                      "a drafter is trained for one target model: use the target it was trained on, or train one for "
                      "this target");
  };
  same(hidden_size, target.hidden_size, "hidden_size");
  same(vocab_size, target.vocab_size, "vocab_size");
  same(num_target_layers, target.num_hidden_layers, "num_target_layers");
}

json DrafterConfig::to_json() const {
  json lt = json::array();
  for (AttnType t : layer_types) lt.push_back(attn_type_name(t));
  bool any_sliding = false;
  for (AttnType t : layer_types) any_sliding = any_sliding || t == AttnType::Sliding;
  // Qwen's older rule "layers i >= max_window_layers slide" agrees with layer_types whenever the
  // sliding layers are a suffix; readers that have layer_types (all of tests/data/serving_fields.json's)
  // use it instead.
  int64_t leading_full = 0;
  while (leading_full < num_hidden_layers && layer_types[static_cast<size_t>(leading_full)] == AttnType::Full)
    ++leading_full;
  // Every field here is one that a serving stack or transformers reads for a DFlash drafter;
  // tests/data/serving_fields.json names the readers (file@commit) and test_export checks it.
  json j = {
      {"architectures", {"DFlashDraftModel"}},
      {"model_type", "qwen3"},
      // transformers' AutoModel(trust_remote_code=True) loads dflash's own module, shipped beside
      // the weights by export_hf (drafter/hf/modeling_dflash.py).
      {"auto_map", {{"AutoModel", std::string(kHfModelingModule) + ".DFlashDraftModel"}}},
      {"hidden_size", hidden_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"head_dim", head_dim},
      {"intermediate_size", intermediate_size},
      {"vocab_size", vocab_size},
      {"rms_norm_eps", rms_norm_eps},
      // transformers 5, SGLang and vLLM read rope_parameters; rope_theta is its transformers 4 form.
      {"rope_theta", rope_theta},
      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", rope_theta}}},
      {"max_position_embeddings", max_position_embeddings},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"tie_word_embeddings", false},
      {"dtype", "bfloat16"},  // (transformers 5 reads dtype; torch_dtype is its deprecated name)
      {"use_cache", true},
      {"layer_types", lt},
      {"use_sliding_window", any_sliding},
      {"sliding_window", any_sliding ? json(sliding_window) : json(nullptr)},
      {"max_window_layers", leading_full},
      {"block_size", block_size},
      {"num_target_layers", num_target_layers},
      {"dflash_config", {{"mask_token_id", mask_token_id}, {"target_layer_ids", target_layer_ids}}},
  };
  return j;
}

DrafterConfig DrafterConfig::for_target(const target::TargetConfig& t, int64_t num_layers, int64_t mask_token_id,
                                        int64_t block_size) {
  DrafterConfig c;
  c.source = "drafter for " + (t.source.empty() ? std::string("target") : t.source);
  c.hidden_size = t.hidden_size;
  c.num_hidden_layers = num_layers;
  c.num_attention_heads = t.num_attention_heads;
  c.num_key_value_heads = t.num_key_value_heads;
  c.head_dim = t.head_dim;
  // An MoE target has no dense MLP width (intermediate_size is not a field of qwen3_5_moe): the
  // drafter's dense MLP defaults to 3 x hidden, the ratio of z-lab's drafters for MoE targets
  // (Qwen3-Coder-30B-A3B-DFlash: hidden 2048, intermediate 6144); model.drafter.intermediate_size overrides.
  c.intermediate_size = t.is_moe() ? 3 * t.hidden_size : t.intermediate_size;
  c.vocab_size = t.vocab_size;
  c.rms_norm_eps = t.rms_norm_eps;
  c.rope_theta = t.rope_theta;
  // Loaders size the drafter's RoPE from it (SGLang, vLLM): the target's context, not a default.
  if (t.max_position_embeddings > 0) c.max_position_embeddings = t.max_position_embeddings;
  c.layer_types.assign(static_cast<size_t>(num_layers), AttnType::Full);
  c.block_size = block_size;
  c.mask_token_id = mask_token_id;
  c.num_target_layers = t.num_hidden_layers;
  c.target_layer_ids = default_target_layer_ids(t.num_hidden_layers, num_layers);
  c.validate();
  return c;
}

std::string DrafterConfig::summary() const {
  std::ostringstream o;
  int64_t sliding = 0;
  for (AttnType t : layer_types) sliding += t == AttnType::Sliding;
  o << "DFlash drafter: " << num_hidden_layers << " layers (" << sliding << " sliding, window " << sliding_window
    << "), hidden " << hidden_size << ", heads " << num_attention_heads << "/" << num_key_value_heads << " x "
    << head_dim << ", mlp " << intermediate_size << ", vocab " << vocab_size << ", block " << block_size
    << ", mask token " << mask_token_id << ", target layers [";
  for (size_t i = 0; i < target_layer_ids.size(); ++i) o << (i ? "," : "") << target_layer_ids[i];
  o << "] of " << num_target_layers;
  return o.str();
}

}  // namespace dflash::drafter
