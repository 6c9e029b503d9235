#include "target_model/config.h"

#include <cmath>
#include <fstream>
#include <filesystem>
#include <sstream>

#include "core/error.h"
#include "core/io/json_fields.h"

namespace dflash::target {

std::optional<Precision> precision_from_name(std::string_view name) {
  for (Precision p : {Precision::Auto, Precision::Bf16, Precision::Fp8})
    if (name == precision_name(p)) return p;
  return std::nullopt;
}

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::Auto: return "auto";
    case Precision::Bf16: return "bf16";
    case Precision::Fp8: return "fp8";
  }
  return "?";
}

Precision parse_precision(std::string_view name, const std::string& where) {
  const auto p = precision_from_name(name);
  DFLASH_REQUIRE_HINT(p.has_value(), where << " is '" << name << "'", "use auto, bf16 or fp8");
  return *p;
}

Precision resolve_precision(Precision p, const TargetConfig& c) {
  if (p != Precision::Auto) return p;
  // An MoE target's FP8 checkpoint runs dequantized unless fp8 is asked (the GPU has no FP8 MoE block; weights.h).
  return c.fp8 && !c.is_moe() ? Precision::Fp8 : Precision::Bf16;
}


using nlohmann::json;

const char* layer_type_name(LayerType t) {
  return t == LayerType::LinearAttention ? "linear_attention" : "full_attention";
}

namespace {
constexpr const char* kMissingHint = "is this a Qwen3.5 / Qwen3.6 config.json?";

// The MoE fields of a qwen3_5_moe text config, as transformers 5.17's Qwen3_5MoeTextConfig has them.
void read_moe_fields(const json& text, const io::JsonFields& f, const std::string& source, const std::string& prefix,
                     TargetConfig& c) {
  const std::string hint = "an MoE config.json (qwen3_5_moe) names num_experts, num_experts_per_tok, "
                           "moe_intermediate_size and shared_expert_intermediate_size";
  io::JsonFields m(text, source, prefix, hint);
  c.num_experts = m.positive_int("num_experts");
  c.num_experts_per_tok = m.positive_int("num_experts_per_tok");
  c.moe_intermediate_size = m.positive_int("moe_intermediate_size");
  c.shared_expert_intermediate_size = m.positive_int("shared_expert_intermediate_size");
  // transformers 5.17 routes every layer through the MoE block and always renormalises the top-k
  // weights: the qwen3_moe / qwen3_next fields that would change that are refused, not ignored.
  c.norm_topk_prob = f.bool_or("norm_topk_prob", true);
  DFLASH_REQUIRE_HINT(c.norm_topk_prob, source << ": field '" << prefix << "norm_topk_prob' is false",
                    "qwen3_5_moe always renormalises the top-k routing weights (transformers 5.17 has no "
                    "norm_topk_prob); a model without renormalisation is not a qwen3_5_moe model");
  if (f.has("decoder_sparse_step")) {
    const json& v = text.at("decoder_sparse_step");
    DFLASH_REQUIRE_HINT(v.is_number_integer() && v.get<int64_t>() == 1,
                      source << ": field '" << prefix << "decoder_sparse_step' is " << v.dump(),
                      "qwen3_5_moe has an MoE block in every layer (transformers 5.17 has no decoder_sparse_step); "
                      "only 1 (every layer sparse) describes this model");
  }
  if (f.has("mlp_only_layers")) {
    const json& v = text.at("mlp_only_layers");
    DFLASH_REQUIRE_HINT(v.is_array() && v.empty(), source << ": field '" << prefix << "mlp_only_layers' is " << v.dump(),
                      "qwen3_5_moe has an MoE block in every layer (transformers 5.17 has no mlp_only_layers); only [] "
                      "describes this model");
  }
  c.output_router_logits = f.bool_or("output_router_logits", false);
  if (f.has("router_aux_loss_coef")) {
    const json& v = text.at("router_aux_loss_coef");
    DFLASH_REQUIRE(v.is_number() && v.get<double>() >= 0,
                   source << ": field '" << prefix << "router_aux_loss_coef' must be a number >= 0, got " << v.dump());
    c.router_aux_loss_coef = v.get<double>();
  }
  DFLASH_REQUIRE(c.num_experts_per_tok <= c.num_experts,
                 source << ": field '" << prefix << "num_experts_per_tok' is " << c.num_experts_per_tok
                        << ", more than num_experts " << c.num_experts);
}
}  // namespace

TargetConfig TargetConfig::from_json(const json& doc, const std::string& source) {
  DFLASH_REQUIRE(doc.is_object(), source << ": config must be a JSON object");
  const std::string top_type = doc.contains("model_type") && doc["model_type"].is_string()
                                   ? doc["model_type"].get<std::string>() : std::string();
  DFLASH_REQUIRE_HINT(top_type != "qwen3_next",
                     source << ": model_type 'qwen3_next' is not supported",
                     "dflash supports the Qwen3.5 / Qwen3.6 hybrid models: model_type qwen3_5, qwen3_5_text, qwen3_5_moe "
                     "or qwen3_5_moe_text");
  DFLASH_REQUIRE_HINT(top_type == "qwen3_5" || top_type == "qwen3_5_text" || top_type == "qwen3_5_moe" ||
                          top_type == "qwen3_5_moe_text",
                    source << ": model_type '" << (top_type.empty() ? std::string("<missing>") : top_type)
                           << "' is not supported",
                    "dflash supports Qwen3.5 / Qwen3.6 hybrid models: model_type qwen3_5, qwen3_5_text, qwen3_5_moe or "
                    "qwen3_5_moe_text");
  const bool moe = top_type == "qwen3_5_moe" || top_type == "qwen3_5_moe_text";

  const json* text = &doc;
  std::string prefix;
  if (top_type == "qwen3_5" || top_type == "qwen3_5_moe") {
    const bool has_text = doc.contains("text_config") && doc["text_config"].is_object();
    // transformers would fill a missing text_config of qwen3_5_moe with the Qwen3.5-35B-A3B defaults.
    DFLASH_REQUIRE_HINT(has_text || !moe, source << ": model_type qwen3_5_moe without an object 'text_config' (transformers "
                                                      "would take the default Qwen3.5-35B-A3B text fields) is not supported yet",
                      "write the language model's fields under text_config, or use model_type qwen3_5_moe_text with them "
                      "at the top level");
    DFLASH_REQUIRE(has_text,
                 source << ": model_type " << top_type << " needs an object 'text_config' with the language model fields");
    text = &doc["text_config"];
    prefix = "text_config.";
    if (text->contains("model_type") && (*text)["model_type"].is_string()) {
      const std::string inner = (*text)["model_type"].get<std::string>();
      const std::string want = moe ? "qwen3_5_moe_text" : "qwen3_5_text";
      DFLASH_REQUIRE_HINT(inner == want, source << ": field 'text_config.model_type' is '" << inner
                                                << "', but the top-level model_type '" << top_type << "' has '" << want
                                                << "' text fields",
                        "a dense model is qwen3_5 / qwen3_5_text, a Mixture-of-Experts one qwen3_5_moe / qwen3_5_moe_text "
                        "throughout");
    }
  }
  if (!moe)
    for (const char* moe_key : {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"})
      if (text->contains(moe_key) && !(*text)[moe_key].is_null())
        DFLASH_REJECT_HINT(source << ": field '" << prefix << moe_key << "' describes a Mixture-of-Experts model, but model_type is '"
                                << top_type << "'",
                         "an MoE config.json has model_type qwen3_5_moe (text fields under text_config) or qwen3_5_moe_text");

  io::JsonFields f(*text, source, prefix, kMissingHint);
  TargetConfig c;
  c.model_type = top_type;
  c.source = source;
  c.hidden_size = f.positive_int("hidden_size");
  c.num_hidden_layers = f.positive_int("num_hidden_layers");
  // transformers' qwen3_5_moe has no intermediate_size (the experts' is moe_intermediate_size).
  if (!moe) c.intermediate_size = f.positive_int("intermediate_size");
  c.vocab_size = f.positive_int("vocab_size");
  c.num_attention_heads = f.positive_int("num_attention_heads");
  c.num_key_value_heads = f.positive_int_or("num_key_value_heads", c.num_attention_heads);
  c.head_dim = f.positive_int_or("head_dim", c.hidden_size / c.num_attention_heads);
  c.rms_norm_eps = f.positive_or("rms_norm_eps", 1e-6);
  c.attn_output_gate = f.bool_or("attn_output_gate", true);
  c.linear_num_key_heads = f.positive_int("linear_num_key_heads");
  c.linear_num_value_heads = f.positive_int("linear_num_value_heads");
  c.linear_key_head_dim = f.positive_int("linear_key_head_dim");
  c.linear_value_head_dim = f.positive_int("linear_value_head_dim");
  c.linear_conv_kernel_dim = f.positive_int_or("linear_conv_kernel_dim", 4);
  c.mamba_ssm_dtype = f.string_or("mamba_ssm_dtype", "float32");
  // tie_word_embeddings may sit at the top level of a multimodal config.
  c.tie_word_embeddings = f.bool_or("tie_word_embeddings", io::JsonFields(doc, source, "").bool_or("tie_word_embeddings", false));
  c.max_position_embeddings = f.positive_int_or("max_position_embeddings", 0);
  c.random_branch_scale = f.positive_or("dflash_random_branch_scale", 1.0);

  const std::string act = f.string_or("hidden_act", "silu");
  DFLASH_REQUIRE(act == "silu", source << ": field '" << prefix << "hidden_act' is '" << act
                                     << "'; only 'silu' is supported");
  DFLASH_REQUIRE(!f.bool_or("attention_bias", false),
               source << ": field '" << prefix << "attention_bias' is true; biased attention projections are not supported");

  // RoPE: rope_parameters (transformers 5) or the legacy top-level rope_theta / partial_rotary_factor.
  c.rope_theta = f.positive_or("rope_theta", 10000.0);
  c.partial_rotary_factor = f.positive_or("partial_rotary_factor", 0.25);
  if (f.has("rope_parameters")) {
    const json& rp = (*text)["rope_parameters"];
    DFLASH_REQUIRE(rp.is_object(), source << ": field '" << prefix << "rope_parameters' must be an object");
    io::JsonFields r(rp, source, prefix + "rope_parameters.", kMissingHint);
    const std::string rope_type = r.string_or("rope_type", "default");
    DFLASH_REQUIRE_HINT(rope_type == "default", source << ": field '" << prefix << "rope_parameters.rope_type' is '"
                                                     << rope_type << "'; only 'default' RoPE is supported",
                      "long-context scaling (yarn, linear, dynamic) is not implemented");
    c.rope_theta = r.positive_or("rope_theta", c.rope_theta);
    c.partial_rotary_factor = r.positive_or("partial_rotary_factor", c.partial_rotary_factor);
  }

  // Layer pattern: explicit layer_types, else every full_attention_interval-th layer is attention.
  if (f.has("layer_types")) {
    const json& lt = (*text)["layer_types"];
    DFLASH_REQUIRE(lt.is_array(), source << ": field '" << prefix << "layer_types' must be a list");
    for (size_t i = 0; i < lt.size(); ++i) {
      const std::string s = lt[i].is_string() ? lt[i].get<std::string>() : lt[i].dump();
      if (s == "linear_attention") c.layer_types.push_back(LayerType::LinearAttention);
      else if (s == "full_attention") c.layer_types.push_back(LayerType::FullAttention);
      else
        DFLASH_REJECT(source << ": field '" << prefix << "layer_types[" << i << "]' is '" << s
                           << "'; expected 'linear_attention' or 'full_attention'");
    }
  } else {
    const int64_t interval = f.positive_int_or("full_attention_interval", 4);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      c.layer_types.push_back((i + 1) % interval == 0 ? LayerType::FullAttention : LayerType::LinearAttention);
  }
  if (moe) read_moe_fields(*text, f, source, prefix, c);
  // quantization_config: at the top level (as save_pretrained writes it) or beside the text fields.
  const bool top_qc = doc.contains("quantization_config");
  const json* qc = top_qc ? &doc.at("quantization_config")
                   : text->contains("quantization_config") ? &text->at("quantization_config") : nullptr;
  if (qc && !qc->is_null()) {
    const std::string qp = (top_qc ? std::string() : prefix) + "quantization_config.";
    DFLASH_REQUIRE(qc->is_object(), source << ": field '" << qp.substr(0, qp.size() - 1) << "' must be an object");
    io::JsonFields q(*qc, source, qp, "an FP8 checkpoint's quantization_config names quant_method fp8");
    const std::string hint = "dflash loads the block-FP8 checkpoints (quant_method fp8, fmt e4m3, weight_block_size "
                             "[128, 128], activation_scheme dynamic) and bf16 / f16 / f32 ones";
    const std::string method = q.string_or("quant_method", "<missing>");
    DFLASH_REQUIRE_HINT(method == "fp8", source << ": field '" << qp << "quant_method' is '" << method
                                              << "'; only 'fp8' (block-scaled e4m3) is supported", hint);
    const std::string fmt = q.string_or("fmt", "e4m3");
    DFLASH_REQUIRE_HINT(fmt == "e4m3", source << ": field '" << qp << "fmt' is '" << fmt << "'; only 'e4m3' is supported", hint);
    const std::string act = q.string_or("activation_scheme", "dynamic");
    DFLASH_REQUIRE_HINT(act == "dynamic", source << ": field '" << qp << "activation_scheme' is '" << act
                                               << "'; only 'dynamic' (per-token 1 x 128 scales computed at run time) is supported",
                      hint);
    DFLASH_REQUIRE_HINT(q.has("weight_block_size"), source << ": field '" << qp << "weight_block_size' is missing",
                      "per-tensor FP8 checkpoints are not supported; " + hint);
    const json& bs = (*qc)["weight_block_size"];
    DFLASH_REQUIRE_HINT(bs == json::array({128, 128}), source << ": field '" << qp << "weight_block_size' is " << bs.dump()
                                                            << "; only [128, 128] is supported",
                      hint);
    Fp8Quantization fq;
    if (q.has("modules_to_not_convert")) {
      const json& m = (*qc)["modules_to_not_convert"];
      DFLASH_REQUIRE(m.is_array(), source << ": field '" << qp << "modules_to_not_convert' must be a list of names");
      for (size_t i = 0; i < m.size(); ++i) {
        DFLASH_REQUIRE(m[i].is_string(), source << ": field '" << qp << "modules_to_not_convert[" << i << "]' is " << m[i].dump()
                                              << "; expected a module name");
        fq.modules_to_not_convert.push_back(m[i].get<std::string>());
      }
    }
    c.fp8 = std::move(fq);  // an MoE target's FP8 checkpoint runs dequantized (weights.h moe_fp8_precision)
  }
  c.validate();
  return c;
}

TargetConfig TargetConfig::from_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::string file = path;
  DFLASH_REQUIRE_HINT(fs::exists(path), "model path '" << path << "' does not exist",
                    "pass a Hugging Face model directory (config.json + *.safetensors) or a config.json file");
  if (fs::is_directory(path)) {
    file = (fs::path(path) / "config.json").string();
    DFLASH_REQUIRE_HINT(fs::exists(file), "model directory '" << path << "' has no config.json",
                      "a Hugging Face model directory holds config.json and the *.safetensors weights");
  }
  std::ifstream in(file);
  DFLASH_CHECK_IO(in.good(), "opening model config", file);
  json doc;
  try {
    doc = json::parse(in);
  } catch (const json::exception& e) {
    DFLASH_REJECT_HINT(file << ": not valid JSON: " << e.what(), "the file should be a Hugging Face config.json");
  }
  return from_json(doc, file);
}

void TargetConfig::validate() const {
  const std::string& s = source;
  DFLASH_REQUIRE(static_cast<int64_t>(layer_types.size()) == num_hidden_layers,
               s << ": layer_types has " << layer_types.size() << " entries but num_hidden_layers is " << num_hidden_layers);
  DFLASH_REQUIRE(num_attention_heads % num_key_value_heads == 0,
               s << ": num_attention_heads " << num_attention_heads << " is not a multiple of num_key_value_heads "
                 << num_key_value_heads);
  DFLASH_REQUIRE(linear_num_value_heads % linear_num_key_heads == 0,
               s << ": linear_num_value_heads " << linear_num_value_heads << " is not a multiple of linear_num_key_heads "
                 << linear_num_key_heads);
  DFLASH_REQUIRE(partial_rotary_factor > 0 && partial_rotary_factor <= 1,
               s << ": partial_rotary_factor " << partial_rotary_factor << " must be in (0, 1]");
  const double rd = static_cast<double>(head_dim) * partial_rotary_factor;
  DFLASH_REQUIRE(std::floor(rd) == rd && static_cast<int64_t>(rd) % 2 == 0,
               s << ": head_dim " << head_dim << " x partial_rotary_factor " << partial_rotary_factor
                 << " must give an even number of rotary dims");
  DFLASH_REQUIRE(rms_norm_eps < 1.0, s << ": rms_norm_eps " << rms_norm_eps << " is implausibly large");
  DFLASH_REQUIRE(vocab_size < (int64_t{1} << 31), s << ": vocab_size " << vocab_size << " does not fit in int32 ids");
  if (is_moe()) {
    DFLASH_REQUIRE(num_experts_per_tok >= 1 && num_experts_per_tok <= num_experts && moe_intermediate_size > 0 &&
                       shared_expert_intermediate_size > 0,
                   s << ": MoE sizes num_experts " << num_experts << ", num_experts_per_tok " << num_experts_per_tok
                     << ", moe_intermediate_size " << moe_intermediate_size << ", shared_expert_intermediate_size "
                     << shared_expert_intermediate_size << " are inconsistent");
    DFLASH_REQUIRE(ep_size >= 1 && num_experts % ep_size == 0,
                   s << ": ep_size " << ep_size << " does not divide num_experts " << num_experts);
  } else {
    DFLASH_REQUIRE(ep_size == 1, s << ": ep_size " << ep_size << " on a dense model (it has no experts)");
    DFLASH_REQUIRE(intermediate_size > 0, s << ": intermediate_size must be positive for a dense model");
  }
}

int64_t TargetConfig::rotary_dim() const {
  return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);
}

int64_t TargetConfig::count_layers(LayerType t) const {
  int64_t n = 0;
  for (LayerType x : layer_types) n += x == t;
  return n;
}

int64_t TargetConfig::parameter_count() const {
  const int64_t H = hidden_size;
  const int64_t gdn = gdn_conv_dim() * H + gdn_value_dim() * H + 2 * linear_num_value_heads * H +
                      gdn_conv_dim() * linear_conv_kernel_dim + 2 * linear_num_value_heads + linear_value_head_dim +
                      H * gdn_value_dim();
  const int64_t attn = attn_q_proj_rows() * H + 2 * num_key_value_heads * head_dim * H +
                       H * num_attention_heads * head_dim + 2 * head_dim;
  const int64_t mlp = mlp_parameters();
  int64_t n = vocab_size * H * (tie_word_embeddings ? 1 : 2) + H;
  n += count_layers(LayerType::LinearAttention) * (gdn + mlp + 2 * H);
  n += count_layers(LayerType::FullAttention) * (attn + mlp + 2 * H);
  return n;
}

int64_t TargetConfig::mlp_parameters() const {
  const int64_t H = hidden_size;
  if (!is_moe()) return 3 * H * intermediate_size;
  return num_experts * H + local_num_experts() * 3 * H * moe_intermediate_size + 3 * H * shared_expert_intermediate_size + H;
}

double TargetConfig::expert_bytes_per_layer(double bytes_per_param) const {
  return static_cast<double>(local_num_experts()) * 3.0 * static_cast<double>(hidden_size * moe_intermediate_size) *
         bytes_per_param;
}

int64_t TargetConfig::active_mlp_parameters() const {
  const int64_t H = hidden_size;
  if (!is_moe()) return mlp_parameters();
  return num_experts * H + num_experts_per_tok * 3 * H * moe_intermediate_size / ep_size +
         3 * H * shared_expert_intermediate_size + H;
}

int64_t TargetConfig::active_parameter_count() const {
  return parameter_count() - num_hidden_layers * (mlp_parameters() - active_mlp_parameters());
}

std::string TargetConfig::summary() const {
  std::ostringstream o;
  o << model_type << ": " << num_hidden_layers << " layers (" << count_layers(LayerType::LinearAttention)
    << " GatedDeltaNet + " << count_layers(LayerType::FullAttention) << " attention), hidden " << hidden_size
    << ", attn heads " << num_attention_heads << "/" << num_key_value_heads << "x" << head_dim << ", GDN heads "
    << linear_num_key_heads << "k/" << linear_num_value_heads << "v x " << linear_key_head_dim << "/"
    << linear_value_head_dim << ", vocab " << vocab_size << ", ";
  if (is_moe())
    o << num_experts << " experts (top " << num_experts_per_tok << ") x " << moe_intermediate_size << " + shared "
      << shared_expert_intermediate_size << ", ";
  auto count = [&](double p) {
    if (p >= 1e9) o << p / 1e9 << "B";
    else o << p / 1e6 << "M";
  };
  o.precision(3);
  count(static_cast<double>(parameter_count()));
  o << " params";
  if (is_moe()) {
    o << " (";
    count(static_cast<double>(active_parameter_count()));
    o << " active)";
  }
  return o.str();
}

std::string TargetConfig::state_dtype_note() const {
  if (mamba_ssm_dtype == "float32") return "";
  return source + ": mamba_ssm_dtype is '" + mamba_ssm_dtype +
         "'; dflash keeps the GatedDeltaNet states in float32 (a serving stack that keeps them in " + mamba_ssm_dtype +
         " may differ from dflash's outputs in the last bits)";
}

json TargetConfig::to_json() const {
  json lt = json::array();
  for (LayerType t : layer_types) lt.push_back(layer_type_name(t));
  json j{
      {"architectures", {is_moe() ? "Qwen3_5MoeForCausalLM" : "Qwen3_5ForCausalLM"}},
      {"model_type", is_moe() ? "qwen3_5_moe_text" : "qwen3_5_text"},
      {"hidden_size", hidden_size},
      {"num_hidden_layers", num_hidden_layers},
      {"vocab_size", vocab_size},
      {"layer_types", lt},
      {"rms_norm_eps", rms_norm_eps},
      {"tie_word_embeddings", tie_word_embeddings},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"head_dim", head_dim},
      {"attn_output_gate", attn_output_gate},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", rope_theta}, {"partial_rotary_factor", partial_rotary_factor}}},
      {"partial_rotary_factor", partial_rotary_factor},
      {"linear_num_key_heads", linear_num_key_heads},
      {"linear_num_value_heads", linear_num_value_heads},
      {"linear_key_head_dim", linear_key_head_dim},
      {"linear_value_head_dim", linear_value_head_dim},
      {"linear_conv_kernel_dim", linear_conv_kernel_dim},
      {"mamba_ssm_dtype", mamba_ssm_dtype},
  };
  if (is_moe()) {
    j["num_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["shared_expert_intermediate_size"] = shared_expert_intermediate_size;
    j["output_router_logits"] = output_router_logits;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
  } else {
    j["intermediate_size"] = intermediate_size;
  }
  if (max_position_embeddings > 0) j["max_position_embeddings"] = max_position_embeddings;
  if (random_branch_scale != 1.0) j["dflash_random_branch_scale"] = random_branch_scale;
  return j;
}

}  // namespace dflash::target
