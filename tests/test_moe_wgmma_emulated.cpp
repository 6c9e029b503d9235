// The wgmma grouped expert GEMM (kernels/cuda/moe_sm90.cu) run on the CPU through
// tests/cuda_emulation.h (wgmma m64n64k16 from swizzled shared memory emulated): its tile table,
// gathered rows, panel layout, 4-stage cp.async ring (k tiles past the ring's length, a partial last
// tile), SwiGLU pairing of gate and up accumulators and partial column blocks, against the f32
// reference. The device's own runs are test_cuda_moe's (CudaMoe.* with tuning::moe_wgmma).
#include "cuda_emulation.h"

#define DFLASH_CUDA_EMULATION 1
#include "moe_emulated.h"
#include "kernels/cuda/moe_sm90.cu"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/random.h"
#include "core/tensor.h"
#include "moe_emulated_routing.h"
#include "test_util.h"

namespace {

using namespace dflash;
namespace cu = dflash::cuda;
namespace cu_test = dflash::cuda_test;

Tensor rand_bf16(const Shape& s, float sd, uint64_t stream) {
  Tensor f = Tensor::empty(s, DType::F32);
  fill_normal(f, {4431, stream, 0}, 0.0f, sd);
  return f.to_dtype(DType::BF16);
}
float at(const Tensor& bf, int64_t i) { return __bfloat162float(bf.data<__nv_bfloat16>()[i]); }

}  // namespace

TEST(MoeEmulated, WgmmaGroupedGemmsMatchTheReference) {
  struct G {
    int64_t N, H, E, k, I;
  };
  uint64_t stream = 1;
  for (const G& c : std::vector<G>{{40, 320, 4, 2, 80}, {9, 72, 3, 3, 24}}) {
    SCOPED_TRACE("N " + std::to_string(c.N) + " H " + std::to_string(c.H) + " I " + std::to_string(c.I));
    const int64_t R = c.N * c.k;
    const Tensor x = rand_bf16({c.N, c.H}, 1.0f, stream++), gu = rand_bf16({c.E, 2 * c.I, c.H}, 0.1f, stream++);
    const Tensor dn = rand_bf16({c.E, c.H, c.I}, 0.2f, stream++);
    // Choice j of row n to expert (n + 2j) % E, permuted by the (emulated) moe_permute.
    const cu_test::FixedRouting rt = cu_test::fixed_routing(c.N, c.E, c.k, 2);
    const Tensor &off = rt.off, &tiles = rt.tiles, &src = rt.src;
    Tensor act = Tensor::empty({R, c.I}, DType::BF16), y = Tensor::empty({R, c.H}, DType::BF16);
    poison(act);
    poison(y);
    cu::MoeGemmParams g;
    g.x = x.raw_data(), g.ldx = c.H, g.src_row = src.data<int32_t>(), g.w = gu.raw_data(), g.y = act.raw_data();
    g.ldy = c.I, g.offsets = off.data<int32_t>(), g.tile_offsets = tiles.data<int32_t>(), g.E = c.E, g.Nout = c.I;
    g.K = c.H, g.max_tiles = cu::moe_max_tiles(R, c.E), g.swiglu = true, g.rows = R;
    cu::moe_grouped_gemm_wgmma(g, nullptr);
    cu::MoeGemmParams d = g;
    d.x = act.raw_data(), d.ldx = c.I, d.src_row = nullptr, d.w = dn.raw_data(), d.y = y.raw_data(), d.ldy = c.H;
    d.Nout = c.H, d.K = c.I, d.swiglu = false;
    cu::moe_grouped_gemm_wgmma(d, nullptr);
    // The reference, per permuted row: its token's x against its expert's rows (gate|up), and the
    // kernel's own act row against the down rows (each GEMM checked on its own inputs).
    double worst_act = 0, worst_y = 0;
    for (int64_t e = 0; e < c.E; ++e)
      for (int64_t pos = off.data<int32_t>()[e]; pos < off.data<int32_t>()[e + 1]; ++pos) {
        const int64_t n = src.data<int32_t>()[pos];
        for (int64_t col = 0; col < c.I; ++col) {
          double gs = 0, us = 0;
          for (int64_t h = 0; h < c.H; ++h) {
            gs += at(x, n * c.H + h) * at(gu, (e * 2 * c.I + col) * c.H + h);
            us += at(x, n * c.H + h) * at(gu, (e * 2 * c.I + c.I + col) * c.H + h);
          }
          const double want = gs / (1.0 + std::exp(-gs)) * us, got = at(act, pos * c.I + col);
          ASSERT_FALSE(std::isnan(got)) << "act row " << pos << " column " << col << " not written";
          worst_act = std::max(worst_act, std::abs(got - want) / (std::abs(want) + 0.05));
        }
        for (int64_t h = 0; h < c.H; ++h) {
          double s = 0;
          for (int64_t col = 0; col < c.I; ++col) s += at(act, pos * c.I + col) * at(dn, (e * c.H + h) * c.I + col);
          const double got = at(y, pos * c.H + h);
          ASSERT_FALSE(std::isnan(got)) << "y row " << pos << " column " << h << " not written";
          worst_y = std::max(worst_y, std::abs(got - s) / (std::abs(s) + 0.05));
        }
      }
    // bf16 outputs of fp32 sums: within a few bf16 ulps (2^-8 relative) of the f64 reference.
    EXPECT_LT(worst_act, 1.6e-2);
    EXPECT_LT(worst_y, 1.6e-2);
  }
}

// The extra group (a shared expert in the routed experts' launch) on the wgmma kernel: its rows are
// the kernel's rows of a one-expert grouped GEMM over every token, the routed rows untouched (bits).
TEST(MoeEmulated, WgmmaExtraGroupIsADenseGroupInTheSameLaunch) {
  const int64_t N = 70, H = 72, E = 3, k = 2, I = 24, R = N * k;
  const Tensor x = rand_bf16({N, H}, 1.0f, 101), gu = rand_bf16({E, 2 * I, H}, 0.1f, 102), sgu = rand_bf16({2 * I, H}, 0.1f, 103);
  const cu_test::FixedRouting rt = cu_test::fixed_routing(N, E, k, 1);
  const Tensor &off = rt.off, &tiles = rt.tiles, &src = rt.src;
  Tensor off1 = Tensor::empty({2}, DType::I32), tiles1 = Tensor::empty({2}, DType::I32);
  off1.data<int32_t>()[0] = 0, off1.data<int32_t>()[1] = static_cast<int32_t>(N);
  tiles1.data<int32_t>()[0] = 0, tiles1.data<int32_t>()[1] = static_cast<int32_t>((N + cu::kMoeTileRows - 1) / cu::kMoeTileRows);
  Tensor act[2], sact[2];
  for (int extra : {0, 1}) {
    act[extra] = Tensor::empty({R, I}, DType::BF16);
    sact[extra] = Tensor::empty({N, I}, DType::BF16);
    poison(act[extra]);
    poison(sact[extra]);
    cu::MoeGemmParams g;
    g.x = x.raw_data(), g.ldx = H, g.src_row = src.data<int32_t>(), g.w = gu.raw_data(), g.y = act[extra].raw_data();
    g.ldy = I, g.offsets = off.data<int32_t>(), g.tile_offsets = tiles.data<int32_t>(), g.E = E, g.Nout = I, g.K = H;
    g.max_tiles = cu::moe_max_tiles(R, E), g.swiglu = true, g.rows = R;
    if (extra) g.extra_x = x.raw_data(), g.extra_w = sgu.raw_data(), g.extra_y = sact[1].raw_data(), g.extra_rows = N;
    cu::moe_grouped_gemm_wgmma(g, nullptr);
  }
  cu::MoeGemmParams g;
  g.x = x.raw_data(), g.ldx = H, g.w = sgu.raw_data(), g.y = sact[0].raw_data(), g.ldy = I;
  g.offsets = off1.data<int32_t>(), g.tile_offsets = tiles1.data<int32_t>(), g.E = 1, g.Nout = I, g.K = H;
  g.max_tiles = cu::moe_max_tiles(N, 1), g.swiglu = true, g.rows = N;
  cu::moe_grouped_gemm_wgmma(g, nullptr);
  EXPECT_EQ(std::memcmp(act[0].raw_data(), act[1].raw_data(), act[0].nbytes()), 0) << "routed rows";
  EXPECT_EQ(std::memcmp(sact[0].raw_data(), sact[1].raw_data(), sact[0].nbytes()), 0) << "shared rows";
}
