#include "drafter/fp8_cuda.h"

#include <cuda_runtime.h>

#include "core/cuda/check.h"
#include "core/device.h"
#include "core/error.h"
#include "core/fp8.h"
#include "drafter/fast_path.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/loss.h"

namespace dflash::drafter {

namespace {

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

void* stream_of(Device d) { return DeviceContext::get(d.index).stream(); }

// x [M, K] bf16 as 1 x 128 codes of the GEMM's padded rows (M rounded up to 4, cuBLASLt's block-scaled
// kernels need it; the padding rows' codes 0) and their scales (gemm.h's activation layout).
struct Act {
  Tensor q, s;
};
Act padded_act(int64_t M, int64_t K, Device d) {  // the buffers, the padding rows' codes 0
  const int64_t Mp = round_up(M, 4);
  Act a{Tensor::empty({Mp, K}, DType::U8, d), Tensor::empty({static_cast<int64_t>(cuda::fp8_act_scale_elems(M, K))}, DType::F32, d)};
  if (Mp > M)
    DFLASH_CUDA_CHECK(cudaMemsetAsync(a.q.data<uint8_t>() + M * K, 0, static_cast<size_t>((Mp - M) * K),
                                      static_cast<cudaStream_t>(stream_of(d))));
  return a;
}
Act quantize_act(const void* x, int64_t ldx, int64_t M, int64_t K, Device d) {
  Act a = padded_act(M, K, d);
  cuda::Fp8ActQuantParams p;
  p.x = x, p.ldx = ldx, p.q = a.q.data<uint8_t>(), p.ldq = K, p.scale = a.s.data<float>(), p.M = M, p.K = K;
  cuda::quantize_fp8_act(p, stream_of(d));
  return a;
}

// x [M, C] bf16 as the transposed codes [C, Tp] of 128 x 1 tiles along the tokens (Tp = M rounded up
// to 128, the padding 0) and their scales (the activation layout over C rows): a weight gradient's
// operand; with `rows` (an output gradient) also its 1 x 128 codes as quantize_act makes them.
struct ActT {
  Tensor q, s;
  int64_t Tp = 0;
  Act rows;
};
ActT quantize_act_t(const void* x, int64_t ldx, int64_t M, int64_t C, Device d, bool rows = false) {
  ActT a;
  a.Tp = round_up(M, fp8::kBlock);  // whole 128-token groups (cuBLASLt takes K % 128 == 0 as the forward does)
  a.q = Tensor::empty({C, a.Tp}, DType::U8, d);
  a.s = Tensor::empty({static_cast<int64_t>(cuda::fp8_act_scale_elems(C, a.Tp))}, DType::F32, d);
  cuda::Fp8TileQuantParams p;
  p.x = x, p.ldx = ldx, p.rows = M, p.cols = C, p.block = false;
  p.qt = a.q.data<uint8_t>(), p.ldqt = a.Tp, p.rows_padded = a.Tp, p.scale_t = a.s.data<float>();
  p.ldst = cuda::fp8_act_scale_ld(C);
  if (rows) {
    a.rows = padded_act(M, C, d);
    p.q = a.rows.q.data<uint8_t>(), p.ldq = C, p.scale = a.rows.s.data<float>(), p.lds = cuda::fp8_act_scale_ld(M);
  }
  cuda::quantize_fp8_tiles(p, stream_of(d));
  return a;
}

// x [M, C] bf16 as 128 x 128 blocks, transposed: codes [C, Tp] (Tp = M rounded up to 128; the columns past
// M are 0 codes: zeroed first, the block kernel writes them only up to M rounded to 16) with gemm_fp8's
// weight-layout scales [C / 128, fp8_weight_scale_ld(Tp)]: the weight gradient's x under
// model.drafter.fp8_wgrad_x_tiles: 128x128 (the B operand of a VEC128 x BLK128x128 GEMM).
ActT quantize_act_t_blocks(const void* x, int64_t ldx, int64_t M, int64_t C, Device d) {
  ActT a;
  a.Tp = round_up(M, fp8::kBlock);
  a.q = Tensor::zeros({C, a.Tp}, DType::U8, d);
  a.s = Tensor::zeros({fp8::blocks(C), cuda::fp8_weight_scale_ld(a.Tp)}, DType::F32, d);
  cuda::Fp8TileQuantParams p;
  p.x = x, p.ldx = ldx, p.rows = M, p.cols = C, p.block = true;
  p.qt = a.q.data<uint8_t>(), p.ldqt = a.Tp, p.scale_t = a.s.data<float>(), p.ldst = cuda::fp8_weight_scale_ld(a.Tp);
  cuda::quantize_fp8_tiles(p, stream_of(d));
  return a;
}

}  // namespace

Fp8LmHead::Fp8LmHead(const Tensor& head) {
  DFLASH_CHECK(head.defined() && head.dim() == 2 && head.dtype() == DType::BF16 && head.is_contiguous() &&
                   head.device().is_cuda(),
               "Fp8LmHead: the LM head must be a contiguous bf16 [V, H] matrix on a GPU, got "
                   << (head.defined() ? head.describe() : "undefined"));
  const int64_t V = head.size(0), H = head.size(1), Vq = cuda::linear_ce_fp8_vocab_ld(V);
  const Device d = head.device();
  q = Tensor::empty({Vq, H}, DType::U8, d);
  qt = Tensor::empty({H, Vq}, DType::U8, d);
  s = Tensor::zeros({fp8::blocks(V), cuda::fp8_weight_scale_ld(H)}, DType::F32, d);
  st = Tensor::zeros({fp8::blocks(H), cuda::fp8_weight_scale_ld(V)}, DType::F32, d);
  cuda::linear_ce_quantize_head(head.raw_data(), V, H, codes(), stream_of(d));
}

cuda::LinearCeFp8Head Fp8LmHead::codes() const {
  return {q.data<uint8_t>(), s.data<float>(), qt.data<uint8_t>(), st.data<float>()};
}

void Fp8LmHead::fill(cuda::LinearCeParams& p) const { cuda::linear_ce_use_fp8_head(p, codes()); }

Fp8Linears::Fp8Linears(const DrafterConfig& c, Device device) : device_(device) {
  check_fp8_drafter_sizes(c);
  DFLASH_CHECK(device.is_cuda(), "Fp8Linears: a CUDA device is needed, got " << device.str());
  const int64_t H = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim();
  auto add = [&](const std::string& name, int64_t rows, int64_t cols, bool fwd, bool tr) {
    Mat m;
    m.rows = rows, m.cols = cols, m.fwd = fwd, m.tr = tr;
    if (fwd) {
      m.q = Tensor::empty({rows, cols}, DType::U8, device);
      m.s = Tensor::zeros({fp8::blocks(rows), cuda::fp8_weight_scale_ld(cols)}, DType::F32, device);
    }
    if (tr) {
      m.qt = Tensor::empty({cols, rows}, DType::U8, device);
      m.st = Tensor::zeros({fp8::blocks(cols), cuda::fp8_weight_scale_ld(rows)}, DType::F32, device);
    }
    mats_.emplace(name, std::move(m));
  };
  add("fc.weight", H, c.context_dim(), true, false);  // (no dgrad: the context comes from the frozen target)
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "self_attn.q_proj.weight", qd + 2 * kvd, H, true, true);  // the fused q|k|v
    add(p + "self_attn.k_proj.weight", 2 * kvd, H, false, true);       // k|v: the context rows' dgrad
    add(p + "self_attn.o_proj.weight", H, qd, true, true);
    add(p + "mlp.gate_proj.weight", 2 * I, H, true, true);             // the fused gate|up
    add(p + "mlp.down_proj.weight", H, I, true, true);
  }
}

void Fp8Linears::quantize_one(Mat& m, const void* w_bf16) {
  cuda::Fp8TileQuantParams p;
  p.x = w_bf16, p.ldx = m.cols, p.rows = m.rows, p.cols = m.cols, p.block = true;
  if (m.fwd) p.q = m.q.data<uint8_t>(), p.ldq = m.cols, p.scale = m.s.data<float>(), p.lds = cuda::fp8_weight_scale_ld(m.cols);
  if (m.tr)
    p.qt = m.qt.data<uint8_t>(), p.ldqt = m.rows, p.scale_t = m.st.data<float>(), p.ldst = cuda::fp8_weight_scale_ld(m.rows);
  cuda::quantize_fp8_tiles(p, stream_of(device_));
}

void Fp8Linears::gemm(const uint8_t* xq, const float* xs, int64_t M, int64_t K, const uint8_t* wq, const float* ws,
                      bool w_vec, int64_t N, void* y, int64_t ldy, bool y_f32, bool acc) const {
  if (M == 0) return;
  cuda::GemmFp8Params p;
  p.x = xq, p.ldx = K, p.x_scale = xs, p.w = wq, p.w_scale = ws, p.w_vec_scales = w_vec;
  p.y_f32 = y_f32, p.accumulate = acc, p.M = M, p.N = N, p.K = K;
  if (M % 4 == 0) {
    p.y = y, p.ldy = ldy;
    cuda::gemm_fp8(p, device_.index);
    return;
  }
  // cuBLASLt's block-scaled kernels run M rounded up to 4 rows: through a temporary y of those rows.
  const auto st = static_cast<cudaStream_t>(stream_of(device_));
  const size_t elem = y_f32 ? 4 : 2;
  const int64_t ldt = round_up(N, 8);
  Tensor tmp = Tensor::empty({round_up(M, 4), ldt}, y_f32 ? DType::F32 : DType::BF16, device_);
  if (acc)
    DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(tmp.raw_data(), ldt * elem, y, ldy * elem, N * elem, M, cudaMemcpyDeviceToDevice, st));
  p.M = round_up(M, 4), p.y = tmp.raw_data(), p.ldy = ldt;
  cuda::gemm_fp8(p, device_.index);
  DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(y, ldy * elem, tmp.raw_data(), ldt * elem, N * elem, M, cudaMemcpyDeviceToDevice, st));
}

void Fp8Linears::forward(const void* x, int64_t ldx, int64_t M, int64_t K, const std::string& w, int64_t row0, int64_t n,
                         void* y, int64_t ldy, bool acc_f32) const {
  const auto it = mats_.find(w);
  DFLASH_CHECK(it != mats_.end() && it->second.fwd, "Fp8Linears: no forward matrix for " << w);
  const Mat& m = it->second;
  DFLASH_CHECK(K == m.cols && row0 % fp8::kBlock == 0 && row0 >= 0 && n >= 0 && row0 + n <= m.rows,
               "Fp8Linears::forward: rows [" << row0 << ", " << row0 + n << ") x K " << K << " of " << w << " ["
                                             << m.rows << ", " << m.cols << "]");
  if (M == 0) return;
  const Act a = quantize_act(x, ldx, M, K, device_);
  gemm(a.q.data<uint8_t>(), a.s.data<float>(), M, K, m.q.data<uint8_t>() + row0 * K,
       m.s.data<float>() + (row0 / fp8::kBlock) * cuda::fp8_weight_scale_ld(K), false, n, y, ldy, acc_f32, acc_f32);
}

void Fp8Linears::backward(const void* dy, int64_t lddy, int64_t M, int64_t n, const std::string& w, const void* x,
                          int64_t ldx, int64_t K, void* dx, int64_t lddx, bool acc_f32, float* dw, bool x_blocks) const {
  const auto it = mats_.find(w);
  DFLASH_CHECK(it != mats_.end() && (dx == nullptr || it->second.tr), "Fp8Linears: no dgrad matrix for " << w);
  const Mat& m = it->second;
  DFLASH_CHECK(n == m.rows && K == m.cols, "Fp8Linears::backward: dy width " << n << ", x width " << K << " for " << w
                                                                             << " [" << m.rows << ", " << m.cols << "]");
  DFLASH_CHECK(n % 4 == 0, "Fp8Linears::backward: the gradient's width " << n << " must be a multiple of 4 (its rows of dw)");
  if (M == 0) return;
  const ActT g = quantize_act_t(dy, lddy, M, n, device_, dx != nullptr);
  if (dx != nullptr)
    gemm(g.rows.q.data<uint8_t>(), g.rows.s.data<float>(), M, n, m.qt.data<uint8_t>(), m.st.data<float>(), false, K, dx,
         lddx, acc_f32, acc_f32);
  // x's codes: 128 x 1 tiles along the tokens (vector scales) or 128 x 128 blocks (the weight layout's).
  const ActT a = x_blocks ? quantize_act_t_blocks(x, ldx, M, K, device_) : quantize_act_t(x, ldx, M, K, device_);
  gemm(g.q.data<uint8_t>(), g.s.data<float>(), n, g.Tp, a.q.data<uint8_t>(), a.s.data<float>(), !x_blocks, K, dw, K, true,
       true);
}

}  // namespace dflash::drafter
