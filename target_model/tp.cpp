#include "target_model/tp.h"

#include <cstring>
#include <map>
#include <sstream>

#include "core/fp8.h"
#include "core/random.h"
#include "core/io/safetensors.h"

namespace dflash::target {

void check_tp(const TargetConfig& c, int tp) {
  DFLASH_REQUIRE(tp >= 1, "parallel.tp must be >= 1, got " << tp);
  DFLASH_REQUIRE_HINT(tp == 1 || !c.is_moe(), "parallel.tp = " << tp << ": " << c.source << " is a Mixture-of-Experts model (num_experts "
                                                            << c.num_experts << "), which runs with tp 1 only for now",
                    "set parallel.tp: 1 (tensor / expert parallelism of the MoE block is not built yet)");
  std::ostringstream bad;
  int n = 0;
  auto need = [&](const char* field, int64_t v) {
    if (v % tp != 0) bad << (n++ ? ", " : "") << field << " " << v;
  };
  need("num_attention_heads", c.num_attention_heads);
  need("linear_num_key_heads", c.linear_num_key_heads);
  need("linear_num_value_heads", c.linear_num_value_heads);
  need("intermediate_size", c.intermediate_size);
  if (c.num_key_value_heads % tp != 0 && tp % c.num_key_value_heads != 0)
    bad << (n++ ? ", " : "") << "num_key_value_heads " << c.num_key_value_heads << " (nor does it divide tp)";
  DFLASH_REQUIRE_HINT(n == 0, "parallel.tp = " << tp << " does not divide the model's " << bad.str() << " (" << c.source << ")",
                    "choose a tp that divides every head count and the intermediate size (e.g. 1, 2, 4, 8 for Qwen3.6-27B)");
}

TargetConfig local_config(const TargetConfig& c, int tp) {
  check_tp(c, tp);
  TargetConfig l = c;
  l.num_attention_heads = c.num_attention_heads / tp;
  l.num_key_value_heads = std::max<int64_t>(1, c.num_key_value_heads / tp);
  l.linear_num_key_heads = c.linear_num_key_heads / tp;
  l.linear_num_value_heads = c.linear_num_value_heads / tp;
  l.intermediate_size = c.intermediate_size / tp;
  l.source = c.source + " (tp shard 1/" + std::to_string(tp) + ")";
  l.validate();
  return l;
}

std::vector<SliceSpec> shard_specs(const TargetConfig& c, const TpShard& sh) {
  DFLASH_CHECK(sh.size >= 1 && sh.rank >= 0 && sh.rank < sh.size, "tp shard " << sh.rank << " of " << sh.size);
  const TargetConfig l = local_config(c, sh.size);
  const std::vector<TensorSpec> full = expected_tensors(c), local = expected_tensors(l);
  DFLASH_CHECK(full.size() == local.size(), "tp: tensor lists differ between the full and the local config");
  const int64_t r = sh.rank;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, d = c.head_dim;
  const int64_t Hk = c.linear_num_key_heads, Hk_l = l.linear_num_key_heads, Hv_l = l.linear_num_value_heads;
  const int64_t Hq_l = l.num_attention_heads, g = c.attn_output_gate ? 2 : 1;
  // kv heads: a contiguous share, or the one kv head this rank's query heads read (replicated).
  const int64_t Hkv_l = l.num_key_value_heads;
  const int64_t kv0 = c.num_key_value_heads >= sh.size ? r * Hkv_l : (r * c.num_key_value_heads) / sh.size;
  std::vector<SliceSpec> out;
  for (size_t i = 0; i < full.size(); ++i) {
    SliceSpec s{full[i].name, full[i].shape, local[i].shape, -1, {}};
    const std::string& n = s.name;
    auto rows = [&](std::vector<std::pair<int64_t, int64_t>> segs) { s.dim = 0; s.segments = std::move(segs); };
    auto cols = [&](int64_t start, int64_t len) { s.dim = 1; s.segments = {{start, len}}; };
    if (n.ends_with("in_proj_qkv.weight") || n.ends_with("conv1d.weight"))
      rows({{r * Hk_l * dk, Hk_l * dk}, {Hk * dk + r * Hk_l * dk, Hk_l * dk}, {2 * Hk * dk + r * Hv_l * dv, Hv_l * dv}});
    else if (n.ends_with("in_proj_z.weight")) rows({{r * Hv_l * dv, Hv_l * dv}});
    else if (n.ends_with("in_proj_b.weight") || n.ends_with("in_proj_a.weight") || n.ends_with("A_log") ||
             n.ends_with("dt_bias"))
      rows({{r * Hv_l, Hv_l}});
    else if (n.ends_with("linear_attn.out_proj.weight")) cols(r * Hv_l * dv, Hv_l * dv);
    else if (n.ends_with("self_attn.q_proj.weight")) rows({{r * Hq_l * d * g, Hq_l * d * g}});
    else if (n.ends_with("self_attn.k_proj.weight") || n.ends_with("self_attn.v_proj.weight")) rows({{kv0 * d, Hkv_l * d}});
    else if (n.ends_with("self_attn.o_proj.weight")) cols(r * Hq_l * d, Hq_l * d);
    else if (n.ends_with("mlp.gate_proj.weight") || n.ends_with("mlp.up_proj.weight"))
      rows({{r * l.intermediate_size, l.intermediate_size}});
    else if (n.ends_with("mlp.down_proj.weight")) cols(r * l.intermediate_size, l.intermediate_size);
    // everything else (embedding, norms, lm_head): replicated
    if (s.dim < 0) DFLASH_CHECK(s.full == s.local, "tp: " << n << " is replicated but its local shape differs");
    out.push_back(std::move(s));
  }
  return out;
}

Tensor extract_slice(const Tensor& full, const SliceSpec& spec) {
  DFLASH_CHECK(full.device().is_cpu() && full.is_contiguous() && full.shape() == spec.full,
               "tp: " << spec.name << ": expected a contiguous host tensor of shape " << shape_str(spec.full) << ", got "
                      << full.describe());
  if (spec.dim < 0) return full;
  Tensor out = Tensor::empty(spec.local, full.dtype());
  const size_t es = dtype_size(full.dtype());
  const char* src = static_cast<const char*>(full.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  const int64_t rows = full.shape()[0];
  const int64_t row_elems = full.numel() / std::max<int64_t>(rows, 1);  // elements per row (all trailing dims)
  if (spec.dim == 0) {
    int64_t at = 0;
    for (auto [start, len] : spec.segments) {
      DFLASH_CHECK(start >= 0 && start + len <= rows, "tp: " << spec.name << ": rows out of range");
      std::memcpy(dst + at * row_elems * es, src + start * row_elems * es, static_cast<size_t>(len * row_elems) * es);
      at += len;
    }
  } else {
    DFLASH_CHECK(full.dim() == 2 && spec.segments.size() == 1, "tp: " << spec.name << ": column slices need a matrix");
    const auto [start, len] = spec.segments[0];
    const int64_t cols = full.shape()[1];
    for (int64_t i = 0; i < rows; ++i)
      std::memcpy(dst + i * len * es, src + (i * cols + start) * es, static_cast<size_t>(len) * es);
  }
  return out;
}

namespace {
std::map<std::string, SliceSpec> specs_by_name(const TargetConfig& full, const TpShard& shard) {
  std::map<std::string, SliceSpec> m;
  for (SliceSpec& s : shard_specs(full, shard)) m.emplace(s.name, std::move(s));
  return m;
}
}  // namespace

SliceSpec scale_slice_spec(const SliceSpec& w, int tp) {
  constexpr int64_t B = fp8::kBlock;
  auto blocks = [](int64_t n) { return (n + B - 1) / B; };
  SliceSpec s{w.name + "_scale_inv", {blocks(w.full[0]), blocks(w.full[1])}, {blocks(w.local[0]), blocks(w.local[1])},
              w.dim, {}};
  if (w.dim < 0) return s;
  const int64_t extent = w.full[static_cast<size_t>(w.dim)];
  for (auto [start, len] : w.segments) {
    DFLASH_CHECK_HINT(start % B == 0 && (len % B == 0 || start + len == extent),
                      "tp = " << tp << ": the FP8 weight " << w.name << " " << shape_str(w.full) << " is cut at "
                              << (w.dim == 0 ? "rows" : "columns") << " [" << start << ", " << start + len
                              << "), which does not fall on its 128 x 128 scale blocks",
                      "use a tp whose head / intermediate slices are multiples of 128 (Qwen3.6-27B-FP8: any tp that "
                      "divides the heads), or load the bf16 checkpoint and quantize at load (precision fp8)");
    s.segments.emplace_back(start / B, blocks(len));
  }
  return s;
}

TargetWeights load_weights_tp(const TargetConfig& full, const std::string& dir, DType dtype, Device device,
                              const TpShard& shard, Precision precision) {
  if (shard.size == 1) return load_weights(full, dir, dtype, device, precision);
  // The checkpoint is validated against the full config exactly as a single rank would, then
  // each slice is copied out of the mmap'd file: only its pages are read.
  const io::SafetensorsIndex ckpt = io::open_checkpoint(dir);
  std::map<std::string, std::string> by_canonical;
  for (const std::string& n : ckpt.names())
    if (std::string c = canonical_weight_name(n); !c.empty()) by_canonical.emplace(c, n);
  for (const TensorSpec& t : expected_tensors(full)) {
    auto it = by_canonical.find(t.name);
    DFLASH_CHECK_HINT(it != by_canonical.end() && ckpt.info(it->second).shape == t.shape,
                      dir << ": tensor " << t.name << " " << shape_str(t.shape) << " is missing or mis-shaped",
                      "run once with tp = 1 (or dflash_doctor) for the full list of checkpoint problems");
    if (ckpt.info(it->second).dtype == DType::F8E4M3)
      DFLASH_CHECK_HINT(is_fp8_projection(t.name) && by_canonical.count(t.name + "_scale_inv"),
                        dir << ": " << it->second << " is e4m3 without its weight_scale_inv (or is not a projection)",
                        "run once with tp = 1 (or dflash_doctor) for the full list of checkpoint problems");
  }
  const auto specs = specs_by_name(full, shard);
  TargetWeights w = assemble_weights(
      local_config(full, shard.size), dtype, device,
      [&](const std::string& name, const Shape&) { return extract_slice(ckpt.tensor(by_canonical.at(name)), specs.at(name)); },
      [&](const std::string& name, const Shape&) {
        return extract_slice(ckpt.tensor(by_canonical.at(name + "_scale_inv")), scale_slice_spec(specs.at(name), shard.size));
      });
  apply_precision(w, precision);
  return w;
}

TargetWeights random_weights_tp(const TargetConfig& full, uint64_t seed, DType dtype, Device device,
                                const TpShard& shard, Precision precision) {
  const auto specs = specs_by_name(full, shard);
  TargetWeights w = assemble_weights(local_config(full, shard.size), dtype, device, [&](const std::string& name, const Shape& shape) {
    const SliceSpec& s = specs.at(name);
    const RandomInit init = random_init(name, s.full, full.random_branch_scale);
    if (s.dim < 0 || init.kind != RandomInit::Normal) {
      // Small tensors (norms, A_log, dt_bias) and replicated ones: the full tensor, then the slice.
      Tensor t = random_tensor(name, s.full, seed, dtype, device, full.random_branch_scale);
      if (s.dim < 0) return t;
      return extract_slice(t.device().is_cpu() ? t : t.to(Device::cpu()), s);
    }
    // Large slices are drawn in place: element (i, j) of the slice draws the index it has in the
    // full tensor, so the shard holds exactly the values of the full model.
    Tensor t = Tensor::empty(shape, dtype, device);
    const int64_t full_rows = s.full[0];
    const int64_t row_elems = shape_numel(s.full) / std::max<int64_t>(full_rows, 1);
    RandomParams rp{seed, weight_stream(name), 0, 0};
    if (s.dim == 0) {
      int64_t at = 0;
      for (auto [start, len] : s.segments) {
        Tensor part = t.slice(0, at, at + len);
        rp.index_offset = start * row_elems;
        fill_normal(part, rp, init.a, init.b);
        at += len;
      }
    } else {
      rp.index_offset = s.segments[0].first;
      rp.row_stride = s.full[1];
      fill_normal(t, rp, init.a, init.b);
    }
    return t;
  });
  apply_precision(w, precision);
  return w;
}

}  // namespace dflash::target
