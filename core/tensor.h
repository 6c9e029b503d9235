#pragma once
// Tensor: a typed, shaped, strided view of memory on one device. Owning tensors share their Storage
// (reference counted); views share it too. Copies between host and device are always explicit.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace dflash {

struct Device {
  enum class Kind : uint8_t { CPU, CUDA };
  Kind kind = Kind::CPU;
  int index = 0;

  static Device cpu() { return {Kind::CPU, 0}; }
  static Device cuda(int i = 0) { return {Kind::CUDA, i}; }
  bool is_cpu() const { return kind == Kind::CPU; }
  bool is_cuda() const { return kind == Kind::CUDA; }
  std::string str() const;  // "cpu", "cuda:0"
  // Parses "cpu", "cuda", "cuda:N".
  static Device parse(const std::string& s);
  friend bool operator==(const Device&, const Device&) = default;
};

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "[2, 3]"
int64_t shape_numel(const Shape& s);

// A block of memory: host memory is 64-byte aligned; device memory comes from the caching allocator.
// `external` storage (mmap'd weights, user buffers) is not freed by us; its owner keeper keeps it alive.
class Storage {
 public:
  static std::shared_ptr<Storage> allocate(size_t bytes, Device device);
  static std::shared_ptr<Storage> wrap(void* ptr, size_t bytes, Device device, std::shared_ptr<void> keeper);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  Storage() = default;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
  bool owned_ = false;
  std::shared_ptr<void> keeper_;
};

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  // Non-owning view of memory someone else keeps alive (keeper may be null for stack/test buffers).
  static Tensor from_blob(void* ptr, const Shape& shape, DType dtype, Device device = Device::cpu(),
                          std::shared_ptr<void> keeper = nullptr);
  // Host tensor holding a copy of `values` converted to `dtype` (for tests and small constants).
  static Tensor from_vector(const std::vector<float>& values, const Shape& shape, DType dtype = DType::F32);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }  // in elements
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool is_contiguous() const;
  std::string describe() const;  // "f32[2, 3] cpu"

  void* raw_data() const;
  template <typename T> T* data() const { return static_cast<T*>(raw_data()); }
  // Checks dtype/device/contiguity and returns the typed pointer; `what` names the tensor in the error.
  template <typename T> T* data_as(DType expect, const char* what) const;

  // Same storage, new shape; requires a contiguous tensor and the same numel (one -1 allowed).
  Tensor view(const Shape& shape) const;
  // Sub-range [start, end) along dim `d` (a view; may be non-contiguous).
  Tensor slice(int64_t d, int64_t start, int64_t end) const;
  // Index `i` along dim 0 (a view with one dimension fewer).
  Tensor select(int64_t i) const;

  // Copies (always new storage).
  Tensor to(Device device) const;        // host<->device, contiguous result
  Tensor to_dtype(DType dtype) const;    // host only: converts element by element
  Tensor contiguous() const;             // no copy when already contiguous
  Tensor clone() const;
  // Copies src into this tensor (same shape; same dtype; any devices; strided on host only).
  void copy_from(const Tensor& src);
  // Fills every element (host: any dtype; device: via a host staging buffer).
  void fill(double value);

  // Host reads of one element as double (tests and diagnostics; converts any dtype).
  double item_at(int64_t flat_index) const;

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_, strides_;
  DType dtype_ = DType::F32;
  Device device_;
};

Shape contiguous_strides(const Shape& shape);

// Host-side element conversion between any two dtypes (n elements, contiguous).
void convert_elements(const void* src, DType src_type, void* dst, DType dst_type, int64_t n);

template <typename T>
T* Tensor::data_as(DType expect, const char* what) const {
  DFLASH_CHECK(defined(), "tensor '" << what << "' is undefined");
  DFLASH_CHECK(dtype_ == expect, "tensor '" << what << "' has dtype " << dtype_name(dtype_) << ", expected "
                                            << dtype_name(expect));
  DFLASH_CHECK(is_contiguous(), "tensor '" << what << "' must be contiguous, got " << describe());
  return data<T>();
}

}  // namespace dflash
