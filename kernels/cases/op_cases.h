#pragma once
// The table of op cases (issue 19; ggml test-backend-ops style): one place that says, per op
// case, its shape (and the label kernel_bench writes in its CSV "shape" column), how its inputs
// are drawn from a seed, the launch parameter struct filled from them (once, here), the CUDA
// variants that run it, its CPU reference (the ops:: functions, reused), the error bound of each
// output and its FLOP / byte count. The gpu tests run the check tables (poisoned outputs, every
// variant against the CPU reference, NaN fails); kernel_bench runs the perf tables (the same
// draw / params / variants, timed, amounts from flops() / bytes()).
//
// This header: what every op family shares (seeded draws, host copies, pool-slot layouts, the
// normalised error). The families: kernels/cases/gdn_cases.h (GatedDeltaNet: causal conv, prep,
// delta rule, and their decode twins), kernels/cases/attention_cases.h (causal flash attention,
// the KV-cache append and attention decode). Built only with CUDA (target dflash_op_cases).
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/launch.h"
#include "kernels/ops.h"
#include "core/random.h"
#include "core/tensor.h"

namespace dflash::cases {

// A CUDA variant of an op: its name (kernel_bench's provider suffix) and launcher.
template <class Params>
struct Variant {
  const char* name;
  void (*launch)(const Params&, cuda::Stream);
};

// The inputs of one case: input j draws stream j of `seed` (counter-based RNG, the same values
// on the CPU and the GPU), so a case drawn twice from one seed holds the same inputs.
struct Draw {
  uint64_t seed = 0;
  uint64_t next_stream = 0;
  RandomParams key() { return {seed, next_stream++, 0}; }
};

// Fresh tensors of N(mean, stddev) / U(lo, hi) values on `dev` (any float dtype; empty shapes allowed).
Tensor normal(Draw& d, const Shape& s, DType dt, Device dev, float stddev, float mean = 0.0f);
Tensor uniform(Draw& d, const Shape& s, DType dt, Device dev, float lo, float hi);
// q / k as gdn_prep leaves them: N(0, 1) rows L2-normalised (eps 1e-6), times `scale`, rounded to
// bf16; a bf16 tensor on the GPU.
Tensor normalized_rows_bf16(Draw& d, const Shape& s, float scale);

// Host f32 copy of a tensor of any float dtype on any device (the CPU reference's view of a
// device input: the same bf16-representable values).
Tensor host_f32(const Tensor& t);
// A tensor filled with NaN (an output whose unwritten elements must be caught); host_poisoned: f32
// on the host (a CPU reference output).
Tensor poisoned(const Shape& s, DType dt, Device dev);
Tensor host_poisoned(const Shape& s);
// An int32 vector on the GPU.
Tensor device_i32(const std::vector<int64_t>& v);
Tensor device_i32(const std::vector<int32_t>& v);

ops::SeqOffsets offsets_of(const std::vector<int64_t>& lens);
// "{63,64,65}"
std::string lens_str(const std::vector<int64_t>& lens);

// max |got - ref| / max |ref| over host copies (any dtype, any device); +inf for a NaN in either
// or different element counts. Every bound of the tables is in this unit.
double max_rel_err(const Tensor& got, const Tensor& ref);

// Sets an int tuning knob (cuda::tuning::*, 0 = the launcher's automatic choice) for the scope.
struct Knob {
  int& ref;
  int saved;
  Knob(int& r, int v) : ref(r), saved(r) { ref = v; }
  ~Knob() { ref = saved; }
  Knob(const Knob&) = delete;
  Knob& operator=(const Knob&) = delete;
};

// Pool slots of a batch of S sequences (decode ops): `sets` disjoint groups of S + spare slots
// (perf mode rotates over the groups so that a call's state is not left in L2 by the previous
// one); in group i sequence s sits in slot i (S + spare) + (S + spare - 1 - s) mod (S + spare):
// reversed, and with spare > 0 a permutation that leaves unused slots between the used ones.
struct SlotLayout {
  int64_t S = 0, sets = 1, spare = 0;
  int64_t pool() const { return sets * (S + spare); }
  std::vector<int32_t> slots(int64_t set) const;  // [S]
  std::vector<int32_t> all() const;               // [sets * S], group after group
  std::vector<int32_t> unused(int64_t set) const; // the slots of the pool no sequence of `set` uses
};

}  // namespace dflash::cases
