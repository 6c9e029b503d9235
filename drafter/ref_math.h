#pragma once
// The CPU drafter's building blocks (internal to drafter/): the training forward and backward
// (model.cpp) and the inference proposer (decode.cpp) are written with the same helpers, so that
// proposing a block computes exactly what the training forward computes for it. Each helper is written
// once for a scalar type T: double is the reference (plain loops, the oracle of the tests and of the
// finite-difference checks), float the CPU backend's fast step (DrafterMath::F32: the same loops, and
// the matrix products on the f32 GEMM of kernels/cpu/gemm.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "drafter/config.h"
#include "drafter/model.h"
#include "drafter/weights.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/train_ops.h"

namespace dflash::drafter::ref {

// A row-major matrix of T: the only working type.
template <class T>
struct MatT {
  int64_t rows = 0, cols = 0;
  std::vector<T> v;
  MatT() = default;
  MatT(int64_t r, int64_t c) : rows(r), cols(c), v(static_cast<size_t>(r * c), T(0)) {}
  T* row(int64_t i) { return v.data() + i * cols; }
  const T* row(int64_t i) const { return v.data() + i * cols; }
};
using Mat = MatT<double>;

template <class T>
constexpr DType dtype_of() {
  return sizeof(T) == sizeof(double) ? DType::F64 : DType::F32;
}

// Host tensor of any float dtype -> [numel / last, last] values of T (1-D tensors become one row).
template <class T = double>
inline MatT<T> to_mat(const Tensor& t) {
  const Tensor c = t.contiguous();
  const int64_t cols = c.dim() == 0 ? 1 : c.size(-1);
  MatT<T> m(cols ? c.numel() / cols : 0, cols);
  convert_elements(c.raw_data(), c.dtype(), m.v.data(), dtype_of<T>(), c.numel());
  return m;
}

// t += m, for F32 / F64 host gradient buffers.
template <class T>
inline void add_into(Tensor& t, const MatT<T>& m, const std::string& name) {
  DFLASH_CHECK(t.defined() && t.device().is_cpu() && t.is_contiguous() && t.numel() == static_cast<int64_t>(m.v.size()),
               "gradient '" << name << "' must be a contiguous host tensor of " << m.v.size() << " elements");
  if (t.dtype() == DType::F64) {
    double* p = t.data<double>();
    for (size_t i = 0; i < m.v.size(); ++i) p[i] += m.v[i];
  } else {
    DFLASH_CHECK(t.dtype() == DType::F32, "gradient '" << name << "' must be F32 or F64, got " << dtype_name(t.dtype()));
    float* p = t.data<float>();
    for (size_t i = 0; i < m.v.size(); ++i) p[i] = static_cast<float>(p[i] + m.v[i]);
  }
}

template <class T>
inline Tensor to_f64_tensor(const MatT<T>& m) {
  Tensor t = Tensor::empty({m.rows, m.cols}, DType::F64);
  std::copy(m.v.begin(), m.v.end(), t.data<double>());
  return t;
}

template <class T>
inline T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
// The float step's dot product: 8 interleaved partial sums (lane l takes i = l, l + 8, ...) added by a
// fixed tree, so the compiler can keep them in one vector; the same bits wherever it is called.
template <>
inline float dot<float>(const float* a, const float* b, int64_t n) {
  float l[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) l[k] += a[i + k] * b[i + k];
  for (int k = 0; i < n; ++i, ++k) l[k] += a[i] * b[i];
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}
template <class T>
inline void axpy(T* y, T a, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// y[M, N] = x[M, K] · w[N, K]^T (each output one dot(); four at a time, cpu::dot4: the same values)
inline Mat linear(const Mat& x, const Mat& w) {
  Mat y(x.rows, w.rows);
  for (int64_t m = 0; m < x.rows; ++m) {
    double* ym = y.row(m);
    int64_t n = 0;
    for (; n + 4 <= w.rows; n += 4) cpu::dot4(x.row(m), w.row(n), w.row(n + 1), w.row(n + 2), w.row(n + 3), x.cols, ym + n);
    for (; n < w.rows; ++n) ym[n] = dot(x.row(m), w.row(n), x.cols);
  }
  return y;
}
// dx += dy · w, dw += dy^T · x (either may be null).
inline void linear_bwd(const Mat& x, const Mat& w, const Mat& dy, Mat* dx, Mat* dw) {
  for (int64_t m = 0; m < dy.rows; ++m)
    for (int64_t n = 0; n < dy.cols; ++n) {
      const double g = dy.row(m)[n];
      if (g == 0) continue;
      if (dx) axpy(dx->row(m), g, w.row(n), w.cols);
      if (dw) axpy(dw->row(n), g, x.row(m), x.cols);
    }
}

// The f32 twins of linear / linear_bwd on the GEMM of kernels/cpu/gemm.h (threaded, deterministic).
using MatF = MatT<float>;
inline MatF linear(const MatF& x, const MatF& w) {
  MatF y(x.rows, w.rows);
  cpu::gemm_f32(cpu::Trans::N, cpu::Trans::T, x.rows, w.rows, x.cols, x.v.data(), x.cols, w.v.data(), w.cols, false,
                y.v.data(), y.cols);
  return y;
}
inline void linear_bwd(const MatF& x, const MatF& w, const MatF& dy, MatF* dx, MatF* dw) {
  if (dx)
    cpu::gemm_f32(cpu::Trans::N, cpu::Trans::N, dy.rows, w.cols, dy.cols, dy.v.data(), dy.cols, w.v.data(), w.cols, true,
                  dx->v.data(), dx->cols);
  if (dw)
    cpu::gemm_f32(cpu::Trans::T, cpu::Trans::N, dy.cols, x.cols, dy.rows, dy.v.data(), dy.cols, x.v.data(), x.cols, true,
                  dw->v.data(), dw->cols);
}

// Simulated block-scaled FP8 linears (StepOptions::fp8_linears, the f32 step): every GEMM operand is
// rounded to e4m3 with one scale per tile (cpu::fake_quantize_e4m3) and the products are summed in f32,
// as FP8 tensor cores with f32 accumulation compute them. The tiles are DeepSeek-V3's recipe
// (Transformer Engine's Float8BlockScaling): weights 128 x 128; activations and output gradients
// 1 x 128 along the reduction dim for the forward (y = x·wᵀ) and the input gradient (dx = dy·w);
// 128 x 1 (along the tokens, the reduction dim) for the weight gradient's operands (dw = dyᵀ·x); with
// x_blocks, x's as 128 x 128 blocks (model.drafter.fp8_wgrad_x_tiles: 128x128, cuBLASLt's vector x block
// mode, which runs the forward's rate).
inline MatF fake_e4m3(const MatF& m, int64_t tile_rows, int64_t tile_cols) {
  MatF q = m;
  cpu::fake_quantize_e4m3(q.v.data(), q.rows, q.cols, tile_rows, tile_cols);
  return q;
}
inline MatF linear_fp8(const MatF& x, const MatF& w) { return linear(fake_e4m3(x, 1, 128), fake_e4m3(w, 128, 128)); }
inline void linear_bwd_fp8(const MatF& x, const MatF& w, const MatF& dy, MatF* dx, MatF* dw, bool x_blocks = false) {
  if (dx) linear_bwd(x, fake_e4m3(w, 128, 128), fake_e4m3(dy, 1, 128), dx, nullptr);
  if (dw) linear_bwd(fake_e4m3(x, 128, x_blocks ? 128 : 1), w, fake_e4m3(dy, 128, 1), nullptr, dw);
}

// Plain RMSNorm (x̂·w) over consecutive groups of D values (D = cols, or head_dim per head).
template <class T>
inline MatT<T> rms(const MatT<T>& x, const std::vector<T>& w, int64_t D, double eps, std::vector<T>& r) {
  MatT<T> y(x.rows, x.cols);
  const int64_t groups = static_cast<int64_t>(x.v.size()) / D;
  r.assign(static_cast<size_t>(groups), T(0));
  for (int64_t g = 0; g < groups; ++g) {
    const T* xp = x.v.data() + g * D;
    T* yp = y.v.data() + g * D;
    const T rg = static_cast<T>(1.0 / std::sqrt(dot(xp, xp, D) / static_cast<T>(D) + eps));
    r[g] = rg;
    for (int64_t i = 0; i < D; ++i) yp[i] = xp[i] * rg * w[i];
  }
  return y;
}
// dx += d/dx, dw += d/dw of y = x·r·w with r = (mean x² + eps)^-1/2.
template <class T>
inline void rms_bwd(const MatT<T>& x, const std::vector<T>& w, const std::vector<T>& r, int64_t D, const MatT<T>& dy,
                    MatT<T>& dx, std::vector<T>& dw) {
  const int64_t groups = static_cast<int64_t>(r.size());
  for (int64_t g = 0; g < groups; ++g) {
    const T* xp = x.v.data() + g * D;
    const T* gp = dy.v.data() + g * D;
    T* dxp = dx.v.data() + g * D;
    const T rg = r[g];
    T sgx = 0;
    for (int64_t i = 0; i < D; ++i) {
      sgx += gp[i] * w[i] * xp[i];
      dw[i] += gp[i] * xp[i] * rg;
    }
    const T k = rg * rg * rg * sgx / static_cast<T>(D);
    for (int64_t i = 0; i < D; ++i) dxp[i] += rg * gp[i] * w[i] - k * xp[i];
  }
}

// Neox RoPE over the full head_dim of every head of x [rows, heads·d] at positions pos[row];
// sign -1 rotates backwards (the transpose: the backward of the forward rotation).
// (The angles are computed in double for either T.)
template <class T>
inline void rope(MatT<T>& x, int64_t d, const std::vector<int64_t>& pos, double theta, double sign) {
  const int64_t half = d / 2, heads = x.cols / d;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -static_cast<double>(2 * i) / static_cast<double>(d));
  for (int64_t r = 0; r < x.rows; ++r)
    for (int64_t i = 0; i < half; ++i) {
      const double ang = static_cast<double>(pos[r]) * inv_freq[i];
      const T c = static_cast<T>(std::cos(ang)), s = static_cast<T>(sign * std::sin(ang));
      for (int64_t h = 0; h < heads; ++h) {
        T* p = x.row(r) + h * d;
        const T x1 = p[i], x2 = p[i + half];
        p[i] = x1 * c - x2 * s;
        p[i + half] = x2 * c + x1 * s;
      }
    }
}

template <class T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// Parameter slots of one layer, in DrafterWeights::entries order.
enum Slot { Q, K, V, O, QN, KN, GATE, UP, DOWN, IN_LN, POST_LN, kSlots };

// Every parameter as a Mat, in DrafterWeights::entries order: [0] fc, [1] hidden_norm, then each
// layer's kSlots (param_index), and norm last.
template <class T = double>
inline std::vector<MatT<T>> load_params(const DrafterConfig& c, const DrafterWeights& w) {
  std::vector<MatT<T>> P;
  for (const auto& e : const_cast<DrafterWeights&>(w).entries(c)) P.push_back(to_mat<T>(*e.tensor));
  return P;
}
inline size_t param_index(int64_t layer, int slot) { return static_cast<size_t>(2 + layer * kSlots + slot); }

// h.row(i) = table[tokens[i]] for a host [V, H] table of any float dtype (ids already checked).
template <class T>
inline void embed_rows(const Tensor& table, const std::vector<int64_t>& tokens, MatT<T>& h) {
  const Tensor emb = table.contiguous();
  const auto* base = static_cast<const uint8_t*>(emb.raw_data());
  const size_t es = dtype_size(emb.dtype());
  for (size_t i = 0; i < tokens.size(); ++i)
    convert_elements(base + static_cast<size_t>(tokens[i] * h.cols) * es, emb.dtype(), h.row(static_cast<int64_t>(i)),
                     dtype_of<T>(), h.cols);
}

// A key of a block query: a context token (global index n) or a block row (global row index).
struct Key {
  bool in_block;
  int64_t index;
};

// The keys the query at block offset j of a block (anchor `anchor`, B rows) attends, in the order
// the softmax sums them: the sequence's context tokens t in [0, ctx_len) where mask_allows lets
// them (global index ctx_base + t), then the block's rows jj (global row blk_base + jj).
inline void block_keys(AttnType type, int64_t window, int64_t anchor, int64_t j, int64_t ctx_len, int64_t ctx_base,
                       int64_t B, int64_t blk_base, MaskVariant variant, std::vector<Key>& keys) {
  keys.clear();
  for (int64_t t = 0; t < ctx_len; ++t)
    if (mask_allows(type, window, anchor, j, false, t, variant)) keys.push_back({false, ctx_base + t});
  for (int64_t jj = 0; jj < B; ++jj)
    if (mask_allows(type, window, anchor, j, true, jj, variant)) keys.push_back({true, blk_base + jj});
}

// Softmax attention of one query row q [Hq·d] over `keys` (context keys/values in kc / vc, block
// keys/values in kb / vb, [rows, Hkv·d]); query head hq reads kv head hq / group. p gets the
// Hq × keys softmax weights; out [Hq·d] += Σ p·v.
template <class T>
inline void attend(const T* q, const std::vector<Key>& keys, const MatT<T>& kc, const MatT<T>& vc, const MatT<T>& kb,
                   const MatT<T>& vb, int64_t Hq, int64_t group, int64_t d, T scale, std::vector<T>& p, T* out) {
  const int64_t nk = static_cast<int64_t>(keys.size());
  p.assign(static_cast<size_t>(Hq * nk), T(0));
  for (int64_t hq = 0; hq < Hq; ++hq) {
    const int64_t kvo = (hq / group) * d;
    const T* qv = q + hq * d;
    T* ph = p.data() + hq * nk;
    T mx = -INFINITY;
    for (int64_t i = 0; i < nk; ++i) {
      const T* kv = (keys[i].in_block ? kb.row(keys[i].index) : kc.row(keys[i].index)) + kvo;
      ph[i] = dot(qv, kv, d) * scale;
      mx = std::max(mx, ph[i]);
    }
    T sum = 0;
    for (int64_t i = 0; i < nk; ++i) sum += (ph[i] = std::exp(ph[i] - mx));
    T* ov = out + hq * d;
    for (int64_t i = 0; i < nk; ++i) {
      ph[i] /= sum;
      const T* vv = (keys[i].in_block ? vb.row(keys[i].index) : vc.row(keys[i].index)) + kvo;
      axpy(ov, ph[i], vv, d);
    }
  }
}

}  // namespace dflash::drafter::ref
