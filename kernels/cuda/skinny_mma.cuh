#pragma once
// The tensor-core step the streaming skinny GEMMs share (gemm_skinny.cu's cluster kernel,
// gemm_stream.cu's stream-K kernels): one 64-byte step of kTiles 16-row weight tiles against up to
// 16 tokens. Lane 4g + t holds weight units wv[2i] / wv[2i + 1] (rows g and g + 8 of tile i, its 16
// bytes of the step) and x units xa0 / xa1 (tokens g and g + 8, the same bytes of their rows). MMA
// h takes words 2h and 2h + 1 of each unit, so the k order inside an MMA is permuted alike for both
// operands and the units are used as loaded: bf16 (m16n8k16) words 2h / 2h + 1 serve logical k
// 2t.. / 2t + 8.., e4m3 (m16n8k32) k 4t.. / 16 + 4t... acc[i][hf] is the C fragment of tile i and
// token half hf (rows g, g + 8; tokens 8 hf + 2t, + 1); the second half only when `two`.
#include <cstdint>

#include "kernels/cuda/ptx.cuh"

namespace dflash::cuda::skinny {

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <bool kFp8, int kTiles>
__device__ __forceinline__ void step_mmas(const uint4 (&wv)[2 * kTiles], const uint4& xa0, const uint4& xa1, bool two,
                                          float (&acc)[kTiles][2][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const uint32_t a[4] = {word(wv[2 * i], 2 * h), word(wv[2 * i + 1], 2 * h), word(wv[2 * i], 2 * h + 1),
                             word(wv[2 * i + 1], 2 * h + 1)};
      if constexpr (kFp8) {
        ptx::mma_e4m3(acc[i][0], a, word(xa0, 2 * h), word(xa0, 2 * h + 1));
        if (two) ptx::mma_e4m3(acc[i][1], a, word(xa1, 2 * h), word(xa1, 2 * h + 1));
      } else {
        ptx::mma_bf16(acc[i][0], a, word(xa0, 2 * h), word(xa0, 2 * h + 1));
        if (two) ptx::mma_bf16(acc[i][1], a, word(xa1, 2 * h), word(xa1, 2 * h + 1));
      }
    }
  }
}

// The C fragment's element acc[i][hf][c]: weight row 16 i + g + 8 (c >> 1) of the warp's tiles, token
// 8 hf + 2 t + (c & 1).
__device__ __forceinline__ int c_row(int i, int c, int g) { return 16 * i + g + 8 * (c >> 1); }
__device__ __forceinline__ int c_token(int hf, int c, int t) { return 8 * hf + 2 * t + (c & 1); }

template <int kTiles>
__device__ __forceinline__ void zero(float (&acc)[kTiles][2][4]) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][hf][c] = 0.0f;
}

// The fragments into a [16 tokens][kLd >= 16 kTiles rows] buffer: buf[token][row] (a warp's partial
// sums before the block adds them up).
template <int kTiles, int kLd>
__device__ __forceinline__ void store_fragments(const float (&acc)[kTiles][2][4], float (*buf)[kLd], int g, int t) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int c = 0; c < 4; ++c) buf[c_token(hf, c, t)][c_row(i, c, g)] = acc[i][hf][c];
}

}  // namespace dflash::cuda::skinny
