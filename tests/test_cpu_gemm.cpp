// kernels/cpu/gemm.h: the f32 GEMM against a double-precision product on fresh random inputs (every
// transpose combination, awkward sizes: one row, sizes off the 16-column and k-range tiles, leading
// dimensions larger than the rows), outputs poisoned with NaN; and its determinism contract: the same
// bits on 1, 2 and 3 threads, a row's values independent of the other rows of the product, and every
// instruction set the CPU runs giving the bits of the documented order of sums.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/gemm.h"

namespace dflash::cpu {
namespace {

struct Case {
  Trans ta, tb;
  int64_t M, N, K;
};

struct Operands {
  std::vector<float> A, B;
  int64_t lda, ldb;
};

// Random operands stored as op() asks, with leading dimensions 3 larger than needed (padding NaN:
// an element read outside the operand poisons the result).
Operands draw(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  Operands o;
  const int64_t ar = c.ta == Trans::N ? c.M : c.K, ac = c.ta == Trans::N ? c.K : c.M;
  const int64_t br = c.tb == Trans::N ? c.K : c.N, bc = c.tb == Trans::N ? c.N : c.K;
  o.lda = ac + 3, o.ldb = bc + 3;
  o.A.assign(static_cast<size_t>(ar * o.lda), NAN);
  o.B.assign(static_cast<size_t>(br * o.ldb), NAN);
  for (int64_t r = 0; r < ar; ++r)
    for (int64_t x = 0; x < ac; ++x) o.A[r * o.lda + x] = nd(rng);
  for (int64_t r = 0; r < br; ++r)
    for (int64_t x = 0; x < bc; ++x) o.B[r * o.ldb + x] = nd(rng);
  return o;
}

double at_a(const Case& c, const Operands& o, int64_t i, int64_t k) {
  return c.ta == Trans::N ? o.A[i * o.lda + k] : o.A[k * o.lda + i];
}
double at_b(const Case& c, const Operands& o, int64_t k, int64_t j) {
  return c.tb == Trans::N ? o.B[k * o.ldb + j] : o.B[j * o.ldb + k];
}

std::vector<float> run(const Case& c, const Operands& o, int64_t ldc, const std::vector<float>* init) {
  std::vector<float> C = init ? *init : std::vector<float>(static_cast<size_t>(c.M * ldc), NAN);
  gemm_f32(c.ta, c.tb, c.M, c.N, c.K, o.A.data(), o.lda, o.B.data(), o.ldb, init != nullptr, C.data(), ldc);
  return C;
}

const Case kCases[] = {
    {Trans::N, Trans::T, 1, 1, 1},     {Trans::N, Trans::T, 1, 4096, 256}, {Trans::N, Trans::T, 37, 100, 300},
    {Trans::N, Trans::N, 130, 17, 513}, {Trans::T, Trans::N, 256, 64, 97},  {Trans::T, Trans::T, 13, 250, 9},
    {Trans::N, Trans::T, 200, 520, 64}, {Trans::N, Trans::N, 5, 33, 1024}, {Trans::T, Trans::N, 97, 129, 260},
};

TEST(CpuGemm, MatchesDoubleProductEveryTransposeAndAwkwardSizes) {
  std::printf("isa %s, %d threads\n", gemm_isa(), cpu_threads());
  uint64_t seed = std::random_device{}();
  for (const Case& c : kCases) {
    SCOPED_TRACE(testing::Message() << "ta " << (c.ta == Trans::T) << " tb " << (c.tb == Trans::T) << " M " << c.M
                                    << " N " << c.N << " K " << c.K << " seed " << seed);
    const Operands o = draw(c, seed++);
    const int64_t ldc = c.N + 5;
    for (bool accumulate : {false, true}) {
      std::vector<float> init(static_cast<size_t>(c.M * ldc), NAN);
      for (int64_t i = 0; i < c.M; ++i)
        for (int64_t j = 0; j < c.N; ++j) init[i * ldc + j] = static_cast<float>((i * 7 + j * 3) % 11) - 5.0f;
      const std::vector<float> C = run(c, o, ldc, accumulate ? &init : nullptr);
      // Bound: f32 products summed in f32 over K terms: |err| <= ~K · 2^-24 · Σ|a·b| (taken 4x looser).
      for (int64_t i = 0; i < c.M; ++i) {
        for (int64_t j = 0; j < c.N; ++j) {
          double ref = accumulate ? init[i * ldc + j] : 0.0, mag = std::fabs(ref);
          for (int64_t k = 0; k < c.K; ++k) {
            const double p = at_a(c, o, i, k) * at_b(c, o, k, j);
            ref += p, mag += std::fabs(p);
          }
          const float got = C[i * ldc + j];
          ASSERT_FALSE(std::isnan(got)) << "C[" << i << "][" << j << "] not written";
          ASSERT_LE(std::fabs(got - ref), 4.0 * static_cast<double>(c.K + 1) * 0x1p-24 * mag + 1e-30)
              << "C[" << i << "][" << j << "] = " << got << ", double product " << ref;
        }
        for (int64_t j = c.N; j < ldc; ++j)
          ASSERT_TRUE(std::isnan(C[i * ldc + j]))
              << "wrote C[" << i << "][" << j << "] beyond N";
      }
    }
  }
}

TEST(CpuGemm, SameBitsOnAnyThreadCountAndForAnyRowSubset) {
  const int saved = cpu_threads();
  uint64_t seed = std::random_device{}();
  for (const Case& c : kCases) {
    SCOPED_TRACE(testing::Message() << "M " << c.M << " N " << c.N << " K " << c.K << " seed " << seed);
    const Operands o = draw(c, seed++);
    set_cpu_threads(1);
    const std::vector<float> one = run(c, o, c.N, nullptr);
    set_cpu_threads(2);
    const std::vector<float> two = run(c, o, c.N, nullptr);
    set_cpu_threads(3);
    const std::vector<float> three = run(c, o, c.N, nullptr);
    for (size_t i = 0; i < one.size(); ++i) {
      ASSERT_EQ(one[i], two[i]) << "element " << i << ": 1 thread vs 2";
      ASSERT_EQ(one[i], three[i]) << "element " << i << ": 1 thread vs 3";
    }
    // The last row alone (A of op N: its row; op T: its column) gives that row's bits of the whole product.
    if (c.M > 1) {
      std::vector<float> last(static_cast<size_t>(c.N), NAN);
      const float* a = c.ta == Trans::N ? o.A.data() + (c.M - 1) * o.lda : o.A.data() + (c.M - 1);
      gemm_f32(c.ta, c.tb, 1, c.N, c.K, a, o.lda, o.B.data(), o.ldb, false, last.data(), c.N);
      for (int64_t j = 0; j < c.N; ++j) ASSERT_EQ(last[j], one[(c.M - 1) * c.N + j]) << "column " << j;
    }
  }
  set_cpu_threads(saved);
}

// The documented order of an element's sum, written out here: the NT path's 8 interleaved lanes of fused
// multiply-adds (a K tail's lanes multiply zeros) reduced by ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7));
// the packed path's fused multiply-adds over k ascending within 256-long k ranges, each range's sum added to the
// element in order. With `init` (accumulating) the sums are added to *init the same way.
float documented_sum(const Case& c, const Operands& o, int64_t i, int64_t j, const float* init) {
  if (c.ta == Trans::N && c.tb == Trans::T) {
    float l[8] = {};
    for (int64_t k = 0; k < (c.K + 7) / 8 * 8; ++k) {
      const bool in = k < c.K;
      l[k % 8] = std::fma(in ? static_cast<float>(at_a(c, o, i, k)) : 0.0f, in ? static_cast<float>(at_b(c, o, k, j)) : 0.0f,
                          l[k % 8]);
    }
    const float sum = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    return init ? *init + sum : sum;
  }
  float total = init ? *init : 0.0f;
  for (int64_t k0 = 0; k0 < c.K; k0 += 256) {
    float part = 0.0f;
    for (int64_t k = k0; k < std::min<int64_t>(c.K, k0 + 256); ++k)
      part = std::fma(static_cast<float>(at_a(c, o, i, k)), static_cast<float>(at_b(c, o, k, j)), part);
    total = k0 == 0 && !init ? part : total + part;
  }
  return total;
}

TEST(CpuGemm, SameBitsOnEveryInstructionSetInTheDocumentedOrder) {
  const std::string saved = gemm_isa();
  const std::vector<std::string> isas = gemm_isas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.back(), "portable");
  std::cout << "instruction sets on this CPU:";
  for (const std::string& n : isas) std::cout << " " << n;
  std::cout << "\n";
  uint64_t seed = std::random_device{}();
  for (const Case& c : kCases) {
    SCOPED_TRACE(testing::Message() << "M " << c.M << " N " << c.N << " K " << c.K << " seed " << seed);
    const Operands o = draw(c, seed++);
    std::vector<float> init(static_cast<size_t>(c.M * c.N));
    for (size_t i = 0; i < init.size(); ++i) init[i] = static_cast<float>(i % 7) - 3.0f;
    std::vector<std::vector<float>> got, got_acc;
    for (const std::string& n : isas) {
      set_gemm_isa(n);
      ASSERT_EQ(n, gemm_isa());
      got.push_back(run(c, o, c.N, nullptr));
      got_acc.push_back(run(c, o, c.N, &init));
    }
    for (int64_t i = 0; i < c.M; ++i)
      for (int64_t j = 0; j < c.N; ++j) {
        const size_t e = static_cast<size_t>(i * c.N + j);
        const float want = documented_sum(c, o, i, j, nullptr), want_acc = documented_sum(c, o, i, j, &init[e]);
        for (size_t t = 0; t < isas.size(); ++t) {
          ASSERT_EQ(got[t][e], want) << isas[t] << ", element (" << i << ", " << j << ")";
          ASSERT_EQ(got_acc[t][e], want_acc) << isas[t] << " accumulating, element (" << i << ", " << j << ")";
        }
      }
  }
  EXPECT_THROW(set_gemm_isa("sse9"), std::invalid_argument);
  set_gemm_isa(saved);
}

TEST(CpuGemm, ParallelForRunsEveryIndexOnceNestsAndRethrows) {
  const int saved = cpu_threads();
  set_cpu_threads(4);
  std::vector<int> hits(1000, 0), inner(50 * 20, 0);
  parallel_for(1000, [&](int64_t i) { ++hits[static_cast<size_t>(i)]; });
  for (int h : hits) ASSERT_EQ(h, 1);
  parallel_for(50, [&](int64_t i) { parallel_for(20, [&](int64_t j) { ++inner[static_cast<size_t>(i * 20 + j)]; }); });
  for (int h : inner) ASSERT_EQ(h, 1);
  // A task's exception reaches the caller, and the pool serves the next region.
  EXPECT_THROW(parallel_for(100, [](int64_t i) { if (i == 37) throw std::runtime_error("task 37"); }), std::runtime_error);
  std::vector<int> again(100, 0);
  parallel_for(100, [&](int64_t i) { ++again[static_cast<size_t>(i)]; });
  for (int h : again) ASSERT_EQ(h, 1);
  set_cpu_threads(saved);
}

}  // namespace
}  // namespace dflash::cpu
