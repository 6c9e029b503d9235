// The MoE kernels (kernels/cuda/moe.h) against the f32 CPU reference (ops::moe_route,
// ops::moe_experts, ops::add_sigmoid_gated, ops::linear / swiglu). Fresh seeded inputs per case,
// every output poisoned (NaN) before the launch, NaN fails.
//
// Routing: moe_topk is checked on the very logits the GPU holds: the CPU reference routes them
// through moe_route(logits, identity) (its dot products with a one-hot row are exact), so the
// chosen experts must be identical, ties included (integer-valued logits: many exact ties, the
// lower index wins on both). Weights: within 1e-5 relative (expf vs std::exp, summation order).
// In the whole block the GPU's router logits (bf16 GEMM, fp32 out) differ from the CPU's f32 ones
// by ~1e-6 relative; a token whose CPU choice differs must have the swapped experts' CPU scores
// within 1e-4 of each other (a near tie), and the expert outputs are checked on the GPU's choices.
// Outputs (bf16): max |got - ref| / max |ref| <= 1e-2 (bf16 rounding of the activations ~2^-9 and
// of the expert outputs; a wrong row, expert or weight is >= 1e-1).
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <set>
#include <vector>

#include "core/cuda/check.h"
#include "core/device.h"
#include "core/random.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/pdl.cuh"
#include "moe_fp8_util.h"
#include "kernels/ops.h"
#include "test_util.h"

using namespace dflash;
namespace cu = dflash::cuda;

namespace {

constexpr double kBound = 1e-2;
uint64_t g_stream = 9100;

struct Pair {
  Tensor dev;   // bf16 (or f32), cuda:0
  Tensor host;  // f32, cpu
};
Pair rand_bf16(const Shape& shape, float stddev) {
  Tensor f = Tensor::empty(shape, DType::F32);
  fill_normal(f, {3311, g_stream++, 0}, 0.0f, stddev);
  Tensor b = f.to_dtype(DType::BF16);
  return {b.to(Device::cuda(0)), b.to_dtype(DType::F32)};
}
Tensor dev_i32(int64_t n) {
  Tensor t = Tensor::empty({n}, DType::I32, Device::cuda(0));
  poison(t);
  return t;
}
Tensor host(const Tensor& t) { return t.to(Device::cpu()); }
Tensor host_f32(const Tensor& t) { return t.to(Device::cpu()).to_dtype(DType::F32); }
cu::Stream stream() { return DeviceContext::get(0).stream(); }

// The routing of N tokens over E experts by logits already on the GPU: moe_topk then moe_permute into
// buffers of their own (the inputs of the grouped GEMM tests and of the bench's GEMMs).
struct Routed {
  Tensor ex, counts, off, tiles, cur, src, slot, wt;
};
Routed route(const Tensor& logits_dev, int64_t N, int64_t E, int64_t k) {
  const int64_t R = N * k;
  Routed r{dev_i32(R), dev_i32(E), dev_i32(E + 1), dev_i32(E + 1), dev_i32(E), dev_i32(R), dev_i32(R),
           Tensor::empty({R}, DType::F32, Device::cuda(0))};
  cu::moe_topk(logits_dev.data<float>(), N, E, k, true, r.ex.data<int32_t>(), r.wt.data<float>(), r.counts.data<int32_t>(),
               stream());
  cu::moe_permute(r.ex.data<int32_t>(), r.counts.data<int32_t>(), N, E, k, r.off.data<int32_t>(), r.tiles.data<int32_t>(),
                  r.cur.data<int32_t>(), r.src.data<int32_t>(), r.slot.data<int32_t>(), stream());
  return r;
}
void sync_dev() { DeviceContext::get(0).synchronize(); }

Tensor eye(int64_t E) {
  Tensor t = Tensor::zeros({E, E}, DType::F32);
  for (int64_t e = 0; e < E; ++e) t.data<float>()[e * E + e] = 1.0f;
  return t;
}

struct TopkCase {
  int64_t N, E, k;
  bool renorm, ties;
};

void check_topk(const TopkCase& c) {
  SCOPED_TRACE("N " + std::to_string(c.N) + " E " + std::to_string(c.E) + " k " + std::to_string(c.k) +
               (c.ties ? " ties" : ""));
  Tensor lf = Tensor::empty({c.N, c.E}, DType::F32);
  fill_normal(lf, {77, g_stream++, 0}, 0.0f, 2.0f);
  if (c.ties)
    for (int64_t i = 0; i < lf.numel(); ++i) lf.data<float>()[i] = std::round(lf.data<float>()[i]);
  Tensor ld = lf.to(Device::cuda(0));
  Tensor ex = dev_i32(c.N * c.k), counts = dev_i32(c.E);
  Tensor wt = Tensor::empty({c.N * c.k}, DType::F32, Device::cuda(0));
  poison(wt);
  cu::moe_topk(ld.data<float>(), c.N, c.E, c.k, c.renorm, ex.data<int32_t>(), wt.data<float>(),
               counts.data<int32_t>(), stream());
  sync_dev();
  ops::MoeRouting ref;
  ops::moe_route(lf, eye(c.E), c.k, c.renorm, ref);
  Tensor ge = host(ex), gw = host(wt), gc = host(counts);
  int64_t bad_e = 0;
  double werr = 0;
  std::vector<int32_t> hist(static_cast<size_t>(c.E), 0);
  for (int64_t i = 0; i < c.N * c.k; ++i) {
    bad_e += ge.data<int32_t>()[i] != ref.experts.data<int32_t>()[i];
    const float r = ref.weights.data<float>()[i], g = gw.data<float>()[i];
    werr = std::max(werr, std::isnan(g) ? double(INFINITY) : double(std::abs(g - r) / std::max(std::abs(r), 1e-30f)));
    hist[static_cast<size_t>(ref.experts.data<int32_t>()[i])] += 1;
  }
  EXPECT_EQ(bad_e, 0) << "chosen experts differ from the CPU's";
  EXPECT_LE(werr, 1e-5) << "routing weights";
  for (int64_t e = 0; e < c.E; ++e) EXPECT_EQ(gc.data<int32_t>()[e], hist[static_cast<size_t>(e)]) << "count of " << e;
}

// The permutation's invariants from given experts.
void check_permute(int64_t N, int64_t E, int64_t k) {
  SCOPED_TRACE("permute N " + std::to_string(N) + " E " + std::to_string(E) + " k " + std::to_string(k));
  Tensor lf = Tensor::empty({N, E}, DType::F32);
  fill_normal(lf, {78, g_stream++, 0}, 0.0f, 1.0f);
  // Skew the routing: experts 0..3 get most tokens (several row tiles), the last ones none.
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) lf.data<float>()[n * E + e] += e < 4 ? 4.0f : (e >= E - 2 ? -50.0f : 0.0f);
  Tensor ld = lf.to(Device::cuda(0));
  const int64_t R = N * k;
  Routed rt = route(ld, N, E, k);
  Tensor &ex = rt.ex, &counts = rt.counts, &off = rt.off, &tiles = rt.tiles, &src = rt.src, &slot = rt.slot;
  sync_dev();
  Tensor he = host(ex), hc = host(counts), ho = host(off), ht = host(tiles), hs = host(src), hp = host(slot);
  const int32_t *E_ = he.data<int32_t>(), *C = hc.data<int32_t>(), *O = ho.data<int32_t>(), *T = ht.data<int32_t>(),
                *S = hs.data<int32_t>(), *P = hp.data<int32_t>();
  ASSERT_EQ(O[0], 0);
  ASSERT_EQ(T[0], 0);
  for (int64_t e = 0; e < E; ++e) {
    ASSERT_EQ(O[e + 1] - O[e], C[e]) << "offsets of expert " << e;
    ASSERT_EQ(T[e + 1] - T[e], (C[e] + cu::kMoeTileRows - 1) / cu::kMoeTileRows) << "tiles of expert " << e;
  }
  ASSERT_EQ(O[E], R);
  EXPECT_LE(T[E], cu::moe_max_tiles(R, E));
  EXPECT_GT(C[0], cu::kMoeTileRows) << "the case should give an expert several tiles";
  EXPECT_EQ(C[E - 1], 0) << "the case should leave an expert empty";
  std::vector<int> seen(static_cast<size_t>(R), 0);
  for (int64_t i = 0; i < R; ++i) {
    const int32_t pos = P[i], e = E_[i];
    ASSERT_TRUE(pos >= 0 && pos < R) << "slot_pos " << pos;
    seen[static_cast<size_t>(pos)] += 1;
    EXPECT_TRUE(pos >= O[e] && pos < O[e + 1]) << "row " << pos << " of (token " << i / k << ", expert " << e << ")";
    EXPECT_EQ(S[pos], i / k) << "src_row of row " << pos;
  }
  for (int64_t i = 0; i < R; ++i) EXPECT_EQ(seen[static_cast<size_t>(i)], 1) << "row " << i << " used";
}

// The grouped GEMM alone (no swiglu, odd Nout, K not a multiple of 32) vs per-row dot products.
void check_grouped_plain(int64_t N, int64_t E, int64_t k, int64_t Nout, int64_t K) {
  SCOPED_TRACE("grouped plain Nout " + std::to_string(Nout) + " K " + std::to_string(K));
  const int64_t R = N * k;
  Tensor lf = Tensor::empty({N, E}, DType::F32);
  fill_normal(lf, {79, g_stream++, 0}, 0.0f, 1.0f);
  Tensor ld = lf.to(Device::cuda(0));
  Routed rt = route(ld, N, E, k);
  Tensor &ex = rt.ex, &off = rt.off, &tiles = rt.tiles, &src = rt.src, &slot = rt.slot;
  Pair x = rand_bf16({N, K}, 1.0f), w = rand_bf16({E, Nout, K}, 1.0f / std::sqrt(float(K)));
  Tensor y = Tensor::empty({R, Nout}, DType::BF16, Device::cuda(0));
  poison(y);
  cu::MoeGemmParams g;
  g.x = x.dev.raw_data();
  g.ldx = K;
  g.src_row = src.data<int32_t>();
  g.w = w.dev.raw_data();
  g.y = y.raw_data();
  g.ldy = Nout;
  g.offsets = off.data<int32_t>();
  g.tile_offsets = tiles.data<int32_t>();
  g.E = E;
  g.Nout = Nout;
  g.K = K;
  g.max_tiles = cu::moe_max_tiles(R, E);
  cu::moe_grouped_gemm(g, stream());
  sync_dev();
  Tensor hy = host_f32(y), he = host(ex), hp = host(slot);
  Tensor ref = Tensor::empty({R, Nout}, DType::F32);
  for (int64_t i = 0; i < R; ++i) {
    const int64_t n = i / k, e = he.data<int32_t>()[i], pos = hp.data<int32_t>()[i];
    for (int64_t c = 0; c < Nout; ++c) {
      float s = 0;
      for (int64_t q = 0; q < K; ++q) s += x.host.data<float>()[n * K + q] * w.host.data<float>()[(e * Nout + c) * K + q];
      ref.data<float>()[pos * Nout + c] = s;
    }
  }
  EXPECT_LE(max_rel_err(hy, ref), kBound);
}

// The block's weights (device pointers; no shared expert when sgu is null).
void set_weights(cu::MoeBlockParams& p, const void* router, const void* gu, const void* dn, const void* sgu = nullptr,
                 const void* sdn = nullptr, const void* sg = nullptr) {
  p.router = router;
  p.experts_gate_up = gu;
  p.experts_down = dn;
  p.shared_gate_up = sgu;
  p.shared_down = sdn;
  p.shared_gate = sg;
}

struct BlockCase {
  int64_t N, H, E, k, I, Is;
  bool renorm;
  int64_t routed = -1;  // MoeBlockParams::routed: rows after these get the shared expert alone
  bool forced = false;  // route by given logits (MoeBlockParams::logits_in) instead of the router's
};

void check_block(const BlockCase& c, cu::MoeImpl impl) {
  SCOPED_TRACE(std::string(cu::moe_impl_name(impl)) + " N " + std::to_string(c.N) + " H " + std::to_string(c.H) +
               " E " + std::to_string(c.E) + " k " + std::to_string(c.k) + " I " + std::to_string(c.I) + " Is " +
               std::to_string(c.Is) + " routed " + std::to_string(c.routed) + (c.forced ? " forced" : ""));
  const int64_t Nr = c.routed < 0 ? c.N : c.routed;
  const float ws = 1.0f / std::sqrt(float(c.H));
  Pair x = rand_bf16({c.N, c.H}, 1.0f), router = rand_bf16({c.E, c.H}, ws);
  Pair gu = rand_bf16({c.E, 2 * c.I, c.H}, ws), dn = rand_bf16({c.E, c.H, c.I}, 1.0f / std::sqrt(float(c.I)));
  Pair sgu, sdn, sg;
  if (c.Is) {
    sgu = rand_bf16({2 * c.Is, c.H}, ws);
    sdn = rand_bf16({c.H, c.Is}, 1.0f / std::sqrt(float(c.Is)));
    sg = rand_bf16({1, c.H}, ws);
  }
  Tensor out = Tensor::empty({c.N, c.H}, DType::BF16, Device::cuda(0));
  poison(out);
  Tensor ex = dev_i32(Nr * c.k), wt = Tensor::empty({Nr * c.k}, DType::F32, Device::cuda(0));
  Tensor lg_out = Tensor::empty({c.N, c.E}, DType::F32, Device::cuda(0));
  poison(wt);
  poison(lg_out);
  // Forced routing: logits of another model (random, wide apart) that the block must follow.
  Tensor forced_host, forced_dev;
  if (c.forced) {
    forced_host = Tensor::empty({c.N, c.E}, DType::F32);
    fill_normal(forced_host, {80, g_stream++, 0}, 0.0f, 3.0f);
    forced_dev = forced_host.to(Device::cuda(0));
  }
  const size_t bytes = cu::moe_workspace_bytes(c.N, c.H, c.E, c.k, c.I, c.Is, impl);
  Tensor ws_t = Tensor::empty({static_cast<int64_t>(bytes)}, DType::U8, Device::cuda(0));
  DFLASH_CUDA_CHECK(cudaMemset(ws_t.raw_data(), 0xff, bytes));  // NaN-ish garbage in every scratch buffer
  cu::MoeBlockParams p;
  p.x = x.dev.raw_data();
  p.N = c.N;
  p.H = c.H;
  p.E = c.E;
  p.k = c.k;
  p.I = c.I;
  p.Is = c.Is;
  p.renormalize = c.renorm;
  if (c.Is)
    set_weights(p, router.dev.raw_data(), gu.dev.raw_data(), dn.dev.raw_data(), sgu.dev.raw_data(), sdn.dev.raw_data(),
                sg.dev.raw_data());
  else
    set_weights(p, router.dev.raw_data(), gu.dev.raw_data(), dn.dev.raw_data());
  p.out = out.raw_data();
  p.workspace = ws_t.raw_data();
  p.experts_out = ex.data<int32_t>();
  p.weights_out = wt.data<float>();
  p.logits_out = lg_out.data<float>();
  p.routed = c.routed;
  if (c.forced) p.logits_in = forced_dev.data<float>();
  cu::moe_block(p, impl, 0);
  sync_dev();

  // The router's logits (logits_out, every row, forced or not) vs the CPU's f32 ones on the same
  // bf16 inputs: only the summation order differs.
  ops::MoeRouting cpu;
  ops::moe_route(x.host, router.host, c.k, c.renorm, cpu);
  EXPECT_LE(max_rel_err(host(lg_out), cpu.logits), 1e-4) << "router logits";
  ops::MoeRouting gpu;
  gpu.experts = host(ex).view({Nr, c.k});
  gpu.weights = host(wt).view({Nr, c.k});
  if (c.forced) {
    // The choices and weights are those of the given logits, exactly as the CPU's top-k on them.
    ops::MoeRouting want;
    ops::moe_route_logits(forced_host.slice(0, 0, Nr).contiguous(), c.k, c.renorm, want);
    for (int64_t i = 0; i < Nr * c.k; ++i) {
      ASSERT_EQ(gpu.experts.data<int32_t>()[i], want.experts.data<int32_t>()[i]) << "forced choice " << i;
      EXPECT_NEAR(gpu.weights.data<float>()[i], want.weights.data<float>()[i], 1e-5) << "forced weight " << i;
    }
  }
  // Routing of the routed rows vs the CPU's f32 router (near ties allowed, see the top).
  int64_t differ = 0;
  for (int64_t n = 0; n < Nr && !c.forced; ++n) {
    std::set<int32_t> a, b;
    for (int64_t j = 0; j < c.k; ++j) {
      a.insert(cpu.experts.data<int32_t>()[n * c.k + j]);
      b.insert(gpu.experts.data<int32_t>()[n * c.k + j]);
    }
    if (a == b) continue;
    ++differ;
    const float* L = cpu.logits.data<float>() + n * c.E;
    const float kth = L[cpu.experts.data<int32_t>()[n * c.k + c.k - 1]];
    for (int32_t e : b) {
      if (!a.count(e)) {
        EXPECT_LE(std::abs(L[e] - kth), 1e-4f * std::max(1.0f, std::abs(kth))) << "token " << n << " expert " << e;
      }
    }
  }
  EXPECT_LE(differ, std::max<int64_t>(1, c.N / 100)) << "tokens routed differently from the CPU";

  // Output vs the CPU block on the GPU's choices; rows past the routed ones have no routed term.
  Tensor ref = Tensor::zeros({c.N, c.H}, DType::F32);
  if (Nr > 0) {
    Tensor part = Tensor::empty({Nr, c.H}, DType::F32);
    ops::moe_experts(x.host.slice(0, 0, Nr).contiguous(), gu.host, dn.host, gpu, part);
    std::copy(part.data<float>(), part.data<float>() + Nr * c.H, ref.data<float>());
  }
  if (c.Is) {
    Tensor g = Tensor::empty({c.N, c.Is}, DType::F32), u = Tensor::empty({c.N, c.Is}, DType::F32);
    Tensor sgu_g = sgu.host.slice(0, 0, c.Is).clone(), sgu_u = sgu.host.slice(0, c.Is, 2 * c.Is).clone();
    ops::linear(x.host, sgu_g, g);
    ops::linear(x.host, sgu_u, u);
    ops::swiglu(g, u, g);
    Tensor sh = Tensor::empty({c.N, c.H}, DType::F32), gate = Tensor::empty({c.N, 1}, DType::F32);
    ops::linear(g, sdn.host, sh);
    ops::linear(x.host, sg.host, gate);
    ops::add_sigmoid_gated(sh, gate, ref);
  }
  if (impl == cu::MoeImpl::Decode && Nr < c.N)  // the decode kernels write zeros into the pad rows
    std::fill(ref.data<float>() + Nr * c.H, ref.data<float>() + c.N * c.H, 0.0f);
  EXPECT_LE(max_rel_err(host_f32(out), ref), kBound);
}

bool gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace

TEST(CudaMoe, TopK) {
  if (!gpu()) GTEST_SKIP() << "no CUDA device";
  for (const TopkCase& c : std::vector<TopkCase>{{37, 8, 2, true, false},
                                                 {300, 256, 8, true, false},
                                                 {64, 256, 8, false, false},
                                                 {50, 64, 8, true, true},
                                                 {9, 1000, 32, true, false},
                                                 {5, 3, 3, true, true},
                                                 {1, 256, 8, true, false}})
    check_topk(c);
}

TEST(CudaMoe, Permute) {
  if (!gpu()) GTEST_SKIP() << "no CUDA device";
  check_permute(200, 16, 2);
  check_permute(500, 256, 8);
}

// The grouped GEMM's kernels, forced for a scope (tuning::moe_narrow_tiles, tuning::moe_wgmma,
// tuning::moe_streamk): 0 the mma.sync kernel's wide tiles, 1 its narrow tiles, 3 its deep tiles, 4 its
// deep tiles of 16-row blocks (the four bit for bit alike, below), 2 the wgmma kernel (moe_sm90.cu; on an
// sm_90 device), 5 the stream-K kernel (moe_stream.cu) where a call supports it (moe_block's decode /
// verify steps; the other calls the automatic tiling); each against the reference.
struct GemmKnob {
  explicit GemmKnob(int v) {
    cu::tuning::moe_narrow_tiles = v == 1 ? 1 : v == 3 ? 2 : v == 4 ? 3 : v == 5 ? -1 : 0;
    cu::tuning::moe_wgmma = v == 2 ? 1 : v == 5 ? -1 : 0;
    cu::tuning::moe_streamk = v == 5 ? 1 : -1;
  }
  ~GemmKnob() {
    cu::tuning::moe_narrow_tiles = -1;
    cu::tuning::moe_wgmma = -1;
    cu::tuning::moe_streamk = -1;
  }
};
std::vector<int> gemm_kernels() {
  if (cu::moe_wgmma_supported(0)) return {0, 1, 3, 4, 2, 5};
  return {0, 1, 3, 4, 5};
}
const char* gemm_kernel_name(int v) {
  return v == 0   ? "mma.sync wide tiles"
         : v == 1 ? "mma.sync narrow tiles"
         : v == 3 ? "mma.sync deep tiles"
         : v == 4 ? "mma.sync deep tiles, 16-row blocks"
         : v == 5 ? "stream-K where supported"
                  : "wgmma";
}

TEST(CudaMoe, GroupedGemmEdges) {
  if (!gpu()) GTEST_SKIP() << "no CUDA device";
  for (int kernel : gemm_kernels()) {
    SCOPED_TRACE(gemm_kernel_name(kernel));
    GemmKnob knob(kernel);
    check_grouped_plain(150, 4, 2, 101, 40);  // ~75 rows an expert: two row tiles; partial column and k tiles
    check_grouped_plain(7, 16, 4, 136, 64);
    check_grouped_plain(3, 64, 8, 72, 48);    // decode-like: one or two rows an expert
  }
}

TEST(CudaMoe, BlockMatchesCpu) {
  if (!gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<BlockCase> cases = {
      {37, 64, 8, 2, 32, 0, true},       {130, 128, 16, 4, 48, 64, true}, {200, 256, 64, 8, 64, 64, true},
      {33, 128, 16, 4, 40, 24, false},   {1, 256, 64, 8, 64, 64, true},   {4, 256, 64, 8, 64, 64, true},
      {16, 256, 64, 8, 64, 64, true},
      // A decode step's pad rows (routed < N) and forced routing (logits_in), alone and together.
      {16, 256, 64, 8, 64, 64, true, 1},  {16, 128, 16, 4, 48, 64, true, 5}, {70, 128, 16, 4, 48, 0, true, 64},
      {37, 64, 8, 2, 32, 48, true, -1, true}, {16, 256, 64, 8, 64, 64, true, 3, true},
      {16, 128, 16, 4, 48, 64, true, 0},
      // Decode-kernel edges: rows of H, I, Is not a multiple of a warp's 256 columns, k not a multiple
      // of 4, no shared expert.
      {12, 136, 16, 3, 40, 24, false}, {8, 64, 8, 2, 32, 0, true, 5},
  };
  for (const BlockCase& c : cases) {
    for (cu::MoeImpl impl : {cu::MoeImpl::Grouped, cu::MoeImpl::Fallback}) check_block(c, impl);
    if (c.N <= cu::kMoeDecodeMaxRows) check_block(c, cu::MoeImpl::Decode);
  }
  // The grouped GEMM's kernels, each forced on every case.
  for (int kernel : gemm_kernels()) {
    SCOPED_TRACE(gemm_kernel_name(kernel));
    GemmKnob knob(kernel);
    for (const BlockCase& c : cases) check_block(c, cu::MoeImpl::Grouped);
  }
}

// Expert parallelism (target_model/tp.h) on one GPU: the ranks of a TP group simulated one after
// another, each with its expert group's experts (columns [er·Il, (er+1)·Il) of each when tp > ep),
// its slice of the shared expert and the replicated router; the sum of their partial outputs (what
// the TP all-reduce makes) equals the whole block's CPU reference on the same routing, for every
// implementation (the decode kernels at N <= 16). Every rank routes alike (the same router).
TEST(CudaMoe, ExpertGroupsSumToTheWholeBlock) {
  if (!gpu()) GTEST_SKIP() << "no CUDA device";
  struct Layout {
    int tp, ep;
  };
  for (int64_t N : {int64_t{16}, int64_t{70}}) {
    const int64_t H = 128, E = 16, k = 4, I = 64, Is = 64;
    const float ws = 1.0f / std::sqrt(float(H));
    Pair x = rand_bf16({N, H}, 1.0f), router = rand_bf16({E, H}, ws), gu = rand_bf16({E, 2 * I, H}, ws);
    Pair dn = rand_bf16({E, H, I}, 1.0f / std::sqrt(float(I))), sgu = rand_bf16({2 * Is, H}, ws);
    Pair sdn = rand_bf16({H, Is}, 1.0f / std::sqrt(float(Is))), sg = rand_bf16({1, H}, ws);
    for (Layout lay : {Layout{2, 1}, Layout{2, 2}, Layout{4, 2}, Layout{4, 4}}) {
      const int64_t per_group = lay.tp / lay.ep, El = E / lay.ep, Il = I / per_group, Isl = Is / lay.tp;
      std::vector<cu::MoeImpl> impls{cu::MoeImpl::Grouped, cu::MoeImpl::Fallback};
      if (N <= cu::kMoeDecodeMaxRows) impls.push_back(cu::MoeImpl::Decode);
      for (cu::MoeImpl impl : impls) {
        SCOPED_TRACE(std::string(cu::moe_impl_name(impl)) + " N " + std::to_string(N) + " tp " + std::to_string(lay.tp) +
                     " ep " + std::to_string(lay.ep));
        Tensor sum = Tensor::zeros({N, H}, DType::F32);
        Tensor routing_ex = dev_i32(N * k), routing_wt = Tensor::empty({N * k}, DType::F32, Device::cuda(0));
        for (int r = 0; r < lay.tp; ++r) {
          const int64_t eg = r / per_group, er = r % per_group;
          // This rank's weights, sliced from the full ones on the host (bf16 values, exact).
          Tensor lgu = Tensor::empty({El, 2 * Il, H}, DType::F32), ldn = Tensor::empty({El, H, Il}, DType::F32);
          Tensor lsgu = Tensor::empty({2 * Isl, H}, DType::F32), lsdn = Tensor::empty({H, Isl}, DType::F32);
          const float *G = gu.host.data<float>(), *D = dn.host.data<float>();
          for (int64_t e = 0; e < El; ++e) {
            const int64_t ge = eg * El + e;
            for (int64_t c = 0; c < Il; ++c)
              for (int64_t q = 0; q < H; ++q) {
                lgu.data<float>()[(e * 2 * Il + c) * H + q] = G[(ge * 2 * I + er * Il + c) * H + q];
                lgu.data<float>()[(e * 2 * Il + Il + c) * H + q] = G[(ge * 2 * I + I + er * Il + c) * H + q];
              }
            for (int64_t h = 0; h < H; ++h)
              for (int64_t c = 0; c < Il; ++c) ldn.data<float>()[(e * H + h) * Il + c] = D[(ge * H + h) * I + er * Il + c];
          }
          for (int64_t c = 0; c < Isl; ++c)
            for (int64_t q = 0; q < H; ++q) {
              lsgu.data<float>()[c * H + q] = sgu.host.data<float>()[(r * Isl + c) * H + q];
              lsgu.data<float>()[(Isl + c) * H + q] = sgu.host.data<float>()[(Is + r * Isl + c) * H + q];
            }
          for (int64_t h = 0; h < H; ++h)
            for (int64_t c = 0; c < Isl; ++c) lsdn.data<float>()[h * Isl + c] = sdn.host.data<float>()[h * Is + r * Isl + c];
          auto dev = [](const Tensor& t) { return t.to_dtype(DType::BF16).to(Device::cuda(0)); };
          const Tensor dgu = dev(lgu), ddn = dev(ldn), dsgu = dev(lsgu), dsdn = dev(lsdn);
          Tensor out = Tensor::empty({N, H}, DType::BF16, Device::cuda(0));
          poison(out);
          const size_t bytes = cu::moe_workspace_bytes(N, H, E, k, Il, Isl, impl);
          Tensor ws_t = Tensor::empty({static_cast<int64_t>(bytes)}, DType::U8, Device::cuda(0));
          DFLASH_CUDA_CHECK(cudaMemset(ws_t.raw_data(), 0xff, bytes));
          cu::MoeBlockParams p;
          p.x = x.dev.raw_data();
          p.N = N, p.H = H, p.E = E, p.k = k, p.I = Il, p.Is = Isl;
          p.expert_begin = eg * El;
          p.local_experts = El;
          set_weights(p, router.dev.raw_data(), dgu.raw_data(), ddn.raw_data(), dsgu.raw_data(), dsdn.raw_data(), sg.dev.raw_data());
          p.out = out.raw_data();
          p.workspace = ws_t.raw_data();
          p.experts_out = routing_ex.data<int32_t>();
          p.weights_out = routing_wt.data<float>();
          cu::moe_block(p, impl, 0);
          sync_dev();
          const Tensor part = host_f32(out);
          for (int64_t i = 0; i < N * H; ++i) sum.data<float>()[i] += part.data<float>()[i];
        }
        // The whole block on the (last rank's, shared by all) routing, in f32 on the CPU.
        ops::MoeRouting gpu;
        gpu.experts = host(routing_ex).view({N, k});
        gpu.weights = host(routing_wt).view({N, k});
        Tensor ref = Tensor::empty({N, H}, DType::F32);
        ops::moe_experts(x.host, gu.host, dn.host, gpu, ref);
        Tensor g = Tensor::empty({N, Is}, DType::F32), u = Tensor::empty({N, Is}, DType::F32);
        ops::linear(x.host, sgu.host.slice(0, 0, Is).clone(), g);
        ops::linear(x.host, sgu.host.slice(0, Is, 2 * Is).clone(), u);
        ops::swiglu(g, u, g);
        Tensor sh = Tensor::empty({N, H}, DType::F32), gate = Tensor::empty({N, 1}, DType::F32);
        ops::linear(g, sdn.host, sh);
        ops::linear(x.host, sg.host, gate);
        ops::add_sigmoid_gated(sh, gate, ref);
        EXPECT_LE(max_rel_err(sum, ref), 2e-2);
      }
    }
  }
}

// FP8 experts (W8A16, kernels/cuda/moe_fp8.cuh) on the GPU: e4m3 codes with block scales give every
// implementation's output bit for bit as the bf16 experts holding their dequantized values (the
// grouped GEMMs and the fallback through moe_block's bf16 scratch, the decode kernels from the codes),
// with an expert range too.
TEST(CudaMoe, Fp8ExpertsGiveTheBf16ExpertsBits) {
  if (!gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t H = 384, E = 8, k = 2, I = 256, Is = 128;
  const Fp8Experts gu = make_fp8_experts(E, 2 * I, H, I, 31), dn = make_fp8_experts(E, H, I, H, 32);
  Pair router = rand_bf16({E, H}, 0.05f), sgu = rand_bf16({2 * Is, H}, 0.05f), sdn = rand_bf16({H, Is}, 0.08f);
  Pair sg = rand_bf16({1, H}, 0.05f);
  auto dev = [](const Tensor& t) { return t.to(Device::cuda(0)); };
  for (int64_t N : {int64_t{16}, int64_t{40}}) {
    const Pair x = rand_bf16({N, H}, 1.0f);
    std::vector<cu::MoeImpl> impls{cu::MoeImpl::Grouped, cu::MoeImpl::Fallback};
    if (N <= cu::kMoeDecodeMaxRows) impls.push_back(cu::MoeImpl::Decode);
    for (cu::MoeImpl impl : impls)
      for (int64_t e0 : {int64_t{0}, int64_t{4}}) {
        const int64_t El = e0 == 0 ? E : 4;
        SCOPED_TRACE(std::string(cu::moe_impl_name(impl)) + " N " + std::to_string(N) + " experts from " + std::to_string(e0));
        auto experts = [&](const Tensor& t) { return dev(t.slice(0, e0, e0 + El).contiguous()); };
        const Tensor gb = experts(gu.bf16), db = experts(dn.bf16), gq = experts(gu.codes), dq = experts(dn.codes);
        const Tensor gs = experts(gu.scale), ds = experts(dn.scale);
        Tensor out[2];
        for (int fp8 : {0, 1}) {
          out[fp8] = Tensor::empty({N, H}, DType::BF16, Device::cuda(0));
          poison(out[fp8]);
          const size_t bytes = cu::moe_workspace_bytes(N, H, E, k, I, Is, impl);
          Tensor ws_t = Tensor::empty({static_cast<int64_t>(bytes)}, DType::U8, Device::cuda(0));
          Tensor scratch = Tensor::empty({static_cast<int64_t>(cu::moe_experts_scratch_bytes(El, I, H))}, DType::U8,
                                         Device::cuda(0));
          cu::MoeBlockParams p;
          p.x = x.dev.raw_data();
          p.N = N, p.H = H, p.E = E, p.k = k, p.I = I, p.Is = Is, p.expert_begin = e0, p.local_experts = El;
          set_weights(p, router.dev.raw_data(), (fp8 ? gq : gb).raw_data(), (fp8 ? dq : db).raw_data(), sgu.dev.raw_data(),
                      sdn.dev.raw_data(), sg.dev.raw_data());
          if (fp8) {
            p.experts_gate_up_scale = gs.data<float>();
            p.experts_down_scale = ds.data<float>();
            p.experts_scratch = scratch.raw_data();
          }
          p.out = out[fp8].raw_data();
          p.workspace = ws_t.raw_data();
          cu::moe_block(p, impl, 0);
          sync_dev();
        }
        const Tensor a = host(out[0]), b = host(out[1]);
        EXPECT_EQ(std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()), 0);
        EXPECT_LT(max_rel_err(host_f32(out[1]), host_f32(out[0])), 1e30);  // no NaN (every element written)
      }
  }
}

// The MoE decode kernels compute each token alone: a block of 16 rows (a verify) gives every row
// the bits it gets as the one routed row of a 16-row decode step (its 15 pad rows routed to none)
// and as a block of one row, at the 35B-A3B widths (H 2048, I = Is 512, k 8).
TEST(CudaMoe, DecodeKernelRowsAreBatchInvariant) {
  if (!gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t N = 16, H = 2048, E = 32, k = 8, I = 512, Is = 512;
  Pair x = rand_bf16({N, H}, 1.0f), router = rand_bf16({E, H}, 0.02f), gu = rand_bf16({E, 2 * I, H}, 0.02f);
  Pair dn = rand_bf16({E, H, I}, 0.05f), sgu = rand_bf16({2 * Is, H}, 0.02f), sdn = rand_bf16({H, Is}, 0.05f);
  Pair sg = rand_bf16({1, H}, 0.02f);
  // The block on rows [n0, n0 + rows) of x, padded to `pad` rows (the first `rows` routed): out, experts.
  auto run = [&](int64_t n0, int64_t rows, int64_t pad) {
    Tensor xin = Tensor::zeros({pad, H}, DType::BF16, Device::cuda(0));
    DFLASH_CUDA_CHECK(cudaMemcpy(xin.raw_data(), static_cast<const char*>(x.dev.raw_data()) + n0 * H * 2,
                                 static_cast<size_t>(rows * H * 2), cudaMemcpyDeviceToDevice));
    Tensor out = Tensor::empty({pad, H}, DType::BF16, Device::cuda(0)), ex = dev_i32(rows * k);
    poison(out);
    const size_t bytes = cu::moe_workspace_bytes(pad, H, E, k, I, Is, cu::MoeImpl::Decode);
    Tensor ws_t = Tensor::empty({static_cast<int64_t>(bytes)}, DType::U8, Device::cuda(0));
    DFLASH_CUDA_CHECK(cudaMemset(ws_t.raw_data(), 0xff, bytes));
    cu::MoeBlockParams p;
    p.x = xin.raw_data();
    p.N = pad, p.H = H, p.E = E, p.k = k, p.I = I, p.Is = Is, p.routed = rows;
    set_weights(p, router.dev.raw_data(), gu.dev.raw_data(), dn.dev.raw_data(), sgu.dev.raw_data(), sdn.dev.raw_data(), sg.dev.raw_data());
    p.out = out.raw_data();
    p.workspace = ws_t.raw_data();
    p.experts_out = ex.data<int32_t>();
    cu::moe_block(p, cu::MoeImpl::Decode, 0);
    sync_dev();
    return std::make_pair(host(out), host(ex));
  };
  const auto [all_out, all_ex] = run(0, N, N);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t pad : {int64_t{1}, N}) {
      const auto [one_out, one_ex] = run(n, 1, pad);
      EXPECT_EQ(std::memcmp(one_out.raw_data(), static_cast<const char*>(all_out.raw_data()) + n * H * 2,
                            static_cast<size_t>(H * 2)),
                0)
          << "row " << n << " alone (padded to " << pad << ") vs in the 16-row block";
      EXPECT_EQ(std::memcmp(one_ex.raw_data(), all_ex.data<int32_t>() + n * k, static_cast<size_t>(k * 4)), 0)
          << "experts of row " << n;
      if (pad > 1) {  // pad rows are zeros, not poison
        const Tensor rest = host_f32(one_out).slice(0, 1, pad).contiguous();
        EXPECT_EQ(max_rel_err(rest, Tensor::zeros({pad - 1, H}, DType::F32)), 0.0) << "pad rows";
      }
    }
  }
}

// The stream-K expert GEMMs (moe_stream.cu, tuning::moe_streamk 1) compute each token row alone: at the
// 35B-A3B widths (H 2048, I = Is 512, k 8, the shared expert as the extra group), a token's act and y rows
// (each choice, wherever the permutation puts it) and shared rows are the same bits at N = 1, 2, 5 and 16
// tokens, on the one-wave grid and on 1 and 7 blocks, and twice in a row (the counters back at zero);
// against the 16-row deep blocks within the bound (another summation order, not the same bits).
TEST(CudaMoe, StreamKRowsAreBatchInvariantAndDeterministic) {
  if (!gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t T = 16, H = 2048, E = 32, k = 8, I = 512;
  Pair x = rand_bf16({T, H}, 1.0f), gu = rand_bf16({E, 2 * I, H}, 0.02f), dn = rand_bf16({E, H, I}, 0.05f);
  Pair sgu = rand_bf16({2 * I, H}, 0.02f), sdn = rand_bf16({H, I}, 0.05f);
  Tensor lf = Tensor::empty({T, E}, DType::F32);
  fill_normal(lf, {82, g_stream++, 0}, 0.0f, 1.0f);
  const Tensor ld = lf.to(Device::cuda(0));
  struct Out {
    Tensor slot, act, y, sact, sout;  // host copies
  };
  // Tokens [0, N) through the routing of a decode / verify step, gate|up and down (moe_block's calls).
  auto run = [&](int64_t N, int streamk, int blocks) {
    const int64_t R = N * k;
    Tensor ex = dev_i32(R), counts = dev_i32(E), off = dev_i32(E + 1), tiles = dev_i32(E + 1), cur = dev_i32(E);
    Tensor src = dev_i32(R), slot = dev_i32(R), wt = Tensor::empty({R}, DType::F32, Device::cuda(0));
    cu::moe_route_small(ld.data<float>(), N, E, k, true, ex.data<int32_t>(), wt.data<float>(), counts.data<int32_t>(),
                        off.data<int32_t>(), tiles.data<int32_t>(), cur.data<int32_t>(), src.data<int32_t>(),
                        slot.data<int32_t>(), stream());
    auto bf = [](int64_t r, int64_t c) {
      Tensor t = Tensor::empty({r, c}, DType::BF16, Device::cuda(0));
      poison(t);
      return t;
    };
    Tensor act = bf(R, I), y = bf(R, H), sact = bf(N, I), sout = bf(N, H);
    cu::tuning::moe_streamk = streamk;
    cu::tuning::moe_streamk_blocks = blocks;
    cu::MoeGemmParams g;
    g.x = x.dev.raw_data(), g.ldx = H, g.src_row = src.data<int32_t>(), g.w = gu.dev.raw_data(), g.y = act.raw_data();
    g.ldy = I, g.offsets = off.data<int32_t>(), g.tile_offsets = tiles.data<int32_t>(), g.E = E, g.Nout = I, g.K = H;
    g.max_tiles = cu::moe_max_tiles(R, E), g.swiglu = true, g.rows = R, g.max_expert_rows = N;
    g.extra_x = x.dev.raw_data(), g.extra_w = sgu.dev.raw_data(), g.extra_y = sact.raw_data(), g.extra_rows = N;
    EXPECT_EQ(cu::moe_streamk(g), streamk == 1);
    cu::moe_grouped_gemm(g, stream());
    cu::MoeGemmParams d = g;
    d.x = act.raw_data(), d.ldx = I, d.src_row = nullptr, d.w = dn.dev.raw_data(), d.y = y.raw_data(), d.ldy = H;
    d.Nout = H, d.K = I, d.swiglu = false, d.routing_settled = true;
    d.extra_x = sact.raw_data(), d.extra_w = sdn.dev.raw_data(), d.extra_y = sout.raw_data();
    cu::moe_grouped_gemm(d, stream());
    sync_dev();
    cu::tuning::moe_streamk = -1;
    cu::tuning::moe_streamk_blocks = 0;
    return Out{host(slot), host(act), host(y), host(sact), host(sout)};
  };
  const Out all = run(T, 1, 0);
  const Out again = run(T, 1, 0);
  for (const auto& [a, b] : std::vector<std::pair<const Tensor*, const Tensor*>>{
           {&all.act, &again.act}, {&all.y, &again.y}, {&all.sact, &again.sact}, {&all.sout, &again.sout}})
    EXPECT_TRUE(bit_equal(*a, *b)) << "a second run's bits";
  const Out deep = run(T, 0, 0);
  EXPECT_LE(max_rel_err(host_f32(all.act), host_f32(deep.act)), kBound) << "gate|up vs the 16-row deep blocks";
  EXPECT_LE(max_rel_err(host_f32(all.y), host_f32(deep.y)), kBound) << "down vs the 16-row deep blocks";
  EXPECT_LE(max_rel_err(host_f32(all.sout), host_f32(deep.sout)), kBound) << "shared expert vs the 16-row deep blocks";
  // A row of `t` (row bytes `bytes`) equals a row of `ref`.
  auto same_row = [](const Tensor& t, int64_t r, const Tensor& ref, int64_t rr, int64_t bytes) {
    return std::memcmp(static_cast<const char*>(t.raw_data()) + r * bytes, static_cast<const char*>(ref.raw_data()) + rr * bytes,
                       static_cast<size_t>(bytes)) == 0;
  };
  for (const auto& [N, blocks] : std::vector<std::pair<int64_t, int>>{{1, 0}, {1, 1}, {2, 7}, {5, 0}, {16, 7}, {16, 1}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " grid " + (blocks ? std::to_string(blocks) : std::string("one wave")));
    const Out o = run(N, 1, blocks);
    int64_t bad = 0;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = n * k + j, po = o.slot.data<int32_t>()[i], pa = all.slot.data<int32_t>()[i];
        bad += !same_row(o.act, po, all.act, pa, I * 2) + !same_row(o.y, po, all.y, pa, H * 2);
      }
      bad += !same_row(o.sact, n, all.sact, n, I * 2) + !same_row(o.sout, n, all.sout, n, H * 2);
    }
    EXPECT_EQ(bad, 0) << "token rows off the 16-token step's bits";
  }
}

// The three tilings give the same bits (each output is the same mma k16 steps in the same K order),
// at the 35B-A3B block's widths (H 2048, I 512: 128 k-steps of gate|up, 32 of down) and a row count
// whose experts hold 1 to several tiles.
TEST(CudaMoe, NarrowAndWideTilesAreBitIdentical) {
  if (!gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t N = 300, E = 32, k = 4, H = 2048, I = 512, R = N * k;
  Tensor lf = Tensor::empty({N, E}, DType::F32);
  fill_normal(lf, {81, g_stream++, 0}, 0.0f, 1.0f);
  Routed rt = route(lf.to(Device::cuda(0)), N, E, k);
  Pair x = rand_bf16({N, H}, 1.0f), gu = rand_bf16({E, 2 * I, H}, 0.02f), dn = rand_bf16({E, H, I}, 0.05f);
  Tensor out[4][2];
  for (int narrow : {0, 1, 2, 3}) {
    GemmKnob knob(narrow >= 2 ? narrow + 1 : narrow);
    Tensor act = Tensor::empty({R, I}, DType::BF16, Device::cuda(0)), y = Tensor::empty({R, H}, DType::BF16, Device::cuda(0));
    poison(act);
    poison(y);
    cu::MoeGemmParams g;
    g.x = x.dev.raw_data(), g.ldx = H, g.src_row = rt.src.data<int32_t>(), g.w = gu.dev.raw_data();
    g.y = act.raw_data(), g.ldy = I, g.offsets = rt.off.data<int32_t>(), g.tile_offsets = rt.tiles.data<int32_t>();
    g.E = E, g.Nout = I, g.K = H, g.max_tiles = cu::moe_max_tiles(R, E), g.swiglu = true, g.rows = R;
    EXPECT_EQ(cu::moe_narrow_tiles(g), narrow >= 1);
    EXPECT_EQ(cu::moe_deep_tiles(g), narrow >= 2);
    EXPECT_EQ(cu::moe_deep16_tiles(g), narrow == 3);
    cu::moe_grouped_gemm(g, stream());
    cu::MoeGemmParams d = g;
    d.x = act.raw_data(), d.ldx = I, d.src_row = nullptr, d.w = dn.dev.raw_data(), d.y = y.raw_data();
    d.ldy = H, d.Nout = H, d.K = I, d.swiglu = false;
    cu::moe_grouped_gemm(d, stream());
    sync_dev();
    out[narrow][0] = host(act);
    out[narrow][1] = host(y);
  }
  for (int v = 1; v < 4; ++v) {
    for (int t = 0; t < 2; ++t) {
      const Tensor &a = out[0][t], &b = out[v][t];
      ASSERT_EQ(a.nbytes(), b.nbytes());
      EXPECT_EQ(std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()), 0)
          << (v == 1 ? "narrow " : v == 2 ? "deep " : "deep 16-row ") << (t ? "down" : "gate|up + swiglu");
      EXPECT_EQ(max_rel_err(b, a), 0.0);  // and no NaN (poisoned outputs all written)
    }
  }
  // The automatic choice: deep for a decode / verify step's rows, narrow for few more, wide for many
  // or unknown.
  cu::MoeGemmParams p;
  p.rows = 8;
  EXPECT_TRUE(cu::moe_narrow_tiles(p));
  EXPECT_TRUE(cu::moe_deep_tiles(p));
  EXPECT_FALSE(cu::moe_deep16_tiles(p));  // (rows an expert holds unknown)
  p.max_expert_rows = 16;
  EXPECT_TRUE(cu::moe_deep16_tiles(p));
  p.max_expert_rows = 17;
  EXPECT_FALSE(cu::moe_deep16_tiles(p));
  p.rows = cu::kMoeDeepRows + 1;
  EXPECT_TRUE(cu::moe_narrow_tiles(p));
  EXPECT_FALSE(cu::moe_deep_tiles(p));
  p.rows = cu::kMoeNarrowRows + 1;
  EXPECT_FALSE(cu::moe_narrow_tiles(p));
  p.rows = -1;
  EXPECT_FALSE(cu::moe_narrow_tiles(p));
}

// Programmatic dependent launch inside the block (pdl.cuh: the routing, the expert GEMMs and the
// combine start under the previous kernel's tail; the down GEMM and the combine read the routing,
// and the combine x, before their waits): in a CUDA graph between a PDL kernel that writes x and one
// that reads out, replayed on fresh inputs each time, the bits of plain launches. A missing wait
// reads the previous replay's routing or rows: other bits.
TEST(CudaMoe, PdlLaunchesGiveThePlainLaunchesBits) {
  if (!gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t H = 2048, E = 16, k = 8, I = 512, Is = 512;
  const float ws = 1.0f / std::sqrt(float(H));
  Pair router = rand_bf16({E, H}, ws), gu = rand_bf16({E, 2 * I, H}, ws), dn = rand_bf16({E, H, I}, 1.0f / std::sqrt(float(I)));
  Pair sgu = rand_bf16({2 * Is, H}, ws), sdn = rand_bf16({H, Is}, 1.0f / std::sqrt(float(Is))), sg = rand_bf16({1, H}, ws);
  const cudaStream_t st = static_cast<cudaStream_t>(stream());
  // (stream-K: the decode / verify steps' expert GEMMs on moe_stream.cu's kernel, whose workspace is
  // first allocated inside the capture and whose counters every replay must leave at zero; N 40 takes
  // the other tilings)
  for (const auto& [N, streamk] : std::vector<std::pair<int64_t, bool>>{{1, false}, {16, false}, {40, false}, {1, true}, {16, true}}) {
    SCOPED_TRACE("N " + std::to_string(N) + (streamk ? " stream-K" : ""));
    cu::tuning::moe_streamk = streamk ? 1 : -1;
    Tensor xf = Tensor::empty({N, H}, DType::F32, Device::cuda(0)), x = Tensor::empty({N, H}, DType::BF16, Device::cuda(0));
    Tensor out = Tensor::empty({N, H}, DType::BF16, Device::cuda(0)), outf = Tensor::empty({N, H}, DType::F32, Device::cuda(0));
    Tensor ws_t = Tensor::empty({static_cast<int64_t>(cu::moe_workspace_bytes(N, H, E, k, I, Is, cu::MoeImpl::Grouped))},
                                DType::U8, Device::cuda(0));
    cu::MoeBlockParams p;
    p.x = x.raw_data();
    p.N = N, p.H = H, p.E = E, p.k = k, p.I = I, p.Is = Is;
    set_weights(p, router.dev.raw_data(), gu.dev.raw_data(), dn.dev.raw_data(), sgu.dev.raw_data(), sdn.dev.raw_data(),
                sg.dev.raw_data());
    p.out = out.raw_data();
    p.workspace = ws_t.raw_data();
    auto step = [&] {
      cu::cast_f32_bf16(xf.data<float>(), x.raw_data(), N * H, stream());
      cu::moe_block(p, cu::MoeImpl::Grouped, 0);
      cu::cast_bf16_f32(out.raw_data(), outf.data<float>(), N * H, stream());
    };
    const int pdl_saved = cu::tuning::pdl;
    cu::tuning::pdl = 1;
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    DFLASH_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    step();
    DFLASH_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
    DFLASH_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 6; ++rep) {
      Tensor in = Tensor::empty({N, H}, DType::F32);
      fill_normal(in, {3313, g_stream++, 0}, 0.0f, 1.0f);
      cu::tuning::pdl = 0;
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(xf.raw_data(), in.raw_data(), in.nbytes(), cudaMemcpyHostToDevice, st));
      step();
      const Tensor want = host(outf);
      poison(ws_t);
      poison(outf);
      DFLASH_CUDA_CHECK(cudaGraphLaunch(exec, st));
      const Tensor got = host(outf);
      EXPECT_EQ(std::memcmp(got.raw_data(), want.raw_data(), want.nbytes()), 0) << "replay " << rep;
      EXPECT_EQ(max_rel_err(got, want), 0.0);  // (and no NaN)
    }
    cu::tuning::pdl = pdl_saved;
    DFLASH_CUDA_CHECK(cudaGraphExecDestroy(exec));
    DFLASH_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  cu::tuning::moe_streamk = -1;
}

struct TopkKnob {  // cu::tuning::moe_decode_topk_first for the scope
  explicit TopkKnob(int v) { cu::tuning::moe_decode_topk_first = v; }
  ~TopkKnob() { cu::tuning::moe_decode_topk_first = -1; }
};

// Timing rows at Qwen3.6-35B-A3B shapes (H 2048, E 256, k 8, I 512, Is 512), random bf16 weights:
// only with DFLASH_MOE_BENCH=1 (kernel_bench-style rows on stdout: impl, N, ms, TFLOP/s).
TEST(CudaMoe, Bench35bA3b) {
  const char* bench = std::getenv("DFLASH_MOE_BENCH");  // (gpu_moe.sh passes an empty value when MOE_BENCH is unset)
  if (!gpu() || !bench || !*bench) GTEST_SKIP() << "set DFLASH_MOE_BENCH=1 (and a GPU)";
  const int64_t H = 2048, E = 256, k = 8, I = 512, Is = 512;
  // Weights drawn on the GPU (a host draw of 800M values would take most of a minute).
  auto gpu_rand = [](const Shape& s, float sd) {
    Pair r;
    r.dev = Tensor::empty(s, DType::BF16, Device::cuda(0));
    cu::fill_normal(r.dev, {3312, g_stream++, 0}, 0.0f, sd);
    return r;
  };
  Pair router = gpu_rand({E, H}, 0.02f), gu = gpu_rand({E, 2 * I, H}, 0.02f), dn = gpu_rand({E, H, I}, 0.02f);
  Pair sgu = gpu_rand({2 * Is, H}, 0.02f), sdn = gpu_rand({H, Is}, 0.02f), sg = gpu_rand({1, H}, 0.02f);
  // FP8 experts (W8A16) of the same weights: codes and block scales.
  const int64_t rbI = 2 * ((I + 127) / 128), kbH = (H + 127) / 128, rbH = (H + 127) / 128, kbI = (I + 127) / 128;
  Tensor gq = Tensor::empty({E, 2 * I, H}, DType::F8E4M3, Device::cuda(0)), dq = Tensor::empty({E, H, I}, DType::F8E4M3, Device::cuda(0));
  Tensor gs = Tensor::empty({E, rbI, kbH}, DType::F32, Device::cuda(0)), ds = Tensor::empty({E, rbH, kbI}, DType::F32, Device::cuda(0));
  cu::moe_quantize_experts(gu.dev.raw_data(), E, 2 * I, H, I, gq.raw_data(), gs.data<float>(), stream());
  cu::moe_quantize_experts(dn.dev.raw_data(), E, H, I, H, dq.raw_data(), ds.data<float>(), stream());
  Tensor scratch = Tensor::empty({static_cast<int64_t>(cu::moe_experts_scratch_bytes(E, I, H))}, DType::U8, Device::cuda(0));
  Tensor l2_flush = Tensor::empty({int64_t{256} << 20}, DType::U8, Device::cuda(0));  // (time_it, N <= 16)
  std::printf("moe_bench,impl,tokens,ms_block,block_tflops,ms_expert_gemms,expert_gemm_tflops,expert_gemm_gbs\n");
  // DFLASH_MOE_PROFILE=1 (scripts/gpu_moe.sh NCU_MOE=1): decode-sized blocks only, and one more call of
  // each after an L2 flush between cudaProfilerStart / Stop, for `ncu --profile-from-start off` (the
  // block's kernels one by one: time, DRAM bytes, share of the DRAM peak).
  const bool profile = std::getenv("DFLASH_MOE_PROFILE") != nullptr;
  for (int64_t N : {1, 16, 2048, 8192}) {
    if (profile && N > cu::kMoeDecodeMaxRows) continue;
    Pair x = gpu_rand({N, H}, 1.0f);
    Tensor out = Tensor::empty({N, H}, DType::BF16, Device::cuda(0));
    // Grouped wide tiles, grouped narrow tiles, the fallback, the decode kernels (N <= 16; its
    // expert_gemm_gbs column: the whole block's weight bytes, router + touched experts + shared
    // expert, over the block's time).
    // 3: the decode kernels routing inside the gate|up blocks, 4: by the top-k kernel first; 5: the
    // decode kernels on FP8 experts (expert_gemm_gbs: the block's bytes with the experts' codes and
    // scales); 6: the grouped GEMMs on FP8 experts (reading the codes), 7: the same with a bf16 copy of
    // the experts written first (tuning::moe_fp8_dequantize_first, in the time); 8: the grouped path on
    // the wgmma kernel (sm_90); 0, 1, 9 and 12 the mma.sync kernel's tilings: wide, narrow, deep, deep
    // of 16-row blocks (6 and 7 take the automatic tiling: deep of 16-row blocks for N <= 16); 10 deep
    // tiles of 16-row blocks with the shared expert in launches of its own after the experts
    // (tuning::moe_fuse_shared 0; the others run it as the grouped GEMMs' extra group where
    // moe_fuse_shared says: N <= 64); 13 as 12 with 5 stages at any K (tuning::moe_deep16_short 0; 12's
    // down GEMM, K = I = 512, takes 3). (The 16-row blocks only where an expert holds <= 16 rows.) 14 the
    // expert GEMMs on the stream-K kernel (moe_stream.cu, tuning::moe_streamk 1: K pieces of 256 / 128
    // columns), 15 the same with 16 pieces at most (tuning::moe_streamk_pieces: 128-column pieces).
    for (int variant : {0, 1, 9, 12, 13, 14, 15, 10, 2, 3, 4, 5, 6, 7, 8}) {
      const bool streamk = variant == 14 || variant == 15;
      if ((variant == 3 || variant == 4 || variant == 5 || variant == 10 || variant == 12 || variant == 13 || streamk) &&
          N > cu::kMoeDecodeMaxRows)
        continue;
      if (variant == 8 && !cu::moe_wgmma_supported(0)) continue;
      // (profiled: the decode-sized paths worth a kernel-by-kernel look)
      if (profile && variant != 9 && variant != 12 && variant != 13 && variant != 10 && variant != 8 && !streamk) continue;
      const bool fp8 = variant >= 5 && variant <= 7;
      const cu::MoeImpl impl = variant < 2 || variant >= 6 ? cu::MoeImpl::Grouped
                               : variant == 2              ? cu::MoeImpl::Fallback
                                                           : cu::MoeImpl::Decode;
      std::optional<GemmKnob> knob;
      if (variant < 2 || variant >= 8) knob.emplace(variant == 8 ? 2 : variant == 9 ? 3 : variant >= 10 ? 4 : variant);
      cu::tuning::moe_fuse_shared = variant == 10 ? 0 : -1;
      cu::tuning::moe_deep16_short = variant == 13 ? 0 : -1;
      cu::tuning::moe_streamk = streamk ? 1 : -1;
      cu::tuning::moe_streamk_pieces = variant == 15 ? 16 : cu::kMoeStreamkPieces;
      const TopkKnob topk(variant == 3 || variant == 4 ? variant - 3 : -1);
      const std::string name = std::string(cu::moe_impl_name(impl)) +
                               (variant == 0   ? "/wide"
                                : variant == 1 ? "/narrow"
                                : variant == 3 ? "/topk_in_blocks"
                                : variant == 4 ? "/topk_first"
                                : variant == 7 ? "/fp8_dequantize_first"
                                : variant == 8 ? "/wgmma"
                                : variant == 9 ? "/deep"
                                : variant == 10 ? "/deep16_shared_apart"
                                : variant == 12 ? "/deep16"
                                : variant == 13 ? "/deep16_5stages"
                                : variant == 14 ? "/streamk"
                                : variant == 15 ? "/streamk_p16"
                                : fp8          ? "/fp8_experts"
                                               : "");
      cu::tuning::moe_fp8_dequantize_first = variant == 7 ? 1 : variant == 6 ? 0 : -1;
      const size_t bytes = cu::moe_workspace_bytes(N, H, E, k, I, Is, impl);
      Tensor ws_t = Tensor::empty({static_cast<int64_t>(bytes)}, DType::U8, Device::cuda(0));
      cu::MoeBlockParams p;
      p.x = x.dev.raw_data();
      p.N = N, p.H = H, p.E = E, p.k = k, p.I = I, p.Is = Is;
      set_weights(p, router.dev.raw_data(), gu.dev.raw_data(), dn.dev.raw_data(), sgu.dev.raw_data(), sdn.dev.raw_data(), sg.dev.raw_data());
      p.out = out.raw_data();
      p.workspace = ws_t.raw_data();
      // Decode-sized blocks (N <= 16) touch few experts (8 at one token: 48 MB), which back-to-back
      // calls would find in the 50 MB L2 (h200-moe6: the decode kernels' 43 us at one token here, ~90
      // in a real decode step); there a 256 MB write before each timed call evicts them, as a decode
      // step's 40 layers do, and only the call is timed.
      auto time_it = [&](auto&& fn) {
        fn();
        sync_dev();
        const auto st = static_cast<cudaStream_t>(stream());
        const bool cold = N <= cu::kMoeDecodeMaxRows;
        // Timed spans: cold, each call alone after a flush; warm, the reps back to back.
        const int reps = N >= 2048 ? 10 : 50, pairs = cold ? reps : 1;
        std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(pairs));
        for (cudaEvent_t& e : ev) cudaEventCreate(&e);
        for (int i = 0; i < pairs; ++i) {
          if (cold) DFLASH_CUDA_CHECK(cudaMemsetAsync(l2_flush.raw_data(), i & 0xff, l2_flush.nbytes(), st));
          cudaEventRecord(ev[2 * static_cast<size_t>(i)], st);
          for (int r = 0; r < reps / pairs; ++r) fn();
          cudaEventRecord(ev[2 * static_cast<size_t>(i) + 1], st);
        }
        cudaEventSynchronize(ev.back());
        double total = 0;
        for (int i = 0; i < pairs; ++i) {
          float ms = 0;
          cudaEventElapsedTime(&ms, ev[2 * static_cast<size_t>(i)], ev[2 * static_cast<size_t>(i) + 1]);
          total += ms;
        }
        for (cudaEvent_t& e : ev) cudaEventDestroy(e);
        return total / reps;
      };
      if (fp8) {
        p.experts_gate_up = gq.raw_data();
        p.experts_down = dq.raw_data();
        p.experts_gate_up_scale = gs.data<float>();
        p.experts_down_scale = ds.data<float>();
        p.experts_scratch = scratch.raw_data();
      }
      Tensor chosen = dev_i32(N * k);
      p.experts_out = chosen.data<int32_t>();
      const double ms = time_it([&] { cu::moe_block(p, impl, 0); });
      if (profile) {
        DFLASH_CUDA_CHECK(cudaMemsetAsync(l2_flush.raw_data(), 1, l2_flush.nbytes(), static_cast<cudaStream_t>(stream())));
        sync_dev();
        std::printf("moe_profile,%s,%lld\n", name.c_str(), static_cast<long long>(N));
        std::fflush(stdout);
        cudaProfilerStart();
        cu::moe_block(p, impl, 0);
        sync_dev();
        cudaProfilerStop();
      }
      const double flops = 2.0 * N * (E * H + k * 3 * I * H + 3 * Is * H);
      double ms_g = NAN, gbs = NAN;
      if (impl == cu::MoeImpl::Decode) {
        const Tensor hc = host(chosen);
        std::set<int32_t> touched(hc.data<int32_t>(), hc.data<int32_t>() + N * k);
        const double expert_bytes = fp8 ? 3.0 * I * H + 4.0 * (rbI * kbH + rbH * kbI) : 3.0 * I * H * 2.0;
        gbs = ((static_cast<double>(E) * H + 3.0 * Is * H) * 2.0 + static_cast<double>(touched.size()) * expert_bytes) / ms / 1e6;
      }
      if (impl == cu::MoeImpl::Grouped && !fp8) {
        // The two grouped GEMMs alone, on the routing moe_block left in the workspace... rerun the
        // routing into separate buffers so the GEMMs' inputs are real.
        const int64_t R = N * k;
        Tensor lg = Tensor::empty({N, E}, DType::F32);
        fill_normal(lg, {5, g_stream++, 0}, 0.0f, 1.0f);
        lg = lg.to(Device::cuda(0));
        Routed rt = route(lg, N, E, k);
        Tensor &off = rt.off, &tiles = rt.tiles, &src = rt.src;
        Tensor act = Tensor::empty({R, I}, DType::BF16, Device::cuda(0)), y = Tensor::empty({R, H}, DType::BF16, Device::cuda(0));
        cu::MoeGemmParams g1;
        g1.x = x.dev.raw_data(), g1.ldx = H, g1.src_row = src.data<int32_t>(), g1.w = gu.dev.raw_data();
        g1.y = act.raw_data(), g1.ldy = I, g1.offsets = off.data<int32_t>(), g1.tile_offsets = tiles.data<int32_t>();
        g1.E = E, g1.Nout = I, g1.K = H, g1.max_tiles = cu::moe_max_tiles(R, E), g1.swiglu = true;
        cu::MoeGemmParams g2 = g1;
        g2.x = act.raw_data(), g2.ldx = I, g2.src_row = nullptr, g2.w = dn.dev.raw_data(), g2.y = y.raw_data();
        g2.ldy = H, g2.Nout = H, g2.K = I, g2.swiglu = false;
        g1.rows = g2.rows = R;
        if (streamk) g1.max_expert_rows = g2.max_expert_rows = N;  // (the stream-K kernel needs it; moe_block sets it)
        ms_g = time_it([&] {
          cu::moe_grouped_gemm(g1, stream());
          cu::moe_grouped_gemm(g2, stream());
        });
        // The experts' weights the two GEMMs must read (each touched expert's gate|up and down).
        const Tensor hc = host(rt.counts);
        int64_t touched = 0;
        for (int64_t e = 0; e < E; ++e) touched += hc.data<int32_t>()[e] > 0;
        gbs = static_cast<double>(touched) * 3.0 * I * H * 2.0 / ms_g / 1e6;
      }
      const double gflops = 2.0 * N * k * 3 * I * H;
      std::printf("moe_bench,%s,%lld,%.4f,%.1f,%.4f,%.1f,%.0f\n", name.c_str(), static_cast<long long>(N), ms,
                  flops / ms / 1e9, ms_g, gflops / ms_g / 1e9, gbs);
      std::fflush(stdout);
    }
  }
  cu::tuning::moe_fp8_dequantize_first = -1;
  cu::tuning::moe_fuse_shared = -1;
  cu::tuning::moe_deep16_short = -1;
  cu::tuning::moe_streamk = -1;
  cu::tuning::moe_streamk_pieces = cu::kMoeStreamkPieces;
}
