// CUDA implementation of core/device.h: device queries, the caching allocator, copies and the
// per-device context. Host code only (no kernels); compiled by the host compiler.
//
// Lifetime at exit: the allocator caches and the device contexts are created with `new` and never
// destroyed. Tensors held by static objects may be released after main returns, and the CUDA
// driver may already be torn down by then; leaking those singletons (the driver reclaims every
// allocation when the process ends) is safe, whereas freeing them from static destructors is not.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/cuda/check.h"
#include "core/device.h"

namespace dflash {

using cuda::DeviceGuard;

namespace {

// Device::parse accepts indices below 1024; the per-device tables are sized to match.
constexpr int kMaxDevices = 1024;

constexpr size_t kSmallGranule = 512;               // bytes, for blocks below kLargeThreshold
constexpr size_t kLargeThreshold = size_t(1) << 20;  // 1 MiB
constexpr size_t kLargeGranule = size_t(2) << 20;    // 2 MiB
constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLASLt workspace per device

size_t round_block(size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes < kLargeThreshold) return (bytes + kSmallGranule - 1) / kSmallGranule * kSmallGranule;
  return (bytes + kLargeGranule - 1) / kLargeGranule * kLargeGranule;
}

std::string format_bytes(size_t b) {
  char buf[64];
  double v = static_cast<double>(b);
  if (b >= (size_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", v / double(size_t(1) << 30));
  else if (b >= (size_t(1) << 20)) std::snprintf(buf, sizeof buf, "%.2f MiB", v / double(size_t(1) << 20));
  else std::snprintf(buf, sizeof buf, "%zu B", b);
  return buf;
}

void check_device_index(int device, const char* what) {
  int n = cuda_device_count();
  DFLASH_CHECK_HINT(device >= 0 && device < n,
                    what << ": cuda:" << device << " does not exist (" << n << " CUDA device(s) visible)",
                    (n == 0 ? "no GPU is visible: check nvidia-smi and CUDA_VISIBLE_DEVICES"
                            : "check CUDA_VISIBLE_DEVICES and the device index in the config / --device"));
}

// Makes `device` current for its scope and restores the caller's device afterwards, so dflash never
// changes the current device behind the back of code that called it.
// ---------------------------------------------------------------------------------------------
// Caching allocator state of one device. All fields are guarded by `mu`. Sizes are rounded block
// sizes: `allocated` counts the whole block a live tensor holds, so reserved == allocated + cached.

struct DeviceCache {
  std::mutex mu;
  std::multimap<size_t, void*> free_blocks;  // rounded size (bytes) -> block, for best-fit lookup
  std::unordered_map<void*, size_t> live;    // block -> rounded size (bytes)
  AllocatorStats stats;

  // Returns all free blocks to the driver. Caller holds `mu` and has made the device current.
  void release_cached() {
    for (auto& [size, ptr] : free_blocks) {
      DFLASH_CUDA_WARN(cudaFree(ptr));
      stats.reserved -= size;
    }
    free_blocks.clear();
  }
};

std::array<std::atomic<DeviceCache*>, kMaxDevices> g_caches{};
std::mutex g_caches_mu;

DeviceCache* find_cache(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return g_caches[static_cast<size_t>(device)].load(std::memory_order_acquire);
}

DeviceCache& get_cache(int device) {
  DFLASH_CHECK(device >= 0 && device < kMaxDevices, "device index " << device << " out of range");
  if (DeviceCache* c = find_cache(device)) return *c;
  std::lock_guard<std::mutex> lock(g_caches_mu);
  auto& slot = g_caches[static_cast<size_t>(device)];
  DeviceCache* c = slot.load(std::memory_order_relaxed);
  if (!c) {
    c = new DeviceCache();  // leaked on purpose: see the note at the top of this file
    slot.store(c, std::memory_order_release);
  }
  return *c;
}

std::array<std::atomic<DeviceContext*>, kMaxDevices> g_contexts{};
std::mutex g_contexts_mu;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Device queries

bool cuda_built() { return true; }

int cuda_device_count() {
  int n = 0;
  cudaError_t st = cudaGetDeviceCount(&n);
  if (st != cudaSuccess) {
    cudaGetLastError();  // clear it so that a later DFLASH_CUDA_CHECK_LAST does not report it
    return 0;
  }
  return n;
}

DeviceInfo cuda_device_info(int device) {
  check_device_index(device, "cuda_device_info");
  cudaDeviceProp prop{};
  DFLASH_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DeviceInfo info;
  info.name = prop.name;
  info.major = prop.major;
  info.minor = prop.minor;
  info.sm_count = prop.multiProcessorCount;
  info.total_memory = prop.totalGlobalMem;
  DFLASH_CUDA_CHECK(cudaDriverGetVersion(&info.driver_version));
  DFLASH_CUDA_CHECK(cudaRuntimeGetVersion(&info.runtime_version));
  return info;
}

// ---------------------------------------------------------------------------------------------
// Caching allocator

namespace device_alloc {

// A pool's blocks, as DeviceCache's (best fit up to twice the request, blocks never split).
struct Pool::State {
  std::mutex mu;
  std::multimap<size_t, void*> free_blocks;
  std::unordered_map<void*, size_t> live;
  std::vector<void*> owned;
  size_t reserved = 0;
};

namespace {

thread_local Pool* t_pool = nullptr;  // the open PoolScope's pool on this thread
std::mutex g_pools_mu;
std::vector<std::pair<int, Pool::State*>> g_pools;  // every pool alive: (device, state)

// Gives a pool's block back (true), or false when no pool of `device` owns ptr.
bool release_to_pool(void* ptr, int device) {
  std::lock_guard<std::mutex> lock(g_pools_mu);
  for (auto& [dev, st] : g_pools) {
    if (dev != device) continue;
    std::lock_guard<std::mutex> l2(st->mu);
    auto it = st->live.find(ptr);
    if (it == st->live.end()) continue;
    st->free_blocks.emplace(it->second, ptr);
    st->live.erase(it);
    return true;
  }
  return false;
}

}  // namespace

Pool::Pool(int device) : device_(device), state_(new State) {
  std::lock_guard<std::mutex> lock(g_pools_mu);
  g_pools.emplace_back(device, state_);
}

Pool::~Pool() {
  {
    std::lock_guard<std::mutex> lock(g_pools_mu);
    g_pools.erase(std::remove_if(g_pools.begin(), g_pools.end(), [&](const auto& e) { return e.second == state_; }),
                  g_pools.end());
  }
  if (!state_->live.empty())
    spdlog::error("device_alloc::Pool on cuda:{}: destroyed while {} tensor(s) still hold its blocks", device_,
                  state_->live.size());
  DeviceGuard guard(device_);
  for (void* p : state_->owned) DFLASH_CUDA_WARN(cudaFree(p));
  delete state_;
}

size_t Pool::reserved() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->reserved;
}

PoolScope::PoolScope(Pool& pool) : previous_(t_pool) { t_pool = &pool; }
PoolScope::~PoolScope() { t_pool = previous_; }

void* allocate(size_t bytes, int device) {
  const size_t rounded = round_block(bytes);
  if (Pool* pool = t_pool; pool && pool->device() == device) {
    Pool::State& st = *pool->state();
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.free_blocks.lower_bound(rounded);
    if (it != st.free_blocks.end() && it->first <= 2 * rounded) {
      void* ptr = it->second;
      st.live.emplace(ptr, it->first);
      st.free_blocks.erase(it);
      return ptr;
    }
    DeviceGuard guard(device);
    void* ptr = nullptr;
    const cudaError_t e = cudaMalloc(&ptr, rounded);
    if (e != cudaSuccess) cuda::throw_cuda_error(e, "cudaMalloc(&ptr, rounded) (a CUDA graph's pool)", __FILE__, __LINE__);
    st.owned.push_back(ptr);
    st.live.emplace(ptr, rounded);
    st.reserved += rounded;
    return ptr;
  }
  DeviceCache& cache = get_cache(device);
  std::lock_guard<std::mutex> lock(cache.mu);

  // Best fit among cached blocks, but never more than twice the request: blocks are not split, so a
  // larger block would waste the difference for the tensor's whole life.
  auto it = cache.free_blocks.lower_bound(rounded);
  if (it != cache.free_blocks.end() && it->first <= 2 * rounded) {
    void* ptr = it->second;
    size_t size = it->first;
    cache.free_blocks.erase(it);
    cache.live.emplace(ptr, size);
    cache.stats.allocated += size;
    cache.stats.peak_allocated = std::max(cache.stats.peak_allocated, cache.stats.allocated);
    cache.stats.cache_hits += 1;
    return ptr;
  }

  if (cache.stats.cuda_mallocs == 0) check_device_index(device, "device allocation");
  DeviceGuard guard(device);
  void* ptr = nullptr;
  cudaError_t st = cudaMalloc(&ptr, rounded);
  if (st == cudaErrorMemoryAllocation) {
    // The cache may hold enough memory in blocks of the wrong sizes: give it back and try again.
    cudaGetLastError();
    cache.release_cached();
    st = cudaMalloc(&ptr, rounded);
  }
  if (st == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    std::string dev_mem;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
      dev_mem = "; the device has " + format_bytes(free_b) + " free of " + format_bytes(total_b);
    else
      cudaGetLastError();
    const AllocatorStats& s = cache.stats;
    DFLASH_FAIL_HINT("CUDA out of memory on cuda:" << device << " allocating " << format_bytes(rounded)
                         << " (" << bytes << " bytes requested); dflash holds " << format_bytes(s.allocated)
                         << " in live tensors (peak " << format_bytes(s.peak_allocated) << "), reserved "
                         << format_bytes(s.reserved) << dev_mem,
                     "reduce the batch size or max sequence length, and check with nvidia-smi that no other "
                     "process holds memory on this GPU");
  }
  if (st != cudaSuccess) cuda::throw_cuda_error(st, "cudaMalloc(&ptr, rounded)", __FILE__, __LINE__);

  cache.live.emplace(ptr, rounded);
  cache.stats.cuda_mallocs += 1;
  cache.stats.reserved += rounded;
  cache.stats.allocated += rounded;
  cache.stats.peak_allocated = std::max(cache.stats.peak_allocated, cache.stats.allocated);
  return ptr;
}

void release(void* ptr, int device) {
  if (ptr == nullptr) return;
  DeviceCache* cache = find_cache(device);
  // Called from destructors: report misuse but never throw.
  if (!cache) {
    if (release_to_pool(ptr, device)) return;
    spdlog::error("device_alloc::release: cuda:{} has no allocations; pointer {} ignored", device, ptr);
    return;
  }
  std::lock_guard<std::mutex> lock(cache->mu);
  auto it = cache->live.find(ptr);
  if (it == cache->live.end()) {
    if (release_to_pool(ptr, device)) return;
    spdlog::error("device_alloc::release: pointer {} was not allocated on cuda:{} (or was released twice)", ptr,
                  device);
    return;
  }
  size_t size = it->second;
  cache->live.erase(it);
  cache->stats.allocated -= size;
  cache->free_blocks.emplace(size, ptr);
}

AllocatorStats stats(int device) {
  DeviceCache* cache = find_cache(device);
  if (!cache) return {};
  std::lock_guard<std::mutex> lock(cache->mu);
  return cache->stats;
}

void reset_peak(int device) {
  DeviceCache* cache = find_cache(device);
  if (!cache) return;
  std::lock_guard<std::mutex> lock(cache->mu);
  cache->stats.peak_allocated = cache->stats.allocated;
}

void empty_cache(int device) {
  DeviceCache* cache = find_cache(device);
  if (!cache) return;
  std::lock_guard<std::mutex> lock(cache->mu);
  if (cache->free_blocks.empty()) return;
  DeviceGuard guard(device);
  cache->release_cached();
}

}  // namespace device_alloc

void memset_device(void* dst, int device, int byte, size_t bytes) {
  if (bytes == 0) return;
  DFLASH_CHECK(dst != nullptr, "memset_device: null pointer for " << bytes << " bytes");
  DeviceGuard guard(device);
  DFLASH_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, static_cast<cudaStream_t>(DeviceContext::get(device).stream())));
}

// ---------------------------------------------------------------------------------------------
// Copies. Every device-side copy is issued on the device context's stream and then waited for, so
// it is ordered after the kernels dflash queued there (the stream is non-blocking: a plain
// cudaMemcpy on the legacy default stream would not wait for them).

void memcpy_any(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  if (bytes == 0) return;
  DFLASH_CHECK(dst != nullptr && src != nullptr, "memcpy_any: null pointer for a copy of " << bytes << " bytes");
  if (dst_dev.is_cpu() && src_dev.is_cpu()) {
    std::memmove(dst, src, bytes);
    return;
  }
  if (dst_dev.is_cpu() || src_dev.is_cpu()) {
    const bool to_device = dst_dev.is_cuda();
    const int dev = to_device ? dst_dev.index : src_dev.index;
    DeviceContext& ctx = DeviceContext::get(dev);
    DeviceGuard guard(dev);
    auto stream = static_cast<cudaStream_t>(ctx.stream());
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                                      stream));
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  DeviceContext& dst_ctx = DeviceContext::get(dst_dev.index);
  auto dst_stream = static_cast<cudaStream_t>(dst_ctx.stream());
  if (dst_dev.index == src_dev.index) {
    DeviceGuard guard(dst_dev.index);
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, dst_stream));
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(dst_stream));
    return;
  }
  // Across devices: wait until the source device's queued work has produced `src`, then copy on the
  // destination's stream (directly over NVLink/PCIe when peer access is possible, else via the host).
  DeviceContext::get(src_dev.index).synchronize();
  DeviceGuard guard(dst_dev.index);
  DFLASH_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_dev.index, src, src_dev.index, bytes, dst_stream));
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(dst_stream));
}

// ---------------------------------------------------------------------------------------------
// DeviceContext

DeviceContext& DeviceContext::get(int device) {
  DFLASH_CHECK(device >= 0 && device < kMaxDevices, "DeviceContext::get: device index " << device << " out of range");
  auto& slot = g_contexts[static_cast<size_t>(device)];
  if (DeviceContext* c = slot.load(std::memory_order_acquire)) return *c;
  std::lock_guard<std::mutex> lock(g_contexts_mu);
  DeviceContext* c = slot.load(std::memory_order_relaxed);
  if (!c) {
    c = new DeviceContext(device);  // leaked on purpose: see the note at the top of this file
    slot.store(c, std::memory_order_release);
  }
  return *c;
}

DeviceContext::DeviceContext(int device) : device_(device) {
  check_device_index(device, "DeviceContext");
  DeviceGuard guard(device);
  cudaStream_t stream = nullptr;
  DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
  try {
    cublasLtHandle_t handle = nullptr;
    DFLASH_CUBLAS_CHECK(cublasLtCreate(&handle));
    cublaslt_ = handle;
    workspace_ = device_alloc::allocate(kWorkspaceBytes, device);
    workspace_bytes_ = kWorkspaceBytes;
  } catch (...) {
    if (cublaslt_) cublasLtDestroy(static_cast<cublasLtHandle_t>(cublaslt_));
    DFLASH_CUDA_WARN(cudaStreamDestroy(stream));
    throw;
  }
}

// Contexts made by get() are never destroyed (see the top of this file); this runs only for a
// context destroyed explicitly while the driver is alive. Best effort, never throws.
DeviceContext::~DeviceContext() {
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) {
    cudaGetLastError();
    return;  // no usable driver any more: the process is going away and the driver reclaims all
  }
  if (prev != device_) cudaSetDevice(device_);
  if (stream_) DFLASH_CUDA_WARN(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
  if (workspace_) device_alloc::release(workspace_, device_);
  if (cublaslt_) cublasLtDestroy(static_cast<cublasLtHandle_t>(cublaslt_));
  if (stream_) DFLASH_CUDA_WARN(cudaStreamDestroy(static_cast<cudaStream_t>(stream_)));
  if (prev != device_) cudaSetDevice(prev);
}

void DeviceContext::synchronize() const {
  DeviceGuard guard(device_);
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
}

}  // namespace dflash
