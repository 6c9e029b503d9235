#pragma once
// The CPU reference's double-precision building blocks (internal to drafter/): the training forward
// and backward (model.cpp) and the inference proposer (decode.cpp) are written with the same
// helpers, so that proposing a block computes exactly what the training forward computes for it.
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
#include "kernels/cpu/train_ops.h"

namespace dflash::drafter::ref {

// A row-major matrix of doubles: the reference's only working type.
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  Mat() = default;
  Mat(int64_t r, int64_t c) : rows(r), cols(c), v(static_cast<size_t>(r * c), 0.0) {}
  double* row(int64_t i) { return v.data() + i * cols; }
  const double* row(int64_t i) const { return v.data() + i * cols; }
};

// Host tensor of any float dtype -> [numel / last, last] doubles (1-D tensors become one row).
inline Mat to_mat(const Tensor& t) {
  const Tensor c = t.contiguous();
  const int64_t cols = c.dim() == 0 ? 1 : c.size(-1);
  Mat m(cols ? c.numel() / cols : 0, cols);
  convert_elements(c.raw_data(), c.dtype(), m.v.data(), DType::F64, c.numel());
  return m;
}

// t += m, for F32 / F64 host gradient buffers.
inline void add_into(Tensor& t, const Mat& m, const std::string& name) {
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

inline Tensor to_f64_tensor(const Mat& m) {
  Tensor t = Tensor::empty({m.rows, m.cols}, DType::F64);
  std::copy(m.v.begin(), m.v.end(), t.data<double>());
  return t;
}

inline double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
inline void axpy(double* y, double a, const double* x, int64_t n) {
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

// Plain RMSNorm (x̂·w) over consecutive groups of D values (D = cols, or head_dim per head).
inline Mat rms(const Mat& x, const std::vector<double>& w, int64_t D, double eps, std::vector<double>& r) {
  Mat y(x.rows, x.cols);
  const int64_t groups = static_cast<int64_t>(x.v.size()) / D;
  r.assign(static_cast<size_t>(groups), 0.0);
  for (int64_t g = 0; g < groups; ++g) {
    const double* xp = x.v.data() + g * D;
    double* yp = y.v.data() + g * D;
    const double rg = 1.0 / std::sqrt(dot(xp, xp, D) / static_cast<double>(D) + eps);
    r[g] = rg;
    for (int64_t i = 0; i < D; ++i) yp[i] = xp[i] * rg * w[i];
  }
  return y;
}
// dx += d/dx, dw += d/dw of y = x·r·w with r = (mean x² + eps)^-1/2.
inline void rms_bwd(const Mat& x, const std::vector<double>& w, const std::vector<double>& r, int64_t D, const Mat& dy,
                    Mat& dx, std::vector<double>& dw) {
  const int64_t groups = static_cast<int64_t>(r.size());
  for (int64_t g = 0; g < groups; ++g) {
    const double* xp = x.v.data() + g * D;
    const double* gp = dy.v.data() + g * D;
    double* dxp = dx.v.data() + g * D;
    const double rg = r[g];
    double sgx = 0;
    for (int64_t i = 0; i < D; ++i) {
      sgx += gp[i] * w[i] * xp[i];
      dw[i] += gp[i] * xp[i] * rg;
    }
    const double k = rg * rg * rg * sgx / static_cast<double>(D);
    for (int64_t i = 0; i < D; ++i) dxp[i] += rg * gp[i] * w[i] - k * xp[i];
  }
}

// Neox RoPE over the full head_dim of every head of x [rows, heads·d] at positions pos[row];
// sign -1 rotates backwards (the transpose: the backward of the forward rotation).
inline void rope(Mat& x, int64_t d, const std::vector<int64_t>& pos, double theta, double sign) {
  const int64_t half = d / 2, heads = x.cols / d;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -static_cast<double>(2 * i) / static_cast<double>(d));
  for (int64_t r = 0; r < x.rows; ++r)
    for (int64_t i = 0; i < half; ++i) {
      const double ang = static_cast<double>(pos[r]) * inv_freq[i];
      const double c = std::cos(ang), s = sign * std::sin(ang);
      for (int64_t h = 0; h < heads; ++h) {
        double* p = x.row(r) + h * d;
        const double x1 = p[i], x2 = p[i + half];
        p[i] = x1 * c - x2 * s;
        p[i + half] = x2 * c + x1 * s;
      }
    }
}

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Parameter slots of one layer, in DrafterWeights::entries order.
enum Slot { Q, K, V, O, QN, KN, GATE, UP, DOWN, IN_LN, POST_LN, kSlots };

// Every parameter as a Mat, in DrafterWeights::entries order: [0] fc, [1] hidden_norm, then each
// layer's kSlots (param_index), and norm last.
inline std::vector<Mat> load_params(const DrafterConfig& c, const DrafterWeights& w) {
  std::vector<Mat> P;
  for (const auto& e : const_cast<DrafterWeights&>(w).entries(c)) P.push_back(to_mat(*e.tensor));
  return P;
}
inline size_t param_index(int64_t layer, int slot) { return static_cast<size_t>(2 + layer * kSlots + slot); }

// h.row(i) = table[tokens[i]] for a host [V, H] table of any float dtype (ids already checked).
inline void embed_rows(const Tensor& table, const std::vector<int64_t>& tokens, Mat& h) {
  const Tensor emb = table.contiguous();
  const auto* base = static_cast<const uint8_t*>(emb.raw_data());
  const size_t es = dtype_size(emb.dtype());
  for (size_t i = 0; i < tokens.size(); ++i)
    convert_elements(base + static_cast<size_t>(tokens[i] * h.cols) * es, emb.dtype(), h.row(static_cast<int64_t>(i)),
                     DType::F64, h.cols);
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
inline void attend(const double* q, const std::vector<Key>& keys, const Mat& kc, const Mat& vc, const Mat& kb,
                   const Mat& vb, int64_t Hq, int64_t group, int64_t d, double scale, std::vector<double>& p,
                   double* out) {
  const int64_t nk = static_cast<int64_t>(keys.size());
  p.assign(static_cast<size_t>(Hq * nk), 0.0);
  for (int64_t hq = 0; hq < Hq; ++hq) {
    const int64_t kvo = (hq / group) * d;
    const double* qv = q + hq * d;
    double* ph = p.data() + hq * nk;
    double mx = -INFINITY;
    for (int64_t i = 0; i < nk; ++i) {
      const double* kv = (keys[i].in_block ? kb.row(keys[i].index) : kc.row(keys[i].index)) + kvo;
      ph[i] = dot(qv, kv, d) * scale;
      mx = std::max(mx, ph[i]);
    }
    double sum = 0;
    for (int64_t i = 0; i < nk; ++i) sum += (ph[i] = std::exp(ph[i] - mx));
    double* ov = out + hq * d;
    for (int64_t i = 0; i < nk; ++i) {
      ph[i] /= sum;
      const double* vv = (keys[i].in_block ? vb.row(keys[i].index) : vc.row(keys[i].index)) + kvo;
      axpy(ov, ph[i], vv, d);
    }
  }
}

}  // namespace dflash::drafter::ref
