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

// f32 weights holding exactly the bf16 values random_weights(c, seed, BF16, <GPU>) draws: the CPU
// reference of a GPU model on the same weights.
inline dflash::target::TargetWeights bf16_random_weights_f32(const dflash::target::TargetConfig& c, uint64_t seed) {
  using namespace dflash;
  return target::assemble_weights(c, DType::F32, Device::cpu(), [&](const std::string& name, const Shape& shape) {
    return target::random_tensor(name, shape, seed, DType::BF16, Device::cpu(), c.random_branch_scale).to_dtype(DType::F32);
  });
}
