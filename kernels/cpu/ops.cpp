// CPU reference for the elementwise, norm, linear, conv and rope ops (fp32 math throughout).
#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/cpu/gemm.h"

namespace dflash::ops {

using detail::require_host_f32;
using detail::require_shape;

namespace {

// y[i] = f(a[i], b[i]) over same-shaped f32 host tensors (y may alias a or b).
template <typename F>
void binary_elementwise(const char* op, const Tensor& a, const Tensor& b, Tensor& y, F f) {
  require_host_f32(a, op, "a");
  require_host_f32(b, op, "b");
  require_host_f32(y, op, "y");
  require_shape(b, a.shape(), op, "b");
  require_shape(y, a.shape(), op, "y");
  const float* A = a.data<float>();
  const float* B = b.data<float>();
  float* Y = y.data<float>();
  for (int64_t i = 0; i < a.numel(); ++i) Y[i] = f(A[i], B[i]);
}

// 1 / sqrt(mean(x^2) + eps) over one row of D.
float inv_rms(const float* x, int64_t D, float eps) {
  float ss = 0;
  for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
  return 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
}

// What the RMS norms check: f32 host x / w / y, a 1-D weight w [D], x [..., D], y shaped as x.
// Returns D.
int64_t check_norm_args(const char* op, const Tensor& x, const Tensor& w, const Tensor& y) {
  require_host_f32(x, op, "x");
  require_host_f32(w, op, "w");
  require_host_f32(y, op, "y");
  DFLASH_CHECK(w.dim() == 1, op << ": weight must be 1-D, got " << w.describe());
  const int64_t D = w.size(0);
  DFLASH_CHECK(x.dim() >= 1 && x.size(-1) == D, op << ": x " << x.describe() << " does not end in " << D);
  require_shape(y, x.shape(), op, "y");
  return D;
}

// y[r, d] = out(r, d, x[r, d] · inv_rms(x[r, :])) over the rows r of x [..., D].
template <typename Out>
void rms_rows(const Tensor& x, int64_t D, float eps, Tensor& y, Out out) {
  const int64_t rows = x.numel() / D;
  const float* X = x.data<float>();
  float* Y = y.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = X + r * D;
    const float inv = inv_rms(xr, D, eps);
    for (int64_t d = 0; d < D; ++d) Y[r * D + d] = out(r, d, xr[d] * inv);
  }
}

}  // namespace

void SeqOffsets::validate(int64_t n_tokens, const char* op) const {
  DFLASH_CHECK(offsets.size() >= 2, op << ": sequence offsets need at least one sequence");
  DFLASH_CHECK(offsets.front() == 0, op << ": sequence offsets must start at 0");
  for (size_t i = 1; i < offsets.size(); ++i)
    DFLASH_CHECK(offsets[i] >= offsets[i - 1], op << ": sequence offsets decrease at index " << i);
  DFLASH_CHECK(offsets.back() == n_tokens,
               op << ": sequence offsets end at " << offsets.back() << " but the tensor has " << n_tokens << " tokens");
}

void linear(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) {
  require_host_f32(x, "linear", "x");
  require_host_f32(w, "linear", "w");
  require_host_f32(y, "linear", "y");
  DFLASH_CHECK(x.dim() == 2 && w.dim() == 2, "linear: x and w must be 2-D, got " << x.describe() << ", " << w.describe());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  DFLASH_CHECK(w.size(1) == K, "linear: x " << x.describe() << " and w " << w.describe() << " disagree on K");
  require_shape(y, {M, N}, "linear", "y");
  // Each output one f32 sum over k in ascending order (kernels/cpu/gemm.h), whatever M and the thread
  // count: a row's values do not depend on the other rows of the batch (decoding relies on it).
  cpu::gemm_f32(cpu::Trans::N, cpu::Trans::T, M, N, K, x.data<float>(), K, w.data<float>(), K, accumulate,
                y.data<float>(), N);
}

void rms_norm(const Tensor& x, const Tensor& w, float eps, RmsNormKind kind, Tensor& y) {
  const int64_t D = check_norm_args("rms_norm", x, w, y);
  const float* Wt = w.data<float>();
  rms_rows(x, D, eps, y, [&](int64_t, int64_t d, float xn) {
    const float scale = kind == RmsNormKind::ZeroCentered ? 1.0f + Wt[d] : Wt[d];
    return xn * scale;
  });
}

void gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& w, float eps, Tensor& y) {
  const int64_t D = check_norm_args("gated_rms_norm", x, w, y);
  require_host_f32(z, "gated_rms_norm", "z");
  require_shape(z, x.shape(), "gated_rms_norm", "z");
  const float* Z = z.data<float>();
  const float* Wt = w.data<float>();
  rms_rows(x, D, eps, y, [&](int64_t r, int64_t d, float xn) { return xn * Wt[d] * detail::silu(Z[r * D + d]); });
}

void swiglu(const Tensor& gate, const Tensor& up, Tensor& y) {
  binary_elementwise("swiglu", gate, up, y, [](float g, float u) { return detail::silu(g) * u; });
}

void sigmoid_gate_inplace(Tensor& x, const Tensor& gate) {
  require_host_f32(x, "sigmoid_gate", "x");
  require_host_f32(gate, "sigmoid_gate", "gate");
  require_shape(gate, x.shape(), "sigmoid_gate", "gate");
  float* X = x.data<float>();
  const float* G = gate.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) X[i] *= detail::sigmoid(G[i]);
}

void add(const Tensor& a, const Tensor& b, Tensor& y) {
  binary_elementwise("add", a, b, y, [](float u, float v) { return u + v; });
}

void embedding(const Tensor& ids, const Tensor& table, Tensor& y) {
  DFLASH_CHECK(ids.defined() && ids.device().is_cpu() && ids.dtype() == DType::I32 && ids.dim() == 1,
               "embedding: ids must be a 1-D i32 host tensor, got " << ids.describe());
  require_host_f32(table, "embedding", "table");
  require_host_f32(y, "embedding", "y");
  DFLASH_CHECK(table.dim() == 2, "embedding: table must be 2-D, got " << table.describe());
  const int64_t N = ids.size(0), V = table.size(0), D = table.size(1);
  require_shape(y, {N, D}, "embedding", "y");
  const int32_t* I = ids.data<int32_t>();
  for (int64_t n = 0; n < N; ++n) {
    DFLASH_CHECK_HINT(I[n] >= 0 && I[n] < V, "token id " << I[n] << " at position " << n << " is outside the vocabulary [0, "
                                                         << V << ")",
                      "the tokens do not belong to this model's tokenizer, or vocab_size in config.json is wrong");
    std::memcpy(y.data<float>() + n * D, table.data<float>() + static_cast<int64_t>(I[n]) * D,
                static_cast<size_t>(D) * sizeof(float));
  }
}

void causal_conv1d(const Tensor& x, const Tensor& w, const SeqOffsets& seqs, bool silu, Tensor& y) {
  require_host_f32(x, "causal_conv1d", "x");
  require_host_f32(w, "causal_conv1d", "w");
  require_host_f32(y, "causal_conv1d", "y");
  DFLASH_CHECK(x.dim() == 2 && w.dim() == 2, "causal_conv1d: x [N, C] and w [C, K], got " << x.describe() << ", "
                                                                                        << w.describe());
  const int64_t N = x.size(0), C = x.size(1), K = w.size(1);
  require_shape(w, {C, K}, "causal_conv1d", "w");
  require_shape(y, {N, C}, "causal_conv1d", "y");
  DFLASH_CHECK(x.raw_data() != y.raw_data(), "causal_conv1d: x and y must not alias");
  seqs.validate(N, "causal_conv1d");
  const float* X = x.data<float>();
  const float* Wt = w.data<float>();
  float* Y = y.data<float>();
  for (int64_t s = 0; s < seqs.num_sequences(); ++s) {
    const int64_t begin = seqs.offsets[s], end = seqs.offsets[s + 1];
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t c = 0; c < C; ++c) {
        float acc = 0;
        for (int64_t j = 0; j < K; ++j) {
          int64_t src = t - (K - 1) + j;
          if (src >= begin) acc += Wt[c * K + j] * X[src * C + c];
        }
        Y[t * C + c] = silu ? detail::silu(acc) : acc;
      }
    }
  }
}

void rope_neox_inplace(Tensor& x, const SeqOffsets& seqs, int64_t rotary_dim, double theta, int64_t position_offset) {
  require_host_f32(x, "rope", "x");
  DFLASH_CHECK(x.dim() == 3, "rope: x must be [N, H, D], got " << x.describe());
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2);
  DFLASH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= D,
               "rope: rotary_dim " << rotary_dim << " must be even and in (0, " << D << "]");
  seqs.validate(N, "rope");
  const int64_t half = rotary_dim / 2;
  // Like transformers: inv_freq and the angle in f32, cos/sin of that f32 angle.
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv_freq[static_cast<size_t>(i)] =
        static_cast<float>(1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(rotary_dim)));
  float* X = x.data<float>();
  for (int64_t s = 0; s < seqs.num_sequences(); ++s) {
    for (int64_t t = seqs.offsets[s]; t < seqs.offsets[s + 1]; ++t) {
      const float pos = static_cast<float>(t - seqs.offsets[s] + position_offset);
      for (int64_t i = 0; i < half; ++i) {
        const float angle = pos * inv_freq[static_cast<size_t>(i)];
        const float c = static_cast<float>(std::cos(static_cast<double>(angle)));
        const float sn = static_cast<float>(std::sin(static_cast<double>(angle)));
        for (int64_t h = 0; h < H; ++h) {
          float* row = X + (t * H + h) * D;
          const float x1 = row[i], x2 = row[i + half];
          row[i] = x1 * c - x2 * sn;
          row[i + half] = x2 * c + x1 * sn;
        }
      }
    }
  }
}

void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, Tensor& g, Tensor& beta) {
  for (auto [t, name] : {std::pair{&a, "a"}, {&b, "b"}, {&A_log, "A_log"}, {&dt_bias, "dt_bias"}, {&g, "g"},
                         {&beta, "beta"}})
    require_host_f32(*t, "gdn_gates", name);
  DFLASH_CHECK(a.dim() == 2, "gdn_gates: a must be [N, Hv], got " << a.describe());
  const int64_t N = a.size(0), Hv = a.size(1);
  require_shape(b, {N, Hv}, "gdn_gates", "b");
  require_shape(A_log, {Hv}, "gdn_gates", "A_log");
  require_shape(dt_bias, {Hv}, "gdn_gates", "dt_bias");
  require_shape(g, {N, Hv}, "gdn_gates", "g");
  require_shape(beta, {N, Hv}, "gdn_gates", "beta");
  const float* A = a.data<float>();
  const float* B = b.data<float>();
  const float* AL = A_log.data<float>();
  const float* DT = dt_bias.data<float>();
  float* G = g.data<float>();
  float* BE = beta.data<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < Hv; ++h) {
      const int64_t i = n * Hv + h;
      G[i] = -std::exp(AL[h]) * detail::softplus(A[i] + DT[h]);
      BE[i] = detail::sigmoid(B[i]);
    }
}

void l2norm_inplace(Tensor& x, float eps) {
  require_host_f32(x, "l2norm", "x");
  const int64_t D = x.size(-1), rows = x.numel() / D;
  float* X = x.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += X[r * D + d] * X[r * D + d];
    const float inv = 1.0f / std::sqrt(ss + eps);
    for (int64_t d = 0; d < D; ++d) X[r * D + d] *= inv;
  }
}

}  // namespace dflash::ops
