#pragma once
// The one memory roofline of the decode benchmarks (issue 30): dflash_eval, generate_bench and
// dflash_doctor state their steps against it, so their figures compare.
//
//   roofline ms = bytes a step must move / the copy bandwidth
//
// Bytes (host code from the configs, no weights loaded; tested on the tiny and 27B configs):
// - weights: every tensor of the target's expected list (expected_tensors) at its stored precision
//   (bf16 on the GPU; at fp8 the is_fp8_projection tensors are 1 byte a value plus their F32
//   [ceil(N/128), ceil(K/128)] block scales), except the embedding table, of which one bf16 row per
//   token is read (a tied lm_head still reads the whole table once). MoE: the router and shared
//   expert in full, and min(E, rows x top-k) of the E experts (the most a step can touch); FP8
//   experts (--fp8-experts) 1 byte a value plus their F32 128 x 128 block scales.
// - state: per sequence and GatedDeltaNet layer the recurrent state (fp32 Hv x dk x dv) and the conv
//   state (bf16 (K-1) x conv_dim), each read once and written once.
// - KV: per sequence and attention layer the bf16 K and V of the context read once, and the step's
//   T new rows written.
// - propose (the drafter): its layer and final-norm weights (bf16), the target's lm_head (bf16,
//   shared), one embedding row per block token, and per layer the bf16 context K / V read once; an
//   FP8 propose (make_cuda_proposer's fp8_propose) reads its projections and the lm_head as e4m3 (1
//   byte a value plus the F32 128 x 128 block scales).
// Bandwidth: copy_bandwidth_gbs (harness.h): the best of 10 device-to-device copies of 1 GiB,
// counting read + write (2 x 1 GiB per copy), measured once per run by the tool that states it, at
// its start, before the model is loaded.
#include <cstdint>
#include <string>

#include "drafter/config.h"
#include "target_model/config.h"

namespace dflash::bench {

struct StepBytes {
  double weights = 0, state = 0, kv = 0;
  double total() const { return weights + state + kv; }
};

// One target step of `seqs` sequences, each bringing `tokens` new rows (1 decode, block verify)
// after `context` tokens already in its KV cache. precision Auto resolves as the config says.
StepBytes target_step_bytes(const target::TargetConfig& c, target::Precision precision, int64_t seqs, int64_t tokens,
                            double context, bool fp8_experts = false);

// One drafter propose of `seqs` sequences (block of dc.block_size tokens each) after `context`
// context tokens in the drafter's K / V cache; lm_head is the target's [V, H] bf16 (tied or not),
// or with fp8 its e4m3 copy, as the projections.
StepBytes propose_bytes(const drafter::DrafterConfig& dc, int64_t seqs, double context, bool fp8 = false);

struct Roofline {
  double copy_gbs = 0;  // read + write GB/s of the best device-to-device copy
  double ms(const StepBytes& b) const { return copy_gbs > 0 ? b.total() / (copy_gbs * 1e6) : 0; }
  // The share of the roofline a step of `measured_ms` reaches (roofline ms / measured ms), 0..1.
  double share(const StepBytes& b, double measured_ms) const { return measured_ms > 0 ? ms(b) / measured_ms : 0; }
};

// "51.25 GB weights + 0.15 GB state + 0.07 GB KV = 51.47 GB" for reports.
std::string describe(const StepBytes& b);

// How the bandwidth is measured, for reports and CSV notes.
inline constexpr const char* kCopyMethod = "best of 10 device-to-device copies of 1 GiB, read + write bytes";

}  // namespace dflash::bench
