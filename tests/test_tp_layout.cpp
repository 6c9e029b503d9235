// Parallel layout and the TP sharding rules as pure functions (no MPI needed).
#include <gtest/gtest.h>

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
