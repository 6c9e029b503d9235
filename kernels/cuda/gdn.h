#pragma once
// GatedDeltaNet family: the post-conv preparation and the gated delta rule, prefill (chunked tensor
// cores, recurrent fallback) and its decode / verify twin on a state pool (kernels/cuda/gdn_*.cu).
// CPU reference: ops::gdn_gates, ops::l2norm_inplace, ops::gated_delta_rule, ops::gated_delta_rule_pool.
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// ---- Prefill ---------------------------------------------------------------------------------------
// Post-conv preparation: from the conv output [N, conv_dim = 2*Hk*dk + Hv*dv] (row stride ld_conv)
// writes q = l2norm(q) · scale and k = l2norm(k) (eps 1e-6) as contiguous bf16 [N, Hk, dk], and
// g = -exp(A_log) · softplus(a + dt_bias), beta = sigmoid(b) as fp32 [N, Hv], from the a / b
// columns of the in-projection output (row stride ld_ab). A_log, dt_bias: bf16 [Hv].
struct GdnPrepParams {
  const void* conv = nullptr;
  int64_t ld_conv = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  int64_t ld_ab = 0;
  const void* A_log = nullptr;
  const void* dt_bias = nullptr;
  void* q = nullptr;
  void* k = nullptr;
  float* g = nullptr;
  float* beta = nullptr;
  int64_t N = 0, Hk = 0, Hv = 0, dk = 0;
  float scale = 0.0f;
};
void gdn_prep(const GdnPrepParams& p, Stream s);

// The per-token inputs of every gated delta rule (prefill and pool), the first fields of both
// parameter structs (no padding after them: the kernels that take a struct by value see the layout
// of one flat struct).
struct DeltaRuleTokens {
  const void* q = nullptr;  // [N, Hk, dk] bf16
  const void* k = nullptr;  // [N, Hk, dk] bf16
  const void* v = nullptr;  // rows strided: v of token n, head h at v + n*ldv + h*dv
  int64_t ldv = 0;
  const float* g = nullptr;     // [N, Hv]
  const float* beta = nullptr;  // [N, Hv]
};

// Gated delta rule on prepared (normalised, q pre-scaled) q/k, per sequence and value head h with
// key head h / (Hv / Hk):  S = exp(g_t) S;  S += k_t (beta_t (v_t - Sᵀ k_t))ᵀ;  o_t = Sᵀ q_t.
// State fp32 [num_seqs, Hv, dk, dv]; initial_state / final_state optional (null).
struct DeltaRuleParams : DeltaRuleTokens {
  const float* initial_state = nullptr;
  float* final_state = nullptr;
  void* out = nullptr;  // [N, Hv, dv] bf16
  const int32_t* cu_seqlens = nullptr;
  int64_t num_seqs = 0, N = 0, Hk = 0, Hv = 0, dk = 0, dv = 0;
};
// Chunked (64 tokens, WY / UT form) on tensor cores, fp32 state. Supports dk = dv = 128 (and 64).
void chunk_gated_delta_rule(const DeltaRuleParams& p, Stream s);
bool chunk_gated_delta_rule_supported(int64_t dk, int64_t dv, int sm_major);
// Token-recurrent, one block per (sequence, value head, dv slice); any dk, dv.
void recurrent_gated_delta_rule(const DeltaRuleParams& p, Stream s);

// ---- Decode / verify (conventions in launch.h) -----------------------------------------------------
// Gated delta rule on a state pool (fp32 [num_slots, Hv, dk, dv]): per sequence, its tokens in
// order from its slot's state, S = exp(g_t) S; S += k_t (beta_t (v_t - Sᵀk_t))ᵀ; o_t = Sᵀ q_t.
// q / k prepared as in DeltaRuleParams (gdn_prep's output: q l2-normalised and scaled, k normalised;
// bf16 [N, Hk, dk]); value head h reads key head h / (Hv / Hk). out [N, Hv, dv] bf16 or null (no
// output: re-running accepted tokens at commit time). update_state: the state after the sequence's
// last token is written back to its slot; false leaves the pool untouched (verify; the rollback
// scheme re-runs the accepted tokens later with update_state = true).
struct DeltaRulePoolParams : DeltaRuleTokens {
  float* state = nullptr;       // [num_slots, Hv, dk, dv] fp32
  const int32_t* slots = nullptr;
  void* out = nullptr;          // [N, Hv, dv] bf16, nullable
  const int32_t* cu_seqlens = nullptr;
  int64_t num_seqs = 0, N = 0, Hk = 0, Hv = 0, dk = 0, dv = 0, num_slots = 0;
  bool update_state = true;
};
// Memory bound: each (slot, head, dv slice) state is read once per call into registers, kept there
// across the sequence's tokens, and written once (only with update_state); dv is split across CTAs
// so that small batches still fill the GPU. Supports dk in {64, 128, 256}, dv % 8 == 0, sm >= 80.
void gated_delta_rule_pool_fast(const DeltaRulePoolParams& p, Stream s);
bool gated_delta_rule_pool_fast_supported(int64_t dk, int64_t dv, int sm_major);
// Plain kernel for any dk (<= 1024) and dv: the state tile in shared memory, the formula as written.
void gated_delta_rule_pool_fallback(const DeltaRulePoolParams& p, Stream s);
// "register-resident" or "fallback" for these head dims on an sm_major device.
const char* gated_delta_rule_pool_kernel_name(int64_t dk, int64_t dv, int sm_major);

// ---- Fused decode / verify chain and fused commit (issue 30; kernels/cuda/gdn_fused.cu) ------------
// One kernel per layer for a decode / verify step: from the in-projection output, per sequence and
// value head, the conv update (conv.h's causal_conv1d_update_fast on this head's q | k | v
// channels), the gates and q / k l2norm (gdn_prep), the gated delta rule on the slot's state
// (gated_delta_rule_pool_fast) and the gated RMSNorm with z (norm.h's gated_rms_norm), each with its
// unfused twin's device arithmetic, so the chain's outputs, states and saved inputs equal the
// unfused kernels' bit for bit (tests/test_cuda_decode.cpp). A thread-block cluster of the Hv / Hk
// value heads that share a key head computes that key head's q / k; its first block writes them
// (and their conv state) once. Launched with programmatic dependent launch where enabled (pdl.cuh):
// the recurrent state is read before the wait for the in-projection.
// Serves dk = dv = 128, conv kernel size 1..4, Hv / Hk <= 8, at most 16 tokens per sequence.
struct GdnDecodeFusedParams {
  const void* proj = nullptr;  // [rows, ldp] bf16: conv input q|k|v [0, C), z [C, C+V), b [C+V, +Hv), a [C+V+Hv, +Hv)
  int64_t ldp = 0;
  const void* conv_w = nullptr;   // [C, K] bf16
  const void* A_log = nullptr;    // [Hv] bf16
  const void* dt_bias = nullptr;  // [Hv] bf16
  const void* norm_w = nullptr;   // [dv] bf16 (the gated RMSNorm's weight)
  void* conv_state = nullptr;     // [num_slots, K-1, C] bf16
  float* state = nullptr;         // [num_slots, Hv, dk, dv] fp32
  const int32_t* slots = nullptr;       // [num_seqs]
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1] over the real tokens
  int64_t num_seqs = 0, N = 0, Hk = 0, Hv = 0, dk = 0, dv = 0, K = 0, num_slots = 0;
  int64_t max_new = 0;            // every sequence's T <= max_new <= 16 (the caller knows it on the host)
  float scale = 0.0f;             // q scale (1 / sqrt(dk))
  float eps = 0.0f;               // the gated RMSNorm's eps
  bool update_state = true;       // decode: conv and recurrent states advance; verify: read only
  void* out = nullptr;            // [rows, ldo] bf16: the gated RMSNorm's output (out_proj's input), real rows only
  int64_t ldo = 0;
  // Or (FP8 out_proj, instead of out) out_proj's quantized input as gated_rms_norm_quant_fp8 writes it
  // for rows: codes [rows, ldq] e4m3 and scale[g * lds + m] per 128-column group g = value head, the
  // real rows' values bit for bit those of gated_rms_norm_quant_fp8; the pad rows [N, rows) get zero
  // codes and the scales of rows [N, lds) are 1 (the last sequence's blocks write them).
  uint8_t* out_q = nullptr;
  int64_t ldq = 0;
  float* out_scale = nullptr;
  int64_t lds = 0;                // fp8_act_scale_ld(rows)
  int64_t rows = 0;               // the batch's rows (>= N; the GEMM's M)
  // What commit re-runs (a verify's saved inputs), written when non-null (all or none):
  void* conv_out = nullptr;       // [rows, C] bf16 (the conv outputs)
  void* q = nullptr;              // [rows, Hk, dk] bf16 (prepared)
  void* k = nullptr;
  float* g = nullptr;             // [rows, Hv]
  float* beta = nullptr;
};
bool gdn_decode_fused_supported(int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t K);
void gdn_decode_fused(const GdnDecodeFusedParams& p, Stream s);

// Commit (rollback scheme, decode.h): the conv update and the delta rule of the n accepted tokens of
// one slot in every GatedDeltaNet layer, from a verify's saved inputs, in one kernel (the conv
// states take the last K-1 rows of [state; x], the recurrent states run the pool kernel's
// arithmetic): equal bit for bit to causal_conv1d_update_fast + gated_delta_rule_pool_fast with
// update_state per layer. The layer table travels as the kernel's parameter (graph-capturable).
inline constexpr int kCommitMaxLayers = 64;
struct GdnCommitLayer {
  void* conv_state = nullptr;  // [num_slots, K-1, C] bf16
  float* state = nullptr;      // [num_slots, Hv, dk, dv] fp32
  const void* x = nullptr;     // the accepted tokens' conv inputs, rows ldx apart (the verify's proj rows)
  const void* q = nullptr;     // [n, Hk, dk] bf16, prepared (unused by the state update, kept for symmetry: null allowed)
  const void* k = nullptr;     // [n, Hk, dk] bf16
  const void* v = nullptr;     // rows ldv apart, value head h at h * dv
  const float* g = nullptr;    // [n, Hv]
  const float* beta = nullptr; // [n, Hv]
};
struct GdnCommitParams {
  GdnCommitLayer layers[kCommitMaxLayers];
  int num_layers = 0;
  const int32_t* slot = nullptr;  // device: the slot (one sequence)
  int n = 0;                      // accepted tokens, 1..16
  int64_t ldx = 0, ldv = 0, C = 0, K = 0, Hk = 0, Hv = 0, dk = 0, dv = 0, num_slots = 0;
};
void gdn_commit_fused(const GdnCommitParams& p, Stream s);

}  // namespace dflash::cuda
