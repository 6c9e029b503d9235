#include "target_model/model.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "target_model/tp.h"

namespace dflash::target {

using ops::SeqOffsets;

namespace {
// y = x · wᵀ; for an FP8 projection (its scale defined) x is first quantized per token and
// 128-column group as the FP8 GEMM quantizes it (w holds the dequantized e4m3 values).
void project(const Tensor& x, const Tensor& w, const Tensor& scale, Tensor& y) {
  if (scale.defined()) ops::linear(ops::fake_quantize_fp8_act(x), w, y);
  else ops::linear(x, w, y);
}
}  // namespace

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
  const int tp_size = tp_ ? tp_->size() : 1;
  DFLASH_CHECK(config_.ep_size >= 1 && tp_size % config_.ep_size == 0,
               "target model: ep " << config_.ep_size << " expert groups in a TP group of " << tp_size << " ranks");
  if (config_.is_moe()) expert_load_.assign(static_cast<size_t>(config_.ep_size), 0);
}

TargetModel::GdnInputs TargetModel::gdn_inputs(const LayerWeights& L, const Tensor& x) const {
  const TargetConfig& c = config_;
  const int64_t N = x.size(0), Hv = c.linear_num_value_heads;
  GdnInputs in;
  in.mixed = Tensor::empty({N, c.gdn_conv_dim()}, DType::F32);
  project(x, L.gdn.in_proj_qkv, L.gdn.in_proj_qkv_scale, in.mixed);
  in.z = Tensor::empty({N, c.gdn_value_dim()}, DType::F32);
  project(x, L.gdn.in_proj_z, L.gdn.in_proj_z_scale, in.z);
  in.b = Tensor::empty({N, Hv}, DType::F32);
  in.a = Tensor::empty({N, Hv}, DType::F32);
  ops::linear(x, L.gdn.in_proj_b, in.b);
  ops::linear(x, L.gdn.in_proj_a, in.a);
  return in;
}

ops::DeltaRuleParams TargetModel::gdn_core_params(const LayerWeights& L, const Tensor& conv, const GdnInputs& in) const {
  const TargetConfig& c = config_;
  const int64_t N = conv.size(0), Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, conv_dim = c.gdn_conv_dim();
  ops::DeltaRuleParams p;
  p.q = conv.slice(1, 0, Hk * dk).contiguous().view({N, Hk, dk});
  p.k = conv.slice(1, Hk * dk, 2 * Hk * dk).contiguous().view({N, Hk, dk});
  p.v = conv.slice(1, 2 * Hk * dk, conv_dim).contiguous().view({N, Hv, dv});
  p.g = Tensor::empty({N, Hv}, DType::F32);
  p.beta = Tensor::empty({N, Hv}, DType::F32);
  ops::gdn_gates(in.a, in.b, L.gdn.A_log, L.gdn.dt_bias, p.g, p.beta);
  p.l2norm_qk = true;
  return p;
}

void TargetModel::gdn_output(const LayerWeights& L, const Tensor& core, const Tensor& z, Tensor& out) const {
  const TargetConfig& c = config_;
  const int64_t N = core.size(0), Hv = c.linear_num_value_heads, dv = c.linear_value_head_dim;
  Tensor normed = Tensor::empty({N, Hv, dv}, DType::F32);
  ops::gated_rms_norm(core, z.view({N, Hv, dv}), L.gdn.norm, static_cast<float>(c.rms_norm_eps), normed);
  project(normed.view({N, Hv * dv}), L.gdn.out_proj, L.gdn.out_proj_scale, out);
  if (tp_) tp_->all_reduce_sum(out);  // row-parallel out_proj: partial sums over the value heads
}

TargetModel::AttnInputs TargetModel::attn_inputs(const LayerWeights& L, const Tensor& x) const {
  const TargetConfig& c = config_;
  const int64_t N = x.size(0), Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, d = c.head_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);
  Tensor qg = Tensor::empty({N, c.attn_q_proj_rows()}, DType::F32);
  project(x, L.attn.q_proj, L.attn.q_proj_scale, qg);
  AttnInputs a;
  if (c.attn_output_gate) {
    // Per head the projection holds [q (d) | gate (d)].
    Tensor per_head = qg.view({N, Hq, 2 * d});
    a.q = per_head.slice(2, 0, d).contiguous();
    a.gate = per_head.slice(2, d, 2 * d).contiguous().view({N, Hq * d});
  } else {
    a.q = qg.view({N, Hq, d});
  }
  Tensor k = Tensor::empty({N, Hkv * d}, DType::F32);
  a.v = Tensor::empty({N, Hkv * d}, DType::F32);
  project(x, L.attn.k_proj, L.attn.k_proj_scale, k);
  project(x, L.attn.v_proj, L.attn.v_proj_scale, a.v);
  a.k = k.view({N, Hkv, d});
  a.v = a.v.view({N, Hkv, d});
  ops::rms_norm(a.q, L.attn.q_norm, eps, ops::RmsNormKind::ZeroCentered, a.q);
  ops::rms_norm(a.k, L.attn.k_norm, eps, ops::RmsNormKind::ZeroCentered, a.k);
  return a;
}

void TargetModel::attn_output(const LayerWeights& L, Tensor& attn, const Tensor& gate, Tensor& out) const {
  const TargetConfig& c = config_;
  Tensor flat = attn.view({attn.size(0), c.num_attention_heads * c.head_dim});
  if (c.attn_output_gate) ops::sigmoid_gate_inplace(flat, gate);
  project(flat, L.attn.o_proj, L.attn.o_proj_scale, out);
  if (tp_) tp_->all_reduce_sum(out);  // row-parallel o_proj
}

void TargetModel::final_norm(const Tensor& h, Tensor& y) const {
  ops::rms_norm(h, weights_.norm, static_cast<float>(config_.rms_norm_eps), ops::RmsNormKind::ZeroCentered, y);
}

void TargetModel::lm_head(const Tensor& normed, Tensor& logits) const { ops::linear(normed, weights_.lm_head, logits); }

void TargetModel::mlp(const LayerWeights& L, const Tensor& x, Tensor& out) const {
  const int64_t N = x.size(0), I = config_.intermediate_size;
  Tensor g = Tensor::empty({N, I}, DType::F32), u = Tensor::empty({N, I}, DType::F32);
  project(x, L.gate_proj, L.gate_proj_scale, g);
  project(x, L.up_proj, L.up_proj_scale, u);
  ops::swiglu(g, u, g);
  project(g, L.down_proj, L.down_proj_scale, out);
  if (tp_) tp_->all_reduce_sum(out);  // row-parallel down_proj
}

void TargetModel::moe(const LayerWeights& L, const Tensor& x, Tensor& out, ops::MoeRouting& routing,
                      const Tensor* logits) const {
  // transformers' Qwen3_5MoeSparseMoeBlock: routed experts (each token's top-k, renormalised
  // weights) + sigmoid(shared_expert_gate · x) · shared_expert(x), all in f32 here.
  // Under tp (tp.h): every rank routes the same tokens with the replicated router, runs its expert
  // group's experts (their moe_intermediate_size slice) and its slice of the shared expert, and the
  // partial outputs are summed by one all-reduce.
  const TargetConfig& c = config_;
  const int64_t N = x.size(0), Is = c.shared_expert_intermediate_size;
  if (logits) {
    DFLASH_CHECK(logits->shape() == Shape({N, c.num_experts}), "target forward: forced router logits "
                                                                   << logits->describe() << " are not [" << N << ", "
                                                                   << c.num_experts << "]");
    ops::moe_route_logits(*logits, c.num_experts_per_tok, c.norm_topk_prob, routing);
    ops::MoeRouting own;  // the router's own logits are still what capture_routing returns
    ops::moe_route(x, L.moe.router, c.num_experts_per_tok, c.norm_topk_prob, own);
    routing.logits = own.logits;
  } else {
    ops::moe_route(x, L.moe.router, c.num_experts_per_tok, c.norm_topk_prob, routing);
  }
  const int64_t El = c.local_num_experts();
  ops::moe_experts(x, L.moe.experts_gate_up, L.moe.experts_down, routing, out, expert_group() * El, c.num_experts, L.moe.fp8);
  {
    // Load balance: (token, expert) pairs per expert group (every rank sees the whole routing).
    const int32_t* ex = routing.experts.data<int32_t>();
    for (int64_t i = 0; i < routing.experts.numel(); ++i) expert_load_[static_cast<size_t>(ex[i] / El)] += 1;
  }
  // The shared expert: W8A8 (MoeWeights::fp8) quantizes its projections' inputs per token, 1 x 128.
  const Tensor xs = L.moe.fp8 ? ops::fake_quantize_fp8_act(x) : x;
  Tensor g = Tensor::empty({N, Is}, DType::F32), u = Tensor::empty({N, Is}, DType::F32);
  ops::linear(xs, L.moe.shared_gate_proj, g);
  ops::linear(xs, L.moe.shared_up_proj, u);
  ops::swiglu(g, u, g);
  if (L.moe.fp8) g = ops::fake_quantize_fp8_act(g);
  Tensor shared = Tensor::empty({N, c.hidden_size}, DType::F32), gate = Tensor::empty({N, 1}, DType::F32);
  ops::linear(g, L.moe.shared_down_proj, shared);
  ops::linear(x, L.moe.shared_expert_gate, gate);
  ops::add_sigmoid_gated(shared, gate, out);
  if (tp_) tp_->all_reduce_sum(out);  // the experts' and the shared expert's partial sums
}

int64_t TargetModel::expert_group() const {
  return tp_ ? TpShard{tp_->rank(), tp_->size(), static_cast<int>(config_.ep_size)}.expert_group() : 0;
}

int64_t layers_to_run(const TargetConfig& c, const ForwardOptions& options) {
  if (!options.skip_unused_layers || options.final_norm || options.capture_routing) return c.num_hidden_layers;
  int64_t last = -1;
  for (int64_t id : options.capture) last = std::max(last, id);
  return std::min(last + 1, c.num_hidden_layers);
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

  const Mixer mixer = [&](int64_t, const LayerWeights& L, const Tensor& x, Tensor& out) {
    if (L.type == LayerType::LinearAttention) {
      const GdnInputs in = gdn_inputs(L, x);
      // One causal conv over the concatenated [q | k | v] channels, then split.
      Tensor conv = Tensor::empty({N, c.gdn_conv_dim()}, DType::F32);
      ops::causal_conv1d(in.mixed, L.gdn.conv1d, seqs, /*silu=*/true, conv);
      const ops::DeltaRuleParams p = gdn_core_params(L, conv, in);
      Tensor core = Tensor::empty({N, c.linear_num_value_heads, c.linear_value_head_dim}, DType::F32);
      ops::gated_delta_rule(p, seqs, options.delta_rule, core);
      gdn_output(L, core, in.z, out);
      if (options.counters) {
        options.counters->add(Step::Conv, Path::Cpu);
        options.counters->add(Step::DeltaRule, Path::Cpu);
      }
    } else {
      AttnInputs a = attn_inputs(L, x);
      ops::rope_neox_inplace(a.q, seqs, c.rotary_dim(), c.rope_theta);
      ops::rope_neox_inplace(a.k, seqs, c.rotary_dim(), c.rope_theta);
      Tensor attn = Tensor::empty({N, c.num_attention_heads, c.head_dim}, DType::F32);
      ops::causal_attention(a.q, a.k, a.v, seqs, 1.0f / std::sqrt(static_cast<float>(c.head_dim)), attn);
      attn_output(L, attn, a.gate, out);
      if (options.counters) options.counters->add(Step::Attention, Path::Cpu);
    }
    if (options.counters) options.counters->add(Step::Gemm, Path::Cpu);
  };
  Tensor h = run_stack(ids, mixer, options.capture, r.layers, options.capture_routing ? &r.routing : nullptr,
                       options.router_logits, layers_to_run(c, options));
  if (options.final_norm) {
    r.final_hidden = Tensor::empty({N, H}, DType::F32);
    final_norm(h, r.final_hidden);
  }
  return r;
}

Tensor TargetModel::run_stack(const Tensor& ids, const Mixer& mixer, const std::vector<int64_t>& capture,
                              std::map<int64_t, Tensor>& layers, std::map<int64_t, ops::MoeRouting>* routing,
                              const std::map<int64_t, Tensor>* router_logits, int64_t num_layers) const {
  const TargetConfig& c = config_;
  const int64_t layers_run = num_layers < 0 ? c.num_hidden_layers : std::min(num_layers, c.num_hidden_layers);
  const int64_t N = ids.size(0), H = c.hidden_size;
  Tensor h = Tensor::empty({N, H}, DType::F32);
  ops::embedding(ids, weights_.embed_tokens, h);
  Tensor normed = Tensor::empty({N, H}, DType::F32), mixed = Tensor::empty({N, H}, DType::F32);
  const float eps = static_cast<float>(c.rms_norm_eps);
  for (int64_t i = 0; i < layers_run; ++i) {
    const LayerWeights& L = weights_.layers[static_cast<size_t>(i)];
    ops::rms_norm(h, L.input_layernorm, eps, ops::RmsNormKind::ZeroCentered, normed);
    mixer(i, L, normed, mixed);
    ops::add(h, mixed, h);
    ops::rms_norm(h, L.post_attention_layernorm, eps, ops::RmsNormKind::ZeroCentered, normed);
    if (c.is_moe()) {
      ops::MoeRouting route;
      const auto forced = router_logits ? router_logits->find(i) : std::map<int64_t, Tensor>::const_iterator();
      moe(L, normed, mixed, route, router_logits && forced != router_logits->end() ? &forced->second : nullptr);
      if (routing) (*routing)[i] = std::move(route);
    } else {
      mlp(L, normed, mixed);
    }
    ops::add(h, mixed, h);
    for (int64_t id : capture)
      if (id == i) layers[id] = h.clone();
  }
  return h;
}

}  // namespace dflash::target
