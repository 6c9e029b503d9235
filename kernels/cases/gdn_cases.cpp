#include "kernels/cases/gdn_cases.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <tuple>

#include "core/device.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/norm.h"

namespace dflash::cases {

namespace {

const Device kGpu = Device::cuda(0);

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }
std::string str(int64_t v) { return std::to_string(v); }
int sm_major() { return cuda_device_info(0).major; }
const char* bf16_at(const Tensor& t, int64_t elements) { return static_cast<const char*>(t.raw_data()) + 2 * elements; }

Tokens draw_tokens(Draw& d, const TokenDraw& in, const std::vector<int64_t>& lens, int64_t Hk, int64_t Hv,
                   int64_t dk, int64_t dv) {
  Tokens t;
  t.seqs = offsets_of(lens);
  t.Hk = Hk, t.Hv = Hv, t.dk = dk, t.dv = dv;
  const int64_t N = t.seqs.total_tokens();
  if (in.normalized) {
    t.q = normalized_rows_bf16(d, {N, Hk, dk}, 1.0f / std::sqrt(static_cast<float>(dk)));
    t.k = normalized_rows_bf16(d, {N, Hk, dk}, 1.0f);
  } else {
    t.q = normal(d, {N, Hk, dk}, DType::BF16, kGpu, in.q_std);
    t.k = normal(d, {N, Hk, dk}, DType::BF16, kGpu, in.k_std);
  }
  t.v_col0 = in.v_col0;
  t.ldv = Hv * dv + in.v_extra;
  t.v_rows = normal(d, {N, t.ldv}, DType::BF16, kGpu, in.v_std);
  t.g = uniform(d, {N, Hv}, DType::F32, kGpu, in.g_lo, in.g_hi);
  t.beta = uniform(d, {N, Hv}, DType::F32, kGpu, in.beta_lo, in.beta_hi);
  t.cu = device_i32(t.seqs.offsets);
  return t;
}

// The per-token fields DeltaRuleParams and DeltaRulePoolParams share.
template <class Params>
void fill_tokens(const Tokens& t, Params& p) {
  p.q = t.q.raw_data();
  p.k = t.k.raw_data();
  p.v = t.v();
  p.ldv = t.ldv;
  p.g = t.g.data<float>();
  p.beta = t.beta.data<float>();
  p.cu_seqlens = t.cu.data<int32_t>();
  p.num_seqs = t.seqs.num_sequences();
  p.N = t.seqs.total_tokens();
  p.Hk = t.Hk;
  p.Hv = t.Hv;
  p.dk = t.dk;
  p.dv = t.dv;
}

}  // namespace

const void* Tokens::v() const { return bf16_at(v_rows, v_col0); }

ops::DeltaRuleParams Tokens::host() const {
  const int64_t N = seqs.total_tokens();
  ops::DeltaRuleParams p;
  p.q = host_f32(q);
  p.k = host_f32(k);
  p.v = host_f32(v_rows).slice(1, v_col0, v_col0 + Hv * dv).contiguous().view({N, Hv, dv});
  p.g = host_f32(g);
  p.beta = host_f32(beta);
  p.scale = 1.0f;  // q arrives scaled, q / k normalised (as gdn_prep leaves them)
  p.l2norm_qk = false;
  p.chunk_size = 64;
  return p;
}

// ---- causal_conv1d -------------------------------------------------------------------------------
const Variant<cuda::ConvParams> kConvFast{"fast", cuda::causal_conv1d_fast};
const Variant<cuda::ConvParams> kConvFallback{"fallback", cuda::causal_conv1d_fallback};

int64_t ConvCase::N() const { return sum(lens); }
double ConvCase::bytes() const {
  return 2.0 * static_cast<double>(N() * C) * 2 + static_cast<double>(C * K) * 2;
}
std::string ConvCase::describe() const {
  return "C " + str(C) + " K " + str(K) + " seqs " + lens_str(lens) + (silu ? " silu" : " linear") + " ldx " +
         str(row()) + " col0 " + str(col0);
}
bool ConvCase::fast_ok() const { return cuda::causal_conv1d_fast_supported(C, K) && row() % 8 == 0 && col0 % 8 == 0; }

ConvData draw(const ConvCase& c, uint64_t seed, int sets) {
  Draw d{seed};
  ConvData data;
  data.seqs = offsets_of(c.lens);
  for (int i = 0; i < sets; ++i) data.x.push_back(normal(d, {c.N(), c.row()}, DType::BF16, kGpu, 1.0f));
  data.w = normal(d, {c.C, c.K}, DType::BF16, kGpu, 0.5f);
  data.cu = device_i32(data.seqs.offsets);
  return data;
}

cuda::ConvParams ConvData::params(const ConvCase& c, void* y, int set, int64_t c0, int64_t width) const {
  cuda::ConvParams p;
  p.x = bf16_at(x[static_cast<size_t>(set)], c.col0 + c0);
  p.ldx = c.row();
  p.w = bf16_at(w, c0 * c.K);
  p.y = y;
  p.cu_seqlens = cu.data<int32_t>();
  p.num_seqs = seqs.num_sequences();
  p.N = c.N();
  p.C = width < 0 ? c.C : width;
  p.K = c.K;
  p.silu = c.silu;
  return p;
}

Tensor ConvData::reference(const ConvCase& c) const {
  Tensor y = host_poisoned({c.N(), c.C});
  ops::causal_conv1d(host_f32(x[0]).slice(1, c.col0, c.col0 + c.C).contiguous(), host_f32(w), seqs, c.silu, y);
  return y;
}

std::vector<ConvCase> conv_check_cases() {
  std::vector<ConvCase> cases;
  // Every channel count and kernel size over single, around-a-tile and mixed sequences, x the first
  // C columns of wider rows. Run lengths 1 and 3 (runs cross every boundary, odd batches), 8, 13 (a
  // partial load ring), 64, 200 (one run over all sequences).
  for (int64_t C : {8, 24, 160, 10240})
    for (const std::vector<int64_t>& lens : {std::vector<int64_t>{1}, {63, 64, 65}, {130, 1, 7}})
      for (int64_t K = 1; K <= 5; ++K)
        for (bool silu : {true, false})
          cases.push_back({"", lens, C, K, C + 24, 0, silu, {}, {0, 1, 3, 8, 13, 64, 200}});
  // Long runs through the load ring: sequences longer than a run and runs longer than a
  // sequence, an empty sequence.
  for (int64_t K = 1; K <= 4; ++K)
    cases.push_back({"", {300, 1, 0, 517, 20}, 160, K, 176, 0, true, {}, {0, 5, 6, 7, 8, 9, 40, 160, 299, 301, 1000}});
  // x at a 16-byte aligned column offset (the v part of [q|k|v]) for the fast path; odd C, odd
  // ldx and offsets for the fallback (the fast one must refuse them).
  for (auto [C, ldx, col0, K] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{64, 96, 16, 4}, {40, 48, 8, 3},
                                 {5, 7, 1, 4}, {13, 13, 0, 2}, {3, 10, 5, 6}})
    cases.push_back({"", {5, 40, 3}, C, K, ldx, col0, true, {}, {0}});
  return cases;
}

std::vector<ConvCase> conv_perf_cases(bool quick) {
  std::vector<ConvCase> cases;  // N separate streams of D channels vs one fused conv
  for (int64_t n : {2, 3, 4})
    for (int64_t T : {2048, 4096})
      for (int64_t D : {512, 1024})
        cases.push_back({str(n) + "x" + str(D) + " T" + str(T), {T}, n * D, 4, 0, 0, true,
                         std::vector<int64_t>(static_cast<size_t>(n), D)});
  if (quick) cases.resize(2);
  for (int64_t T : {2048, 8192})
    cases.push_back({"qwen3.6-27b q|k|v 2048+2048+6144 T" + str(T), {T}, 10240, 4, 0, 0, true, {2048, 2048, 6144}});
  return cases;
}

// ---- gdn_prep ----------------------------------------------------------------------------------
float PrepCase::scale() const { return 1.0f / std::sqrt(static_cast<float>(dk)); }
std::string PrepCase::describe() const {
  return "N " + str(N) + " Hk " + str(Hk) + " Hv " + str(Hv) + " dk " + str(dk) + " dv " + str(dv);
}

PrepData draw(const PrepCase& c, uint64_t seed) {
  Draw d{seed};
  PrepData data;
  data.conv = normal(d, {c.N, c.conv_dim()}, DType::BF16, kGpu, 0.7f);
  data.ab = normal(d, {c.N, c.ld_ab()}, DType::BF16, kGpu, 6.0f);  // wide spread: softplus' x > 20 branch too
  data.A_log = normal(d, {c.Hv}, DType::BF16, kGpu, 0.8f);
  data.dt_bias = normal(d, {c.Hv}, DType::BF16, kGpu, 1.0f);
  return data;
}

PrepOutputs PrepData::poisoned_outputs(const PrepCase& c) const {
  return {poisoned({c.N, c.Hk, c.dk}, DType::BF16, kGpu), poisoned({c.N, c.Hk, c.dk}, DType::BF16, kGpu),
          poisoned({c.N, c.Hv}, DType::F32, kGpu), poisoned({c.N, c.Hv}, DType::F32, kGpu)};
}

cuda::GdnPrepParams PrepData::params(const PrepCase& c, PrepOutputs& out) const {
  cuda::GdnPrepParams p;
  p.conv = conv.raw_data();
  p.ld_conv = c.conv_dim();
  p.a = ab.raw_data();
  p.b = bf16_at(ab, c.Hv + 3);
  p.ld_ab = c.ld_ab();
  p.A_log = A_log.raw_data();
  p.dt_bias = dt_bias.raw_data();
  p.q = out.q.raw_data();
  p.k = out.k.raw_data();
  p.g = out.g.data<float>();
  p.beta = out.beta.data<float>();
  p.N = c.N;
  p.Hk = c.Hk;
  p.Hv = c.Hv;
  p.dk = c.dk;
  p.scale = c.scale();
  return p;
}

PrepOutputs PrepData::reference(const PrepCase& c) const {
  const int64_t qk = c.Hk * c.dk;
  const Tensor x = host_f32(conv), ab_h = host_f32(ab);
  PrepOutputs r;
  r.q = x.slice(1, 0, qk).contiguous().view({c.N, c.Hk, c.dk});
  r.k = x.slice(1, qk, 2 * qk).contiguous().view({c.N, c.Hk, c.dk});
  ops::l2norm_inplace(r.q, 1e-6f);
  ops::l2norm_inplace(r.k, 1e-6f);
  for (int64_t i = 0; i < r.q.numel(); ++i) r.q.data<float>()[i] *= c.scale();
  r.g = host_poisoned({c.N, c.Hv});
  r.beta = host_poisoned({c.N, c.Hv});
  ops::gdn_gates(ab_h.slice(1, 0, c.Hv).contiguous(), ab_h.slice(1, c.Hv + 3, 2 * c.Hv + 3).contiguous(),
                 host_f32(A_log), host_f32(dt_bias), r.g, r.beta);
  return r;
}

std::vector<PrepCase> prep_check_cases() {
  struct Dims {
    int64_t N, Hk, ratio, dk, dv;
  };
  // dk 8..256 (multiple of 8) take the persistent ring kernel: lane groups of 1..32, idle lanes at
  // dk 24 and 200, groups past the last row, more gates than threads (N 300, Hk 1, Hv 4, dk 8: the
  // gate loop strides over the grid). dk 20 (scalar) and 264 (vector, a warp per row) the general one.
  std::vector<PrepCase> cases;
  for (const Dims& d : {Dims{1, 1, 1, 128, 128}, Dims{65, 2, 2, 128, 64}, Dims{63, 3, 3, 16, 24}, Dims{64, 2, 3, 20, 8},
                        Dims{7, 1, 2, 256, 16}, Dims{130, 16, 3, 128, 128}, Dims{300, 1, 4, 8, 8}, Dims{33, 2, 2, 24, 16},
                        Dims{21, 3, 2, 32, 8}, Dims{11, 2, 1, 64, 8}, Dims{9, 2, 2, 200, 8}, Dims{5, 2, 1, 264, 8}})
    cases.push_back({d.N, d.Hk, d.Hk * d.ratio, d.dk, d.dv});
  return cases;
}

// ---- chunk / recurrent delta rule ----------------------------------------------------------------
const Variant<cuda::DeltaRuleParams> kChunkFast{"chunk_fast", cuda::chunk_gated_delta_rule};
const Variant<cuda::DeltaRuleParams> kRecurrentFallback{"recurrent_fallback", cuda::recurrent_gated_delta_rule};

int64_t RuleCase::N() const { return sum(lens); }
double RuleCase::flops() const {
  return static_cast<double>(N()) * static_cast<double>(Hv) * (8.0 * 64 * dk + 6.0 * dk * dv);
}
double RuleCase::bytes() const {
  return static_cast<double>(N()) * (2.0 * Hk * dk * 2 + 2.0 * Hv * dv * 2 + 2.0 * Hv * 4);
}
std::string RuleCase::describe() const {
  char g[48];
  std::snprintf(g, sizeof g, " g [%g, %g]", in.g_lo, in.g_hi);
  return "seqs " + lens_str(lens) + " Hk " + str(Hk) + " Hv " + str(Hv) + " dk " + str(dk) + " dv " + str(dv) +
         (init ? " init" : "") + g + " v col0 " + str(in.v_col0) + " ldv+" + str(in.v_extra);
}
bool RuleCase::chunk_ok() const { return cuda::chunk_gated_delta_rule_supported(dk, dv, sm_major()); }

RuleData draw(const RuleCase& c, uint64_t seed) {
  Draw d{seed};
  RuleData data;
  data.t = draw_tokens(d, c.in, c.lens, c.Hk, c.Hv, c.dk, c.dv);
  if (c.init)
    data.init = normal(d, {data.t.seqs.num_sequences(), c.Hv, c.dk, c.dv}, DType::F32, kGpu, c.init_std);
  return data;
}

cuda::DeltaRuleParams RuleData::params(void* out, float* final_state) const {
  cuda::DeltaRuleParams p;
  fill_tokens(t, p);
  p.initial_state = init.defined() ? init.data<float>() : nullptr;
  p.final_state = final_state;
  p.out = out;
  return p;
}

RuleData::Ref RuleData::reference(ops::DeltaRuleAlgo algo) const {
  ops::DeltaRuleParams p = t.host();
  if (init.defined()) p.initial_state = host_f32(init);
  Ref r{host_poisoned({t.seqs.total_tokens(), t.Hv, t.dv}), host_poisoned({t.seqs.num_sequences(), t.Hv, t.dk, t.dv})};
  ops::gated_delta_rule(p, t.seqs, algo, r.out, &r.state);
  return r;
}

std::vector<RuleCase> rule_check_cases() {
  std::vector<RuleCase> cases;
  // The recurrent kernel's shapes (q/k normalised, v at column 8 of wider rows, g ~ U(-0.4,
  // -0.001), beta ~ U(0.02, 0.98), initial state N(0, 0.3)), each rows-per-thread variant.
  struct Dims {
    int64_t Hk, Hv, dk, dv;
    std::vector<int64_t> lens;
  };
  const std::vector<int> rows = {0, 8, 16, 32};
  for (bool init : {false, true})
    for (const Dims& d : {Dims{16, 48, 128, 128, {65}},  // the real shape
                          Dims{1, 1, 16, 24, {1}}, Dims{2, 4, 16, 24, {63, 64, 65}}, Dims{1, 3, 16, 24, {130, 1, 7}},
                          Dims{2, 2, 20, 24, {70}},  // dk % 8 != 0: scalar staging
                          Dims{1, 2, 256, 64, {33, 9}},
                          Dims{1, 1, 100, 7, {150}}})  // ragged dk, odd dv
      cases.push_back({"", d.lens, d.Hk, d.Hv, d.dk, d.dv, init, 0.3f, {}, rows});
  cases.push_back({"", {12}, 1, 1, 1024, 8, true, 0.3f, {}, {0}});       // the largest dk the recurrent kernel takes
  cases.push_back({"", {0, 5, 0}, 2, 2, 64, 64, true, 0.3f, {}, {0}});   // empty sequences keep their state
  // The chunked kernel's shapes: g ~ U(g_lo, 0) (fast decay -2, slow -0.05 / -0.002: long
  // memory), beta ~ U(0, 1), initial state N(0, 0.5), v contiguous or at column 8 of rows
  // ldv_extra longer; every chunk_gated_delta_rule_variant.
  struct Chunked {
    std::vector<int64_t> lens;
    int64_t Hk, Hv, dk, dv;
    bool init;
    float g_lo;
    int64_t ldv_extra;
  };
  for (const Chunked& c : {
           // Qwen3.6-27B heads: lengths around the chunk size, packed batches.
           Chunked{{1}, 16, 48, 128, 128, true, -2.0f, 0}, Chunked{{63}, 16, 48, 128, 128, false, -0.05f, 0},
           Chunked{{64}, 16, 48, 128, 128, true, -2.0f, 0}, Chunked{{65}, 16, 48, 128, 128, true, -0.05f, 0},
           Chunked{{130}, 16, 48, 128, 128, false, -2.0f, 0}, Chunked{{300}, 16, 48, 128, 128, true, -0.05f, 0},
           Chunked{{1, 64, 65, 200}, 16, 48, 128, 128, true, -2.0f, 136},
           Chunked{{1, 64, 65, 200}, 16, 48, 128, 128, false, -0.05f, 0},
           // Head ratios 1, 2, 3 with fewer heads, dk / dv = 64, an empty sequence, strided v rows.
           Chunked{{200}, 1, 1, 128, 128, true, -0.05f, 0}, Chunked{{130, 7}, 2, 4, 128, 128, false, -2.0f, 64},
           Chunked{{5, 0, 70}, 2, 6, 128, 128, true, -0.05f, 0}, Chunked{{63, 64, 129}, 2, 4, 64, 64, true, -0.05f, 0},
           Chunked{{100, 3}, 1, 3, 64, 128, true, -2.0f, 8}, Chunked{{77}, 3, 3, 128, 64, false, -0.05f, 0},
           Chunked{{1}, 1, 2, 64, 64, false, -2.0f, 0},
           // Long sequences with slow decay: the state carries information over many chunks.
           Chunked{{2000}, 1, 2, 128, 128, true, -0.05f, 0}, Chunked{{1500, 700}, 1, 2, 128, 128, true, -0.002f, 0}}) {
    TokenDraw in;
    in.v_col0 = c.ldv_extra > 0 ? 8 : 0;
    in.v_extra = c.ldv_extra;
    in.g_lo = c.g_lo, in.g_hi = 0.0f, in.beta_lo = 0.0f, in.beta_hi = 1.0f;
    cases.push_back({"", c.lens, c.Hk, c.Hv, c.dk, c.dv, c.init, 0.5f, in, {0}, {0, 8, 16, 64, 128}});
  }
  return cases;
}

std::vector<RuleCase> rule_perf_cases(bool quick) {
  std::vector<std::vector<int64_t>> lens = {{2048}, {4096}, {8192}, {32768}, std::vector<int64_t>(8, 1024)};
  if (quick) lens = {{2048}, {8192}};
  // q, k not normalised: N(0, 1/sqrt(d)) rows have a norm of ~1 (q also times 1/sqrt(d)).
  TokenDraw in;
  in.normalized = false;
  in.q_std = 1.0f / std::sqrt(128.0f) / std::sqrt(128.0f);
  in.k_std = 1.0f / std::sqrt(128.0f);
  in.v_col0 = 0, in.v_extra = 0;
  in.g_lo = -0.5f, in.g_hi = 0.0f, in.beta_lo = 0.0f, in.beta_hi = 1.0f;
  std::vector<RuleCase> cases;
  for (const auto& l : lens) {
    const int64_t N = sum(l);
    const std::string shape = std::string("T") + str(N) + (l.size() > 1 ? " (" + str(static_cast<int64_t>(l.size())) + " seqs)" : "");
    cases.push_back({shape, l, 16, 48, 128, 128, false, 0.0f, in});
  }
  return cases;
}

// ---- causal_conv1d_update ------------------------------------------------------------------------
const Variant<cuda::ConvUpdateParams> kConvUpdateFast{"fast", cuda::causal_conv1d_update_fast};
const Variant<cuda::ConvUpdateParams> kConvUpdateRuns{"runs", cuda::causal_conv1d_update_runs};
const Variant<cuda::ConvUpdateParams> kConvUpdateFallback{"fallback", cuda::causal_conv1d_update_fallback};

int64_t ConvUpdateCase::N() const { return sum(lens); }
double ConvUpdateCase::bytes() const {
  const int64_t B = static_cast<int64_t>(lens.size());
  return static_cast<double>(B * (K - 1) * C * 2 * 2 + N() * C * 2 * 2);
}
std::string ConvUpdateCase::describe() const {
  return "C " + str(C) + " K " + str(K) + " seqs " + lens_str(lens) + (update ? " update" : " verify") +
         (silu ? " silu" : " linear");
}
bool ConvUpdateCase::fast_ok() const { return cuda::causal_conv1d_update_fast_supported(C, K) && row() % 8 == 0; }

ConvUpdateData draw(const ConvUpdateCase& c, uint64_t seed, int64_t sets) {
  Draw d{seed};
  ConvUpdateData data;
  data.seqs = offsets_of(c.lens);
  data.layout = {data.seqs.num_sequences(), sets, c.spare};
  data.x = normal(d, {c.N(), c.row()}, DType::BF16, kGpu, 1.0f);
  data.w = normal(d, {c.C, c.K}, DType::BF16, kGpu, 0.5f);
  data.cu = device_i32(data.seqs.offsets);
  data.slots = device_i32(data.layout.all());
  data.state0 = normal(d, {data.layout.pool(), c.K - 1, c.C}, DType::BF16, kGpu, 1.0f);
  return data;
}

cuda::ConvUpdateParams ConvUpdateData::params(const ConvUpdateCase& c, void* y, void* state, int64_t set) const {
  cuda::ConvUpdateParams p;
  p.x = x.raw_data();
  p.ldx = c.row();
  p.w = w.raw_data();
  p.y = y;
  p.state = state;
  p.slots = slots.data<int32_t>() + set * layout.S;
  p.cu_seqlens = cu.data<int32_t>();
  p.num_seqs = layout.S;
  p.N = c.N();
  p.C = c.C;
  p.K = c.K;
  p.num_slots = layout.pool();
  p.silu = c.silu;
  p.update_state = c.update;
  return p;
}

ConvUpdateData::Ref ConvUpdateData::reference(const ConvUpdateCase& c) const {
  Ref r{host_poisoned({c.N(), c.C}), host_f32(state0)};
  ops::causal_conv1d_update(host_f32(x).slice(1, 0, c.C).contiguous(), host_f32(w), r.state, layout.slots(0), seqs,
                            c.silu, c.update, r.y);
  return r;
}

std::vector<ConvUpdateCase> conv_update_check_cases() {
  std::vector<ConvUpdateCase> cases;
  // Decode (T = 1, batches 1 and 8), verify (T up to 16), an empty sequence; both activations
  // across the two passes (update: SiLU, verify: linear).
  for (int64_t C : {8, 24, 160, 10240})
    for (const std::vector<int64_t>& lens :
         {std::vector<int64_t>{1}, std::vector<int64_t>(8, 1), {16, 1, 5, 2}, {0, 3}, {2, 9}})
      for (int64_t K = 1; K <= 5; ++K)
        for (bool update : {true, false}) cases.push_back({"", lens, C, K, C + 16, update, update, 3});
  // Chunked-prefill steps (decode rows, then prompt pieces: the runs kernel's case): pieces longer than
  // a run, a piece of one token after a longer one, an empty sequence, pieces shorter than K - 1.
  for (int64_t C : {24, 160, 10240})
    for (const std::vector<int64_t>& lens : {std::vector<int64_t>{1, 1, 300, 1}, {1, 2, 37, 0, 129}, {2, 1}})
      for (int64_t K = 1; K <= 4; ++K)
        for (bool update : {true, false}) cases.push_back({"", lens, C, K, C + 16, update, update, 2});
  return cases;
}

ConvUpdateCase conv_update_perf_case(int64_t B, int64_t T) {
  return {std::string("B") + str(B) + " T" + str(T) + " C10240 K4", std::vector<int64_t>(static_cast<size_t>(B), T), 10240, 4,
          16480, true, true, 0};
}

ConvUpdateCase conv_update_piece_perf_case(int64_t B, int64_t T) {
  ConvUpdateCase c = conv_update_perf_case(B - 1, 1);  // the same channels and row stride
  c.lens.push_back(T);
  c.shape = std::string("B") + str(B - 1) + " T1 + piece T" + str(T) + " C" + str(c.C) + " K" + str(c.K);
  return c;
}

// ---- gated_delta_rule_pool -----------------------------------------------------------------------
const Variant<cuda::DeltaRulePoolParams> kPoolFast{"fast", cuda::gated_delta_rule_pool_fast};
const Variant<cuda::DeltaRulePoolParams> kPoolFallback{"fallback", cuda::gated_delta_rule_pool_fallback};

int64_t PoolCase::N() const { return sum(lens); }
double PoolCase::state_bytes() const {
  return static_cast<double>(static_cast<int64_t>(lens.size()) * Hv * dk * dv * 4);
}
std::string PoolCase::describe() const {
  return "Hk " + str(Hk) + " Hv " + str(Hv) + " dk " + str(dk) + " dv " + str(dv) + " seqs " + lens_str(lens);
}
bool PoolCase::fast_ok() const { return cuda::gated_delta_rule_pool_fast_supported(dk, dv, sm_major()); }

PoolData draw(const PoolCase& c, uint64_t seed, int64_t sets) {
  Draw d{seed};
  PoolData data;
  data.t = draw_tokens(d, c.in, c.lens, c.Hk, c.Hv, c.dk, c.dv);
  data.layout = {data.t.seqs.num_sequences(), sets, c.spare};
  data.slots = device_i32(data.layout.all());
  data.pool0 = normal(d, {data.layout.pool(), c.Hv, c.dk, c.dv}, DType::F32, kGpu, c.state_std);
  return data;
}

cuda::DeltaRulePoolParams PoolData::params(float* state, void* out, bool update, int64_t set) const {
  cuda::DeltaRulePoolParams p;
  fill_tokens(t, p);
  p.state = state;
  p.slots = slots.data<int32_t>() + set * layout.S;
  p.out = out;
  p.num_slots = layout.pool();
  p.update_state = update;
  return p;
}

PoolData::Ref PoolData::reference(bool update) const {
  Ref r{host_poisoned({t.seqs.total_tokens(), t.Hv, t.dv}), host_f32(pool0)};
  ops::gated_delta_rule_pool(t.host(), t.seqs, r.pool, layout.slots(0), update, &r.out);
  return r;
}

std::vector<PoolCase> pool_check_cases() {
  struct Dims {
    int64_t Hk, Hv, dk, dv;
    std::vector<int64_t> lens;
  };
  std::vector<PoolCase> cases;
  for (const Dims& d : {Dims{16, 48, 128, 128, {1}},                          // Qwen3.6-27B, batch 1 decode
                        Dims{16, 48, 128, 128, std::vector<int64_t>(8, 1)},   // batch 8 decode
                        Dims{16, 48, 128, 128, {16, 16, 16}},                 // batch 3 verify T = 16
                        Dims{4, 4, 128, 128, {5, 1, 16, 7}},                  // GVA 1, odd T
                        Dims{4, 8, 128, 64, {3, 11}},                         // GVA 2, dv 64
                        Dims{2, 6, 64, 64, {3, 16, 1}},                       // GVA 3, dk 64
                        Dims{1, 2, 256, 32, {9, 2}},                          // dk 256
                        Dims{2, 2, 128, 128, {37, 2}},                        // T > 16: several staged chunks
                        Dims{2, 2, 64, 64, {0, 5, 0}},                        // empty sequences keep their state
                        Dims{1, 3, 20, 12, {4, 1}},                           // fallback only: dk 20, dv 12
                        Dims{1, 1, 100, 7, {6}}})                             // fallback only: ragged dims
    cases.push_back({"", d.lens, d.Hk, d.Hv, d.dk, d.dv, {}});
  return cases;
}

PoolCase pool_perf_case(int64_t B, int64_t T) {
  PoolCase c{std::string("B") + str(B) + " T" + str(T) + " Hk16 Hv48 d128", std::vector<int64_t>(static_cast<size_t>(B), T), 16, 48,
             128, 128, {}};
  c.in.normalized = false;
  c.in.q_std = 1.0f / 128.0f;
  c.in.k_std = 0.0884f;
  c.in.v_col0 = 0, c.in.v_extra = 0;
  c.in.g_lo = -0.5f, c.in.g_hi = 0.0f, c.in.beta_lo = 0.0f, c.in.beta_hi = 1.0f;
  c.state_std = 0.1f;
  c.spare = 0;
  return c;
}

// ---- gdn_decode_fused ----------------------------------------------------------------------------
int64_t ChainCase::N() const { return sum(lens); }
double ChainCase::bytes() const {
  const int64_t B = static_cast<int64_t>(lens.size());
  const double state = static_cast<double>(B * (Hv * dk * dv * 4 + (K - 1) * C() * 2));
  return (update ? 2.0 : 1.0) * state + static_cast<double>(N() * (C() + V() + 2 * Hv) * 2 + N() * V() * 2);
}
std::string ChainCase::describe() const {
  return "Hk " + str(Hk) + " Hv " + str(Hv) + " K " + str(K) + " seqs " + lens_str(lens) + (update ? " decode" : " verify") +
         (fp8_out ? " fp8 out" : "");
}
bool ChainCase::fused_ok() const { return cuda::gdn_decode_fused_supported(Hk, Hv, dk, dv, K); }

ChainData draw(const ChainCase& c, uint64_t seed, int64_t sets) {
  Draw d{seed};
  ChainData data;
  data.seqs = offsets_of(c.lens);
  data.layout = {data.seqs.num_sequences(), sets, c.spare};
  data.proj = normal(d, {c.N(), c.P()}, DType::BF16, kGpu, 1.0f);
  data.conv_w = normal(d, {c.C(), c.K}, DType::BF16, kGpu, 0.5f);
  data.A_log = uniform(d, {c.Hv}, DType::BF16, kGpu, -2.0f, 1.0f);
  data.dt_bias = normal(d, {c.Hv}, DType::BF16, kGpu, 0.5f);
  data.norm_w = normal(d, {c.dv}, DType::BF16, kGpu, 0.2f, 1.0f);
  data.conv_state0 = normal(d, {data.layout.pool(), c.K - 1, c.C()}, DType::BF16, kGpu, 1.0f);
  data.state0 = normal(d, {data.layout.pool(), c.Hv, c.dk, c.dv}, DType::F32, kGpu, 0.3f);
  data.cu = device_i32(data.seqs.offsets);
  data.slots = device_i32(data.layout.all());
  return data;
}

ChainData::Outputs ChainData::outputs(const ChainCase& c) const {
  Outputs o;
  const int64_t N = c.N();
  o.out = poisoned({N, c.V()}, DType::BF16, kGpu);
  o.conv_state = conv_state0.clone();
  o.state = state0.clone();
  o.conv = poisoned({N, c.C()}, DType::BF16, kGpu);
  o.q = poisoned({N, c.Hk, c.dk}, DType::BF16, kGpu);
  o.k = poisoned({N, c.Hk, c.dk}, DType::BF16, kGpu);
  o.g = poisoned({N, c.Hv}, DType::F32, kGpu);
  o.beta = poisoned({N, c.Hv}, DType::F32, kGpu);
  o.core = poisoned({N, c.Hv, c.dv}, DType::BF16, kGpu);
  if (c.fp8_out) {
    o.out_q = poisoned({c.rows(), c.V()}, DType::F8E4M3, kGpu);
    o.out_scale = poisoned({static_cast<int64_t>(cuda::fp8_act_scale_elems(c.rows(), c.V()))}, DType::F32, kGpu);
  }
  return o;
}

cuda::GdnDecodeFusedParams ChainData::fused_params(const ChainCase& c, Outputs& o, int64_t set) const {
  cuda::GdnDecodeFusedParams p;
  p.proj = proj.raw_data();
  p.ldp = c.P();
  p.conv_w = conv_w.raw_data();
  p.A_log = A_log.raw_data();
  p.dt_bias = dt_bias.raw_data();
  p.norm_w = norm_w.raw_data();
  p.conv_state = o.conv_state.raw_data();
  p.state = o.state.data<float>();
  p.slots = slots.data<int32_t>() + set * layout.S;
  p.cu_seqlens = cu.data<int32_t>();
  p.num_seqs = layout.S;
  p.N = c.N();
  p.Hk = c.Hk, p.Hv = c.Hv, p.dk = c.dk, p.dv = c.dv, p.K = c.K;
  p.num_slots = layout.pool();
  p.max_new = 0;
  for (int64_t l : c.lens) p.max_new = std::max(p.max_new, l);
  p.scale = 1.0f / std::sqrt(static_cast<float>(c.dk));
  p.eps = 1e-6f;
  p.update_state = c.update;
  if (c.fp8_out) {
    p.out_q = static_cast<uint8_t*>(o.out_q.raw_data());
    p.ldq = c.V();
    p.out_scale = o.out_scale.data<float>();
    p.rows = c.rows();
    p.lds = cuda::fp8_act_scale_ld(c.rows());
  } else {
    p.out = o.out.raw_data();
    p.ldo = c.V();
  }
  if (!c.update) {
    p.conv_out = o.conv.raw_data();
    p.q = o.q.raw_data();
    p.k = o.k.raw_data();
    p.g = o.g.data<float>();
    p.beta = o.beta.data<float>();
  }
  return p;
}

void ChainData::run_unfused(const ChainCase& c, Outputs& o, cuda::Stream s, int64_t set) const {
  const int64_t C = c.C(), V = c.V(), P = c.P(), N = c.N();
  cuda::ConvUpdateParams cu_p;
  cu_p.x = proj.raw_data();
  cu_p.ldx = P;
  cu_p.w = conv_w.raw_data();
  cu_p.y = o.conv.raw_data();
  cu_p.state = o.conv_state.raw_data();
  cu_p.slots = slots.data<int32_t>() + set * layout.S;
  cu_p.cu_seqlens = cu.data<int32_t>();
  cu_p.num_seqs = layout.S;
  cu_p.N = N;
  cu_p.C = C;
  cu_p.K = c.K;
  cu_p.num_slots = layout.pool();
  cu_p.silu = true;
  cu_p.update_state = c.update;
  cuda::causal_conv1d_update_fast(cu_p, s);
  cuda::GdnPrepParams pp;
  pp.conv = o.conv.raw_data();
  pp.ld_conv = C;
  pp.b = bf16_at(proj, C + V);
  pp.a = bf16_at(proj, C + V + c.Hv);
  pp.ld_ab = P;
  pp.A_log = A_log.raw_data();
  pp.dt_bias = dt_bias.raw_data();
  pp.q = o.q.raw_data();
  pp.k = o.k.raw_data();
  pp.g = o.g.data<float>();
  pp.beta = o.beta.data<float>();
  pp.N = N;
  pp.Hk = c.Hk;
  pp.Hv = c.Hv;
  pp.dk = c.dk;
  pp.scale = 1.0f / std::sqrt(static_cast<float>(c.dk));
  cuda::gdn_prep(pp, s);
  cuda::DeltaRulePoolParams dp;
  dp.q = o.q.raw_data();
  dp.k = o.k.raw_data();
  dp.v = bf16_at(o.conv, 2 * c.Hk * c.dk);
  dp.ldv = C;
  dp.g = o.g.data<float>();
  dp.beta = o.beta.data<float>();
  dp.state = o.state.data<float>();
  dp.slots = cu_p.slots;
  dp.out = o.core.raw_data();
  dp.cu_seqlens = cu.data<int32_t>();
  dp.num_seqs = layout.S;
  dp.N = N;
  dp.Hk = c.Hk, dp.Hv = c.Hv, dp.dk = c.dk, dp.dv = c.dv;
  dp.num_slots = layout.pool();
  dp.update_state = c.update;
  cuda::gated_delta_rule_pool_fast(dp, s);
  if (!c.fp8_out)
    cuda::gated_rms_norm(o.core.raw_data(), bf16_at(proj, C), P, norm_w.raw_data(), o.out.raw_data(), N, c.Hv, c.dv, 1e-6f, s);
  else
    cuda::gated_rms_norm_quant_fp8(o.core.raw_data(), bf16_at(proj, C), P, norm_w.raw_data(), N, c.Hv, c.dv, 1e-6f,
                                   static_cast<uint8_t*>(o.out_q.raw_data()), V, o.out_scale.data<float>(), s);
}

ChainData::Ref ChainData::reference(const ChainCase& c) const {
  const int64_t N = c.N(), C = c.C(), V = c.V(), Hk = c.Hk, Hv = c.Hv, dk = c.dk, dv = c.dv;
  auto round = [](const Tensor& t) { return t.to_dtype(DType::BF16).to_dtype(DType::F32); };
  Ref r{host_poisoned({N, V}), host_f32(conv_state0), host_f32(state0)};
  const Tensor x = host_f32(proj);
  Tensor y = host_poisoned({N, C});
  ops::causal_conv1d_update(x.slice(1, 0, C).contiguous(), host_f32(conv_w), r.conv_state, layout.slots(0), seqs, true,
                            c.update, y);
  y = round(y);  // the conv output as the GPU stores it (bf16)
  Tensor q = y.slice(1, 0, Hk * dk).contiguous().view({N, Hk, dk});
  Tensor k = y.slice(1, Hk * dk, 2 * Hk * dk).contiguous().view({N, Hk, dk});
  ops::l2norm_inplace(q);
  ops::l2norm_inplace(k);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int64_t i = 0; i < q.numel(); ++i) q.data<float>()[i] *= scale;
  ops::DeltaRuleParams dp;
  dp.q = round(q);
  dp.k = round(k);
  dp.v = y.slice(1, 2 * Hk * dk, C).contiguous().view({N, Hv, dv});
  dp.g = host_poisoned({N, Hv});
  dp.beta = host_poisoned({N, Hv});
  ops::gdn_gates(x.slice(1, C + V + Hv, C + V + 2 * Hv).contiguous(), x.slice(1, C + V, C + V + Hv).contiguous(),
                 host_f32(A_log), host_f32(dt_bias), dp.g, dp.beta);
  dp.scale = 1.0f;
  dp.l2norm_qk = false;
  Tensor core = host_poisoned({N, Hv, dv});
  ops::gated_delta_rule_pool(dp, seqs, r.state, layout.slots(0), c.update, &core);
  core = round(core);
  Tensor out = host_poisoned({N * Hv, dv});
  ops::gated_rms_norm(core.view({N * Hv, dv}), x.slice(1, C, C + V).contiguous().view({N * Hv, dv}), host_f32(norm_w), 1e-6f,
                      out);
  r.out = out.view({N, V});
  return r;
}

std::vector<ChainCase> chain_check_cases() {
  std::vector<ChainCase> cases;
  struct Dims {
    int64_t Hk, Hv, K;
    std::vector<int64_t> lens;
  };
  for (const Dims& d : {Dims{16, 48, 4, {1}},                         // Qwen3.6-27B, batch 1 decode
                        Dims{16, 48, 4, {16}},                        // its verify block
                        Dims{2, 6, 4, {1, 1, 1}},                     // the tests' real_dims, batch 3
                        Dims{2, 6, 4, {16, 2, 5}},                    // verify T = 16 / 2 / 5
                        Dims{4, 4, 4, {3, 1}},                        // GVA 1 (no cluster)
                        Dims{2, 4, 3, {2, 0, 7}},                     // K 3, an empty sequence
                        Dims{1, 8, 2, {1, 4}},                        // GVA 8 (the largest cluster), K 2
                        Dims{3, 6, 1, {2}}})                          // K 1 (no conv state)
    for (bool update : {true, false}) cases.push_back({"", d.lens, d.Hk, d.Hv, 128, 128, d.K, update, 2, 8});
  // FP8 out_proj input: the 27B decode (1 real row of 16) and verify, a ragged batch, GVA 8.
  for (const Dims& d : {Dims{16, 48, 4, {1}}, Dims{16, 48, 4, {16}}, Dims{2, 6, 4, {16, 2, 5}}, Dims{1, 8, 2, {1, 4}}})
    for (bool update : {true, false}) cases.push_back({"", d.lens, d.Hk, d.Hv, 128, 128, d.K, update, 2, 8, true});
  return cases;
}

ChainCase chain_perf_case(int64_t B, int64_t T, bool update) {
  return {std::string("B") + str(B) + " T" + str(T) + " Hk16 Hv48 d128 K4" + (update ? "" : " verify"),
          std::vector<int64_t>(static_cast<size_t>(B), T), 16, 48, 128, 128, 4, update, 0, 0};
}

}  // namespace dflash::cases
