// CUDA GEMM, embedding, norm and elementwise kernels (kernels/cuda/gemm.h, norm.h, rope.h, elementwise.h) against the fp32 CPU
// reference ops. Inputs are drawn in f32, rounded to bf16 on the host, and the reference gets the
// same rounded values in f32; every output is poisoned (NaN) before the launch, and padding columns
// of strided views are checked to be left alone.
//
// Error measure: max_rel_err = max |got - ref| / max |ref| over the whole output (NaN fails).
// Bound for bf16 outputs: 1e-2. Storing an f32 result as bf16 costs up to 2^-9 ≈ 2e-3 of the
// element itself, so the normalised error of a correct kernel is <= ~2e-3 plus fp32
// reassociation noise (~1e-6); 1e-2 leaves room for that and for the rotary angle at large
// positions (pos ~ 3e4: a 1-ulp difference in sin/cos of the f32 angle is ~1e-7), while a wrong
// index, a missing weight or a wrong rounding shows up at >= 1e-1.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "core/cuda/check.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/rope.h"
#include "core/device.h"
#include "kernels/ops.h"
#include "core/random.h"
#include "cuda_timing.h"
#include "test_util.h"

// Test/benchmark knob defined in norm.cu (0 = the launcher's automatic choice).
namespace dflash::cuda::tuning {
extern int gated_norm_blocks;
extern int add_norm_rows;
}  // namespace dflash::cuda::tuning

using namespace dflash;
namespace cu = dflash::cuda;

namespace {

constexpr double kBound = 1e-2;  // bf16 outputs, see the top of the file
constexpr float kEps = 1e-6f;

uint64_t g_stream = 5000;  // a fresh RNG stream for every drawn tensor

// A random bf16 tensor on the device and the same values in f32 on the host.
struct Pair {
  Tensor dev;   // bf16, cuda:0
  Tensor host;  // f32, cpu
};
Pair rand_bf16(const Shape& shape, float mean = 0.0f, float stddev = 1.0f) {
  Tensor f = Tensor::empty(shape, DType::F32);
  fill_normal(f, {4242, g_stream++, 0}, mean, stddev);
  Tensor b = f.to_dtype(DType::BF16);
  return {b.to(Device::cuda(0)), b.to_dtype(DType::F32)};
}
Tensor poisoned(const Shape& shape) {
  Tensor t = Tensor::empty(shape, DType::BF16, Device::cuda(0));
  poison(t);
  return t;
}
Tensor host_f32(const Tensor& dev) { return dev.to(Device::cpu()).to_dtype(DType::F32); }
// Columns [c0, c1) of a 2-D host tensor (or of the last dim of a 3-D one): always a fresh copy,
// so a reference computed in place on it never writes back into `t` (contiguous() would return
// `t` itself for a full-width slice).
Tensor cols(const Tensor& t, int64_t c0, int64_t c1) { return t.slice(t.dim() - 1, c0, c1).clone(); }
// Device address `elems` bf16 elements into a tensor.
void* at(const Tensor& t, int64_t elems) { return static_cast<uint16_t*>(t.raw_data()) + elems; }
cu::Stream stream() { return DeviceContext::get(0).stream(); }

// Every element of columns outside [c0, c1) of `got` equals `want` bit for bit (or both NaN).
void expect_cols_untouched(const Tensor& got, const Tensor& want, int64_t c0, int64_t c1, const std::string& what) {
  std::vector<double> g = to_doubles(got), w = to_doubles(want);
  const int64_t width = got.size(-1);
  int64_t bad = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const int64_t c = static_cast<int64_t>(i) % width;
    if (c >= c0 && c < c1) continue;
    const bool same = (std::isnan(g[i]) && std::isnan(w[i])) || g[i] == w[i];
    bad += same ? 0 : 1;
  }
  EXPECT_EQ(bad, 0) << what << ": elements outside the output columns were written";
}

ops::SeqOffsets offsets_of(const std::vector<int64_t>& lens) {
  ops::SeqOffsets s{{0}};
  for (int64_t l : lens) s.offsets.push_back(s.offsets.back() + l);
  return s;
}

}  // namespace

// ---- GEMM ---------------------------------------------------------------------------------------

TEST(CudaOps, GemmMatchesLinear) {
  DFLASH_REQUIRE_GPU();
  struct Case {
    int64_t M, N, K, pad_x, pad_y;
    bool acc;
  };
  const Case cases[] = {
      {1, 160, 96, 0, 0, false},    {37, 160, 96, 0, 0, false},   {37, 160, 96, 8, 16, false},
      {63, 64, 64, 0, 0, false},    {64, 64, 64, 0, 0, false},    {65, 256, 128, 24, 0, false},
      {300, 1024, 512, 0, 8, false}, {1, 160, 96, 8, 8, true},    {37, 160, 96, 8, 16, true},
      {129, 520, 1032, 0, 0, true},
  };
  // Both algorithm choices: the heuristic's first answer, and autotuning (the fastest of its top
  // answers, timed on the real operands, which must then still compute the same product).
  for (bool tune : {false, true})
  for (const Case& c : cases) {
    cu::set_gemm_autotune(tune);
    SCOPED_TRACE(testing::Message() << "M=" << c.M << " N=" << c.N << " K=" << c.K << " ldx=K+" << c.pad_x
                                    << " ldy=N+" << c.pad_y << " acc=" << c.acc << " autotune=" << tune);
    const int64_t ldx = c.K + c.pad_x, ldy = c.N + c.pad_y;
    Pair x = rand_bf16({c.M, ldx}), w = rand_bf16({c.N, c.K}, 0.0f, 0.1f);
    Pair y0 = rand_bf16({c.M, ldy});
    Tensor y = c.acc ? y0.dev.clone() : poisoned({c.M, ldy});
    Tensor y_before = y.to(Device::cpu());
    cu::GemmParams p;
    p.x = x.dev.raw_data();
    p.ldx = ldx;
    p.w = w.dev.raw_data();
    p.y = y.raw_data();
    p.ldy = ldy;
    p.M = c.M;
    p.N = c.N;
    p.K = c.K;
    p.accumulate = c.acc;
    cu::gemm_bf16(p, 0);

    Tensor ref = c.acc ? cols(y0.host, 0, c.N) : Tensor::empty({c.M, c.N}, DType::F32);
    ops::linear(cols(x.host, 0, c.K), w.host, ref, c.acc);
    Tensor got = host_f32(y);
    const double err = max_rel_err(cols(got, 0, c.N), ref);
    EXPECT_LT(err, kBound);
    std::printf("  gemm M=%ld N=%ld K=%ld ldx=%ld ldy=%ld acc=%d: max_rel_err %.2e\n", long(c.M), long(c.N),
                long(c.K), long(ldx), long(ldy), int(c.acc), err);
    expect_cols_untouched(y.to(Device::cpu()), y_before, 0, c.N, "gemm y padding");

    // Second call takes the cached plan: same result bit for bit.
    if (!c.acc) {
      Tensor y2 = poisoned({c.M, ldy});
      p.y = y2.raw_data();
      cu::gemm_bf16(p, 0);
      EXPECT_EQ(max_rel_err(cols(host_f32(y2), 0, c.N), cols(got, 0, c.N)), 0.0);
    }
  }
  cu::set_gemm_autotune(false);
}

TEST(CudaOps, GemmRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  Tensor x = poisoned({4, 80}), w = poisoned({32, 64}), y = poisoned({4, 48});
  auto make = [&] {
    cu::GemmParams p;
    p.x = x.raw_data();
    p.ldx = 64;
    p.w = w.raw_data();
    p.y = y.raw_data();
    p.ldy = 32;
    p.M = 4;
    p.N = 32;
    p.K = 64;
    return p;
  };
  const auto expect_throw = throws_after_edit(make(), [](const cu::GemmParams& p) { cu::gemm_bf16(p, 0); });
  expect_throw([](cu::GemmParams& p) { p.N = 0; }, "N = 0");
  expect_throw([](cu::GemmParams& p) { p.K = 0; }, "K = 0");
  expect_throw([](cu::GemmParams& p) { p.M = -1; }, "M < 0");
  expect_throw([](cu::GemmParams& p) { p.ldx = 56; }, "ldx < K");
  expect_throw([](cu::GemmParams& p) { p.ldy = 24; }, "ldy < N");
  expect_throw([](cu::GemmParams& p) { p.x = nullptr; }, "null x");
  expect_throw([](cu::GemmParams& p) { p.y = nullptr; }, "null y");
  expect_throw([&](cu::GemmParams& p) { p.x = at(x, 1); }, "misaligned x");
  expect_throw([](cu::GemmParams& p) { p.ldx = 65; }, "ldx not a multiple of 8");
  expect_throw([](cu::GemmParams& p) { p.K = 60; }, "K not a multiple of 8");
  expect_throw([](cu::GemmParams& p) { p.ldx = 72; p.K = 64; p.M = 4; p.ldy = 33; }, "ldy not a multiple of 8");
  cu::GemmParams p = make();
  p.M = 0;
  p.x = p.y = nullptr;
  EXPECT_NO_THROW(cu::gemm_bf16(p, 0)) << "M = 0 is a no-op";
}

// ---- skinny GEMM (decode / verify) ------------------------------------------------------------------

// gemm_skinny against ops::linear (the bound of the file) and against cuBLASLt's gemm_bf16 on the
// same operands; with SwiGLU as its prologue against cuda::swiglu + gemm_skinny bit for bit; each
// output row the same bit for bit whatever the other rows are (M = 16 against M = 1: batch
// invariance); forced K splits (thread-block clusters) 1..8; rows past M and padding columns left
// alone; a second call gives the same bits. All of it twice: on the cluster kernel, then with
// tuning::gemm_skinny_streamk = 1 (the stream-K kernel of gemm_stream.cu where it applies: no SwiGLU,
// K % 128 == 0; the other cases stay on the cluster kernel), and a third time on the stream-K kernel with the
// warp fix-up (tuning::gemm_stream_fixup = 2).
TEST(CudaOps, GemmSkinnyMatchesLinear) {
  DFLASH_REQUIRE_GPU();
  struct Case {
    int64_t M, N, K, pad_x, pad_y;
    int ks;  // 0: automatic
    bool swiglu;
  };
  const Case cases[] = {
      {1, 64, 32, 0, 0, 0, false},     {5, 136, 96, 8, 0, 0, false},    {16, 520, 640, 8, 16, 0, false},
      {9, 1032, 1024, 0, 8, 0, false}, {16, 256, 2048, 0, 0, 3, false}, {16, 192, 4096, 0, 0, 8, false},
      {12, 136, 512, 0, 0, 2, false},  {16, 512, 1024, 0, 0, 0, true},  {3, 264, 96, 0, 8, 0, true},
      {16, 128, 2048, 8, 0, 4, true},  {8, 72, 64, 0, 0, 1, false},     {16, 64, 8192, 0, 0, 0, false},
      {16, 5120, 2048, 0, 8, 0, false}, {7, 17000, 768, 8, 0, 0, false},
  };
  for (int streamk : {0, 1, 2})
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "M=" << c.M << " N=" << c.N << " K=" << c.K << " ldx+" << c.pad_x << " ldy+"
                                    << c.pad_y << " ks=" << c.ks << (c.swiglu ? " swiglu" : "") << " streamk=" << streamk);
    cu::tuning::gemm_skinny_ks = c.ks;
    cu::tuning::gemm_skinny_streamk = streamk != 0;
    cu::tuning::gemm_stream_fixup = streamk == 2 ? 2 : 0;
    const int64_t ldx = (c.swiglu ? 2 * c.K : c.K) + c.pad_x, ldy = c.N + c.pad_y;
    Pair x = rand_bf16({c.M, ldx}, 0.0f, c.swiglu ? 3.0f : 1.0f), w = rand_bf16({c.N, c.K}, 0.0f, 0.1f);
    Tensor y = poisoned({16, ldy});  // 16 rows: the ones past M must stay poisoned
    Tensor y_before = y.to(Device::cpu());
    cu::GemmSkinnyParams p;
    p.x = x.dev.raw_data();
    p.ldx = ldx;
    p.w = w.dev.raw_data();
    p.y = y.raw_data();
    p.ldy = ldy;
    p.M = c.M;
    p.N = c.N;
    p.K = c.K;
    p.swiglu = c.swiglu;
    cu::gemm_skinny(p, 0, stream());
    const int splits = cu::gemm_skinny_splits(p, 0);

    // The reference: the GEMM's input as the op would form it (SwiGLU through ops::swiglu, rounded
    // to bf16 as the kernel stores it), then ops::linear.
    Tensor xin = cols(x.host, 0, c.K);
    if (c.swiglu) {
      ops::swiglu(cols(x.host, 0, c.K), cols(x.host, c.K, 2 * c.K), xin);
      xin = xin.to_dtype(DType::BF16).to_dtype(DType::F32);
    }
    Tensor ref = Tensor::empty({c.M, c.N}, DType::F32);
    ops::linear(xin, w.host, ref, false);
    Tensor got = host_f32(y).slice(0, 0, c.M).clone();
    const double err = max_rel_err(cols(got, 0, c.N), ref);
    EXPECT_LT(err, kBound);
    std::printf("  gemm_skinny M=%ld N=%ld K=%ld%s ks=%d (auto split %d)%s: max_rel_err %.2e\n", long(c.M), long(c.N),
                long(c.K), c.swiglu ? " swiglu" : "", c.ks, splits,
                streamk && cu::gemm_bf16_stream_supported(p) ? " stream-K" : "", err);
    expect_cols_untouched(y.to(Device::cpu()).slice(0, 0, c.M).clone(), y_before.slice(0, 0, c.M).clone(), 0, c.N,
                          "gemm_skinny y padding");
    if (c.M < 16) {
      Tensor past = y.to(Device::cpu()).slice(0, c.M, 16).clone(), want = y_before.slice(0, c.M, 16).clone();
      expect_cols_untouched(past, want, 0, 0, "gemm_skinny rows past M");
    }

    // The same bits again.
    Tensor y2 = poisoned({16, ldy});
    p.y = y2.raw_data();
    cu::gemm_skinny(p, 0, stream());
    EXPECT_TRUE(bit_equal(y2.slice(0, 0, c.M), y.slice(0, 0, c.M))) << "a second call differs";

    // cuBLASLt on the same GEMM input (for SwiGLU: cuda::swiglu's output, which the fused call must
    // reproduce bit for bit through the unfused skinny GEMM).
    Tensor xg = x.dev;
    int64_t ldg = ldx;
    if (c.swiglu) {
      xg = poisoned({c.M, c.K});
      ldg = c.K;
      cu::swiglu(x.dev.raw_data(), xg.raw_data(), c.M, c.K, stream());
      ASSERT_EQ(ldx, 2 * c.K + c.pad_x);
      if (c.pad_x == 0) {  // cuda::swiglu reads gu rows 2K apart
        cu::GemmSkinnyParams u = p;
        Tensor y3 = poisoned({16, ldy});
        u.x = xg.raw_data();
        u.ldx = c.K;
        u.y = y3.raw_data();
        u.swiglu = false;
        cu::gemm_skinny(u, 0, stream());
        // (with the stream-K knob the unfused call runs that kernel, the fused one the cluster kernel:
        // the same products summed in another order, so only within the bound)
        if (streamk && cu::gemm_bf16_stream_supported(u))
          EXPECT_LT(max_rel_err(cols(host_f32(y3).slice(0, 0, c.M).clone(), 0, c.N), cols(got, 0, c.N)), kBound);
        else
          EXPECT_TRUE(bit_equal(y3.slice(0, 0, c.M), y.slice(0, 0, c.M))) << "fused SwiGLU != swiglu + gemm_skinny";
      }
    }
    if (!c.swiglu || c.pad_x == 0) {
      Tensor yc = poisoned({c.M, ldy});
      cu::GemmParams gp;
      gp.x = xg.raw_data();
      gp.ldx = ldg;
      gp.w = w.dev.raw_data();
      gp.y = yc.raw_data();
      gp.ldy = ldy;
      gp.M = c.M;
      gp.N = c.N;
      gp.K = c.K;
      cu::gemm_bf16(gp, 0);
      EXPECT_LT(max_rel_err(cols(host_f32(yc), 0, c.N), cols(got, 0, c.N)), kBound) << "against cuBLASLt";
    }

    // Batch invariance: each row alone (M = 1) gives its row of the batch bit for bit.
    for (int64_t r : {int64_t{0}, c.M / 2, c.M - 1}) {
      cu::GemmSkinnyParams one = p;
      Tensor y1 = poisoned({1, ldy});
      one.x = at(x.dev, r * ldx);
      one.M = 1;
      one.y = y1.raw_data();
      cu::gemm_skinny(one, 0, stream());
      EXPECT_TRUE(bit_equal(y1.to(Device::cpu()).slice(1, 0, c.N), y.to(Device::cpu()).slice(0, r, r + 1).slice(1, 0, c.N)))
          << "row " << r << " alone";
    }
  }
  cu::tuning::gemm_skinny_ks = 0;
  cu::tuning::gemm_skinny_streamk = 0;
  cu::tuning::gemm_stream_fixup = 0;
  // The decode shapes of Qwen3.6-27B on this GPU: which fit one wave (printed, GPU-dependent).
  for (auto [N, K, sw] : {std::tuple<int64_t, int64_t, bool>{16480, 5120, false}, {14336, 5120, false},
                          {5120, 6144, false}, {5120, 17408, true}, {34816, 5120, false}}) {
    cu::GemmSkinnyParams q;
    q.ldx = sw ? 2 * K : K, q.ldy = N, q.M = 16, q.N = N, q.K = K, q.swiglu = sw;
    std::printf("  gemm_skinny one-wave split at N=%ld K=%ld%s: %d\n", long(N), long(K), sw ? " swiglu" : "",
                cu::gemm_skinny_splits(q, 0));
  }
}

// The decode steps' L2 prefetch (cuda::prefetch_l2, gemm.h) writes nothing and takes every shape its
// callers give it: row prefixes of 16 bytes, whole rows, rows longer than one 32 KB bulk instruction,
// a grid-stride loop over more rows than its 32 x 128 threads; by cp.async.bulk.prefetch.L2 and by
// prefetch.global.L2 per line (tuning::decode_prefetch_bulk 0). Misaligned pointers, row strides and
// prefixes are refused. l2_prefetch_bytes_per_row splits a budget into equal 16-byte multiples.
TEST(CudaOps, L2PrefetchWritesNothingAndRefusesMisalignment) {
  DFLASH_REQUIRE_GPU();
  EXPECT_EQ(cu::l2_prefetch_bytes_per_row(1000, 10240, 16 << 20), 10240);  // all of it fits
  EXPECT_EQ(cu::l2_prefetch_bytes_per_row(34816, 10240, 16 << 20), 480);   // 27B gate_up, bf16: 481 -> 480
  EXPECT_EQ(cu::l2_prefetch_bytes_per_row(34816, 10240, 100000), 0);       // < 16 bytes a row
  EXPECT_EQ(cu::l2_prefetch_bytes_per_row(0, 10240, 1 << 20), 0);
  const int64_t bytes = 8 << 20;
  std::vector<uint8_t> host(static_cast<size_t>(bytes));
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint8_t>(i * 131 + 7);
  Tensor buf = Tensor::empty({bytes}, DType::U8, Device::cuda(0));
  DFLASH_CUDA_CHECK(cudaMemcpy(buf.raw_data(), host.data(), host.size(), cudaMemcpyHostToDevice));
  const int saved = cu::tuning::decode_prefetch_bulk;
  struct Shape {
    int64_t rows, row_bytes, bytes_per_row;
  };
  for (int bulk : {1, 0}) {
    cu::tuning::decode_prefetch_bulk = bulk;
    for (const Shape& sh : {Shape{1, 16, 16}, Shape{100, 1024, 16}, Shape{64, 131072, 131072}, Shape{8192, 1024, 1024},
                            Shape{5000, 1600, 480}}) {
      cu::L2PrefetchParams p;
      p.w = buf.raw_data();
      p.rows = sh.rows, p.row_bytes = sh.row_bytes, p.bytes_per_row = sh.bytes_per_row;
      ASSERT_LE(p.rows * p.row_bytes, bytes);
      ASSERT_TRUE(cu::prefetch_l2_supported(p));
      cu::prefetch_l2(p, stream());
    }
  }
  cu::tuning::decode_prefetch_bulk = saved;
  DFLASH_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> back(host.size());
  DFLASH_CUDA_CHECK(cudaMemcpy(back.data(), buf.raw_data(), back.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(back.data(), host.data(), host.size()), 0) << "the prefetch wrote to its source";
  auto make = [&] {
    cu::L2PrefetchParams p;
    p.w = buf.raw_data();
    p.rows = 16, p.row_bytes = 1024, p.bytes_per_row = 256;
    return p;
  };
  const auto expect_throw = throws_after_edit(make(), [](const cu::L2PrefetchParams& p) { cu::prefetch_l2(p, stream()); });
  expect_throw([&](cu::L2PrefetchParams& p) { p.w = static_cast<const char*>(buf.raw_data()) + 8; }, "w not 16-byte aligned");
  expect_throw([](cu::L2PrefetchParams& p) { p.row_bytes = 1000; }, "row_bytes not a multiple of 16");
  expect_throw([](cu::L2PrefetchParams& p) { p.bytes_per_row = 250; }, "bytes_per_row not a multiple of 16");
  expect_throw([](cu::L2PrefetchParams& p) { p.bytes_per_row = 2048; }, "bytes_per_row > row_bytes");
  expect_throw([](cu::L2PrefetchParams& p) { p.rows = 0; }, "no rows");
}

TEST(CudaOps, GemmSkinnyRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  Tensor x = poisoned({16, 128}), w = poisoned({64, 64}), y = poisoned({16, 64});
  auto make = [&] {
    cu::GemmSkinnyParams p;
    p.x = x.raw_data();
    p.ldx = 128;
    p.w = w.raw_data();
    p.y = y.raw_data();
    p.ldy = 64;
    p.M = 16;
    p.N = 64;
    p.K = 64;
    return p;
  };
  const auto expect_throw = throws_after_edit(make(), [](const cu::GemmSkinnyParams& p) { cu::gemm_skinny(p, 0, stream()); });
  expect_throw([](cu::GemmSkinnyParams& p) { p.M = 17; }, "M > 16");
  expect_throw([](cu::GemmSkinnyParams& p) { p.K = 48; }, "K not a multiple of 32");
  expect_throw([](cu::GemmSkinnyParams& p) { p.N = 60; }, "N not a multiple of 8");
  expect_throw([](cu::GemmSkinnyParams& p) { p.ldx = 56; p.K = 64; }, "ldx < K");
  expect_throw([](cu::GemmSkinnyParams& p) { p.ldx = 100; p.swiglu = true; }, "ldx < 2K with swiglu");
  expect_throw([](cu::GemmSkinnyParams& p) { p.ldy = 60; }, "ldy < N");
  expect_throw([&](cu::GemmSkinnyParams& p) { p.x = at(x, 1); }, "misaligned x");
  expect_throw([](cu::GemmSkinnyParams& p) { p.w = nullptr; }, "null w");
  cu::GemmSkinnyParams p = make();
  p.M = 0;
  EXPECT_NO_THROW(cu::gemm_skinny(p, 0, stream())) << "M = 0 is a no-op";
  EXPECT_EQ(cu::gemm_skinny_splits(make(), 0) > 0, true) << "a small shape fits one wave";
  p = make();
  p.K = 48;
  EXPECT_EQ(cu::gemm_skinny_splits(p, 0), 0) << "a shape it cannot run";
}

// ---- norms ----------------------------------------------------------------------------------------

TEST(CudaOps, RmsNormBothKinds) {
  DFLASH_REQUIRE_GPU();
  struct Case {
    int64_t rows, D, pad_x, pad_y;
  };
  // Vector path: D % 8 == 0 and strides % 8 == 0; scalar path otherwise. Group sizes: 16 lanes
  // (D <= 128), a warp (D <= 1024), a block; 9000 and 4100 overflow the register cache (re-read).
  const Case cases[] = {{1, 24, 0, 0},   {63, 96, 0, 0},    {65, 130, 0, 0},   {64, 128, 8, 0},
                        {37, 256, 0, 16}, {5, 1024, 0, 0},  {7, 1032, 8, 8},   {9, 5120, 0, 0},
                        {3, 5120, 3, 1}, {2, 9000, 0, 0},   {2, 4100, 0, 0},   {4, 600, 0, 0},
                        {3, 513, 0, 0}};
  for (const Case& c : cases) {
    for (auto kind : {ops::RmsNormKind::ZeroCentered, ops::RmsNormKind::Plain}) {
      const bool zc = kind == ops::RmsNormKind::ZeroCentered;
      SCOPED_TRACE(testing::Message() << "rows=" << c.rows << " D=" << c.D << " ldx=D+" << c.pad_x << " ldy=D+"
                                      << c.pad_y << (zc ? " zero-centred" : " plain"));
      const int64_t ldx = c.D + c.pad_x, ldy = c.D + c.pad_y;
      Pair x = rand_bf16({c.rows, ldx}, 0.5f, 2.0f), w = rand_bf16({c.D}, zc ? 0.0f : 1.0f, 0.3f);
      Tensor y = poisoned({c.rows, ldy});
      cu::rms_norm(x.dev.raw_data(), ldx, w.dev.raw_data(), y.raw_data(), ldy, c.rows, c.D, kEps, zc, stream());
      Tensor ref = Tensor::empty({c.rows, c.D}, DType::F32);
      ops::rms_norm(cols(x.host, 0, c.D), w.host, kEps, kind, ref);
      Tensor got = host_f32(y);
      const double err = max_rel_err(cols(got, 0, c.D), ref);
      EXPECT_LT(err, kBound);
      if (c.pad_y) {
        EXPECT_TRUE(std::isnan(got.item_at(c.D))) << "padding written";
      }
    }
  }
  // In place (x == y), the way the model normalises a buffer it owns.
  Pair x = rand_bf16({33, 5120}), w = rand_bf16({5120}, 0.0f, 0.3f);
  Tensor xy = x.dev.clone();
  cu::rms_norm(xy.raw_data(), 5120, w.dev.raw_data(), xy.raw_data(), 5120, 33, 5120, kEps, true, stream());
  Tensor ref = Tensor::empty({33, 5120}, DType::F32);
  ops::rms_norm(x.host, w.host, kEps, ops::RmsNormKind::ZeroCentered, ref);
  EXPECT_LT(max_rel_err(xy, ref), kBound) << "in place";
}

TEST(CudaOps, AddRmsNorm) {
  DFLASH_REQUIRE_GPU();
  for (auto [rows, D] : {std::pair<int64_t, int64_t>{1, 24}, {63, 130}, {65, 1024}, {64, 96}, {8, 5120}, {16, 5120},
                         {5, 2056}, {3, 4100}, {2, 9000}, {4, 8192}}) {
    SCOPED_TRACE(testing::Message() << "rows=" << rows << " D=" << D);
    Pair h = rand_bf16({rows, D}, 0.0f, 3.0f), d = rand_bf16({rows, D}), w = rand_bf16({D}, 0.0f, 0.3f);
    // Reference: h + d in f32, stored as bf16 (what the kernel writes and then normalises), then
    // the zero-centred norm of the stored h.
    Tensor sum = Tensor::empty({rows, D}, DType::F32);
    ops::add(h.host, d.host, sum);
    Tensor h_ref = sum.to_dtype(DType::BF16).to_dtype(DType::F32);
    Tensor y_ref = Tensor::empty({rows, D}, DType::F32);
    ops::rms_norm(h_ref, w.host, kEps, ops::RmsNormKind::ZeroCentered, y_ref);

    Tensor hd = h.dev.clone(), y = poisoned({rows, D});
    cu::add_rms_norm(hd.raw_data(), d.dev.raw_data(), w.dev.raw_data(), y.raw_data(), rows, D, kEps, stream());
    // The f32 sum rounded to nearest-even is the same on both sides: exact.
    EXPECT_EQ(max_rel_err(hd, h_ref), 0.0) << "h not updated to bf16(h + d)";
    const double err = max_rel_err(y, y_ref);
    EXPECT_LT(err, kBound);

    Tensor hd2 = h.dev.clone();
    cu::add_rms_norm(hd2.raw_data(), d.dev.raw_data(), nullptr, nullptr, rows, D, kEps, stream());
    EXPECT_EQ(max_rel_err(hd2, h_ref), 0.0) << "add only (y == null)";

    // The block-per-row kernel (loads first) against its twin, the generic row kernel: the same bits.
    cu::tuning::add_norm_rows = 0;
    Tensor hd3 = h.dev.clone(), y3 = poisoned({rows, D});
    cu::add_rms_norm(hd3.raw_data(), d.dev.raw_data(), w.dev.raw_data(), y3.raw_data(), rows, D, kEps, stream());
    cu::tuning::add_norm_rows = 1;
    EXPECT_TRUE(bit_equal(y3, y)) << "add_rms_norm: the row kernels disagree";
    EXPECT_TRUE(bit_equal(hd3, hd));
  }
}

TEST(CudaOps, GatedRmsNorm) {
  DFLASH_REQUIRE_GPU();
  struct Case {
    int64_t N, Hv, dv, z_off, z_pad;
  };
  // z is a column range of a wider projection output (offset z_off, row stride Hv*dv + pads).
  // The multi-row kernel (8 | dv <= 256) at every group width G = 1..32, with idle lanes (dv / 8 not
  // a power of two) and partial last blocks, the Qwen3.6-27B layout (z at column 10240 of a 16480-wide
  // in-projection row), and the generic kernels (dv 130: scalar, dv 1032: a block per row).
  const Case cases[] = {{1, 1, 128, 0, 0},  {37, 3, 128, 64, 8}, {65, 4, 64, 8, 16},  {63, 2, 24, 0, 0},
                        {5, 3, 130, 2, 1},  {64, 2, 1032, 8, 0}, {40, 3, 8, 0, 0},    {17, 7, 16, 8, 0},
                        {33, 5, 32, 8, 8},  {9, 3, 256, 16, 0},  {70, 5, 200, 8, 8},  {19, 48, 128, 10240, 96}};
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "N=" << c.N << " Hv=" << c.Hv << " dv=" << c.dv << " z_off=" << c.z_off);
    const int64_t ldz = c.z_off + c.Hv * c.dv + c.z_pad;
    Pair core = rand_bf16({c.N, c.Hv, c.dv}), proj = rand_bf16({c.N, ldz}, 0.0f, 2.0f);
    Pair w = rand_bf16({c.dv}, 1.0f, 0.3f);
    Tensor z = cols(proj.host, c.z_off, c.z_off + c.Hv * c.dv).view({c.N * c.Hv, c.dv});
    Tensor ref = Tensor::empty({c.N * c.Hv, c.dv}, DType::F32);
    ops::gated_rms_norm(core.host.view({c.N * c.Hv, c.dv}), z, w.host, kEps, ref);
    // The automatic grid, and 1 or 3 persistent blocks: each lane group then streams many rows
    // through its ring (wrap-around, groups of a warp running out at different rows). The rows
    // are independent, so every grid gives the same bits.
    Tensor y0;
    for (int blocks : {0, 1, 3}) {
      const int saved = cu::tuning::gated_norm_blocks;
      cu::tuning::gated_norm_blocks = blocks;
      Tensor y = poisoned({c.N, c.Hv * c.dv});
      cu::gated_rms_norm(core.dev.raw_data(), at(proj.dev, c.z_off), ldz, w.dev.raw_data(), y.raw_data(), c.N, c.Hv,
                         c.dv, kEps, stream());
      cu::tuning::gated_norm_blocks = saved;
      EXPECT_LT(max_rel_err(y, ref), kBound) << "blocks " << blocks;
      if (blocks == 0) y0 = y;
      else EXPECT_EQ(max_rel_err(y, y0), 0.0) << "blocks " << blocks << " vs automatic";
    }
  }
}

// ---- pointwise ------------------------------------------------------------------------------------

TEST(CudaOps, Swiglu) {
  DFLASH_REQUIRE_GPU();
  for (int64_t N : {1, 37, 65})
    for (int64_t I : {24, 96, 130, 1024, 17}) {
      SCOPED_TRACE(testing::Message() << "N=" << N << " I=" << I);
      Pair gu = rand_bf16({N, 2 * I}, 0.0f, 3.0f);
      Tensor y = poisoned({N, I});
      cu::swiglu(gu.dev.raw_data(), y.raw_data(), N, I, stream());
      Tensor ref = Tensor::empty({N, I}, DType::F32);
      ops::swiglu(cols(gu.host, 0, I), cols(gu.host, I, 2 * I), ref);
      EXPECT_LT(max_rel_err(y, ref), kBound);
    }
}

TEST(CudaOps, SigmoidGate) {
  DFLASH_REQUIRE_GPU();
  // The gate is the second half of each head of the gated q projection [N, H, 2d].
  for (int64_t N : {1, 37, 65})
    for (auto [H, d] : {std::pair<int64_t, int64_t>{2, 24}, {3, 44}, {2, 128}, {3, 256}, {1, 7}}) {
      SCOPED_TRACE(testing::Message() << "N=" << N << " H=" << H << " d=" << d);
      Pair x = rand_bf16({N, H, d}), qg = rand_bf16({N, H, 2 * d}, 0.0f, 3.0f);
      Tensor xd = x.dev.clone();
      cu::sigmoid_gate(xd.raw_data(), at(qg.dev, d), H * 2 * d, 2 * d, N, H, d, stream());
      Tensor ref = x.host.clone();
      ops::sigmoid_gate_inplace(ref, cols(qg.host, d, 2 * d));
      EXPECT_LT(max_rel_err(xd, ref), kBound);
    }
}

TEST(CudaOps, EmbeddingExact) {
  DFLASH_REQUIRE_GPU();
  const int64_t V = 50;
  for (int64_t N : {1, 37, 65})
    for (int64_t D : {24, 130, 5120, 7}) {
      SCOPED_TRACE(testing::Message() << "N=" << N << " D=" << D);
      Pair table = rand_bf16({V, D});
      Tensor u = Tensor::empty({N}, DType::F32);
      fill_uniform(u, {4242, g_stream++, 0}, 0.0f, 1.0f);
      Tensor ids = Tensor::empty({N}, DType::I32);
      for (int64_t n = 0; n < N; ++n)
        ids.data<int32_t>()[n] = std::min<int32_t>(static_cast<int32_t>(u.data<float>()[n] * V), int32_t(V - 1));
      Tensor ids_dev = ids.to(Device::cuda(0));
      Tensor y = poisoned({N, D});
      cu::embedding(ids_dev.data<int32_t>(), table.dev.raw_data(), y.raw_data(), N, D, stream());
      Tensor ref = Tensor::empty({N, D}, DType::F32);
      ops::embedding(ids, table.host, ref);
      EXPECT_EQ(max_rel_err(y, ref), 0.0);
    }
}

// ---- qk_norm_rope ---------------------------------------------------------------------------------

namespace {

enum class QkLayout {
  Gated,  // q_in [N, Hq, 2d] (per head [q | gate]), k [N, Hkv, d] contiguous
  Plain,  // q_in [N, Hq, d], k contiguous
  Fused,  // one projection row [q|gate per head ..., k ..., v ...]; q and k are strided views
};

double run_qk_case(int64_t d, int64_t rotary_dim, int64_t Hq, int64_t Hkv, QkLayout layout,
                   const std::vector<int64_t>& lens, int64_t position_offset, float theta) {
  const ops::SeqOffsets seqs = offsets_of(lens);
  const int64_t N = seqs.total_tokens();
  const bool fused = layout == QkLayout::Fused;
  const int64_t hsq = layout == QkLayout::Plain ? d : 2 * d;
  const int64_t qw = Hq * hsq;  // q columns (incl. gates)
  const int64_t width = fused ? qw + 2 * Hkv * d : qw;
  // Buffers are never empty: a missing q (Hq = 0) needs the fused layout, a missing k the others.
  Pair qbuf = rand_bf16({N, width}, 0.3f, 2.0f);
  Pair kbuf = fused ? qbuf : (Hkv > 0 ? rand_bf16({N, Hkv * d}, -0.2f, 1.5f) : Pair{});
  Pair wq = rand_bf16({d}, 0.0f, 0.3f), wk = rand_bf16({d}, 0.0f, 0.3f);

  Tensor pos = Tensor::empty({N}, DType::I32);
  for (int64_t s = 0; s < seqs.num_sequences(); ++s)
    for (int64_t t = seqs.offsets[s]; t < seqs.offsets[s + 1]; ++t)
      pos.data<int32_t>()[t] = static_cast<int32_t>(t - seqs.offsets[s] + position_offset);
  Tensor pos_dev = pos.to(Device::cuda(0));

  Tensor qdev = fused ? qbuf.dev.clone() : qbuf.dev;
  Tensor kdev = !fused && Hkv > 0 ? kbuf.dev.clone() : Tensor();
  Tensor q_out = Hq > 0 ? poisoned({N, Hq, d}) : Tensor();
  cu::QkPrepParams p;
  p.q_in = qdev.raw_data();
  p.ldq = width;
  p.hsq = hsq;
  p.q_out = Hq > 0 ? q_out.raw_data() : nullptr;
  p.k = fused ? at(qdev, qw) : (Hkv > 0 ? kdev.raw_data() : nullptr);
  p.ldk = fused ? width : Hkv * d;
  p.wq = wq.dev.raw_data();
  p.wk = wk.dev.raw_data();
  p.pos = pos_dev.data<int32_t>();
  p.N = N;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.d = d;
  p.rotary_dim = rotary_dim;
  p.eps = kEps;
  p.theta = theta;
  cu::qk_norm_rope(p, stream());

  // Reference: zero-centred RMSNorm over d, then neox RoPE on the first rotary_dim dims.
  double err = 0.0;
  if (Hq > 0) {
    Tensor q_ref = cols(cols(qbuf.host, 0, qw).view({N, Hq, hsq}), 0, d);
    ops::rms_norm(q_ref, wq.host, kEps, ops::RmsNormKind::ZeroCentered, q_ref);
    ops::rope_neox_inplace(q_ref, seqs, rotary_dim, theta, position_offset);
    err = std::max(err, max_rel_err(q_out, q_ref));
  }
  const int64_t k0 = fused ? qw : 0;
  if (Hkv > 0) {
    Tensor k_ref = cols(kbuf.host, k0, k0 + Hkv * d).view({N, Hkv, d});
    ops::rms_norm(k_ref, wk.host, kEps, ops::RmsNormKind::ZeroCentered, k_ref);
    ops::rope_neox_inplace(k_ref, seqs, rotary_dim, theta, position_offset);
    Tensor k_after = fused ? cols(host_f32(qdev), k0, k0 + Hkv * d) : host_f32(kdev);
    err = std::max(err, max_rel_err(k_after, k_ref));
  }
  // q_in must be left alone; in the fused row, only the k columns change.
  if (fused)
    expect_cols_untouched(qdev.to(Device::cpu()), qbuf.dev.to(Device::cpu()), k0, k0 + Hkv * d, "fused qkv row");
  else
    EXPECT_EQ(max_rel_err(qdev, qbuf.host), 0.0) << "q_in modified";
  return err;
}

}  // namespace

TEST(CudaOps, QkNormRope) {
  DFLASH_REQUIRE_GPU();
  const std::vector<int64_t> lens = {5, 37, 1, 64, 65};  // several sequences, positions restart
  const std::pair<int64_t, int64_t> heads[] = {{2, 2}, {4, 2}, {6, 2}};  // ratios 1, 2, 3
  int i = 0;
  // d = 44 has no 16-byte rows (scalar kernel); d = 32 with rotary_dim 8 has half = 4, not a
  // multiple of 8 (scalar kernel); the rest run the vectorised kernel.
  for (int64_t d : {32, 64, 256, 44})
    for (int64_t rd : {d / 4, d}) {
      if (rd % 2) rd = d / 2;
      for (QkLayout layout : {QkLayout::Gated, QkLayout::Plain, QkLayout::Fused}) {
        const auto [Hq, Hkv] = heads[i++ % 3];
        const float theta = (i % 2) ? 1e7f : 1e4f;
        SCOPED_TRACE(testing::Message() << "d=" << d << " rotary_dim=" << rd << " Hq=" << Hq << " Hkv=" << Hkv
                                        << " layout=" << int(layout) << " theta=" << theta);
        const double err = run_qk_case(d, rd, Hq, Hkv, layout, lens, 0, theta);
        EXPECT_LT(err, kBound);
        std::printf("  qk_norm_rope d=%ld rd=%ld Hq=%ld Hkv=%ld layout=%d: max_rel_err %.2e\n", long(d), long(rd),
                    long(Hq), long(Hkv), int(layout), err);
      }
    }
  // Long-context positions (~32k): the f32 angle pos · inv_freq and accurate sin / cos.
  for (int64_t d : {256, 44}) {
    SCOPED_TRACE(testing::Message() << "d=" << d << " at positions 32700+");
    const double err = run_qk_case(d, d == 256 ? 64 : 44, 4, 2, QkLayout::Gated, {3, 70}, 32700, 1e7f);
    EXPECT_LT(err, kBound);
    std::printf("  qk_norm_rope d=%ld at positions 32700+: max_rel_err %.2e\n", long(d), err);
  }
  // Only k (Hq = 0) and only q (Hkv = 0).
  EXPECT_LT(run_qk_case(64, 64, 0, 2, QkLayout::Fused, {9}, 0, 1e4f), kBound);
  EXPECT_LT(run_qk_case(64, 16, 3, 0, QkLayout::Gated, {9}, 0, 1e4f), kBound);
}

// ---- argument checks --------------------------------------------------------------------------------

TEST(CudaOps, ElementwiseRejectBadSizes) {
  DFLASH_REQUIRE_GPU();
  Tensor a = poisoned({64, 64}), b = poisoned({64, 64}), c = poisoned({64, 64});
  void* A = a.raw_data();
  void* B = b.raw_data();
  void* C = c.raw_data();
  Tensor ids = Tensor::zeros({8}, DType::I32, Device::cuda(0));
  const auto* I = ids.data<int32_t>();
  auto s = stream();
  EXPECT_THROW(cu::embedding(I, A, B, 8, 0, s), Error);
  EXPECT_THROW(cu::embedding(I, A, B, -1, 8, s), Error);
  EXPECT_THROW(cu::embedding(I, nullptr, B, 8, 8, s), Error);
  EXPECT_THROW(cu::rms_norm(A, 16, B, C, 32, 4, 32, kEps, true, s), Error);  // ldx < D
  EXPECT_THROW(cu::rms_norm(A, 32, B, C, 16, 4, 32, kEps, true, s), Error);  // ldy < D
  EXPECT_THROW(cu::rms_norm(A, 32, B, C, 32, 4, 0, kEps, true, s), Error);
  EXPECT_THROW(cu::rms_norm(A, 32, B, C, 32, -4, 32, kEps, true, s), Error);
  EXPECT_THROW(cu::rms_norm(A, 32, nullptr, C, 32, 4, 32, kEps, true, s), Error);
  EXPECT_THROW(cu::add_rms_norm(A, B, C, A, 4, 0, kEps, s), Error);
  EXPECT_THROW(cu::add_rms_norm(A, nullptr, C, A, 4, 8, kEps, s), Error);
  EXPECT_THROW(cu::add_rms_norm(A, B, nullptr, C, 4, 8, kEps, s), Error);  // y without w
  EXPECT_THROW(cu::swiglu(A, B, 4, 0, s), Error);
  EXPECT_THROW(cu::swiglu(A, B, -1, 8, s), Error);
  EXPECT_THROW(cu::sigmoid_gate(A, B, 64, 4, 2, 2, 8, s), Error);    // hsg < d
  EXPECT_THROW(cu::sigmoid_gate(A, B, 8, 16, 2, 2, 8, s), Error);    // ldg too small
  EXPECT_THROW(cu::sigmoid_gate(A, B, 64, 16, 2, 0, 8, s), Error);   // H = 0
  EXPECT_THROW(cu::gated_rms_norm(A, B, 8, C, A, 2, 2, 8, kEps, s), Error);  // ldz < Hv*dv
  EXPECT_THROW(cu::gated_rms_norm(A, B, 16, C, A, 2, 2, 0, kEps, s), Error);
  EXPECT_THROW(cu::gated_rms_norm(A, B, 16, C, A, 2, 0, 8, kEps, s), Error);

  auto qk = [&] {
    cu::QkPrepParams p;
    p.q_in = A;
    p.ldq = 64;
    p.hsq = 32;
    p.q_out = B;
    p.k = C;
    p.ldk = 32;
    p.wq = A;
    p.wk = A;
    p.pos = I;
    p.N = 4;
    p.Hq = 2;
    p.Hkv = 2;
    p.d = 16;
    p.rotary_dim = 8;
    return p;
  };
  EXPECT_NO_THROW(cu::qk_norm_rope(qk(), s));
  const auto bad = throws_after_edit(qk(), [&](const cu::QkPrepParams& p) { cu::qk_norm_rope(p, s); });
  bad([](cu::QkPrepParams& p) { p.rotary_dim = 7; }, "odd rotary_dim");
  bad([](cu::QkPrepParams& p) { p.rotary_dim = 18; }, "rotary_dim > d");
  bad([](cu::QkPrepParams& p) { p.rotary_dim = 0; }, "rotary_dim = 0");
  bad([](cu::QkPrepParams& p) { p.d = 0; }, "d = 0");
  bad([](cu::QkPrepParams& p) { p.hsq = 8; }, "hsq < d");
  bad([](cu::QkPrepParams& p) { p.ldq = 40; }, "ldq too small");
  bad([](cu::QkPrepParams& p) { p.ldk = 24; }, "ldk < Hkv*d");
  bad([](cu::QkPrepParams& p) { p.N = -1; }, "N < 0");
  bad([](cu::QkPrepParams& p) { p.pos = nullptr; }, "null pos");
  bad([](cu::QkPrepParams& p) { p.d = 512; p.rotary_dim = 512; p.hsq = 512; p.ldq = 1024; p.ldk = 1024; },
      "rotary_dim > 256");
  DeviceContext::get(0).synchronize();
}

// ---- timings (print only) ----------------------------------------------------------------------------

namespace {

// Median milliseconds of `fn` over `reps` runs after 3 warm-ups, timed with CUDA events on the
// context stream.
double time_ms(const std::function<void()>& fn, int reps = 20) { return median_ms(stream(), 3, reps, fn); }

Tensor dev_randn(const Shape& shape, float stddev = 1.0f) {
  Tensor t = Tensor::empty(shape, DType::BF16, Device::cuda(0));
  fill_normal(t, {99, g_stream++, 0}, 0.0f, stddev);
  return t;
}

void report(const char* what, double ms, double bytes, double flops = 0) {
  if (flops > 0)
    std::printf("  %-52s %9.3f ms  %7.1f TFLOP/s  %7.1f GB/s\n", what, ms, flops / ms * 1e-9, bytes / ms * 1e-6);
  else
    std::printf("  %-52s %9.3f ms  %7.1f GB/s\n", what, ms, bytes / ms * 1e-6);
}

}  // namespace

// Realistic sizes (Qwen3.5-27B-like: hidden 5120, intermediate 17408, 24 q / 4 kv heads of 256,
// 48 GDN value heads of 128), 8192 tokens. Vector vs scalar kernels where both exist (the scalar
// one is forced with a misaligned / odd-stride view). Prints only.
TEST(CudaOpsTiming, PrintTimings) {
  DFLASH_REQUIRE_GPU();
  const int64_t T = 8192, H = 5120, I = 17408;
  auto s = stream();
  {
    for (auto [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{T, 2 * I, H}, {T, H, I}, {T, 5120, 5120},
                           {1, 2 * I, H}, {64, 2 * I, H}}) {
      Tensor x = dev_randn({M, K}), w = dev_randn({N, K}, 0.02f), y = dev_randn({M, N});
      cu::GemmParams p;
      p.x = x.raw_data();
      p.ldx = K;
      p.w = w.raw_data();
      p.y = y.raw_data();
      p.ldy = N;
      p.M = M;
      p.N = N;
      p.K = K;
      const double ms = time_ms([&] { cu::gemm_bf16(p, 0); });
      char name[96];
      std::snprintf(name, sizeof name, "gemm M=%ld N=%ld K=%ld", long(M), long(N), long(K));
      report(name, ms, 2.0 * (M * K + N * K + M * N), 2.0 * M * N * K);
    }
  }
  {
    Tensor x = dev_randn({T, H + 8}), w = dev_randn({H}, 0.3f), y = dev_randn({T, H + 8});
    report("rms_norm 8192x5120 vec", time_ms([&] {
             cu::rms_norm(x.raw_data(), H, w.raw_data(), y.raw_data(), H, T, H, kEps, true, s);
           }), 4.0 * T * H);
    report("rms_norm 8192x5120 scalar (ldx = 5121)", time_ms([&] {
             cu::rms_norm(x.raw_data(), H + 1, w.raw_data(), y.raw_data(), H, T, H, kEps, true, s);
           }), 4.0 * T * H);
    Tensor d = dev_randn({T, H});
    report("add_rms_norm 8192x5120 vec", time_ms([&] {
             cu::add_rms_norm(x.raw_data(), d.raw_data(), w.raw_data(), y.raw_data(), T, H, kEps, s);
           }), 8.0 * T * H);
    report("add_rms_norm 8192x5120 scalar (misaligned h)", time_ms([&] {
             cu::add_rms_norm(at(x, 1), d.raw_data(), w.raw_data(), y.raw_data(), T, H, kEps, s);
           }), 8.0 * T * H);
    Tensor ids_host = Tensor::empty({T}, DType::I32);
    for (int64_t n = 0; n < T; ++n) ids_host.data<int32_t>()[n] = static_cast<int32_t>((n * 7919) % 8000);
    Tensor ids = ids_host.to(Device::cuda(0));
    Tensor table = dev_randn({8000, H});
    report("embedding 8192x5120", time_ms([&] { cu::embedding(ids.data<int32_t>(), table.raw_data(), y.raw_data(), T, H, s); }),
           2.0 * T * H);
  }
  {
    Tensor gu = dev_randn({T, 2 * I}), y = dev_randn({T, I});
    report("swiglu 8192x17408 vec", time_ms([&] { cu::swiglu(gu.raw_data(), y.raw_data(), T, I, s); }), 6.0 * T * I);
    report("swiglu 8192x17407 scalar", time_ms([&] { cu::swiglu(gu.raw_data(), y.raw_data(), T, I - 1, s); }),
           6.0 * (T * (I - 1)));
  }
  {
    const int64_t Hq = 24, Hkv = 4, d = 256, width = Hq * 2 * d + 2 * Hkv * d;
    Tensor qkv = dev_randn({T, width + 8}), q_out = dev_randn({T, Hq, d}), w = dev_randn({d}, 0.3f);
    Tensor pos = Tensor::zeros({T}, DType::I32, Device::cuda(0));
    cu::QkPrepParams p;
    p.q_in = qkv.raw_data();
    p.ldq = width;
    p.hsq = 2 * d;
    p.q_out = q_out.raw_data();
    p.k = at(qkv, Hq * 2 * d);
    p.ldk = width;
    p.wq = p.wk = w.raw_data();
    p.pos = pos.data<int32_t>();
    p.N = T;
    p.Hq = Hq;
    p.Hkv = Hkv;
    p.d = d;
    p.rotary_dim = 64;
    p.theta = 1e7f;
    const double bytes = 2.0 * T * (2 * Hq * d + 2 * Hkv * d);
    report("qk_norm_rope 8192 tok, 24+4 heads of 256 vec", time_ms([&] { cu::qk_norm_rope(p, s); }), bytes);
    p.ldq = width + 1;  // odd row stride: scalar kernel
    p.ldk = width + 1;
    report("qk_norm_rope ... scalar (ldq = ldk odd)", time_ms([&] { cu::qk_norm_rope(p, s); }), bytes);

    Tensor x = dev_randn({T, Hq * d});
    report("sigmoid_gate 8192 tok, 24 heads of 256 vec", time_ms([&] {
             cu::sigmoid_gate(x.raw_data(), at(qkv, d), width, 2 * d, T, Hq, d, s);
           }), 6.0 * T * Hq * d);
    report("sigmoid_gate ... scalar (ldg odd)", time_ms([&] {
             cu::sigmoid_gate(x.raw_data(), at(qkv, d), width + 1, 2 * d, T, Hq, d, s);
           }), 6.0 * T * Hq * d);
  }
  {
    const int64_t Hv = 48, dv = 128;
    Tensor core = dev_randn({T, Hv, dv}), z = dev_randn({T, Hv * dv + 8}), w = dev_randn({dv}), y = dev_randn({T, Hv * dv});
    report("gated_rms_norm 8192 tok, 48 heads of 128 vec", time_ms([&] {
             cu::gated_rms_norm(core.raw_data(), z.raw_data(), Hv * dv, w.raw_data(), y.raw_data(), T, Hv, dv, kEps, s);
           }), 6.0 * T * Hv * dv);
    // As in the forward: z inside the [T, 16480] in-projection output (ldz 16480, column 10240);
    // persistent grids of 1..4 blocks per SM (132 SMs) and the automatic one (0).
    Tensor proj = dev_randn({T, 16480});
    for (int blocks : {0, 132, 264, 396, 528, 660}) {
      const int saved = cu::tuning::gated_norm_blocks;
      cu::tuning::gated_norm_blocks = blocks;
      char name[96];
      std::snprintf(name, sizeof name, "gated_rms_norm ... z in the in_proj output (ldz 16480), %d blocks", blocks);
      report(name, time_ms([&] {
               cu::gated_rms_norm(core.raw_data(), at(proj, 10240), 16480, w.raw_data(), y.raw_data(), T, Hv, dv, kEps,
                                  s);
             }), 6.0 * T * Hv * dv);
      cu::tuning::gated_norm_blocks = saved;
    }
    report("gated_rms_norm ... scalar (ldz odd)", time_ms([&] {
             cu::gated_rms_norm(core.raw_data(), z.raw_data(), Hv * dv + 1, w.raw_data(), y.raw_data(), T, Hv, dv,
                                kEps, s);
           }), 6.0 * T * Hv * dv);
  }
  {
    // Device-to-device copy as the bandwidth ceiling.
    Tensor a = dev_randn({T, 2 * I}), b = dev_randn({T, 2 * I});
    const size_t bytes = a.nbytes();
    report("cudaMemcpyAsync D2D 570 MB", time_ms([&] {
             cudaMemcpyAsync(b.raw_data(), a.raw_data(), bytes, cudaMemcpyDeviceToDevice,
                             static_cast<cudaStream_t>(s));
           }), 2.0 * bytes);
  }
  DeviceContext::get(0).synchronize();
}
