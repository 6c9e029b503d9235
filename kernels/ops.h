#pragma once
// The op families of the target forward. Each op takes a plain parameter struct or tensors,
// validates shapes/dtypes/devices once here, then runs on the tensors' device: `cpu::` is the
// fp32 reference (simple, obviously right, the oracle for every test); the CUDA backend arrives
// with the CUDA target forward and is reached through the same entry points.
//
// Layout conventions (row-major, "packed" = tokens of all sequences back to back):
//   activations [N, D] with N = total tokens; per-head tensors [N, H, d];
//   sequence boundaries as host offsets {0, len0, len0+len1, ...} (like HDF5 /offsets).
#include <cstdint>
#include <vector>

#include "kernels/tensor.h"

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

}  // namespace dflash::ops
