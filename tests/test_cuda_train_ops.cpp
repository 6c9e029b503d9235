// The drafter's training kernels (kernels/cuda/norm.h, rope.h, elementwise.h, optimizer.h) and
// gemm_ex (gemm.h) against CPU references in double (kernels/cpu/train_ops.h, and a few written here). Inputs are fresh random values (bf16 inputs are rounded
// on the host, and the reference gets the rounded values); every output is poisoned (NaN) before
// the launch, padding of strided outputs is checked to be left alone, NaN fails.
//
// Error bounds (max |got − ref| / max |ref| over the output, see test_util.h):
//   bf16 outputs                1e-2   (storing costs up to 2^-9 ≈ 2e-3 of the element; a wrong
//                                       index or formula shows up at >= 1e-1)
//   fp32 outputs of reductions  1e-4   (fp32 sums of <= ~10^4 terms: ~1e-6 relative; the rope
//                                       angle's fp32 sincosf adds ~1e-6)
//   gemm fp32 D                 1e-5   (exact bf16 products, fp32 accumulation over K <= 600)
//   casts, adds, embedding      exact  (one rounding, defined bit for bit)
// The backward references themselves are checked against central finite differences of the
// double forward (relative 1e-6) on tiny cases: tests/test_ops_train.cpp.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <functional>
#include <random>
#include <sstream>
#include <cstdio>
#include <vector>

#include "kernels/cpu/train_ops.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/optimizer.h"
#include "kernels/cuda/rope.h"
#include "core/device.h"
#include "core/dtype.h"
#include "test_util.h"

using namespace dflash;
namespace cu = dflash::cuda;

namespace {

constexpr double kBf16Bound = 1e-2;
constexpr double kF32Bound = 1e-4;
constexpr double kGemmF32Bound = 1e-5;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

uint64_t g_seed = 9100;  // a fresh seed for every drawn vector

std::vector<float> randn(int64_t n, double stddev = 1.0, double mean = 0.0) {
  std::mt19937_64 rng(g_seed++);
  std::normal_distribution<double> dist(mean, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(dist(rng));
  return v;
}
std::vector<float> round_bf16(std::vector<float> v) {
  for (auto& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}
std::vector<double> to_d(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Device buffers of raw elements (poisoned on request), with host up/downloads.
struct Buf {
  Tensor t;
  void* p() const { return t.raw_data(); }
  float* f() const { return static_cast<float*>(t.raw_data()); }
};
Buf dev_f32(const std::vector<float>& v) {
  Buf b{Tensor::empty({static_cast<int64_t>(std::max<size_t>(v.size(), 1))}, DType::F32, Device::cuda(0))};
  if (!v.empty()) memcpy_any(b.p(), Device::cuda(0), v.data(), Device::cpu(), v.size() * sizeof(float));
  return b;
}
// v is rounded to bf16 (callers pass already rounded values when the reference needs them).
Buf dev_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
  Buf b{Tensor::empty({static_cast<int64_t>(std::max<size_t>(v.size(), 1))}, DType::BF16, Device::cuda(0))};
  if (!v.empty()) memcpy_any(b.p(), Device::cuda(0), h.data(), Device::cpu(), h.size() * sizeof(uint16_t));
  return b;
}
Buf dev_i32(const std::vector<int32_t>& v) {
  Buf b{Tensor::empty({static_cast<int64_t>(std::max<size_t>(v.size(), 1))}, DType::I32, Device::cuda(0))};
  memcpy_any(b.p(), Device::cuda(0), v.data(), Device::cpu(), v.size() * sizeof(int32_t));
  return b;
}
Buf poisoned(int64_t n, DType dt) {
  Buf b{Tensor::empty({std::max<int64_t>(n, 1)}, dt, Device::cuda(0))};
  poison(b.t);
  return b;
}
void sync() { DeviceContext::get(0).synchronize(); }
cu::Stream stream() { return DeviceContext::get(0).stream(); }
std::vector<double> host(const Buf& b) {
  sync();
  return to_doubles(b.t);
}
// Raw bits of a device buffer (determinism checks).
std::vector<uint8_t> bits(const Buf& b) {
  sync();
  std::vector<uint8_t> out(b.t.nbytes());
  memcpy_any(out.data(), Device::cpu(), b.p(), Device::cuda(0), out.size());
  return out;
}


// Elements of a [rows, ld] buffer at columns >= width equal `want` (both NaN counts as equal).
int64_t padding_changed(const std::vector<double>& got, const std::vector<double>& want, int64_t ld, int64_t width) {
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (static_cast<int64_t>(i) % ld < width) continue;
    const bool same = (std::isnan(got[i]) && std::isnan(want[i])) || got[i] == want[i];
    bad += same ? 0 : 1;
  }
  return bad;
}

// ---- casts, residual add, embedding --------------------------------------------------------------

TEST(CudaTrainOps, Casts) {
  DFLASH_REQUIRE_GPU();
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{4096}, int64_t{1000003}}) {
    for (int off : {0, 1}) {  // off 1: a misaligned view (scalar path)
      const std::vector<float> x = randn(n + off, 3.0);
      // bf16 -> f32: exact.
      const std::vector<float> xb = round_bf16(x);
      Buf src = dev_bf16(xb);
      Buf dst = poisoned(n + off, DType::F32);
      cu::cast_bf16_f32(static_cast<uint16_t*>(src.p()) + off, dst.f() + off, n, stream());
      std::vector<double> got = host(dst);
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) bad += got[off + i] == xb[off + i] ? 0 : 1;
      EXPECT_EQ(bad, 0) << "cast_bf16_f32 n=" << n << " off=" << off;
      // f32 -> bf16: round to nearest even, bit for bit as the host conversion.
      Buf fs = dev_f32(x);
      Buf bd = poisoned(n + off, DType::BF16);
      cu::cast_f32_bf16(fs.f() + off, static_cast<uint16_t*>(bd.p()) + off, n, stream());
      got = host(bd);
      bad = 0;
      for (int64_t i = 0; i < n; ++i) bad += got[off + i] == bf16_to_f32(f32_to_bf16(x[off + i])) ? 0 : 1;
      EXPECT_EQ(bad, 0) << "cast_f32_bf16 n=" << n << " off=" << off;
    }
  }
}

TEST(CudaTrainOps, AddIntoF32ReallyAdds) {
  DFLASH_REQUIRE_GPU();
  for (int64_t n : {int64_t{3}, int64_t{40}, int64_t{123457}}) {
    for (bool d_f32 : {false, true}) {
      const std::vector<float> h0 = randn(n), d = round_bf16(randn(n));  // exact in both dtypes
      Buf h = dev_f32(h0);
      Buf dd = d_f32 ? dev_f32(d) : dev_bf16(d);
      cu::add_into_f32(h.f(), dd.p(), d_f32, n, stream());
      cu::add_into_f32(h.f(), dd.p(), d_f32, n, stream());  // twice: accumulates
      const std::vector<double> got = host(h);
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) bad += got[i] == static_cast<double>((h0[i] + d[i]) + d[i]) ? 0 : 1;
      EXPECT_EQ(bad, 0) << "add_into_f32 n=" << n << " d_f32=" << d_f32;
    }
  }
}

TEST(CudaTrainOps, EmbeddingF32) {
  DFLASH_REQUIRE_GPU();
  const int64_t V = 97;
  for (int64_t D : {int64_t{128}, int64_t{5120}, int64_t{100}}) {
    const int64_t rows = 37;
    const std::vector<float> table = round_bf16(randn(V * D));
    std::vector<int32_t> ids(rows);
    std::mt19937 rng(static_cast<uint32_t>(g_seed++));
    for (auto& i : ids) i = static_cast<int32_t>(rng() % V);
    Buf tb = dev_bf16(table), id = dev_i32(ids), h = poisoned(rows * D, DType::F32);
    cu::embedding_f32(static_cast<const int32_t*>(id.p()), tb.p(), h.f(), rows, D, stream());
    const std::vector<double> got = host(h);
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < D; ++i) bad += got[r * D + i] == table[ids[r] * D + i] ? 0 : 1;
    EXPECT_EQ(bad, 0) << "embedding_f32 D=" << D;
  }
}

// scatter_rows_f32: each row lands on its destination exactly; the rows not named keep their values.
TEST(CudaTrainOps, ScatterRowsF32) {
  DFLASH_REQUIRE_GPU();
  for (int64_t D : {int64_t{5120}, int64_t{100}, int64_t{7}}) {
    const int64_t total = 53, rows = 31;
    std::vector<int32_t> dst(static_cast<size_t>(total));
    for (int64_t i = 0; i < total; ++i) dst[i] = static_cast<int32_t>(i);
    std::mt19937 rng(static_cast<uint32_t>(g_seed++));
    std::shuffle(dst.begin(), dst.end(), rng);
    dst.resize(static_cast<size_t>(rows));
    const std::vector<float> x = randn(rows * D), before = randn(total * D);
    Buf xb = dev_f32(x), yb = dev_f32(before), ib = dev_i32(dst);
    cu::scatter_rows_f32(xb.f(), static_cast<const int32_t*>(ib.p()), yb.f(), rows, D, stream());
    const std::vector<double> got = host(yb);
    std::vector<float> want = before;
    for (int64_t r = 0; r < rows; ++r) std::copy_n(x.begin() + r * D, D, want.begin() + dst[r] * D);
    int64_t bad = 0;
    for (int64_t i = 0; i < total * D; ++i) bad += got[i] == want[i] ? 0 : 1;
    EXPECT_EQ(bad, 0) << "scatter_rows_f32 D=" << D;
  }
}

// ---- RMSNorm --------------------------------------------------------------------------------------

struct RmsCase {
  int64_t rows, D, ldx;
};

TEST(CudaTrainOps, RmsNormForward) {
  DFLASH_REQUIRE_GPU();
  for (const RmsCase c : {RmsCase{1, 128, 128}, RmsCase{3, 5120, 5128}, RmsCase{257, 1000, 1000},
                          RmsCase{19, 37, 40}}) {
    for (bool x_f32 : {true, false}) {
      std::vector<float> xs = randn(c.rows * c.ldx, 2.0);
      if (!x_f32) xs = round_bf16(xs);
      const std::vector<float> w = round_bf16(randn(c.D, 0.3, 1.0));
      std::vector<double> xc(static_cast<size_t>(c.rows * c.D));
      for (int64_t r = 0; r < c.rows; ++r)
        for (int64_t i = 0; i < c.D; ++i) xc[r * c.D + i] = xs[r * c.ldx + i];
      std::vector<double> yr, rsr;
      cpu::rms_norm_fwd(xc, to_d(w), c.rows, c.D, 1e-6, yr, rsr);
      Buf x = x_f32 ? dev_f32(xs) : dev_bf16(xs), wb = dev_bf16(w);
      Buf y = poisoned(c.rows * c.D, DType::BF16), rs = poisoned(c.rows, DType::F32);
      cu::rms_norm_fwd(x.p(), x_f32, c.ldx, wb.p(), y.p(), rs.f(), c.rows, c.D, 1e-6f, stream());
      EXPECT_REL(host(y), yr, kBf16Bound, "rms_norm_fwd y rows=" << c.rows << " D=" << c.D);
      EXPECT_REL(host(rs), rsr, 1e-5, "rms_norm_fwd rstd rows=" << c.rows << " D=" << c.D);
    }
  }
}

TEST(CudaTrainOps, RmsNormBackward) {
  DFLASH_REQUIRE_GPU();
  for (const RmsCase c : {RmsCase{1, 128, 128}, RmsCase{5, 5120, 5120}, RmsCase{600, 72, 80},
                          RmsCase{1100, 1000, 1000}, RmsCase{7, 37, 37}}) {
    for (bool x_f32 : {true, false}) {
      for (int mode = 0; mode < 2; ++mode) {  // 0: fp32 dx accumulate + bf16 copy; 1: bf16 dx written
        const int64_t rows = c.rows, D = c.D;
        std::vector<float> xs = randn(rows * c.ldx, 2.0);
        if (!x_f32) xs = round_bf16(xs);
        const std::vector<float> w = round_bf16(randn(D, 0.3, 1.0));
        const std::vector<float> dyv = round_bf16(randn(rows * D));
        std::vector<double> xc(static_cast<size_t>(rows * D));
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t i = 0; i < D; ++i) xc[r * D + i] = xs[r * c.ldx + i];
        std::vector<double> yr, rsd;
        cpu::rms_norm_fwd(xc, to_d(w), rows, D, 1e-6, yr, rsd);
        std::vector<float> rsf(rsd.begin(), rsd.end());  // the kernel gets rstd as saved (fp32)
        const std::vector<float> dx0 = randn(rows * D), dw0 = randn(D);
        std::vector<double> dxr, dwr = to_d(dw0);
        cpu::rms_norm_bwd(xc, to_d(w), to_d(rsf), to_d(dyv), rows, D, dxr, dwr);

        Buf x = x_f32 ? dev_f32(xs) : dev_bf16(xs), wb = dev_bf16(w), rs = dev_f32(rsf), dy = dev_bf16(dyv);
        Buf dx = dev_f32(dx0), dxb = poisoned(rows * D, DType::BF16), copy = poisoned(rows * D, DType::BF16);
        Buf dw = dev_f32(dw0);
        cu::RmsNormBwdParams p;
        p.x = x.p();
        p.x_f32 = x_f32;
        p.ldx = c.ldx;
        p.w = wb.p();
        p.rstd = rs.f();
        p.dy = dy.p();
        if (mode == 0) {
          p.dx = dx.f();
          p.dx_copy_bf16 = copy.p();
        } else {
          p.dx_bf16 = dxb.p();
        }
        p.dw = dw.f();
        p.rows = rows;
        p.D = D;
        cu::rms_norm_bwd(p, stream());
        const std::string what = "rms_norm_bwd rows=" + std::to_string(rows) + " D=" + std::to_string(D) +
                                 " x_f32=" + std::to_string(x_f32) + " mode=" + std::to_string(mode);
        if (mode == 0) {
          std::vector<double> want(dxr.size());
          for (size_t i = 0; i < want.size(); ++i) want[i] = dx0[i] + dxr[i];
          EXPECT_REL(host(dx), want, kF32Bound, what << " dx (+)=");
          EXPECT_REL(host(copy), want, kBf16Bound, what << " dx_copy_bf16");
        } else {
          EXPECT_REL(host(dxb), dxr, kBf16Bound, what << " dx_bf16");
        }
        EXPECT_REL(host(dw), dwr, kF32Bound, what << " dw (+)=");
        // The accumulation really adds: dw − dw0 against the reference increment.
        std::vector<double> inc(static_cast<size_t>(D)), ref_inc(static_cast<size_t>(D));
        const std::vector<double> g = host(dw);
        for (int64_t i = 0; i < D; ++i) {
          inc[i] = g[i] - dw0[i];
          ref_inc[i] = dwr[i] - dw0[i];
        }
        EXPECT_REL(inc, ref_inc, 1e-3, what << " dw increment");
        // Determinism: the same call from the same dw gives the same bits.
        if (mode == 0) {
          Buf dw2 = dev_f32(dw0), dx2 = dev_f32(dx0), dw3 = dev_f32(dw0), dx3 = dev_f32(dx0);
          p.dw = dw2.f();
          p.dx = dx2.f();
          cu::rms_norm_bwd(p, stream());
          p.dw = dw3.f();
          p.dx = dx3.f();
          cu::rms_norm_bwd(p, stream());
          EXPECT_EQ(bits(dw2), bits(dw3)) << what << ": dw differs between two runs";
          EXPECT_EQ(bits(dw2), bits(dw)) << what << ": dw differs between two runs";
        }
      }
    }
  }
}

// ---- per-head RMSNorm + RoPE ------------------------------------------------------------------------

struct HeadCase {
  int64_t rows, heads, d, ldx_pad;
};

TEST(CudaTrainOps, HeadNormRopeForwardBackward) {
  DFLASH_REQUIRE_GPU();
  const float eps = 1e-6f, theta = 1e6f;
  for (const HeadCase c : {HeadCase{1, 1, 128, 0}, HeadCase{37, 3, 128, 8}, HeadCase{65, 32, 128, 0},
                           HeadCase{9, 5, 64, 16}, HeadCase{700, 2, 6, 2}, HeadCase{3, 4, 256, 0}}) {
    const int64_t rows = c.rows, heads = c.heads, d = c.d, ldx = heads * d + c.ldx_pad, hd = heads * d;
    const std::string what = "head_norm_rope rows=" + std::to_string(rows) + " heads=" + std::to_string(heads) +
                             " d=" + std::to_string(d);
    const std::vector<float> xs = round_bf16(randn(rows * ldx, 2.0));
    const std::vector<float> w = round_bf16(randn(d, 0.3, 1.0));
    std::vector<int32_t> pos(static_cast<size_t>(rows));
    std::mt19937 rng(static_cast<uint32_t>(g_seed++));
    for (auto& q : pos) q = static_cast<int32_t>(rng() % 30000);
    std::vector<double> xc(static_cast<size_t>(rows * hd));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < hd; ++i) xc[r * hd + i] = xs[r * ldx + i];
    std::vector<double> yr, rsr;
    cpu::head_norm_rope_fwd(xc, to_d(w), pos, rows, heads, d, eps, theta, yr, rsr);

    Buf x = dev_bf16(xs), wb = dev_bf16(w), pb = dev_i32(pos);
    Buf y = poisoned(rows * hd, DType::BF16), rs = poisoned(rows * heads, DType::F32);
    cu::HeadNormRopeParams f;
    f.x = x.p();
    f.ldx = ldx;
    f.w = wb.p();
    f.pos = static_cast<const int32_t*>(pb.p());
    f.y = y.p();
    f.rstd = rs.f();
    f.rows = rows;
    f.heads = heads;
    f.d = d;
    f.eps = eps;
    f.theta = theta;
    cu::head_norm_rope_fwd(f, stream());
    EXPECT_REL(host(y), yr, kBf16Bound, what << " y");
    EXPECT_REL(host(rs), rsr, 1e-5, what << " rstd");

    // Backward with the rstd the forward saved; dx written with a padded row stride.
    const std::vector<double> rs_saved = host(rs);
    const std::vector<float> dyv = round_bf16(randn(rows * hd));
    const std::vector<float> dw0 = randn(d);
    std::vector<double> dxr, dwr = to_d(dw0);
    cpu::head_norm_rope_bwd(xc, to_d(w), pos, rs_saved, to_d(dyv), rows, heads, d, theta, dxr, dwr);
    const int64_t lddx = hd + 8;
    Buf dy = dev_bf16(dyv), dx = poisoned(rows * lddx, DType::BF16), dw = dev_f32(dw0);
    cu::HeadNormRopeBwdParams b;
    b.fwd = f;
    b.fwd.y = nullptr;
    b.dy = dy.p();
    b.dx = dx.p();
    b.lddx = lddx;
    b.dw = dw.f();
    cu::head_norm_rope_bwd(b, stream());
    const std::vector<double> dxg = host(dx);
    std::vector<double> dxc(static_cast<size_t>(rows * hd));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < hd; ++i) dxc[r * hd + i] = dxg[r * lddx + i];
    EXPECT_REL(dxc, dxr, kBf16Bound, what << " dx");
    EXPECT_EQ(padding_changed(dxg, std::vector<double>(dxg.size(), kNaN), lddx, hd), 0) << what << " dx padding";
    EXPECT_REL(host(dw), dwr, kF32Bound, what << " dw (+)=");
    // Determinism of dw.
    Buf dw2 = dev_f32(dw0);
    b.dw = dw2.f();
    cu::head_norm_rope_bwd(b, stream());
    EXPECT_EQ(bits(dw2), bits(dw)) << what << ": dw differs between two runs";
  }
}

// ---- SwiGLU backward ----------------------------------------------------------------------------------

TEST(CudaTrainOps, SwigluBackward) {
  DFLASH_REQUIRE_GPU();
  for (const auto& [rows, I] : std::vector<std::pair<int64_t, int64_t>>{{1, 8}, {33, 1000}, {5, 17408}, {17, 37}}) {
    const std::vector<float> gu = round_bf16(randn(rows * 2 * I, 3.0)), dm = round_bf16(randn(rows * I));
    std::vector<double> ref(static_cast<size_t>(rows * 2 * I));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < I; ++i) {
        const double g = gu[r * 2 * I + i], u = gu[r * 2 * I + I + i], m = dm[r * I + i];
        const double sg = 1.0 / (1.0 + std::exp(-g));
        ref[r * 2 * I + i] = m * u * sg * (1.0 + g * (1.0 - sg));
        ref[r * 2 * I + I + i] = m * g * sg;
      }
    Buf g = dev_bf16(gu), m = dev_bf16(dm), out = poisoned(rows * 2 * I, DType::BF16);
    cu::swiglu_bwd(g.p(), m.p(), out.p(), rows, I, stream());
    EXPECT_REL(host(out), ref, kBf16Bound, "swiglu_bwd rows=" << rows << " I=" << I);
  }
}

// ---- optimizer -------------------------------------------------------------------------------------------

TEST(CudaTrainOps, SumSquaresDeterministic) {
  DFLASH_REQUIRE_GPU();
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1000}, int64_t{4097}, int64_t{10000003}}) {
    const std::vector<float> x = randn(n);
    double ref = 0;
    for (float v : x) ref += static_cast<double>(v) * v;
    Buf xb = dev_f32(x), out = poisoned(1, DType::F32), out2 = poisoned(1, DType::F32);
    Buf ws{Tensor::empty({cu::sum_squares_workspace(n)}, DType::U8, Device::cuda(0))};
    cu::sum_squares(xb.f(), n, out.f(), ws.p(), stream());
    cu::sum_squares(xb.f(), n, out2.f(), ws.p(), stream());
    const double got = host(out)[0];
    EXPECT_FALSE(std::isnan(got));
    EXPECT_REL(std::vector<double>{got}, std::vector<double>{ref}, 1e-6, "sum_squares n=" << n);
    if (n == 0) {
      EXPECT_EQ(got, 0.0);
    }
    EXPECT_EQ(bits(out), bits(out2)) << "sum_squares n=" << n << " differs between two runs";
    // The same values one float into a buffer (not 16-byte aligned: the scalar loads) give the same bits.
    std::vector<float> shifted(static_cast<size_t>(n) + 1, 0.0f);
    std::copy(x.begin(), x.end(), shifted.begin() + 1);
    Buf xs = dev_f32(shifted), out3 = poisoned(1, DType::F32);
    cu::sum_squares(xs.f() + 1, n, out3.f(), ws.p(), stream());
    EXPECT_EQ(bits(out), bits(out3)) << "sum_squares n=" << n << ": aligned and unaligned x differ";
  }
}

TEST(CudaTrainOps, AdamWThreeSteps) {
  DFLASH_REQUIRE_GPU();
  const int64_t n = 10007;
  const double lr = 1e-3, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  for (bool with_weight : {true, false}) {
    std::vector<float> master0 = randn(n), m0(static_cast<size_t>(n), 0.0f), v0(static_cast<size_t>(n), 0.0f);
    Buf master = dev_f32(master0), m = dev_f32(m0), v = dev_f32(v0), weight = poisoned(n, DType::BF16);
    const float dev_scale = 0.5f, host_scale = 3.0f;
    Buf scale = dev_f32({dev_scale});
    std::vector<double> pm = to_d(master0), mm(n, 0.0), vv(n, 0.0);
    for (int64_t step = 1; step <= 3; ++step) {
      const std::vector<float> grad = randn(n, 0.01);
      Buf g = dev_f32(grad);
      cu::AdamWParams p;
      p.master = master.f();
      p.grad = g.f();
      p.m = m.f();
      p.v = v.f();
      p.weight = with_weight ? weight.p() : nullptr;
      p.n = n;
      p.lr = static_cast<float>(lr);
      p.beta1 = static_cast<float>(b1);
      p.beta2 = static_cast<float>(b2);
      p.eps = static_cast<float>(eps);
      p.weight_decay = static_cast<float>(wd);
      p.step = step;
      p.grad_scale = scale.f();
      p.grad_scale_host = host_scale;
      cu::adamw_step(p, stream());
      // PyTorch AdamW (decoupled decay, bias correction) in double, with the fp32 hyper-parameters.
      const double fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2);
      for (int64_t i = 0; i < n; ++i) {
        const double gi = static_cast<double>(grad[i]) * dev_scale * host_scale;
        mm[i] = fb1 * mm[i] + (1 - fb1) * gi;
        vv[i] = fb2 * vv[i] + (1 - fb2) * gi * gi;
        const double mh = mm[i] / (1 - std::pow(fb1, step)), vh = vv[i] / (1 - std::pow(fb2, step));
        pm[i] -= static_cast<double>(static_cast<float>(lr)) *
                 (static_cast<double>(static_cast<float>(wd)) * pm[i] + mh / (std::sqrt(vh) + static_cast<float>(eps)));
      }
    }
    // Compare the total update (master − master0): fp32 rounding of master (~6e-8) against updates ~3e-3.
    const std::vector<double> got = host(master);
    std::vector<double> upd(static_cast<size_t>(n)), ref_upd(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      upd[i] = got[i] - master0[i];
      ref_upd[i] = pm[i] - master0[i];
    }
    EXPECT_REL(upd, ref_upd, 1e-3, "adamw master update");
    EXPECT_REL(host(m), mm, 1e-5, "adamw m");
    EXPECT_REL(host(v), vv, 1e-5, "adamw v");
    if (with_weight) {
      const std::vector<double> wt = host(weight);
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) bad += wt[i] == bf16_to_f32(f32_to_bf16(static_cast<float>(got[i]))) ? 0 : 1;
      EXPECT_EQ(bad, 0) << "adamw weight = bf16(master)";
    }
  }
}

// adamw_step takes 16-byte accesses where every buffer is aligned and 4-byte ones otherwise: the same
// arithmetic per element, so the same bits. The aligned run (vector loop + a 3-element tail) against a
// run on the same values one element into the buffers (scalar loop).
TEST(CudaTrainOps, AdamWVectorAndScalarLoopsGiveTheSameBits) {
  DFLASH_REQUIRE_GPU();
  const int64_t n = 4099;
  const std::vector<float> master0 = randn(n), m0 = randn(n, 0.01), grad = randn(n, 0.01);
  std::vector<float> v0 = randn(n, 1e-4);
  for (float& x : v0) x = std::abs(x);
  auto shifted = [](const std::vector<float>& v) {
    std::vector<float> s(v.size() + 1, 0.0f);
    std::copy(v.begin(), v.end(), s.begin() + 1);
    return s;
  };
  std::vector<std::vector<double>> out[2];
  for (int off : {0, 1}) {
    Buf master = dev_f32(off ? shifted(master0) : master0), m = dev_f32(off ? shifted(m0) : m0),
        v = dev_f32(off ? shifted(v0) : v0), g = dev_f32(off ? shifted(grad) : grad), weight = poisoned(n + 1, DType::BF16);
    cu::AdamWParams p;
    p.master = master.f() + off, p.grad = g.f() + off, p.m = m.f() + off, p.v = v.f() + off;
    p.weight = static_cast<uint16_t*>(weight.p()) + off;
    p.n = n, p.lr = 1e-3f, p.beta1 = 0.9f, p.beta2 = 0.95f, p.eps = 1e-8f, p.weight_decay = 0.1f, p.step = 5;
    p.grad_scale_host = 0.7f;
    cu::adamw_step(p, stream());
    for (Buf* b : {&master, &m, &v, &weight}) {
      std::vector<double> h = host(*b);
      out[off].emplace_back(h.begin() + off, h.begin() + off + n);
    }
  }
  const char* names[] = {"master", "m", "v", "bf16 weight"};
  for (size_t k = 0; k < 4; ++k) {
    int64_t diff = 0;
    for (int64_t i = 0; i < n; ++i) diff += out[0][k][i] == out[1][k][i] ? 0 : 1;
    EXPECT_EQ(diff, 0) << names[k] << ": elements that differ between the vector and the scalar loop";
  }
}

TEST(CudaTrainOps, ClipFactor) {
  DFLASH_REQUIRE_GPU();
  struct Case {
    float sumsq, max_norm;
    double scale, norm;  // NaN norm: expect NaN
  };
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (const Case c : {Case{4.0f, 1.0f, 1.0 / (2.0 + 1e-6), 2.0}, Case{4.0f, 10.0f, 1.0, 2.0},
                       Case{4.0f, 0.0f, 1.0, 2.0}, Case{0.0f, 1.0f, 1.0, 0.0}, Case{inf, 1.0f, 0.0, INFINITY},
                       Case{nan, 1.0f, 0.0, kNaN}, Case{inf, 0.0f, 0.0, INFINITY}}) {
    Buf s = dev_f32({c.sumsq}), scale = poisoned(1, DType::F32), norm = poisoned(1, DType::F32);
    cu::clip_factor(s.f(), c.max_norm, scale.f(), norm.f(), stream());
    const double gs = host(scale)[0], gn = host(norm)[0];
    EXPECT_NEAR(gs, c.scale, 1e-6) << "clip_factor sumsq=" << c.sumsq << " max_norm=" << c.max_norm;
    if (std::isnan(c.norm)) {
      EXPECT_TRUE(std::isnan(gn)) << "clip_factor norm of NaN sumsq";
    } else if (std::isinf(c.norm)) {
      EXPECT_TRUE(std::isinf(gn)) << "clip_factor norm of inf sumsq";
    } else {
      EXPECT_NEAR(gn, c.norm, 1e-6) << "clip_factor norm sumsq=" << c.sumsq;
    }
  }
}

// ---- gemm_ex ------------------------------------------------------------------------------------------------

struct GemmCase {
  int64_t M, N, K;
};

TEST(CudaTrainOps, GemmExAllTransposes) {
  DFLASH_REQUIRE_GPU();
  for (const GemmCase c : {GemmCase{72, 40, 56}, GemmCase{37, 19, 45}, GemmCase{128, 256, 333}, GemmCase{1, 8, 600}}) {
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (bool d_f32 : {true, false})
          for (float beta : {0.0f, 1.0f}) {
            const int64_t M = c.M, N = c.N, K = c.K;
            // Storage shapes and padded strides (multiples of 8, larger than the row length).
            const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K, b_rows = tb ? N : K, b_cols = tb ? K : N;
            auto pad8 = [](int64_t v) { return (v + 7) / 8 * 8 + 8; };
            const int64_t lda = pad8(a_cols), ldb = pad8(b_cols), ldd = pad8(N);
            const std::vector<float> a = round_bf16(randn(a_rows * lda)), b = round_bf16(randn(b_rows * ldb));
            std::vector<float> d0 = randn(M * ldd);
            if (!d_f32) d0 = round_bf16(d0);
            const float alpha = 0.75f;
            std::vector<double> ref(static_cast<size_t>(M * N));
            for (int64_t i = 0; i < M; ++i)
              for (int64_t j = 0; j < N; ++j) {
                double s = 0;
                for (int64_t k = 0; k < K; ++k) {
                  const double av = ta ? a[k * lda + i] : a[i * lda + k];
                  const double bv = tb ? b[j * ldb + k] : b[k * ldb + j];
                  s += av * bv;
                }
                ref[i * N + j] = alpha * s + (beta != 0.0f ? beta * d0[i * ldd + j] : 0.0);
              }
            Buf ab = dev_bf16(a), bb = dev_bf16(b);
            // beta 0: D poisoned (must never be read); beta 1: D holds d0. Padding keeps its values.
            Buf d = beta == 0.0f ? poisoned(M * ldd, d_f32 ? DType::F32 : DType::BF16)
                                 : (d_f32 ? dev_f32(d0) : dev_bf16(d0));
            const std::vector<double> before = host(d);
            cu::GemmExParams p;
            p.a = ab.p();
            p.lda = lda;
            p.trans_a = ta;
            p.b = bb.p();
            p.ldb = ldb;
            p.trans_b = tb;
            p.d = d.p();
            p.ldd = ldd;
            p.d_f32 = d_f32;
            p.M = M;
            p.N = N;
            p.K = K;
            p.alpha = alpha;
            p.beta = beta;
            cu::gemm_ex(p, 0);
            const std::vector<double> got = host(d);
            std::vector<double> gc(static_cast<size_t>(M * N));
            for (int64_t i = 0; i < M; ++i)
              for (int64_t j = 0; j < N; ++j) gc[i * N + j] = got[i * ldd + j];
            const std::string what = "gemm_ex M=" + std::to_string(M) + " N=" + std::to_string(N) +
                                     " K=" + std::to_string(K) + " trans_a=" + std::to_string(ta) +
                                     " trans_b=" + std::to_string(tb) + " d_f32=" + std::to_string(d_f32) +
                                     " beta=" + std::to_string(beta);
            EXPECT_REL(gc, ref, d_f32 ? kGemmF32Bound : kBf16Bound, what);
            EXPECT_EQ(padding_changed(got, before, ldd, N), 0) << what << ": padding of D written";
          }
  }
}

TEST(CudaTrainOps, GemmExKZeroScalesD) {
  DFLASH_REQUIRE_GPU();
  const int64_t M = 5, N = 12, ldd = 16;
  for (float beta : {0.0f, 1.0f, 0.5f}) {
    const std::vector<float> d0 = randn(M * ldd);
    Buf d = dev_f32(d0);
    if (beta == 0.0f) poison(d.t);
    cu::GemmExParams p;
    p.d = d.p();
    p.ldd = ldd;
    p.d_f32 = true;
    p.M = M;
    p.N = N;
    p.K = 0;
    p.lda = 8;
    p.ldb = N;
    p.beta = beta;
    cu::gemm_ex(p, 0);
    const std::vector<double> got = host(d);
    int64_t bad = 0;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) bad += got[i * ldd + j] == (beta == 0.0f ? 0.0 : beta * d0[i * ldd + j]) ? 0 : 1;
    EXPECT_EQ(bad, 0) << "gemm_ex K=0 beta=" << beta;
  }
}

// Accumulating dw (+)= dyᵀ·x over two micro-batches equals one GEMM over both (the training use).
TEST(CudaTrainOps, GemmExAccumulatesWeightGradient) {
  DFLASH_REQUIRE_GPU();
  const int64_t out = 64, in = 48, rows = 100;
  const std::vector<float> dy = round_bf16(randn(rows * out)), x = round_bf16(randn(rows * in));
  std::vector<double> ref(static_cast<size_t>(out * in), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < out; ++i)
      for (int64_t j = 0; j < in; ++j) ref[i * in + j] += static_cast<double>(dy[r * out + i]) * x[r * in + j];
  Buf dyb = dev_bf16(dy), xb = dev_bf16(x), dw = dev_f32(std::vector<float>(static_cast<size_t>(out * in), 0.0f));
  for (int64_t half = 0; half < 2; ++half) {  // rows [0, 50) then [50, 100)
    cu::GemmExParams p;
    p.a = static_cast<const uint16_t*>(dyb.p()) + half * 50 * out;
    p.lda = out;
    p.trans_a = true;
    p.b = static_cast<const uint16_t*>(xb.p()) + half * 50 * in;
    p.ldb = in;
    p.d = dw.p();
    p.ldd = in;
    p.d_f32 = true;
    p.M = out;
    p.N = in;
    p.K = 50;
    p.beta = 1.0f;
    cu::gemm_ex(p, 0);
  }
  EXPECT_REL(host(dw), ref, kGemmF32Bound, "dw (+)= dyᵀ·x over two micro-batches");
}

// Validation runs before any device work: no GPU needed.
TEST(CudaTrainOps, ValidationNamesLauncherAndValue) {
  cu::GemmExParams p;
  p.a = reinterpret_cast<void*>(0x1000);
  p.b = reinterpret_cast<void*>(0x1000);
  p.d = reinterpret_cast<void*>(0x1000);
  p.M = 16;
  p.N = 16;
  p.K = 12;
  p.lda = 12;  // >= K but not a multiple of 8
  p.ldb = 16;
  p.ldd = 16;
  std::string e = error_of([&] { cu::gemm_ex(p, 0); });
  EXPECT_NE(e.find("gemm_ex"), std::string::npos) << e;
  EXPECT_NE(e.find("lda=12"), std::string::npos) << e;
  EXPECT_NE(e.find("multiple"), std::string::npos) << e;
  p.lda = 8;  // < K
  e = error_of([&] { cu::gemm_ex(p, 0); });
  EXPECT_NE(e.find("lda=8"), std::string::npos) << e;
  p.lda = 16;
  p.d = reinterpret_cast<void*>(0x1004);  // misaligned D
  e = error_of([&] { cu::gemm_ex(p, 0); });
  EXPECT_NE(e.find("16-byte"), std::string::npos) << e;

  e = error_of([] { cu::rms_norm_fwd(nullptr, true, 4, nullptr, nullptr, nullptr, 2, 8, 1e-6f, nullptr); });
  EXPECT_NE(e.find("rms_norm_fwd"), std::string::npos) << e;
  EXPECT_NE(e.find("ldx=4"), std::string::npos) << e;
  cu::HeadNormRopeParams h;
  h.rows = 1;
  h.heads = 2;
  h.d = 7;
  h.ldx = 14;
  e = error_of([&] { cu::head_norm_rope_fwd(h, nullptr); });
  EXPECT_NE(e.find("head_norm_rope_fwd"), std::string::npos) << e;
  EXPECT_NE(e.find("d=7"), std::string::npos) << e;
  cu::RmsNormBwdParams r;
  r.rows = 1;
  r.D = 8;
  r.ldx = 8;
  e = error_of([&] { cu::rms_norm_bwd(r, nullptr); });
  EXPECT_NE(e.find("exactly one of dx"), std::string::npos) << e;
}

// Bandwidth of the kernels at drafter-training shapes (printed, never asserted).
double time_ms(const std::function<void()>& f) {
  f();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  const auto st = static_cast<cudaStream_t>(stream());
  cudaEventRecord(a, st);
  for (int i = 0; i < 10; ++i) f();
  cudaEventRecord(b, st);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / 10;
}
void report(const char* what, double ms, double bytes, double flops = 0) {
  std::printf("  timing %-52s %8.3f ms %7.0f GB/s", what, ms, bytes / ms * 1e-6);
  if (flops > 0) std::printf(" %6.0f TFLOP/s", flops / ms * 1e-9);
  std::printf("\n");
}

TEST(CudaTrainOpsTiming, PrintTimings) {
  DFLASH_REQUIRE_GPU();
  const int64_t T = 8192, H = 5120, heads = 32, d = 128, I = 17408;
  auto s = stream();
  Buf xf = dev_f32(randn(T * H)), w = dev_bf16(randn(H, 0.3, 1.0)), y = poisoned(T * H, DType::BF16);
  Buf rs = poisoned(T, DType::F32), dy = dev_bf16(randn(T * H)), dx = dev_f32(randn(T * H));
  Buf copy = poisoned(T * H, DType::BF16), dw = dev_f32(randn(H));
  report("cast_f32_bf16 8192x5120", time_ms([&] { cu::cast_f32_bf16(xf.f(), y.p(), T * H, s); }), 6.0 * T * H);
  report("add_into_f32 bf16 8192x5120", time_ms([&] { cu::add_into_f32(dx.f(), dy.p(), false, T * H, s); }),
         10.0 * T * H);
  report("rms_norm_fwd f32 x 8192x5120", time_ms([&] {
           cu::rms_norm_fwd(xf.p(), true, H, w.p(), y.p(), rs.f(), T, H, 1e-6f, s);
         }), 6.0 * T * H);
  cu::RmsNormBwdParams p;
  p.x = xf.p();
  p.x_f32 = true;
  p.ldx = H;
  p.w = w.p();
  p.rstd = rs.f();
  p.dy = dy.p();
  p.dx = dx.f();
  p.dx_copy_bf16 = copy.p();
  p.dw = dw.f();
  p.rows = T;
  p.D = H;
  report("rms_norm_bwd f32 x, dx (+)=, copy 8192x5120", time_ms([&] { cu::rms_norm_bwd(p, s); }), 16.0 * T * H);
  {
    Buf q = dev_bf16(randn(T * heads * d)), qy = poisoned(T * heads * d, DType::BF16);
    Buf qr = poisoned(T * heads, DType::F32), qdw = dev_f32(randn(d));
    std::vector<int32_t> pos(static_cast<size_t>(T));
    for (int64_t i = 0; i < T; ++i) pos[i] = static_cast<int32_t>(i % 4096);
    Buf pb = dev_i32(pos);
    cu::HeadNormRopeParams f;
    f.x = q.p();
    f.ldx = heads * d;
    f.w = w.p();
    f.pos = static_cast<const int32_t*>(pb.p());
    f.y = qy.p();
    f.rstd = qr.f();
    f.rows = T;
    f.heads = heads;
    f.d = d;
    report("head_norm_rope_fwd 8192x32x128", time_ms([&] { cu::head_norm_rope_fwd(f, s); }), 4.0 * T * heads * d);
    cu::HeadNormRopeBwdParams b;
    b.fwd = f;
    b.dy = dy.p();
    b.dx = copy.p();
    b.lddx = heads * d;
    b.dw = qdw.f();
    report("head_norm_rope_bwd 8192x32x128", time_ms([&] { cu::head_norm_rope_bwd(b, s); }), 6.0 * T * heads * d);
  }
  {
    const int64_t rows = 2048;
    Buf gu = dev_bf16(randn(rows * 2 * I)), dm = dev_bf16(randn(rows * I)), dgu = poisoned(rows * 2 * I, DType::BF16);
    report("swiglu_bwd 2048x17408", time_ms([&] { cu::swiglu_bwd(gu.p(), dm.p(), dgu.p(), rows, I, s); }),
           10.0 * rows * I);
  }
  {
    const int64_t n = 64 << 20;
    Buf master = dev_f32(randn(n)), g = dev_f32(randn(n)), m = dev_f32(randn(n)), v = dev_f32(randn(n, 0.1, 1.0));
    Buf wt = poisoned(n, DType::BF16), out = poisoned(1, DType::F32);
    Buf ws{Tensor::empty({cu::sum_squares_workspace(n)}, DType::U8, Device::cuda(0))};
    report("sum_squares 64M", time_ms([&] { cu::sum_squares(g.f(), n, out.f(), ws.p(), s); }), 4.0 * n);
    cu::AdamWParams a;
    a.master = master.f();
    a.grad = g.f();
    a.m = m.f();
    a.v = v.f();
    a.weight = wt.p();
    a.n = n;
    a.lr = 1e-4f;
    report("adamw_step 64M", time_ms([&] { cu::adamw_step(a, s); }), 30.0 * n);
  }
  {
    // The drafter's projections: y = x·wᵀ, dx = dy·w, dw (+)= dyᵀ·x (fp32 D).
    const int64_t M = T, N = 4096, K = H;
    Buf xa = dev_bf16(randn(M * K)), wa = dev_bf16(randn(N * K)), ya = poisoned(M * N, DType::BF16);
    Buf dya = dev_bf16(randn(M * N)), dxa = poisoned(M * K, DType::BF16), dwa = dev_f32(randn(N * K));
    cu::GemmExParams g;
    g.a = xa.p(); g.lda = K; g.b = wa.p(); g.ldb = K; g.trans_b = true; g.d = ya.p(); g.ldd = N;
    g.M = M; g.N = N; g.K = K;
    const double flops = 2.0 * M * N * K;
    report("gemm_ex y = x·wᵀ 8192x4096x5120", time_ms([&] { cu::gemm_ex(g, 0); }), 0, flops);
    cu::GemmExParams gx;
    gx.a = dya.p(); gx.lda = N; gx.b = wa.p(); gx.ldb = K; gx.d = dxa.p(); gx.ldd = K;
    gx.M = M; gx.N = K; gx.K = N;
    report("gemm_ex dx = dy·w", time_ms([&] { cu::gemm_ex(gx, 0); }), 0, flops);
    cu::GemmExParams gw;
    gw.a = dya.p(); gw.lda = N; gw.trans_a = true; gw.b = xa.p(); gw.ldb = K; gw.d = dwa.p(); gw.ldd = K;
    gw.d_f32 = true; gw.M = N; gw.N = K; gw.K = M; gw.beta = 1.0f;
    report("gemm_ex dw (+)= dyᵀ·x fp32", time_ms([&] { cu::gemm_ex(gw, 0); }), 0, flops);
  }
}

}  // namespace
