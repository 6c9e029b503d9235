#include "drafter/model.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "drafter/ref_math.h"
#include "core/error.h"

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

namespace {

using namespace ref;

template <class T>
struct LayerCache {
  MatT<T> h_in, xn, q_pre, kb_pre, kc_pre, q, kb, kc, vb, vc, o, h1, yn, g, u, m;
  std::vector<T> r_in, r_q, r_kb, r_kc, r_post;
  std::vector<std::vector<Key>> keys;  // [R] keys each row attends
  std::vector<std::vector<T>> prob;    // [R] Hq × keys softmax weights
};

// The LM-head loss of the final hidden states: the double reference or its f32 twin.
CeSums head_ce(const Mat& hf, const Tensor& lm_head, const BlockTargets& tg, int64_t chunk, double gscale, Mat* dhf,
               std::vector<int32_t>& argmax, bool /*fp8: F32 only, checked by the step*/) {
  return fused_linear_ce(hf.v.data(), hf.rows, hf.cols, lm_head.contiguous(), tg.labels, tg.weights, chunk, gscale,
                         dhf ? dhf->v.data() : nullptr, &argmax);
}
// fp8: the simulated FP8 LM head (StepOptions::fp8_lm_head): the head's 128 x 128 tiles here, the
// hidden rows' and the logits' gradient's 1 x 128 tiles in fused_linear_ce_f32.
CeSums head_ce(const MatF& hf, const Tensor& lm_head, const BlockTargets& tg, int64_t chunk, double gscale, MatF* dhf,
               std::vector<int32_t>& argmax, bool fp8) {
  Tensor head = lm_head.dtype() == DType::F32 ? lm_head.contiguous() : lm_head.to_dtype(DType::F32);
  if (fp8) {
    if (head.raw_data() == lm_head.raw_data()) head = head.clone();
    cpu::fake_quantize_e4m3(head.data<float>(), head.size(0), head.size(1), 128, 128);
  }
  return cpu::fused_linear_ce_f32(hf.v.data(), hf.rows, hf.cols, head, tg.labels, tg.weights, chunk, gscale,
                                  dhf ? dhf->v.data() : nullptr, &argmax, fp8);
}

template <class T>
StepStats forward_backward_impl(const DrafterConfig& c, const DrafterWeights& w, const FrozenTarget& target,
                                const DrafterBatch& batch, const StepOptions& opt, DrafterWeights* grads,
                                Tensor* grad_context, Tensor* final_hidden);

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
  if (opt.math == DrafterMath::F32)
    return forward_backward_impl<float>(c, w, target, batch, opt, grads, grad_context, final_hidden);
  return forward_backward_impl<double>(c, w, target, batch, opt, grads, grad_context, final_hidden);
}

namespace {

template <class T>
StepStats forward_backward_impl(const DrafterConfig& c, const DrafterWeights& w, const FrozenTarget& target,
                                const DrafterBatch& batch, const StepOptions& opt, DrafterWeights* grads,
                                Tensor* grad_context, Tensor* final_hidden) {
  using M = MatT<T>;
  constexpr bool kF32 = std::is_same_v<T, float>;
  DFLASH_CHECK(!opt.fp8_linears || kF32, "drafter: FP8 linears run on the f32 step (math f32), not the double reference");
  DFLASH_CHECK(!opt.fp8_lm_head || kF32, "drafter: the FP8 LM head runs on the f32 step (math f32), not the double reference");
  // The step's linear layers: f32 / double, or simulated FP8 (opt.fp8_linears).
  const auto linear = [&](const M& x, const M& w) -> M {
    if constexpr (std::is_same_v<T, float>)
      if (opt.fp8_linears) return ref::linear_fp8(x, w);
    return ref::linear(x, w);
  };
  const auto linear_bwd = [&](const M& x, const M& w, const M& dy, M* dx, M* dw) {
    if constexpr (std::is_same_v<T, float>)
      if (opt.fp8_linears) return ref::linear_bwd_fp8(x, w, dy, dx, dw, opt.fp8_wgrad_x_blocks);
    ref::linear_bwd(x, w, dy, dx, dw);
  };
  c.validate();
  w.check(c);
  const int64_t H = c.hidden_size, B = c.block_size, d = c.head_dim, Hq = c.num_attention_heads;
  const int64_t group = Hq / c.num_key_value_heads, Vocab = c.vocab_size, L = c.num_hidden_layers;
  const double eps = c.rms_norm_eps;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(d)));
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
  std::vector<M> P = load_params<T>(c, w);
  auto lp = [&](int64_t l, int s) -> M& { return P[param_index(l, s)]; };
  M& norm_w = P.back();

  // Positions: context tokens at 0..S-1 of their sequence; block rows at anchor + j.
  std::vector<int64_t> ctx_pos(static_cast<size_t>(N)), blk_pos(static_cast<size_t>(R));
  for (int64_t s = 0; s < batch.seqs.num_sequences(); ++s)
    for (int64_t n = batch.seqs.offsets[s]; n < batch.seqs.offsets[s + 1]; ++n) ctx_pos[n] = n - batch.seqs.offsets[s];
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t j = 0; j < B; ++j) blk_pos[b * B + j] = batch.blocks[b].anchor + j;

  // Context features, shared by all layers.
  const M X = to_mat<T>(ctx_in);
  const M cpre = linear(X, P[0]);
  std::vector<T> r_ctx;
  const M ctx = rms(cpre, P[1].v, H, eps, r_ctx);

  // Block inputs: embeddings of [anchor token, mask × (B-1)].
  M h(R, H);
  {
    std::vector<int64_t> ids(static_cast<size_t>(R), c.mask_token_id);
    for (int64_t b = 0; b < nb; ++b) ids[b * B] = batch.tokens[batch.seqs.offsets[batch.blocks[b].seq] + batch.blocks[b].anchor];
    embed_rows(target.embed_tokens, ids, h);
  }

  std::vector<LayerCache<T>> cache(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    LayerCache<T>& C = cache[l];
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
    C.o = M(R, c.q_dim());
    cpu::parallel_for(nb, [&](int64_t b) {  // blocks are independent: each writes its own rows
      const int64_t a = batch.blocks[b].anchor, off = batch.seqs.offsets[batch.blocks[b].seq];
      const int64_t S = batch.seqs.offsets[batch.blocks[b].seq + 1] - off;
      for (int64_t j = 0; j < B; ++j) {
        const int64_t r = b * B + j;
        block_keys(type, c.sliding_window, a, j, S, off, B, b * B, opt.mask, C.keys[r]);
        attend(C.q.row(r), C.keys[r], C.kc, C.vc, C.kb, C.vb, Hq, group, d, scale, C.prob[r], C.o.row(r));
      }
    });
    const M attn = linear(C.o, lp(l, O));
    C.h1 = C.h_in;
    for (size_t i = 0; i < attn.v.size(); ++i) C.h1.v[i] += attn.v[i];
    C.yn = rms(C.h1, lp(l, POST_LN).v, H, eps, C.r_post);
    C.g = linear(C.yn, lp(l, GATE));
    C.u = linear(C.yn, lp(l, UP));
    C.m = M(R, c.intermediate_size);
    for (size_t i = 0; i < C.m.v.size(); ++i) C.m.v[i] = C.g.v[i] * sigmoid(C.g.v[i]) * C.u.v[i];
    const M mlp = linear(C.m, lp(l, DOWN));
    h = C.h1;
    for (size_t i = 0; i < mlp.v.size(); ++i) h.v[i] += mlp.v[i];
  }
  std::vector<T> r_final;
  const M hf = rms(h, norm_w.v, H, eps, r_final);
  if (final_hidden) *final_hidden = to_f64_tensor(hf);

  // Labels and weights.
  const BlockTargets tg = block_targets(c, batch, opt.gamma, opt.label_shift);
  const double wsum = tg.weight_sum;
  const bool backward = grads != nullptr || grad_context != nullptr;
  const double gscale = opt.grad_scale != 0 ? opt.grad_scale : (wsum > 0 ? 1.0 / wsum : 0.0);
  M dhf(R, H);
  std::vector<int32_t> argmax;
  const CeSums ce =
      head_ce(hf, target.lm_head, tg, opt.ce_chunk_rows, gscale, backward ? &dhf : nullptr, argmax, opt.fp8_lm_head);

  StepStats st = block_stats(B, tg, argmax, ce.weighted_ce_sum);
  st.weight_sum = ce.weight_sum;
  if (!backward) return st;

  // ---- backward ----
  std::vector<M> dP;
  for (const M& p : P) dP.push_back(M(p.rows, p.cols));
  auto dlp = [&](int64_t l, int s) -> M& { return dP[2 + l * kSlots + s]; };
  M dh(R, H);
  rms_bwd(h, norm_w.v, r_final, H, dhf, dh, dP.back().v);
  M dctx(N, H);
  for (int64_t l = L - 1; l >= 0; --l) {
    LayerCache<T>& C = cache[l];
    // MLP: h_out = h1 + down(silu(g)·u)
    M dh1 = dh;
    M dm(R, c.intermediate_size);
    linear_bwd(C.m, lp(l, DOWN), dh, &dm, &dlp(l, DOWN));
    M dg(R, c.intermediate_size), du(R, c.intermediate_size);
    for (size_t i = 0; i < dm.v.size(); ++i) {
      const T g = C.g.v[i], sg = sigmoid(g);
      du.v[i] = dm.v[i] * g * sg;
      dg.v[i] = dm.v[i] * C.u.v[i] * sg * (T(1) + g * (T(1) - sg));
    }
    M dyn(R, H);
    linear_bwd(C.yn, lp(l, GATE), dg, &dyn, &dlp(l, GATE));
    linear_bwd(C.yn, lp(l, UP), du, &dyn, &dlp(l, UP));
    rms_bwd(C.h1, lp(l, POST_LN).v, C.r_post, H, dyn, dh1, dlp(l, POST_LN).v);
    // Attention: h1 = h_in + o_proj(o)
    M dh_in = dh1;
    M d_o(R, c.q_dim());
    linear_bwd(C.o, lp(l, O), dh1, &d_o, &dlp(l, O));
    M dq(R, c.q_dim()), dkb(R, c.kv_dim()), dvb(R, c.kv_dim()), dkc(N, c.kv_dim()), dvc(N, c.kv_dim());
    std::vector<T> dp;
    for (int64_t r = 0; r < R; ++r) {
      const std::vector<Key>& keys = C.keys[r];
      const int64_t nk = static_cast<int64_t>(keys.size());
      dp.assign(static_cast<size_t>(nk), T(0));
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const int64_t kvo = (hq / group) * d;
        const T* ph = C.prob[r].data() + hq * nk;
        const T* dov = d_o.row(r) + hq * d;
        T pdp = 0;
        for (int64_t i = 0; i < nk; ++i) {
          const Key& k = keys[i];
          dp[i] = dot(dov, (k.in_block ? C.vb.row(k.index) : C.vc.row(k.index)) + kvo, d);
          pdp += ph[i] * dp[i];
          axpy((k.in_block ? dvb.row(k.index) : dvc.row(k.index)) + kvo, ph[i], dov, d);
        }
        const T* qv = C.q.row(r) + hq * d;
        T* dqv = dq.row(r) + hq * d;
        for (int64_t i = 0; i < nk; ++i) {
          const Key& k = keys[i];
          const T ds = ph[i] * (dp[i] - pdp) * scale;
          axpy(dqv, ds, (k.in_block ? C.kb.row(k.index) : C.kc.row(k.index)) + kvo, d);
          axpy((k.in_block ? dkb.row(k.index) : dkc.row(k.index)) + kvo, ds, qv, d);
        }
      }
    }
    rope(dq, d, blk_pos, c.rope_theta, -1.0);
    rope(dkb, d, blk_pos, c.rope_theta, -1.0);
    rope(dkc, d, ctx_pos, c.rope_theta, -1.0);
    M dq_pre(R, c.q_dim()), dkb_pre(R, c.kv_dim()), dkc_pre(N, c.kv_dim());
    rms_bwd(C.q_pre, lp(l, QN).v, C.r_q, d, dq, dq_pre, dlp(l, QN).v);
    rms_bwd(C.kb_pre, lp(l, KN).v, C.r_kb, d, dkb, dkb_pre, dlp(l, KN).v);
    rms_bwd(C.kc_pre, lp(l, KN).v, C.r_kc, d, dkc, dkc_pre, dlp(l, KN).v);
    M dxn(R, H);
    linear_bwd(C.xn, lp(l, Q), dq_pre, &dxn, &dlp(l, Q));
    linear_bwd(C.xn, lp(l, K), dkb_pre, &dxn, &dlp(l, K));
    linear_bwd(C.xn, lp(l, V), dvb, &dxn, &dlp(l, V));
    linear_bwd(ctx, lp(l, K), dkc_pre, &dctx, &dlp(l, K));
    linear_bwd(ctx, lp(l, V), dvc, &dctx, &dlp(l, V));
    rms_bwd(C.h_in, lp(l, IN_LN).v, C.r_in, H, dxn, dh_in, dlp(l, IN_LN).v);
    dh = std::move(dh_in);  // the embeddings are frozen: the gradient stops at the block input
  }
  M dcpre(N, H);
  rms_bwd(cpre, P[1].v, r_ctx, H, dctx, dcpre, dP[1].v);
  M dX(N, c.context_dim());
  linear_bwd(X, P[0], dcpre, grad_context ? &dX : nullptr, &dP[0]);
  if (grad_context) *grad_context = to_f64_tensor(dX);
  if (grads) {
    grads->check(c);
    auto gentries = grads->entries(c);
    for (size_t i = 0; i < gentries.size(); ++i) add_into(*gentries[i].tensor, dP[i], gentries[i].name);
  }
  return st;
}

}  // namespace

}  // namespace dflash::drafter
