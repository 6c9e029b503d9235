#pragma once
// Programmatic dependent launch (PDL, sm_90): a kernel launched with the programmatic stream
// serialization attribute may start while the kernel before it in the stream is still running; it
// must execute pdl_wait() (griddepcontrol.wait: the previous grid has completed and its writes are
// visible) before it reads anything that grid wrote or writes anything it reads. What comes before
// the wait may only read data no kernel of the step writes (weights). pdl_launch_dependents()
// (griddepcontrol.launch_dependents) lets the next PDL kernel be launched once every block of this
// grid has executed it (else it is launched when this grid's blocks exit); it orders nothing, the
// next kernel still waits for this grid's completion. Both are no-ops for a kernel launched
// without the attribute, and below sm_90 they compile to nothing.
//
// Why (issue 30): a decode step is ~450 small kernels between ~350 weight-streaming GEMMs; inside
// a CUDA graph each boundary still costs the next grid's launch and ramp (~1-2 us). With PDL the
// next grid is resident when the previous one ends, and a GEMM issues its first weight loads
// before the wait, under the previous kernel.
//
// launch_pdl(kernel, grid, block, smem, stream, args...) launches with the attribute when
// pdl_enabled(): the device is sm_90 or newer and tuning::pdl != 0 (default 1; DFLASH_PDL=0 in the
// environment turns it off at start-up: the A/B switch of the benchmarks). Host code.
#include <cuda_runtime.h>

#include <utility>

#include "core/cuda/check.h"

namespace dflash::cuda {

namespace tuning {
extern int pdl;  // 1: decode-path kernels launched with programmatic dependent launch (sm_90+); 0: plain launches
}  // namespace tuning

// Whether launch_pdl sets the attribute on the current device (sm_90+ and tuning::pdl).
bool pdl_enabled();

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Launches kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute when
// pdl_enabled(), and with a cluster of cluster_x blocks along x when cluster_x > 1; checks the launch.
template <class... KArgs, class... Args>
void launch_pdl_cluster(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                        unsigned cluster_x, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  unsigned n = 0;
  if (pdl_enabled()) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster_x > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = cluster_x;
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  DFLASH_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

template <class... KArgs, class... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  launch_pdl_cluster(kernel, grid, block, smem, stream, 1u, std::forward<Args>(args)...);
}

}  // namespace dflash::cuda
