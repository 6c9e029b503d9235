#pragma once
// The DFlash drafter's architecture, as a Hugging Face config.json that z-lab's DFlashDraftModel,
// SGLang, vLLM and transformers (through dflash's own modeling file) read: architectures
// ["DFlashDraftModel"], model_type "qwen3", auto_map, the Qwen3 fields, block_size, dflash_config
// {mask_token_id, target_layer_ids}, num_target_layers. tests/data/serving_fields.json lists every
// field those loaders read, with where each is read.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace dflash::target {
struct TargetConfig;
}

namespace dflash::drafter {

// The Python module export_hf writes beside the weights (drafter/hf/modeling_dflash.py, compiled in)
// and config.json's auto_map names: AutoModel.from_pretrained(dir, trust_remote_code=True) loads it.
inline constexpr const char* kHfModelingModule = "modeling_dflash";

enum class AttnType { Full, Sliding };

// The arithmetic of the CPU drafter step (StepOptions::math, drafter/model.h): F64 is the reference
// (plain double loops: the oracle of the tests, finite differences and the CUDA drafter); F32 computes
// the same formulas in float with the matrix products on the threaded f32 GEMM (kernels/cpu/gemm.h),
// ~10x faster: the CPU backend's default (kernels.cpu_drafter). Both give the same bits on any thread
// count.
enum class DrafterMath { F64, F32 };
const char* attn_type_name(AttnType t);  // "full_attention" / "sliding_attention"

// z-lab's rule: n ids evenly spaced from 1 to L-3 (Python round: half to even), or L/2 when n = 1.
std::vector<int64_t> default_target_layer_ids(int64_t num_target_layers, int64_t n);

struct DrafterConfig {
  std::string source;  // where it was read from, for messages

  int64_t hidden_size = 0;        // = the target's hidden size
  int64_t num_hidden_layers = 0;  // drafter layers (typically 5)
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;  // = the target's vocab (its embed_tokens / lm_head are used)
  double rms_norm_eps = 1e-6;
  double rope_theta = 1000000.0;
  int64_t max_position_embeddings = 40960;  // written for loaders; not used by training
  std::vector<AttnType> layer_types;        // [num_hidden_layers]
  int64_t sliding_window = 0;               // keys; required (> 0) when a layer is sliding
  int64_t block_size = 16;
  int64_t mask_token_id = -1;
  std::vector<int64_t> target_layer_ids;  // captured target layers (decoder-layer outputs), k of them
  int64_t num_target_layers = 0;

  int64_t num_context_layers() const { return static_cast<int64_t>(target_layer_ids.size()); }
  int64_t context_dim() const { return num_context_layers() * hidden_size; }  // fc input width k·H
  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }

  // Parses a config.json document; `source` names it in error messages. Calls validate().
  static DrafterConfig from_json(const nlohmann::json& doc, const std::string& source);
  // Reads a config.json file, or DIR/config.json when given a directory.
  static DrafterConfig from_file(const std::string& path);
  // The Hugging Face form (what export writes).
  nlohmann::json to_json() const;
  // Checks internal consistency; throws dflash::Error naming the field.
  void validate() const;
  // Throws naming the field when this drafter was not made for `target`: hidden_size, vocab_size
  // and num_target_layers must be the target's (validate() keeps target_layer_ids and
  // mask_token_id inside them). The message does not name the drafter: callers add where it came from.
  void check_target(const target::TargetConfig& target) const;

  // A drafter for `target`: hidden/vocab/heads/head_dim/intermediate/rope_theta from the target,
  // all layers full attention, default target_layer_ids with n = num_layers.
  static DrafterConfig for_target(const target::TargetConfig& target, int64_t num_layers, int64_t mask_token_id,
                                  int64_t block_size = 16);
  std::string summary() const;  // one line for logs
};

}  // namespace dflash::drafter
