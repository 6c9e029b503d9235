// CUDA DFlash block attention (block_attention_fwd / _bwd) against a float64 CPU reference that
// builds every query's key set with drafter::mask_allows, the CPU drafter's own mask. Inputs are
// bf16 drawn on the host (so the reference sees the exact values the kernels read); every output
// is poisoned (NaN) before the launch, and a NaN fails.
//
// Error bounds, as max|got − ref| / max|ref| per tensor:
//   out 1e-2: stored in bf16 (2^-9 relative per element) and P rounded to bf16 before P·V;
//   lse 1e-4: fp32 throughout (the inputs are exact; ex2.approx and fp32 sums give ~1e-6);
//   dq, dkc, dvc, dkb, dvb 2e-2: on top of the output rounding, P and dS are rounded to bf16 for
//   the tensor-core GEMMs and δ = rowsum(dO·O) uses the bf16 O. Measured on an H200: worst
//   out 4.0e-3, lse 2.0e-7, gradients 6.4e-3 (dkc at d 128); the fallback about the same.
// Context rows no query attends must be exactly 0 in dkc / dvc (checked separately).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "drafter/config.h"
#include "drafter/model.h"
#include "core/cuda/check.h"
#include "kernels/cpu/train_ops.h"
#include "kernels/cases/block_attention_cases.h"
#include "kernels/cuda/block_attention.h"
#include "core/device.h"
#include "core/random.h"
#include "tests/test_util.h"

using namespace dflash;

namespace {

constexpr double kOutBound = 1e-2, kLseBound = 1e-4, kGradBound = 2e-2;
uint64_t g_stream = 9100;

struct Shape5 {
  std::vector<int64_t> lens;                 // context rows per sequence
  std::vector<std::vector<int64_t>> anchors;  // per sequence, sorted
  int64_t B = 16, Hq = 4, Hkv = 1, d = 64;
  bool sliding = false;
  int64_t window = 0;
  float q_stddev = 1.0f;
  bool force_fallback = false;
  cuda::FlashImpl impl = cuda::FlashImpl::Auto;  // which tensor-core kernels
};

const char* impl_name(cuda::FlashImpl i) {
  return i == cuda::FlashImpl::Wgmma ? " [wgmma]" : i == cuda::FlashImpl::MmaSync ? " [mma.sync]" : "";
}
// The tensor-core kernels a d can run here: mma.sync always, wgmma on sm_90 at d = 128.
std::vector<cuda::FlashImpl> impls_for(int64_t d) {
  std::vector<cuda::FlashImpl> v = {cuda::FlashImpl::MmaSync};
  if (d == 128 && std::string(cuda::block_attention_kernel_name(d, 0)) == "wgmma sm_90a") v.push_back(cuda::FlashImpl::Wgmma);
  return v;
}

std::string describe(const Shape5& s) {
  std::ostringstream os;
  os << "d=" << s.d << " Hq=" << s.Hq << " Hkv=" << s.Hkv << " B=" << s.B << (s.sliding ? " sliding w=" : " full")
     << (s.sliding ? std::to_string(s.window) : "") << (s.force_fallback ? " [forced fallback]" : "") << impl_name(s.impl) << " lens={";
  for (size_t i = 0; i < s.lens.size(); ++i) os << (i ? "," : "") << s.lens[i];
  os << "} blocks={";
  for (size_t i = 0; i < s.anchors.size(); ++i) os << (i ? "," : "") << s.anchors[i].size();
  os << "}";
  return os.str();
}

Tensor bf16_normal(const Shape& shape, float stddev) {
  Tensor t = Tensor::empty(shape, DType::BF16);
  fill_normal(t, {5151, g_stream++, 0}, 0.0f, stddev);
  return t;
}

Tensor dev_i32(const std::vector<int32_t>& v) {
  std::vector<int32_t> c = v.empty() ? std::vector<int32_t>{0} : v;
  return Tensor::from_blob(c.data(), {static_cast<int64_t>(c.size())}, DType::I32).to(Device::cuda(0));
}

struct Problem {
  Shape5 s;
  int64_t N = 0, nb = 0, R = 0, max_len = 0;
  std::vector<int32_t> cu_seqlens, cu_blocks, anchor, block_seq;
  Tensor q, kc, vc, kb, vb, dout;  // host bf16
  std::vector<double> hq, hkc, hvc, hkb, hvb, hdo;
};

Problem make(const Shape5& s) {
  Problem p;
  p.s = s;
  p.cu_seqlens = {0};
  p.cu_blocks = {0};
  for (size_t i = 0; i < s.lens.size(); ++i) {
    p.cu_seqlens.push_back(p.cu_seqlens.back() + static_cast<int32_t>(s.lens[i]));
    p.max_len = std::max(p.max_len, s.lens[i]);
    for (int64_t a : s.anchors[i]) {
      EXPECT_TRUE(a >= 0 && a < s.lens[i]);
      p.anchor.push_back(static_cast<int32_t>(a));
      p.block_seq.push_back(static_cast<int32_t>(i));
    }
    p.cu_blocks.push_back(static_cast<int32_t>(p.anchor.size()));
  }
  p.N = p.cu_seqlens.back();
  p.nb = static_cast<int64_t>(p.anchor.size());
  p.R = p.nb * s.B;
  p.q = bf16_normal({p.R, s.Hq, s.d}, s.q_stddev);
  p.kc = bf16_normal({p.N, s.Hkv, s.d}, 1.0f);
  p.vc = bf16_normal({p.N, s.Hkv, s.d}, 1.0f);
  p.kb = bf16_normal({p.R, s.Hkv, s.d}, 1.0f);
  p.vb = bf16_normal({p.R, s.Hkv, s.d}, 1.0f);
  p.dout = bf16_normal({p.R, s.Hq, s.d}, 1.0f);
  p.hq = to_doubles(p.q);
  p.hkc = to_doubles(p.kc);
  p.hvc = to_doubles(p.vc);
  p.hkb = to_doubles(p.kb);
  p.hvb = to_doubles(p.vb);
  p.hdo = to_doubles(p.dout);
  return p;
}

// float64 reference (kernels/cpu/train_ops.h) with the drafter's own mask as the oracle of which
// keys each query sees.
cpu::BlockAttentionRef reference(const Problem& p) {
  const Shape5& s = p.s;
  const auto type = s.sliding ? drafter::AttnType::Sliding : drafter::AttnType::Full;
  cpu::BlockAttentionShape shape;
  shape.cu_seqlens = p.cu_seqlens;
  shape.anchor = p.anchor;
  shape.block_seq = p.block_seq;
  shape.B = s.B;
  shape.Hq = s.Hq;
  shape.Hkv = s.Hkv;
  shape.d = s.d;
  return cpu::block_attention(shape, p.hq, p.hkc, p.hvc, p.hkb, p.hvb, p.hdo,
                              [&](int64_t anchor, int64_t j, bool key_in_block, int64_t t) {
                                return drafter::mask_allows(type, s.window, anchor, j, key_in_block, t);
                              });
}

double rel_err(const Tensor& got, const std::vector<double>& ref) {
  const std::vector<double> g = to_doubles(got);
  if (g.size() != ref.size()) return INFINITY;
  double md = 0, mr = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) return INFINITY;
    md = std::max(md, std::abs(g[i] - ref[i]));
    mr = std::max(mr, std::abs(ref[i]));
  }
  return md / std::max(mr, 1e-30);
}

struct Errors {
  double out = 0, lse = 0, dq = 0, dkc = 0, dvc = 0, dkb = 0, dvb = 0;
  void max_with(const Errors& e) {
    out = std::max(out, e.out);
    lse = std::max(lse, e.lse);
    dq = std::max(dq, e.dq);
    dkc = std::max(dkc, e.dkc);
    dvc = std::max(dvc, e.dvc);
    dkb = std::max(dkb, e.dkb);
    dvb = std::max(dvb, e.dvb);
  }
};

Errors check(const Shape5& shape) {
  const Problem p = make(shape);
  const Shape5& s = p.s;
  const cpu::BlockAttentionRef ref = reference(p);
  const Device dev = Device::cuda(0);
  const cases::BlockAttnInputs in{p.q.to(dev),           p.kc.to(dev),          p.vc.to(dev),
                                  p.kb.to(dev),          p.vb.to(dev),          dev_i32(p.anchor),
                                  dev_i32(p.block_seq), dev_i32(p.cu_seqlens), dev_i32(p.cu_blocks)};
  Tensor dout = p.dout.to(dev);
  Tensor out = Tensor::empty({p.R, s.Hq, s.d}, DType::BF16, dev), lse = Tensor::empty({p.R, s.Hq}, DType::F32, dev);
  Tensor dq = Tensor::empty({p.R, s.Hq, s.d}, DType::BF16, dev);
  Tensor dkc = Tensor::empty({p.N, s.Hkv, s.d}, DType::BF16, dev), dvc = dkc.clone();
  Tensor dkb = Tensor::empty({p.R, s.Hkv, s.d}, DType::BF16, dev), dvb = dkb.clone();
  for (Tensor* t : {&out, &lse, &dq, &dkc, &dvc, &dkb, &dvb}) poison(*t);

  cuda::BlockAttnParams a = cases::block_attn_params(
      in, {.nb = p.nb, .B = s.B, .N = p.N, .num_seqs = static_cast<int64_t>(s.lens.size()), .max_seqlen = p.max_len,
           .Hq = s.Hq, .Hkv = s.Hkv, .d = s.d});
  a.out = out.raw_data();
  a.lse = lse.data<float>();
  a.sliding = s.sliding;
  a.window = s.window;
  a.force_fallback = s.force_fallback;
  a.impl = s.impl;
  void* stream = DeviceContext::get(0).stream();
  cuda::block_attention_fwd(a, stream);
  Tensor ws = Tensor::empty({std::max<int64_t>(cuda::block_attention_bwd_workspace(a), 1)}, DType::U8, dev);
  // All-ones bytes are NaN as float and bf16: a dSᵀ tile or δ read before it is written shows.
  EXPECT_EQ(cudaMemset(ws.raw_data(), 0xFF, static_cast<size_t>(ws.nbytes())), cudaSuccess);
  const cuda::BlockAttnBwdParams bp = cases::block_attn_bwd_params(a, {dout, dq, dkc, dvc, dkb, dvb, ws});
  cuda::block_attention_bwd(bp, stream);
  DeviceContext::get(0).synchronize();

  Errors e;
  e.out = rel_err(out, ref.out);
  e.lse = rel_err(lse, ref.lse);
  e.dq = rel_err(dq, ref.dq);
  e.dkc = p.N ? rel_err(dkc, ref.dkc) : 0;
  e.dvc = p.N ? rel_err(dvc, ref.dvc) : 0;
  e.dkb = rel_err(dkb, ref.dkb);
  e.dvb = rel_err(dvb, ref.dvb);
  const std::string what = describe(s);
  EXPECT_LT(e.out, kOutBound) << what;
  EXPECT_LT(e.lse, kLseBound) << what;
  EXPECT_LT(e.dq, kGradBound) << what;
  EXPECT_LT(e.dkc, kGradBound) << what;
  EXPECT_LT(e.dvc, kGradBound) << what;
  EXPECT_LT(e.dkb, kGradBound) << what;
  EXPECT_LT(e.dvb, kGradBound) << what;
  // Context rows no query attends: exactly zero (not just small).
  if (p.N) {
    const std::vector<double> gk = to_doubles(dkc), gv = to_doubles(dvc);
    int64_t unattended = 0, nonzero = 0;
    for (int64_t n = 0; n < p.N; ++n) {
      if (ref.ctx_attended[n]) continue;
      ++unattended;
      for (int64_t e2 = 0; e2 < s.Hkv * s.d; ++e2)
        if (gk[n * s.Hkv * s.d + e2] != 0.0 || gv[n * s.Hkv * s.d + e2] != 0.0) ++nonzero;
    }
    EXPECT_EQ(nonzero, 0) << what << ": " << nonzero << " non-zero gradient values in " << unattended
                          << " unattended context rows";
  }
  std::printf("  %-80s out %.2e lse %.2e dq %.2e dkc %.2e dvc %.2e dkb %.2e dvb %.2e\n", what.c_str(), e.out, e.lse,
              e.dq, e.dkc, e.dvc, e.dkb, e.dvb);
  return e;
}

// Varlen context: anchors at 0 and S−1, blocks whose positions run past the sequence end, several
// context tiles (S > 64), a sequence without blocks (its rows get zero gradients) and an empty one.
Shape5 varlen(int64_t d, int64_t Hq, int64_t Hkv, int64_t B) {
  Shape5 s;
  s.lens = {300, 77, 0, 40, 131};
  s.anchors = {{0, 1, 63, 64, 65, 150, 290, 299}, {5, 76}, {}, {}, {0, 64, 127, 128, 130}};
  s.d = d;
  s.Hq = Hq;
  s.Hkv = Hkv;
  s.B = B;
  return s;
}

void sweep(int64_t d, bool fallback, cuda::FlashImpl impl = cuda::FlashImpl::Auto) {
  Errors worst;
  struct Heads {
    int64_t Hq, Hkv, B;
  };
  // 4/1 and 32/8 (the 27B drafter), B 16 (M = 64 packed rows), odd B 7 (M 28 / 28: partial tiles),
  // B 16 with 8 heads per kv head (M = 128: two query tiles), B 80 (two own-block key tiles), and
  // groups that do not divide 8 (3: M 48; 16: M 80, two query tiles), where a tile's rows change
  // token and head unevenly.
  std::vector<Heads> heads = {{4, 1, 16}, {32, 8, 16}, {4, 1, 7}, {32, 8, 7}, {8, 1, 16}, {2, 2, 80}, {6, 2, 16}, {16, 1, 5}};
  for (const Heads& h : heads)
    for (int mode = 0; mode < 3; ++mode) {
      Shape5 s = varlen(d, h.Hq, h.Hkv, h.B);
      s.force_fallback = fallback;
      s.impl = impl;
      if (h.Hq == 32) {  // keep the float64 reference fast at 32 heads
        s.lens = {200, 70};
        s.anchors = {{0, 99, 140, 199}, {3, 69}};
      }
      if (mode >= 1) {
        s.sliding = true;
        s.window = mode == 1 ? 5 : 100;  // smaller than a block / larger than a block and a tile
      }
      worst.max_with(check(s));
    }
  std::printf("d=%lld %s%s worst: out %.2e lse %.2e dq %.2e dkc %.2e dvc %.2e dkb %.2e dvb %.2e\n",
              static_cast<long long>(d), fallback ? "fallback" : "dispatch", impl_name(impl), worst.out, worst.lse, worst.dq, worst.dkc,
              worst.dvc, worst.dkb, worst.dvb);
}

}  // namespace

TEST(CudaBlockAttention, FastD64) {
  DFLASH_REQUIRE_GPU();
  sweep(64, false);
}

TEST(CudaBlockAttention, FastD128) {
  DFLASH_REQUIRE_GPU();
  for (cuda::FlashImpl impl : impls_for(128)) sweep(128, false, impl);
}

// On an sm_90 GPU (the H200) the drafter's d = 128 attention must run the wgmma kernels: a build
// that lost its sm_90a code would otherwise drop to mma.sync without a word.
TEST(CudaBlockAttention, WgmmaOnSm90) {
  DFLASH_REQUIRE_GPU();
  int major = 0, minor = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
  const bool sm90 = major == 9 && minor == 0;
  EXPECT_STREQ(cuda::block_attention_kernel_name(128, 0), sm90 ? "wgmma sm_90a" : "mma.sync");
  EXPECT_STREQ(cuda::block_attention_kernel_name(64, 0), "mma.sync");
  if (!sm90) {  // forcing it where it cannot run is an error, not a silent mma.sync run
    Shape5 s = varlen(128, 4, 1, 16);
    s.impl = cuda::FlashImpl::Wgmma;
    EXPECT_THROW(check(s), Error);
  }
}

TEST(CudaBlockAttention, ForcedFallbackD64) {
  DFLASH_REQUIRE_GPU();
  sweep(64, true);
}

// Head dims without tensor-core kernels go to the fallback through the same launchers.
TEST(CudaBlockAttention, FallbackOddHeadDims) {
  DFLASH_REQUIRE_GPU();
  for (int64_t d : {32, 96, 40})
    for (int mode = 0; mode < 2; ++mode) {
      Shape5 s = varlen(d, 4, 2, d == 40 ? 7 : 16);
      s.sliding = mode == 1;
      s.window = 9;
      check(s);
    }
}

// Peaky softmax (q stddev 6: logits of stddev ~6): the running max must be handled in fp32.
TEST(CudaBlockAttention, PeakySoftmax) {
  DFLASH_REQUIRE_GPU();
  for (int64_t d : {64, 128}) {
    for (cuda::FlashImpl impl : impls_for(d)) {
      Shape5 s = varlen(d, 4, 1, 16);
      s.q_stddev = 6.0f;
      s.impl = impl;
      check(s);
    }
    Shape5 s = varlen(d, 4, 1, 16);
    s.q_stddev = 6.0f;
    s.force_fallback = true;
    check(s);
  }
}

// The drafter layout in small: one 1024-token context, 64 uniform anchors (sorted), Hq 32, Hkv 8.
TEST(CudaBlockAttention, DrafterShapeSmall) {
  DFLASH_REQUIRE_GPU();
  Shape5 s;
  s.lens = {1024};
  s.anchors = {{}};
  for (int64_t i = 0; i < 24; ++i) s.anchors[0].push_back((i * 977 + 13) % 1024);
  std::sort(s.anchors[0].begin(), s.anchors[0].end());
  s.Hq = 32;
  s.Hkv = 8;
  s.d = 128;
  for (cuda::FlashImpl impl : impls_for(128)) {
    s.impl = impl;
    s.sliding = false;
    check(s);
    s.sliding = true;
    s.window = 200;
    check(s);
  }
}

TEST(CudaBlockAttention, Supported) {
  EXPECT_TRUE(cuda::block_attention_supported(64, 9));
  EXPECT_TRUE(cuda::block_attention_supported(128, 8));
  EXPECT_FALSE(cuda::block_attention_supported(128, 7));
  for (int64_t d : {32, 96, 256, 40}) EXPECT_FALSE(cuda::block_attention_supported(d, 9));
}

TEST(CudaBlockAttention, BadSizesThrow) {
  DFLASH_REQUIRE_GPU();
  // One block of 16 rows over 10 context rows; no pointers.
  const cuda::BlockAttnParams a{.nb = 1, .B = 16, .N = 10, .num_seqs = 1, .max_seqlen = 10, .Hq = 6, .Hkv = 4, .d = 64};
  const auto rejects = throws_after_edit(
      a, [](const cuda::BlockAttnParams& p) { cuda::block_attention_fwd(p, DeviceContext::get(0).stream()); });
  rejects([](cuda::BlockAttnParams&) {}, "6 query heads over 4 kv heads: not a divisor");
  rejects([](cuda::BlockAttnParams& p) { p.Hkv = 2; }, "null pointers");
  rejects([](cuda::BlockAttnParams& p) { p.Hkv = 2; p.sliding = true; p.window = 0; }, "sliding with window 0");
}
