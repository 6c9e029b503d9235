#include "core/tensor.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "core/device.h"
#include "core/fp8.h"

namespace dflash {

std::optional<DType> dtype_from_name(std::string_view name) {
  for (DType t : {DType::BF16, DType::F16, DType::F32, DType::F64, DType::I32, DType::I64, DType::U8, DType::F8E4M3})
    if (name == dtype_name(t)) return t;
  return std::nullopt;
}

uint16_t f32_to_f16(float f) {
  uint32_t x = f32_to_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t mant = x & 0x007fffffu;
  int32_t exp = static_cast<int32_t>((x >> 23) & 0xffu);
  if (exp == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0u));  // inf / NaN
  int32_t e = exp - 127 + 15;
  if (e >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (e <= 0) {                                                   // subnormal or zero
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x00800000u;
    uint32_t shift = static_cast<uint32_t>(14 - e);
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;  // may carry into the exponent: correct
  return static_cast<uint16_t>(half);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bits_to_f32(sign);
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (mant << 13));
  return bits_to_f32(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

Device Device::parse(const std::string& s) {
  if (s == "cpu") return cpu();
  if (s == "cuda") return cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    char* end = nullptr;
    long i = std::strtol(s.c_str() + 5, &end, 10);
    if (end && *end == '\0' && s.size() > 5 && i >= 0 && i < 1024) return cuda(static_cast<int>(i));
  }
  DFLASH_FAIL_HINT("unknown device '" << s << "'", "use 'cpu', 'cuda' or 'cuda:N'");
}

std::string shape_str(const Shape& s) {
  std::ostringstream o;
  o << '[';
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << ']';
  return o.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t acc = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = acc;
    acc *= shape[i];
  }
  return st;
}

// ---------------------------------------------------------------------------------------------
// Storage

std::shared_ptr<Storage> Storage::allocate(size_t bytes, Device device) {
  std::shared_ptr<Storage> s(new Storage());
  s->bytes_ = bytes;
  s->device_ = device;
  s->owned_ = true;
  size_t alloc = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
  if (device.is_cpu()) {
    s->ptr_ = std::aligned_alloc(64, alloc);
    DFLASH_CHECK_HINT(s->ptr_ != nullptr, "host allocation of " << bytes << " bytes failed",
                      "the machine is out of memory; reduce the batch or sequence length");
  } else {
    s->ptr_ = device_alloc::allocate(alloc, device.index);
  }
  return s;
}

std::shared_ptr<Storage> Storage::wrap(void* ptr, size_t bytes, Device device, std::shared_ptr<void> keeper) {
  std::shared_ptr<Storage> s(new Storage());
  s->ptr_ = ptr;
  s->bytes_ = bytes;
  s->device_ = device;
  s->owned_ = false;
  s->keeper_ = std::move(keeper);
  return s;
}

Storage::~Storage() {
  if (!owned_ || ptr_ == nullptr) return;
  if (device_.is_cpu()) std::free(ptr_);
  else device_alloc::release(ptr_, device_.index);
}

// ---------------------------------------------------------------------------------------------
// Tensor

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape) DFLASH_CHECK(d >= 0, "negative dimension in shape " << shape_str(shape));
  Tensor t;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.storage_ = Storage::allocate(t.nbytes(), device);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill(0.0);
  return t;
}

Tensor Tensor::from_blob(void* ptr, const Shape& shape, DType dtype, Device device, std::shared_ptr<void> keeper) {
  Tensor t;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.storage_ = Storage::wrap(ptr, t.nbytes(), device, std::move(keeper));
  return t;
}

Tensor Tensor::from_vector(const std::vector<float>& values, const Shape& shape, DType dtype) {
  DFLASH_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape),
               "from_vector: " << values.size() << " values for shape " << shape_str(shape));
  Tensor t = empty(shape, dtype);
  convert_elements(values.data(), DType::F32, t.raw_data(), dtype, t.numel());
  return t;
}

int64_t Tensor::size(int64_t d) const {
  int64_t n = dim();
  if (d < 0) d += n;
  DFLASH_CHECK(d >= 0 && d < n, "dimension " << d << " out of range for " << describe());
  return shape_[static_cast<size_t>(d)];
}

bool Tensor::is_contiguous() const {
  int64_t acc = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != acc) return false;
    acc *= shape_[i];
  }
  return true;
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined";
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + " " + device_.str();
}

void* Tensor::raw_data() const {
  if (!storage_) return nullptr;
  return static_cast<char*>(storage_->data()) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

Tensor Tensor::view(const Shape& shape) const {
  DFLASH_CHECK(is_contiguous(), "view() needs a contiguous tensor, got " << describe());
  Shape s = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      DFLASH_CHECK(infer < 0, "view(): more than one -1 in " << shape_str(shape));
      infer = static_cast<int64_t>(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    DFLASH_CHECK(known > 0 && numel() % known == 0, "view(): cannot infer " << shape_str(shape) << " from " << describe());
    s[static_cast<size_t>(infer)] = numel() / known;
  }
  DFLASH_CHECK(shape_numel(s) == numel(), "view(): shape " << shape_str(shape) << " does not match " << describe());
  Tensor t = *this;
  t.shape_ = s;
  t.strides_ = contiguous_strides(s);
  return t;
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end) const {
  if (d < 0) d += dim();
  DFLASH_CHECK(d >= 0 && d < dim(), "slice(): dimension out of range for " << describe());
  size_t i = static_cast<size_t>(d);
  DFLASH_CHECK(0 <= start && start <= end && end <= shape_[i],
               "slice(): range [" << start << ", " << end << ") out of bounds for dim " << d << " of " << describe());
  Tensor t = *this;
  t.offset_ += start * strides_[i];
  t.shape_[i] = end - start;
  return t;
}

Tensor Tensor::select(int64_t idx) const {
  DFLASH_CHECK(dim() >= 1 && idx >= 0 && idx < shape_[0], "select(" << idx << ") out of range for " << describe());
  Tensor t = *this;
  t.offset_ += idx * strides_[0];
  t.shape_.erase(t.shape_.begin());
  t.strides_.erase(t.strides_.begin());
  return t;
}

namespace {
// Visits every element's flat offset (in elements) of a strided tensor, in row-major order.
template <typename F>
void for_each_offset(const Shape& shape, const Shape& strides, F&& f) {
  int64_t n = shape_numel(shape);
  if (n == 0) return;
  std::vector<int64_t> idx(shape.size(), 0);
  int64_t off = 0;
  for (int64_t k = 0; k < n; ++k) {
    f(k, off);
    for (size_t d = shape.size(); d-- > 0;) {
      if (++idx[d] < shape[d]) { off += strides[d]; break; }
      off -= (shape[d] - 1) * strides[d];
      idx[d] = 0;
    }
  }
}
}  // namespace

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device_);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(Device device) const {
  Tensor src = device_.is_cpu() ? contiguous() : *this;
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(src);
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  DFLASH_CHECK(defined() && src.defined(), "copy_from(): undefined tensor");
  DFLASH_CHECK(shape_ == src.shape_, "copy_from(): shape " << src.describe() << " into " << describe());
  DFLASH_CHECK(dtype_ == src.dtype_, "copy_from(): dtype " << src.describe() << " into " << describe()
                                                           << " (use to_dtype() on the host first)");
  size_t es = dtype_size(dtype_);
  if (is_contiguous() && src.is_contiguous()) {
    if (device_.is_cpu() && src.device_.is_cpu()) {
      if (nbytes()) std::memcpy(raw_data(), src.raw_data(), nbytes());
    } else {
      memcpy_any(raw_data(), device_, src.raw_data(), src.device_, nbytes());
    }
    return;
  }
  DFLASH_CHECK(device_.is_cpu() && src.device_.is_cpu(),
               "copy_from(): strided copies are host-only; make " << src.describe() << " contiguous first");
  // Gather src in row-major order, then scatter into this.
  std::vector<char> tmp(nbytes());
  const char* s = static_cast<const char*>(src.raw_data());
  for_each_offset(src.shape_, src.strides_, [&](int64_t k, int64_t off) {
    std::memcpy(tmp.data() + k * es, s + off * static_cast<int64_t>(es), es);
  });
  char* d = static_cast<char*>(raw_data());
  for_each_offset(shape_, strides_, [&](int64_t k, int64_t off) {
    std::memcpy(d + off * static_cast<int64_t>(es), tmp.data() + k * es, es);
  });
}

Tensor Tensor::to_dtype(DType dtype) const {
  DFLASH_CHECK(device_.is_cpu(), "to_dtype() runs on the host; copy " << describe() << " to cpu first");
  Tensor src = contiguous();
  Tensor t = empty(shape_, dtype, device_);
  convert_elements(src.raw_data(), dtype_, t.raw_data(), dtype, numel());
  return t;
}

void Tensor::fill(double value) {
  DFLASH_CHECK(defined(), "fill(): undefined tensor");
  // Zero (every dtype's zero is all-zero bytes): a memset, on the device without a host copy (a
  // 7 GB optimizer buffer used to be staged through the host, a minute at start-up).
  if (value == 0.0 && !std::signbit(value) && is_contiguous()) {
    if (device_.is_cpu()) std::memset(raw_data(), 0, nbytes());
    else memset_device(raw_data(), device_.index, 0, nbytes());
    return;
  }
  if (device_.is_cpu() && is_contiguous()) {
    // Convert once, then replicate the element bytes.
    double v = value;
    char elem[8];
    convert_elements(&v, DType::F64, elem, dtype_, 1);
    size_t es = dtype_size(dtype_);
    char* d = static_cast<char*>(raw_data());
    for (int64_t i = 0; i < numel(); ++i) std::memcpy(d + i * es, elem, es);
    return;
  }
  Tensor host = empty(shape_, dtype_, Device::cpu());
  host.fill(value);
  copy_from(host);
}

double Tensor::item_at(int64_t flat_index) const {
  DFLASH_CHECK(flat_index >= 0 && flat_index < numel(), "item_at(" << flat_index << ") out of range for " << describe());
  Tensor host = device_.is_cpu() ? contiguous() : to(Device::cpu());
  double v = 0;
  convert_elements(static_cast<const char*>(host.raw_data()) + flat_index * static_cast<int64_t>(dtype_size(dtype_)),
                   dtype_, &v, DType::F64, 1);
  return v;
}

namespace {
double load_as_double(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F64: return static_cast<const double*>(p)[i];
    case DType::I32: return static_cast<const int32_t*>(p)[i];
    case DType::I64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::U8: return static_cast<const uint8_t*>(p)[i];
    case DType::F8E4M3: return fp8::e4m3_to_float(static_cast<const uint8_t*>(p)[i]);
  }
  return 0;
}
void store_from_double(void* p, DType t, int64_t i, double v) {
  switch (t) {
    case DType::BF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(static_cast<float>(v)); break;
    case DType::F16: static_cast<uint16_t*>(p)[i] = f32_to_f16(static_cast<float>(v)); break;
    case DType::F32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::F64: static_cast<double*>(p)[i] = v; break;
    case DType::I32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::I64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    case DType::U8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
    // (unscaled: the nearest code, saturating at +-448; quantizing a weight needs its block scales)
    case DType::F8E4M3: static_cast<uint8_t*>(p)[i] = fp8::e4m3_from_float(static_cast<float>(v)); break;
  }
}
}  // namespace

void convert_elements(const void* src, DType st, void* dst, DType dt, int64_t n) {
  if (st == dt) {
    std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(st));
    return;
  }
  // Fast paths for the conversions weights go through.
  if (st == DType::BF16 && dt == DType::F32) {
    auto s = static_cast<const uint16_t*>(src);
    auto d = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
    return;
  }
  if (st == DType::F32 && dt == DType::BF16) {
    auto s = static_cast<const float*>(src);
    auto d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
    return;
  }
  // int64 <-> int64-ish conversions must not pass through double when exactness matters.
  if (st == DType::I64 && dt == DType::I32) {
    auto s = static_cast<const int64_t*>(src);
    auto d = static_cast<int32_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<int32_t>(s[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) store_from_double(dst, dt, i, load_as_double(src, st, i));
}

}  // namespace dflash
