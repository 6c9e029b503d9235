#pragma once
// The timing of the print-only GPU tests (…TimingsPrintOnly: they print, never assert on time).
// Host code that includes the CUDA runtime: gpu tests only.
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

namespace dflash {

// Median milliseconds of `iters` runs of fn (which enqueues work on `stream`) after `warm` untimed
// ones; each run is bracketed by CUDA events and waited for before the next.
inline double median_ms(void* stream, int warm, int iters, const std::function<void()>& fn) {
  auto st = static_cast<cudaStream_t>(stream);
  for (int i = 0; i < warm; ++i) fn();
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(e0, st);
    fn();
    cudaEventRecord(e1, st);
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace dflash
