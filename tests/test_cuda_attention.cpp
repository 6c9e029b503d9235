// CUDA causal attention (flash_attention_fwd with each of its kernels: the mma.sync one and, on an
// sm_90 GPU, the wgmma one; attention_fallback) against the CPU reference ops::causal_attention,
// from the op-case table (kernels/cases/attention_cases.h). Inputs are bf16 drawn on the GPU (the
// reference gets the same values in f32). Outputs are poisoned (NaN) before every launch.
//
// Error bound (AttentionCase::out_bound): max|out - ref| / max|ref| < 1e-2. The output is stored in
// bf16 (relative rounding 2^-9 ≈ 2e-3 of an element, at most ~4e-3 of max|ref| after the
// averaging), and the flash kernel also rounds the probabilities P to bf16 before P·V (relative
// 2^-9 per term, partly averaging out); expected errors are ~2e-3 to 5e-3, the fallback (fp32 P)
// near the bf16 output rounding. The parameter checks (rejects) are written out here; last,
// print-only timings at the Qwen3.6-27B prefill shape.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "kernels/cases/attention_cases.h"
#include "core/cuda/check.h"
#include "core/device.h"
#include "tests/test_util.h"

using namespace dflash;
using AttentionVariant = cases::Variant<cuda::AttentionParams>;

namespace {

cuda::Stream stream0() { return DeviceContext::get(0).stream(); }
Tensor poisoned_out(const cases::AttentionCase& c) { return cases::poisoned({c.N(), c.Hq, c.d}, DType::BF16, Device::cuda(0)); }
bool wgmma_runs(int64_t d) { return cuda::flash_attention_wgmma_available(d, 0); }

uint64_t g_seed = 7001;  // each case drawn from its own seed

// Runs every variant that takes the case's head dim here (cases::attention_variants) on it, checks
// each against the reference, prints the errors; `worst` collects the largest per variant.
void check_case(const cases::AttentionCase& c, std::map<std::string, double>* worst = nullptr) {
  SCOPED_TRACE(c.describe());
  const cases::AttentionData data = cases::draw(c, g_seed++);
  const Tensor ref = data.reference(c);
  std::string line = "  " + c.describe() + ":";
  for (const AttentionVariant* v : cases::attention_variants(c.d)) {
    Tensor out = poisoned_out(c);
    v->launch(data.params(c, out.raw_data()), stream0());
    const double err = max_rel_err(out, ref);
    char e[32];
    std::snprintf(e, sizeof e, " %.3g", err);
    line += std::string(" ") + v->name + e;
    EXPECT_LT(err, c.out_bound) << v->name;
    if (worst) (*worst)[v->name] = std::max((*worst)[v->name], err);
  }
  std::printf("%s\n", line.c_str());
}

void check_cases(const std::vector<cases::AttentionCase>& cs) {
  for (const cases::AttentionCase& c : cs) check_case(c);
}

// Every head ratio (1, 2, 3, 6) x sequence set at head dim d, each kernel that runs d here: the
// mma.sync flash kernel always, the wgmma one on sm_90 (d 128, 256), the default choice, and the fallback.
void sweep(int64_t d) {
  std::map<std::string, double> worst;
  for (const cases::AttentionCase& c : cases::attention_sweep_cases(d)) check_case(c, &worst);
  std::printf("d=%lld worst normalized error: flash %.3g, mma.sync %.3g, wgmma %s%.3g, fallback %.3g (bound %.0e)\n",
              static_cast<long long>(d), worst["flash"], worst["mma_sync"], wgmma_runs(d) ? "" : "(not run) ",
              worst["wgmma"], worst["fallback"], cases::AttentionCase::out_bound);
}

}  // namespace

TEST(CudaAttention, FlashAndFallbackD64) {
  DFLASH_REQUIRE_GPU();
  sweep(64);
}

TEST(CudaAttention, FlashAndFallbackD128) {
  DFLASH_REQUIRE_GPU();
  sweep(128);
}

TEST(CudaAttention, FlashAndFallbackD256) {
  DFLASH_REQUIRE_GPU();
  sweep(256);
}

// Peaky softmax (logits with stddev ~8 and ~24): the running max must be subtracted correctly.
TEST(CudaAttention, PeakySoftmax) {
  DFLASH_REQUIRE_GPU();
  check_cases(cases::attention_peaky_cases());
}

// Head dims the flash kernel does not instantiate (40, 96, 1, 33): the fallback covers any d.
TEST(CudaAttention, FallbackOddHeadDims) {
  DFLASH_REQUIRE_GPU();
  for (const cases::AttentionCase& c : cases::attention_odd_dim_cases())
    ASSERT_EQ(cases::attention_variants(c.d).size(), 1u) << "d=" << c.d << ": only the fallback takes it";
  check_cases(cases::attention_odd_dim_cases());
}

// One long sequence (32 key tiles per query block at the end) and a long packed batch.
TEST(CudaAttention, LongSequences) {
  DFLASH_REQUIRE_GPU();
  check_cases(cases::attention_long_cases());
}

TEST(CudaAttention, SupportedHeadDims) {
  DFLASH_REQUIRE_GPU();
  for (int64_t d : {64, 128, 256}) {
    EXPECT_TRUE(cuda::flash_attention_supported(d, 9));
    EXPECT_TRUE(cuda::flash_attention_supported(d, 8));
    EXPECT_FALSE(cuda::flash_attention_supported(d, 7));
  }
  for (int64_t d : {1, 32, 40, 96, 80, 192, 512}) EXPECT_FALSE(cuda::flash_attention_supported(d, 9));
}

// k and v read in place from the columns of a wider row (as in the model's fused q|k|v
// projection): row stride 2·Hkv·d + 24 elements, k at column offset 8, v after it, the rest NaN.
TEST(CudaAttention, StridedKeysValues) {
  DFLASH_REQUIRE_GPU();
  check_cases(cases::attention_strided_cases());
}

// On an sm_90 GPU (the H200) the wgmma kernel must be there and be what the model runs: a build
// that lost its sm_90a code would otherwise fall back to mma.sync without a word.
TEST(CudaAttention, WgmmaOnSm90) {
  DFLASH_REQUIRE_GPU();
  int major = 0, minor = 0;
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
  const bool sm90 = major == 9 && minor == 0;
  for (int64_t d : {128, 256}) {
    EXPECT_EQ(cuda::flash_attention_wgmma_available(d, 0), sm90) << "d=" << d;
    EXPECT_STREQ(cuda::flash_attention_kernel_name(d, 0), sm90 ? "wgmma sm_90a" : "mma.sync") << "d=" << d;
  }
  EXPECT_FALSE(cuda::flash_attention_wgmma_available(64, 0));
  EXPECT_STREQ(cuda::flash_attention_kernel_name(64, 0), "mma.sync");
  if (!sm90) {  // forcing it where it cannot run is an error, not a silent mma.sync run
    const cases::AttentionCase c{"", {5}, 2, 1, 128};
    const cases::AttentionData data = cases::draw(c, 1);
    Tensor out = poisoned_out(c);
    EXPECT_THROW(cases::kFlashWgmma.launch(data.params(c, out.raw_data()), stream0()), Error);
  }
}

TEST(CudaAttention, BadSizesThrow) {
  DFLASH_REQUIRE_GPU();
  const cases::AttentionCase c{"", {5, 3}, 6, 2, 64};
  const cases::AttentionData data = cases::draw(c, 2);
  Tensor out = poisoned_out(c);
  const cuda::AttentionParams p = data.params(c, out.raw_data());
  for (const AttentionVariant* v : {&cases::kFlash, &cases::kFlashMmaSync, &cases::kAttentionFallback}) {
    const auto rejects = throws_after_edit(p, [&](const cuda::AttentionParams& a) { v->launch(a, stream0()); });
    const std::string n = v->name;
    rejects([](cuda::AttentionParams& a) { a.Hkv = 4; }, n);  // 6 query heads do not divide into 4 kv heads
    rejects([](cuda::AttentionParams& a) { a.Hkv = 0; }, n);
    rejects([](cuda::AttentionParams& a) { a.scale = 0.0f; }, n);
    rejects([](cuda::AttentionParams& a) { a.num_seqs = 0; }, n);
    rejects([&](cuda::AttentionParams& a) { a.max_seqlen = c.N() + 1; }, n);
    rejects([](cuda::AttentionParams& a) { a.out = nullptr; }, n);
    rejects([&](cuda::AttentionParams& a) { a.ldk = c.Hkv * c.d - 8; }, n);  // a k row stride shorter than the row
  }
  for (int64_t d : {32, 96, 40, 512}) {
    cuda::AttentionParams a = p;
    a.d = d;
    EXPECT_THROW(cases::kFlash.launch(a, stream0()), Error) << "d=" << d;
  }
  cuda::AttentionParams a = p;
  a.q = static_cast<const char*>(a.q) + 2;  // misaligned for 16-byte loads
  EXPECT_THROW(cases::kFlash.launch(a, stream0()), Error);
  // N = 0 is a no-op for both.
  a = p;
  a.N = 0;
  a.max_seqlen = 0;
  EXPECT_NO_THROW(cases::kFlash.launch(a, stream0()));
  EXPECT_NO_THROW(cases::kAttentionFallback.launch(a, stream0()));
  DeviceContext::get(0).synchronize();
}

// Print-only timing of the Qwen3.6-27B prefill shape (T = 8192, Hq = 24, Hkv = 4, d = 256), plus
// the flash kernel at d = 128 and 64 and on a packed batch of short sequences; FLOPs from
// AttentionCase::flops() (the causal half of QKᵀ and PV). Also checks the kernels agree at this
// size (no CPU reference: it would take minutes).
TEST(CudaAttention, TimingPrintOnly) {
  DFLASH_REQUIRE_GPU();
  auto stream = static_cast<cudaStream_t>(stream0());
  cudaEvent_t start, stop;
  DFLASH_CUDA_CHECK(cudaEventCreate(&start));
  DFLASH_CUDA_CHECK(cudaEventCreate(&stop));
  auto time_ms = [&](const AttentionVariant& v, const cuda::AttentionParams& a, int warmup, int reps) {
    for (int i = 0; i < warmup; ++i) v.launch(a, stream);
    std::vector<float> ms;
    for (int i = 0; i < reps; ++i) {
      DFLASH_CUDA_CHECK(cudaEventRecord(start, stream));
      v.launch(a, stream);
      DFLASH_CUDA_CHECK(cudaEventRecord(stop, stream));
      DFLASH_CUDA_CHECK(cudaEventSynchronize(stop));
      float t = 0;
      DFLASH_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  for (int64_t d : {256, 128, 64}) {
    const cases::AttentionCase c{"", {8192}, 24, 4, d};
    const cases::AttentionData data = cases::draw(c, 3);
    const long long T = c.N(), dl = d;
    Tensor out_f = poisoned_out(c);
    const float ms_f = time_ms(cases::kFlash, data.params(c, out_f.raw_data()), 3, 20);
    std::printf("attention T=%lld Hq=24 Hkv=4 d=%lld: flash (%s) %.3f ms (%.1f TFLOP/s)\n", T, dl,
                cuda::flash_attention_kernel_name(d, 0), ms_f, c.flops() / ms_f * 1e-9);
    if (wgmma_runs(d)) {  // the other kernel on the same inputs: timing and agreement
      Tensor out_m = poisoned_out(c);
      const float ms_m = time_ms(cases::kFlashMmaSync, data.params(c, out_m.raw_data()), 3, 20);
      const double diff = max_rel_err(out_f, out_m);
      std::printf("attention T=%lld Hq=24 Hkv=4 d=%lld: mma.sync %.3f ms (%.1f TFLOP/s); wgmma vs mma.sync "
                  "normalized difference %.3g\n",
                  T, dl, ms_m, c.flops() / ms_m * 1e-9, diff);
      EXPECT_LT(diff, c.out_bound);
    }
    if (d == 256) {
      Tensor out_b = poisoned_out(c);
      const float ms_b = time_ms(cases::kAttentionFallback, data.params(c, out_b.raw_data()), 1, 3);
      const double diff = max_rel_err(out_f, out_b);
      std::printf("attention T=%lld Hq=24 Hkv=4 d=256: fallback %.3f ms (%.2f TFLOP/s); flash is %.1fx faster; "
                  "flash vs fallback normalized difference %.3g\n",
                  T, ms_b, c.flops() / ms_b * 1e-9, ms_b / ms_f, diff);
      EXPECT_LT(diff, c.out_bound);
    }
  }
  {  // a packed batch of 16 sequences of 512 tokens (drafter-training style prefill)
    const cases::AttentionCase c{"", std::vector<int64_t>(16, 512), 24, 4, 256};
    const cases::AttentionData data = cases::draw(c, 4);
    Tensor out = poisoned_out(c);
    const float ms = time_ms(cases::kFlash, data.params(c, out.raw_data()), 3, 20);
    std::printf("attention 16 x 512 tokens Hq=24 Hkv=4 d=256: flash %.3f ms (%.1f TFLOP/s)\n", ms, c.flops() / ms * 1e-9);
  }
  DFLASH_CUDA_CHECK(cudaEventDestroy(start));
  DFLASH_CUDA_CHECK(cudaEventDestroy(stop));
}
