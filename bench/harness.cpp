#include "bench/harness.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <limits>

#include "core/cuda/check.h"
#include "core/device.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/pdl.cuh"

namespace dflash::bench {

std::vector<double> time_cuda(void* stream, int warmup, int iters, const std::function<void()>& fn) {
  auto st = static_cast<cudaStream_t>(stream);
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<cudaEvent_t> ev(static_cast<size_t>(iters) + 1);
  for (auto& e : ev) DFLASH_CUDA_CHECK(cudaEventCreate(&e));
  DFLASH_CUDA_CHECK(cudaEventRecord(ev[0], st));
  for (int i = 0; i < iters; ++i) {
    fn();
    DFLASH_CUDA_CHECK(cudaEventRecord(ev[static_cast<size_t>(i) + 1], st));
  }
  DFLASH_CUDA_CHECK(cudaEventSynchronize(ev.back()));
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    float t = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&t, ev[static_cast<size_t>(i)], ev[static_cast<size_t>(i) + 1]));
    ms.push_back(t);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return ms;
}

double copy_bandwidth_gbs(int device) {
  const int64_t bytes = int64_t{1} << 30;
  const Device dev = Device::cuda(device);
  Tensor a = Tensor::empty({bytes}, DType::U8, dev), b = Tensor::empty({bytes}, DType::U8, dev);
  void* st = DeviceContext::get(device).stream();
  // An idle GPU: no work in flight on any stream shares the memory with the copies. (The callers
  // measure before loading a model too: with 52 GB of weights allocated the same copies gave
  // 3,835 GB/s against 4,273 before, on one H200.)
  DFLASH_CUDA_CHECK(cudaSetDevice(device));
  DFLASH_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<double> ms = time_cuda(st, 2, 10, [&] {
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(b.raw_data(), a.raw_data(), static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice,
                                      static_cast<cudaStream_t>(st)));
  });
  // The best copy: the bandwidth the memory reaches (roofline.h states every step against it).
  return 2.0 * static_cast<double>(bytes) / (*std::min_element(ms.begin(), ms.end()) * 1e-3) / 1e9;
}

void apply_decode_variant(const std::string& name, target::FastPathPlan::DecodeFusion& f, const char* option) {
  if (name == "no_pdl") cuda::tuning::pdl = 0;
  else if (name == "skinny") f.skinny_gemm = f.swiglu_gemm = true;
  else if (name == "skinny_no_swiglu") f.skinny_gemm = true, f.swiglu_gemm = false;
  else if (name == "no_skinny") f.skinny_gemm = f.swiglu_gemm = f.skinny_streamk = false;
  else if (name == "skinny_streamk") f.skinny_gemm = f.skinny_streamk = true, f.swiglu_gemm = false;
  else if (name == "no_gdn_chain") f.gdn_chain = false;
  else if (name == "gdn_chain_all") f.gdn_chain_max_seqs = std::numeric_limits<int64_t>::max();
  else if (name == "no_commit") f.commit = f.commit_overlap = false;
  else if (name == "no_overlap") f.commit_overlap = false;
  else if (name == "moe_decode") f.moe_decode = true;
  else if (name == "moe_wgmma") f.moe_wgmma = true;
  else if (name == "prefetch") f.prefetch = true;
  else if (name == "no_prefetch") f.prefetch = false;
  else if (name == "packed") f.skinny_gemm = f.swiglu_gemm = f.fp8_packed = true;
  else if (name == "no_packed") f.fp8_packed = false;
  else if (name == "side_gemms") f.fp8_side_gemms = true;
  else if (name == "no_side_gemms") f.fp8_side_gemms = false;
  else if (name == "gate_quant") cuda::tuning::gate_quant = 1;
  else if (name == "no_gate_quant") cuda::tuning::gate_quant = 0;
  else if (name == "unfused") f = {}, cuda::tuning::pdl = cuda::tuning::gate_quant = 0;
  else DFLASH_REQUIRE_HINT(name == "fused", option << ": unknown variant '" << name << "'", "use " << kDecodeVariantNames);
}

VariantSwitches VariantSwitches::save() { return {cuda::tuning::pdl, cuda::tuning::gate_quant}; }

void VariantSwitches::restore() const {
  cuda::tuning::pdl = pdl;
  cuda::tuning::gate_quant = gate_quant;
}

}  // namespace dflash::bench
