#include "target_model/weights.h"
#include "target_model/tp.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <unordered_set>

#include "core/device.h"
#include "core/fp8.h"
#include "kernels/ops.h"
#include "core/random.h"
#include "core/rng.h"
#if DFLASH_WITH_CUDA
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/moe.h"
#endif
#include "core/io/safetensors.h"

namespace dflash::target {

namespace {

std::string layer_prefix(int64_t i) { return "layers." + std::to_string(i) + "."; }

// Visits every weight slot of `w` with its canonical name and expected HF shape, in file order.
template <typename F>
void for_each_slot(const TargetConfig& c, TargetWeights& w, F&& f) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  f("embed_tokens.weight", Shape{c.vocab_size, H}, w.embed_tokens);
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    LayerWeights& L = w.layers[static_cast<size_t>(i)];
    L.type = c.layer_types[static_cast<size_t>(i)];
    const std::string p = layer_prefix(i);
    f(p + "input_layernorm.weight", Shape{H}, L.input_layernorm);
    if (L.type == LayerType::LinearAttention) {
      const std::string q = p + "linear_attn.";
      const int64_t Hv = c.linear_num_value_heads;
      f(q + "in_proj_qkv.weight", Shape{c.gdn_conv_dim(), H}, L.gdn.in_proj_qkv);
      f(q + "in_proj_z.weight", Shape{c.gdn_value_dim(), H}, L.gdn.in_proj_z);
      f(q + "in_proj_b.weight", Shape{Hv, H}, L.gdn.in_proj_b);
      f(q + "in_proj_a.weight", Shape{Hv, H}, L.gdn.in_proj_a);
      f(q + "conv1d.weight", Shape{c.gdn_conv_dim(), 1, c.linear_conv_kernel_dim}, L.gdn.conv1d);
      f(q + "A_log", Shape{Hv}, L.gdn.A_log);
      f(q + "dt_bias", Shape{Hv}, L.gdn.dt_bias);
      f(q + "norm.weight", Shape{c.linear_value_head_dim}, L.gdn.norm);
      f(q + "out_proj.weight", Shape{H, c.gdn_value_dim()}, L.gdn.out_proj);
    } else {
      const std::string q = p + "self_attn.";
      const int64_t d = c.head_dim;
      f(q + "q_proj.weight", Shape{c.attn_q_proj_rows(), H}, L.attn.q_proj);
      f(q + "k_proj.weight", Shape{c.num_key_value_heads * d, H}, L.attn.k_proj);
      f(q + "v_proj.weight", Shape{c.num_key_value_heads * d, H}, L.attn.v_proj);
      f(q + "o_proj.weight", Shape{H, c.num_attention_heads * d}, L.attn.o_proj);
      f(q + "q_norm.weight", Shape{d}, L.attn.q_norm);
      f(q + "k_norm.weight", Shape{d}, L.attn.k_norm);
    }
    f(p + "post_attention_layernorm.weight", Shape{H}, L.post_attention_layernorm);
    if (c.is_moe()) {
      const int64_t E = c.num_experts, Ie = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
      f(p + "mlp.gate.weight", Shape{E, H}, L.moe.router);
      const int64_t El = c.local_num_experts();  // = E but on an expert-parallel shard
      f(p + "mlp.experts.gate_up_proj", Shape{El, 2 * Ie, H}, L.moe.experts_gate_up);
      f(p + "mlp.experts.down_proj", Shape{El, H, Ie}, L.moe.experts_down);
      f(p + "mlp.shared_expert.gate_proj.weight", Shape{Is, H}, L.moe.shared_gate_proj);
      f(p + "mlp.shared_expert.up_proj.weight", Shape{Is, H}, L.moe.shared_up_proj);
      f(p + "mlp.shared_expert.down_proj.weight", Shape{H, Is}, L.moe.shared_down_proj);
      f(p + "mlp.shared_expert_gate.weight", Shape{1, H}, L.moe.shared_expert_gate);
    } else {
      f(p + "mlp.gate_proj.weight", Shape{I, H}, L.gate_proj);
      f(p + "mlp.up_proj.weight", Shape{I, H}, L.up_proj);
      f(p + "mlp.down_proj.weight", Shape{H, I}, L.down_proj);
    }
  }
  f("norm.weight", Shape{H}, w.norm);
  if (!c.tie_word_embeddings) f("lm_head.weight", Shape{c.vocab_size, H}, w.lm_head);
}

// Stores a host tensor in the slot: converted to dtype, on device, conv weight squeezed.
void place(Tensor& slot, const std::string& name, const Tensor& host, DType dtype, Device device) {
  Tensor t = host.to_dtype(dtype);
  if (name.ends_with("conv1d.weight")) t = t.view({t.size(0), t.size(2)});
  slot = device.is_cpu() ? t : t.to(device);
}

void finish(const TargetConfig& c, TargetWeights& w, DType dtype, Device device) {
  if (c.tie_word_embeddings) w.lm_head = w.embed_tokens;
  w.dtype = dtype;
  w.device = device;
}

using fp8::blocks;

// Stores an FP8 projection from host codes and scale in the layout of weights.h.
void place_fp8(Tensor& weight, Tensor& scale, const Tensor& codes, const Tensor& scale_in, DType dtype, Device device) {
  Tensor s = scale_in.to_dtype(DType::F32).contiguous();
  if (dtype == DType::F32) {
    weight = ops::dequantize_fp8(ops::Fp8Weight{codes.contiguous(), s});
    if (!device.is_cpu()) weight = weight.to(device);
  } else {
    weight = device.is_cpu() ? codes.contiguous() : codes.contiguous().to(device);
  }
  scale = device.is_cpu() ? s : s.to(device);
}

// Quantizes one projection in place (apply_precision fp8).
void quantize_projection(Tensor& weight, Tensor& scale, DType dtype) {
  const int64_t N = weight.size(0), K = weight.size(1);
  if (weight.device().is_cpu()) {
    ops::Fp8Weight q = ops::quantize_fp8_weight(weight);
    weight = dtype == DType::F32 ? ops::dequantize_fp8(q) : q.q.to_dtype(DType::F8E4M3);
    scale = q.scale_inv;
    return;
  }
#if DFLASH_WITH_CUDA
  DFLASH_CHECK(weight.dtype() == DType::BF16 && weight.is_contiguous(),
               "fp8: quantizing on the GPU takes contiguous bf16 weights, got " << weight.describe());
  Tensor codes = Tensor::empty({N, K}, DType::F8E4M3, weight.device());
  Tensor s = Tensor::empty({blocks(N), blocks(K)}, DType::F32, weight.device());
  cuda::quantize_fp8_weight(weight.raw_data(), N, K, static_cast<uint8_t*>(codes.raw_data()), s.data<float>(), blocks(K),
                            DeviceContext::get(weight.device().index).stream());
  weight = codes;
  scale = s;
#else
  (void)N, (void)K;
  DFLASH_FAIL("fp8: " << weight.describe() << " is on a GPU, but this build has no CUDA backend");
#endif
}

// An FP8 projection back to plain `dtype` values (apply_precision bf16), through the host.
void dequantize_projection(Tensor& weight, Tensor& scale, DType dtype) {
  const Device dev = weight.device();
  Tensor s = dev.is_cpu() ? scale : scale.to(Device::cpu());
  Tensor values = dtype == DType::F32 && dev.is_cpu()
                      ? weight
                      : ops::dequantize_fp8(ops::Fp8Weight{dev.is_cpu() ? weight : weight.to(Device::cpu()), s});
  values = values.to_dtype(dtype);
  weight = dev.is_cpu() ? values : values.to(dev);
  scale = Tensor();
}

}  // namespace

bool is_fp8_projection(const std::string& n) {
  if (!n.starts_with("layers.")) return false;
  for (const char* suffix : {".linear_attn.in_proj_qkv.weight", ".linear_attn.in_proj_z.weight", ".linear_attn.out_proj.weight",
                             ".self_attn.q_proj.weight", ".self_attn.k_proj.weight", ".self_attn.v_proj.weight",
                             ".self_attn.o_proj.weight", ".mlp.gate_proj.weight", ".mlp.up_proj.weight",
                             ".mlp.down_proj.weight"})
    if (n.ends_with(suffix)) return true;
  return false;
}

void for_each_projection(TargetWeights& w, const std::function<void(const std::string&, Tensor&, Tensor&)>& f) {
  for (size_t i = 0; i < w.layers.size(); ++i) {
    LayerWeights& L = w.layers[i];
    const std::string p = layer_prefix(static_cast<int64_t>(i));
    if (L.type == LayerType::LinearAttention) {
      f(p + "linear_attn.in_proj_qkv.weight", L.gdn.in_proj_qkv, L.gdn.in_proj_qkv_scale);
      f(p + "linear_attn.in_proj_z.weight", L.gdn.in_proj_z, L.gdn.in_proj_z_scale);
      f(p + "linear_attn.out_proj.weight", L.gdn.out_proj, L.gdn.out_proj_scale);
    } else {
      f(p + "self_attn.q_proj.weight", L.attn.q_proj, L.attn.q_proj_scale);
      f(p + "self_attn.k_proj.weight", L.attn.k_proj, L.attn.k_proj_scale);
      f(p + "self_attn.v_proj.weight", L.attn.v_proj, L.attn.v_proj_scale);
      f(p + "self_attn.o_proj.weight", L.attn.o_proj, L.attn.o_proj_scale);
    }
    if (L.moe.defined()) continue;  // the MoE block's FP8 form is MoeWeights::fp8 (apply_moe_precision)
    f(p + "mlp.gate_proj.weight", L.gate_proj, L.gate_proj_scale);
    f(p + "mlp.up_proj.weight", L.up_proj, L.up_proj_scale);
    f(p + "mlp.down_proj.weight", L.down_proj, L.down_proj_scale);
  }
}

bool TargetWeights::fp8_moe() const {
  return std::any_of(layers.begin(), layers.end(), [](const LayerWeights& L) { return L.moe.fp8; });
}

namespace {
// w (host f32 [rows, cols], or [E, rows, cols] stacked in `parts` row blocks per expert) rounded to
// e4m3 block values, per matrix of `rows / parts` rows (an expert's gate and up apart).
void round_to_e4m3_blocks(Tensor& w, int64_t parts) {
  DFLASH_CHECK(w.device().is_cpu() && w.dtype() == DType::F32 && w.is_contiguous(),
               "weights: FP8 MoE weights are rounded on host f32 tensors, got " << w.describe());
  const int64_t cols = w.size(-1), rows = w.numel() / cols, per = rows / parts;
  for (int64_t m = 0; m < parts; ++m) {
    Tensor part = Tensor::from_blob(w.data<float>() + m * per * cols, {per, cols}, DType::F32);
    const Tensor d = ops::dequantize_fp8(ops::quantize_fp8_weight(part));
    std::memcpy(part.raw_data(), d.raw_data(), d.nbytes());
  }
}

// precision fp8 / bf16 on an MoE target's blocks (apply_precision).
void apply_moe_precision(TargetWeights& w, Precision precision) {
  for (LayerWeights& L : w.layers) {
    MoeWeights& m = L.moe;
    if (!m.defined()) continue;
    if (precision != Precision::Fp8) {
      m.fp8 = false;  // bf16: the weights' values stay (an FP8 checkpoint's exact e4m3 values), no activation quantization
      continue;
    }
    DFLASH_REQUIRE_HINT(w.device.is_cpu() && w.dtype == DType::F32,
                        "precision fp8: the FP8 Mixture-of-Experts block runs on the CPU reference only (the GPU's FP8 "
                        "MoE kernels are not built; " << w.device.str() << ")",
                        "run this MoE target in bf16 on GPUs (precision bf16 or auto: an FP8 checkpoint then runs on its "
                        "dequantized weights)");
    if (!m.fp8) {  // bf16 / f32 values: rounded as the official checkpoints were made
      const int64_t E = m.experts_gate_up.size(0);
      round_to_e4m3_blocks(m.experts_gate_up, 2 * E);
      round_to_e4m3_blocks(m.experts_down, E);
      for (Tensor* t : {&m.shared_gate_proj, &m.shared_up_proj, &m.shared_down_proj}) round_to_e4m3_blocks(*t, 1);
    }
    m.fp8 = true;
  }
}
}  // namespace

int64_t TargetWeights::fp8_projections() const {
  int64_t n = 0;
  for_each_projection(const_cast<TargetWeights&>(*this), [&](const std::string&, Tensor&, Tensor& s) { n += s.defined(); });
  return n;
}

void store_moe_experts_fp8(TargetWeights& w, const std::vector<MoeExpertScales>* scales) {
  DFLASH_REQUIRE_HINT(w.device.is_cuda() && w.dtype == DType::BF16,
                      "FP8 experts are a GPU storage of bf16 weights; these are " << dtype_name(w.dtype) << " on "
                                                                                   << w.device.str(),
                      "drop --fp8-experts on the CPU (the CPU reference runs its experts in f32)");
#if DFLASH_WITH_CUDA
  const auto stream = DeviceContext::get(w.device.index).stream();
  for (size_t i = 0; i < w.layers.size(); ++i) {
    MoeWeights& m = w.layers[i].moe;
    if (!m.defined() || m.experts_gate_up_scale.defined()) continue;
    const int64_t E = m.experts_gate_up.size(0), I2 = m.experts_gate_up.size(1), H = m.experts_gate_up.size(2);
    const int64_t I = I2 / 2;
    DFLASH_REQUIRE_HINT(H % 16 == 0 && I % 16 == 0, "--fp8-experts: layer " << i << "'s experts are " << I << " x " << H
                                                                             << " (this rank's share); FP8 experts need multiples of 16",
                        "run this target without --fp8-experts");
    const int64_t kbH = blocks(H), kbI = blocks(I), rbI = blocks(I), rbH = blocks(H);
    Tensor gq = Tensor::empty({E, I2, H}, DType::F8E4M3, w.device), gs = Tensor::empty({E, 2 * rbI, kbH}, DType::F32, w.device);
    Tensor dq = Tensor::empty({E, H, I}, DType::F8E4M3, w.device), ds = Tensor::empty({E, rbH, kbI}, DType::F32, w.device);
    // gate rows and up rows scaled apart; down in one part
    if (scales && !scales->empty()) {  // the checkpoint's own scales
      const MoeExpertScales& given = scales->at(i);
      DFLASH_CHECK(given.gate_up.shape() == gs.shape() && given.down.shape() == ds.shape(),
                   "FP8 experts: layer " << i << "'s checkpoint scales " << given.gate_up.describe() << " / "
                                         << given.down.describe() << " do not fit the experts " << gs.describe() << " / "
                                         << ds.describe());
      gs = given.gate_up.to(w.device);
      ds = given.down.to(w.device);
      cuda::moe_quantize_experts_scaled(m.experts_gate_up.raw_data(), E, I2, H, I, gs.data<float>(), gq.raw_data(), stream);
      cuda::moe_quantize_experts_scaled(m.experts_down.raw_data(), E, H, I, H, ds.data<float>(), dq.raw_data(), stream);
    } else {
      cuda::moe_quantize_experts(m.experts_gate_up.raw_data(), E, I2, H, I, gq.raw_data(), gs.data<float>(), stream);
      cuda::moe_quantize_experts(m.experts_down.raw_data(), E, H, I, H, dq.raw_data(), ds.data<float>(), stream);
    }
    m.experts_gate_up = gq;
    m.experts_down = dq;
    m.experts_gate_up_scale = gs;
    m.experts_down_scale = ds;
  }
  device_alloc::empty_cache(w.device.index);  // the bf16 experts went back to the cache
#endif
}

void apply_precision(TargetWeights& w, Precision precision) {
  if (precision == Precision::Auto) return;
  apply_moe_precision(w, precision);
  const bool any_fp8 = w.fp8_projections() > 0;
  if (precision == Precision::Fp8 && any_fp8) return;  // an FP8 checkpoint as stored (its bf16 projections stay)
  for_each_projection(w, [&](const std::string&, Tensor& weight, Tensor& scale) {
    if (precision == Precision::Fp8) quantize_projection(weight, scale, w.dtype);
    else if (scale.defined()) dequantize_projection(weight, scale, w.dtype);
    // The bf16 copy just freed goes back to the device now: left in the cache, the next projection's codes
    // (half its size when the shapes repeat) would take that block, which the caching allocator serves up to
    // twice a request, and keep it for the model's life (a suspect of the 27B FP8 recipe's memory holding
    // ~8 GiB more than its plan after loading).
    if (!w.device.is_cpu()) device_alloc::empty_cache(w.device.index);
  });
}

uint64_t weight_stream(const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return rng::mix64(h);
}

size_t TargetWeights::bytes() const {
  std::set<const void*> seen;
  size_t total = 0;
  auto add = [&](const Tensor& t) {
    if (t.defined() && seen.insert(t.raw_data()).second) total += t.nbytes();
  };
  add(embed_tokens);
  add(norm);
  add(lm_head);
  for (const LayerWeights& L : layers) {
    for (const Tensor* t : {&L.input_layernorm, &L.post_attention_layernorm, &L.gate_proj, &L.up_proj, &L.down_proj,
                            &L.gdn.in_proj_qkv, &L.gdn.in_proj_z, &L.gdn.in_proj_b, &L.gdn.in_proj_a, &L.gdn.conv1d,
                            &L.gdn.A_log, &L.gdn.dt_bias, &L.gdn.norm, &L.gdn.out_proj, &L.attn.q_proj,
                            &L.attn.k_proj, &L.attn.v_proj, &L.attn.o_proj, &L.attn.q_norm, &L.attn.k_norm,
                            &L.gdn.in_proj_qkv_scale, &L.gdn.in_proj_z_scale, &L.gdn.out_proj_scale, &L.attn.q_proj_scale,
                            &L.attn.k_proj_scale, &L.attn.v_proj_scale, &L.attn.o_proj_scale, &L.gate_proj_scale,
                            &L.up_proj_scale, &L.down_proj_scale, &L.moe.router, &L.moe.experts_gate_up,
                            &L.moe.experts_down, &L.moe.shared_gate_proj, &L.moe.shared_up_proj,
                            &L.moe.shared_down_proj, &L.moe.shared_expert_gate, &L.moe.experts_gate_up_scale,
                            &L.moe.experts_down_scale})
      add(*t);
  }
  return total;
}

std::vector<TensorSpec> expected_tensors(const TargetConfig& c) {
  std::vector<TensorSpec> specs;
  TargetWeights scratch;
  for_each_slot(c, scratch, [&](const std::string& name, const Shape& shape, Tensor&) { specs.push_back({name, shape}); });
  return specs;
}

bool parse_per_expert_name(const std::string& n, PerExpertName& out) {
  // layers.<L>.mlp.experts.<N>.<gate|up|down>_proj.weight
  auto number = [&](size_t& pos, int64_t& v) {
    const size_t start = pos;
    v = 0;
    while (pos < n.size() && n[pos] >= '0' && n[pos] <= '9' && pos - start < 12) v = v * 10 + (n[pos++] - '0');
    return pos > start && (pos - start == 1 || n[start] != '0');
  };
  auto literal = [&](size_t& pos, const char* lit) {
    const std::string_view l(lit);
    if (n.compare(pos, l.size(), l) != 0) return false;
    pos += l.size();
    return true;
  };
  size_t pos = 0;
  PerExpertName r;
  if (!literal(pos, "layers.") || !number(pos, r.layer) || !literal(pos, ".mlp.experts.") || !number(pos, r.expert) ||
      !literal(pos, "."))
    return false;
  for (const char* proj : {"gate", "up", "down"}) {
    size_t q = pos;
    if (literal(q, proj) && literal(q, "_proj.weight") && q == n.size()) {
      r.proj = proj;
      out = r;
      return true;
    }
  }
  return false;
}

std::string canonical_weight_name(const std::string& n) {
  auto starts = [&](const char* p) { return n.rfind(p, 0) == 0; };
  if (starts("mtp.") || starts("model.mtp.") || starts("model.visual.") || starts("visual.") ||
      starts("model.vision_tower.") || n.find(".visual.") != std::string::npos)
    return {};
  if (starts("model.language_model.")) return n.substr(std::string("model.language_model.").size());
  if (starts("language_model.model.")) return n.substr(std::string("language_model.model.").size());
  if (starts("language_model.lm_head.")) return n.substr(std::string("language_model.").size());
  if (starts("model.")) return n.substr(std::string("model.").size());
  return n;
}

namespace {

// Whether quantization_config.modules_to_not_convert names the module of checkpoint weight `name`
// (an entry names the module, a dotted suffix of it, or a parent module).
bool not_converted(const TargetConfig& c, const std::string& name) {
  if (!c.fp8) return false;
  const std::string module = name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
  for (const std::string& e : c.fp8->modules_to_not_convert) {
    if (e.empty()) continue;
    if (module == e || module.ends_with("." + e) || module.starts_with(e + ".") ||
        module.find("." + e + ".") != std::string::npos)
      return true;
  }
  return false;
}

std::string scale_name(const std::string& weight_name) { return weight_name + "_scale_inv"; }

// One fused expert tensor of `shape` [E, rows, cols] from per-expert pieces (checkpoint names, in
// order; each [rows / pieces-per-expert, cols]) stacked along the first two dims, as f32.
// e4m3 pieces (an FP8 MoE checkpoint) are dequantized with their block scales.
Tensor stack_experts(const io::SafetensorsIndex& ckpt, const std::vector<std::string>& pieces, const Shape& shape) {
  Tensor out = Tensor::empty(shape, DType::F32);
  const int64_t per = out.numel() / static_cast<int64_t>(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Tensor t = read_dequantized(ckpt, pieces[i]).to_dtype(DType::F32).contiguous();
    DFLASH_CHECK(t.numel() == per, "weights: " << pieces[i] << " has " << t.numel() << " elements, expected " << per);
    std::memcpy(out.data<float>() + static_cast<int64_t>(i) * per, t.data<float>(), static_cast<size_t>(per) * sizeof(float));
  }
  return out;
}

}  // namespace

bool is_fp8_moe_weight(const std::string& n) {
  for (const char* suffix : {".mlp.shared_expert.gate_proj.weight", ".mlp.shared_expert.up_proj.weight",
                             ".mlp.shared_expert.down_proj.weight"})
    if (n.ends_with(suffix)) return true;
  return false;
}

Precision moe_fp8_precision(const TargetConfig& c, bool fp8_checkpoint, Precision requested, const std::string& dir) {
  if (!c.is_moe() || !fp8_checkpoint || requested != Precision::Auto) return requested;
  spdlog::warn("{}: an FP8 Mixture-of-Experts checkpoint runs in bf16 here: its e4m3 experts, shared experts and "
               "projections are dequantized at load (exact values); precision fp8 runs them W8A8 on the CPU reference only",
               dir);
  return Precision::Bf16;
}

void mark_fp8_moe_layers(TargetWeights& w, const TargetConfig& full, const io::SafetensorsIndex& ckpt) {
  if (!full.is_moe()) return;
  std::unordered_set<std::string> e4m3;  // canonical names of the e4m3 tensors
  for (const std::string& n : ckpt.names())
    if (ckpt.info(n).dtype == DType::F8E4M3) e4m3.insert(canonical_weight_name(n));
  if (e4m3.empty()) return;
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const std::string p = layer_prefix(static_cast<int64_t>(i)) + "mlp.";
    bool all = w.layers[i].moe.defined();
    for (const char* proj : {"gate", "up", "down"}) {
      all = all && e4m3.count(p + "shared_expert." + proj + "_proj.weight");
      for (int64_t e = 0; all && e < full.num_experts; ++e)
        all = e4m3.count(p + "experts." + std::to_string(e) + "." + proj + "_proj.weight") > 0;
    }
    w.layers[i].moe.fp8 = all;
  }
}

Tensor read_dequantized(const io::SafetensorsIndex& ckpt, const std::string& name) {
  Tensor t = ckpt.tensor(name);
  if (t.dtype() != DType::F8E4M3) return t;
  const std::string s = scale_name(name);
  DFLASH_CHECK(ckpt.has(s), "weights: " << name << " is e4m3 without its block scales " << s);
  return ops::dequantize_fp8(ops::Fp8Weight{t.contiguous(), ckpt.tensor(s).to_dtype(DType::F32).contiguous()});
}

TargetWeights load_weights(const TargetConfig& c, const std::string& dir, DType dtype, Device device, Precision precision) {
  io::SafetensorsIndex ckpt = io::open_checkpoint(dir);
  // canonical name -> checkpoint name; the FP8 scales apart: canonical weight name -> scale name
  std::map<std::string, std::string> by_canonical, scales;
  std::vector<std::string> ignored, duplicated;
  // Per-expert tensors: layer -> (expert, "gate" / "up" / "down") -> checkpoint name.
  std::map<int64_t, std::map<std::pair<int64_t, std::string>, std::string>> per_expert;
  for (const std::string& n : ckpt.names()) {
    std::string canon = canonical_weight_name(n);
    if (canon.empty()) { ignored.push_back(n); continue; }
    if (PerExpertName pe; parse_per_expert_name(canon, pe)) {
      if (!per_expert[pe.layer].emplace(std::make_pair(pe.expert, pe.proj), n).second) duplicated.push_back(n);
      continue;
    }
    if (canon.ends_with(".weight_scale_inv")) {
      scales.emplace(canon.substr(0, canon.size() - std::string("_scale_inv").size()), n);
      continue;
    }
    if (!by_canonical.emplace(canon, n).second) duplicated.push_back(n + " (same as " + by_canonical[canon] + ")");
  }
  std::ostringstream problems;
  int n_problems = 0;
  auto problem = [&](const std::string& what) {
    problems << "\n  " << what;
    ++n_problems;
  };
  for (const std::string& d : duplicated) problem("duplicate: " + d);
  // The block scales of the e4m3 weight `weight` (checkpoint name; canonical `canon`, HF shape `shape`):
  // present, one per 128 x 128 block, F32 or BF16. False (the problems noted) otherwise.
  auto check_scales = [&](const std::string& canon, const std::string& weight, const Shape& shape) {
    const Shape want{blocks(shape[0]), blocks(shape[1])};
    const auto sc = scales.find(canon);
    if (sc == scales.end()) {
      problem("missing: " + scale_name(canon) + " " + shape_str(want) + " (the block scales of the e4m3 " + weight + ")");
      return false;
    }
    const io::TensorInfo& si = ckpt.info(sc->second);
    bool ok = true;
    if (si.shape != want) {
      problem("wrong shape: " + sc->second + " is " + shape_str(si.shape) + ", expected " + shape_str(want) +
              " (one scale per 128 x 128 block of " + shape_str(shape) + ")");
      ok = false;
    }
    if (si.dtype != DType::F32 && si.dtype != DType::BF16) {
      problem(sc->second + " is " + dtype_name(si.dtype) + "; block scales are F32 (or BF16)");
      ok = false;
    }
    return ok;
  };
  // A layer's experts stored one tensor per expert become the fused tensors of expected_tensors.
  std::map<std::string, std::vector<std::string>> stacked;  // fused canonical name -> pieces in order
  std::set<std::string> per_expert_layout;                  // fused names a layer's per-expert tensors stand for
  std::set<std::string> expert_scales;                      // per-expert weights whose scales were seen
  int64_t n_fp8 = 0;
  for (const auto& [layer, entries] : per_expert) {
    const std::string fused = layer_prefix(layer) + "mlp.experts.";
    if (!c.is_moe() || layer >= c.num_hidden_layers) {
      for (const auto& [key, name] : entries) problem("unexpected: " + name);
      continue;
    }
    per_expert_layout.insert({fused + "gate_up_proj", fused + "down_proj"});
    if (by_canonical.count(fused + "gate_up_proj") || by_canonical.count(fused + "down_proj")) {
      problem("layer " + std::to_string(layer) + " stores its experts both fused (" + fused + "gate_up_proj / down_proj) and " +
              "one tensor per expert (" + entries.begin()->second + ", ...)");
      continue;
    }
    const int64_t E = c.num_experts, Ie = c.moe_intermediate_size, H = c.hidden_size;
    bool complete = true;
    for (const auto& [key, name] : entries)
      if (key.first >= E) {
        problem("unexpected: " + name + " (expert " + std::to_string(key.first) + ", but num_experts is " + std::to_string(E) + ")");
        complete = false;
      }
    std::vector<std::string> gate_up, down;
    for (int64_t e = 0; e < E; ++e)
      for (const char* proj : {"gate", "up", "down"}) {
        const std::string want = fused + std::to_string(e) + "." + proj + "_proj.weight";
        const Shape shape = std::string(proj) == "down" ? Shape{H, Ie} : Shape{Ie, H};
        const auto it = entries.find({e, proj});
        if (it == entries.end()) {
          problem("missing: " + want + " " + shape_str(shape) + " (the other experts of layer " + std::to_string(layer) +
                  " are stored one tensor per expert)");
          complete = false;
          continue;
        }
        const io::TensorInfo& info = ckpt.info(it->second);
        if (info.shape != shape) {
          problem("wrong shape: " + it->second + " is " + shape_str(info.shape) + ", expected " + shape_str(shape));
          complete = false;
        }
        const auto sc = scales.find(want);
        if (sc != scales.end()) expert_scales.insert(want);
        if (info.dtype == DType::F8E4M3) {  // an FP8 MoE checkpoint: dequantized when stacked
          ++n_fp8;
          complete = check_scales(want, it->second, shape) && complete;
        } else if (sc != scales.end()) {
          problem("unexpected: " + sc->second + " (its weight is " + dtype_name(info.dtype) + ", not e4m3)");
        }
        (std::string(proj) == "down" ? down : gate_up).push_back(it->second);
      }
    if (complete) {
      stacked[fused + "gate_up_proj"] = std::move(gate_up);  // per expert [gate | up], as transformers fuses them
      stacked[fused + "down_proj"] = std::move(down);
    }
  }
  std::unordered_set<std::string> used;
  for (const TensorSpec& spec : expected_tensors(c)) {
    if (per_expert_layout.count(spec.name)) continue;  // checked above
    auto it = by_canonical.find(spec.name);
    if (it == by_canonical.end()) {
      problem("missing: " + spec.name + " " + shape_str(spec.shape));
      continue;
    }
    used.insert(spec.name);
    const io::TensorInfo& info = ckpt.info(it->second);
    if (info.shape != spec.shape)
      problem("wrong shape: " + it->second + " is " + shape_str(info.shape) + ", expected " + shape_str(spec.shape));
    const auto sc = scales.find(spec.name);
    if (info.dtype != DType::F8E4M3) {
      if (sc != scales.end()) problem("unexpected: " + sc->second + " (its weight is " + dtype_name(info.dtype) + ", not e4m3)");
      continue;
    }
    ++n_fp8;
    if (!is_fp8_projection(spec.name) && !is_fp8_moe_weight(spec.name)) {
      problem(it->second + " is stored as F8_E4M3, but only the large projections run in FP8 here (in_proj_qkv, in_proj_z, "
              "out_proj, q/k/v/o_proj, gate/up/down_proj; an MoE checkpoint's experts and shared expert are dequantized)");
      continue;
    }
    if (not_converted(c, it->second))
      problem(it->second + " is stored as F8_E4M3, but quantization_config.modules_to_not_convert lists it");
    check_scales(spec.name, it->second, spec.shape);
  }
  for (const auto& [canon, name] : by_canonical) {
    // A tied checkpoint may still carry lm_head.weight; it must then equal the embedding's shape.
    if (used.count(canon) || (c.tie_word_embeddings && canon == "lm_head.weight")) continue;
    problem("unexpected: " + name);
  }
  for (const auto& [weight, name] : scales)
    if (!by_canonical.count(weight) && !expert_scales.count(weight)) problem("unexpected: " + name + " (no weight " + weight + ")");
  if (n_fp8 > 0 && !c.fp8)
    problem(std::to_string(n_fp8) + " tensors are F8_E4M3, but config.json has no quantization_config (quant_method fp8)");
  if (n_fp8 == 0 && c.fp8) problem("config.json has a quantization_config (quant_method fp8), but no tensor is F8_E4M3");
  DFLASH_REQUIRE_HINT(n_problems == 0, dir << ": the checkpoint does not match its config (" << c.source << "), "
                                         << n_problems << " problem(s):" << problems.str(),
                    "check that config.json belongs to these weights (layer_types, head counts and dims; an FP8 "
                    "checkpoint's weight_scale_inv tensors and quantization_config)");
  if (!ignored.empty()) spdlog::info("{}: ignoring {} tensors of the MTP head / vision tower", dir, ignored.size());

  TargetWeights w = assemble_weights(
      c, dtype, device,
      [&](const std::string& name, const Shape& shape) {
        const auto st = stacked.find(name);
        if (st != stacked.end()) return stack_experts(ckpt, st->second, shape);
        return is_fp8_moe_weight(name) ? read_dequantized(ckpt, by_canonical.at(name)) : ckpt.tensor(by_canonical.at(name));
      },
      [&](const std::string& name, const Shape&) { return ckpt.tensor(scales.at(name)); });
  mark_fp8_moe_layers(w, c, ckpt);
  apply_precision(w, moe_fp8_precision(c, n_fp8 > 0, precision, dir));
  return w;
}

TargetWeights assemble_weights(const TargetConfig& c, DType dtype, Device device, const TensorMaker& make,
                               const TensorMaker& make_scale) {
  TargetWeights w;
  std::map<std::string, std::pair<Tensor, Tensor>> fp8;  // name -> host codes, scale
  for_each_slot(c, w, [&](const std::string& name, const Shape& shape, Tensor& slot) {
    Tensor t = make(name, shape);
    DFLASH_CHECK(t.shape() == shape, "weights: " << name << " was made with shape " << shape_str(t.shape())
                                                 << ", expected " << shape_str(shape));
    if (t.dtype() == DType::F8E4M3) {
      DFLASH_CHECK(is_fp8_projection(name) && make_scale, "weights: " << name << " is e4m3 without block scales");
      const Shape ss{blocks(shape[0]), blocks(shape[1])};
      Tensor s = make_scale(name, ss);
      DFLASH_CHECK(s.shape() == ss, "weights: the scales of " << name << " have shape " << shape_str(s.shape())
                                                              << ", expected " << shape_str(ss));
      fp8.emplace(name, std::make_pair(t.device().is_cpu() ? t : t.to(Device::cpu()), s.device().is_cpu() ? s : s.to(Device::cpu())));
      return;
    }
    if (t.dtype() == dtype && t.device() == device && t.is_contiguous()) {
      slot = name.ends_with("conv1d.weight") ? t.view({shape[0], shape[2]}) : t;
    } else {
      Tensor host = t.device().is_cpu() ? t : t.to(Device::cpu());
      place(slot, name, host, dtype, device);
    }
  });
  if (!fp8.empty())
    for_each_projection(w, [&](const std::string& name, Tensor& weight, Tensor& scale) {
      auto it = fp8.find(name);
      if (it != fp8.end()) place_fp8(weight, scale, it->second.first, it->second.second, dtype, device);
    });
  finish(c, w, dtype, device);
  return w;
}

RandomInit random_init(const std::string& name, const Shape& full_shape, double branch_scale) {
  if (name.ends_with("A_log")) return {RandomInit::LogUniform, 1.0f, 16.0f};
  if (name.ends_with("dt_bias") || name.ends_with("linear_attn.norm.weight")) return {RandomInit::Constant, 1.0f, 0};
  if (name.ends_with("norm.weight")) return {RandomInit::Constant, 0.0f, 0};
  float stddev = name == "embed_tokens.weight" ? 1.0f : 1.0f / std::sqrt(static_cast<float>(full_shape.back()));
  if (name.ends_with("o_proj.weight") || name.ends_with("out_proj.weight") || name.ends_with("down_proj.weight") ||
      name.ends_with("experts.down_proj"))
    stddev *= static_cast<float>(branch_scale);
  return {RandomInit::Normal, 0.0f, stddev};
}

Tensor random_tensor(const std::string& name, const Shape& shape, uint64_t seed, DType dtype, Device device,
                     double branch_scale) {
  const RandomInit init = random_init(name, shape, branch_scale);
  const RandomParams rp{seed, weight_stream(name), 0};
  if (init.kind == RandomInit::Normal) {
    // Drawn in place (on the GPU for a CUDA target: a 27B model never exists in f32 on the host).
    Tensor t = Tensor::empty(shape, dtype, device);
    fill_normal(t, rp, init.a, init.b);
    return t;
  }
  Tensor host = Tensor::empty(shape, DType::F32);
  if (init.kind == RandomInit::LogUniform) {
    fill_uniform(host, rp, init.a, init.b);
    for (int64_t i = 0; i < host.numel(); ++i) host.data<float>()[i] = std::log(host.data<float>()[i]);
  } else {
    host.fill(init.a);
  }
  return host;
}

TargetWeights random_weights(const TargetConfig& c, uint64_t seed, DType dtype, Device device, Precision precision) {
  TargetWeights w = assemble_weights(c, dtype, device, [&](const std::string& name, const Shape& shape) {
    return random_tensor(name, shape, seed, dtype, device, c.random_branch_scale);
  });
  apply_precision(w, precision);
  return w;
}

void save_checkpoint(const TargetConfig& c, const TargetWeights& w, const std::string& dir, DType dtype) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  DFLASH_CHECK_IO(!ec, "creating directory", dir);
  std::vector<std::pair<std::string, Tensor>> tensors;
  TargetWeights copy = w;  // the visitors want mutable slots; tensors share storage
  std::map<std::string, std::pair<Tensor, Tensor>> fp8;  // FP8 projections: host codes, scale
  for_each_projection(copy, [&](const std::string& name, Tensor& weight, Tensor& scale) {
    if (!scale.defined()) return;
    Tensor s = scale.device().is_cpu() ? scale : scale.to(Device::cpu());
    Tensor v = weight.device().is_cpu() ? weight : weight.to(Device::cpu());
    if (v.dtype() != DType::F8E4M3) {  // the CPU layout holds code * scale: recover the codes
      const Tensor f = v.to_dtype(DType::F32).contiguous();
      const int64_t N = f.size(0), K = f.size(1);
      v = Tensor::empty({N, K}, DType::F8E4M3);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k)
          static_cast<uint8_t*>(v.raw_data())[n * K + k] = fp8::e4m3_from_float(
              f.data<float>()[n * K + k] / s.data<float>()[(n / fp8::kBlock) * blocks(K) + k / fp8::kBlock]);
    }
    fp8.emplace(name, std::make_pair(v, s));
  });
  for_each_slot(c, copy, [&](const std::string& name, const Shape& shape, Tensor& slot) {
    const std::string out = name == "lm_head.weight" ? name : "model." + name;
    if (auto it = fp8.find(name); it != fp8.end()) {
      tensors.emplace_back(out, it->second.first);
      tensors.emplace_back(scale_name(out), it->second.second);
      return;
    }
    Tensor host = slot.device().is_cpu() ? slot : slot.to(Device::cpu());
    tensors.emplace_back(out, host.to_dtype(dtype).view(shape));
  });
  io::save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  std::ofstream out(cfg_path);
  DFLASH_CHECK_IO(out.good(), "writing", cfg_path);
  nlohmann::json j = c.to_json();
  j["dtype"] = dtype == DType::BF16 ? "bfloat16" : dtype == DType::F16 ? "float16" : "float32";
  j.erase("quantization_config");
  if (!fp8.empty()) {
    // The official block-FP8 layout; the projections left in bf16 are named.
    nlohmann::json keep = nlohmann::json::array();
    for_each_projection(copy, [&](const std::string& name, Tensor&, Tensor& scale) {
      if (!scale.defined()) keep.push_back("model." + name.substr(0, name.size() - 7));
    });
    for (const char* m : {"lm_head", "model.embed_tokens"}) keep.push_back(m);
    j["quantization_config"] = {{"quant_method", "fp8"},
                                {"fmt", "e4m3"},
                                {"activation_scheme", "dynamic"},
                                {"weight_block_size", {fp8::kBlock, fp8::kBlock}},
                                {"modules_to_not_convert", keep}};
  }
  out << j.dump(2) << "\n";
  DFLASH_CHECK_IO(out.good(), "writing", cfg_path);
}

}  // namespace dflash::target
