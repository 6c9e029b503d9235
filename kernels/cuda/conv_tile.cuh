#pragma once
// The causal conv's device arithmetic shared by the prefill kernels (gdn_conv.cu) and their decode
// twins (gdn_decode.cu): one copy, so that prefill and decode compute the same values bit for bit.
#include <cuda_runtime.h>

namespace dflash::cuda::conv {

// SiLU with the fast intrinsics (ex2.approx + approximate division, a few ulp in f32, far below the
// bf16 output rounding): the full-precision expf and IEEE division would make the fast conv
// instruction-bound (~90 instructions per 16-byte row and thread as written, ~150 with them).
// For x < -87, __expf(-x) = inf and the quotient is -0, silu's limit.
__device__ __forceinline__ float silu_f(float x) { return __fdividef(x, 1.0f + __expf(-x)); }

// One output row of the vec8 kernels (8 channels per thread): out[c] = act(Σ_j wr[c][j] · window[j][c])
// over the window [the K-1 rows of win ; cur], taps j = 0..K-1 in order (as the fallbacks and the CPU
// reference), act = silu_f when `silu`; then the window moves down one row (win = its last K-1 rows).
template <int K>
__device__ __forceinline__ void conv8_step(const float (&wr)[8][K], float (&win)[K > 1 ? K - 1 : 1][8],
                                           const float (&cur)[8], bool silu, float (&out)[8]) {
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < K - 1; ++j) acc = fmaf(wr[c][j], win[j][c], acc);
    acc = fmaf(wr[c][K - 1], cur[c], acc);
    out[c] = silu ? silu_f(acc) : acc;
  }
#pragma unroll
  for (int j = 0; j + 1 < K - 1; ++j)
#pragma unroll
    for (int c = 0; c < 8; ++c) win[j][c] = win[j + 1][c];
  if constexpr (K > 1) {
#pragma unroll
    for (int c = 0; c < 8; ++c) win[K - 2][c] = cur[c];
  }
}

}  // namespace dflash::cuda::conv
