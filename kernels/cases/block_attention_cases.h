#pragma once
// The block-attention family (the drafter's attention, kernels/cuda/block_attention.h) for its gpu
// test and kernel_bench: the launch parameters filled from device tensors in one place. (Its draws,
// CPU reference and bounds are still the test's own: the family is not in the op-case table yet.)
// Header only, CUDA builds.
#include <cstdint>

#include "core/tensor.h"
#include "kernels/cuda/block_attention.h"

namespace dflash::cases {

// Device tensors: bf16 q [R, Hq, d], context kc / vc [N, Hkv, d], block kb / vb [R, Hkv, d];
// int32 anchor / block_seq [nb] and cu_seqlens / cu_blocks [num_seqs + 1].
struct BlockAttnInputs {
  Tensor q, kc, vc, kb, vb;
  Tensor anchor, block_seq, cu_seqlens, cu_blocks;
};

// The forward's parameters over `in`: `sizes` (nb, B, N, num_seqs, max_seqlen, Hq, Hkv, d; and
// whatever else it sets) with the input pointers filled in. out / lse are the caller's.
inline cuda::BlockAttnParams block_attn_params(const BlockAttnInputs& in, const cuda::BlockAttnParams& sizes) {
  cuda::BlockAttnParams p = sizes;
  p.q = in.q.raw_data();
  p.kc = in.kc.raw_data();
  p.vc = in.vc.raw_data();
  p.kb = in.kb.raw_data();
  p.vb = in.vb.raw_data();
  p.anchor = in.anchor.data<int32_t>();
  p.block_seq = in.block_seq.data<int32_t>();
  p.cu_seqlens = in.cu_seqlens.data<int32_t>();
  p.cu_blocks = in.cu_blocks.data<int32_t>();
  return p;
}

// The backward's tensors: dout [R, Hq, d], the gradients shaped as q, kc, vc, kb, vb, and the
// workspace (block_attention_bwd_workspace bytes).
struct BlockAttnGrads {
  Tensor dout, dq, dkc, dvc, dkb, dvb, workspace;
};

inline cuda::BlockAttnBwdParams block_attn_bwd_params(const cuda::BlockAttnParams& fwd, const BlockAttnGrads& g) {
  cuda::BlockAttnBwdParams bp;
  bp.fwd = fwd;
  bp.dout = g.dout.raw_data();
  bp.dq = g.dq.raw_data();
  bp.dkc = g.dkc.raw_data();
  bp.dvc = g.dvc.raw_data();
  bp.dkb = g.dkb.raw_data();
  bp.dvb = g.dvb.raw_data();
  bp.workspace = g.workspace.raw_data();
  return bp;
}

}  // namespace dflash::cases
