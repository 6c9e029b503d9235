#pragma once
// Capturing a stream's work into a CUDA graph (the target decoder's step graphs, the proposer's).
#include <functional>
#include <string>

namespace dflash {

// Begins a relaxed-mode capture on `stream` (an allocator pool may cudaMalloc while capturing), runs
// `enqueue`, ends the capture and instantiates the graph into *exec (a cudaGraphExec_t). Returns ""
// on success, else what failed (an exception of enqueue, the end of the capture, the instantiation);
// then *exec stays null and the error a failed capture leaves behind is cleared. The stream is out of
// capture mode either way. The caller owns *exec (cudaGraphExecDestroy).
std::string capture_cuda_graph(void* stream, const std::function<void()>& enqueue, void** exec);

}  // namespace dflash
