#pragma once
// The small drafter shared by test_export and dump_drafter_logits: unlike the defaults in every
// field a loader might guess (GQA, head_dim not hidden / heads, an odd vocabulary, sliding layers
// wherever `types` puts them), so an export that left a field out would load as another model.
#include <utility>
#include <vector>

#include "drafter/config.h"

namespace dflash::fixtures {

inline drafter::DrafterConfig small_drafter_config(std::vector<drafter::AttnType> types) {
  drafter::DrafterConfig c;
  c.source = "small test drafter";
  c.hidden_size = 32;
  c.num_hidden_layers = static_cast<int64_t>(types.size());
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 12;
  c.intermediate_size = 56;
  c.vocab_size = 71;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 4096;
  c.layer_types = std::move(types);
  c.sliding_window = 5;
  c.block_size = 6;
  c.mask_token_id = 70;
  c.num_target_layers = 10;
  c.target_layer_ids = {1, 4, 7};
  c.validate();
  return c;
}

}  // namespace dflash::fixtures
