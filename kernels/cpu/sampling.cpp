// CPU reference of the sampling ops (kernels/ops.h "sampling"): the greedy argmax over each row of
// logits and temperature / top-p sampling, the oracles of cuda::argmax_rows and cuda::sample_rows.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>

#include "kernels/cpu/common.h"
#include "core/rng.h"

namespace dflash::ops {

namespace {

// The logits both ops take: a 2-D host float tensor [R, V] with 1 <= V < 2^31 (ids fit int32).
void check_logits(const Tensor& logits, const char* op) {
  DFLASH_CHECK(logits.defined() && logits.device().is_cpu() && logits.dim() == 2 && dtype_is_float(logits.dtype()),
               op << ": logits must be a 2-D host float tensor [R, V], got "
                  << (logits.defined() ? logits.describe() : "undefined"));
  const int64_t V = logits.size(1);
  DFLASH_CHECK(V >= 1 && V <= std::numeric_limits<int32_t>::max(),
               op << ": the vocabulary dimension V = " << V << " must be in [1, 2^31)");
}

// f(r, row) for each row r of logits [R, V], the row converted to T (F64 or F32) in one buffer that
// every row reuses.
template <typename T, typename F>
void for_each_row(const Tensor& logits, F f) {
  const Tensor x = logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  std::vector<T> row(static_cast<size_t>(V));
  const size_t row_bytes = static_cast<size_t>(V) * dtype_size(x.dtype());
  for (int64_t r = 0; r < R; ++r) {
    convert_elements(static_cast<const uint8_t*>(x.raw_data()) + r * row_bytes, x.dtype(), row.data(),
                     std::is_same_v<T, double> ? DType::F64 : DType::F32, V);
    f(r, row);
  }
}

}  // namespace

void argmax_rows(const Tensor& logits, std::vector<int32_t>& out) {
  check_logits(logits, "argmax_rows");
  const int64_t R = logits.size(0), V = logits.size(1);
  out.assign(static_cast<size_t>(R), 0);
  for_each_row<double>(logits, [&](int64_t r, const std::vector<double>& row) {
    int64_t best = -1;
    for (int64_t v = 0; v < V; ++v)
      if (!std::isnan(row[v]) && (best < 0 || row[v] > row[best])) best = v;  // strictly greater: the lowest id wins
    out[r] = static_cast<int32_t>(best < 0 ? 0 : best);
  });
}

void check_sample_params(const SampleParams& p) {
  DFLASH_CHECK_HINT(std::isfinite(p.temperature) && p.temperature > 0,
                    "sampling: temperature = " << p.temperature << " must be > 0",
                    "temperature 0 is greedy decoding; use a positive temperature to sample");
  DFLASH_CHECK_HINT(std::isfinite(p.top_p) && p.top_p > 0 && p.top_p <= 1,
                    "sampling: top_p = " << p.top_p << " must be in (0, 1]", "top_p = 1 keeps every token");
}

float nucleus_threshold(const float* z, int64_t V, float top_p, double* margin) {
  if (margin) *margin = std::numeric_limits<double>::infinity();
  std::vector<int64_t> idx;
  idx.reserve(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v)
    if (!std::isnan(z[v])) idx.push_back(v);
  if (idx.empty()) return std::numeric_limits<float>::infinity();  // nothing can be chosen
  std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
  const double m = z[idx.front()];
  if (top_p >= 1.0f || std::isinf(m)) return z[idx.back()];
  double total = 0;
  for (int64_t v : idx) total += std::exp(static_cast<double>(z[v]) - m);
  const double want = static_cast<double>(top_p) * total;
  double before = 0;
  for (size_t i = 0; i < idx.size();) {
    size_t j = i;
    double group = 0;  // the mass of every token with this value
    while (j < idx.size() && z[idx[j]] == z[idx[i]]) group += std::exp(static_cast<double>(z[idx[j++]]) - m);
    if (before + group >= want || j == idx.size()) {
      if (margin)
        *margin = std::min(std::abs(before / total - top_p), std::abs((before + group) / total - top_p));
      return z[idx[i]];
    }
    before += group;
    i = j;
  }
  return z[idx.back()];
}

void sample_rows(const Tensor& logits, const SampleParams& p, const std::vector<uint64_t>& streams,
                 const std::vector<int64_t>& positions, std::vector<int32_t>& out) {
  check_logits(logits, "sample_rows");
  check_sample_params(p);
  const int64_t R = logits.size(0), V = logits.size(1);
  DFLASH_CHECK(static_cast<int64_t>(streams.size()) == R && static_cast<int64_t>(positions.size()) == R,
               "sample_rows: " << R << " rows but " << streams.size() << " streams and " << positions.size() << " positions");
  out.assign(static_cast<size_t>(R), 0);
  for_each_row<float>(logits, [&](int64_t r, std::vector<float>& z) {
    for (float& f : z) f = f / p.temperature;
    const float zc = nucleus_threshold(z.data(), V, p.top_p);
    const uint64_t base = static_cast<uint64_t>(positions[r]) * static_cast<uint64_t>(V);
    int64_t best = -1;
    double best_score = 0;
    for (int64_t v = 0; v < V; ++v) {
      if (std::isnan(z[v]) || !(z[v] >= zc)) continue;
      const uint32_t bits = rng::bits(p.seed, streams[r], base + static_cast<uint64_t>(v));
      const double u = (static_cast<double>(bits >> 8) + 0.5) * (1.0 / 16777216.0);
      const double score = static_cast<double>(z[v]) - std::log(-std::log(u));
      if (best < 0 || score > best_score) best = v, best_score = score;  // strictly greater: the lowest id wins
    }
    out[r] = static_cast<int32_t>(best < 0 ? 0 : best);
  });
}

}  // namespace dflash::ops
