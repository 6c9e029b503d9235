// CUDA GatedDeltaNet kernels (kernels/cuda/gdn_conv.cu, gdn_recurrent.cu) against the fp32 CPU
// reference ops: causal_conv1d (fast and fallback), gdn_prep (l2norm + gates) and the
// token-recurrent gated delta rule. Inputs are bf16 (rounded on the host; the CPU gets the same
// rounded values in f32); every output is poisoned (NaN) before the launch. Last, print-only
// timings at the Qwen3.6-27B shape.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "kernels/cuda/launch.h"
#include "kernels/device.h"
#include "kernels/ops.h"
#include "kernels/random.h"
#include "test_util.h"

// Test/benchmark knobs defined in the kernel files (0 = the launcher's automatic choice).
namespace dflash::cuda::tuning {
extern int conv_tokens_per_thread;
extern int prep_blocks;
extern int recurrent_rows_per_thread;
}  // namespace dflash::cuda::tuning

using namespace dflash;

namespace {

uint64_t g_stream = 7000;

// Host f32 tensor of bf16-representable values.
Tensor randn_bf16(const Shape& s, float stddev = 1.0f, float mean = 0.0f) {
  Tensor t = Tensor::empty(s, DType::F32);
  fill_normal(t, {2024, g_stream++, 0}, mean, stddev);
  return t.to_dtype(DType::BF16).to_dtype(DType::F32);
}
Tensor rand_uniform(const Shape& s, float lo, float hi) {
  Tensor t = Tensor::empty(s, DType::F32);
  fill_uniform(t, {2024, g_stream++, 0}, lo, hi);
  return t;
}
Tensor to_gpu_bf16(const Tensor& host_f32) { return host_f32.contiguous().to_dtype(DType::BF16).to(Device::cuda(0)); }
Tensor to_gpu(const Tensor& host) { return host.contiguous().to(Device::cuda(0)); }
Tensor gpu_out(const Shape& s, DType dt) {
  Tensor t = Tensor::empty(s, dt, Device::cuda(0));
  poison(t);
  return t;
}
Tensor cpu_out(const Shape& s) {
  Tensor t = Tensor::empty(s, DType::F32);
  poison(t);
  return t;
}

ops::SeqOffsets offsets_of(const std::vector<int64_t>& lens) {
  ops::SeqOffsets s{{0}};
  for (int64_t l : lens) s.offsets.push_back(s.offsets.back() + l);
  return s;
}
Tensor cu_seqlens_gpu(const ops::SeqOffsets& s) {
  Tensor t = Tensor::empty({static_cast<int64_t>(s.offsets.size())}, DType::I32);
  for (size_t i = 0; i < s.offsets.size(); ++i) t.data<int32_t>()[i] = static_cast<int32_t>(s.offsets[i]);
  return t.to(Device::cuda(0));
}
cuda::Stream stream0() { return DeviceContext::get(0).stream(); }
const int32_t* i32(const Tensor& t) { return static_cast<const int32_t*>(t.raw_data()); }
// Element pointer `off` elements into a bf16 tensor.
void* at_bf16(const Tensor& t, int64_t off) { return static_cast<uint16_t*>(t.raw_data()) + off; }

// A conv over N tokens of C channels (row stride ldx) of num_seqs sequences, kernel size K; the
// caller sets p.y.
cuda::ConvParams conv_params(const void* x, int64_t ldx, const Tensor& w, const Tensor& cu, int64_t num_seqs,
                             int64_t N, int64_t C, int64_t K, bool silu = true) {
  cuda::ConvParams p;
  p.x = x;
  p.ldx = ldx;
  p.w = w.raw_data();
  p.cu_seqlens = i32(cu);
  p.num_seqs = num_seqs;
  p.N = N;
  p.C = C;
  p.K = K;
  p.silu = silu;
  return p;
}

std::string lens_str(const std::vector<int64_t>& lens) {
  std::string s = "{";
  for (size_t i = 0; i < lens.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(lens[i]);
  }
  s += '}';
  return s;
}

// Sets a tuning knob for the scope.
struct Knob {
  int& ref;
  int saved;
  Knob(int& r, int v) : ref(r), saved(r) { ref = v; }
  ~Knob() { ref = saved; }
};

const std::vector<std::vector<int64_t>> kSeqSets = {{1}, {63, 64, 65}, {130, 1, 7}};

}  // namespace

// ---- causal conv -------------------------------------------------------------------------------
// Bounds: the kernels accumulate the K taps in f32 in the reference's order and round once to
// bf16, so against the f32 CPU output the normalised error is at most half a bf16 ulp of the
// largest output (2^-9 ~ 2e-3): bound 1e-2. Fast and fallback use the same fmaf order, so they
// must agree bit for bit (zero padding contributes fmaf(w, 0, acc) = acc exactly).
// Measured on an H200: worst 3.4e-3 (fast), 3.7e-3 (fallback); fast == fallback everywhere.
TEST(CudaGdn, CausalConvFastAndFallbackMatchCpu) {
  DFLASH_REQUIRE_GPU();
  double worst_fast = 0, worst_fb = 0;
  for (int64_t C : {8, 24, 160, 10240}) {
    for (const auto& lens : kSeqSets) {
      const ops::SeqOffsets seqs = offsets_of(lens);
      const int64_t N = seqs.total_tokens();
      const int64_t ldx = C + 24;  // x = the first C columns of a wider [N, ldx] buffer
      const Tensor xw = randn_bf16({N, ldx});
      const Tensor xd = to_gpu_bf16(xw);
      const Tensor xc = xw.slice(1, 0, C).contiguous();
      const Tensor cu = cu_seqlens_gpu(seqs);
      for (int64_t K = 1; K <= 5; ++K) {
        const Tensor w = randn_bf16({C, K}, 0.5f);
        const Tensor wd = to_gpu_bf16(w);
        for (bool silu : {true, false}) {
          Tensor ref = cpu_out({N, C});
          ops::causal_conv1d(xc, w, seqs, silu, ref);
          cuda::ConvParams p = conv_params(xd.raw_data(), ldx, wd, cu, seqs.num_sequences(), N, C, K, silu);
          Tensor yfb = gpu_out({N, C}, DType::BF16);
          p.y = yfb.raw_data();
          cuda::causal_conv1d_fallback(p, stream0());
          const double efb = max_rel_err(yfb, ref);
          worst_fb = std::max(worst_fb, efb);
          const std::string what = "C " + std::to_string(C) + " K " + std::to_string(K) + " seqs " + lens_str(lens) +
                                   (silu ? " silu" : " linear");
          EXPECT_LT(efb, 1e-2) << "fallback " << what;
          ASSERT_EQ(cuda::causal_conv1d_fast_supported(C, K), K <= 4) << what;
          if (K > 4) continue;
          // Automatic run length, and forced ones: 1 and 3 (runs cross every boundary, odd
          // batches), 8, 13 (a partial load ring), 64, 200 (one run over all sequences).
          for (int R : {0, 1, 3, 8, 13, 64, 200}) {
            Knob knob(cuda::tuning::conv_tokens_per_thread, R);
            Tensor yf = gpu_out({N, C}, DType::BF16);
            p.y = yf.raw_data();
            cuda::causal_conv1d_fast(p, stream0());
            const double ef = max_rel_err(yf, ref);
            worst_fast = std::max(worst_fast, ef);
            EXPECT_LT(ef, 1e-2) << "fast " << what << " R " << R;
            EXPECT_EQ(max_rel_err(yf, yfb), 0.0) << "fast vs fallback " << what << " R " << R;
          }
        }
      }
    }
  }
  std::printf("causal_conv1d: worst normalised error vs CPU: fast %.3g, fallback %.3g\n", worst_fast, worst_fb);
}

// Long runs through the load ring: sequences longer than a run and runs longer than a sequence,
// an empty sequence, every K; fast must equal the fallback bit for bit.
TEST(CudaGdn, CausalConvLongRuns) {
  DFLASH_REQUIRE_GPU();
  const ops::SeqOffsets seqs = offsets_of({300, 1, 0, 517, 20});
  const int64_t N = seqs.total_tokens(), C = 160, ldx = 176;
  const Tensor cu = cu_seqlens_gpu(seqs);
  const Tensor xw = randn_bf16({N, ldx});
  const Tensor xd = to_gpu_bf16(xw);
  for (int64_t K = 1; K <= 4; ++K) {
    const Tensor w = randn_bf16({C, K}, 0.5f);
    const Tensor wd = to_gpu_bf16(w);
    Tensor ref = cpu_out({N, C});
    ops::causal_conv1d(xw.slice(1, 0, C).contiguous(), w, seqs, true, ref);
    cuda::ConvParams p = conv_params(xd.raw_data(), ldx, wd, cu, seqs.num_sequences(), N, C, K);
    Tensor yfb = gpu_out({N, C}, DType::BF16);
    p.y = yfb.raw_data();
    cuda::causal_conv1d_fallback(p, stream0());
    EXPECT_LT(max_rel_err(yfb, ref), 1e-2) << "fallback K " << K;
    for (int R : {0, 5, 6, 7, 8, 9, 40, 160, 299, 301, 1000}) {
      Knob knob(cuda::tuning::conv_tokens_per_thread, R);
      Tensor yf = gpu_out({N, C}, DType::BF16);
      p.y = yf.raw_data();
      cuda::causal_conv1d_fast(p, stream0());
      EXPECT_LT(max_rel_err(yf, ref), 1e-2) << "fast K " << K << " R " << R;
      EXPECT_EQ(max_rel_err(yf, yfb), 0.0) << "fast vs fallback K " << K << " R " << R;
    }
  }
}

// x starting at a 16-byte aligned column offset (e.g. the v part of [q|k|v]) for the fast path;
// odd C and odd ldx for the fallback.
TEST(CudaGdn, CausalConvOffsetsAndOddShapes) {
  DFLASH_REQUIRE_GPU();
  const ops::SeqOffsets seqs = offsets_of({5, 40, 3});
  const int64_t N = seqs.total_tokens();
  const Tensor cu = cu_seqlens_gpu(seqs);
  for (auto [C, ldx, col0, K] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{64, 96, 16, 4}, {40, 48, 8, 3},
                                 {5, 7, 1, 4}, {13, 13, 0, 2}, {3, 10, 5, 6}}) {
    const Tensor xw = randn_bf16({N, ldx});
    const Tensor xd = to_gpu_bf16(xw);
    const Tensor w = randn_bf16({C, K}, 0.5f);
    const Tensor wd = to_gpu_bf16(w);
    Tensor ref = cpu_out({N, C});
    ops::causal_conv1d(xw.slice(1, col0, col0 + C).contiguous(), w, seqs, true, ref);
    cuda::ConvParams p = conv_params(at_bf16(xd, col0), ldx, wd, cu, seqs.num_sequences(), N, C, K);
    Tensor yfb = gpu_out({N, C}, DType::BF16);
    p.y = yfb.raw_data();
    cuda::causal_conv1d_fallback(p, stream0());
    EXPECT_LT(max_rel_err(yfb, ref), 1e-2) << "fallback C " << C << " ldx " << ldx << " K " << K;
    const bool fast_ok = cuda::causal_conv1d_fast_supported(C, K) && ldx % 8 == 0 && col0 % 8 == 0;
    Tensor yf = gpu_out({N, C}, DType::BF16);
    p.y = yf.raw_data();
    if (fast_ok) {
      cuda::causal_conv1d_fast(p, stream0());
      EXPECT_LT(max_rel_err(yf, ref), 1e-2) << "fast C " << C << " ldx " << ldx << " K " << K;
    } else {
      EXPECT_THROW(cuda::causal_conv1d_fast(p, stream0()), Error) << "C " << C << " ldx " << ldx << " K " << K;
    }
  }
}

TEST(CudaGdn, CausalConvRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  Tensor x = Tensor::empty({4, 64}, DType::BF16, Device::cuda(0));
  Tensor w = Tensor::empty({64, 5}, DType::BF16, Device::cuda(0));
  Tensor y = Tensor::empty({4, 64}, DType::BF16, Device::cuda(0));
  const Tensor cu = cu_seqlens_gpu(offsets_of({4}));
  cuda::ConvParams p = conv_params(x.raw_data(), 64, w, cu, 1, 4, 64, 4);
  p.y = y.raw_data();
  EXPECT_NO_THROW(cuda::causal_conv1d_fast(p, stream0()));
  auto fast_throws = [&](auto mutate) {
    cuda::ConvParams q = p;
    mutate(q);
    EXPECT_THROW(cuda::causal_conv1d_fast(q, stream0()), Error);
  };
  fast_throws([](cuda::ConvParams& q) { q.K = 5; });
  fast_throws([](cuda::ConvParams& q) { q.K = 0; });
  fast_throws([](cuda::ConvParams& q) { q.C = 60; });
  fast_throws([](cuda::ConvParams& q) { q.ldx = 63; q.C = 56; });  // rows not 16-byte aligned
  fast_throws([&](cuda::ConvParams& q) { q.x = at_bf16(x, 1); q.C = 56; });  // misaligned pointer
  fast_throws([](cuda::ConvParams& q) { q.ldx = 32; });  // ldx < C
  fast_throws([](cuda::ConvParams& q) { q.num_seqs = 0; });
  EXPECT_FALSE(cuda::causal_conv1d_fast_supported(60, 4));
  EXPECT_FALSE(cuda::causal_conv1d_fast_supported(64, 5));
  EXPECT_TRUE(cuda::causal_conv1d_fast_supported(10240, 4));
  cuda::ConvParams q = p;
  q.ldx = 32;
  EXPECT_THROW(cuda::causal_conv1d_fallback(q, stream0()), Error);
  q = p;
  q.K = 0;
  EXPECT_THROW(cuda::causal_conv1d_fallback(q, stream0()), Error);
  DeviceContext::get(0).synchronize();
}

// ---- gdn_prep ----------------------------------------------------------------------------------
// q/k: l2norm in f32 then one rounding to bf16: normalised error <= 2^-9 of the largest element,
// bound 1e-2. g/beta: f32 on both sides (expf/log1pf vs std::exp/log1p, a few ulp): bound 1e-5.
// Measured on an H200: q/k <= 3.2e-3, g <= 1.1e-7, beta <= 1.3e-7.
TEST(CudaGdn, PrepMatchesCpuL2NormAndGates) {
  DFLASH_REQUIRE_GPU();
  struct Case {
    int64_t N, Hk, ratio, dk, dv;
  };
  // dk 8..256 (multiple of 8) take the persistent ring kernel: lane groups of 1..32, idle lanes at
  // dk 24 and 200, groups past the last row, more gates than threads (N 300, Hk 1, Hv 4, dk 8: the
  // gate loop strides over the grid). dk 20 (scalar) and 264 (vector, a warp per row) the general one.
  for (const Case& c : {Case{1, 1, 1, 128, 128}, Case{65, 2, 2, 128, 64}, Case{63, 3, 3, 16, 24},
                        Case{64, 2, 3, 20, 8},  // dk % 8 != 0: scalar path
                        Case{7, 1, 2, 256, 16}, Case{130, 16, 3, 128, 128}, Case{300, 1, 4, 8, 8},
                        Case{33, 2, 2, 24, 16}, Case{21, 3, 2, 32, 8}, Case{11, 2, 1, 64, 8}, Case{9, 2, 2, 200, 8},
                        Case{5, 2, 1, 264, 8}}) {
    const int64_t Hv = c.Hk * c.ratio, qk = c.Hk * c.dk, conv_dim = 2 * qk + Hv * c.dv;
    const int64_t ld_ab = 2 * Hv + 5;
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.dk));
    const Tensor conv = randn_bf16({c.N, conv_dim}, 0.7f);
    const Tensor ab = randn_bf16({c.N, ld_ab}, 6.0f);  // wide spread: softplus' x > 20 branch too
    const Tensor A_log = randn_bf16({Hv}, 0.8f);
    const Tensor dt_bias = randn_bf16({Hv}, 1.0f);
    const Tensor conv_d = to_gpu_bf16(conv), ab_d = to_gpu_bf16(ab), A_log_d = to_gpu_bf16(A_log),
                 dt_d = to_gpu_bf16(dt_bias);
    // CPU reference.
    Tensor q_ref = conv.slice(1, 0, qk).contiguous().view({c.N, c.Hk, c.dk});
    Tensor k_ref = conv.slice(1, qk, 2 * qk).contiguous().view({c.N, c.Hk, c.dk});
    ops::l2norm_inplace(q_ref, 1e-6f);
    ops::l2norm_inplace(k_ref, 1e-6f);
    for (int64_t i = 0; i < q_ref.numel(); ++i) q_ref.data<float>()[i] *= scale;
    Tensor g_ref = cpu_out({c.N, Hv}), beta_ref = cpu_out({c.N, Hv});
    ops::gdn_gates(ab.slice(1, 0, Hv).contiguous(), ab.slice(1, Hv + 3, 2 * Hv + 3).contiguous(), A_log, dt_bias,
                   g_ref, beta_ref);
    // GPU.
    // The automatic persistent grid, and 1 or 3 blocks (every lane group streams many rows and
    // each thread several gates); all grids give the same bits.
    Tensor q0, k0;
    for (int blocks : {0, 1, 3}) {
      Knob knob(cuda::tuning::prep_blocks, blocks);
      Tensor q = gpu_out({c.N, c.Hk, c.dk}, DType::BF16), k = gpu_out({c.N, c.Hk, c.dk}, DType::BF16);
      Tensor g = gpu_out({c.N, Hv}, DType::F32), beta = gpu_out({c.N, Hv}, DType::F32);
      cuda::GdnPrepParams p;
      p.conv = conv_d.raw_data();
      p.ld_conv = conv_dim;
      p.a = ab_d.raw_data();
      p.b = at_bf16(ab_d, Hv + 3);
      p.ld_ab = ld_ab;
      p.A_log = A_log_d.raw_data();
      p.dt_bias = dt_d.raw_data();
      p.q = q.raw_data();
      p.k = k.raw_data();
      p.g = g.data<float>();
      p.beta = beta.data<float>();
      p.N = c.N;
      p.Hk = c.Hk;
      p.Hv = Hv;
      p.dk = c.dk;
      p.scale = scale;
      cuda::gdn_prep(p, stream0());
      const std::string what = "N " + std::to_string(c.N) + " Hk " + std::to_string(c.Hk) + " Hv " +
                               std::to_string(Hv) + " dk " + std::to_string(c.dk) + " blocks " + std::to_string(blocks);
      const double eq = max_rel_err(q, q_ref), ek = max_rel_err(k, k_ref);
      const double eg = max_rel_err(g, g_ref), eb = max_rel_err(beta, beta_ref);
      EXPECT_LT(eq, 1e-2) << "q " << what;
      EXPECT_LT(ek, 1e-2) << "k " << what;
      EXPECT_LT(eg, 1e-5) << "g " << what;
      EXPECT_LT(eb, 1e-5) << "beta " << what;
      std::printf("gdn_prep %s: q %.3g k %.3g g %.3g beta %.3g\n", what.c_str(), eq, ek, eg, eb);
      if (blocks == 0) {
        q0 = q;
        k0 = k;
      } else {
        EXPECT_EQ(max_rel_err(q, q0), 0.0) << "q " << what << " vs automatic grid";
        EXPECT_EQ(max_rel_err(k, k0), 0.0) << "k " << what << " vs automatic grid";
      }
    }
  }
  cuda::GdnPrepParams bad;
  bad.N = 4;
  bad.Hk = 2;
  bad.Hv = 4;
  bad.dk = 16;
  bad.ld_conv = 63;  // < 2*Hk*dk
  bad.ld_ab = 8;
  bad.scale = 0.25f;
  EXPECT_THROW(cuda::gdn_prep(bad, stream0()), Error);
  bad.ld_conv = 64;
  bad.ld_ab = 3;  // < Hv
  EXPECT_THROW(cuda::gdn_prep(bad, stream0()), Error);
}

// ---- recurrent gated delta rule ------------------------------------------------------------------
// The CPU gets the same normalised, pre-scaled bf16 q/k (l2norm_qk = false, scale = 1). The GPU
// state is f32 with a different summation order (partial sums over RP lanes, o from
// exp(g)·S_oldᵀq + delta·(k·q)): ~1e-6 relative on the state, so bound 1e-3 on the final state;
// outputs are rounded once to bf16 (<= 2^-9 of the largest): bound 2e-2 as briefed.
// Measured on an H200 over all cases and rows-per-thread variants: out 2.6e-3, final state 3.5e-7.
namespace {

struct RuleCase {
  int64_t Hk, Hv, dk, dv;
  std::vector<int64_t> lens;
  bool init;
};

void check_recurrent(const RuleCase& c, std::vector<int> rows_variants, double* worst_out, double* worst_state) {
  const ops::SeqOffsets seqs = offsets_of(c.lens);
  const int64_t N = seqs.total_tokens(), S = seqs.num_sequences();
  // q, k: random, l2-normalised, q scaled by 1/sqrt(dk), rounded to bf16 (as gdn_prep leaves them).
  Tensor q = randn_bf16({N, c.Hk, c.dk}), k = randn_bf16({N, c.Hk, c.dk});
  ops::l2norm_inplace(q, 1e-6f);
  ops::l2norm_inplace(k, 1e-6f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.dk));
  for (int64_t i = 0; i < q.numel(); ++i) q.data<float>()[i] *= scale;
  q = q.to_dtype(DType::BF16).to_dtype(DType::F32);
  k = k.to_dtype(DType::BF16).to_dtype(DType::F32);
  // v: a strided view, the columns [off, off + Hv*dv) of rows of ldv.
  const int64_t off = 8, ldv = c.Hv * c.dv + 24;
  const Tensor vw = randn_bf16({N, ldv});
  const Tensor v = vw.slice(1, off, off + c.Hv * c.dv).contiguous().view({N, c.Hv, c.dv});
  const Tensor g = rand_uniform({N, c.Hv}, -0.4f, -0.001f);
  const Tensor beta = rand_uniform({N, c.Hv}, 0.02f, 0.98f);
  Tensor init;
  if (c.init) {
    init = Tensor::empty({S, c.Hv, c.dk, c.dv}, DType::F32);
    fill_normal(init, {2024, g_stream++, 0}, 0.0f, 0.3f);
  }
  ops::DeltaRuleParams rp;
  rp.q = q;
  rp.k = k;
  rp.v = v;
  rp.g = g;
  rp.beta = beta;
  rp.initial_state = init;
  rp.scale = 1.0f;
  rp.l2norm_qk = false;
  Tensor out_ref = cpu_out({N, c.Hv, c.dv}), state_ref = cpu_out({S, c.Hv, c.dk, c.dv});
  ops::gated_delta_rule(rp, seqs, ops::DeltaRuleAlgo::Recurrent, out_ref, &state_ref);

  const Tensor qd = to_gpu_bf16(q), kd = to_gpu_bf16(k), vd = to_gpu_bf16(vw), gd = to_gpu(g), bd = to_gpu(beta);
  const Tensor cu = cu_seqlens_gpu(seqs);
  Tensor init_d;
  if (c.init) init_d = to_gpu(init);
  for (int rows : rows_variants) {
    Knob knob(cuda::tuning::recurrent_rows_per_thread, rows);
    Tensor out = gpu_out({N, c.Hv, c.dv}, DType::BF16), state = gpu_out({S, c.Hv, c.dk, c.dv}, DType::F32);
    cuda::DeltaRuleParams p;
    p.q = qd.raw_data();
    p.k = kd.raw_data();
    p.v = at_bf16(vd, off);
    p.ldv = ldv;
    p.g = gd.data<float>();
    p.beta = bd.data<float>();
    p.initial_state = c.init ? init_d.data<float>() : nullptr;
    p.final_state = state.data<float>();
    p.out = out.raw_data();
    p.cu_seqlens = i32(cu);
    p.num_seqs = S;
    p.N = N;
    p.Hk = c.Hk;
    p.Hv = c.Hv;
    p.dk = c.dk;
    p.dv = c.dv;
    cuda::recurrent_gated_delta_rule(p, stream0());
    const double eo = max_rel_err(out, out_ref), es = max_rel_err(state, state_ref);
    const std::string what = "Hk " + std::to_string(c.Hk) + " Hv " + std::to_string(c.Hv) + " dk " +
                             std::to_string(c.dk) + " dv " + std::to_string(c.dv) + " seqs " + lens_str(c.lens) +
                             (c.init ? " init" : "") + " rows/thread " + std::to_string(rows);
    EXPECT_LT(eo, 2e-2) << "out " << what;
    EXPECT_LT(es, 1e-3) << "final state " << what;
    *worst_out = std::max(*worst_out, eo);
    *worst_state = std::max(*worst_state, es);
  }
}

}  // namespace

TEST(CudaGdn, RecurrentDeltaRuleMatchesCpu) {
  DFLASH_REQUIRE_GPU();
  double wo = 0, ws = 0;
  const std::vector<int> all = {0, 8, 16, 32};
  for (bool init : {false, true}) {
    check_recurrent({16, 48, 128, 128, {65}, init}, all, &wo, &ws);  // the real shape
    check_recurrent({1, 1, 16, 24, {1}, init}, all, &wo, &ws);
    check_recurrent({2, 4, 16, 24, {63, 64, 65}, init}, all, &wo, &ws);
    check_recurrent({1, 3, 16, 24, {130, 1, 7}, init}, all, &wo, &ws);
    check_recurrent({2, 2, 20, 24, {70}, init}, all, &wo, &ws);    // dk % 8 != 0: scalar staging
    check_recurrent({1, 2, 256, 64, {33, 9}, init}, all, &wo, &ws);
    check_recurrent({1, 1, 100, 7, {150}, init}, all, &wo, &ws);  // ragged dk, odd dv
  }
  check_recurrent({1, 1, 1024, 8, {12}, true}, {0}, &wo, &ws);  // the largest dk supported
  check_recurrent({2, 2, 64, 64, {0, 5, 0}, true}, {0}, &wo, &ws);  // empty sequences keep their state
  std::printf("recurrent_gated_delta_rule: worst normalised error vs CPU: out %.3g, final state %.3g\n", wo, ws);
}

TEST(CudaGdn, RecurrentDeltaRuleRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  const Tensor cu = cu_seqlens_gpu(offsets_of({0}));  // N = 0: the kernel only writes (no) state
  cuda::DeltaRuleParams p;
  p.cu_seqlens = i32(cu);
  p.num_seqs = 1;
  p.N = 0;
  p.Hk = 2;
  p.Hv = 6;
  p.dk = 16;
  p.dv = 16;
  p.ldv = 96;
  EXPECT_NO_THROW(cuda::recurrent_gated_delta_rule(p, stream0()));
  auto throws = [&](auto mutate) {
    cuda::DeltaRuleParams q = p;
    mutate(q);
    EXPECT_THROW(cuda::recurrent_gated_delta_rule(q, stream0()), Error);
  };
  throws([](cuda::DeltaRuleParams& q) { q.Hv = 5; });      // not a multiple of Hk
  throws([](cuda::DeltaRuleParams& q) { q.dk = 2048; });   // above the supported dk
  throws([](cuda::DeltaRuleParams& q) { q.ldv = 95; });    // ldv < Hv*dv
  throws([](cuda::DeltaRuleParams& q) { q.num_seqs = 0; });
  throws([](cuda::DeltaRuleParams& q) { q.N = 4; });       // null q/k/v/... pointers
  DeviceContext::get(0).synchronize();
}

// ---- timings (print only) ------------------------------------------------------------------------
namespace {

// Median of `iters` event-timed launches after `warm` warm-up launches, in ms.
template <typename F>
float time_ms(F&& launch, int warm, int iters) {
  auto st = static_cast<cudaStream_t>(stream0());
  for (int i = 0; i < warm; ++i) launch();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(a, st);
    launch();
    cudaEventRecord(b, st);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

TEST(CudaGdn, TimingsPrintOnly) {
  DFLASH_REQUIRE_GPU();
  // The in-projection output row of Qwen3.6-27B: [q 2048 | k 2048 | v 6144 | z 6144 | b 48 | a 48].
  const int64_t N = 8192, C = 10240, K = 4, ld_in = 10240 + 6144 + 48 + 48, Hk = 16, Hv = 48, d = 128;
  const ops::SeqOffsets seqs = offsets_of({N});
  const Tensor cu = cu_seqlens_gpu(seqs);
  Tensor xin = Tensor::empty({N, ld_in}, DType::BF16, Device::cuda(0));
  cuda::fill_normal(xin, {2024, g_stream++, 0}, 0.0f, 1.0f);
  Tensor w = Tensor::empty({C, K}, DType::BF16, Device::cuda(0));
  cuda::fill_normal(w, {2024, g_stream++, 0}, 0.0f, 0.5f);
  Tensor y = Tensor::empty({N, C}, DType::BF16, Device::cuda(0));
  cuda::ConvParams p = conv_params(xin.raw_data(), ld_in, w, cu, 1, N, C, K);
  p.y = y.raw_data();
  const double bytes = 2.0 * N * C * 2;
  std::printf("causal_conv1d T=%lld C=%lld K=%lld (roofline %.1f MB, 0.080 ms at 4.2 TB/s):\n",
              static_cast<long long>(N), static_cast<long long>(C), static_cast<long long>(K), bytes / 1e6);
  for (int R : {0, 32, 64, 96, 128, 160, 192, 256}) {
    Knob knob(cuda::tuning::conv_tokens_per_thread, R);
    const float ms = time_ms([&] { cuda::causal_conv1d_fast(p, stream0()); }, 5, 30);
    std::printf("  fast  R=%-4s %8.4f ms  %7.1f GB/s\n", R ? std::to_string(R).c_str() : "auto", ms,
                bytes / (ms * 1e-3) / 1e9);
  }
  {
    const float ms = time_ms([&] { cuda::causal_conv1d_fallback(p, stream0()); }, 2, 10);
    std::printf("  fallback    %8.4f ms  %7.1f GB/s\n", ms, bytes / (ms * 1e-3) / 1e9);
  }
  {  // The ceiling: a device-to-device copy of the same N·C·2 bytes (read + write counted).
    Tensor dst = Tensor::empty({N, C}, DType::BF16, Device::cuda(0));
    const float ms = time_ms(
        [&] {
          cudaMemcpyAsync(dst.raw_data(), y.raw_data(), static_cast<size_t>(N * C * 2), cudaMemcpyDeviceToDevice,
                          static_cast<cudaStream_t>(stream0()));
        },
        3, 30);
    std::printf("  d2d copy    %8.4f ms  %7.1f GB/s (ceiling)\n", ms, bytes / (ms * 1e-3) / 1e9);
  }

  // gdn_prep on the conv output, and the recurrent rule on its q/k.
  Tensor q = Tensor::empty({N, Hk, d}, DType::BF16, Device::cuda(0)), k = q.clone();
  Tensor g = Tensor::empty({N, Hv}, DType::F32, Device::cuda(0)), beta = g.clone();
  Tensor A_log = Tensor::empty({Hv}, DType::BF16, Device::cuda(0)), dt = A_log.clone();
  cuda::fill_normal(A_log, {2024, g_stream++, 0}, 0.0f, 0.5f);
  cuda::fill_normal(dt, {2024, g_stream++, 0}, 0.0f, 0.5f);
  cuda::GdnPrepParams pp;
  pp.conv = y.raw_data();
  pp.ld_conv = C;
  pp.a = at_bf16(xin, ld_in - 48);
  pp.b = at_bf16(xin, ld_in - 96);
  pp.ld_ab = ld_in;
  pp.A_log = A_log.raw_data();
  pp.dt_bias = dt.raw_data();
  pp.q = q.raw_data();
  pp.k = k.raw_data();
  pp.g = g.data<float>();
  pp.beta = beta.data<float>();
  pp.N = N;
  pp.Hk = Hk;
  pp.Hv = Hv;
  pp.dk = d;
  pp.scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int blocks : {0, 132, 264, 396, 528, 792}) {  // persistent grid (0: as many blocks as fit)
    Knob knob(cuda::tuning::prep_blocks, blocks);
    const float ms = time_ms([&] { cuda::gdn_prep(pp, stream0()); }, 3, 20);
    const double prep_bytes = N * (2.0 * Hk * d * 2 * 2 + Hv * (2 * 2 + 2 * 4));
    std::printf("gdn_prep T=%lld Hk=%lld Hv=%lld dk=%lld blocks %d: %.4f ms  %.1f GB/s\n", static_cast<long long>(N),
                static_cast<long long>(Hk), static_cast<long long>(Hv), static_cast<long long>(d), blocks, ms,
                prep_bytes / (ms * 1e-3) / 1e9);
  }
  Tensor out = Tensor::empty({N, Hv, d}, DType::BF16, Device::cuda(0));
  Tensor state = Tensor::empty({1, Hv, d, d}, DType::F32, Device::cuda(0));
  cuda::DeltaRuleParams rp;
  rp.q = q.raw_data();
  rp.k = k.raw_data();
  rp.v = at_bf16(y, 2 * Hk * d);
  rp.ldv = C;
  rp.g = g.data<float>();
  rp.beta = beta.data<float>();
  rp.final_state = state.data<float>();
  rp.out = out.raw_data();
  rp.cu_seqlens = i32(cu);
  rp.num_seqs = 1;
  rp.N = N;
  rp.Hk = Hk;
  rp.Hv = Hv;
  rp.dk = d;
  rp.dv = d;
  for (int rows : {0, 8, 16, 32}) {
    Knob knob(cuda::tuning::recurrent_rows_per_thread, rows);
    const float ms = time_ms([&] { cuda::recurrent_gated_delta_rule(rp, stream0()); }, 1, 5);
    std::printf("recurrent_gated_delta_rule T=%lld Hk=%lld Hv=%lld d=%lld rows/thread %-4s: %.3f ms (%.1f us/token)\n",
                static_cast<long long>(N), static_cast<long long>(Hk), static_cast<long long>(Hv),
                static_cast<long long>(d), rows ? std::to_string(rows).c_str() : "auto", ms, ms * 1e3 / N);
  }
  // Several sequences at once (8 x 1024 tokens) fill more of the GPU.
  {
    std::vector<int64_t> lens(8, 1024);
    const Tensor cu8 = cu_seqlens_gpu(offsets_of(lens));
    Tensor state8 = Tensor::empty({8, Hv, d, d}, DType::F32, Device::cuda(0));
    cuda::DeltaRuleParams r8 = rp;
    r8.cu_seqlens = i32(cu8);
    r8.num_seqs = 8;
    r8.final_state = state8.data<float>();
    const float ms = time_ms([&] { cuda::recurrent_gated_delta_rule(r8, stream0()); }, 1, 5);
    std::printf("recurrent_gated_delta_rule 8 x 1024 tokens Hv=%lld d=%lld: %.3f ms\n", static_cast<long long>(Hv),
                static_cast<long long>(d), ms);
  }
  DeviceContext::get(0).synchronize();
}
