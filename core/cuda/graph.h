#pragma once
// Capturing a stream's work into a CUDA graph (the target decoder's step graphs, the proposer's).
#include <functional>
#include <string>

namespace dflash {

// An instantiated CUDA graph (a cudaGraphExec_t), destroyed with its owner; empty until
// capture_cuda_graph fills it.
class CudaGraphExec {
 public:
  CudaGraphExec() = default;
  ~CudaGraphExec();
  CudaGraphExec(const CudaGraphExec&) = delete;
  CudaGraphExec& operator=(const CudaGraphExec&) = delete;
  explicit operator bool() const { return exec_ != nullptr; }
  // Replays the graph on `stream` (a cudaStream_t); throws naming the CUDA error.
  void launch(void* stream) const;

 private:
  friend std::string capture_cuda_graph(void* stream, const std::function<void()>& enqueue, CudaGraphExec* exec);
  void* exec_ = nullptr;  // cudaGraphExec_t
};

// Begins a relaxed-mode capture on `stream` (an allocator pool may cudaMalloc while capturing), runs
// `enqueue`, ends the capture and instantiates the graph into *exec (empty before). Returns "" on
// success, else what failed (an exception of enqueue, the end of the capture, the instantiation);
// then *exec stays empty and the error a failed capture leaves behind is cleared. The stream is out of
// capture mode either way.
std::string capture_cuda_graph(void* stream, const std::function<void()>& enqueue, CudaGraphExec* exec);

}  // namespace dflash
