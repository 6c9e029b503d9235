#pragma once
// Versions of the CUDA-side libraries this binary runs with (for diagnostics and bench rows).
#include <string>

namespace dflash::cuda {

struct LibraryVersions {
  int driver = 0, runtime = 0;  // e.g. 13000
  size_t cublaslt = 0;          // cublasLtGetVersion()
  int nccl = 0;                 // ncclGetVersion(), e.g. 22803
};
LibraryVersions library_versions();
std::string version_str(int cuda_style);  // 13000 -> "13.0"

}  // namespace dflash::cuda
