#pragma once
// The CPU reference forward of one sequence with the CUDA model's bf16 storage emulated: f32
// arithmetic as the reference (target_model/model.cpp's forward, op for op), but every activation the
// GPU keeps in bf16 rounded to bf16 where it stores it — the residual stream after each add, the
// norms' outputs, the in-projections' outputs, the conv and delta-rule outputs, q / k / v / gate
// after their norms and RoPE, the attention output, each mixer's and MLP / MoE block's output and the
// final norm. (Inside the MoE block and the GatedDeltaNet gates it stays f32.) What bf16 storage
// alone costs against an f32 reference, for bounds of GPU tests: the HF tiny MoE at T = 37 loses
// 4.0e-2 at its attention layer this way, and the GPU measured the same (h200-moe5).
#include <cmath>
#include <cstdint>
#include <map>
#include <vector>

#include "kernels/ops.h"
#include "target_model/model.h"

struct Bf16Storage {
  std::map<int64_t, dflash::Tensor> layers;                 // layer -> [T, H] f32 (bf16 values)
  std::map<int64_t, dflash::ops::MoeRouting> routing;       // MoE: each layer's choices and router logits
  dflash::Tensor final_hidden;                               // [T, H]
};

// `round` false: no rounding (then equal to m.forward, bit for bit: tests/test_golden_moe.cpp).
// `router_logits`: ForwardOptions::router_logits.
inline Bf16Storage bf16_storage_forward(const dflash::target::TargetModel& m, const std::vector<int32_t>& ids,
                                        bool round = true,
                                        const std::map<int64_t, dflash::Tensor>* router_logits = nullptr) {
  using namespace dflash;
  using namespace dflash::target;
  const TargetConfig& c = m.config();
  const int64_t N = static_cast<int64_t>(ids.size()), H = c.hidden_size;
  auto rb = [round](Tensor& t) {
    if (round) t = t.to_dtype(DType::BF16).to_dtype(DType::F32);
  };
  const ops::SeqOffsets seqs{{0, N}};
  std::vector<int32_t> idv = ids;
  Tensor h = Tensor::empty({N, H}, DType::F32);
  ops::embedding(Tensor::from_blob(idv.data(), {N}, DType::I32), m.weights().embed_tokens, h);
  Tensor normed = Tensor::empty({N, H}, DType::F32), mixed = Tensor::empty({N, H}, DType::F32);
  const float eps = static_cast<float>(c.rms_norm_eps);
  Bf16Storage out;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerWeights& L = m.weights().layers[static_cast<size_t>(i)];
    ops::rms_norm(h, L.input_layernorm, eps, ops::RmsNormKind::ZeroCentered, normed);
    rb(normed);
    if (L.type == LayerType::LinearAttention) {
      TargetModel::GdnInputs in = m.gdn_inputs(L, normed);
      rb(in.mixed), rb(in.z), rb(in.a), rb(in.b);
      Tensor conv = Tensor::empty({N, c.gdn_conv_dim()}, DType::F32);
      ops::causal_conv1d(in.mixed, L.gdn.conv1d, seqs, /*silu=*/true, conv);
      rb(conv);
      const ops::DeltaRuleParams p = m.gdn_core_params(L, conv, in);
      Tensor core = Tensor::empty({N, c.linear_num_value_heads, c.linear_value_head_dim}, DType::F32);
      ops::gated_delta_rule(p, seqs, ops::DeltaRuleAlgo::Chunked, core);
      rb(core);
      m.gdn_output(L, core, in.z, mixed);
    } else {
      TargetModel::AttnInputs a = m.attn_inputs(L, normed);
      ops::rope_neox_inplace(a.q, seqs, c.rotary_dim(), c.rope_theta);
      ops::rope_neox_inplace(a.k, seqs, c.rotary_dim(), c.rope_theta);
      rb(a.q), rb(a.k), rb(a.v);
      if (a.gate.defined()) rb(a.gate);
      Tensor attn = Tensor::empty({N, c.num_attention_heads, c.head_dim}, DType::F32);
      ops::causal_attention(a.q, a.k, a.v, seqs, 1.0f / std::sqrt(static_cast<float>(c.head_dim)), attn);
      rb(attn);
      m.attn_output(L, attn, a.gate, mixed);
    }
    rb(mixed);
    ops::add(h, mixed, h);
    rb(h);
    ops::rms_norm(h, L.post_attention_layernorm, eps, ops::RmsNormKind::ZeroCentered, normed);
    rb(normed);
    DFLASH_CHECK(c.is_moe(), "bf16_storage_forward: written for MoE targets (the dense MLP is private)");
    ops::MoeRouting route;
    const auto forced = router_logits ? router_logits->find(i) : std::map<int64_t, Tensor>::const_iterator();
    m.moe(L, normed, mixed, route, router_logits && forced != router_logits->end() ? &forced->second : nullptr);
    out.routing[i] = std::move(route);
    rb(mixed);
    ops::add(h, mixed, h);
    rb(h);
    out.layers[i] = h.clone();
  }
  out.final_hidden = Tensor::empty({N, H}, DType::F32);
  m.final_norm(h, out.final_hidden);
  rb(out.final_hidden);
  return out;
}
