#pragma once
// Grid sizing and the lane-count dispatch shared by the persistent-grid row kernels (norm.cu,
// gdn_conv.cu): host code.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/cuda/check.h"

namespace dflash::cuda {

// How many blocks of `kernel` (at `threads` per block and `smem` bytes of dynamic shared memory) are
// resident on the current GPU at once: SMs x blocks per SM, the latter capped at max_per_sm when
// > 0 and at least 1.
inline int64_t resident_blocks(const void* kernel, int threads, size_t smem, int max_per_sm) {
#ifdef DFLASH_CUDA_EMULATION  // (tests/cuda_emulation.h: no device; a few blocks, so grid-stride loops wrap)
  (void)kernel, (void)threads, (void)smem, (void)max_per_sm;
  return 3;
#endif
  int dev = 0, sms = 0, per_sm = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  DFLASH_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  if (max_per_sm > 0) per_sm = std::min(per_sm, max_per_sm);
  return static_cast<int64_t>(sms) * std::max(per_sm, 1);
}

// The grid of a persistent kernel over `work` items, `per_block` per block and pass: `blocks` when
// > 0 (a tuning knob), else every block that is resident at once (resident_blocks, no dynamic shared
// memory), and never more than the work needs.
inline unsigned persistent_grid(const void* kernel, int threads, int max_per_sm, int64_t blocks, int64_t work,
                                int64_t per_block) {
  if (blocks <= 0) blocks = resident_blocks(kernel, threads, 0, max_per_sm);
  return static_cast<unsigned>(std::min((work + per_block - 1) / per_block, blocks));
}

// The smallest power of two >= n (n >= 1): lanes per row of the row kernels.
inline int pow2_at_least(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// Runs f(std::integral_constant<int, G>{}) for G = lanes (a power of two, pow2_at_least of the row's
// 16-byte units), so that the row kernel templated on its lanes per row is picked in one place;
// lanes above 16 take G = 32, a warp per row.
template <typename F>
void dispatch_lanes(int lanes, F&& f) {
  switch (lanes) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    default: f(std::integral_constant<int, 32>{}); break;
  }
}

}  // namespace dflash::cuda
