// The drafter export against what serving stacks read: every field of
// tests/data/serving_fields.json (each with the loaders that read it, file@commit) is checked in
// an export, present with its type and the value the drafter config gives it, or absent where its
// presence would change what a reader does; the export writes no field the list does not name;
// the PyTorch module of the auto_map is in the directory, byte for byte the one in drafter/hf/.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>

#include "drafter/config.h"
#include "drafter/weights.h"
#include "small_drafter.h"

namespace {

using nlohmann::json;
using namespace dflash;
using namespace dflash::drafter;

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

json read_json(const std::string& p) {
  std::ifstream in(p);
  EXPECT_TRUE(in.good()) << p;
  return json::parse(in);
}

// tests/small_drafter.h's drafter, with an rms_norm_eps and a rope_theta that are no reader's
// default either.
DrafterConfig export_config(std::vector<AttnType> types) {
  DrafterConfig c = fixtures::small_drafter_config(std::move(types));
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 5e5;
  c.validate();
  return c;
}

// The drafter config quantities of serving_fields.json's "config" rules, restated here from
// what the readers expect (not from to_json).
json expected_from_config(const DrafterConfig& c, const std::string& name) {
  bool any_sliding = false;
  json types = json::array();
  int64_t leading_full = 0;
  bool leading = true;
  for (AttnType t : c.layer_types) {
    any_sliding = any_sliding || t == AttnType::Sliding;
    types.push_back(t == AttnType::Full ? "full_attention" : "sliding_attention");
    leading = leading && t == AttnType::Full;
    leading_full += leading;
  }
  const std::map<std::string, json> m = {
      {"hidden_size", c.hidden_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"intermediate_size", c.intermediate_size},
      {"vocab_size", c.vocab_size},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_theta", c.rope_theta},
      {"max_position_embeddings", c.max_position_embeddings},
      {"layer_types", types},
      {"any_sliding", any_sliding},
      {"sliding_window", any_sliding ? json(c.sliding_window) : json(nullptr)},
      {"leading_full_layers", leading_full},
      {"block_size", c.block_size},
      {"num_target_layers", c.num_target_layers},
      {"mask_token_id", c.mask_token_id},
      {"target_layer_ids", c.target_layer_ids},
  };
  const auto it = m.find(name);
  if (it == m.end()) {
    ADD_FAILURE() << "serving_fields.json names config quantity '" << name << "', which the test does not know";
    return json();
  }
  return it->second;
}

bool has_type(const json& v, const std::string& type) {
  auto list_of = [&](auto&& pred) {
    if (!v.is_array()) return false;
    for (const json& x : v)
      if (!pred(x)) return false;
    return true;
  };
  if (type == "int") return v.is_number_integer();
  if (type == "number") return v.is_number();
  if (type == "bool") return v.is_boolean();
  if (type == "string") return v.is_string();
  if (type == "object") return v.is_object();
  if (type == "int|null") return v.is_null() || v.is_number_integer();
  if (type == "list[int]") return list_of([](const json& x) { return x.is_number_integer(); });
  if (type == "list[string]") return list_of([](const json& x) { return x.is_string(); });
  ADD_FAILURE() << "unknown type '" << type << "' in serving_fields.json";
  return false;
}

// The value at a dotted path ("dflash_config.mask_token_id"), or nullptr when any part is missing.
const json* at_path(const json& doc, const std::string& path) {
  const json* p = &doc;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string key = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!p->is_object() || !p->contains(key)) return nullptr;
    p = &(*p)[key];
    if (dot == std::string::npos) return p;
    start = dot + 1;
  }
}

// Every key of the export, as dotted paths (objects are descended into).
void all_paths(const json& j, const std::string& prefix, std::set<std::string>& out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string p = prefix.empty() ? it.key() : prefix + "." + it.key();
    out.insert(p);
    if (it.value().is_object()) all_paths(it.value(), p, out);
  }
}

std::string export_dir(const std::string& name) {
  const auto p = std::filesystem::temp_directory_path() / ("dflash_test_export_" + name);
  std::filesystem::remove_all(p);
  return p.string();
}

void check_export_against_list(const DrafterConfig& c, const std::string& name) {
  const json list = read_json(std::string(DFLASH_TEST_DATA_DIR) + "/serving_fields.json");
  const std::string dir = export_dir(name);
  export_hf(dir, c, DrafterWeights::random(c, 7));
  const json cfg = read_json(dir + "/config.json");

  const json& readers = list.at("readers");
  std::set<std::string> listed;
  int checked = 0;
  for (const json& f : list.at("fields")) {
    const std::string field = f.at("field");
    SCOPED_TRACE(name + ": field " + field);
    EXPECT_TRUE(listed.insert(field).second) << "listed twice";
    ASSERT_TRUE(f.contains("readers") && f["readers"].is_array() && !f["readers"].empty()) << "no readers named";
    for (const json& r : f["readers"]) EXPECT_TRUE(readers.contains(r.get<std::string>())) << "unknown reader " << r;
    const json* v = at_path(cfg, field);
    if (f.value("absent", false)) {
      EXPECT_EQ(v, nullptr) << "must not be written: " << f.value("note", "");
      ++checked;
      continue;
    }
    ASSERT_NE(v, nullptr) << "missing from the export (read by " << f["readers"].dump() << ")";
    EXPECT_TRUE(has_type(*v, f.at("type"))) << "is " << v->dump() << ", expected type " << f["type"];
    if (f.contains("value")) {
      EXPECT_EQ(*v, f["value"]);
    }
    if (f.contains("config")) {
      EXPECT_EQ(*v, expected_from_config(c, f["config"])) << "config quantity " << f["config"];
    }
    ++checked;
  }
  EXPECT_GT(checked, 40);
  // Nothing written that the list does not name: every field of an export has a reader.
  std::set<std::string> written;
  all_paths(cfg, "", written);
  for (const std::string& p : written) EXPECT_TRUE(listed.count(p)) << name << ": the export writes '" << p
                                                                   << "', which serving_fields.json does not list";

  // The module auto_map names is there, as compiled in and as in the source tree.
  const std::string module = cfg.at("auto_map").at("AutoModel").get<std::string>();
  const std::string file = module.substr(0, module.find('.')) + ".py";
  EXPECT_EQ(slurp(dir + "/" + file), std::string(hf_modeling_source()));
  EXPECT_EQ(slurp(dir + "/" + file), slurp(std::string(DFLASH_TEST_DATA_DIR) + "/../../drafter/hf/" + file));
  EXPECT_NE(std::string(hf_modeling_source()).find("class DFlashDraftModel("), std::string::npos);

  // What the export wrote reads back as the same drafter.
  const LoadedDrafter back = import_hf(dir);
  EXPECT_EQ(back.config.to_json(), c.to_json());
}

}  // namespace

TEST(DrafterServingFields, MixedSlidingAndFullLayers) {
  check_export_against_list(export_config({AttnType::Sliding, AttnType::Full, AttnType::Sliding}), "mixed");
}

TEST(DrafterServingFields, FullAttentionOnly) {
  check_export_against_list(export_config({AttnType::Full, AttnType::Full}), "full");
}

TEST(DrafterServingFields, SlidingSuffixAgreesWithMaxWindowLayers) {
  const DrafterConfig c = export_config({AttnType::Full, AttnType::Full, AttnType::Sliding});
  EXPECT_EQ(c.to_json()["max_window_layers"], 2);
  check_export_against_list(c, "suffix");
}

// The list itself: readers name repo, file and commit; every field says its rule.
TEST(DrafterServingFields, ListNamesWhereEachFieldIsRead) {
  const json list = read_json(std::string(DFLASH_TEST_DATA_DIR) + "/serving_fields.json");
  for (const auto& [id, r] : list.at("readers").items())
    for (const char* k : {"repo", "file", "commit"})
      EXPECT_TRUE(r.contains(k) && r[k].is_string() && !r[k].get<std::string>().empty()) << id << " lacks " << k;
  std::set<std::string> must = {"block_size", "num_target_layers", "dflash_config.mask_token_id",
                                "dflash_config.target_layer_ids", "layer_types", "sliding_window",
                                "use_sliding_window", "max_window_layers", "rope_parameters", "head_dim",
                                "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "dtype",
                                "architectures", "model_type", "auto_map"};
  for (const json& f : list.at("fields")) {
    const int rules = f.contains("value") + f.contains("config") + f.value("absent", false);
    EXPECT_TRUE(rules == 1 || (rules == 0 && f.value("type", "") == "object")) << f.dump();
    must.erase(f.at("field").get<std::string>());
  }
  for (const std::string& m : must) ADD_FAILURE() << "serving_fields.json does not list " << m;
}
