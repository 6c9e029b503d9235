#include "target_model/tp.h"

#include <cstring>
#include <map>
#include <sstream>

#include "core/fp8.h"
#include "core/random.h"
#include "core/io/safetensors.h"

namespace dflash::target {

void check_tp(const TargetConfig& c, int tp, int ep) {
  DFLASH_REQUIRE(tp >= 1, "parallel.tp must be >= 1, got " << tp);
  check_ep(c, tp, ep);
  std::ostringstream bad;
  int n = 0;
  auto need = [&](const char* field, int64_t v, int64_t by) {
    if (v % by != 0) bad << (n++ ? ", " : "") << field << " " << v;
  };
  need("num_attention_heads", c.num_attention_heads, tp);
  need("linear_num_key_heads", c.linear_num_key_heads, tp);
  need("linear_num_value_heads", c.linear_num_value_heads, tp);
  if (c.is_moe()) {
    // Each expert is split over the tp / ep ranks of its expert group, the shared expert over all tp.
    need("moe_intermediate_size", c.moe_intermediate_size, tp / ep);
    need("shared_expert_intermediate_size", c.shared_expert_intermediate_size, tp);
  } else {
    need("intermediate_size", c.intermediate_size, tp);
  }
  if (c.num_key_value_heads % tp != 0 && tp % c.num_key_value_heads != 0)
    bad << (n++ ? ", " : "") << "num_key_value_heads " << c.num_key_value_heads << " (nor does it divide tp)";
  DFLASH_REQUIRE_HINT(n == 0, "parallel.tp = " << tp << (ep > 1 ? " (ep " + std::to_string(ep) + ")" : std::string())
                                               << " does not divide the model's " << bad.str() << " (" << c.source << ")",
                    (c.is_moe() ? "choose a tp that divides every head count and shared_expert_intermediate_size, with tp / ep "
                                 "dividing moe_intermediate_size (e.g. tp 1, 2, 4 or 8 with any ep dividing tp for "
                                 "Qwen3.6-35B-A3B)"
                               : "choose a tp that divides every head count and the intermediate size (e.g. 1, 2, 4, 8 "
                                 "for Qwen3.6-27B)"));
}

void check_ep(const TargetConfig& c, int tp, int ep) {
  DFLASH_REQUIRE_HINT(ep >= 1, "parallel.ep must be >= 1, got " << ep, "set parallel.ep: 1 (no expert parallelism) or a divisor of parallel.tp");
  if (ep == 1) return;
  DFLASH_REQUIRE_HINT(c.is_moe(), "parallel.ep = " << ep << ": " << c.source << " is a dense model (no experts to split)",
                      "set parallel.ep: 1 (expert parallelism is for Mixture-of-Experts targets)");
  DFLASH_REQUIRE_HINT(tp % ep == 0, "parallel.ep = " << ep << " does not divide parallel.tp = " << tp
                                                     << ": the experts are split over the ranks of a TP group (ep groups of tp / ep ranks)",
                      "choose ep among the divisors of tp (e.g. tp " << tp << ", ep " << tp << ": each rank holds whole experts)");
  DFLASH_REQUIRE_HINT(c.num_experts % ep == 0, "parallel.ep = " << ep << " does not divide the model's num_experts "
                                                                << c.num_experts << " (" << c.source << ")",
                      "choose an ep that divides num_experts (e.g. 2, 4, 8 for 256 experts)");
}

TargetConfig local_config(const TargetConfig& c, int tp, int ep) {
  check_tp(c, tp, ep);
  TargetConfig l = c;
  l.num_attention_heads = c.num_attention_heads / tp;
  l.num_key_value_heads = std::max<int64_t>(1, c.num_key_value_heads / tp);
  l.linear_num_key_heads = c.linear_num_key_heads / tp;
  l.linear_num_value_heads = c.linear_num_value_heads / tp;
  l.intermediate_size = c.intermediate_size / tp;
  if (c.is_moe()) {
    l.moe_intermediate_size = c.moe_intermediate_size / (tp / ep);
    l.shared_expert_intermediate_size = c.shared_expert_intermediate_size / tp;
    l.ep_size = ep;
  }
  l.source = c.source + " (tp shard 1/" + std::to_string(tp) + (ep > 1 ? ", ep " + std::to_string(ep) : std::string()) + ")";
  l.validate();
  return l;
}

std::vector<SliceSpec> shard_specs(const TargetConfig& c, const TpShard& sh) {
  DFLASH_CHECK(sh.size >= 1 && sh.rank >= 0 && sh.rank < sh.size, "tp shard " << sh.rank << " of " << sh.size);
  const TargetConfig l = local_config(c, sh.size, sh.ep);
  const std::vector<TensorSpec> full = expected_tensors(c), local = expected_tensors(l);
  DFLASH_CHECK(full.size() == local.size(), "tp: tensor lists differ between the full and the local config");
  const int64_t r = sh.rank;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, d = c.head_dim;
  const int64_t Hk = c.linear_num_key_heads, Hk_l = l.linear_num_key_heads, Hv_l = l.linear_num_value_heads;
  const int64_t Hq_l = l.num_attention_heads, g = c.attn_output_gate ? 2 : 1;
  // kv heads: a contiguous share, or the one kv head this rank's query heads read (replicated).
  const int64_t Hkv_l = l.num_key_value_heads;
  const int64_t kv0 = c.num_key_value_heads >= sh.size ? r * Hkv_l : (r * c.num_key_value_heads) / sh.size;
  // MoE: expert group eg = r / (tp / ep) holds experts [eg·El, (eg+1)·El); rank er of the group's
  // tp / ep ranks holds columns [er·Ie_l, ...) of each of them.
  const int64_t eg = sh.expert_group(), er = sh.expert_rank();
  const int64_t El = l.local_num_experts(), Ie_l = l.moe_intermediate_size, Is_l = l.shared_expert_intermediate_size;
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
    else if (n.ends_with("mlp.shared_expert.gate_proj.weight") || n.ends_with("mlp.shared_expert.up_proj.weight"))
      rows({{r * Is_l, Is_l}});
    else if (n.ends_with("mlp.shared_expert.down_proj.weight")) cols(r * Is_l, Is_l);
    else if (n.ends_with("mlp.experts.gate_up_proj")) {
      // [E, 2·Ie, H]: the rank's expert group, and within each expert its share of the gate and up rows.
      s.dim = 1;
      s.segments = {{er * Ie_l, Ie_l}, {c.moe_intermediate_size + er * Ie_l, Ie_l}};
      s.experts = {eg * El, El};
    } else if (n.ends_with("mlp.experts.down_proj")) {  // [E, H, Ie]: the same experts, their columns
      s.dim = 2;
      s.segments = {{er * Ie_l, Ie_l}};
      s.experts = {eg * El, El};
    }
    // everything else (embedding, norms, router, shared expert gate, lm_head): replicated
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
  // The tensor as [outer, extent, inner] around dim; the segments cut `extent`, the expert range
  // (dim >= 1 only) cuts the leading dim and with it `outer`.
  const int d = spec.dim;
  DFLASH_CHECK(d < full.dim() && (d >= 1 || spec.experts.second < 0), "tp: " << spec.name << ": bad slice dim " << d);
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < d; ++i) outer *= full.shape()[static_cast<size_t>(i)];
  for (int i = d + 1; i < full.dim(); ++i) inner *= full.shape()[static_cast<size_t>(i)];
  const int64_t extent = full.shape()[static_cast<size_t>(d)];
  int64_t o0 = 0, o1 = outer;
  if (spec.experts.second >= 0) {
    const int64_t lead = full.shape()[0], per = outer / lead;
    DFLASH_CHECK(spec.experts.first >= 0 && spec.experts.first + spec.experts.second <= lead,
                 "tp: " << spec.name << ": experts out of range");
    o0 = spec.experts.first * per;
    o1 = (spec.experts.first + spec.experts.second) * per;
  }
  for (auto [start, len] : spec.segments)
    DFLASH_CHECK(start >= 0 && len >= 0 && start + len <= extent, "tp: " << spec.name << ": slice out of range");
  Tensor out = Tensor::empty(spec.local, full.dtype());
  const size_t es = dtype_size(full.dtype());
  const char* src = static_cast<const char*>(full.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  size_t at = 0;
  for (int64_t o = o0; o < o1; ++o)
    for (auto [start, len] : spec.segments) {
      const size_t n = static_cast<size_t>(len * inner) * es;
      std::memcpy(dst + at, src + static_cast<size_t>((o * extent + start) * inner) * es, n);
      at += n;
    }
  DFLASH_CHECK(at == static_cast<size_t>(out.numel()) * es, "tp: " << spec.name << ": the slice does not fill " << shape_str(spec.local));
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
  using fp8::blocks;
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

namespace {
// One expert-parallel slice of a fused expert tensor (gate_up_proj / down_proj) from a checkpoint
// that stores one tensor per expert (mlp.experts.N.{gate,up,down}_proj.weight, what transformers
// 5.17's save_pretrained writes): only the held experts' tensors are read (e4m3 ones dequantized).
Tensor slice_from_per_expert(const io::SafetensorsIndex& ckpt, const std::map<std::pair<int64_t, std::string>, std::string>& pieces,
                             const SliceSpec& spec) {
  const bool down = spec.name.ends_with("down_proj");
  const int64_t E_l = spec.local[0];
  const Shape one{spec.full[1], spec.full[2]};  // one expert's fused tensor: [2·Ie, H] or [H, Ie]
  SliceSpec per{spec.name, one, {spec.local[1], spec.local[2]}, spec.dim - 1, spec.segments, {0, -1}};
  Tensor out;
  for (int64_t j = 0; j < E_l; ++j) {
    const int64_t e = spec.experts.first + j;
    Tensor fused;
    if (down) {
      fused = read_dequantized(ckpt, pieces.at({e, "down"})).contiguous();
    } else {
      const Tensor g = read_dequantized(ckpt, pieces.at({e, "gate"})), u = read_dequantized(ckpt, pieces.at({e, "up"}));
      DFLASH_CHECK(g.dtype() == u.dtype(), "tp: the gate and up tensors of expert " << e << " (" << spec.name << ") differ in dtype");
      fused = Tensor::empty(one, g.dtype());
      const size_t half = static_cast<size_t>(g.numel()) * dtype_size(g.dtype());
      std::memcpy(fused.raw_data(), g.contiguous().raw_data(), half);
      std::memcpy(static_cast<char*>(fused.raw_data()) + half, u.contiguous().raw_data(), half);
    }
    const Tensor part = extract_slice(fused, per);
    if (!out.defined()) out = Tensor::empty(spec.local, part.dtype());
    DFLASH_CHECK(part.dtype() == out.dtype(), "tp: the experts of " << spec.name << " are stored in different dtypes");
    const size_t n = static_cast<size_t>(part.numel()) * dtype_size(part.dtype());
    std::memcpy(static_cast<char*>(out.raw_data()) + static_cast<size_t>(j) * n, part.raw_data(), n);
  }
  return out;
}
}  // namespace

namespace {
// W8A8 MoE (precision fp8) quantizes each expert's and the shared expert's SwiGLU output per 1 x 128
// group and holds their weights in 128 x 128 blocks: a rank's slice of those widths must fall on them.
void check_moe_fp8_slices(const TargetConfig& full, const TpShard& shard, Precision precision) {
  if (!full.is_moe() || precision != Precision::Fp8 || shard.size == 1) return;
  const TargetConfig l = local_config(full, shard.size, shard.ep);
  const std::pair<const char*, std::pair<int64_t, int64_t>> widths[] = {
      {"moe_intermediate_size", {full.moe_intermediate_size, l.moe_intermediate_size}},
      {"shared_expert_intermediate_size", {full.shared_expert_intermediate_size, l.shared_expert_intermediate_size}}};
  for (const auto& [name, w] : widths)
    DFLASH_REQUIRE_HINT(w.first == w.second || w.second % fp8::kBlock == 0,
                        "tp = " << shard.size << ", ep = " << shard.ep << ": precision fp8 (W8A8 MoE) needs each rank's slice of "
                                << name << " " << w.first << " to fall on 128-wide blocks, but it is " << w.second,
                        "use a tp / ep whose slices are multiples of 128 (ep = tp keeps experts whole), or run this MoE "
                        "target in bf16");
}
}  // namespace

TargetWeights load_weights_tp(const TargetConfig& full, const std::string& dir, DType dtype, Device device,
                              const TpShard& shard, Precision precision) {
  if (shard.size == 1) return load_weights(full, dir, dtype, device, precision);
  // The checkpoint is validated against the full config exactly as a single rank would, then
  // each slice is copied out of the mmap'd file: only its pages are read.
  const io::SafetensorsIndex ckpt = io::open_checkpoint(dir);
  std::map<std::string, std::string> by_canonical;
  // A layer's experts stored one tensor each: fused name -> (expert, "gate" / "up" / "down") -> checkpoint name.
  std::map<std::string, std::map<std::pair<int64_t, std::string>, std::string>> per_expert;
  for (const std::string& n : ckpt.names()) {
    std::string c = canonical_weight_name(n);
    if (c.empty()) continue;
    if (PerExpertName pe; parse_per_expert_name(c, pe)) {
      const std::string prefix = "layers." + std::to_string(pe.layer) + ".mlp.experts.";
      per_expert[prefix + (pe.proj == "down" ? "down_proj" : "gate_up_proj")][{pe.expert, pe.proj}] = n;
      continue;
    }
    by_canonical.emplace(c, n);
  }
  const std::string hint = "run once with tp = 1 (or dflash_doctor) for the full list of checkpoint problems";
  bool any_fp8 = false;
  // An e4m3 MoE weight (an FP8 MoE checkpoint; dequantized when read) needs its scales, shaped per 128 x 128 block.
  auto scales_ok = [&](const std::string& n, const Shape& shape) {
    const auto it = by_canonical.find(canonical_weight_name(n) + "_scale_inv");
    return it != by_canonical.end() && ckpt.info(it->second).shape == Shape{fp8::blocks(shape[0]), fp8::blocks(shape[1])};
  };
  for (const TensorSpec& t : expected_tensors(full)) {
    if (auto pe = per_expert.find(t.name); pe != per_expert.end() && !by_canonical.count(t.name)) {
      const bool down = t.name.ends_with("down_proj");
      const Shape one = down ? Shape{t.shape[1], t.shape[2]} : Shape{t.shape[1] / 2, t.shape[2]};
      for (int64_t e = 0; e < full.num_experts; ++e)
        for (const char* proj : down ? std::vector<const char*>{"down"} : std::vector<const char*>{"gate", "up"}) {
          auto it = pe->second.find({e, proj});
          const bool e4m3 = it != pe->second.end() && ckpt.info(it->second).dtype == DType::F8E4M3;
          any_fp8 = any_fp8 || e4m3;
          DFLASH_CHECK_HINT(it != pe->second.end() && ckpt.info(it->second).shape == one &&
                                (!e4m3 || scales_ok(it->second, one)),
                            dir << ": expert " << e << "'s " << proj << "_proj of " << t.name << " " << shape_str(one)
                                << " is missing, mis-shaped or e4m3 without its block scales",
                            hint);
        }
      continue;
    }
    auto it = by_canonical.find(t.name);
    DFLASH_CHECK_HINT(it != by_canonical.end() && ckpt.info(it->second).shape == t.shape,
                      dir << ": tensor " << t.name << " " << shape_str(t.shape) << " is missing or mis-shaped", hint);
    if (ckpt.info(it->second).dtype == DType::F8E4M3) {
      any_fp8 = true;
      DFLASH_CHECK_HINT((is_fp8_projection(t.name) || is_fp8_moe_weight(t.name)) && by_canonical.count(t.name + "_scale_inv"),
                        dir << ": " << it->second << " is e4m3 without its weight_scale_inv (or is not a projection)", hint);
    }
  }
  // An MoE target's FP8 checkpoint: its experts and shared experts are read as their (exact) values;
  // auto runs it in bf16 (moe_fp8_precision), fp8 in W8A8 on the CPU reference (MoeWeights::fp8).
  const Precision run_as = moe_fp8_precision(full, any_fp8, precision, dir);
  check_moe_fp8_slices(full, shard, run_as);
  // Run in bf16, every e4m3 tensor is read as its values (no scale slices to align); in fp8 the
  // dense projections keep their codes and scale slices (tp must cut them on 128-blocks).
  const bool dequantize_all = full.is_moe() && any_fp8 && run_as != Precision::Fp8;
  const auto specs = specs_by_name(full, shard);
  TargetWeights w = assemble_weights(
      local_config(full, shard.size, shard.ep), dtype, device,
      [&](const std::string& name, const Shape&) {
        if (auto pe = per_expert.find(name); pe != per_expert.end() && !by_canonical.count(name))
          return slice_from_per_expert(ckpt, pe->second, specs.at(name));
        const std::string& n = by_canonical.at(name);
        return extract_slice(dequantize_all || is_fp8_moe_weight(name) ? read_dequantized(ckpt, n) : ckpt.tensor(n),
                             specs.at(name));
      },
      [&](const std::string& name, const Shape&) {
        return extract_slice(ckpt.tensor(by_canonical.at(name + "_scale_inv")), scale_slice_spec(specs.at(name), shard.size));
      });
  mark_fp8_moe_layers(w, full, ckpt);
  apply_precision(w, run_as);
  return w;
}

std::vector<MoeExpertScales> read_moe_expert_scales(const TargetConfig& full, const std::string& dir, const TpShard& shard,
                                                    std::string* why) {
  auto none = [&](const std::string& reason) {
    if (why) *why = reason;
    return std::vector<MoeExpertScales>{};
  };
  if (!full.is_moe()) return none("a dense model");
  io::SafetensorsIndex ckpt = io::open_checkpoint(dir);
  std::map<int64_t, std::map<std::pair<int64_t, std::string>, std::string>> per_expert;  // layer -> (expert, proj) -> name
  for (const std::string& n : ckpt.names())
    if (PerExpertName pe; parse_per_expert_name(canonical_weight_name(n), pe)) per_expert[pe.layer][{pe.expert, pe.proj}] = n;
  const TargetConfig l = local_config(full, shard.size, shard.ep);
  const int64_t eg = shard.expert_group(), er = shard.expert_rank();
  const int64_t El = l.local_num_experts(), I = full.moe_intermediate_size, Il = l.moe_intermediate_size;
  const int64_t H = full.hidden_size, kI = fp8::blocks(I), kH = fp8::blocks(H), rb = fp8::blocks(Il);
  if (Il != I && Il % fp8::kBlock != 0)
    return none("this rank's " + std::to_string(Il) + " columns of each expert do not fall on 128-blocks");
  const int64_t b0 = er * Il / fp8::kBlock;  // the shard's first row block of gate / up, column block of down
  std::vector<MoeExpertScales> out;
  for (int64_t layer = 0; layer < full.num_hidden_layers; ++layer) {
    const auto it = per_expert.find(layer);
    if (it == per_expert.end()) return none("its experts are not stored one tensor each");
    MoeExpertScales m{Tensor::empty({El, 2 * rb, kH}, DType::F32), Tensor::empty({El, kH, rb}, DType::F32)};
    for (int64_t e = 0; e < El; ++e) {
      const int64_t ge = eg * El + e;
      auto scales = [&](const char* proj, const Shape& want) -> Tensor {
        const auto n = it->second.find({ge, proj});
        if (n == it->second.end() || ckpt.info(n->second).dtype != DType::F8E4M3 || !ckpt.has(n->second + "_scale_inv"))
          return {};
        Tensor s = ckpt.tensor(n->second + "_scale_inv").to_dtype(DType::F32).contiguous();
        return s.shape() == want ? s : Tensor{};
      };
      for (int part = 0; part < 2; ++part) {
        const Tensor s = scales(part == 0 ? "gate" : "up", {kI, kH});
        if (!s.defined()) return none("its experts are not e4m3 with [ceil(I/128), ceil(H/128)] scales");
        std::memcpy(m.gate_up.data<float>() + (e * 2 * rb + part * rb) * kH, s.data<float>() + b0 * kH,
                    static_cast<size_t>(rb * kH) * sizeof(float));
      }
      const Tensor s = scales("down", {kH, kI});
      if (!s.defined()) return none("its experts are not e4m3 with [ceil(H/128), ceil(I/128)] scales");
      for (int64_t r = 0; r < kH; ++r)
        std::memcpy(m.down.data<float>() + (e * kH + r) * rb, s.data<float>() + r * kI + b0, static_cast<size_t>(rb) * sizeof(float));
    }
    out.push_back(std::move(m));
  }
  return out;
}

TargetWeights random_weights_tp(const TargetConfig& full, uint64_t seed, DType dtype, Device device,
                                const TpShard& shard, Precision precision) {
  check_moe_fp8_slices(full, shard, precision);
  const auto specs = specs_by_name(full, shard);
  const TargetConfig local = local_config(full, shard.size, shard.ep);
  TargetWeights w = assemble_weights(local, dtype, device, [&](const std::string& name, const Shape& shape) {
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
    if (s.experts.second >= 0) {
      // An expert tensor [E, R, C]: per held expert, its row segments (dim 1) or its column block (dim 2).
      const int64_t R = s.full[1], C = s.full[2], R_l = shape[1], C_l = shape[2];
      const int64_t e0 = s.experts.first;
      for (int64_t j = 0; j < shape[0]; ++j) {
        Tensor ex = t.slice(0, j, j + 1).view({R_l, C_l});
        const int64_t base = (e0 + j) * R * C;
        if (s.dim == 1) {
          int64_t at = 0;
          for (auto [start, len] : s.segments) {
            Tensor part = ex.slice(0, at, at + len);
            rp.index_offset = base + start * C;
            rp.row_stride = 0;
            fill_normal(part, rp, init.a, init.b);
            at += len;
          }
        } else {
          rp.index_offset = base + s.segments[0].first;
          rp.row_stride = C;
          fill_normal(ex, rp, init.a, init.b);
        }
      }
    } else if (s.dim == 0) {
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
