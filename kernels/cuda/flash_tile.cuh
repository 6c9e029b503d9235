#pragma once
// Pieces shared by the flash-style attention kernels (attention.cu: the target's causal attention;
// attention_decode.cu: its decode / verify form; block_attention.cu: the DFlash drafter's block
// attention): cp.async copies into XOR-swizzled shared tiles, exp2, the scores S = Q·Kᵀ of a key tile
// and the per-key-tile online-softmax step with O += P·V for one warp's 16 query rows. Force-inlined, so the kernels compile exactly as if written in place.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/ptx.cuh"

namespace dflash::cuda::flash {

// Kernel arguments of the causal flash forward (attention.cu, attention_sm90.cu).
struct FlashArgs {
  const __nv_bfloat16* q;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  __nv_bfloat16* out;
  const int32_t* cu_seqlens;
  int64_t ldk, ldv;  // token row strides of k / v (elements)
  int Hq, Hkv, group;
  float scale_log2;  // scale · log2(e)
};
inline FlashArgs flash_args(const AttentionParams& p) {
  FlashArgs a;
  a.q = static_cast<const __nv_bfloat16*>(p.q);
  a.k = static_cast<const __nv_bfloat16*>(p.k);
  a.v = static_cast<const __nv_bfloat16*>(p.v);
  a.out = static_cast<__nv_bfloat16*>(p.out);
  a.cu_seqlens = p.cu_seqlens;
  a.ldk = p.ldk ? p.ldk : p.Hkv * p.d;
  a.ldv = p.ldv ? p.ldv : p.Hkv * p.d;
  a.Hq = static_cast<int>(p.Hq);
  a.Hkv = static_cast<int>(p.Hkv);
  a.group = static_cast<int>(p.Hq / p.Hkv);
  a.scale_log2 = p.scale * 1.4426950408889634f;
  return a;
}

// 16-byte global->shared copy; src_bytes = 0 writes zeros (rows past the end of a sequence).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(ptx::smem_addr(dst)), "l"(src), "r"(src_bytes));
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: 2^-inf = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Element offset of (row, 16-byte chunk) in a swizzled [rows, D] bf16 tile.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

// The online-softmax step of one key tile for the warp's query rows g and g+8 (a row is spread
// over the 4 threads of a quad): s holds the masked scores of NT n-tiles (8 keys each; -inf where
// masked), m / l the running max (in log2 units, scaled) and sum of each row. Turns s into the
// probabilities P (fp32, in place), updates m and l, and returns in alpha0 / alpha1 the factors by
// which the rows' output accumulators must be rescaled before P·V is added.
template <int NT>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], float& m0, float& m1, float& l0, float& l1,
                                               float scale_log2, float& alpha0, float& alpha1) {
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    mx0 = fmaxf(mx0, fmaxf(s[i][0], s[i][1]));
    mx1 = fmaxf(mx1, fmaxf(s[i][2], s[i][3]));
  }
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
  }
  const float new0 = fmaxf(m0, mx0 * scale_log2), new1 = fmaxf(m1, mx1 * scale_log2);
  // A row with every key masked so far keeps max -inf: subtract 0 instead (p = 0, no NaN).
  const float base0 = new0 == -INFINITY ? 0.0f : new0, base1 = new1 == -INFINITY ? 0.0f : new1;
  alpha0 = fast_exp2(m0 - base0);
  alpha1 = fast_exp2(m1 - base1);
  m0 = new0;
  m1 = new1;
  float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    s[i][0] = fast_exp2(fmaf(s[i][0], scale_log2, -base0));
    s[i][1] = fast_exp2(fmaf(s[i][1], scale_log2, -base0));
    s[i][2] = fast_exp2(fmaf(s[i][2], scale_log2, -base1));
    s[i][3] = fast_exp2(fmaf(s[i][3], scale_log2, -base1));
    sum0 += s[i][0] + s[i][1];
    sum1 += s[i][2] + s[i][3];
  }
  l0 = l0 * alpha0 + sum0;
  l1 = l1 * alpha1 + sum1;
}

// End of the key loop: the row sums l0 / l1 summed over the quad (each thread held its own
// columns' share) and the factors that normalise the output rows (0 for a row with no key).
__device__ __forceinline__ void finish_rows(float& l0, float& l1, float& inv0, float& inv1) {
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f;
  inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
}

// S = Q·Kᵀ of one key tile for the warp's 16 query rows: s (NT n-tiles of 8 keys) zeroed, then KS
// k-steps of 16 columns, each NT mma.sync against the swizzled key tile tK [NT·8, D] (ldmatrix at
// k_row / k_chk). The warp's Q fragments come from qf (Q_IN_REGS: every k-step's, QN = KS) or else
// from the swizzled tile sQ at a_row / a_chk each k-step.
template <int NT, int KS, int D, bool Q_IN_REGS, int QN>
__device__ __forceinline__ void qk_scores(float (&s)[NT][4], const uint32_t (&qf)[QN][4], const __nv_bfloat16* sQ,
                                          int a_row, int a_chk, const __nv_bfloat16* tK, int k_row, int k_chk) {
  static_assert(!Q_IN_REGS || QN == KS, "qf holds every k-step's Q fragment");
#pragma unroll
  for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    uint32_t qa[4];
    if constexpr (Q_IN_REGS) {
#pragma unroll
      for (int e = 0; e < 4; ++e) qa[e] = qf[ks][e];
    } else {
      ptx::ldmatrix_x4(qa, sQ + swz<D>(a_row, ks * 2 + a_chk));
    }
#pragma unroll
    for (int n2 = 0; n2 < NT / 2; ++n2) {
      uint32_t kb[4];
      ptx::ldmatrix_x4(kb, tK + swz<D>(n2 * 16 + k_row, ks * 2 + k_chk));
      ptx::mma_bf16(s[2 * n2], qa, kb[0], kb[1]);
      ptx::mma_bf16(s[2 * n2 + 1], qa, kb[2], kb[3]);
    }
  }
}

// The bf16 A fragment (m16n8k16 layout, which is also wgmma's register-A layout for a warp's 16
// rows) of k-step kk of P·V: the accumulators of S n-tiles 2kk and 2kk+1 are exactly its elements.
template <int NT>
__device__ __forceinline__ void p_fragment(const float (&s)[NT][4], int kk, uint32_t (&pa)[4]) {
  pa[0] = ptx::pack_bf16(s[2 * kk][0], s[2 * kk][1]);
  pa[1] = ptx::pack_bf16(s[2 * kk][2], s[2 * kk][3]);
  pa[2] = ptx::pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  pa[3] = ptx::pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// One key tile of the online softmax (online_softmax above) followed by O += P·V with V read from
// the swizzled tile tV [NT·8, D] through ldmatrix.trans and mma.sync; o holds the DT n-tiles of the
// warp's output accumulator.
template <int NT, int DT, int D>
__device__ __forceinline__ void softmax_tile_pv(float (&s)[NT][4], float (&o)[DT][4], float& m0, float& m1, float& l0,
                                                float& l1, float scale_log2, const __nv_bfloat16* tV, int v_row,
                                                int v_chk) {
  float alpha0, alpha1;
  online_softmax<NT>(s, m0, m1, l0, l1, scale_log2, alpha0, alpha1);
#pragma unroll
  for (int i = 0; i < DT; ++i) {
    o[i][0] *= alpha0;
    o[i][1] *= alpha0;
    o[i][2] *= alpha1;
    o[i][3] *= alpha1;
  }
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    uint32_t pa[4];
    p_fragment<NT>(s, kk, pa);
#pragma unroll
    for (int d2 = 0; d2 < DT / 2; ++d2) {
      uint32_t vb[4];
      ptx::ldmatrix_x4_trans(vb, tV + swz<D>(kk * 16 + v_row, d2 * 2 + v_chk));
      ptx::mma_bf16(o[2 * d2], pa, vb[0], vb[1]);
      ptx::mma_bf16(o[2 * d2 + 1], pa, vb[2], vb[3]);
    }
  }
}

}  // namespace dflash::cuda::flash
