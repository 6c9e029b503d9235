// CUDA fused linear cross-entropy (loss.h: linear_ce) against the CPU oracle
// drafter::fused_linear_ce, computed in double on the same bf16-rounded hidden states and lm_head.
// Fresh random inputs per case; ce / argmax / dhidden are poisoned (NaN / sentinel) before every run.
//
// Bounds (why they hold for a correct kernel, and what a wrong one gives):
//   ce per row: |got − ref| <= 2e-4 (absolute, logits of magnitude <~ 20). The logits are fp32
//     GEMM outputs (fp32 accumulation of exact bf16 products): error ~1e-6 per logit, so lse and
//     ce move by ~1e-5. A wrong row, label or max shows up at >= 1e-1.
//   Σ w·ce: relative 1e-5 of the oracle's weighted sum.
//   argmax: equal to the oracle's, except where the two logits are within 1e-4 (a near tie that
//     fp32 rounding may break either way); an exact tie must give the lowest id.
//   dhidden: max_rel_err <= 1e-2. The logit gradient is stored as bf16 (relative 2^-9 per element)
//     before the fp32 dhidden GEMM; the normalised error of a correct kernel is ~1e-3 (printed), a
//     missing weight / scale / onehot term is >= 1e-1. Rows of weight 0 must be exactly 0.
//   chunk_rows independence: two chunk sizes agree to 1e-5 in ce (absolute) and 1e-4 in dhidden
//     (cuBLASLt may pick another algorithm for another n: fp32 reassociation of the logits, which
//     can flip the bf16 rounding of a few gradient elements); argmax equal.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "drafter/fp8_cuda.h"
#include "drafter/loss.h"
#include "kernels/cpu/train_ops.h"
#include "kernels/cuda/loss.h"
#include "core/device.h"
#include "core/random.h"
#include "test_util.h"

using namespace dflash;
namespace cu = dflash::cuda;

namespace {

constexpr double kCeAbs = 2e-4;
constexpr double kCeSumRel = 1e-5;
constexpr double kTieGap = 1e-4;
constexpr double kDhidden = 1e-2;
constexpr double kChunkCe = 1e-5;
constexpr double kChunkDh = 1e-4;

uint64_t g_stream = 7100;  // a fresh RNG stream for every drawn tensor

struct Inputs {
  int64_t R = 0, H = 0, V = 0;
  Tensor hidden_dev, lm_dev, labels_dev, weights_dev;  // bf16, bf16, i32, f32 on cuda:0
  Tensor lm_host;                                      // bf16 [V, H] on the host
  std::vector<double> hidden;                          // the bf16 values as doubles [R, H]
  std::vector<int32_t> labels;
  std::vector<double> weights;  // the f32 values as doubles
};

// Hidden ~ N(0, 1), lm_head ~ N(0, 2/sqrt(H)) (logits ~ N(0, 2)); labels random with row 0 -> 0
// and row 1 -> V−1; every 5th row (from row 3) has weight 0, the rest U(0.05, 1). When V > 17,
// lm_head row 17 is a copy of row 5 and hidden row 2 = sign(lm_head[5]): logits 5 and 17 are an
// exact tie far above the rest, so argmax[2] must be 5.
Inputs make_inputs(int64_t R, int64_t H, int64_t V) {
  Inputs in;
  in.R = R;
  in.H = H;
  in.V = V;
  Tensor h = Tensor::empty({R, H}, DType::F32), w = Tensor::empty({V, H}, DType::F32);
  fill_normal(h, {4243, g_stream++, 0}, 0.0f, 1.0f);
  fill_normal(w, {4243, g_stream++, 0}, 0.0f, 2.0f / std::sqrt(static_cast<float>(H)));
  if (V > 17 && R > 2) {
    float* wp = w.data<float>();
    float* hp = h.data<float>();
    for (int64_t c = 0; c < H; ++c) {
      wp[17 * H + c] = wp[5 * H + c];
      hp[2 * H + c] = wp[5 * H + c] >= 0 ? 1.0f : -1.0f;
    }
  }
  Tensor hb = h.to_dtype(DType::BF16);
  in.lm_host = w.to_dtype(DType::BF16);
  in.hidden = to_doubles(hb);
  in.hidden_dev = hb.to(Device::cuda(0));
  in.lm_dev = in.lm_host.to(Device::cuda(0));

  Tensor lab = Tensor::empty({R}, DType::F32), wt = Tensor::empty({R}, DType::F32);
  fill_uniform(lab, {4243, g_stream++, 0}, 0.0f, 1.0f);
  fill_uniform(wt, {4243, g_stream++, 0}, 0.05f, 1.0f);
  in.labels.resize(static_cast<size_t>(R));
  std::vector<float> wf(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    in.labels[r] = std::min<int32_t>(static_cast<int32_t>(lab.data<float>()[r] * static_cast<float>(V)),
                                     static_cast<int32_t>(V - 1));
    wf[r] = (r % 5 == 3) ? 0.0f : wt.data<float>()[r];
  }
  in.labels[0] = 0;
  if (R > 1) in.labels[1] = static_cast<int32_t>(V - 1);
  in.weights.assign(wf.begin(), wf.end());
  in.labels_dev = Tensor::from_blob(in.labels.data(), {R}, DType::I32).to(Device::cuda(0));
  in.weights_dev = Tensor::from_blob(wf.data(), {R}, DType::F32).to(Device::cuda(0));
  return in;
}

struct Out {
  std::vector<double> ce;
  std::vector<int32_t> argmax;
  Tensor dhidden;  // f32 host [R, H]; undefined when run without the gradient
};

// fp8: the FP8 form with these head codes.
Out run_gpu(const Inputs& in, int64_t chunk_rows, float grad_scale, bool with_grad,
            const drafter::Fp8LmHead* fp8 = nullptr) {
  Tensor ce = Tensor::empty({in.R}, DType::F32, Device::cuda(0));
  Tensor am = Tensor::empty({in.R}, DType::I32, Device::cuda(0));
  Tensor dh;
  poison(ce);
  poison(am);
  if (with_grad) {
    dh = Tensor::empty({in.R, in.H}, DType::F32, Device::cuda(0));
    poison(dh);
  }
  cu::LinearCeParams p;
  p.hidden = in.hidden_dev.raw_data();
  p.lm_head = in.lm_dev.raw_data();
  p.labels = in.labels_dev.data<int32_t>();
  p.weights = in.weights_dev.data<float>();
  p.R = in.R;
  p.H = in.H;
  p.V = in.V;
  p.chunk_rows = chunk_rows;
  p.grad_scale = grad_scale;
  p.ce = ce.data<float>();
  p.argmax = am.data<int32_t>();
  p.dhidden = with_grad ? dh.data<float>() : nullptr;
  if (fp8) fp8->fill(p);
  Tensor ws = Tensor::empty({cu::linear_ce_workspace(p)}, DType::U8, Device::cuda(0));
  poison(ws);
  p.workspace = ws.raw_data();
  cu::linear_ce(p, 0);
  DeviceContext::get(0).synchronize();
  Out o;
  o.ce = to_doubles(ce);
  Tensor amh = am.to(Device::cpu());
  o.argmax.assign(amh.data<int32_t>(), amh.data<int32_t>() + in.R);
  if (with_grad) o.dhidden = dh.to(Device::cpu());
  return o;
}

// max |a − b| over two equally long vectors; +inf when either holds a NaN.
double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    m = std::max(m, std::abs(a[i] - b[i]));
  }
  return m;
}

// logit of row r, id v in double (for judging near ties).
double logit(const Inputs& in, int64_t r, int64_t v) {
  std::vector<double> w(static_cast<size_t>(in.H));
  convert_elements(static_cast<const uint16_t*>(in.lm_host.raw_data()) + v * in.H, DType::BF16, w.data(), DType::F64,
                   in.H);
  double s = 0;
  for (int64_t c = 0; c < in.H; ++c) s += in.hidden[r * in.H + c] * w[c];
  return s;
}

void check_case(int64_t R, int64_t H, int64_t V, int64_t chunk, int64_t chunk2, float grad_scale) {
  SCOPED_TRACE("R=" + std::to_string(R) + " H=" + std::to_string(H) + " V=" + std::to_string(V) +
               " chunk_rows=" + std::to_string(chunk) + "/" + std::to_string(chunk2) +
               " grad_scale=" + std::to_string(grad_scale));
  const Inputs in = make_inputs(R, H, V);

  // Oracle, per row (weight 1: ce and argmax of every row, weight-0 rows included) ...
  std::vector<double> ce_ref(static_cast<size_t>(R));
  std::vector<int32_t> am_ref(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    std::vector<int32_t> am;
    ce_ref[r] = drafter::fused_linear_ce(&in.hidden[r * H], 1, H, in.lm_host, {in.labels[r]}, {1.0}, 1, 1.0, nullptr,
                                         &am)
                    .weighted_ce_sum;
    am_ref[r] = am[0];
  }
  // ... and over all rows with the weights and grad_scale (dhidden is added into zeros).
  Tensor dh_ref = Tensor::zeros({R, H}, DType::F64);
  const drafter::CeSums sums = drafter::fused_linear_ce(in.hidden.data(), R, H, in.lm_host, in.labels, in.weights,
                                                        chunk, grad_scale, dh_ref.data<double>(), nullptr);

  const Out got = run_gpu(in, chunk, grad_scale, true);
  const double ce_err = max_abs_diff(got.ce, ce_ref);
  double wsum = 0;
  for (int64_t r = 0; r < R; ++r) {
    wsum += in.weights[r] * got.ce[r];
    const int32_t a = got.argmax[r];
    ASSERT_TRUE(a >= 0 && a < V) << "argmax of row " << r << " is " << a;
    if (a != am_ref[r]) {
      EXPECT_LE(std::abs(logit(in, r, a) - logit(in, r, am_ref[r])), kTieGap)
          << "row " << r << ": argmax " << a << ", oracle " << am_ref[r];
    }
  }
  if (V > 17 && R > 2) {
    EXPECT_EQ(got.argmax[2], 5) << "exact tie of ids 5 and 17: the lowest id wins";
  }
  const double sum_err = std::abs(wsum - sums.weighted_ce_sum) / std::max(std::abs(sums.weighted_ce_sum), 1e-30);
  const double dh_err = max_rel_err(got.dhidden, dh_ref);
  std::printf("  R=%lld H=%lld V=%lld chunk=%lld: ce max abs err %.3g, sum(w ce) rel err %.3g, dhidden err %.3g\n",
              static_cast<long long>(R), static_cast<long long>(H), static_cast<long long>(V),
              static_cast<long long>(chunk), ce_err, sum_err, dh_err);
  EXPECT_LE(ce_err, kCeAbs);
  EXPECT_LE(sum_err, kCeSumRel);
  EXPECT_LE(dh_err, kDhidden);
  int64_t nonzero = 0;
  const float* dh = got.dhidden.data<float>();
  for (int64_t r = 0; r < R; ++r)
    if (in.weights[r] == 0)
      for (int64_t c = 0; c < H; ++c) nonzero += dh[r * H + c] != 0.0f;
  EXPECT_EQ(nonzero, 0) << "rows with weight 0 must get dhidden exactly 0";

  // Without dhidden: the same ce and argmax (the same logits and row statistics), nothing else.
  const Out fwd = run_gpu(in, chunk, grad_scale, false);
  EXPECT_LE(max_abs_diff(fwd.ce, got.ce), 1e-6) << "ce without dhidden differs (NaN: not written)";
  EXPECT_EQ(fwd.argmax, got.argmax);

  // Another chunk size: equal within fp32 rounding.
  const Out other = run_gpu(in, chunk2, grad_scale, true);
  const double chunk_ce = max_abs_diff(other.ce, got.ce);
  const double chunk_dh = max_rel_err(other.dhidden, got.dhidden);
  std::printf("  chunk %lld vs %lld: ce max abs diff %.3g, dhidden rel diff %.3g\n", static_cast<long long>(chunk),
              static_cast<long long>(chunk2), chunk_ce, chunk_dh);
  EXPECT_LE(chunk_ce, kChunkCe);
  EXPECT_LE(chunk_dh, kChunkDh);
  EXPECT_EQ(other.argmax, got.argmax);
}

}  // namespace

// One oracle check per shape (R, H, V, chunk_rows, the other chunk_rows, grad_scale).
struct CeShape {
  const char* name;
  int64_t R, H, V, chunk, chunk2;
  float grad_scale;
};
class CudaLinearCeShape : public ::testing::TestWithParam<CeShape> {};

TEST_P(CudaLinearCeShape, MatchesOracle) {
  DFLASH_REQUIRE_GPU();
  const CeShape& c = GetParam();
  check_case(c.R, c.H, c.V, c.chunk, c.chunk2, c.grad_scale);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaLinearCeShape,
    ::testing::Values(
        // R not a multiple of chunk_rows, odd V (rows padded to 1008 in the workspace), grad_scale != 1.
        CeShape{"OddVocabPartialChunk", 50, 64, 1001, 16, 7, 0.37f},
        // chunk_rows > R (one partial chunk), V % 8 == 3.
        CeShape{"ChunkLargerThanRows", 19, 128, 4099, 64, 5, 1.0f},
        // V a multiple of 8, several chunks, grad_scale 2.
        CeShape{"AlignedVocabManyChunks", 130, 256, 2048, 32, 130, 2.0f},
        // V below one float4 (scalar tail only) and a single row.
        CeShape{"TinyVocab", 1, 8, 3, 4, 1, 1.5f}),
    [](const ::testing::TestParamInfo<CeShape>& i) { return std::string(i.param.name); });

TEST(CudaLinearCe, Workspace) {
  // fp32 logits + bf16 gradient of chunk_rows padded rows.
  EXPECT_GE(cu::linear_ce_workspace(16, 1001), 16 * 1001 * 6);
  EXPECT_GE(cu::linear_ce_workspace(1024, 248320), int64_t{1024} * 248320 * 6);
  EXPECT_NE(error_of([] { cu::linear_ce_workspace(0, 10); }).find("linear_ce_workspace"), std::string::npos);
}

// Size checks run before anything touches a device (no GPU needed).
TEST(CudaLinearCe, RejectsBadSizes) {
  alignas(16) static char buf[64];
  cu::LinearCeParams p;
  p.hidden = p.lm_head = p.workspace = buf;
  p.labels = reinterpret_cast<const int32_t*>(buf);
  p.weights = reinterpret_cast<const float*>(buf);
  p.ce = reinterpret_cast<float*>(buf);
  p.argmax = reinterpret_cast<int32_t*>(buf);
  p.R = 4;
  p.H = 60;  // not a multiple of 8
  p.V = 100;
  p.chunk_rows = 2;
  std::string e = error_of([&] { cu::linear_ce(p, 0); });
  EXPECT_NE(e.find("linear_ce: hidden size H=60 must be a multiple of 8"), std::string::npos) << e;
  p.H = 64;
  p.chunk_rows = 0;
  e = error_of([&] { cu::linear_ce(p, 0); });
  EXPECT_NE(e.find("linear_ce: need R >= 0"), std::string::npos) << e;
  p.chunk_rows = 2;
  p.hidden = nullptr;
  e = error_of([&] { cu::linear_ce(p, 0); });
  EXPECT_NE(e.find("linear_ce: null pointer"), std::string::npos) << e;
  p.R = 0;  // no rows: a no-op, pointers not needed
  EXPECT_EQ(error_of([&] { cu::linear_ce(p, 0); }), "");
}

// The FP8 form (LinearCeParams' FP8 fields, drafter::Fp8LmHead's codes) against the CPU's simulation of
// it (cpu::fused_linear_ce_f32 with fp8 on the head rounded in its 128 x 128 tiles): both round the
// same bf16 hidden rows and head to the same e4m3 values (the tile quantizers are bit for bit the
// CPU's), so their logits differ only by the GEMMs' accumulation (cuBLASLt sums each 128-deep block of
// FP8 products in less than fp32: ~2e-3 of the largest logit, CudaFp8.TrainingGemmFormsMatchTheirReference).
// Bounds: ce per row 3e-2 absolute (logits ~N(0, 2), largest ~8); argmax equal but for near ties (the
// reference's logits within 3e-2); dhidden max_rel_err 5e-2 (the gradient's codes are rounded from
// slightly different fp32 values on the two sides: an element near an e4m3 boundary moves by one
// step, 6-12% of itself); rows of weight 0 exactly 0. A wrong scale, tile or padding gives O(1).
// What FP8 itself does (the FP8 form against the exact double oracle) is printed and held loosely
// (mean |Δce| < 0.1). Shapes: V not a multiple of 16 (the head's padding rows / columns), chunks whose
// rows are not a multiple of 4 (the staged dhidden), one chunk larger than the rows.
TEST(CudaLinearCe, Fp8FormMatchesTheCpuFp8Simulation) {
  DFLASH_REQUIRE_GPU();
  struct Case {
    int64_t R, H, V, chunk;
    float grad_scale;
  };
  for (const Case& c : {Case{50, 256, 1001, 16, 0.37f}, Case{19, 128, 4099, 64, 1.0f}, Case{133, 512, 2048, 32, 2.0f}}) {
    SCOPED_TRACE(testing::Message() << "R=" << c.R << " H=" << c.H << " V=" << c.V << " chunk=" << c.chunk);
    const Inputs in = make_inputs(c.R, c.H, c.V);
    const drafter::Fp8LmHead head(in.lm_dev);
    const Out got = run_gpu(in, c.chunk, c.grad_scale, true, &head);

    // The CPU simulation: per row (weight 1) for ce / argmax, then all rows with the weights for dhidden.
    Tensor hf = Tensor::empty({c.R, c.H}, DType::F32);
    for (int64_t i = 0; i < c.R * c.H; ++i) hf.data<float>()[i] = static_cast<float>(in.hidden[i]);
    Tensor wq = in.lm_host.to_dtype(DType::F32);
    cpu::fake_quantize_e4m3(wq.data<float>(), c.V, c.H, 128, 128);
    std::vector<double> ce_ref(static_cast<size_t>(c.R)), ce_exact(static_cast<size_t>(c.R));
    std::vector<int32_t> am_ref(static_cast<size_t>(c.R));
    for (int64_t r = 0; r < c.R; ++r) {
      std::vector<int32_t> am;
      ce_ref[r] = cpu::fused_linear_ce_f32(hf.data<float>() + r * c.H, 1, c.H, wq, {in.labels[r]}, {1.0}, 1, 1.0, nullptr,
                                           &am, true)
                      .weighted_ce_sum;
      am_ref[r] = am[0];
      ce_exact[r] = drafter::fused_linear_ce(&in.hidden[r * c.H], 1, c.H, in.lm_host, {in.labels[r]}, {1.0}, 1, 1.0,
                                             nullptr, nullptr)
                        .weighted_ce_sum;
    }
    Tensor dh_ref = Tensor::zeros({c.R, c.H}, DType::F32);
    cpu::fused_linear_ce_f32(hf.data<float>(), c.R, c.H, wq, in.labels, in.weights, c.chunk, c.grad_scale,
                             dh_ref.data<float>(), nullptr, true);
    const double ce_err = max_abs_diff(got.ce, ce_ref);
    double fp8_effect = 0;
    for (int64_t r = 0; r < c.R; ++r) fp8_effect += std::abs(got.ce[r] - ce_exact[r]) / static_cast<double>(c.R);
    int64_t far_ties = 0;
    for (int64_t r = 0; r < c.R; ++r) {
      if (got.argmax[r] == am_ref[r]) continue;
      // the reference's own (simulated FP8) logits of the two ids
      auto zq = [&](int64_t v) {
        double s = 0;
        std::vector<float> x(hf.data<float>() + r * c.H, hf.data<float>() + (r + 1) * c.H);
        cpu::fake_quantize_e4m3(x.data(), 1, c.H, 1, 128);
        for (int64_t k = 0; k < c.H; ++k) s += static_cast<double>(x[k]) * wq.data<float>()[v * c.H + k];
        return s;
      };
      ASSERT_TRUE(got.argmax[r] >= 0 && got.argmax[r] < c.V) << "row " << r;
      far_ties += std::abs(zq(got.argmax[r]) - zq(am_ref[r])) > 3e-2;
    }
    const double dh_err = max_rel_err(got.dhidden, dh_ref);
    int64_t nonzero = 0;
    for (int64_t r = 0; r < c.R; ++r)
      if (in.weights[r] == 0)
        for (int64_t k = 0; k < c.H; ++k) nonzero += got.dhidden.data<float>()[r * c.H + k] != 0.0f;
    std::printf("  fp8 R=%lld H=%lld V=%lld chunk=%lld: ce max abs err vs the CPU simulation %.3g, dhidden err %.3g; "
                "mean |ce(fp8) - ce(exact)| %.3g\n",
                static_cast<long long>(c.R), static_cast<long long>(c.H), static_cast<long long>(c.V),
                static_cast<long long>(c.chunk), ce_err, dh_err, fp8_effect);
    EXPECT_LE(ce_err, 3e-2);
    EXPECT_EQ(far_ties, 0) << "argmax differs from the simulation's beyond a near tie";
    EXPECT_LE(dh_err, 5e-2);
    EXPECT_EQ(nonzero, 0) << "rows with weight 0 must get dhidden exactly 0";
    EXPECT_GT(fp8_effect, 0.0) << "the FP8 form gives the exact ce: not quantized?";
    EXPECT_LT(fp8_effect, 0.1);
    // Without dhidden: the same ce and argmax.
    const Out fwd = run_gpu(in, c.chunk, c.grad_scale, false, &head);
    EXPECT_LE(max_abs_diff(fwd.ce, got.ce), 1e-6);
    EXPECT_EQ(fwd.argmax, got.argmax);
  }
}
