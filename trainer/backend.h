#pragma once
// Where dflash_train's step runs: the CPU reference (f32 target, double drafter, MPI) or one GPU
// per rank (bf16 CUDA target with tensor parallelism over NCCL, the CUDA drafter, AdamW on the
// device, gradients all-reduced in buckets while backward runs). The loop in train.cpp (data,
// anchors, loss normalisation, metrics, checkpoints, resume, stop) is the same for both.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "drafter/config.h"
#include "drafter/loss.h"
#include "drafter/model.h"
#include "drafter/weights.h"
#include "target_model/config.h"
#include "target_model/weights.h"
#include "trainer/config.h"
#include "trainer/optimizer.h"

namespace dflash::trainer {

struct MicroBatch {
  std::vector<std::vector<int32_t>> seqs;  // token ids per sequence (the target's input)
  drafter::DrafterBatch batch;             // tokens, loss_mask, offsets and this rank's blocks; the
                                           // backend fills batch.context from the target
  int64_t tokens = 0;
};

using StepClock = std::chrono::steady_clock;
inline double seconds_since(StepClock::time_point t0) {
  return std::chrono::duration<double>(StepClock::now() - t0).count();
}

struct StepTimes {
  double target_s = 0, drafter_s = 0, comm_s = 0, optimizer_s = 0;
  void add(const StepTimes& o) {
    target_s += o.target_s, drafter_s += o.drafter_s, comm_s += o.comm_s, optimizer_s += o.optimizer_s;
  }
};

struct BackendSetup {
  const TrainConfig* cfg = nullptr;
  target::TargetConfig target;      // the full target
  drafter::DrafterConfig drafter;
  comm::Layout layout;
  int world = 1, rank = 0;
  int local_rank = 0, local_size = 1;  // on this node (the GPU a rank uses is its local rank)
};

class TrainBackend {
 public:
  virtual ~TrainBackend() = default;
  virtual std::string describe() const = 0;  // "cpu" / "cuda:0 (NVIDIA H200)"
  // The benchmark rows' gpu field: the GPU's name ("NVIDIA H200"), "cpu" on the CPU reference.
  virtual std::string device_name() const { return "cpu"; }
  virtual int64_t num_params() const = 0;
  // The target layers a training forward runs (target::layers_to_run of the backend's own
  // ForwardOptions: the layers after the last captured one are skipped); MFU counts these.
  virtual int64_t target_layers_run() const = 0;
  virtual void zero_grads() = 0;
  // The 1-based step about to run (before its micro-steps): for messages and test hooks.
  virtual void begin_step(int64_t /*step*/) {}
  // The target forward of the micro-batch (capturing the drafter's layers), then the drafter step
  // (forward, and backward when grad_scale > 0); gradients accumulate. `last` marks the step's last
  // micro-batch (a GPU backend starts its bucketed all-reduce during that backward).
  virtual drafter::StepStats micro_step(MicroBatch& m, const drafter::StepOptions& opt, bool last, StepTimes& t) = 0;
  // Sums the gradients over all ranks (finishing what micro_step started) and returns the global
  // L2 norm of the summed gradient (NaN / inf when non-finite).
  virtual double reduce_grads(StepTimes& t) = 0;
  // AdamW with learning rate lr on the gradients times grad_factor (the clip factor).
  virtual void apply(double lr, double grad_factor, StepTimes& t) = 0;
  // Host copy of the current weights (for the export).
  virtual drafter::DrafterWeights weights() = 0;
  // What a checkpoint writes: the drafter's weights and the optimizer state, on the host, left
  // unchanged by training until the next checkpoint_state() call (so a checkpoint can be written
  // by another thread while the next steps run).
  struct CheckpointState {
    drafter::DrafterWeights weights;
    OptimizerState optimizer;
  };
  virtual CheckpointState checkpoint_state() = 0;
  virtual void load_optimizer(const std::string& path, const nlohmann::json& state) = 0;
  // One line on memory use for the log (empty on the CPU), and the peak in GiB (0 on the CPU).
  virtual std::string memory_summary() { return ""; }
  virtual double peak_memory_gib() { return 0; }
  // The memory plan per GPU (estimated from the configs before loading; empty on the CPU).
  virtual std::string memory_plan() { return ""; }
  // How long loading / initialising took, for the log (may be empty).
  virtual std::string init_summary() { return ""; }
  // Fast-path summary of the target's and the drafter's plans (empty on the CPU).
  virtual std::string fast_path_summary() { return ""; }
  // An MoE target's load balance so far: (token, expert) pairs per expert group (empty otherwise).
  virtual std::string expert_load() { return ""; }
  // This rank's fast-path record for run_dir/fast_path.json: device, the target's per-layer plan,
  // the kernels launched so far per step and path, the drafter's attention path ("drafter_attention")
  // and the drafter's whole plan ("drafter", drafter/fast_path.h).
  virtual nlohmann::json fast_path_json() = 0;
};

// What both backends load and make the same way (backend.cpp).
// This rank's TP shard of the target (s.layout) on `device`: the checkpoint's slices, or the seed's
// random weights (target::load_target_shard).
target::TargetWeights load_target(const BackendSetup& s, Device device);
// The drafter's initial fp32 weights: from training.seed (drawn on `device`: the same values on
// every device) or model.drafter.warm_start (on the host).
drafter::DrafterWeights initial_drafter_weights(const BackendSetup& s, Device device);
// AdamW's hyper-parameters from the training section.
AdamWHyper adamw_hyper(const TrainConfig& cfg);

std::unique_ptr<TrainBackend> make_cpu_backend(const BackendSetup& s, comm::Communicator* world,
                                               comm::Communicator* tp);
// Built with the CUDA backend only (throws otherwise, naming the way out).
std::unique_ptr<TrainBackend> make_cuda_backend(const BackendSetup& s);
// Whether this build has the CUDA backend and this rank has a GPU of its own.
bool cuda_backend_available(int local_ranks, std::string* why);

}  // namespace dflash::trainer
