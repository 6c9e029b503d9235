#pragma once
// Small helpers shared by the test suites (in namespace dflash, so unqualified calls on Tensors
// find them by argument-dependent lookup).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <limits>
#include <sstream>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/random.h"
#include "core/tensor.h"

// First statement of every test that needs a GPU: skips (not fails) on machines without one.
#define DFLASH_REQUIRE_GPU()                                                          \
  do {                                                                                \
    if (::dflash::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

namespace dflash {

// Host copy of any tensor's elements as doubles (row-major).
inline std::vector<double> to_doubles(const Tensor& t) {
  Tensor h = t.device().is_cpu() ? t.contiguous() : t.contiguous().to(Device::cpu());
  std::vector<double> out(static_cast<size_t>(h.numel()));
  convert_elements(h.raw_data(), h.dtype(), out.data(), DType::F64, h.numel());
  return out;
}

// max|got - ref| / max(max|ref|, 1e-30), in double over host copies of any float dtype.
// +inf when `got` holds a NaN (or an inf where ref has none) or the element counts differ.
inline double max_rel_err(const Tensor& got, const Tensor& ref) {
  if (got.numel() != ref.numel()) return std::numeric_limits<double>::infinity();
  std::vector<double> g = to_doubles(got), r = to_doubles(ref);
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i])) return std::numeric_limits<double>::infinity();
    double d = std::abs(g[i] - r[i]);
    if (std::isnan(d)) d = (g[i] == r[i]) ? 0 : std::numeric_limits<double>::infinity();  // inf - inf
    max_diff = std::max(max_diff, d);
    max_ref = std::max(max_ref, std::abs(r[i]));
  }
  return max_diff / std::max(max_ref, 1e-30);
}

// One row of V logits against its reference row: the largest |got - ref| and the reference's top-1 minus
// top-2 margin. Where the margin exceeds twice the error, the two argmaxes must agree (a greedy token or
// a draft); elsewhere rounding may pick either.
struct RowMargin {
  double err = 0, margin = 0;
};
inline RowMargin row_margin(const float* got, const float* ref, int64_t V) {
  double err = 0, top1 = -INFINITY, top2 = -INFINITY;
  for (int64_t v = 0; v < V; ++v) {
    err = std::max(err, std::abs(static_cast<double>(got[v]) - ref[v]));
    if (ref[v] > top1) top2 = top1, top1 = ref[v];
    else if (ref[v] > top2) top2 = ref[v];
  }
  return {err, top1 - top2};
}

// Same bytes (host copies of any device, contiguous), and the same byte count.
inline bool bit_equal(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::cpu()).contiguous(), y = b.to(Device::cpu()).contiguous();
  return x.nbytes() == y.nbytes() && std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0;
}

// Overwrites every element so that outputs a kernel forgot to write are caught: NaN for float
// dtypes, an unlikely sentinel for integer ones. Works on cpu and cuda tensors.
inline void poison(Tensor& t) {
  if (!t.defined() || t.numel() == 0) return;
  switch (t.dtype()) {
    case DType::U8: t.fill(0xAB); break;
    case DType::F8E4M3: t.fill(std::numeric_limits<double>::quiet_NaN()); break;  // code 0x7F
    case DType::I32: case DType::I64: t.fill(-123456789.0); break;
    default: t.fill(std::numeric_limits<double>::quiet_NaN()); break;
  }
}

// The message of the dflash::Error that f throws, "" when it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// The bad-argument tests of the launchers: returns expect(edit, what), which applies `edit` to a
// copy of `base` and expects launch(copy) to throw dflash::Error; `what` names the defect.
template <typename P, typename Launch>
auto throws_after_edit(const P& base, Launch launch) {
  return [base, launch](const std::function<void(P&)>& edit, const std::string& what = "") {
    P p = base;
    edit(p);
    EXPECT_THROW(launch(p), Error) << what;
  };
}

// Token ids stored as any integer tensor (golden files hold them as i32).
inline std::vector<int32_t> ids_of(const Tensor& t) {
  Tensor i = t.to_dtype(DType::I32);
  return std::vector<int32_t>(i.data<int32_t>(), i.data<int32_t>() + i.numel());
}

// max |got − ref| / max |ref| over the first ref.size() elements; +inf on NaN in got.
inline double rel_err(const std::vector<double>& got, const std::vector<double>& ref) {
  double md = 0, mr = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i])) return std::numeric_limits<double>::infinity();
    md = std::max(md, std::abs(got[i] - ref[i]));
    mr = std::max(mr, std::abs(ref[i]));
  }
  return md / std::max(mr, 1e-30);
}
// Checks rel_err(got, ref) < bound and prints the measured value (for the record of errors).
#define EXPECT_REL(got, ref, bound, what)                                                              \
  do {                                                                                                 \
    std::ostringstream what_;                                                                          \
    what_ << what;                                                                                     \
    const double err_ = rel_err(got, ref);                                                             \
    std::printf("  measured %-70s %.2e (bound %.0e)\n", what_.str().c_str(), err_, double(bound));     \
    EXPECT_LT(err_, bound) << what_.str();                                                             \
  } while (0)

// Fresh f32 host tensors for the CPU op tests: every draw takes the next counter-based stream of
// one seed, so a test's inputs do not depend on what other tests drew.
struct HostDraws {
  uint64_t seed;
  uint64_t stream = 1;
  Tensor randn(const Shape& s, float stddev = 1.0f) {
    Tensor t = Tensor::empty(s, DType::F32);
    fill_normal(t, {seed, stream++, 0}, 0.0f, stddev);
    return t;
  }
  Tensor uniform(const Shape& s, float lo, float hi) {
    Tensor t = Tensor::empty(s, DType::F32);
    fill_uniform(t, {seed, stream++, 0}, lo, hi);
    return t;
  }
};
// An f32 output tensor, poisoned (NaN) so that elements an op does not write are caught.
inline Tensor poisoned_f32(const Shape& s) {
  Tensor t = Tensor::empty(s, DType::F32);
  poison(t);
  return t;
}

}  // namespace dflash
