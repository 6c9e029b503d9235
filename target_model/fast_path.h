#pragma once
// The fast-path plan: for every layer of the target, which kernel runs each step and why.
// The plan is printed at start-up, written as JSON, compared with run-time counters of what
// actually ran, and `require_fast_path` refuses to start when any layer would fall back.
// A silent fallback is a bug: every fallback here carries its reason.
#include <nlohmann/json.hpp>

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "target_model/config.h"

namespace dflash::target {

enum class KernelPolicy { Auto, Fast, Fallback };
const char* policy_name(KernelPolicy p);
KernelPolicy parse_policy(const std::string& s, const std::string& what);  // "auto|fast|fallback"

// Per-op policies (config section `kernels`). require_fast_path is enforced in one place, by
// make_plan / make_decode_plan (a plan with a fallback step is refused there).
struct KernelPolicies {
  KernelPolicy conv = KernelPolicy::Auto;        // GatedDeltaNet short conv
  KernelPolicy delta_rule = KernelPolicy::Auto;  // GatedDeltaNet core
  KernelPolicy attention = KernelPolicy::Auto;   // full-attention layers
  bool require_fast_path = false;
  // Decode plans on a GPU: decode / verify steps (T >= 1 on slots with a past) run as CUDA graphs
  // captured per shape and replayed (decode_cuda.cpp); false: eager launches (--no-cuda-graphs).
  bool cuda_graphs = true;
  // MoE targets on a GPU: the routed experts through the grouped GEMM (fast, moe_grouped_mma) or a
  // loop over experts of gemm_bf16 (fallback, moe_loop_gemm_bf16; eager launches only).
  KernelPolicy moe = KernelPolicy::Auto;
  // Every op on policy p (e.g. all(KernelPolicy::Fallback): the explicit slow path to compare with).
  static KernelPolicies all(KernelPolicy p, bool require_fast = false) {
    KernelPolicies k{p, p, p, require_fast};
    k.moe = p;
    return k;
  }
};

// The forward's steps, and the decode / verify steps of target::Decoder (decode.h), which run the
// same layers on slot states: their own plan (make_decode_plan) and counters.
// Gemm: the layer's projections (in both plans; its kernel names the precision), counted once per
// layer and forward.
enum class Step { Conv = 0, DeltaRule = 1, Attention = 2, ConvUpdate = 3, DeltaRulePool = 4, AttentionDecode = 5, Gemm = 6 };
inline constexpr int kNumSteps = 7;
inline constexpr Step kAllSteps[kNumSteps] = {Step::Conv,          Step::DeltaRule,       Step::Attention, Step::ConvUpdate,
                                              Step::DeltaRulePool, Step::AttentionDecode, Step::Gemm};
const char* step_name(Step s);

enum class Path { Fast, Fallback, Cpu };
const char* path_name(Path p);

struct StepPlan {
  Step step;
  Path path;
  std::string kernel;  // e.g. "causal_conv1d_fast"
  std::string reason;  // e.g. "fast: sm_90, C=10240 (q|k|v fused), K=4"
};

struct LayerPlan {
  int64_t layer = 0;
  LayerType type = LayerType::LinearAttention;
  std::vector<StepPlan> steps;
  bool all_fast() const;
  const StepPlan& step(Step s) const;
};

struct FastPathPlan {
  std::string device;  // "cuda:0 (NVIDIA H200, sm_90)" or "cpu"
  std::string moe;     // MoE targets: "40 MoE blocks (256 experts, top 8) on the CPU reference"; "" if dense
  // MoE targets on a GPU: the routed experts' kernel (cuda::moe_impl_name: "moe_grouped_mma" or the
  // fallback "moe_loop_gemm_bf16") and whether it is the fallback; "" / false otherwise.
  std::string moe_kernel;
  bool moe_fallback = false;
  std::vector<LayerPlan> layers;
  // Decode plans on CUDA (KernelPolicies::cuda_graphs): the decoder captures each decode / verify
  // step shape once and replays it; summary() says which.
  bool cuda_graphs = false;
  // Decode plans on CUDA (issue 30): the fused decode kernels that run (make_decode_plan turns the
  // GatedDeltaNet ones on with the fast path on sm_90 for bf16 and fp8 targets; a fallback policy keeps the
  // unfused kernels, which are also each fused kernel's reference; the skinny GEMM is measured slower
  // than cuBLASLt and stays off unless a caller sets it); summary() names them.
  static constexpr int64_t kGdnChainMaxSeqs = 4;
  struct DecodeFusion {
    // decode / verify GEMMs of <= 16 rows on the skinny kernels: bf16 on cuda::gemm_skinny where its
    // grid fits one wave (else cuBLASLt), FP8 on cuda::gemm_fp8_stream
    bool skinny_gemm = false;
    // with skinny_gemm: bf16 GEMMs on the stream-K kernel (cuda::gemm_bf16_stream) where it applies (no
    // SwiGLU prologue, K % 128 == 0); off in the plan until measured (--decode-variant skinny_streamk)
    bool skinny_streamk = false;
    bool swiglu_gemm = false;  // SwiGLU as down_proj's prologue (gemm_skinny's swiglu), where skinny_gemm runs down_proj
    bool gdn_chain = false;    // conv update + gates + l2norm + delta rule + gated RMSNorm: one kernel per layer (gdn_decode_fused)
    // ... in steps of at most this many sequences; larger steps run the unfused kernels. One block per
    // (value head, sequence) holding its 64 KB state in registers hides latency worse than the pool
    // kernel's grid once the grid is many waves. On an H200 (27B shapes, 512-token prompts; decode step,
    // fused vs unfused): 1 / 2 / 4 sequences 14.65 / 14.78 / 15.25 vs 14.92 / 15.09 / 15.40 ms, 8 16.06 vs
    // 15.89, 32 19.75 vs 18.32, 64 25.49 vs 22.05, 128 36.28 vs 29.58 (bench/results/h200-s20-37f530d
    // genbench_sweep.csv, h200-genab-627ea7a).
    int64_t gdn_chain_max_seqs = kGdnChainMaxSeqs;
    bool commit = false;       // commit: every layer's conv update + delta rule re-run in one kernel (gdn_commit_fused)
    // A replayed fused commit runs on a side stream, so the drafter's context update (the next work
    // on the decoder's stream) overlaps it; the decoder's next step waits for it.
    bool commit_overlap = false;
    // MoE targets: decode / verify steps of <= cuda::kMoeDecodeMaxRows rows run the MoE block as three
    // kernels streaming each weight row once (cuda::MoeImpl::Decode, "moe_decode_gemv") instead of
    // the grouped path's eleven launches. Off in the plan: measured slower in a 35B-A3B decode
    // (h200-moe6-c4bc6aa: 5.35 vs 4.95 ms); dflash_eval / generate_bench --decode-variant moe_decode.
    bool moe_decode = false;
    // MoE targets: the grouped path's expert GEMMs of decode / verify steps on the wgmma kernel
    // (cuda::moe_grouped_gemm_wgmma, sm_90) instead of mma.sync's narrow tiles (--decode-variant moe_wgmma).
    bool moe_wgmma = false;
    // After each decode / verify GEMM the next GEMM's first weight bytes are fetched into L2 on a side
    // stream (cuda::prefetch_l2, tuning::decode_prefetch_mb MiB each), so they travel while the short
    // ops between the two run. Off in the plan: on H100s the 27B bf16 decode step gained 2.1-2.3% at
    // 8-12 MiB on one machine and nothing at 16 MiB on another, fp8 lost 0.7% (bench/results/
    // h100-prefetch-dea16b8, h100-l2prefetch-7e34c98); --decode-variant prefetch.
    bool prefetch = false;
    // With skinny_gemm on an FP8 target: the streaming kernel reads decode copies of the FP8 projections
    // in its packed unit layout (cuda::pack_stream_weight, made when a decoder with it is built: the
    // projections' bytes once more), whose loads are contiguous 2 KB runs. The same bits as the
    // row-major weights; --decode-variant packed (skinny + packed), no_packed. Off in the plan: it makes the
    // streaming kernel 6-11% faster, still slower than cuBLASLt (27B fp8 decode on an H100: 16.56 ms against
    // 13.75, bench/results/h100-packed-effd9fd).
    bool fp8_packed = false;
    // FP8 targets: a decode / verify step's bf16 GEMMs beside FP8 ones in one projection (the GatedDeltaNet
    // in_proj's b|a, 96 rows the checkpoints keep in bf16: one ~10 us GEMM a layer after the FP8 one,
    // 0.51 ms of an H100's 14.8-ms 27B fp8 decode step, bench/results/h100-bulkring-384ebce) run on
    // cuda::gemm_skinny on a side stream while the FP8 GEMM runs (on in the plan: -1.1% on the step,
    // bench/results/h100-sidegemm-0c25100); --decode-variant no_side_gemms.
    bool fp8_side_gemms = false;
    bool any() const {
      return skinny_gemm || swiglu_gemm || gdn_chain || commit || moe_decode || moe_wgmma || prefetch || fp8_packed ||
             fp8_side_gemms;
    }
    // "skinny GEMMs, SwiGLU in down_proj, fused GatedDeltaNet chain, fused commit, MoE decode kernels, weights
    // prefetched into L2" ("" if none)
    std::string str() const;
  };
  DecodeFusion fusion;

  int64_t count(LayerType t, bool fast_only) const;
  // "48/48 GatedDeltaNet layers on the fast path, 16/16 attention layers on the fast path" (+ ", fp8
  // GEMMs" when the gemm steps run FP8)
  std::string summary() const;
  // One line per layer that does not run entirely on the fast path, with the reasons.
  std::vector<std::string> fallbacks() const;
  std::string table() const;  // human-readable per-layer table
  nlohmann::json to_json() const;
  // Throws listing every layer that would fall back and why (require_fast_path).
  void require_all_fast() const;
};

// Builds the plan. For a CUDA device, `sm_major` is the compute capability's major version (the
// caller reads it from the device; tests may pass any value). Policy `fast` on a layer the fast
// kernel cannot serve is an error naming the layer and the reason.
// `precision` (resolved, not auto) picks the gemm step: bf16 through cuBLASLt, or the block-scaled
// FP8 GEMM, which needs sm_90 (elsewhere: a reported fallback, the weights dequantized to bf16).
FastPathPlan make_plan(const TargetConfig& c, Device device, const KernelPolicies& policies, int sm_major,
                       Precision precision = Precision::Bf16);
// The plan of incremental decoding: per GatedDeltaNet layer the conv update and the delta rule on
// the state pool, per attention layer attention over the KV cache (the forward's policies apply:
// kernels.conv covers the conv update, and so on; a prompt into an empty slot runs the forward's
// kernels of make_plan).
FastPathPlan make_decode_plan(const TargetConfig& c, Device device, const KernelPolicies& policies, int sm_major,
                              Precision precision = Precision::Bf16);
// Whether the block-scaled FP8 GEMM runs on compute capability sm_major (cuBLASLt's VEC128 /
// BLK128x128 scale modes: Hopper).
bool fp8_gemm_supported(int sm_major);

// ---- Model sizes the GPU kernels constrain (issue 26) ------------------------------------------
// The projections' GEMMs take hidden_size, intermediate_size, num_attention_heads x head_dim and
// linear_num_value_heads x linear_value_head_dim (this rank's share under tp) as K and as row
// strides. The fast cuBLASLt kernels need each a multiple of 8 (16-byte rows of bf16); a model with
// another size runs the gemm step's fallback, kGemmUnalignedKernel (cuBLASLt told the operands'
// real alignment), named in the plan with the fields that need it. Every other GPU kernel of the
// forward and of decoding serves any size (vectorized bodies where rows are aligned, scalar ones
// elsewhere; the vocabulary's logits rows are padded to a multiple of 8 on the device).
inline constexpr const char* kGemmUnalignedKernel = "gemm_bf16_unaligned";
// "" when every size above is a multiple of 8, else the fields that are not, e.g.
// "intermediate_size=1001, num_attention_heads x head_dim=4x36=144 ..." (each named once).
std::string unaligned_gemm_sizes(const TargetConfig& c);
// Throws, naming each config.json field that breaks it and what to do, when the GPU cannot run
// this model at `precision` (resolved): the fused q/k norm + RoPE kernel takes at most 256 rotary
// dims (head_dim x partial_rotary_factor) and head_dim up to 3008; the block-scaled FP8 GEMM needs
// each projection input size a multiple of 16 (its e4m3 rows must stay 16-byte aligned).
// make_plan / make_decode_plan call it for a CUDA device, so a model is refused at start-up,
// before any weight is read.
void check_gpu_sizes(const TargetConfig& c, Precision precision);

// Kernel invocations per (step, path) since the last reset, counted at launch time.
class PathCounters {
 public:
  void add(Step s, Path p, uint64_t n = 1) { counts_[idx(s, p)].fetch_add(n, std::memory_order_relaxed); }
  void add(const PathCounters& o) {  // every count of o (a CUDA graph's launches, once per replay)
    for (size_t i = 0; i < counts_.size(); ++i) counts_[i].fetch_add(o.counts_[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
  uint64_t get(Step s, Path p) const { return counts_[idx(s, p)].load(std::memory_order_relaxed); }
  void reset();
  nlohmann::json to_json() const;
  std::string str() const;  // "conv fast 48 fallback 0, delta_rule fast 48 fallback 0, attention fast 16 fallback 0"
  // What one forward of `plan` launches: compares with the counters, listing the differences.
  std::vector<std::string> mismatches(const FastPathPlan& plan, uint64_t forwards) const;

 private:
  static size_t idx(Step s, Path p) { return static_cast<size_t>(s) * 3 + static_cast<size_t>(p); }
  std::array<std::atomic<uint64_t>, kNumSteps * 3> counts_{};
};

}  // namespace dflash::target
