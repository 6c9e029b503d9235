// The CPU backend: the f32 reference target (tensor-parallel over MPI inside a TP group) and the drafter
// step in f32 on the threaded GEMM (kernels.cpu_drafter: f32) or the double-precision reference (f64);
// gradients summed with one MPI all-reduce (in double); AdamW on the host.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <thread>

#include "drafter/batch.h"
#include "drafter/fast_path.h"
#include "kernels/cpu/gemm.h"
#include "target_model/model.h"
#include "target_model/tp.h"
#include "target_model/weights.h"
#include "target_model/fast_path.h"
#include "trainer/backend.h"
#include "trainer/optimizer.h"

namespace dflash::trainer {

namespace {

class CpuBackend final : public TrainBackend {
 public:
  CpuBackend(const BackendSetup& s, comm::Communicator* world, comm::Communicator* tp)
      : dcfg_(s.drafter), world_(world), drafter_plan_(drafter::make_cpu_drafter_plan(s.drafter)) {
    const TrainConfig& cfg = *s.cfg;
    blocks_per_pass_ = cfg.training.blocks_per_pass;
    const int tps = s.layout.tp_size, ep = static_cast<int>(cfg.parallel.ep);
    // The CPU reference holds f32 weights: refuse up front what cannot fit.
    target::check_cpu_reference_fits(target::local_config(s.target, tps, ep), s.target,
                                     "the CPU backend (parallel.device: cpu) is for small targets: train this one "
                                     "with parallel.device: cuda on GPUs");
    tmodel_ = std::make_unique<target::TargetModel>(target::local_config(s.target, tps, ep), load_target(s, Device::cpu()), tp);
    frozen_ = {tmodel_->weights().embed_tokens, tmodel_->weights().lm_head};
    dw_ = initial_drafter_weights(s, Device::cpu());
    dw_.check(dcfg_);
    math_ = cfg.kernels.cpu_drafter;
    fp8_ = cfg.model.drafter.precision == DrafterPrecision::Fp8;
    wgx_ = fp8_wgrad_x_blocks(cfg.model.drafter);
    // Ranks sharing a machine share its cores (DFLASH_CPU_THREADS, when set, wins).
    if (s.local_size > 1 && !std::getenv("DFLASH_CPU_THREADS"))
      cpu::set_cpu_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / s.local_size));
    grads_ = drafter::DrafterWeights::zeros(dcfg_, math_ == drafter::DrafterMath::F32 ? DType::F32 : DType::F64);
    std::vector<std::pair<std::string, Tensor*>> params;
    for (auto& e : dw_.entries(dcfg_)) params.emplace_back(e.name, e.tensor), n_params_ += e.tensor->numel();
    for (auto& e : grads_.entries(dcfg_)) grad_list_.push_back(e.tensor);
    opt_ = std::make_unique<AdamW>(params, adamw_hyper(cfg));
    fopt_.capture = dcfg_.target_layer_ids;
    fopt_.skip_unused_layers = true;  // no layer after the last captured one runs
    fopt_.counters = &counters_;
  }

  std::string describe() const override {
    return math_ == drafter::DrafterMath::F32
               ? "cpu (f32 target reference, f32 drafter" +
                     std::string(fp8_ ? (wgx_ ? " with simulated block-FP8 linears, weight gradients' x in 128 x 128 blocks"
                                              : " with simulated block-FP8 linears")
                                      : "") +
                     " on " + std::to_string(cpu::cpu_threads()) + " thread(s), " + cpu::gemm_isa() + " GEMM)"
               : "cpu (f32 target reference, double drafter reference)";
  }
  std::string expert_load() override {
    const std::vector<int64_t>& load = tmodel_->expert_load();
    if (load.empty()) return "";
    int64_t sum = 0, most = 0;
    std::string per;
    for (int64_t v : load) {
      sum += v, most = std::max(most, v);
      if (!per.empty()) per += ' ';
      per += std::to_string(v);
    }
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%.2f",
                  sum > 0 ? static_cast<double>(most) * static_cast<double>(load.size()) / static_cast<double>(sum) : 0.0);
    return "target MoE load: token-expert pairs per expert group (ep " + std::to_string(load.size()) + "): " + per +
           " of " + std::to_string(sum) + " (max / mean " + ratio + ")";
  }
  int64_t num_params() const override { return n_params_; }
  int64_t target_layers_run() const override { return target::layers_to_run(tmodel_->config(), fopt_); }
  void zero_grads() override {
    for (Tensor* t : grad_list_) t->fill(0.0);
  }

  drafter::StepStats micro_step(MicroBatch& m, const drafter::StepOptions& opt, bool, StepTimes& t) override {
    auto t0 = StepClock::now();
    target::ForwardResult fr = tmodel_->forward(m.seqs, fopt_);
    t.target_s += seconds_since(t0);
    const int64_t N = m.tokens, H = dcfg_.hidden_size, K = dcfg_.num_context_layers();
    Tensor ctx = Tensor::empty({N, K * H}, DType::F32);
    float* cp = ctx.data<float>();
    for (int64_t j = 0; j < K; ++j) {
      const float* src = fr.layers.at(dcfg_.target_layer_ids[static_cast<size_t>(j)]).data<float>();
      for (int64_t n = 0; n < N; ++n) std::memcpy(cp + n * K * H + j * H, src + n * H, sizeof(float) * H);
    }
    m.batch.context = ctx;
    if (m.batch.blocks.empty() || opt.grad_scale <= 0) return {};
    t0 = StepClock::now();
    drafter::StepOptions o = opt;
    o.math = math_;
    drafter::StepStats st = drafter::for_each_block_pass(m.batch, blocks_per_pass_, opt.grad_scale, [&](bool) {
      return drafter::forward_backward(dcfg_, dw_, frozen_, m.batch, o, &grads_);
    });
    t.drafter_s += seconds_since(t0);
    return st;
  }

  double reduce_grads(StepTimes& t) override {
    auto t0 = StepClock::now();
    if (world_ && world_->size() > 1) {  // summed in double whatever the gradients' dtype
      std::vector<double> buf(static_cast<size_t>(n_params_));
      size_t at = 0;
      for (Tensor* g : grad_list_) {
        convert_elements(g->raw_data(), g->dtype(), buf.data() + at, DType::F64, g->numel());
        at += static_cast<size_t>(g->numel());
      }
      Tensor b = Tensor::from_blob(buf.data(), {static_cast<int64_t>(buf.size())}, DType::F64);
      world_->all_reduce_sum(b);
      at = 0;
      for (Tensor* g : grad_list_) {
        convert_elements(buf.data() + at, DType::F64, g->raw_data(), g->dtype(), g->numel());
        at += static_cast<size_t>(g->numel());
      }
    }
    t.comm_s += seconds_since(t0);
    std::vector<const Tensor*> gl(grad_list_.begin(), grad_list_.end());
    return global_grad_norm(gl);
  }

  void apply(double lr, double grad_factor, StepTimes& t) override {
    auto t0 = StepClock::now();
    std::vector<const Tensor*> gl(grad_list_.begin(), grad_list_.end());
    opt_->step(gl, lr, grad_factor);
    t.optimizer_s += seconds_since(t0);
  }

  drafter::DrafterWeights weights() override { return dw_; }
  nlohmann::json fast_path_json() override {
    return {{"device", "cpu"},
            {"target", "every layer on the CPU reference (f32)"},
            {"target_layers_run", target_layers_run()},
            {"target_kernel_launches", counters_.to_json()},
            {"drafter_attention", drafter_plan_.attention_json()},
            {"drafter", drafter_plan_.to_json()}};
  }
  CheckpointState checkpoint_state() override {
    // Copies (the next step updates dw_ and the moments in place); the weights are the copied masters.
    CheckpointState cs;
    cs.optimizer = opt_->state(true);
    cs.weights.layers.resize(dw_.layers.size());
    auto entries = cs.weights.entries(dcfg_);
    for (size_t i = 0; i < entries.size(); ++i) {
      const auto& [name, t] = cs.optimizer.tensors[3 * i];
      DFLASH_CHECK(name == "master." + entries[i].name, "checkpoint state: optimizer tensor " << name << " where master."
                                                                                            << entries[i].name << " was expected");
      *entries[i].tensor = t;
    }
    return cs;
  }
  void load_optimizer(const std::string& path, const nlohmann::json& state) override { opt_->load(path, state); }

 private:
  drafter::DrafterConfig dcfg_;
  comm::Communicator* world_;
  drafter::DrafterPlan drafter_plan_;
  std::unique_ptr<target::TargetModel> tmodel_;
  drafter::FrozenTarget frozen_;
  drafter::DrafterWeights dw_, grads_;
  std::vector<Tensor*> grad_list_;
  int64_t n_params_ = 0;
  int64_t blocks_per_pass_ = 0;  // training.blocks_per_pass
  std::unique_ptr<AdamW> opt_;
  drafter::DrafterMath math_ = drafter::DrafterMath::F32;
  bool fp8_ = false;  // model.drafter.precision: fp8 (the step options carry it)
  bool wgx_ = false;  // model.drafter.fp8_wgrad_x_tiles: 128x128 (likewise)
  target::ForwardOptions fopt_;
  target::PathCounters counters_;
};

}  // namespace

std::unique_ptr<TrainBackend> make_cpu_backend(const BackendSetup& s, comm::Communicator* world,
                                               comm::Communicator* tp) {
  return std::make_unique<CpuBackend>(s, world, tp);
}

#if !DFLASH_WITH_CUDA
std::unique_ptr<TrainBackend> make_cuda_backend(const BackendSetup&) {
  DFLASH_FAIL_HINT("parallel.device: cuda, but this dflash_train was built without the CUDA backend",
                   "rebuild with -DDFLASH_CUDA=ON on a machine with nvcc, or set parallel.device: cpu");
}
bool cuda_backend_available(int, std::string* why) {
  if (why) *why = "this build has no CUDA backend";
  return false;
}
#endif

}  // namespace dflash::trainer
