#pragma once
// The drafter's fast-path plan: which kernel runs each step of the drafter's training step and why,
// decided once at start-up (the drafter's twin of target_model/fast_path.h). The trainer prints its
// summary with the target's, writes it into run_dir/fast_path.json ("drafter_attention", as before,
// and the whole plan under "drafter"), and `require_fast_path` refuses a fallback here, in the plan
// builder, and nowhere else.
//
// Of the drafter's steps (drafter/model_cuda.cpp) only the block attention has a choice: the
// tensor-core kernels (wgmma on sm_90a, mma.sync elsewhere) for head dims 64 and 128 on sm_80+, else
// the (tens of times slower) fallback kernel. The GEMMs (cuBLASLt) and the fused LM-head CE have one
// kernel each; the plan names them too.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "drafter/config.h"
#include "core/tensor.h"

namespace dflash::drafter {

struct DrafterStepPlan {
  std::string step;    // "block_attention", "gemm", "lm_head_ce"
  std::string path;    // "fast", "fallback" or "cpu"
  std::string kernel;  // e.g. "wgmma sm_90a" (empty for the attention fallback)
  std::string reason;  // e.g. "head_dim 128 on sm_90"
};

struct DrafterPlan {
  std::string device;  // Device::str(): "cuda:0" or "cpu"
  int64_t head_dim = 0;
  std::vector<DrafterStepPlan> steps;  // block_attention first

  const DrafterStepPlan& attention() const { return steps.front(); }
  bool attention_fallback() const { return attention().path == "fallback"; }
  // "drafter attention: tensor-core kernels (wgmma sm_90a, head_dim 128)" / "drafter attention:
  // FALLBACK kernel (<reason>)" / "drafter attention: the CPU reference (double)".
  std::string summary() const;
  // fast_path.json's "drafter_attention": {"path", "kernel" (fast only), "reason"}.
  nlohmann::json attention_json() const;
  nlohmann::json to_json() const;  // {"device", "steps": [{"step", "path", "kernel", "reason"}]}
};

// What the kernels report for the block attention on a device (kernels/cuda/block_attention.h),
// passed in so the decision below is host logic a test drives without a GPU.
struct BlockAttentionKernels {
  bool tensor_cores = false;  // block_attention_supported(head_dim, sm_major)
  std::string kernel;         // block_attention_kernel_name(head_dim, device) when tensor_cores
};

// The plan of a CUDA device of compute capability sm_major.sm_minor from what its kernels support;
// require_fast_path refuses the attention fallback (naming the device and the reason, with a hint).
// fp8_linears (model.drafter.precision: fp8): the gemm step is the block-scaled FP8 one
// (drafter/fp8_cuda.h); refused, naming the fields or the GPU, where check_fp8_drafter_sizes fails or
// the GPU is not sm_90 (cuBLASLt's block-scaled FP8 kernels).
DrafterPlan drafter_plan(const DrafterConfig& c, Device device, int sm_major, int sm_minor,
                         const BlockAttentionKernels& kernels, bool require_fast_path, bool fp8_linears = false,
                         bool fp8_lm_head = false);
// The same, asking the kernels (a build without CUDA throws, naming the way out).
DrafterPlan make_drafter_plan(const DrafterConfig& c, Device device, int sm_major, int sm_minor, bool require_fast_path,
                              bool fp8_linears = false, bool fp8_lm_head = false);
// The CPU reference's plan (every step on the double-precision reference).
DrafterPlan make_cpu_drafter_plan(const DrafterConfig& c);

// ---- Sizes the CUDA drafter's kernels constrain (issue 26) --------------------------------------
// hidden_size (the target's) and head_dim must be multiples of 8: the flat parameter layout, the
// fused LM-head CE, the block attention and the q|k|v views keep 16-byte rows of bf16; throws naming
// the field and what to do. drafter_plan calls it (start-up, before anything is loaded), and so do
// CudaDrafter and the CUDA proposer. The vocabulary may have any size (the CE pads its logits rows).
void check_cuda_drafter_sizes(const DrafterConfig& c);
// intermediate_size not a multiple of 8: the MLP's GEMMs run cuBLASLt's kernels for unaligned
// operands (GemmExParams::unaligned; the plan's gemm step is then "fallback" and says why).
bool cuda_drafter_gemm_unaligned(const DrafterConfig& c);
// The FP8 drafter on GPUs (issue 31): hidden_size, q_dim (heads x head_dim), kv_dim and
// intermediate_size multiples of 128 (the 128 x 128 weight tiles of each projection, inside the fused
// q|k|v and gate|up matrices); throws naming each field that is not, with the way out (bf16).
void check_fp8_drafter_sizes(const DrafterConfig& c);

}  // namespace dflash::drafter
