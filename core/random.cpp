#include "core/random.h"

#include "core/rng.h"

namespace dflash {

namespace {
void check_fillable(const Tensor& t, const char* op) {
  DFLASH_CHECK(t.defined() && dtype_is_float(t.dtype()), op << ": needs a floating tensor, got " << t.describe());
  DFLASH_CHECK(t.is_contiguous(), op << ": needs a contiguous tensor, got " << t.describe());
}

// Index of element i in the drawn stream (see RandomParams::row_stride).
int64_t source_index(const Tensor& t, const RandomParams& p, int64_t i) {
  if (p.row_stride <= 0) return p.index_offset + i;
  const int64_t cols = t.dim() > 0 && t.size(-1) > 0 ? t.size(-1) : 1;
  return p.index_offset + (i / cols) * p.row_stride + i % cols;
}

template <typename Draw>
void fill_host(Tensor& t, Draw draw) {
  const int64_t n = t.numel();
  if (t.dtype() == DType::F32) {
    float* d = t.data<float>();
    for (int64_t i = 0; i < n; ++i) d[i] = draw(i);
    return;
  }
  std::vector<float> tmp(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) tmp[static_cast<size_t>(i)] = draw(i);
  convert_elements(tmp.data(), DType::F32, t.raw_data(), t.dtype(), n);
}
}  // namespace

void fill_uniform(Tensor& t, const RandomParams& p, float lo, float hi) {
  check_fillable(t, "fill_uniform");
  if (t.device().is_cuda()) return cuda::fill_uniform(t, p, lo, hi);
  fill_host(t, [&](int64_t i) {
    return lo + (hi - lo) * rng::uniform(p.seed, p.stream, static_cast<uint64_t>(source_index(t, p, i)));
  });
}

void fill_normal(Tensor& t, const RandomParams& p, float mean, float stddev) {
  check_fillable(t, "fill_normal");
  if (t.device().is_cuda()) return cuda::fill_normal(t, p, mean, stddev);
  fill_host(t, [&](int64_t i) {
    return mean + stddev * rng::normal(p.seed, p.stream, static_cast<uint64_t>(source_index(t, p, i)));
  });
}

}  // namespace dflash
