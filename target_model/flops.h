#pragma once
// Model FLOPs of the target forward, for TFLOP/s and MFU figures (target_bench, dflash_train).
#include <cstdint>
#include <vector>

#include "target_model/config.h"

namespace dflash::target {

// One forward over sequences of the given lengths: every linear (2 per weight element per token),
// causal attention (QKᵀ and PV: 2·Hq·d·T(T+1) per layer and sequence of T tokens) and the
// delta-rule state math (~7·dk·dv per token and value head: decay, Sᵀk, update, Sᵀq). For a
// tensor-parallel rank divide by tp (every term splits by heads or columns). An MoE block counts
// the weights a token uses (router, its top-k experts, the shared expert and its gate).
// num_layers >= 0 counts layers 0..num_layers-1 only (a forward with ForwardOptions::skip_unused_layers).
double forward_flops(const TargetConfig& c, const std::vector<int64_t>& seq_lens, int64_t num_layers = -1);

}  // namespace dflash::target
