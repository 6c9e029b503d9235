#include "drafter/decode_cuda.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>

#include "drafter/fast_path.h"
#include "drafter/proposer_slots.h"
#include "kernels/cuda/attention.h"
#include "core/cuda/check.h"
#include "core/cuda/graph.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/sampling.h"
#include "core/device.h"
#include "core/error.h"

namespace dflash::drafter {

namespace {

constexpr int64_t kLogitChunkRows = 256;  // block rows whose fp32 logits exist at a time

// Row stride of the fp32 logits: V rounded up to 8 (32 bytes), so the LM-head GEMM's D rows stay
// 16-byte aligned for any vocabulary.
int64_t padded_vocab(int64_t V) { return (V + 7) / 8 * 8; }

char* bf16_at(void* base, int64_t elems) { return static_cast<char*>(base) + elems * 2; }
const char* bf16_at(const void* base, int64_t elems) { return static_cast<const char*>(base) + elems * 2; }

// Tensors of any float dtype and device, flattened one after the other into one bf16 tensor on
// `device` (one host conversion and one upload). Used for the fused q|k|v and gate|up operands.
Tensor upload_bf16(const std::vector<const Tensor*>& parts, Device device) {
  int64_t n = 0;
  for (const Tensor* t : parts) n += t->numel();
  Tensor host = Tensor::empty({n}, DType::BF16);
  int64_t at = 0;
  for (const Tensor* t : parts) {
    const Tensor h = t->to(Device::cpu()).contiguous();
    convert_elements(h.raw_data(), h.dtype(), bf16_at(host.raw_data(), at), DType::BF16, h.numel());
    at += h.numel();
  }
  return host.to(device);
}

// Pinned host memory for the small int32 transfers of a call (block tokens, positions, slots,
// lengths; the drafts), reused from call to call. Before it is rewritten the host waits for the
// event recorded after the last copy that read it; in the decode loop that copy finished long ago
// (propose ends with a synchronisation), so the wait costs nothing.
class Pinned {
 public:
  Pinned() = default;
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  ~Pinned() {
    if (event_) DFLASH_CUDA_WARN(cudaEventDestroy(event_));
    if (p_) DFLASH_CUDA_WARN(cudaFreeHost(p_));
  }
  // `count` int32 ready to be written (grown when needed).
  int32_t* get(int64_t count) {
    if (event_) DFLASH_CUDA_CHECK(cudaEventSynchronize(event_));
    if (count > cap_) {
      if (p_) DFLASH_CUDA_CHECK(cudaFreeHost(p_));
      p_ = nullptr;
      DFLASH_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&p_), static_cast<size_t>(count) * 4));
      cap_ = count;
    }
    return p_;
  }
  void upload(void* dst, int64_t count, cudaStream_t s) {
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst, p_, static_cast<size_t>(count) * 4, cudaMemcpyHostToDevice, s));
    if (!event_) DFLASH_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    DFLASH_CUDA_CHECK(cudaEventRecord(event_, s));
  }

 private:
  int32_t* p_ = nullptr;
  int64_t cap_ = 0;
  cudaEvent_t event_ = nullptr;
};

class CudaProposer final : public Proposer {
 public:
  CudaProposer(const DrafterConfig& c, const DrafterWeights& w, Tensor embed, Tensor lm_head, Device device,
               int64_t num_slots, int64_t max_len, bool fp8_propose, bool cuda_graphs)
      : c_(c), slots_(c, num_slots, max_len, "cuda proposer"), device_(device), embed_(std::move(embed)),
        lm_head_(std::move(lm_head)), fp8_(fp8_propose), graphs_on_(cuda_graphs) {
    if (const char* e = std::getenv("DFLASH_CONTEXT_GRAPHS")) ctx_graphs_on_ = graphs_on_ && std::string(e) == "1";
    c_.validate();
    w.check(c_);
    DFLASH_CHECK(device_.is_cuda(), "cuda proposer: device must be a CUDA device, got " << device_.str());
    for (const auto& [t, name] : {std::pair{&embed_, "embed_tokens"}, {&lm_head_, "lm_head"}})
      DFLASH_CHECK(t->defined() && t->device() == device_ && t->dtype() == DType::BF16 && t->dim() == 2 &&
                       t->size(0) == c_.vocab_size && t->size(1) == c_.hidden_size && t->is_contiguous(),
                   "cuda proposer: target " << name << " must be bf16 [" << c_.vocab_size << ", " << c_.hidden_size
                                            << "] on " << device_.str() << ", got "
                                            << (t->defined() ? t->describe() : "undefined"));
    check_cuda_drafter_sizes(c_);  // hidden_size, head_dim multiples of 8 (so is k·hidden)
    gemm_unaligned_ = cuda_drafter_gemm_unaligned(c_);
    fast_attention_ = cuda::attention_decode_fast_supported(c_.head_dim, cuda_device_info(device_.index).major);
    const int64_t H = c_.hidden_size, I = c_.intermediate_size, qd = c_.q_dim(), kvd = c_.kv_dim();
    const int64_t B = c_.block_size, Rmax = num_slots * B, V = c_.vocab_size;
    fc_ = upload_bf16({&w.fc}, device_);
    hidden_norm_ = upload_bf16({&w.hidden_norm}, device_);
    norm_ = upload_bf16({&w.norm}, device_);
    const int64_t cache_elems = num_slots * max_len * kvd;
    for (const LayerWeights& lw : w.layers) {
      Layer L;
      L.qkv = upload_bf16({&lw.q_proj, &lw.k_proj, &lw.v_proj}, device_);
      L.o = upload_bf16({&lw.o_proj}, device_);
      L.gu = upload_bf16({&lw.gate_proj, &lw.up_proj}, device_);
      L.down = upload_bf16({&lw.down_proj}, device_);
      L.q_norm = upload_bf16({&lw.q_norm}, device_);
      L.k_norm = upload_bf16({&lw.k_norm}, device_);
      L.in_ln = upload_bf16({&lw.input_layernorm}, device_);
      L.post_ln = upload_bf16({&lw.post_attention_layernorm}, device_);
      L.k_cache = zeros({cache_elems}, DType::BF16);
      L.v_cache = zeros({cache_elems}, DType::BF16);
      layers_.push_back(std::move(L));
    }
    // Scratch for a block of every slot.
    h_ = empty({Rmax, H}, DType::F32);
    x_ = empty({Rmax, H}, DType::BF16);
    rstd_ = empty({Rmax * std::max<int64_t>(c_.num_attention_heads, 1)}, DType::F32);
    qkv_ = empty({Rmax, qd + 2 * kvd}, DType::BF16);
    q_ = empty({Rmax, qd}, DType::BF16);
    k_ = empty({Rmax, kvd}, DType::BF16);
    o_ = empty({Rmax, qd}, DType::BF16);
    gu_ = empty({Rmax, 2 * I}, DType::BF16);
    m_ = empty({Rmax, I}, DType::BF16);
    logits_ = empty({std::min(Rmax, kLogitChunkRows), padded_vocab(V)}, DType::F32);
    amax_ = empty({Rmax}, DType::I32);
    meta_ = empty({2 * Rmax + 3 * num_slots + 1}, DType::I32);
    // The split-KV workspace of the fastest attention for any number of slots in a call (the split
    // count, hence the size, depends on it); any smaller size would still be correct.
    size_t ws = 0;
    if (fast_attention_)
      for (int64_t S = 1; S <= num_slots; ++S) ws = std::max(ws, cuda::attention_decode_workspace(attention_params(S, B, false)));
    workspace_ = empty({static_cast<int64_t>(std::max<size_t>(ws, 16))}, DType::U8);
    meta_host_.get(meta_.numel());  // the pinned staging of propose, at its largest
    drafts_host_.get(num_slots * (B - 1));
    if (fp8_) quantize_weights(Rmax);
  }

  const DrafterConfig& config() const override { return c_; }
  Device device() const override { return device_; }
  int64_t num_slots() const override { return slots_.num_slots(); }
  int64_t max_len() const override { return slots_.max_len(); }
  int64_t context_length(int32_t slot) const override { return slots_.length(slot); }
  void reset(int32_t slot) override { slots_.reset(slot); }  // positions past the length are never read
  std::string graph_stats() const override {
    if (!graphs_on_) return "CUDA graphs off (eager launches)";
    return "CUDA graphs: " + propose_counts_.str("propose") + "; " + ctx_counts_.str("add_context") +
           " (eager: a shape's first call or a failed capture; prefill-sized contexts always run eagerly)";
  }

  void add_context(const std::vector<int32_t>& slots, const Tensor& features, const ops::SeqOffsets& seqs) override {
    slots_.check_add(slots, features, seqs);
    DFLASH_CHECK(features.device() == device_ && features.dtype() == DType::BF16 && features.is_contiguous(),
                 "cuda proposer: add_context: features must be contiguous bf16 on " << device_.str() << ", got "
                                                                                    << features.describe());
    const int64_t N = features.size(0), S = static_cast<int64_t>(slots.size());
    if (N == 0) return;
    const cudaStream_t st = stream();
    // Device metadata: [positions N | slots S | past lengths S | cu_seqlens S+1].
    const int64_t count = N + 3 * S + 1;
    int32_t* m = ctx_meta_.get(count);
    int64_t max_new = 0;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t past = slots_.length(slots[s]), T = seqs.offsets[s + 1] - seqs.offsets[s];
      for (int64_t t = 0; t < T; ++t) m[seqs.offsets[s] + t] = static_cast<int32_t>(past + t);
      m[N + s] = slots[s];
      m[N + S + s] = static_cast<int32_t>(past);
      m[N + 2 * S + s] = static_cast<int32_t>(seqs.offsets[s]);
      max_new = std::max(max_new, T);
    }
    m[N + 3 * S] = static_cast<int32_t>(N);
    // Contexts of at most a block per slot (the accepted tokens of a speculative step) run as a CUDA
    // graph per (slots, rows, longest sequence) shape, from fixed copies of the features and metadata
    // (captured at a shape's second call, as propose's); a prefill-sized context runs eagerly.
    if (!ctx_graphs_on_ || N > c_.block_size * slots_.num_slots()) {
      const Tensor meta = empty({count}, DType::I32);
      ctx_meta_.upload(meta.raw_data(), count, st);
      enqueue_context(features.raw_data(), meta.data<int32_t>(), N, S, max_new);
    } else {
      ShapeGraph& g = ctx_graphs_.try_emplace(std::tuple{S, N, max_new, context_fp8(N)}, device_.index).first->second;
      if (!g.meta.defined()) {
        g.meta = empty({count}, DType::I32);
        g.features = empty({N, c_.context_dim()}, DType::BF16);
      }
      ctx_meta_.upload(g.meta.raw_data(), count, st);
      DFLASH_CUDA_CHECK(cudaMemcpyAsync(g.features.raw_data(), features.raw_data(), features.nbytes(),
                                        cudaMemcpyDeviceToDevice, st));
      run_graphed(
          g, ctx_counts_, [&] { enqueue_context(g.features.raw_data(), g.meta.data<int32_t>(), N, S, max_new); },
          [&] { return fmt::format("the context shape ({} slot(s), {} rows)", S, N); });
    }
    slots_.commit_add(slots, seqs);
  }

  std::vector<std::vector<int32_t>> propose(const std::vector<int32_t>& slots, const std::vector<int32_t>& x_start,
                                            int64_t block_size, Tensor* logits) override {
    slots_.check_propose(slots, x_start, block_size);
    const int64_t Bp = block_size, S = static_cast<int64_t>(slots.size()), R = S * Bp;
    if (logits) *logits = Tensor::empty({R, c_.vocab_size}, DType::F32);
    if (S == 0) return {};
    const cudaStream_t st = stream();
    // Device metadata: [block tokens R | positions R | slots S | past lengths S | cu_seqlens S+1].
    const int64_t count = 2 * R + 3 * S + 1;
    int32_t* m = meta_host_.get(count);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t past = slots_.length(slots[s]);
      for (int64_t j = 0; j < Bp; ++j) {
        m[s * Bp + j] = j == 0 ? x_start[s] : static_cast<int32_t>(c_.mask_token_id);
        m[R + s * Bp + j] = static_cast<int32_t>(past + j);
      }
      m[2 * R + s] = slots[s];
      m[2 * R + S + s] = static_cast<int32_t>(past);
      m[2 * R + 2 * S + s] = static_cast<int32_t>(s * Bp);
    }
    m[2 * R + 3 * S] = static_cast<int32_t>(R);
    meta_host_.upload(meta_.raw_data(), count, st);
    const int32_t* d_ids = meta_.data<int32_t>();
    const int32_t* d_pos = d_ids + R;
    const int32_t* d_slots = d_pos + R;
    const int32_t* d_past = d_slots + S;
    const int32_t* d_cu = d_past + S;

    // The step's kernels: as CUDA graph replays per (slots, block) shape where graphs are on and no
    // logits are asked for (a shape's first call runs eagerly, which also settles cuBLASLt's algorithm
    // choices; its second is captured; a failed capture is logged, counted, and that shape stays eager).
    const Meta dm{d_ids, d_pos, d_slots, d_past, d_cu};
    if (logits || !graphs_on_) {
      enqueue(S, Bp, dm, logits);
    } else {
      run_graphed(
          graphs_.try_emplace({S, Bp}, device_.index).first->second, propose_counts_,
          [&] { enqueue(S, Bp, dm, nullptr); },
          [&] { return fmt::format("the propose shape ({} slot(s), block {})", S, Bp); });
    }
    // Rows 1 .. Bp-1 of each block: (Bp-1) ids per slot come back, then the one synchronisation.
    int32_t* out = drafts_host_.get(S * (Bp - 1));
    DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(out, static_cast<size_t>(Bp - 1) * 4, amax_.data<int32_t>() + 1,
                                        static_cast<size_t>(Bp) * 4, static_cast<size_t>(Bp - 1) * 4,
                                        static_cast<size_t>(S), cudaMemcpyDeviceToHost, st));
    DFLASH_CUDA_CHECK(cudaStreamSynchronize(st));
    std::vector<std::vector<int32_t>> drafts(static_cast<size_t>(S));
    for (int64_t s = 0; s < S; ++s) drafts[s].assign(out + s * (Bp - 1), out + (s + 1) * (Bp - 1));
    return drafts;
  }

 private:
  // The device pointers of a propose call's metadata (meta_'s sections: fixed for a given S and Bp).
  struct Meta {
    const int32_t *ids, *pos, *slots, *past, *cu;
  };

  // A propose step's kernels on the stream: embeddings, the layers, the final norm, the LM head and
  // the argmax of every block row into amax_ (and, when given, the fp32 logits copied to the host).
  void enqueue(int64_t S, int64_t Bp, const Meta& dm, Tensor* logits) {
    const int64_t R = S * Bp, H = c_.hidden_size, I = c_.intermediate_size, qd = c_.q_dim(), kvd = c_.kv_dim();
    const int64_t QKV = qd + 2 * kvd, V = c_.vocab_size;
    const cudaStream_t st = stream();
    const int32_t *d_ids = dm.ids, *d_pos = dm.pos, *d_slots = dm.slots, *d_past = dm.past, *d_cu = dm.cu;
    float* h = h_.data<float>();
    cuda::embedding_f32(d_ids, embed_.raw_data(), h, R, H, st);
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      Layer& L = layers_[l];
      const bool sliding = c_.layer_types[l] == AttnType::Sliding;
      cuda::rms_norm_fwd(h, true, H, L.in_ln.raw_data(), x_.raw_data(), rstd_.data<float>(), R, H, eps(), st);
      project(L.qkv, L.qkv_q, x_.raw_data(), H, qkv_.raw_data(), QKV, R, QKV, H);
      cuda::head_norm_rope_fwd(head_params(qkv_.raw_data(), QKV, L.q_norm, d_pos, q_.raw_data(), rstd_, R,
                                           c_.num_attention_heads), st);
      cuda::head_norm_rope_fwd(head_params(bf16_at(qkv_.raw_data(), qd), QKV, L.k_norm, d_pos, k_.raw_data(), rstd_, R,
                                           c_.num_key_value_heads), st);
      // The block's K / V at positions n .. n+Bp-1 of its slot (overwritten by the next add_context).
      append(L, k_.raw_data(), 0, bf16_at(qkv_.raw_data(), qd + kvd), QKV, d_slots, d_past, d_cu, S, R, Bp);
      cuda::AttentionDecodeParams a = attention_params(S, Bp, sliding);
      a.q = q_.raw_data(), a.k_cache = L.k_cache.raw_data(), a.v_cache = L.v_cache.raw_data(), a.out = o_.raw_data();
      a.slots = d_slots, a.past_len = d_past, a.cu_seqlens = d_cu;
      a.workspace = workspace_.raw_data(), a.workspace_bytes = workspace_.nbytes();
      if (fast_attention_) cuda::attention_decode_fast(a, st);
      else cuda::attention_decode_fallback(a, st);
      project(L.o, L.o_q, o_.raw_data(), qd, h, H, R, H, qd, true);  // h += o_proj(attn)
      cuda::rms_norm_fwd(h, true, H, L.post_ln.raw_data(), x_.raw_data(), rstd_.data<float>(), R, H, eps(), st);
      project(L.gu, L.gu_q, x_.raw_data(), H, gu_.raw_data(), 2 * I, R, 2 * I, H);
      cuda::swiglu(gu_.raw_data(), m_.raw_data(), R, I, st);
      project(L.down, L.down_q, m_.raw_data(), I, h, H, R, H, I, true);  // h += down(silu(gate) · up)
    }
    cuda::rms_norm_fwd(h, true, H, norm_.raw_data(), x_.raw_data(), rstd_.data<float>(), R, H, eps(), st);
    for (int64_t r0 = 0; r0 < R; r0 += kLogitChunkRows) {
      const int64_t rows = std::min(kLogitChunkRows, R - r0);
      const int64_t Vp = padded_vocab(V);
      project(lm_head_, lm_head_q_, bf16_at(x_.raw_data(), r0 * H), H, logits_.raw_data(), Vp, rows, V, H, false, true);
      cuda::argmax_rows(logits_.raw_data(), false, Vp, rows, V, amax_.data<int32_t>() + r0, st);
      if (logits)  // the V real columns of each row (the pad columns are never written)
        DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(logits->data<float>() + r0 * V, static_cast<size_t>(V) * 4,
                                            logits_.raw_data(), static_cast<size_t>(Vp) * 4, static_cast<size_t>(V) * 4,
                                            static_cast<size_t>(rows), cudaMemcpyDeviceToHost, st));
    }
  }

  // Whether a context update of N rows runs its GEMMs (fc, each layer's k|v) on the FP8 copies: under FP8
  // propose with cuda_context_fp8 on, at most 16 rows (a speculative step's accepted tokens).
  bool context_fp8(int64_t N) const { return fp8_ && cuda_context_fp8 != 0 && N <= std::min<int64_t>(16, xq_rows_); }

  // add_context's kernels on the stream: ctx = hidden_norm(fc(features)); per layer k = rope(k_norm(k_proj
  // ctx)), v = v_proj ctx, appended to the slots' caches. meta: [positions N | slots S | past lengths S |
  // cu_seqlens S+1] on the device. Its temporaries come from the allocator (a capture's pool when captured).
  void enqueue_context(const void* features, const int32_t* meta, int64_t N, int64_t S, int64_t max_new) {
    const int64_t H = c_.hidden_size, qd = c_.q_dim(), kvd = c_.kv_dim(), Hkv = c_.num_key_value_heads;
    const cudaStream_t st = stream();
    const int32_t* d_pos = meta;
    const int32_t* d_slots = d_pos + N;
    const int32_t* d_past = d_slots + S;
    const int32_t* d_cu = d_past + S;
    const Tensor pre = empty({N, H}, DType::BF16), ctx = empty({N, H}, DType::BF16), kv = empty({N, 2 * kvd}, DType::BF16);
    const Tensor k = empty({N, kvd}, DType::BF16), rstd = empty({N * std::max<int64_t>(Hkv, 1)}, DType::F32);
    const int64_t Kc = c_.context_dim();
    const bool q8 = context_fp8(N);
    if (q8) gemm_fp8_rows(fc_q_.rows_from(0, Kc), features, Kc, pre.raw_data(), H, N, H, Kc);
    else linear(features, Kc, fc_.raw_data(), pre.raw_data(), H, N, H, Kc);
    cuda::rms_norm_fwd(pre.raw_data(), false, H, hidden_norm_.raw_data(), ctx.raw_data(), rstd.data<float>(), N, H, eps(), st);
    for (Layer& L : layers_) {
      // k|v: rows qd .. qd + 2 kvd of the fused q|k|v weight
      if (q8) gemm_fp8_rows(L.qkv_q.rows_from(qd, H), ctx.raw_data(), H, kv.raw_data(), 2 * kvd, N, 2 * kvd, H);
      else linear(ctx.raw_data(), H, bf16_at(L.qkv.raw_data(), qd * H), kv.raw_data(), 2 * kvd, N, 2 * kvd, H);
      cuda::head_norm_rope_fwd(head_params(kv.raw_data(), 2 * kvd, L.k_norm, d_pos, k.raw_data(), rstd, N, Hkv), st);
      append(L, k.raw_data(), 0, bf16_at(kv.raw_data(), kvd), 2 * kvd, d_slots, d_past, d_cu, S, N, max_new);
    }
  }

  // A CUDA graph of one step shape: a propose shape (S slots, block Bp; the device addresses and every
  // buffer it touches fixed at construction, replayed after the metadata upload) or a context shape
  // (the features and metadata it reads are its own fixed buffers, which add_context copies each
  // call's into first). Whatever a kernel wrapper allocates while captured stays in its pool.
  struct ShapeGraph {
    explicit ShapeGraph(int device) : pool(device) {}
    device_alloc::Pool pool;  // (declared first: released after the graph and the buffers)
    Tensor meta, features;    // a context shape's inputs (unused by propose shapes)
    CudaGraphExec exec;
    int64_t calls = 0;
    bool failed = false;
  };
  // What one kind of step did with its graphs, for graph_stats().
  struct GraphCounts {
    int64_t captures = 0, replays = 0, eager = 0, failures = 0;
    std::string str(const char* what) const {
      std::string out = std::string(what) + " " + std::to_string(captures) + " shape(s) captured, " +
                        std::to_string(replays) + " replay(s), " + std::to_string(eager) + " eager";
      if (failures > 0) out += ", " + std::to_string(failures) + " capture(s) FAILED (eager)";
      return out;
    }
  };
  // One call of a graphed shape: its first call runs `enqueue` eagerly (which also settles cuBLASLt's
  // algorithm choices), its second captures it and replays, later calls replay; a failed capture is
  // logged (naming what()), counted, and leaves that shape eager.
  template <class Enqueue, class What>
  void run_graphed(ShapeGraph& g, GraphCounts& n, const Enqueue& enqueue, const What& what) {
    if (!g.exec && !g.failed && g.calls > 0) {
      std::string err;
      {
        device_alloc::PoolScope scope(g.pool);
        err = capture_cuda_graph(stream(), enqueue, &g.exec);
      }
      if (err.empty()) {
        ++n.captures;
      } else {
        g.failed = true;
        ++n.failures;
        spdlog::warn("cuda proposer: capturing {} as a CUDA graph failed ({}); that shape runs eager launches", what(), err);
      }
    }
    ++g.calls;
    if (g.exec) {
      g.exec.launch(stream());
      ++n.replays;
    } else {
      enqueue();
      ++n.eager;
    }
  }

  // Where a GEMM reads an FP8 weight's codes and 128 x 128 block scales (rows from a block boundary on).
  struct Fp8View {
    const uint8_t* q = nullptr;
    const float* s = nullptr;
  };
  // A weight's e4m3 codes and 128 x 128 block scales in gemm_fp8's layout (FP8 propose).
  struct Fp8Weight {
    Tensor q, s;
    // Rows row0.. of the [N, K] weight (row0 a multiple of 128: whole blocks of scales).
    Fp8View rows_from(int64_t row0, int64_t K) const {
      DFLASH_CHECK(row0 % 128 == 0, "cuda proposer: an FP8 weight's rows are addressed by 128-row blocks, got row " << row0);
      if (!q.defined()) return {};
      return {q.data<uint8_t>() + row0 * K, s.data<float>() + row0 / 128 * cuda::fp8_weight_scale_ld(K)};
    }
  };
  struct Layer {
    Tensor qkv, o, gu, down;                      // bf16 [q+k+v, H], [H, q], [2I, H], [H, I]
    Fp8Weight qkv_q, o_q, gu_q, down_q;           // FP8 propose: their quantized copies
    Tensor q_norm, k_norm, in_ln, post_ln;        // bf16 [d], [d], [H], [H]
    Tensor k_cache, v_cache;                      // bf16 [num_slots, max_len, Hkv, d]
  };

  cudaStream_t stream() const { return static_cast<cudaStream_t>(DeviceContext::get(device_.index).stream()); }
  float eps() const { return static_cast<float>(c_.rms_norm_eps); }
  Tensor empty(const Shape& s, DType t) const { return Tensor::empty(s, t, device_); }
  Tensor zeros(const Shape& s, DType t) const {
    Tensor x = Tensor::empty(s, t, device_);
    memset_device(x.raw_data(), device_.index, 0, x.nbytes());
    return x;
  }

  // FP8 propose: each propose GEMM's weight (q|k|v, o, gate|up, down, and the target's lm_head)
  // quantized once into e4m3 codes with 128 x 128 block scales (as the official FP8 checkpoints
  // store them), and fc's for the context update of a commit (cuda_context_fp8); the bf16 weights stay for
  // add_context of any number of rows. Scratch for the quantized GEMM inputs of a block of every slot.
  void quantize_weights(int64_t Rmax) {
    const int64_t H = c_.hidden_size, I = c_.intermediate_size, qd = c_.q_dim(), kvd = c_.kv_dim();
    DFLASH_CHECK_HINT(cuda_device_info(device_.index).major >= 9,
                      "cuda proposer: FP8 propose runs block-scaled FP8 GEMMs, which need sm_90 (this GPU is sm_"
                          << cuda_device_info(device_.index).major << "x)",
                      "propose in bf16 (--draft-precision bf16)");
    for (const auto& [K, what] : {std::pair{H, "hidden_size"}, {qd, "q_dim (heads x head_dim)"}, {I, "intermediate_size"}})
      DFLASH_CHECK_HINT(K % 128 == 0, "cuda proposer: FP8 propose needs every GEMM's K a multiple of 128 (the block "
                                      "scales' width), got "
                                          << what << " = " << K,
                        "propose in bf16 (--draft-precision bf16)");
    auto quantize = [&](const Tensor& w, int64_t N, int64_t K) {
      const int64_t ld = cuda::fp8_weight_scale_ld(K);
      Fp8Weight f{empty({N, K}, DType::U8), empty({(N + 127) / 128, ld}, DType::F32)};
      memset_device(f.s.raw_data(), device_.index, 0, f.s.nbytes());  // the padding entries
      cuda::quantize_fp8_weight(w.raw_data(), N, K, f.q.data<uint8_t>(), f.s.data<float>(), ld, stream());
      return f;
    };
    for (Layer& L : layers_) {
      L.qkv_q = quantize(L.qkv, qd + 2 * kvd, H);
      L.o_q = quantize(L.o, H, qd);
      L.gu_q = quantize(L.gu, 2 * I, H);
      L.down_q = quantize(L.down, H, I);
    }
    lm_head_q_ = quantize(lm_head_, c_.vocab_size, H);
    fc_q_ = quantize(fc_, H, c_.context_dim());
    const int64_t K = std::max({H, qd, I, c_.context_dim()});
    xq_rows_ = Rmax, xq_k_ = K;
    xq_ = empty({Rmax, K}, DType::U8);
    xs_ = empty({static_cast<int64_t>(cuda::fp8_act_scale_elems(Rmax, K))}, DType::F32);
  }

  // y[M, N] = x[M, K] · w[N, K]ᵀ as linear() does it, or, in an FP8 propose of <= 16 rows, from the
  // quantized weight `f` (x quantized per token and 128 columns first): cuBLASLt's block-scaled kernel
  // (cuda::gemm_fp8) where it applies (rows a multiple of 4, y's row stride a multiple of 8), else the
  // streaming kernel (at M 16 cuBLASLt streams the decode shapes at 1.6-2.3 TB/s against the streaming
  // kernel's 1.0-1.4 on an H100: bench/results/h100-fused-6bf6ff4).
  void project(const Tensor& w, const Fp8Weight& f, const void* x, int64_t ldx, void* y, int64_t ldy, int64_t M, int64_t N,
               int64_t K, bool accumulate = false, bool f32_out = false) {
    if (!fp8_ || M > 16) {
      if (fp8_ && fp8_fallbacks_++ == 0)
        spdlog::warn("cuda proposer: FP8 propose runs steps of at most 16 rows (one slot's block); a step of {} rows "
                     "runs its GEMMs in bf16 (this and every such step)",
                     M);
      return linear(x, ldx, w.raw_data(), y, ldy, M, N, K, accumulate, f32_out);
    }
    gemm_fp8_rows(f.rows_from(0, K), x, ldx, y, ldy, M, N, K, accumulate, f32_out);
  }
  // project()'s FP8 GEMM of M <= 16 rows on the weight rows `w` (N of them, K columns).
  void gemm_fp8_rows(const Fp8View& w, const void* x, int64_t ldx, void* y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                     bool accumulate = false, bool f32_out = false) {
    DFLASH_CHECK(M <= std::min<int64_t>(16, xq_rows_) && K <= xq_k_,
                 "cuda proposer: an FP8 GEMM of " << M << " x " << K << " exceeds its scratch");
    cuda::Fp8ActQuantParams qp{x, ldx, xq_.data<uint8_t>(), K, xs_.data<float>(), M, K};
    cuda::quantize_fp8_act(qp, stream());
    cuda::GemmFp8Params g;
    g.x = xq_.data<uint8_t>(), g.ldx = K, g.x_scale = xs_.data<float>(), g.w = w.q, g.w_scale = w.s;
    g.y = y, g.ldy = ldy, g.M = M, g.N = N, g.K = K, g.y_f32 = accumulate || f32_out, g.accumulate = accumulate;
    if (M % 4 == 0 && ldy % 8 == 0)
      cuda::gemm_fp8(g, device_.index);
    else
      cuda::gemm_fp8_stream(g, device_.index, stream());
  }

  // y[M, N] = x[M, K] · w[N, K]ᵀ: bf16 y, or fp32 y added into (accumulate) or written (f32_out).
  void linear(const void* x, int64_t ldx, const void* w, void* y, int64_t ldy, int64_t M, int64_t N, int64_t K,
              bool accumulate = false, bool f32_out = false) const {
    cuda::GemmExParams g;
    g.a = x, g.lda = ldx, g.b = w, g.ldb = K, g.trans_b = true, g.d = y, g.ldd = ldy;
    g.d_f32 = accumulate || f32_out, g.M = M, g.N = N, g.K = K, g.beta = accumulate ? 1.0f : 0.0f;
    g.unaligned = gemm_unaligned_;
    cuda::gemm_ex(g, device_.index);
  }
  cuda::HeadNormRopeParams head_params(const void* x, int64_t ldx, const Tensor& w, const int32_t* pos, void* y,
                                       const Tensor& rstd, int64_t rows, int64_t heads) const {
    cuda::HeadNormRopeParams p;
    p.x = x, p.ldx = ldx, p.w = w.raw_data(), p.pos = pos, p.y = y, p.rstd = rstd.data<float>();
    p.rows = rows, p.heads = heads, p.d = c_.head_dim, p.eps = eps(), p.theta = static_cast<float>(c_.rope_theta);
    return p;
  }
  void append(Layer& L, const void* k, int64_t ldk, const void* v, int64_t ldv, const int32_t* slots,
              const int32_t* past, const int32_t* cu, int64_t S, int64_t N, int64_t max_new) const {
    cuda::KvAppendParams p;
    p.k = k, p.ldk = ldk, p.v = v, p.ldv = ldv, p.k_cache = L.k_cache.raw_data(), p.v_cache = L.v_cache.raw_data();
    p.slots = slots, p.past_len = past, p.cu_seqlens = cu, p.num_seqs = S, p.N = N;
    p.Hkv = c_.num_key_value_heads, p.d = c_.head_dim, p.max_len = slots_.max_len(), p.num_slots = slots_.num_slots();
    p.max_new = max_new;
    cuda::kv_cache_append(p, stream());
  }
  // The sizes of an attention over S blocks of Bp rows (pointers are the caller's).
  cuda::AttentionDecodeParams attention_params(int64_t S, int64_t Bp, bool sliding) const {
    cuda::AttentionDecodeParams a;
    a.num_seqs = S, a.N = S * Bp, a.Hq = c_.num_attention_heads, a.Hkv = c_.num_key_value_heads, a.d = c_.head_dim;
    a.max_len = slots_.max_len(), a.num_slots = slots_.num_slots(), a.max_new = Bp;
    a.causal = sliding, a.window = sliding ? c_.sliding_window : 0;
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c_.head_dim)));
    return a;
  }

  DrafterConfig c_;
  ProposerSlots slots_;
  Device device_;
  Tensor embed_, lm_head_;
  bool fp8_ = false;                // FP8 propose (make_cuda_proposer's fp8_propose)
  bool graphs_on_ = true;           // propose steps as CUDA graphs (make_cuda_proposer's cuda_graphs)
  bool ctx_graphs_on_ = false;      // add_context too (graphs_on_ and DFLASH_CONTEXT_GRAPHS=1: opt-in, no gain measured)
  std::map<std::pair<int64_t, int64_t>, ShapeGraph> graphs_;  // propose shapes, by (slots, block)
  std::map<std::tuple<int64_t, int64_t, int64_t, bool>, ShapeGraph> ctx_graphs_;  // by (slots, rows, longest, context_fp8)
  GraphCounts propose_counts_, ctx_counts_;
  Fp8Weight lm_head_q_, fc_q_;      // FP8 propose: the lm_head's and fc's codes and scales
  Tensor xq_, xs_;                  // FP8 propose: a GEMM input's codes [Rmax, K] and scales
  int64_t xq_rows_ = 0, xq_k_ = 0;  // (their Rmax and K)
  int64_t fp8_fallbacks_ = 0;       // FP8 propose GEMMs of more than 16 rows, run in bf16
  bool fast_attention_ = false;
  bool gemm_unaligned_ = false;     // cuda_drafter_gemm_unaligned: intermediate_size not a multiple of 8
  Tensor fc_, hidden_norm_, norm_;  // bf16 [H, k·H], [H], [H]
  std::vector<Layer> layers_;
  // Propose scratch, sized for a block of B rows in every slot (Rmax = num_slots · B rows).
  Tensor h_;                          // f32 [Rmax, H] residual stream
  Tensor x_;                          // bf16 [Rmax, H] normed input of the next GEMM
  Tensor rstd_;                       // f32 [Rmax · Hq]
  Tensor qkv_, q_, k_, o_, gu_, m_;   // bf16 [Rmax, q+2kv], [Rmax, q], [Rmax, kv], [Rmax, q], [Rmax, 2I], [Rmax, I]
  Tensor logits_;                     // f32 [min(Rmax, kLogitChunkRows), V]
  Tensor amax_;                       // i32 [Rmax]
  Tensor meta_;                       // i32 [2 Rmax + 3 num_slots + 1]
  Tensor workspace_;                  // attention split-KV partials
  Pinned meta_host_, ctx_meta_, drafts_host_;
};

}  // namespace

std::unique_ptr<Proposer> make_cuda_proposer(const DrafterConfig& config, const DrafterWeights& host_weights,
                                             Tensor embed_tokens, Tensor lm_head, Device device, int64_t num_slots,
                                             int64_t max_len, bool fp8_propose, bool cuda_graphs) {
  return std::make_unique<CudaProposer>(config, host_weights, std::move(embed_tokens), std::move(lm_head), device,
                                        num_slots, max_len, fp8_propose, cuda_proposer_graphs(cuda_graphs));
}

bool cuda_proposer_graphs(bool requested) {
  // (scripts/gpu_fused.sh's "+peager" A/B sets 0.)
  if (const char* e = std::getenv("DFLASH_PROPOSE_GRAPHS"); e != nullptr && (std::string(e) == "0" || std::string(e) == "1"))
    return std::string(e) == "1";
  return requested;
}

int cuda_context_fp8 = [] {
  const char* e = std::getenv("DFLASH_CONTEXT_FP8");
  return e != nullptr && std::string(e) == "1" ? 1 : 0;
}();

const char* cuda_proposer_attention_kernel(const DrafterConfig& config, Device device) {
  return cuda::attention_decode_kernel_name(config.head_dim, cuda_device_info(device.index).major);
}

}  // namespace dflash::drafter
