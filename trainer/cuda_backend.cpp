// The GPU backend: one GPU per rank. The bf16 CUDA target (tensor-parallel over NCCL inside the
// TP group) captures the drafter's layers; the CUDA drafter trains data-parallel over all ranks.
// Gradients are fp32 in one flat buffer; backward reports each layer's bucket as soon as it is
// final and its NCCL all-reduce starts on a second stream while the earlier layers' backward runs.
// AdamW runs on the device on fp32 masters and refreshes the bf16 weights.
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdlib>

#include <spdlog/spdlog.h>

#include "drafter/batch.h"
#include "drafter/fast_path.h"
#include "drafter/model_cuda.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/fault.h"
#include "core/cuda/check.h"
#include "kernels/cuda/optimizer.h"
#include "core/device.h"
#include "target_model/fast_path.h"
#include "target_model/model_cuda.h"
#include "target_model/tp.h"
#include "target_model/weights.h"
#include "trainer/backend.h"
#include "trainer/faults.h"
#include "trainer/memory_plan.h"
#include "trainer/optimizer.h"

namespace dflash::trainer {

namespace {

class CudaBackend final : public TrainBackend {
 public:
  explicit CudaBackend(const BackendSetup& s) : dcfg_(s.drafter), device_(Device::cuda(s.local_rank)) {
    const TrainConfig& cfg = *s.cfg;
    const auto& ts = cfg.model.target;
    blocks_per_pass_ = cfg.training.blocks_per_pass;
    DFLASH_CUDA_CHECK(cudaSetDevice(device_.index));
    const DeviceInfo info = cuda_device_info(device_.index);
    gpu_name_ = info.name;
    stream_ = DeviceContext::get(device_.index).stream();
    DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(reinterpret_cast<cudaStream_t*>(&comm_stream_), cudaStreamNonBlocking));
    if (s.world > 1) {
      world_ = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, 0, s.rank, device_, cfg.parallel.timeout_s, "dp");
      if (s.layout.tp_size > 1)
        tp_ = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, s.layout.tp_group, s.rank, device_,
                                                   cfg.parallel.timeout_s, "tp");
    }
    // Target: this rank's shard, bf16, read slice by slice (or made from the seed).
    const int tps = s.layout.tp_size;
    const target::TargetConfig local = target::local_config(s.target, tps, static_cast<int>(cfg.parallel.ep));
    const target::Precision precision = target::resolve_precision(ts.precision, s.target);
    target::FastPathPlan plan = target::make_plan(local, device_, cfg.kernel_policies(), info.major, precision);
    fast_path_ = "target: " + plan.summary();
    // The drafter's plan (its attention: the tensor-core kernels, or the much slower fallback, which
    // require_fast_path refuses there like a target fallback).
    const bool fp8_drafter = cfg.model.drafter.precision == DrafterPrecision::Fp8;
    const bool fp8_head = cfg.model.drafter.lm_head_precision == DrafterPrecision::Fp8;
    const bool wgx = fp8_wgrad_x_blocks(cfg.model.drafter);
    precision_text_ = fmt::format("{} target, {} drafter{}", target::precision_name(precision),
                                  fp8_drafter ? (wgx ? "bf16 (block-scaled fp8 linears, weight gradients' x in 128 x 128 blocks)"
                                                     : "bf16 (block-scaled fp8 linears)")
                                              : "bf16",
                                  fp8_head ? ", fp8 LM-head cross-entropy" : "");
    drafter_plan_ = drafter::make_drafter_plan(dcfg_, device_, info.major, info.minor, cfg.kernels.require_fast_path,
                                               fp8_drafter, fp8_head);
    fast_path_ += "; " + drafter_plan_.summary();
    if (drafter_plan_.attention_fallback() && s.rank == 0)
      spdlog::warn("the drafter's attention runs the fallback kernel ({}): expect a slow step", drafter_plan_.attention().reason);
    // Memory plan from the configs, before anything is loaded: refuse what cannot fit.
    {
      const int64_t tokens = cfg.training.batch_size * cfg.data.max_length;
      const int64_t blocks = blocks_per_drafter_pass(cfg, tps);  // (training.blocks_per_pass)
      const MemoryPlan mp =
          gpu_memory_plan(local, dcfg_, tokens, cfg.data.max_length, blocks, drafter::CudaDrafter::kMinCeChunkRows,
                          precision == target::Precision::Fp8, fp8_drafter, cfg.model.target.fp8_experts, fp8_head);
      size_t free_b = 0, total_b = 0;
      DFLASH_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
      memory_plan_ = mp.table(static_cast<double>(total_b));
      plan_bytes_ = mp.total();
      check_memory_plan_fits(mp, static_cast<double>(free_b), static_cast<double>(total_b), device_.str());
    }
    fault_ = parse_cuda_fault(std::getenv("DFLASH_FAULT_CUDA_ERROR"));
    if (fault_.enabled())
      spdlog::warn("test hook DFLASH_FAULT_CUDA_ERROR: a CUDA {} fault in the {} op of step {}", fault_.kind, fault_.op, fault_.step);
    auto t0 = StepClock::now();
    target::TargetWeights tw = load_target(s, device_);
    Tensor embed = tw.embed_tokens, lm_head = tw.lm_head;
    tmodel_ = std::make_unique<target::CudaTargetModel>(local, std::move(tw), std::move(plan), tp_.get());
    DeviceContext::get(device_.index).synchronize();
    // (the live bytes after each part: what the memory plan's target weights and drafter state are checked by)
    const size_t live0 = device_alloc::stats(device_.index).allocated;
    init_log_ = fmt::format("target {} in {:.1f} s ({:.2f} GiB on the device)", ts.path.empty() ? "random init" : "load",
                            seconds_since(t0), gib(live0));
    fopt_.capture = dcfg_.target_layer_ids;
    fopt_.skip_unused_layers = true;  // no layer after the last captured one runs
    t0 = StepClock::now();
    // Drafter: masters from the seed or the warm start; the target's embeddings and LM head shared.
    // (Random masters are drawn on the device: the same values as on the host, without a minute of
    // single-core RNG and 7 GB of host staging for a 27B-sized drafter.)
    drafter::DrafterWeights init = initial_drafter_weights(s, device_);
    model_ = std::make_unique<drafter::CudaDrafter>(dcfg_, init, embed, lm_head, device_);
    init = {};
    const int64_t n = model_->flat_size();
    m_ = Tensor::zeros({n}, DType::F32, device_);
    v_ = Tensor::zeros({n}, DType::F32, device_);
    sumsq_ = Tensor::zeros({1}, DType::F32, device_);
    sumsq_ws_ = Tensor::empty({std::max<int64_t>(cuda::sum_squares_workspace(n), 1)}, DType::U8, device_);
    hyper_ = adamw_hyper(cfg);
    DeviceContext::get(device_.index).synchronize();
    init_log_ += fmt::format(", drafter + optimizer state ({:.2f} B parameters) in {:.1f} s ({:.2f} GiB more)",
                             static_cast<double>(model_->num_params()) / 1e9, seconds_since(t0),
                             gib(device_alloc::stats(device_.index).allocated - live0));
    DFLASH_CUDA_CHECK(cudaEventCreateWithFlags(&grads_ready_, cudaEventDisableTiming));
  }

  ~CudaBackend() override {
    if (grads_ready_) cudaEventDestroy(grads_ready_);
    if (comm_stream_) cudaStreamDestroy(static_cast<cudaStream_t>(comm_stream_));
  }

  std::string describe() const override {
    return device_.str() + " (" + gpu_name_ + "), " + precision_text_ + ", fp32 masters and gradients";
  }
  std::string device_name() const override { return gpu_name_; }
  int64_t num_params() const override { return model_->num_params(); }
  int64_t target_layers_run() const override { return target::layers_to_run(tmodel_->config(), fopt_); }
  std::string fast_path_summary() override { return fast_path_; }
  nlohmann::json fast_path_json() override {
    return {{"device", tmodel_->plan().device},
            {"target", tmodel_->plan().to_json()},
            {"target_layers_run", target_layers_run()},
            {"target_kernel_launches", tmodel_->counters().to_json()},
            {"drafter_attention", drafter_plan_.attention_json()},
            {"drafter", drafter_plan_.to_json()}};
  }
  void zero_grads() override { model_->zero_grads(); }

  void begin_step(int64_t step) override { step_ = step; }

  drafter::StepStats micro_step(MicroBatch& m, const drafter::StepOptions& opt, bool last, StepTimes& t) override {
    auto t0 = StepClock::now();
    in_op("target forward", "target", [&] {
      target::ForwardResult fr = tmodel_->forward(m.seqs, fopt_);
      std::vector<Tensor> layers;
      for (int64_t id : dcfg_.target_layer_ids) layers.push_back(fr.layers.at(id));
      m.batch.context = drafter::CudaDrafter::pack_context(layers);
      fr = {};
      DeviceContext::get(device_.index).synchronize();
    });
    t.target_s += seconds_since(t0);
    const bool first = !first_step_checked_;
    const size_t target_peak = first ? device_alloc::stats(device_.index).peak_allocated : 0;  // (the plan check's)
    if (m.batch.blocks.empty() || opt.grad_scale <= 0) {
      if (last) pending_ = 0;
      return {};
    }
    t0 = StepClock::now();
    pending_ = 0;
    const bool overlap = last && world_ && world_->size() > 1;
    drafter::StepStats st;
    in_op("drafter forward+backward", "drafter", [&] {
      // (training.blocks_per_pass: the blocks in passes; the all-reduce starts in the last one's backward)
      st = drafter::for_each_block_pass(m.batch, blocks_per_pass_, opt.grad_scale, [&](bool last_pass) {
        return model_->step(m.batch, opt, true, last && last_pass, [&](int64_t b) {
          if (overlap && last_pass) start_all_reduce(b);
        });
      });
      m.batch.context = Tensor{};
      // Wait for the backward the step queued (the all-reduces it started go on): drafter_s is the
      // whole forward + backward, comm_s what the all-reduce adds after it.
      DeviceContext::get(device_.index).synchronize();
    });
    t.drafter_s += seconds_since(t0);
    if (first) check_plan_after_first_step(target_peak);
    return st;
  }

  double reduce_grads(StepTimes& t) override {
    auto t0 = StepClock::now();
    if (world_ && world_->size() > 1) {
      if (pending_ == 0) {
        // Nothing overlapped (this rank had no blocks in its last micro-batch, or none at all): the
        // same bucket all-reduces now, in the same order, so every rank issues the same sequence of
        // NCCL calls whatever its share of the blocks.
        for (size_t b = 0; b < model_->buckets().size(); ++b) start_all_reduce(static_cast<int64_t>(b));
      } else {
        DFLASH_CHECK(pending_ == static_cast<int64_t>(model_->buckets().size()),
                     "gradient all-reduce: " << pending_ << " of " << model_->buckets().size() << " buckets were started");
      }
      world_->wait_async(comm_stream_, "gradient all-reduce");
      pending_ = 0;
    }
    t.comm_s += seconds_since(t0);
    // Global norm on the device (deterministic reduction), read back once.
    cuda::sum_squares(model_->grads().data<float>(), model_->flat_size(), sumsq_.data<float>(), sumsq_ws_.raw_data(), stream_);
    const double ss = sumsq_.to(Device::cpu()).data<float>()[0];
    return std::sqrt(ss);
  }

  void apply(double lr, double grad_factor, StepTimes& t) override {
    auto t0 = StepClock::now();
    ++steps_;
    cuda::AdamWParams p;
    p.master = model_->masters().data<float>(), p.grad = model_->grads().data<float>();
    p.m = m_.data<float>(), p.v = v_.data<float>(), p.weight = model_->weights().raw_data(), p.n = model_->flat_size();
    p.lr = static_cast<float>(lr), p.beta1 = static_cast<float>(hyper_.beta1), p.beta2 = static_cast<float>(hyper_.beta2);
    p.eps = static_cast<float>(hyper_.eps), p.weight_decay = static_cast<float>(hyper_.weight_decay);
    p.step = steps_, p.grad_scale_host = static_cast<float>(grad_factor);
    in_op("optimizer (AdamW)", "optimizer", [&] {
      cuda::adamw_step(p, stream_);
      DeviceContext::get(device_.index).synchronize();  // (so optimizer_s is the update, not its launch)
    });
    t.optimizer_s += seconds_since(t0);
  }

  drafter::DrafterWeights weights() override { return model_->download_masters(); }

  CheckpointState checkpoint_state() override {
    // The device state copied into the host tensors (made on first use, then reused: they stay
    // unchanged until the next call); the masters serve as the exported weights too.
    sync_host_state();
    return {host_w_, host_opt_->state(false)};
  }
  void load_optimizer(const std::string& path, const nlohmann::json& state) override {
    make_host_state();
    host_opt_->load(path, state);
    steps_ = host_opt_->steps();
    model_->upload_masters(host_w_);
    model_->from_tensors(const_pointers(host_opt_->exp_avg()), m_);
    model_->from_tensors(const_pointers(host_opt_->exp_avg_sq()), v_);
  }
  std::string init_summary() override { return init_log_; }
  std::string memory_plan() override { return memory_plan_; }

  std::string memory_summary() override {
    const AllocatorStats a = device_alloc::stats(device_.index);
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    return fmt::format("GPU memory on {}: {:.1f} GiB in use, peak {:.1f} GiB, {:.1f} GiB reserved, {:.1f} of {:.1f} GiB free",
                       device_.str(), gib(a.allocated), gib(a.peak_allocated), gib(a.reserved), gib(free_b), gib(total_b));
  }
  double peak_memory_gib() override { return gib(device_alloc::stats(device_.index).peak_allocated); }

 private:
  // Runs f, the body of the step's op `what` (fault_op: its name in DFLASH_FAULT_CUDA_ERROR); an error
  // raised inside names the op. The test hook's failing launch is queued first on the op's stream.
  template <class F>
  void in_op(const char* what, const char* fault_op, F&& f) {
    try {
      if (fault_.at(step_, fault_op)) {
        spdlog::warn("test hook DFLASH_FAULT_CUDA_ERROR: a failing CUDA launch ({}) in the {} of step {}", fault_.kind, what, step_);
        cuda::launch_fault(fault_.kind == "trap", stream_);
      }
      f();
    } catch (const Error& e) {
      throw Error(std::string(what) + ": " + e.message(), e.hint(), e.where(), e.kind());
    }
  }

  static double gib(double b) { return b / (1024.0 * 1024.0 * 1024.0); }

  // The memory plan against the first step's measured peaks (through the target forward, then the whole step):
  // logged, and a warning where the plan was low, since its start-up check then passes runs that may not fit
  // (session 29: 70.9 GiB planned, out of memory at 79.5 in the FP8 drafter's first step on an H100).
  void check_plan_after_first_step(size_t target_peak) {
    first_step_checked_ = true;
    const size_t peak = device_alloc::stats(device_.index).peak_allocated;
    spdlog::info("first step's GPU memory: peak {:.2f} GiB through the target forward, {:.2f} GiB through the drafter's "
                 "forward + backward; the memory plan said {:.2f} GiB",
                 gib(target_peak), gib(peak), gib(plan_bytes_));
    if (const std::string w = memory_plan_shortfall(plan_bytes_, static_cast<double>(peak)); !w.empty()) spdlog::warn("{}", w);
  }

  // Starts the sum of bucket b's gradients over all ranks on the comm stream, ordered after the
  // kernels queued so far on the compute stream (those that finished the bucket).
  void start_all_reduce(int64_t b) {
    const auto& bk = model_->buckets()[static_cast<size_t>(b)];
    DFLASH_CUDA_CHECK(cudaEventRecord(grads_ready_, static_cast<cudaStream_t>(stream_)));
    DFLASH_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(comm_stream_), grads_ready_, 0));
    world_->all_reduce_sum_async(model_->grads().data<float>() + bk.first, bk.end - bk.first, DType::F32, comm_stream_);
    ++pending_;
  }

  // The host-side state checkpoints go through (the CPU backend's format), made on first use: a
  // 27B-sized drafter's masters and moments are 20 GB of host memory.
  void make_host_state() {
    if (host_opt_) return;
    host_w_ = drafter::DrafterWeights::zeros(dcfg_, DType::F32);
    std::vector<std::pair<std::string, Tensor*>> params;
    for (auto& e : host_w_.entries(dcfg_)) params.emplace_back(e.name, e.tensor);
    host_opt_ = std::make_unique<AdamW>(params, hyper_);
  }
  // The device state copied into the host tensors the host AdamW saves from (in place, so the
  // optimizer's pointers to them stay valid).
  void sync_host_state() {
    make_host_state();
    host_opt_->set_steps(steps_);
    std::vector<Tensor*> masters;
    for (auto& e : host_w_.entries(dcfg_)) masters.push_back(e.tensor);
    model_->to_host(model_->masters(), masters);
    model_->to_host(m_, pointers(host_opt_->exp_avg()));
    model_->to_host(v_, pointers(host_opt_->exp_avg_sq()));
  }
  static std::vector<Tensor*> pointers(std::vector<Tensor>& v) {
    std::vector<Tensor*> out;
    for (Tensor& t : v) out.push_back(&t);
    return out;
  }
  static std::vector<const Tensor*> const_pointers(std::vector<Tensor>& v) {
    std::vector<const Tensor*> out;
    for (const Tensor& t : v) out.push_back(&t);
    return out;
  }

  drafter::DrafterConfig dcfg_;
  Device device_;
  std::string gpu_name_, fast_path_, precision_text_;  // precision_text_: "fp8 target, bf16 drafter", ... (describe)
  void* stream_ = nullptr;
  void* comm_stream_ = nullptr;
  cudaEvent_t grads_ready_ = nullptr;  // orders a bucket's all-reduce after the kernels that finished it
  std::unique_ptr<comm::Communicator> world_, tp_;
  std::unique_ptr<target::CudaTargetModel> tmodel_;
  target::ForwardOptions fopt_;
  std::unique_ptr<drafter::CudaDrafter> model_;
  Tensor m_, v_, sumsq_, sumsq_ws_;
  AdamWHyper hyper_;
  drafter::DrafterWeights host_w_;
  std::unique_ptr<AdamW> host_opt_;
  int64_t pending_ = 0, steps_ = 0;
  int64_t blocks_per_pass_ = 0;  // training.blocks_per_pass
  int64_t step_ = 0;  // the 1-based step running (begin_step)
  double plan_bytes_ = 0;            // the memory plan's total (gpu_memory_plan)
  bool first_step_checked_ = false;  // check_plan_after_first_step ran
  CudaFault fault_;   // the test hook DFLASH_FAULT_CUDA_ERROR
  std::string init_log_, memory_plan_;
  drafter::DrafterPlan drafter_plan_;
};

}  // namespace

std::unique_ptr<TrainBackend> make_cuda_backend(const BackendSetup& s) { return std::make_unique<CudaBackend>(s); }

bool cuda_backend_available(int local_ranks, std::string* why) {
  const int gpus = cuda_device_count();
  if (gpus >= local_ranks && gpus > 0) return true;
  if (why) *why = fmt::format("this node has {} visible GPU(s) for {} rank(s)", gpus, local_ranks);
  return false;
}

}  // namespace dflash::trainer
