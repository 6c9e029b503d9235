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
//
// CUDA graphs (FastPathPlan::cuda_graphs, on by default; --no-cuda-graphs): a decode / verify step
// shape (tokens per slot, the options, the attention's key splits rounded up to a power of two) and
// a commit shape (n, its row, the verify graph it follows) run eagerly once, are then captured
// (relaxed mode) into a graph whose buffers — the fixed input buffer the host arrays are copied into,
// temporaries, outputs, a verify's saved layer inputs — come from the graph's own device_alloc::Pool,
// and are replayed from then on; the caller gets its own copy of the features. Prefill is never
// captured, nor a step with more than 16 tokens of a slot (a chunked prefill's prompt piece: its shapes
// rarely repeat); a profiler, tensor parallelism or a failed capture (logged) run eagerly, and every eager
// step with graphs on is counted by reason (kernels_run(), graph_stats()). Replays give the eager
// launches' values bit for bit (the extra key splits add exact zeros; tests/test_cuda_decoder.cpp).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <sstream>

#include <spdlog/spdlog.h>

#include "kernels/cuda/attention.h"
#include "core/cuda/check.h"
#include "core/cuda/graph.h"
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
  // The packed bytes (padded to 16, at least 16): what upload copies.
  const std::vector<char>& bytes() {
    bytes_.resize(std::max<size_t>((bytes_.size() + 15) / 16 * 16, 16));
    return bytes_;
  }
  Tensor upload(Device d) {
    bytes();
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
    for (LayerType t : c.layer_types) gdn_layers_ += t == LayerType::LinearAttention;
    if (plan_.fusion.fp8_packed && plan_.fusion.skinny_gemm) {
      const int64_t bytes = model_.pack_decode_weights();
      if (bytes > 0)
        spdlog::info("decode plan: the FP8 projections' packed decode copies hold {:.2f} GB", static_cast<double>(bytes) / 1e9);
    }
    if (plan_.fusion.commit && plan_.fusion.commit_overlap && plan_.cuda_graphs) {
      cuda::DeviceGuard scope(dev_.index);
      DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
      DFLASH_CUDA_CHECK(cudaEventCreateWithFlags(&ev_fork_, cudaEventDisableTiming));
      DFLASH_CUDA_CHECK(cudaEventCreateWithFlags(&ev_join_, cudaEventDisableTiming));
    }
  }

  ~CudaDecoder() override {
    // The graphs' pools go back to the driver once nothing runs on them and no layer holds their buffers.
    if (side_) DFLASH_CUDA_WARN(cudaStreamSynchronize(side_));
    DFLASH_CUDA_WARN(cudaStreamSynchronize(static_cast<cudaStream_t>(model_.stream())));
    restore_saved(std::vector<SavedLayer>(state_.size()));
    graphs_.clear();
    if (ev_fork_) DFLASH_CUDA_WARN(cudaEventDestroy(ev_fork_));
    if (ev_join_) DFLASH_CUDA_WARN(cudaEventDestroy(ev_join_));
    if (side_) DFLASH_CUDA_WARN(cudaStreamDestroy(side_));
  }

  Device device() const override { return dev_; }
  std::string describe() const override { return plan_.device + ", decode plan: " + plan_.summary(); }
  std::string kernels_run() const override {
    std::string out = counters_.str();
    if (!plan_.cuda_graphs) return out + "; CUDA graphs off (eager launches)";
    out += "; CUDA graphs: " + std::to_string(stats_.captures) + " shape(s) captured, " + std::to_string(stats_.replays) +
           " replay(s), " + std::to_string(stats_.eager) + " eager step(s)";
    std::string why;
    for (const auto& [w, n] : eager_why_) why += (why.empty() ? "" : ", ") + std::to_string(n) + " " + w;
    if (!why.empty()) out += " (" + why + ")";
    if (stats_.capture_failures) out += ", " + std::to_string(stats_.capture_failures) + " CAPTURE(S) FAILED";
    return out;
  }
  GraphStats graph_stats() const override { return stats_; }
  void synchronize() override {
    join_commit();
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(model_.stream())));
  }

 private:
  struct LayerTensors {
    Tensor a, b;  // conv + recurrent state, or k + v cache
  };
  // A verify's saved layer inputs (DecodeLayer), which commit reads.
  struct SavedLayer {
    Tensor proj, conv, q, k, g, beta;
    int64_t proj_ld = 0;
  };
  struct StepOutputs {
    Tensor next, features, logits;  // [M] argmax / samples, [R, k·H] bf16, [M, Vp] f32 (device)
  };
  // One captured step shape: its graph, and every buffer the graph reads or writes beside the
  // decoder's states (the inputs it is replayed on, its outputs, a verify's saved layer inputs), all
  // from its own pool (declared first: released last; the graph declared last: destroyed first).
  struct Graph {
    explicit Graph(int device) : pool(device) {}
    device_alloc::Pool pool;
    Tensor input, workspace;
    StepOutputs out;
    PathCounters counts;  // the decode kernels one replay launches
    std::vector<SavedLayer> saved;
    CudaGraphExec exec;
  };

  // The decoder's stream waits for a commit replayed on the side stream (plan_.fusion.commit_overlap)
  // before anything else of the decoder touches the states: called first by every entry point.
  void join_commit() {
    if (!join_pending_) return;
    DFLASH_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(model_.stream()), ev_join_, 0));
    join_pending_ = false;
  }

  void do_reset(int32_t slot) override {
    join_commit();
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
    join_commit();
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
    step.fusion = plan_.fusion;
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

    // Chunked prefill (generate.h step_tokens): prompt pieces after the decode rows (DecodeStep::piece_from)
    // run the chunked delta rule from their slots' states, the token-parallel conv and an attention call of
    // their own, not the decode kernels that walk a sequence's tokens one by one.
    std::vector<int32_t> piece_cu;
    if (!step.prefill && opt.commit && b.max_seqlen > kMaxVerifyTokens) {
      // The leading one-token rows are decode rows (the pool kernel); every row from the first longer one
      // on is a piece, one-token pieces included (generate.h cuts the last piece wherever the budget
      // ends, and a prompt's last token may follow a longer piece).
      int64_t from = 0;
      while (from < S && tokens[static_cast<size_t>(from)].size() == 1) ++from;
      if (from < S) {
        step.piece_from = from;
        step.piece_row0 = b.offsets[from];
        for (int64_t s2 = from; s2 < S; ++s2)
          step.piece_max_new = std::max<int64_t>(step.piece_max_new, static_cast<int64_t>(tokens[static_cast<size_t>(s2)].size()));
        for (int64_t s2 = from; s2 <= S; ++s2) piece_cu.push_back(static_cast<int32_t>(b.offsets[s2] - b.offsets[from]));
      }
    }
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
    // The lm_head: a prefill's or a step with prompt pieces' kept rows alone (gathered when that is not
    // every row: last_only; a 1,024-row step's lm_head at the 27B shapes is 2.6 TFLOP and 1 GB of fp32
    // logits, where its kept rows are one a sequence); a decode
    // step's every (padded) row, the same GEMM shape for T = 1 and T = 16 (batch invariance).
    const bool gather_head = (step.prefill || step.piece_from >= 0) && R < N;
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

    // Everything the step reads on the device, packed at offsets that depend on the step's shape
    // alone: one upload (eager), or one copy into a graph's fixed input buffer (replay).
    Staging st;
    const size_t o_ids = st.add(ids), o_pos = st.add(pos), o_cu = st.add(cu), o_slots = st.add(slots);
    const size_t o_past = st.add(past), o_keep = st.add(keep), o_streams = st.add(streams), o_positions = st.add(positions);
    step.real_tokens = N;
    step.max_new = b.max_seqlen;
    const size_t o_piece_cu = st.add(piece_cu);
    int64_t key_bound = 0;
    if (!step.prefill) {
      // Absolute key splits: about 32 of them over the pool's length (enough CTAs for the 132 SMs
      // at batch 1), the same for every step of this decoder.
      step.split_keys = std::max<int64_t>(64, ((max_len() + 31) / 32 + 63) / 64 * 64);
      for (int64_t s2 = 0; s2 < S; ++s2)
        key_bound = std::max<int64_t>(key_bound, lengths[s2] + static_cast<int64_t>(tokens[s2].size()));
    }

    // The device part of the step: everything enqueued from the staged inputs at `base` (device) up
    // to the outputs; the same code runs eagerly and under stream capture. `ws` holds the attention
    // workspace (grown here), `counters` counts the decode kernels.
    auto enqueue = [&](const char* base, int64_t kb, Tensor& ws, PathCounters* counters) {
      auto at = [&](size_t off) { return const_cast<char*>(base) + off; };
      auto i32 = [&](size_t off, int64_t n) { return Tensor::from_blob(at(off), {n}, DType::I32, dev_); };
      b.num_tokens = rows;
      b.num_seqs = S;
      b.ids = i32(o_ids, rows);
      b.pos = i32(o_pos, rows);
      b.cu_seqlens = i32(o_cu, S + 1);
      step.slots = reinterpret_cast<const int32_t*>(at(o_slots));
      step.past_len = reinterpret_cast<const int32_t*>(at(o_past));
      step.piece_cu = step.piece_from >= 0 ? reinterpret_cast<const int32_t*>(at(o_piece_cu)) : nullptr;
      step.counters = counters;
      const int32_t* d_keep = reinterpret_cast<const int32_t*>(at(o_keep));
      if (!step.prefill) {
        step.key_bound = kb;
        // The workspace the flash-decoding kernel wants for this step: its rows with the absolute splits,
        // or with prompt pieces (model_cuda.h) the decode rows' call and the pieces' (splits for speed).
        auto workspace_for = [&](int64_t seqs, int64_t rows_, int64_t max_new, bool absolute) {
          if (seqs == 0) return size_t{0};
          cuda::AttentionDecodeParams probe;
          probe.num_seqs = seqs, probe.N = rows_, probe.Hq = c.num_attention_heads, probe.Hkv = c.num_key_value_heads;
          probe.d = c.head_dim, probe.max_len = max_len(), probe.num_slots = num_slots(), probe.max_new = max_new;
          probe.scale = 1.0f, probe.split_keys = absolute ? step.split_keys : 0, probe.key_bound = absolute ? step.key_bound : 0;
          return cuda::attention_decode_workspace(probe);
        };
        const size_t need = step.piece_from < 0
                                ? workspace_for(S, N, step.max_new, true)
                                : std::max(workspace_for(step.piece_from, step.piece_row0, 1, true),
                                           workspace_for(S - step.piece_from, N - step.piece_row0, step.piece_max_new, false));
        if (!ws.defined() || ws.nbytes() < need)
          ws = Tensor::empty({static_cast<int64_t>(std::max<size_t>(need, 1))}, DType::U8, dev_);
        step.attn_workspace = ws.raw_data();
        step.attn_workspace_bytes = ws.nbytes();
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

      auto s = static_cast<cudaStream_t>(model_.stream());
      Tensor head_in = fr.final_hidden;
      if (gather_head) {  // the kept rows of the final hidden state, packed (cuda::embedding as a row gather)
        head_in = Tensor::empty({R, H}, DType::BF16, dev_);
        cuda::embedding(d_keep, fr.final_hidden.raw_data(), head_in.raw_data(), R, H, s);
      }
      StepOutputs out;
      // Logits rows padded to Vp = V rounded up to 8 floats (32 bytes), so the LM-head GEMM's D keeps
      // 16-byte aligned rows for any vocabulary (V = 777: ldd 784); the pad columns are never written
      // nor read (the GEMM's N, argmax / sampling and the copy to the host take V).
      const int64_t Vp = (V + 7) / 8 * 8;
      out.logits = Tensor::empty({M, Vp}, DType::F32, dev_);
      cuda::GemmExParams gp;
      gp.a = head_in.raw_data();
      gp.lda = H;
      gp.b = model_.weights().lm_head.raw_data();
      gp.ldb = H;
      gp.trans_b = true;
      gp.d = out.logits.raw_data();
      gp.ldd = Vp;
      gp.d_f32 = true;
      gp.M = M, gp.N = V, gp.K = H;
      gp.unaligned = model_.gemm_unaligned();  // hidden_size not a multiple of 8
      GemmShape head_shape;
      head_shape.M = M, head_shape.N = V, head_shape.K = H, head_shape.ldx = H, head_shape.ldy = Vp;
      model_.profiled(ForwardOp::LmHead, [&] { cuda::gemm_ex(gp, dev_.index); }, head_shape);
      out.next = Tensor::empty({M}, DType::I32, dev_);
      model_.profiled(ForwardOp::NextToken, [&] {
        if (opt.sample)
          cuda::sample_rows(out.logits.data<float>(), Vp, M, V, opt.sample->temperature, opt.sample->top_p, opt.sample->seed,
                            reinterpret_cast<const uint64_t*>(at(o_streams)), reinterpret_cast<const int64_t*>(at(o_positions)),
                            out.next.data<int32_t>(), s);
        else
          cuda::argmax_rows(out.logits.raw_data(), false, Vp, M, V, out.next.data<int32_t>(), s);
      });
      if (!opt.capture.empty()) {
        const int64_t k = static_cast<int64_t>(opt.capture.size());
        out.features = Tensor::empty({R, k * H}, DType::BF16, dev_);
        // Kept rows in runs of consecutive rows: one 2-D copy per run when there are few runs (decode
        // steps: one), else one gather of all of them and one 2-D copy (a prefill's last rows).
        int64_t runs = 0;
        for (int64_t j = 0; j < R; ++j) runs += j == 0 || keep[j] != keep[j - 1] + 1;
        Tensor packed = runs > 2 && k > 1 ? Tensor::empty({R, H}, DType::BF16, dev_) : Tensor();
        for (int64_t l = 0; l < k; ++l) {
          const Tensor& src = fr.layers.at(opt.capture[static_cast<size_t>(l)]);
          char* dst = static_cast<char*>(out.features.raw_data()) + l * H * 2;
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
      return out;
    };

    // CUDA graphs (decode / verify steps): one per shape, captured after the shape's first (eager)
    // step and replayed from then on; the attention's key bound goes up to a power-of-two number of
    // key splits (the extra splits add exact zeros: the same values as the eager step's).
    Graph* graph = nullptr;
    std::string key;
    const char* eager_why = nullptr;  // graphs on, this step eager: why
    int64_t graph_kb = key_bound;
    if (!step.prefill && plan_.cuda_graphs) {
      if (model_.profiling()) eager_why = "an op profiler is set";
      else if (model_.tensor_parallel()) eager_why = "tensor parallelism (the all-reduces are not captured)";
      else if (step.max_new > kMaxVerifyTokens)  // chunked prefill (generate.h step_tokens): shapes rarely repeat
        eager_why = "a step with a prompt piece (> 16 tokens of a slot; not captured)";
      else {
        int64_t splits = 2;
        while (splits * step.split_keys < key_bound) splits *= 2;
        graph_kb = std::min<int64_t>(max_len(), splits * step.split_keys);
        key = graph_key(tokens, opt, splits);
        graph = find_graph(key, eager_why);
      }
    }
    count_eager(eager_why);

    StepOutputs out;
    auto s = static_cast<cudaStream_t>(model_.stream());
    if (graph) {
      const std::vector<char>& bytes = st.bytes();
      DFLASH_CHECK(bytes.size() == graph->input.nbytes(), "CUDA decoder: a graph's inputs are " << graph->input.nbytes()
                                                            << " bytes, the step's " << bytes.size());
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(graph->input.raw_data(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice, s));
      graph->exec.launch(s);
      ++stats_.replays;
      counters_.add(graph->counts);
      if (!opt.commit) restore_saved(graph->saved);  // what commit re-runs: the graph's buffers
      out.next = graph->out.next;
      out.logits = graph->out.logits;
      if (graph->out.features.defined()) {  // the caller's own copy (the graph's buffer is rewritten by its next replay)
        out.features = Tensor::empty(graph->out.features.shape(), DType::BF16, dev_);
        DFLASH_CUDA_CHECK(cudaMemcpyAsync(out.features.raw_data(), graph->out.features.raw_data(),
                                          graph->out.features.nbytes(), cudaMemcpyDeviceToDevice, s));
      }
    } else {
      const Tensor staged = st.upload(dev_);
      out = enqueue(static_cast<const char*>(staged.raw_data()), key_bound, workspace_, &counters_);
    }
    if (!opt.commit)
      for (int64_t s2 = 0; s2 < S; ++s2) pending_rows_[static_cast<size_t>(slots[s2])] = b.offsets[s2];

    const Tensor next_h = out.next.to(Device::cpu());
    r.next.resize(static_cast<size_t>(R));
    for (int64_t j = 0; j < R; ++j) r.next[static_cast<size_t>(j)] = next_h.data<int32_t>()[head_row(j)];
    if (opt.logits) {
      const int64_t Vp = out.logits.size(1);
      Tensor lh = out.logits.to(Device::cpu());
      r.logits = Tensor::empty({R, V}, DType::F32);
      for (int64_t j = 0; j < R; ++j)
        std::copy_n(lh.data<float>() + head_row(j) * Vp, V, r.logits.data<float>() + j * V);
    }
    r.features = out.features;
    if (!opt.commit) {  // commit reads this verify's saved inputs: a graph's (stable) or the eager step's
      verify_graph_ = graph;
      verify_graph_key_ = graph ? key : std::string();
    }
    if (!key.empty() && !graph && !graphs_.count(key))
      capture(key, st.bytes().size(), !opt.commit,
              [&](const char* base, Graph& g) { g.out = enqueue(base, graph_kb, g.workspace, &g.counts); });
    return r;
  }

  // Captures what `record(input, graph)` enqueues (the shape of the eager step just run, whose
  // results are already out) into a graph with its own memory pool, or records that the capture
  // failed (logged and counted; that shape then runs eagerly). keep_saved: a verify, whose saved
  // layer inputs the graph keeps for commit.
  template <class Record>
  void capture(const std::string& key, size_t input_bytes, bool keep_saved, Record&& record) {
    auto s = static_cast<cudaStream_t>(model_.stream());
    auto g = std::make_unique<Graph>(dev_.index);
    const std::vector<SavedLayer> eager_saved = save_saved();  // the eager verify's, for commit
    std::string err;
    {
      device_alloc::PoolScope scope(g->pool);
      try {
        synchronize();
        g->input = Tensor::empty({static_cast<int64_t>(input_bytes)}, DType::U8, dev_);
        // Relaxed: the pool may cudaMalloc its blocks while capturing (nothing synchronizes).
        err = capture_cuda_graph(s, [&] { record(static_cast<const char*>(g->input.raw_data()), *g); }, &g->exec);
      } catch (const std::exception& e) {  // (before the capture: the synchronisation, the input buffer)
        if (err.empty()) err = e.what();
        cudaGetLastError();
      }
      if (keep_saved) g->saved = save_saved();
      restore_saved(eager_saved);
    }
    if (!err.empty()) {
      ++stats_.capture_failures;
      spdlog::warn("CUDA decoder: capturing the step shape {} as a CUDA graph failed ({}); that shape runs eager launches",
                   key, err);
      graphs_[key] = nullptr;
      return;
    }
    ++stats_.captures;
    pool_bytes_ += g->pool.reserved();
    graphs_[key] = std::move(g);
  }

  // At most kMaxGraphs shapes and kMaxPoolBytes of their pools per decoder (many batch shapes, e.g.
  // regeneration's changing number of sequences in flight, must not fill the GPU); beyond that, new
  // shapes run eagerly (counted).
  static constexpr size_t kMaxGraphs = 64;
  static constexpr size_t kMaxPoolBytes = size_t(4) << 30;
  static constexpr const char* kGraphsFull = "the graph limit (64 shapes or 4 GiB of their pools) reached";
  bool graphs_full() const { return graphs_.size() >= kMaxGraphs || pool_bytes_ >= kMaxPoolBytes; }
  // The replayable graph of `key`, or nullptr with why the step runs eagerly; `key` is cleared when no new
  // graph may be captured (the limit), so the step is not captured after it runs.
  Graph* find_graph(std::string& key, const char*& eager_why) {
    auto it = graphs_.find(key);
    if (it == graphs_.end() && graphs_full()) {
      eager_why = kGraphsFull;
      key.clear();
      return nullptr;
    }
    if (it == graphs_.end()) eager_why = "first step of its shape";
    else if (!it->second) eager_why = "its shape's capture failed";
    else return it->second.get();
    return nullptr;
  }
  void count_eager(const char* eager_why) {
    if (!eager_why) return;
    ++stats_.eager;
    ++eager_why_[eager_why];
  }

  // The shape a graph is keyed by: the tokens per slot, the options the step's launches depend on,
  // and the attention's key splits.
  static std::string graph_key(const std::vector<std::vector<int32_t>>& tokens, const ExtendOptions& opt, int64_t splits) {
    std::ostringstream k;
    k << (opt.commit ? "decode" : "verify") << " T=";
    for (size_t i = 0; i < tokens.size(); ++i) k << (i ? "," : "") << tokens[i].size();
    k << " splits=" << splits;
    if (!opt.capture.empty()) {
      k << " capture=";
      for (size_t i = 0; i < opt.capture.size(); ++i) k << (i ? "," : "") << opt.capture[i];
    }
    if (opt.last_only) k << " last_only";
    if (opt.logits) k << " logits";
    if (opt.sample)
      k << " sample=" << std::hexfloat << opt.sample->temperature << "," << opt.sample->top_p << std::dec << ","
        << opt.sample->seed;
    return k.str();
  }

  // The verify's saved layer inputs (DecodeLayer::proj ... beta) of every layer.
  std::vector<SavedLayer> save_saved() const {
    std::vector<SavedLayer> v(state_.size());
    for (size_t i = 0; i < state_.size(); ++i) {
      const DecodeLayer& dl = state_[i];
      v[i] = {dl.proj, dl.conv, dl.q, dl.k, dl.g, dl.beta, dl.proj_ld};
    }
    return v;
  }
  void restore_saved(const std::vector<SavedLayer>& v) {
    for (size_t i = 0; i < state_.size() && i < v.size(); ++i) {
      DecodeLayer& dl = state_[i];
      const SavedLayer& sv = v[i];
      dl.proj = sv.proj, dl.conv = sv.conv, dl.q = sv.q, dl.k = sv.k, dl.g = sv.g, dl.beta = sv.beta;
      dl.proj_ld = sv.proj_ld;
    }
  }

  // The GDN states advance by the n accepted tokens from the verify's saved inputs: the conv update
  // and the delta rule on them alone (their outputs were the verify's).
  void do_commit(int32_t slot, int64_t, int64_t n) override {
    join_commit();
    const TargetConfig& c = config_;
    const int64_t row0 = pending_rows_[static_cast<size_t>(slot)];
    DFLASH_CHECK(row0 >= 0, "CUDA decoder: slot " << slot << " has no saved verify inputs");
    const std::vector<int32_t> host{slot, 0, static_cast<int32_t>(n), 0};  // the slot, then cu_seqlens {0, n}
    auto s = static_cast<cudaStream_t>(model_.stream());
    const int64_t Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads, dk = c.linear_key_head_dim;
    const int64_t dv = c.linear_value_head_dim, C = c.gdn_conv_dim();
    // Fused (plan_.fusion.commit): every layer's conv state update and delta rule in one kernel, the
    // unfused launches' values bit for bit (gdn.h gdn_commit_fused).
    const bool fused = plan_.fusion.commit && n <= 16 && gdn_layers_ <= cuda::kCommitMaxLayers;
    auto enqueue_fused = [&](const int32_t* d_in, PathCounters* counters) {
      cuda::GdnCommitParams p;
      p.slot = d_in;
      p.n = static_cast<int>(n);
      p.C = C, p.K = c.linear_conv_kernel_dim, p.Hk = Hk, p.Hv = Hv, p.dk = dk, p.dv = dv, p.num_slots = num_slots();
      p.ldv = C;
      for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
        if (c.layer_types[static_cast<size_t>(i)] != LayerType::LinearAttention) continue;
        const DecodeLayer& dl = state_[static_cast<size_t>(i)];
        DFLASH_CHECK(p.ldx == 0 || p.ldx == dl.proj_ld, "CUDA decoder: the layers' in-projections differ in width");
        p.ldx = dl.proj_ld;
        cuda::GdnCommitLayer& L = p.layers[p.num_layers++];
        L.conv_state = dl.conv_state;
        L.state = dl.gdn_state;
        L.x = static_cast<const char*>(dl.proj.raw_data()) + row0 * dl.proj_ld * 2;
        L.q = static_cast<const char*>(dl.q.raw_data()) + row0 * Hk * dk * 2;
        L.k = static_cast<const char*>(dl.k.raw_data()) + row0 * Hk * dk * 2;
        L.v = static_cast<const char*>(dl.conv.raw_data()) + (row0 * C + 2 * Hk * dk) * 2;
        L.g = dl.g.data<float>() + row0 * Hv;
        L.beta = dl.beta.data<float>() + row0 * Hv;
        counters->add(Step::ConvUpdate, Path::Fast);
        counters->add(Step::DeltaRulePool, Path::Fast);
      }
      cuda::gdn_commit_fused(p, s);
    };
    auto enqueue = [&](const int32_t* d_in, Tensor& scratch, PathCounters* counters) {
      if (fused) return enqueue_fused(d_in, counters);
      const int32_t *d_slot = d_in, *d_cu = d_in + 1;
      if (!scratch.defined() || scratch.size(0) < n * C)
        scratch = Tensor::empty({std::max<int64_t>(n, 16) * C}, DType::BF16, dev_);
      for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
        if (c.layer_types[static_cast<size_t>(i)] != LayerType::LinearAttention) continue;
        DecodeLayer& dl = state_[static_cast<size_t>(i)];
        const LayerWeights& L = model_.weights().layers[static_cast<size_t>(i)];
        const ConvUpdateCall call{static_cast<const char*>(dl.proj.raw_data()) + row0 * dl.proj_ld * 2, dl.proj_ld,
                                  scratch.raw_data(), d_slot, d_cu, 1, n, num_slots(), true};
        run_conv_update(c, L, dl, call, *counters, s);
        cuda::DeltaRuleParams p;  // the accepted tokens' rows of the verify's inputs
        p.q = static_cast<const char*>(dl.q.raw_data()) + row0 * Hk * dk * 2;
        p.k = static_cast<const char*>(dl.k.raw_data()) + row0 * Hk * dk * 2;
        p.v = static_cast<const char*>(dl.conv.raw_data()) + (row0 * C + 2 * Hk * dk) * 2;
        p.ldv = C;
        p.g = dl.g.data<float>() + row0 * Hv;
        p.beta = dl.beta.data<float>() + row0 * Hv;
        p.out = nullptr;
        p.cu_seqlens = d_cu;
        p.num_seqs = 1, p.N = n, p.Hk = Hk, p.Hv = Hv, p.dk = dk, p.dv = dv;
        run_delta_rule_pool(dl, p, d_slot, num_slots(), true, *counters, s);
      }
    };
    // A graph per (n, row0) of a verify graph (whose saved inputs live as long as it does); after an
    // eager verify (its saved inputs come and go with the allocator) the commit runs eagerly too.
    std::string key;
    const char* eager_why = nullptr;
    Graph* graph = nullptr;
    if (plan_.cuda_graphs) {
      if (model_.profiling()) eager_why = "an op profiler is set";
      else if (!verify_graph_) eager_why = "commit after an eager verify";
      else {
        key = "commit n=" + std::to_string(n) + " row0=" + std::to_string(row0) + " of " + verify_graph_key_;
        graph = find_graph(key, eager_why);
      }
    }
    count_eager(eager_why);
    if (graph) {
      // A fused commit replays on the side stream after the verify (fork), and the decoder's next
      // step waits for it (join_commit): the caller's next work on the stream (the drafter's context
      // update) runs beside it.
      cudaStream_t cs = s;
      if (side_ && fused) {
        DFLASH_CUDA_CHECK(cudaEventRecord(ev_fork_, s));
        DFLASH_CUDA_CHECK(cudaStreamWaitEvent(side_, ev_fork_, 0));
        cs = side_;
      }
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(graph->input.raw_data(), host.data(), host.size() * sizeof(int32_t),
                                        cudaMemcpyHostToDevice, cs));
      graph->exec.launch(cs);
      if (cs != s) {
        DFLASH_CUDA_CHECK(cudaEventRecord(ev_join_, cs));
        join_pending_ = true;
      }
      ++stats_.replays;
      counters_.add(graph->counts);
    } else {
      const Tensor d_in = upload_i32(host, dev_);
      enqueue(d_in.data<int32_t>(), scratch_, &counters_);
      if (!key.empty() && !graphs_.count(key))
        capture(key, host.size() * sizeof(int32_t), false, [&](const char* base, Graph& g) {
          enqueue(reinterpret_cast<const int32_t*>(base), g.workspace, &g.counts);
        });
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
  int64_t gdn_layers_ = 0;             // GatedDeltaNet layers (commit's fused kernel takes up to kCommitMaxLayers)
  cudaStream_t side_ = nullptr;        // plan_.fusion.commit_overlap: replayed fused commits run here
  cudaEvent_t ev_fork_ = nullptr, ev_join_ = nullptr;
  bool join_pending_ = false;          // a side-stream commit the decoder's stream has not waited for yet
  PathCounters counters_;
  Tensor workspace_, scratch_;
  std::map<std::string, std::unique_ptr<Graph>> graphs_;  // by graph_key; null: its capture failed
  GraphStats stats_;
  size_t pool_bytes_ = 0;  // the graphs' pools, together
  Graph* verify_graph_ = nullptr;  // the last verify's graph (null: it ran eagerly)
  std::string verify_graph_key_;
  std::map<std::string, uint64_t> eager_why_;  // eager steps with graphs on, by reason
};

}  // namespace

std::unique_ptr<Decoder> make_cuda_decoder(CudaTargetModel& model, int64_t num_slots, int64_t max_len,
                                           FastPathPlan decode_plan) {
  return std::make_unique<CudaDecoder>(model, num_slots, max_len, std::move(decode_plan));
}

}  // namespace dflash::target
