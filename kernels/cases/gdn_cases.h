#pragma once
// The GatedDeltaNet op cases (see op_cases.h): causal_conv1d and gdn_prep (kernels/cuda/gdn_conv.cu),
// the chunked and token-recurrent delta rule (gdn_chunk.cu, gdn_recurrent.cu), and the decode
// twins causal_conv1d_update and gated_delta_rule_pool (gdn_decode.cu). Per op: a Case (shape,
// draw, bounds, amounts), Data (the drawn device inputs) with params() — the one place the launch
// struct is filled — and reference() (the CPU op on host copies of the same inputs), the variants,
// and two tables: *_check_cases() for the gpu tests, *_perf_cases(quick) for kernel_bench.
#include <string>
#include <vector>

#include "kernels/cases/op_cases.h"
#include "kernels/cuda/conv.h"
#include "kernels/cuda/gdn.h"

// Tuning knobs and test hooks defined in the kernel files, swept by the check tables and kernel_bench.
namespace dflash::cuda {
namespace tuning {
extern int conv_tokens_per_thread;     // gdn_conv.cu: the fast conv's tokens per thread
extern int prep_blocks;                // gdn_conv.cu: gdn_prep's persistent grid
extern int recurrent_rows_per_thread;  // gdn_recurrent.cu
extern int gdn_pool_warps;             // gdn_decode.cu: warps per CTA of the fast pool kernel
extern int gdn_pool_cg;                // gdn_decode.cu: its column groups per warp
}  // namespace tuning
// gdn_chunk.cu's hook for variants and timing breakdowns: 2 = skip the prep kernel, 4 = skip the
// state kernel, 8 = two input stages in the state kernel (instead of three), 16 = 32-column
// state-kernel slices (instead of 64), 64 = one prep CTA per value head (instead of per key head),
// 128 = the state kernel as a programmatic dependent launch of prep; 0 is the full op.
void chunk_gated_delta_rule_variant(const DeltaRuleParams& p, Stream s, int flags);
}  // namespace dflash::cuda

namespace dflash::cases {

// ---- causal_conv1d: depthwise causal conv over packed sequences, bf16 in / out -------------------
struct ConvCase {
  std::string shape = {};      // kernel_bench's shape label ("" in check tables: describe())
  std::vector<int64_t> lens = {};  // tokens per sequence
  int64_t C = 0, K = 4;
  int64_t ldx = 0;             // x row stride (0: C)
  int64_t col0 = 0;            // x = the columns [col0, col0 + C) of rows of ldx (ldx >= col0 + C)
  bool silu = true;
  std::vector<int64_t> parts = {};  // perf: also timed as separate convs over these channel widths (sum C)
  std::vector<int> runs = {0}; // check: the fast kernel's tokens per thread swept (0 = automatic)
  // y (both variants) against the f32 CPU conv: f32 taps in the reference's order, one bf16
  // rounding (<= 2^-9 of the largest output); fast == fallback bit for bit.
  static constexpr double y_bound = 1e-2;

  int64_t N() const;
  int64_t row() const { return ldx > 0 ? ldx : C; }
  double bytes() const;  // read x + write y + read w
  std::string describe() const;
  bool fast_ok() const;  // causal_conv1d_fast takes it (C % 8, K <= 4, 16-byte aligned rows / columns)
};
extern const Variant<cuda::ConvParams> kConvFast, kConvFallback;

struct ConvData {
  ops::SeqOffsets seqs;
  std::vector<Tensor> x;  // device bf16 [N, row], one per set (perf rotates over them)
  Tensor w, cu;           // device bf16 [C, K]; int32 [S + 1]
  // The conv of set `set`'s x (channels [c0, c0 + width) of the case's, all by default) into y.
  cuda::ConvParams params(const ConvCase& c, void* y, int set = 0, int64_t c0 = 0, int64_t width = -1) const;
  Tensor reference(const ConvCase& c) const;  // host f32 [N, C] from x[0]
};
ConvData draw(const ConvCase& c, uint64_t seed, int sets = 1);
std::vector<ConvCase> conv_check_cases();
std::vector<ConvCase> conv_perf_cases(bool quick);

// ---- gdn_prep: l2norm + scale of q / k, the gates g / beta -------------------------------------
struct PrepCase {
  int64_t N = 0, Hk = 0, Hv = 0, dk = 0, dv = 0;
  std::vector<int> blocks = {0, 1, 3};  // check: persistent grid sizes swept (0 = automatic); same bits
  // q / k: l2norm in f32, one bf16 rounding (2^-9 of the largest); g / beta: f32 on both sides
  // (expf / log1pf vs std::exp / log1p, a few ulp).
  static constexpr double qk_bound = 1e-2, gate_bound = 1e-5;

  int64_t conv_dim() const { return 2 * Hk * dk + Hv * dv; }
  int64_t ld_ab() const { return 2 * Hv + 5; }  // a at column 0, b at column Hv + 3 of wider rows
  float scale() const;
  std::string describe() const;
};
struct PrepOutputs {
  Tensor q, k, g, beta;  // [N, Hk, dk] x 2, [N, Hv] x 2 (device: bf16, bf16, f32, f32; reference: f32)
};
struct PrepData {
  Tensor conv, ab, A_log, dt_bias;  // device bf16 [N, conv_dim], [N, ld_ab], [Hv], [Hv]
  PrepOutputs poisoned_outputs(const PrepCase& c) const;
  cuda::GdnPrepParams params(const PrepCase& c, PrepOutputs& out) const;
  PrepOutputs reference(const PrepCase& c) const;
};
PrepData draw(const PrepCase& c, uint64_t seed);
std::vector<PrepCase> prep_check_cases();

// ---- the per-token inputs of the delta rule (prefill and decode) --------------------------------
struct TokenDraw {
  bool normalized = true;           // q, k as gdn_prep leaves them; else N(0, q_std), N(0, k_std)
  float q_std = 1.0f, k_std = 1.0f;
  int64_t v_col0 = 8, v_extra = 24; // v = columns [v_col0, v_col0 + Hv dv) of rows Hv dv + v_extra long
  float v_std = 1.0f;
  float g_lo = -0.4f, g_hi = -0.001f, beta_lo = 0.02f, beta_hi = 0.98f;
};
struct Tokens {
  ops::SeqOffsets seqs;
  int64_t Hk = 0, Hv = 0, dk = 0, dv = 0, ldv = 0, v_col0 = 0;
  Tensor q, k, v_rows, g, beta, cu;  // device: bf16 [N, Hk, dk] x 2, bf16 [N, ldv], f32 [N, Hv] x 2, int32
  const void* v() const;             // the first v element of token 0
  ops::DeltaRuleParams host() const; // host f32 copies, l2norm_qk = false, scale = 1
};

// ---- chunk_gated_delta_rule (fast) + recurrent_gated_delta_rule (fallback) ----------------------
struct RuleCase {
  std::string shape = {};  // kernel_bench's shape label
  std::vector<int64_t> lens = {};
  int64_t Hk = 0, Hv = 0, dk = 0, dv = 0;
  bool init = false;    // an initial state N(0, init_std)
  float init_std = 0.3f;
  TokenDraw in = {};
  std::vector<int> rows_per_thread = {0};  // check: the recurrent kernel's rows per thread swept
  std::vector<int> chunk_flags = {0};      // check: chunk_gated_delta_rule_variant flags swept
  // out: one bf16 rounding of the output (<= 2^-9) after bf16 tensor-core operands (chunk);
  // final state: chunk rounds every tensor-core operand to bf16 (a few 1e-3), the recurrent one is
  // f32 in another summation order (~1e-6).
  static constexpr double out_bound = 2e-2, chunk_state_bound = 1e-2, recurrent_state_bound = 1e-3;

  int64_t N() const;
  // Dense-equivalent chunked form, C = 64, per value head and token: 8·C·d + 6·d² (K Kᵀ, Q Kᵀ,
  // the triangular solves, W S, Q S, the state update); bytes: q, k, v, out bf16 and g, beta f32
  // once each, no states.
  double flops() const;
  double bytes() const;
  std::string describe() const;
  bool chunk_ok() const;  // chunk_gated_delta_rule takes these head dims on this GPU
};
extern const Variant<cuda::DeltaRuleParams> kChunkFast, kRecurrentFallback;

struct RuleData {
  Tokens t;
  Tensor init;  // device f32 [S, Hv, dk, dv] or undefined
  cuda::DeltaRuleParams params(void* out, float* final_state) const;
  struct Ref {
    Tensor out, state;  // host f32 [N, Hv, dv], [S, Hv, dk, dv]
  };
  Ref reference(ops::DeltaRuleAlgo algo) const;
};
RuleData draw(const RuleCase& c, uint64_t seed);
std::vector<RuleCase> rule_check_cases();
std::vector<RuleCase> rule_perf_cases(bool quick);

// ---- causal_conv1d_update: the conv of decode / verify tokens on a pool of conv states ---------
struct ConvUpdateCase {
  std::string shape = {};
  std::vector<int64_t> lens = {};
  int64_t C = 0, K = 4, ldx = 0;  // ldx 0: C
  bool silu = true, update = true;
  int64_t spare = 3;              // unused pool slots between the used ones (check)
  // y as causal_conv1d's; the new state is a copy of bf16 inputs: exact; fast == fallback bit for bit.
  static constexpr double y_bound = 1e-2;

  int64_t N() const;
  int64_t row() const { return ldx > 0 ? ldx : C; }
  double bytes() const;  // state read + write, x read + y write
  std::string describe() const;
  bool fast_ok() const;
};
extern const Variant<cuda::ConvUpdateParams> kConvUpdateFast, kConvUpdateRuns, kConvUpdateFallback;

struct ConvUpdateData {
  ops::SeqOffsets seqs;
  SlotLayout layout;
  Tensor x, w, cu, slots;  // device bf16 [N, row], [C, K]; int32 [S + 1], [sets * S]
  Tensor state0;           // device bf16 [pool, K - 1, C]
  cuda::ConvUpdateParams params(const ConvUpdateCase& c, void* y, void* state, int64_t set = 0) const;
  struct Ref {
    Tensor y, state;  // host f32 [N, C], [pool, K - 1, C]
  };
  Ref reference(const ConvUpdateCase& c) const;  // slot set 0
};
ConvUpdateData draw(const ConvUpdateCase& c, uint64_t seed, int64_t sets = 1);
std::vector<ConvUpdateCase> conv_update_check_cases();
// kernel_bench's decode shape: B sequences of T tokens, the 27B q|k|v channels (C 10240, K 4)
// strided as the in-projection's output (ldx 16480).
ConvUpdateCase conv_update_perf_case(int64_t B, int64_t T);
// A chunked-prefill step of the same channels: B - 1 decode rows and one prompt piece of T tokens.
ConvUpdateCase conv_update_piece_perf_case(int64_t B, int64_t T);

// ---- gated_delta_rule_pool: the delta rule of decode / verify tokens on a pool of states --------
struct PoolCase {
  std::string shape = {};
  std::vector<int64_t> lens = {};
  int64_t Hk = 0, Hv = 0, dk = 0, dv = 0;
  TokenDraw in = {};
  float state_std = 0.3f;
  int64_t spare = 3;
  // {warps per CTA, column groups per warp} of the fast kernel swept in check mode (0 = automatic).
  std::vector<std::pair<int, int>> fast_knobs = {{0, 0}, {1, 2}, {2, 4}, {4, 8}, {1, 8}, {4, 2}, {2, 0}};
  // As the recurrent kernel's: out one bf16 rounding; the f32 state another summation order.
  static constexpr double out_bound = 2e-2, state_bound = 1e-3;

  int64_t N() const;
  double state_bytes() const;  // one read of the batch's states
  std::string describe() const;
  bool fast_ok() const;
};
extern const Variant<cuda::DeltaRulePoolParams> kPoolFast, kPoolFallback;

struct PoolData {
  Tokens t;
  SlotLayout layout;
  Tensor slots, pool0;  // int32 [sets * S]; device f32 [pool, Hv, dk, dv]
  cuda::DeltaRulePoolParams params(float* state, void* out, bool update, int64_t set = 0) const;
  struct Ref {
    Tensor out, pool;  // host f32 [N, Hv, dv], [pool, Hv, dk, dv]
  };
  Ref reference(bool update) const;  // slot set 0
};
PoolData draw(const PoolCase& c, uint64_t seed, int64_t sets = 1);
std::vector<PoolCase> pool_check_cases();
// kernel_bench's decode shape: B sequences of T tokens, Qwen3.6-27B heads.
PoolCase pool_perf_case(int64_t B, int64_t T);

// ---- gdn_decode_fused: the decode / verify chain of one layer (conv update .. gated RMSNorm) ----
// Variants: "fused" (gdn_decode_fused) and "unfused" (causal_conv1d_update_fast, gdn_prep,
// gated_delta_rule_pool_fast, gated_rms_norm: the twin the fused kernel equals bit for bit). The
// reference: the CPU ops on the GPU's roundings (bf16 conv outputs, q / k, core).
struct ChainCase {
  std::string shape = {};
  std::vector<int64_t> lens = {};  // tokens per sequence, <= 16
  int64_t Hk = 0, Hv = 0, dk = 128, dv = 128, K = 4;
  bool update = true;              // decode (states advance) or verify (read only, saved inputs written)
  int64_t spare = 2;
  int64_t pad = 8;                 // extra columns of each in-projection row (a multiple of 8)
  bool fp8_out = false;            // out as out_proj's FP8 input (codes + scales over rows() rows); twin:
                                   // gated_rms_norm_quant_fp8 in place of gated_rms_norm
  // out after the bf16 roundings of both sides (a few 2^-9); states: the pool kernel's bounds.
  static constexpr double out_bound = 3e-2, state_bound = 1e-3;

  int64_t N() const;
  int64_t rows() const { return (N() + 15) / 16 * 16; }  // fp8_out: the decode step's padded rows
  int64_t C() const { return 2 * Hk * dk + Hv * dv; }
  int64_t V() const { return Hv * dv; }
  int64_t P() const { return (C() + V() + 2 * Hv + 7) / 8 * 8 + pad; }  // 16-byte rows (pad: a multiple of 8)
  double bytes() const;  // states read (+ written), the in-projection rows read, out written
  std::string describe() const;
  bool fused_ok() const;
};
struct ChainData {
  ops::SeqOffsets seqs;
  SlotLayout layout;
  Tensor proj, conv_w, A_log, dt_bias, norm_w;  // device bf16 [N, P], [C, K], [Hv], [Hv], [dv]
  Tensor conv_state0, state0;                   // device bf16 [pool, K-1, C], f32 [pool, Hv, dk, dv]
  Tensor cu, slots;
  struct Outputs {  // device; states start as copies of the drawn pools, the rest poisoned
    Tensor out, conv_state, state, conv, q, k, g, beta, core;
    Tensor out_q, out_scale;  // fp8_out: e4m3 [rows, V], f32 [fp8_act_scale_elems(rows, V)]
  };
  Outputs outputs(const ChainCase& c) const;
  cuda::GdnDecodeFusedParams fused_params(const ChainCase& c, Outputs& o, int64_t set = 0) const;
  // The twin; with fp8_out it writes out_q / out_scale instead of out (gated_rms_norm_quant_fp8 over
  // the N real rows: scale layout fp8_act_scale_ld(N)).
  void run_unfused(const ChainCase& c, Outputs& o, cuda::Stream s, int64_t set = 0) const;
  struct Ref {
    Tensor out, conv_state, state;  // host f32 [N, V], [pool, K-1, C], [pool, Hv, dk, dv]
  };
  Ref reference(const ChainCase& c) const;  // slot set 0
};
ChainData draw(const ChainCase& c, uint64_t seed, int64_t sets = 1);
std::vector<ChainCase> chain_check_cases();
// kernel_bench's decode shape: B sequences of T tokens, Qwen3.6-27B heads (Hk 16, Hv 48, K 4).
ChainCase chain_perf_case(int64_t B, int64_t T, bool update);

}  // namespace dflash::cases
