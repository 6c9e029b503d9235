// CUDA gated delta rule, chunked (kernels/cuda/gdn_chunk.cu, the fast path) and token-recurrent
// (gdn_recurrent.cu, the fallback), against the fp32 CPU reference (ops::gated_delta_rule, both
// its chunked and its token-recurrent algorithm), over the op-case table's delta-rule cases
// (kernels/cases/gdn_cases.h: rule_check_cases).
//
// Inputs are what the kernels see in the model: q and k L2-normalised (q also scaled by 1/sqrt(dk))
// and then rounded to bf16, v rounded to bf16; the CPU gets exactly those values in f32 with
// l2norm_qk = false and scale = 1. g ~ U(-2, 0) (fast decay), U(-0.05, 0) (slow decay, long
// memory) or U(-0.4, -0.001), beta ~ U(0, 1) or U(0.02, 0.98), initial state N(0, 0.3 / 0.5) or none.
//
// Bounds (max |gpu - ref| / max |ref|, RuleCase): out <= 2e-2 for both kernels; final state
// <= 1e-2 (chunked) and <= 1e-3 (recurrent). The chunked kernel rounds every tensor-core operand to
// bf16 (rel. 2^-9 = 2e-3 each: K, Q, V, the state S, Y = beta (V - e^G K S), T = (I + A)^-1, P, V')
// and the output itself to bf16, so a few 1e-3 is expected; errors do not grow with the sequence
// because the decay and the delta rule's (I - beta k k^T) contract the state. The recurrent one keeps
// an f32 state in another summation order (partial sums over RP lanes, o from exp(g)·S_oldᵀq +
// delta·(k·q)): ~1e-6 on the state; its outputs are rounded once to bf16.
// Measured on the H200: chunked out 2.9e-3 .. 5.5e-3, final state 1.1e-3 .. 4.9e-3 (the same
// against either CPU algorithm); recurrent out 2.6e-3, final state 3.5e-7.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/cases/gdn_cases.h"
#include "core/cuda/check.h"
#include "kernels/cuda/gdn.h"
#include "core/device.h"
#include "kernels/ops.h"
#include "test_util.h"

using namespace dflash;

namespace {

struct Worst {
  double chunk_out = 0, chunk_state = 0, rec_out = 0, rec_state = 0;
};

void check_case(const cases::RuleCase& c, uint64_t seed, Worst& worst) {
  SCOPED_TRACE(c.describe());
  const cases::RuleData data = cases::draw(c, seed);
  const int64_t N = c.N(), S = static_cast<int64_t>(c.lens.size());
  const Device gpu = Device::cuda(0);
  cuda::Stream stream = DeviceContext::get(0).stream();
  const cases::RuleData::Ref ref_r = data.reference(ops::DeltaRuleAlgo::Recurrent);
  // The recurrent kernel, each rows-per-thread variant (0 = automatic).
  for (int rows : c.rows_per_thread) {
    cases::Knob knob(cuda::tuning::recurrent_rows_per_thread, rows);
    Tensor out = cases::poisoned({N, c.Hv, c.dv}, DType::BF16, gpu);
    Tensor fs = cases::poisoned({S, c.Hv, c.dk, c.dv}, DType::F32, gpu);
    cases::kRecurrentFallback.launch(data.params(out.raw_data(), fs.data<float>()), stream);
    const double eo = max_rel_err(out, ref_r.out), es = max_rel_err(fs, ref_r.state);
    EXPECT_LT(eo, c.out_bound) << "recurrent out, rows/thread " << rows;
    EXPECT_LT(es, c.recurrent_state_bound) << "recurrent final state, rows/thread " << rows;
    worst.rec_out = std::max(worst.rec_out, eo);
    worst.rec_state = std::max(worst.rec_state, es);
  }
  if (!c.chunk_ok()) return;
  const cases::RuleData::Ref ref_c = data.reference(ops::DeltaRuleAlgo::Chunked);
  // The full op, then the test hook's variants.
  for (const int flags : c.chunk_flags) {
    const char* variant = flags == 0    ? "full"
                          : flags == 8  ? "s2"
                          : flags == 16 ? "c32"
                          : flags == 64 ? "prepv"
                                        : "pdl";
    SCOPED_TRACE(variant);
    Tensor out = cases::poisoned({N, c.Hv, c.dv}, DType::BF16, gpu);
    Tensor fs = cases::poisoned({S, c.Hv, c.dk, c.dv}, DType::F32, gpu);
    const cuda::DeltaRuleParams p = data.params(out.raw_data(), fs.data<float>());
    if (flags == 0)
      cases::kChunkFast.launch(p, stream);
    else
      cuda::chunk_gated_delta_rule_variant(p, stream, flags);
    const double eo_c = max_rel_err(out, ref_c.out), eo_r = max_rel_err(out, ref_r.out);
    const double es_c = max_rel_err(fs, ref_c.state), es_r = max_rel_err(fs, ref_r.state);
    std::printf("  %-90s %-6s out %.2e (rec %.2e)  state %.2e (rec %.2e)\n", c.describe().c_str(), variant, eo_c,
                eo_r, es_c, es_r);
    EXPECT_LT(eo_c, c.out_bound) << "out vs chunked";
    EXPECT_LT(eo_r, c.out_bound) << "out vs recurrent";
    EXPECT_LT(es_c, c.chunk_state_bound) << "final state vs chunked";
    EXPECT_LT(es_r, c.chunk_state_bound) << "final state vs recurrent";
    worst.chunk_out = std::max({worst.chunk_out, eo_c, eo_r});
    worst.chunk_state = std::max({worst.chunk_state, es_c, es_r});
  }
}

}  // namespace

// Every case of the table through both kernels (the chunked one where it takes the head dims):
// the Qwen3.6-27B heads (Hk 16, Hv 48, d 128) at lengths around the chunk size and packed batches,
// head ratios 1..3, dk / dv 64, ragged and large dk (recurrent only), empty sequences, strided v
// rows, long sequences with slow decay (the state carries information over many chunks).
TEST(CudaDeltaRule, ChunkedAndRecurrentMatchCpu) {
  DFLASH_REQUIRE_GPU();
  Worst worst;
  uint64_t seed = 7001;
  for (const cases::RuleCase& c : cases::rule_check_cases()) check_case(c, seed++, worst);
  std::printf("gated delta rule: worst normalised error vs CPU: chunked out %.3g state %.3g, recurrent out %.3g "
              "state %.3g\n", worst.chunk_out, worst.chunk_state, worst.rec_out, worst.rec_state);
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

// Timings only (never asserts on time): kernel_bench's gdn shapes (the table's perf cases, Qwen3.6-27B
// heads) through the chunked kernel's variants; TFLOP/s and TB/s from RuleCase::flops() / bytes()
// (kernel_bench's counts).
TEST(CudaDeltaRule, ChunkedTimings) {
  DFLASH_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  auto stream = static_cast<cudaStream_t>(DeviceContext::get(0).stream());
  std::printf("  %-14s %-10s %9s %9s %9s\n", "shape", "variant", "ms", "TFLOP/s", "TB/s");
  for (const cases::RuleCase& c : cases::rule_perf_cases(false)) {
    const cases::RuleData data = cases::draw(c, 99);
    Tensor out = Tensor::empty({c.N(), c.Hv, c.dv}, DType::BF16, gpu);
    const cuda::DeltaRuleParams p = data.params(out.raw_data(), nullptr);
    const double flops = c.flops(), bytes = c.bytes();
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
      std::printf("  %-14s %-10s %9.4f %9.1f %9.2f\n", c.shape.c_str(), names[vi], med, flops / (med * 1e-3) / 1e12,
                  bytes / (med * 1e-3) / 1e12);
    }
  }
}
