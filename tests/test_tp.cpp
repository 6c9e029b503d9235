// Tensor parallelism on the CPU backend under mpirun (label mpi): collectives over MPI, and the
// target sharded over the ranks of a TP group gives the hidden states of the unsharded model on
// every rank. Run as `mpirun -n 2 test_tp` (any world size; tp = world size).
#include <gtest/gtest.h>

#include <map>

#include "comm/comm.h"
#include "core/device.h"
#include "target_model/model.h"
#if DFLASH_WITH_CUDA
#include "target_model/model_cuda.h"
#endif
#include "core/io/safetensors.h"
#include "target_model/tp.h"
#include "real_dims.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::target;

namespace {

comm::MpiEnv* g_mpi = nullptr;
const std::string kHf = std::string(DFLASH_TEST_DATA_DIR) + "/hf/";

std::unique_ptr<comm::Communicator> world_group() {
  return std::make_unique<comm::Communicator>(MPI_COMM_WORLD, 0, g_mpi->rank(), Device::cpu(), 60.0, "tp");
}

// The same tensor on every rank of the group: rank 0's copy broadcast and compared.
double max_diff_to_rank0(comm::Communicator& g, const Tensor& t) {
  Tensor mine = t.contiguous().to_dtype(DType::F32), r0 = mine.clone();
  g.broadcast(r0, 0);
  return max_rel_err(mine, r0);
}

}  // namespace

TEST(Comm, CollectivesOnHostTensors) {
  auto g = world_group();
  const int n = g->size(), r = g->rank();
  Tensor f = Tensor::from_vector({1.0f * r, 2.0f, -1.0f}, {3});
  g->all_reduce_sum(f);
  EXPECT_FLOAT_EQ(f.data<float>()[0], n * (n - 1) / 2.0f);
  EXPECT_FLOAT_EQ(f.data<float>()[1], 2.0f * n);
  Tensor b = Tensor::from_vector({0.5f, static_cast<float>(r)}, {2}, DType::BF16);
  g->all_reduce_sum(b);
  EXPECT_FLOAT_EQ(static_cast<float>(b.item_at(0)), 0.5f * n);
  Tensor i = Tensor::from_vector({static_cast<float>(r + 1)}, {1}).to_dtype(DType::I64);
  g->all_reduce_sum(i);
  EXPECT_EQ(i.data<int64_t>()[0], static_cast<int64_t>(n) * (n + 1) / 2);
  Tensor in = Tensor::from_vector({static_cast<float>(r), static_cast<float>(10 * r)}, {1, 2});
  Tensor out = Tensor::empty({n, 2}, DType::F32);
  g->all_gather(in, out);
  for (int k = 0; k < n; ++k) EXPECT_FLOAT_EQ(out.data<float>()[2 * k + 1], 10.0f * k);
  Tensor bc = Tensor::from_vector({static_cast<float>(r + 7)}, {1});
  g->broadcast(bc, n - 1);
  EXPECT_FLOAT_EQ(bc.data<float>()[0], static_cast<float>(n - 1 + 7));
  g->barrier();
  Tensor wrong = Tensor::empty({3, 2}, DType::F32);
  EXPECT_THROW(g->all_gather(in, wrong), Error);
}

// tp = world size on the HF tiny checkpoints: every captured layer within 1e-5 of the tp = 1
// model (both f32 CPU; the sums are only reordered) and identical on every rank of the group.
TEST(TensorParallel, ShardedForwardEqualsUnsharded) {
  auto g = world_group();
  const int tp = g->size();
  for (const char* name : {"tiny_a", "tiny_b"}) {
    const std::string dir = kHf + name;
    TargetConfig cfg = TargetConfig::from_file(dir);
    if (cfg.num_attention_heads % tp || cfg.linear_num_key_heads % tp || cfg.linear_num_value_heads % tp ||
        cfg.intermediate_size % tp) {
      std::printf("%s: skipped for tp = %d (heads do not divide)\n", name, tp);
      continue;
    }
    TargetModel full(cfg, load_weights(cfg, dir, DType::F32, Device::cpu()));
    TargetModel shard(local_config(cfg, tp), load_weights_tp(cfg, dir, DType::F32, Device::cpu(), {g->rank(), tp}),
                      g.get());
    io::SafetensorsFile golden(dir + "/golden.safetensors");
    std::vector<std::vector<int32_t>> batch = {ids_of(golden.tensor("ids.37")), ids_of(golden.tensor("ids.130")),
                                               ids_of(golden.tensor("ids.1"))};
    ForwardOptions opt;
    for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) opt.capture.push_back(i);
    opt.final_norm = true;
    ForwardResult a = full.forward(batch, opt), b = shard.forward(batch, opt);
    double worst = 0;
    for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
      const double e = max_rel_err(b.layers.at(i), a.layers.at(i));
      EXPECT_LE(e, 1e-5) << name << " layer " << i << " rank " << g->rank();
      EXPECT_EQ(max_diff_to_rank0(*g, b.layers.at(i)), 0.0) << name << " layer " << i << " differs across ranks";
      worst = std::max(worst, e);
    }
    EXPECT_LE(max_rel_err(b.final_hidden, a.final_hidden), 1e-5);
    if (g->rank() == 0) std::printf("%s tp=%d: max rel err vs tp=1 %.2e\n", name, tp, worst);
  }
}

// Random initialisation: the shards hold exactly the slices of the full random model.
TEST(TensorParallel, RandomShardsAreSlicesOfTheFullModel) {
  auto g = world_group();
  const int tp = g->size();
  TargetConfig cfg = TargetConfig::from_file(std::string(DFLASH_TEST_DATA_DIR) + "/../../configs/tiny/config.json");
  cfg.random_branch_scale = 1.0;  // full-size residual branches: every layer's error shows (the demo's 0.02 would hide them)
  if (cfg.num_attention_heads % tp || cfg.linear_num_key_heads % tp || cfg.intermediate_size % tp) GTEST_SKIP();
  TargetModel full(cfg, random_weights(cfg, 11, DType::F32, Device::cpu()));
  TargetModel shard(local_config(cfg, tp), random_weights_tp(cfg, 11, DType::F32, Device::cpu(), {g->rank(), tp}), g.get());
  ForwardOptions opt;
  opt.capture = {0, 3, 7};
  std::vector<std::vector<int32_t>> batch{{1, 5, 9, 4000, 17}, {3}};
  ForwardResult a = full.forward(batch, opt), b = shard.forward(batch, opt);
  for (int64_t id : opt.capture) EXPECT_LE(max_rel_err(b.layers.at(id), a.layers.at(id)), 1e-5) << id;
}

// The MoE block across ranks (tp.h): TP groups of 2 consecutive ranks (any even world), on the
// HF-made tiny qwen3_5_moe checkpoint (8 experts of 32, top 2, shared expert 48; its experts stored
// one tensor each). tp 2 with ep 1 (every expert split in two along moe_intermediate_size) and ep 2
// (each rank holds 4 whole experts): every layer within 1e-5 (max error over max magnitude) of the
// unsharded model, the same router choices, identical on both ranks, and the expert groups' load
// (token-expert pairs) adding up to N·k·layers. The f32 sums are only reordered (the experts' and the
// shared expert's partial outputs summed by one all-reduce), so 1e-5 is ~100x the float rounding seen.
TEST(MoeParallel, ShardedForwardEqualsUnsharded) {
  const int world = g_mpi->size();
  if (world < 2 || world % 2) GTEST_SKIP() << "needs an even number of ranks";
  const int tp = 2;
  comm::Communicator g(MPI_COMM_WORLD, g_mpi->rank() / tp, g_mpi->rank(), Device::cpu(), 60.0, "tp");
  const std::string dir = std::string(DFLASH_TEST_DATA_DIR) + "/hf_moe/tiny_moe";
  const TargetConfig cfg = TargetConfig::from_file(dir);
  TargetModel full(cfg, load_weights(cfg, dir, DType::F32, Device::cpu()));
  io::SafetensorsFile golden(dir + "/golden.safetensors");
  const std::vector<std::vector<int32_t>> batch = {ids_of(golden.tensor("ids.37")), ids_of(golden.tensor("ids.130")),
                                                   ids_of(golden.tensor("ids.1"))};
  ForwardOptions opt;
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) opt.capture.push_back(i);
  opt.final_norm = true;
  opt.capture_routing = true;
  const ForwardResult a = full.forward(batch, opt);
  const int64_t N = a.offsets.back();
  for (int ep : {1, 2}) {
    TargetModel shard(local_config(cfg, tp, ep), load_weights_tp(cfg, dir, DType::F32, Device::cpu(), {g.rank(), tp, ep}), &g);
    EXPECT_EQ(shard.weights().layers[0].moe.experts_gate_up.size(0), cfg.num_experts / ep);
    const ForwardResult b = shard.forward(batch, opt);
    double worst = 0;
    for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
      const double e = max_rel_err(b.layers.at(i), a.layers.at(i));
      EXPECT_LE(e, 1e-5) << "ep " << ep << " layer " << i << " rank " << g.rank();
      EXPECT_EQ(max_diff_to_rank0(g, b.layers.at(i)), 0.0) << "ep " << ep << " layer " << i << " differs across ranks";
      EXPECT_EQ(max_rel_err(b.routing.at(i).experts.to_dtype(DType::F32), a.routing.at(i).experts.to_dtype(DType::F32)), 0.0)
          << "ep " << ep << " layer " << i << ": other experts chosen";
      worst = std::max(worst, e);
    }
    EXPECT_LE(max_rel_err(b.final_hidden, a.final_hidden), 1e-5);
    const std::vector<int64_t>& load = shard.expert_load();
    ASSERT_EQ(load.size(), static_cast<size_t>(ep));
    int64_t sum = 0;
    std::string per_rank;
    for (int64_t v : load) sum += v, per_rank += " " + std::to_string(v);
    EXPECT_EQ(sum, N * cfg.num_experts_per_tok * cfg.num_hidden_layers);
    if (g_mpi->rank() == 0)
      std::printf("tiny_moe tp=%d ep=%d: max rel err vs tp=1 %.2e; token-expert pairs per expert group:%s (of %lld)\n", tp,
                  ep, worst, per_rank.c_str(), static_cast<long long>(sum));
  }
}

// Random MoE weights at tp 2 (ep 1, 2) or, on a multiple of 4 ranks, tp 4 (ep 1, 2, 4: experts
// split in 4, in 2 groups of 2 ranks each splitting them in 2, whole experts; the tiny model with 4
// GDN key heads): the forward equals the unsharded random model's (the shards draw exactly the
// full model's values, random_weights_tp), full-size residual branches.
TEST(MoeParallel, RandomShardsForwardEqualsUnsharded) {
  const int world = g_mpi->size();
  if (world < 2 || world % 2) GTEST_SKIP() << "needs an even number of ranks";
  const int tp = world % 4 == 0 ? 4 : 2;
  comm::Communicator g(MPI_COMM_WORLD, g_mpi->rank() / tp, g_mpi->rank(), Device::cpu(), 60.0, "tp");
  TargetConfig cfg = TargetConfig::from_file(std::string(DFLASH_TEST_DATA_DIR) + "/hf_moe/tiny_moe");
  cfg.linear_num_key_heads = 4;  // tp 4 divides every head count (kv heads: 2, each on 2 ranks)
  TargetModel full(cfg, random_weights(cfg, 7, DType::F32, Device::cpu()));
  ForwardOptions opt;
  opt.capture = {0, 1, 2, 3};
  const std::vector<std::vector<int32_t>> batch{{1, 5, 9, 200, 17, 3, 3, 80}, {3}};
  const ForwardResult a = full.forward(batch, opt);
  for (int ep = 1; ep <= tp; ep *= 2) {
    TargetModel shard(local_config(cfg, tp, ep), random_weights_tp(cfg, 7, DType::F32, Device::cpu(), {g.rank(), tp, ep}), &g);
    const ForwardResult b = shard.forward(batch, opt);
    double worst = 0;
    for (int64_t id : opt.capture) {
      worst = std::max(worst, max_rel_err(b.layers.at(id), a.layers.at(id)));
      EXPECT_LE(max_rel_err(b.layers.at(id), a.layers.at(id)), 1e-5) << "tp " << tp << " ep " << ep << " layer " << id;
    }
    if (g_mpi->rank() == 0) std::printf("random tiny_moe tp=%d ep=%d: max rel err vs tp=1 %.2e\n", tp, ep, worst);
  }
}

#if DFLASH_WITH_CUDA
// A real-dims model with more heads, so that tp (2, 4 or 8) divides them.
TargetConfig with_tp_heads(TargetConfig c) {
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.linear_num_key_heads = 4;
  c.linear_num_value_heads = 8;
  c.validate();
  return c;
}

// On a machine with a GPU per rank: the bf16 CUDA forward sharded over the group (NCCL all-reduce)
// against the unsharded CUDA forward on rank 0's GPU, on a model with the real head dims (fast
// kernels), every rank holding the same hidden states. Skips unless each rank has its own GPU.
TEST(TensorParallel, CudaShardedForwardEqualsUnsharded) {
  const int world = g_mpi->size();
  if (cuda_device_count() < g_mpi->local_size() || world < 2) GTEST_SKIP() << "needs one GPU per rank and 2+ ranks";
  const Device dev = g_mpi->bind_device();
  const TargetConfig c = with_tp_heads(real_dims());
  const int tp = world, sm = cuda_device_info(dev.index).major;
  comm::Communicator g(MPI_COMM_WORLD, 0, g_mpi->rank(), dev, 120.0, "tp");
  const TargetConfig local = local_config(c, tp);
  CudaTargetModel shard(local, random_weights_tp(c, 5, DType::BF16, dev, {g.rank(), tp}), make_plan(local, dev, {}, sm), &g);
  CudaTargetModel full(c, random_weights(c, 5, DType::BF16, dev), make_plan(c, dev, {}, sm));
  std::vector<std::vector<int32_t>> batch;
  for (int len : {300, 65, 1}) {
    std::vector<int32_t> s;
    for (int t = 0; t < len; ++t) s.push_back((t * 31 + len) % static_cast<int>(c.vocab_size));
    batch.push_back(s);
  }
  ForwardOptions opt;
  opt.capture = {3, 7};
  ForwardResult a = full.forward(batch, opt), b = shard.forward(batch, opt);
  // The oracle: the f32 CPU forward of the same (bf16-valued) weights. Both CUDA forwards must be
  // within the bf16 bound of it; by the triangle inequality they are then within twice that of
  // each other (the sharded one sums in another order: per-shard GEMMs, then NCCL).
  TargetModel cpu(c, bf16_random_weights_f32(c, 5));
  ForwardResult ref = cpu.forward(batch, opt);
  comm::Communicator host_group(MPI_COMM_WORLD, 0, g_mpi->rank(), Device::cpu(), 60.0, "check");
  for (int64_t id : opt.capture) {
    Tensor mine = b.layers.at(id).to(Device::cpu()), one = a.layers.at(id).to(Device::cpu());
    const double e_tp = max_rel_err(mine, ref.layers.at(id)), e_one = max_rel_err(one, ref.layers.at(id));
    const double e = max_rel_err(mine, one);
    EXPECT_LE(e_tp, 3e-2) << "layer " << id << ": tp=" << tp << " vs the f32 reference";
    EXPECT_LE(e_one, 3e-2) << "layer " << id << ": tp=1 vs the f32 reference";
    EXPECT_LE(e, 6e-2) << "layer " << id << ": tp=" << tp << " vs tp=1";
    EXPECT_EQ(max_diff_to_rank0(host_group, mine), 0.0) << "layer " << id << " differs across ranks";
    if (g.rank() == 0)
      std::printf("cuda layer %lld: max rel err vs f32 reference tp=%d %.2e, tp=1 %.2e; tp=%d vs tp=1 %.2e\n",
                  static_cast<long long>(id), tp, e_tp, e_one, tp, e);
  }
}

// Expert parallelism on GPUs (one per rank): a real-dims MoE target (16 experts, top 4, a shared
// expert) sharded tp ways with ep 1 (every expert split along moe_intermediate_size) and ep = tp
// (whole experts), the MoE blocks' partial outputs summed by the NCCL all-reduce, against the
// unsharded CUDA forward and the f32 CPU reference, as the dense test above.
TEST(MoeParallel, CudaShardedForwardEqualsUnsharded) {
  const int world = g_mpi->size();
  if (cuda_device_count() < g_mpi->local_size() || world < 2) GTEST_SKIP() << "needs one GPU per rank and 2+ ranks";
  const Device dev = g_mpi->bind_device();
  const TargetConfig c = with_tp_heads(real_dims_moe());
  const int tp = world, sm = cuda_device_info(dev.index).major;
  comm::Communicator g(MPI_COMM_WORLD, 0, g_mpi->rank(), dev, 120.0, "tp");
  CudaTargetModel full(c, random_weights(c, 5, DType::BF16, dev), make_plan(c, dev, {}, sm));
  const std::vector<std::vector<int32_t>> batch{{1, 5, 9, 200, 17, 3, 3, 80, 41, 7}, {3}};
  // Every model routes by the f32 reference's router logits (ForwardOptions::router_logits), so a
  // near tie that bf16 rounding flips cannot send one token to other experts in one of them.
  TargetModel cpu(c, bf16_random_weights_f32(c, 5));
  ForwardOptions ropt;
  ropt.capture = {3, 7};
  ropt.capture_routing = true;
  const ForwardResult ref = cpu.forward(batch, ropt);
  std::map<int64_t, Tensor> logits;
  for (const auto& [i, r] : ref.routing) logits[i] = r.logits;
  ForwardOptions opt;
  opt.capture = {3, 7};
  opt.router_logits = &logits;
  const ForwardResult a = full.forward(batch, opt);
  comm::Communicator host_group(MPI_COMM_WORLD, 0, g_mpi->rank(), Device::cpu(), 60.0, "check");
  for (int ep : {1, tp}) {
    const TargetConfig local = local_config(c, tp, ep);
    const FastPathPlan plan = make_plan(local, dev, {}, sm);
    EXPECT_EQ(plan.moe_kernel, "moe_grouped_mma") << plan.moe;
    CudaTargetModel shard(local, random_weights_tp(c, 5, DType::BF16, dev, {g.rank(), tp, ep}), plan, &g);
    const ForwardResult b = shard.forward(batch, opt);
    for (int64_t id : opt.capture) {
      Tensor mine = b.layers.at(id).to(Device::cpu()), one = a.layers.at(id).to(Device::cpu());
      const double e_tp = max_rel_err(mine, ref.layers.at(id)), e = max_rel_err(mine, one);
      EXPECT_LE(e_tp, 3e-2) << "layer " << id << ": tp=" << tp << " ep=" << ep << " vs the f32 reference";
      EXPECT_LE(e, 6e-2) << "layer " << id << ": tp=" << tp << " ep=" << ep << " vs tp=1";
      EXPECT_EQ(max_diff_to_rank0(host_group, mine), 0.0) << "layer " << id << " differs across ranks";
      if (g.rank() == 0)
        std::printf("cuda moe layer %lld: tp=%d ep=%d vs f32 reference %.2e, vs tp=1 %.2e\n", static_cast<long long>(id),
                    tp, ep, e_tp, e);
    }
  }
}
#endif

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  comm::MpiEnv mpi(&argc, &argv);
  g_mpi = &mpi;
  int failed = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (mpi.rank() == 0) std::printf("%s on %d ranks\n", any ? "FAILED" : "PASSED", mpi.size());
  return any;
}
