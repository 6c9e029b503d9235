#include "drafter/weights.h"

#include <filesystem>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/random.h"
#include "core/io/files.h"
#include "core/io/safetensors.h"

namespace dflash::drafter {

std::vector<DrafterWeights::Entry> DrafterWeights::entries(const DrafterConfig& c) {
  DFLASH_CHECK(static_cast<int64_t>(layers.size()) == c.num_hidden_layers,
               "drafter weights have " << layers.size() << " layers, config has " << c.num_hidden_layers);
  const int64_t H = c.hidden_size, I = c.intermediate_size, d = c.head_dim;
  std::vector<Entry> e;
  e.push_back({"fc.weight", &fc, {H, c.context_dim()}, false});
  e.push_back({"hidden_norm.weight", &hidden_norm, {H}, true});
  for (size_t i = 0; i < layers.size(); ++i) {
    LayerWeights& l = layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    e.push_back({p + "self_attn.q_proj.weight", &l.q_proj, {c.q_dim(), H}, false});
    e.push_back({p + "self_attn.k_proj.weight", &l.k_proj, {c.kv_dim(), H}, false});
    e.push_back({p + "self_attn.v_proj.weight", &l.v_proj, {c.kv_dim(), H}, false});
    e.push_back({p + "self_attn.o_proj.weight", &l.o_proj, {H, c.q_dim()}, false});
    e.push_back({p + "self_attn.q_norm.weight", &l.q_norm, {d}, true});
    e.push_back({p + "self_attn.k_norm.weight", &l.k_norm, {d}, true});
    e.push_back({p + "mlp.gate_proj.weight", &l.gate_proj, {I, H}, false});
    e.push_back({p + "mlp.up_proj.weight", &l.up_proj, {I, H}, false});
    e.push_back({p + "mlp.down_proj.weight", &l.down_proj, {H, I}, false});
    e.push_back({p + "input_layernorm.weight", &l.input_layernorm, {H}, true});
    e.push_back({p + "post_attention_layernorm.weight", &l.post_attention_layernorm, {H}, true});
  }
  e.push_back({"norm.weight", &norm, {H}, true});
  return e;
}

DrafterWeights DrafterWeights::zeros(const DrafterConfig& c, DType dtype, Device device) {
  DFLASH_CHECK(dtype_is_float(dtype), "drafter weights need a float dtype, got " << dtype_name(dtype));
  DrafterWeights w;
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (Entry& e : w.entries(c)) *e.tensor = Tensor::zeros(e.shape, dtype, device);
  return w;
}

DrafterWeights DrafterWeights::random(const DrafterConfig& c, uint64_t seed, float stddev, DType dtype, Device device) {
  DrafterWeights w = zeros(c, dtype, device);
  uint64_t stream = 0;
  for (Entry& e : w.entries(c)) {
    ++stream;  // one stream per tensor in entry order: adding a layer leaves earlier tensors unchanged
    if (e.is_norm) e.tensor->fill(1.0);
    else fill_normal(*e.tensor, {seed, stream, 0}, 0.0f, stddev);
  }
  return w;
}

void DrafterWeights::check(const DrafterConfig& c) const {
  auto& self = const_cast<DrafterWeights&>(*this);
  for (const Entry& e : self.entries(c)) {
    DFLASH_CHECK(e.tensor->defined(), "drafter weight '" << e.name << "' is not allocated");
    DFLASH_CHECK(e.tensor->shape() == e.shape, "drafter weight '" << e.name << "' has shape "
                                                                   << shape_str(e.tensor->shape()) << ", expected "
                                                                   << shape_str(e.shape));
  }
}

void export_hf(const std::string& dir, const DrafterConfig& c, const DrafterWeights& w) {
  namespace fs = std::filesystem;
  c.validate();
  w.check(c);
  std::error_code ec;
  fs::create_directories(dir, ec);
  DFLASH_CHECK(!ec, "export: cannot create directory '" << dir << "': " << ec.message());
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& e : const_cast<DrafterWeights&>(w).entries(c))
    tensors.emplace_back(e.name, e.tensor->contiguous().to_dtype(DType::BF16));
  io::save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  io::write_file_atomic((fs::path(dir) / (std::string(kHfModelingModule) + ".py")).string(), hf_modeling_source());
  // config.json last (atomically), so a directory with a config has its weights and its module.
  io::write_file_atomic((fs::path(dir) / "config.json").string(), c.to_json().dump(2) + "\n");
}

LoadedDrafter import_hf(const std::string& dir, DType dtype) {
  LoadedDrafter out;
  out.config = DrafterConfig::from_file(dir);
  const io::SafetensorsIndex ckpt = io::open_checkpoint(dir);
  out.weights = DrafterWeights::zeros(out.config, dtype);
  std::vector<std::string> missing, misshaped;
  std::set<std::string> expected;
  for (auto& e : out.weights.entries(out.config)) {
    expected.insert(e.name);
    if (!ckpt.has(e.name)) {
      missing.push_back(e.name);
      continue;
    }
    const Tensor t = ckpt.tensor(e.name);
    if (t.shape() != e.shape) {
      misshaped.push_back(e.name + " " + shape_str(t.shape()) + " (expected " + shape_str(e.shape) + ")");
      continue;
    }
    DFLASH_CHECK(dtype_is_float(t.dtype()), dir << ": tensor '" << e.name << "' has non-float dtype "
                                                << dtype_name(t.dtype()));
    *e.tensor = t.to_dtype(dtype);
  }
  std::vector<std::string> unexpected;
  for (const std::string& n : ckpt.names())
    if (!expected.count(n)) unexpected.push_back(n);
  if (!missing.empty() || !unexpected.empty() || !misshaped.empty()) {
    std::ostringstream m;
    m << dir << ": the checkpoint does not match the drafter config (" << out.config.summary() << ")";
    auto list = [&](const char* what, const std::vector<std::string>& v) {
      if (v.empty()) return;
      m << "; " << what << " (" << v.size() << "):";
      for (const std::string& s : v) m << " " << s;
    };
    list("missing", missing);
    list("unexpected", unexpected);
    list("mis-shaped", misshaped);
    DFLASH_FAIL_HINT(m.str(), "is config.json the one written with these weights?");
  }
  return out;
}

}  // namespace dflash::drafter
