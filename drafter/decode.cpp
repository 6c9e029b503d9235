// The CPU proposer (decode.h): the training forward of model.cpp for one block at the context's end,
// in double (the reference) or float (DrafterMath::F32: the same GEMM, loops and operation order as the
// training step's F32 math, so its drafts are the ones that step's estimate predicts), written with the
// same helpers (ref_math.h) and the same mask (mask_allows with anchor = context length), over a
// per-slot cache of each layer's context keys (k_proj, k_norm, RoPE at their positions) and values.
#include "drafter/decode.h"

#include <cmath>
#include <type_traits>

#include "drafter/proposer_slots.h"
#include "drafter/ref_math.h"
#include "core/error.h"

namespace dflash::drafter {

namespace {

using namespace ref;

template <class T>
class CpuProposer final : public Proposer {
  using M = MatT<T>;

 public:
  CpuProposer(const DrafterConfig& c, const DrafterWeights& w, const FrozenTarget& target, int64_t num_slots,
              int64_t max_len)
      : c_(c), slots_(c, num_slots, max_len, "cpu proposer"), target_(target) {
    c_.validate();
    w.check(c_);
    for (const auto& [t, name] : {std::pair{&target_.embed_tokens, "embed_tokens"}, {&target_.lm_head, "lm_head"}})
      DFLASH_CHECK(t->defined() && t->device().is_cpu() && t->dim() == 2 && t->size(0) == c_.vocab_size &&
                       t->size(1) == c_.hidden_size && dtype_is_float(t->dtype()),
                   "cpu proposer: target " << name << " must be a host float tensor [" << c_.vocab_size << ", "
                                           << c_.hidden_size << "], got " << (t->defined() ? t->describe() : "undefined"));
    P_ = load_params<T>(c_, w);
    if constexpr (std::is_same_v<T, float>)
      lm_head_f32_ = target_.lm_head.dtype() == DType::F32 ? target_.lm_head.contiguous() : target_.lm_head.to_dtype(DType::F32);
    cache_.resize(static_cast<size_t>(num_slots));
    for (int32_t s = 0; s < num_slots; ++s) reset(s);
  }

  const DrafterConfig& config() const override { return c_; }
  Device device() const override { return Device::cpu(); }
  int64_t num_slots() const override { return slots_.num_slots(); }
  int64_t max_len() const override { return slots_.max_len(); }
  int64_t context_length(int32_t slot) const override { return slots_.length(slot); }
  void reset(int32_t slot) override {
    slots_.reset(slot);
    cache_[slot].k.assign(static_cast<size_t>(c_.num_hidden_layers), M(0, c_.kv_dim()));
    cache_[slot].v = cache_[slot].k;
  }

  void add_context(const std::vector<int32_t>& slots, const Tensor& features, const ops::SeqOffsets& seqs) override {
    slots_.check_add(slots, features, seqs);
    DFLASH_CHECK(features.device().is_cpu() && dtype_is_float(features.dtype()),
                 "cpu proposer: add_context: features must be a host float tensor, got " << features.describe());
    const int64_t H = c_.hidden_size, d = c_.head_dim, N = features.size(0);
    const double eps = c_.rms_norm_eps;
    // ctx = hidden_norm(fc(features)), then per layer k = rope(k_norm(k_proj ctx)), v = v_proj ctx.
    std::vector<T> r;
    const M ctx = rms(linear(to_mat<T>(features), P_[0]), P_[1].v, H, eps, r);
    std::vector<int64_t> pos(static_cast<size_t>(N));
    for (size_t s = 0; s < slots.size(); ++s)
      for (int64_t n = seqs.offsets[s]; n < seqs.offsets[s + 1]; ++n)
        pos[n] = slots_.length(slots[s]) + (n - seqs.offsets[s]);
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      M k = rms(linear(ctx, lp(l, K)), lp(l, KN).v, d, eps, r);
      rope(k, d, pos, c_.rope_theta, 1.0);
      const M v = linear(ctx, lp(l, V));
      for (size_t s = 0; s < slots.size(); ++s) {
        SlotCache& sc = cache_[slots[s]];
        append_rows(sc.k[l], k, seqs.offsets[s], seqs.offsets[s + 1]);
        append_rows(sc.v[l], v, seqs.offsets[s], seqs.offsets[s + 1]);
      }
    }
    slots_.commit_add(slots, seqs);
  }

  std::vector<std::vector<int32_t>> propose(const std::vector<int32_t>& slots, const std::vector<int32_t>& x_start,
                                            int64_t block_size, Tensor* logits) override {
    slots_.check_propose(slots, x_start, block_size);
    const int64_t Bp = block_size, S = static_cast<int64_t>(slots.size()), R = S * Bp;
    const int64_t H = c_.hidden_size, d = c_.head_dim, Hq = c_.num_attention_heads;
    const int64_t group = Hq / c_.num_key_value_heads;
    const double eps = c_.rms_norm_eps;
    const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(d)));
    // Block s: rows s·Bp + j = [x_start, mask × (Bp-1)] at positions n_s + j (n_s = its context length).
    std::vector<int64_t> ids(static_cast<size_t>(R), c_.mask_token_id), pos(static_cast<size_t>(R));
    for (int64_t s = 0; s < S; ++s) {
      ids[s * Bp] = x_start[s];
      for (int64_t j = 0; j < Bp; ++j) pos[s * Bp + j] = slots_.length(slots[s]) + j;
    }
    M h(R, H);
    embed_rows(target_.embed_tokens, ids, h);
    std::vector<T> r, prob;
    std::vector<Key> keys;
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      const M xn = rms(h, lp(l, IN_LN).v, H, eps, r);
      M q = rms(linear(xn, lp(l, Q)), lp(l, QN).v, d, eps, r);
      M kb = rms(linear(xn, lp(l, K)), lp(l, KN).v, d, eps, r);
      const M vb = linear(xn, lp(l, V));
      rope(q, d, pos, c_.rope_theta, 1.0);
      rope(kb, d, pos, c_.rope_theta, 1.0);
      M o(R, c_.q_dim());
      for (int64_t s = 0; s < S; ++s) {
        const SlotCache& sc = cache_[slots[s]];
        const int64_t n = slots_.length(slots[s]);
        for (int64_t j = 0; j < Bp; ++j) {
          block_keys(c_.layer_types[l], c_.sliding_window, n, j, n, 0, Bp, s * Bp, MaskVariant::Correct, keys);
          attend(q.row(s * Bp + j), keys, sc.k[l], sc.v[l], kb, vb, Hq, group, d, scale, prob, o.row(s * Bp + j));
        }
      }
      const M attn = linear(o, lp(l, O));
      for (size_t i = 0; i < attn.v.size(); ++i) h.v[i] += attn.v[i];
      const M yn = rms(h, lp(l, POST_LN).v, H, eps, r);
      const M g = linear(yn, lp(l, GATE)), u = linear(yn, lp(l, UP));
      M m(R, c_.intermediate_size);
      for (size_t i = 0; i < m.v.size(); ++i) m.v[i] = g.v[i] * sigmoid(g.v[i]) * u.v[i];
      const M mlp = linear(m, lp(l, DOWN));
      for (size_t i = 0; i < mlp.v.size(); ++i) h.v[i] += mlp.v[i];
    }
    const M hf = rms(h, P_.back().v, H, eps, r);
    const Tensor lg = head_logits(hf);
    std::vector<int32_t> top;
    ops::argmax_rows(lg, top);
    std::vector<std::vector<int32_t>> drafts(static_cast<size_t>(S));
    for (int64_t s = 0; s < S; ++s) drafts[s].assign(top.begin() + s * Bp + 1, top.begin() + (s + 1) * Bp);
    if (logits) *logits = lg.to_dtype(DType::F32);
    return drafts;
  }

 private:
  // logits [R, V] = hf · lm_headᵀ: in double one lm_head row (converted) at a time; in float the GEMM
  // that the training step's loss uses (the same bits for every row).
  Tensor head_logits(const M& hf) const {
    const int64_t R = hf.rows, H = c_.hidden_size, Vocab = c_.vocab_size;
    if constexpr (std::is_same_v<T, float>) {
      Tensor lg = Tensor::empty({R, Vocab}, DType::F32);
      cpu::gemm_f32(cpu::Trans::N, cpu::Trans::T, R, Vocab, H, hf.v.data(), H, lm_head_f32_.data<float>(), H, false,
                    lg.data<float>(), Vocab);
      return lg;
    } else {
      Tensor lg = Tensor::empty({R, Vocab}, DType::F64);
      const Tensor lm = target_.lm_head.contiguous();
      const auto* lm_base = static_cast<const uint8_t*>(lm.raw_data());
      std::vector<double> wrow(static_cast<size_t>(H));
      for (int64_t v = 0; v < Vocab; ++v) {
        convert_elements(lm_base + static_cast<size_t>(v * H) * dtype_size(lm.dtype()), lm.dtype(), wrow.data(),
                         DType::F64, H);
        for (int64_t i = 0; i < R; ++i) lg.data<double>()[i * Vocab + v] = dot(hf.row(i), wrow.data(), H);
      }
      return lg;
    }
  }

  struct SlotCache {
    std::vector<M> k, v;  // per layer [context length, Hkv·d]: k normed and rotated at its positions
  };
  M& lp(int64_t l, int slot) { return P_[param_index(l, slot)]; }
  static void append_rows(M& dst, const M& src, int64_t begin, int64_t end) {
    dst.v.insert(dst.v.end(), src.row(begin), src.row(begin) + (end - begin) * src.cols);
    dst.rows += end - begin;
  }

  DrafterConfig c_;
  ProposerSlots slots_;
  FrozenTarget target_;
  std::vector<M> P_;              // parameters, DrafterWeights::entries order
  Tensor lm_head_f32_;            // F32: the lm_head as f32
  std::vector<SlotCache> cache_;  // [num_slots]
};

}  // namespace

std::unique_ptr<Proposer> make_cpu_proposer(const DrafterConfig& config, const DrafterWeights& weights,
                                            const FrozenTarget& target, int64_t num_slots, int64_t max_len,
                                            DrafterMath math) {
  if (math == DrafterMath::F32) return std::make_unique<CpuProposer<float>>(config, weights, target, num_slots, max_len);
  return std::make_unique<CpuProposer<double>>(config, weights, target, num_slots, max_len);
}

}  // namespace dflash::drafter
