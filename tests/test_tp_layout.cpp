// Parallel layout and the TP sharding rules as pure functions (no MPI needed).
#include <gtest/gtest.h>

#include <tuple>

#include "comm/comm.h"
#include "target_model/tp.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::target;

namespace {
TargetConfig qwen27b() {
  return TargetConfig::from_file(std::string(DFLASH_TEST_DATA_DIR) + "/../../configs/qwen3.6-27b/config.json");
}
const SliceSpec& spec(const std::vector<SliceSpec>& v, const std::string& name) {
  for (const SliceSpec& s : v)
    if (s.name == name) return s;
  throw std::runtime_error("no spec " + name);
}
}  // namespace

TEST(ParallelLayout, GroupsOfConsecutiveRanks) {
  comm::Layout l = comm::make_layout(8, 5, 2);
  EXPECT_EQ(l.tp_rank, 1);
  EXPECT_EQ(l.tp_group, 2);
  EXPECT_EQ(l.num_tp_groups, 4);
  for (int tp : {1, 2, 4, 8}) EXPECT_EQ(comm::make_layout(8, 7, tp).tp_rank, 7 % tp);
  EXPECT_NE(error_of([] { comm::make_layout(6, 0, 4); }).find("parallel.tp = 4 does not divide the world size 6"),
            std::string::npos);
  EXPECT_THROW(comm::make_layout(4, 4, 1), Error);
}

TEST(TensorParallelRules, Qwen27bShards) {
  TargetConfig c = qwen27b();
  for (int tp : {1, 2, 4, 8}) EXPECT_NO_THROW(check_tp(c, tp)) << tp;
  const std::string e = error_of([&] { check_tp(c, 3); });
  EXPECT_NE(e.find("parallel.tp = 3 does not divide the model's linear_num_key_heads 16"), std::string::npos) << e;
  EXPECT_EQ(e.find("num_attention_heads"), std::string::npos) << "24 is divisible by 3";
  TargetConfig l = local_config(c, 8);
  EXPECT_EQ(l.num_attention_heads, 3);
  EXPECT_EQ(l.num_key_value_heads, 1);  // 4 kv heads over 8 ranks: each replicated on 2
  EXPECT_EQ(l.linear_num_key_heads, 2);
  EXPECT_EQ(l.linear_num_value_heads, 6);
  EXPECT_EQ(l.intermediate_size, 2176);
  // Rank 5 of 8: kv head 5*4/8 = 2; q heads 15..17 read kv head 15/6 = 2 as well.
  auto specs = shard_specs(c, {5, 8});
  const SliceSpec& k = spec(specs, "layers.3.self_attn.k_proj.weight");
  ASSERT_EQ(k.segments.size(), 1u);
  EXPECT_EQ(k.segments[0].first, 2 * 256);
  const SliceSpec& qkv = spec(specs, "layers.0.linear_attn.in_proj_qkv.weight");
  ASSERT_EQ(qkv.segments.size(), 3u);  // the q, k and v sections each
  EXPECT_EQ(qkv.segments[0], (std::pair<int64_t, int64_t>{5 * 2 * 128, 2 * 128}));
  EXPECT_EQ(qkv.segments[1], (std::pair<int64_t, int64_t>{2048 + 5 * 2 * 128, 2 * 128}));
  EXPECT_EQ(qkv.segments[2], (std::pair<int64_t, int64_t>{4096 + 5 * 6 * 128, 6 * 128}));
  EXPECT_EQ(spec(specs, "layers.0.linear_attn.conv1d.weight").segments, qkv.segments);
  const SliceSpec& out = spec(specs, "layers.0.linear_attn.out_proj.weight");
  EXPECT_EQ(out.dim, 1);
  EXPECT_EQ(out.local, (Shape{5120, 6 * 128}));
  EXPECT_EQ(spec(specs, "embed_tokens.weight").dim, -1);
  EXPECT_EQ(spec(specs, "layers.0.linear_attn.norm.weight").dim, -1);
}

TEST(TensorParallelRules, ExtractSliceRowsAndColumns) {
  std::vector<float> v(24);
  for (int i = 0; i < 24; ++i) v[i] = static_cast<float>(i);
  Tensor full = Tensor::from_vector(v, {4, 6});
  SliceSpec rows{"x", {4, 6}, {2, 6}, 0, {{0, 1}, {3, 1}}};
  Tensor r = extract_slice(full, rows);
  EXPECT_EQ(r.item_at(0), 0.0);
  EXPECT_EQ(r.item_at(6), 18.0);
  SliceSpec cols{"y", {4, 6}, {4, 2}, 1, {{4, 2}}};
  Tensor c = extract_slice(full, cols);
  EXPECT_EQ(c.item_at(0), 4.0);
  EXPECT_EQ(c.item_at(7), 23.0);
  EXPECT_THROW(extract_slice(Tensor::empty({3, 6}, DType::F32), cols), Error);
}

// ---- The MoE block's shards (tp.h): tp / ep checks, and the shards hold the full model's slices.
namespace {
TargetConfig tiny_moe() { return TargetConfig::from_file(std::string(DFLASH_TEST_DATA_DIR) + "/hf_moe/tiny_moe"); }
const Tensor& moe_slot(const TargetWeights& w, int64_t layer, const std::string& what) {
  const MoeWeights& m = w.layers[static_cast<size_t>(layer)].moe;
  if (what == "gate_up") return m.experts_gate_up;
  if (what == "down") return m.experts_down;
  if (what == "shared_gate") return m.shared_gate_proj;
  if (what == "shared_down") return m.shared_down_proj;
  return m.router;
}
// The expected shard of a full [E, R, C] expert tensor, cut by hand: experts [e0, e0 + El), and
// per expert rows [r0, r0 + n) and [r1, r1 + n) (gate_up) or columns [c0, c0 + n) (down).
Tensor hand_slice(const Tensor& full, int64_t e0, int64_t El, const std::vector<std::pair<int64_t, int64_t>>& rows,
                  std::pair<int64_t, int64_t> cols) {
  std::vector<Tensor> parts;
  for (int64_t e = e0; e < e0 + El; ++e) {
    Tensor ex = full.select(e);
    for (auto [r, n] : rows) parts.push_back(ex.slice(0, r, r + n).slice(1, cols.first, cols.first + cols.second).contiguous());
  }
  int64_t total = 0;
  for (const Tensor& p : parts) total += p.numel();
  Tensor out = Tensor::empty({total}, DType::F32);
  int64_t at = 0;
  for (const Tensor& p : parts) {
    std::copy(p.data<float>(), p.data<float>() + p.numel(), out.data<float>() + at);
    at += p.numel();
  }
  return out;
}
}  // namespace

TEST(MoeParallelRules, ChecksNameTheFieldAndTheFix) {
  const TargetConfig c = tiny_moe();  // 8 experts of 32, shared 48; 4 / 2 attention heads, GDN 2 / 4
  EXPECT_NO_THROW(check_tp(c, 2, 1));
  EXPECT_NO_THROW(check_tp(c, 2, 2));
  std::string e = error_of([&] { check_tp(c, 2, 3); });
  EXPECT_NE(e.find("parallel.ep = 3 does not divide parallel.tp = 2"), std::string::npos) << e;
  e = error_of([&] { check_ep(c, 6, 3); });
  EXPECT_NE(e.find("parallel.ep = 3 does not divide the model's num_experts 8"), std::string::npos) << e;
  e = error_of([&] { check_tp(c, 1, 0); });
  EXPECT_NE(e.find("parallel.ep must be >= 1"), std::string::npos) << e;
  e = error_of([&] { check_ep(qwen27b(), 2, 2); });
  EXPECT_NE(e.find("is a dense model (no experts to split)"), std::string::npos) << e;
  EXPECT_NE(e.find("set parallel.ep: 1"), std::string::npos) << e;
  // tp / ep must divide moe_intermediate_size, tp the shared expert's.
  TargetConfig odd = c;
  odd.moe_intermediate_size = 33;
  odd.shared_expert_intermediate_size = 50;
  e = error_of([&] { check_tp(odd, 2, 1); });
  EXPECT_NE(e.find("moe_intermediate_size 33"), std::string::npos) << e;
  EXPECT_EQ(e.find("shared_expert_intermediate_size 50"), std::string::npos) << "50 is divisible by 2: " << e;
  EXPECT_NO_THROW(check_tp(odd, 2, 2));  // whole experts: 33 is not cut
  odd.shared_expert_intermediate_size = 49;
  e = error_of([&] { check_tp(odd, 2, 2); });
  EXPECT_NE(e.find("shared_expert_intermediate_size 49"), std::string::npos) << e;
  // Qwen3.6-35B-A3B's layouts: tp 8 with ep 1, 2, 4, 8.
  const TargetConfig q35 = TargetConfig::from_file(std::string(DFLASH_TEST_DATA_DIR) + "/../../configs/qwen3.6-35b-a3b/config.json");
  for (int ep : {1, 2, 4, 8}) {
    const TargetConfig l = local_config(q35, 8, ep);
    EXPECT_EQ(l.local_num_experts(), 256 / ep);
    EXPECT_EQ(l.moe_intermediate_size, 512 / (8 / ep));
    EXPECT_EQ(l.shared_expert_intermediate_size, 64);
    EXPECT_EQ(l.num_experts, 256);  // the router scores them all
  }
}

// Every layout of tp 2 (ep 1, 2) and tp 4 (ep 1, 2, 4; shard specs only, no forward): the shard's
// expert tensors are the hand-cut slices of the full tensors, for random weights and for the HF
// checkpoint (which stores one tensor per expert); the router is replicated.
TEST(MoeParallelRules, ShardsAreSlicesOfTheFullModel) {
  const TargetConfig c = tiny_moe();
  const std::string dir = std::string(DFLASH_TEST_DATA_DIR) + "/hf_moe/tiny_moe";
  const TargetWeights rfull = random_weights(c, 3, DType::F32, Device::cpu());
  const TargetWeights cfull = load_weights(c, dir, DType::F32, Device::cpu());
  TargetConfig wide = c;  // tp 4 needs 4 GDN key heads: shard specs and random shards only
  wide.linear_num_key_heads = 4;
  wide.linear_num_value_heads = 4;
  const TargetWeights wfull = random_weights(wide, 3, DType::F32, Device::cpu());
  const int64_t E = c.num_experts, Ie = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size, H = c.hidden_size;
  for (int tp : {2, 4})
    for (int ep : {1, 2, 4}) {
      if (ep > tp) continue;
      const TargetConfig& cfg = tp == 4 ? wide : c;
      const TargetWeights& full_r = tp == 4 ? wfull : rfull;
      for (int r = 0; r < tp; ++r) {
        const TpShard sh{r, tp, ep};
        const int64_t per = tp / ep, g = r / per, er = r % per, El = E / ep, n = Ie / per, ns = Is / tp;
        const TargetWeights rw = random_weights_tp(cfg, 3, DType::F32, Device::cpu(), sh);
        const TargetWeights cw = tp == 2 ? load_weights_tp(c, dir, DType::F32, Device::cpu(), sh) : TargetWeights{};
        for (const auto& [what, full, mine] : {std::tuple{"random", &full_r, &rw}, std::tuple{"checkpoint", &cfull, &cw}}) {
          if (!mine->layers.size()) continue;
          for (int64_t L : {int64_t{0}, cfg.num_hidden_layers - 1}) {
            const std::string at = std::string(what) + " tp " + std::to_string(tp) + " ep " + std::to_string(ep) + " rank " +
                                   std::to_string(r) + " layer " + std::to_string(L);
            const Tensor gu = hand_slice(moe_slot(*full, L, "gate_up"), g * El, El, {{er * n, n}, {Ie + er * n, n}}, {0, H});
            EXPECT_EQ(max_rel_err(moe_slot(*mine, L, "gate_up").view({gu.numel()}), gu), 0.0) << at;
            const Tensor dn = hand_slice(moe_slot(*full, L, "down"), g * El, El, {{0, H}}, {er * n, n});
            EXPECT_EQ(max_rel_err(moe_slot(*mine, L, "down").view({dn.numel()}), dn), 0.0) << at;
            const Tensor sg = moe_slot(*full, L, "shared_gate").slice(0, r * ns, (r + 1) * ns).contiguous();
            EXPECT_EQ(max_rel_err(moe_slot(*mine, L, "shared_gate"), sg), 0.0) << at;
            const Tensor sd = moe_slot(*full, L, "shared_down").slice(1, r * ns, (r + 1) * ns).contiguous();
            EXPECT_EQ(max_rel_err(moe_slot(*mine, L, "shared_down"), sd), 0.0) << at;
            EXPECT_EQ(max_rel_err(moe_slot(*mine, L, "router"), moe_slot(*full, L, "router")), 0.0) << at;
          }
        }
      }
    }
}
