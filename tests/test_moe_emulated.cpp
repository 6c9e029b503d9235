// The grouped MoE path (kernels/cuda/moe.cu: top-k, the permutation by expert, the grouped mma.sync
// GEMM in both tilings, the combine; moe_stream.cu's stream-K expert GEMMs) run on the CPU through
// tests/cuda_emulation.h (mma.sync and ldmatrix emulated): routing, tile tables, expert ranges (expert
// parallelism) and the products checked on every machine, GPU or not, against the f32 CPU reference.
// The device's own runs are test_cuda_moe's (CudaMoe.*).
#include "cuda_emulation.h"

#define DFLASH_CUDA_EMULATION 1
// The stream-K expert GEMMs' names (moe_stream.cu, included here beside moe.cu, whose moe_grouped_gemm
// calls them), renamed as moe_emulated.h renames the others.
#define moe_streamk moe_streamk_emulated
#define moe_streamk_supported moe_streamk_supported_emulated
#define moe_streamk_blocks moe_streamk_blocks_emulated
#define moe_streamk_pieces moe_streamk_pieces_emulated
#define moe_grouped_gemm_stream moe_grouped_gemm_stream_emulated
#include "moe_emulated.h"
#include "kernels/cuda/moe.cu"
#include "kernels/cuda/moe_stream.cu"

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

// ---- the stream-K expert GEMMs (moe_stream.cu) ----------------------------------------------------------
namespace {

// A decode / verify step's expert GEMMs on the stream-K kernel: tokens [0, N) of the 16 in x routed by
// their rows of `logits` (moe_route_small, the decode path's routing), gate|up (row gather, SwiGLU, the
// shared expert as the extra group) then down (routing settled, as moe_block runs it), each launched on
// `blocks` blocks over its own workspace (partials NaN, counters zero: every counter must be zero again
// after the call).
struct StreamShape {
  int64_t H, E, k, I;
};
struct StreamWeights {
  Pair gu, dn, sgu, sdn;
};
struct StreamOut {
  Tensor ex, slot, src, act, y, sact, sout;  // outputs bf16: act [R, I], y [R, H], sact [N, I], sout [N, H]
};
StreamWeights stream_weights(const StreamShape& c) {
  return {rand_bf16({c.E, 2 * c.I, c.H}, 0.1f), rand_bf16({c.E, c.H, c.I}, 0.2f), rand_bf16({2 * c.I, c.H}, 0.1f),
          rand_bf16({c.H, c.I}, 0.2f)};
}

// Operands whose sums cancel, so that another summation order (other K pieces) shows in the bf16 outputs
// (with plain random values a piece layout's f32 rounding rarely reaches a bf16 bit): over the last
// dimension C, column c + C/2 = sign · column c + noise of `small` deviation, `big` the columns' deviation.
Pair halves(const Shape& s, float big, float sign, float small) {
  Tensor f = Tensor::empty(s, DType::F32), noise = Tensor::empty(s, DType::F32);
  fill_normal(f, {4431, g_stream++, 0}, 0.0f, big);
  fill_normal(noise, {4433, g_stream++, 0}, 0.0f, small);
  const int64_t C = s.back(), h = C / 2;
  for (int64_t r = 0; r < f.numel() / C; ++r)
    for (int64_t col = 0; col < h; ++col)
      f.data<float>()[r * C + h + col] =
          sign * f.data<float>()[r * C + col] + (small > 0 ? noise.data<float>()[r * C + h + col] : 0.0f);
  Tensor b = f.to_dtype(DType::BF16);
  return {b, b.to_dtype(DType::F32)};
}
// x [16, H] with x[h + H/2] = -x[h] + noise (2^12 against 1) and gate|up rows even in K (w[h + H/2] = w[h]):
// x · w = sum w[h] · noise[h], its partial sums ~2^12 times larger. The gate|up rows of act columns c and
// c + I/2 alike (the same act bits), the down rows odd in I (w[i + I/2] = -w[i] + noise: 2^14 against 1):
// act · w sums the act pairs' noise terms, its partial sums again far larger.
Pair cancelling_x(const StreamShape& c) { return halves({16, c.H}, 4096.0f, -1.0f, 1.0f); }
StreamWeights cancelling_weights(const StreamShape& c) {
  StreamWeights w{halves({c.E, 2 * c.I, c.H}, 0.1f, 1.0f, 0.0f), halves({c.E, c.H, c.I}, 3277.0f, -1.0f, 0.2f),
                  halves({2 * c.I, c.H}, 0.1f, 1.0f, 0.0f), halves({c.H, c.I}, 3277.0f, -1.0f, 0.2f)};
  for (Pair* p : {&w.gu, &w.sgu}) {  // rows c + I/2 of the gate and of the up rows = rows c
    const int64_t H = c.H, I = c.I, mats = p->f.numel() / (2 * I * H);
    for (int64_t m = 0; m < mats; ++m)
      for (int64_t part = 0; part < 2; ++part)
        for (int64_t r = 0; r < I / 2; ++r) {
          const int64_t from = (m * 2 * I + part * I + r) * H, to = from + I / 2 * H;
          std::memcpy(static_cast<char*>(p->bf.raw_data()) + to * 2, static_cast<const char*>(p->bf.raw_data()) + from * 2, H * 2);
          std::memcpy(p->f.data<float>() + to, p->f.data<float>() + from, H * 4);
        }
  }
  return w;
}
StreamOut run_streamk(const StreamShape& c, const StreamWeights& w, const Tensor& logits, const Pair& x, int64_t N,
                      int blocks) {
  const int64_t R = N * c.k;
  auto i32 = [](int64_t n) { return Tensor::empty({n}, DType::I32); };
  auto bf = [](int64_t r, int64_t cols) {
    Tensor t = Tensor::empty({r, cols}, DType::BF16);
    poison(t);
    return t;
  };
  StreamOut o{i32(R), i32(R), i32(R), bf(R, c.I), bf(R, c.H), bf(N, c.I), bf(N, c.H)};
  Tensor wt = Tensor::empty({R}, DType::F32), counts = i32(c.E), off = i32(c.E + 1), tiles = i32(c.E + 1), cur = i32(c.E);
  cu::moe_route_small(logits.data<float>(), N, c.E, c.k, true, o.ex.data<int32_t>(), wt.data<float>(),
                      counts.data<int32_t>(), off.data<int32_t>(), tiles.data<int32_t>(), cur.data<int32_t>(),
                      o.src.data<int32_t>(), o.slot.data<int32_t>(), nullptr);
  cu::MoeGemmParams g;
  g.x = x.bf.raw_data(), g.ldx = c.H, g.src_row = o.src.data<int32_t>(), g.w = w.gu.bf.raw_data(), g.y = o.act.raw_data();
  g.ldy = c.I, g.offsets = off.data<int32_t>(), g.tile_offsets = tiles.data<int32_t>(), g.E = c.E, g.Nout = c.I;
  g.K = c.H, g.max_tiles = cu::moe_max_tiles(R, c.E), g.swiglu = true, g.rows = R, g.max_expert_rows = N;
  g.extra_x = x.bf.raw_data(), g.extra_w = w.sgu.bf.raw_data(), g.extra_y = o.sact.raw_data(), g.extra_rows = N;
  cu::MoeGemmParams d = g;
  d.x = o.act.raw_data(), d.ldx = c.I, d.src_row = nullptr, d.w = w.dn.bf.raw_data(), d.y = o.y.raw_data(), d.ldy = c.H;
  d.Nout = c.H, d.K = c.I, d.swiglu = false, d.routing_settled = true;
  d.extra_x = o.sact.raw_data(), d.extra_w = w.sdn.bf.raw_data(), d.extra_y = o.sout.raw_data();
  for (const cu::MoeGemmParams* q : {&g, &d}) {
    EXPECT_TRUE(cu::moe_streamk_supported(*q));
    const cu::streamk::Shape sh = cu::streamk::shape_of(*q);
    std::vector<float> partial(sh.partial_floats(), NAN);
    std::vector<int> counters(sh.counter_ints(), 0);
    cu::streamk::launch(*q, blocks, partial.data(), counters.data(), nullptr);
    int64_t left = 0;
    for (int v : counters) left += v != 0;
    EXPECT_EQ(left, 0) << "counters not back to zero (" << (q == &g ? "gate|up" : "down") << ", grid " << blocks << ")";
  }
  return o;
}

// The GEMMs' references in double: act = silu(x · gate) · (x · up) of each routed row (its token, its
// expert) and of the shared rows, y = act · down on the kernel's own act (bf16), likewise the shared rows.
void expect_streamk_matches(const StreamShape& c, const StreamWeights& w, const Pair& x, int64_t N, const StreamOut& o) {
  const int64_t R = N * c.k, H = c.H, I = c.I;
  Tensor act_ref = Tensor::empty({R, I}, DType::F32), y_ref = Tensor::empty({R, H}, DType::F32);
  Tensor sact_ref = Tensor::empty({N, I}, DType::F32), sout_ref = Tensor::empty({N, H}, DType::F32);
  const Tensor act = f32(o.act), sact = f32(o.sact);
  // Row `row` of act / y: token n through gate|up rows gu (2I x H) and down rows dn (H x I).
  auto rows = [&](int64_t n, const float* gu, const float* dn, const float* a_got, float* a_ref, float* y_ref_row) {
    for (int64_t col = 0; col < I; ++col) {
      double gs = 0, us = 0;
      for (int64_t h = 0; h < H; ++h) {
        gs += double(x.f.data<float>()[n * H + h]) * gu[col * H + h];
        us += double(x.f.data<float>()[n * H + h]) * gu[(I + col) * H + h];
      }
      a_ref[col] = static_cast<float>(gs / (1.0 + std::exp(-gs)) * us);
    }
    for (int64_t col = 0; col < H; ++col) {
      double s = 0;
      for (int64_t i = 0; i < I; ++i) s += double(a_got[i]) * dn[col * I + i];
      y_ref_row[col] = static_cast<float>(s);
    }
  };
  for (int64_t i = 0; i < R; ++i) {
    const int64_t pos = o.slot.data<int32_t>()[i], e = o.ex.data<int32_t>()[i];
    ASSERT_EQ(o.src.data<int32_t>()[pos], i / c.k);
    rows(i / c.k, w.gu.f.data<float>() + e * 2 * I * H, w.dn.f.data<float>() + e * H * I, act.data<float>() + pos * I,
         act_ref.data<float>() + pos * I, y_ref.data<float>() + pos * H);
  }
  for (int64_t n = 0; n < N; ++n)
    rows(n, w.sgu.f.data<float>(), w.sdn.f.data<float>(), sact.data<float>() + n * I, sact_ref.data<float>() + n * I,
         sout_ref.data<float>() + n * H);
  // (bf16 outputs: 2^-9 relative; a lost piece, tile or token row is O(1))
  EXPECT_LE(max_rel_err(act, act_ref), 1e-2) << "gate|up";
  EXPECT_LE(max_rel_err(f32(o.y), y_ref), 1e-2) << "down";
  EXPECT_LE(max_rel_err(sact, sact_ref), 1e-2) << "shared gate|up";
  EXPECT_LE(max_rel_err(f32(o.sout), sout_ref), 1e-2) << "shared down";
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

// Shapes: gate|up K (H) 512 in 4 pieces of 128 columns, I 80 (a last tile of 16 act columns; the down
// GEMM's K 80 one piece: its tiles stored by their warps, a last step of 16 columns); K 136 in 2 pieces
// (the second one step of 8 columns), I 256 (the down GEMM's K in 2 pieces, its Nout 136 a partial tile).
const StreamShape kStreamShapes[] = {{512, 8, 4, 80}, {136, 16, 3, 256}};

}  // namespace

// The stream-K GEMMs against double references, on grids that split a tile's pieces every way (one block:
// a warp holding pieces of several tiles and groups; a tile's pieces in warps of one block, of two
// blocks, the last piece first or last to arrive; grids past the items: empty warps), every grid the
// same bits; a second run on a grid its bits.
TEST(MoeEmulated, StreamKGemmsMatchTheReferenceOnEveryGrid) {
  for (const StreamShape& c : kStreamShapes) {
    const StreamWeights w = stream_weights(c);
    const Pair x = rand_bf16({16, c.H}, 1.0f);
    Tensor logits = Tensor::empty({16, c.E}, DType::F32);
    fill_normal(logits, {4419, g_stream++, 0}, 0.0f, 2.0f);
    for (const auto& [N, grids] : std::vector<std::pair<int64_t, std::vector<int>>>{{16, {1, 7, 400, 7}}, {5, {1, 3}}}) {
      StreamOut first;
      for (int blocks : grids) {
        SCOPED_TRACE("H " + std::to_string(c.H) + " I " + std::to_string(c.I) + " N " + std::to_string(N) + " grid " +
                     std::to_string(blocks));
        const StreamOut o = run_streamk(c, w, logits, x, N, blocks);
        if (blocks == 1) {
          expect_streamk_matches(c, w, x, N, o);
          first = o;
          continue;
        }
        EXPECT_TRUE(same_bits(o.act, first.act) && same_bits(o.y, first.y)) << "routed rows: grid 1's bits";
        EXPECT_TRUE(same_bits(o.sact, first.sact) && same_bits(o.sout, first.sout)) << "shared rows: grid 1's bits";
      }
    }
  }
}

// A token row's bits do not depend on the step's other tokens (decode == verify): token n's act and y
// rows (each of its choices, wherever the permutation puts them) and its shared rows at N = 1, 2, 5 and
// 16 tokens, each N on another grid, against the 16-token step's. On operands whose sums cancel, where
// another piece layout gives other bits (checked first: tuning::moe_streamk_pieces 1, one piece), so a
// layout that moved with N would show; and within the references' bound.
TEST(MoeEmulated, StreamKRowsDoNotDependOnTheTokens) {
  for (const StreamShape& c : kStreamShapes) {
    SCOPED_TRACE("H " + std::to_string(c.H) + " I " + std::to_string(c.I));
    const StreamWeights w = cancelling_weights(c);
    const Pair x = cancelling_x(c);
    Tensor logits = Tensor::empty({16, c.E}, DType::F32);
    fill_normal(logits, {4423, g_stream++, 0}, 0.0f, 2.0f);
    const StreamOut all = run_streamk(c, w, logits, x, 16, 5);
    expect_streamk_matches(c, w, x, 16, all);
    {
      cu::tuning::moe_streamk_pieces = 1;
      const StreamOut one = run_streamk(c, w, logits, x, 16, 5);
      cu::tuning::moe_streamk_pieces = cu::kMoeStreamkPieces;
      EXPECT_FALSE(same_bits(one.act, all.act)) << "the gate|up bits of one K piece: the check below can fail";
      if (c.I > 128) {  // (the down GEMM's K I in more than one piece)
        EXPECT_FALSE(same_bits(one.y, all.y)) << "the down bits of one K piece";
      }
    }
    const int64_t row_bytes[2] = {c.I * 2, c.H * 2};
    for (const auto& [N, blocks] : std::vector<std::pair<int64_t, int>>{{1, 1}, {2, 3}, {5, 2}, {16, 13}}) {
      const StreamOut o = run_streamk(c, w, logits, x, N, blocks);
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t j = 0; j < c.k; ++j) {
          const int64_t i = n * c.k + j, pa = all.slot.data<int32_t>()[i], po = o.slot.data<int32_t>()[i];
          ASSERT_EQ(all.ex.data<int32_t>()[i], o.ex.data<int32_t>()[i]) << "token " << n << " choice " << j;
          EXPECT_EQ(std::memcmp(static_cast<const char*>(o.act.raw_data()) + po * row_bytes[0],
                                static_cast<const char*>(all.act.raw_data()) + pa * row_bytes[0], row_bytes[0]),
                    0)
              << "act of token " << n << " choice " << j << " at N " << N;
          EXPECT_EQ(std::memcmp(static_cast<const char*>(o.y.raw_data()) + po * row_bytes[1],
                                static_cast<const char*>(all.y.raw_data()) + pa * row_bytes[1], row_bytes[1]),
                    0)
              << "y of token " << n << " choice " << j << " at N " << N;
        }
        EXPECT_EQ(std::memcmp(static_cast<const char*>(o.sact.raw_data()) + n * row_bytes[0],
                              static_cast<const char*>(all.sact.raw_data()) + n * row_bytes[0], row_bytes[0]),
                  0)
            << "shared act of token " << n << " at N " << N;
        EXPECT_EQ(std::memcmp(static_cast<const char*>(o.sout.raw_data()) + n * row_bytes[1],
                              static_cast<const char*>(all.sout.raw_data()) + n * row_bytes[1], row_bytes[1]),
                  0)
            << "shared out of token " << n << " at N " << N;
      }
    }
  }
}

// moe_grouped_gemm takes the stream-K kernel where tuning::moe_streamk is 1 and the call is supported
// (its per-device workspace: host memory here; the counters it leaves zero), the other tilings otherwise;
// both within the reference's bound of each other (other summation orders: not the same bits).
TEST(MoeEmulated, GroupedGemmTakesTheStreamKKernelWhereTheKnobSays) {
  const StreamShape c = kStreamShapes[0];
  const int64_t N = 16, R = N * c.k;
  const StreamWeights w = stream_weights(c);
  const Pair x = rand_bf16({N, c.H}, 1.0f);
  Tensor logits = Tensor::empty({N, c.E}, DType::F32);
  fill_normal(logits, {4427, g_stream++, 0}, 0.0f, 2.0f);
  const StreamOut direct = run_streamk(c, w, logits, x, N, 3);  // (the emulated workspace's grid)
  cu::MoeGemmParams g;
  g.x = x.bf.raw_data(), g.ldx = c.H, g.src_row = direct.src.data<int32_t>(), g.w = w.gu.bf.raw_data(), g.ldy = c.I;
  g.E = c.E, g.Nout = c.I, g.K = c.H, g.max_tiles = cu::moe_max_tiles(R, c.E), g.swiglu = true, g.rows = R;
  g.max_expert_rows = N, g.extra_x = x.bf.raw_data(), g.extra_w = w.sgu.bf.raw_data(), g.extra_rows = N;
  // The routing again (run_streamk's tables are its own).
  Tensor ex = Tensor::empty({R}, DType::I32), wt = Tensor::empty({R}, DType::F32), counts = Tensor::empty({c.E}, DType::I32);
  Tensor off = Tensor::empty({c.E + 1}, DType::I32), tiles = Tensor::empty({c.E + 1}, DType::I32);
  Tensor cur = Tensor::empty({c.E}, DType::I32), src = Tensor::empty({R}, DType::I32), slot = Tensor::empty({R}, DType::I32);
  cu::moe_route_small(logits.data<float>(), N, c.E, c.k, true, ex.data<int32_t>(), wt.data<float>(), counts.data<int32_t>(),
                      off.data<int32_t>(), tiles.data<int32_t>(), cur.data<int32_t>(), src.data<int32_t>(),
                      slot.data<int32_t>(), nullptr);
  g.src_row = src.data<int32_t>(), g.offsets = off.data<int32_t>(), g.tile_offsets = tiles.data<int32_t>();
  Tensor act[2], sact[2];
  for (int knob : {1, -1}) {
    cu::tuning::moe_streamk = knob;
    EXPECT_EQ(cu::moe_streamk(g), knob == 1);
    Tensor& a = act[knob == 1 ? 0 : 1];
    Tensor& sa = sact[knob == 1 ? 0 : 1];
    a = Tensor::empty({R, c.I}, DType::BF16);
    sa = Tensor::empty({N, c.I}, DType::BF16);
    poison(a);
    poison(sa);
    g.y = a.raw_data(), g.extra_y = sa.raw_data();
    cu::moe_grouped_gemm(g, nullptr);
  }
  cu::tuning::moe_streamk = -1;
  EXPECT_TRUE(same_bits(act[0], direct.act) && same_bits(sact[0], direct.sact)) << "the stream-K kernel's bits";
  EXPECT_LE(max_rel_err(f32(act[1]), f32(act[0])), 1e-2) << "the 16-row deep blocks";
  EXPECT_LE(max_rel_err(f32(sact[1]), f32(sact[0])), 1e-2);
  {
    const cu::streamk::Shape sh = cu::streamk::shape_of(g);
    const cu::streamk::Workspace& ws = cu::streamk::workspace(sh);
    int64_t left = 0;
    for (size_t i = 0; i < sh.counter_ints(); ++i) left += ws.counters[i] != 0;
    EXPECT_EQ(left, 0) << "the per-device workspace's counters";
  }
  // Supported: bf16 weights, the rows known, <= 16 rows an expert and in the extra group.
  cu::tuning::moe_streamk = 1;
  cu::MoeGemmParams q = g;
  EXPECT_TRUE(cu::moe_streamk(q));
  q.max_expert_rows = 17;
  EXPECT_FALSE(cu::moe_streamk(q));
  q = g, q.max_expert_rows = -1;
  EXPECT_FALSE(cu::moe_streamk(q));
  q = g, q.rows = -1;
  EXPECT_FALSE(cu::moe_streamk(q));
  q = g, q.extra_rows = 17;
  EXPECT_FALSE(cu::moe_streamk(q));
  q = g, q.w_scale = logits.data<float>();
  EXPECT_FALSE(cu::moe_streamk(q));
  cu::tuning::moe_streamk = 0;
  EXPECT_FALSE(cu::moe_streamk(g));
  cu::tuning::moe_streamk = -1;
  EXPECT_FALSE(cu::moe_streamk(g)) << "off by default (it loses to deep16)";
}
