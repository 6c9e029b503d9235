// target::Decoder on one GPU (a TP rank): the CUDA forward with a DecodeStep (model_cuda.h), so
// prefill, decode and verify run the same layer code as the forward and differ only in the conv,
// the delta rule and attention (the decode plan's kernels on the slot states).
//
// Every decode / verify step runs its rows padded to a multiple of 16 (the pad rows belong to no
// sequence), so a T = 1 decode and a T = 16 verify of one sequence launch the same GEMMs and
// row-wise kernels on the same shapes: each row's arithmetic is the same in both, and speculative
// decoding reproduces target-only greedy decoding bit for bit (batch invariance), not just to
// rounding. The sequence-aware kernels (conv update, delta rule pool, KV append, attention decode)
// compute each token from its own inputs and state in the same order whatever T is.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cuda/attention.h"
#include "core/cuda/check.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gdn.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/sampling.h"
#include "core/device.h"
#include "target_model/decode.h"
#include "target_model/model_cuda.h"

namespace dflash::target {

namespace {

Tensor upload_i32(const std::vector<int32_t>& v, Device d) {
  return Tensor::from_blob(const_cast<int32_t*>(v.data()), {static_cast<int64_t>(v.size())}, DType::I32).to(d);
}

// Host arrays packed (16-byte aligned each) into one buffer that goes to the device in one copy.
class Staging {
 public:
  template <class T>
  size_t add(const std::vector<T>& v) {
    const size_t off = (bytes_.size() + 15) / 16 * 16;
    bytes_.resize(off + v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(bytes_.data() + off, v.data(), v.size() * sizeof(T));
    return off;
  }
  Tensor upload(Device d) {
    bytes_.resize(std::max<size_t>((bytes_.size() + 15) / 16 * 16, 16));
    return Tensor::from_blob(bytes_.data(), {static_cast<int64_t>(bytes_.size())}, DType::U8).to(d);
  }

 private:
  std::vector<char> bytes_;
};

class CudaDecoder final : public Decoder {
 public:
  CudaDecoder(CudaTargetModel& model, int64_t num_slots, int64_t max_len, FastPathPlan plan)
      : Decoder(model.config(), num_slots, max_len), model_(model), plan_(std::move(plan)), dev_(model.device()) {
    const TargetConfig& c = config_;
    DFLASH_CHECK(plan_.layers.size() == static_cast<size_t>(c.num_hidden_layers),
                 "CUDA decoder: the decode plan has " << plan_.layers.size() << " layers, the model "
                                                      << c.num_hidden_layers);
    state_.resize(static_cast<size_t>(c.num_hidden_layers));
    tensors_.resize(state_.size());
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      DecodeLayer& dl = state_[static_cast<size_t>(i)];
      LayerTensors& t = tensors_[static_cast<size_t>(i)];
      dl.plan = &plan_.layers[static_cast<size_t>(i)];
      if (c.layer_types[static_cast<size_t>(i)] == LayerType::LinearAttention) {
        t.a = Tensor::zeros({num_slots, c.linear_conv_kernel_dim - 1, c.gdn_conv_dim()}, DType::BF16, dev_);
        t.b = Tensor::zeros({num_slots, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim},
                            DType::F32, dev_);
        dl.conv_state = t.a.raw_data();
        dl.gdn_state = t.b.data<float>();
      } else {
        t.a = Tensor::empty({num_slots, max_len, c.num_key_value_heads, c.head_dim}, DType::BF16, dev_);
        t.b = Tensor::empty({num_slots, max_len, c.num_key_value_heads, c.head_dim}, DType::BF16, dev_);
        dl.k_cache = t.a.raw_data();
        dl.v_cache = t.b.raw_data();
      }
    }
    pending_rows_.assign(static_cast<size_t>(num_slots), -1);
  }

  Device device() const override { return dev_; }
  std::string describe() const override { return plan_.device + ", decode plan: " + plan_.summary(); }
  std::string kernels_run() const override { return counters_.str(); }
  void synchronize() override { DFLASH_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(model_.stream()))); }

 private:
  struct LayerTensors {
    Tensor a, b;  // conv + recurrent state, or k + v cache
  };

  void do_reset(int32_t slot) override {
    const TargetConfig& c = config_;
    auto s = static_cast<cudaStream_t>(model_.stream());
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      if (c.layer_types[static_cast<size_t>(i)] != LayerType::LinearAttention) continue;  // caches: overwritten in order
      for (Tensor* t : {&tensors_[static_cast<size_t>(i)].a, &tensors_[static_cast<size_t>(i)].b}) {
        const size_t row = t->nbytes() / static_cast<size_t>(num_slots());
        DFLASH_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(t->raw_data()) + row * static_cast<size_t>(slot), 0, row, s));
      }
    }
    pending_rows_[static_cast<size_t>(slot)] = -1;
  }

  ExtendResult do_extend(const std::vector<int32_t>& slots, const std::vector<int64_t>& lengths,
                         const std::vector<std::vector<int32_t>>& tokens, const ExtendOptions& opt) override {
    const TargetConfig& c = config_;
    const int64_t S = static_cast<int64_t>(slots.size()), H = c.hidden_size, V = c.vocab_size;
    DecodeStep step;
    // Prompts into empty slots: the forward's kernels over the packed batch. Any other extend (a
    // slot with a past, or a verify) runs the decode kernels on the padded rows.
    step.prefill = opt.commit && std::all_of(lengths.begin(), lengths.end(), [](int64_t l) { return l == 0; });
    step.commit = opt.commit;
    step.host_slots = slots;
    step.num_slots = num_slots();
    step.max_len = max_len();
    step.layers = &state_;
    step.counters = &counters_;
    // The batch: real tokens packed, positions from each slot's length; decode steps padded to 16 rows.
    CudaBatch b;
    b.offsets = {0};
    std::vector<int32_t> ids, pos, cu{0}, past;
    for (int64_t s = 0; s < S; ++s) {
      const auto& t = tokens[static_cast<size_t>(s)];
      for (size_t j = 0; j < t.size(); ++j) {
        ids.push_back(t[j]);
        pos.push_back(static_cast<int32_t>(lengths[s] + static_cast<int64_t>(j)));
      }
      b.offsets.push_back(b.offsets.back() + static_cast<int64_t>(t.size()));
      cu.push_back(static_cast<int32_t>(b.offsets.back()));
      past.push_back(static_cast<int32_t>(lengths[s]));
      b.max_seqlen = std::max<int64_t>(b.max_seqlen, static_cast<int64_t>(t.size()));
    }
    const int64_t N = b.offsets.back();
    const int64_t rows = step.prefill ? N : (N + 15) / 16 * 16;
    ids.resize(static_cast<size_t>(rows), 0);
    pos.resize(static_cast<size_t>(rows), 0);

    // Kept rows: all new tokens, or each slot's last one.
    ExtendResult r;
    r.offsets = {0};
    std::vector<int32_t> keep;
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t n = opt.last_only ? b.offsets[s + 1] - 1 : b.offsets[s]; n < b.offsets[s + 1]; ++n)
        keep.push_back(static_cast<int32_t>(n));
      r.offsets.push_back(static_cast<int64_t>(keep.size()));
    }
    const int64_t R = static_cast<int64_t>(keep.size());
    // The lm_head: a prefill's kept rows alone (gathered when that is not every row: last_only); a
    // decode step's every (padded) row, the same GEMM shape for T = 1 and T = 16 (batch invariance).
    const bool gather_head = step.prefill && R < N;
    const int64_t M = gather_head ? R : rows;
    auto head_row = [&](int64_t j) -> int64_t { return gather_head ? j : keep[static_cast<size_t>(j)]; };
    // Sampling: lm_head row m is drawn with its slot's stream at its token's position (pad rows:
    // stream 0, position 0, drawn and dropped), as the CPU decoder draws its kept rows.
    std::vector<uint64_t> streams;
    std::vector<int64_t> positions;
    if (opt.sample) {
      streams.assign(static_cast<size_t>(M), 0);
      positions.assign(static_cast<size_t>(M), 0);
      for (int64_t s = 0; s < S; ++s)
        for (int64_t n = b.offsets[s]; n < b.offsets[s + 1]; ++n) {
          int64_t m = n;  // the lm_head row of token n (gathered: its index among the kept rows, if kept)
          if (gather_head) {
            if (n != b.offsets[s + 1] - 1) continue;  // last_only keeps the last token alone
            m = r.offsets[s];
          }
          streams[static_cast<size_t>(m)] = opt.sample_streams[static_cast<size_t>(s)];
          positions[static_cast<size_t>(m)] = lengths[s] + n - b.offsets[s];
        }
    }

    // Everything the step reads on the device, in one upload (one host sync per extend).
    Staging st;
    const size_t o_ids = st.add(ids), o_pos = st.add(pos), o_cu = st.add(cu), o_slots = st.add(slots);
    const size_t o_past = st.add(past), o_keep = st.add(keep), o_streams = st.add(streams), o_positions = st.add(positions);
    const Tensor staged = st.upload(dev_);
    auto at = [&](size_t off) { return static_cast<char*>(staged.raw_data()) + off; };
    auto i32 = [&](size_t off, int64_t n) { return Tensor::from_blob(at(off), {n}, DType::I32, dev_); };
    b.num_tokens = rows;
    b.num_seqs = S;
    b.ids = i32(o_ids, rows);
    b.pos = i32(o_pos, rows);
    b.cu_seqlens = i32(o_cu, S + 1);
    step.slots = reinterpret_cast<const int32_t*>(at(o_slots));
    step.past_len = reinterpret_cast<const int32_t*>(at(o_past));
    const int32_t* d_keep = reinterpret_cast<const int32_t*>(at(o_keep));
    step.real_tokens = N;
    step.max_new = b.max_seqlen;
    if (!step.prefill) {
      // Absolute key splits: about 32 of them over the pool's length (enough CTAs for the 132 SMs
      // at batch 1), the same for every step of this decoder.
      step.split_keys = std::max<int64_t>(64, ((max_len() + 31) / 32 + 63) / 64 * 64);
      for (int64_t s2 = 0; s2 < S; ++s2)
        step.key_bound = std::max<int64_t>(step.key_bound, lengths[s2] + static_cast<int64_t>(tokens[s2].size()));
      cuda::AttentionDecodeParams probe;  // the workspace the flash-decoding kernel wants for this step
      probe.num_seqs = S, probe.N = N, probe.Hq = c.num_attention_heads, probe.Hkv = c.num_key_value_heads;
      probe.d = c.head_dim, probe.max_len = max_len(), probe.num_slots = num_slots(), probe.max_new = step.max_new;
      probe.scale = 1.0f, probe.split_keys = step.split_keys, probe.key_bound = step.key_bound;
      const size_t need = cuda::attention_decode_workspace(probe);
      if (!workspace_.defined() || workspace_.nbytes() < need)
        workspace_ = Tensor::empty({static_cast<int64_t>(std::max<size_t>(need, 1))}, DType::U8, dev_);
      step.attn_workspace = workspace_.raw_data();
      step.attn_workspace_bytes = workspace_.nbytes();
    }
    ForwardOptions fo;
    fo.capture = opt.capture;
    fo.final_norm = true;
    model_.set_decode(&step);
    ForwardResult fr;
    try {
      fr = model_.forward(b, fo);
    } catch (...) {
      model_.set_decode(nullptr);
      throw;
    }
    model_.set_decode(nullptr);
    if (!opt.commit)
      for (int64_t s = 0; s < S; ++s) pending_rows_[static_cast<size_t>(slots[s])] = b.offsets[s];

    auto s = static_cast<cudaStream_t>(model_.stream());
    Tensor head_in = fr.final_hidden;
    if (gather_head) {  // the kept rows of the final hidden state, packed (cuda::embedding as a row gather)
      head_in = Tensor::empty({R, H}, DType::BF16, dev_);
      cuda::embedding(d_keep, fr.final_hidden.raw_data(), head_in.raw_data(), R, H, s);
    }
    // Logits rows padded to Vp = V rounded up to 8 floats (32 bytes), so the LM-head GEMM's D keeps
    // 16-byte aligned rows for any vocabulary (V = 777: ldd 784); the pad columns are never written
    // nor read (the GEMM's N, argmax / sampling and the copy to the host take V).
    const int64_t Vp = (V + 7) / 8 * 8;
    Tensor logits = Tensor::empty({M, Vp}, DType::F32, dev_);
    cuda::GemmExParams gp;
    gp.a = head_in.raw_data();
    gp.lda = H;
    gp.b = model_.weights().lm_head.raw_data();
    gp.ldb = H;
    gp.trans_b = true;
    gp.d = logits.raw_data();
    gp.ldd = Vp;
    gp.d_f32 = true;
    gp.M = M, gp.N = V, gp.K = H;
    gp.unaligned = model_.gemm_unaligned();  // hidden_size not a multiple of 8
    cuda::gemm_ex(gp, dev_.index);
    Tensor next = Tensor::empty({M}, DType::I32, dev_);
    if (opt.sample)
      cuda::sample_rows(logits.data<float>(), Vp, M, V, opt.sample->temperature, opt.sample->top_p, opt.sample->seed,
                        reinterpret_cast<const uint64_t*>(at(o_streams)), reinterpret_cast<const int64_t*>(at(o_positions)),
                        next.data<int32_t>(), s);
    else
      cuda::argmax_rows(logits.raw_data(), false, Vp, M, V, next.data<int32_t>(), s);
    if (!opt.capture.empty()) {
      const int64_t k = static_cast<int64_t>(opt.capture.size());
      r.features = Tensor::empty({R, k * H}, DType::BF16, dev_);
      // Kept rows in runs of consecutive rows: one 2-D copy per run when there are few runs (decode
      // steps: one), else one gather of all of them and one 2-D copy (a prefill's last rows).
      int64_t runs = 0;
      for (int64_t j = 0; j < R; ++j) runs += j == 0 || keep[j] != keep[j - 1] + 1;
      Tensor packed = runs > 2 && k > 1 ? Tensor::empty({R, H}, DType::BF16, dev_) : Tensor();
      for (int64_t l = 0; l < k; ++l) {
        const Tensor& src = fr.layers.at(opt.capture[static_cast<size_t>(l)]);
        char* dst = static_cast<char*>(r.features.raw_data()) + l * H * 2;
        if (runs > 2) {
          cuda::embedding(d_keep, src.raw_data(), k > 1 ? packed.raw_data() : dst, R, H, s);
          if (k > 1)
            DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<size_t>(k * H * 2), packed.raw_data(),
                                                static_cast<size_t>(H * 2), static_cast<size_t>(H * 2),
                                                static_cast<size_t>(R), cudaMemcpyDeviceToDevice, s));
          continue;
        }
        for (int64_t a = 0; a < R;) {
          int64_t e = a + 1;
          while (e < R && keep[e] == keep[e - 1] + 1) ++e;
          DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(dst + a * k * H * 2, static_cast<size_t>(k * H * 2),
                                              static_cast<const char*>(src.raw_data()) + keep[a] * H * 2,
                                              static_cast<size_t>(H * 2), static_cast<size_t>(H * 2),
                                              static_cast<size_t>(e - a), cudaMemcpyDeviceToDevice, s));
          a = e;
        }
      }
    }
    const Tensor next_h = next.to(Device::cpu());
    r.next.resize(static_cast<size_t>(R));
    for (int64_t j = 0; j < R; ++j) r.next[static_cast<size_t>(j)] = next_h.data<int32_t>()[head_row(j)];
    if (opt.logits) {
      Tensor lh = logits.to(Device::cpu());
      r.logits = Tensor::empty({R, V}, DType::F32);
      for (int64_t j = 0; j < R; ++j)
        std::copy_n(lh.data<float>() + head_row(j) * Vp, V, r.logits.data<float>() + j * V);
    }
    return r;
  }

  // The GDN states advance by the n accepted tokens from the verify's saved inputs: the conv update
  // and the delta rule on them alone (their outputs were the verify's).
  void do_commit(int32_t slot, int64_t, int64_t n) override {
    const TargetConfig& c = config_;
    const int64_t row0 = pending_rows_[static_cast<size_t>(slot)];
    DFLASH_CHECK(row0 >= 0, "CUDA decoder: slot " << slot << " has no saved verify inputs");
    const Tensor d_slot = upload_i32({slot}, dev_), d_cu = upload_i32({0, static_cast<int32_t>(n)}, dev_);
    auto s = static_cast<cudaStream_t>(model_.stream());
    const int64_t Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads, dk = c.linear_key_head_dim;
    const int64_t dv = c.linear_value_head_dim, C = c.gdn_conv_dim();
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      if (c.layer_types[static_cast<size_t>(i)] != LayerType::LinearAttention) continue;
      DecodeLayer& dl = state_[static_cast<size_t>(i)];
      const LayerWeights& L = model_.weights().layers[static_cast<size_t>(i)];
      if (!scratch_.defined() || scratch_.size(0) < n * C) scratch_ = Tensor::empty({std::max<int64_t>(n, 16) * C}, DType::BF16, dev_);
      const ConvUpdateCall call{static_cast<const char*>(dl.proj.raw_data()) + row0 * dl.proj_ld * 2, dl.proj_ld,
                                scratch_.raw_data(), d_slot.data<int32_t>(), d_cu.data<int32_t>(), 1, n, num_slots(), true};
      run_conv_update(c, L, dl, call, counters_, s);
      cuda::DeltaRuleParams p;  // the accepted tokens' rows of the verify's inputs
      p.q = static_cast<const char*>(dl.q.raw_data()) + row0 * Hk * dk * 2;
      p.k = static_cast<const char*>(dl.k.raw_data()) + row0 * Hk * dk * 2;
      p.v = static_cast<const char*>(dl.conv.raw_data()) + (row0 * C + 2 * Hk * dk) * 2;
      p.ldv = C;
      p.g = dl.g.data<float>() + row0 * Hv;
      p.beta = dl.beta.data<float>() + row0 * Hv;
      p.out = nullptr;
      p.cu_seqlens = d_cu.data<int32_t>();
      p.num_seqs = 1, p.N = n, p.Hk = Hk, p.Hv = Hv, p.dk = dk, p.dv = dv;
      run_delta_rule_pool(dl, p, d_slot.data<int32_t>(), num_slots(), true, counters_, s);
    }
    pending_rows_[static_cast<size_t>(slot)] = -1;
    // The saved inputs are released with the next extend of any slot (they belong to one batch).
  }

  CudaTargetModel& model_;
  FastPathPlan plan_;
  Device dev_;
  std::vector<DecodeLayer> state_;
  std::vector<LayerTensors> tensors_;
  std::vector<int64_t> pending_rows_;  // per slot: its first row in the last verify's batch, -1: none
  PathCounters counters_;
  Tensor workspace_, scratch_;
};

}  // namespace

std::unique_ptr<Decoder> make_cuda_decoder(CudaTargetModel& model, int64_t num_slots, int64_t max_len,
                                           FastPathPlan decode_plan) {
  return std::make_unique<CudaDecoder>(model, num_slots, max_len, std::move(decode_plan));
}

}  // namespace dflash::target
