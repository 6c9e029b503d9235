#include "target_model/model_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <numeric>

#include <fmt/format.h>

#include "kernels/cuda/attention.h"
#include "core/cuda/check.h"
#include "kernels/cuda/conv.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gdn.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/rope.h"
#include "core/device.h"
#include "target_model/tp.h"

namespace dflash::target {

namespace {

int64_t round_up8(int64_t x) { return (x + 7) / 8 * 8; }

// Rows [r0, r0 + part.rows) of `dst` := part (both bf16 on the same device, contiguous).
void put_rows(Tensor& dst, int64_t r0, const Tensor& part) {
  Tensor window = dst.slice(0, r0, r0 + part.size(0));
  window.copy_from(part);
}

Tensor device_bf16(const Shape& s, Device d) { return Tensor::empty(s, DType::BF16, d); }

}  // namespace

OpProfiler::~OpProfiler() {
  for (void* e : events_) DFLASH_CUDA_WARN(cudaEventDestroy(static_cast<cudaEvent_t>(e)));
}

size_t OpProfiler::begin(ForwardOp op, void* stream, const GemmShape& gemm) {
  DFLASH_CHECK(!open_, "OpProfiler: " << forward_op_name(ops_.back().op) << " was not closed before "
                                      << forward_op_name(op));
  const size_t slot = ops_.size();
  while (events_.size() < 2 * (slot + 1)) {  // first forward only: the pool keeps its events
    cudaEvent_t e = nullptr;
    DFLASH_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  ops_.push_back({op, gemm, 0.0});
  open_ = true;
  DFLASH_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(events_[2 * slot]), static_cast<cudaStream_t>(stream)));
  return slot;
}

void OpProfiler::end(size_t slot, void* stream) {
  DFLASH_CHECK(open_ && slot + 1 == ops_.size(), "OpProfiler: end of slot " << slot << " that is not the open one");
  DFLASH_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(events_[2 * slot + 1]), static_cast<cudaStream_t>(stream)));
  open_ = false;
}

OpProfile OpProfiler::collect() {
  DFLASH_CHECK(!open_, "OpProfiler: collect() while " << forward_op_name(ops_.back().op) << " is still open");
  OpProfile p;
  if (ops_.empty()) return p;
  auto elapsed = [&](size_t a, size_t b) {
    float ms = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_[a]), static_cast<cudaEvent_t>(events_[b])));
    return static_cast<double>(ms);
  };
  DFLASH_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(events_[2 * ops_.size() - 1])));
  for (size_t i = 0; i < ops_.size(); ++i) ops_[i].ms = elapsed(2 * i, 2 * i + 1);
  p.span_ms = elapsed(0, 2 * ops_.size() - 1);
  p.ops = ops_;
  ops_.clear();  // keeps its capacity: later forwards do not allocate
  return p;
}

template <class Enqueue>
void CudaTargetModel::timed(ForwardOp op, Enqueue&& enqueue, const GemmShape& gemm) {
  if (!profiler_) return enqueue();
  const size_t slot = profiler_->begin(op, stream_, gemm);
  enqueue();
  profiler_->end(slot, stream_);
}

void CudaTargetModel::profiled(ForwardOp op, const std::function<void()>& enqueue, const GemmShape& gemm) {
  timed(op, enqueue, gemm);
}

CudaTargetModel::CudaTargetModel(TargetConfig config, TargetWeights weights, FastPathPlan plan, comm::Communicator* tp)
    : config_(std::move(config)), weights_(std::move(weights)), plan_(std::move(plan)), device_(weights_.device), tp_(tp) {
  DFLASH_CHECK(device_.is_cuda() && weights_.dtype == DType::BF16,
               "CUDA target model: weights must be bf16 on a CUDA device, got " << dtype_name(weights_.dtype) << " on "
                                                                               << device_.str());
  DFLASH_CHECK(!config_.is_moe() || (tp_ ? tp_->size() : 1) % config_.ep_size == 0,
               config_.source << ": ep " << config_.ep_size << " expert groups in a TP group of " << (tp_ ? tp_->size() : 1)
                              << " ranks");
  DFLASH_CHECK(plan_.layers.size() == static_cast<size_t>(config_.num_hidden_layers),
               "CUDA target model: the plan has " << plan_.layers.size() << " layers, the config "
                                                  << config_.num_hidden_layers);
  stream_ = DeviceContext::get(device_.index).stream();
  // The plan's gemm steps and the weights must agree on the precision; an FP8 plan that falls back
  // (no block-scaled FP8 GEMM on this GPU) runs the dequantized weights.
  const StepPlan& gemm_step = plan_.layers[0].step(Step::Gemm);
  // gemm_fp8, or its dequantizing fallback (the unaligned bf16 fallback is bf16: make_plan refuses
  // an FP8 model whose sizes it would need)
  const bool plan_fp8 = gemm_step.kernel != "gemm_bf16" && gemm_step.kernel != kGemmUnalignedKernel;
  const bool weights_fp8 = weights_.fp8_projections() > 0;
  DFLASH_CHECK_HINT(plan_fp8 == weights_fp8, "CUDA target model: the weights are " << (weights_fp8 ? "FP8" : "bf16")
                                                 << " but the plan's gemm steps are " << gemm_step.kernel,
                    "make the plan with the weights' precision (make_plan(..., Precision::"
                        << (weights_fp8 ? "Fp8" : "Bf16") << "))");
  if (weights_fp8 && gemm_step.path != Path::Fast) apply_precision(weights_, Precision::Bf16);
  fp8_ = weights_fp8 && gemm_step.path == Path::Fast;
  gemm_unaligned_ = gemm_step.kernel == kGemmUnalignedKernel;
  DFLASH_CHECK_HINT(!config_.is_moe() || (!weights_fp8 && !gemm_unaligned_ && !plan_.moe_kernel.empty()),
                    config_.source << ": the GPU runs MoE blocks in bf16 with every size a multiple of 8 (the plan: "
                                   << plan_.moe << ")",
                    "make the plan for this device with make_plan (bf16); FP8 MoE runs nowhere yet");
  fused_.resize(weights_.layers.size());
  for (size_t i = 0; i < weights_.layers.size(); ++i) {
    LayerWeights& L = weights_.layers[i];
    Fused& f = fused_[i];
    std::vector<Tensor*> parts, scales;
    if (L.type == LayerType::LinearAttention) {
      parts = {&L.gdn.in_proj_qkv, &L.gdn.in_proj_z, &L.gdn.in_proj_b, &L.gdn.in_proj_a};
      scales = {&L.gdn.in_proj_qkv_scale, &L.gdn.in_proj_z_scale, nullptr, nullptr};
      f.out = make_proj({&L.gdn.out_proj}, {&L.gdn.out_proj_scale}, 0, 0);
    } else {
      parts = {&L.attn.q_proj, &L.attn.k_proj, &L.attn.v_proj};
      scales = {&L.attn.q_proj_scale, &L.attn.k_proj_scale, &L.attn.v_proj_scale};
      f.out = make_proj({&L.attn.o_proj}, {&L.attn.o_proj_scale}, 0, 0);
    }
    int64_t rows = 0;
    for (Tensor* t : parts) rows += t->size(0);
    f.rows = round_up8(rows);
    // Groups of consecutive parts of one precision; an FP8 group continues only across a part with
    // a multiple of 128 rows (its scale blocks then stack). The last GEMM also writes the padding
    // columns up to pad_to (zero rows of its weight).
    auto group = [&](std::vector<Tensor*>& ps, std::vector<Tensor*>& ss, std::vector<Proj>& out, int64_t pad_to) {
      std::vector<std::pair<size_t, size_t>> groups;
      for (size_t j = 0; j < ps.size();) {
        const bool fp8 = ss[j] && ss[j]->defined();
        size_t e = j + 1;
        while (e < ps.size() && (ss[e] && ss[e]->defined()) == fp8 && (!fp8 || ps[e - 1]->size(0) % 128 == 0)) ++e;
        groups.emplace_back(j, e);
        j = e;
      }
      int64_t col = 0;
      for (size_t g = 0; g < groups.size(); ++g) {
        const auto [j, e] = groups[g];
        std::vector<Tensor*> gw(ps.begin() + static_cast<std::ptrdiff_t>(j), ps.begin() + static_cast<std::ptrdiff_t>(e));
        std::vector<Tensor*> gs(ss.begin() + static_cast<std::ptrdiff_t>(j), ss.begin() + static_cast<std::ptrdiff_t>(e));
        int64_t rows_g = 0;
        for (Tensor* t : gw) rows_g += t->size(0);
        const int64_t extra = g + 1 == groups.size() ? std::max<int64_t>(0, pad_to - col - rows_g) : 0;
        out.push_back(make_proj(gw, gs, col, extra));
        col += rows_g;
      }
    };
    group(parts, scales, f.in_parts, f.rows);
    if (L.moe.defined()) {
      f.shared_gate_up = make_proj({&L.moe.shared_gate_proj, &L.moe.shared_up_proj}, {nullptr, nullptr}, 0, 0);
      continue;
    }
    std::vector<Tensor*> gu = {&L.gate_proj, &L.up_proj}, gus = {&L.gate_proj_scale, &L.up_proj_scale};
    group(gu, gus, f.gate_up, 0);
    f.down = make_proj({&L.down_proj}, {&L.down_proj_scale}, 0, 0);
  }
  DeviceContext::get(device_.index).synchronize();
  // The unfused copies went back to the cache; their sizes rarely fit later requests.
  device_alloc::empty_cache(device_.index);
}

CudaTargetModel::Proj CudaTargetModel::make_proj(std::vector<Tensor*> ws, std::vector<Tensor*> ss, int64_t col,
                                                 int64_t extra_rows) {
  Proj p;
  p.col = col;
  p.K = ws[0]->size(1);
  const bool fp8 = ss[0] && ss[0]->defined();
  for (Tensor* t : ws) {
    DFLASH_CHECK(t->size(1) == p.K, "CUDA target model: fused projections of different input sizes");
    p.N += t->size(0);
  }
  p.N += extra_rows;
  DFLASH_CHECK_HINT(col % 8 == 0, "CUDA target model: a projection's output starts at column " << col
                                      << ", not a multiple of 8 (16-byte aligned rows)",
                    "the model's head / value dims must keep the fused projections' boundaries 16-byte aligned");
  if (ws.size() == 1 && extra_rows == 0) {
    p.w = *ws[0];
  } else {
    p.w = extra_rows ? Tensor::zeros({p.N, p.K}, ws[0]->dtype(), device_) : Tensor::empty({p.N, p.K}, ws[0]->dtype(), device_);
    int64_t r = 0;
    for (Tensor* t : ws) {
      put_rows(p.w, r, *t);
      *t = p.w.slice(0, r, r + t->size(0));  // the separate copy is freed
      r += t->size(0);
    }
  }
  if (!fp8) return p;
  // The block scales stacked in cuBLASLt's layout: rows of fp8_weight_scale_ld(K) floats.
  const int64_t kb = (p.K + 127) / 128, ld = cuda::fp8_weight_scale_ld(p.K);
  Tensor host = Tensor::zeros({(p.N + 127) / 128, ld}, DType::F32);
  int64_t b0 = 0;
  for (Tensor* s : ss) {
    DFLASH_CHECK(s && s->defined() && s->size(1) == kb, "CUDA target model: an FP8 group mixes precisions");
    Tensor hs = s->to(Device::cpu());
    for (int64_t r = 0; r < hs.size(0); ++r)
      std::memcpy(host.data<float>() + (b0 + r) * ld, hs.data<float>() + r * kb, static_cast<size_t>(kb) * sizeof(float));
    b0 += hs.size(0);
  }
  p.scale = host.to(device_);
  return p;
}

CudaTargetModel::Fp8Input CudaTargetModel::alloc_input(int64_t M, int64_t K) {
  Fp8Input in;
  const int64_t Mg = gemm_rows(M);
  in.q = Tensor::empty({Mg, K}, DType::F8E4M3, device_);
  if (Mg > M)  // the pad rows the GEMM reads: zero codes (their scales are written as 1)
    DFLASH_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(in.q.raw_data()) + M * K, 0, static_cast<size_t>((Mg - M) * K),
                                      static_cast<cudaStream_t>(stream_)));
  in.scale = Tensor::empty({static_cast<int64_t>(cuda::fp8_act_scale_elems(M, K))}, DType::F32, device_);
  return in;
}

CudaTargetModel::Fp8Input CudaTargetModel::quantize_input(const Tensor& x, int64_t ldx, int64_t M, int64_t K) {
  Fp8Input in = alloc_input(M, K);
  cuda::Fp8ActQuantParams qp;
  qp.x = x.raw_data();
  qp.ldx = ldx;
  qp.q = static_cast<uint8_t*>(in.q.raw_data());
  qp.ldq = K;
  qp.scale = in.scale.data<float>();
  qp.M = M;
  qp.K = K;
  timed(ForwardOp::Fp8Quant, [&] { cuda::quantize_fp8_act(qp, stream_); });
  return in;
}

bool CudaTargetModel::skinny_step(int64_t M) const {
  const DecodeStep* ds = decode_;
  return ds && !ds->prefill && ds->fusion.skinny_gemm && !gemm_unaligned_ && M <= 16;
}

cuda::GemmSkinnyParams CudaTargetModel::skinny_params(const Proj& p, const void* x, int64_t ldx, void* y, int64_t ldy,
                                                      int64_t M, bool swiglu) {
  cuda::GemmSkinnyParams g;
  g.x = x, g.ldx = ldx, g.w = p.w.raw_data(), g.y = y, g.ldy = ldy, g.M = M, g.N = p.N, g.K = p.K, g.swiglu = swiglu;
  return g;
}

bool CudaTargetModel::skinny(const Proj& p, int64_t M, int64_t ldx, int64_t ldy, bool swiglu) const {
  if (!skinny_step(M) || p.fp8()) return false;
  if (swiglu && !decode_->fusion.swiglu_gemm) return false;
  const cuda::GemmSkinnyParams sp = skinny_params(p, nullptr, ldx, nullptr, ldy, M, swiglu);
  return streamk(sp) || cuda::gemm_skinny_splits(sp, device_.index) > 0;
}

bool CudaTargetModel::streamk(const cuda::GemmSkinnyParams& sp) const {
  return decode_ && decode_->fusion.skinny_streamk && cuda::gemm_bf16_stream_supported(sp);
}

bool CudaTargetModel::side_gemms(const std::vector<Proj>& parts, int64_t M, int64_t ldx, int64_t ldy, bool swiglu) const {
  const DecodeStep* ds = decode_;
  if (!ds || ds->prefill || !ds->fusion.fp8_side_gemms || profiler_ || gemm_unaligned_ || swiglu || M > 16) return false;
  bool fp8 = false, bf16 = false;
  for (const Proj& p : parts) {
    if (p.fp8()) {
      fp8 = true;
      continue;
    }
    if (cuda::gemm_skinny_splits(skinny_params(p, nullptr, ldx, nullptr, ldy, M, false), device_.index) <= 0) return false;
    bf16 = true;
  }
  return fp8 && bf16;
}

struct CudaTargetModel::SideLane {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};

CudaTargetModel::SideLane& CudaTargetModel::lane(SideLanePtr& l) {
  if (!l) {
    cuda::DeviceGuard scope(device_.index);
    l.reset(new SideLane);
    DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&l->stream, cudaStreamNonBlocking));
    DFLASH_CUDA_CHECK(cudaEventCreateWithFlags(&l->fork, cudaEventDisableTiming));
    DFLASH_CUDA_CHECK(cudaEventCreateWithFlags(&l->join, cudaEventDisableTiming));
  }
  return *l;
}

void CudaTargetModel::SideLaneDeleter::operator()(SideLane* lane) const {
  if (lane->stream) DFLASH_CUDA_WARN(cudaStreamSynchronize(lane->stream));
  if (lane->fork) DFLASH_CUDA_WARN(cudaEventDestroy(lane->fork));
  if (lane->join) DFLASH_CUDA_WARN(cudaEventDestroy(lane->join));
  if (lane->stream) DFLASH_CUDA_WARN(cudaStreamDestroy(lane->stream));
  delete lane;
}

void CudaTargetModel::prefetch_next(const std::vector<Proj>& parts) {
  const DecodeStep* ds = decode_;
  if (!ds || ds->prefill || !ds->fusion.prefetch || cuda::tuning::decode_prefetch_mb <= 0 || parts.empty()) return;
  lane(prefetch_);
  // The budget shared by the parts in proportion to their bytes (the parts run back to back).
  const int64_t budget = static_cast<int64_t>(cuda::tuning::decode_prefetch_mb) << 20;
  int64_t total = 0;
  for (const Proj& p : parts) total += static_cast<int64_t>(p.w.nbytes());
  DFLASH_CUDA_CHECK(cudaEventRecord(prefetch_->fork, static_cast<cudaStream_t>(stream_)));
  DFLASH_CUDA_CHECK(cudaStreamWaitEvent(prefetch_->stream, prefetch_->fork, 0));
  for (const Proj& p : parts) {
    const int64_t bytes = static_cast<int64_t>(p.w.nbytes());
    cuda::L2PrefetchParams g;
    g.w = p.w.raw_data();
    g.rows = p.N;
    g.row_bytes = p.K * static_cast<int64_t>(dtype_size(p.w.dtype()));
    g.bytes_per_row = cuda::l2_prefetch_bytes_per_row(g.rows, g.row_bytes,
                                                      total > budget ? static_cast<int64_t>(static_cast<double>(budget) * bytes / total) : bytes);
    if (!cuda::prefetch_l2_supported(g)) continue;
    cuda::prefetch_l2(g, prefetch_->stream);
    ++prefetches_;
  }
  prefetch_pending_ = true;
}

int64_t CudaTargetModel::pack_decode_weights() {
  int64_t bytes = 0;
  cuda::DeviceGuard scope(device_.index);
  for (Fused& f : fused_) {
    std::vector<Proj*> parts{&f.out, &f.down, &f.shared_gate_up};
    for (Proj& p : f.in_parts) parts.push_back(&p);
    for (Proj& p : f.gate_up) parts.push_back(&p);
    for (Proj* p : parts) {
      if (!p->w.defined() || !p->fp8()) continue;
      if (!p->packed.defined()) {
        const int64_t need = cuda::stream_packed_bytes(p->N, p->K);
        try {
          p->packed = Tensor::empty({need}, DType::U8, device_);
        } catch (const Error& e) {
          throw Error(fmt::format("the packed FP8 decode copies (DecodeFusion::fp8_packed) did not fit: {:.2f} GB made, "
                                  "{:.2f} GB more asked: {}",
                                  static_cast<double>(bytes) / 1e9, static_cast<double>(need) / 1e9, e.message()),
                      "run without the packed copies (they are off in the plan; --decode-variant packed turns them on)",
                      e.where(), e.kind());
        }
        cuda::pack_stream_weight(p->w.raw_data(), p->N, p->K, p->packed.raw_data(), stream_);
      }
      bytes += static_cast<int64_t>(p->packed.nbytes());
    }
  }
  return bytes;
}

void CudaTargetModel::join_prefetch() {
  if (!prefetch_pending_) return;
  DFLASH_CUDA_CHECK(cudaEventRecord(prefetch_->join, prefetch_->stream));
  DFLASH_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_), prefetch_->join, 0));
  prefetch_pending_ = false;
}

void CudaTargetModel::project(ForwardOp op, const Tensor& x, int64_t ldx, const std::vector<Proj>& parts, Tensor& y,
                              int64_t ldy, int64_t M, const Fp8Input* pre, bool swiglu) {
  DFLASH_CHECK(!swiglu || (parts.size() == 1 && skinny(parts[0], M, ldx, ldy, true)),
               "CUDA target model: a GEMM with SwiGLU as its prologue runs on gemm_skinny only");
  Fp8Input in;
  if (pre) in = *pre;
  SideLane* side = nullptr;
  if (side_gemms(parts, M, ldx, ldy, swiglu)) {  // x is ready on stream_: the side lane starts from here
    side = &lane(side_);
    DFLASH_CUDA_CHECK(cudaEventRecord(side->fork, static_cast<cudaStream_t>(stream_)));
    DFLASH_CUDA_CHECK(cudaStreamWaitEvent(side->stream, side->fork, 0));
  }
  for (const Proj& p : parts) {
    char* out = static_cast<char*>(y.raw_data()) + p.col * 2;
    if (side && !p.fp8()) {  // beside the FP8 GEMMs (which write other columns of y)
      cuda::gemm_skinny(skinny_params(p, x.raw_data(), ldx, out, ldy, M, false), device_.index, side->stream);
      ++side_gemms_;
      continue;
    }
    const GemmShape shape{p.fp8() ? gemm_rows(M) : M, p.N, p.K, p.fp8() ? p.K : ldx, ldy, p.fp8()};
    if (p.fp8()) {
      if (!in.q.defined()) in = quantize_input(x, ldx, M, p.K);
      cuda::GemmFp8Params g;
      g.x = static_cast<const uint8_t*>(in.q.raw_data());
      g.ldx = p.K;
      g.x_scale = in.scale.data<float>();
      g.w = static_cast<const uint8_t*>(p.w.raw_data());
      g.w_scale = p.scale.data<float>();
      g.y = out;
      g.ldy = ldy;
      g.M = gemm_rows(M);  // y has those rows (gemm_rows)
      g.N = p.N;
      g.K = p.K;
      if (skinny_step(M) && cuda::gemm_fp8_stream_supported(g)) {  // a decode / verify step: the streaming kernel
        if (decode_->fusion.fp8_packed && p.packed.defined()) {
          g.w_packed = p.packed.data<uint8_t>();
          ++packed_gemms_;
        }
        timed(op, [&] { cuda::gemm_fp8_stream(g, device_.index, stream_); }, shape);
      } else {
        timed(op, [&] { cuda::gemm_fp8(g, device_.index); }, shape);
      }
    } else if (skinny(p, M, ldx, ldy, swiglu)) {  // a decode / verify step (DecodeStep::fusion)
      const cuda::GemmSkinnyParams g = skinny_params(p, x.raw_data(), ldx, out, ldy, M, swiglu);
      if (streamk(g))
        timed(op, [&] { cuda::gemm_bf16_stream(g, device_.index, stream_); }, shape);
      else
        timed(op, [&] { cuda::gemm_skinny(g, device_.index, stream_); }, shape);
    } else {
      cuda::GemmParams g;
      g.x = x.raw_data();
      g.ldx = ldx;
      g.w = p.w.raw_data();
      g.y = out;
      g.ldy = ldy;
      g.M = M;
      g.N = p.N;
      g.K = p.K;
      g.unaligned = gemm_unaligned_;
      timed(op, [&] { cuda::gemm_bf16(g, device_.index); }, shape);
    }
  }
  if (side) {  // y's readers wait for the side GEMMs
    DFLASH_CUDA_CHECK(cudaEventRecord(side->join, side->stream));
    DFLASH_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_), side->join, 0));
  }
}

void CudaTargetModel::set_plan(FastPathPlan plan) {
  DFLASH_CHECK(plan.layers.size() == static_cast<size_t>(config_.num_hidden_layers),
               "CUDA target model: the plan has " << plan.layers.size() << " layers, the config "
                                                  << config_.num_hidden_layers);
  plan_ = std::move(plan);
  gemm_unaligned_ = plan_.layers[0].step(Step::Gemm).kernel == kGemmUnalignedKernel;
}

CudaBatch CudaTargetModel::make_batch(const std::vector<std::vector<int32_t>>& sequences) const {
  DFLASH_CHECK(!sequences.empty(), "target forward: the batch has no sequences");
  CudaBatch b;
  b.offsets.push_back(0);
  std::vector<int32_t> ids, pos, cu{0};
  for (size_t s = 0; s < sequences.size(); ++s) {
    DFLASH_CHECK(!sequences[s].empty(), "target forward: sequence " << s << " is empty");
    for (size_t t = 0; t < sequences[s].size(); ++t) {
      const int32_t id = sequences[s][t];
      DFLASH_CHECK_HINT(id >= 0 && id < config_.vocab_size,
                        "target forward: token id " << id << " at sequence " << s << ", position " << t
                                                    << " is outside the vocabulary [0, " << config_.vocab_size << ")",
                        "the tokens do not come from this model's tokenizer, or vocab_size in config.json is wrong");
      ids.push_back(id);
      pos.push_back(static_cast<int32_t>(t));
    }
    b.offsets.push_back(b.offsets.back() + static_cast<int64_t>(sequences[s].size()));
    DFLASH_CHECK(b.offsets.back() < INT32_MAX, "target forward: more than 2^31 tokens in one batch");
    cu.push_back(static_cast<int32_t>(b.offsets.back()));
    b.max_seqlen = std::max<int64_t>(b.max_seqlen, static_cast<int64_t>(sequences[s].size()));
  }
  b.num_tokens = b.offsets.back();
  b.num_seqs = static_cast<int64_t>(sequences.size());
  auto upload = [&](std::vector<int32_t>& v) {
    return Tensor::from_blob(v.data(), {static_cast<int64_t>(v.size())}, DType::I32).to(device_);
  };
  b.ids = upload(ids);
  b.pos = upload(pos);
  b.cu_seqlens = upload(cu);
  return b;
}

void CudaTargetModel::gdn_mixer(int64_t i, const Tensor& x, const CudaBatch& b, const LayerPlan& lp, Tensor& out,
                                const Fp8Input* x_q) {
  const TargetConfig& c = config_;
  const LayerWeights& L = weights_.layers[static_cast<size_t>(i)];
  const Fused& f = fused_[static_cast<size_t>(i)];
  const int64_t N = b.num_tokens, H = c.hidden_size, Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, C = c.gdn_conv_dim(), V = c.gdn_value_dim();
  const int64_t P = f.rows;
  Tensor proj = device_bf16({gemm_rows(N), P}, device_);
  project(ForwardOp::GdnInProj, x, H, f.in_parts, proj, P, N, x_q);
  prefetch_next({f.out});
  auto col = [&](int64_t j) { return static_cast<char*>(proj.raw_data()) + j * 2; };

  DecodeStep* ds = decode_;
  DecodeLayer* dl = ds ? &(*ds->layers)[static_cast<size_t>(i)] : nullptr;
  if (ds && !ds->prefill && ds->fusion.gdn_chain && b.num_seqs <= ds->fusion.gdn_chain_max_seqs &&
      ds->max_new <= kMaxVerifyTokens) {
    // The fused chain (gdn.h gdn_decode_fused): conv update .. gated RMSNorm in one kernel, the
    // unfused kernels' values bit for bit; a verify also keeps what commit re-runs. With an FP8
    // out_proj it writes out_proj's quantized input (gated_rms_norm_quant_fp8's codes and scales).
    Tensor normed;
    Fp8Input in;
    cuda::GdnDecodeFusedParams fp;
    if (f.out.fp8()) {
      in = alloc_input(N, V);
      fp.out_q = static_cast<uint8_t*>(in.q.raw_data());
      fp.ldq = V;
      fp.out_scale = in.scale.data<float>();
      fp.lds = cuda::fp8_act_scale_ld(N);
      fp.rows = N;
    } else {
      normed = device_bf16({N, V}, device_);
      fp.out = normed.raw_data();
      fp.ldo = V;
    }
    fp.proj = proj.raw_data();
    fp.ldp = P;
    fp.conv_w = L.gdn.conv1d.raw_data();
    fp.A_log = L.gdn.A_log.raw_data();
    fp.dt_bias = L.gdn.dt_bias.raw_data();
    fp.norm_w = L.gdn.norm.raw_data();
    fp.conv_state = dl->conv_state;
    fp.state = dl->gdn_state;
    fp.slots = ds->slots;
    fp.cu_seqlens = b.cu_seqlens.data<int32_t>();
    fp.num_seqs = b.num_seqs;
    fp.N = ds->real_tokens;
    fp.Hk = Hk, fp.Hv = Hv, fp.dk = dk, fp.dv = dv, fp.K = c.linear_conv_kernel_dim;
    fp.num_slots = ds->num_slots;
    fp.max_new = ds->max_new;
    fp.scale = 1.0f / std::sqrt(static_cast<float>(dk));
    fp.eps = static_cast<float>(c.rms_norm_eps);
    fp.update_state = ds->commit;
    if (!ds->commit) {  // what commit re-runs for the accepted tokens
      Tensor conv = device_bf16({N, C}, device_), q = device_bf16({N, Hk, dk}, device_), k = device_bf16({N, Hk, dk}, device_);
      Tensor g = Tensor::empty({N, Hv}, DType::F32, device_), beta = Tensor::empty({N, Hv}, DType::F32, device_);
      fp.conv_out = conv.raw_data(), fp.q = q.raw_data(), fp.k = k.raw_data(), fp.g = g.data<float>(), fp.beta = beta.data<float>();
      dl->proj = proj, dl->proj_ld = P, dl->conv = conv, dl->q = q, dl->k = k, dl->g = g, dl->beta = beta;
    }
    timed(ForwardOp::GdnFused, [&] { cuda::gdn_decode_fused(fp, stream_); });
    ds->counters->add(Step::ConvUpdate, Path::Fast);
    ds->counters->add(Step::DeltaRulePool, Path::Fast);
    project(ForwardOp::GdnOutProj, normed, V, {f.out}, out, H, N, f.out.fp8() ? &in : nullptr);
    if (tp_) timed(ForwardOp::AllReduce, [&] { tp_->all_reduce_sum(out); });
    return;
  }
  Tensor conv = device_bf16({N, C}, device_);
  // The conv update on the slots' conv states: the decode step's conv, and after a prefill the
  // state update from the prompts' last K-1 inputs (its outputs unused).
  auto conv_update = [&](const void* x, int64_t ldx, int64_t rows, const int32_t* cu, void* y, bool update) {
    const ConvUpdateCall call{x, ldx, y, ds->slots, cu, b.num_seqs, rows, ds->num_slots, update, ds->piece_from >= 0};
    timed(ForwardOp::GdnConv, [&] { run_conv_update(c, L, *dl, call, *ds->counters, stream_); });
  };
  if (ds && !ds->prefill) {
    conv_update(proj.raw_data(), P, ds->real_tokens, b.cu_seqlens.data<int32_t>(), conv.raw_data(), ds->commit);
  } else {
    cuda::ConvParams cp;
    cp.x = proj.raw_data();
    cp.ldx = P;
    cp.w = L.gdn.conv1d.raw_data();
    cp.y = conv.raw_data();
    cp.cu_seqlens = b.cu_seqlens.data<int32_t>();
    cp.num_seqs = b.num_seqs;
    cp.N = N;
    cp.C = C;
    cp.K = c.linear_conv_kernel_dim;
    cp.silu = true;
    const StepPlan& conv_step = lp.step(Step::Conv);
    timed(ForwardOp::GdnConv, [&] {
      if (conv_step.path == Path::Fast) cuda::causal_conv1d_fast(cp, stream_);
      else cuda::causal_conv1d_fallback(cp, stream_);
    });
    counters_.add(Step::Conv, conv_step.path);
    if (ds && prefill_.tail_rows > 0) {
      // Each prompt's last m = min(T, K-1) conv inputs (columns [0, C) of its rows of proj), packed
      // by one gather (cuda::embedding over chunks of the rows), then the conv update of those rows
      // on the slots' zero states: the states become [zeros; the m inputs], as after decode steps.
      const Prefill& pf = prefill_;
      timed(ForwardOp::GdnConv, [&] {
        cuda::embedding(pf.gather_ids, proj.raw_data(), pf.tails.raw_data(), pf.gather_rows, pf.chunk, stream_);
      });
      conv_update(pf.tails.raw_data(), C, pf.tail_rows, pf.tail_cu, pf.tails_y.raw_data(), true);
    }
  }

  Tensor q = device_bf16({N, Hk, dk}, device_), k = device_bf16({N, Hk, dk}, device_);
  Tensor g = Tensor::empty({N, Hv}, DType::F32, device_), beta = Tensor::empty({N, Hv}, DType::F32, device_);
  cuda::GdnPrepParams pp;
  pp.conv = conv.raw_data();
  pp.ld_conv = C;
  pp.b = col(C + V);
  pp.a = col(C + V + Hv);
  pp.ld_ab = P;
  pp.A_log = L.gdn.A_log.raw_data();
  pp.dt_bias = L.gdn.dt_bias.raw_data();
  pp.q = q.raw_data();
  pp.k = k.raw_data();
  pp.g = g.data<float>();
  pp.beta = beta.data<float>();
  pp.N = N;
  pp.Hk = Hk;
  pp.Hv = Hv;
  pp.dk = dk;
  pp.scale = 1.0f / std::sqrt(static_cast<float>(dk));
  timed(ForwardOp::GdnPrep, [&] { cuda::gdn_prep(pp, stream_); });

  Tensor core = device_bf16({N, Hv, dv}, device_);
  cuda::DeltaRuleParams dp;
  dp.q = q.raw_data();
  dp.k = k.raw_data();
  dp.v = static_cast<char*>(conv.raw_data()) + 2 * Hk * dk * 2;
  dp.ldv = C;
  dp.g = g.data<float>();
  dp.beta = beta.data<float>();
  dp.out = core.raw_data();
  dp.cu_seqlens = b.cu_seqlens.data<int32_t>();
  dp.num_seqs = b.num_seqs;
  dp.N = N;
  dp.Hk = Hk;
  dp.Hv = Hv;
  dp.dk = dk;
  dp.dv = dv;
  if (ds && !ds->prefill) {
    dp.N = ds->real_tokens;
    if (ds->piece_from >= 0 && ds->commit)
      timed(ForwardOp::DeltaRule, [&] { run_delta_rule_pieces(*dl, dp, *ds, lp.step(Step::DeltaRule), stream_); });
    else
      timed(ForwardOp::DeltaRule,
            [&] { run_delta_rule_pool(*dl, dp, ds->slots, ds->num_slots, ds->commit, *ds->counters, stream_); });
    if (!ds->commit) {  // what commit re-runs for the accepted tokens
      dl->proj = proj, dl->proj_ld = P, dl->conv = conv, dl->q = q, dl->k = k, dl->g = g, dl->beta = beta;
    }
  } else {
    // A prefill writes the state after each prompt into its slot: in place when the slots are
    // consecutive in batch order, else through a scratch copied per run of consecutive slots.
    const int64_t state_elems = Hv * dk * dv;
    if (ds)
      dp.final_state = prefill_.in_place ? dl->gdn_state + static_cast<int64_t>(prefill_.first_slot) * state_elems
                                         : prefill_.state.data<float>();
    timed(ForwardOp::DeltaRule, [&] { run_delta_rule(dp, lp.step(Step::DeltaRule), counters_, stream_); });
    if (ds && !prefill_.in_place)
      timed(ForwardOp::DeltaRule, [&] {
        for (const auto& [s0, count] : prefill_.runs)
          DFLASH_CUDA_CHECK(cudaMemcpyAsync(dl->gdn_state + static_cast<int64_t>(ds->host_slots[static_cast<size_t>(s0)]) * state_elems,
                                            prefill_.state.data<float>() + s0 * state_elems,
                                            static_cast<size_t>(count * state_elems) * sizeof(float),
                                            cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream_)));
      });
  }

  if (f.out.fp8() && dv % 128 == 0) {  // the norm writes out_proj's quantized input (fused)
    const Fp8Input in = alloc_input(N, V);
    timed(ForwardOp::GatedRmsNorm, [&] {
      cuda::gated_rms_norm_quant_fp8(core.raw_data(), col(C), P, L.gdn.norm.raw_data(), N, Hv, dv,
                                     static_cast<float>(c.rms_norm_eps), static_cast<uint8_t*>(in.q.raw_data()), V,
                                     in.scale.data<float>(), stream_);
    });
    project(ForwardOp::GdnOutProj, Tensor(), V, {f.out}, out, H, N, &in);
  } else {
    Tensor normed = device_bf16({N, V}, device_);
    timed(ForwardOp::GatedRmsNorm, [&] {
      cuda::gated_rms_norm(core.raw_data(), col(C), P, L.gdn.norm.raw_data(), normed.raw_data(), N, Hv, dv,
                           static_cast<float>(c.rms_norm_eps), stream_);
    });
    project(ForwardOp::GdnOutProj, normed, V, {f.out}, out, H, N);
  }
  if (tp_) timed(ForwardOp::AllReduce, [&] { tp_->all_reduce_sum(out); });
}

void run_conv_update(const TargetConfig& c, const LayerWeights& L, const DecodeLayer& dl, const ConvUpdateCall& call,
                     PathCounters& counters, void* stream) {
  cuda::ConvUpdateParams up;
  up.x = call.x;
  up.ldx = call.ldx;
  up.w = L.gdn.conv1d.raw_data();
  up.y = call.y;
  up.state = dl.conv_state;
  up.slots = call.slots;
  up.cu_seqlens = call.cu_seqlens;
  up.num_seqs = call.num_seqs;
  up.N = call.rows;
  up.C = c.gdn_conv_dim();
  up.K = c.linear_conv_kernel_dim;
  up.num_slots = call.num_slots;
  up.silu = true;
  up.update_state = call.update;
  const StepPlan& st = dl.plan->step(Step::ConvUpdate);
  if (st.path == Path::Fast && call.pieces) cuda::causal_conv1d_update_runs(up, stream);
  else if (st.path == Path::Fast) cuda::causal_conv1d_update_fast(up, stream);
  else cuda::causal_conv1d_update_fallback(up, stream);
  counters.add(Step::ConvUpdate, st.path);
}

void run_delta_rule_pool(const DecodeLayer& dl, const cuda::DeltaRuleParams& p, const int32_t* slots, int64_t num_slots,
                         bool update, PathCounters& counters, void* stream) {
  cuda::DeltaRulePoolParams pp;
  pp.q = p.q;
  pp.k = p.k;
  pp.v = p.v;
  pp.ldv = p.ldv;
  pp.g = p.g;
  pp.beta = p.beta;
  pp.state = dl.gdn_state;
  pp.slots = slots;
  pp.out = p.out;
  pp.cu_seqlens = p.cu_seqlens;
  pp.num_seqs = p.num_seqs;
  pp.N = p.N;
  pp.Hk = p.Hk;
  pp.Hv = p.Hv;
  pp.dk = p.dk;
  pp.dv = p.dv;
  pp.num_slots = num_slots;
  pp.update_state = update;
  const StepPlan& st = dl.plan->step(Step::DeltaRulePool);
  if (st.path == Path::Fast) cuda::gated_delta_rule_pool_fast(pp, stream);
  else cuda::gated_delta_rule_pool_fallback(pp, stream);
  counters.add(Step::DeltaRulePool, st.path);
}

void run_delta_rule(const cuda::DeltaRuleParams& p, const StepPlan& st, PathCounters& counters, void* stream) {
  if (st.path == Path::Fast) cuda::chunk_gated_delta_rule(p, stream);
  else cuda::recurrent_gated_delta_rule(p, stream);
  counters.add(Step::DeltaRule, st.path);
}

void run_delta_rule_pieces(const DecodeLayer& dl, const cuda::DeltaRuleParams& p, const DecodeStep& ds, const StepPlan& chunked,
                           void* stream) {
  const int64_t from = ds.piece_from, row0 = ds.piece_row0, P = p.num_seqs - from;
  DFLASH_CHECK(from >= 0 && P >= 1 && row0 >= 0 && row0 < p.N && static_cast<int64_t>(ds.host_slots.size()) == p.num_seqs,
               "CUDA decoder: a chunked-prefill step's pieces (sequences " << from << " .. " << p.num_seqs << ", from row "
                                                                         << row0 << " of " << p.N << ") do not fit the batch");
  if (from > 0) {  // the decode rows: one token each, on the pool
    cuda::DeltaRuleParams head = p;
    head.num_seqs = from;
    head.N = row0;
    run_delta_rule_pool(dl, head, ds.slots, ds.num_slots, true, *ds.counters, stream);
  }
  // The pieces: their slots' states copied out, the chunked kernel (or its recurrent fallback, as the
  // forward's plan says) over their rows, the final states copied back.
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t elems = p.Hv * p.dk * p.dv;
  const size_t bytes = static_cast<size_t>(elems) * sizeof(float);
  int index = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&index));
  const Device dev = Device::cuda(index);
  Tensor init = Tensor::empty({P, elems}, DType::F32, dev), fin = Tensor::empty({P, elems}, DType::F32, dev);
  for (int64_t j = 0; j < P; ++j)
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(init.data<float>() + j * elems,
                                      dl.gdn_state + static_cast<int64_t>(ds.host_slots[static_cast<size_t>(from + j)]) * elems,
                                      bytes, cudaMemcpyDeviceToDevice, s));
  cuda::DeltaRuleParams tail = p;
  tail.q = static_cast<const char*>(p.q) + row0 * p.Hk * p.dk * 2;
  tail.k = static_cast<const char*>(p.k) + row0 * p.Hk * p.dk * 2;
  tail.v = static_cast<const char*>(p.v) + row0 * p.ldv * 2;
  tail.g = p.g + row0 * p.Hv;
  tail.beta = p.beta + row0 * p.Hv;
  tail.out = static_cast<char*>(p.out) + row0 * p.Hv * p.dv * 2;
  tail.cu_seqlens = ds.piece_cu;
  tail.num_seqs = P;
  tail.N = p.N - row0;
  tail.initial_state = init.data<float>();
  tail.final_state = fin.data<float>();
  run_delta_rule(tail, chunked, *ds.counters, stream);
  for (int64_t j = 0; j < P; ++j)
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(dl.gdn_state + static_cast<int64_t>(ds.host_slots[static_cast<size_t>(from + j)]) * elems,
                                      fin.data<float>() + j * elems, bytes, cudaMemcpyDeviceToDevice, s));
}

void CudaTargetModel::attention_mixer(int64_t i, const Tensor& x, const CudaBatch& b, const LayerPlan& lp, Tensor& out,
                                      const Fp8Input* x_q) {
  const TargetConfig& c = config_;
  const LayerWeights& L = weights_.layers[static_cast<size_t>(i)];
  const Fused& f = fused_[static_cast<size_t>(i)];
  const int64_t N = b.num_tokens, H = c.hidden_size, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const int64_t d = c.head_dim, Q = c.attn_q_proj_rows(), P = f.rows;
  const bool gated = c.attn_output_gate;
  Tensor proj = device_bf16({gemm_rows(N), P}, device_);
  project(ForwardOp::AttnQkv, x, H, f.in_parts, proj, P, N, x_q);
  prefetch_next({f.out});
  char* base = static_cast<char*>(proj.raw_data());

  Tensor q = device_bf16({N, Hq, d}, device_);
  cuda::QkPrepParams qp;
  qp.q_in = base;
  qp.ldq = P;
  qp.hsq = gated ? 2 * d : d;
  qp.q_out = q.raw_data();
  qp.k = base + Q * 2;
  qp.ldk = P;
  qp.wq = L.attn.q_norm.raw_data();
  qp.wk = L.attn.k_norm.raw_data();
  qp.pos = b.pos.data<int32_t>();
  qp.N = N;
  qp.Hq = Hq;
  qp.Hkv = Hkv;
  qp.d = d;
  qp.rotary_dim = c.rotary_dim();
  qp.eps = static_cast<float>(c.rms_norm_eps);
  qp.theta = static_cast<float>(c.rope_theta);
  timed(ForwardOp::QkNormRope, [&] { cuda::qk_norm_rope(qp, stream_); });
  // The attention kernels read k (normed and rotated in place) and v where the projection left
  // them: rows P elements apart.
  Tensor attn = device_bf16({N, Hq, d}, device_);
  cuda::AttentionParams ap;
  ap.q = q.raw_data();
  ap.k = base + Q * 2;
  ap.v = base + (Q + Hkv * d) * 2;
  ap.ldk = P;
  ap.ldv = P;
  ap.out = attn.raw_data();
  ap.cu_seqlens = b.cu_seqlens.data<int32_t>();
  ap.num_seqs = b.num_seqs;
  ap.max_seqlen = b.max_seqlen;
  ap.N = N;
  ap.Hq = Hq;
  ap.Hkv = Hkv;
  ap.d = d;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(d));
  DecodeStep* ds = decode_;
  // A decode step's sequences [s0, s1) from row `row0` (their rows up to `rows`, cu_seqlens `cu` counted
  // from row0, at most `max_new` tokens each): the K / V append, then the attention over the cache.
  // A step with prompt pieces makes two calls (the decode rows, then the pieces; DecodeStep::piece_from).
  struct Part {
    int64_t s0, s1, row0, rows, max_new;
    const int32_t* cu;
    bool absolute_splits;
  };
  auto rows_at = [](const void* base, int64_t row0, int64_t ld) { return static_cast<const char*>(base) + row0 * ld * 2; };
  auto append = [&](const Part& pt) {
    DecodeLayer& dl = (*ds->layers)[static_cast<size_t>(i)];
    cuda::KvAppendParams kp;
    kp.k = rows_at(ap.k, pt.row0, P);
    kp.ldk = P;
    kp.v = rows_at(ap.v, pt.row0, P);
    kp.ldv = P;
    kp.k_cache = dl.k_cache;
    kp.v_cache = dl.v_cache;
    kp.slots = ds->slots + pt.s0;
    kp.past_len = ds->past_len + pt.s0;
    kp.cu_seqlens = pt.cu;
    kp.num_seqs = pt.s1 - pt.s0;
    kp.N = pt.rows;
    kp.Hkv = Hkv;
    kp.d = d;
    kp.max_len = ds->max_len;
    kp.num_slots = ds->num_slots;
    kp.max_new = pt.max_new;
    timed(ForwardOp::Attention, [&] { cuda::kv_cache_append(kp, stream_); });
  };
  auto attend = [&](const Part& pt) {
    DecodeLayer& dl = (*ds->layers)[static_cast<size_t>(i)];
    cuda::AttentionDecodeParams adp;
    adp.q = rows_at(ap.q, pt.row0, Hq * d);
    adp.k_cache = dl.k_cache;
    adp.v_cache = dl.v_cache;
    adp.out = const_cast<char*>(rows_at(ap.out, pt.row0, Hq * d));
    adp.slots = ds->slots + pt.s0;
    adp.past_len = ds->past_len + pt.s0;
    adp.cu_seqlens = pt.cu;
    adp.num_seqs = pt.s1 - pt.s0;
    adp.N = pt.rows;
    adp.Hq = Hq;
    adp.Hkv = Hkv;
    adp.d = d;
    adp.max_len = ds->max_len;
    adp.num_slots = ds->num_slots;
    adp.max_new = pt.max_new;
    adp.causal = true;
    adp.window = 0;
    adp.scale = ap.scale;
    adp.workspace = ds->attn_workspace;
    adp.workspace_bytes = ds->attn_workspace_bytes;
    // Decode and verify rows: absolute key splits (batch invariance); prompt pieces: splits for speed
    // (a prefill's values are not the decode steps' either way).
    adp.split_keys = pt.absolute_splits ? ds->split_keys : 0;
    adp.key_bound = pt.absolute_splits ? ds->key_bound : 0;
    const StepPlan& st = dl.plan->step(Step::AttentionDecode);
    timed(ForwardOp::Attention, [&] {
      if (st.path == Path::Fast) cuda::attention_decode_fast(adp, stream_);
      else cuda::attention_decode_fallback(adp, stream_);
    });
    ds->counters->add(Step::AttentionDecode, st.path);
  };
  std::vector<Part> parts;
  if (ds && !ds->prefill && ds->piece_from >= 0) {
    if (ds->piece_from > 0) parts.push_back({0, ds->piece_from, 0, ds->piece_row0, 1, ap.cu_seqlens, true});
    parts.push_back({ds->piece_from, b.num_seqs, ds->piece_row0, ds->real_tokens - ds->piece_row0, ds->piece_max_new,
                     ds->piece_cu, false});
  } else if (ds) {
    parts.push_back({0, b.num_seqs, 0, ds->real_tokens, ds->max_new, ap.cu_seqlens, true});
  }
  // The new K / V into the slots' caches (a verify's are overwritten by the next extend).
  for (const Part& pt : parts) append(pt);
  if (ds && !ds->prefill) {
    for (const Part& pt : parts) attend(pt);
  } else {
    const StepPlan& st = lp.step(Step::Attention);
    timed(ForwardOp::Attention, [&] {
      if (st.path == Path::Fast) cuda::flash_attention_fwd(ap, stream_);
      else cuda::attention_fallback(ap, stream_);
    });
    counters_.add(Step::Attention, st.path);
  }
  if (gated && f.out.fp8() && cuda::tuning::gate_quant != 0 && cuda::sigmoid_gate_quant_fp8_supported(P, 2 * d, Hq, d)) {
    // the gate writes o_proj's quantized input (fused)
    const Fp8Input in = alloc_input(N, Hq * d);
    timed(ForwardOp::SigmoidGate, [&] {
      cuda::sigmoid_gate_quant_fp8(attn.raw_data(), base + d * 2, P, 2 * d, N, Hq, d, static_cast<uint8_t*>(in.q.raw_data()),
                                   Hq * d, in.scale.data<float>(), stream_);
    });
    project(ForwardOp::AttnOProj, Tensor(), Hq * d, {f.out}, out, H, N, &in);
  } else {
    if (gated)
      timed(ForwardOp::SigmoidGate, [&] { cuda::sigmoid_gate(attn.raw_data(), base + d * 2, P, 2 * d, N, Hq, d, stream_); });
    project(ForwardOp::AttnOProj, attn, Hq * d, {f.out}, out, H, N);
  }
  if (tp_) timed(ForwardOp::AllReduce, [&] { tp_->all_reduce_sum(out); });
}

void CudaTargetModel::moe(int64_t i, const Tensor& x, Tensor& out) {
  // transformers' Qwen3_5MoeSparseMoeBlock (kernels/cuda/moe.h): router, top-k, permutation, the
  // routed experts (grouped GEMMs, or the per-expert gemm_bf16 fallback), the shared expert behind
  // its sigmoid gate, the weighted un-permute; out [N, H] bf16.
  const TargetConfig& c = config_;
  const LayerWeights& L = weights_.layers[static_cast<size_t>(i)];
  const Fused& f = fused_[static_cast<size_t>(i)];
  const int64_t N = x.size(0);
  // A decode / verify step of <= 16 rows (a T = 1 decode and a T <= 16 verify alike: their rows are
  // padded to 16) on the MoE decode kernels where the decode plan says (off by default: slower in a
  // measured decode); the rest on the grouped GEMMs (which read FP8 experts' codes too).
  static_assert(cuda::kMoeDecodeMaxRows == kMaxVerifyTokens, "the MoE decode kernels take every decode and verify step");
  const bool fp8_experts = L.moe.experts_gate_up_scale.defined();
  const bool step = decode_ && !decode_->prefill;  // a decode / verify step (not a prompt's prefill)
  const bool decode_kernels = step && decode_->fusion.moe_decode && N <= cuda::kMoeDecodeMaxRows;
  const cuda::MoeImpl impl = plan_.moe_fallback ? cuda::MoeImpl::Fallback
                             : decode_kernels   ? cuda::MoeImpl::Decode
                                                : cuda::MoeImpl::Grouped;
  if (impl == cuda::MoeImpl::Fallback) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    DFLASH_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream_), &st));
    DFLASH_CHECK_HINT(st == cudaStreamCaptureStatusNone,
                      "CUDA target model: the MoE fallback (moe_loop_gemm_bf16) reads the expert counts back to the "
                      "host and cannot run inside a CUDA graph",
                      "use kernels.moe: auto (the grouped GEMM), or decode with --no-cuda-graphs");
  }
  cuda::MoeBlockParams p;
  p.x = x.raw_data();
  p.N = N;
  p.H = c.hidden_size;
  p.E = c.num_experts;
  p.k = c.num_experts_per_tok;
  p.I = c.moe_intermediate_size;
  p.Is = c.shared_expert_intermediate_size;
  p.renormalize = c.norm_topk_prob;
  // Under tp / ep (tp.h) this rank holds its expert group's experts (a slice of each when tp > ep)
  // and a slice of the shared expert; the partial outputs join in the all-reduce below.
  const int64_t El = c.local_num_experts();
  p.expert_begin = expert_group() * El;
  p.local_experts = El;
  p.router = L.moe.router.raw_data();
  p.experts_gate_up = L.moe.experts_gate_up.raw_data();
  p.experts_down = L.moe.experts_down.raw_data();
  // A decode step's pad rows (after the real tokens) belong to no sequence: they are not routed, so
  // they read no expert weights.
  p.routed = step ? decode_->real_tokens : N;
  if (step && decode_->fusion.moe_wgmma) p.wgmma = 1;
  Tensor scratch;  // FP8 experts: their bf16 values where the kernels read bf16 (cuda::moe_fp8_scratch)
  if (fp8_experts) {
    p.experts_gate_up_scale = L.moe.experts_gate_up_scale.data<float>();
    p.experts_down_scale = L.moe.experts_down_scale.data<float>();
    if (cuda::moe_fp8_scratch(impl, p.routed * p.k, p.wgmma, device_.index)) {
      scratch = Tensor::empty({static_cast<int64_t>(cuda::moe_experts_scratch_bytes(El, p.I, p.H))}, DType::U8, device_);
      p.experts_scratch = scratch.raw_data();
    }
  }
  if (p.Is > 0) {
    p.shared_gate_up = f.shared_gate_up.w.raw_data();
    p.shared_down = L.moe.shared_down_proj.raw_data();
    p.shared_gate = L.moe.shared_expert_gate.raw_data();
  }
  p.out = out.raw_data();
  if (moe_io_) {
    MoeIo::Layer& io = moe_io_->layers[i];
    const ForwardOptions& o = *moe_io_->options;
    if (o.router_logits && o.router_logits->count(i)) {
      const Tensor& f = o.router_logits->at(i);
      DFLASH_CHECK(f.dtype() == DType::F32 && f.shape() == Shape({N, p.E}),
                   "CUDA target forward: forced router logits of layer " << i << " " << f.describe() << " are not [" << N
                                                                          << ", " << p.E << "] f32");
      io.forced = f.contiguous().to(device_);
      p.logits_in = io.forced.data<float>();
    }
    if (o.capture_routing) {
      io.experts = Tensor::empty({p.routed, p.k}, DType::I32, device_);
      io.weights = Tensor::empty({p.routed, p.k}, DType::F32, device_);
      io.logits = Tensor::empty({N, p.E}, DType::F32, device_);
      p.experts_out = io.experts.data<int32_t>();
      p.weights_out = io.weights.data<float>();
      p.logits_out = io.logits.data<float>();
    }
  }
  Tensor ws = Tensor::empty({static_cast<int64_t>(cuda::moe_workspace_bytes(N, p.H, p.E, p.k, p.I, p.Is, impl))},
                            DType::U8, device_);
  p.workspace = ws.raw_data();
  timed(ForwardOp::MoeBlock, [&] { cuda::moe_block(p, impl, device_.index); });
  if (tp_) timed(ForwardOp::AllReduce, [&] { tp_->all_reduce_sum(out); });  // the expert groups' and shared slices' partial sums
}

int64_t CudaTargetModel::expert_group() const {
  return tp_ ? TpShard{tp_->rank(), tp_->size(), static_cast<int>(config_.ep_size)}.expert_group() : 0;
}

void CudaTargetModel::mlp(int64_t i, const Tensor& x, Tensor& out, const Fp8Input* x_q) {
  const TargetConfig& c = config_;
  if (c.is_moe()) return moe(i, x, out);
  const Fused& f = fused_[static_cast<size_t>(i)];
  const int64_t N = x.size(0), H = c.hidden_size, I = c.intermediate_size;
  Tensor gu = device_bf16({gemm_rows(N), 2 * I}, device_);
  project(ForwardOp::MlpGateUp, x, H, f.gate_up, gu, 2 * I, N, x_q);
  prefetch_next({f.down});
  if (f.down.fp8()) {  // SwiGLU writes down_proj's quantized input (fused)
    const Fp8Input in = alloc_input(N, I);
    timed(ForwardOp::Swiglu, [&] {
      cuda::swiglu_quant_fp8(gu.raw_data(), N, I, static_cast<uint8_t*>(in.q.raw_data()), I, in.scale.data<float>(),
                             stream_);
    });
    project(ForwardOp::MlpDown, Tensor(), I, {f.down}, out, H, N, &in);
  } else if (skinny(f.down, N, 2 * I, H, true)) {  // SwiGLU as down_proj's prologue (a decode / verify step)
    project(ForwardOp::MlpDown, gu, 2 * I, {f.down}, out, H, N, nullptr, true);
  } else {
    Tensor act = device_bf16({N, I}, device_);
    timed(ForwardOp::Swiglu, [&] { cuda::swiglu(gu.raw_data(), act.raw_data(), N, I, stream_); });
    project(ForwardOp::MlpDown, act, I, {f.down}, out, H, N);
  }
  if (tp_) timed(ForwardOp::AllReduce, [&] { tp_->all_reduce_sum(out); });
}

void CudaTargetModel::add_norm(Tensor& h, const Tensor& delta, const Tensor* w, Tensor* y, int64_t N,
                               const std::vector<Proj>* parts, Fp8Input* q) {
  const int64_t H = config_.hidden_size;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  bool fp8_parts = false, bf16_parts = false;
  if (parts)
    for (const Proj& p : *parts) (p.fp8() ? fp8_parts : bf16_parts) = true;
  if (w && y && q && fp8_parts && cuda::tuning::add_norm_quant != 0 && cuda::add_rms_norm_quant_fp8_supported(H)) {
    *q = alloc_input(N, H);
    timed(ForwardOp::AddRmsNorm, [&] {
      cuda::add_rms_norm_quant_fp8(h.raw_data(), delta.raw_data(), w->raw_data(), bf16_parts ? y->raw_data() : nullptr, N,
                                   H, eps, static_cast<uint8_t*>(q->q.raw_data()), H, q->scale.data<float>(), stream_);
    });
    return;
  }
  timed(ForwardOp::AddRmsNorm, [&] {
    cuda::add_rms_norm(h.raw_data(), delta.raw_data(), w ? w->raw_data() : nullptr, w && y ? y->raw_data() : nullptr, N,
                       H, eps, stream_);
  });
}

void CudaTargetModel::layer_body(int64_t i, Tensor& h, Tensor& normed, const CudaBatch& b, const LayerPlan& lp,
                                 const Tensor* next_norm, Tensor* next_out, const Fp8Input* in_q, Fp8Input* next_q) {
  DFLASH_CHECK(i >= 0 && i < config_.num_hidden_layers, "run_layer: layer " << i << " out of range");
  DFLASH_CHECK(lp.type == config_.layer_types[static_cast<size_t>(i)], "run_layer: plan of the wrong layer type");
  const TargetConfig& c = config_;
  const LayerWeights& L = weights_.layers[static_cast<size_t>(i)];
  const int64_t N = b.num_tokens, H = c.hidden_size;
  Tensor delta = device_bf16({gemm_rows(N), H}, device_);  // the GEMMs' output rows (gemm_rows)
  if (L.type == LayerType::LinearAttention) gdn_mixer(i, normed, b, lp, delta, in_q);
  else attention_mixer(i, normed, b, lp, delta, in_q);
  if (!c.is_moe()) prefetch_next(fused_[static_cast<size_t>(i)].gate_up);  // (fetched under the residual step)
  Fp8Input mlp_q;
  add_norm(h, delta, &L.post_attention_layernorm, &normed, N, c.is_moe() ? nullptr : &fused_[static_cast<size_t>(i)].gate_up,
           &mlp_q);
  mlp(i, normed, delta, mlp_q.q.defined() ? &mlp_q : nullptr);
  if (i + 1 < c.num_hidden_layers) prefetch_next(fused_[static_cast<size_t>(i + 1)].in_parts);
  {  // the layer's projections ran on the gemm step's kernel (counted once per layer)
    const DecodeStep* ds = decode_;
    if (ds && !ds->prefill) {
      const DecodeLayer& dl = (*ds->layers)[static_cast<size_t>(i)];
      ds->counters->add(Step::Gemm, dl.plan->step(Step::Gemm).path);
    } else {
      counters_.add(Step::Gemm, lp.step(Step::Gemm).path);
    }
  }
  // The residual add, fused with the norm the next step needs (the next layer's input norm, or
  // the final norm after the last layer) when there is one, and with the next layer's input
  // quantization where next_q asks.
  add_norm(h, delta, next_norm, next_out, N, next_q ? &fused_[static_cast<size_t>(i + 1)].in_parts : nullptr, next_q);
}

void CudaTargetModel::run_layer(int64_t i, Tensor& h, const CudaBatch& b, const LayerPlan& lp) {
  DFLASH_CHECK(i >= 0 && i < config_.num_hidden_layers, "run_layer: layer " << i << " out of range");
  const int64_t N = b.num_tokens, H = config_.hidden_size;
  Tensor normed = device_bf16({N, H}, device_);
  timed(ForwardOp::InputNorm, [&] {
    cuda::rms_norm(h.raw_data(), H, weights_.layers[static_cast<size_t>(i)].input_layernorm.raw_data(),
                   normed.raw_data(), H, N, H, static_cast<float>(config_.rms_norm_eps), true, stream_);
  });
  layer_body(i, h, normed, b, lp, nullptr, nullptr);
}

ForwardResult CudaTargetModel::forward(const std::vector<std::vector<int32_t>>& sequences, const ForwardOptions& options) {
  return forward(make_batch(sequences), options);
}

void CudaTargetModel::begin_prefill(const CudaBatch& b) {
  const TargetConfig& c = config_;
  const DecodeStep& ds = *decode_;
  Prefill& pf = prefill_;
  pf = Prefill{};
  const int64_t S = b.num_seqs;
  DFLASH_CHECK(static_cast<int64_t>(ds.host_slots.size()) == S && S >= 1 && b.num_tokens == b.offsets.back(),
               "prefill: " << ds.host_slots.size() << " slots for " << S << " sequences (rows must not be padded)");
  pf.first_slot = ds.host_slots[0];
  for (int64_t s = 0; s < S; ++s) {
    const int32_t slot = ds.host_slots[static_cast<size_t>(s)];
    if (slot != pf.first_slot + s) pf.in_place = false;
    if (s > 0 && slot == ds.host_slots[static_cast<size_t>(s - 1)] + 1) ++pf.runs.back().second;
    else pf.runs.emplace_back(s, 1);
  }
  int64_t P = 0;  // the GatedDeltaNet in-projection's row length (the same in every such layer)
  for (int64_t i = 0; i < c.num_hidden_layers && P == 0; ++i)
    if (c.layer_types[static_cast<size_t>(i)] == LayerType::LinearAttention) P = fused_[static_cast<size_t>(i)].rows;
  if (P == 0) return;  // no GatedDeltaNet layer
  const int64_t C = c.gdn_conv_dim(), K1 = c.linear_conv_kernel_dim - 1;
  if (!pf.in_place)
    pf.state = Tensor::empty({S, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim}, DType::F32,
                             device_);
  // The tails' conv inputs, row r's columns [0, C) of proj: chunks r·P/w + j (j < C/w) of width
  // w = gcd(P, C), gathered packed [tail_rows, C].
  pf.chunk = std::gcd(P, C);
  const int64_t per_row = C / pf.chunk, row_chunks = P / pf.chunk;
  DFLASH_CHECK(b.num_tokens * row_chunks < INT32_MAX, "prefill: " << b.num_tokens << " tokens are too many to gather");
  std::vector<int32_t> host, cu{0};
  for (int64_t s = 0; s < S; ++s) {
    const int64_t end = b.offsets[static_cast<size_t>(s + 1)];
    const int64_t m = std::min(end - b.offsets[static_cast<size_t>(s)], K1);
    for (int64_t r = end - m; r < end; ++r)
      for (int64_t j = 0; j < per_row; ++j) host.push_back(static_cast<int32_t>(r * row_chunks + j));
    cu.push_back(cu.back() + static_cast<int32_t>(m));
  }
  pf.tail_rows = cu.back();
  if (pf.tail_rows == 0) return;
  pf.gather_rows = static_cast<int64_t>(host.size());
  host.insert(host.end(), cu.begin(), cu.end());
  pf.staging = Tensor::from_blob(host.data(), {static_cast<int64_t>(host.size())}, DType::I32).to(device_);
  pf.gather_ids = pf.staging.data<int32_t>();
  pf.tail_cu = pf.gather_ids + pf.gather_rows;
  pf.tails = device_bf16({pf.tail_rows, C}, device_);
  pf.tails_y = device_bf16({pf.tail_rows, C}, device_);
}

ForwardResult CudaTargetModel::forward(const CudaBatch& b, const ForwardOptions& options) {
  const TargetConfig& c = config_;
  for (int64_t id : options.capture)
    DFLASH_CHECK_HINT(id >= 0 && id < c.num_hidden_layers, "target forward: capture layer id " << id << " is out of range",
                      "layer ids are 0.." << c.num_hidden_layers - 1 << " (id i = output of decoder layer i)");
  struct DropPrefill {  // the prefill's scratch goes back to the allocator however the forward ends
    Prefill& pf;
    ~DropPrefill() { pf = Prefill{}; }
  } drop{prefill_};
  if (decode_ && decode_->prefill) begin_prefill(b);
  MoeIo moe_io;
  moe_io.options = &options;
  struct DropMoeIo {  // the blocks write into moe_io for this forward only
    MoeIo*& at;
    ~DropMoeIo() { at = nullptr; }
  } drop_io{moe_io_};
  if (c.is_moe() && (options.capture_routing || options.router_logits)) {
    DFLASH_CHECK(!decode_ || decode_->prefill, "CUDA target forward: capture_routing / router_logits in a decode step");
    moe_io_ = &moe_io;
  }
  ForwardResult r;
  r.offsets = b.offsets;
  const int64_t N = b.num_tokens, H = c.hidden_size;
  Tensor h = device_bf16({N, H}, device_), normed = device_bf16({N, H}, device_);
  timed(ForwardOp::Embedding,
        [&] { cuda::embedding(b.ids.data<int32_t>(), weights_.embed_tokens.raw_data(), h.raw_data(), N, H, stream_); });
  const float eps = static_cast<float>(c.rms_norm_eps);
  timed(ForwardOp::InputNorm, [&] {
    cuda::rms_norm(h.raw_data(), H, weights_.layers[0].input_layernorm.raw_data(), normed.raw_data(), H, N, H, eps,
                   true, stream_);
  });
  if (options.final_norm) r.final_hidden = device_bf16({N, H}, device_);
  // A decode step's prefill writes every layer's state: it runs the whole stack.
  const int64_t layers_run = decode_ ? c.num_hidden_layers : layers_to_run(c, options);
  Fp8Input cur_q, next_q;
  for (int64_t i = 0; i < layers_run; ++i) {
    // The residual add fuses the next layer's input norm; the last layer run (skip_unused_layers)
    // has none to prepare.
    const bool last = i + 1 == c.num_hidden_layers, stops = i + 1 == layers_run;
    const Tensor* next_norm = last    ? (options.final_norm ? &weights_.norm : nullptr)
                              : stops ? nullptr
                                      : &weights_.layers[static_cast<size_t>(i + 1)].input_layernorm;
    Tensor* next_out = last ? &r.final_hidden : &normed;
    // The next layer's input, quantized by this layer's residual step where its projections are FP8.
    next_q = Fp8Input{};
    layer_body(i, h, normed, b, plan_.layers[static_cast<size_t>(i)], next_norm, next_out,
               cur_q.q.defined() ? &cur_q : nullptr, !last && !stops ? &next_q : nullptr);
    cur_q = next_q;
    for (int64_t id : options.capture)
      if (id == i) {
        Tensor copy = device_bf16({N, H}, device_);
        timed(ForwardOp::CaptureCopy, [&] {
          DFLASH_CUDA_CHECK(cudaMemcpyAsync(copy.raw_data(), h.raw_data(), h.nbytes(), cudaMemcpyDeviceToDevice,
                                            static_cast<cudaStream_t>(stream_)));
        });
        r.layers[id] = copy;
      }
  }
  join_prefetch();
  if (options.capture_routing)
    for (auto& [i, io] : moe_io.layers)
      if (io.experts.defined())
        r.routing[i] = ops::MoeRouting{io.experts.to(Device::cpu()), io.weights.to(Device::cpu()), io.logits.to(Device::cpu())};
  return r;
}

}  // namespace dflash::target
