#pragma once
// Kernels the CPU can also run (tests/cuda_emulation.h: a block's threads as fibers, warp shuffles,
// ldmatrix and mma.sync exchanged at warp barriers). Such a kernel launches through launch_kernel and
// takes its dynamic shared memory through DFLASH_DYNAMIC_SMEM; with DFLASH_CUDA_EMULATION defined (an
// emulated test includes the kernel source after tests/cuda_emulation.h) a launch runs on the CPU,
// otherwise it is the <<<>>> launch and its error check. Used by moe.cu and moe_decode.cu, whose
// logic CI checks without a GPU (tests/test_moe_emulated.cpp).
#include <cuda_runtime.h>

#include <cstddef>

#include "core/cuda/check.h"
#ifdef DFLASH_CUDA_EMULATION
namespace dflash::cuda {  // (blocks run one after another: nothing to wait for)
inline void pdl_wait() {}
inline void pdl_launch_dependents() {}
}  // namespace dflash::cuda
#else
#include "kernels/cuda/pdl.cuh"
#endif

#ifdef DFLASH_CUDA_EMULATION
#define DFLASH_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(::emu::dynamic_smem())
#else
#define DFLASH_DYNAMIC_SMEM(type, name) extern __shared__ __align__(16) type name[]
#endif

namespace dflash::cuda {

// kPdl: with programmatic dependent launch (pdl.cuh's launch_pdl: the attribute where pdl_enabled());
// emulated, a plain launch either way (blocks run one after another, pdl_wait is a no-op).
template <bool kPdl = false, class Kernel, class... Args>
void launch_kernel(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const Args&... args) {
#ifdef DFLASH_CUDA_EMULATION
  (void)stream;
  ::emu::launch(grid, block, smem, kernel, args...);
#else
  if constexpr (kPdl) {
    launch_pdl(kernel, grid, block, smem, stream, args...);
  } else {
    kernel<<<grid, block, smem, stream>>>(args...);
    DFLASH_CUDA_CHECK_LAST();
  }
#endif
}
template <class Kernel, class... Args>
void launch_kernel_pdl(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const Args&... args) {
  launch_kernel<true>(kernel, grid, block, smem, stream, args...);
}

}  // namespace dflash::cuda
