#pragma once
// Launchers of the training kernels (the DFlash drafter's forward and backward, the fused linear
// cross-entropy, the optimizer). Same conventions as launch.h: raw pointers and sizes, no CUDA
// types, every launcher validates its sizes (throwing dflash::Error naming the launcher and the
// value), enqueues on the stream and checks the launch; none synchronizes.
//
// Precision: weights and activations bf16, every reduction and accumulation in fp32; the
// residual stream, its gradient and every weight gradient are fp32. "(+)=" marks an output that
// is ADDED into (gradient accumulation over layers and micro-batches); "=" marks one written.
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// ---- General GEMM (cuBLASLt), row-major ------------------------------------------------------------
//   D[M, N] (row stride ldd) = alpha · op(A) · op(B) + beta · D
//   A: [M, K] row-major (lda >= K), or when trans_a its transpose stored as [K, M] (lda >= M);
//   B: [K, N] row-major (ldb >= N), or when trans_b its transpose stored as [N, K] (ldb >= K).
// A and B bf16, fp32 accumulation; D fp32 (d_f32) or bf16. beta 0 never reads D.
// The training uses:  y = x·wᵀ (trans_b), dx = dy·w, dw (+)= dyᵀ·x (trans_a, fp32 D, beta 1).
// M == 0 or N == 0 is a no-op; K == 0 scales D by beta.
struct GemmExParams {
  const void* a = nullptr;
  int64_t lda = 0;
  bool trans_a = false;
  const void* b = nullptr;
  int64_t ldb = 0;
  bool trans_b = false;
  void* d = nullptr;
  int64_t ldd = 0;
  bool d_f32 = false;
  int64_t M = 0, N = 0, K = 0;
  float alpha = 1.0f, beta = 0.0f;
};
void gemm_ex(const GemmExParams& p, int device);

// ---- Conversions and residual updates --------------------------------------------------------------
// y[i] = float(x[i])  (bf16 -> fp32), n elements.
void cast_bf16_f32(const void* x, float* y, int64_t n, Stream s);
// y[i] = bf16(x[i])  (fp32 -> bf16, round to nearest even), n elements.
void cast_f32_bf16(const float* x, void* y, int64_t n, Stream s);
// h[i] += float(d[i]) for bf16 d (d_f32 false) or fp32 d, n elements.
void add_into_f32(float* h, const void* d, bool d_f32, int64_t n, Stream s);
// Embedding rows into the fp32 residual stream: h[r, :] = float(table[ids[r], :]), table bf16 [V, D].
void embedding_f32(const int32_t* ids, const void* table, float* h, int64_t rows, int64_t D, Stream s);

// ---- Plain RMSNorm (x̂ · w) with saved statistics ---------------------------------------------------
// Forward over rows of D: y = x · rstd · w, rstd[r] = 1 / sqrt(mean(x²) + eps) (saved for backward).
// x fp32 (x_f32) or bf16, row stride ldx; w bf16 [D]; y bf16 contiguous [rows, D].
void rms_norm_fwd(const void* x, bool x_f32, int64_t ldx, const void* w, void* y, float* rstd, int64_t rows, int64_t D,
                  float eps, Stream s);
// Backward of y = x · rstd · w with dy bf16 [rows, D]:
//   dx (+)= rstd · (w·dy − x̂ · mean(x̂ · w·dy))   into fp32 dx [rows, D] (accumulate) — or,
//   when dx_bf16 is set instead of dx, written as bf16;
//   dw (+)= Σ_rows dy · x̂ into fp32 dw [D] (deterministic: fixed reduction order, no atomics on dw
//   across runs — a per-block partial buffer is reduced in order).
// x as in forward; dx / dx_bf16: exactly one is non-null; dx_copy_bf16 (optional): after the add,
// also write bf16(dx) there (the residual-stream gradient as the next GEMM's input).
struct RmsNormBwdParams {
  const void* x = nullptr;
  bool x_f32 = false;
  int64_t ldx = 0;
  const void* w = nullptr;
  const float* rstd = nullptr;
  const void* dy = nullptr;  // bf16 [rows, D]
  float* dx = nullptr;
  void* dx_bf16 = nullptr;
  void* dx_copy_bf16 = nullptr;
  float* dw = nullptr;
  int64_t rows = 0, D = 0;
};
void rms_norm_bwd(const RmsNormBwdParams& p, Stream s);

// ---- Per-head plain RMSNorm + full-head neox RoPE (drafter q_norm / k_norm) -------------------------
// For each row r and head h of x [rows, heads, d] (row stride ldx, heads contiguous with stride d):
//   n = x̂ · w (plain RMSNorm over d, rstd saved [rows, heads]); y = rope(n) at position pos[r]:
//   neox halves over the full head dim, inv_freq_i = 1 / theta^(2i / d) in fp32, angle in fp32.
// y bf16 contiguous [rows, heads, d].
struct HeadNormRopeParams {
  const void* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;  // [d] bf16
  const int32_t* pos = nullptr;  // [rows]
  void* y = nullptr;
  float* rstd = nullptr;  // [rows, heads]
  int64_t rows = 0, heads = 0, d = 0;
  float eps = 1e-6f, theta = 1e6f;
};
void head_norm_rope_fwd(const HeadNormRopeParams& p, Stream s);
// Backward: from dy bf16 [rows, heads, d] (the gradient of y), dx = d/dx written bf16 to dx
// (row stride lddx, heads contiguous), dw (+)= fp32 [d] (deterministic as rms_norm_bwd).
struct HeadNormRopeBwdParams {
  HeadNormRopeParams fwd;  // x, ldx, w, pos, rstd (as saved), rows, heads, d, theta; y unused
  const void* dy = nullptr;
  void* dx = nullptr;
  int64_t lddx = 0;
  float* dw = nullptr;
};
void head_norm_rope_bwd(const HeadNormRopeBwdParams& p, Stream s);

// ---- SwiGLU backward --------------------------------------------------------------------------------
// Forward is swiglu() in launch.h: m = silu(gu[:, :I]) · gu[:, I:]. Backward from dm bf16 [rows, I]:
//   dgu[:, :I] = dm · u · σ(g)(1 + g(1 − σ(g))),  dgu[:, I:] = dm · silu(g);  dgu bf16 [rows, 2I].
void swiglu_bwd(const void* gu, const void* dm, void* dgu, int64_t rows, int64_t I, Stream s);

// ---- DFlash block attention ---------------------------------------------------------------------------
// Queries: the R = nb·B block rows (block b's rows are b·B .. b·B+B−1, block offset j = row − b·B);
// keys/values: the context rows of the block's sequence [N, Hkv, d] and the block's own rows
// [R, Hkv, d]. GQA: query head h reads kv head h / (Hq / Hkv). The mask (query j of block b with
// anchor a = anchor[b], sequence s = block_seq[b], context rows cu_seqlens[s] + t):
//   context key t: allowed iff t < a (strictly), and on sliding layers t >= a + j − (window − 1);
//   own-block key jj: full layers all jj; sliding layers jj <= j (and a + jj >= a + j − (window−1));
//   never keys of another block or sequence.
// Blocks are sorted by (sequence, anchor); blocks of sequence s are cu_blocks[s] .. cu_blocks[s+1]−1.
// Every row has at least its own block key, so no row is empty. Masked tiles are skipped; no
// queries × keys mask or score matrix is materialised.
struct BlockAttnParams {
  const void* q = nullptr;   // [R, Hq, d] bf16 (normalised, rotated)
  const void* kc = nullptr;  // [N, Hkv, d]
  const void* vc = nullptr;  // [N, Hkv, d]
  const void* kb = nullptr;  // [R, Hkv, d]
  const void* vb = nullptr;  // [R, Hkv, d]
  void* out = nullptr;       // [R, Hq, d] bf16   (forward: written; backward: read)
  float* lse = nullptr;      // [R, Hq] natural-log sum of exp(scale · q·k) (forward: written; backward: read)
  const int32_t* anchor = nullptr;      // [nb] device
  const int32_t* block_seq = nullptr;   // [nb] device
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1] device, context rows
  const int32_t* cu_blocks = nullptr;   // [num_seqs + 1] device, block ranges
  int64_t nb = 0, B = 0, N = 0, num_seqs = 0, max_seqlen = 0, Hq = 0, Hkv = 0, d = 0;
  bool sliding = false;
  int64_t window = 0;  // keys, > 0 when sliding
  float scale = 0.0f;  // 0 means 1/sqrt(d)
  bool force_fallback = false;  // run the plain kernels even where the tensor-core ones apply (tests, bench)
  // Which tensor-core kernels: Auto = wgmma (sm_90a) on an sm_90 GPU at d = 128, else mma.sync.
  FlashImpl impl = FlashImpl::Auto;
};
void block_attention_fwd(const BlockAttnParams& p, Stream s);
// Backward from dout [R, Hq, d] bf16: dq [R, Hq, d], dkc / dvc [N, Hkv, d], dkb / dvb [R, Hkv, d],
// all bf16, all WRITTEN (context rows no query attends get zeros). Deterministic (no float atomics).
// workspace: block_attention_bwd_workspace(p) bytes of device memory (may be 0), computed with the
// same p (impl, force_fallback, max_seqlen): δ [R, Hq] floats and, where the wgmma kernels run, the
// dSᵀ tiles of the two-pass backward, 8 KiB per (block, kv head, 64-row query tile, 64-key tile up
// to ceil(max_seqlen / 64) + ceil(B / 64)) — about 2.2 GB for 512 blocks over 4096 tokens, 8 kv heads.
struct BlockAttnBwdParams {
  BlockAttnParams fwd;
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dkc = nullptr;
  void* dvc = nullptr;
  void* dkb = nullptr;
  void* dvb = nullptr;
  void* workspace = nullptr;
};
int64_t block_attention_bwd_workspace(const BlockAttnParams& p);
void block_attention_bwd(const BlockAttnBwdParams& p, Stream s);
bool block_attention_supported(int64_t d, int sm_major);  // the tensor-core kernels: d in {64, 128}, sm >= 80
// The tensor-core kernel Auto picks for head dim d on CUDA device `device`: "wgmma sm_90a" or "mma.sync".
const char* block_attention_kernel_name(int64_t d, int device);

// ---- Fused linear cross-entropy (LM head) -------------------------------------------------------------
// For each of the R rows of hidden [R, H] bf16 (the final-normed drafter states), with the frozen
// lm_head [V, H] bf16: logits = hidden · lm_headᵀ; ce[r] = logsumexp(logits_r) − logits_r[label_r];
// argmax[r] = top-1 id (lowest id on ties); and, when dhidden is set,
//   dhidden[r, :] = grad_scale · weight[r] · (softmax(logits_r) − onehot(label_r)) · lm_head   (fp32, written)
// Rows are processed chunk_rows at a time: the logits of one chunk live in the workspace and are
// dropped; the R × V logits never exist. Rows with weight 0 still get ce / argmax (dhidden 0).
// workspace: linear_ce_workspace(chunk_rows, V) bytes. labels int32 [R] in [0, V).
struct LinearCeParams {
  const void* hidden = nullptr;
  const void* lm_head = nullptr;
  const int32_t* labels = nullptr;
  const float* weights = nullptr;  // [R]
  int64_t R = 0, H = 0, V = 0, chunk_rows = 0;
  float grad_scale = 1.0f;
  float* ce = nullptr;        // [R] written
  int32_t* argmax = nullptr;  // [R] written
  float* dhidden = nullptr;   // [R, H] written when non-null
  void* workspace = nullptr;
};
int64_t linear_ce_workspace(int64_t chunk_rows, int64_t V);
void linear_ce(const LinearCeParams& p, int device);

// ---- Optimizer ------------------------------------------------------------------------------------------
// Σ x² over n fp32 values into *out (fp32 device scalar, written), deterministic: fixed-size block
// partials reduced in a fixed order. partial: sum_squares_workspace(n) bytes.
int64_t sum_squares_workspace(int64_t n);
void sum_squares(const float* x, int64_t n, float* out, void* partial, Stream s);
// AdamW on fp32 masters, decoupled weight decay, bias-corrected (PyTorch's AdamW):
//   g = grad · grad_scale;  m = β1 m + (1−β1) g;  v = β2 v + (1−β2) g²;
//   master −= lr · (wd · master + (m / (1 − β1^step)) / (sqrt(v / (1 − β2^step)) + eps));
//   weight = bf16(master) (when weight is non-null).
// grad_scale comes from the device (the clip factor, computed on the device from the grad norm)
// times grad_scale_host, so the host never waits for the norm.
struct AdamWParams {
  float* master = nullptr;
  const float* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  void* weight = nullptr;  // bf16 copy, optional
  int64_t n = 0;
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;  // 1-based
  const float* grad_scale = nullptr;  // device scalar, optional (1 when null)
  float grad_scale_host = 1.0f;
};
void adamw_step(const AdamWParams& p, Stream s);
// The clip factor on the device: scale = min(1, max_norm / (sqrt(sumsq) + 1e-6)); norm = sqrt(sumsq).
// max_norm <= 0 means no clipping (scale 1). A non-finite sumsq gives scale 0 and norm = that
// value (the trainer reads the norm and skips the update of a non-finite step).
void clip_factor(const float* sumsq, float max_norm, float* scale, float* norm, Stream s);

}  // namespace dflash::cuda
