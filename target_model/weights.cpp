#include "target_model/weights.h"

#include <spdlog/spdlog.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <unordered_set>

#include "kernels/random.h"
#include "kernels/rng.h"
#include "target_model/safetensors.h"

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
    f(p + "mlp.gate_proj.weight", Shape{I, H}, L.gate_proj);
    f(p + "mlp.up_proj.weight", Shape{I, H}, L.up_proj);
    f(p + "mlp.down_proj.weight", Shape{H, I}, L.down_proj);
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

}  // namespace

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
                            &L.attn.k_proj, &L.attn.v_proj, &L.attn.o_proj, &L.attn.q_norm, &L.attn.k_norm})
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

void check_loadable(const TargetConfig& c, const std::string& dir) {
  DFLASH_CHECK_HINT(!c.fp8, dir << ": a block-FP8 checkpoint (quantization_config.quant_method fp8): its config is read, "
                                   "but loading e4m3 weights is not implemented yet",
                    "use the bf16 checkpoint of the same model for now");
}

TargetWeights load_weights(const TargetConfig& c, const std::string& dir, DType dtype, Device device) {
  check_loadable(c, dir);
  SafetensorsIndex ckpt = open_checkpoint(dir);
  // canonical name -> checkpoint name
  std::map<std::string, std::string> by_canonical;
  std::vector<std::string> ignored, duplicated;
  for (const std::string& n : ckpt.names()) {
    std::string canon = canonical_weight_name(n);
    if (canon.empty()) { ignored.push_back(n); continue; }
    if (!by_canonical.emplace(canon, n).second) duplicated.push_back(n + " (same as " + by_canonical[canon] + ")");
  }
  std::ostringstream problems;
  int n_problems = 0;
  for (const std::string& d : duplicated) {
    problems << "\n  duplicate: " << d;
    ++n_problems;
  }
  std::unordered_set<std::string> used;
  for (const TensorSpec& spec : expected_tensors(c)) {
    auto it = by_canonical.find(spec.name);
    if (it == by_canonical.end()) {
      problems << "\n  missing: " << spec.name << " " << shape_str(spec.shape);
      ++n_problems;
      continue;
    }
    used.insert(spec.name);
    const Shape got = ckpt.info(it->second).shape;
    if (got != spec.shape) {
      problems << "\n  wrong shape: " << it->second << " is " << shape_str(got) << ", expected " << shape_str(spec.shape);
      ++n_problems;
    }
  }
  for (const auto& [canon, name] : by_canonical) {
    // A tied checkpoint may still carry lm_head.weight; it must then equal the embedding's shape.
    if (used.count(canon) || (c.tie_word_embeddings && canon == "lm_head.weight")) continue;
    problems << "\n  unexpected: " << name;
    ++n_problems;
  }
  DFLASH_CHECK_HINT(n_problems == 0, dir << ": the checkpoint does not match its config (" << c.source << "), "
                                         << n_problems << " problem(s):" << problems.str(),
                    "check that config.json belongs to these weights (layer_types, head counts and dims)");
  if (!ignored.empty()) spdlog::info("{}: ignoring {} tensors of the MTP head / vision tower", dir, ignored.size());

  return assemble_weights(c, dtype, device,
                          [&](const std::string& name, const Shape&) { return ckpt.tensor(by_canonical.at(name)); });
}

TargetWeights assemble_weights(const TargetConfig& c, DType dtype, Device device, const TensorMaker& make) {
  TargetWeights w;
  for_each_slot(c, w, [&](const std::string& name, const Shape& shape, Tensor& slot) {
    Tensor t = make(name, shape);
    DFLASH_CHECK(t.shape() == shape, "weights: " << name << " was made with shape " << shape_str(t.shape())
                                                 << ", expected " << shape_str(shape));
    if (t.dtype() == dtype && t.device() == device && t.is_contiguous()) {
      slot = name.ends_with("conv1d.weight") ? t.view({shape[0], shape[2]}) : t;
    } else {
      Tensor host = t.device().is_cpu() ? t : t.to(Device::cpu());
      place(slot, name, host, dtype, device);
    }
  });
  finish(c, w, dtype, device);
  return w;
}

RandomInit random_init(const std::string& name, const Shape& full_shape, double branch_scale) {
  if (name.ends_with("A_log")) return {RandomInit::LogUniform, 1.0f, 16.0f};
  if (name.ends_with("dt_bias") || name.ends_with("linear_attn.norm.weight")) return {RandomInit::Constant, 1.0f, 0};
  if (name.ends_with("norm.weight")) return {RandomInit::Constant, 0.0f, 0};
  float stddev = name == "embed_tokens.weight" ? 1.0f : 1.0f / std::sqrt(static_cast<float>(full_shape.back()));
  if (name.ends_with("o_proj.weight") || name.ends_with("out_proj.weight") || name.ends_with("down_proj.weight"))
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

TargetWeights random_weights(const TargetConfig& c, uint64_t seed, DType dtype, Device device) {
  return assemble_weights(c, dtype, device, [&](const std::string& name, const Shape& shape) {
    return random_tensor(name, shape, seed, dtype, device, c.random_branch_scale);
  });
}

void save_checkpoint(const TargetConfig& c, const TargetWeights& w, const std::string& dir, DType dtype) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  DFLASH_CHECK_IO(!ec, "creating directory", dir);
  std::vector<std::pair<std::string, Tensor>> tensors;
  TargetWeights copy = w;  // for_each_slot wants mutable slots; tensors share storage
  for_each_slot(c, copy, [&](const std::string& name, const Shape& shape, Tensor& slot) {
    Tensor host = slot.device().is_cpu() ? slot : slot.to(Device::cpu());
    tensors.emplace_back(name == "lm_head.weight" ? name : "model." + name, host.to_dtype(dtype).view(shape));
  });
  save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  std::ofstream out(cfg_path);
  DFLASH_CHECK_IO(out.good(), "writing", cfg_path);
  nlohmann::json j = c.to_json();
  j["dtype"] = dtype == DType::BF16 ? "bfloat16" : dtype == DType::F16 ? "float16" : "float32";
  out << j.dump(2) << "\n";
  DFLASH_CHECK_IO(out.good(), "writing", cfg_path);
}

}  // namespace dflash::target
