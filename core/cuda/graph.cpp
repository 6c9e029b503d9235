#include "core/cuda/graph.h"

#include <cuda_runtime.h>

#include <exception>

#include "core/cuda/check.h"
#include "core/error.h"

namespace dflash {

CudaGraphExec::~CudaGraphExec() {
  if (exec_) DFLASH_CUDA_WARN(cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_)));
}

void CudaGraphExec::launch(void* stream) const {
  DFLASH_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), static_cast<cudaStream_t>(stream)));
}

std::string capture_cuda_graph(void* stream, const std::function<void()>& enqueue, CudaGraphExec* exec) {
  const auto s = static_cast<cudaStream_t>(stream);
  DFLASH_CHECK(!*exec, "capture_cuda_graph: the graph to fill is not empty");
  std::string err;
  cudaGraph_t cg = nullptr;
  try {
    DFLASH_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
    try {
      enqueue();
    } catch (const std::exception& e) {
      err = e.what();
    }
    const cudaError_t end = cudaStreamEndCapture(s, &cg);
    if (err.empty() && end != cudaSuccess) err = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(end);
    if (err.empty()) {
      cudaGraphExec_t e = nullptr;
      const cudaError_t inst = cudaGraphInstantiate(&e, cg, 0);
      if (inst != cudaSuccess) err = std::string("cudaGraphInstantiate: ") + cudaGetErrorString(inst);
      else exec->exec_ = e;
    }
  } catch (const std::exception& e) {
    if (err.empty()) err = e.what();
  }
  if (cg) DFLASH_CUDA_WARN(cudaGraphDestroy(cg));
  if (!err.empty()) cudaGetLastError();  // a failed capture leaves its error behind
  return err;
}

}  // namespace dflash
