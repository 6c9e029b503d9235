#pragma once
// Launchers of the CUDA kernels of the target forward (bf16 activations and weights, fp32 math,
// fp32 GatedDeltaNet state). Raw pointers and sizes only, as FlashInfer / TensorRT-LLM entry
// points: no Tensor, no CUDA types in this header (bf16 data is `void*`, streams are `void*` =
// cudaStream_t), so host code can include it. Every launcher validates its sizes (throwing
// dflash::Error), enqueues on the stream and checks the launch; none synchronizes.
//
// Conventions: "rows" are tokens of a packed batch (all sequences back to back); `ld*` are row
// strides in elements; cu_seqlens is an int32 device array {0, len0, len0+len1, ..., N}.
// "fast" kernels are the ones the fast-path plan selects; "fallback" kernels are simple, correct
// for every shape and architecture, and only run when chosen on purpose.
#include <cstdint>

namespace dflash::cuda {

using Stream = void*;

// ---- GEMM (cuBLASLt) ----------------------------------------------------------------------------
// y[M, N] (row stride ldy) = x[M, K] (row stride ldx) · w[N, K]^T  (+ y when accumulate)
// bf16 inputs, fp32 accumulation, bf16 output. w is the Hugging Face Linear weight, row-major.
// Uses the device's DeviceContext (stream, cuBLASLt handle, workspace); algorithms are cached per
// shape. M == 0 is a no-op.
struct GemmParams {
  const void* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;
  void* y = nullptr;
  int64_t ldy = 0;
  int64_t M = 0, N = 0, K = 0;
  bool accumulate = false;
};
void gemm_bf16(const GemmParams& p, int device);
// Algorithm choice per shape: off (default) takes cuBLASLt's first heuristic answer; on times its
// top 16 answers on the first call of each non-accumulating shape and keeps the fastest (~0.1-1 s
// once per shape). Also enabled by DFLASH_GEMM_AUTOTUNE=1. Switching drops the cached plans.
void set_gemm_autotune(bool on);
bool gemm_autotune();

// ---- Embedding, norms, elementwise (bf16 in/out, fp32 math) --------------------------------------
// y[n, :] = table[ids[n], :]; ids were validated against V on the host.
void embedding(const int32_t* ids, const void* table, void* y, int64_t N, int64_t D, Stream s);

// y = x̂ · (1 + w) (zero_centered) or x̂ · w, over rows of D.
void rms_norm(const void* x, int64_t ldx, const void* w, void* y, int64_t ldy, int64_t rows, int64_t D, float eps,
              bool zero_centered, Stream s);

// Residual step of a decoder layer: h += d (fp32 add, bf16 store), then y = rmsnorm(h) · (1 + w).
// h, d, y are contiguous [rows, D]; y may be null (then only the add).
void add_rms_norm(void* h, const void* d, const void* w, void* y, int64_t rows, int64_t D, float eps, Stream s);

// y[N, I] = silu(gu[:, 0:I]) * gu[:, I:2I]; gu is the output of the fused gate|up GEMM [N, 2I].
void swiglu(const void* gu, void* y, int64_t N, int64_t I, Stream s);

// Attention q/k preparation, one (token, head) row at a time: zero-centred RMSNorm over d with
// wq / wk, then neox RoPE on the first rotary_dim dims at position pos[n] (inv_freq and angle in
// f32 as transformers computes them: inv_freq_i = 1 / theta^(2i / rotary_dim)).
// q is read from q_in (row stride ldq, head stride hsq: per head [q | gate] when gated) and written
// contiguous to q_out [N, Hq, d]; k [N, Hkv, d] (row stride ldk) is normalised and rotated in place.
struct QkPrepParams {
  const void* q_in = nullptr;
  int64_t ldq = 0, hsq = 0;
  void* q_out = nullptr;
  void* k = nullptr;
  int64_t ldk = 0;
  const void* wq = nullptr;  // [d]
  const void* wk = nullptr;  // [d]
  const int32_t* pos = nullptr;  // [N] position of each token within its sequence
  int64_t N = 0, Hq = 0, Hkv = 0, d = 0, rotary_dim = 0;
  float eps = 1e-6f;
  float theta = 10000.0f;
};
void qk_norm_rope(const QkPrepParams& p, Stream s);

// x[N, H*d] *= sigmoid(gate); gate of token n, head h at gate + n*ldg + h*hsg (d contiguous).
void sigmoid_gate(void* x, const void* gate, int64_t ldg, int64_t hsg, int64_t N, int64_t H, int64_t d, Stream s);

// GatedDeltaNet output: y[n, h*dv:(h+1)*dv] = rmsnorm(core[n, h, :]) · w · silu(z[n, h*dv + :]).
// core [N, Hv, dv] contiguous; z rows strided (ldz); w [dv] plain weight.
void gated_rms_norm(const void* core, const void* z, int64_t ldz, const void* w, void* y, int64_t N, int64_t Hv,
                    int64_t dv, float eps, Stream s);

// ---- Causal attention -----------------------------------------------------------------------------
// out[N, Hq, d] = softmax(scale · q kᵀ + causal mask within each sequence) v, GQA: query head h
// reads kv head h / (Hq / Hkv). q [N, Hq, d] contiguous bf16; k / v [N, Hkv, d] with token rows
// ldk / ldv elements apart (0 = Hkv·d, contiguous; e.g. the columns of a fused q|k|v projection),
// heads contiguous within a row; fp32 softmax.
// Which flash kernel runs: Auto = wgmma on an sm_90 device (when this build has its sm_90a code and
// the head dim is 128 or 256), else mma.sync; the other two force one (kernel_bench, tests).
enum class FlashImpl { Auto, MmaSync, Wgmma };
struct AttentionParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1]
  int64_t num_seqs = 0, max_seqlen = 0, N = 0, Hq = 0, Hkv = 0, d = 0;
  int64_t ldk = 0, ldv = 0;  // token row strides of k / v in elements; 0 = Hkv·d
  float scale = 0.0f;
  FlashImpl impl = FlashImpl::Auto;  // flash_attention_fwd only
};
// Flash-style (no T×T matrix in memory), tensor cores. Supports d in {64, 128, 256}, sm >= 80.
void flash_attention_fwd(const AttentionParams& p, Stream s);
bool flash_attention_supported(int64_t d, int sm_major);
// Whether the wgmma (sm_90a) kernel can run head dim d on CUDA device `device`, and the name of the
// kernel Auto picks there ("wgmma sm_90a" or "mma.sync").
bool flash_attention_wgmma_available(int64_t d, int device);
const char* flash_attention_kernel_name(int64_t d, int device);
// Plain kernel for any d and architecture (one query row per block, online softmax).
void attention_fallback(const AttentionParams& p, Stream s);

// ---- GatedDeltaNet ----------------------------------------------------------------------------------
// Causal depthwise conv over C channels, channel-last, zeros before each sequence start:
//   y[t, c] = act(sum_j w[c, j] · x[t - K + 1 + j, c]),  act = silu when `silu`.
// x rows strided (ldx >= C, e.g. the [q|k|v] columns of the fused in-projection output); y contiguous.
struct ConvParams {
  const void* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;  // [C, K]
  void* y = nullptr;        // [N, C]
  const int32_t* cu_seqlens = nullptr;
  int64_t num_seqs = 0, N = 0, C = 0, K = 0;
  bool silu = true;
};
// One pass over all channels: vectorized (8 bf16 channels per thread), each input read once, K <= 4.
void causal_conv1d_fast(const ConvParams& p, Stream s);
bool causal_conv1d_fast_supported(int64_t C, int64_t K);
// One thread per (token, channel), any C and K.
void causal_conv1d_fallback(const ConvParams& p, Stream s);

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

// Gated delta rule on prepared (normalised, q pre-scaled) q/k, per sequence and value head h with
// key head h / (Hv / Hk):  S = exp(g_t) S;  S += k_t (beta_t (v_t - Sᵀ k_t))ᵀ;  o_t = Sᵀ q_t.
// State fp32 [num_seqs, Hv, dk, dv]; initial_state / final_state optional (null).
struct DeltaRuleParams {
  const void* q = nullptr;  // [N, Hk, dk] bf16
  const void* k = nullptr;  // [N, Hk, dk] bf16
  const void* v = nullptr;  // rows strided: v of token n, head h at v + n*ldv + h*dv
  int64_t ldv = 0;
  const float* g = nullptr;     // [N, Hv]
  const float* beta = nullptr;  // [N, Hv]
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

// ---- Decode / verify (speculative decoding) -----------------------------------------------------
// All of these work on a state pool of num_slots slots: a batch of num_seqs sequences, sequence s
// in pool slot slots[s] (int32 device array), bringing T_s >= 0 new tokens packed back to back
// (cu_seqlens {0, T_0, T_0 + T_1, ..., N}). T = 1 is decode, T = 2..16 verify (any T works).
// slots, past_len and cu_seqlens are device data the launchers cannot read: the caller guarantees
// 0 <= slots[s] < num_slots, slots distinct within a call that writes the pool, and (attention)
// past_len[s] + T_s <= max_len. A kernel that meets a slot or position outside the pool skips it
// (it writes nothing out of bounds; that sequence's outputs are then undefined).

// Causal conv update (GatedDeltaNet short conv, channel-last). state [num_slots, K-1, C] bf16 holds
// the last K-1 conv inputs of each slot (zeros for a new sequence). For seq s the window is
// [state rows ; its T_s rows of x] and y_t[c] = act(sum_j w[c, j] · window[t + j][c]); with
// update_state the slot's state becomes the window's last K-1 rows (also when T_s < K-1).
// x rows strided (ldx >= C, e.g. the q|k|v columns of the in-projection output), y [N, C].
struct ConvUpdateParams {
  const void* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;     // [C, K]
  void* y = nullptr;           // [N, C]
  void* state = nullptr;       // [num_slots, K-1, C] bf16
  const int32_t* slots = nullptr;       // [num_seqs]
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1]
  int64_t num_seqs = 0, N = 0, C = 0, K = 0, num_slots = 0;
  bool silu = true, update_state = true;
};
// One thread per (sequence, 8 channels): the state rows and the sequence's rows stay in registers,
// 16-byte loads and stores. Needs C % 8 == 0, ldx % 8 == 0, K in [1, 4], 16-byte aligned x / y / state.
void causal_conv1d_update_fast(const ConvUpdateParams& p, Stream s);
bool causal_conv1d_update_fast_supported(int64_t C, int64_t K);
// One thread per (sequence, channel); any C and K, any alignment.
void causal_conv1d_update_fallback(const ConvUpdateParams& p, Stream s);
// The kernel the fast path names for this shape ("vec8" or "fallback").
const char* causal_conv1d_update_kernel_name(int64_t C, int64_t K);

// Gated delta rule on a state pool (fp32 [num_slots, Hv, dk, dv]): per sequence, its tokens in
// order from its slot's state, S = exp(g_t) S; S += k_t (beta_t (v_t - Sᵀk_t))ᵀ; o_t = Sᵀ q_t.
// q / k prepared as in DeltaRuleParams (gdn_prep's output: q l2-normalised and scaled, k normalised;
// bf16 [N, Hk, dk]); value head h reads key head h / (Hv / Hk). out [N, Hv, dv] bf16 or null (no
// output: re-running accepted tokens at commit time). update_state: the state after the sequence's
// last token is written back to its slot; false leaves the pool untouched (verify; the rollback
// scheme re-runs the accepted tokens later with update_state = true).
struct DeltaRulePoolParams {
  const void* q = nullptr;  // [N, Hk, dk] bf16
  const void* k = nullptr;  // [N, Hk, dk] bf16
  const void* v = nullptr;  // rows strided: v of token n, head h at v + n*ldv + h*dv
  int64_t ldv = 0;
  const float* g = nullptr;     // [N, Hv]
  const float* beta = nullptr;  // [N, Hv]
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

// KV-cache append: the new tokens' k / v (token rows ldk / ldv elements apart, e.g. columns of a
// fused q|k|v projection; the Hkv·d values of a row contiguous) into the cache pool k_cache /
// v_cache [num_slots, max_len, Hkv, d] bf16 at positions past_len[s] .. past_len[s] + T_s - 1.
struct KvAppendParams {
  const void* k = nullptr;
  int64_t ldk = 0;  // 0 = Hkv·d
  const void* v = nullptr;
  int64_t ldv = 0;  // 0 = Hkv·d
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  const int32_t* slots = nullptr;
  const int32_t* past_len = nullptr;
  const int32_t* cu_seqlens = nullptr;
  int64_t num_seqs = 0, N = 0, Hkv = 0, d = 0, max_len = 0, num_slots = 0, max_new = 0 /* >= every T_s */;
};
// One CTA per (token index < max_new, sequence), 16-byte copies when the rows allow them.
void kv_cache_append(const KvAppendParams& p, Stream s);

// Attention of the T_s new queries of each sequence over its slot's KV cache (new K / V already
// appended), GQA (query head h reads kv head h / (Hq / Hkv)), bf16 cache, fp32 softmax. Query t of
// seq s is at position p = past_len[s] + t; key position kp is attended when kp < past_len[s] + T_s
// and (causal ? kp <= p : true) and (window > 0 ? kp >= p - (window - 1) : true).
// q, out [N, Hq, d] contiguous bf16. max_new bounds every T_s (the grid is sized by it).
struct AttentionDecodeParams {
  const void* q = nullptr;
  const void* k_cache = nullptr;  // [num_slots, max_len, Hkv, d]
  const void* v_cache = nullptr;
  void* out = nullptr;
  const int32_t* slots = nullptr;
  const int32_t* past_len = nullptr;
  const int32_t* cu_seqlens = nullptr;
  int64_t num_seqs = 0, N = 0, Hq = 0, Hkv = 0, d = 0, max_len = 0, num_slots = 0, max_new = 0;
  bool causal = true;
  int64_t window = 0;  // 0 = none
  float scale = 0.0f;
  void* workspace = nullptr;  // split-KV partials (fast kernel); may be null
  size_t workspace_bytes = 0;
  // Batch invariance (speculative decoding must reproduce greedy decoding bit for bit): > 0 cuts
  // the keys into splits of split_keys (a multiple of 64) at absolute positions, so a query's keys
  // are summed in the same splits, tiles and order whatever T and past_len are (the extra splits and
  // tiles a longer call covers add exact zeros); key_bound >= every past_len + T_s (the host knows
  // it) sizes the grid, and the workspace must hold attention_decode_workspace(p). 0: splits chosen
  // for speed, which depend on T.
  int64_t split_keys = 0;
  int64_t key_bound = 0;
};
// Flash-decoding on tensor cores (mma.sync): one CTA per (sequence, kv head, block of up to 128
// query rows = tokens x the kv head's query heads, split of the key range); the K / V tiles are read
// once per (kv head, split) and shared by all query rows of the group; the splits' partials (fp32)
// are combined by a second kernel. Supports d in {64, 128, 256}, sm >= 80. The number of splits is
// chosen from the grid's size and capped by what fits in the workspace (none: one split, no
// combine), so any workspace is correct and attention_decode_workspace(p) bytes is the fastest.
void attention_decode_fast(const AttentionDecodeParams& p, Stream s);
bool attention_decode_fast_supported(int64_t d, int sm_major);
size_t attention_decode_workspace(const AttentionDecodeParams& p);
// One CTA per (query token, query head), fp32 dot products on CUDA cores, any d.
void attention_decode_fallback(const AttentionDecodeParams& p, Stream s);
// "flash-decoding mma.sync" or "fallback".
const char* attention_decode_kernel_name(int64_t d, int sm_major);

// ---- Sampling --------------------------------------------------------------------------------------
// The token choice of decoding on the device: greedy (argmax) and temperature / top-p sampling.
// out[r] = argmax over v < V of logits[r · ld + v] for R rows of fp32 (bf16 = false) or bf16 logits,
// as ops::argmax_rows: ties go to the lowest id (also across threads), NaN entries are never chosen
// (a row without a non-NaN value gives 0). One CTA per row, 16-byte loads whatever the rows'
// alignment (a scalar head and tail around the aligned body). Needs 1 <= V < 2^31 and ld >= V.
void argmax_rows(const void* logits, bool bf16, int64_t ld, int64_t R, int64_t V, int32_t* out, Stream s);

// Temperature / top-p sampling of R rows of fp32 logits (rows ld apart), as ops::sample_rows (its
// definition, kernels/ops.h): out[r] is drawn with stream streams[r] and position positions[r]
// (device arrays [R]). The nucleus threshold may be found with float sums in another order than the
// reference's, so a row whose nucleus mass lies within ~1e-5 of top_p may keep one token more or
// less; everything else is the reference's draw exactly. Needs 1 <= V < 2^31, ld >= V, temperature > 0,
// 0 < top_p <= 1.
void sample_rows(const float* logits, int64_t ld, int64_t R, int64_t V, float temperature, float top_p, uint64_t seed,
                 const uint64_t* streams, const int64_t* positions, int32_t* out, Stream s);

// ==== FP8: block-scaled e4m3 (issue 18; kernels/cuda/fp8.cu, gemm_fp8 in kernels/cuda/gemm.cpp) ====
// The official -FP8 checkpoints' format (kernels/fp8.h, the CPU reference in kernels/ops.h "fp8"):
// weights [N, K] as e4m3 codes with one f32 dequantization scale per 128 x 128 block, activations
// quantized per token and 128-column group at run time (DeepSeek-V3's recipe). Codes are uint8_t
// (e4m3 "fn" bit patterns); scales are dequantization scales (value ~= e4m3(code) * scale), laid
// out as cuBLASLt's block-scaling modes read them, so gemm_fp8 consumes them without a copy:
//   activation scale of (token m, group g):  scale[g * fp8_act_scale_ld(M) + m]
//       (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F on the [K, M] column-major operand: token index
//       contiguous, one row of fp8_act_scale_ld(M) floats per 128-column group)
//   weight scale of block (nb, kb):         scale_inv[nb * fp8_weight_scale_ld(K) + kb]
//       (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F: the K-block index contiguous, each row of
//       blocks padded to a multiple of 4 floats)
// Both established on an H200 (cuBLASLt 13.1) against the CPU reference: see gemm.cpp's gemm_fp8 part.

// Row stride (floats) between the 128-column groups of an activation's scales (M rounded up to 4:
// the layout of the GEMM on the padded rows, which gemm_fp8 needs), and the number of floats a
// scale buffer of an [M, K] activation needs (callers allocate this; the quantizers write its
// padding entries too, as 1.0).
int64_t fp8_act_scale_ld(int64_t M);
size_t fp8_act_scale_elems(int64_t M, int64_t K);
// Row stride (floats) between the 128-row blocks of a weight's scales (>= ceil(K / 128)).
int64_t fp8_weight_scale_ld(int64_t K);

// Dynamic per-token group quantization, as ops::quantize_fp8_act bit for bit (for the same values in
// f32): per (token m, group g of 128 columns; the last group may be partial and covers only the
// existing columns) scale = max(amax, 1e-10) / 448, q = e4m3(clamp(x * (1 / scale), +-448)) (one
// correctly rounded reciprocal per group, round to nearest even). Memory bound: 2·M·K bytes read, M·K + 4·M·ceil(K/128) written.
struct Fp8ActQuantParams {
  const void* x = nullptr;  // bf16 [M, K], row stride ldx
  int64_t ldx = 0;
  uint8_t* q = nullptr;     // e4m3 [M, K], row stride ldq
  int64_t ldq = 0;
  float* scale = nullptr;   // fp8_act_scale_elems(M, K) floats (layout above)
  int64_t M = 0, K = 0;
};
// Needs K % 16 == 0, x and q 16-byte aligned, ldx % 8 == 0, ldq % 16 == 0 (what gemm_fp8 needs of
// its codes anyway), scale 16-byte aligned. M == 0 is a no-op.
void quantize_fp8_act(const Fp8ActQuantParams& p, Stream s);

// Block quantization of a bf16 weight [N, K] (contiguous), as ops::quantize_fp8_weight bit for bit:
// per 128 x 128 block (partial at the edges) scale_inv = max(amax, 1e-10) / 448 written to
// scale_inv[nb * ld_scale + kb] (ld_scale >= ceil(K / 128); pass fp8_weight_scale_ld(K) for
// gemm_fp8; padding entries are not written), q [N, K] contiguous. For bf16 checkpoints and random
// weights at load time. Needs K % 16 == 0 and 16-byte aligned w and q.
void quantize_fp8_weight(const void* w_bf16, int64_t N, int64_t K, uint8_t* q, float* scale_inv, int64_t ld_scale,
                         Stream s);

// y[M, N] (bf16, row stride ldy) = x[M, K] · w[N, K]^T with both operands e4m3 codes and block
// scales, fp32 accumulation (per 128-column group the code products summed, times the two scales),
// through cuBLASLt on the device's DeviceContext; algorithms cached per shape like gemm_bf16 (and
// autotuned under the same switch). tensor_scales: x_scale and w_scale point to one float each
// (plain per-tensor scaling: the dense FP8 ceiling kernel_bench compares against).
struct GemmFp8Params {
  const uint8_t* x = nullptr;   // e4m3 [M, K], row stride ldx
  int64_t ldx = 0;
  const float* x_scale = nullptr;  // quantize_fp8_act's layout (fp8_act_scale_ld(M))
  const uint8_t* w = nullptr;   // e4m3 [N, K] contiguous
  const float* w_scale = nullptr;  // [ceil(N/128), fp8_weight_scale_ld(K)]
  void* y = nullptr;            // bf16 [M, N], row stride ldy
  int64_t ldy = 0;
  int64_t M = 0, N = 0, K = 0;
  bool tensor_scales = false;
};
// Needs 16-byte aligned pointers, K % 16 == 0, ldx % 16 == 0, ldy % 8 == 0, and with block scales
// M % 4 == 0 (cuBLASLt has no block-scaled kernel for other M: pad the rows, see gemm.cpp); throws
// naming the shape and the GPU when the installed cuBLASLt has no algorithm for it (block scaling
// needs sm_90 and cuBLAS >= 12.9). M == 0 is a no-op.
void gemm_fp8(const GemmFp8Params& p, int device);
// The kernel gemm_fp8 runs, in words ("cublasLt e4m3 VEC128xBLK128x128").
const char* gemm_fp8_kernel_name();
// Fused producers of gemm_fp8's activation operand: the unfused GPU op's bf16 result (exactly as
// cuda::rms_norm / cuda::swiglu / cuda::gated_rms_norm compute and round it), quantized as
// quantize_fp8_act does, without the bf16 round trip through memory: codes and scales equal those
// of the op followed by quantize_fp8_act bit for bit. Outputs: q [rows, K] (row stride ldq) and
// scale (fp8_act_scale_elems(rows, K) floats), K the op's output width; K % 16 == 0, 16-byte aligned
// pointers, ldq % 16 == 0 (the unfused ops also take other alignments).
// y = rmsnorm(x) · (1 + w) (zero-centred, Qwen3.5's decoder norms), x rows strided (ldx % 8 == 0),
// D <= 8192.
void rms_norm_quant_fp8(const void* x, int64_t ldx, const void* w, int64_t rows, int64_t D, float eps, uint8_t* q,
                        int64_t ldq, float* scale, Stream s);
// y[N, I] = silu(gu[:, 0:I]) * gu[:, I:2I] (gu [N, 2I] contiguous, the fused gate|up GEMM output).
void swiglu_quant_fp8(const void* gu, int64_t N, int64_t I, uint8_t* q, int64_t ldq, float* scale, Stream s);
// y[n, h*dv:(h+1)*dv] = rmsnorm(core[n, h, :]) · w · silu(z[n, h*dv + :]), K = Hv·dv; dv 128 or 256
// (each head one or two 128-column groups), z rows strided (ldz % 8 == 0).
void gated_rms_norm_quant_fp8(const void* core, const void* z, int64_t ldz, const void* w, int64_t N, int64_t Hv,
                              int64_t dv, float eps, uint8_t* q, int64_t ldq, float* scale, Stream s);
// ==== end FP8 =======================================================================================

}  // namespace dflash::cuda
