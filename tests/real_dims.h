#pragma once
// A random target with the real head dims (GatedDeltaNet d 128, attention d 256), so the fast
// kernels serve it, and full-size residual branches (every layer's error shows; the demo's 0.02
// would hide them): the GPU tests' model of the 27B's shapes at a toy width.
#include <cstdint>
#include <string>

#include "target_model/config.h"
#include "target_model/weights.h"

inline dflash::target::TargetConfig real_dims() {
  dflash::target::TargetConfig c =
      dflash::target::TargetConfig::from_file(std::string(DFLASH_TEST_DATA_DIR) + "/../../configs/tiny/config.json");
  c.random_branch_scale = 1.0;
  c.hidden_size = 512;
  c.linear_key_head_dim = c.linear_value_head_dim = 128;
  c.head_dim = 256;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 1;
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 6;
  c.validate();
  return c;
}

// real_dims() with a sparse MoE block in every layer (qwen3_5_moe): 16 experts of 256, top 4, a
// shared expert of 256 (the MoE decode / speculative tests' target).
inline dflash::target::TargetConfig real_dims_moe() {
  dflash::target::TargetConfig c = real_dims();
  c.model_type = "qwen3_5_moe_text";
  c.num_experts = 16;
  c.num_experts_per_tok = 4;
  c.moe_intermediate_size = 256;
  c.shared_expert_intermediate_size = 256;
  c.intermediate_size = 0;
  c.validate();
  return c;
}

// f32 weights holding exactly the bf16 values random_weights(c, seed, BF16, <GPU>) draws: the CPU
// reference of a GPU model on the same weights.
inline dflash::target::TargetWeights bf16_random_weights_f32(const dflash::target::TargetConfig& c, uint64_t seed) {
  using namespace dflash;
  return target::assemble_weights(c, DType::F32, Device::cpu(), [&](const std::string& name, const Shape& shape) {
    return target::random_tensor(name, shape, seed, DType::BF16, Device::cpu(), c.random_branch_scale).to_dtype(DType::F32);
  });
}
