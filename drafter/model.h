#pragma once
// The DFlash drafter forward and hand-written backward: the CPU reference.
//
// Precision: StepOptions::math. The reference (F64) runs every computation in double; tensors in and
// out may be F32 or F64 (weights, context features, gradients), so the same code is the f32 pipeline
// reference and the float64 path of the finite-difference test. F32 is the same code in float.
//
// Forward, for a packed batch of sequences and sorted anchor blocks (B = block_size):
//   ctx   = hidden_norm(fc(context))                               [N, H]   once, shared by all layers
//   h     = embed_tokens[anchor token, mask × (B-1)] per block      [R, H]   R = blocks·B
//   layer: x = input_layernorm(h); q = q_norm(q_proj x); keys/values = [k/v_proj(ctx) ; k/v_proj(x)]
//          (k_norm on both); RoPE (full head_dim) at context positions 0..S-1 and block positions
//          anchor..anchor+B-1; masked softmax attention (GQA); h += o_proj(attn);
//          h += down(silu(gate(y)) · up(y)) with y = post_attention_layernorm(h)
//   final = norm(h); logits = final · lm_head^T (fused, chunked CE; see loss.h)
#include <cstdint>
#include <vector>

#include "drafter/config.h"
#include "drafter/loss.h"
#include "drafter/weights.h"
#include "kernels/ops.h"
#include "core/tensor.h"

namespace dflash::drafter {

// Test hook: the released mask, and the two published mask bugs.
enum class MaskVariant {
  Correct,          // context keys < anchor; full layers see the whole own block
  CausalInBlock,    // bug: full layers causal inside the block
  AnchorInclusive,  // bug: context keys <= anchor
};

// Whether the query at block offset j (position anchor + j) of a block may attend a key of the
// same sequence: a context key at position key_index, or (key_in_block) the key at block offset
// key_index of the same block. Keys of other blocks and other sequences are never attended.
// Sliding layers are causal in the block and keep keys with position >= query position - (window-1).
bool mask_allows(AttnType type, int64_t sliding_window, int64_t anchor, int64_t j, bool key_in_block,
                 int64_t key_index, MaskVariant variant = MaskVariant::Correct);

// The frozen target tensors the drafter uses (never updated, no gradient).
struct FrozenTarget {
  Tensor embed_tokens;  // [V, H] any float dtype, host
  Tensor lm_head;       // [V, H] any float dtype, host
};

struct Block {
  int64_t seq = 0;     // sequence index in the batch
  int64_t anchor = 0;  // position within that sequence, 0 <= anchor < S
};

struct DrafterBatch {
  Tensor context;                  // [N, k·H] captured target hidden states, packed, host F32/F64/BF16
  std::vector<int32_t> tokens;     // [N]
  std::vector<uint8_t> loss_mask;  // [N]
  ops::SeqOffsets seqs;            // boundaries over N
  std::vector<Block> blocks;       // sorted by (seq, anchor)
};

// A batch's blocks are drawn by sample_blocks / make_batch (drafter/batch.h).

struct StepOptions {
  double gamma = 7.0;           // loss decay (7 for B = 16)
  int64_t ce_chunk_rows = 256;  // rows of logits made at a time
  // Gradients are of grad_scale · Σ w·CE. 0 means 1 / (Σ w of this call), i.e. of this call's
  // loss; a trainer passes 1 / (global Σ w) over all ranks and micro-batches.
  double grad_scale = 0;
  MaskVariant mask = MaskVariant::Correct;  // test hook
  int64_t label_shift = 0;                  // test hook: position k predicts token a+k+label_shift
  DrafterMath math = DrafterMath::F64;
  // The drafter's linear layers (fc, q/k/v/o, gate/up/down; not the LM head) in simulated
  // block-scaled FP8, forward and backward (ref_math.h linear_fp8; F32 math only): the CPU reference
  // of the FP8 drafter (model.drafter.precision: fp8).
  bool fp8_linears = false;
  // The LM-head cross-entropy's two GEMMs in block-scaled FP8 (model.drafter.lm_head_precision: fp8;
  // F32 math only on the CPU: cpu::fused_linear_ce_f32's fp8 form on the head's 128 x 128 tiles).
  bool fp8_lm_head = false;
  // With fp8_linears: the weight gradient's x operand in 128 x 128 blocks instead of 128 x 1 tiles along
  // the tokens (model.drafter.fp8_wgrad_x_tiles: 128x128; ref_math.h linear_bwd_fp8).
  bool fp8_wgrad_x_blocks = false;
};

// Checks a batch against the config (context width, sequence offsets, token ids, sorted blocks
// inside their sequences); throws naming the first bad item. The context may be on any device.
void check_batch(const DrafterConfig& c, const DrafterBatch& batch);

// Labels and loss weights of every block row (R = blocks·B; row b·B + k), from block_label.
struct BlockTargets {
  std::vector<int32_t> labels;  // [R] (0 where the weight is 0)
  std::vector<double> weights;  // [R]
  double weight_sum = 0;
};
BlockTargets block_targets(const DrafterConfig& c, const DrafterBatch& batch, double gamma, int64_t label_shift = 0);
// The step's metrics from each row's top-1 id (argmax[r], compared only where weights[r] > 0).
StepStats block_stats(int64_t B, const BlockTargets& t, const std::vector<int32_t>& argmax, double weighted_ce_sum);

// Model FLOPs of one drafter step on `batch` (N context rows, R = blocks·B block rows), counted
// from the shapes: every GEMM 2·M·N·K (forward; backward = 2x forward for the layers, 1x for fc,
// whose input gets no gradient; the LM head: logits + the hidden-state gradient, 2 GEMMs of
// 2·R·H·V), attention 4·d·Hq per (query row, attended key) forward and 2.5x that backward (dq, dk,
// dv and the recomputed scores), counting only the keys the mask keeps.
double step_flops(const DrafterConfig& c, const DrafterBatch& batch, bool backward);

// Forward (and backward when grads or grad_context is given) over a batch.
//   grads:        gradients ADDED into these tensors (F32 or F64; allocate with DrafterWeights::zeros)
//   grad_context: when given, set to d/d context, [N, k·H] F64 (the fc input)
//   final_hidden: when given, set to the final-normed hidden states [R, H] F64 (tests, diagnostics)
StepStats forward_backward(const DrafterConfig& c, const DrafterWeights& w, const FrozenTarget& target,
                           const DrafterBatch& batch, const StepOptions& opt, DrafterWeights* grads = nullptr,
                           Tensor* grad_context = nullptr, Tensor* final_hidden = nullptr);

}  // namespace dflash::drafter
