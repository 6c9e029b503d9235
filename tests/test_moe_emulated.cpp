// The grouped MoE path (kernels/cuda/moe.cu: top-k, the permutation by expert, the grouped mma.sync
// GEMM in both tilings, the combine) run on the CPU through tests/cuda_emulation.h (mma.sync and
// ldmatrix emulated): routing, tile tables, expert ranges (expert parallelism) and the products
// checked on every machine, GPU or not, against the f32 CPU reference. The device's own runs are
// test_cuda_moe's (CudaMoe.*).
#include "cuda_emulation.h"

#define DFLASH_CUDA_EMULATION 1
#include "moe_emulated.h"
#include "kernels/cuda/moe.cu"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "core/random.h"
#include "moe_emulated_routing.h"
#include "moe_fp8_util.h"
#include "core/tensor.h"
#include "kernels/ops.h"
#include "test_util.h"

namespace {

using namespace dflash;
namespace cu = dflash::cuda;
namespace cu_test = dflash::cuda_test;

uint64_t g_stream = 7900;
Tensor f32(const Tensor& t) { return t.to_dtype(DType::F32); }
struct Pair {
  Tensor bf, f;  // bf16, and the same values in f32
};
Pair rand_bf16(const Shape& s, float sd) {
  Tensor f = Tensor::empty(s, DType::F32);
  fill_normal(f, {4421, g_stream++, 0}, 0.0f, sd);
  Tensor b = f.to_dtype(DType::BF16);
  return {b, b.to_dtype(DType::F32)};
}

}  // namespace

// The grouped path's kernels: top-k on given logits, the permutation over this rank's experts (all,
// or an expert range: expert parallelism), the grouped gate|up (gather + SwiGLU fused) and down
// GEMMs in both tilings (mma.sync emulated), the combine with a sigmoid-gated shared term; against
// the CPU's top-k and experts on the same routing; the three tilings give the same bits.
TEST(MoeEmulated, GroupedPathMatchesTheCpuReference) {
  const char* const tiling[] = {"wide", "narrow", "deep", "deep, 16-row blocks", "deep, 16-row blocks, 5 stages at any K"};
  struct G {
    int64_t N, H, E, k, I, e0, El;
  };
  // (H 512: the gate|up GEMM's 4 k tiles of 128 through the 16-row blocks' 3-stage ring, wrapping)
  for (const G& c : std::vector<G>{{40, 64, 8, 2, 32, 0, 8}, {70, 72, 8, 3, 40, 4, 4}, {9, 64, 4, 2, 24, 1, 2}, {5, 512, 4, 2, 24, 0, 4}}) {
    Tensor first_out;
    const uint64_t draws = g_stream;  // every tiling on the same inputs
    for (int narrow : {0, 1, 2, 3, 4}) {
      g_stream = draws;
      SCOPED_TRACE("N " + std::to_string(c.N) + " experts [" + std::to_string(c.e0) + ", " +
                   std::to_string(c.e0 + c.El) + ") of " + std::to_string(c.E) + ", " + tiling[narrow]);
      cu::tuning::moe_narrow_tiles = std::min(narrow, 3);
      cu::tuning::moe_deep16_short = narrow == 4 ? 0 : -1;  // (3: the short-K stages at these K)
      Tensor logits = Tensor::empty({c.N, c.E}, DType::F32);
      fill_normal(logits, {4413, g_stream++, 0}, 0.0f, 2.0f);
      const Pair x = rand_bf16({c.N, c.H}, 1.0f);
      const Pair gu = rand_bf16({c.El, 2 * c.I, c.H}, 0.1f), dn = rand_bf16({c.El, c.H, c.I}, 0.2f);
      const int64_t R = c.N * c.k;
      Tensor ex = Tensor::empty({R}, DType::I32), wt = Tensor::empty({R}, DType::F32), counts = Tensor::empty({c.E}, DType::I32);
      Tensor off = Tensor::empty({c.E + 1}, DType::I32), tiles = Tensor::empty({c.E + 1}, DType::I32);
      Tensor cursor = Tensor::empty({c.E}, DType::I32), src = Tensor::empty({R}, DType::I32), slot = Tensor::empty({R}, DType::I32);
      cu::moe_topk(logits.data<float>(), c.N, c.E, c.k, true, ex.data<int32_t>(), wt.data<float>(), counts.data<int32_t>(),
                   nullptr);
      ops::MoeRouting want;
      ops::moe_route_logits(logits, c.k, true, want);
      for (int64_t i = 0; i < R; ++i) {
        ASSERT_EQ(ex.data<int32_t>()[i], want.experts.data<int32_t>()[i]) << "choice " << i;
        ASSERT_NEAR(wt.data<float>()[i], want.weights.data<float>()[i], 1e-6) << "weight " << i;
      }
      cu::moe_permute(ex.data<int32_t>(), counts.data<int32_t>(), c.N, c.E, c.k, off.data<int32_t>(), tiles.data<int32_t>(),
                      cursor.data<int32_t>(), src.data<int32_t>(), slot.data<int32_t>(), nullptr, c.e0, c.El);
      int64_t local = 0;
      for (int64_t i = 0; i < R; ++i) {
        const int32_t e = ex.data<int32_t>()[i];
        const bool mine = e >= c.e0 && e < c.e0 + c.El;
        local += mine;
        ASSERT_EQ(slot.data<int32_t>()[i] >= 0, mine) << "slot of choice " << i;
        if (mine) {
          ASSERT_EQ(src.data<int32_t>()[slot.data<int32_t>()[i]], i / c.k) << "row of choice " << i;
        }
      }
      ASSERT_EQ(off.data<int32_t>()[c.El], local);
      Tensor act = Tensor::empty({std::max<int64_t>(1, local), c.I}, DType::BF16);
      Tensor y = Tensor::empty({std::max<int64_t>(1, local), c.H}, DType::BF16);
      cu::MoeGemmParams g;
      g.x = x.bf.raw_data(), g.ldx = c.H, g.src_row = src.data<int32_t>(), g.w = gu.bf.raw_data(), g.y = act.raw_data();
      g.ldy = c.I, g.offsets = off.data<int32_t>(), g.tile_offsets = tiles.data<int32_t>(), g.E = c.El, g.Nout = c.I;
      g.K = c.H, g.max_tiles = cu::moe_max_tiles(R, c.El), g.swiglu = true, g.rows = R;
      cu::moe_grouped_gemm(g, nullptr);
      cu::MoeGemmParams d = g;
      d.x = act.raw_data(), d.ldx = c.I, d.src_row = nullptr, d.w = dn.bf.raw_data(), d.y = y.raw_data(), d.ldy = c.H;
      d.Nout = c.H, d.K = c.I, d.swiglu = false;
      cu::moe_grouped_gemm(d, nullptr);
      // The combine, with a shared term behind the gate sigmoid(x · gate_w).
      const Pair shared = rand_bf16({c.N, c.H}, 0.5f), gate_w = rand_bf16({1, c.H}, 0.1f);
      Tensor out = Tensor::empty({c.N, c.H}, DType::BF16);
      cu::moe_combine(y.raw_data(), slot.data<int32_t>(), wt.data<float>(), c.N, c.k, c.H, shared.bf.raw_data(),
                      x.bf.raw_data(), gate_w.bf.raw_data(), out.raw_data(), nullptr);
      Tensor ref = Tensor::empty({c.N, c.H}, DType::F32), gate = Tensor::empty({c.N, 1}, DType::F32);
      ops::moe_experts(x.f, gu.f, dn.f, want, ref, c.e0, c.E);
      ops::linear(x.f, gate_w.f, gate);
      ops::add_sigmoid_gated(shared.f, gate, ref);
      EXPECT_LE(max_rel_err(f32(out), ref), 1e-2);
      if (narrow == 0) first_out = out;
      else EXPECT_EQ(std::memcmp(out.raw_data(), first_out.raw_data(), out.nbytes()), 0) << "the wide tiling's bits";
    }
  }
  cu::tuning::moe_narrow_tiles = -1;
  cu::tuning::moe_deep16_short = -1;
}

// The one-block routing of decode / verify steps (moe_route_small) against moe_topk + moe_permute:
// the same choices, weights, counts, offsets and tiles; every local choice a row of its expert's
// range, in (token, choice) order; other ranks' choices no row; the choices the CPU's. Ties included
// (integer logits); a rank from the tokens' bitmasks (N <= 32) and by counting (N 128).
TEST(MoeEmulated, SmallRoutingEqualsTopkAndPermute) {
  struct C {
    int64_t N, E, k, e0, El;
  };
  for (const C& c : std::vector<C>{{1, 256, 8, 0, 256}, {16, 256, 8, 0, 256}, {5, 64, 4, 16, 32}, {128, 8, 8, 0, 8}}) {
    SCOPED_TRACE("N " + std::to_string(c.N) + " E " + std::to_string(c.E) + " k " + std::to_string(c.k));
    Tensor logits = Tensor::empty({c.N, c.E}, DType::F32);
    fill_normal(logits, {4417, g_stream++, 0}, 0.0f, 2.0f);
    if (c.N == 16)
      for (int64_t i = 0; i < c.N * c.E; ++i) logits.data<float>()[i] = std::round(logits.data<float>()[i]);
    const int64_t R = c.N * c.k;
    auto i32 = [](int64_t n) {
      Tensor t = Tensor::empty({n}, DType::I32);
      std::fill_n(t.data<int32_t>(), n, -7);
      return t;
    };
    Tensor ex[2] = {i32(R), i32(R)}, cnt[2] = {i32(c.E), i32(c.E)}, off[2] = {i32(c.El + 1), i32(c.El + 1)};
    Tensor tiles[2] = {i32(c.El + 1), i32(c.El + 1)}, cur[2] = {i32(c.El), i32(c.El)};
    Tensor src[2] = {i32(R), i32(R)}, slot[2] = {i32(R), i32(R)};
    Tensor wt[2] = {Tensor::empty({R}, DType::F32), Tensor::empty({R}, DType::F32)};
    cu::moe_topk(logits.data<float>(), c.N, c.E, c.k, true, ex[0].data<int32_t>(), wt[0].data<float>(),
                 cnt[0].data<int32_t>(), nullptr);
    cu::moe_permute(ex[0].data<int32_t>(), cnt[0].data<int32_t>(), c.N, c.E, c.k, off[0].data<int32_t>(),
                    tiles[0].data<int32_t>(), cur[0].data<int32_t>(), src[0].data<int32_t>(), slot[0].data<int32_t>(),
                    nullptr, c.e0, c.El);
    cu::moe_route_small(logits.data<float>(), c.N, c.E, c.k, true, ex[1].data<int32_t>(), wt[1].data<float>(),
                        cnt[1].data<int32_t>(), off[1].data<int32_t>(), tiles[1].data<int32_t>(), cur[1].data<int32_t>(),
                        src[1].data<int32_t>(), slot[1].data<int32_t>(), nullptr, c.e0, c.El);
    for (Tensor* t : {ex, cnt, off, tiles, cur, wt})
      EXPECT_EQ(std::memcmp(t[0].raw_data(), t[1].raw_data(), t[0].nbytes()), 0) << "same values";
    ops::MoeRouting want;  // the CPU's top-k (ties: the lower expert)
    ops::moe_route_logits(logits, c.k, true, want);
    for (int64_t i = 0; i < R; ++i) {
      ASSERT_EQ(ex[1].data<int32_t>()[i], want.experts.data<int32_t>()[i]) << "choice " << i;
      ASSERT_NEAR(wt[1].data<float>()[i], want.weights.data<float>()[i], 1e-6) << "weight " << i;
    }
    for (int64_t i = 0; i < R; ++i) {
      const int32_t e = ex[1].data<int32_t>()[i] - static_cast<int32_t>(c.e0), pos = slot[1].data<int32_t>()[i];
      if (e < 0 || e >= c.El) {
        EXPECT_EQ(pos, -1) << "choice " << i;
        continue;
      }
      ASSERT_GE(pos, off[1].data<int32_t>()[e]) << "choice " << i;
      ASSERT_LT(pos, off[1].data<int32_t>()[e + 1]) << "choice " << i;
      EXPECT_EQ(src[1].data<int32_t>()[pos], i / c.k) << "choice " << i;
    }
    // (token, choice) order inside each expert's range (a token chooses an expert once).
    for (int64_t e = 0; e < c.El; ++e)
      for (int32_t pos = off[1].data<int32_t>()[e] + 1; pos < off[1].data<int32_t>()[e + 1]; ++pos)
        EXPECT_LT(src[1].data<int32_t>()[pos - 1], src[1].data<int32_t>()[pos]) << "expert " << e;
  }
}

// The extra group (a shared expert riding in the routed experts' launch): its rows are the same
// kernel's rows of a one-expert grouped GEMM over every token (bits), the routed rows are untouched
// (bits), in every tiling; gate|up with SwiGLU and down; rows past a 64-row tile.
TEST(MoeEmulated, ExtraGroupIsADenseGroupInTheSameLaunch) {
  const int64_t N = 70, H = 144, E = 3, k = 2, I = 80, R = N * k;
  const Pair x = rand_bf16({N, H}, 1.0f), gu = rand_bf16({E, 2 * I, H}, 0.1f), dn = rand_bf16({E, H, I}, 0.2f);
  const Pair sgu = rand_bf16({2 * I, H}, 0.1f), sdn = rand_bf16({H, I}, 0.2f);
  const cu_test::FixedRouting rt = cu_test::fixed_routing(N, E, k, 1);
  const Tensor &off = rt.off, &tiles = rt.tiles, &src = rt.src;
  // One expert holding every token: offsets {0, N}, tiles {0, ceil(N / 64)}.
  Tensor off1 = Tensor::empty({2}, DType::I32), tiles1 = Tensor::empty({2}, DType::I32);
  off1.data<int32_t>()[0] = 0, off1.data<int32_t>()[1] = static_cast<int32_t>(N);
  tiles1.data<int32_t>()[0] = 0, tiles1.data<int32_t>()[1] = static_cast<int32_t>((N + cu::kMoeTileRows - 1) / cu::kMoeTileRows);
  auto bf = [](int64_t r, int64_t c) {
    Tensor t = Tensor::empty({r, c}, DType::BF16);
    poison(t);
    return t;
  };
  for (int tiling : {0, 1, 2, 3, 4}) {
    SCOPED_TRACE(tiling == 0   ? "wide"
                 : tiling == 1 ? "narrow"
                 : tiling == 2 ? "deep"
                 : tiling == 3 ? "deep, 16-row blocks"
                               : "deep, 16-row blocks, 5 stages at any K");
    cu::tuning::moe_narrow_tiles = std::min(tiling, 3);
    cu::tuning::moe_deep16_short = tiling == 4 ? 0 : -1;
    Tensor act[2] = {bf(R, I), bf(R, I)}, y[2] = {bf(R, H), bf(R, H)}, sact[2] = {bf(N, I), bf(N, I)}, sout[2] = {bf(N, H), bf(N, H)};
    for (int extra : {0, 1}) {
      cu::MoeGemmParams g;
      g.x = x.bf.raw_data(), g.ldx = H, g.src_row = src.data<int32_t>(), g.w = gu.bf.raw_data(), g.y = act[extra].raw_data();
      g.ldy = I, g.offsets = off.data<int32_t>(), g.tile_offsets = tiles.data<int32_t>(), g.E = E, g.Nout = I, g.K = H;
      g.max_tiles = cu::moe_max_tiles(R, E), g.swiglu = true, g.rows = R;
      if (extra) g.extra_x = x.bf.raw_data(), g.extra_w = sgu.bf.raw_data(), g.extra_y = sact[1].raw_data(), g.extra_rows = N;
      cu::moe_grouped_gemm(g, nullptr);
      cu::MoeGemmParams d = g;
      d.x = act[extra].raw_data(), d.ldx = I, d.src_row = nullptr, d.w = dn.bf.raw_data(), d.y = y[extra].raw_data();
      d.ldy = H, d.Nout = H, d.K = I, d.swiglu = false;
      if (extra) d.extra_x = sact[1].raw_data(), d.extra_w = sdn.bf.raw_data(), d.extra_y = sout[1].raw_data();
      cu::moe_grouped_gemm(d, nullptr);
    }
    // The shared expert as a one-expert grouped GEMM of its own.
    cu::MoeGemmParams g;
    g.x = x.bf.raw_data(), g.ldx = H, g.w = sgu.bf.raw_data(), g.y = sact[0].raw_data(), g.ldy = I;
    g.offsets = off1.data<int32_t>(), g.tile_offsets = tiles1.data<int32_t>(), g.E = 1, g.Nout = I, g.K = H;
    g.max_tiles = cu::moe_max_tiles(N, 1), g.swiglu = true, g.rows = R;  // (rows: the routed call's tiling)
    cu::moe_grouped_gemm(g, nullptr);
    cu::MoeGemmParams d = g;
    d.x = sact[1].raw_data(), d.ldx = I, d.w = sdn.bf.raw_data(), d.y = sout[0].raw_data(), d.ldy = H, d.Nout = H, d.K = I;
    d.swiglu = false;
    cu::moe_grouped_gemm(d, nullptr);
    EXPECT_LT(max_rel_err(f32(sout[1]), f32(sout[1])), 1.0) << "every shared row written";
    for (auto* t : {act, y, sact, sout}) EXPECT_EQ(std::memcmp(t[0].raw_data(), t[1].raw_data(), t[0].nbytes()), 0);
  }
  cu::tuning::moe_narrow_tiles = -1;
  cu::tuning::moe_deep16_short = -1;
}

// FP8 experts for the grouped GEMMs and the fallback: moe_dequantize_experts writes exactly the
// loader's bf16 values (gate|up blocked apart at I; down in one part; partial last blocks).
TEST(MoeEmulated, Fp8ExpertsDequantizeToTheLoadersValues) {
  for (const auto& [E, R, K, split] : std::vector<std::array<int64_t, 4>>{{3, 272, 264, 136}, {2, 264, 136, 264}}) {
    const Fp8Experts f = make_fp8_experts(E, R, K, split, 21);
    Tensor y = Tensor::empty({E, R, K}, DType::BF16);
    cu::moe_dequantize_experts(f.codes.raw_data(), f.scale.data<float>(), E, R, K, split, y.raw_data(), nullptr);
    EXPECT_EQ(std::memcmp(y.raw_data(), f.bf16.raw_data(), y.nbytes()), 0) << "R " << R << " K " << K << " split " << split;
    // And back: those bf16 values quantized with the same scales give codes of the same values (the
    // checkpoint's own codes; +0 / -0 aside).
    Tensor q = Tensor::empty({E, R, K}, DType::U8), y2 = Tensor::empty({E, R, K}, DType::BF16);
    cu::moe_quantize_experts_scaled(f.bf16.raw_data(), E, R, K, split, f.scale.data<float>(), q.raw_data(), nullptr);
    cu::moe_dequantize_experts(q.raw_data(), f.scale.data<float>(), E, R, K, split, y2.raw_data(), nullptr);
    EXPECT_EQ(max_rel_err(f32(y2), f32(f.bf16)), 0.0) << "round trip, R " << R;
    int64_t same = 0;
    for (int64_t i = 0; i < E * R * K; ++i)
      same += q.data<uint8_t>()[i] == f.codes.data<uint8_t>()[i] || (f.codes.data<uint8_t>()[i] & 0x7f) == 0;
    EXPECT_EQ(same, E * R * K) << "codes recovered";
  }
}

// FP8 experts on the grouped GEMMs (w_scale): the e4m3 tiles converted in the kernel give the bits
// of the same GEMMs on the loader's bf16 values of those experts, in both tilings (gate|up with
// SwiGLU blocked apart at I, I not a multiple of 128 and partial tiles; down in one part); every tiling.
TEST(MoeEmulated, Fp8GroupedGemmsGiveTheBf16ExpertsBits) {
  const int64_t N = 23, H = 144, E = 3, k = 2, I = 80, R = N * k;
  const Fp8Experts gu = make_fp8_experts(E, 2 * I, H, I, 31), dn = make_fp8_experts(E, H, I, H, 32);
  const Pair x = rand_bf16({N, H}, 1.0f);
  // Routing: choice j of row n to expert (n + j) % E, through the permutation kernel.
  const cu_test::FixedRouting rt = cu_test::fixed_routing(N, E, k, 1);
  const Tensor &off = rt.off, &tiles = rt.tiles, &src = rt.src;
  for (int narrow : {0, 1, 2, 3, 4}) {
    cu::tuning::moe_narrow_tiles = std::min(narrow, 3);
    cu::tuning::moe_deep16_short = narrow == 4 ? 0 : -1;
    Tensor act[2], y[2];
    for (int fp8 : {0, 1}) {
      act[fp8] = Tensor::empty({R, I}, DType::BF16);
      y[fp8] = Tensor::empty({R, H}, DType::BF16);
      poison(act[fp8]);
      poison(y[fp8]);
      cu::MoeGemmParams g;
      g.x = x.bf.raw_data(), g.ldx = H, g.src_row = src.data<int32_t>(), g.y = act[fp8].raw_data(), g.ldy = I;
      g.offsets = off.data<int32_t>(), g.tile_offsets = tiles.data<int32_t>(), g.E = E, g.Nout = I, g.K = H;
      g.max_tiles = cu::moe_max_tiles(R, E), g.swiglu = true, g.rows = R;
      g.w = fp8 ? gu.codes.raw_data() : gu.bf16.raw_data();
      g.w_scale = fp8 ? gu.scale.data<float>() : nullptr;
      cu::moe_grouped_gemm(g, nullptr);
      cu::MoeGemmParams d = g;
      d.x = act[fp8].raw_data(), d.ldx = I, d.src_row = nullptr, d.y = y[fp8].raw_data(), d.ldy = H, d.Nout = H, d.K = I;
      d.swiglu = false;
      d.w = fp8 ? dn.codes.raw_data() : dn.bf16.raw_data();
      d.w_scale = fp8 ? dn.scale.data<float>() : nullptr;
      cu::moe_grouped_gemm(d, nullptr);
    }
    EXPECT_LT(max_rel_err(f32(y[1]), f32(y[1])), 1.0) << "every row written, narrow " << narrow;
    EXPECT_EQ(std::memcmp(act[0].raw_data(), act[1].raw_data(), act[0].nbytes()), 0) << "gate|up, narrow " << narrow;
    EXPECT_EQ(std::memcmp(y[0].raw_data(), y[1].raw_data(), y[0].nbytes()), 0) << "down, narrow " << narrow;
  }
  cu::tuning::moe_narrow_tiles = -1;
  cu::tuning::moe_deep16_short = -1;
}
