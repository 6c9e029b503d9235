#pragma once
// The target forward on one GPU: bf16 weights and activations, fp32 accumulation, fp32
// GatedDeltaNet state, kernels chosen per layer by the fast-path plan and counted as they launch.
// (Built only with the CUDA backend; tensor parallelism comes with comm/.)
#include <array>
#include <compare>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/cuda/gdn.h"
#include "kernels/cuda/gemm.h"
#include "target_model/fast_path.h"
#include "target_model/model.h"

namespace dflash::target {

// A packed batch on the device: ids, per-token positions and sequence boundaries.
struct CudaBatch {
  std::vector<int64_t> offsets;  // host copy
  int64_t num_tokens = 0, num_seqs = 0, max_seqlen = 0;
  Tensor ids, pos, cu_seqlens;   // int32 on the device: [N], [N], [S + 1]
};

// ---- Per-op profile of the forward (target_bench --profile) --------------------------------------
// What the forward enqueues, one category per op; the GEMMs by role. Host-only (the CPU build
// aggregates profiles in its tests).
enum class ForwardOp : uint8_t {
  Embedding, InputNorm,                                           // once per forward (run_layer: per call)
  GdnInProj, GdnConv, GdnPrep, DeltaRule, GatedRmsNorm, GdnOutProj,  // GatedDeltaNet mixer
  AttnQkv, QkNormRope, Attention, SigmoidGate, AttnOProj,            // gated attention mixer
  AddRmsNorm, MlpGateUp, Swiglu, MlpDown,                          // residual steps and MLP
  AllReduce, CaptureCopy,                                          // tp > 1; ForwardOptions::capture
  Fp8Quant,                                                        // precision fp8: a GEMM input quantized
  MoeBlock,                                                        // MoE targets: the whole sparse MoE block
  GdnFused,                                                        // decode: the fused GatedDeltaNet chain (conv .. gated norm)
  LmHead, NextToken,                                               // decode / verify steps (decode_cuda.cpp): logits, argmax / sampling
  kCount
};
inline constexpr int kNumForwardOps = static_cast<int>(ForwardOp::kCount);
inline constexpr std::array<std::string_view, kNumForwardOps> kForwardOpNames = {
    "embedding",   "input_norm",   "gdn_in_proj",  "gdn_conv",   "gdn_prep",     "delta_rule",  "gated_rms_norm",
    "gdn_out_proj", "attn_qkv",    "qk_norm_rope", "attention",  "sigmoid_gate", "attn_o_proj",
    "add_rms_norm", "mlp_gate_up", "swiglu",       "mlp_down",   "all_reduce",   "capture_copy", "fp8_quant",
    "moe_block",   "gdn_fused",    "lm_head",      "next_token"};
inline std::string_view forward_op_name(ForwardOp op) { return kForwardOpNames[static_cast<size_t>(op)]; }
inline bool forward_op_is_gemm(ForwardOp op) {
  return op == ForwardOp::GdnInProj || op == ForwardOp::GdnOutProj || op == ForwardOp::AttnQkv ||
         op == ForwardOp::AttnOProj || op == ForwardOp::MlpGateUp || op == ForwardOp::MlpDown || op == ForwardOp::LmHead;
}

// A GEMM as the forward runs it (cuda::gemm_bf16): y[M, N] (row stride ldy) = x[M, K] (row stride
// ldx) · w[N, K]ᵀ, w contiguous. All zero for the other ops.
struct GemmShape {
  int64_t M = 0, N = 0, K = 0, ldx = 0, ldy = 0;
  bool fp8 = false;  // cuda::gemm_fp8 on e4m3 codes (then ldx is the codes' row stride, K)
  auto operator<=>(const GemmShape&) const = default;
  double flops() const { return 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K); }
};

struct OpRecord {
  ForwardOp op = ForwardOp::Embedding;
  GemmShape gemm;
  double ms = 0;  // GPU time between the op's two events
};

// One profiled forward: its ops in enqueue order and the time from the first op's start to the
// last op's end (span - sum of ops = time between ops: event overhead, launch gaps).
struct OpProfile {
  std::vector<OpRecord> ops;
  double span_ms = 0;
};

// Brackets each op with two CUDA events recorded on the model's stream. The events come from a pool
// that grows during the first profiled forward and is reused afterwards (that forward is the one to
// discard); nothing synchronizes until collect().
class OpProfiler {
 public:
  OpProfiler() = default;
  ~OpProfiler();
  OpProfiler(const OpProfiler&) = delete;
  OpProfiler& operator=(const OpProfiler&) = delete;

  // Around one op enqueued on `stream` (ops do not nest): begin returns the slot end closes.
  size_t begin(ForwardOp op, void* stream, const GemmShape& gemm = {});
  void end(size_t slot, void* stream);
  // Waits for the last op and returns what was recorded since the previous collect(); the events
  // are kept for the next forward.
  OpProfile collect();

 private:
  std::vector<void*> events_;  // cudaEvent_t; 2 per op slot: [2i] before op i, [2i + 1] after it
  std::vector<OpRecord> ops_;
  bool open_ = false;          // begin without end yet
};

// What a decode / verify step (target::Decoder on CUDA, decode_cuda.cpp) gives the layers of a
// forward: the slot states and the decode plan's kernels. A plain forward has none.
struct DecodeLayer {
  const LayerPlan* plan = nullptr;  // this layer's steps of the decode plan (make_decode_plan)
  void* conv_state = nullptr;       // GatedDeltaNet: [num_slots, K-1, conv_dim] bf16
  float* gdn_state = nullptr;       //   [num_slots, Hv, dk, dv] fp32
  void* k_cache = nullptr;          // attention: [num_slots, max_len, Hkv, d] bf16
  void* v_cache = nullptr;
  // After a verify (commit = false), the layer's inputs of the conv update and the delta rule that
  // commit re-runs for the accepted tokens: the in-projection output [rows, P], the conv output
  // [rows, conv_dim] (v inside it), prepared q / k, g, beta.
  Tensor proj, conv, q, k, g, beta;
  int64_t proj_ld = 0;
};
// The most tokens of one slot a decode / verify step carries (a verify block; what the fused
// GatedDeltaNet chain serves). A step with more is a chunked prefill's prompt piece (generate.h).
inline constexpr int64_t kMaxVerifyTokens = 16;

struct DecodeStep {
  // Prompts into empty slots (every slot of the extend at length 0, commit = true; any number of
  // slots and prompt lengths): the forward's kernels once over the packed varlen batch (causal conv,
  // chunked delta rule, varlen flash attention), then each slot's states written — the final
  // recurrent state of its sequence, the conv state from its own last min(T, K-1) conv inputs, its
  // K / V. Otherwise the decode kernels on the slot states (T = 1 decode, T > 1 verify).
  bool prefill = false;
  bool commit = true;                 // decode: the states advance (false: verify, the pool is read only)
  std::vector<int32_t> host_slots;    // (host) the slots, batch order: a prefill's state copies
  const int32_t* slots = nullptr;     // device [num_seqs]
  const int32_t* past_len = nullptr;  // device [num_seqs]: committed tokens before this step
  int64_t real_tokens = 0;            // tokens of the sequences (the batch's rows may be padded beyond)
  int64_t num_slots = 0, max_len = 0, max_new = 0;
  void* attn_workspace = nullptr;
  size_t attn_workspace_bytes = 0;
  // Attention over the cache with absolute splits of split_keys keys (batch invariance, see
  // AttentionDecodeParams); key_bound >= every past_len + T.
  int64_t split_keys = 0, key_bound = 0;
  std::vector<DecodeLayer>* layers = nullptr;  // [num_hidden_layers]
  PathCounters* counters = nullptr;            // the decode steps' launches
  FastPathPlan::DecodeFusion fusion;           // the decode plan's fused kernels (decode / verify steps)
  // Chunked prefill inside decode steps (generate.h step_tokens): when sequences [piece_from,
  // num_seqs) are prompt pieces (more than one token each, one of them more than 16) after one-token
  // decode rows, their delta rule runs the chunked prefill kernel from copies of their slots' states
  // (written back after) instead of the pool kernel, which walks a sequence's tokens one by one.
  // -1: none. piece_cu: device [num_seqs - piece_from + 1], rows counted from piece_row0. The pieces'
  // conv runs parallel over tokens (ConvUpdateCall::pieces), and their attention is a call of its own
  // (up to piece_max_new tokens a sequence, splits chosen for speed) after the decode rows' (one token
  // each, the absolute splits): the decode kernels size their grids by the longest sequence.
  int64_t piece_from = -1, piece_row0 = 0, piece_max_new = 0;
  const int32_t* piece_cu = nullptr;
};

// The GatedDeltaNet decode kernels of one layer as the decode plan chose them, counted in
// `counters`; the decode step (CudaTargetModel's mixer) and commit (decode_cuda.cpp) run these.
// The conv update of `rows` tokens of x (rows ldx apart; cu_seqlens over them) on the layer's state.
struct ConvUpdateCall {
  const void* x = nullptr;
  int64_t ldx = 0;
  void* y = nullptr;
  const int32_t* slots = nullptr;
  const int32_t* cu_seqlens = nullptr;
  int64_t num_seqs = 0, rows = 0, num_slots = 0;
  bool update = true;
  // A step with prompt pieces (DecodeStep::piece_from >= 0): the token-parallel kernel on the fast
  // path (causal_conv1d_update_runs), not the vec8 one that walks a sequence's tokens in one thread.
  bool pieces = false;
};
void run_conv_update(const TargetConfig& c, const LayerWeights& L, const DecodeLayer& dl, const ConvUpdateCall& call,
                     PathCounters& counters, void* stream);
// The delta rule on the layer's state pool for the tokens of `p` (q, k, v, g, beta, cu_seqlens, N,
// sizes as for the prefill kernel); out may be null.
void run_delta_rule_pool(const DecodeLayer& dl, const cuda::DeltaRuleParams& p, const int32_t* slots, int64_t num_slots,
                         bool update, PathCounters& counters, void* stream);
// The forward's gated delta rule over p's sequences (from p.initial_state, into p.final_state when
// set): the chunked kernel or its recurrent fallback, as the plan's DeltaRule step `st` says; counted.
void run_delta_rule(const cuda::DeltaRuleParams& p, const StepPlan& st, PathCounters& counters, void* stream);
// A chunked-prefill step's delta rule (DecodeStep::piece_from >= 0, commit): the decode rows on the pool,
// the prompt pieces with the chunked kernel (`chunked` = the forward plan's DeltaRule step) from their slots' states.
void run_delta_rule_pieces(const DecodeLayer& dl, const cuda::DeltaRuleParams& p, const DecodeStep& ds, const StepPlan& chunked,
                           void* stream);

class CudaTargetModel {
 public:
  // `weights` must be bf16 on a CUDA device; the in-projections are fused in place (q|k|v|z|b|a,
  // q|k|v, gate|up) so each mixer and MLP starts with one GEMM. FP8 projections (weights.h: e4m3
  // codes and block scales) run the block-scaled FP8 GEMM when the plan's gemm steps say so (the
  // plan's precision must match the weights'); there the in-projection is one FP8 GEMM over the
  // FP8 parts (q|k|v|z, q|k|v, gate|up, fused when each part before the last has a multiple of 128
  // rows) and one bf16 GEMM over the rest (b|a); a fallback gemm step dequantizes them at start.
  // With `tp`, config / weights / plan are this rank's shard (tp.h) and the output of each mixer
  // and MLP is all-reduced over the group (NCCL).
  CudaTargetModel(TargetConfig config, TargetWeights weights, FastPathPlan plan, comm::Communicator* tp = nullptr);

  const TargetConfig& config() const { return config_; }
  const FastPathPlan& plan() const { return plan_; }
  // Switches kernels (e.g. to time the fallback with the same weights); must match the config.
  void set_plan(FastPathPlan plan);
  PathCounters& counters() { return counters_; }
  Device device() const { return device_; }
  // Per-op timing of every later forward / run_layer (null, the default: off, and each op costs one
  // pointer test). The profiler must outlive its use; collect() after the forward.
  void set_profiler(OpProfiler* profiler) { profiler_ = profiler; }
  // Runs `enqueue` (a step's op outside the forward: the decoder's LM head and next-token choice) on the
  // model's stream, bracketed by the profiler's events when one is set, so a step's profile has every op.
  void profiled(ForwardOp op, const std::function<void()>& enqueue, const GemmShape& gemm = {});
  bool profiling() const { return profiler_ != nullptr; }
  bool tensor_parallel() const { return tp_ != nullptr; }
  // Makes the next forwards a decode step on slot states (null: plain forwards again).
  void set_decode(DecodeStep* step) { decode_ = step; }
  const TargetWeights& weights() const { return weights_; }
  void* stream() const { return stream_; }
  // The L2 prefetches of decode GEMMs' weights enqueued so far (DecodeFusion::prefetch; a captured
  // step's count once, not per replay).
  uint64_t l2_prefetches() const { return prefetches_; }
  // The decode copies of the FP8 projections in the streaming kernel's packed layout
  // (DecodeFusion::fp8_packed; made once, on the model's stream, by the first decoder that asks);
  // returns the bytes they hold (0 on a bf16 target).
  int64_t pack_decode_weights();
  // The decode / verify GEMMs enqueued on a packed copy so far (a captured step's once, not per replay).
  uint64_t packed_gemms() const { return packed_gemms_; }
  // The FP8 decode / verify steps' bf16 GEMMs enqueued on the side lane so far (DecodeFusion::fp8_side_gemms;
  // a captured step's once).
  uint64_t side_gemms() const { return side_gemms_; }
  // The plan's gemm step is kGemmUnalignedKernel (sizes not multiples of 8): every GEMM on this
  // model's activations, the decoder's LM head too, passes cuda::GemmParams::unaligned.
  bool gemm_unaligned() const { return gemm_unaligned_; }

  // Validates the sequences (as TargetModel::forward does) and uploads them.
  CudaBatch make_batch(const std::vector<std::vector<int32_t>>& sequences) const;

  // Captured layers come back as bf16 (N, H) device tensors; final_hidden likewise. MoE targets:
  // ForwardOptions::capture_routing returns each layer's choices, weights and router logits (host,
  // as the CPU reference), router_logits forces a routing (tests; plain forwards, not decode steps).
  ForwardResult forward(const std::vector<std::vector<int32_t>>& sequences, const ForwardOptions& options);
  ForwardResult forward(const CudaBatch& batch, const ForwardOptions& options);

  // One decoder layer in place on h (bf16 (N, H) on the device) with the kernels of `layer_plan`
  // (the model's own plan, or another one to compare paths). Enqueued on the device stream.
  void run_layer(int64_t i, Tensor& h, const CudaBatch& batch, const LayerPlan& layer_plan);

 private:
  // One GEMM of the forward: y[:, col, col + N) = x · wᵀ with w [N, K] bf16, or e4m3 codes with
  // their block scales in the layout cuda::gemm_fp8 reads (rows of cuda::fp8_weight_scale_ld(K)).
  struct Proj {
    Tensor w, scale;  // scale undefined: bf16
    Tensor packed;    // FP8: w in the streaming kernel's packed layout (pack_decode_weights), or undefined
    int64_t col = 0, N = 0, K = 0;
    bool fp8() const { return scale.defined(); }
  };
  struct Fused {
    int64_t rows = 0; // P (a multiple of 8 so every row of the GEMM output stays 16-byte aligned)
    std::vector<Proj> in_parts, gate_up;  // the GEMMs that write proj [N, P] and gu [N, 2I]
    Proj out, down;                       // out_proj / o_proj, down_proj
    Proj shared_gate_up;                  // MoE: the shared expert's [gate | up] rows, fused
  };
  // Quantized GEMM inputs (precision fp8): x [M, K] as e4m3 codes and its per-token group scales.
  struct Fp8Input {
    Tensor q, scale;
  };
  Fp8Input alloc_input(int64_t M, int64_t K);  // [gemm_rows(M), K] codes (pad rows zero) and the scales
  Fp8Input quantize_input(const Tensor& x, int64_t ldx, int64_t M, int64_t K);
  // Rows of a GEMM's output buffer for N tokens: the block-scaled FP8 GEMM runs on M % 4 == 0 only
  // (cuBLASLt), so an FP8 target's GEMMs run on N rounded up to 4, the pad rows' inputs zero and
  // their outputs never read.
  int64_t gemm_rows(int64_t N) const { return fp8_ ? (N + 3) / 4 * 4 : N; }
  // Runs the parts' GEMMs of x (ldx) into y (ldy); FP8 parts read x quantized once.
  // `pre`: x already quantized by a fused producer (swiglu_quant_fp8, gated_rms_norm_quant_fp8).
  void project(ForwardOp op, const Tensor& x, int64_t ldx, const std::vector<Proj>& parts, Tensor& y, int64_t ldy,
               int64_t M, const Fp8Input* pre = nullptr, bool swiglu = false);
  // Whether this is a decode / verify step of M <= 16 rows whose GEMMs the plan puts on the skinny
  // kernels (DecodeFusion::skinny_gemm): bf16 projections on cuda::gemm_skinny, FP8 ones on
  // cuda::gemm_fp8_stream.
  bool skinny_step(int64_t M) const;
  // Whether a decode / verify step's bf16 GEMM of M rows over `p` runs cuda::gemm_skinny (the plan's
  // fusion, M <= 16, its grid one wave); swiglu: with SwiGLU as its prologue.
  bool skinny(const Proj& p, int64_t M, int64_t ldx, int64_t ldy, bool swiglu) const;
  // ... and on the stream-K kernel (the plan's DecodeFusion::skinny_streamk, where it applies).
  bool streamk(const cuda::GemmSkinnyParams& sp) const;
  // gemm_skinny's operands for y (ldy) = x (ldx) · p's weightᵀ over M rows (x, y null for the shape alone).
  static cuda::GemmSkinnyParams skinny_params(const Proj& p, const void* x, int64_t ldx, void* y, int64_t ldy, int64_t M,
                                              bool swiglu);
  // Whether an FP8 decode / verify step runs the bf16 parts of `parts` (a GatedDeltaNet in_proj's b|a)
  // on cuda::gemm_skinny on the side lane, beside the FP8 GEMMs (DecodeFusion::fp8_side_gemms; not while
  // profiling, whose events time ops on stream_ one after another).
  bool side_gemms(const std::vector<Proj>& parts, int64_t M, int64_t ldx, int64_t ldy, bool swiglu) const;
  // One GEMM over the concatenated weights (their slots become views of it), output from column
  // `col`, with extra_rows zero rows after them.
  Proj make_proj(std::vector<Tensor*> weights, std::vector<Tensor*> scales, int64_t col, int64_t extra_rows);
  // Mixer and MLP of layer i on h, from `normed` = input_norm(h) (overwritten as scratch); ends with
  // the residual add fused with `next_norm` into *next_out when next_norm is set.
  // in_q: `normed` already quantized for the mixer's FP8 projections (by the previous layer's residual
  // step); next_q (where given): the residual step quantizes next_out for the next layer's projections
  // too, when they are FP8 (add_norm).
  void layer_body(int64_t i, Tensor& h, Tensor& normed, const CudaBatch& b, const LayerPlan& lp, const Tensor* next_norm,
                  Tensor* next_out, const Fp8Input* in_q = nullptr, Fp8Input* next_q = nullptr);
  // The residual step: h += delta (N rows), then, with w, y = rmsnorm(h) · (1 + w); where `parts` (the
  // projections that read y) take FP8 input and tuning::add_norm_quant is on, fused with their
  // quantization into *q (add_rms_norm_quant_fp8; y then written only where a part is bf16).
  void add_norm(Tensor& h, const Tensor& delta, const Tensor* w, Tensor* y, int64_t N, const std::vector<Proj>* parts,
                Fp8Input* q);
  // x_q (optional): x already quantized for the FP8 input projections.
  void gdn_mixer(int64_t i, const Tensor& x, const CudaBatch& b, const LayerPlan& lp, Tensor& out,
                 const Fp8Input* x_q = nullptr);
  void attention_mixer(int64_t i, const Tensor& x, const CudaBatch& b, const LayerPlan& lp, Tensor& out,
                       const Fp8Input* x_q = nullptr);
  void mlp(int64_t i, const Tensor& x, Tensor& out, const Fp8Input* x_q = nullptr);
  // What a prefill (DecodeStep::prefill) needs beside the batch, built once per forward (one upload)
  // by begin_prefill and dropped at the end of the forward.
  struct Prefill {
    Tensor staging;                    // int32 on the device: gather ids, then tail_cu
    const int32_t* gather_ids = nullptr;  // [gather_rows]: the tails' chunks of the in-projection output
    int64_t gather_rows = 0, chunk = 0;   // rows of `chunk` elements that cuda::embedding gathers
    const int32_t* tail_cu = nullptr;  // [S + 1] over the tails, m_s = min(T_s, K-1)
    int64_t tail_rows = 0;             // sum of m_s
    Tensor tails, tails_y;             // [tail_rows, C] bf16: the gathered conv inputs; the conv update's (unused) output
    int32_t first_slot = 0;            // the pool is written in place when the slots are first_slot, first_slot + 1, ...
    bool in_place = true;
    Tensor state;                      // else [S, Hv, dk, dv] fp32, copied to the slots per run
    std::vector<std::pair<int64_t, int64_t>> runs;  // (first sequence, count) of consecutive slots
  };
  void begin_prefill(const CudaBatch& b);
  // Runs `enqueue` (which enqueues `op` on stream_), bracketed by the profiler's events when one is set.
  template <class Enqueue>
  void timed(ForwardOp op, Enqueue&& enqueue, const GemmShape& gemm = {});

  TargetConfig config_;
  TargetWeights weights_;
  FastPathPlan plan_;
  std::vector<Fused> fused_;
  bool fp8_ = false;  // the projections run the block-scaled FP8 GEMM
  bool gemm_unaligned_ = false;  // gemm_unaligned()
  void moe(int64_t i, const Tensor& x, Tensor& out);  // the sparse MoE block (cuda::moe_block)
  int64_t expert_group() const;  // this rank's expert group under tp / ep (0 without tp)
  // What a forward's options ask of its MoE blocks (capture_routing, router_logits), set for the
  // length of one forward: the device buffers the blocks write into, per layer.
  struct MoeIo {
    const ForwardOptions* options = nullptr;
    struct Layer {
      Tensor experts, weights, logits;  // device: [routed, k] i32, [routed, k] f32, [N, E] f32
      Tensor forced;                    // device copy of options->router_logits->at(i)
    };
    std::map<int64_t, Layer> layers;
  };
  MoeIo* moe_io_ = nullptr;
  // A side stream with its fork and join events (made on first use; a captured step's graph holds
  // the forks and joins). Decode steps' L2 prefetches (FastPathPlan::DecodeFusion::prefetch): after a
  // GEMM, the next GEMM's first weight bytes are fetched on prefetch_, joined at the forward's end.
  // FP8 decode steps' bf16 GEMM parts (DecodeFusion::fp8_side_gemms) run on side_, joined after the
  // projection's FP8 GEMMs.
  struct SideLane;
  struct SideLaneDeleter {
    void operator()(SideLane* lane) const;
  };
  using SideLanePtr = std::unique_ptr<SideLane, SideLaneDeleter>;
  SideLane& lane(SideLanePtr& l);
  SideLanePtr prefetch_, side_;
  bool prefetch_pending_ = false;
  uint64_t side_gemms_ = 0;  // GEMMs enqueued on side_ (eager or captured; replays not counted)
  uint64_t prefetches_ = 0;  // prefetch_l2 launches enqueued (eager or captured; replays not counted)
  uint64_t packed_gemms_ = 0;  // streaming GEMMs enqueued on a packed decode copy (likewise)
  void prefetch_next(const std::vector<Proj>& parts);
  void join_prefetch();
  PathCounters counters_;
  Device device_;
  void* stream_ = nullptr;
  comm::Communicator* tp_ = nullptr;
  OpProfiler* profiler_ = nullptr;
  DecodeStep* decode_ = nullptr;
  Prefill prefill_;
};

}  // namespace dflash::target
