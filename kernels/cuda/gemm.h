#pragma once
// GEMM family: the target's bf16 projections (gemm_bf16), the drafter's general row-major GEMM
// (gemm_ex, forward and backward), and the FP8 block-scaled GEMM with its operand quantizers
// (kernels/cuda/gemm.cpp on cuBLASLt; the quantizers in fp8.cu). CPU reference: ops::linear,
// ops::quantize_fp8_act / quantize_fp8_weight (kernels/ops.h).
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// ---- GEMM (cuBLASLt) ----------------------------------------------------------------------------
// y[M, N] (row stride ldy) = x[M, K] (row stride ldx) · w[N, K]^T  (+ y when accumulate)
// bf16 inputs, fp32 accumulation, bf16 output. w is the Hugging Face Linear weight, row-major.
// Uses the device's DeviceContext (stream, cuBLASLt handle, workspace); algorithms are cached per
// shape. M == 0 is a no-op.
//
// Alignment: by default every operand must be 16-byte aligned with row strides (and K) multiples
// of 8 elements — what the fast tensor-core kernels need; a misaligned operand is refused (it is
// almost always a wrong offset upstream). `unaligned` is the explicit fallback for models whose
// sizes are not multiples of 8 (hidden_size 1001, head dims like 36, ...; the fast-path plan's gemm
// step says so): the operands then need only element alignment (2 bytes bf16, 4 fp32) and cuBLASLt
// is told each operand's real alignment, so it picks kernels that serve it (slower ones).
struct GemmParams {
  const void* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;
  void* y = nullptr;
  int64_t ldy = 0;
  int64_t M = 0, N = 0, K = 0;
  bool accumulate = false;
  bool unaligned = false;  // allow operands that are not 16-byte aligned (see above)
};
void gemm_bf16(const GemmParams& p, int device);
// Algorithm choice per shape: off (default) takes cuBLASLt's first heuristic answer; on times its
// top 16 answers on the first call of each non-accumulating shape and keeps the fastest (~0.1-1 s
// once per shape). Also enabled by DFLASH_GEMM_AUTOTUNE=1. Switching drops the cached plans.
void set_gemm_autotune(bool on);
bool gemm_autotune();

// ---- General GEMM (cuBLASLt), row-major ------------------------------------------------------------
//   D[M, N] (row stride ldd) = alpha · op(A) · op(B) + beta · D
//   A: [M, K] row-major (lda >= K), or when trans_a its transpose stored as [K, M] (lda >= M);
//   B: [K, N] row-major (ldb >= N), or when trans_b its transpose stored as [N, K] (ldb >= K).
// A and B bf16, fp32 accumulation; D fp32 (d_f32) or bf16. beta 0 never reads D.
// The training uses:  y = x·wᵀ (trans_b), dx = dy·w, dw (+)= dyᵀ·x (trans_a, fp32 D, beta 1).
// M == 0 or N == 0 is a no-op; K == 0 scales D by beta. Alignment and `unaligned` as for GemmParams
// (the fast path needs 16-byte aligned A, B, D with lda, ldb multiples of 8 and ldd of 8 bf16 / 4 fp32).
struct GemmExParams {
  const void* a = nullptr;
  int64_t lda = 0;
  bool trans_a = false;
  const void* b = nullptr;
  int64_t ldb = 0;
  bool trans_b = false;
  void* d = nullptr;
  int64_t ldd = 0;
  bool d_f32 = false;
  int64_t M = 0, N = 0, K = 0;
  float alpha = 1.0f, beta = 0.0f;
  bool unaligned = false;  // allow operands that are not 16-byte aligned (see GemmParams)
};
void gemm_ex(const GemmExParams& p, int device);


// ==== FP8: block-scaled e4m3 (issue 18; kernels/cuda/fp8.cu, gemm_fp8 in kernels/cuda/gemm.cpp) ====
// The official -FP8 checkpoints' format (core/fp8.h, the CPU reference in kernels/ops.h "fp8"):
// weights [N, K] as e4m3 codes with one f32 dequantization scale per 128 x 128 block, activations
// quantized per token and 128-column group at run time (DeepSeek-V3's recipe). Codes are uint8_t
// (e4m3 "fn" bit patterns); scales are dequantization scales (value ~= e4m3(code) * scale), laid
// out as cuBLASLt's block-scaling modes read them, so gemm_fp8 consumes them without a copy:
//   activation scale of (token m, group g):  scale[g * fp8_act_scale_ld(M) + m]
//       (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F on the [K, M] column-major operand: token index
//       contiguous, one row of fp8_act_scale_ld(M) floats per 128-column group)
//   weight scale of block (nb, kb):         scale_inv[nb * fp8_weight_scale_ld(K) + kb]
//       (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F: the K-block index contiguous, each row of
//       blocks padded to a multiple of 4 floats)
// Both established on an H200 (cuBLASLt 13.1) against the CPU reference: see gemm.cpp's gemm_fp8 part.

// Row stride (floats) between the 128-column groups of an activation's scales (M rounded up to 4:
// the layout of the GEMM on the padded rows, which gemm_fp8 needs), and the number of floats a
// scale buffer of an [M, K] activation needs (callers allocate this; the quantizers write its
// padding entries too, as 1.0).
int64_t fp8_act_scale_ld(int64_t M);
size_t fp8_act_scale_elems(int64_t M, int64_t K);
// Row stride (floats) between the 128-row blocks of a weight's scales (>= ceil(K / 128)).
int64_t fp8_weight_scale_ld(int64_t K);

// Dynamic per-token group quantization, as ops::quantize_fp8_act bit for bit (for the same values in
// f32): per (token m, group g of 128 columns; the last group may be partial and covers only the
// existing columns) scale = max(amax, 1e-10) / 448, q = e4m3(clamp(x * (1 / scale), +-448)) (one
// correctly rounded reciprocal per group, round to nearest even). Memory bound: 2·M·K bytes read, M·K + 4·M·ceil(K/128) written.
struct Fp8ActQuantParams {
  const void* x = nullptr;  // bf16 [M, K], row stride ldx
  int64_t ldx = 0;
  uint8_t* q = nullptr;     // e4m3 [M, K], row stride ldq
  int64_t ldq = 0;
  float* scale = nullptr;   // fp8_act_scale_elems(M, K) floats (layout above)
  int64_t M = 0, K = 0;
};
// Needs K % 16 == 0, x and q 16-byte aligned, ldx % 8 == 0, ldq % 16 == 0 (what gemm_fp8 needs of
// its codes anyway), scale 16-byte aligned. M == 0 is a no-op.
void quantize_fp8_act(const Fp8ActQuantParams& p, Stream s);

// Block quantization of a bf16 weight [N, K] (contiguous), as ops::quantize_fp8_weight bit for bit:
// per 128 x 128 block (partial at the edges) scale_inv = max(amax, 1e-10) / 448 written to
// scale_inv[nb * ld_scale + kb] (ld_scale >= ceil(K / 128); pass fp8_weight_scale_ld(K) for
// gemm_fp8; padding entries are not written), q [N, K] contiguous. For bf16 checkpoints and random
// weights at load time. Needs K % 16 == 0 and 16-byte aligned w and q.
void quantize_fp8_weight(const void* w_bf16, int64_t N, int64_t K, uint8_t* q, float* scale_inv, int64_t ld_scale,
                         Stream s);

// The FP8 drafter's operands (issue 31; DeepSeek-V3's training tiles, Transformer Engine's
// Float8BlockScaling), as cpu::fake_quantize_e4m3 (kernels/cpu/train_ops.h) bit for bit: every tile's
// scale = max(amax, 1e-10) / 448, codes e4m3(clamp(x * (1 / scale), +-448)) (the activation arithmetic,
// one reciprocal per tile, for weights too). x is bf16 [rows, cols] (row stride ldx); per mode:
//   block (128 x 128 tiles, weights [N, K]): optional q [rows, cols] (row stride ldq) with
//       scale[rb * lds + cb] (gemm_fp8's weight layout: lds = fp8_weight_scale_ld(cols)), and optional
//       qt = the transpose [cols, rows] (row stride ldqt) with scale_t[cb * ldst + rb]
//       (ldst = fp8_weight_scale_ld(rows)): the weight of dx = dy · w as gemm_fp8 takes it (its columns
//       [rows, rows rounded up to 16) written as codes 0, so ldqt >= that);
//   columns (128 x 1 tiles: 128 rows of one column, the tokens of a weight gradient dw = dyᵀ·x):
//       qt [cols, rows_padded] (row stride ldqt), codes of rows in [rows, rows_padded) 0, with
//       scale_t[g * ldst + c] (g = row / 128; ldst = fp8_act_scale_ld(cols); cols % 8 == 0 leaves no
//       padding entries): gemm_fp8's activation layout, for either operand (w_vec_scales); and, optional,
//       q [rows, cols] (row stride ldq) as quantize_fp8_act writes it, bit for bit (1 x 128 per row, its
//       scales at scale[g * lds + row], lds = fp8_act_scale_ld(rows), the padding rows' entries 1): both
//       encodings of an output gradient (dx = dy·w takes q, dw = dyᵀ·x takes qt) from one read.
// Needs cols % 8 == 0, ldx % 8 == 0, 16-byte aligned x, q, qt, ldq and ldqt multiples of 16,
// rows_padded a multiple of 16 (>= rows). Memory bound: 2·rows·cols read, 1 or 2 bytes per element written.
struct Fp8TileQuantParams {
  const void* x = nullptr;
  int64_t ldx = 0;
  int64_t rows = 0, cols = 0;
  bool block = true;                 // 128 x 128 tiles; false: 128 x 1 (columns)
  uint8_t* q = nullptr;              // optional: the 128 x 128 (block) or 1 x 128 (columns) codes
  int64_t ldq = 0;
  float* scale = nullptr;
  int64_t lds = 0;
  uint8_t* qt = nullptr;             // the transposed codes (optional in block mode)
  int64_t ldqt = 0;
  int64_t rows_padded = 0;           // columns mode: qt's columns written (0 = rows rounded up to 16)
  float* scale_t = nullptr;
  int64_t ldst = 0;
};
void quantize_fp8_tiles(const Fp8TileQuantParams& p, Stream s);

// y[M, N] (bf16, row stride ldy) = x[M, K] · w[N, K]^T with both operands e4m3 codes and block
// scales, fp32 accumulation (per 128-column group the code products summed, times the two scales),
// through cuBLASLt on the device's DeviceContext; algorithms cached per shape like gemm_bf16 (and
// autotuned under the same switch). tensor_scales: x_scale and w_scale point to one float each
// (plain per-tensor scaling: the dense FP8 ceiling kernel_bench compares against).
//
// For training (the FP8 drafter, issue 31): y_f32 writes fp32 y (row stride ldy % 4 == 0) and
// accumulate adds to it (beta 1: the weight gradients' dw += dyᵀ·x); w_vec_scales scales w per row and
// 128-column group like x (w_scale[g * fp8_act_scale_ld(N) + n]: both operands 1 x 128, the weight
// gradient's form), else 128 x 128 blocks. The streaming kernel below serves y_f32 and accumulate (not
// w_vec_scales or tensor_scales).
struct GemmFp8Params {
  const uint8_t* x = nullptr;   // e4m3 [M, K], row stride ldx
  int64_t ldx = 0;
  const float* x_scale = nullptr;  // quantize_fp8_act's layout (fp8_act_scale_ld(M))
  const uint8_t* w = nullptr;   // e4m3 [N, K] contiguous
  const float* w_scale = nullptr;  // [ceil(N/128), fp8_weight_scale_ld(K)] (w_vec_scales: the x layout over N)
  void* y = nullptr;            // bf16 (y_f32: fp32) [M, N], row stride ldy
  int64_t ldy = 0;
  int64_t M = 0, N = 0, K = 0;
  bool tensor_scales = false;
  bool w_vec_scales = false;
  bool y_f32 = false;
  bool accumulate = false;      // y += (y_f32 only)
  // Or nullptr: w also in the streaming kernel's packed unit layout (pack_stream_weight), which
  // gemm_fp8_stream reads instead of w (the same bits); cuBLASLt reads w.
  const uint8_t* w_packed = nullptr;
};
// Needs 16-byte aligned pointers, K % 16 == 0, ldx % 16 == 0, ldy % 8 == 0, and with block scales
// M % 4 == 0 (cuBLASLt has no block-scaled kernel for other M: pad the rows, see gemm.cpp); throws
// naming the shape and the GPU when the installed cuBLASLt has no algorithm for it (block scaling
// needs sm_90 and cuBLAS >= 12.9). M == 0 is a no-op.
void gemm_fp8(const GemmFp8Params& p, int device);
// The kernel gemm_fp8 runs, in words ("cublasLt e4m3 VEC128xBLK128x128").
const char* gemm_fp8_kernel_name();

// Streaming FP8 skinny GEMM (issue 30; kernels/cuda/gemm_stream.cu): gemm_fp8's operands and result
// for 1 <= M <= 16 (no M % 4 needed), block scales only, K % 128 == 0, y bf16 or f32 (y_f32; accumulate:
// y += x · wᵀ, each output added once); each weight byte read once
// with 16-byte loads into a per-warp register ring over a one-wave stream-K grid, mma.sync e4m3 (sm_89+;
// run on sm_90).
// gemm_fp8 runs it on sm_90 where cuBLASLt has no block-scaled kernel (M % 4 != 0), or for every
// shape it supports when tuning::gemm_fp8_stream == 1 (kernel_bench's stream_e4m3 rows); the
// model's decode / verify steps run it where the decode plan's skinny GEMMs are on (slower than cuBLASLt at M 16:
// bench/results/h100-stream2-7ce8e65; off by default). Same sums as
// ops::gemm_fp8_blockwise (per group code products in fp32, times the two scales), in another
// order, fixed by N, K and the device (deterministic, and a row's result does not depend on M).
// Uses a per-device workspace (2 KB per resident block, allocated on first use) on the stream it
// is given: launches on one device are stream-ordered (dflash's single stream per device). Throws
// naming the shape for what it cannot do.
bool gemm_fp8_stream_supported(const GemmFp8Params& p);
// The streaming kernel's packed weight layout: every (16-row tile, 128-byte column run) unit's 2 KB
// contiguous, tile-major, in the order its lanes load them (rows past N zero), so a warp's loads of a
// unit read one 2 KB run instead of 64-byte pieces of 16 rows (bench/probes/fp8_gemv_probe.cu: the
// checkpoint layout cost ~8-10% of the weight stream). A decode-only copy (GemmFp8Params::w_packed) of
// stream_packed_bytes(N, row_bytes) bytes (N rounded up to 16 rows) of the row-major [N, row_bytes] w;
// row_bytes a multiple of 128, 16-byte aligned pointers.
int64_t stream_packed_bytes(int64_t N, int64_t row_bytes);
void pack_stream_weight(const void* w, int64_t N, int64_t row_bytes, void* packed, Stream s);
void gemm_fp8_stream(const GemmFp8Params& p, int device, Stream s);
// The blocks gemm_fp8_stream launches for p on device (its one-wave grid: the register ring's, or on a packed
// weight with the bulk ring on, the bulk kernel's, which fits fewer blocks an SM for rings of more than ~100 KB
// a block). The sums' order and so the output bits depend on it: two launches with the same grid give the
// same bits (row-major or packed weight, either ring).
int gemm_fp8_stream_grid(const GemmFp8Params& p, int device, Stream s);
const char* gemm_fp8_stream_kernel_name();
namespace tuning {
extern int gemm_fp8_stream;  // -1 automatic (stream only for M % 4 != 0), 0 never, 1 whenever supported
// On a packed weight (w_packed) the streaming kernel takes its units through per-warp rings in shared
// memory filled by the copy engine (cp.async.bulk on mbarriers, sm_90): gemm_fp8_stream_stages slots of
// gemm_fp8_stream_chunk 2-KB units (DFLASH_FP8_STREAM_STAGES / _CHUNK; chunk default 2), the copies with
// an L2 evict-first hint unless gemm_fp8_stream_evict_first is 0 (DFLASH_FP8_STREAM_EVICT_FIRST). Stages
// default 0, the register ring as on row-major weights: the shared-memory ring loses to cuBLASLt by 8-27% at
// M 16 on an H100 (bench/results/h100-bulkring-384ebce).
extern int gemm_fp8_stream_stages;
extern int gemm_fp8_stream_chunk;
extern int gemm_fp8_stream_evict_first;
// The register ring's depth (units of weight loads in flight a warp; 2, 3 or 4, default 2 since session 41;
// DFLASH_FP8_STREAM_DEPTH): the same bits at any depth. Depth 4 spills at the kernel's 128 registers
// (36 / 92 bytes of spill stores / loads), 2 and 3 do not; 2 is 4-17% faster than 4 on every decode shape
// (kernel_bench --only fp8 on an H100, bench/results/h100-stream-f683da9).
extern int gemm_fp8_stream_depth;
// How the streaming kernels' register rings (FP8 and bf16) sum the pieces of tiles that several warps share
// (DFLASH_STREAM_FIXUP; the bf16 kernel takes block or warp):
// 0 block (default): the block's warps meet at a barrier, the block sums its pieces and the last block of a
// tile shared by blocks sums their slots; 2 warp: a warp that ends a piece writes it to its own slot and the
// last warp of the tile sums them in global warp order (no barrier; deterministic, batch invariant, other
// bits than block's where a tile spans more than two blocks' warps); 1 atomic: every piece added into the
// output with fp32 atomics, no fix-up — a timing experiment only (kernel_bench: what a fix-up costs), never in
// a plan: the sums' order then depends on timing, and only an f32 accumulate output (y_f32, accumulate) is taken.
extern int gemm_stream_fixup;
}  // namespace tuning

// ---- Weights into L2 ahead of a decode GEMM (issue 30; kernels/cuda/gemm_prefetch.cu) ----------------
// Hints L2 to fetch the first bytes_per_row bytes of each of `rows` rows (row stride row_bytes) at w:
// the model forks it onto a side stream after a decode step's GEMM, so the next GEMM's weights start
// to travel while the short ops between the two run. Writes nothing (no reference to compare: the
// decode steps' outputs stay the same bits, CudaDecoder.L2PrefetchLeavesEveryStepBitForBit).
// Needs w, row_bytes and bytes_per_row 16-byte aligned (cp.async.bulk), 0 < bytes_per_row <= row_bytes.
struct L2PrefetchParams {
  const void* w = nullptr;
  int64_t rows = 0, row_bytes = 0, bytes_per_row = 0;
};
bool prefetch_l2_supported(const L2PrefetchParams& p);
void prefetch_l2(const L2PrefetchParams& p, Stream s);
// The equal prefix of every row that fits `budget` bytes, in multiples of 16 (0 when less than 16 a row).
int64_t l2_prefetch_bytes_per_row(int64_t rows, int64_t row_bytes, int64_t budget);
namespace tuning {
extern int decode_prefetch_mb;    // the bytes fetched ahead of each decode GEMM, MiB (default 8; DFLASH_DECODE_PREFETCH_MB)
extern int decode_prefetch_bulk;  // 1: cp.async.bulk.prefetch.L2 on sm_90 (default); 0: prefetch.global.L2 per line
}  // namespace tuning

// ---- Skinny bf16 GEMM for decode / verify (issue 30; kernels/cuda/gemm_skinny.cu) ----------------
// y[M, N] (row stride ldy) = x[M, K] · w[N, K]^T for 0 <= M <= 16, bf16 in and out, fp32
// accumulation, each weight byte read once with 16-byte loads (mma.sync, sm_80+; K splits over
// thread-block clusters on sm_90). swiglu: x is SwiGLU's input gu [M, 2K] (row stride ldx, gate
// columns [0, K), up [K, 2K)) and the GEMM multiplies silu(gate) * up rounded to bf16 — what
// cuda::swiglu writes — so swiglu + gemm_skinny and the fused call agree bit for bit. Each output
// depends only on its own x row and weight row, in a fixed order (batch invariance across M).
// Launched with programmatic dependent launch where pdl.cuh enables it (its weight loads start
// under the previous kernel). CPU reference: ops::linear; cuBLASLt's gemm_bf16 is its twin.
// Needs K % 32 == 0, N % 8 == 0, ldx and ldy multiples of 8, 16-byte aligned x, w, y; w contiguous.
struct GemmSkinnyParams {
  const void* x = nullptr;  // bf16 [M, ldx]
  int64_t ldx = 0;
  const void* w = nullptr;  // bf16 [N, K] contiguous
  void* y = nullptr;        // bf16 [M, ldy]
  int64_t ldy = 0;
  int64_t M = 0, N = 0, K = 0;
  bool swiglu = false;
};
// The K split (thread-block cluster size, 1..8) gemm_skinny runs this shape with when its grid is
// resident all at once on `device` (one wave); 0 when the shape breaks its rules or needs more than
// one wave (the decode path then calls gemm_bf16).
int gemm_skinny_splits(const GemmSkinnyParams& p, int device);
// Runs on the given stream (the decode step's); a shape beyond one wave runs in waves (ks 1).
void gemm_skinny(const GemmSkinnyParams& p, int device, Stream s);
const char* gemm_skinny_kernel_name();
// The stream-K twin (kernels/cuda/gemm_stream.cu, as gemm_fp8_stream on bf16): one wave whatever N
// and K (no cluster split, no partial last wave), K % 128 == 0, no SwiGLU prologue; the same
// products in another fixed order (deterministic, batch invariant). gemm_skinny runs it where
// tuning::gemm_skinny_streamk == 1 and it applies (tests, kernel_bench); the model's decode steps run it
// where the plan's DecodeFusion::skinny_streamk says (dflash_eval --decode-variants skinny_streamk).
bool gemm_bf16_stream_supported(const GemmSkinnyParams& p);
void gemm_bf16_stream(const GemmSkinnyParams& p, int device, Stream s);
namespace tuning {
extern int gemm_skinny_ks;        // 0: automatic K split; 1..8 forces it (tests, benches)
extern int gemm_skinny_streamk;   // 1: gemm_skinny takes the stream-K kernel where it applies (default 0)
}  // namespace tuning

}  // namespace dflash::cuda
