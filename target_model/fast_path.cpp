#include "target_model/fast_path.h"

#include <limits>
#include <sstream>

#include "core/device.h"
#include "core/error.h"
#if DFLASH_WITH_CUDA
#include "kernels/cuda/attention.h"
#include "kernels/cuda/conv.h"
#include "kernels/cuda/gdn.h"
#include "kernels/cuda/gemm.h"
#endif

namespace dflash::target {

const char* policy_name(KernelPolicy p) {
  switch (p) {
    case KernelPolicy::Auto: return "auto";
    case KernelPolicy::Fast: return "fast";
    case KernelPolicy::Fallback: return "fallback";
  }
  return "?";
}

KernelPolicy parse_policy(const std::string& s, const std::string& what) {
  if (s == "auto") return KernelPolicy::Auto;
  if (s == "fast") return KernelPolicy::Fast;
  if (s == "fallback") return KernelPolicy::Fallback;
  DFLASH_FAIL_HINT(what << ": unknown kernel policy '" << s << "'", "use auto, fast or fallback");
}

const char* step_name(Step s) {
  switch (s) {
    case Step::Conv: return "conv";
    case Step::DeltaRule: return "delta_rule";
    case Step::Attention: return "attention";
    case Step::ConvUpdate: return "conv_update";
    case Step::DeltaRulePool: return "delta_rule_pool";
    case Step::AttentionDecode: return "attention_decode";
    case Step::Gemm: return "gemm";
  }
  return "?";
}

const char* path_name(Path p) {
  switch (p) {
    case Path::Fast: return "fast";
    case Path::Fallback: return "fallback";
    case Path::Cpu: return "cpu";
  }
  return "?";
}

bool LayerPlan::all_fast() const {
  for (const StepPlan& s : steps)
    if (s.path != Path::Fast) return false;
  return true;
}

const StepPlan& LayerPlan::step(Step s) const {
  for (const StepPlan& p : steps)
    if (p.step == s) return p;
  DFLASH_FAIL("layer " << layer << " has no " << step_name(s) << " step");
}

namespace {

struct Capability {
  bool ok;
  std::string why;  // when !ok: what the fast kernel cannot serve
};

// Decides one step: the fast kernel when allowed and able, else the fallback with the reason.
// (Unused in a build without the CUDA backend, whose plans are CPU-only.)
[[maybe_unused]] StepPlan decide(Step step, int64_t layer, KernelPolicy policy, const Capability& cap,
                                 const std::string& fast_kernel, const std::string& fast_detail,
                                 const std::string& fallback_kernel, const std::string& config_key) {
  if (policy == KernelPolicy::Fallback)
    return {step, Path::Fallback, fallback_kernel, "fallback: forced by config (" + config_key + ": fallback)"};
  if (!cap.ok) {
    DFLASH_CHECK_HINT(policy != KernelPolicy::Fast,
                      config_key << ": fast requested, but layer " << layer << " cannot use " << fast_kernel << ": "
                                 << cap.why,
                      "set " << config_key << ": auto to accept the fallback, or fix the model shape");
    return {step, Path::Fallback, fallback_kernel, "fallback: " + cap.why};
  }
  return {step, Path::Fast, fast_kernel, "fast: " + fast_detail};
}

}  // namespace

namespace {

// Both plans: the forward's steps (decode = false) or those of incremental decoding on slot states.
// The layer's projections, as the gemm step's reason names them.
// An MoE block (CPU reference only: ops::moe_route / moe_experts / add_sigmoid_gated) names its
// router, routed experts and shared expert in place of the dense MLP's gate|up, down.
std::string projections(bool gdn, const TargetConfig& c) {
  const std::string mlp = c.is_moe() ? "MoE block (router over " + std::to_string(c.num_experts) + " experts, top " +
                                           std::to_string(c.num_experts_per_tok) +
                                           " experts' gate|up, down, shared expert, its sigmoid gate)"
                                     : std::string("gate|up, down");
  return gdn ? "in_proj_qkv|z, out_proj, " + mlp + " (in_proj_b|a bf16)" : "q|k|v, o_proj, " + mlp;
}

// The GPU runs MoE blocks in bf16 (kernels/cuda/moe.h; an FP8 MoE checkpoint runs dequantized), on
// one rank or expert-parallel inside the TP group (tp.h: each rank its expert group, the partial
// outputs summed by the TP all-reduce); precision fp8 is refused by name.
void require_gpu_moe(const TargetConfig& c, Precision precision, Device device) {
  DFLASH_REQUIRE_HINT(precision != Precision::Fp8,
                      c.source << ": model_type " << c.model_type << " (num_experts " << c.num_experts
                               << "): FP8 MoE layers do not run on the GPU yet (" << device.str() << ")",
                      "run this MoE target in bf16 (model.target.precision: bf16, or --precision bf16)");
}

// The GPU MoE block's steps and kernels (sets the plan's moe_kernel / moe_fallback).
std::string gpu_moe_detail(const TargetConfig& c, const KernelPolicies& pol, FastPathPlan& plan) {
  const bool fallback = pol.moe == KernelPolicy::Fallback;
  plan.moe_kernel = fallback ? "moe_loop_gemm_bf16" : "moe_grouped_mma";
  plan.moe_fallback = fallback;
  std::string steps = ": router gemm_ex (fp32 logits), moe_topk (fp32 softmax, top " +
                      std::to_string(c.num_experts_per_tok) + (c.norm_topk_prob ? ", renormalised" : "") +
                      "), moe_permute, ";
  steps += fallback ? "fallback moe_loop_gemm_bf16 (kernels.moe: fallback; gathered rows, per expert gemm_bf16 "
                      "gate|up + swiglu + gemm_bf16 down; reads the counts back: eager launches, no CUDA graphs)"
                    : "fast moe_grouped_mma (grouped gate|up with the gather and SwiGLU fused, grouped down; "
                      "wgmma tiles on sm_90 for calls of more than 512 routed rows, mma.sync below)";
  steps += ", shared expert gemm_bf16, moe_combine (weighted un-permute + sigmoid-gated shared expert)";
  if (!fallback)
    steps += "; decode / verify steps (<= 16 tokens): the routing in one launch (moe_route_small), deep mma.sync "
             "tiles of 16-row blocks, and with bf16 experts and a shared expert as wide as the routed ones (" +
             std::string(c.shared_expert_intermediate_size == c.moe_intermediate_size ? "here" : "not here") +
             ") the shared expert in the expert GEMMs' launches: 5 launches a block";
  if (c.ep_size > 1 || c.local_num_experts() < c.num_experts)
    steps += "; expert parallel: " + std::to_string(c.local_num_experts()) + " of the " + std::to_string(c.num_experts) +
             " experts on each rank (ep " + std::to_string(c.ep_size) + "), partial outputs summed by the TP all-reduce";
  return steps;
}

FastPathPlan build_plan(const TargetConfig& c, Device device, const KernelPolicies& pol, int sm_major, bool decode,
                        Precision precision) {
  DFLASH_CHECK(precision != Precision::Auto, "fast-path plan: resolve the precision first (resolve_precision)");
  const bool fp8 = precision == Precision::Fp8;
  if (!device.is_cpu()) {
    if (c.is_moe()) require_gpu_moe(c, precision, device);
    check_gpu_sizes(c, precision);
  }
  [[maybe_unused]] const std::string unaligned = unaligned_gemm_sizes(c);
  FastPathPlan plan;
  plan.device = device.str();
  if (c.is_moe())
    plan.moe = std::to_string(c.num_hidden_layers) + " MoE blocks (" + std::to_string(c.num_experts) + " experts, top " +
               std::to_string(c.num_experts_per_tok) +
               (c.ep_size > 1 ? ", ep " + std::to_string(c.ep_size) + ": " + std::to_string(c.local_num_experts()) +
                                    " of them on this rank"
                              : std::string()) +
               ")" + (device.is_cpu() ? std::string(" on the CPU reference") : gpu_moe_detail(c, pol, plan));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    LayerPlan lp;
    lp.layer = i;
    lp.type = c.layer_types[static_cast<size_t>(i)];
    const bool gdn = lp.type == LayerType::LinearAttention;
    if (device.is_cpu()) {
      auto cpu_step = [&](Step s, const char* k) { lp.steps.push_back({s, Path::Cpu, k, "cpu reference (f32)"}); };
      if (gdn) {
        cpu_step(decode ? Step::ConvUpdate : Step::Conv, decode ? "cpu::causal_conv1d_update" : "cpu::causal_conv1d");
        cpu_step(decode ? Step::DeltaRulePool : Step::DeltaRule,
                 decode ? "cpu::gated_delta_rule_pool" : "cpu::gated_delta_rule");
      } else {
        cpu_step(decode ? Step::AttentionDecode : Step::Attention, decode ? "cpu::attention_decode" : "cpu::causal_attention");
      }
      lp.steps.push_back({Step::Gemm, Path::Cpu, fp8 ? "cpu::linear (fp8)" : "cpu::linear",
                          fp8 ? "cpu reference (f32 on the e4m3 values; inputs quantized per 1 x 128 group): " + projections(gdn, c)
                              : "cpu reference (f32): " + projections(gdn, c)});
      plan.layers.push_back(std::move(lp));
      continue;
    }
#if DFLASH_WITH_CUDA
    const std::string sm = "sm_" + std::to_string(sm_major) + "x";
    const int64_t C = c.gdn_conv_dim(), K = c.linear_conv_kernel_dim, dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
    const int64_t d = c.head_dim;
    const std::string gqa = "GQA " + std::to_string(c.num_attention_heads) + "/" + std::to_string(c.num_key_value_heads);
    if (gdn && !decode) {
      Capability conv{cuda::causal_conv1d_fast_supported(C, K),
                      "fused conv needs channels % 8 == 0 and kernel size 1..4 (C=" + std::to_string(C) +
                          ", K=" + std::to_string(K) + ")"};
      lp.steps.push_back(decide(Step::Conv, i, pol.conv, conv, "causal_conv1d_fast",
                                "one conv over C=" + std::to_string(C) + " (q|k|v) channels, K=" + std::to_string(K),
                                "causal_conv1d_fallback", "kernels.conv"));
      Capability dr{cuda::chunk_gated_delta_rule_supported(dk, dv, sm_major),
                    "head dims dk=" + std::to_string(dk) + " dv=" + std::to_string(dv) + " on " + sm +
                        " are not supported by the chunk kernel"};
      lp.steps.push_back(decide(Step::DeltaRule, i, pol.delta_rule, dr, "chunk_gated_delta_rule",
                                sm + ", dk=" + std::to_string(dk) + " dv=" + std::to_string(dv) + ", " +
                                    std::to_string(c.linear_num_key_heads) + "k/" +
                                    std::to_string(c.linear_num_value_heads) + "v heads",
                                "recurrent_gated_delta_rule", "kernels.delta_rule"));
    } else if (gdn) {
      lp.steps.push_back(decide(Step::ConvUpdate, i, pol.conv,
                                {cuda::causal_conv1d_update_fast_supported(C, K),
                                 "the vectorized conv update needs channels % 8 == 0 and kernel size 1..4 (C=" +
                                     std::to_string(C) + ", K=" + std::to_string(K) + ")"},
                                "causal_conv1d_update_fast",
                                std::string(cuda::causal_conv1d_update_kernel_name(C, K)) + ", C=" + std::to_string(C) +
                                    " (q|k|v), K=" + std::to_string(K),
                                "causal_conv1d_update_fallback", "kernels.conv"));
      lp.steps.push_back(decide(Step::DeltaRulePool, i, pol.delta_rule,
                                {cuda::gated_delta_rule_pool_fast_supported(dk, dv, sm_major),
                                 "head dims dk=" + std::to_string(dk) + " dv=" + std::to_string(dv) + " on " + sm +
                                     " are not supported by the state-pool kernel"},
                                "gated_delta_rule_pool_fast",
                                std::string(cuda::gated_delta_rule_pool_kernel_name(dk, dv, sm_major)) + ", " + sm +
                                    ", dk=" + std::to_string(dk) + " dv=" + std::to_string(dv),
                                "gated_delta_rule_pool_fallback", "kernels.delta_rule"));
    } else if (!decode) {
      Capability at{cuda::flash_attention_supported(d, sm_major),
                    "head dim " + std::to_string(d) + " on " + sm + " is not supported by the flash kernel"};
      // Which of the flash kernels runs (wgmma on sm_90 for d 128 / 256, else mma.sync).
      const std::string flash_kernel = sm_major == 9 && device.index < cuda_device_count()
                                           ? cuda::flash_attention_kernel_name(d, device.index)
                                           : "mma.sync";
      lp.steps.push_back(decide(Step::Attention, i, pol.attention, at, "flash_attention_fwd",
                                sm + ", head dim " + std::to_string(d) + ", " + gqa + ", " + flash_kernel,
                                "attention_fallback", "kernels.attention"));
    } else {
      lp.steps.push_back(decide(Step::AttentionDecode, i, pol.attention,
                                {cuda::attention_decode_fast_supported(d, sm_major),
                                 "head dim " + std::to_string(d) + " on " + sm + " is not supported by flash-decoding"},
                                "attention_decode_fast",
                                std::string(cuda::attention_decode_kernel_name(d, sm_major)) + ", head dim " +
                                    std::to_string(d) + ", " + gqa,
                                "attention_decode_fallback", "kernels.attention"));
    }
    if (fp8)
      lp.steps.push_back(decide(Step::Gemm, i, KernelPolicy::Auto,
                                {fp8_gemm_supported(sm_major),
                                 "block-scaled FP8 GEMMs run on sm_90 only (" + sm + "); the weights are dequantized to bf16"},
                                "gemm_fp8", std::string(cuda::gemm_fp8_kernel_name()) + ": " + projections(gdn, c),
                                "gemm_bf16 (dequantized)", "model.target.precision"));
    else if (!unaligned.empty())
      lp.steps.push_back({Step::Gemm, Path::Fallback, kGemmUnalignedKernel,
                          "fallback: " + unaligned + " not multiples of 8, so cuBLASLt runs its kernels for unaligned "
                          "bf16 operands (slower than the 16-byte aligned ones): " + projections(gdn, c)});
    else
      lp.steps.push_back({Step::Gemm, Path::Fast, "gemm_bf16", "fast: cuBLASLt bf16, fp32 accumulation: " + projections(gdn, c)});
#else
    (void)sm_major;
    DFLASH_FAIL_HINT("a plan for " << device.str() << " needs the CUDA backend, which this build does not have",
                     "reconfigure with -DDFLASH_CUDA=ON on a machine with nvcc");
#endif
    plan.layers.push_back(std::move(lp));
  }
  if (pol.require_fast_path && !device.is_cpu()) plan.require_all_fast();
  return plan;
}

}  // namespace

FastPathPlan make_plan(const TargetConfig& c, Device device, const KernelPolicies& pol, int sm_major, Precision precision) {
  return build_plan(c, device, pol, sm_major, false, precision);
}

FastPathPlan make_decode_plan(const TargetConfig& c, Device device, const KernelPolicies& pol, int sm_major,
                              Precision precision) {
  FastPathPlan plan = build_plan(c, device, pol, sm_major, true, precision);
  plan.cuda_graphs = device.is_cuda() && pol.cuda_graphs && !plan.moe_fallback;  // the fallback syncs
#if DFLASH_WITH_CUDA
  // The fused decode kernels (issue 30): sm_90 (thread-block clusters, programmatic dependent
  // launch), bf16 GEMMs on 16-byte aligned sizes; the GatedDeltaNet ones with the fast conv update
  // and delta rule of every layer (their policies) at the shapes the fused kernels take. The skinny
  // GEMM (and with it SwiGLU in down_proj) stays off for dense targets: on an H200 it streamed the 27B
  // decode weights at 2.6-3.9 TB/s against cuBLASLt's 3.6-4.1 in CUDA graphs
  // (bench/results/h200-decode4-*). MoE targets (no dense MLP: their projections are the attention's
  // and GatedDeltaNet's, 16-50 MB at hidden 2048) take it: alone it is no faster than cuBLASLt there
  // (kernel_bench --only decode_gemm), but in the step it issues its weight loads before the PDL wait,
  // under the previous kernel (cuBLASLt's kernels cannot): the 35B-A3B decode step 4.02 / 4.03 / 4.06
  // ms against 4.20 / 4.22 on an H100 (bench/results/h100-moe8-f28f635 and -7ba8105), 3.87 / 3.89
  // against 4.02 / 4.05 with the plan's default (h100-moe8-8b89610). dflash_eval
  // --decode-variants no_skinny measures it off. FP8 targets take the GatedDeltaNet chain (writing
  // out_proj's quantized input) and the fused commit too (the states are the same bf16 / fp32 ones);
  // the skinny GEMM is bf16's (their FP8 projections have gemm_stream.cu, project()'s own choice).
  // FP8 targets run the GatedDeltaNet in_proj's bf16 b|a GEMM (gemm_skinny) on a side stream beside the FP8
  // qkv|z GEMM (DecodeFusion::fp8_side_gemms): the 27B fp8 decode step 13.61 against 13.77 ms, verify 13.97
  // against 14.14 (five alternated pairs on two H100s, bench/results/h100-sidegemm-0c25100).
  if (device.is_cuda() && sm_major >= 9 && (precision == Precision::Bf16 || precision == Precision::Fp8) &&
      unaligned_gemm_sizes(c).empty()) {
    bool gdn_fast = true;
    for (const LayerPlan& l : plan.layers)
      if (l.type == LayerType::LinearAttention)
        gdn_fast = gdn_fast && l.step(Step::ConvUpdate).path == Path::Fast && l.step(Step::DeltaRulePool).path == Path::Fast;
    const bool fused = gdn_fast && cuda::gdn_decode_fused_supported(c.linear_num_key_heads, c.linear_num_value_heads,
                                                                    c.linear_key_head_dim, c.linear_value_head_dim,
                                                                    c.linear_conv_kernel_dim);
    plan.fusion.skinny_gemm = c.is_moe() && precision == Precision::Bf16;
    plan.fusion.fp8_side_gemms = precision == Precision::Fp8;
    plan.fusion.gdn_chain = fused;
    plan.fusion.commit = fused;
    plan.fusion.commit_overlap = fused;
  }
#endif
  return plan;
}

std::string FastPathPlan::DecodeFusion::str() const {
  std::string s;
  auto add = [&](bool on, const std::string& what) {
    if (on) s += (s.empty() ? "" : ", ") + what;
  };
  add(skinny_gemm, skinny_streamk ? "skinny GEMMs (stream-K)" : "skinny GEMMs");
  add(swiglu_gemm, "SwiGLU in down_proj");
  add(gdn_chain, gdn_chain_max_seqs == std::numeric_limits<int64_t>::max()
                     ? std::string("fused GatedDeltaNet chain")
                     : "fused GatedDeltaNet chain (steps of <= " + std::to_string(gdn_chain_max_seqs) + " sequences)");
  add(commit, commit_overlap ? "fused commit (side stream)" : "fused commit");
  add(moe_decode, "MoE decode kernels (steps of <= 16 rows)");
  add(moe_wgmma, "MoE expert GEMMs on wgmma");
  add(prefetch, "weights prefetched into L2");
  add(fp8_packed, "packed FP8 decode weights");
  add(fp8_side_gemms, "bf16 GEMM parts beside the FP8 ones (side stream)");
  return s;
}

bool fp8_gemm_supported(int sm_major) { return sm_major == 9; }

namespace {

// The projections' input sizes (elements; this rank's share), each with the config.json fields
// that make it. Attention / GatedDeltaNet sizes only when the model has such layers.
std::vector<std::pair<std::string, int64_t>> projection_sizes(const TargetConfig& c) {
  std::vector<std::pair<std::string, int64_t>> out = {{"hidden_size", c.hidden_size},
                                                      {"intermediate_size", c.intermediate_size}};
  if (c.count_layers(LayerType::FullAttention) > 0)
    out.emplace_back("num_attention_heads x head_dim = " + std::to_string(c.num_attention_heads) + " x " +
                         std::to_string(c.head_dim),
                     c.num_attention_heads * c.head_dim);
  if (c.count_layers(LayerType::LinearAttention) > 0)
    out.emplace_back("linear_num_value_heads x linear_value_head_dim = " + std::to_string(c.linear_num_value_heads) +
                         " x " + std::to_string(c.linear_value_head_dim),
                     c.gdn_value_dim());
  return out;
}

std::string sizes_not_multiple_of(const TargetConfig& c, int64_t m) {
  std::string out;
  for (const auto& [what, n] : projection_sizes(c))
    if (n % m != 0) out += (out.empty() ? "" : ", ") + what + (what.find('=') == std::string::npos ? "=" : " = ") + std::to_string(n);
  return out;
}

}  // namespace

std::string unaligned_gemm_sizes(const TargetConfig& c) { return sizes_not_multiple_of(c, 8); }

void check_gpu_sizes(const TargetConfig& c, Precision precision) {
  // The fused q/k norm + RoPE kernel (kernels/cuda/rope.cu, qk_norm_rope): its inverse-frequency table
  // holds at most 256 rotary dims, and its shared memory (rotary_dim + 4 warps x head_dim floats)
  // fits 48 KiB. Every other attention kernel takes any head_dim (the fallbacks up to 4096).
  if (c.count_layers(LayerType::FullAttention) > 0) {
    DFLASH_CHECK_HINT(c.rotary_dim() <= 256,
                      c.source << ": head_dim " << c.head_dim << " x partial_rotary_factor " << c.partial_rotary_factor
                               << " = " << c.rotary_dim()
                               << " rotary dims; the GPU's q/k norm + RoPE kernel takes at most 256",
                      "run this model on the CPU reference (--device cpu); no Qwen3.5 / 3.6 model has more than 64");
    DFLASH_CHECK_HINT((c.rotary_dim() + 4 * c.head_dim) * 4 <= 48 * 1024,
                      c.source << ": head_dim " << c.head_dim
                               << " is too large for the GPU's q/k norm + RoPE kernel (at most 3008 with 256 rotary dims)",
                      "run this model on the CPU reference (--device cpu)");
  }
  if (precision != Precision::Fp8) return;  // bf16: every size runs (the gemm step may be the fallback)
  const std::string bad = sizes_not_multiple_of(c, 16);
  DFLASH_CHECK_HINT(bad.empty(),
                    c.source << ": the FP8 target on the GPU needs every projection's input size a multiple of 16 "
                             << "(the block-scaled e4m3 GEMM's rows must stay 16-byte aligned), but " << bad
                             << (c.source.empty() ? "" : " in config.json") << " is not",
                    "run this model in bf16 (model.target.precision: bf16, or --precision bf16), which takes every size");
}

int64_t FastPathPlan::count(LayerType t, bool fast_only) const {
  int64_t n = 0;
  for (const LayerPlan& l : layers)
    if (l.type == t && (!fast_only || l.all_fast())) ++n;
  return n;
}

std::string FastPathPlan::summary() const {
  std::ostringstream o;
  const int64_t gdn = count(LayerType::LinearAttention, false), attn = count(LayerType::FullAttention, false);
  std::string fp8;
  if (!layers.empty())
    for (const StepPlan& s : layers[0].steps)
      if (s.step == Step::Gemm && s.kernel.find("fp8") != std::string::npos) fp8 = ", fp8 GEMMs";
  if (!layers.empty() && !layers[0].steps.empty() && layers[0].steps[0].path == Path::Cpu) {
    o << gdn << " GatedDeltaNet + " << attn << " attention layers on the CPU reference (" << device << ")" << fp8;
    if (!moe.empty()) o << ", " << moe;
    return o.str();
  }
  o << count(LayerType::LinearAttention, true) << "/" << gdn << " GatedDeltaNet layers on the fast path, "
    << count(LayerType::FullAttention, true) << "/" << attn << " attention layers on the fast path" << fp8;
  if (!moe_kernel.empty()) o << ", " << layers.size() << " MoE blocks on " << moe_kernel;
  if (cuda_graphs) o << ", decode / verify steps as CUDA graphs";
  if (fusion.any()) o << ", fused decode kernels (" << fusion.str() << ")";
  return o.str();
}

std::vector<std::string> FastPathPlan::fallbacks() const {
  std::vector<std::string> out;
  for (const LayerPlan& l : layers)
    for (const StepPlan& s : l.steps)
      if (s.path == Path::Fallback)
        out.push_back("layer " + std::to_string(l.layer) + " (" + layer_type_name(l.type) + ") " + step_name(s.step) +
                      ": " + s.kernel + " — " + s.reason);
  if (moe_fallback) out.push_back("MoE blocks: " + moe_kernel + " — " + moe);
  return out;
}

std::string FastPathPlan::table() const {
  std::ostringstream o;
  char line[512];
  std::snprintf(line, sizeof line, "%-5s %-16s %-10s %-8s %-28s %s\n", "layer", "type", "step", "path", "kernel", "reason");
  o << line;
  for (const LayerPlan& l : layers)
    for (const StepPlan& s : l.steps) {
      std::snprintf(line, sizeof line, "%-5lld %-16s %-10s %-8s %-28s %s\n", static_cast<long long>(l.layer),
                    layer_type_name(l.type), step_name(s.step), path_name(s.path), s.kernel.c_str(), s.reason.c_str());
      o << line;
    }
  return o.str();
}

nlohmann::json FastPathPlan::to_json() const {
  nlohmann::json j;
  j["device"] = device;
  if (!moe.empty()) j["moe"] = moe;
  if (!moe_kernel.empty()) j["moe_kernel"] = moe_kernel;
  j["summary"] = summary();
  j["fallbacks"] = fallbacks();
  j["cuda_graphs"] = cuda_graphs;
  j["decode_fusion"] = {{"skinny_gemm", fusion.skinny_gemm},
                        {"skinny_streamk", fusion.skinny_streamk},
                        {"swiglu_gemm", fusion.swiglu_gemm},
                        {"gdn_chain", fusion.gdn_chain},
                        {"gdn_chain_max_seqs", fusion.gdn_chain_max_seqs},
                        {"commit", fusion.commit},
                        {"commit_overlap", fusion.commit_overlap},
                        {"moe_decode", fusion.moe_decode},
                        {"moe_wgmma", fusion.moe_wgmma}};
  for (const LayerPlan& l : layers) {
    nlohmann::json lj{{"layer", l.layer}, {"type", layer_type_name(l.type)}, {"all_fast", l.all_fast()}};
    for (const StepPlan& s : l.steps)
      lj["steps"].push_back({{"step", step_name(s.step)}, {"path", path_name(s.path)}, {"kernel", s.kernel},
                             {"reason", s.reason}});
    j["layers"].push_back(lj);
  }
  return j;
}

void FastPathPlan::require_all_fast() const {
  std::vector<std::string> fb = fallbacks();
  if (fb.empty()) return;
  std::ostringstream o;
  o << "require_fast_path is set, but " << fb.size() << " step(s) would run a fallback kernel on " << device << ":";
  for (const std::string& f : fb) o << "\n  " << f;
  DFLASH_FAIL_HINT(o.str(), "fix the cause named above, or set kernels.require_fast_path: false to accept the fallback");
}

void PathCounters::reset() {
  for (auto& c : counts_) c.store(0, std::memory_order_relaxed);
}

nlohmann::json PathCounters::to_json() const {
  nlohmann::json j;
  for (Step s : kAllSteps) {
    bool used = false;
    for (Path p : {Path::Fast, Path::Fallback, Path::Cpu}) used = used || get(s, p);
    if (!used && static_cast<int>(s) >= static_cast<int>(Step::ConvUpdate)) continue;  // decode steps only when they ran
    for (Path p : {Path::Fast, Path::Fallback, Path::Cpu}) j[step_name(s)][path_name(p)] = get(s, p);
  }
  return j;
}

std::string PathCounters::str() const {
  std::ostringstream o;
  bool first = true;
  for (Step s : kAllSteps) {
    const bool used = get(s, Path::Fast) || get(s, Path::Fallback) || get(s, Path::Cpu);
    if (!used && static_cast<int>(s) >= static_cast<int>(Step::ConvUpdate)) continue;  // decode steps only when they ran
    o << (first ? "" : ", ") << step_name(s) << " fast " << get(s, Path::Fast) << " fallback " << get(s, Path::Fallback);
    if (get(s, Path::Cpu)) o << " cpu " << get(s, Path::Cpu);
    first = false;
  }
  return o.str();
}

std::vector<std::string> PathCounters::mismatches(const FastPathPlan& plan, uint64_t forwards) const {
  std::array<uint64_t, kNumSteps * 3> want{};
  for (const LayerPlan& l : plan.layers)
    for (const StepPlan& s : l.steps) want[idx(s.step, s.path)] += forwards;
  std::vector<std::string> out;
  for (Step s : kAllSteps)
    for (Path p : {Path::Fast, Path::Fallback, Path::Cpu})
      if (get(s, p) != want[idx(s, p)])
        out.push_back(std::string(step_name(s)) + " " + path_name(p) + ": planned " + std::to_string(want[idx(s, p)]) +
                      ", ran " + std::to_string(get(s, p)));
  return out;
}

}  // namespace dflash::target
