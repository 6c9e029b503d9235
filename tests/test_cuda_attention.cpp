// CUDA causal attention (flash_attention_fwd with each of its kernels: the mma.sync one and, on an
// sm_90 GPU, the wgmma one; attention_fallback) against the CPU reference ops::causal_attention. Inputs are bf16 (drawn on the host, so rounded once); the reference gets
// the same rounded values in f32. Outputs are poisoned (NaN) before every launch.
//
// Error bound: max|out - ref| / max|ref| < 1e-2. The output is stored in bf16 (relative rounding
// 2^-9 ≈ 2e-3 of an element, at most ~4e-3 of max|ref| after the averaging), and the flash kernel
// also rounds the probabilities P to bf16 before P·V (relative 2^-9 per term, partly averaging
// out); expected errors are ~2e-3 to 5e-3, the fallback (fp32 P) near the bf16 output rounding.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/check.h"
#include "kernels/device.h"
#include "kernels/ops.h"
#include "kernels/random.h"
#include "tests/test_util.h"

using namespace dflash;

namespace {

constexpr double kBound = 1e-2;
uint64_t g_stream = 7001;

// Flash = flash_attention_fwd as the model calls it (FlashImpl::Auto); the other two force a kernel.
enum class Kernel { Flash, FlashMma, FlashWgmma, Fallback };
const char* kernel_name(Kernel k) {
  switch (k) {
    case Kernel::Flash: return "flash";
    case Kernel::FlashMma: return "flash-mma.sync";
    case Kernel::FlashWgmma: return "flash-wgmma";
    default: return "fallback";
  }
}
bool wgmma_runs(int64_t d) { return cuda::flash_attention_wgmma_available(d, 0); }

struct Problem {
  std::vector<int64_t> lens;
  int64_t Hq = 1, Hkv = 1, d = 64;
  float scale = 0.0f;        // softmax scale (set from d when 0)
  float q_stddev = 1.0f;     // larger values make the softmax peakier
  int64_t N = 0, max_len = 0;
  ops::SeqOffsets seqs;
  Tensor q, k, v;            // host bf16
  Tensor qd, kd, vd, cu;     // device copies (cu: int32 cu_seqlens)
};

std::string describe(const Problem& p) {
  std::ostringstream os;
  os << "d=" << p.d << " Hq=" << p.Hq << " Hkv=" << p.Hkv << " lens={";
  for (size_t i = 0; i < p.lens.size(); ++i) os << (i ? "," : "") << p.lens[i];
  os << "} scale=" << p.scale;
  return os.str();
}

Tensor bf16_normal(const Shape& s, float stddev) {
  Tensor t = Tensor::empty(s, DType::BF16);
  fill_normal(t, {4242, g_stream++, 0}, 0.0f, stddev);  // rounded to bf16 on the host
  return t;
}

Problem make_problem(std::vector<int64_t> lens, int64_t Hq, int64_t Hkv, int64_t d, float scale_mult = 1.0f,
                     float q_stddev = 1.0f) {
  Problem p;
  p.lens = std::move(lens);
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.d = d;
  p.scale = scale_mult / std::sqrt(static_cast<float>(d));
  p.q_stddev = q_stddev;
  p.seqs.offsets = {0};
  for (int64_t l : p.lens) {
    p.seqs.offsets.push_back(p.seqs.offsets.back() + l);
    p.max_len = std::max(p.max_len, l);
  }
  p.N = p.seqs.offsets.back();
  p.q = bf16_normal({p.N, Hq, d}, q_stddev);
  p.k = bf16_normal({p.N, Hkv, d}, 1.0f);
  p.v = bf16_normal({p.N, Hkv, d}, 1.0f);
  p.qd = p.q.to(Device::cuda(0));
  p.kd = p.k.to(Device::cuda(0));
  p.vd = p.v.to(Device::cuda(0));
  std::vector<float> cu(p.seqs.offsets.begin(), p.seqs.offsets.end());
  p.cu = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}, DType::I32).to(Device::cuda(0));
  return p;
}

Tensor reference(const Problem& p) {
  Tensor out = Tensor::empty({p.N, p.Hq, p.d}, DType::F32);
  poison(out);
  ops::causal_attention(p.q.to_dtype(DType::F32), p.k.to_dtype(DType::F32), p.v.to_dtype(DType::F32), p.seqs,
                        p.scale, out);
  return out;
}

cuda::AttentionParams params_of(const Problem& p, const Tensor& out) {
  cuda::AttentionParams a;
  a.q = p.qd.raw_data();
  a.k = p.kd.raw_data();
  a.v = p.vd.raw_data();
  a.out = out.raw_data();
  a.cu_seqlens = p.cu.data<int32_t>();
  a.num_seqs = static_cast<int64_t>(p.lens.size());
  a.max_seqlen = p.max_len;
  a.N = p.N;
  a.Hq = p.Hq;
  a.Hkv = p.Hkv;
  a.d = p.d;
  a.scale = p.scale;
  return a;
}

void launch(Kernel kernel, cuda::AttentionParams a) {
  void* stream = DeviceContext::get(0).stream();
  if (kernel == Kernel::Fallback) {
    cuda::attention_fallback(a, stream);
    return;
  }
  a.impl = kernel == Kernel::FlashMma ? cuda::FlashImpl::MmaSync
           : kernel == Kernel::FlashWgmma ? cuda::FlashImpl::Wgmma
                                          : cuda::FlashImpl::Auto;
  cuda::flash_attention_fwd(a, stream);
}

// Device output [N, Hq, d] bf16, poisoned before the launch; returned on the host.
Tensor run(Kernel kernel, const Problem& p) {
  Tensor out = Tensor::empty({p.N, p.Hq, p.d}, DType::BF16, Device::cuda(0));
  poison(out);
  launch(kernel, params_of(p, out));
  return out.to(Device::cpu());
}

// Runs the kernels on one problem, checks them against the reference, prints the errors.
void check_problem(const Problem& p, const std::vector<Kernel>& kernels, double* worst = nullptr) {
  const Tensor ref = reference(p);
  std::ostringstream line;
  line << "  " << describe(p) << ":";
  for (Kernel k : kernels) {
    const double err = max_rel_err(run(k, p), ref);
    line << " " << kernel_name(k) << " " << err;
    EXPECT_LT(err, kBound) << kernel_name(k) << " " << describe(p);
    if (worst) worst[static_cast<int>(k)] = std::max(worst[static_cast<int>(k)], err);
  }
  std::printf("%s\n", line.str().c_str());
}

const std::vector<std::vector<int64_t>> kSeqSets = {{1}, {63}, {64}, {65}, {130}, {1, 200, 17}, {3, 0, 70}};
// Head ratios 1, 2, 3 and 6 (= Qwen3.6-27B's 24 / 4).
const std::vector<std::pair<int64_t, int64_t>> kHeads = {{2, 2}, {4, 2}, {6, 2}, {6, 1}};

// Every kernel that can run head dim d here: the mma.sync flash kernel always, the wgmma one on
// sm_90 (d 128, 256), the default choice, and the fallback.
std::vector<Kernel> kernels_for(int64_t d) {
  std::vector<Kernel> k = {Kernel::Flash, Kernel::FlashMma};
  if (wgmma_runs(d)) k.push_back(Kernel::FlashWgmma);
  k.push_back(Kernel::Fallback);
  return k;
}

void sweep(int64_t d) {
  double worst[4] = {0, 0, 0, 0};
  for (auto [Hq, Hkv] : kHeads)
    for (const auto& lens : kSeqSets) check_problem(make_problem(lens, Hq, Hkv, d), kernels_for(d), worst);
  std::printf("d=%lld worst normalized error: flash %.3g, mma.sync %.3g, wgmma %s%.3g, fallback %.3g (bound %.0e)\n",
              static_cast<long long>(d), worst[0], worst[1], wgmma_runs(d) ? "" : "(not run) ", worst[2], worst[3],
              kBound);
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
  for (int64_t d : {64, 128, 256}) {
    check_problem(make_problem({130, 5}, 4, 2, d, 8.0f), kernels_for(d));
    check_problem(make_problem({97}, 2, 1, d, 8.0f, 3.0f), kernels_for(d));
  }
}

// Head dims the flash kernel does not instantiate: the fallback covers any d.
TEST(CudaAttention, FallbackOddHeadDims) {
  DFLASH_REQUIRE_GPU();
  for (int64_t d : {40, 96, 1, 33})
    for (const auto& lens : kSeqSets) check_problem(make_problem(lens, 6, 2, d), {Kernel::Fallback});
}

// One long sequence (32 key tiles per query block at the end) and a long packed batch.
TEST(CudaAttention, LongSequences) {
  DFLASH_REQUIRE_GPU();
  check_problem(make_problem({2048}, 2, 1, 256), kernels_for(256));
  check_problem(make_problem({2048}, 4, 2, 128), kernels_for(128));
  check_problem(make_problem({2048}, 6, 1, 64), kernels_for(64));
  check_problem(make_problem({700, 1, 1347}, 2, 2, 128), kernels_for(128));
  check_problem(make_problem({1000, 129, 3000}, 6, 1, 256), kernels_for(256));
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
// projection): row stride W elements, k at column offset 8, v after it.
TEST(CudaAttention, StridedKeysValues) {
  DFLASH_REQUIRE_GPU();
  for (int64_t d : {64, 128, 256}) {
    const Problem p = make_problem({130, 1, 77}, 6, 2, d);
    const Tensor ref = reference(p);
    const int64_t kv = p.Hkv * d, W = 2 * kv + 24;
    Tensor wide = Tensor::empty({p.N, W}, DType::BF16);
    poison(wide);
    const auto* ks = static_cast<const uint16_t*>(p.k.raw_data());
    const auto* vs = static_cast<const uint16_t*>(p.v.raw_data());
    auto* w = static_cast<uint16_t*>(wide.raw_data());
    for (int64_t n = 0; n < p.N; ++n)
      for (int64_t e = 0; e < kv; ++e) {
        w[n * W + 8 + e] = ks[n * kv + e];
        w[n * W + 8 + kv + e] = vs[n * kv + e];
      }
    const Tensor wd = wide.to(Device::cuda(0));
    for (Kernel k : kernels_for(d)) {
      Tensor out = Tensor::empty({p.N, p.Hq, p.d}, DType::BF16, Device::cuda(0));
      poison(out);
      cuda::AttentionParams a = params_of(p, out);
      a.k = static_cast<const char*>(wd.raw_data()) + 8 * 2;
      a.v = static_cast<const char*>(wd.raw_data()) + (8 + kv) * 2;
      a.ldk = a.ldv = W;
      launch(k, a);
      const double err = max_rel_err(out.to(Device::cpu()), ref);
      std::printf("  strided k/v d=%lld %s: %.3g\n", static_cast<long long>(d), kernel_name(k), err);
      EXPECT_LT(err, kBound) << kernel_name(k) << " d=" << d;
    }
  }
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
    const Problem p = make_problem({5}, 2, 1, 128);
    Tensor out = Tensor::empty({p.N, p.Hq, p.d}, DType::BF16, Device::cuda(0));
    EXPECT_THROW(launch(Kernel::FlashWgmma, params_of(p, out)), Error);
  }
}

TEST(CudaAttention, BadSizesThrow) {
  DFLASH_REQUIRE_GPU();
  const Problem p = make_problem({5, 3}, 6, 2, 64);
  Tensor out = Tensor::empty({p.N, p.Hq, p.d}, DType::BF16, Device::cuda(0));
  for (Kernel k : {Kernel::Flash, Kernel::FlashMma, Kernel::Fallback}) {
    auto a = params_of(p, out);
    a.Hkv = 4;  // 6 query heads do not divide into 4 kv heads
    EXPECT_THROW(launch(k, a), Error) << kernel_name(k);
    a = params_of(p, out);
    a.Hkv = 0;
    EXPECT_THROW(launch(k, a), Error) << kernel_name(k);
    a = params_of(p, out);
    a.scale = 0.0f;
    EXPECT_THROW(launch(k, a), Error) << kernel_name(k);
    a = params_of(p, out);
    a.num_seqs = 0;
    EXPECT_THROW(launch(k, a), Error) << kernel_name(k);
    a = params_of(p, out);
    a.max_seqlen = p.N + 1;
    EXPECT_THROW(launch(k, a), Error) << kernel_name(k);
    a = params_of(p, out);
    a.out = nullptr;
    EXPECT_THROW(launch(k, a), Error) << kernel_name(k);
    a = params_of(p, out);
    a.ldk = p.Hkv * p.d - 8;  // a k row stride shorter than the row
    EXPECT_THROW(launch(k, a), Error) << kernel_name(k);
  }
  for (int64_t d : {32, 96, 40, 512}) {
    auto a = params_of(p, out);
    a.d = d;
    EXPECT_THROW(cuda::flash_attention_fwd(a, DeviceContext::get(0).stream()), Error) << "d=" << d;
  }
  auto a = params_of(p, out);
  a.q = static_cast<const char*>(a.q) + 2;  // misaligned for 16-byte loads
  EXPECT_THROW(cuda::flash_attention_fwd(a, DeviceContext::get(0).stream()), Error);
  // N = 0 is a no-op for both.
  a = params_of(p, out);
  a.N = 0;
  a.max_seqlen = 0;
  EXPECT_NO_THROW(cuda::flash_attention_fwd(a, DeviceContext::get(0).stream()));
  EXPECT_NO_THROW(cuda::attention_fallback(a, DeviceContext::get(0).stream()));
  DeviceContext::get(0).synchronize();
}

// Print-only timing of the Qwen3.6-27B prefill shape (T = 8192, Hq = 24, Hkv = 4, d = 256), plus
// the flash kernel at d = 128 and 64 and on a packed batch of short sequences.
// FLOPs = 4 · T²/2 · d · Hq per sequence (causal half of QKᵀ and PV).
// Also checks the two kernels agree at this size (no CPU reference: it would take minutes).
TEST(CudaAttention, TimingPrintOnly) {
  DFLASH_REQUIRE_GPU();
  auto stream = static_cast<cudaStream_t>(DeviceContext::get(0).stream());
  cudaEvent_t start, stop;
  DFLASH_CUDA_CHECK(cudaEventCreate(&start));
  DFLASH_CUDA_CHECK(cudaEventCreate(&stop));
  auto time_ms = [&](Kernel k, const cuda::AttentionParams& a, int warmup, int reps) {
    for (int i = 0; i < warmup; ++i) launch(k, a);
    std::vector<float> ms;
    for (int i = 0; i < reps; ++i) {
      DFLASH_CUDA_CHECK(cudaEventRecord(start, stream));
      launch(k, a);
      DFLASH_CUDA_CHECK(cudaEventRecord(stop, stream));
      DFLASH_CUDA_CHECK(cudaEventSynchronize(stop));
      float t = 0;
      DFLASH_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  const int64_t T = 8192;
  for (int64_t d : {256, 128, 64}) {
    const Problem p = make_problem({T}, 24, 4, d);
    const double flops = 4.0 * (double(T) * T / 2) * double(d) * 24;
    Tensor out_f = Tensor::empty({p.N, p.Hq, p.d}, DType::BF16, Device::cuda(0));
    poison(out_f);
    const float ms_f = time_ms(Kernel::Flash, params_of(p, out_f), 3, 20);
    std::printf("attention T=%lld Hq=24 Hkv=4 d=%lld: flash (%s) %.3f ms (%.1f TFLOP/s)\n", static_cast<long long>(T),
                static_cast<long long>(d), cuda::flash_attention_kernel_name(d, 0), ms_f, flops / ms_f * 1e-9);
    if (wgmma_runs(d)) {  // the other kernel on the same inputs: timing and agreement
      Tensor out_m = Tensor::empty({p.N, p.Hq, p.d}, DType::BF16, Device::cuda(0));
      poison(out_m);
      const float ms_m = time_ms(Kernel::FlashMma, params_of(p, out_m), 3, 20);
      const double diff = max_rel_err(out_f.to(Device::cpu()), out_m.to(Device::cpu()));
      std::printf("attention T=%lld Hq=24 Hkv=4 d=%lld: mma.sync %.3f ms (%.1f TFLOP/s); wgmma vs mma.sync "
                  "normalized difference %.3g\n",
                  static_cast<long long>(T), static_cast<long long>(d), ms_m, flops / ms_m * 1e-9, diff);
      EXPECT_LT(diff, kBound);
    }
    if (d == 256) {
      Tensor out_b = Tensor::empty({p.N, p.Hq, p.d}, DType::BF16, Device::cuda(0));
      poison(out_b);
      const float ms_b = time_ms(Kernel::Fallback, params_of(p, out_b), 1, 3);
      const double diff = max_rel_err(out_f.to(Device::cpu()), out_b.to(Device::cpu()));
      std::printf("attention T=%lld Hq=24 Hkv=4 d=256: fallback %.3f ms (%.2f TFLOP/s); flash is %.1fx faster; "
                  "flash vs fallback normalized difference %.3g\n",
                  static_cast<long long>(T), ms_b, flops / ms_b * 1e-9, ms_b / ms_f, diff);
      EXPECT_LT(diff, kBound);
    }
  }
  {  // a packed batch of 16 sequences of 512 tokens (drafter-training style prefill)
    const Problem p = make_problem(std::vector<int64_t>(16, 512), 24, 4, 256);
    const double flops = 16 * 4.0 * (512.0 * 512 / 2) * 256 * 24;
    Tensor out = Tensor::empty({p.N, p.Hq, p.d}, DType::BF16, Device::cuda(0));
    const float ms = time_ms(Kernel::Flash, params_of(p, out), 3, 20);
    std::printf("attention 16 x 512 tokens Hq=24 Hkv=4 d=256: flash %.3f ms (%.1f TFLOP/s)\n", ms, flops / ms * 1e-9);
  }
  DFLASH_CUDA_CHECK(cudaEventDestroy(start));
  DFLASH_CUDA_CHECK(cudaEventDestroy(stop));
}
