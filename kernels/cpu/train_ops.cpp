// CPU references of the drafter's training ops (kernels/cpu/train_ops.h), in double; and the f32
// twin of the fused linear cross-entropy (the CPU backend's fast drafter step).
#include "kernels/cpu/train_ops.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/gemm.h"

namespace dflash::cpu {

// y = x · rstd · w per row of D (x contiguous here); rstd out.
void rms_norm_fwd(const std::vector<double>& x, const std::vector<double>& w, int64_t rows, int64_t D, double eps,
                 std::vector<double>& y, std::vector<double>& rstd) {
  y.assign(static_cast<size_t>(rows * D), 0);
  rstd.assign(static_cast<size_t>(rows), 0);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += x[r * D + i] * x[r * D + i];
    rstd[r] = 1.0 / std::sqrt(ss / static_cast<double>(D) + eps);
    for (int64_t i = 0; i < D; ++i) y[r * D + i] = x[r * D + i] * rstd[r] * w[i];
  }
}
// dx = rstd · (w·dy − x̂ · mean(x̂ · w·dy)) (written), dw += Σ dy · x̂, with the given rstd.
void rms_norm_bwd(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& rstd,
                 const std::vector<double>& dy, int64_t rows, int64_t D, std::vector<double>& dx,
                 std::vector<double>& dw) {
  dx.assign(static_cast<size_t>(rows * D), 0);
  for (int64_t r = 0; r < rows; ++r) {
    double c = 0;
    for (int64_t i = 0; i < D; ++i) c += x[r * D + i] * rstd[r] * w[i] * dy[r * D + i];
    c /= static_cast<double>(D);
    for (int64_t i = 0; i < D; ++i) {
      const double xh = x[r * D + i] * rstd[r];
      dx[r * D + i] = rstd[r] * (w[i] * dy[r * D + i] - xh * c);
      dw[i] += dy[r * D + i] * xh;
    }
  }
}

// inv_freq as the kernel uses it: f32 of the double value; the angle is the f32 product.
std::vector<double> rope_angles_f32(int64_t d, double theta, int32_t pos) {
  std::vector<double> a(static_cast<size_t>(d / 2));
  for (int64_t i = 0; i < d / 2; ++i) {
    const auto f = static_cast<float>(1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(d)));
    a[i] = static_cast<double>(static_cast<float>(pos) * f);
  }
  return a;
}
// Per (row, head): n = x̂ · w, y = rope(n); x contiguous [rows, heads, d].
void head_norm_rope_fwd(const std::vector<double>& x, const std::vector<double>& w, const std::vector<int32_t>& pos,
                 int64_t rows, int64_t heads, int64_t d, double eps, double theta, std::vector<double>& y,
                 std::vector<double>& rstd) {
  const int64_t half = d / 2;
  y.assign(static_cast<size_t>(rows * heads * d), 0);
  rstd.assign(static_cast<size_t>(rows * heads), 0);
  for (int64_t r = 0; r < rows; ++r) {
    const auto ang = rope_angles_f32(d, theta, pos[r]);
    for (int64_t h = 0; h < heads; ++h) {
      const double* xr = &x[(r * heads + h) * d];
      double ss = 0;
      for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
      const double rs = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
      rstd[r * heads + h] = rs;
      double* yr = &y[(r * heads + h) * d];
      for (int64_t i = 0; i < half; ++i) {
        const double n1 = xr[i] * rs * w[i], n2 = xr[i + half] * rs * w[i + half];
        const double c = std::cos(ang[i]), s = std::sin(ang[i]);
        yr[i] = n1 * c - n2 * s;
        yr[i + half] = n2 * c + n1 * s;
      }
    }
  }
}
// Backward: dn = rotation of dy by −angle, then plain RMSNorm backward per head.
void head_norm_rope_bwd(const std::vector<double>& x, const std::vector<double>& w, const std::vector<int32_t>& pos,
                 const std::vector<double>& rstd, const std::vector<double>& dy, int64_t rows, int64_t heads, int64_t d,
                 double theta, std::vector<double>& dx, std::vector<double>& dw) {
  const int64_t half = d / 2;
  std::vector<double> dn(dy.size());
  for (int64_t r = 0; r < rows; ++r) {
    const auto ang = rope_angles_f32(d, theta, pos[r]);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const int64_t b = (r * heads + h) * d;
        const double c = std::cos(ang[i]), s = std::sin(ang[i]);
        dn[b + i] = dy[b + i] * c + dy[b + i + half] * s;
        dn[b + i + half] = dy[b + i + half] * c - dy[b + i] * s;
      }
  }
  rms_norm_bwd(x, w, rstd, dn, rows * heads, d, dx, dw);
}

BlockAttentionRef block_attention(const BlockAttentionShape& s, const std::vector<double>& q,
                                  const std::vector<double>& kc, const std::vector<double>& vc,
                                  const std::vector<double>& kb, const std::vector<double>& vb,
                                  const std::vector<double>& dout, const BlockKeyAllowed& allowed) {
  const int64_t d = s.d, Hq = s.Hq, Hkv = s.Hkv, G = Hq / Hkv, B = s.B;
  const int64_t nb = static_cast<int64_t>(s.anchor.size()), R = nb * B, N = s.cu_seqlens.back();
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  BlockAttentionRef r;
  r.out.assign(R * Hq * d, 0.0);
  r.lse.assign(R * Hq, 0.0);
  r.dq.assign(R * Hq * d, 0.0);
  r.dkc.assign(N * Hkv * d, 0.0);
  r.dvc.assign(N * Hkv * d, 0.0);
  r.dkb.assign(R * Hkv * d, 0.0);
  r.dvb.assign(R * Hkv * d, 0.0);
  r.ctx_attended.assign(N, 0);
  struct Key {
    bool in_block;
    int64_t row;  // context row (global) or block row
  };
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t a = s.anchor[b], off = s.cu_seqlens[s.block_seq[b]];
    for (int64_t j = 0; j < B; ++j) {
      std::vector<Key> keys;
      const int64_t S = s.cu_seqlens[s.block_seq[b] + 1] - off;
      for (int64_t t = 0; t < S; ++t)  // every context row of the sequence: the mask decides
        if (allowed(a, j, false, t))
          keys.push_back({false, off + t});
      for (int64_t jj = 0; jj < B; ++jj)
        if (allowed(a, j, true, jj)) keys.push_back({true, b * B + jj});
      const int64_t row = b * B + j;
      for (const Key& k : keys)
        if (!k.in_block) r.ctx_attended[k.row] = 1;
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t kv = h / G;
        const double* qv = &q[(row * Hq + h) * d];
        const double* gv = &dout[(row * Hq + h) * d];
        auto kptr = [&](const Key& k, bool v) {
          const auto& src = k.in_block ? (v ? vb : kb) : (v ? vc : kc);
          return &src[(k.row * Hkv + kv) * d];
        };
        std::vector<double> sc(keys.size());
        double mx = -INFINITY;
        for (size_t i = 0; i < keys.size(); ++i) {
          const double* kr = kptr(keys[i], false);
          double dot = 0;
          for (int64_t e = 0; e < d; ++e) dot += qv[e] * kr[e];
          sc[i] = dot * scale;
          mx = std::max(mx, sc[i]);
        }
        double sum = 0;
        for (double& x : sc) sum += (x = std::exp(x - mx));
        double* o = &r.out[(row * Hq + h) * d];
        for (size_t i = 0; i < keys.size(); ++i) {
          sc[i] /= sum;
          const double* vr = kptr(keys[i], true);
          for (int64_t e = 0; e < d; ++e) o[e] += sc[i] * vr[e];
        }
        r.lse[row * Hq + h] = mx + std::log(sum);
        double delta = 0;
        for (int64_t e = 0; e < d; ++e) delta += gv[e] * o[e];
        double* dq = &r.dq[(row * Hq + h) * d];
        for (size_t i = 0; i < keys.size(); ++i) {
          const double* kr = kptr(keys[i], false);
          const double* vr = kptr(keys[i], true);
          double dp = 0;
          for (int64_t e = 0; e < d; ++e) dp += gv[e] * vr[e];
          const double ds = sc[i] * (dp - delta);
          auto& dk = keys[i].in_block ? r.dkb : r.dkc;
          auto& dv = keys[i].in_block ? r.dvb : r.dvc;
          double* dkr = &dk[(keys[i].row * Hkv + kv) * d];
          double* dvr = &dv[(keys[i].row * Hkv + kv) * d];
          for (int64_t e = 0; e < d; ++e) {
            dq[e] += scale * ds * kr[e];
            dkr[e] += scale * ds * qv[e];
            dvr[e] += sc[i] * gv[e];
          }
        }
      }
    }
  }
  return r;
}

namespace {

// The argument checks of fused_linear_ce and its f32 twin (`op` names which; f32_head: lm_head must be F32).
void check_ce_args(const char* op, int64_t rows, int64_t H, const Tensor& lm_head, bool f32_head,
                   const std::vector<int32_t>& labels, const std::vector<double>& weights, int64_t chunk_rows) {
  DFLASH_CHECK(chunk_rows > 0, op << ": chunk_rows must be positive, got " << chunk_rows);
  DFLASH_CHECK(lm_head.defined() && lm_head.device().is_cpu() && lm_head.is_contiguous() && lm_head.dim() == 2 &&
                   lm_head.size(1) == H && (f32_head ? lm_head.dtype() == DType::F32 : dtype_is_float(lm_head.dtype())),
               op << ": lm_head must be a contiguous host " << (f32_head ? "F32" : "float") << " tensor [V, " << H
                  << "], got " << (lm_head.defined() ? lm_head.describe() : "undefined"));
  DFLASH_CHECK(static_cast<int64_t>(labels.size()) == rows && static_cast<int64_t>(weights.size()) == rows,
               op << ": " << rows << " rows but " << labels.size() << " labels and " << weights.size() << " weights");
}

// The rows of [r0, r1) with weight > 0, their labels checked against the vocabulary [0, V).
void live_rows(const char* op, int64_t r0, int64_t r1, const std::vector<int32_t>& labels,
               const std::vector<double>& weights, int64_t V, std::vector<int64_t>& live) {
  live.clear();
  for (int64_t r = r0; r < r1; ++r)
    if (weights[r] > 0) {
      DFLASH_CHECK(labels[r] >= 0 && labels[r] < V,
                   op << ": label " << labels[r] << " of row " << r << " is outside the vocabulary [0, " << V << ")");
      live.push_back(r);
    }
}

}  // namespace

CeSums fused_linear_ce(const double* hidden, int64_t rows, int64_t H, const Tensor& lm_head,
                       const std::vector<int32_t>& labels, const std::vector<double>& weights, int64_t chunk_rows,
                       double grad_scale, double* dhidden, std::vector<int32_t>* argmax) {
  check_ce_args("fused_linear_ce", rows, H, lm_head, false, labels, weights, chunk_rows);
  const int64_t V = lm_head.size(0);
  const size_t esize = dtype_size(lm_head.dtype());
  const auto* base = static_cast<const uint8_t*>(lm_head.raw_data());
  if (argmax) argmax->assign(static_cast<size_t>(rows), -1);
  CeSums sums;
  std::vector<double> wrow(static_cast<size_t>(H));
  auto head_row = [&](int64_t v) {  // lm_head row v as doubles
    convert_elements(base + static_cast<size_t>(v * H) * esize, lm_head.dtype(), wrow.data(), DType::F64, H);
    return wrow.data();
  };
  std::vector<int64_t> live;
  std::vector<double> logits;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t r1 = std::min(rows, r0 + chunk_rows);
    live_rows("fused_linear_ce", r0, r1, labels, weights, V, live);
    if (live.empty()) continue;
    const int64_t n = static_cast<int64_t>(live.size());
    logits.assign(static_cast<size_t>(n * V), 0.0);  // the only [rows, V] buffer: one chunk
    for (int64_t v = 0; v < V; ++v) {
      const double* w = head_row(v);
      // Each logit one sum in ascending c; four rows at a time so that their chains overlap (the
      // same values bit for bit: the serial double sum is latency-bound, not the arithmetic).
      int64_t i = 0;
      for (; i + 4 <= n; i += 4) {
        double s[4];
        dot4(w, hidden + live[i] * H, hidden + live[i + 1] * H, hidden + live[i + 2] * H, hidden + live[i + 3] * H, H, s);
        for (int j = 0; j < 4; ++j) logits[(i + j) * V + v] = s[j];
      }
      for (; i < n; ++i) {
        const double* h = hidden + live[i] * H;
        double s = 0;
        for (int64_t c = 0; c < H; ++c) s += h[c] * w[c];
        logits[i * V + v] = s;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      double* z = &logits[i * V];
      const int64_t r = live[i];
      int64_t best = 0;
      for (int64_t v = 1; v < V; ++v)
        if (z[v] > z[best]) best = v;
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - z[best]);
      const double lse = z[best] + std::log(sum);
      sums.weighted_ce_sum += weights[r] * (lse - z[labels[r]]);
      sums.weight_sum += weights[r];
      if (argmax) (*argmax)[r] = static_cast<int32_t>(best);
      // Turn the row into dCE/dz scaled by w·grad_scale: softmax - onehot.
      for (int64_t v = 0; v < V; ++v) z[v] = std::exp(z[v] - lse);
      z[labels[r]] -= 1.0;
      for (int64_t v = 0; v < V; ++v) z[v] *= weights[r] * grad_scale;
    }
    if (!dhidden) continue;
    for (int64_t v = 0; v < V; ++v) {
      const double* w = head_row(v);
      for (int64_t i = 0; i < n; ++i) {
        const double g = logits[i * V + v];
        double* dh = dhidden + live[i] * H;
        for (int64_t c = 0; c < H; ++c) dh[c] += g * w[c];
      }
    }
  }
  return sums;
}

CeSums fused_linear_ce_f32(const float* hidden, int64_t rows, int64_t H, const Tensor& lm_head,
                           const std::vector<int32_t>& labels, const std::vector<double>& weights, int64_t chunk_rows,
                           double grad_scale, float* dhidden, std::vector<int32_t>* argmax, bool fp8) {
  check_ce_args("fused_linear_ce_f32", rows, H, lm_head, true, labels, weights, chunk_rows);
  const int64_t V = lm_head.size(0);
  const float* W = lm_head.data<float>();
  if (argmax) argmax->assign(static_cast<size_t>(rows), -1);
  CeSums sums;
  std::vector<int64_t> live;
  std::vector<float> x, logits, dx;
  std::vector<double> ce;
  std::vector<int32_t> best;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t r1 = std::min(rows, r0 + chunk_rows);
    live_rows("fused_linear_ce_f32", r0, r1, labels, weights, V, live);
    if (live.empty()) continue;
    const int64_t n = static_cast<int64_t>(live.size());
    x.resize(static_cast<size_t>(n * H));
    for (int64_t i = 0; i < n; ++i) std::copy_n(hidden + live[i] * H, H, x.data() + i * H);
    if (fp8) fake_quantize_e4m3(x.data(), n, H, 1, 128);
    logits.resize(static_cast<size_t>(n * V));  // the only [rows, V] buffer: one chunk
    gemm_f32(Trans::N, Trans::T, n, V, H, x.data(), H, W, H, false, logits.data(), V);
    ce.assign(static_cast<size_t>(n), 0.0);
    best.assign(static_cast<size_t>(n), 0);
    parallel_for(n, [&](int64_t i) {
      float* z = &logits[i * V];
      const int64_t r = live[i];
      int64_t b = 0;
      for (int64_t v = 1; v < V; ++v)
        if (z[v] > z[b]) b = v;
      // exp in float (vectorized), its sum in double in index order.
      const float zb = z[b];
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += static_cast<double>(std::exp(z[v] - zb));
      const double lse = static_cast<double>(zb) + std::log(sum);
      ce[i] = lse - static_cast<double>(z[labels[r]]);
      best[i] = static_cast<int32_t>(b);
      // The row becomes dCE/dz scaled by w·grad_scale: softmax - onehot.
      const float f = static_cast<float>(weights[r] * grad_scale), lsef = static_cast<float>(lse);
      for (int64_t v = 0; v < V; ++v) z[v] = std::exp(z[v] - lsef) * f;
      z[labels[r]] -= f;
    });
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = live[i];
      sums.weighted_ce_sum += weights[r] * ce[i];
      sums.weight_sum += weights[r];
      if (argmax) (*argmax)[r] = best[i];
    }
    if (!dhidden) continue;
    dx.resize(static_cast<size_t>(n * H));
    if (fp8) fake_quantize_e4m3(logits.data(), n, V, 1, 128);
    gemm_f32(Trans::N, Trans::N, n, H, V, logits.data(), V, W, H, false, dx.data(), H);
    for (int64_t i = 0; i < n; ++i) {
      float* dh = dhidden + live[i] * H;
      const float* g = dx.data() + i * H;
      for (int64_t c = 0; c < H; ++c) dh[c] += g[c];
    }
  }
  return sums;
}

}  // namespace dflash::cpu
