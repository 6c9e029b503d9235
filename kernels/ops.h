#pragma once
// The CPU reference of every op family: plain parameter structs or tensors, validated once here
// (shapes, dtypes, devices: a wrong one throws naming the op), then `cpu::` runs it in fp32 (fp64
// for the drafter's training ops, kernels/cpu/train_ops.h): simple, obviously right, the oracle for
// every test and the backend of the whole pipeline on a machine without a GPU.
//
// There is no Tensor-level dispatch to CUDA behind these entry points, on purpose: the CUDA models
// (target_model/model_cuda, drafter/model_cuda) call the raw-pointer launchers of kernels/cuda/<family>.h
// directly, because they fuse neighbouring ops, pass strided views of buffers planned once (row
// strides into fused projections) and choose kernels by the fast-path plan, none of which a
// Tensor-in / Tensor-out call can express without copies, allocations or checks on the hot path. What pairs each CUDA
// launcher with its reference here is the table of op cases (kernels/cases/op_cases.h), which the
// gpu tests run in check mode and kernel_bench in perf mode.
//
// Layout conventions (row-major, "packed" = tokens of all sequences back to back):
//   activations [N, D] with N = total tokens; per-head tensors [N, H, d];
//   sequence boundaries as host offsets {0, len0, len0+len1, ...} (like HDF5 /offsets).
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace dflash::ops {

// Sequence boundaries of a packed batch: offsets.front() == 0, offsets.back() == N, non-decreasing.
struct SeqOffsets {
  std::vector<int64_t> offsets;
  int64_t num_sequences() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t total_tokens() const { return offsets.empty() ? 0 : offsets.back(); }
  void validate(int64_t n_tokens, const char* op) const;
};

// y[M, N] = x[M, K] · w[N, K]^T (+ y when accumulate). w is in Hugging Face Linear layout.
void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate = false);

enum class RmsNormKind {
  ZeroCentered,  // x̂ · (1 + w)   (Qwen3.5 decoder norms, q_norm, k_norm)
  Plain,         // x̂ · w
};
// y[M, D] = rmsnorm over the last dim of x[M, D]; x and y may alias. Rows of any view [.., D].
void rms_norm(const Tensor& x, const Tensor& w, float eps, RmsNormKind kind, Tensor& y);
// GatedDeltaNet output norm: y = (x̂ · w) · silu(z), per row of D (D = value head dim). Plain w.
void gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& w, float eps, Tensor& y);

// y[M, N] = silu(gate[M, N]) * up[M, N]
void swiglu(const Tensor& gate, const Tensor& up, Tensor& y);
// x[M, N] *= sigmoid(gate[M, N]) in place.
void sigmoid_gate_inplace(Tensor& x, const Tensor& gate);
// y = a + b (same shapes); y may alias a or b.
void add(const Tensor& a, const Tensor& b, Tensor& y);
// y[N, D] = table[ids[n], :]; ids are int32 and each must be < table rows (checked, named).
void embedding(const Tensor& ids, const Tensor& table, Tensor& y);

// Causal depthwise conv over time, channel-last: y[t, c] = act(sum_j w[c, j] · x[t - K + 1 + j, c])
// with zeros before each sequence start. x, y [N, C]; w [C, K]. silu optional.
void causal_conv1d(const Tensor& x, const Tensor& w, const SeqOffsets& seqs, bool silu, Tensor& y);

// Neox-style rotary embedding on the first `rotary_dim` dims of each head, in place.
// x [N, H, D]; position of token n = n - offsets[s] for its sequence s (+ position_offset).
void rope_neox_inplace(Tensor& x, const SeqOffsets& seqs, int64_t rotary_dim, double theta,
                       int64_t position_offset = 0);

// Causal softmax attention with GQA (query head h reads kv head h / (Hq / Hkv)).
// q [N, Hq, D], k/v [N, Hkv, D], out [N, Hq, D]; each sequence attends only within itself.
void causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, const SeqOffsets& seqs,
                      float scale, Tensor& out);

// GatedDeltaNet gates: g = -exp(A_log) · softplus(a + dt_bias), beta = sigmoid(b).
// a, b [N, Hv]; A_log, dt_bias [Hv]; g, beta [N, Hv] (f32).
void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, Tensor& g,
               Tensor& beta);

// Per-row L2 normalisation x / sqrt(sum x^2 + eps) over the last dim, in place ([.., D]).
void l2norm_inplace(Tensor& x, float eps = 1e-6f);

enum class DeltaRuleAlgo { Chunked, Recurrent };
// Gated delta rule (GatedDeltaNet core), per sequence and value head h with key head
// kh = h / (Hv / Hk) (grouped value attention, no repeated q/k in memory):
//   S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T (scale q_t)
// with S in f32 [dk, dv]. When l2norm_qk, q and k are L2-normalised (eps 1e-6) first.
struct DeltaRuleParams {
  Tensor q, k;             // [N, Hk, dk]
  Tensor v;                // [N, Hv, dv]
  Tensor g, beta;          // [N, Hv]  (log-decay <= 0, and the write strength)
  Tensor initial_state;    // optional [S, Hv, dk, dv] f32 (S = number of sequences)
  float scale = 0.0f;      // 0 means 1/sqrt(dk)
  bool l2norm_qk = true;
  int64_t chunk_size = 64; // Chunked only
};
// out [N, Hv, dv]; final_state optional [S, Hv, dk, dv] f32 (pass an undefined Tensor to skip).
void gated_delta_rule(const DeltaRuleParams& p, const SeqOffsets& seqs, DeltaRuleAlgo algo, Tensor& out,
                      Tensor* final_state = nullptr);

// ---- mixture of experts (qwen3_5_moe's sparse MoE block, transformers 5.17's order of ops) --------
// Routing of N tokens over E experts:
//   logits [N, E] = x [N, H] · router [E, H]ᵀ (f32);  p = softmax over E (f32);
//   experts [N, k] = the k largest p, largest first (ties: the lower expert index first);
//   weights [N, k] = those p, divided by their sum when renormalize (qwen3_5_moe always does).
struct MoeRouting {
  Tensor experts;  // [N, k] i32, each in [0, E)
  Tensor weights;  // [N, k] f32
  Tensor logits;   // [N, E] f32, the router logits
};
// Fills `r` (its tensors allocated here).
void moe_route(const Tensor& x, const Tensor& router, int64_t top_k, bool renormalize, MoeRouting& r);
// The same from given logits [N, E] f32 (r.logits is a copy of them): the softmax and top-k alone.
void moe_route_logits(const Tensor& logits, int64_t top_k, bool renormalize, MoeRouting& r);
// The routed experts' SwiGLU, weighted and summed per token:
//   y[n] = sum over j of weights[n, j] · down[e] · (silu(g) * u),  [g | u] = gate_up[e] · x[n],  e = experts[n, j]
// gate_up [E, 2I, H] (per expert [gate (I) | up (I)] rows), down [E, H, I], x / y [N, H] (y overwritten).
// Each token's terms are added in ascending expert order onto zero, as transformers' loop over the
// experts hit (index_add_) adds them.
// Expert parallelism: gate_up / down hold experts [expert_begin, expert_begin + E) of num_experts
// (0: E, the whole model); choices of the other experts are skipped (another rank runs them), so
// y is this shard's share of the sum. Returns the (token, expert) pairs this shard ran.
// fp8_act (W8A8 block FP8, MoeWeights::fp8): each token's x and each SwiGLU output row are quantized
// per 1 x 128 group (fake_quantize_fp8_act's values) before their products, as FP8 MoE kernels do.
int64_t moe_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down, const MoeRouting& r, Tensor& y,
                    int64_t expert_begin = 0, int64_t num_experts = 0, bool fp8_act = false);
// y[n, :] += sigmoid(gate[n, 0]) · x[n, :] (the shared expert behind its gate). y, x [N, D]; gate [N, 1].
void add_sigmoid_gated(const Tensor& x, const Tensor& gate, Tensor& y);

// ---- decode / verify (speculative decoding) ---------------------------------------------------
// All of these work on a state pool of P slots: a batch of S sequences, sequence s in slot
// slots[s] (each < P; distinct when the op updates the pool), bringing T_s >= 0 new tokens packed
// back to back (seqs: {0, T_0, T_0 + T_1, ..., N}). T = 1 is decode, T = 2..16 verify.

// Causal conv over the new tokens of each sequence, continuing from its state. conv_state
// [P, K-1, C] holds the last K-1 conv *inputs* of each slot (zeros for a new sequence, which
// equals zero padding before its start). For seq s the window is [state rows ; T_s new rows] and
//   y_t[c] = act(sum_j w[c, j] · window[t + j][c]),  act = silu when asked.
// When update_state, the slot's state becomes the last K-1 rows of the window (also when
// T_s < K-1); otherwise the pool is left untouched. x, y [N, C]; w [C, K].
void causal_conv1d_update(const Tensor& x, const Tensor& w, Tensor& conv_state, const std::vector<int32_t>& slots,
                          const SeqOffsets& seqs, bool silu, bool update_state, Tensor& y);

// The gated delta rule (as gated_delta_rule above; q, k raw, l2norm_qk and scale as there;
// p.initial_state is ignored) over the new tokens of each sequence, starting from its slot's state
// in state_pool [P, Hv, dk, dv] f32. update_state: the state after the sequence's last token is
// written back to its slot; otherwise the pool is read-only (verify: the accepted tokens are run
// again later with update_state = true, which is the rollback scheme). out [N, Hv, dv], or null /
// undefined for no output (re-running accepted tokens at commit time).
void gated_delta_rule_pool(const DeltaRuleParams& p, const SeqOffsets& seqs, Tensor& state_pool,
                           const std::vector<int32_t>& slots, bool update_state, Tensor* out);

// Writes the new tokens' k / v [N, Hkv, d] into the cache pool k_cache / v_cache [P, L, Hkv, d] at
// positions past_len[s] .. past_len[s] + T_s - 1 of slot slots[s] (past_len[s] + T_s <= L).
void kv_cache_append(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                     const std::vector<int32_t>& slots, const std::vector<int64_t>& past_len, const SeqOffsets& seqs);

// Attention of the T_s new queries of each sequence over its slot's KV cache, the new tokens'
// K / V already appended (kv_cache_append). GQA: query head h reads kv head h / (Hq / Hkv).
// Query t of seq s sits at position p = past_len[s] + t; a key at position kp is attended when
//   kp < past_len[s] + T_s  and  (causal ? kp <= p : true)  and  (window > 0 ? kp >= p - (window - 1) : true).
// causal = true is the target; causal = false, window = 0 the drafter's full layer (the block
// attends itself both ways and all the context); causal = true, window > 0 its sliding layer.
// q, out [N, Hq, d]; softmax in f32 with the given scale.
void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const std::vector<int32_t>& slots,
                      const std::vector<int64_t>& past_len, const SeqOffsets& seqs, bool causal, int64_t window,
                      float scale, Tensor& out);

// ---- sampling ------------------------------------------------------------------------------------
// The token choice of decoding: greedy (argmax) and temperature / top-p sampling.

// out[r] = argmax over v of logits[r, v] for host logits [R, V] (f32 or bf16; any float dtype,
// rows may be strided), resized to R. Ties go to the lowest id; NaN entries are never chosen (a row
// without any non-NaN value gives 0). The oracle of cuda::argmax_rows.
void argmax_rows(const Tensor& logits, std::vector<int32_t>& out);

// Temperature / top-p (nucleus) sampling that is reproducible: row r's token is a pure function of
// its logits, the parameters, streams[r] and positions[r] — not of the batch it runs in, the
// thread layout or the device (cuda::sample_rows draws the same numbers). Per row:
//   z_v = logit_v / temperature (f32; NaN entries are never chosen), m = max z, e_v = exp(z_v - m);
//   the nucleus is {v : z_v >= z_c}, z_c the largest z_u with  sum_{z_w >= z_u} e_w >= top_p * sum_w e_w
//   (every token when top_p >= 1; ties at z_c are all kept);
//   the token is the Gumbel-max over the nucleus: argmax of z_v + G_v, G_v = -log(-log(u_v)),
//   u_v = ((rng::bits(seed, streams[r], positions[r] * V + v) >> 8) + 0.5) * 2^-24, in double;
//   ties go to the lowest id.
// That is an exact draw from softmax(z) restricted to the nucleus and renormalized. A decoder passes
// stream = the sequence's id and position = the position whose next token is drawn, so a sequence's
// draws do not depend on what else is decoded with it.
struct SampleParams {
  float temperature = 1.0f;  // > 0 (0 is greedy decoding: argmax_rows)
  float top_p = 1.0f;        // in (0, 1]
  uint64_t seed = 0;
};
// Throws naming the parameter when temperature <= 0 or top_p is outside (0, 1] (or not finite).
void check_sample_params(const SampleParams& p);
// logits: host [R, V] (any float dtype, rows may be strided); streams, positions: [R]; out resized to R.
void sample_rows(const Tensor& logits, const SampleParams& p, const std::vector<uint64_t>& streams,
                 const std::vector<int64_t>& positions, std::vector<int32_t>& out);
// The nucleus threshold z_c of one row of z values (and, in *margin when non-null, how far the
// nucleus mass is from the top_p boundary: min over the two sets next to z_c of |mass/total - top_p|,
// which says how sure a float summation in another order is to pick the same z_c). Tests use it.
float nucleus_threshold(const float* z, int64_t V, float top_p, double* margin = nullptr);

// ---- fp8: block-scaled e4m3 (the official -FP8 checkpoints' format; core/fp8.h) ---------------
// The CPU reference of the FP8 target's GEMMs: what every FP8 CUDA op is tested against.

// A weight [N, K] as e4m3 codes (U8 [N, K]) and one dequantization scale per 128 x 128 block
// (F32 [ceil(N/128), ceil(K/128)], the checkpoints' weight_scale_inv): w ~= e4m3(q) * scale_inv.
struct Fp8Weight {
  Tensor q, scale_inv;
};
// An activation [M, K] as e4m3 codes and one scale per token and 128-column group (F32 [M, ceil(K/128)]).
struct Fp8Act {
  Tensor q, scale;
};
// Quantizes a host float tensor [N, K] (any float dtype): per block scale_inv = max(amax, floor) / 448,
// q = e4m3(clamp(w / scale_inv, +-448)), rounded to nearest even.
Fp8Weight quantize_fp8_weight(const Tensor& w);
// The same per token and 128-column group (dynamic activation quantization), except that the codes
// are e4m3(clamp(x * (1 / scale))): one reciprocal per group instead of a division per element (the
// GPU kernels' arithmetic; it differs from x / scale only where that quotient lies within an f32 ulp
// of an e4m3 rounding boundary).
Fp8Act quantize_fp8_act(const Tensor& x);
// Back to F32 [N, K] / [M, K]: code value times its scale.
Tensor dequantize_fp8(const Fp8Weight& w);
Tensor dequantize_fp8(const Fp8Act& a);
// x [..., K] -> dequantize(quantize_fp8_act(x)) as F32 [..., K]: what the FP8 target's GEMM sees of
// its input (the CPU FP8 target runs its FP8 projections as this times the dequantized weight).
Tensor fake_quantize_fp8_act(const Tensor& x);
// out [M, N] (F32, host) = the product of the two quantized operands, accumulated as an FP8 GEMM
// with block scales does: per 128-column group g the f32 sum of code products, times
// a.scale[m, g] * w.scale_inv[n / 128, g], the groups summed in f32, in order. (Equal to
// dequantize(a) dequantize(w)^T up to f32 summation order.)
void gemm_fp8_blockwise(const Fp8Act& a, const Fp8Weight& w, Tensor& out);

}  // namespace dflash::ops
