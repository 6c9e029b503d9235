// core/device.h (and the cuda:: fills of core/random.h) for a build without the CUDA backend:
// no devices, host<->host copies only, and every other entry point says clearly why it cannot run.
#include <cstring>

#include "core/device.h"
#include "core/random.h"

namespace dflash {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  raise(__FILE__, __LINE__, std::string(what) + ": this build of dflash has no CUDA backend",
        "reconfigure with -DDFLASH_CUDA=ON on a machine with nvcc");
}
}  // namespace

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }

DeviceInfo cuda_device_info(int) { no_cuda("cuda_device_info"); }

namespace device_alloc {
void* allocate(size_t, int) { no_cuda("device memory allocation"); }
// Reached only from Storage's destructor, which cannot hold device memory in this build; never throws.
void release(void*, int) {}
AllocatorStats stats(int) { no_cuda("device_alloc::stats"); }
void reset_peak(int) { no_cuda("device_alloc::reset_peak"); }
void empty_cache(int) { no_cuda("device_alloc::empty_cache"); }
}  // namespace device_alloc

void memcpy_any(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) {
  if (!dst_dev.is_cpu() || !src_dev.is_cpu()) no_cuda(("copy " + src_dev.str() + " -> " + dst_dev.str()).c_str());
  if (bytes == 0) return;
  DFLASH_CHECK(dst != nullptr && src != nullptr, "memcpy_any: null pointer for a copy of " << bytes << " bytes");
  std::memmove(dst, src, bytes);
}

void memset_device(void*, int, int, size_t) { no_cuda("memset_device"); }

DeviceContext& DeviceContext::get(int) { no_cuda("DeviceContext"); }
DeviceContext::~DeviceContext() = default;
void DeviceContext::synchronize() const { no_cuda("DeviceContext::synchronize"); }

namespace cuda {
void fill_uniform(Tensor&, const RandomParams&, float, float) { no_cuda("cuda::fill_uniform"); }
void fill_normal(Tensor&, const RandomParams&, float, float) { no_cuda("cuda::fill_normal"); }
}  // namespace cuda

}  // namespace dflash
