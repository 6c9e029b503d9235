#include "trainer/memory_plan.h"

#include "drafter/weights.h"
#include "target_model/weights.h"

#include <algorithm>

#include <spdlog/fmt/fmt.h>

namespace dflash::trainer {

namespace {
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The widest input of one FP8 GEMM per token, in elements (it is quantized to e4m3 [N, .]): the
// dense MLP's down projection input I; an MoE block's k expert down inputs or the shared expert's.
double fp8_gemm_input_per_token(const target::TargetConfig& t) {
  if (!t.is_moe()) return static_cast<double>(t.intermediate_size);
  return static_cast<double>(std::max(t.num_experts_per_tok * t.moe_intermediate_size, t.shared_expert_intermediate_size));
}
double drafter_params(const drafter::DrafterConfig& d) {
  drafter::DrafterWeights w;  // shapes only: nothing is allocated
  w.layers.resize(static_cast<size_t>(d.num_hidden_layers));
  double n = 0;
  for (const auto& e : w.entries(d)) n += static_cast<double>(shape_numel(e.shape));
  return n;
}
}  // namespace

// Bytes per token, the widest MLP-block buffers of the target forward. Dense: gate|up and
// their product (bf16, 3·I). MoE: the router's fp32 logits and probabilities (2·E), the top-k ids
// and weights (int32 + fp32), per chosen expert the token's gathered copy, its gate|up, their
// product and the weighted expert output (bf16, 2·H + 3·I_e), and the shared expert's gate|up
// and product (bf16, 3·I_s); the shared gate's logit is one fp32.
double mlp_activation_bytes_per_token(const target::TargetConfig& t) {
  if (!t.is_moe()) return 2.0 * 3.0 * static_cast<double>(t.intermediate_size);
  const double H = static_cast<double>(t.hidden_size), E = static_cast<double>(t.num_experts);
  const double k = static_cast<double>(t.num_experts_per_tok), Ie = static_cast<double>(t.moe_intermediate_size);
  const double Is = static_cast<double>(t.shared_expert_intermediate_size);
  return 4.0 * 2.0 * E + 8.0 * k + 2.0 * k * (2.0 * H + 3.0 * Ie) + 2.0 * 3.0 * Is + 4.0;
}

MemoryPlan gpu_memory_plan(const target::TargetConfig& t, const drafter::DrafterConfig& d, int64_t tokens,
                           int64_t max_seqlen, int64_t blocks, int64_t ce_chunk_rows, bool fp8_target,
                           bool fp8_drafter, bool fp8_experts, bool fp8_lm_head) {
  MemoryPlan p;
  const double N = static_cast<double>(tokens), R = static_cast<double>(blocks * d.block_size);
  p.target_weights = 2.0 * static_cast<double>(t.parameter_count());
  if (t.is_moe()) p.target_experts = static_cast<double>(t.num_hidden_layers) * t.expert_bytes_per_layer(2.0);
  if (fp8_experts && t.is_moe()) {  // 2 -> 1 byte a value, plus a 4-byte scale per 128 x 128 block
    const double fp8 = p.target_experts * (0.5 + 2.0 / (128.0 * 128.0));
    p.target_weights -= p.target_experts - fp8;
    p.target_experts = fp8;
  }
  if (fp8_target) {
    double proj = 0;
    for (const target::TensorSpec& s : target::expected_tensors(t))
      if (target::is_fp8_projection(s.name)) proj += static_cast<double>(shape_numel(s.shape));
    p.target_weights -= proj * (1.0 - 4.0 / (128.0 * 128.0));  // 2 -> 1 byte, plus the block scales
  }
  // The widest per-token buffers of one layer (bf16): residual + normed + scratch, the fused
  // in-projection output, conv output, the MLP block's (mlp_activation_bytes_per_token); plus the captures.
  const double H = static_cast<double>(t.hidden_size);
  const double proj = static_cast<double>(std::max(t.gdn_conv_dim() + 2 * t.gdn_value_dim() + 2 * t.linear_num_value_heads,
                                                   t.attn_q_proj_rows() + 2 * t.num_key_value_heads * t.head_dim));
  p.target_activations = 2.0 * N * (4 * H + proj + static_cast<double>(t.gdn_conv_dim())) +
                         N * mlp_activation_bytes_per_token(t) +
                         2.0 * N * H * static_cast<double>(d.num_context_layers()) * 2;  // captures + packed context
  // FP8: the largest quantized GEMM input (e4m3) and its scales
  if (fp8_target) p.target_activations += N * fp8_gemm_input_per_token(t) * (1.0 + 4.0 / 128.0);
  // FP8 experts: the prefill's grouped calls on sm_90 (the wgmma kernel, bf16 tiles only) and the
  // fallback read a bf16 copy of a layer's experts (cuda::moe_fp8_scratch), written first.
  if (fp8_experts && t.is_moe()) p.target_activations += t.expert_bytes_per_layer(2.0);
  p.drafter_state = 18.0 * drafter_params(d);
  if (fp8_drafter) p.drafter_state += 2.0 * drafter_params(d);  // e4m3 codes + their transposes (upper bound)
  const double Hd = static_cast<double>(d.hidden_size), Id = static_cast<double>(d.intermediate_size);
  const double qd = static_cast<double>(d.q_dim()), kvd = static_cast<double>(d.kv_dim());
  const double Hq = static_cast<double>(d.num_attention_heads), Hkv = static_cast<double>(d.num_key_value_heads);
  // Saved per layer: per block row h_in, h1 (fp32), xn, yn, q|k, v, q, k, o (bf16), gate|up, m,
  // statistics; per context row k, v, rotated k.
  const double per_row = 8 * Hd + 4 * Hd + 2 * (qd + kvd) + 2 * kvd + 2 * qd + 2 * kvd + 2 * qd + 4 * Id + 2 * Id +
                         4 * (2 + 2 * Hq + Hkv);
  const double per_ctx = 6 * kvd + 4 * Hkv;
  const double saved = static_cast<double>(d.num_hidden_layers) * (R * per_row + N * per_ctx);
  // Outside the layers: context features, final states, the LM-head gradient, backward temporaries.
  const double other = N * (2 * Hd * 2 + 4 * Hd + 2 * Hd * 2 + 4 * kvd * 2) +
                       R * (4 * Hd + 2 * Hd + 4 * Hd + 4 * Hd + 2 * Hd * 2 + 2 * Id + 4 * Id + 2 * qd * 2 +
                            2 * (qd + 2 * kvd) + 2 * kvd * 2);
  p.drafter_activations = saved + other;
  if (fp8_drafter)  // the widest backward's operand codes at once: gate|up's gradient in both encodings, yn's transposed
    p.drafter_activations += R * (2.0 * 2.0 * static_cast<double>(d.intermediate_size) + static_cast<double>(d.hidden_size));
  const double V = static_cast<double>(d.vocab_size);
  // A chunk's fp32 logits and bf16 gradient, and the loss rows gathered out of the block rows with
  // their fp32 d(final norm) (CudaDrafter::loss; at most R rows).
  const double chunk = static_cast<double>(std::min<int64_t>(ce_chunk_rows, std::max<int64_t>(blocks * d.block_size, 1)));
  p.ce_workspace = chunk * (V + 8) * 6.0 + R * 6.0 * Hd;
  if (fp8_lm_head)  // (cuda::linear_ce_workspace's FP8 form: logits fp32 + gradient codes over V + 16, hidden codes,
                    // an fp32 staging block; the head's codes and their transpose)
    p.ce_workspace = (chunk + 4) * ((V + 16) * 5.0 + Hd * 5.0 + 4.0 * (V / 128.0 + 2)) + R * 6.0 * Hd + 2.0 * V * Hd;
  // block_attention_bwd_workspace where the wgmma kernels run (its upper bound elsewhere): δ
  // [R, Hq] fp32 and a 64 x 64 bf16 dSᵀ tile per block, kv head, 64-row query tile and 64-key tile
  // (ceil(max_seqlen / 64) context tiles + the block's own).
  const int64_t m_tiles = (d.block_size * d.num_attention_heads / d.num_key_value_heads + 63) / 64;
  const int64_t key_tiles = (max_seqlen + 63) / 64 + (d.block_size + 63) / 64;
  p.attn_workspace = R * Hq * 4 + static_cast<double>(blocks) * Hkv * static_cast<double>(m_tiles * key_tiles) * 8192;
  return p;
}

int64_t blocks_per_drafter_pass(const TrainConfig& cfg, int64_t tp) {
  const int64_t blocks = (cfg.training.batch_size * cfg.training.num_anchors + tp - 1) / tp;
  return cfg.training.blocks_per_pass > 0 ? std::min(blocks, cfg.training.blocks_per_pass) : blocks;
}

std::string MemoryPlan::table(double device_bytes) const {
  auto row = [&](const char* what, double b) {
    return fmt::format("  {:<24} {:8.2f} GiB\n", what, b / kGiB);
  };
  std::string s = row("target weights", target_weights) +
                  (target_experts > 0 ? row("  of which routed experts", target_experts) : std::string()) +
                  row("target activations", target_activations) +
                  row("drafter state", drafter_state) + row("drafter activations", drafter_activations) +
                  row("LM-head CE workspace", ce_workspace) + row("attention bwd workspace", attn_workspace);
  s += fmt::format("  {:<24} {:8.2f} GiB", "total (estimate)", total() / kGiB);
  if (device_bytes > 0) s += fmt::format(" of {:.1f} GiB ({:.0f}%)", device_bytes / kGiB, 100.0 * total() / device_bytes);
  return s;
}

}  // namespace dflash::trainer
