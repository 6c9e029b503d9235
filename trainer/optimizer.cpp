#include "trainer/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/io/safetensors.h"
#include "kernels/cpu/gemm.h"

namespace dflash::trainer {

int64_t LrSchedule::warmup_steps() const {
  return std::clamp<int64_t>(std::llround(warmup_ratio * static_cast<double>(total_steps)), 0, total_steps);
}

double LrSchedule::at(int64_t step) const {
  const int64_t W = warmup_steps();
  if (step < W) return lr * static_cast<double>(step + 1) / static_cast<double>(W);
  if (kind == Schedule::Constant) return lr;
  const int64_t span = std::max<int64_t>(1, total_steps - W - 1);
  const double p = std::clamp(static_cast<double>(step - W) / static_cast<double>(span), 0.0, 1.0);
  if (kind == Schedule::Linear) return min_lr + (lr - min_lr) * (1.0 - p);
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
}

namespace {
// f(i, value) for the elements [begin, end) of a contiguous host gradient (F32 / F64).
template <typename F>
void for_each_value(const Tensor& t, F&& f, int64_t begin = 0, int64_t end = -1) {
  DFLASH_CHECK(t.device().is_cpu() && t.is_contiguous(), "optimizer: gradient must be a contiguous host tensor, got "
                                                           << t.describe());
  if (end < 0) end = t.numel();
  if (t.dtype() == DType::F64) {
    const double* p = t.data<double>();
    for (int64_t i = begin; i < end; ++i) f(i, p[i]);
  } else if (t.dtype() == DType::F32) {
    const float* p = t.data<float>();
    for (int64_t i = begin; i < end; ++i) f(i, static_cast<double>(p[i]));
  } else {
    DFLASH_FAIL("optimizer: gradients must be f32 or f64, got " << t.describe());
  }
}
}  // namespace

double global_grad_norm(const std::vector<const Tensor*>& grads) {
  double ss = 0;
  for (const Tensor* g : grads) for_each_value(*g, [&](int64_t, double x) { ss += x * x; });
  return std::sqrt(ss);
}

double clip_factor(double norm, double max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0;
  return max_norm / norm;
}

AdamW::AdamW(std::vector<std::pair<std::string, Tensor*>> params, AdamWHyper hyper)
    : params_(std::move(params)), h_(hyper) {
  for (auto& [name, p] : params_) {
    DFLASH_CHECK(p->dtype() == DType::F32 && p->device().is_cpu() && p->is_contiguous(),
                 "optimizer: master '" << name << "' must be a contiguous f32 host tensor, got " << p->describe());
    m_.push_back(Tensor::zeros(p->shape(), DType::F32));
    v_.push_back(Tensor::zeros(p->shape(), DType::F32));
  }
}

void AdamW::step(const std::vector<const Tensor*>& grads, double lr, double grad_factor) {
  DFLASH_CHECK(grads.size() == params_.size(), "optimizer: " << grads.size() << " gradients for " << params_.size()
                                                             << " parameters");
  ++t_;
  const double b1 = h_.beta1, b2 = h_.beta2;
  const double c1 = 1.0 - std::pow(b1, static_cast<double>(t_)), c2 = 1.0 - std::pow(b2, static_cast<double>(t_));
  for (size_t k = 0; k < params_.size(); ++k) {
    Tensor& p = *params_[k].second;
    DFLASH_CHECK(grads[k]->numel() == p.numel(), "optimizer: gradient of '" << params_[k].first << "' has "
                                                                             << grads[k]->numel() << " elements, expected "
                                                                             << p.numel());
    float* pw = p.data<float>();
    float* m = m_[k].data<float>();
    float* v = v_[k].data<float>();
    const Tensor& gk = *grads[k];
    DFLASH_CHECK(gk.device().is_cpu() && gk.is_contiguous() && (gk.dtype() == DType::F32 || gk.dtype() == DType::F64),
                 "optimizer: gradient of '" << params_[k].first << "' must be a contiguous f32 / f64 host tensor, got "
                                            << gk.describe());
    // Each element on its own: chunks on the CPU worker threads give the same bits as one loop. F32
    // gradients (the CPU backend's f32 drafter) update in float, a loop the compiler vectorizes; F64 ones
    // (the double reference) in double.
    constexpr int64_t kChunk = 1 << 15;
    const int64_t n = p.numel();
    if (gk.dtype() == DType::F32) {
      const float* g32 = gk.data<float>();
      const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2), gf = static_cast<float>(grad_factor);
      const float step = static_cast<float>(lr / c1), decay = static_cast<float>(1.0 - lr * h_.weight_decay);
      const float rc2 = static_cast<float>(1.0 / c2), eps = static_cast<float>(h_.eps);
      cpu::parallel_for((n + kChunk - 1) / kChunk, [&](int64_t c) {
        const int64_t e = std::min(n, (c + 1) * kChunk);
        for (int64_t i = c * kChunk; i < e; ++i) {
          const float g = g32[i] * gf;
          const float mi = fb1 * m[i] + (1.0f - fb1) * g, vi = fb2 * v[i] + (1.0f - fb2) * g * g;
          m[i] = mi, v[i] = vi;
          pw[i] = pw[i] * decay - step * mi / (std::sqrt(vi * rc2) + eps);
        }
      });
      continue;
    }
    auto update = [&](int64_t i, double g0) {
      const double g = g0 * grad_factor;
      const double mi = b1 * m[i] + (1.0 - b1) * g;
      const double vi = b2 * v[i] + (1.0 - b2) * g * g;
      m[i] = static_cast<float>(mi);
      v[i] = static_cast<float>(vi);
      double w = pw[i];
      w -= lr * h_.weight_decay * w;
      w -= lr * (mi / c1) / (std::sqrt(vi / c2) + h_.eps);
      pw[i] = static_cast<float>(w);
    };
    cpu::parallel_for((n + kChunk - 1) / kChunk, [&](int64_t c) {
      for_each_value(gk, update, c * kChunk, std::min(n, (c + 1) * kChunk));
    });
  }
}

void OptimizerState::save(const std::string& path) const {
  io::save_safetensors(path, tensors, {{"format", "dflash.adamw.v1"}, {"step", std::to_string(steps)}});
}

OptimizerState AdamW::state(bool copy) const {
  OptimizerState st;
  auto take = [&](const Tensor& t) { return copy ? t.clone() : t; };
  for (size_t k = 0; k < params_.size(); ++k) {
    st.tensors.emplace_back("master." + params_[k].first, take(*params_[k].second));
    st.tensors.emplace_back("exp_avg." + params_[k].first, take(m_[k]));
    st.tensors.emplace_back("exp_avg_sq." + params_[k].first, take(v_[k]));
  }
  st.json = state_json();
  st.steps = t_;
  return st;
}

void AdamW::save(const std::string& path) const { state(false).save(path); }

nlohmann::json AdamW::state_json() const {
  return {{"step", t_}, {"beta1", h_.beta1}, {"beta2", h_.beta2}, {"eps", h_.eps}, {"weight_decay", h_.weight_decay}};
}

void AdamW::load(const std::string& path, const nlohmann::json& state) {
  io::SafetensorsFile f(path);
  auto get = [&](const std::string& name, Tensor& dst) {
    DFLASH_CHECK_HINT(f.has(name), path << ": optimizer state has no tensor '" << name << "'",
                      "the checkpoint was written for another drafter config");
    Tensor t = f.tensor(name);
    DFLASH_CHECK(t.shape() == dst.shape() && t.dtype() == DType::F32,
                 path << ": optimizer tensor '" << name << "' is " << t.describe() << ", expected f32"
                      << shape_str(dst.shape()));
    dst.copy_from(t);
  };
  for (size_t k = 0; k < params_.size(); ++k) {
    get("master." + params_[k].first, *params_[k].second);
    get("exp_avg." + params_[k].first, m_[k]);
    get("exp_avg_sq." + params_[k].first, v_[k]);
  }
  t_ = state.at("step").get<int64_t>();
}

}  // namespace dflash::trainer
