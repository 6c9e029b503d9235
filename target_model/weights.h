#pragma once
// The frozen target's weights: the tensor list a config implies, loading from a Hugging Face
// checkpoint (text-model or multimodal names), seeded random initialisation, and export.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "target_model/config.h"

namespace dflash::io {
class SafetensorsIndex;
}

namespace dflash::target {

// in_proj_qkv, in_proj_z, out_proj, q/k/v/o_proj, gate/up/down_proj (canonical weight names).
bool is_fp8_projection(const std::string& canonical_name);

// An FP8 projection [N, K] holds, per backend,
//   CPU (f32 weights):  the dequantized values code * scale (f32), so the reference GEMM is exact
//                       on the values the GPU multiplies; the CPU model quantizes its input
//   CUDA (bf16 weights): the e4m3 codes (DType::F8E4M3) on the device
// and its `*_scale` is the F32 [ceil(N/128), ceil(K/128)] weight_scale_inv on the weights' device
// (undefined: the projection is not FP8).
struct GdnWeights {
  Tensor in_proj_qkv;  // (2*Hk*dk + Hv*dv, H)   rows: [q | k | v]
  Tensor in_proj_z;    // (Hv*dv, H)
  Tensor in_proj_b;    // (Hv, H)
  Tensor in_proj_a;    // (Hv, H)
  Tensor conv1d;       // (conv_dim, K)   HF stores (conv_dim, 1, K)
  Tensor A_log;        // (Hv)
  Tensor dt_bias;      // (Hv)
  Tensor norm;         // (dv)            plain weight of the gated RMSNorm
  Tensor out_proj;     // (H, Hv*dv)
  Tensor in_proj_qkv_scale, in_proj_z_scale, out_proj_scale;  // FP8 block scales
};

struct AttnWeights {
  Tensor q_proj;  // (Hq*d*2, H) with the gate: per head [q (d) | gate (d)]; (Hq*d, H) without
  Tensor k_proj;  // (Hkv*d, H)
  Tensor v_proj;  // (Hkv*d, H)
  Tensor o_proj;  // (H, Hq*d)
  Tensor q_norm;  // (d)  zero-centred
  Tensor k_norm;  // (d)  zero-centred
  Tensor q_proj_scale, k_proj_scale, v_proj_scale, o_proj_scale;  // FP8 block scales
};

// The sparse MoE block of a qwen3_5_moe layer (E experts of width Ie, a shared expert of width Is),
// in transformers' in-memory layout, which the official checkpoints store (fused experts);
// transformers 5.17's save_pretrained writes one tensor per expert
// (mlp.experts.N.{gate,up,down}_proj.weight), which load_weights stacks into it.
struct MoeWeights {
  Tensor router;              // (E, H)        mlp.gate.weight
  Tensor experts_gate_up;     // (E, 2*Ie, H)  mlp.experts.gate_up_proj: per expert [gate (Ie) | up (Ie)] rows
  Tensor experts_down;        // (E, H, Ie)    mlp.experts.down_proj
  Tensor shared_gate_proj;    // (Is, H)       mlp.shared_expert.gate_proj.weight
  Tensor shared_up_proj;      // (Is, H)
  Tensor shared_down_proj;    // (H, Is)
  Tensor shared_expert_gate;  // (1, H)        mlp.shared_expert_gate.weight
  // W8A8 block FP8 (precision fp8; the CPU reference only): the experts' and the shared expert's
  // weights hold e4m3 values times their 128 x 128 block scales (per expert, gate and up apart, as
  // the official FP8 checkpoints store them), and their inputs are quantized per token in 1 x 128
  // groups, as vLLM's and SGLang's FP8 MoE kernels run those checkpoints. The router and the shared
  // expert's gate stay unquantized (the checkpoints do not convert them).
  bool fp8 = false;
  // FP8 experts on a GPU (store_moe_experts_fp8; kernels/cuda/moe_fp8.cuh): when defined, experts_gate_up
  // and experts_down hold e4m3 codes and these their 128 x 128 block scales (f32 [E, 2·ceil(Ie/128),
  // ceil(H/128)], gate rows' blocks then up rows', and [E, ceil(H/128), ceil(Ie/128)]); the kernels
  // read every weight as the bf16-rounded code · scale (W8A16): half the experts' bytes.
  Tensor experts_gate_up_scale, experts_down_scale;
  bool defined() const { return router.defined(); }
};

struct LayerWeights {
  LayerType type = LayerType::LinearAttention;
  Tensor input_layernorm;           // (H)  zero-centred
  Tensor post_attention_layernorm;  // (H)  zero-centred
  GdnWeights gdn;                   // when type == LinearAttention
  AttnWeights attn;                 // when type == FullAttention
  Tensor gate_proj, up_proj;        // (I, H)      dense models
  Tensor down_proj;                 // (H, I)
  Tensor gate_proj_scale, up_proj_scale, down_proj_scale;  // FP8 block scales
  MoeWeights moe;                   // MoE models (config.is_moe()) instead of the dense MLP
};

struct TargetWeights {
  Tensor embed_tokens;  // (V, H)
  std::vector<LayerWeights> layers;
  Tensor norm;     // (H)  zero-centred
  Tensor lm_head;  // (V, H); the same tensor as embed_tokens when tied
  DType dtype = DType::F32;
  Device device;
  size_t bytes() const;  // unique bytes held
  int64_t fp8_projections() const;  // how many projections are FP8 (0: a bf16 / f32 target)
  bool fp8_moe() const;              // MoE blocks in W8A8 block FP8 (MoeWeights::fp8)
  Precision precision() const { return fp8_projections() > 0 || fp8_moe() ? Precision::Fp8 : Precision::Bf16; }
};

// Visits every FP8-capable projection of `w` (is_fp8_projection) with its canonical name, its
// weight and its scale slot.
void for_each_projection(TargetWeights& w,
                         const std::function<void(const std::string& name, Tensor& weight, Tensor& scale)>& f);

// Applies `precision` to loaded weights: fp8 quantizes every projection when none is FP8 yet
// (128 x 128 blocks of each tensor as it is held, i.e. of the rank's slice at tp > 1, which are
// the full tensor's blocks whenever the slice cuts on multiples of 128); bf16 dequantizes FP8
// projections; auto keeps what was loaded. An MoE target's blocks: fp8 rounds the experts' and the
// shared expert's weights to e4m3 block values (unless they came from an FP8 checkpoint, then they
// are already) and sets MoeWeights::fp8 — host f32 weights only (the GPU has no FP8 MoE block: refused);
// bf16 clears it (the values stay).
void apply_precision(TargetWeights& w, Precision precision);
// FP8 experts (TargetSource::fp8_experts, --fp8-experts): every MoE layer's routed experts of bf16
// GPU weights quantized per 128 x 128 block (gate and up apart; as ops::quantize_fp8_weight) into
// e4m3 codes and scales (MoeWeights::experts_*_scale), the bf16 copies freed. With `scales` (an FP8
// checkpoint's own, tp.h read_moe_expert_scales: host F32, one pair a layer) the codes are those
// nearest to value / scale: the checkpoint's own codes again, so the experts keep its exact values.
// Refused on the CPU and for experts whose widths are not multiples of 16, naming them.
struct MoeExpertScales;
void store_moe_experts_fp8(TargetWeights& w, const std::vector<MoeExpertScales>* scales = nullptr);

// One expected tensor: canonical (text-model) name without the "model." prefix, and HF shape.
struct TensorSpec {
  std::string name;  // e.g. "layers.0.linear_attn.in_proj_qkv.weight", "embed_tokens.weight", "lm_head.weight"
  Shape shape;
};
std::vector<TensorSpec> expected_tensors(const TargetConfig& c);

// A checkpoint's per-expert tensor name (canonical) "layers.L.mlp.experts.N.{gate,up,down}_proj.weight":
// true with its layer, expert and projection ("gate", "up", "down"); false for any other name.
struct PerExpertName {
  int64_t layer = -1, expert = -1;
  std::string proj;
};
bool parse_per_expert_name(const std::string& canonical_name, PerExpertName& out);

// FP8 Mixture-of-Experts checkpoints (the official Qwen3.5/3.6-MoE-FP8 layout: every expert's
// mlp.experts.N.{gate,up,down}_proj.weight and the shared expert's projections in e4m3, each with
// its 128 x 128 block scales, weight_scale_inv): these weights are dequantized (code x block scale,
// exact in f32) where they are read; precision auto runs the target in bf16 (the GPU has no FP8 MoE
// block), fp8 in W8A8 block FP8 on the CPU reference (MoeWeights::fp8).
// True for the shared expert's gate / up / down_proj (the per-expert names: parse_per_expert_name).
bool is_fp8_moe_weight(const std::string& canonical_name);
// The precision an MoE target's checkpoint runs in: auto on an FP8 checkpoint resolves to bf16
// (logged, naming dir); anything else is returned as requested (apply_precision refuses fp8).
Precision moe_fp8_precision(const TargetConfig& c, bool fp8_checkpoint, Precision requested, const std::string& dir);
// Sets MoeWeights::fp8 on the MoE layers of `w` whose experts (one tensor each) and shared expert are
// all e4m3 in `ckpt` (their loaded values are then exact e4m3 block values; `full`: the checkpoint's config).
void mark_fp8_moe_layers(TargetWeights& w, const TargetConfig& full, const io::SafetensorsIndex& ckpt);
// Checkpoint tensor `name` as stored, or dequantized to F32 when it is e4m3 (scales: name + "_scale_inv").
Tensor read_dequantized(const io::SafetensorsIndex& ckpt, const std::string& name);

// Maps a checkpoint name to the canonical one: "model.layers.3.mlp.up_proj.weight" and
// "model.language_model.layers.3.mlp.up_proj.weight" -> "layers.3.mlp.up_proj.weight";
// "lm_head.weight" stays. Returns "" for tensors the target ignores (mtp.*, vision tower).
std::string canonical_weight_name(const std::string& checkpoint_name);

// Loads DIR (config.json + model.safetensors or a sharded index). Missing, unexpected or
// mis-shaped tensors fail with the full list of offending names and the expected shapes. An MoE
// layer's experts may be stored fused (mlp.experts.gate_up_proj / down_proj, the official
// checkpoints) or one tensor per expert (mlp.experts.N.gate_proj.weight, ..., what transformers
// 5.17's save_pretrained writes), not both.
// Weights are converted to `dtype` and placed on `device`. A block-FP8 checkpoint's e4m3
// projections come with their weight_scale_inv (F32 or BF16 in the file); then `precision`
// (apply_precision) decides what the target runs.
TargetWeights load_weights(const TargetConfig& c, const std::string& dir, DType dtype, Device device,
                           Precision precision = Precision::Auto);

// Seeded random weights without any file. Tensor element j of tensor `name` draws element j of
// the RNG stream derived from (seed, name), so any slice can be drawn on its own (TP shards).
// Scales keep activations O(1): linears N(0, 1/in), norms at their identity, A_log = log U(1, 16).
TargetWeights random_weights(const TargetConfig& c, uint64_t seed, DType dtype, Device device,
                             Precision precision = Precision::Auto);

// Builds the weights of config `c` slot by slot: make(canonical name, HF shape) returns the tensor
// (any dtype, host or device); it is converted to `dtype` on `device` (the conv weight squeezed).
// An F8E4M3 tensor from `make` is an FP8 projection: make_scale(name) then returns its scale
// (F32 / BF16 [ceil(N/128), ceil(K/128)]), and it is stored as the FP8 layout above says.
using TensorMaker = std::function<Tensor(const std::string& name, const Shape& shape)>;
TargetWeights assemble_weights(const TargetConfig& c, DType dtype, Device device, const TensorMaker& make,
                               const TensorMaker& make_scale = nullptr);

// How random_weights draws a tensor (from its canonical name and full shape).
struct RandomInit {
  enum Kind { Normal, LogUniform, Constant } kind;
  float a, b;  // Normal: mean, stddev; LogUniform: log U(a, b); Constant: a
};
// branch_scale: TargetConfig::random_branch_scale (multiplies the output projections' stddev).
RandomInit random_init(const std::string& name, const Shape& full_shape, double branch_scale = 1.0);
// The RNG stream of a tensor: a hash of its canonical name.
uint64_t weight_stream(const std::string& name);
// One full random tensor as random_weights draws it (normal ones in `dtype` on `device`, the
// small others as f32 on the host).
Tensor random_tensor(const std::string& name, const Shape& shape, uint64_t seed, DType dtype, Device device,
                     double branch_scale = 1.0);

// Writes config.json and model.safetensors (text-model names) to DIR, creating it. FP8 projections
// are written as the official block-FP8 checkpoints store them (e4m3 weight + F32
// weight_scale_inv, and a quantization_config) unless dtype asks for plain floats.
void save_checkpoint(const TargetConfig& c, const TargetWeights& w, const std::string& dir, DType dtype);

}  // namespace dflash::target
