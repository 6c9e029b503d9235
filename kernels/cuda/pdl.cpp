// pdl.cuh's host side: the switch and the per-device check.
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "core/cuda/check.h"
#include "kernels/cuda/pdl.cuh"

namespace dflash::cuda {

namespace tuning {
int pdl = [] {
  const char* e = std::getenv("DFLASH_PDL");
  return e && std::strcmp(e, "0") == 0 ? 0 : 1;
}();
}  // namespace tuning

bool pdl_enabled() {
  if (tuning::pdl == 0) return false;
  // Compute capability + 1 per device, read once (0: not read yet).
  static std::array<std::atomic<int>, 64> major{};
  int dev = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= static_cast<int>(major.size())) return false;
  int m = major[static_cast<size_t>(dev)].load(std::memory_order_relaxed);
  if (m == 0) {
    DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev));
    major[static_cast<size_t>(dev)].store(++m, std::memory_order_relaxed);
  }
  return m - 1 >= 9;
}

}  // namespace dflash::cuda
