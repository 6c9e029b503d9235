#include "core/cuda/env.h"

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <nccl.h>

namespace dflash::cuda {

LibraryVersions library_versions() {
  LibraryVersions v;
  if (cudaDriverGetVersion(&v.driver) != cudaSuccess) v.driver = 0;
  if (cudaRuntimeGetVersion(&v.runtime) != cudaSuccess) v.runtime = 0;
  cudaGetLastError();
  v.cublaslt = cublasLtGetVersion();
  if (ncclGetVersion(&v.nccl) != ncclSuccess) v.nccl = 0;
  return v;
}

std::string version_str(int x) {
  return std::to_string(x / 1000) + "." + std::to_string((x % 1000) / 10);
}

}  // namespace dflash::cuda
