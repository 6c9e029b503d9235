#include "drafter/fast_path.h"

#include <fmt/format.h>

#include "core/device.h"
#include "core/error.h"
#if DFLASH_WITH_CUDA
#include "kernels/cuda/block_attention.h"
#endif

namespace dflash::drafter {

std::string DrafterPlan::summary() const {
  const DrafterStepPlan& a = attention();
  std::string linears;  // the FP8 linears (model.drafter.precision: fp8) are named; bf16 ones are the default
  for (const DrafterStepPlan& s : steps)
    if (s.step == "gemm" && s.kernel.find("gemm_fp8") != std::string::npos) linears = "; drafter linears: block-scaled fp8";
  if (a.path == "fast")
    return fmt::format("drafter attention: tensor-core kernels ({}, head_dim {}){}", a.kernel, head_dim, linears);
  if (a.path == "fallback") return "drafter attention: FALLBACK kernel (" + a.reason + ")" + linears;
  return "drafter attention: " + a.reason;
}

nlohmann::json DrafterPlan::attention_json() const {
  const DrafterStepPlan& a = attention();
  if (a.path == "fast") return {{"path", a.path}, {"kernel", a.kernel}, {"reason", a.reason}};
  return {{"path", a.path}, {"reason", a.reason}};
}

nlohmann::json DrafterPlan::to_json() const {
  nlohmann::json steps_json = nlohmann::json::array();
  for (const DrafterStepPlan& s : steps)
    steps_json.push_back({{"step", s.step}, {"path", s.path}, {"kernel", s.kernel}, {"reason", s.reason}});
  return {{"device", device}, {"steps", steps_json}};
}

void check_cuda_drafter_sizes(const DrafterConfig& c) {
  std::string bad;
  if (c.hidden_size % 8 != 0)
    bad += fmt::format("\n  hidden_size {} (the target's; the drafter shares its embedding and LM head)", c.hidden_size);
  if (c.head_dim % 8 != 0) bad += fmt::format("\n  head_dim {} (model.drafter.head_dim)", c.head_dim);
  // The head norm + RoPE kernels (kernels/cuda/rope.cu, head_norm_rope) hold 4 rotary pairs per lane.
  if (c.head_dim > 256)
    bad += fmt::format("\n  head_dim {} (model.drafter.head_dim) above 256, the head norm + RoPE kernels' limit", c.head_dim);
  DFLASH_CHECK_HINT(bad.empty(),
                    (c.source.empty() ? std::string("drafter") : c.source)
                        << ": the CUDA drafter needs these sizes multiples of 8 (16-byte rows of bf16 for its "
                           "parameter layout, GEMMs, block attention and fused LM-head CE) and head_dim <= 256:"
                        << bad,
                    "set model.drafter.head_dim to a multiple of 8 up to 256 (64 or 128 run the tensor-core attention); a "
                    "target whose hidden_size is not a multiple of 8 trains its drafter on the CPU backend "
                    "(parallel.device: cpu) only");
}

bool cuda_drafter_gemm_unaligned(const DrafterConfig& c) { return c.intermediate_size % 8 != 0; }

void check_fp8_drafter_sizes(const DrafterConfig& c) {
  std::string bad;
  if (c.hidden_size % 128 != 0)
    bad += fmt::format("\n  hidden_size {} (the target's; the drafter shares its embedding and LM head)", c.hidden_size);
  if (c.q_dim() % 128 != 0)
    bad += fmt::format("\n  q_dim {} = num_attention_heads {} x head_dim {}", c.q_dim(), c.num_attention_heads, c.head_dim);
  if (c.kv_dim() % 128 != 0)
    bad += fmt::format("\n  kv_dim {} = num_key_value_heads {} x head_dim {}", c.kv_dim(), c.num_key_value_heads, c.head_dim);
  if (c.intermediate_size % 128 != 0) bad += fmt::format("\n  intermediate_size {}", c.intermediate_size);
  DFLASH_REQUIRE_HINT(bad.empty(),
                      (c.source.empty() ? std::string("drafter") : c.source)
                          << ": model.drafter.precision: fp8 on GPUs needs these sizes multiples of 128 (each "
                             "projection's 128 x 128 weight tiles inside the fused q|k|v and gate|up matrices):"
                          << bad,
                      "train this drafter in bf16 (model.drafter.precision: bf16), or pick sizes that are multiples of "
                      "128 (every published DFlash drafter's are)");
}

DrafterPlan drafter_plan(const DrafterConfig& c, Device device, int sm_major, int sm_minor,
                         const BlockAttentionKernels& kernels, bool require_fast_path, bool fp8_linears,
                         bool fp8_lm_head) {
  check_cuda_drafter_sizes(c);
  if (fp8_lm_head) {
    DFLASH_REQUIRE_HINT(c.hidden_size % 16 == 0,
                        "model.drafter.lm_head_precision: fp8 needs a hidden size that is a multiple of 16, got "
                            << c.hidden_size,
                        "run the LM head in bf16 (model.drafter.lm_head_precision: bf16)");
    DFLASH_REQUIRE_HINT(sm_major == 9,
                        "model.drafter.lm_head_precision: fp8 needs an sm_90 GPU (cuBLASLt's block-scaled FP8 GEMMs), but "
                            << device.str() << " is sm_" << sm_major << sm_minor,
                        "run the LM head in bf16 (model.drafter.lm_head_precision: bf16) on this GPU");
  }
  if (fp8_linears) {
    check_fp8_drafter_sizes(c);
    DFLASH_REQUIRE_HINT(sm_major == 9,
                        "model.drafter.precision: fp8 needs an sm_90 GPU (cuBLASLt's block-scaled FP8 GEMMs), but "
                            << device.str() << " is sm_" << sm_major << sm_minor,
                        "train the drafter in bf16 (model.drafter.precision: bf16) on this GPU");
  }
  DrafterPlan plan;
  plan.device = device.str();
  plan.head_dim = c.head_dim;
  if (kernels.tensor_cores) {
    plan.steps.push_back({"block_attention", "fast", kernels.kernel,
                          fmt::format("head_dim {} on sm_{}{}", c.head_dim, sm_major, sm_minor)});
  } else {
    const std::string why = fmt::format("head_dim {} on sm_{}{}; the tensor-core kernels take head_dim 64 or 128 on sm_80+",
                                        c.head_dim, sm_major, sm_minor);
    plan.steps.push_back({"block_attention", "fallback", "", why});
    DFLASH_REQUIRE_HINT(!require_fast_path,
                      "require_fast_path is set, but the drafter's attention would run the fallback kernel on "
                          << device.str() << ": " << why,
                      "set model.drafter.head_dim: 128 (with num_attention_heads / num_key_value_heads to match), or "
                      "kernels.require_fast_path: false to accept the fallback (tens of times slower)");
  }
  if (cuda_drafter_gemm_unaligned(c)) {
    const std::string why = fmt::format(
        "intermediate_size {} is not a multiple of 8: the MLP's GEMMs run cuBLASLt's kernels for unaligned bf16 "
        "operands",
        c.intermediate_size);
    plan.steps.push_back({"gemm", "fallback", "cuBLASLt gemm_ex (unaligned)", why});
    DFLASH_REQUIRE_HINT(!require_fast_path,
                      "require_fast_path is set, but the drafter's GEMMs would run the fallback kernels on "
                          << device.str() << ": " << why,
                      "set model.drafter.intermediate_size to a multiple of 8, or kernels.require_fast_path: false");
  } else if (fp8_linears) {
    plan.steps.push_back({"gemm", "fast", "cuBLASLt gemm_fp8 (e4m3 VEC128xBLK128x128, wgrad VEC128xVEC128)",
                          "model.drafter.precision: fp8: block-scaled e4m3 operands (weights 128x128, activations and "
                          "gradients 1x128, weight gradients' operands 128x1 along the tokens), fp32 accumulation"});
  } else {
    plan.steps.push_back({"gemm", "fast", "cuBLASLt gemm_ex", "bf16 operands, fp32 accumulation (weight gradients fp32)"});
  }
  if (fp8_lm_head)
    plan.steps.push_back({"lm_head_ce", "fast", "linear_ce fp8 (cuBLASLt gemm_fp8)",
                          "model.drafter.lm_head_precision: fp8: fused chunked LM head + cross-entropy on block-scaled e4m3 "
                          "operands (head 128x128, hidden rows and the logits' gradient 1x128), fp32 logits"});
  else
    plan.steps.push_back({"lm_head_ce", "fast", "linear_ce", "fused chunked LM head + cross-entropy (no R x V logits)"});
  return plan;
}

DrafterPlan make_drafter_plan(const DrafterConfig& c, Device device, int sm_major, int sm_minor, bool require_fast_path,
                              bool fp8_linears, bool fp8_lm_head) {
#if DFLASH_WITH_CUDA
  BlockAttentionKernels k;
  k.tensor_cores = cuda::block_attention_supported(c.head_dim, sm_major);
  // (Which tensor-core kernel runs is the device's to say; without it, as a test may ask, mma.sync.)
  if (k.tensor_cores)
    k.kernel = device.index < cuda_device_count() ? cuda::block_attention_kernel_name(c.head_dim, device.index) : "mma.sync";
  return drafter_plan(c, device, sm_major, sm_minor, k, require_fast_path, fp8_linears, fp8_lm_head);
#else
  (void)c, (void)sm_major, (void)sm_minor, (void)require_fast_path, (void)fp8_linears, (void)fp8_lm_head;
  DFLASH_FAIL_HINT("a drafter plan for " << device.str() << " needs the CUDA backend, which this build does not have",
                   "reconfigure with -DDFLASH_CUDA=ON on a machine with nvcc");
#endif
}

DrafterPlan make_cpu_drafter_plan(const DrafterConfig& c) {
  DrafterPlan plan;
  plan.head_dim = c.head_dim;
  plan.device = Device::cpu().str();
  for (const char* step : {"block_attention", "gemm", "lm_head_ce"})
    plan.steps.push_back({step, "cpu", "cpu reference", "the CPU reference (double)"});
  return plan;
}

}  // namespace dflash::drafter
