// The CPU references of the drafter's training ops (kernels/cpu/train_ops.h) against central finite
// differences of their double forward (relative 1e-6) on tiny cases: the oracles of
// tests/test_cuda_train_ops.cpp are themselves checked, in every build (no GPU needed).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu/train_ops.h"
#include "test_util.h"

using namespace dflash;

namespace {

uint64_t g_seed = 9100;  // a fresh seed for every drawn vector

std::vector<double> randn(int64_t n, double stddev = 1.0, double mean = 0.0) {
  std::mt19937_64 rng(g_seed++);
  std::normal_distribution<double> dist(mean, stddev);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<double>(static_cast<float>(dist(rng)));
  return v;
}

// L = Σ dy · f(x, w); checks ∂L/∂x and ∂L/∂w of the analytic backward against central differences.
template <class Fwd, class Bwd>
void check_fd(std::vector<double> x, std::vector<double> w, const std::vector<double>& dy, Fwd fwd, Bwd bwd,
              const char* what) {
  auto loss = [&](const std::vector<double>& xx, const std::vector<double>& ww) {
    std::vector<double> y = fwd(xx, ww);
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += dy[i] * y[i];
    return l;
  };
  std::vector<double> dx, dw(w.size(), 0.0);
  bwd(x, w, dx, dw);
  const double h = 1e-5;
  // Central differences of the loss in each element of v (x or w), the other held fixed.
  auto central = [&](std::vector<double>& v) {
    std::vector<double> fd(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const double v0 = v[i];
      v[i] = v0 + h;
      const double lp = loss(x, w);
      v[i] = v0 - h;
      const double lm = loss(x, w);
      v[i] = v0;
      fd[i] = (lp - lm) / (2 * h);
    }
    return fd;
  };
  const std::vector<double> fdx = central(x), fdw = central(w);
  EXPECT_REL(dx, fdx, 1e-6, what << ": analytic dx vs finite differences");
  EXPECT_REL(dw, fdw, 1e-6, what << ": analytic dw vs finite differences");
}

TEST(TrainOpsReference, RmsNormBackwardMatchesFiniteDifferences) {
  const int64_t rows = 3, D = 7;
  const double eps = 1e-6;
  auto fwd = [&](const std::vector<double>& x, const std::vector<double>& w) {
    std::vector<double> y, rs;
    cpu::rms_norm_fwd(x, w, rows, D, eps, y, rs);
    return y;
  };
  const std::vector<double> dy = (randn(rows * D));
  auto bwd_dy = [&](const std::vector<double>& x, const std::vector<double>& w, std::vector<double>& dx,
                    std::vector<double>& dw) {
    std::vector<double> y, rs;
    cpu::rms_norm_fwd(x, w, rows, D, eps, y, rs);
    cpu::rms_norm_bwd(x, w, rs, dy, rows, D, dx, dw);
  };
  check_fd((randn(rows * D)), (randn(D, 0.5, 1.0)), dy, fwd, bwd_dy, "rms_norm");
}

TEST(TrainOpsReference, HeadNormRopeBackwardMatchesFiniteDifferences) {
  const int64_t rows = 2, heads = 3, d = 8;
  const double eps = 1e-6, theta = 100.0;
  const std::vector<int32_t> pos = {5, 123};
  auto fwd = [&](const std::vector<double>& x, const std::vector<double>& w) {
    std::vector<double> y, rs;
    cpu::head_norm_rope_fwd(x, w, pos, rows, heads, d, eps, theta, y, rs);
    return y;
  };
  const std::vector<double> dy = (randn(rows * heads * d));
  auto bwd = [&](const std::vector<double>& x, const std::vector<double>& w, std::vector<double>& dx,
                 std::vector<double>& dw) {
    std::vector<double> y, rs;
    cpu::head_norm_rope_fwd(x, w, pos, rows, heads, d, eps, theta, y, rs);
    cpu::head_norm_rope_bwd(x, w, pos, rs, dy, rows, heads, d, theta, dx, dw);
  };
  check_fd((randn(rows * heads * d)), (randn(d, 0.5, 1.0)), dy, fwd, bwd, "head_norm_rope");
}

}  // namespace
