#pragma once
// Incremental decoding of the target: the one seam that the CPU reference and the CUDA model both
// implement, and that speculative decoding (dflash_eval) and regeneration are written against.
//
// A pool of `num_slots` sequences, each up to `max_len` tokens. Per slot, per layer: the attention
// KV cache [max_len, Hkv, d], the GatedDeltaNet recurrent state [Hv, dk, dv] in fp32 and the conv
// state (the last K-1 conv inputs). A slot holds `length(slot)` committed tokens.
//
// extend(slots, tokens) runs T_s >= 1 new tokens of each slot on top of its committed state in one
// forward (positions length .. length + T_s - 1) and returns, for every new token, the greedy next
// token (argmax of its logits over the vocabulary, computed where the model runs; ties go to the
// lowest id; or a sampled one, ExtendOptions::sample) and the captured features the drafter is trained on. With commit = true the tokens
// become part of the slot (prefill, plain decoding); with commit = false (verify) the slot is left
// as it was until commit(slot, n) keeps the first n of those tokens (1 <= n <= T): the KV cache
// then ends after them and the GDN recurrent and conv states are those after token n — the state
// before verify is never overwritten; commit re-runs the delta rule and the conv state update of the
// n accepted tokens from their saved inputs (O(n) and no per-token state copies; see
// bench/README.md for the cost). A verify's tokens are committed (or dropped) before the next
// verify: another verify, of any slot, or a commit = true extend of the same slot discards them.
//
// Extending a sequence in pieces of any sizes gives the hidden states and logits of one forward
// over the whole sequence (the CPU reference to ~1e-5, tests/test_decode.cpp).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "core/tensor.h"
#include "target_model/config.h"
#include "target_model/fast_path.h"

namespace dflash::target {

class TargetModel;

struct ExtendOptions {
  bool commit = true;
  // Decoder layers whose outputs make the features (id i = output of layer i, as ForwardOptions):
  // the drafter's target_layer_ids. Empty: no features.
  std::vector<int64_t> capture;
  // Only the last new token of each slot needs its next token and features (prefill).
  bool last_only = false;
  bool logits = false;  // also return the f32 logits (tests)
  // Sampling instead of greedy argmax: `next` holds ops::sample_rows draws (on the model's device),
  // row of slot s at position p drawn with stream sample_streams[s] and position p, so a sequence's
  // tokens depend on its stream (e.g. its index in a dataset) and the seed, not on its batch.
  const ops::SampleParams* sample = nullptr;
  std::vector<uint64_t> sample_streams;  // [slots] with sample
};

struct ExtendResult {
  std::vector<int64_t> offsets;  // rows of each slot's new tokens: {0, T_0, T_0 + T_1, ...} (last_only: {0, 1, 2, ...})
  std::vector<int32_t> next;     // [rows] argmax of the logits after each (kept) new token
  Tensor features;               // [rows, k·H] the captured layers side by side (capture order), on the model's
                                 // device: f32 on the CPU, bf16 on CUDA; undefined without capture
  Tensor logits;                 // [rows, V] f32 host when ExtendOptions::logits
};

// How a decoder's decode / verify steps ran (CUDA: decode_cuda.cpp); zero on the CPU reference.
struct GraphStats {
  uint64_t captures = 0;          // step shapes captured as CUDA graphs
  uint64_t replays = 0;           // steps that replayed one
  uint64_t eager = 0;             // steps that launched eagerly although graphs are on (first step of a shape,
                                  // profiler set, tensor parallel, a shape whose capture failed)
  uint64_t capture_failures = 0;  // captures that failed (logged; that shape then runs eagerly, counted in eager)
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  const TargetConfig& config() const { return config_; }
  int64_t num_slots() const { return static_cast<int64_t>(length_.size()); }
  int64_t max_len() const { return max_len_; }
  int64_t length(int32_t slot) const;  // committed tokens
  virtual Device device() const = 0;
  virtual std::string describe() const = 0;  // "cpu reference (f32)" / "cuda:0 ... kernels"
  // Waits for the work this decoder enqueued (commit returns before a GPU has done it).
  virtual void synchronize() {}
  // The decode kernels launched so far per step and path ("conv_update fast 96 fallback 0, ..."), or "".
  virtual std::string kernels_run() const { return {}; }
  virtual GraphStats graph_stats() const { return {}; }

  // Empties the slot (length 0, zero states).
  void reset(int32_t slot);
  // Checks (slot ids in range and distinct, T_s >= 1, token ids in the vocabulary, length + T_s <=
  // max_len — naming the slot and the numbers), then runs the model.
  ExtendResult extend(const std::vector<int32_t>& slots, const std::vector<std::vector<int32_t>>& tokens,
                      const ExtendOptions& options);
  // Keeps the first n tokens of the slot's pending (commit = false) extend.
  void commit(int32_t slot, int64_t n);

 protected:
  Decoder(TargetConfig config, int64_t num_slots, int64_t max_len);
  virtual void do_reset(int32_t slot) = 0;
  // lengths[s] = length(slots[s]) before these tokens; the base updates lengths after a commit.
  virtual ExtendResult do_extend(const std::vector<int32_t>& slots, const std::vector<int64_t>& lengths,
                                 const std::vector<std::vector<int32_t>>& tokens, const ExtendOptions& options) = 0;
  virtual void do_commit(int32_t slot, int64_t length, int64_t n) = 0;

  TargetConfig config_;

 private:
  int64_t max_len_;
  std::vector<int64_t> length_;   // committed tokens per slot
  std::vector<int64_t> pending_;  // tokens of the uncommitted extend per slot (0: none)
};

// The CPU reference decoder over `model`'s f32 weights (tensor parallel when the model is).
std::unique_ptr<Decoder> make_cpu_decoder(const TargetModel& model, int64_t num_slots, int64_t max_len);

#if DFLASH_WITH_CUDA
class CudaTargetModel;
// The CUDA decoder over `model` (which must outlive it), with the kernels of `decode_plan`
// (make_decode_plan of the model's config and device).
std::unique_ptr<Decoder> make_cuda_decoder(CudaTargetModel& model, int64_t num_slots, int64_t max_len,
                                           FastPathPlan decode_plan);
#endif

}  // namespace dflash::target
