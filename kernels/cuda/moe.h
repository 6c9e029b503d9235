#pragma once
// Mixture-of-experts family (issue 33): qwen3_5_moe's sparse MoE block on the GPU
// (kernels/cuda/moe.cu). CPU reference: ops::moe_route, ops::moe_experts, ops::add_sigmoid_gated
// (kernels/ops.h, kernels/cpu/moe.cpp), which follow transformers 5.17's Qwen3_5MoeSparseMoeBlock.
//
// The block, for x bf16 [N, H], E experts of width I, top-k routing and a shared expert of width Is:
//   1. router logits  [N, E] fp32  = x · router^T          (gemm_ex, bf16 in, fp32 out)
//   2. moe_topk:      p = softmax(logits) in fp32; each token's k largest p (ties: the lower expert
//                     index, as the CPU's partial_sort comparator); weights = p (/ their sum when
//                     norm_topk_prob); per-expert counts.
//   3. moe_permute:   offsets (exclusive scan of counts), the grouped GEMM's tile table, and the
//                     permutation: row pos of expert e's range [offsets[e], offsets[e+1]) holds token
//                     src_row[pos]; slot_pos[n * k + j] = the row of (token n, choice j).
//   4. grouped GEMMs  (moe_grouped_gemm, tensor cores, mma.sync m16n8k16): act[pos] = silu(g) * u of
//                     x[src_row[pos]] · gate_up[e]^T (the gather and the SwiGLU fused), then
//                     y[pos] = act[pos] · down[e]^T.
//      or the explicit fallback: gather x rows, a loop over experts of gemm_bf16 + swiglu (reads
//                     the counts back to the host: a synchronisation, not graph-capturable).
//   5. moe_combine:   out[n] = sum_j weights[n, j] · y[slot_pos[n, j]] (j in order, fp32)
//                     (+ sigmoid(x[n] · shared_gate) · shared[n] when a shared expert is given).
// The row order inside an expert's range is that of atomic arrival (not token order); every row's
// result depends only on its own token, so outputs are deterministic all the same.
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// Tile of the grouped GEMM in rows (tokens of one expert): the tile table counts ceil(count / this).
constexpr int kMoeTileRows = 64;
// Upper bound of the grouped GEMM's row tiles for N*k routed rows over E experts (grid size).
int64_t moe_max_tiles(int64_t rows, int64_t E);

// logits fp32 [N, E] (row stride E) -> experts i32 [N, k], weights fp32 [N, k], counts i32 [E]
// (zeroed and counted here). Needs 1 <= k <= E <= 1024, k <= 32.
void moe_topk(const float* logits, int64_t N, int64_t E, int64_t k, bool renormalize, int32_t* experts,
              float* weights, int32_t* counts, Stream s);

// From experts [N, k] and counts [E]: offsets i32 [E + 1], tile_offsets i32 [E + 1] (prefix sums of
// ceil(counts / kMoeTileRows)), src_row i32 [N * k], slot_pos i32 [N * k]; cursor i32 [E] scratch.
// With an expert range (expert parallelism: this rank holds experts [expert_begin, expert_begin +
// local_experts); -1: all E) the offsets, tiles and cursor cover the local experts alone
// ([local_experts + 1], expert e at index e - expert_begin) and a choice of any other expert gets
// slot_pos -1 (no row).
void moe_permute(const int32_t* experts, const int32_t* counts, int64_t N, int64_t E, int64_t k, int32_t* offsets,
                 int32_t* tile_offsets, int32_t* cursor, int32_t* src_row, int32_t* slot_pos, Stream s,
                 int64_t expert_begin = 0, int64_t local_experts = -1);

// moe_topk + moe_permute in one launch (one block) for N·k <= kMoeRouteSmallRows routed rows (a decode
// or verify step: moe_block takes it there): the same experts, weights, counts, offsets and tile
// offsets; the rows inside an expert's range in (token, choice) order; cursor left as moe_permute
// leaves it. Needs N >= 1.
inline constexpr int64_t kMoeRouteSmallRows = 1024;
void moe_route_small(const float* logits, int64_t N, int64_t E, int64_t k, bool renormalize, int32_t* experts,
                     float* weights, int32_t* counts, int32_t* offsets, int32_t* tile_offsets, int32_t* cursor,
                     int32_t* src_row, int32_t* slot_pos, Stream s, int64_t expert_begin = 0,
                     int64_t local_experts = -1);

// Grouped GEMM over experts. For every expert e and row pos in [offsets[e], offsets[e+1]), with
// a = x[gather ? src_row[pos] : pos] (bf16 rows of K, row stride ldx):
//   swiglu:  y[pos, c] = silu(a · w[e][c]) * (a · w[e][Nout + c]),  c < Nout; w[e] is [2 Nout, K]
//   else:    y[pos, c] = a · w[e][c],                                c < Nout; w[e] is [Nout, K]
// w: E consecutive bf16 matrices (the checkpoint's fused experts), y bf16 [N*k, Nout] row stride ldy.
// Needs K % 8 == 0, ldx % 8 == 0, 16-byte aligned x and w. max_tiles: moe_max_tiles(N*k, E).
struct MoeGemmParams {
  const void* x = nullptr;
  int64_t ldx = 0;
  const int32_t* src_row = nullptr;  // gather rows (nullptr: a = x[pos])
  const void* w = nullptr;
  void* y = nullptr;
  int64_t ldy = 0;
  const int32_t* offsets = nullptr;       // [E + 1]
  const int32_t* tile_offsets = nullptr;  // [E + 1]
  int64_t E = 0, Nout = 0, K = 0, max_tiles = 0;
  bool swiglu = false;
  int64_t rows = -1;  // the routed rows (offsets[E]) when the host knows them: picks the tiling
  // The most rows an expert (or the extra group) can hold when the host knows it (a step of N tokens:
  // N, each token choosing an expert once): <= 16 picks the deep tiling's 16-row blocks.
  int64_t max_expert_rows = -1;
  int wgmma = -1;     // the wgmma kernel: -1 as tuning::moe_wgmma says, 1 for this call where supported, 0 not
  // FP8 weights (W8A16): w holds e4m3 codes and w_scale their 128 x 128 block scales, f32
  // [E, row blocks, ceil(K/128)], the rows [0, Nout) and [Nout, 2 Nout) (swiglu's gate and up) blocked
  // apart (moe_fp8.cuh); every weight reads as the bf16-rounded code · scale (the bf16 experts' bits).
  // Needs K % 16 == 0.
  const float* w_scale = nullptr;
  // An extra dense group in the same launch (the shared expert of a decode / verify step: its GEMM
  // rides beside the routed experts' instead of three launches after them): rows [0, extra_rows) of
  // extra_x (no gather, row stride ldx) through extra_w (bf16, [2 Nout, K] with swiglu, else [Nout,
  // K]) into extra_y (row stride ldy), in blocks past max_tiles (moe_extra_tiles of them). bf16
  // weights only (no w_scale).
  const void* extra_x = nullptr;
  const void* extra_w = nullptr;
  void* extra_y = nullptr;
  int64_t extra_rows = 0;
  // The mma.sync kernel launches with programmatic dependent launch (pdl.cuh): the extra group's
  // blocks issue their first weight loads before the wait. routing_settled: offsets, tile_offsets
  // and src_row were written before the launch preceding this one (moe_block's down GEMM: by the
  // routing, before the gate|up GEMM), so every block finds its tile and issues its first weight loads
  // before the wait, under the previous kernel's tail. (Every PDL kernel of the MoE block signals its
  // dependents only after its own wait, which makes "two launches back" complete by then.)
  bool routing_settled = false;
};
void moe_grouped_gemm(const MoeGemmParams& p, Stream s);
// Whether moe_block runs the shared expert as the grouped GEMMs' extra group: a shared expert as wide
// as the routed ones (Is == I), bf16 weights in the call (not the FP8 codes), and a decode-sized call
// (1..kMoeNarrowRows routed rows), or as tuning::moe_fuse_shared says (-1 this rule, 0 never, 1 for
// every such call whatever its size). Otherwise: gemm_bf16, swiglu, gemm_bf16 after the experts.
bool moe_fuse_shared(bool shared, int64_t I, int64_t Is, int64_t routed_rows, bool fp8_codes);
namespace tuning {
extern int moe_fuse_shared;
}  // namespace tuning
inline int64_t moe_extra_tiles(const MoeGemmParams& p) { return p.extra_w ? (p.extra_rows + kMoeTileRows - 1) / kMoeTileRows : 0; }
// The grouped GEMM's three tilings give the same bits (the same mma k16 steps per element in the same
// K order); narrow tiles (64 weight rows a block, 32-column k tiles, 5 stages) have twice the blocks
// and more loads in flight, for few routed rows, where the experts' weight reads are the cost; deep
// ones (64 rows, 128-column k tiles, 3 stages: 32 KB of weights in flight a block, 2 blocks an SM) for the fewest
// (a decode or verify step: 8-128 rows at 35B-A3B shapes, ~128 blocks a call); wide ones (128, 3
// stages) read each row tile half as often.
inline constexpr int64_t kMoeNarrowRows = 512;
inline constexpr int64_t kMoeDeepRows = 128;
bool moe_narrow_tiles(const MoeGemmParams& p);  // narrow (or deep): rows known and <= kMoeNarrowRows, or the knob
bool moe_deep_tiles(const MoeGemmParams& p);    // deep: rows known and <= kMoeDeepRows, or the knob
// Deep tiles of 16 rows (16 x 64 blocks, 5 stages: 2 blocks an SM with 64 KB of weights in flight
// each, where the 64-row deep block's A tile, all but a row or two zero in a decode step, took half the
// shared memory): deep and max_expert_rows known and <= 16, or the knob.
bool moe_deep16_tiles(const MoeGemmParams& p);
// The 16-row deep blocks of a short K (<= kMoeDeep16ShortK: 4 k tiles, the down GEMM at 35B-A3B's I 512)
// with 3 stages (FP8 codes 4) where 5 (8) held shared memory for k tiles that do not exist: 3 blocks an SM
// instead of 2, so a one-token down GEMM's 288 blocks run in one wave, not 1.2 (ncu,
// bench/results/h100-moe8-7ba8105). The same bits. tuning::moe_deep16_short: -1 this rule, 0 never, 1 always.
inline constexpr int64_t kMoeDeep16ShortK = 512;
bool moe_deep16_short(const MoeGemmParams& p);
namespace tuning {
extern int moe_deep16_short;
// -1 automatic (moe_narrow_tiles(p), moe_deep_tiles(p), moe_deep16_tiles(p)), 0 wide, 1 narrow, 2 deep,
// 3 deep with 16-row blocks (tests, benches).
extern int moe_narrow_tiles;
// The wgmma kernel (moe_sm90.cu) for bf16 weights on an sm_90 device: -1 for the wide tiling's calls
// (the default: prefill; a call's MoeGemmParams::wgmma overrides it), 0 never (the mma.sync kernels),
// 1 for every bf16 call.
extern int moe_wgmma;
// FP8 experts on the grouped path: 0 the GEMMs read the codes; 1 a bf16 copy of the layer's experts
// is written first and read by the wgmma kernel (the fallback's way); -1 (the default) the copy for
// large prefills on sm_90 (moe_fp8_scratch says which; moe_bench compares the two) ...
extern int moe_fp8_dequantize_first;
}  // namespace tuning
// ... from this many routed rows on. Measured on an H200 (bench/results/h200-moe6-c4bc6aa, moe_bench at
// 35B-A3B shapes): 2,048 tokens (16,384 rows) codes 0.95 ms a block vs the copy + wgmma 1.35; 8,192
// (65,536 rows) 2.88 vs 2.48: the copy costs ~0.66 ms a layer, the codes kernel (mma.sync) ~0.016 ms
// more than wgmma per 1,000 rows; they cross near 40,000.
inline constexpr int64_t kMoeFp8ScratchRows = 40960;

// The one-token expert GEMMs on a balanced one-wave grid (moe_stream.cu: items of (active expert or the
// extra group, 64 weight rows, a K piece fixed by K) split evenly over every resident warp, each warp's
// weights through one cp.async ring; a tile's pieces summed in piece order by the warp that brings the
// last, through a per-device workspace): bf16 weights, the routed rows known (MoeGemmParams::rows) and
// every expert and the extra group <= 16 rows (max_expert_rows: a decode / verify step of <= 16 tokens).
// A token row's bits depend on neither N nor the grid (decode == verify); not the 16-row deep blocks'
// bits (another summation order: equal to f32 rounding). moe_grouped_gemm takes it where moe_streamk(p).
bool moe_streamk_supported(const MoeGemmParams& p);
bool moe_streamk(const MoeGemmParams& p);  // tuning::moe_streamk == 1 and supported
void moe_grouped_gemm_stream(const MoeGemmParams& p, Stream s);
// K pieces: a tile's K columns in ceil(K / c) pieces of c = ceil(ceil(K / 128) / pieces) · 128 columns
// (at 35B-A3B shapes 8 of 256 for gate|up, 4 of 128 for down).
inline constexpr int kMoeStreamkPieces = 8;
namespace tuning {
// -1 (the default) and 0: the other tilings (the stream-K kernel loses to deep16: the one-token block 0.078
// against 0.043 ms on an H200, bench/results/h200-fp8head-5d8af27); 1: every supported call (tests,
// benches: moe_bench's /streamk rows).
extern int moe_streamk;
extern int moe_streamk_blocks;  // its grid: 0 every resident block (one wave), > 0 this many (tests)
extern int moe_streamk_pieces;  // kMoeStreamkPieces; another value gives other bits (the same at every N)
}  // namespace tuning

// The grouped GEMM on Hopper warpgroup MMA (moe_sm90.cu; bf16 weights, no w_scale), which
// moe_grouped_gemm runs where tuning::moe_wgmma says and moe_wgmma_supported(device): an sm_90 GPU
// and this build's sm_90a code.
void moe_grouped_gemm_wgmma(const MoeGemmParams& p, Stream s);
bool moe_wgmma_supported(int device);

// y[pos, :] = x[src_row[pos], :] for pos < rows (bf16, H columns, contiguous).
void moe_gather(const void* x, const int32_t* src_row, int64_t rows, int64_t H, void* y, Stream s);

// out[n, :] = sum_j weights[n, j] * y[slot_pos[n, j], :] (+ sigmoid(x[n] · gate_w) * shared[n, :]
// when shared != nullptr; x, gate_w [H] bf16), bf16 out [N, H] contiguous, fp32 math. Rows n >=
// routed (routed < 0: every row is routed) have no routed term; slot_pos / weights hold the routed rows.
// A choice with slot_pos -1 (an expert of another rank) adds nothing. Launched with programmatic
// dependent launch (pdl.cuh); settled: slot_pos, weights and x were written before the launch
// preceding this one (moe_block), so the gate's dot product and the choices are read before the
// wait, under the previous kernel's tail.
void moe_combine(const void* y, const int32_t* slot_pos, const float* weights, int64_t N, int64_t k, int64_t H,
                 const void* shared, const void* x, const void* gate_w, void* out, Stream s, int64_t routed = -1,
                 bool settled = false);

// ---- The whole block --------------------------------------------------------------------------------
// Grouped: the steps above. Fallback: the per-expert gemm_bf16 loop. Decode (kernels/cuda/moe_decode.cu,
// N <= kMoeDecodeMaxRows): a decode / verify step's block in three kernels, each weight row streamed
// once by one warp against the few token rows (at one token the 11 launches of the grouped path
// cost as much as reading the 8 experts' 50 MB, h200-moe5-441b581):
//   1. moe_decode_router:  router logits [N, E] and the shared gate's logit [N], fp32, a warp a weight row;
//   2. moe_decode_gate_up: per routed (token, choice) the top-k of its token (moe_topk.cuh's warp_topk,
//                          as moe_topk routes; with > 2 routed tokens a top-k kernel runs it once per
//                          token before), then act = silu(x · gate_c) * (x · up_c) a warp a column
//                          (the grouped kernel's rounding: fp32 dots, one bf16 rounding); the shared
//                          expert's act for the routed tokens (gemm_bf16 + swiglu's roundings);
//   3. moe_decode_down:    out[n, h] = sum_j w_j · bf16(act_j · down_e_j[h]) + sigmoid(gate_n) ·
//                          bf16(sact_n · shared_down[h]), in moe_combine's order, a warp an (h, n).
// Each token's arithmetic is the same whatever N is (a T = 1 decode and a T = 16 verify give a row
// the same bits); the dot products' order differs from the mma kernels', so Decode and Grouped agree
// to rounding, not bit for bit. Rows n >= routed (pad rows) are written as zeros: nothing reads them.
enum class MoeImpl { Grouped, Fallback, Decode };
const char* moe_impl_name(MoeImpl impl);  // "moe_grouped_mma" / "moe_loop_gemm_bf16" / "moe_decode_gemv"
inline constexpr int64_t kMoeDecodeMaxRows = 16;

struct MoeBlockParams {
  const void* x = nullptr;  // bf16 [N, H] contiguous
  int64_t N = 0, H = 0, E = 0, k = 0, I = 0, Is = 0;
  // Rows routed to experts: the first `routed` of the N (-1: all). The rows after them (a decode
  // step's pad rows, which belong to no sequence) get the shared expert's term alone, so they add
  // no experts to the step's weight reads; the router and shared-expert GEMMs still run on all N
  // rows (the same GEMM shapes whatever the number of real rows: batch invariance).
  int64_t routed = -1;
  // Expert parallelism (target_model/tp.h): this rank holds experts [expert_begin, expert_begin +
  // local_experts) of the E the router scores (experts_gate_up / experts_down hold those alone, I
  // and Is this rank's slices); a choice of another rank's expert adds nothing here. The ranks'
  // partial outputs are summed by the caller (the TP group's all-reduce). -1: every expert.
  int64_t expert_begin = 0, local_experts = -1;
  int wgmma = -1;  // the grouped path's expert GEMMs on the wgmma kernel: MoeGemmParams::wgmma
  bool renormalize = true;
  const void* router = nullptr;           // bf16 [E, H]
  const void* experts_gate_up = nullptr;  // bf16 [local experts, 2I, H] (or e4m3 codes: below)
  const void* experts_down = nullptr;     // bf16 [local experts, H, I]
  // FP8 experts (W8A16, kernels/cuda/moe_fp8.cuh): experts_gate_up / experts_down hold e4m3 codes and
  // these their 128 x 128 block scales, f32 [El, 2·ceil(I/128), ceil(H/128)] (the gate rows' blocks,
  // then the up rows') and [El, ceil(H/128), ceil(I/128)]; every weight reads as the bf16-rounded
  // code · scale, the bf16 experts' values, so the outputs are the bf16 experts' bits. The decode
  // kernels and the grouped GEMMs read the codes; the fallback (and the grouped path's wgmma calls,
  // moe_fp8_scratch) reads a bf16 copy that moe_block writes into experts_scratch first.
  const float* experts_gate_up_scale = nullptr;
  const float* experts_down_scale = nullptr;
  void* experts_scratch = nullptr;
  const void* shared_gate_up = nullptr;   // bf16 [2 Is, H] (gate rows, then up rows); nullptr: no shared expert
  const void* shared_down = nullptr;      // bf16 [H, Is]
  const void* shared_gate = nullptr;      // bf16 [H] (mlp.shared_expert_gate.weight)
  void* out = nullptr;                    // bf16 [N, H]
  void* workspace = nullptr;              // moe_workspace_bytes(...) bytes, 16-byte aligned
  // Optional copies out (device): the router's choices.
  int32_t* experts_out = nullptr;  // [routed, k]
  float* weights_out = nullptr;    // [routed, k]
  float* logits_out = nullptr;     // [N, E] fp32: the router logits x · router^T
  // Tests: route by these fp32 logits [N, E] (device) instead of the router's own (still computed,
  // into logits_out when given): a reference's routing forced onto the GPU's activations.
  const float* logits_in = nullptr;
};
size_t moe_workspace_bytes(int64_t N, int64_t H, int64_t E, int64_t k, int64_t I, int64_t Is, MoeImpl impl);
// The bf16 copy of El FP8 experts (gate|up, then down) for the grouped GEMMs / the fallback.
size_t moe_experts_scratch_bytes(int64_t El, int64_t I, int64_t H);
// Whether moe_block with FP8 experts on `impl`, `routed_rows` = routed tokens x k, `wgmma` =
// MoeBlockParams::wgmma, on `device` reads a bf16 copy of the experts (MoeBlockParams::experts_scratch,
// moe_experts_scratch_bytes): the fallback always, the grouped path as tuning::moe_fp8_dequantize_first
// says (by default where its calls take the wgmma kernel, from kMoeFp8ScratchRows), the decode kernels never.
bool moe_fp8_scratch(MoeImpl impl, int64_t routed_rows, int wgmma, int device);
// y bf16 [El, R, K] = the bf16-rounded code · scale of e4m3 codes q [El, R, K] with block scales
// [El, row blocks, ceil(K/128)], rows [0, split) and [split, R) blocked apart (gate|up: R = 2I,
// split = I; down: split = R). Needs K % 8 == 0, 16-byte aligned y and 8-byte aligned q.
void moe_dequantize_experts(const void* q, const float* scale, int64_t El, int64_t R, int64_t K, int64_t split, void* y,
                            Stream s);
// The inverse for bf16 experts w [El, R, K]: codes q [El, R, K] and block scales as above, each
// expert's row parts quantized apart (quantize_fp8_weight, gemm.h: amax / 448 per 128 x 128 block).
// Needs K % 16 == 0, (R - split) and split multiples of 16 or the whole R, 16-byte aligned w and q.
void moe_quantize_experts(const void* w, int64_t El, int64_t R, int64_t K, int64_t split, void* q, float* scale, Stream s);
// The same with given block scales (an FP8 checkpoint's own): q = the e4m3 code nearest to w / scale.
// For w holding the bf16-rounded code · scale this recovers the code (bf16's 2^-9 relative error is
// far below e4m3's half step), so the FP8 experts hold the checkpoint's own codes again. K % 8 == 0.
void moe_quantize_experts_scaled(const void* w, int64_t El, int64_t R, int64_t K, int64_t split, const float* scale,
                                 void* q, Stream s);
void moe_block(const MoeBlockParams& p, MoeImpl impl, int device);

// The Decode impl's kernels on buffers moe_block carves from its workspace: logits fp32 [N, E],
// gate_logit fp32 [N], experts i32 / weights fp32 [routed, k], act bf16 [routed·k, I], sact bf16
// [routed, Is]. Needs 1 <= N <= kMoeDecodeMaxRows, E <= 1024, k <= 32, H, I, Is multiples of 8.
struct MoeDecodeBuffers {
  float* logits = nullptr;
  float* gate_logit = nullptr;
  int32_t* experts = nullptr;
  float* weights = nullptr;
  void* act = nullptr;
  void* sact = nullptr;
};
void moe_decode_block(const MoeBlockParams& p, const MoeDecodeBuffers& b, Stream s);
namespace tuning {
// The decode kernels' routing: -1 automatic (a top-k kernel first when more than 2 tokens are routed,
// else inside each gate|up block), 0 always inside the blocks, 1 always first (tests, benches).
extern int moe_decode_topk_first;
}  // namespace tuning

}  // namespace dflash::cuda
