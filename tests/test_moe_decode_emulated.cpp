// The MoE decode kernels (kernels/cuda/moe_decode.cu, cuda::MoeImpl::Decode) run on the CPU through
// tests/cuda_emulation.h: their indexing, top-k, barriers, pad rows and expert ranges checked on
// every machine, GPU or not, against the f32 CPU reference (ops::moe_route / moe_experts / linear /
// swiglu / add_sigmoid_gated) as test_cuda_moe checks them on a GPU. Small shapes: every CUDA thread
// is a fiber. The device's own runs are test_cuda_moe's (CudaMoe.BlockMatchesCpu, ...);
// test_moe_emulated.cpp does the same for moe.cu's grouped path.
#include "cuda_emulation.h"

#define DFLASH_CUDA_EMULATION 1
#include "moe_emulated.h"
#include "kernels/cuda/moe_decode.cu"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "core/random.h"
#include "moe_fp8_util.h"
#include "core/tensor.h"
#include "kernels/ops.h"
#include "test_util.h"

namespace {

using namespace dflash;
namespace cu = dflash::cuda;

uint64_t g_stream = 7700;
Tensor f32(const Tensor& t) { return t.to_dtype(DType::F32); }

struct Pair {
  Tensor bf;  // bf16 (what the kernels read)
  Tensor f;   // the same values in f32 (the reference's)
};
Pair rand_bf16(const Shape& s, float sd) {
  Tensor f = Tensor::empty(s, DType::F32);
  fill_normal(f, {4411, g_stream++, 0}, 0.0f, sd);
  Tensor b = f.to_dtype(DType::BF16);
  return {b, b.to_dtype(DType::F32)};
}

struct Case {
  int64_t N, H, E, k, I, Is;
  int64_t routed = -1;
  bool renorm = true;
};

struct Weights {
  Pair router, gu, dn, sgu, sdn, sg;
};
Weights make_weights(const Case& c) {
  const float ws = 1.0f / std::sqrt(float(c.H));
  Weights w{rand_bf16({c.E, c.H}, ws), rand_bf16({c.E, 2 * c.I, c.H}, ws), rand_bf16({c.E, c.H, c.I}, 0.2f), {}, {}, {}};
  if (c.Is) {
    w.sgu = rand_bf16({2 * c.Is, c.H}, ws);
    w.sdn = rand_bf16({c.H, c.Is}, 0.2f);
    w.sg = rand_bf16({1, c.H}, ws);
  }
  return w;
}

struct Out {
  Tensor out, experts, weights, logits;  // bf16 [N, H], i32 / f32 [routed, k], f32 [N, E]
};

// The three kernels on host memory: experts [e0, e0 + El) of the gate|up / down given (sliced).
// FP8 experts: gu / dn hold e4m3 codes and fp8 points at their block scales.
struct Fp8Scales {
  const Tensor* gate_up = nullptr;
  const Tensor* down = nullptr;
};
Out run(const Case& c, const Tensor& x, const Weights& w, const Tensor& gu, const Tensor& dn, const Tensor& sgu,
        const Tensor& sdn, int64_t I, int64_t Is, int64_t e0 = 0, int64_t El = -1, const Tensor* forced = nullptr,
        Fp8Scales fp8 = {}) {
  const int64_t Nr = c.routed < 0 ? c.N : c.routed;
  Out o{Tensor::empty({c.N, c.H}, DType::BF16), Tensor::empty({Nr * c.k}, DType::I32), Tensor::empty({Nr * c.k}, DType::F32),
        Tensor::empty({c.N, c.E}, DType::F32)};
  std::fill_n(static_cast<uint16_t*>(o.out.raw_data()), c.N * c.H, uint16_t{0x7fc0});  // NaN: every element written
  Tensor gate_logit = Tensor::empty({c.N}, DType::F32), act = Tensor::empty({std::max<int64_t>(1, Nr * c.k * I)}, DType::BF16);
  Tensor sact = Tensor::empty({std::max<int64_t>(1, c.N * std::max<int64_t>(Is, 1))}, DType::BF16);
  cu::MoeBlockParams p;
  p.x = x.raw_data();
  p.N = c.N, p.H = c.H, p.E = c.E, p.k = c.k, p.I = I, p.Is = Is, p.routed = c.routed, p.renormalize = c.renorm;
  p.expert_begin = e0;
  p.local_experts = El;
  p.router = w.router.bf.raw_data();
  p.experts_gate_up = gu.raw_data();
  p.experts_down = dn.raw_data();
  if (fp8.gate_up) {
    p.experts_gate_up_scale = fp8.gate_up->data<float>();
    p.experts_down_scale = fp8.down->data<float>();
  }
  if (Is) {
    p.shared_gate_up = sgu.raw_data();
    p.shared_down = sdn.raw_data();
    p.shared_gate = w.sg.bf.raw_data();
  }
  p.out = o.out.raw_data();
  if (forced) p.logits_in = forced->data<float>();
  cu::MoeDecodeBuffers b;
  b.logits = o.logits.data<float>();
  b.gate_logit = gate_logit.data<float>();
  b.experts = o.experts.data<int32_t>();
  b.weights = o.weights.data<float>();
  b.act = act.raw_data();
  b.sact = sact.raw_data();
  cu::moe_decode_block(p, b, nullptr);
  return o;
}

// The whole block in f32 on the kernels' routing: routed rows < Nr, pad rows zero.
Tensor reference(const Case& c, const Pair& x, const Weights& w, const Out& o) {
  const int64_t Nr = c.routed < 0 ? c.N : c.routed;
  Tensor ref = Tensor::zeros({c.N, c.H}, DType::F32);
  if (Nr == 0) return ref;
  ops::MoeRouting r;
  r.experts = o.experts.view({Nr, c.k});
  r.weights = o.weights.view({Nr, c.k});
  const Tensor xr = x.f.slice(0, 0, Nr).contiguous();
  Tensor part = Tensor::empty({Nr, c.H}, DType::F32);
  ops::moe_experts(xr, w.gu.f, w.dn.f, r, part);
  if (c.Is) {
    Tensor g = Tensor::empty({Nr, c.Is}, DType::F32), u = Tensor::empty({Nr, c.Is}, DType::F32);
    ops::linear(xr, w.sgu.f.slice(0, 0, c.Is).clone(), g);
    ops::linear(xr, w.sgu.f.slice(0, c.Is, 2 * c.Is).clone(), u);
    ops::swiglu(g, u, g);
    Tensor sh = Tensor::empty({Nr, c.H}, DType::F32), gate = Tensor::empty({Nr, 1}, DType::F32);
    ops::linear(g, w.sdn.f, sh);
    ops::linear(xr, w.sg.f, gate);
    ops::add_sigmoid_gated(sh, gate, part);
  }
  std::copy(part.data<float>(), part.data<float>() + Nr * c.H, ref.data<float>());
  return ref;
}

// One case against the reference (MatchesTheCpuReference).
void check_case(const Case& c) {
  const Pair x = rand_bf16({c.N, c.H}, 1.0f);
  const Weights w = make_weights(c);
  const Out o = run(c, x.bf, w, w.gu.bf, w.dn.bf, w.sgu.bf, w.sdn.bf, c.I, c.Is);
  ops::MoeRouting cpu;
  ops::moe_route(x.f, w.router.f, c.k, c.renorm, cpu);
  EXPECT_LE(max_rel_err(o.logits, cpu.logits), 1e-5) << "router logits";
  const int64_t Nr = c.routed < 0 ? c.N : c.routed;
  ops::MoeRouting mine;
  ops::moe_route_logits(o.logits.slice(0, 0, Nr).contiguous(), c.k, c.renorm, mine);
  for (int64_t i = 0; i < Nr * c.k; ++i) {
    EXPECT_EQ(o.experts.data<int32_t>()[i], mine.experts.data<int32_t>()[i]) << "choice " << i;
    EXPECT_NEAR(o.weights.data<float>()[i], mine.weights.data<float>()[i], 1e-6) << "weight " << i;
  }
  EXPECT_LE(max_rel_err(f32(o.out), reference(c, x, w, o)), 1e-2);
  // Forced routing: the given logits' top-k, the router's logits still returned.
  Tensor forced = Tensor::empty({c.N, c.E}, DType::F32);
  fill_normal(forced, {4412, g_stream++, 0}, 0.0f, 3.0f);
  const Out f = run(c, x.bf, w, w.gu.bf, w.dn.bf, w.sgu.bf, w.sdn.bf, c.I, c.Is, 0, -1, &forced);
  ops::MoeRouting want;
  ops::moe_route_logits(forced.slice(0, 0, Nr).contiguous(), c.k, c.renorm, want);
  for (int64_t i = 0; i < Nr * c.k; ++i) EXPECT_EQ(f.experts.data<int32_t>()[i], want.experts.data<int32_t>()[i]);
  EXPECT_LE(max_rel_err(f.logits, cpu.logits), 1e-5);
  EXPECT_LE(max_rel_err(f32(f.out), reference(c, x, w, f)), 1e-2);
}

}  // namespace

// Against the f32 reference: the router's logits, the routing (the CPU's top-k on the kernels' own
// logits, exactly), the block's output; pad rows (routed < N) zero; forced routing (logits_in); the
// routing inside the gate|up blocks and by the top-k kernel first.
TEST(MoeDecodeEmulated, MatchesTheCpuReference) {
  const std::vector<Case> cases{{3, 64, 8, 2, 32, 32},
                                {4, 72, 8, 3, 40, 24, 2},         // rows not a multiple of 256, k = 3, pad rows
                                {2, 64, 8, 2, 32, 0, -1, false},  // no shared expert, no renormalisation
                                {16, 64, 4, 2, 16, 16, 1}};       // a decode step: 1 routed row of 16
  for (int first : {0, 1}) {
    cu::tuning::moe_decode_topk_first = first;
    for (const Case& c : cases) {
      SCOPED_TRACE("N " + std::to_string(c.N) + " H " + std::to_string(c.H) + " k " + std::to_string(c.k) + " Is " +
                   std::to_string(c.Is) + " routed " + std::to_string(c.routed) +
                   (first ? ", top-k first" : ", top-k in the blocks"));
      check_case(c);
    }
  }
  cu::tuning::moe_decode_topk_first = -1;
}

// A token's bits do not depend on the other rows: each row alone (as the one routed row of a padded
// step, routed inside the gate|up blocks) equals the same row in a block of all of them (5 routed:
// routed by the top-k kernel first).
TEST(MoeDecodeEmulated, RowsAreBatchInvariant) {
  const Case all{5, 64, 8, 2, 32, 32};
  const Pair x = rand_bf16({all.N, all.H}, 1.0f);
  const Weights w = make_weights(all);
  const Out o = run(all, x.bf, w, w.gu.bf, w.dn.bf, w.sgu.bf, w.sdn.bf, all.I, all.Is);
  for (int64_t n = 0; n < all.N; ++n) {
    Case one = all;
    one.N = 3;
    one.routed = 1;
    Tensor xin = Tensor::zeros({3, all.H}, DType::BF16);
    std::memcpy(xin.raw_data(), static_cast<const char*>(x.bf.raw_data()) + n * all.H * 2, static_cast<size_t>(all.H * 2));
    const Out s = run(one, xin, w, w.gu.bf, w.dn.bf, w.sgu.bf, w.sdn.bf, all.I, all.Is);
    EXPECT_EQ(std::memcmp(s.out.raw_data(), static_cast<const char*>(o.out.raw_data()) + n * all.H * 2,
                          static_cast<size_t>(all.H * 2)),
              0)
        << "row " << n;
    const Tensor pad = f32(s.out);
    for (int64_t i = all.H; i < 3 * all.H; ++i) ASSERT_EQ(pad.data<float>()[i], 0.0f) << "pad rows of row " << n;
  }
}

// Expert parallelism: the ranks of tp 2 / ep 2 (whole experts) and tp 2 / ep 1 (every expert's
// columns split) each run their share; the partial outputs sum to the whole block.
TEST(MoeDecodeEmulated, ExpertGroupsSumToTheWholeBlock) {
  const Case c{4, 64, 8, 2, 32, 32};
  const Pair x = rand_bf16({c.N, c.H}, 1.0f);
  const Weights w = make_weights(c);
  for (int ep : {1, 2}) {
    const int tp = 2, per_group = tp / ep;
    const int64_t El = c.E / ep, Il = c.I / per_group, Isl = c.Is / tp;
    Tensor sum = Tensor::zeros({c.N, c.H}, DType::F32);
    Out last;
    for (int r = 0; r < tp; ++r) {
      const int64_t eg = r / per_group, er = r % per_group;
      Tensor gu = Tensor::empty({El, 2 * Il, c.H}, DType::F32), dn = Tensor::empty({El, c.H, Il}, DType::F32);
      Tensor sgu = Tensor::empty({2 * Isl, c.H}, DType::F32), sdn = Tensor::empty({c.H, Isl}, DType::F32);
      for (int64_t e = 0; e < El; ++e) {
        const int64_t ge = eg * El + e;
        for (int64_t j = 0; j < Il; ++j)
          for (int64_t q = 0; q < c.H; ++q) {
            gu.data<float>()[(e * 2 * Il + j) * c.H + q] = w.gu.f.data<float>()[(ge * 2 * c.I + er * Il + j) * c.H + q];
            gu.data<float>()[(e * 2 * Il + Il + j) * c.H + q] =
                w.gu.f.data<float>()[(ge * 2 * c.I + c.I + er * Il + j) * c.H + q];
          }
        for (int64_t h = 0; h < c.H; ++h)
          for (int64_t j = 0; j < Il; ++j)
            dn.data<float>()[(e * c.H + h) * Il + j] = w.dn.f.data<float>()[(ge * c.H + h) * c.I + er * Il + j];
      }
      for (int64_t j = 0; j < Isl; ++j)
        for (int64_t q = 0; q < c.H; ++q) {
          sgu.data<float>()[j * c.H + q] = w.sgu.f.data<float>()[(r * Isl + j) * c.H + q];
          sgu.data<float>()[(Isl + j) * c.H + q] = w.sgu.f.data<float>()[(c.Is + r * Isl + j) * c.H + q];
        }
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t j = 0; j < Isl; ++j) sdn.data<float>()[h * Isl + j] = w.sdn.f.data<float>()[h * c.Is + r * Isl + j];
      const auto bf = [](const Tensor& t) { return t.to_dtype(DType::BF16); };
      last = run(c, x.bf, w, bf(gu), bf(dn), bf(sgu), bf(sdn), Il, Isl, eg * El, El);
      const Tensor part = f32(last.out);
      for (int64_t i = 0; i < c.N * c.H; ++i) sum.data<float>()[i] += part.data<float>()[i];
    }
    EXPECT_LE(max_rel_err(sum, reference(c, x, w, last)), 2e-2) << "tp 2, ep " << ep;
  }
}


// FP8 experts (W8A16, moe_fp8.cuh): e4m3 codes with block scales give, bit for bit, what the bf16
// experts holding their dequantized values give (outputs and routing); several row and column blocks,
// a partial last block, both routings, and an expert range (expert parallelism).
TEST(MoeDecodeEmulated, Fp8ExpertsGiveTheBf16ExpertsBits) {
  const Case c{3, 136, 4, 2, 136, 32};  // H: 2 column blocks (the last partial); I: 2 row blocks a part
  const Pair x = rand_bf16({c.N, c.H}, 1.0f);
  const Weights w = make_weights(c);
  const Fp8Experts gu = make_fp8_experts(c.E, 2 * c.I, c.H, c.I, 11), dn = make_fp8_experts(c.E, c.H, c.I, c.H, 12);
  for (const auto& [first, e0] : std::vector<std::pair<int, int64_t>>{{0, 0}, {1, 2}}) {
    cu::tuning::moe_decode_topk_first = first;
    const int64_t El = e0 == 0 ? c.E : 2;
    SCOPED_TRACE("experts [" + std::to_string(e0) + ", " + std::to_string(e0 + El) + ")" + (first ? ", top-k first" : ""));
    auto experts = [&](const Tensor& t) { return t.slice(0, e0, e0 + El).contiguous(); };
    const Tensor gs = experts(gu.scale), ds = experts(dn.scale);
    const Out a = run(c, x.bf, w, experts(gu.bf16), experts(dn.bf16), w.sgu.bf, w.sdn.bf, c.I, c.Is, e0, El);
    const Out b = run(c, x.bf, w, experts(gu.codes), experts(dn.codes), w.sgu.bf, w.sdn.bf, c.I, c.Is, e0, El, nullptr,
                      {&gs, &ds});
    EXPECT_EQ(std::memcmp(a.out.raw_data(), b.out.raw_data(), a.out.nbytes()), 0) << "outputs";
    EXPECT_EQ(std::memcmp(a.experts.raw_data(), b.experts.raw_data(), a.experts.nbytes()), 0) << "routing";
    const Tensor af = f32(a.out);
    EXPECT_TRUE(std::any_of(af.data<float>(), af.data<float>() + af.numel(), [](float v) { return v != 0.0f; }));
  }
  cu::tuning::moe_decode_topk_first = -1;
}
