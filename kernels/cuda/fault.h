#pragma once
// A test hook's kernels (trainer's DFLASH_FAULT_CUDA_ERROR, the fault matrix): one CUDA launch that
// fails. Never used by a production run.
#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// trap = false: a launch with an invalid configuration (a block of 2048 threads), which
// DFLASH_CUDA_CHECK_LAST reports at once (cudaErrorInvalidValue on the H200, CUDA 13; the context stays
// usable).
// trap = true: a kernel that executes a trap instruction on the device: the launch succeeds and the
// error (sticky: the context is lost) surfaces at the next synchronizing call, as a faulting kernel's does.
void launch_fault(bool trap, Stream s);

}  // namespace dflash::cuda
