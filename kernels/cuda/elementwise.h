#pragma once
// Elementwise family: embedding, SwiGLU (forward, backward, FP8-quantizing), the sigmoid output
// gate, casts and residual adds (kernels/cuda/elementwise.cu; swiglu_quant_fp8 and sigmoid_gate_quant_fp8 in fp8.cu).
// CPU reference: kernels/ops.h.
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// ---- Target forward (bf16 in / out, fp32 math) -----------------------------------------------------
// y[n, :] = table[ids[n], :]; ids were validated against V on the host.
void embedding(const int32_t* ids, const void* table, void* y, int64_t N, int64_t D, Stream s);

// y[N, I] = silu(gu[:, 0:I]) * gu[:, I:2I]; gu is the output of the fused gate|up GEMM [N, 2I].
void swiglu(const void* gu, void* y, int64_t N, int64_t I, Stream s);

// x[N, H*d] *= sigmoid(gate); gate of token n, head h at gate + n*ldg + h*hsg (d contiguous).
void sigmoid_gate(void* x, const void* gate, int64_t ldg, int64_t hsg, int64_t N, int64_t H, int64_t d, Stream s);

// ---- Conversions and residual updates --------------------------------------------------------------
// y[i] = float(x[i])  (bf16 -> fp32), n elements.
void cast_bf16_f32(const void* x, float* y, int64_t n, Stream s);
// y[i] = bf16(x[i])  (fp32 -> bf16, round to nearest even), n elements.
void cast_f32_bf16(const float* x, void* y, int64_t n, Stream s);
// h[i] += float(d[i]) for bf16 d (d_f32 false) or fp32 d, n elements.
void add_into_f32(float* h, const void* d, bool d_f32, int64_t n, Stream s);
// Embedding rows into the fp32 residual stream: h[r, :] = float(table[ids[r], :]), table bf16 [V, D].
void embedding_f32(const int32_t* ids, const void* table, float* h, int64_t rows, int64_t D, Stream s);
// Rows out to their places: y[dst_rows[r], :] = x[r, :] for r < rows (fp32, row stride D); y's other
// rows untouched. dst_rows distinct (a row written twice is a race), in range (not checked here).
void scatter_rows_f32(const float* x, const int32_t* dst_rows, float* y, int64_t rows, int64_t D, Stream s);

// ---- SwiGLU backward --------------------------------------------------------------------------------
// Forward is swiglu() above: m = silu(gu[:, :I]) · gu[:, I:]. Backward from dm bf16 [rows, I]:
//   dgu[:, :I] = dm · u · σ(g)(1 + g(1 − σ(g))),  dgu[:, I:] = dm · silu(g);  dgu bf16 [rows, 2I].
void swiglu_bwd(const void* gu, const void* dm, void* dgu, int64_t rows, int64_t I, Stream s);

// FP8-quantizing twin of swiglu (gemm_fp8's activation operand; contract and scale layout as
// rms_norm_quant_fp8 in norm.h, gemm.h):
// y[N, I] = silu(gu[:, 0:I]) * gu[:, I:2I] (gu [N, 2I] contiguous, the fused gate|up GEMM output).
void swiglu_quant_fp8(const void* gu, int64_t N, int64_t I, uint8_t* q, int64_t ldq, float* scale, Stream s);
// ... of sigmoid_gate (the gated attention's o_proj input): y[N, H*d] = x * sigmoid(gate), x [N, H*d]
// contiguous, gate as sigmoid_gate's, rounded to bf16 as sigmoid_gate stores it; x is not written. d, hsg and
// ldg multiples of 8, H*d of 16 (sigmoid_gate_quant_fp8_supported), x and gate 16-byte aligned.
bool sigmoid_gate_quant_fp8_supported(int64_t ldg, int64_t hsg, int64_t H, int64_t d);
void sigmoid_gate_quant_fp8(const void* x, const void* gate, int64_t ldg, int64_t hsg, int64_t N, int64_t H, int64_t d,
                            uint8_t* q, int64_t ldq, float* scale, Stream s);
namespace tuning {
extern int gate_quant;  // the CUDA target model's use of sigmoid_gate_quant_fp8 (default 1; DFLASH_GATE_QUANT=0)
}  // namespace tuning

}  // namespace dflash::cuda
