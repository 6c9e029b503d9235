#pragma once
// AdamW on fp32 master tensors, the learning-rate schedule and global grad-norm clipping.
//
// AdamW (Loshchilov & Hutter): with g the (clipped) gradient of the step, t the 1-based update count,
//   m = b1·m + (1-b1)·g;  v = b2·v + (1-b2)·g²
//   p -= lr · (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + lr · wd · p     (decoupled decay)
// computed in double per element, stored in f32 (masters and moments). On the CPU the masters ARE
// the drafter's weights (f32); a GPU backend refreshes its bf16 copies from them after step().
//
// Schedule over `total` optimizer steps (step s = 0, 1, ..., total-1), W = round(warmup_ratio·total):
//   s < W:  lr·(s+1)/W;  then p = (s-W)/max(1, total-W-1) in [0, 1]:
//   cosine: min_lr + (lr-min_lr)·(1+cos(pi·p))/2;  linear: min_lr + (lr-min_lr)·(1-p);  constant: lr.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "trainer/config.h"

namespace dflash::trainer {

struct LrSchedule {
  double lr = 6e-4, min_lr = 0, warmup_ratio = 0;
  Schedule kind = Schedule::Cosine;
  int64_t total_steps = 1;
  int64_t warmup_steps() const;
  double at(int64_t step) const;  // lr of optimizer step `step` (0-based)
};

struct AdamWHyper {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
};

// Global L2 norm over gradient tensors (F32 or F64 host), in double.
double global_grad_norm(const std::vector<const Tensor*>& grads);
// The factor the gradients are multiplied by: min(1, max_norm / norm) (1 when max_norm <= 0).
double clip_factor(double norm, double max_norm);

// What a checkpoint writes of the optimizer: masters and moments as named f32 host tensors
// (master.<name>, exp_avg.<name>, exp_avg_sq.<name>) and the rest (step count, hyper-parameters)
// as JSON.
struct OptimizerState {
  std::vector<std::pair<std::string, Tensor>> tensors;
  nlohmann::json json;
  int64_t steps = 0;
  // As safetensors, via tmp + fsync + rename (what AdamW::load reads).
  void save(const std::string& safetensors_path) const;
};

class AdamW {
 public:
  // params: (name, f32 host master tensor) pairs; the tensors are updated in place.
  AdamW(std::vector<std::pair<std::string, Tensor*>> params, AdamWHyper hyper);

  // One update with learning rate `lr`, gradients `grads` (F32/F64, same order and shapes as the
  // params) multiplied by `grad_factor` (the clip factor).
  void step(const std::vector<const Tensor*>& grads, double lr, double grad_factor);
  int64_t steps() const { return t_; }
  // For a device optimizer that keeps its own copies (the GPU backend): the host state that
  // save() / load() go through, and the update count it advances.
  std::vector<Tensor>& exp_avg() { return m_; }
  std::vector<Tensor>& exp_avg_sq() { return v_; }
  void set_steps(int64_t t) { t_ = t; }

  // Masters and moments as safetensors (master.<name>, exp_avg.<name>, exp_avg_sq.<name>, all f32,
  // written via tmp + fsync + rename) and the rest as JSON.
  void save(const std::string& safetensors_path) const;
  nlohmann::json state_json() const;
  // The state as it is now. With copy = false the tensors alias the optimizer's (they change with
  // the next step); with copy = true they are independent (for writing while training goes on).
  OptimizerState state(bool copy) const;
  // Restores masters (into the params), moments and the step count; throws naming a missing or
  // mis-shaped tensor.
  void load(const std::string& safetensors_path, const nlohmann::json& state);

 private:
  std::vector<std::pair<std::string, Tensor*>> params_;
  std::vector<Tensor> m_, v_;
  AdamWHyper h_;
  int64_t t_ = 0;
};

}  // namespace dflash::trainer
