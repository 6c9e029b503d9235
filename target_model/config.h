#pragma once
// The target model's architecture, parsed from a Hugging Face config.json of model_type
// `qwen3_5` (text fields under `text_config`) or `qwen3_5_text`, or their Mixture-of-Experts
// twins `qwen3_5_moe` (text fields under `text_config`) and `qwen3_5_moe_text`.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dflash::target {

// How the target's large projections run (model.target.precision, --precision):
//   auto  as stored: FP8 for a block-FP8 checkpoint, bf16 otherwise (random weights: bf16)
//   bf16  bf16 weights (f32 on the CPU reference); an FP8 checkpoint is dequantized at load
//   fp8   e4m3 weights with one f32 scale per 128 x 128 block, activations quantized per token
//         and 128-column group at run time (core/fp8.h); a bf16 checkpoint or random weights
//         are quantized at load
// Only the FP8 projections (is_fp8_projection) change; norms, conv, A_log, dt_bias, the small
// in_proj_b / in_proj_a, the embedding and lm_head stay as they are, as in the official checkpoints.
enum class Precision : uint8_t { Auto, Bf16, Fp8 };
std::optional<Precision> precision_from_name(std::string_view name);  // "auto", "bf16", "fp8"
const char* precision_name(Precision p);
struct TargetConfig;
// Auto resolved for a config: fp8 when it is a block-FP8 checkpoint's (not an MoE target's, which runs
// dequantized), bf16 otherwise.
Precision resolve_precision(Precision p, const TargetConfig& c);
// precision_from_name, throwing a message that names `where` (e.g. "--precision") otherwise.
Precision parse_precision(std::string_view name, const std::string& where);
inline constexpr const char* kPrecisionHelp =
    "auto | bf16 | fp8: the target's large projections as stored, in bf16, or in block-FP8 (e4m3 weights with "
    "128 x 128 block scales, dynamic 1 x 128 activation groups; a bf16 checkpoint is quantized at load)";

enum class LayerType { LinearAttention, FullAttention };
const char* layer_type_name(LayerType t);  // "linear_attention" / "full_attention"

struct TargetConfig {
  std::string model_type = "qwen3_5_text";  // as read (qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text)
  std::string source;                       // where it was read from, for messages

  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t intermediate_size = 0;  // the dense MLP's (0 for an MoE model, whose config does not have one)
  int64_t vocab_size = 0;
  std::vector<LayerType> layer_types;  // [num_hidden_layers]
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;  // the context the model was made for (0: the config does not say)
  // Random weights only (demos): the standard deviation of the residual branches' output
  // projections (o_proj, out_proj, down_proj) is multiplied by this (config.json key
  // "dflash_random_branch_scale", default 1). A deep random network's next token is a chaotic
  // function of its whole context that no drafter can learn; with small branches it depends mostly
  // on the recent tokens, like a language model's mostly predictable text (configs/tiny).
  double random_branch_scale = 1.0;

  // quantization_config of a block-FP8 checkpoint (Qwen3.6-27B-FP8 and its kin: quant_method fp8,
  // fmt e4m3, weight_block_size [128, 128], activation_scheme dynamic); absent for bf16/f16/f32
  // checkpoints. Any other scheme is refused by from_json, naming the field and the value.
  struct Fp8Quantization {
    std::vector<std::string> modules_to_not_convert;  // names (or name prefixes) kept in bf16
    bool operator==(const Fp8Quantization&) const = default;
  };
  std::optional<Fp8Quantization> fp8;

  // Gated full attention.
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  bool attn_output_gate = true;  // q_proj yields [q | gate] per head
  double partial_rotary_factor = 0.25;
  double rope_theta = 10000.0;

  // GatedDeltaNet.
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 4;
  // The recurrent state's dtype config.json asks for (mamba_ssm_dtype: the Qwen3.5 / 3.6 checkpoints say
  // float32, and vLLM sizes its state cache by it). dflash keeps the states in float32 on every backend;
  // another value is kept for to_json and named in a warning when the target loads (load_target_shard) and
  // by dflash_doctor: state_dtype_note().
  std::string mamba_ssm_dtype = "float32";
  std::string state_dtype_note() const;  // "" for float32

  // Mixture of experts (qwen3_5_moe as transformers 5.17 reads it): every decoder layer's MLP is a
  // sparse MoE block. router logits = x · gateᵀ (f32), softmax over all experts (f32), the top
  // num_experts_per_tok of them, their weights renormalised to sum 1, each chosen expert's SwiGLU
  // (moe_intermediate_size) times its weight, plus the shared expert's SwiGLU
  // (shared_expert_intermediate_size) times sigmoid(shared_expert_gate · x). 0 experts: dense.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;
  // transformers 5.17's qwen3_5_moe has no norm_topk_prob and always renormalises; a config.json
  // that says false is refused (that would be another model), true or absent reads as true.
  bool norm_topk_prob = true;
  // Read and kept for to_json, but without effect: the target is frozen (no load-balancing loss).
  bool output_router_logits = false;
  double router_aux_loss_coef = 0.001;
  bool is_moe() const { return num_experts > 0; }
  // Expert parallelism (set by target::local_config on a rank's shard, never read from config.json):
  // the experts are split into ep_size consecutive groups and this shard holds one group,
  // local_num_experts() of them (the router still scores all num_experts). 1 for the whole model.
  int64_t ep_size = 1;
  int64_t local_num_experts() const { return num_experts / ep_size; }

  // Parses a config.json document. `source` names it in error messages.
  static TargetConfig from_json(const nlohmann::json& doc, const std::string& source);
  // Reads a config.json file, or DIR/config.json when given a directory.
  static TargetConfig from_file(const std::string& path);
  // The qwen3_5_text form of this config (what save_pretrained of a text model writes).
  nlohmann::json to_json() const;
  // Checks internal consistency; throws naming the field. Called by from_json.
  void validate() const;

  int64_t rotary_dim() const;  // head_dim * partial_rotary_factor (even)
  int64_t gdn_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int64_t gdn_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int64_t gdn_conv_dim() const { return 2 * gdn_key_dim() + gdn_value_dim(); }
  int64_t attn_q_proj_rows() const { return num_attention_heads * head_dim * (attn_output_gate ? 2 : 1); }
  int64_t count_layers(LayerType t) const;
  // Parameters of one layer's MLP or MoE block, all of them / those one token uses (an expert-parallel
  // shard: the experts it holds / its average share of a token's, num_experts_per_tok / ep_size).
  int64_t mlp_parameters() const;
  int64_t active_mlp_parameters() const;
  // Bytes of one layer's routed experts (gate|up and down of local_num_experts()) at `bytes_per_param`.
  double expert_bytes_per_layer(double bytes_per_param) const;
  // Parameter count of the decoder stack plus embedding (and lm_head when untied).
  int64_t parameter_count() const;
  // The same with only the experts one token uses (= parameter_count() for a dense model).
  int64_t active_parameter_count() const;
  std::string summary() const;  // one line for logs
};

}  // namespace dflash::target
