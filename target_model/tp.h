#pragma once
// Tensor parallelism of the target (Megatron-style). A rank of a TP group of size tp holds:
//   GatedDeltaNet: key heads [r·Hk/tp, ...) and value heads [r·Hv/tp, ...): the q, k, v row sections
//     of in_proj_qkv and the conv channels with them, z / b / a rows, A_log and dt_bias of its value
//     heads (column-parallel); out_proj columns of its value heads (row-parallel).
//   Attention: query heads [r·Hq/tp, ...) with their gates (q_proj rows), k / v rows of its kv heads
//     (a kv head is replicated on tp / Hkv ranks when Hkv < tp), o_proj columns (row-parallel).
//   MLP: gate / up rows [r·I/tp, ...), down columns.
//   MoE block (parallel.ep = ep, dividing tp and num_experts): the TP group is ep expert groups of
//     tp / ep consecutive ranks; group g = r / (tp / ep) holds experts [g·E/ep, (g+1)·E/ep), each
//     split like the dense MLP over the group's ranks (gate / up rows, down columns of
//     moe_intermediate_size); ep = 1: every rank holds every expert's 1/tp, ep = tp: whole experts.
//     The shared expert is split over all tp ranks like the dense MLP. The router (E x H) and the
//     shared expert's sigmoid gate (1 x H) are replicated: every rank routes every token of the
//     (replicated) hidden states to the same experts, so no token is dispatched, and each rank adds
//     its experts' and its shared-expert slice's weighted partial outputs into one sum.
//   Embedding, every norm and lm_head: replicated.
// One all-reduce (sum) after each mixer's and each MLP's (MoE block's) output projection makes the
// hidden states identical on every rank of the group. The rank's model is the single-GPU model of
// local_config().
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "target_model/config.h"
#include "target_model/weights.h"

namespace dflash::target {

struct TpShard {
  int rank = 0, size = 1;
  int ep = 1;  // expert groups of the MoE block within the TP group (divides size)
  // MoE: this rank's expert group (of ep groups of size / ep consecutive ranks), and its place in it
  // (which slice of each of the group's experts it holds).
  int expert_group() const { return rank / (size / ep); }
  int expert_rank() const { return rank % (size / ep); }
};

// Throws one message naming every count that tp does not divide (heads, intermediate sizes; an
// MoE model's moe_intermediate_size by tp / ep), after check_ep.
void check_tp(const TargetConfig& c, int tp, int ep = 1);
// parallel.ep: >= 1; > 1 only for an MoE model, dividing tp and num_experts (messages name the field).
void check_ep(const TargetConfig& c, int tp, int ep);

// The per-rank architecture: head counts and intermediate size divided by tp (kv heads: at least 1);
// MoE: moe_intermediate_size by tp / ep, the shared expert's by tp, ep_size = ep (num_experts / ep held).
TargetConfig local_config(const TargetConfig& c, int tp, int ep = 1);

// How a rank's tensor is cut from the full one: replicated (dim = -1), or the concatenation of
// `segments` (start, length) along `dim` (0 = rows / output features, 1 = columns / input features
// of a matrix; an expert tensor [E, ., .]: 1 = its rows, 2 = its columns), within the leading-dim
// range `experts` (start, length) when that is set (the expert-parallel group's experts).
struct SliceSpec {
  std::string name;  // canonical name
  Shape full, local;
  int dim = -1;
  std::vector<std::pair<int64_t, int64_t>> segments;
  std::pair<int64_t, int64_t> experts{0, -1};  // length -1: all
};
std::vector<SliceSpec> shard_specs(const TargetConfig& full, const TpShard& shard);

// Cuts the rank's slice out of a full host tensor (any dtype; a zero-copy mmap view is fine: only
// the slice's bytes are touched), returning a contiguous host tensor of the same dtype.
Tensor extract_slice(const Tensor& full, const SliceSpec& spec);

// The slice of an FP8 projection's block scales [ceil(N/128), ceil(K/128)] that goes with the
// weight slice `weight`: every cut must fall on a multiple of 128 (or the tensor's end); throws
// naming the tensor, the cut and tp otherwise.
SliceSpec scale_slice_spec(const SliceSpec& weight, int tp);

// The rank's weights, read slice by slice from the checkpoint (no full copy in host memory); an
// FP8 checkpoint's e4m3 projections with their block scales (scale_slice_spec), then `precision`
// as apply_precision says.
TargetWeights load_weights_tp(const TargetConfig& full, const std::string& dir, DType dtype, Device device,
                              const TpShard& shard, Precision precision = Precision::Auto);
// The rank's slice of exactly the model random_weights(full, seed) would make (precision fp8:
// quantized after slicing, see apply_precision).
// An FP8 MoE checkpoint's routed-expert block scales for this shard, as MoeWeights::experts_*_scale
// lays them out: per layer host F32 [El, 2·ceil(Il/128), ceil(H/128)] (gate's row blocks, then up's)
// and [El, ceil(H/128), ceil(Il/128)]. Empty, with the reason in *why, when the checkpoint's experts
// are not e4m3 tensors of their own with scales, or this shard's columns of an expert do not start
// and end on 128-blocks. (store_moe_experts_fp8 quantizes with them: the checkpoint's own codes.)
struct MoeExpertScales {
  Tensor gate_up, down;
};
std::vector<MoeExpertScales> read_moe_expert_scales(const TargetConfig& full, const std::string& dir, const TpShard& shard,
                                                    std::string* why);

TargetWeights random_weights_tp(const TargetConfig& full, uint64_t seed, DType dtype, Device device,
                                const TpShard& shard, Precision precision = Precision::Auto);

}  // namespace dflash::target
