#pragma once
// Tensor parallelism of the target (Megatron-style). A rank of a TP group of size tp holds:
//   GatedDeltaNet: key heads [r·Hk/tp, ...) and value heads [r·Hv/tp, ...): the q, k, v row sections
//     of in_proj_qkv and the conv channels with them, z / b / a rows, A_log and dt_bias of its value
//     heads (column-parallel); out_proj columns of its value heads (row-parallel).
//   Attention: query heads [r·Hq/tp, ...) with their gates (q_proj rows), k / v rows of its kv heads
//     (a kv head is replicated on tp / Hkv ranks when Hkv < tp), o_proj columns (row-parallel).
//   MLP: gate / up rows [r·I/tp, ...), down columns.
//   Embedding, every norm and lm_head: replicated.
// One all-reduce (sum) after each mixer's and each MLP's output projection makes the hidden states
// identical on every rank of the group. The rank's model is the single-GPU model of local_config().
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "target_model/config.h"
#include "target_model/weights.h"

namespace dflash::target {

struct TpShard {
  int rank = 0, size = 1;
};

// Throws one message naming every count that tp does not divide (heads, intermediate size).
void check_tp(const TargetConfig& c, int tp);

// The per-rank architecture: head counts and intermediate size divided by tp (kv heads: at least 1).
TargetConfig local_config(const TargetConfig& c, int tp);

// How a rank's tensor is cut from the full one: replicated (dim = -1), or the concatenation of
// `segments` (start, length) along `dim` (0 = rows / output features, 1 = columns / input features).
struct SliceSpec {
  std::string name;  // canonical name
  Shape full, local;
  int dim = -1;
  std::vector<std::pair<int64_t, int64_t>> segments;
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
TargetWeights random_weights_tp(const TargetConfig& full, uint64_t seed, DType dtype, Device device,
                                const TpShard& shard, Precision precision = Precision::Auto);

}  // namespace dflash::target
