// The streaming decode GEMMs (kernels/cuda/gemm_stream.cu: a one-wave stream-K grid, per-warp
// register rings of weight loads across tile boundaries, mma.sync m16n8k32 e4m3 / m16n8k16 bf16, tiles shared by
// warps summed in the block and tiles shared by blocks summed by the last block through a
// workspace) run on the CPU through tests/cuda_emulation.h, so CI checks their partition, rings,
// scales and fix-ups without a GPU; the device's own runs are test_cuda_fp8's
// (CudaFp8.StreamingGemmMatchesCpuBlockwise) and test_cuda_ops' (CudaOps.GemmSkinnyMatchesLinear).
//
// Bound: the emulated MMAs sum exact products in f32 (k order), the references (ops::gemm_fp8_blockwise;
// a double sum for bf16) in another order, so per element |got - ref| <= 2^-8 |ref| (the bf16 store:
// 2^-9) + 1e-5 max |ref| (f32 order). A wrong scale, k permutation, tile or piece gives errors of
// the order of |ref|.
#include "cuda_emulation.h"

#define DFLASH_CUDA_EMULATION 1
// Renamed, so that the emulated definitions sit beside the library's real ones in one test binary.
#define gemm_fp8_stream gemm_fp8_stream_emulated
#define gemm_fp8_stream_supported gemm_fp8_stream_supported_emulated
#define gemm_fp8_stream_kernel_name gemm_fp8_stream_kernel_name_emulated
#define gemm_bf16_stream gemm_bf16_stream_emulated
#define gemm_bf16_stream_supported gemm_bf16_stream_supported_emulated
#define gemm_skinny_streamk gemm_skinny_streamk_emulated
#define stream_packed_bytes stream_packed_bytes_emulated
#define gemm_fp8_stream_stages gemm_fp8_stream_stages_emulated
#define gemm_fp8_stream_chunk gemm_fp8_stream_chunk_emulated
#define gemm_fp8_stream_evict_first gemm_fp8_stream_evict_first_emulated
#define gemm_fp8_stream_depth gemm_fp8_stream_depth_emulated
#define gemm_stream_fixup gemm_stream_fixup_emulated
#include "kernels/cuda/gemm_stream.cu"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/random.h"
#include "core/tensor.h"
#include "fp8_gemm_layout.h"
#include "kernels/ops.h"

namespace {

using namespace dflash;
namespace cu = dflash::cuda;
using namespace fp8_gemm_layout;

uint64_t g_stream = 8300;

Tensor rand_values(int64_t R, int64_t C, float sd) { return group_scaled_values(R, C, sd, {4243, g_stream++, 0}); }

struct Operands {
  ops::Fp8Act a;
  ops::Fp8Weight w;
  std::vector<uint8_t> xq, wq;
  std::vector<float> xs, ws;
  int64_t ldx = 0;
};

Operands make(const Tensor& x, const Tensor& w, int64_t pad_x) {
  Operands o;
  o.a = ops::quantize_fp8_act(x);
  o.w = ops::quantize_fp8_weight(w);
  o.ldx = x.size(1) + pad_x;
  o.xq = strided_codes(o.a.q, o.ldx, 0xAB);
  o.wq = strided_codes(o.w.q, w.size(1), 0xAB);
  o.xs = act_scales_for_gemm(o.a.scale);
  o.ws = weight_scales_for_gemm(o.w.scale_inv, w.size(1));
  return o;
}

// Runs the kernel on k's operands with a grid of `blocks` on host memory; y [M, ldy] in f32 (NaN
// before, the output window at column y_col). Every counter must be back to zero.
template <bool kFp8>
std::vector<float> run(cu::StreamParams k, int64_t K, int blocks, int64_t y_col, int64_t ldy, const cu::BulkRing& ring = {}) {
  std::vector<uint16_t> y(static_cast<size_t>(k.M * ldy), 0x7FC0);  // bf16 NaN
  k.y = reinterpret_cast<__nv_bfloat16*>(y.data() + y_col);
  k.ldy = ldy;
  std::vector<float> partial(static_cast<size_t>(cu::workspace_floats(blocks)), NAN);
  std::vector<int> counters(static_cast<size_t>(cu::workspace_counters(blocks)), 0);
  cu::launch_stream<kFp8>(k, K, blocks, partial.data(), counters.data(), nullptr, ring);
  for (int c : counters) EXPECT_EQ(c, 0) << "a shared tile's counter was not reset";
  std::vector<float> out(y.size());
  for (size_t i = 0; i < y.size(); ++i) {
    const uint32_t bits = static_cast<uint32_t>(y[i]) << 16;
    std::memcpy(&out[i], &bits, 4);
  }
  return out;
}

std::vector<float> run_fp8(const Operands& o, int64_t M, int64_t N, int64_t K, int blocks, int64_t y_col, int64_t ldy,
                           const uint8_t* packed = nullptr, int stages = 0, int chunk = 1) {
  cu::GemmFp8Params p;
  p.w_packed = packed;
  p.x = o.xq.data();
  p.ldx = o.ldx;
  p.x_scale = o.xs.data();
  p.w = o.wq.data();
  p.w_scale = o.ws.data();
  p.y = nullptr;
  p.ldy = ldy;
  p.M = M;
  p.N = N;
  p.K = K;
  EXPECT_TRUE(cu::gemm_fp8_stream_supported(p));
  cu::BulkRing ring;  // stages > 0 with a packed weight: the bulk kernel's rings of `chunk` units a slot
  ring.stages = stages;
  ring.chunk = chunk;
  return run<true>(cu::fp8_params(p), K, blocks, y_col, ldy, ring);
}

// bf16 operands: x [M, ldx] and w [N, K] as bf16 bits, from f32 values that are bf16-exact.
std::vector<uint16_t> bf16_bits(const Tensor& v, int64_t ld) {
  const int64_t R = v.size(0), C = v.size(1);
  std::vector<uint16_t> out(static_cast<size_t>(R * ld), 0x7FC0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      uint32_t b;
      std::memcpy(&b, v.data<float>() + r * C + c, 4);
      out[static_cast<size_t>(r * ld + c)] = static_cast<uint16_t>(b >> 16);
    }
  return out;
}

std::vector<float> run_bf16(const std::vector<uint16_t>& x, int64_t ldx, const std::vector<uint16_t>& w, int64_t M,
                            int64_t N, int64_t K, int blocks, int64_t y_col, int64_t ldy) {
  cu::GemmSkinnyParams p;
  p.x = x.data();
  p.ldx = ldx;
  p.w = w.data();
  p.ldy = ldy;
  p.M = M;
  p.N = N;
  p.K = K;
  EXPECT_TRUE(cu::gemm_bf16_stream_supported(p));
  return run<false>(cu::bf16_params(p), K, blocks, y_col, ldy);
}

// call() must throw, its message naming `needle` (the switch to change).
template <class F>
void expect_refused(F&& call, const char* needle) {
  try {
    call();
    ADD_FAILURE() << "not refused (expected a message naming " << needle << ")";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Elements of y's window off ref [M, N] beyond the bound, and elements outside the window written.
void expect_matches(const std::vector<float>& y, const Tensor& ref, int64_t y_col, int64_t ldy) {
  const int64_t M = ref.size(0), N = ref.size(1);
  double max_ref = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) max_ref = std::max(max_ref, std::abs(double(ref.data<float>()[i])));
  int64_t bad = 0, written = 0;
  double worst = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < ldy; ++n) {
      const float got = y[static_cast<size_t>(m * ldy + n)];
      if (n < y_col || n >= y_col + N) {
        written += !std::isnan(got);
        continue;
      }
      const double r = ref.data<float>()[m * N + n - y_col];
      const double err = std::abs(double(got) - r);
      worst = std::max(worst, std::isnan(err) ? INFINITY : err / max_ref);
      if (!(err <= std::ldexp(std::abs(r), -8) + 1e-5 * max_ref)) ++bad;
    }
  EXPECT_EQ(bad, 0) << "elements off the reference (worst " << worst << " of max |ref|)";
  EXPECT_EQ(written, 0) << "elements outside the output window were written";
}

// Shapes and grids that split tiles every way: a tile over two, three and four blocks, blocks and
// warps holding a tile's end and the next one's start, tiles shared by warps inside a block,
// whole tiles stored by one warp (short K), empty warp runs (fewer units than warps), one unit per
// block, runs longer than the register ring (K 1024, one block); M 1..16 (one and two MMA token halves),
// N not a multiple of 16 (and, FP8, of 4: partial
// quads), ldx > K, an output window inside wider rows (NaN-poisoned: nothing outside it written).
struct Case {
  int64_t M, N, K, pad_x;
  std::vector<int> grids;
};
const std::vector<Case> kCases = {
    {16, 192, 512, 0, {1, 2, 5, 7, 12}},  // U = 12 tiles x 4 groups (FP8; bf16 8)
    {9, 200, 384, 16, {1, 3, 4, 13}},     // a last tile of 8 rows
    {8, 136, 640, 32, {4, 9, 15}},
    {1, 64, 128, 0, {1}},                 // four units (FP8): four empty warps
    {12, 640, 128, 0, {1, 2, 3}},         // K 128: every unit a whole tile
    {3, 256, 1024, 0, {1, 6}},
};

}  // namespace

// The partition: every unit in exactly one block's run, block_of the inverse of unit_begin.
TEST(GemmStreamEmulated, UnitRunsCoverEveryUnitOnce) {
  for (int64_t U : {1, 2, 7, 12, 80, 3840, 21760})
    for (int64_t B : {1, 2, 3, 5, 7, 12, 132, 264}) {
      if (B > U) continue;
      int64_t covered = 0;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t lo = cu::run_begin(U, B, b), hi = cu::run_begin(U, B, b + 1);
        ASSERT_LT(lo, hi) << "U " << U << " B " << B << ": block " << b << " empty";
        for (int64_t u = lo; u < hi; ++u) ASSERT_EQ(cu::run_of(U, B, u), b) << "U " << U << " B " << B << " u " << u;
        covered += hi - lo;
      }
      EXPECT_EQ(covered, U);
    }
}

// The FP8 kernel against ops::gemm_fp8_blockwise on the same codes and scales.
TEST(GemmStreamEmulated, Fp8MatchesCpuBlockwiseOnEveryGrid) {
  std::vector<Case> cases = kCases;
  cases.push_back({5, 77, 256, 0, {1, 2}});  // N % 4 != 0
  cases.push_back({16, 1, 256, 0, {2}});
  for (const Case& c : cases) {
    const Operands o = make(rand_values(c.M, c.K, 1.0f), rand_values(c.N, c.K, 0.05f), c.pad_x);
    Tensor ref = Tensor::empty({c.M, c.N}, DType::F32);
    ops::gemm_fp8_blockwise(o.a, o.w, ref);
    const int64_t y_col = 8, ldy = (c.N + 24 + 7) / 8 * 8;
    for (int blocks : c.grids) {
      SCOPED_TRACE("M " + std::to_string(c.M) + " N " + std::to_string(c.N) + " K " + std::to_string(c.K) + " grid " +
                   std::to_string(blocks));
      expect_matches(run_fp8(o, c.M, c.N, c.K, blocks, y_col, ldy), ref, y_col, ldy);
    }
  }
}

// The warp fix-up (tuning::gemm_stream_fixup = 2, DFLASH_STREAM_FIXUP=warp: each shared tile summed by the
// last of its warps, in global warp order) against the CPU reference on every grid and ring depth, its counters
// back at zero (run() checks), the same bits twice, and a row's bits independent of M.
TEST(GemmStreamEmulated, WarpFixupMatchesCpuBlockwiseOnEveryGrid) {
  const int saved[2] = {cu::tuning::gemm_stream_fixup, cu::tuning::gemm_fp8_stream_depth};
  std::vector<Case> cases = kCases;
  cases.push_back({5, 77, 256, 0, {1, 2}});
  cases.push_back({16, 1, 256, 0, {2}});
  cases.push_back({16, 64, 2048, 0, {1, 3}});  // a tile over several warps' runs and both blocks
  cu::tuning::gemm_stream_fixup = 2;
  for (const Case& c : cases) {
    const Operands o = make(rand_values(c.M, c.K, 1.0f), rand_values(c.N, c.K, 0.05f), c.pad_x);
    Tensor ref = Tensor::empty({c.M, c.N}, DType::F32);
    ops::gemm_fp8_blockwise(o.a, o.w, ref);
    const int64_t y_col = 8, ldy = (c.N + 24 + 7) / 8 * 8;
    for (int blocks : c.grids)
      for (int depth : {4, 2}) {
        SCOPED_TRACE("M " + std::to_string(c.M) + " N " + std::to_string(c.N) + " K " + std::to_string(c.K) + " grid " +
                     std::to_string(blocks) + " depth " + std::to_string(depth));
        cu::tuning::gemm_fp8_stream_depth = depth;
        const std::vector<float> a = run_fp8(o, c.M, c.N, c.K, blocks, y_col, ldy);
        expect_matches(a, ref, y_col, ldy);
        const std::vector<float> b = run_fp8(o, c.M, c.N, c.K, blocks, y_col, ldy);
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "a second call differs";
      }
  }
  {  // row 0 alone and as row 0 of 16: the same bits
    const int64_t N = 200, K = 512;
    const Tensor x16 = rand_values(16, K, 1.0f), w = rand_values(N, K, 0.05f);
    const Operands o16 = make(x16, w, 0), o1 = make(x16.slice(0, 0, 1).clone(), w, 0);
    for (int blocks : {2, 7}) {
      const std::vector<float> y16 = run_fp8(o16, 16, N, K, blocks, 0, N), y1 = run_fp8(o1, 1, N, K, blocks, 0, N);
      EXPECT_EQ(std::memcmp(y16.data(), y1.data(), N * sizeof(float)), 0) << "grid " << blocks;
    }
  }
  cu::tuning::gemm_stream_fixup = 3;
  const Case& c = kCases.front();
  const Operands o = make(rand_values(c.M, c.K, 1.0f), rand_values(c.N, c.K, 0.05f), c.pad_x);
  expect_refused([&] { run_fp8(o, c.M, c.N, c.K, c.grids.front(), 0, (c.N + 7) / 8 * 8); }, "DFLASH_STREAM_FIXUP");
  cu::tuning::gemm_stream_fixup = saved[0];
  cu::tuning::gemm_fp8_stream_depth = saved[1];
}

// The bf16 kernel against a double-precision product of the same bf16 values, with either fix-up.
TEST(GemmStreamEmulated, Bf16MatchesTheProductOnEveryGrid) {
  for (const Case& c : kCases) {
    if (c.N % 8 != 0) continue;
    const Tensor x = rand_values(c.M, c.K, 1.0f), w = rand_values(c.N, c.K, 0.05f);
    Tensor ref = Tensor::empty({c.M, c.N}, DType::F32);
    for (int64_t m = 0; m < c.M; ++m)
      for (int64_t n = 0; n < c.N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < c.K; ++k) s += double(x.data<float>()[m * c.K + k]) * w.data<float>()[n * c.K + k];
        ref.data<float>()[m * c.N + n] = static_cast<float>(s);
      }
    const int64_t ldx = c.K + c.pad_x, y_col = 8, ldy = (c.N + 24 + 7) / 8 * 8;
    const std::vector<uint16_t> xb = bf16_bits(x, ldx), wb = bf16_bits(w, c.K);
    for (int blocks : c.grids)
      for (int fix : {0, 2}) {  // the block fix-up and the warp fix-up (tuning::gemm_stream_fixup)
        SCOPED_TRACE("M " + std::to_string(c.M) + " N " + std::to_string(c.N) + " K " + std::to_string(c.K) + " grid " +
                     std::to_string(blocks) + " fix-up " + std::to_string(fix));
        const int saved = cu::tuning::gemm_stream_fixup;
        cu::tuning::gemm_stream_fixup = fix;
        expect_matches(run_bf16(xb, ldx, wb, c.M, c.N, c.K, blocks, y_col, ldy), ref, y_col, ldy);
        cu::tuning::gemm_stream_fixup = saved;
      }
  }
}

// The FP8 kernel's f32 outputs (gemm_fp8's y_f32): written, and added into (accumulate: each output
// once, whether its tile is stored by a warp, summed in its block or by the last of its blocks, or by the last
// of its warps: the warp fix-up); and the timing experiment's atomic pieces (tuning::gemm_stream_fixup 1,
// at ring depths 4 and 2): every piece added once, no fix-up, f32 accumulate outputs only (anything else
// refused by name).
TEST(GemmStreamEmulated, Fp8F32OutputsAndAccumulate) {
  const int saved[2] = {cu::tuning::gemm_stream_fixup, cu::tuning::gemm_fp8_stream_depth};
  for (const Case& c : kCases) {
    const Operands o = make(rand_values(c.M, c.K, 1.0f), rand_values(c.N, c.K, 0.05f), c.pad_x);
    Tensor ref = Tensor::empty({c.M, c.N}, DType::F32);
    ops::gemm_fp8_blockwise(o.a, o.w, ref);
    double max_ref = 0;
    for (int64_t i = 0; i < ref.numel(); ++i) max_ref = std::max(max_ref, std::abs(double(ref.data<float>()[i])));
    const int64_t ldy = (c.N + 3) / 4 * 4 + 4;
    for (int blocks : c.grids)
      for (const auto& [acc, fix, depth] :
           {std::tuple{false, 0, 4}, {true, 0, 4}, {true, 1, 4}, {true, 1, 2}, {false, 1, 4}, {false, 2, 4}, {true, 2, 3}}) {
        SCOPED_TRACE("M " + std::to_string(c.M) + " N " + std::to_string(c.N) + " K " + std::to_string(c.K) + " grid " +
                     std::to_string(blocks) + (acc ? " accumulate" : "") + " fix-up " + std::to_string(fix) + " depth " +
                     std::to_string(depth));
        const bool atomic = fix == 1;
        cu::tuning::gemm_stream_fixup = fix;
        cu::tuning::gemm_fp8_stream_depth = depth;
        std::vector<float> y(static_cast<size_t>(c.M * ldy));
        for (size_t i = 0; i < y.size(); ++i) y[i] = acc ? 0.25f * static_cast<float>(i % 7) : NAN;
        const std::vector<float> y0 = y;
        cu::GemmFp8Params p;
        p.x = o.xq.data(), p.ldx = o.ldx, p.x_scale = o.xs.data(), p.w = o.wq.data(), p.w_scale = o.ws.data();
        p.y = y.data(), p.ldy = ldy, p.M = c.M, p.N = c.N, p.K = c.K, p.y_f32 = true, p.accumulate = acc;
        ASSERT_TRUE(cu::gemm_fp8_stream_supported(p));
        std::vector<float> partial(static_cast<size_t>(cu::workspace_floats(blocks)), NAN);
        std::vector<int> counters(static_cast<size_t>(cu::workspace_counters(blocks)), 0);
        if (atomic && !acc) {
          expect_refused([&] { cu::launch_stream<true>(cu::fp8_params(p), c.K, blocks, partial.data(), counters.data(), nullptr); },
                         "DFLASH_STREAM_FIXUP");
          continue;
        }
        cu::launch_stream<true>(cu::fp8_params(p), c.K, blocks, partial.data(), counters.data(), nullptr);
        int64_t bad = 0, touched = 0;
        for (int64_t m = 0; m < c.M; ++m)
          for (int64_t n = 0; n < ldy; ++n) {
            const size_t at = static_cast<size_t>(m * ldy + n);
            if (n >= c.N) {
              touched += std::memcmp(&y[at], &y0[at], 4) != 0;
              continue;
            }
            const double r = ref.data<float>()[m * c.N + n] + (acc ? y0[at] : 0.0f);
            bad += !(std::abs(double(y[at]) - r) <= 1e-5 * (max_ref + 2.0));
          }
        EXPECT_EQ(bad, 0) << "outputs off the reference (f32 out: the order of f32 sums only)";
        EXPECT_EQ(touched, 0) << "columns past N written";
      }
  }
  cu::tuning::gemm_stream_fixup = saved[0];
  cu::tuning::gemm_fp8_stream_depth = saved[1];
}

// The packed unit layout (pack_stream_weight, built here on the host from packed_source as pack_kernel
// does): every piece comes from the right row and bytes (or is zero past N), so the kernel reading it
// gives the row-major weight's outputs bit for bit, on every grid, through the register ring and through
// the bulk kernel's shared-memory rings (slots x units: 1 x 1, every unit waits for its own copy; 3 x 1 and
// 2 x 3, a run wraps the ring, and with 3 units a slot a run's last copy is short); a sentinel after the
// copy stays.
TEST(GemmStreamEmulated, PackedWeightGivesTheSameBits) {
  std::vector<Case> cases = kCases;
  cases.push_back({5, 77, 256, 0, {1, 2}});  // a last tile of 13 rows: zero pieces
  for (const Case& c : cases) {
    const Operands o = make(rand_values(c.M, c.K, 1.0f), rand_values(c.N, c.K, 0.05f), c.pad_x);
    const int64_t bytes = cu::stream_packed_bytes(c.N, c.K);
    ASSERT_EQ(bytes, (c.N + 15) / 16 * 16 * c.K);
    std::vector<uint8_t> packed(static_cast<size_t>(bytes + 16), 0xCD);
    std::vector<int> seen(static_cast<size_t>(c.N * c.K), 0);
    for (int64_t i = 0; i < bytes / 16; ++i) {
      const int64_t src = cu::packed_source(i, c.N, c.K);
      for (int b = 0; b < 16; ++b) {
        packed[static_cast<size_t>(16 * i + b)] = src >= 0 ? o.wq[static_cast<size_t>(src + b)] : 0;
        if (src >= 0) ++seen[static_cast<size_t>(src + b)];
      }
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), c.N * c.K) << "every weight byte packed exactly once";
    const int64_t ldy = (c.N + 7) / 8 * 8;
    for (int blocks : c.grids) {
      SCOPED_TRACE("M " + std::to_string(c.M) + " N " + std::to_string(c.N) + " K " + std::to_string(c.K) + " grid " +
                   std::to_string(blocks));
      const std::vector<float> a = run_fp8(o, c.M, c.N, c.K, blocks, 0, ldy);
      for (const auto& [stages, chunk] : {std::pair{0, 1}, {1, 1}, {3, 1}, {2, 3}}) {
        const std::vector<float> b = run_fp8(o, c.M, c.N, c.K, blocks, 0, ldy, packed.data(), stages, chunk);
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "ring " << stages << " x " << chunk;
      }
    }
    EXPECT_EQ(packed[static_cast<size_t>(bytes)], 0xCD);
  }
}

// The register ring's depth (tuning::gemm_fp8_stream_depth: 2, 3 or 4 units in flight a warp) changes when
// the loads are issued, not what is summed: every depth gives the default's bits on every grid, runs shorter
// and longer than the ring, row-major and packed; an unbuilt depth is refused by name.
TEST(GemmStreamEmulated, RingDepthsGiveTheSameBits) {
  const int saved = cu::tuning::gemm_fp8_stream_depth;
  for (const Case& c : kCases) {
    const Operands o = make(rand_values(c.M, c.K, 1.0f), rand_values(c.N, c.K, 0.05f), c.pad_x);
    const int64_t ldy = (c.N + 7) / 8 * 8;
    for (int blocks : c.grids) {
      SCOPED_TRACE("M " + std::to_string(c.M) + " N " + std::to_string(c.N) + " K " + std::to_string(c.K) + " grid " +
                   std::to_string(blocks));
      cu::tuning::gemm_fp8_stream_depth = 4;
      const std::vector<float> a = run_fp8(o, c.M, c.N, c.K, blocks, 0, ldy);
      for (int depth : {2, 3}) {
        cu::tuning::gemm_fp8_stream_depth = depth;
        const std::vector<float> b = run_fp8(o, c.M, c.N, c.K, blocks, 0, ldy);
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "depth " << depth;
      }
    }
  }
  cu::tuning::gemm_fp8_stream_depth = 5;
  const Case& c = kCases.front();
  const Operands o = make(rand_values(c.M, c.K, 1.0f), rand_values(c.N, c.K, 0.05f), c.pad_x);
  expect_refused([&] { run_fp8(o, c.M, c.N, c.K, c.grids.front(), 0, (c.N + 7) / 8 * 8); }, "DFLASH_FP8_STREAM_DEPTH");
  cu::tuning::gemm_fp8_stream_depth = saved;
}

// A row's result does not depend on the other rows of the step (M): token 0 alone and as row 0 of
// 16 give the same bits (the same grid), so a T = 1 decode and a T = 16 verify agree.
TEST(GemmStreamEmulated, ARowsBitsDoNotDependOnM) {
  const int64_t N = 200, K = 512;
  const Tensor x16 = rand_values(16, K, 1.0f), w = rand_values(N, K, 0.05f);
  const Operands o16 = make(x16, w, 0), o1 = make(x16.slice(0, 0, 1).clone(), w, 0);
  const std::vector<uint16_t> xb = bf16_bits(x16, K), wb = bf16_bits(w.slice(0, 0, 192).clone(), K);
  for (int blocks : {2, 7}) {
    const std::vector<float> y16 = run_fp8(o16, 16, N, K, blocks, 0, N), y1 = run_fp8(o1, 1, N, K, blocks, 0, N);
    EXPECT_EQ(std::memcmp(y16.data(), y1.data(), static_cast<size_t>(N) * sizeof(float)), 0) << "fp8, grid " << blocks;
    const std::vector<float> b16 = run_bf16(xb, K, wb, 16, 192, K, blocks, 0, 192), b1 = run_bf16(xb, K, wb, 1, 192, K, blocks, 0, 192);
    EXPECT_EQ(std::memcmp(b16.data(), b1.data(), 192 * sizeof(float)), 0) << "bf16, grid " << blocks;
  }
}
