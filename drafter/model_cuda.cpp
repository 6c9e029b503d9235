#include "drafter/model_cuda.h"

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/block_attention.h"
#include "core/cuda/check.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/loss.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/rope.h"
#include "core/device.h"
#include "core/error.h"
#include "drafter/fast_path.h"
#include "drafter/fp8_cuda.h"

namespace dflash::drafter {

namespace {

constexpr int64_t kAlign = 8;  // elements: 16 bytes of bf16 (cuBLASLt operand alignment), 32 of fp32

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

Tensor dev_empty(const Shape& s, DType t, Device d) { return Tensor::empty(s, t, d); }

// An int32 host vector on the device (synchronous upload; small).
Tensor upload_i32(const std::vector<int32_t>& v, Device d) {
  Tensor h = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I32);
  if (!v.empty()) std::copy(v.begin(), v.end(), h.data<int32_t>());
  return h.to(d);
}
Tensor upload_f32(const std::vector<float>& v, Device d) {
  Tensor h = Tensor::empty({static_cast<int64_t>(v.size())}, DType::F32);
  if (!v.empty()) std::copy(v.begin(), v.end(), h.data<float>());
  return h.to(d);
}

void copy_async(void* dst, const void* src, size_t bytes, void* stream) {
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
}
// Columns [0, cols) of a row-strided bf16 matrix into another (different strides).
void copy_cols_bf16(void* dst, int64_t ldd, const void* src, int64_t lds, int64_t rows, int64_t cols, void* stream) {
  if (rows == 0) return;
  DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<size_t>(ldd) * 2, src, static_cast<size_t>(lds) * 2,
                                      static_cast<size_t>(cols) * 2, static_cast<size_t>(rows), cudaMemcpyDeviceToDevice,
                                      static_cast<cudaStream_t>(stream)));
}

char* bf16_at(void* base, int64_t elems) { return static_cast<char*>(base) + elems * 2; }
const char* bf16_at(const void* base, int64_t elems) { return static_cast<const char*>(base) + elems * 2; }

}  // namespace

CudaDrafter::CudaDrafter(DrafterConfig c, const DrafterWeights& init, Tensor embed_tokens, Tensor lm_head, Device device)
    : c_(std::move(c)), device_(device), embed_(std::move(embed_tokens)), lm_head_(std::move(lm_head)) {
  c_.validate();
  init.check(c_);
  DFLASH_CHECK(device_.is_cuda(), "CudaDrafter: device must be a CUDA device, got " << device_.str());
  for (const auto& [t, name] : {std::pair{&embed_, "embed_tokens"}, {&lm_head_, "lm_head"}})
    DFLASH_CHECK(t->defined() && t->device() == device_ && t->dtype() == DType::BF16 && t->dim() == 2 &&
                     t->size(0) == c_.vocab_size && t->size(1) == c_.hidden_size && t->is_contiguous(),
                 "CudaDrafter: target " << name << " must be bf16 [" << c_.vocab_size << ", " << c_.hidden_size
                                        << "] on " << device_.str() << ", got "
                                        << (t->defined() ? t->describe() : "undefined"));
  check_cuda_drafter_sizes(c_);  // hidden_size, head_dim multiples of 8 (so is k·hidden)
  gemm_unaligned_ = cuda_drafter_gemm_unaligned(c_);
  // Offsets: fc, hidden_norm and norm first (one bucket), then the layers in order; spans_ stays in
  // entries order.
  auto entries = const_cast<DrafterWeights&>(init).entries(c_);
  for (const auto& e : entries) spans_.push_back({e.name, 0, shape_numel(e.shape)});
  for (int pass = 0; pass < 2; ++pass)
    for (Span& sp : spans_)
      if ((sp.name.rfind("layers.", 0) == 0) == (pass == 1)) {
        sp.offset = flat_;
        flat_ = round_up(flat_ + sp.numel, kAlign);
      }
  // Fused operands must be adjacent: q|k|v and gate|up (their sizes are multiples of 8).
  for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    DFLASH_CHECK(span(p + "self_attn.k_proj.weight").offset ==
                         span(p + "self_attn.q_proj.weight").offset + span(p + "self_attn.q_proj.weight").numel &&
                     span(p + "self_attn.v_proj.weight").offset ==
                         span(p + "self_attn.k_proj.weight").offset + span(p + "self_attn.k_proj.weight").numel &&
                     span(p + "mlp.up_proj.weight").offset ==
                         span(p + "mlp.gate_proj.weight").offset + span(p + "mlp.gate_proj.weight").numel,
                 "CudaDrafter: internal: parameter order does not keep q|k|v and gate|up adjacent");
  }
  // Buckets in the order backward completes them: the last layer first, then fc / hidden_norm / norm.
  for (int64_t l = c_.num_hidden_layers - 1; l >= 0; --l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    int64_t first = INT64_MAX, end = 0;
    for (const Span& sp : spans_)
      if (sp.name.rfind(p, 0) == 0) first = std::min(first, sp.offset), end = std::max(end, round_up(sp.offset + sp.numel, kAlign));
    buckets_.push_back({"layer " + std::to_string(l), first, end});
  }
  int64_t head_end = 0;
  for (const Span& sp : spans_)
    if (sp.name.rfind("layers.", 0) != 0) head_end = std::max(head_end, round_up(sp.offset + sp.numel, kAlign));
  buckets_.push_back({"fc, hidden_norm, norm", 0, head_end});
  masters_ = Tensor::zeros({flat_}, DType::F32, device_);
  weights_ = Tensor::zeros({flat_}, DType::BF16, device_);
  grads_ = Tensor::zeros({flat_}, DType::F32, device_);
  upload_masters(init);
}

int64_t CudaDrafter::num_params() const {
  int64_t n = 0;
  for (const Span& s : spans_) n += s.numel;
  return n;
}

const CudaDrafter::Span& CudaDrafter::span(const std::string& name) const {
  for (const Span& s : spans_)
    if (s.name == name) return s;
  DFLASH_FAIL("CudaDrafter: no parameter named " << name);
}
void* CudaDrafter::wptr(const std::string& name) const { return bf16_at(weights_.raw_data(), span(name).offset); }
float* CudaDrafter::gptr(const std::string& name) const { return grads_.data<float>() + span(name).offset; }

std::vector<const Tensor*> CudaDrafter::tensors_of(const DrafterConfig& c, const DrafterWeights& w) {
  w.check(c);
  std::vector<const Tensor*> out;
  for (const auto& e : const_cast<DrafterWeights&>(w).entries(c)) out.push_back(e.tensor);
  return out;
}

void CudaDrafter::from_tensors(const std::vector<const Tensor*>& src, Tensor& flat) const {
  DFLASH_CHECK(src.size() == spans_.size() && flat.numel() == flat_ && flat.dtype() == DType::F32 &&
                   flat.device() == device_,
               "CudaDrafter::from_tensors: " << src.size() << " tensors for " << spans_.size() << " parameters into "
                                             << flat.describe());
  void* s = DeviceContext::get(device_.index).stream();
  DFLASH_CUDA_CHECK(cudaMemsetAsync(flat.raw_data(), 0, flat.nbytes(), static_cast<cudaStream_t>(s)));
  Tensor host;  // staging for host tensors (and other dtypes / devices), made when first needed
  for (size_t i = 0; i < src.size(); ++i) {
    const Tensor& t = *src[i];
    DFLASH_CHECK(t.numel() == spans_[i].numel, "CudaDrafter::from_tensors: " << spans_[i].name << " has "
                                                                             << t.numel() << " elements, expected "
                                                                             << spans_[i].numel);
    float* dst = flat.data<float>() + spans_[i].offset;
    if (t.device() == device_ && t.dtype() == DType::F32 && t.is_contiguous()) {
      copy_async(dst, t.raw_data(), static_cast<size_t>(spans_[i].numel) * 4, s);
      continue;
    }
    if (!host.defined()) host = Tensor::zeros({flat_}, DType::F32);
    const Tensor h = t.to(Device::cpu()).contiguous();
    convert_elements(h.raw_data(), h.dtype(), host.data<float>() + spans_[i].offset, DType::F32, spans_[i].numel);
    Tensor::from_blob(dst, {spans_[i].numel}, DType::F32, device_)
        .copy_from(Tensor::from_blob(host.data<float>() + spans_[i].offset, {spans_[i].numel}, DType::F32));
  }
}

void CudaDrafter::upload_masters(const DrafterWeights& w) {
  from_tensors(tensors_of(c_, w), masters_);
  refresh_weights();
}

Tensor CudaDrafter::pack_context(const std::vector<Tensor>& layers) {
  DFLASH_CHECK(!layers.empty(), "pack_context: no captured layers");
  const Tensor& f = layers.front();
  const int64_t N = f.size(0), H = f.size(1), K = static_cast<int64_t>(layers.size());
  Tensor out = Tensor::empty({N, K * H}, DType::BF16, f.device());
  void* s = DeviceContext::get(f.device().index).stream();
  for (int64_t j = 0; j < K; ++j) {
    const Tensor& t = layers[static_cast<size_t>(j)];
    DFLASH_CHECK(t.device() == f.device() && t.dtype() == DType::BF16 && t.dim() == 2 && t.size(0) == N &&
                     t.size(1) == H && t.is_contiguous(),
                 "pack_context: captured layer " << j << " is " << t.describe() << ", expected bf16[" << N << ", " << H
                                                 << "] on " << f.device().str());
    copy_cols_bf16(bf16_at(out.raw_data(), j * H), K * H, t.raw_data(), H, N, H, s);
  }
  return out;
}

void CudaDrafter::refresh_weights() {
  fp8_stale_ = true;
  cuda::cast_f32_bf16(masters_.data<float>(), weights_.raw_data(), flat_, DeviceContext::get(device_.index).stream());
}

void CudaDrafter::zero_grads() {
  DFLASH_CUDA_CHECK(cudaMemsetAsync(grads_.raw_data(), 0, grads_.nbytes(),
                                    static_cast<cudaStream_t>(DeviceContext::get(device_.index).stream())));
}

std::vector<Tensor> CudaDrafter::to_host(const Tensor& flat) const {
  std::vector<Tensor> out;
  std::vector<Tensor*> dst;
  for (const Span& sp : spans_) out.push_back(Tensor::empty({sp.numel}, DType::F32));
  for (Tensor& t : out) dst.push_back(&t);
  to_host(flat, dst);
  return out;
}

void CudaDrafter::to_host(const Tensor& flat, const std::vector<Tensor*>& dst) const {
  DFLASH_CHECK(dst.size() == spans_.size() && flat.numel() == flat_ && flat.dtype() == DType::F32 &&
                   flat.device() == device_,
               "CudaDrafter::to_host: " << dst.size() << " tensors for " << spans_.size() << " parameters from "
                                        << flat.describe());
  for (size_t i = 0; i < dst.size(); ++i) {
    Tensor& t = *dst[i];
    DFLASH_CHECK(t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous() && t.numel() == spans_[i].numel,
                 "CudaDrafter::to_host: " << spans_[i].name << " needs a contiguous f32 host tensor of "
                                          << spans_[i].numel << " elements, got " << t.describe());
    // (memcpy_any waits for the work queued on the device's stream first.)
    memcpy_any(t.raw_data(), Device::cpu(), flat.data<float>() + spans_[i].offset, device_,
               static_cast<size_t>(spans_[i].numel) * sizeof(float));
  }
}

DrafterWeights CudaDrafter::download(const Tensor& flat) const {
  std::vector<Tensor> parts = to_host(flat);
  DrafterWeights w = DrafterWeights::zeros(c_, DType::F32);
  auto entries = w.entries(c_);
  for (size_t i = 0; i < entries.size(); ++i) *entries[i].tensor = parts[i].view(entries[i].shape);
  return w;
}
DrafterWeights CudaDrafter::download_masters() const { return download(masters_); }
DrafterWeights CudaDrafter::download_grads() const { return download(grads_); }

// One step's state, handed from part to part: the host-side layout and its device copies, the
// forward's saved activations and the loss's outputs. It lives until step() returns (as the same
// tensors did when the step was one function); the backward's own buffers live inside backward().
struct CudaDrafter::StepState {
  StepState(const CudaDrafter& m, const DrafterBatch& b)
      : model(m),
        batch(b),
        dev(m.device_.index),
        s(DeviceContext::get(dev).stream()),
        N(b.context.size(0)),
        nb(static_cast<int64_t>(b.blocks.size())),
        R(nb * m.c_.block_size),
        S(b.seqs.num_sequences()),
        eps(static_cast<float>(m.c_.rms_norm_eps)),
        theta(static_cast<float>(m.c_.rope_theta)) {}

  struct Saved {
    Tensor h_in, xn, r_in, qk_b, v_b, k_c, v_c, q_r, k_br, k_cr, r_q, r_kb, r_kc, o, lse, h1, yn, r_post, gu, m;
  };

  const CudaDrafter& model;
  const DrafterBatch& batch;
  const int dev;
  void* const s;  // the device's stream: every kernel of the step runs on it
  const int64_t N, nb, R, S;  // context rows, blocks, block rows (nb·B), sequences
  const float eps, theta;
  // layout
  BlockTargets tg;
  int64_t max_seqlen = 0;
  double gscale = 0;
  Tensor d_ids, d_pos_b, d_pos_c, d_anchor, d_bseq, d_cuseq, d_cublk;
  std::vector<int32_t> loss_rows;  // the rows with a loss weight (tg.weights > 0), ascending
  Tensor d_loss_rows, d_labels, d_w;  // loss_rows on the device (when not all R rows), their labels and weights
  const Fp8Linears* f8 = nullptr;  // the FP8 linears when StepOptions::fp8_linears
  bool f8_x_blocks = false;        // StepOptions::fp8_wgrad_x_blocks: the weight gradients' x in 128 x 128 blocks
  // forward
  cuda::BlockAttnParams ap;
  Tensor ctx_pre, ctx, r_ctx;  // fc(context) [N, H] bf16, hidden_norm of it, its rstd
  std::vector<Saved> sv;       // [L]
  Tensor h;                    // [R, H] fp32 residual stream after the last layer
  Tensor hf, r_f;              // final norm [R, H] bf16, its rstd
  // loss
  Tensor ce, amax, dhf;        // CE and top-1 of the loss rows, d(final norm) [R, H] fp32 when backward

  Tensor bf(int64_t rows, int64_t cols) const { return dev_empty({rows, cols}, DType::BF16, model.device_); }
  Tensor f32(int64_t rows, int64_t cols) const { return dev_empty({rows, cols}, DType::F32, model.device_); }
  // y[M, N] = x[M, K] · w[row0 : row0 + N, K]ᵀ for the parameter w (the fused q|k|v and gate|up start at
  // q_proj / gate_proj), bf16 out (or fp32 accumulated into y when acc_f32); in FP8 when f8.
  void linear(const void* x, int64_t ldx, const std::string& w, int64_t row0, void* y, int64_t ldy, int64_t M,
              int64_t Nn, int64_t K, bool acc_f32 = false) const {
    if (f8) return f8->forward(x, ldx, M, K, w, row0, Nn, y, ldy, acc_f32);
    cuda::GemmExParams g;
    g.a = x, g.lda = ldx, g.b = bf16_at(model.wptr(w), row0 * K), g.ldb = K, g.trans_b = true, g.d = y, g.ldd = ldy;
    g.d_f32 = acc_f32;
    g.M = M, g.N = Nn, g.K = K, g.beta = acc_f32 ? 1.0f : 0.0f, g.unaligned = model.gemm_unaligned_;
    cuda::gemm_ex(g, dev);
  }
  // A linear's backward for the parameter w's first N rows: dx[M, K] = dy[M, N] · w[N, K] (bf16, or fp32
  // with accumulation; skipped when dx is null) and dw[N, K] (+)= dy[M, N]ᵀ · x[M, K] (fp32); in FP8 when
  // f8 (dy quantized once for both).
  void linear_bwd(const void* dy, int64_t lddy, const std::string& w, const void* x, int64_t ldx, void* dx, int64_t lddx,
                  float* dw, int64_t M, int64_t Nn, int64_t K, bool acc_f32 = false) const {
    if (f8) return f8->backward(dy, lddy, M, Nn, w, x, ldx, K, dx, lddx, acc_f32, dw, f8_x_blocks);
    cuda::GemmExParams g;
    if (dx != nullptr) {
      g.a = dy, g.lda = lddy, g.b = model.wptr(w), g.ldb = K, g.d = dx, g.ldd = lddx, g.d_f32 = acc_f32;
      g.M = M, g.N = K, g.K = Nn, g.beta = acc_f32 ? 1.0f : 0.0f, g.unaligned = model.gemm_unaligned_;
      cuda::gemm_ex(g, dev);
    }
    g = {};
    g.a = dy, g.lda = lddy, g.trans_a = true, g.b = x, g.ldb = ldx, g.d = dw, g.ldd = K, g.d_f32 = true;
    g.M = Nn, g.N = K, g.K = M, g.beta = 1.0f, g.unaligned = model.gemm_unaligned_;
    cuda::gemm_ex(g, dev);
  }
  void rms_fwd(const void* x, bool x_f32, int64_t ldx, const std::string& w, void* y, float* rstd, int64_t rows,
               int64_t D) const {
    cuda::rms_norm_fwd(x, x_f32, ldx, model.wptr(w), y, rstd, rows, D, eps, s);
  }
  cuda::HeadNormRopeParams head_fwd(const void* x, int64_t ldx, const std::string& w, const Tensor& pos, void* y,
                                    float* rstd, int64_t rows, int64_t heads) const {
    cuda::HeadNormRopeParams p;
    p.x = x, p.ldx = ldx, p.w = model.wptr(w), p.pos = pos.data<int32_t>(), p.y = y, p.rstd = rstd;
    p.rows = rows, p.heads = heads, p.d = model.c_.head_dim, p.eps = eps, p.theta = theta;
    return p;
  }
  void rms_bwd(const void* x, bool x_f32, int64_t ldx, const std::string& w, const float* rstd, const void* dy, float* dx,
               void* dx_bf16, void* dx_copy, int64_t rows, int64_t D) const {
    cuda::RmsNormBwdParams p;
    p.x = x, p.x_f32 = x_f32, p.ldx = ldx, p.w = model.wptr(w), p.rstd = rstd, p.dy = dy, p.dx = dx, p.dx_bf16 = dx_bf16;
    p.dx_copy_bf16 = dx_copy, p.dw = model.gptr(w), p.rows = rows, p.D = D;
    cuda::rms_norm_bwd(p, s);
  }
};

StepStats CudaDrafter::step(const DrafterBatch& batch, const StepOptions& opt, bool with_backward, bool last_micro_batch,
                            const BucketReady& on_bucket) {
  check_batch(c_, batch);
  const Tensor& context = batch.context;
  DFLASH_CHECK(context.device() == device_ && context.dtype() == DType::BF16 && context.is_contiguous(),
               "CudaDrafter: context must be contiguous bf16 on " << device_.str() << ", got " << context.describe());
  DFLASH_CHECK(opt.mask == MaskVariant::Correct && opt.label_shift == 0,
               "CudaDrafter: the mask / label test hooks exist on the CPU reference only");
  StepState st(*this, batch);
  layout(st, opt);
  if (st.nb == 0) return block_stats(c_.block_size, st.tg, {}, 0.0);
  if (opt.fp8_linears) {  // the weight codes, remade only after the bf16 weights changed (an optimizer update)
    if (!fp8_) fp8_ = std::make_shared<Fp8Linears>(c_, device_), fp8_stale_ = true;
    if (fp8_stale_) fp8_->quantize([&](const std::string& name) { return wptr(name); });
    fp8_stale_ = false;
    st.f8 = fp8_.get();
    st.f8_x_blocks = opt.fp8_wgrad_x_blocks;
  }
  if (opt.fp8_lm_head && !lm_fp8_) lm_fp8_ = std::make_shared<Fp8LmHead>(lm_head_);  // the head is frozen: once
  forward(st);
  const StepStats stats = loss(st, opt, with_backward);
  if (with_backward) backward(st, last_micro_batch, on_bucket);
  return stats;
}

// ---- host-side layout of the step ----
void CudaDrafter::layout(StepState& st, const StepOptions& opt) const {
  const DrafterBatch& batch = st.batch;
  const int64_t B = c_.block_size, N = st.N, nb = st.nb, R = st.R, S = st.S;
  st.tg = block_targets(c_, batch, opt.gamma);
  const BlockTargets& tg = st.tg;
  if (nb == 0) return;
  std::vector<int32_t> ids(static_cast<size_t>(R)), pos_b(static_cast<size_t>(R)), pos_c(static_cast<size_t>(N));
  std::vector<int32_t> anchor(static_cast<size_t>(nb)), block_seq(static_cast<size_t>(nb));
  std::vector<int32_t> cu_seq(static_cast<size_t>(S + 1)), cu_blk(static_cast<size_t>(S + 1), 0);
  int64_t max_seqlen = 0;
  for (int64_t q = 0; q < S; ++q) {
    cu_seq[q] = static_cast<int32_t>(batch.seqs.offsets[q]);
    max_seqlen = std::max(max_seqlen, batch.seqs.offsets[q + 1] - batch.seqs.offsets[q]);
    for (int64_t n = batch.seqs.offsets[q]; n < batch.seqs.offsets[q + 1]; ++n)
      pos_c[n] = static_cast<int32_t>(n - batch.seqs.offsets[q]);
  }
  cu_seq[S] = static_cast<int32_t>(N);
  for (int64_t b = 0; b < nb; ++b) {
    const Block& bl = batch.blocks[b];
    anchor[b] = static_cast<int32_t>(bl.anchor);
    block_seq[b] = static_cast<int32_t>(bl.seq);
    cu_blk[bl.seq + 1] = static_cast<int32_t>(b + 1);
    for (int64_t j = 0; j < B; ++j) {
      ids[b * B + j] = j == 0 ? batch.tokens[batch.seqs.offsets[bl.seq] + bl.anchor] : static_cast<int32_t>(c_.mask_token_id);
      pos_b[b * B + j] = static_cast<int32_t>(bl.anchor + j);
    }
  }
  for (int64_t q = 1; q <= S; ++q) cu_blk[q] = std::max(cu_blk[q], cu_blk[q - 1]);  // sequences without blocks
  st.max_seqlen = max_seqlen;
  st.gscale = opt.grad_scale != 0 ? opt.grad_scale : (tg.weight_sum > 0 ? 1.0 / tg.weight_sum : 0.0);
  std::vector<int32_t> labels;
  std::vector<float> wts;
  st.loss_rows.clear();
  for (int64_t r = 0; r < R; ++r)
    if (tg.weights[r] > 0) {
      st.loss_rows.push_back(static_cast<int32_t>(r));
      labels.push_back(tg.labels[r]);
      wts.push_back(static_cast<float>(tg.weights[r]));
    }
  if (!st.loss_rows.empty() && static_cast<int64_t>(st.loss_rows.size()) < R) st.d_loss_rows = upload_i32(st.loss_rows, device_);
  st.d_ids = upload_i32(ids, device_), st.d_pos_b = upload_i32(pos_b, device_), st.d_pos_c = upload_i32(pos_c, device_);
  st.d_anchor = upload_i32(anchor, device_), st.d_bseq = upload_i32(block_seq, device_);
  st.d_cuseq = upload_i32(cu_seq, device_), st.d_cublk = upload_i32(cu_blk, device_);
  if (!labels.empty()) st.d_labels = upload_i32(labels, device_), st.d_w = upload_f32(wts, device_);
}

// ---- forward ----
void CudaDrafter::forward(StepState& st) const {
  const Tensor& context = st.batch.context;
  void* s = st.s;
  const int64_t H = c_.hidden_size, B = c_.block_size, d = c_.head_dim, Hq = c_.num_attention_heads;
  const int64_t Hkv = c_.num_key_value_heads, I = c_.intermediate_size, L = c_.num_hidden_layers;
  const int64_t qd = c_.q_dim(), kvd = c_.kv_dim(), KH = c_.context_dim();
  const int64_t N = st.N, nb = st.nb, R = st.R, S = st.S;
  st.ctx_pre = st.bf(N, H), st.ctx = st.bf(N, H), st.r_ctx = st.f32(N, 1);
  const Tensor &ctx_pre = st.ctx_pre, &ctx = st.ctx, &r_ctx = st.r_ctx;
  st.linear(context.raw_data(), KH, "fc.weight", 0, ctx_pre.raw_data(), H, N, H, KH);
  st.rms_fwd(ctx_pre.raw_data(), false, H, "hidden_norm.weight", ctx.raw_data(), r_ctx.data<float>(), N, H);

  st.sv.resize(static_cast<size_t>(L));
  Tensor& h = st.h;
  h = st.f32(R, H);
  cuda::embedding_f32(st.d_ids.data<int32_t>(), embed_.raw_data(), h.data<float>(), R, H, s);
  cuda::BlockAttnParams& ap = st.ap;
  ap.anchor = st.d_anchor.data<int32_t>(), ap.block_seq = st.d_bseq.data<int32_t>();
  ap.cu_seqlens = st.d_cuseq.data<int32_t>(), ap.cu_blocks = st.d_cublk.data<int32_t>();
  ap.nb = nb, ap.B = B, ap.N = N, ap.num_seqs = S, ap.max_seqlen = st.max_seqlen, ap.Hq = Hq, ap.Hkv = Hkv, ap.d = d;
  ap.window = c_.sliding_window;
  for (int64_t l = 0; l < L; ++l) {
    StepState::Saved& v = st.sv[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    v.h_in = h;
    v.xn = st.bf(R, H), v.r_in = st.f32(R, 1);
    st.rms_fwd(h.raw_data(), true, H, p + "input_layernorm.weight", v.xn.raw_data(), v.r_in.data<float>(), R, H);
    const std::string wqkv = p + "self_attn.q_proj.weight";  // q|k|v rows are adjacent
    v.qk_b = st.bf(R, qd + kvd), v.v_b = st.bf(R, kvd), v.k_c = st.bf(N, kvd), v.v_c = st.bf(N, kvd);
    st.linear(v.xn.raw_data(), H, wqkv, 0, v.qk_b.raw_data(), qd + kvd, R, qd + kvd, H);
    st.linear(v.xn.raw_data(), H, wqkv, qd + kvd, v.v_b.raw_data(), kvd, R, kvd, H);
    st.linear(ctx.raw_data(), H, wqkv, qd, v.k_c.raw_data(), kvd, N, kvd, H);
    st.linear(ctx.raw_data(), H, wqkv, qd + kvd, v.v_c.raw_data(), kvd, N, kvd, H);
    v.q_r = st.bf(R, qd), v.k_br = st.bf(R, kvd), v.k_cr = st.bf(N, kvd);
    v.r_q = st.f32(R, Hq), v.r_kb = st.f32(R, Hkv), v.r_kc = st.f32(N, Hkv);
    cuda::head_norm_rope_fwd(st.head_fwd(v.qk_b.raw_data(), qd + kvd, p + "self_attn.q_norm.weight", st.d_pos_b,
                                         v.q_r.raw_data(), v.r_q.data<float>(), R, Hq), s);
    cuda::head_norm_rope_fwd(st.head_fwd(bf16_at(v.qk_b.raw_data(), qd), qd + kvd, p + "self_attn.k_norm.weight", st.d_pos_b,
                                         v.k_br.raw_data(), v.r_kb.data<float>(), R, Hkv), s);
    cuda::head_norm_rope_fwd(st.head_fwd(v.k_c.raw_data(), kvd, p + "self_attn.k_norm.weight", st.d_pos_c, v.k_cr.raw_data(),
                                         v.r_kc.data<float>(), N, Hkv), s);
    v.o = st.bf(R, qd), v.lse = st.f32(R, Hq);
    ap.q = v.q_r.raw_data(), ap.kc = v.k_cr.raw_data(), ap.vc = v.v_c.raw_data();
    ap.kb = v.k_br.raw_data(), ap.vb = v.v_b.raw_data(), ap.out = v.o.raw_data(), ap.lse = v.lse.data<float>();
    ap.sliding = c_.layer_types[l] == AttnType::Sliding;
    cuda::block_attention_fwd(ap, s);
    v.h1 = st.f32(R, H);
    copy_async(v.h1.raw_data(), h.raw_data(), h.nbytes(), s);
    st.linear(v.o.raw_data(), qd, p + "self_attn.o_proj.weight", 0, v.h1.raw_data(), H, R, H, qd, true);
    v.yn = st.bf(R, H), v.r_post = st.f32(R, 1);
    st.rms_fwd(v.h1.raw_data(), true, H, p + "post_attention_layernorm.weight", v.yn.raw_data(), v.r_post.data<float>(), R, H);
    v.gu = st.bf(R, 2 * I), v.m = st.bf(R, I);
    st.linear(v.yn.raw_data(), H, p + "mlp.gate_proj.weight", 0, v.gu.raw_data(), 2 * I, R, 2 * I, H);
    cuda::swiglu(v.gu.raw_data(), v.m.raw_data(), R, I, s);
    h = st.f32(R, H);
    copy_async(h.raw_data(), v.h1.raw_data(), h.nbytes(), s);
    st.linear(v.m.raw_data(), I, p + "mlp.down_proj.weight", 0, h.raw_data(), H, R, H, I, true);
  }
  st.hf = st.bf(R, H), st.r_f = st.f32(R, 1);
  st.rms_fwd(h.raw_data(), true, H, "norm.weight", st.hf.raw_data(), st.r_f.data<float>(), R, H);
}

// ---- loss ----
// The LM-head CE runs on the rows with a loss weight only (loss_rows: every block's anchor row k = 0
// and the rows past a sequence's end or outside its loss mask have none, and neither their CE nor
// their top-1 enters the stats): 15 of 16 rows on a fully supervised batch, fewer on masked data.
// Those rows are gathered (cuda::embedding on the final-norm rows) and their gradient scattered
// back into a zeroed d(final norm); with every row weighted the CE reads hf in place.
StepStats CudaDrafter::loss(StepState& st, const StepOptions& opt, bool with_backward) const {
  const int64_t H = c_.hidden_size, B = c_.block_size, R = st.R, n = static_cast<int64_t>(st.loss_rows.size());
  const BlockTargets& tg = st.tg;
  const bool all = n == R;
  auto* s = static_cast<cudaStream_t>(st.s);
  if (with_backward) {
    st.dhf = st.f32(R, H);
    if (!all) DFLASH_CUDA_CHECK(cudaMemsetAsync(st.dhf.raw_data(), 0, st.dhf.nbytes(), s));
  }
  std::vector<int32_t> argmax(static_cast<size_t>(R), -1);
  double wce = 0;
  if (n > 0) {
    Tensor hc = st.hf, dc = st.dhf;  // the CE's rows: hf itself, or the gathered rows
    if (!all) {
      hc = st.bf(n, H);
      cuda::embedding(st.d_loss_rows.data<int32_t>(), st.hf.raw_data(), hc.raw_data(), n, H, st.s);
      if (with_backward) dc = st.f32(n, H);
    }
    st.ce = st.f32(n, 1), st.amax = dev_empty({n}, DType::I32, device_);
    cuda::LinearCeParams lp;
    lp.hidden = hc.raw_data(), lp.lm_head = lm_head_.raw_data(), lp.labels = st.d_labels.data<int32_t>();
    lp.weights = st.d_w.data<float>(), lp.R = n, lp.H = H, lp.V = c_.vocab_size;
    lp.chunk_rows = std::min<int64_t>(n, std::max<int64_t>(opt.ce_chunk_rows, kMinCeChunkRows));
    lp.grad_scale = static_cast<float>(st.gscale), lp.ce = st.ce.data<float>(), lp.argmax = st.amax.data<int32_t>();
    if (with_backward) lp.dhidden = dc.data<float>();
    if (opt.fp8_lm_head) {
      DFLASH_CHECK(lm_fp8_, "CudaDrafter: the FP8 LM head's codes are made by step()");
      lm_fp8_->fill(lp);
    }
    // The workspace (3 GB at the 27B recipe's chunk) lives for the CE only, not through the backward.
    const Tensor ws = dev_empty({std::max<int64_t>(cuda::linear_ce_workspace(lp), 1)}, DType::U8, device_);
    lp.workspace = ws.raw_data();
    cuda::linear_ce(lp, st.dev);
    if (with_backward && !all)
      cuda::scatter_rows_f32(dc.data<float>(), st.d_loss_rows.data<int32_t>(), st.dhf.data<float>(), n, H, st.s);
    const Tensor ce_h = st.ce.to(Device::cpu()), am_h = st.amax.to(Device::cpu());  // synchronizes
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = st.loss_rows[static_cast<size_t>(i)];
      argmax[r] = am_h.data<int32_t>()[i];
      wce += tg.weights[r] * static_cast<double>(ce_h.data<float>()[i]);
    }
  }
  return block_stats(B, tg, argmax, wce);
}

// ---- backward ----
void CudaDrafter::backward(StepState& st, bool last_micro_batch, const BucketReady& on_bucket) {
  const Tensor& context = st.batch.context;
  void* s = st.s;
  const int64_t H = c_.hidden_size, I = c_.intermediate_size, L = c_.num_hidden_layers;
  const int64_t qd = c_.q_dim(), kvd = c_.kv_dim(), QKV = qd + 2 * kvd, KH = c_.context_dim();
  const int64_t N = st.N, R = st.R;
  const Tensor &h = st.h, &ctx = st.ctx;
  cuda::BlockAttnParams& ap = st.ap;
  auto report = [&](int64_t bucket) {
    if (last_micro_batch && on_bucket) on_bucket(bucket);
  };
  const Tensor dh = st.f32(R, H), dh_b = st.bf(R, H), tmp_b = st.bf(R, H);
  DFLASH_CUDA_CHECK(cudaMemsetAsync(dh.raw_data(), 0, dh.nbytes(), static_cast<cudaStream_t>(s)));
  cuda::cast_f32_bf16(st.dhf.data<float>(), tmp_b.raw_data(), R * H, s);
  st.rms_bwd(h.raw_data(), true, H, "norm.weight", st.r_f.data<float>(), tmp_b.raw_data(), dh.data<float>(), nullptr,
             dh_b.raw_data(), R, H);
  const Tensor dctx = st.f32(N, H);
  DFLASH_CUDA_CHECK(cudaMemsetAsync(dctx.raw_data(), 0, dctx.nbytes(), static_cast<cudaStream_t>(s)));
  const Tensor dm = st.bf(R, I), dgu = st.bf(R, 2 * I), d_o = st.bf(R, qd), dq_r = st.bf(R, qd), dkb_r = st.bf(R, kvd);
  const Tensor dkc_r = st.bf(N, kvd), dqkv = st.bf(R, QKV), dkv_c = st.bf(N, 2 * kvd), dvb = st.bf(R, kvd), dvc = st.bf(N, kvd);
  cuda::BlockAttnBwdParams bp;
  const Tensor aws = dev_empty({std::max<int64_t>(cuda::block_attention_bwd_workspace(ap), 1)}, DType::U8, device_);
  for (int64_t l = L - 1; l >= 0; --l) {
    StepState::Saved& v = st.sv[l];
    const std::string p = "layers." + std::to_string(l) + ".";
    // MLP: h_out = h1 + down(m), m = swiglu(gu), gu = yn · [gate; up]ᵀ
    const std::string down = p + "mlp.down_proj.weight", gate = p + "mlp.gate_proj.weight";
    st.linear_bwd(dh_b.raw_data(), H, down, v.m.raw_data(), I, dm.raw_data(), I, gptr(down), R, H, I);
    cuda::swiglu_bwd(v.gu.raw_data(), dm.raw_data(), dgu.raw_data(), R, I, s);
    st.linear_bwd(dgu.raw_data(), 2 * I, gate, v.yn.raw_data(), H, tmp_b.raw_data(), H, gptr(gate), R, 2 * I, H);
    st.rms_bwd(v.h1.raw_data(), true, H, p + "post_attention_layernorm.weight", v.r_post.data<float>(), tmp_b.raw_data(),
               dh.data<float>(), nullptr, dh_b.raw_data(), R, H);
    // Attention: h1 = h_in + o_proj(o)
    const std::string o_w = p + "self_attn.o_proj.weight", q_w = p + "self_attn.q_proj.weight";
    const std::string k_w = p + "self_attn.k_proj.weight";
    st.linear_bwd(dh_b.raw_data(), H, o_w, v.o.raw_data(), qd, d_o.raw_data(), qd, gptr(o_w), R, H, qd);
    ap.q = v.q_r.raw_data(), ap.kc = v.k_cr.raw_data(), ap.vc = v.v_c.raw_data();
    ap.kb = v.k_br.raw_data(), ap.vb = v.v_b.raw_data(), ap.out = v.o.raw_data(), ap.lse = v.lse.data<float>();
    ap.sliding = c_.layer_types[l] == AttnType::Sliding;
    bp.fwd = ap, bp.dout = d_o.raw_data(), bp.dq = dq_r.raw_data(), bp.dkb = dkb_r.raw_data(), bp.dvb = dvb.raw_data();
    bp.dkc = dkc_r.raw_data(), bp.dvc = dvc.raw_data(), bp.workspace = aws.raw_data();
    cuda::block_attention_bwd(bp, s);
    // Head norms + RoPE backward into the fused gradient buffers [dq | dk | dv] (block) and [dk | dv] (context).
    cuda::HeadNormRopeBwdParams hb;
    hb.fwd = st.head_fwd(v.qk_b.raw_data(), qd + kvd, p + "self_attn.q_norm.weight", st.d_pos_b, nullptr, v.r_q.data<float>(),
                         R, c_.num_attention_heads);
    hb.dy = dq_r.raw_data(), hb.dx = dqkv.raw_data(), hb.lddx = QKV, hb.dw = gptr(p + "self_attn.q_norm.weight");
    cuda::head_norm_rope_bwd(hb, s);
    hb.fwd = st.head_fwd(bf16_at(v.qk_b.raw_data(), qd), qd + kvd, p + "self_attn.k_norm.weight", st.d_pos_b, nullptr,
                         v.r_kb.data<float>(), R, c_.num_key_value_heads);
    hb.dy = dkb_r.raw_data(), hb.dx = bf16_at(dqkv.raw_data(), qd), hb.lddx = QKV, hb.dw = gptr(p + "self_attn.k_norm.weight");
    cuda::head_norm_rope_bwd(hb, s);
    hb.fwd = st.head_fwd(v.k_c.raw_data(), kvd, p + "self_attn.k_norm.weight", st.d_pos_c, nullptr, v.r_kc.data<float>(), N,
                         c_.num_key_value_heads);
    hb.dy = dkc_r.raw_data(), hb.dx = dkv_c.raw_data(), hb.lddx = 2 * kvd, hb.dw = gptr(p + "self_attn.k_norm.weight");
    cuda::head_norm_rope_bwd(hb, s);
    copy_cols_bf16(bf16_at(dqkv.raw_data(), qd + kvd), QKV, dvb.raw_data(), kvd, R, kvd, s);
    copy_cols_bf16(bf16_at(dkv_c.raw_data(), kvd), 2 * kvd, dvc.raw_data(), kvd, N, kvd, s);
    // q|k|v weights (adjacent) from the block rows, k|v from the context rows.
    st.linear_bwd(dqkv.raw_data(), QKV, q_w, v.xn.raw_data(), H, tmp_b.raw_data(), H, gptr(q_w), R, QKV, H);
    st.linear_bwd(dkv_c.raw_data(), 2 * kvd, k_w, ctx.raw_data(), H, dctx.raw_data(), H, gptr(k_w), N, 2 * kvd, H, true);
    st.rms_bwd(v.h_in.raw_data(), true, H, p + "input_layernorm.weight", v.r_in.data<float>(), tmp_b.raw_data(),
               dh.data<float>(), nullptr, dh_b.raw_data(), R, H);
    report(L - 1 - l);
    v = StepState::Saved{};  // free this layer's activations (back to the caching allocator)
  }
  // Context features: ctx = hidden_norm(fc(context)); the gradient stops at the (frozen) target.
  const Tensor dctx_b = st.bf(N, H), dctx_pre = st.bf(N, H);
  cuda::cast_f32_bf16(dctx.data<float>(), dctx_b.raw_data(), N * H, s);
  st.rms_bwd(st.ctx_pre.raw_data(), false, H, "hidden_norm.weight", st.r_ctx.data<float>(), dctx_b.raw_data(), nullptr,
             dctx_pre.raw_data(), nullptr, N, H);
  st.linear_bwd(dctx_pre.raw_data(), H, "fc.weight", context.raw_data(), KH, nullptr, 0, gptr("fc.weight"), N, H, KH);
  report(static_cast<int64_t>(buckets_.size()) - 1);
}

}  // namespace dflash::drafter
