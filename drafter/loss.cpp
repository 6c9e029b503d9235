#include "drafter/loss.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/error.h"
#include "kernels/rng.h"

namespace dflash::drafter {

std::vector<int64_t> sample_anchors(const uint8_t* loss_mask, int64_t seq_len, int64_t num_anchors, uint64_t seed,
                                    uint64_t stream) {
  DFLASH_CHECK(num_anchors >= 0, "sample_anchors: num_anchors must be >= 0, got " << num_anchors);
  std::vector<int64_t> cand;
  for (int64_t t = 0; t + 1 < seq_len; ++t)
    if (loss_mask[t] && loss_mask[t + 1]) cand.push_back(t);
  const int64_t n = static_cast<int64_t>(cand.size()), take = std::min(n, num_anchors);
  for (int64_t i = 0; i < take; ++i) {
    // Uniform in [0, n - i) from 64 random bits (Lemire's multiply-shift; bias < 2^-32).
    const uint64_t r = (static_cast<uint64_t>(rng::bits(seed, stream, 2 * i)) << 32) |
                       rng::bits(seed, stream, 2 * i + 1);
    const uint64_t range = static_cast<uint64_t>(n - i);
    const int64_t j = i + static_cast<int64_t>((static_cast<unsigned __int128>(r) * range) >> 64);
    std::swap(cand[i], cand[j]);
  }
  cand.resize(take);
  std::sort(cand.begin(), cand.end());
  return cand;
}

BlockLabel block_label(const uint8_t* loss_mask, int64_t seq_len, int64_t anchor, int64_t k, double gamma,
                       int64_t label_shift) {
  BlockLabel l;
  if (k < 1) return l;
  const int64_t p = anchor + k + label_shift;
  if (p < 0 || p >= seq_len) return l;
  l.position = p;
  l.weight = loss_mask[p] ? std::exp(-static_cast<double>(k - 1) / gamma) : 0.0;
  return l;
}

double StepStats::accuracy(int64_t k) const {
  if (k < 0 || k >= static_cast<int64_t>(counted.size()) || counted[k] == 0) return 0.0;
  return static_cast<double>(correct[k]) / static_cast<double>(counted[k]);
}

void StepStats::add(const StepStats& o) {
  weighted_ce_sum += o.weighted_ce_sum;
  weight_sum += o.weight_sum;
  if (correct.size() < o.correct.size()) correct.resize(o.correct.size(), 0);
  if (counted.size() < o.counted.size()) counted.resize(o.counted.size(), 0);
  for (size_t i = 0; i < o.correct.size(); ++i) correct[i] += o.correct[i];
  for (size_t i = 0; i < o.counted.size(); ++i) counted[i] += o.counted[i];
  accept_len_sum += o.accept_len_sum;
  num_blocks += o.num_blocks;
}

CeSums fused_linear_ce(const double* hidden, int64_t rows, int64_t H, const Tensor& lm_head,
                       const std::vector<int32_t>& labels, const std::vector<double>& weights, int64_t chunk_rows,
                       double grad_scale, double* dhidden, std::vector<int32_t>* argmax) {
  DFLASH_CHECK(chunk_rows > 0, "fused_linear_ce: chunk_rows must be positive, got " << chunk_rows);
  DFLASH_CHECK(lm_head.defined() && lm_head.device().is_cpu() && lm_head.is_contiguous() && lm_head.dim() == 2 &&
                   lm_head.size(1) == H && dtype_is_float(lm_head.dtype()),
               "fused_linear_ce: lm_head must be a contiguous host float tensor [V, " << H << "], got "
                                                                                    << (lm_head.defined() ? lm_head.describe() : "undefined"));
  DFLASH_CHECK(static_cast<int64_t>(labels.size()) == rows && static_cast<int64_t>(weights.size()) == rows,
               "fused_linear_ce: " << rows << " rows but " << labels.size() << " labels and " << weights.size()
                                   << " weights");
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
    live.clear();
    for (int64_t r = r0; r < r1; ++r)
      if (weights[r] > 0) {
        DFLASH_CHECK(labels[r] >= 0 && labels[r] < V,
                     "fused_linear_ce: label " << labels[r] << " of row " << r << " is outside the vocabulary [0, " << V << ")");
        live.push_back(r);
      }
    if (live.empty()) continue;
    const int64_t n = static_cast<int64_t>(live.size());
    logits.assign(static_cast<size_t>(n * V), 0.0);  // the only [rows, V] buffer: one chunk
    for (int64_t v = 0; v < V; ++v) {
      const double* w = head_row(v);
      for (int64_t i = 0; i < n; ++i) {
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

}  // namespace dflash::drafter
