#include "target_model/model.h"

#include <unistd.h>

#include <cmath>

namespace dflash::target {

using ops::SeqOffsets;

void check_cpu_reference_fits(const TargetConfig& local, const TargetConfig& full, const std::string& hint) {
  const double need = static_cast<double>(local.parameter_count()) * 4.0;
  const double have = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  DFLASH_CHECK_HINT(need < 0.8 * have, "the CPU reference needs " << need / 1e9 << " GB for the f32 weights of "
                                          << full.summary() << " (per rank), but this machine has " << have / 1e9
                                          << " GB",
                    hint);
}

TargetModel::TargetModel(TargetConfig config, TargetWeights weights, comm::Communicator* tp)
    : config_(std::move(config)), weights_(std::move(weights)), tp_(tp) {
  DFLASH_CHECK(weights_.layers.size() == static_cast<size_t>(config_.num_hidden_layers),
               "target model: " << weights_.layers.size() << " layers of weights for a config with "
                                << config_.num_hidden_layers);
  DFLASH_CHECK(weights_.device.is_cpu() && weights_.dtype == DType::F32,
               "target model: the CPU reference forward needs f32 weights on cpu, got "
                   << dtype_name(weights_.dtype) << " on " << weights_.device.str());
}

void TargetModel::gdn_mixer(const LayerWeights& L, const Tensor& x, const SeqOffsets& seqs, ops::DeltaRuleAlgo algo,
                            Tensor& out) const {
  const TargetConfig& c = config_;
  const int64_t N = x.size(0), Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, conv_dim = c.gdn_conv_dim();
  Tensor mixed = Tensor::empty({N, conv_dim}, DType::F32);
  ops::linear(x, L.gdn.in_proj_qkv, mixed);
  Tensor z = Tensor::empty({N, c.gdn_value_dim()}, DType::F32);
  ops::linear(x, L.gdn.in_proj_z, z);
  Tensor b = Tensor::empty({N, Hv}, DType::F32), a = Tensor::empty({N, Hv}, DType::F32);
  ops::linear(x, L.gdn.in_proj_b, b);
  ops::linear(x, L.gdn.in_proj_a, a);
  // One causal conv over the concatenated [q | k | v] channels, then split.
  Tensor conv = Tensor::empty({N, conv_dim}, DType::F32);
  ops::causal_conv1d(mixed, L.gdn.conv1d, seqs, /*silu=*/true, conv);
  ops::DeltaRuleParams p;
  p.q = conv.slice(1, 0, Hk * dk).contiguous().view({N, Hk, dk});
  p.k = conv.slice(1, Hk * dk, 2 * Hk * dk).contiguous().view({N, Hk, dk});
  p.v = conv.slice(1, 2 * Hk * dk, conv_dim).contiguous().view({N, Hv, dv});
  p.g = Tensor::empty({N, Hv}, DType::F32);
  p.beta = Tensor::empty({N, Hv}, DType::F32);
  ops::gdn_gates(a, b, L.gdn.A_log, L.gdn.dt_bias, p.g, p.beta);
  p.l2norm_qk = true;
  Tensor core = Tensor::empty({N, Hv, dv}, DType::F32);
  ops::gated_delta_rule(p, seqs, algo, core);
  Tensor normed = Tensor::empty({N, Hv, dv}, DType::F32);
  ops::gated_rms_norm(core, z.view({N, Hv, dv}), L.gdn.norm, static_cast<float>(c.rms_norm_eps), normed);
  ops::linear(normed.view({N, Hv * dv}), L.gdn.out_proj, out);
  if (tp_) tp_->all_reduce_sum(out);  // row-parallel out_proj: partial sums over the value heads
}

void TargetModel::attention_mixer(const LayerWeights& L, const Tensor& x, const SeqOffsets& seqs, Tensor& out) const {
  const TargetConfig& c = config_;
  const int64_t N = x.size(0), Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, d = c.head_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);
  Tensor qg = Tensor::empty({N, c.attn_q_proj_rows()}, DType::F32);
  ops::linear(x, L.attn.q_proj, qg);
  Tensor q, gate;
  if (c.attn_output_gate) {
    // Per head the projection holds [q (d) | gate (d)].
    Tensor per_head = qg.view({N, Hq, 2 * d});
    q = per_head.slice(2, 0, d).contiguous();
    gate = per_head.slice(2, d, 2 * d).contiguous().view({N, Hq * d});
  } else {
    q = qg.view({N, Hq, d});
  }
  Tensor k = Tensor::empty({N, Hkv * d}, DType::F32), v = Tensor::empty({N, Hkv * d}, DType::F32);
  ops::linear(x, L.attn.k_proj, k);
  ops::linear(x, L.attn.v_proj, v);
  Tensor k3 = k.view({N, Hkv, d});
  ops::rms_norm(q, L.attn.q_norm, eps, ops::RmsNormKind::ZeroCentered, q);
  ops::rms_norm(k3, L.attn.k_norm, eps, ops::RmsNormKind::ZeroCentered, k3);
  ops::rope_neox_inplace(q, seqs, c.rotary_dim(), c.rope_theta);
  ops::rope_neox_inplace(k3, seqs, c.rotary_dim(), c.rope_theta);
  Tensor attn = Tensor::empty({N, Hq, d}, DType::F32);
  ops::causal_attention(q, k3, v.view({N, Hkv, d}), seqs, 1.0f / std::sqrt(static_cast<float>(d)), attn);
  Tensor flat = attn.view({N, Hq * d});
  if (c.attn_output_gate) ops::sigmoid_gate_inplace(flat, gate);
  ops::linear(flat, L.attn.o_proj, out);
  if (tp_) tp_->all_reduce_sum(out);  // row-parallel o_proj
}

void TargetModel::mlp(const LayerWeights& L, const Tensor& x, Tensor& out) const {
  const int64_t N = x.size(0), I = config_.intermediate_size;
  Tensor g = Tensor::empty({N, I}, DType::F32), u = Tensor::empty({N, I}, DType::F32);
  ops::linear(x, L.gate_proj, g);
  ops::linear(x, L.up_proj, u);
  ops::swiglu(g, u, g);
  ops::linear(g, L.down_proj, out);
  if (tp_) tp_->all_reduce_sum(out);  // row-parallel down_proj
}

ForwardResult TargetModel::forward(const std::vector<std::vector<int32_t>>& sequences,
                                   const ForwardOptions& options) const {
  const TargetConfig& c = config_;
  DFLASH_CHECK(!sequences.empty(), "target forward: the batch has no sequences");
  ForwardResult r;
  r.offsets.push_back(0);
  for (size_t s = 0; s < sequences.size(); ++s) {
    DFLASH_CHECK(!sequences[s].empty(), "target forward: sequence " << s << " is empty");
    for (size_t t = 0; t < sequences[s].size(); ++t) {
      const int32_t id = sequences[s][t];
      DFLASH_CHECK_HINT(id >= 0 && id < c.vocab_size, "target forward: token id " << id << " at sequence " << s
                                                          << ", position " << t << " is outside the vocabulary [0, "
                                                          << c.vocab_size << ")",
                        "the tokens do not come from this model's tokenizer, or vocab_size in config.json is wrong");
    }
    r.offsets.push_back(r.offsets.back() + static_cast<int64_t>(sequences[s].size()));
  }
  for (int64_t id : options.capture)
    DFLASH_CHECK_HINT(id >= 0 && id < c.num_hidden_layers,
                      "target forward: capture layer id " << id << " is out of range",
                      "layer ids are 0.." << c.num_hidden_layers - 1 << " (id i = output of decoder layer i)");

  const SeqOffsets seqs{r.offsets};
  const int64_t N = r.offsets.back(), H = c.hidden_size;
  std::vector<int32_t> flat;
  flat.reserve(static_cast<size_t>(N));
  for (const auto& s : sequences) flat.insert(flat.end(), s.begin(), s.end());
  Tensor ids = Tensor::from_blob(flat.data(), {N}, DType::I32);

  Tensor h = Tensor::empty({N, H}, DType::F32);
  ops::embedding(ids, weights_.embed_tokens, h);
  Tensor normed = Tensor::empty({N, H}, DType::F32), mixed = Tensor::empty({N, H}, DType::F32);
  const float eps = static_cast<float>(c.rms_norm_eps);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerWeights& L = weights_.layers[static_cast<size_t>(i)];
    ops::rms_norm(h, L.input_layernorm, eps, ops::RmsNormKind::ZeroCentered, normed);
    if (L.type == LayerType::LinearAttention) {
      gdn_mixer(L, normed, seqs, options.delta_rule, mixed);
      if (options.counters) {
        options.counters->add(Step::Conv, Path::Cpu);
        options.counters->add(Step::DeltaRule, Path::Cpu);
      }
    } else {
      attention_mixer(L, normed, seqs, mixed);
      if (options.counters) options.counters->add(Step::Attention, Path::Cpu);
    }
    ops::add(h, mixed, h);
    ops::rms_norm(h, L.post_attention_layernorm, eps, ops::RmsNormKind::ZeroCentered, normed);
    mlp(L, normed, mixed);
    ops::add(h, mixed, h);
    for (int64_t id : options.capture)
      if (id == i) r.layers[id] = h.clone();
  }
  if (options.final_norm) {
    r.final_hidden = Tensor::empty({N, H}, DType::F32);
    ops::rms_norm(h, weights_.norm, eps, ops::RmsNormKind::ZeroCentered, r.final_hidden);
  }
  return r;
}

}  // namespace dflash::target
