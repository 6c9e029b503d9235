#pragma once
// CUDA device management behind a header that never includes CUDA: device count and properties,
// the caching allocator for device memory, copies, and the per-device context (stream, cuBLASLt
// handle, workspace). In a build without CUDA every entry point reports that clearly.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace dflash {

// True when this binary was built with the CUDA backend.
bool cuda_built();
// Number of visible CUDA devices; 0 when none (or no driver, or a CPU-only build). Never throws.
int cuda_device_count();

struct DeviceInfo {
  std::string name;
  int major = 0, minor = 0;        // compute capability
  int sm_count = 0;
  size_t total_memory = 0;         // bytes
  int driver_version = 0, runtime_version = 0;  // e.g. 12080 for 12.8
};
DeviceInfo cuda_device_info(int device);
// Throws, naming the option `flag` that chose it, when `dev` is a CUDA device this process cannot see.
void check_device_visible(const Device& dev, const std::string& flag = "--device");

// Caching allocator for device memory. Blocks are rounded up (512 B granules below 1 MiB, 2 MiB
// above) and kept on per-device free lists after release, so a steady-state training step does no
// cudaMalloc. Memory is reused in stream order: everything in dflash runs on the context's stream,
// so a block freed by one kernel's tensor can be handed to the next launch safely.
struct AllocatorStats {
  size_t allocated = 0;       // bytes held by live tensors
  size_t reserved = 0;        // bytes obtained from cudaMalloc (allocated + cached)
  size_t peak_allocated = 0;  // high-water mark of `allocated`
  uint64_t cuda_mallocs = 0;  // number of cudaMalloc calls so far
  uint64_t cache_hits = 0;    // allocations served from the cache
};
namespace device_alloc {
void* allocate(size_t bytes, int device);
void release(void* ptr, int device);
AllocatorStats stats(int device);
void reset_peak(int device);
// Returns every cached (unused) block to the driver.
void empty_cache(int device);

// A private pool (CUDA graphs, CUDA builds only): while a PoolScope on it is open on this thread,
// every allocation on the pool's device comes from the pool — its own cached blocks, or new ones
// from cudaMalloc — so the addresses a captured graph bakes in belong to that graph alone and are
// never handed to other tensors. A block goes back to the pool that gave it whenever its tensor is
// released, inside the scope or not; the blocks return to the driver when the pool is destroyed
// (the caller makes sure no work on them is in flight; tensors still holding blocks then are
// reported).
class Pool {
 public:
  explicit Pool(int device);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  int device() const { return device_; }
  size_t reserved() const;  // bytes this pool obtained from cudaMalloc

  struct State;  // defined in core/cuda/device.cpp
  State* state() const { return state_; }

 private:
  int device_;
  State* state_;
};
class PoolScope {
 public:
  explicit PoolScope(Pool& pool);
  ~PoolScope();
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;

 private:
  Pool* previous_;
};
}  // namespace device_alloc

// Raw copies; `kind` is inferred from the devices. Synchronous with respect to the host.
void memcpy_any(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes);
// Sets `bytes` bytes of device memory to `byte`, queued on the device context's stream (ordered
// with every kernel and copy dflash issues; not waited for).
void memset_device(void* dst, int device, int byte, size_t bytes);

// Per-device context: one stream all dflash work is issued on, a cuBLASLt handle and its workspace.
// Opaque here so that no header outside kernels/cuda includes CUDA.
class DeviceContext {
 public:
  static DeviceContext& get(int device);  // created on first use, lives until exit
  int device() const { return device_; }
  void* stream() const { return stream_; }           // cudaStream_t
  void* cublaslt() const { return cublaslt_; }       // cublasLtHandle_t
  void* workspace() const { return workspace_; }
  size_t workspace_bytes() const { return workspace_bytes_; }
  void synchronize() const;

  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;
  ~DeviceContext();

 private:
  explicit DeviceContext(int device);
  int device_ = 0;
  void* stream_ = nullptr;
  void* cublaslt_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

}  // namespace dflash
