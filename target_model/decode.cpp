#include "target_model/decode.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>

#include "core/error.h"
#include "kernels/ops.h"
#include "target_model/model.h"

namespace dflash::target {

// ---------------------------------------------------------------------------------------------
// The checks and bookkeeping every decoder shares.

Decoder::Decoder(TargetConfig config, int64_t num_slots, int64_t max_len)
    : config_(std::move(config)), max_len_(max_len) {
  DFLASH_CHECK_HINT(num_slots >= 1 && max_len >= 1,
                    "decoder: " << num_slots << " slot(s) of " << max_len << " tokens; both must be >= 1",
                    "size the state pool for the sequences decoded at once and their prompt + new tokens");
  length_.assign(static_cast<size_t>(num_slots), 0);
  pending_.assign(static_cast<size_t>(num_slots), 0);
}

int64_t Decoder::length(int32_t slot) const {
  DFLASH_CHECK(slot >= 0 && slot < num_slots(), "decoder: slot " << slot << " is outside [0, " << num_slots() << ")");
  return length_[static_cast<size_t>(slot)];
}

void Decoder::reset(int32_t slot) {
  DFLASH_CHECK(slot >= 0 && slot < num_slots(), "decoder: slot " << slot << " is outside [0, " << num_slots() << ")");
  length_[static_cast<size_t>(slot)] = 0;
  pending_[static_cast<size_t>(slot)] = 0;
  do_reset(slot);
}

ExtendResult Decoder::extend(const std::vector<int32_t>& slots, const std::vector<std::vector<int32_t>>& tokens,
                             const ExtendOptions& options) {
  DFLASH_CHECK(!slots.empty() && slots.size() == tokens.size(),
               "decoder: extend got " << slots.size() << " slot(s) and " << tokens.size() << " token list(s)");
  std::set<int32_t> seen;
  std::vector<int64_t> lengths;
  for (size_t s = 0; s < slots.size(); ++s) {
    const int32_t slot = slots[s];
    DFLASH_CHECK(slot >= 0 && slot < num_slots(), "decoder: slot " << slot << " is outside [0, " << num_slots() << ")");
    DFLASH_CHECK(seen.insert(slot).second, "decoder: slot " << slot << " appears twice in one extend");
    DFLASH_CHECK_HINT(!tokens[s].empty(), "decoder: no tokens for slot " << slot << " (an empty prompt?)",
                      "every sequence needs at least one token");
    const int64_t len = length_[static_cast<size_t>(slot)], T = static_cast<int64_t>(tokens[s].size());
    DFLASH_CHECK_HINT(len + T <= max_len_,
                      "decoder: slot " << slot << " holds " << len << " token(s); " << T << " more exceed the "
                                       << max_len_ << " the state pool was sized for",
                      "size the decoder for the longest prompt + max new tokens + one block");
    for (size_t t = 0; t < tokens[s].size(); ++t)
      DFLASH_CHECK_HINT(tokens[s][t] >= 0 && tokens[s][t] < config_.vocab_size,
                        "decoder: token id " << tokens[s][t] << " (slot " << slot << ", new token " << t
                                             << ") is outside the vocabulary [0, " << config_.vocab_size << ")",
                        "the tokens do not come from this model's tokenizer");
    lengths.push_back(len);
  }
  if (options.sample) {
    ops::check_sample_params(*options.sample);
    DFLASH_CHECK(options.sample_streams.size() == slots.size(),
                 "decoder: sampling needs one stream per slot, got " << options.sample_streams.size() << " for "
                                                                     << slots.size() << " slot(s)");
  }
  for (int64_t id : options.capture)
    DFLASH_CHECK_HINT(id >= 0 && id < config_.num_hidden_layers, "decoder: capture layer id " << id << " is out of range",
                      "layer ids are 0.." << config_.num_hidden_layers - 1 << " (id i = output of decoder layer i)");
  if (!options.commit) std::fill(pending_.begin(), pending_.end(), 0);  // one verify at a time (decode.h)
  ExtendResult r = do_extend(slots, lengths, tokens, options);
  for (size_t s = 0; s < slots.size(); ++s) {
    const size_t i = static_cast<size_t>(slots[s]);
    const int64_t T = static_cast<int64_t>(tokens[s].size());
    if (options.commit) {
      length_[i] += T;
      pending_[i] = 0;
    } else {
      pending_[i] = T;
    }
  }
  return r;
}

void Decoder::commit(int32_t slot, int64_t n) {
  DFLASH_CHECK(slot >= 0 && slot < num_slots(), "decoder: slot " << slot << " is outside [0, " << num_slots() << ")");
  const size_t i = static_cast<size_t>(slot);
  DFLASH_CHECK(pending_[i] > 0, "decoder: commit on slot " << slot << ", which has no uncommitted extend");
  DFLASH_CHECK(n >= 1 && n <= pending_[i],
               "decoder: commit of " << n << " token(s) on slot " << slot << ", whose extend brought " << pending_[i]);
  do_commit(slot, length_[i], n);
  length_[i] += n;
  pending_[i] = 0;
}

// ---------------------------------------------------------------------------------------------
// The CPU reference: the forward's own layer pieces (TargetModel::run_stack and the mixer stages),
// with the conv, the delta rule and attention on slot states (kernels/ops.h decode ops).

namespace {

class CpuDecoder final : public Decoder {
 public:
  CpuDecoder(const TargetModel& model, int64_t num_slots, int64_t max_len)
      : Decoder(model.config(), num_slots, max_len), model_(model) {
    const TargetConfig& c = config_;
    layers_.resize(static_cast<size_t>(c.num_hidden_layers));
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      LayerState& st = layers_[static_cast<size_t>(i)];
      if (c.layer_types[static_cast<size_t>(i)] == LayerType::LinearAttention) {
        st.conv = Tensor::zeros({num_slots, c.linear_conv_kernel_dim - 1, c.gdn_conv_dim()}, DType::F32);
        st.gdn = Tensor::zeros({num_slots, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim},
                               DType::F32);
      } else {
        st.k = Tensor::zeros({num_slots, max_len, c.num_key_value_heads, c.head_dim}, DType::F32);
        st.v = Tensor::zeros({num_slots, max_len, c.num_key_value_heads, c.head_dim}, DType::F32);
      }
    }
    saved_.resize(static_cast<size_t>(num_slots));
  }

  Device device() const override { return Device::cpu(); }
  std::string describe() const override {
    // f32 arithmetic; an FP8 target's projections and MoE blocks on e4m3 values with quantized inputs.
    const TargetWeights& w = model_.weights();
    return w.precision() == Precision::Fp8
               ? std::string("cpu reference (f32; fp8: ") + (w.fp8_projections() > 0 ? "block-FP8 projections" : "") +
                     (w.fp8_projections() > 0 && w.fp8_moe() ? ", " : "") + (w.fp8_moe() ? "W8A8 MoE blocks" : "") + ")"
               : "cpu reference (f32)";
  }

 private:
  struct LayerState {
    Tensor conv, gdn;  // GatedDeltaNet: [P, K-1, conv_dim], [P, Hv, dk, dv]
    Tensor k, v;       // attention: [P, max_len, Hkv, d]
  };
  // What commit needs to advance a slot's GDN states by n of its verified tokens: per GDN layer
  // the conv inputs and the delta rule's inputs of those tokens (rows of the slot in the extend).
  struct SavedLayer {
    Tensor mixed;                   // [T, conv_dim]
    Tensor q, k, v, g, beta;        // [T, ...] as ops::DeltaRuleParams
  };
  using Saved = std::vector<SavedLayer>;  // per layer (empty for attention layers)

  void do_reset(int32_t slot) override {
    for (LayerState& st : layers_) {
      for (Tensor* t : {&st.conv, &st.gdn})
        if (t->defined()) {
          Tensor row = t->select(slot);
          std::fill_n(row.data<float>(), row.numel(), 0.0f);
        }
    }
    saved_[static_cast<size_t>(slot)].clear();
  }

  ExtendResult do_extend(const std::vector<int32_t>& slots, const std::vector<int64_t>& lengths,
                         const std::vector<std::vector<int32_t>>& tokens, const ExtendOptions& opt) override {
    const TargetConfig& c = config_;
    ops::SeqOffsets seqs{{0}};
    std::vector<int32_t> flat;
    for (const auto& t : tokens) {
      flat.insert(flat.end(), t.begin(), t.end());
      seqs.offsets.push_back(seqs.offsets.back() + static_cast<int64_t>(t.size()));
    }
    const int64_t N = seqs.total_tokens(), S = seqs.num_sequences();
    Tensor ids = Tensor::from_blob(flat.data(), {N}, DType::I32);
    std::vector<Saved> saved(opt.commit ? 0 : static_cast<size_t>(S));
    for (Saved& sv : saved) sv.resize(static_cast<size_t>(c.num_hidden_layers));

    const TargetModel::Mixer mixer = [&](int64_t i, const LayerWeights& L, const Tensor& x, Tensor& out) {
      LayerState& st = layers_[static_cast<size_t>(i)];
      if (L.type == LayerType::LinearAttention) {
        const TargetModel::GdnInputs in = model_.gdn_inputs(L, x);
        Tensor conv = Tensor::empty({N, c.gdn_conv_dim()}, DType::F32);
        ops::causal_conv1d_update(in.mixed, L.gdn.conv1d, st.conv, slots, seqs, /*silu=*/true, opt.commit, conv);
        ops::DeltaRuleParams p = model_.gdn_core_params(L, conv, in);
        Tensor core = Tensor::empty({N, c.linear_num_value_heads, c.linear_value_head_dim}, DType::F32);
        ops::gated_delta_rule_pool(p, seqs, st.gdn, slots, opt.commit, &core);
        model_.gdn_output(L, core, in.z, out);
        for (int64_t s = 0; s < static_cast<int64_t>(saved.size()); ++s) {
          const int64_t a = seqs.offsets[s], b = seqs.offsets[s + 1];
          SavedLayer& sl = saved[s][static_cast<size_t>(i)];
          sl.mixed = in.mixed.slice(0, a, b).clone();
          sl.q = p.q.slice(0, a, b).clone();
          sl.k = p.k.slice(0, a, b).clone();
          sl.v = p.v.slice(0, a, b).clone();
          sl.g = p.g.slice(0, a, b).clone();
          sl.beta = p.beta.slice(0, a, b).clone();
        }
      } else {
        TargetModel::AttnInputs a = model_.attn_inputs(L, x);
        for (int64_t s = 0; s < S; ++s) {  // RoPE at each sequence's own positions
          const int64_t lo = seqs.offsets[s], hi = seqs.offsets[s + 1];
          Tensor qs = a.q.slice(0, lo, hi), ks = a.k.slice(0, lo, hi);
          const ops::SeqOffsets one{{0, hi - lo}};
          ops::rope_neox_inplace(qs, one, c.rotary_dim(), c.rope_theta, lengths[s]);
          ops::rope_neox_inplace(ks, one, c.rotary_dim(), c.rope_theta, lengths[s]);
        }
        // The new K/V go into the cache after the committed ones: harmless for a verify that is
        // committed shorter (those positions are written again by the next extend).
        ops::kv_cache_append(a.k, a.v, st.k, st.v, slots, lengths, seqs);
        Tensor attn = Tensor::empty({N, c.num_attention_heads, c.head_dim}, DType::F32);
        ops::attention_decode(a.q, st.k, st.v, slots, lengths, seqs, /*causal=*/true, /*window=*/0,
                              1.0f / std::sqrt(static_cast<float>(c.head_dim)), attn);
        model_.attn_output(L, attn, a.gate, out);
      }
    };
    std::map<int64_t, Tensor> captured;
    Tensor h = model_.run_stack(ids, mixer, opt.capture, captured);
    for (size_t s = 0; s < saved.size(); ++s) saved_[static_cast<size_t>(slots[s])] = std::move(saved[s]);

    // Rows kept: every new token, or each slot's last one.
    ExtendResult r;
    std::vector<int64_t> rows;
    r.offsets = {0};
    for (int64_t s = 0; s < S; ++s) {
      const int64_t lo = opt.last_only ? seqs.offsets[s + 1] - 1 : seqs.offsets[s];
      for (int64_t n = lo; n < seqs.offsets[s + 1]; ++n) rows.push_back(n);
      r.offsets.push_back(static_cast<int64_t>(rows.size()));
    }
    const int64_t R = static_cast<int64_t>(rows.size()), H = c.hidden_size;
    auto gather = [&](const Tensor& src) {
      if (R == N) return src;
      Tensor out = Tensor::empty({R, src.size(1)}, DType::F32);
      for (int64_t j = 0; j < R; ++j)
        std::copy_n(src.data<float>() + rows[j] * src.size(1), src.size(1), out.data<float>() + j * src.size(1));
      return out;
    };
    if (!opt.capture.empty()) {
      const int64_t k = static_cast<int64_t>(opt.capture.size());
      r.features = Tensor::empty({R, k * H}, DType::F32);
      for (int64_t l = 0; l < k; ++l) {
        const Tensor src = gather(captured.at(opt.capture[static_cast<size_t>(l)]));
        for (int64_t j = 0; j < R; ++j)
          std::copy_n(src.data<float>() + j * H, H, r.features.data<float>() + j * k * H + l * H);
      }
    }
    Tensor hr = gather(h), normed = Tensor::empty({R, H}, DType::F32), logits = Tensor::empty({R, c.vocab_size}, DType::F32);
    model_.final_norm(hr, normed);
    model_.lm_head(normed, logits);
    if (opt.sample) {
      std::vector<uint64_t> streams(static_cast<size_t>(R));
      std::vector<int64_t> positions(static_cast<size_t>(R));
      for (int64_t s = 0; s < S; ++s)
        for (int64_t j = r.offsets[s]; j < r.offsets[s + 1]; ++j) {
          streams[j] = opt.sample_streams[static_cast<size_t>(s)];
          positions[j] = lengths[s] + rows[j] - seqs.offsets[s];
        }
      ops::sample_rows(logits, *opt.sample, streams, positions, r.next);
    } else {
      ops::argmax_rows(logits, r.next);
    }
    if (opt.logits) r.logits = logits;
    return r;
  }

  void do_commit(int32_t slot, int64_t, int64_t n) override {
    const TargetConfig& c = config_;
    Saved& sv = saved_[static_cast<size_t>(slot)];
    DFLASH_CHECK(!sv.empty(), "decoder: slot " << slot << " has no saved verify inputs");
    const std::vector<int32_t> slots{slot};
    const ops::SeqOffsets seqs{{0, n}};
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      if (c.layer_types[static_cast<size_t>(i)] != LayerType::LinearAttention) continue;
      const LayerWeights& L = model_.weights().layers[static_cast<size_t>(i)];
      LayerState& st = layers_[static_cast<size_t>(i)];
      const SavedLayer& sl = sv[static_cast<size_t>(i)];
      // The states advance by the n accepted tokens; their outputs were made by the verify.
      Tensor scratch = Tensor::empty({n, c.gdn_conv_dim()}, DType::F32);
      ops::causal_conv1d_update(sl.mixed.slice(0, 0, n), L.gdn.conv1d, st.conv, slots, seqs, true, true, scratch);
      ops::DeltaRuleParams p;
      p.q = sl.q.slice(0, 0, n);
      p.k = sl.k.slice(0, 0, n);
      p.v = sl.v.slice(0, 0, n);
      p.g = sl.g.slice(0, 0, n);
      p.beta = sl.beta.slice(0, 0, n);
      p.l2norm_qk = true;
      ops::gated_delta_rule_pool(p, seqs, st.gdn, slots, true, nullptr);
    }
    sv.clear();
  }

  const TargetModel& model_;
  std::vector<LayerState> layers_;
  std::vector<Saved> saved_;  // per slot: the inputs of its uncommitted extend
};

}  // namespace

std::unique_ptr<Decoder> make_cpu_decoder(const TargetModel& model, int64_t num_slots, int64_t max_len) {
  return std::make_unique<CpuDecoder>(model, num_slots, max_len);
}

}  // namespace dflash::target
