#include "drafter/loss.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"

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

}  // namespace dflash::drafter
