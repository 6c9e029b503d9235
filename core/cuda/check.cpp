// The throwing half of core/cuda/check.h: turns a status code into one dflash::Error with the
// call text, the library's name and description of the code, and a hint a user can act on.
#include "core/cuda/check.h"

#include <spdlog/spdlog.h>

#include "core/error.h"

namespace dflash::cuda {

namespace {

std::string or_unknown(const char* s) { return s ? std::string(s) : std::string("unknown"); }

std::string failed(const char* call, const std::string& what) {
  return std::string("`") + call + "` failed: " + what;
}

// Errors after which the CUDA context is unusable: every later CUDA call in this process fails too.
bool is_sticky(cudaError_t s) {
  switch (s) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorLaunchTimeout:
      return true;
    default:
      return false;
  }
}

const char* cublas_hint(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "the GPU is out of memory; reduce the batch size or sequence length";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "the cuBLAS handle could not be created: check the driver with nvidia-smi and CUDA_VISIBLE_DEVICES";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "this GPU lacks a feature the call needs (e.g. bf16 tensor cores need sm_80 or newer)";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "cuBLASLt has no algorithm for this shape/dtype/layout on this GPU; check the matrix "
             "layouts and alignment (16-byte aligned pointers, leading dimensions a multiple of 8)";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "a size, leading dimension or descriptor attribute is invalid for this call";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "the GPU failed to run the cuBLAS kernel; an earlier kernel may have corrupted memory "
             "(rerun with CUDA_LAUNCH_BLOCKING=1 or compute-sanitizer)";
    default:
      return "";
  }
}

const char* nccl_name(ncclResult_t s) {
  switch (s) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult";
  }
}

const char* nccl_hint(ncclResult_t s) {
  switch (s) {
    case ncclUnhandledCudaError:
      return "a CUDA call inside NCCL failed (often out of GPU memory); rerun with NCCL_DEBUG=WARN for details";
    case ncclSystemError:
      return "a system call failed (network, shared memory /dev/shm, or ulimits); rerun with NCCL_DEBUG=INFO";
    case ncclInternalError:
      return "rerun with NCCL_DEBUG=INFO and check that every rank runs the same NCCL version";
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return "the ranks disagree on the collective (count, dtype, root or order of calls), or a "
             "communicator is used after an error; rerun with NCCL_DEBUG=WARN";
    case ncclRemoteError:
      return "another rank failed or a network link broke; look at the logs of the other ranks first";
    default:
      return "rerun with NCCL_DEBUG=WARN for details";
  }
}

}  // namespace

std::string cuda_error_text(cudaError_t status) {
  // Both functions are table look-ups in the runtime: they work without a driver or device.
  return or_unknown(cudaGetErrorName(status)) + " (" + or_unknown(cudaGetErrorString(status)) + ")";
}

std::string cuda_error_hint(cudaError_t s) {
  switch (s) {
    case cudaErrorMemoryAllocation:
      return "the GPU is out of memory; reduce the batch size or sequence length, and check with "
             "nvidia-smi that no other process holds memory on this GPU";
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorStubLibrary:
      return "no usable GPU/driver: check nvidia-smi and CUDA_VISIBLE_DEVICES (the driver must support "
             "CUDA " + std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10) +
             ")";
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return "the NVIDIA kernel driver and the user-space driver library differ in version; reboot or "
             "reinstall the driver so that nvidia-smi works";
    case cudaErrorInvalidDevice:
      return "the device index is out of range; check CUDA_VISIBLE_DEVICES and that the ranks per node "
             "do not exceed the GPUs per node";
    case cudaErrorDevicesUnavailable:
      return "the GPU is busy or in exclusive-process mode and used by another process; check nvidia-smi";
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorInvalidPtx:
      return "this binary was not built for this GPU's architecture; reconfigure with "
             "-DCMAKE_CUDA_ARCHITECTURES=<sm> (e.g. 90 for H100/H200) and rebuild";
    case cudaErrorInvalidConfiguration:
    case cudaErrorLaunchOutOfResources:
      return "the kernel launch asks for more threads, registers or shared memory than the GPU offers "
             "(a dflash bug: please report the shapes that triggered it)";
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
      return "a kernel failed; kernels run asynchronously, so it may be an earlier launch than this "
             "call: rerun with CUDA_LAUNCH_BLOCKING=1 or under compute-sanitizer to find it. The CUDA "
             "context is unusable now, so the process must exit";
    case cudaErrorECCUncorrectable:
      return "the GPU reported an uncorrectable ECC memory error; check nvidia-smi -q and drain the node";
    case cudaErrorLaunchTimeout:
      return "a kernel ran into the display watchdog timeout; use a GPU without a display attached";
    case cudaErrorPeerAccessUnsupported:
      return "these GPUs cannot access each other's memory directly; copies go through the host";
    default:
      return "";
  }
}

void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  std::string msg = failed(call, cuda_error_text(status));
  if (is_sticky(status)) msg += " [sticky: the CUDA context is lost]";
  raise(file, line, msg, cuda_error_hint(status));
}

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  raise(file, line,
        failed(call, or_unknown(cublasGetStatusName(status)) + " (" + or_unknown(cublasGetStatusString(status)) + ")"),
        cublas_hint(status));
}

void throw_nccl_error(ncclResult_t status, const char* call, const char* file, int line) {
  std::string msg = failed(call, std::string(nccl_name(status)) + " (" + or_unknown(ncclGetErrorString(status)) + ")");
  // The detailed reason NCCL recorded (e.g. which peer or which system call); the comm argument is
  // unused by NCCL, and the text may be empty when NCCL recorded nothing.
  const char* last = ncclGetLastError(nullptr);
  if (last && *last) msg += "; NCCL says: " + std::string(last);
  raise(file, line, msg, nccl_hint(status));
}

bool warn_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  if (status == cudaSuccess) return true;
  spdlog::warn("`{}` failed: {} (at {}:{})", call, cuda_error_text(status), file, line);
  return false;
}

}  // namespace dflash::cuda
