// CUDA chunked gated delta rule (kernels/cuda/gdn_chunk.cu) against the fp32 CPU reference
// (ops::gated_delta_rule, both the chunked and the token-recurrent algorithm).
//
// Inputs are what the kernel sees in the model: q and k L2-normalised on the host (q also scaled
// by 1/sqrt(dk)) and then rounded to bf16, v rounded to bf16; the CPU gets exactly those rounded
// values in f32 with l2norm_qk = false and scale = 1. g ~ U(-2, 0) (fast decay) or U(-0.05, 0)
// (slow decay, long memory), beta ~ U(0, 1), initial state ~ N(0, 0.5) or none.
//
// Bounds (max |gpu - ref| / max |ref|): out <= 2e-2, final state <= 1e-2. The kernel rounds every
// tensor-core operand to bf16 (rel. 2^-9 = 2e-3 each: K, Q, V, the state S, Y = beta (V - e^G K S),
// T = (I + A)^-1, P, V') and the output itself to bf16, so a few 1e-3 is expected; errors do not
// grow with the sequence because the decay and the delta rule's (I - beta k k^T) contract the state.
// The measured errors are printed for every case; on the H200 they were out 2.9e-3 .. 5.5e-3 and
// final state 1.1e-3 .. 4.9e-3 over all cases below (the same against either CPU algorithm).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/launch.h"
#include "kernels/device.h"
#include "kernels/ops.h"
#include "kernels/random.h"
#include "test_util.h"

namespace dflash::cuda {
// Test hook in gdn_chunk.cu for timing breakdowns and variants: 2 = skip the prep kernel, 4 = skip
// the state kernel, 8 = two input stages in the state kernel (instead of three), 16 = 32-column
// state-kernel slices (instead of 64), 64 = one prep CTA per value head (instead of per key head),
// 128 = the state kernel as a programmatic dependent launch of prep; 0 is the full op.
void chunk_gated_delta_rule_variant(const DeltaRuleParams& p, Stream s, int flags);
}  // namespace dflash::cuda

using namespace dflash;

namespace {

uint64_t g_stream = 7001;

Tensor host_normal(const Shape& s, float stddev) {
  Tensor t = Tensor::empty(s, DType::F32);
  fill_normal(t, {4242, g_stream++, 0}, 0.0f, stddev);
  return t;
}
Tensor host_uniform(const Shape& s, float lo, float hi) {
  Tensor t = Tensor::empty(s, DType::F32);
  fill_uniform(t, {4242, g_stream++, 0}, lo, hi);
  return t;
}
Tensor round_bf16(const Tensor& t) { return t.to_dtype(DType::BF16).to_dtype(DType::F32); }

// Rows of the last dim L2-normalised (eps 1e-6 as the model's l2norm), times `scale`, bf16-rounded.
Tensor normalized_bf16(const Shape& s, float scale) {
  Tensor t = host_normal(s, 1.0f);
  const int64_t d = s.back(), rows = t.numel() / d;
  float* x = t.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += double(x[r * d + i]) * x[r * d + i];
    const float inv = scale / std::sqrt(static_cast<float>(ss) + 1e-6f);
    for (int64_t i = 0; i < d; ++i) x[r * d + i] *= inv;
  }
  return round_bf16(t);
}

struct Case {
  std::vector<int64_t> lens;
  int64_t Hk, Hv, dk, dv;
  bool init;
  float g_lo;         // g ~ U(g_lo, 0)
  int64_t ldv_extra;  // extra columns in the v rows (v sits at column 8 of a wider buffer when > 0)
};

std::string describe(const Case& c) {
  std::string lens;
  for (int64_t l : c.lens) {
    if (!lens.empty()) lens.push_back(',');
    lens.append(std::to_string(l));
  }
  char buf[160];
  std::snprintf(buf, sizeof buf, "lens {%s} Hk=%lld Hv=%lld dk=%lld dv=%lld %s g_lo=%g ldv+%lld", lens.c_str(),
                static_cast<long long>(c.Hk), static_cast<long long>(c.Hv), static_cast<long long>(c.dk),
                static_cast<long long>(c.dv), c.init ? "init" : "no-init", c.g_lo, static_cast<long long>(c.ldv_extra));
  return buf;
}

void run_case(const Case& cs) {
  SCOPED_TRACE(describe(cs));
  ops::SeqOffsets seqs{{0}};
  for (int64_t l : cs.lens) seqs.offsets.push_back(seqs.offsets.back() + l);
  const int64_t N = seqs.total_tokens(), S = seqs.num_sequences();
  const int64_t Hk = cs.Hk, Hv = cs.Hv, dk = cs.dk, dv = cs.dv;

  ops::DeltaRuleParams p;
  p.q = normalized_bf16({N, Hk, dk}, 1.0f / std::sqrt(static_cast<float>(dk)));
  p.k = normalized_bf16({N, Hk, dk}, 1.0f);
  p.v = round_bf16(host_normal({N, Hv, dv}, 1.0f));
  p.g = host_uniform({N, Hv}, cs.g_lo, 0.0f);
  p.beta = host_uniform({N, Hv}, 0.0f, 1.0f);
  if (cs.init) p.initial_state = host_normal({S, Hv, dk, dv}, 0.5f);
  p.scale = 1.0f;
  p.l2norm_qk = false;
  p.chunk_size = 64;

  Tensor out_c = Tensor::empty({N, Hv, dv}, DType::F32), out_r = Tensor::empty({N, Hv, dv}, DType::F32);
  Tensor fs_c = Tensor::empty({S, Hv, dk, dv}, DType::F32), fs_r = Tensor::empty({S, Hv, dk, dv}, DType::F32);
  ops::gated_delta_rule(p, seqs, ops::DeltaRuleAlgo::Chunked, out_c, &fs_c);
  ops::gated_delta_rule(p, seqs, ops::DeltaRuleAlgo::Recurrent, out_r, &fs_r);

  // v inside wider rows: columns [voff, voff + Hv dv) of [N, ldv], the rest junk.
  const int64_t voff = cs.ldv_extra > 0 ? 8 : 0, ldv = Hv * dv + cs.ldv_extra;
  Tensor vwide = host_normal({N, ldv}, 3.0f);
  for (int64_t n = 0; n < N; ++n)
    std::copy_n(p.v.data<float>() + n * Hv * dv, Hv * dv, vwide.data<float>() + n * ldv + voff);

  const Device gpu = Device::cuda(0);
  Tensor q_d = p.q.to_dtype(DType::BF16).to(gpu), k_d = p.k.to_dtype(DType::BF16).to(gpu);
  Tensor v_d = vwide.to_dtype(DType::BF16).to(gpu);
  Tensor g_d = p.g.to(gpu), b_d = p.beta.to(gpu);
  Tensor init_d = cs.init ? p.initial_state.to(gpu) : Tensor();
  std::vector<int32_t> cu(seqs.offsets.begin(), seqs.offsets.end());
  Tensor cu_d = Tensor::from_blob(cu.data(), {S + 1}, DType::I32).to(gpu);

  // The full op, then the test hook's variants.
  for (const int flags : {0, 8, 16, 64, 128}) {
    const char* variant = flags == 0    ? "full"
                          : flags == 8  ? "s2"
                          : flags == 16 ? "c32"
                          : flags == 64 ? "prepv"
                                        : "pdl";
    SCOPED_TRACE(variant);
    Tensor out = Tensor::empty({N, Hv, dv}, DType::BF16, gpu), fs = Tensor::empty({S, Hv, dk, dv}, DType::F32, gpu);
    poison(out);
    poison(fs);
    cuda::DeltaRuleParams d;
    d.q = q_d.raw_data();
    d.k = k_d.raw_data();
    d.v = static_cast<const char*>(v_d.raw_data()) + voff * 2;
    d.ldv = ldv;
    d.g = g_d.data<float>();
    d.beta = b_d.data<float>();
    d.initial_state = cs.init ? init_d.data<float>() : nullptr;
    d.final_state = fs.data<float>();
    d.out = out.raw_data();
    d.cu_seqlens = cu_d.data<int32_t>();
    d.num_seqs = S;
    d.N = N;
    d.Hk = Hk;
    d.Hv = Hv;
    d.dk = dk;
    d.dv = dv;
    cuda::chunk_gated_delta_rule_variant(d, DeviceContext::get(0).stream(), flags);
    const double eo_c = max_rel_err(out, out_c), eo_r = max_rel_err(out, out_r);
    const double es_c = max_rel_err(fs, fs_c), es_r = max_rel_err(fs, fs_r);
    std::printf("  %-70s %-6s out %.2e (rec %.2e)  state %.2e (rec %.2e)\n", describe(cs).c_str(), variant,
                eo_c, eo_r, es_c, es_r);
    EXPECT_LT(eo_c, 2e-2) << "out vs chunked";
    EXPECT_LT(eo_r, 2e-2) << "out vs recurrent";
    EXPECT_LT(es_c, 1e-2) << "final state vs chunked";
    EXPECT_LT(es_r, 1e-2) << "final state vs recurrent";
  }
}

}  // namespace

// Qwen3.6-27B head shape: Hk = 16, Hv = 48, d = 128; lengths around the chunk size, packed batches.
TEST(CudaDeltaRule, ChunkedRealHeads) {
  DFLASH_REQUIRE_GPU();
  for (const Case& c : {Case{{1}, 16, 48, 128, 128, true, -2.0f, 0}, Case{{63}, 16, 48, 128, 128, false, -0.05f, 0},
                        Case{{64}, 16, 48, 128, 128, true, -2.0f, 0}, Case{{65}, 16, 48, 128, 128, true, -0.05f, 0},
                        Case{{130}, 16, 48, 128, 128, false, -2.0f, 0},
                        Case{{300}, 16, 48, 128, 128, true, -0.05f, 0},
                        Case{{1, 64, 65, 200}, 16, 48, 128, 128, true, -2.0f, 136},
                        Case{{1, 64, 65, 200}, 16, 48, 128, 128, false, -0.05f, 0}})
    run_case(c);
}

// Head ratios 1, 2, 3 with fewer heads, dk / dv = 64, an empty sequence, strided v rows.
TEST(CudaDeltaRule, ChunkedSmallShapes) {
  DFLASH_REQUIRE_GPU();
  for (const Case& c : {Case{{200}, 1, 1, 128, 128, true, -0.05f, 0}, Case{{130, 7}, 2, 4, 128, 128, false, -2.0f, 64},
                        Case{{5, 0, 70}, 2, 6, 128, 128, true, -0.05f, 0},
                        Case{{63, 64, 129}, 2, 4, 64, 64, true, -0.05f, 0},
                        Case{{100, 3}, 1, 3, 64, 128, true, -2.0f, 8}, Case{{77}, 3, 3, 128, 64, false, -0.05f, 0},
                        Case{{1}, 1, 2, 64, 64, false, -2.0f, 0}})
    run_case(c);
}

// Long sequences with slow decay: the state carries information over many chunks.
TEST(CudaDeltaRule, ChunkedLongMemory) {
  DFLASH_REQUIRE_GPU();
  for (const Case& c : {Case{{2000}, 1, 2, 128, 128, true, -0.05f, 0}, Case{{1500, 700}, 1, 2, 128, 128, true, -0.002f, 0}})
    run_case(c);
}

TEST(CudaDeltaRule, ChunkedRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  EXPECT_TRUE(cuda::chunk_gated_delta_rule_supported(128, 128, 9));
  EXPECT_TRUE(cuda::chunk_gated_delta_rule_supported(64, 64, 8));
  EXPECT_FALSE(cuda::chunk_gated_delta_rule_supported(128, 128, 7));
  EXPECT_FALSE(cuda::chunk_gated_delta_rule_supported(96, 128, 9));
  EXPECT_FALSE(cuda::chunk_gated_delta_rule_supported(128, 96, 9));

  const int64_t N = 10;
  Tensor q = Tensor::empty({N, 2, 128}, DType::BF16, Device::cuda(0)), v = Tensor::empty({N, 4, 128}, DType::BF16, Device::cuda(0));
  Tensor g = Tensor::empty({N, 4}, DType::F32, Device::cuda(0)), out = Tensor::empty({N, 4, 128}, DType::BF16, Device::cuda(0));
  cuda::DeltaRuleParams d;
  d.q = d.k = q.raw_data();
  d.v = v.raw_data();
  d.ldv = 4 * 128;
  d.g = d.beta = g.data<float>();
  d.out = out.raw_data();
  d.num_seqs = 1;
  d.N = N;
  d.Hk = 2;
  d.Hv = 4;
  d.dk = 128;
  d.dv = 128;
  void* stream = DeviceContext::get(0).stream();
  EXPECT_NO_THROW(cuda::chunk_gated_delta_rule(d, stream));  // one sequence without cu_seqlens is fine
  DeviceContext::get(0).synchronize();
  auto expect_error = [&](cuda::DeltaRuleParams bad, const char* what) {
    try {
      cuda::chunk_gated_delta_rule(bad, stream);
      ADD_FAILURE() << "expected an error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("chunk_gated_delta_rule"), std::string::npos) << e.what();
    }
  };
  cuda::DeltaRuleParams bad = d;
  bad.dk = 96;
  expect_error(bad, "dk = 96");
  bad = d;
  bad.dv = 100;
  expect_error(bad, "dv = 100");
  bad = d;
  bad.Hv = 5;
  expect_error(bad, "Hv not a multiple of Hk");
  bad = d;
  bad.ldv = 4 * 128 - 8;
  expect_error(bad, "ldv < Hv dv");
  bad = d;
  bad.num_seqs = 2;
  expect_error(bad, "two sequences without cu_seqlens");
  bad = d;
  bad.v = static_cast<const char*>(v.raw_data()) + 2;
  expect_error(bad, "misaligned v");
}

// Timings only (never asserts on time). Qwen3.6-27B GDN layer shape: Hk = 16, Hv = 48, d = 128.
// FLOPs: dense-equivalent chunked form, N Hv (2 C (3 dk + 2 dv) + 6 dk dv), C = 64.
// Bytes: q, k (2 N Hk dk 2) + v, out (2 N Hv dv 2) + g, beta (2 N Hv 4); no states.
TEST(CudaDeltaRule, ChunkedTimings) {
  DFLASH_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  auto stream = static_cast<cudaStream_t>(DeviceContext::get(0).stream());
  const int64_t Hk = 16, Hv = 48, d = 128, C = 64;
  struct Shape2 { int64_t seqs, len; };
  std::printf("  %-14s %-10s %9s %9s %9s\n", "shape", "variant", "ms", "TFLOP/s", "TB/s");
  for (auto [nseq, len] : {Shape2{1, 2048}, Shape2{1, 8192}, Shape2{1, 32768}, Shape2{8, 1024}}) {
    const int64_t N = nseq * len;
    Tensor q = Tensor::empty({N, Hk, d}, DType::BF16, gpu), k = Tensor::empty({N, Hk, d}, DType::BF16, gpu);
    Tensor v = Tensor::empty({N, Hv, d}, DType::BF16, gpu), out = Tensor::empty({N, Hv, d}, DType::BF16, gpu);
    Tensor g = Tensor::empty({N, Hv}, DType::F32, gpu), beta = Tensor::empty({N, Hv}, DType::F32, gpu);
    cuda::fill_normal(q, {99, 1, 0}, 0.0f, 1.0f / 128.0f);  // ~unit rows times 1/sqrt(d)
    cuda::fill_normal(k, {99, 2, 0}, 0.0f, 1.0f / std::sqrt(128.0f));
    cuda::fill_normal(v, {99, 3, 0}, 0.0f, 1.0f);
    cuda::fill_uniform(g, {99, 4, 0}, -1.0f, 0.0f);
    cuda::fill_uniform(beta, {99, 5, 0}, 0.0f, 1.0f);
    std::vector<int32_t> cu;
    for (int64_t s = 0; s <= nseq; ++s) cu.push_back(static_cast<int32_t>(s * len));
    Tensor cu_d = Tensor::from_blob(cu.data(), {nseq + 1}, DType::I32).to(gpu);
    cuda::DeltaRuleParams p;
    p.q = q.raw_data();
    p.k = k.raw_data();
    p.v = v.raw_data();
    p.ldv = Hv * d;
    p.g = g.data<float>();
    p.beta = beta.data<float>();
    p.out = out.raw_data();
    p.cu_seqlens = cu_d.data<int32_t>();
    p.num_seqs = nseq;
    p.N = N;
    p.Hk = Hk;
    p.Hv = Hv;
    p.dk = d;
    p.dv = d;
    const double flops = double(N) * Hv * (2.0 * C * (3 * d + 2 * d) + 6.0 * d * d);
    const double bytes = 2.0 * N * Hk * d * 2 + 2.0 * N * Hv * d * 2 + 2.0 * N * Hv * 4;
    const char* names[] = {"chunk", "chunk pdl", "chunk pv", "prep only", "prep/value", "state only", "state s2",
                           "state c32"};
    const int flag_sets[] = {0, 128, 64, 4, 4 | 64, 2, 2 | 8, 2 | 16};
    for (int vi = 0; vi < 8; ++vi) {
      cudaEvent_t e0, e1;
      DFLASH_CUDA_CHECK(cudaEventCreate(&e0));
      DFLASH_CUDA_CHECK(cudaEventCreate(&e1));
      // Each sample: 5 back-to-back calls after one untimed call, so the host work of a launch
      // (checks, scratch from the cache) overlaps the previous call's kernels.
      std::vector<float> ms;
      for (int it = 0; it < 7; ++it) {
        cuda::chunk_gated_delta_rule_variant(p, stream, flag_sets[vi]);
        DFLASH_CUDA_CHECK(cudaEventRecord(e0, stream));
        for (int r = 0; r < 5; ++r) cuda::chunk_gated_delta_rule_variant(p, stream, flag_sets[vi]);
        DFLASH_CUDA_CHECK(cudaEventRecord(e1, stream));
        DFLASH_CUDA_CHECK(cudaEventSynchronize(e1));
        float t = 0;
        DFLASH_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
        if (it >= 2) ms.push_back(t / 5);
      }
      DFLASH_CUDA_CHECK(cudaEventDestroy(e0));
      DFLASH_CUDA_CHECK(cudaEventDestroy(e1));
      std::sort(ms.begin(), ms.end());
      const double med = ms[ms.size() / 2];
      char shape[32];
      std::snprintf(shape, sizeof shape, "%lldx%lld", static_cast<long long>(nseq), static_cast<long long>(len));
      std::printf("  %-14s %-10s %9.4f %9.1f %9.2f\n", shape, names[vi], med, flops / (med * 1e-3) / 1e12,
                  bytes / (med * 1e-3) / 1e12);
    }
  }
}
