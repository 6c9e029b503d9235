#include <cuda_runtime.h>

#include "core/cuda/check.h"
#include "kernels/cuda/fault.h"

namespace dflash::cuda {

namespace {
__global__ void fault_kernel(int trap) {
  if (trap) __trap();
}
}  // namespace

void launch_fault(bool trap, Stream s) {
  const dim3 block(trap ? 1 : 2048);  // 2048 > the 1024 threads a block may have
  fault_kernel<<<1, block, 0, static_cast<cudaStream_t>(s)>>>(trap ? 1 : 0);
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace dflash::cuda
