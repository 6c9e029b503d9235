#pragma once
// The hand-made drafters of the drafter tests (CPU reference, CUDA step, CUDA proposer): two
// layers, a full one then a sliding one, RoPE theta 1e4, the mask token the last vocabulary id, and
// k = 2 captured target layers {1, 3} of 6. Only the sizes differ between the tests.
#include <cstdint>
#include <string>

#include "drafter/config.h"
#include "drafter/weights.h"
#include "core/random.h"
#include "core/tensor.h"

namespace dflash {

struct DrafterSizes {
  int64_t hidden = 0, intermediate = 0, vocab = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t sliding_window = 0, block_size = 0;  // tokens: the sliding layer's window, a block
};

inline drafter::DrafterConfig full_and_sliding_drafter(const std::string& source, const DrafterSizes& s) {
  drafter::DrafterConfig c;
  c.source = source;
  c.hidden_size = s.hidden;
  c.num_hidden_layers = 2;
  c.num_attention_heads = s.heads;
  c.num_key_value_heads = s.kv_heads;
  c.head_dim = s.head_dim;
  c.intermediate_size = s.intermediate;
  c.vocab_size = s.vocab;
  c.rope_theta = 10000.0;
  c.layer_types = {drafter::AttnType::Full, drafter::AttnType::Sliding};
  c.sliding_window = s.sliding_window;
  c.block_size = s.block_size;
  c.mask_token_id = s.vocab - 1;
  c.num_target_layers = 6;
  c.target_layer_ids = {1, 3};
  c.validate();
  return c;
}

// The drafter of the CUDA-vs-CPU tests (step and proposer): H 256, I 512, V 1000, 4 query / 2 kv
// heads of 64 (sizes the tensor-core kernels take); the window and the block are each test's.
inline drafter::DrafterConfig gpu_test_drafter(int64_t sliding_window, int64_t block_size) {
  return full_and_sliding_drafter("test", {.hidden = 256, .intermediate = 512, .vocab = 1000, .heads = 4, .kv_heads = 2,
                                           .head_dim = 64, .sliding_window = sliding_window, .block_size = block_size});
}

// The values a bf16 copy of t holds, as an f64 host tensor: what the CPU reference gets so that it
// sees exactly what the GPU sees.
inline Tensor bf16_values(const Tensor& t) { return t.to(Device::cpu()).to_dtype(DType::BF16).to_dtype(DType::F64); }

// Random inputs of a CUDA-vs-CPU drafter test. w: weights drawn with std 0.05, norm weights
// uniform in [0.5, 1.5] (away from 1, so that their gradients are exercised), holding bf16 values
// exactly, as F64 (the CPU reference's view; the GPU rounds nothing away). embed (std 1) and lm_head
// (std 0.06) [vocab, hidden] F32 on the host: the GPU gets their bf16 copies, the CPU bf16_values.
struct Bf16DrafterInputs {
  drafter::DrafterWeights w;
  Tensor embed, lm_head;
};
inline Bf16DrafterInputs bf16_drafter_inputs(const drafter::DrafterConfig& c, uint64_t seed) {
  drafter::DrafterWeights drawn = drafter::DrafterWeights::random(c, seed, 0.05f, DType::F32);
  for (auto& e : drawn.entries(c))
    if (e.is_norm) fill_uniform(*e.tensor, {seed, 77, 0}, 0.5f, 1.5f);
  Bf16DrafterInputs in{drafter::DrafterWeights::zeros(c, DType::F64), {}, {}};
  auto src = drawn.entries(c), dst = in.w.entries(c);
  for (size_t i = 0; i < src.size(); ++i) dst[i].tensor->copy_from(bf16_values(*src[i].tensor));
  in.embed = Tensor::empty({c.vocab_size, c.hidden_size}, DType::F32);
  in.lm_head = in.embed.clone();
  fill_normal(in.embed, {seed, 1, 0}, 0.0f, 1.0f);
  fill_normal(in.lm_head, {seed, 2, 0}, 0.0f, 0.06f);
  return in;
}

}  // namespace dflash
