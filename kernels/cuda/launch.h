#pragma once
// The conventions every CUDA launcher follows; the launchers themselves are declared one header per
// op family, forward, backward, decode / verify and fallback side by side (as llm.c keeps
// layernorm.cuh): gemm.h, norm.h, rope.h, elementwise.h, attention.h, block_attention.h, conv.h,
// gdn.h, loss.h, optimizer.h, sampling.h. Each family's CPU reference is named at the top of its header.
//
// Raw pointers and sizes only, as FlashInfer / TensorRT-LLM entry points: no Tensor, no CUDA types
// in these headers (bf16 data is `void*`, streams are `void*` = cudaStream_t), so host code can
// include them. Every launcher validates its sizes (throwing dflash::Error naming the launcher and
// the value), enqueues on the stream and checks the launch; none synchronizes.
//
// Conventions: "rows" are tokens of a packed batch (all sequences back to back); `ld*` are row
// strides in elements; cu_seqlens is an int32 device array {0, len0, len0+len1, ..., N}.
// "fast" kernels are the ones the fast-path plan selects; "fallback" kernels are simple, correct
// for every shape and architecture, and only run when chosen on purpose.
// Precision: bf16 weights and activations, fp32 math and state; the drafter's residual stream, its
// gradient and every weight gradient are fp32. "(+)=" marks an output that is ADDED into (gradient
// accumulation over layers and micro-batches); "=" marks one written.
#include <cstdint>

namespace dflash::cuda {

using Stream = void*;

// Which tensor-core kernels an attention launcher runs (attention.h, block_attention.h): Auto picks
// (wgmma on sm_90 where the build has the sm_90a code, else mma.sync); the others force one (tests, benches).
enum class FlashImpl { Auto, MmaSync, Wgmma };

// ---- Decode / verify (speculative decoding): conventions of the pool ops in attention.h, conv.h, gdn.h
// All of these work on a state pool of num_slots slots: a batch of num_seqs sequences, sequence s
// in pool slot slots[s] (int32 device array), bringing T_s >= 0 new tokens packed back to back
// (cu_seqlens {0, T_0, T_0 + T_1, ..., N}). T = 1 is decode, T = 2..16 verify (any T works).
// slots, past_len and cu_seqlens are device data the launchers cannot read: the caller guarantees
// 0 <= slots[s] < num_slots, slots distinct within a call that writes the pool, and (attention)
// past_len[s] + T_s <= max_len. A kernel that meets a slot or position outside the pool skips it
// (it writes nothing out of bounds; that sequence's outputs are then undefined).

}  // namespace dflash::cuda

