#pragma once
// The drafter's trainable parameters, named as z-lab's DFlashDraftModel names them, plus random
// initialisation and the Hugging Face export / warm-start import (config.json + model.safetensors
// in bf16). The frozen target embed_tokens and lm_head are not part of the drafter.
#include <cstdint>
#include <string>
#include <vector>

#include "drafter/config.h"
#include "core/tensor.h"

namespace dflash::drafter {

struct LayerWeights {
  Tensor q_proj;                    // [Hq·d, H]
  Tensor k_proj, v_proj;            // [Hkv·d, H]
  Tensor o_proj;                    // [H, Hq·d]
  Tensor q_norm, k_norm;            // [d]  plain RMSNorm weight (x̂·w), init ones
  Tensor gate_proj, up_proj;        // [I, H]
  Tensor down_proj;                 // [H, I]
  Tensor input_layernorm;           // [H]  plain RMSNorm
  Tensor post_attention_layernorm;  // [H]  plain RMSNorm
};

struct DrafterWeights {
  Tensor fc;           // [H, k·H]  context projection, no bias
  Tensor hidden_norm;  // [H]       plain RMSNorm on fc's output
  std::vector<LayerWeights> layers;
  Tensor norm;         // [H]       final norm before the target's lm_head

  struct Entry {
    std::string name;  // z-lab / HF tensor name, e.g. "layers.0.self_attn.q_proj.weight"
    Tensor* tensor;
    Shape shape;       // expected shape for the config
    bool is_norm;      // an RMSNorm weight (init ones)
  };
  // Every parameter in a fixed order (fc, hidden_norm, layers.0..., norm); the same order for
  // export, import, gradients and tests. `layers` must already have num_hidden_layers entries.
  std::vector<Entry> entries(const DrafterConfig& c);

  // All parameters allocated and zeroed (gradient buffers) in `dtype` (F32 or F64 on the CPU).
  static DrafterWeights zeros(const DrafterConfig& c, DType dtype = DType::F32, Device device = Device::cpu());
  // Allocated and initialised: matrices ~ N(0, stddev) from the counter RNG (stream per tensor),
  // norm weights ones.
  // On a CUDA device the same values are drawn there (the counter RNG is identical on both), which
  // for a 27B-sized drafter (1.7 B parameters) is seconds instead of a minute on one host core.
  static DrafterWeights random(const DrafterConfig& c, uint64_t seed, float stddev = 0.02f,
                               DType dtype = DType::F32, Device device = Device::cpu());
  // Checks every tensor exists with the expected shape; throws naming the tensor.
  void check(const DrafterConfig& c) const;
};

// Writes `dir`/model.safetensors (bf16, z-lab names), `dir`/modeling_dflash.py (hf_modeling_source)
// and, last, `dir`/config.json (DrafterConfig::to_json, with the auto_map naming the module);
// creates `dir`. SGLang and vLLM load the directory as it is, transformers through
// AutoModel.from_pretrained(dir, trust_remote_code=True).
void export_hf(const std::string& dir, const DrafterConfig& c, const DrafterWeights& w);

// drafter/hf/modeling_dflash.py as compiled in: dflash's PyTorch DFlashDraftModel.
const char* hf_modeling_source();

struct LoadedDrafter {
  DrafterConfig config;
  DrafterWeights weights;
};
// Reads a directory written by export_hf (or by z-lab / SpecForge): config.json plus
// model.safetensors (or a sharded index). Weights are converted to `dtype`. Throws one error
// listing every missing, unexpected and mis-shaped tensor name.
LoadedDrafter import_hf(const std::string& dir, DType dtype = DType::F32);

}  // namespace dflash::drafter
