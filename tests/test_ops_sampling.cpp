// The CPU reference of temperature / top-p sampling (ops::sample_rows, kernels/cpu/sampling.cpp),
// the oracle of cuda::sample_rows, checked against its definition: over many positions the tokens'
// frequencies match the softmax of z restricted to the nucleus and renormalized (chi-square test),
// tokens outside the nucleus never appear, ties at z_c are all kept, a tiny top_p and a very low
// temperature are the argmax, NaN is never chosen, and bad parameters are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "kernels/ops.h"
#include "core/random.h"
#include "test_util.h"

using namespace dflash;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// The upper 1e-6 quantile of the chi-square distribution with df degrees of freedom
// (Wilson-Hilferty: within ~1 % of the exact quantile for df >= 2, z = 4.7534 the normal quantile).
double chi2_critical_1e6(int df) {
  const double k = df, z = 4.7534;
  const double c = 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k));
  return k * c * c * c;
}

// Counts of each token over n draws of the one row `logits` (stream i % 3, position i / 3).
std::vector<int64_t> draw_counts(const std::vector<float>& logits, const ops::SampleParams& sp, int64_t n) {
  const int64_t V = static_cast<int64_t>(logits.size());
  Tensor x = Tensor::empty({n, V}, DType::F32);
  for (int64_t i = 0; i < n; ++i) std::copy(logits.begin(), logits.end(), x.data<float>() + i * V);
  std::vector<uint64_t> streams(static_cast<size_t>(n));
  std::vector<int64_t> positions(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) streams[static_cast<size_t>(i)] = static_cast<uint64_t>(i % 3), positions[static_cast<size_t>(i)] = i / 3;
  std::vector<int32_t> out;
  ops::sample_rows(x, sp, streams, positions, out);
  std::vector<int64_t> counts(static_cast<size_t>(V), 0);
  for (int32_t t : out) {
    EXPECT_TRUE(t >= 0 && t < V) << "token " << t;
    if (t >= 0 && t < V) ++counts[static_cast<size_t>(t)];
  }
  return counts;
}

}  // namespace

// Frequencies over 300k positions against the renormalized nucleus softmax, in double from the
// definition (kernels/ops.h): chi-square over the nucleus tokens with nonzero probability, each test's
// false-failure probability 1e-6 (for a random choice of seed; the seeds here are fixed). Tokens outside
// the nucleus (and NaN, and -inf) must never appear.
TEST(OpsSampling, FrequenciesMatchTheNucleusSoftmax) {
  const std::vector<float> logits{2.0f, 1.5f, 1.2f, 1.0f, kNaN, 0.7f, 0.3f, 0.0f, -0.5f, -1.0f, -kInf, -2.0f};
  const int64_t V = static_cast<int64_t>(logits.size()), n = 300000;
  struct Case {
    float temperature, top_p;
    int nucleus_size;  // expected |nucleus| (the non-NaN tokens when top_p = 1)
  };
  for (const Case& c : {Case{1.0f, 1.0f, 11}, Case{0.7f, 0.8f, 4}, Case{2.5f, 0.6f, 5}, Case{1.0f, 0.95f, 7},
                        Case{0.3f, 0.5f, 1}}) {
    const ops::SampleParams sp{c.temperature, c.top_p, 2024};
    std::vector<float> z(logits.size());
    for (size_t v = 0; v < z.size(); ++v) z[v] = logits[v] / c.temperature;
    double margin = 0;
    const float zc = ops::nucleus_threshold(z.data(), V, c.top_p, &margin);
    if (c.top_p < 1.0f) {
      ASSERT_GT(margin, 1e-3) << "the case must sit clear of the top_p boundary";
    }
    std::vector<double> p(logits.size(), 0.0);
    double m = -INFINITY, sum = 0;
    int size = 0;
    for (float zv : z)
      if (zv >= zc) m = std::max(m, static_cast<double>(zv));
    for (size_t v = 0; v < z.size(); ++v)
      if (z[v] >= zc) p[v] = std::exp(static_cast<double>(z[v]) - m), sum += p[v], ++size;
    EXPECT_EQ(size, c.nucleus_size) << "T " << c.temperature << " top_p " << c.top_p;
    const std::vector<int64_t> counts = draw_counts(logits, sp, n);
    double chi2 = 0;
    int cells = 0;
    for (size_t v = 0; v < z.size(); ++v) {
      const double e = p[v] / sum * static_cast<double>(n);
      if (e == 0) {
        EXPECT_EQ(counts[v], 0) << "token " << v << " (z " << z[v] << ", outside the nucleus or of zero mass) appeared"
                                << " at T " << c.temperature << " top_p " << c.top_p;
        continue;
      }
      ASSERT_GE(e, 20.0) << "the chi-square approximation needs the expected counts large";
      chi2 += (static_cast<double>(counts[v]) - e) * (static_cast<double>(counts[v]) - e) / e;
      ++cells;
    }
    if (cells >= 2) {
      const double crit = chi2_critical_1e6(cells - 1);
      EXPECT_LT(chi2, crit) << "T " << c.temperature << " top_p " << c.top_p << ": chi-square " << chi2 << " over "
                            << cells << " tokens";
      std::printf("T %.1f top_p %.2f: nucleus of %d, chi-square %.2f (df %d, 1e-6 critical value %.1f)\n", c.temperature,
                  c.top_p, size, chi2, cells - 1, crit);
    } else {
      EXPECT_EQ(counts[static_cast<size_t>(std::max_element(p.begin(), p.end()) - p.begin())], n);
    }
  }
}

// Ties at z_c are all kept (and drawn uniformly): values {1, 0, 1, 1, 0}, top_p 0.3 — the group of
// 1s holds 3e / (3e + 2) = 0.80 of the mass, so the nucleus is the three 1s, 1/3 each.
TEST(OpsSampling, TiesAtTheThresholdAreAllKept) {
  const std::vector<float> logits{1.0f, 0.0f, 1.0f, 1.0f, 0.0f};
  const int64_t n = 90000;
  const std::vector<int64_t> counts = draw_counts(logits, {1.0f, 0.3f, 9}, n);
  EXPECT_EQ(counts[1] + counts[4], 0);
  double chi2 = 0;
  for (int v : {0, 2, 3}) chi2 += std::pow(static_cast<double>(counts[static_cast<size_t>(v)]) - n / 3.0, 2) / (n / 3.0);
  EXPECT_LT(chi2, chi2_critical_1e6(2)) << counts[0] << " " << counts[2] << " " << counts[3];
}

// top_p so small that only the maximum's mass (1 of a total <= V) reaches it, and a temperature so
// low that the planted gap of 0.01 between the best and second logit (100 in z) beats any Gumbel
// difference (G lies in [-2.9, 17.4]): both give the argmax, on every row and position.
TEST(OpsSampling, TinyTopPAndLowTemperatureAreTheArgmax) {
  const int64_t R = 300, V = 1000;
  Tensor x = Tensor::empty({R, V}, DType::F32);
  fill_normal(x, {5, 1, 0}, 0.0f, 1.0f);
  for (int64_t r = 0; r < R; ++r) {
    float* row = x.data<float>() + r * V;
    int64_t a = 0;
    for (int64_t v = 1; v < V; ++v) a = row[v] > row[a] ? v : a;
    float second = -INFINITY;
    for (int64_t v = 0; v < V; ++v) second = v == a ? second : std::max(second, row[v]);
    row[a] = std::max(row[a], second + 0.01f);
  }
  std::vector<int32_t> argmax;
  ops::argmax_rows(x, argmax);
  std::vector<uint64_t> streams(static_cast<size_t>(R));
  std::vector<int64_t> positions(static_cast<size_t>(R));
  std::mt19937_64 g(3);
  for (int64_t r = 0; r < R; ++r) streams[static_cast<size_t>(r)] = g(), positions[static_cast<size_t>(r)] = static_cast<int64_t>(g() % 100000);
  for (const ops::SampleParams& sp : {ops::SampleParams{1.0f, 1e-7f, 1}, ops::SampleParams{2.5f, 1e-7f, 2},
                                      ops::SampleParams{1e-4f, 1.0f, 3}, ops::SampleParams{1e-4f, 0.9f, 4}}) {
    std::vector<int32_t> out;
    ops::sample_rows(x, sp, streams, positions, out);
    for (int64_t r = 0; r < R; ++r)
      ASSERT_EQ(out[static_cast<size_t>(r)], argmax[static_cast<size_t>(r)]) << "T " << sp.temperature << " top_p " << sp.top_p << " row " << r;
  }
}

// NaN entries are never chosen (a row of NaN gives 0); a row's token does not depend on the batch.
TEST(OpsSampling, NaNNeverChosenAndRowsIndependent) {
  const int64_t V = 6;
  Tensor x = Tensor::from_vector({kNaN, kNaN, kNaN, kNaN, kNaN, kNaN,    // all NaN: 0
                                  kNaN, 3.0f, kNaN, kNaN, kNaN, kNaN,    // the one number
                                  kNaN, -kInf, kNaN, -kInf, kNaN, kNaN,  // all -inf: the first
                                  0.5f, kNaN, 0.1f, kNaN, 0.2f, 0.4f},
                                 {4, V});
  for (float top_p : {1.0f, 0.5f}) {
    std::vector<int32_t> out;
    ops::sample_rows(x, {1.0f, top_p, 0}, {1, 2, 3, 4}, {10, 20, 30, 40}, out);
    EXPECT_EQ(out[0], 0);
    EXPECT_EQ(out[1], 1);
    EXPECT_EQ(out[2], 1);
    EXPECT_TRUE(out[3] == 0 || out[3] == 2 || out[3] == 4 || out[3] == 5) << out[3];
    std::vector<int32_t> alone;
    ops::sample_rows(x.slice(0, 3, 4), {1.0f, top_p, 0}, {4}, {40}, alone);
    EXPECT_EQ(alone[0], out[3]);
  }
}

TEST(OpsSampling, BadParametersAreRefused) {
  for (float t : {0.0f, -1.0f, kNaN, kInf})
    EXPECT_NE(error_of([&] { ops::check_sample_params({t, 1.0f, 0}); }).find("temperature"), std::string::npos) << t;
  for (float p : {0.0f, -0.1f, 1.5f, kNaN, kInf})
    EXPECT_NE(error_of([&] { ops::check_sample_params({1.0f, p, 0}); }).find("top_p"), std::string::npos) << p;
  EXPECT_EQ(error_of([] { ops::check_sample_params({0.7f, 0.9f, 0}); }), "");
  EXPECT_EQ(error_of([] { ops::check_sample_params({1.0f, 1.0f, 0}); }), "");
  Tensor x = Tensor::zeros({1, 4}, DType::F32);
  std::vector<int32_t> out;
  EXPECT_NE(error_of([&] { ops::sample_rows(x, {0.0f, 1.0f, 0}, {0}, {0}, out); }).find("temperature"), std::string::npos);
  EXPECT_NE(error_of([&] { ops::sample_rows(x, {1.0f, 1.5f, 0}, {0}, {0}, out); }).find("top_p"), std::string::npos);
  EXPECT_NE(error_of([&] { ops::sample_rows(x, {1.0f, 1.0f, 0}, {0, 1}, {0}, out); }).find("1 rows but 2 streams"),
            std::string::npos);
}
