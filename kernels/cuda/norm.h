#pragma once
// Norm family: RMSNorm in its forms (decoder norm, residual add + norm, GatedDeltaNet gated norm,
// the drafter's plain norm forward and backward, the FP8-quantizing twins), side by side
// (kernels/cuda/norm.cu; the quantizing twins in fp8.cu, add_rms_norm_quant_fp8 in norm.cu). CPU reference: ops::rms_norm,
// ops::gated_rms_norm (kernels/ops.h), cpu::rms_norm_bwd (kernels/cpu/train_ops.h).
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// ---- Target forward (bf16 in / out, fp32 math) -----------------------------------------------------
// y = x̂ · (1 + w) (zero_centered) or x̂ · w, over rows of D.
void rms_norm(const void* x, int64_t ldx, const void* w, void* y, int64_t ldy, int64_t rows, int64_t D, float eps,
              bool zero_centered, Stream s);

// Residual step of a decoder layer: h += d (fp32 add, bf16 store), then y = rmsnorm(h) · (1 + w).
// h, d, y are contiguous [rows, D]; y may be null (then only the add).
void add_rms_norm(void* h, const void* d, const void* w, void* y, int64_t rows, int64_t D, float eps, Stream s);

// GatedDeltaNet output: y[n, h*dv:(h+1)*dv] = rmsnorm(core[n, h, :]) · w · silu(z[n, h*dv + :]).
// core [N, Hv, dv] contiguous; z rows strided (ldz); w [dv] plain weight.
void gated_rms_norm(const void* core, const void* z, int64_t ldz, const void* w, void* y, int64_t N, int64_t Hv,
                    int64_t dv, float eps, Stream s);

// ---- Plain RMSNorm (x̂ · w) with saved statistics ---------------------------------------------------
// Forward over rows of D: y = x · rstd · w, rstd[r] = 1 / sqrt(mean(x²) + eps) (saved for backward).
// x fp32 (x_f32) or bf16, row stride ldx; w bf16 [D]; y bf16 contiguous [rows, D].
void rms_norm_fwd(const void* x, bool x_f32, int64_t ldx, const void* w, void* y, float* rstd, int64_t rows, int64_t D,
                  float eps, Stream s);
// Backward of y = x · rstd · w with dy bf16 [rows, D]:
//   dx (+)= rstd · (w·dy − x̂ · mean(x̂ · w·dy))   into fp32 dx [rows, D] (accumulate) — or,
//   when dx_bf16 is set instead of dx, written as bf16;
//   dw (+)= Σ_rows dy · x̂ into fp32 dw [D] (deterministic: fixed reduction order, no atomics on dw
//   across runs — a per-block partial buffer is reduced in order).
// x as in forward; dx / dx_bf16: exactly one is non-null; dx_copy_bf16 (optional): after the add,
// also write bf16(dx) there (the residual-stream gradient as the next GEMM's input).
struct RmsNormBwdParams {
  const void* x = nullptr;
  bool x_f32 = false;
  int64_t ldx = 0;
  const void* w = nullptr;
  const float* rstd = nullptr;
  const void* dy = nullptr;  // bf16 [rows, D]
  float* dx = nullptr;
  void* dx_bf16 = nullptr;
  void* dx_copy_bf16 = nullptr;
  float* dw = nullptr;
  int64_t rows = 0, D = 0;
};
void rms_norm_bwd(const RmsNormBwdParams& p, Stream s);

// ---- FP8-quantizing twins (gemm_fp8's activation operand; scale layout in gemm.h) ---------------
// Fused producers of gemm_fp8's activation operand: the unfused GPU op's bf16 result (exactly as
// cuda::rms_norm / cuda::swiglu / cuda::gated_rms_norm compute and round it), quantized as
// quantize_fp8_act does, without the bf16 round trip through memory: codes and scales equal those
// of the op followed by quantize_fp8_act bit for bit. Outputs: q [rows, K] (row stride ldq) and
// scale (fp8_act_scale_elems(rows, K) floats), K the op's output width; K % 16 == 0, 16-byte aligned
// pointers, ldq % 16 == 0 (the unfused ops also take other alignments).
// y = rmsnorm(x) · (1 + w) (zero-centred, Qwen3.5's decoder norms), x rows strided (ldx % 8 == 0),
// D <= 8192.
void rms_norm_quant_fp8(const void* x, int64_t ldx, const void* w, int64_t rows, int64_t D, float eps, uint8_t* q,
                        int64_t ldq, float* scale, Stream s);

// The residual step fused with the next GEMM's quantization: h += d, y = rmsnorm(h) · (1 + w) by
// add_rms_norm's block-per-row kernel itself (norm.cu; quantize_fp8_act's arithmetic, fp8_act.cuh, as
// its output), y quantized: codes and scales equal add_rms_norm then quantize_fp8_act bit for bit, h
// too; y (optional, may be null) also gets the bf16 row. h, d, y contiguous [rows, D], 16-byte aligned;
// D as add_rms_norm_quant_fp8_supported says (1024 < D <= 8192, D % 16 == 0: where add_rms_norm takes
// that kernel; tuning::add_norm_rows on). Launched with programmatic dependent launch where pdl.cuh
// enables it, as add_rms_norm.
bool add_rms_norm_quant_fp8_supported(int64_t D);
namespace tuning {
extern int add_norm_rows;   // add_rms_norm's block-per-row kernel (default 1; 0: the generic row kernel, its twin)
extern int add_norm_quant;  // the CUDA target model's use of add_rms_norm_quant_fp8 (default 1; DFLASH_ADD_NORM_QUANT=0)
}  // namespace tuning
void add_rms_norm_quant_fp8(void* h, const void* d, const void* w, void* y, int64_t rows, int64_t D, float eps,
                            uint8_t* q, int64_t ldq, float* scale, Stream s);

// y[n, h*dv:(h+1)*dv] = rmsnorm(core[n, h, :]) · w · silu(z[n, h*dv + :]), K = Hv·dv; dv 128 or 256
// (each head one or two 128-column groups), z rows strided (ldz % 8 == 0).
void gated_rms_norm_quant_fp8(const void* core, const void* z, int64_t ldz, const void* w, int64_t N, int64_t Hv,
                              int64_t dv, float eps, uint8_t* q, int64_t ldq, float* scale, Stream s);

}  // namespace dflash::cuda
