#include "drafter/model.h"

#include <algorithm>
#include <cmath>

#include "kernels/error.h"

namespace dflash::drafter {

bool mask_allows(AttnType type, int64_t sliding_window, int64_t anchor, int64_t j, bool key_in_block,
                 int64_t key_index, MaskVariant variant) {
  const int64_t q_pos = anchor + j;
  const int64_t k_pos = key_in_block ? anchor + key_index : key_index;
  if (type == AttnType::Sliding && k_pos < q_pos - (sliding_window - 1)) return false;
  if (!key_in_block) return variant == MaskVariant::AnchorInclusive ? k_pos <= anchor : k_pos < anchor;
  if (type == AttnType::Sliding || variant == MaskVariant::CausalInBlock) return key_index <= j;
  return true;  // full attention: the whole own block, in both directions
}

std::vector<Block> sample_blocks(const std::vector<uint8_t>& loss_mask, const ops::SeqOffsets& seqs,
                                 int64_t num_anchors, uint64_t seed, uint64_t base_stream) {
  seqs.validate(static_cast<int64_t>(loss_mask.size()), "sample_blocks");
  std::vector<Block> blocks;
  for (int64_t s = 0; s < seqs.num_sequences(); ++s) {
    const int64_t off = seqs.offsets[s], S = seqs.offsets[s + 1] - off;
    for (int64_t a : sample_anchors(loss_mask.data() + off, S, num_anchors, seed, base_stream + s))
      blocks.push_back({s, a});
  }
  return blocks;
}

namespace {

// A row-major matrix of doubles: the reference's only working type.
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  Mat() = default;
  Mat(int64_t r, int64_t c) : rows(r), cols(c), v(static_cast<size_t>(r * c), 0.0) {}
  double* row(int64_t i) { return v.data() + i * cols; }
  const double* row(int64_t i) const { return v.data() + i * cols; }
};

// Host tensor of any float dtype -> [numel / last, last] doubles (1-D tensors become one row).
Mat to_mat(const Tensor& t) {
  const Tensor c = t.contiguous();
  const int64_t cols = c.dim() == 0 ? 1 : c.size(-1);
  Mat m(cols ? c.numel() / cols : 0, cols);
  convert_elements(c.raw_data(), c.dtype(), m.v.data(), DType::F64, c.numel());
  return m;
}

// t += m, for F32 / F64 host gradient buffers.
void add_into(Tensor& t, const Mat& m, const std::string& name) {
  DFLASH_CHECK(t.defined() && t.device().is_cpu() && t.is_contiguous() && t.numel() == static_cast<int64_t>(m.v.size()),
               "gradient '" << name << "' must be a contiguous host tensor of " << m.v.size() << " elements");
  if (t.dtype() == DType::F64) {
    double* p = t.data<double>();
    for (size_t i = 0; i < m.v.size(); ++i) p[i] += m.v[i];
  } else {
    DFLASH_CHECK(t.dtype() == DType::F32, "gradient '" << name << "' must be F32 or F64, got " << dtype_name(t.dtype()));
    float* p = t.data<float>();
    for (size_t i = 0; i < m.v.size(); ++i) p[i] = static_cast<float>(p[i] + m.v[i]);
  }
}

Tensor to_f64_tensor(const Mat& m) {
  Tensor t = Tensor::empty({m.rows, m.cols}, DType::F64);
  std::copy(m.v.begin(), m.v.end(), t.data<double>());
  return t;
}

double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
void axpy(double* y, double a, const double* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// y[M, N] = x[M, K] · w[N, K]^T
Mat linear(const Mat& x, const Mat& w) {
  Mat y(x.rows, w.rows);
  for (int64_t m = 0; m < x.rows; ++m)
    for (int64_t n = 0; n < w.rows; ++n) y.row(m)[n] = dot(x.row(m), w.row(n), x.cols);
  return y;
}
// dx += dy · w, dw += dy^T · x (either may be null).
void linear_bwd(const Mat& x, const Mat& w, const Mat& dy, Mat* dx, Mat* dw) {
  for (int64_t m = 0; m < dy.rows; ++m)
    for (int64_t n = 0; n < dy.cols; ++n) {
      const double g = dy.row(m)[n];
      if (g == 0) continue;
      if (dx) axpy(dx->row(m), g, w.row(n), w.cols);
      if (dw) axpy(dw->row(n), g, x.row(m), x.cols);
    }
}

// Plain RMSNorm (x̂·w) over consecutive groups of D values (D = cols, or head_dim per head).
Mat rms(const Mat& x, const std::vector<double>& w, int64_t D, double eps, std::vector<double>& r) {
  Mat y(x.rows, x.cols);
  const int64_t groups = static_cast<int64_t>(x.v.size()) / D;
  r.assign(static_cast<size_t>(groups), 0.0);
  for (int64_t g = 0; g < groups; ++g) {
    const double* xp = x.v.data() + g * D;
    double* yp = y.v.data() + g * D;
    const double rg = 1.0 / std::sqrt(dot(xp, xp, D) / static_cast<double>(D) + eps);
    r[g] = rg;
    for (int64_t i = 0; i < D; ++i) yp[i] = xp[i] * rg * w[i];
  }
  return y;
}
// dx += d/dx, dw += d/dw of y = x·r·w with r = (mean x² + eps)^-1/2.
void rms_bwd(const Mat& x, const std::vector<double>& w, const std::vector<double>& r, int64_t D, const Mat& dy,
             Mat& dx, std::vector<double>& dw) {
  const int64_t groups = static_cast<int64_t>(r.size());
  for (int64_t g = 0; g < groups; ++g) {
    const double* xp = x.v.data() + g * D;
    const double* gp = dy.v.data() + g * D;
    double* dxp = dx.v.data() + g * D;
    const double rg = r[g];
    double sgx = 0;
    for (int64_t i = 0; i < D; ++i) {
      sgx += gp[i] * w[i] * xp[i];
      dw[i] += gp[i] * xp[i] * rg;
    }
    const double k = rg * rg * rg * sgx / static_cast<double>(D);
    for (int64_t i = 0; i < D; ++i) dxp[i] += rg * gp[i] * w[i] - k * xp[i];
  }
}

// Neox RoPE over the full head_dim of every head of x [rows, heads·d] at positions pos[row];
// sign -1 rotates backwards (the transpose: the backward of the forward rotation).
void rope(Mat& x, int64_t d, const std::vector<int64_t>& pos, double theta, double sign) {
  const int64_t half = d / 2, heads = x.cols / d;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -static_cast<double>(2 * i) / static_cast<double>(d));
  for (int64_t r = 0; r < x.rows; ++r)
    for (int64_t i = 0; i < half; ++i) {
      const double ang = static_cast<double>(pos[r]) * inv_freq[i];
      const double c = std::cos(ang), s = sign * std::sin(ang);
      for (int64_t h = 0; h < heads; ++h) {
        double* p = x.row(r) + h * d;
        const double x1 = p[i], x2 = p[i + half];
        p[i] = x1 * c - x2 * s;
        p[i + half] = x2 * c + x1 * s;
      }
    }
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Parameter slots of one layer, in DrafterWeights::entries order.
enum Slot { Q, K, V, O, QN, KN, GATE, UP, DOWN, IN_LN, POST_LN, kSlots };

// A key of a block query: a context token (global index n) or a block row (global row index).
struct Key {
  bool in_block;
  int64_t index;
};

struct LayerCache {
  Mat h_in, xn, q_pre, kb_pre, kc_pre, q, kb, kc, vb, vc, o, h1, yn, g, u, m;
  std::vector<double> r_in, r_q, r_kb, r_kc, r_post;
  std::vector<std::vector<Key>> keys;     // [R] keys each row attends
  std::vector<std::vector<double>> prob;  // [R] Hq × keys softmax weights
};

}  // namespace

void check_batch(const DrafterConfig& c, const DrafterBatch& batch) {
  const Tensor& ctx_in = batch.context;
  DFLASH_CHECK(ctx_in.defined() && ctx_in.dim() == 2 && ctx_in.size(1) == c.context_dim(),
               "drafter: context must be [N, " << c.context_dim() << "] (k = " << c.num_context_layers()
                                               << " captured layers × hidden " << c.hidden_size << "), got "
                                               << (ctx_in.defined() ? ctx_in.describe() : "undefined"));
  const int64_t N = ctx_in.size(0), Vocab = c.vocab_size;
  batch.seqs.validate(N, "drafter");
  DFLASH_CHECK(static_cast<int64_t>(batch.tokens.size()) == N && static_cast<int64_t>(batch.loss_mask.size()) == N,
               "drafter: " << N << " context rows but " << batch.tokens.size() << " tokens and "
                           << batch.loss_mask.size() << " loss_mask entries");
  for (size_t i = 0; i < batch.blocks.size(); ++i) {
    const Block& b = batch.blocks[i];
    DFLASH_CHECK(b.seq >= 0 && b.seq < batch.seqs.num_sequences(),
                 "drafter: block " << i << " names sequence " << b.seq << " of " << batch.seqs.num_sequences());
    const int64_t S = batch.seqs.offsets[b.seq + 1] - batch.seqs.offsets[b.seq];
    DFLASH_CHECK(b.anchor >= 0 && b.anchor < S,
                 "drafter: block " << i << " anchor " << b.anchor << " is outside sequence " << b.seq << " of length " << S);
    if (i) {
      const Block& p = batch.blocks[i - 1];
      DFLASH_CHECK(p.seq < b.seq || (p.seq == b.seq && p.anchor <= b.anchor),
                   "drafter: blocks must be sorted by (sequence, anchor); block " << i << " is not");
    }
  }
  for (int64_t n = 0; n < N; ++n)
    DFLASH_CHECK(batch.tokens[n] >= 0 && batch.tokens[n] < Vocab,
                 "drafter: token id " << batch.tokens[n] << " at row " << n << " is outside the vocabulary [0, " << Vocab << ")");

}

BlockTargets block_targets(const DrafterConfig& c, const DrafterBatch& batch, double gamma, int64_t label_shift) {
  const int64_t B = c.block_size, nb = static_cast<int64_t>(batch.blocks.size());
  BlockTargets t;
  t.labels.assign(static_cast<size_t>(nb * B), 0);
  t.weights.assign(static_cast<size_t>(nb * B), 0.0);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t off = batch.seqs.offsets[batch.blocks[b].seq];
    const int64_t S = batch.seqs.offsets[batch.blocks[b].seq + 1] - off;
    for (int64_t k = 1; k < B; ++k) {
      const BlockLabel bl = block_label(batch.loss_mask.data() + off, S, batch.blocks[b].anchor, k, gamma, label_shift);
      if (bl.position < 0) continue;
      t.labels[b * B + k] = batch.tokens[off + bl.position];
      t.weights[b * B + k] = bl.weight;
      t.weight_sum += bl.weight;
    }
  }
  return t;
}

StepStats block_stats(int64_t B, const BlockTargets& t, const std::vector<int32_t>& argmax, double weighted_ce_sum) {
  const int64_t nb = static_cast<int64_t>(t.labels.size()) / B;
  StepStats st;
  st.weighted_ce_sum = weighted_ce_sum;
  st.weight_sum = t.weight_sum;
  st.correct.assign(static_cast<size_t>(B), 0);
  st.counted.assign(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < nb; ++b) {
    int64_t leading = 0;
    bool run = true;
    for (int64_t k = 1; k < B; ++k) {
      const int64_t r = b * B + k;
      const bool ok = t.weights[r] > 0 && argmax[r] == t.labels[r];
      if (t.weights[r] > 0) {
        ++st.counted[k];
        st.correct[k] += ok;
      }
      run = run && ok;
      leading += run;
    }
    st.accept_len_sum += 1.0 + static_cast<double>(leading);
    ++st.num_blocks;
  }
  return st;
}

double step_flops(const DrafterConfig& c, const DrafterBatch& batch, bool backward) {
  const double N = static_cast<double>(batch.context.defined() ? batch.context.size(0) : 0);
  const double B = static_cast<double>(c.block_size), R = static_cast<double>(batch.blocks.size()) * B;
  const double H = static_cast<double>(c.hidden_size), I = static_cast<double>(c.intermediate_size);
  const double qd = static_cast<double>(c.q_dim()), kvd = static_cast<double>(c.kv_dim());
  const double fc = 2.0 * N * static_cast<double>(c.context_dim()) * H;
  double layers = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const bool sliding = c.layer_types[l] == AttnType::Sliding;
    double keys = 0;  // Σ over query rows of attended keys
    for (const Block& b : batch.blocks)
      for (int64_t j = 0; j < c.block_size; ++j) {
        const int64_t ctx = sliding ? std::min(b.anchor, c.sliding_window - j > 0 ? c.sliding_window - 1 - j : 0) : b.anchor;
        keys += static_cast<double>(std::max<int64_t>(ctx, 0) + (sliding ? std::min(j + 1, c.sliding_window) : c.block_size));
      }
    const double gemm = 2.0 * R * H * (qd + 2 * kvd) + 2.0 * N * H * 2 * kvd + 2.0 * R * qd * H + 2.0 * R * H * 3 * I;
    const double attn = 4.0 * static_cast<double>(c.head_dim * c.num_attention_heads) * keys;
    layers += backward ? 3.0 * gemm + 3.5 * attn : gemm + attn;
  }
  const double head = 2.0 * R * H * static_cast<double>(c.vocab_size);
  return (backward ? 2.0 * fc : fc) + layers + (backward ? 2.0 * head : head);
}

StepStats forward_backward(const DrafterConfig& c, const DrafterWeights& w, const FrozenTarget& target,
                           const DrafterBatch& batch, const StepOptions& opt, DrafterWeights* grads,
                           Tensor* grad_context, Tensor* final_hidden) {
  c.validate();
  w.check(c);
  const int64_t H = c.hidden_size, B = c.block_size, d = c.head_dim, Hq = c.num_attention_heads;
  const int64_t group = Hq / c.num_key_value_heads, Vocab = c.vocab_size, L = c.num_hidden_layers;
  const double eps = c.rms_norm_eps, scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (const auto& [t, name] : {std::pair{&target.embed_tokens, "embed_tokens"}, {&target.lm_head, "lm_head"}})
    DFLASH_CHECK(t->defined() && t->device().is_cpu() && t->dim() == 2 && t->size(0) == Vocab && t->size(1) == H &&
                     dtype_is_float(t->dtype()),
                 "drafter: target " << name << " must be a host float tensor [" << Vocab << ", " << H << "], got "
                                    << (t->defined() ? t->describe() : "undefined"));
  const Tensor& ctx_in = batch.context;
  DFLASH_CHECK(ctx_in.defined() && ctx_in.device().is_cpu() && dtype_is_float(ctx_in.dtype()),
               "drafter: context must be a host float tensor, got " << (ctx_in.defined() ? ctx_in.describe() : "undefined"));
  check_batch(c, batch);
  const int64_t N = ctx_in.size(0);
  const int64_t nb = static_cast<int64_t>(batch.blocks.size()), R = nb * B;
  std::vector<Mat> P;
  auto entries = const_cast<DrafterWeights&>(w).entries(c);
  for (const auto& e : entries) P.push_back(to_mat(*e.tensor));
  auto lp = [&](int64_t l, int s) -> Mat& { return P[2 + l * kSlots + s]; };
  Mat& norm_w = P.back();

  // Positions: context tokens at 0..S-1 of their sequence; block rows at anchor + j.
  std::vector<int64_t> ctx_pos(static_cast<size_t>(N)), blk_pos(static_cast<size_t>(R));
  for (int64_t s = 0; s < batch.seqs.num_sequences(); ++s)
    for (int64_t n = batch.seqs.offsets[s]; n < batch.seqs.offsets[s + 1]; ++n) ctx_pos[n] = n - batch.seqs.offsets[s];
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t j = 0; j < B; ++j) blk_pos[b * B + j] = batch.blocks[b].anchor + j;

  // Context features, shared by all layers.
  const Mat X = to_mat(ctx_in);
  const Mat cpre = linear(X, P[0]);
  std::vector<double> r_ctx;
  const Mat ctx = rms(cpre, P[1].v, H, eps, r_ctx);

  // Block inputs: embeddings of [anchor token, mask × (B-1)].
  Mat h(R, H);
  {
    const Tensor emb = target.embed_tokens.contiguous();
    const auto* base = static_cast<const uint8_t*>(emb.raw_data());
    const size_t es = dtype_size(emb.dtype());
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t j = 0; j < B; ++j) {
        const int64_t tok = j == 0 ? batch.tokens[batch.seqs.offsets[batch.blocks[b].seq] + batch.blocks[b].anchor]
                                   : c.mask_token_id;
        convert_elements(base + static_cast<size_t>(tok * H) * es, emb.dtype(), h.row(b * B + j), DType::F64, H);
      }
  }

  std::vector<LayerCache> cache(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    LayerCache& C = cache[l];
    const AttnType type = c.layer_types[l];
    C.h_in = h;
    C.xn = rms(h, lp(l, IN_LN).v, H, eps, C.r_in);
    C.q_pre = linear(C.xn, lp(l, Q));
    C.kb_pre = linear(C.xn, lp(l, K));
    C.vb = linear(C.xn, lp(l, V));
    C.kc_pre = linear(ctx, lp(l, K));
    C.vc = linear(ctx, lp(l, V));
    C.q = rms(C.q_pre, lp(l, QN).v, d, eps, C.r_q);
    C.kb = rms(C.kb_pre, lp(l, KN).v, d, eps, C.r_kb);
    C.kc = rms(C.kc_pre, lp(l, KN).v, d, eps, C.r_kc);
    rope(C.q, d, blk_pos, c.rope_theta, 1.0);
    rope(C.kb, d, blk_pos, c.rope_theta, 1.0);
    rope(C.kc, d, ctx_pos, c.rope_theta, 1.0);

    C.keys.assign(static_cast<size_t>(R), {});
    C.prob.assign(static_cast<size_t>(R), {});
    C.o = Mat(R, c.q_dim());
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t a = batch.blocks[b].anchor, off = batch.seqs.offsets[batch.blocks[b].seq];
      const int64_t S = batch.seqs.offsets[batch.blocks[b].seq + 1] - off;
      for (int64_t j = 0; j < B; ++j) {
        const int64_t r = b * B + j;
        std::vector<Key>& keys = C.keys[r];
        for (int64_t t = 0; t < S; ++t)
          if (mask_allows(type, c.sliding_window, a, j, false, t, opt.mask)) keys.push_back({false, off + t});
        for (int64_t jj = 0; jj < B; ++jj)
          if (mask_allows(type, c.sliding_window, a, j, true, jj, opt.mask)) keys.push_back({true, b * B + jj});
        const int64_t nk = static_cast<int64_t>(keys.size());
        std::vector<double>& p = C.prob[r];
        p.assign(static_cast<size_t>(Hq * nk), 0.0);
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const int64_t kvo = (hq / group) * d;
          const double* qv = C.q.row(r) + hq * d;
          double* ph = p.data() + hq * nk;
          double mx = -INFINITY;
          for (int64_t i = 0; i < nk; ++i) {
            const double* kv = (keys[i].in_block ? C.kb.row(keys[i].index) : C.kc.row(keys[i].index)) + kvo;
            ph[i] = dot(qv, kv, d) * scale;
            mx = std::max(mx, ph[i]);
          }
          double sum = 0;
          for (int64_t i = 0; i < nk; ++i) sum += (ph[i] = std::exp(ph[i] - mx));
          double* ov = C.o.row(r) + hq * d;
          for (int64_t i = 0; i < nk; ++i) {
            ph[i] /= sum;
            const double* vv = (keys[i].in_block ? C.vb.row(keys[i].index) : C.vc.row(keys[i].index)) + kvo;
            axpy(ov, ph[i], vv, d);
          }
        }
      }
    }
    const Mat attn = linear(C.o, lp(l, O));
    C.h1 = C.h_in;
    for (size_t i = 0; i < attn.v.size(); ++i) C.h1.v[i] += attn.v[i];
    C.yn = rms(C.h1, lp(l, POST_LN).v, H, eps, C.r_post);
    C.g = linear(C.yn, lp(l, GATE));
    C.u = linear(C.yn, lp(l, UP));
    C.m = Mat(R, c.intermediate_size);
    for (size_t i = 0; i < C.m.v.size(); ++i) C.m.v[i] = C.g.v[i] * sigmoid(C.g.v[i]) * C.u.v[i];
    const Mat mlp = linear(C.m, lp(l, DOWN));
    h = C.h1;
    for (size_t i = 0; i < mlp.v.size(); ++i) h.v[i] += mlp.v[i];
  }
  std::vector<double> r_final;
  const Mat hf = rms(h, norm_w.v, H, eps, r_final);
  if (final_hidden) *final_hidden = to_f64_tensor(hf);

  // Labels and weights.
  const BlockTargets tg = block_targets(c, batch, opt.gamma, opt.label_shift);
  const std::vector<int32_t>& labels = tg.labels;
  const std::vector<double>& weights = tg.weights;
  const double wsum = tg.weight_sum;
  const bool backward = grads != nullptr || grad_context != nullptr;
  const double gscale = opt.grad_scale != 0 ? opt.grad_scale : (wsum > 0 ? 1.0 / wsum : 0.0);
  Mat dhf(R, H);
  std::vector<int32_t> argmax;
  const CeSums ce = fused_linear_ce(hf.v.data(), R, H, target.lm_head.contiguous(), labels, weights, opt.ce_chunk_rows,
                                    gscale, backward ? dhf.v.data() : nullptr, &argmax);

  StepStats st = block_stats(B, tg, argmax, ce.weighted_ce_sum);
  st.weight_sum = ce.weight_sum;
  if (!backward) return st;

  // ---- backward ----
  std::vector<Mat> dP;
  for (const Mat& p : P) dP.push_back(Mat(p.rows, p.cols));
  auto dlp = [&](int64_t l, int s) -> Mat& { return dP[2 + l * kSlots + s]; };
  Mat dh(R, H);
  rms_bwd(h, norm_w.v, r_final, H, dhf, dh, dP.back().v);
  Mat dctx(N, H);
  for (int64_t l = L - 1; l >= 0; --l) {
    LayerCache& C = cache[l];
    // MLP: h_out = h1 + down(silu(g)·u)
    Mat dh1 = dh;
    Mat dm(R, c.intermediate_size);
    linear_bwd(C.m, lp(l, DOWN), dh, &dm, &dlp(l, DOWN));
    Mat dg(R, c.intermediate_size), du(R, c.intermediate_size);
    for (size_t i = 0; i < dm.v.size(); ++i) {
      const double g = C.g.v[i], sg = sigmoid(g);
      du.v[i] = dm.v[i] * g * sg;
      dg.v[i] = dm.v[i] * C.u.v[i] * sg * (1.0 + g * (1.0 - sg));
    }
    Mat dyn(R, H);
    linear_bwd(C.yn, lp(l, GATE), dg, &dyn, &dlp(l, GATE));
    linear_bwd(C.yn, lp(l, UP), du, &dyn, &dlp(l, UP));
    rms_bwd(C.h1, lp(l, POST_LN).v, C.r_post, H, dyn, dh1, dlp(l, POST_LN).v);
    // Attention: h1 = h_in + o_proj(o)
    Mat dh_in = dh1;
    Mat d_o(R, c.q_dim());
    linear_bwd(C.o, lp(l, O), dh1, &d_o, &dlp(l, O));
    Mat dq(R, c.q_dim()), dkb(R, c.kv_dim()), dvb(R, c.kv_dim()), dkc(N, c.kv_dim()), dvc(N, c.kv_dim());
    std::vector<double> dp;
    for (int64_t r = 0; r < R; ++r) {
      const std::vector<Key>& keys = C.keys[r];
      const int64_t nk = static_cast<int64_t>(keys.size());
      dp.assign(static_cast<size_t>(nk), 0.0);
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const int64_t kvo = (hq / group) * d;
        const double* ph = C.prob[r].data() + hq * nk;
        const double* dov = d_o.row(r) + hq * d;
        double pdp = 0;
        for (int64_t i = 0; i < nk; ++i) {
          const Key& k = keys[i];
          dp[i] = dot(dov, (k.in_block ? C.vb.row(k.index) : C.vc.row(k.index)) + kvo, d);
          pdp += ph[i] * dp[i];
          axpy((k.in_block ? dvb.row(k.index) : dvc.row(k.index)) + kvo, ph[i], dov, d);
        }
        const double* qv = C.q.row(r) + hq * d;
        double* dqv = dq.row(r) + hq * d;
        for (int64_t i = 0; i < nk; ++i) {
          const Key& k = keys[i];
          const double ds = ph[i] * (dp[i] - pdp) * scale;
          axpy(dqv, ds, (k.in_block ? C.kb.row(k.index) : C.kc.row(k.index)) + kvo, d);
          axpy((k.in_block ? dkb.row(k.index) : dkc.row(k.index)) + kvo, ds, qv, d);
        }
      }
    }
    rope(dq, d, blk_pos, c.rope_theta, -1.0);
    rope(dkb, d, blk_pos, c.rope_theta, -1.0);
    rope(dkc, d, ctx_pos, c.rope_theta, -1.0);
    Mat dq_pre(R, c.q_dim()), dkb_pre(R, c.kv_dim()), dkc_pre(N, c.kv_dim());
    rms_bwd(C.q_pre, lp(l, QN).v, C.r_q, d, dq, dq_pre, dlp(l, QN).v);
    rms_bwd(C.kb_pre, lp(l, KN).v, C.r_kb, d, dkb, dkb_pre, dlp(l, KN).v);
    rms_bwd(C.kc_pre, lp(l, KN).v, C.r_kc, d, dkc, dkc_pre, dlp(l, KN).v);
    Mat dxn(R, H);
    linear_bwd(C.xn, lp(l, Q), dq_pre, &dxn, &dlp(l, Q));
    linear_bwd(C.xn, lp(l, K), dkb_pre, &dxn, &dlp(l, K));
    linear_bwd(C.xn, lp(l, V), dvb, &dxn, &dlp(l, V));
    linear_bwd(ctx, lp(l, K), dkc_pre, &dctx, &dlp(l, K));
    linear_bwd(ctx, lp(l, V), dvc, &dctx, &dlp(l, V));
    rms_bwd(C.h_in, lp(l, IN_LN).v, C.r_in, H, dxn, dh_in, dlp(l, IN_LN).v);
    dh = std::move(dh_in);  // the embeddings are frozen: the gradient stops at the block input
  }
  Mat dcpre(N, H);
  rms_bwd(cpre, P[1].v, r_ctx, H, dctx, dcpre, dP[1].v);
  Mat dX(N, c.context_dim());
  linear_bwd(X, P[0], dcpre, grad_context ? &dX : nullptr, &dP[0]);
  if (grad_context) *grad_context = to_f64_tensor(dX);
  if (grads) {
    grads->check(c);
    auto gentries = grads->entries(c);
    for (size_t i = 0; i < gentries.size(); ++i) add_into(*gentries[i].tensor, dP[i], gentries[i].name);
  }
  return st;
}

}  // namespace dflash::drafter
