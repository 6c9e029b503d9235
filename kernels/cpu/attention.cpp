// CPU reference for causal GQA softmax attention (f32, max-subtracted softmax, one pass per query).
#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"

namespace dflash::ops {

void causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, const SeqOffsets& seqs, float scale,
                      Tensor& out) {
  using detail::require_host_f32;
  require_host_f32(q, "causal_attention", "q");
  require_host_f32(k, "causal_attention", "k");
  require_host_f32(v, "causal_attention", "v");
  require_host_f32(out, "causal_attention", "out");
  DFLASH_CHECK(q.dim() == 3 && k.dim() == 3, "causal_attention: q, k, v must be [N, H, D]");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1);
  detail::require_shape(k, {N, Hkv, D}, "causal_attention", "k");
  detail::require_shape(v, {N, Hkv, D}, "causal_attention", "v");
  detail::require_shape(out, {N, Hq, D}, "causal_attention", "out");
  DFLASH_CHECK(Hkv > 0 && Hq % Hkv == 0, "causal_attention: " << Hq << " query heads do not divide into " << Hkv
                                                               << " kv heads");
  seqs.validate(N, "causal_attention");
  const int64_t group = Hq / Hkv;
  const float* Q = q.data<float>();
  const float* Kp = k.data<float>();
  const float* V = v.data<float>();
  float* O = out.data<float>();
  std::vector<float> scores;
  for (int64_t s = 0; s < seqs.num_sequences(); ++s) {
    const int64_t begin = seqs.offsets[s], end = seqs.offsets[s + 1];
    scores.resize(static_cast<size_t>(end - begin));
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t kh = h / group;
        const float* qr = Q + (t * Hq + h) * D;
        float mx = -INFINITY;
        for (int64_t j = begin; j <= t; ++j) {
          const float* kr = Kp + (j * Hkv + kh) * D;
          float dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
          float sc = dot * scale;
          scores[static_cast<size_t>(j - begin)] = sc;
          mx = std::max(mx, sc);
        }
        float denom = 0;
        for (int64_t j = begin; j <= t; ++j) {
          float e = std::exp(scores[static_cast<size_t>(j - begin)] - mx);
          scores[static_cast<size_t>(j - begin)] = e;
          denom += e;
        }
        float* orow = O + (t * Hq + h) * D;
        std::fill(orow, orow + D, 0.0f);
        for (int64_t j = begin; j <= t; ++j) {
          const float p = scores[static_cast<size_t>(j - begin)] / denom;
          const float* vr = V + (j * Hkv + kh) * D;
          for (int64_t d = 0; d < D; ++d) orow[d] += p * vr[d];
        }
      }
    }
  }
}

}  // namespace dflash::ops
