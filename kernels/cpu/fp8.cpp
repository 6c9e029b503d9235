// CPU reference of the fp8 ops (kernels/ops.h "fp8"): block quantization of weights, per-token group
// quantization of activations, and the block-scaled FP8 GEMM.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/common.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/train_ops.h"
#include "core/fp8.h"

namespace dflash::ops {

namespace {

using fp8::blocks;

Tensor host_f32_2d(const Tensor& t, const char* op) {
  DFLASH_CHECK(t.defined() && t.device().is_cpu() && t.dim() == 2 && dtype_is_float(t.dtype()),
               op << ": expected a 2-D host float tensor, got " << (t.defined() ? t.describe() : "undefined"));
  return t.to_dtype(DType::F32).contiguous();
}

// Quantizes rows [r0, r1) x columns [c0, c1) of x (row stride ld) with one scale: x / scale
// (weights, as the checkpoints were made) or x * (1 / scale) (activations: one reciprocal per group,
// what the CUDA kernels compute, bit for bit).
float quantize_tile(const float* x, int64_t ld, int64_t r0, int64_t r1, int64_t c0, int64_t c1, uint8_t* q, bool divide) {
  float amax = 0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::abs(x[r * ld + c]));
  const float scale = std::max(amax, fp8::kAmaxFloor) / fp8::kE4m3Max;
  const float inv = 1.0f / scale;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      const float t = divide ? x[r * ld + c] / scale : x[r * ld + c] * inv;
      q[r * ld + c] = fp8::e4m3_from_float(std::clamp(t, -fp8::kE4m3Max, fp8::kE4m3Max));
    }
  return scale;
}

void check_codes(const Tensor& q, const Tensor& s, int64_t srows, const char* what) {
  DFLASH_CHECK(q.defined() && q.device().is_cpu() && q.dim() == 2 && (q.dtype() == DType::U8 || q.dtype() == DType::F8E4M3),
               what << ": codes must be a host U8 / F8E4M3 [rows, K] tensor, got " << (q.defined() ? q.describe() : "undefined"));
  DFLASH_CHECK(s.defined() && s.device().is_cpu() && s.dtype() == DType::F32 && s.dim() == 2 && s.size(0) == srows &&
                   s.size(1) == blocks(q.size(1)),
               what << ": scales must be F32 [" << srows << ", " << blocks(q.size(1)) << "] for codes " << q.describe()
                    << ", got " << (s.defined() ? s.describe() : "undefined"));
}

}  // namespace

Fp8Weight quantize_fp8_weight(const Tensor& w) {
  const Tensor x = host_f32_2d(w, "quantize_fp8_weight");
  const int64_t N = x.size(0), K = x.size(1);
  Fp8Weight out{Tensor::empty({N, K}, DType::U8), Tensor::empty({blocks(N), blocks(K)}, DType::F32)};
  for (int64_t bn = 0; bn < blocks(N); ++bn)
    for (int64_t bk = 0; bk < blocks(K); ++bk)
      out.scale_inv.data<float>()[bn * blocks(K) + bk] =
          quantize_tile(x.data<float>(), K, bn * fp8::kBlock, std::min(N, (bn + 1) * fp8::kBlock), bk * fp8::kBlock,
                        std::min(K, (bk + 1) * fp8::kBlock), out.q.data<uint8_t>(), true);
  return out;
}

Fp8Act quantize_fp8_act(const Tensor& a) {
  const Tensor x = host_f32_2d(a, "quantize_fp8_act");
  const int64_t M = x.size(0), K = x.size(1);
  Fp8Act out{Tensor::empty({M, K}, DType::U8), Tensor::empty({M, blocks(K)}, DType::F32)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < blocks(K); ++g)
      out.scale.data<float>()[m * blocks(K) + g] = quantize_tile(x.data<float>(), K, m, m + 1, g * fp8::kBlock,
                                                                 std::min(K, (g + 1) * fp8::kBlock), out.q.data<uint8_t>(), false);
  return out;
}

namespace {
Tensor dequantize(const Tensor& q, const Tensor& s, int64_t row_block) {
  const int64_t R = q.size(0), K = q.size(1);
  Tensor out = Tensor::empty({R, K}, DType::F32);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; ++k)
      out.data<float>()[r * K + k] =
          fp8::e4m3_to_float(q.data<uint8_t>()[r * K + k]) * s.data<float>()[(r / row_block) * blocks(K) + k / fp8::kBlock];
  return out;
}
}  // namespace

Tensor dequantize_fp8(const Fp8Weight& w) {
  check_codes(w.q, w.scale_inv, w.q.defined() ? blocks(w.q.size(0)) : 0, "dequantize_fp8 (weight)");
  return dequantize(w.q, w.scale_inv, fp8::kBlock);
}

Tensor dequantize_fp8(const Fp8Act& a) {
  check_codes(a.q, a.scale, a.q.defined() ? a.q.size(0) : 0, "dequantize_fp8 (activation)");
  return dequantize(a.q, a.scale, 1);
}

Tensor fake_quantize_fp8_act(const Tensor& x) {
  DFLASH_CHECK(x.defined() && x.dim() >= 1, "fake_quantize_fp8_act: expected a tensor [..., K]");
  const int64_t K = x.size(-1);
  return dequantize_fp8(quantize_fp8_act(x.contiguous().view({x.numel() / std::max<int64_t>(K, 1), K}))).view(x.shape());
}

void gemm_fp8_blockwise(const Fp8Act& a, const Fp8Weight& w, Tensor& out) {
  check_codes(a.q, a.scale, a.q.defined() ? a.q.size(0) : 0, "gemm_fp8_blockwise (activation)");
  check_codes(w.q, w.scale_inv, w.q.defined() ? blocks(w.q.size(0)) : 0, "gemm_fp8_blockwise (weight)");
  const int64_t M = a.q.size(0), K = a.q.size(1), N = w.q.size(0);
  DFLASH_CHECK(w.q.size(1) == K, "gemm_fp8_blockwise: activation K = " << K << ", weight K = " << w.q.size(1));
  DFLASH_CHECK(out.defined() && out.device().is_cpu() && out.dtype() == DType::F32 && out.dim() == 2 && out.size(0) == M &&
                   out.size(1) == N && out.is_contiguous(),
               "gemm_fp8_blockwise: out must be a contiguous host F32 [" << M << ", " << N << "]");
  const int64_t G = blocks(K);
  std::vector<float> av(static_cast<size_t>(K)), wv(static_cast<size_t>(K));
  std::vector<float> wdeq(static_cast<size_t>(N * K));  // code values, decoded once
  for (int64_t i = 0; i < N * K; ++i) wdeq[i] = fp8::e4m3_to_float(w.q.data<uint8_t>()[i]);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) av[k] = fp8::e4m3_to_float(a.q.data<uint8_t>()[m * K + k]);
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0;
      for (int64_t g = 0; g < G; ++g) {
        float part = 0;
        for (int64_t k = g * fp8::kBlock; k < std::min(K, (g + 1) * fp8::kBlock); ++k) part += av[k] * wdeq[n * K + k];
        acc += part * (a.scale.data<float>()[m * G + g] * w.scale_inv.data<float>()[(n / fp8::kBlock) * G + g]);
      }
      out.data<float>()[m * N + n] = acc;
    }
  }
}

}  // namespace dflash::ops

namespace dflash::cpu {

void fake_quantize_e4m3(float* x, int64_t rows, int64_t cols, int64_t tile_rows, int64_t tile_cols) {
  DFLASH_CHECK(rows >= 0 && cols >= 0 && tile_rows >= 1 && tile_cols >= 1,
               "fake_quantize_e4m3: rows " << rows << ", cols " << cols << ", tiles " << tile_rows << " x " << tile_cols);
  const int64_t tr = (rows + tile_rows - 1) / tile_rows, tc = (cols + tile_cols - 1) / tile_cols;
  // One task per band of tile rows (each task's tiles are disjoint), quantized as activations are
  // (ops::quantize_fp8_act's arithmetic), then decoded.
  std::vector<uint8_t> codes(static_cast<size_t>(rows * cols));
  parallel_for(tr, [&](int64_t bi) {
    const int64_t r0 = bi * tile_rows, r1 = std::min(rows, r0 + tile_rows);
    for (int64_t bj = 0; bj < tc; ++bj) {
      const int64_t c0 = bj * tile_cols, c1 = std::min(cols, c0 + tile_cols);
      const float scale = ops::quantize_tile(x, cols, r0, r1, c0, c1, codes.data(), false);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) x[r * cols + c] = fp8::e4m3_to_float(codes[r * cols + c]) * scale;
    }
  });
}

}  // namespace dflash::cpu
