#include "kernels/cases/op_cases.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace dflash::cases {

Tensor normal(Draw& d, const Shape& s, DType dt, Device dev, float stddev, float mean) {
  Tensor t = Tensor::empty(s, dt, dev);
  const RandomParams key = d.key();
  if (t.numel() > 0) fill_normal(t, key, mean, stddev);
  return t;
}

Tensor uniform(Draw& d, const Shape& s, DType dt, Device dev, float lo, float hi) {
  Tensor t = Tensor::empty(s, dt, dev);
  const RandomParams key = d.key();
  if (t.numel() > 0) fill_uniform(t, key, lo, hi);
  return t;
}

Tensor normalized_rows_bf16(Draw& d, const Shape& s, float scale) {
  Tensor t = normal(d, s, DType::F32, Device::cpu(), 1.0f);
  if (t.numel() > 0) ops::l2norm_inplace(t, 1e-6f);
  float* x = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) x[i] *= scale;
  return t.to_dtype(DType::BF16).to(Device::cuda(0));
}

Tensor host_f32(const Tensor& t) {
  Tensor h = t.device().is_cpu() ? t.contiguous() : t.contiguous().to(Device::cpu());
  return h.dtype() == DType::F32 ? h : h.to_dtype(DType::F32);
}

Tensor poisoned(const Shape& s, DType dt, Device dev) {
  Tensor t = Tensor::empty(s, dt, dev);
  if (t.numel() > 0) t.fill(std::numeric_limits<double>::quiet_NaN());
  return t;
}

Tensor host_poisoned(const Shape& s) { return poisoned(s, DType::F32, Device::cpu()); }

Tensor device_i32(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I32);
  std::copy(v.begin(), v.end(), t.data<int32_t>());
  return t.to(Device::cuda(0));
}

Tensor device_i32(const std::vector<int64_t>& v) {
  std::vector<int32_t> w(v.size());
  for (size_t i = 0; i < v.size(); ++i) w[i] = static_cast<int32_t>(v[i]);
  return device_i32(w);
}

ops::SeqOffsets offsets_of(const std::vector<int64_t>& lens) {
  ops::SeqOffsets s{{0}};
  for (int64_t l : lens) s.offsets.push_back(s.offsets.back() + l);
  return s;
}

std::string lens_str(const std::vector<int64_t>& lens) {
  std::string s = "{";
  for (size_t i = 0; i < lens.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(lens[i]);
  }
  return s + '}';
}

double max_rel_err(const Tensor& got, const Tensor& ref) {
  if (got.numel() != ref.numel()) return std::numeric_limits<double>::infinity();
  const Tensor g = host_f32(got).to_dtype(DType::F64), r = host_f32(ref).to_dtype(DType::F64);
  double max_diff = 0, max_ref = 0;
  for (int64_t i = 0; i < g.numel(); ++i) {
    const double a = g.data<double>()[i], b = r.data<double>()[i];
    if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::infinity();
    double diff = std::abs(a - b);
    if (std::isnan(diff)) diff = a == b ? 0 : std::numeric_limits<double>::infinity();  // inf - inf
    max_diff = std::max(max_diff, diff);
    max_ref = std::max(max_ref, std::abs(b));
  }
  return max_diff / std::max(max_ref, 1e-30);
}

std::vector<int32_t> SlotLayout::slots(int64_t set) const {
  const int64_t group = S + spare;
  std::vector<int32_t> v;
  for (int64_t s = 0; s < S; ++s) v.push_back(static_cast<int32_t>(set * group + (group - 1 - s) % group));
  return v;
}

std::vector<int32_t> SlotLayout::all() const {
  std::vector<int32_t> v;
  for (int64_t i = 0; i < sets; ++i) {
    const std::vector<int32_t> g = slots(i);
    v.insert(v.end(), g.begin(), g.end());
  }
  return v;
}

std::vector<int32_t> SlotLayout::unused(int64_t set) const {
  const std::vector<int32_t> used = slots(set);
  std::vector<int32_t> u;
  for (int32_t p = 0; p < pool(); ++p)
    if (std::find(used.begin(), used.end(), p) == used.end()) u.push_back(p);
  return u;
}

}  // namespace dflash::cases
