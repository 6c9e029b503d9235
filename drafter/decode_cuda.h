#pragma once
// The drafter's proposer (decode.h) on one GPU; CUDA builds only (like model_cuda.h).
//
// bf16 weights uploaded once (per layer q|k|v and gate|up fused), per layer a bf16 context K / V
// cache [num_slots, max_len, Hkv, d]; fp32 residual stream, norms and softmax, as the training step
// (model_cuda.h), and tested against the CPU proposer (tests/test_cuda_drafter_decode.cpp).
//   add_context: fc GEMM, hidden_norm, per layer the k|v GEMM, k_norm + RoPE, kv_cache_append.
//   propose: embeddings of the block tokens; per layer RMSNorm, q|k|v GEMM, q/k norm + RoPE, the
//     block's K / V appended at the context end (tentative: the next add_context overwrites them),
//     attention_decode (full layers: causal = false, window 0; sliding: causal, window =
//     sliding_window), o_proj, residual, RMSNorm, gate|up, SwiGLU, down, residual; final norm; the
//     lm_head GEMM of the block rows (fp32 logits, 256 rows at a time) and cuda::argmax_rows.
// Propose steps can run as CUDA graphs per (slots, block) shape (make_cuda_proposer's cuda_graphs).
// No host synchronisation inside propose except its final copy of the (B-1) int32 drafts per slot
// (and, when asked, the logits); no device allocation per propose call: the scratch for a block of
// every slot is allocated at construction. add_context takes its scratch (proportional to its rows)
// from the caching allocator and returns without waiting for the device.
#include <cstdint>
#include <memory>

#include "drafter/decode.h"

namespace dflash::drafter {

// host_weights: any float dtype, on the host or any device (converted to bf16 once);
// embed_tokens / lm_head: the target's bf16 [V, H] tensors on `device` (shared, never written).
// fp8_propose: a propose step's GEMMs (q|k|v, o, gate|up, down and the lm_head) read e4m3 copies of
// their weights with 128 x 128 block scales (made once here; +~50% weight memory, the lm_head's copy
// included) through cuda::gemm_fp8 (cuBLASLt; the streaming kernel where that has none), their inputs quantized
// per token and 128 columns: about
// half the bytes a propose step reads. The drafts may differ from the bf16 proposer's where two
// logits are close; speculative decoding stays lossless (the target verifies every draft). Steps of
// more than 16 rows (several slots) run the bf16 GEMMs. Needs hidden_size, q_dim and
// intermediate_size multiples of 128 (refused at construction otherwise) and sm_89+.
// cuda_graphs: a propose step's kernels as one CUDA graph per (slots, block) shape, captured at the
// shape's second call and replayed after the metadata upload (calls asking for logits run eagerly; a
// failed capture is logged and counted, and that shape runs eagerly: graph_stats()). On by default
// (CudaProposer.GraphReplaysGiveTheEagerDrafts passed on an H100 at 1edc71b; 27B fp8 target, 5-layer
// drafter, block 16: propose 1.83 -> 1.75 ms with the FP8 propose, 2.89 -> 2.82 bf16:
// bench/results/h100-pgraphs-1edc71b). DFLASH_PROPOSE_GRAPHS=1 / 0 overrides the argument.
// add_context calls of at most block_size rows per slot (a speculative step's accepted tokens; part
// of the commit step) can run as graphs too, one per (slots, rows, longest sequence) shape, from fixed
// copies of the features and metadata: with cuda_graphs and DFLASH_CONTEXT_GRAPHS=1. Opt-in: its GPU
// test passed (H100, 2209fd5) but the commit step did not move (0.90 vs 0.89 ms on the 27B shapes,
// bench/results/h100-commit-0ee3d07). Prefill-sized contexts always run eagerly.
std::unique_ptr<Proposer> make_cuda_proposer(const DrafterConfig& config, const DrafterWeights& host_weights,
                                             Tensor embed_tokens, Tensor lm_head, Device device, int64_t num_slots,
                                             int64_t max_len, bool fp8_propose = false, bool cuda_graphs = true);

// The commit step's context update under FP8 propose (issue 30): 1 runs the GEMMs of an add_context of at
// most 16 rows (a speculative step's accepted tokens: fc and each layer's k|v) on e4m3 copies of their weights
// (fc's made at construction, +k·H·H bytes; k|v are rows of the propose copies), the features and the context
// quantized per token and 128 columns: about half the bytes of the drafter's part of a commit step (the 27B
// drafter's fc is 262 MB in bf16). The drafter's context K / V then carry the W8A8 error, as FP8 propose's own
// block K / V do: drafts may change, the output stays the target's. Read at each call (a context graph is
// kept per setting). Default 0: on an H100 the context update alone took 0.316 -> 0.268 ms but the commit step
// 0.400 -> 0.388 (the target's commit beside it; bench/results/h100-stream-f683da9), too little for the W8A8
// error it puts in the context. DFLASH_CONTEXT_FP8=1 sets it at start-up.
extern int cuda_context_fp8;

// Whether a CUDA proposer asked for `requested` replays its propose steps as CUDA graphs here:
// DFLASH_PROPOSE_GRAPHS=1 / 0 overrides the request (make_cuda_proposer; dflash_doctor reports it).
bool cuda_proposer_graphs(bool requested = true);

// The attention kernel the CUDA proposer runs for `config` on `device` ("flash-decoding mma.sync"
// or "fallback"), for reports.
const char* cuda_proposer_attention_kernel(const DrafterConfig& config, Device device);

}  // namespace dflash::drafter
