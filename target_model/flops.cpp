#include "target_model/flops.h"

#include <algorithm>

namespace dflash::target {

double forward_flops(const TargetConfig& c, const std::vector<int64_t>& seq_lens, int64_t num_layers) {
  double N = 0, attn_core = 0;
  for (int64_t T : seq_lens) {
    N += static_cast<double>(T);
    attn_core += 2.0 * static_cast<double>(c.num_attention_heads * c.head_dim) * static_cast<double>(T) *
                 static_cast<double>(T + 1);
  }
  const double H = static_cast<double>(c.hidden_size);
  // An MoE block counts what a token runs: the router, its top-k experts and the shared expert.
  const double mlp = static_cast<double>(c.active_mlp_parameters());
  const double gdn_lin = H * static_cast<double>(c.gdn_conv_dim() + 2 * c.gdn_value_dim() + 2 * c.linear_num_value_heads);
  const double attn_lin = H * static_cast<double>(c.attn_q_proj_rows() + 2 * c.num_key_value_heads * c.head_dim +
                                                  c.num_attention_heads * c.head_dim);
  const double gdn_core = 7.0 * static_cast<double>(c.linear_key_head_dim * c.linear_value_head_dim * c.linear_num_value_heads);
  double n_gdn = 0, n_attn = 0;
  const int64_t run = num_layers < 0 ? c.num_hidden_layers : std::min(num_layers, c.num_hidden_layers);
  for (int64_t i = 0; i < run; ++i) (c.layer_types[static_cast<size_t>(i)] == LayerType::LinearAttention ? n_gdn : n_attn) += 1;
  return n_gdn * (2.0 * N * (gdn_lin + mlp) + N * gdn_core) + n_attn * (2.0 * N * (attn_lin + mlp) + attn_core);
}

}  // namespace dflash::target
