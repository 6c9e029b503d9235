#pragma once
// Checked CUDA runtime, cuBLAS(Lt) and NCCL calls. A failure throws dflash::Error naming the call
// text, file:line, the library's error name and string, and a hint where a user can act on it:
//
//   DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream));
//   my_kernel<<<grid, block, 0, stream>>>(...);
//   DFLASH_CUDA_CHECK_LAST();
//   DFLASH_CUBLAS_CHECK(cublasLtMatmul(...));
//   DFLASH_NCCL_CHECK(ncclAllReduce(...));
//
// The throwing is done by the non-inline throw_* functions (core/cuda/check.cpp) that take the
// status code, so a test can feed them fabricated codes on a machine without a GPU. Only code under
// kernels/cuda (and CUDA-only code elsewhere) includes this header: it pulls in the CUDA headers.
#include <cublas_api.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

namespace dflash::cuda {

// `call` is the call's source text; file/line where it was made. Never return.
[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line);
[[noreturn]] void throw_nccl_error(ncclResult_t status, const char* call, const char* file, int line);

// For destructors and other paths that must not throw: logs a warning instead. Returns ok.
bool warn_cuda_error(cudaError_t status, const char* call, const char* file, int line);

// "cudaErrorMemoryAllocation: out of memory"; the hint ("" when none) for a status.
std::string cuda_error_text(cudaError_t status);
std::string cuda_error_hint(cudaError_t status);

}  // namespace dflash::cuda

// The one shape of every check below: `call` is evaluated once; a status other than `ok` goes to
// ::dflash::cuda::`thrower` with `text` (the call's source text) and this file:line.
#define DFLASH_STATUS_CHECK_(Status, call, ok, thrower, text)                          \
  do {                                                                                 \
    const Status dflash_st_ = (call);                                                  \
    if (dflash_st_ != (ok)) ::dflash::cuda::thrower(dflash_st_, text, __FILE__, __LINE__); \
  } while (0)

#define DFLASH_CUDA_CHECK(call) DFLASH_STATUS_CHECK_(cudaError_t, call, cudaSuccess, throw_cuda_error, #call)

// After a kernel launch: reports bad launch configurations at once. Errors while the kernel runs
// surface at a later synchronizing call (see the hint printed for them).
#define DFLASH_CUDA_CHECK_LAST() \
  DFLASH_STATUS_CHECK_(cudaError_t, cudaGetLastError(), cudaSuccess, throw_cuda_error, "kernel launch (cudaGetLastError())")

// Logs instead of throwing (destructors, clean-up after another error).
#define DFLASH_CUDA_WARN(call) ::dflash::cuda::warn_cuda_error((call), #call, __FILE__, __LINE__)

#define DFLASH_CUBLAS_CHECK(call) \
  DFLASH_STATUS_CHECK_(cublasStatus_t, call, CUBLAS_STATUS_SUCCESS, throw_cublas_error, #call)

#define DFLASH_NCCL_CHECK(call) DFLASH_STATUS_CHECK_(ncclResult_t, call, ncclSuccess, throw_nccl_error, #call)

namespace dflash::cuda {

// Makes `device` current for a scope and restores the caller's device at its end.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    DFLASH_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) {
      DFLASH_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) DFLASH_CUDA_WARN(cudaSetDevice(prev_));
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool switched_ = false;
};

}  // namespace dflash::cuda
