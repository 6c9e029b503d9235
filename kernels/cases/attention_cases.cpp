#include "kernels/cases/attention_cases.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "core/device.h"

namespace dflash::cases {

namespace {

const Device kGpu = Device::cuda(0);

std::string str(int64_t v) { return std::to_string(v); }
int sm_major() { return cuda_device_info(0).major; }
const char* bf16_at(const Tensor& t, int64_t elements) { return static_cast<const char*>(t.raw_data()) + 2 * elements; }

void flash_auto(const cuda::AttentionParams& p, cuda::Stream s) {
  cuda::AttentionParams a = p;
  a.impl = cuda::FlashImpl::Auto;
  cuda::flash_attention_fwd(a, s);
}
void flash_mma_sync(const cuda::AttentionParams& p, cuda::Stream s) {
  cuda::AttentionParams a = p;
  a.impl = cuda::FlashImpl::MmaSync;
  cuda::flash_attention_fwd(a, s);
}
void flash_wgmma(const cuda::AttentionParams& p, cuda::Stream s) {
  cuda::AttentionParams a = p;
  a.impl = cuda::FlashImpl::Wgmma;
  cuda::flash_attention_fwd(a, s);
}

}  // namespace

// ---- causal attention ----------------------------------------------------------------------------
// The names are kernel_bench's providers ("wgmma", "mma_sync").
const Variant<cuda::AttentionParams> kFlash{"flash", flash_auto};
const Variant<cuda::AttentionParams> kFlashMmaSync{"mma_sync", flash_mma_sync};
const Variant<cuda::AttentionParams> kFlashWgmma{"wgmma", flash_wgmma};
const Variant<cuda::AttentionParams> kAttentionFallback{"fallback", cuda::attention_fallback};

std::vector<const Variant<cuda::AttentionParams>*> attention_variants(int64_t d) {
  if (!cuda::flash_attention_supported(d, sm_major())) return {&kAttentionFallback};
  std::vector<const Variant<cuda::AttentionParams>*> v = {&kFlash, &kFlashMmaSync};
  if (cuda::flash_attention_wgmma_available(d, 0)) v.push_back(&kFlashWgmma);
  v.push_back(&kAttentionFallback);
  return v;
}

int64_t AttentionCase::N() const { return std::accumulate(lens.begin(), lens.end(), int64_t{0}); }
int64_t AttentionCase::max_len() const { return lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end()); }
float AttentionCase::scale() const { return scale_mult / std::sqrt(static_cast<float>(d)); }
double AttentionCase::flops() const {
  double pairs = 0;
  for (int64_t l : lens) pairs += 0.5 * static_cast<double>(l) * static_cast<double>(l + 1);
  return 4.0 * static_cast<double>(d * Hq) * pairs;
}
double AttentionCase::bytes() const { return static_cast<double>(N()) * static_cast<double>(2 * Hq + 2 * Hkv) * d * 2; }
std::string AttentionCase::describe() const {
  char s[64];
  std::snprintf(s, sizeof s, " scale=%g q_std=%g", scale(), q_std);
  return "d=" + str(d) + " Hq=" + str(Hq) + " Hkv=" + str(Hkv) + " lens=" + lens_str(lens) + s +
         (strided_kv ? " k/v strided ld " + str(ldkv()) : "");
}

AttentionData draw(const AttentionCase& c, uint64_t seed) {
  Draw d{seed};
  AttentionData data;
  data.seqs = offsets_of(c.lens);
  const int64_t N = c.N(), kv = c.Hkv * c.d;
  data.q = normal(d, {N, c.Hq, c.d}, DType::BF16, kGpu, c.q_std);
  data.k = normal(d, {N, c.Hkv, c.d}, DType::BF16, kGpu, 1.0f);
  data.v = normal(d, {N, c.Hkv, c.d}, DType::BF16, kGpu, 1.0f);
  if (c.strided_kv) {  // the same k / v in place in wider rows, the other columns NaN
    Tensor rows = poisoned({N, c.ldkv()}, DType::BF16, Device::cpu());
    rows.slice(1, 8, 8 + kv).copy_from(data.k.to(Device::cpu()).view({N, kv}));
    rows.slice(1, 8 + kv, 8 + 2 * kv).copy_from(data.v.to(Device::cpu()).view({N, kv}));
    data.kv_rows = rows.to(kGpu);
  }
  data.cu = device_i32(data.seqs.offsets);
  return data;
}

cuda::AttentionParams AttentionData::params(const AttentionCase& c, void* out) const {
  cuda::AttentionParams p;
  const int64_t kv = c.Hkv * c.d;
  p.q = q.raw_data();
  p.k = c.strided_kv ? bf16_at(kv_rows, 8) : k.raw_data();
  p.v = c.strided_kv ? bf16_at(kv_rows, 8 + kv) : v.raw_data();
  p.out = out;
  p.cu_seqlens = cu.data<int32_t>();
  p.num_seqs = seqs.num_sequences();
  p.max_seqlen = c.max_len();
  p.N = c.N();
  p.Hq = c.Hq;
  p.Hkv = c.Hkv;
  p.d = c.d;
  p.ldk = p.ldv = c.ldkv();
  p.scale = c.scale();
  return p;
}

Tensor AttentionData::reference(const AttentionCase& c) const {
  Tensor out = host_poisoned({c.N(), c.Hq, c.d});
  ops::causal_attention(host_f32(q), host_f32(k), host_f32(v), seqs, c.scale(), out);
  return out;
}

namespace {

const std::vector<std::vector<int64_t>> kSeqSets = {{1}, {63}, {64}, {65}, {130}, {1, 200, 17}, {3, 0, 70}};

}  // namespace

std::vector<AttentionCase> attention_sweep_cases(int64_t d) {
  std::vector<AttentionCase> cases;
  // Head ratios 1, 2, 3 and 6 (= Qwen3.6-27B's 24 / 4).
  for (auto [Hq, Hkv] : {std::pair<int64_t, int64_t>{2, 2}, {4, 2}, {6, 2}, {6, 1}})
    for (const auto& lens : kSeqSets) cases.push_back({"", lens, Hq, Hkv, d});
  return cases;
}

std::vector<AttentionCase> attention_peaky_cases() {
  // Logits with stddev ~8 and ~24: the running max must be subtracted correctly.
  std::vector<AttentionCase> cases;
  for (int64_t d : {64, 128, 256}) {
    cases.push_back({"", {130, 5}, 4, 2, d, 8.0f});
    cases.push_back({"", {97}, 2, 1, d, 8.0f, 3.0f});
  }
  return cases;
}

std::vector<AttentionCase> attention_odd_dim_cases() {
  // Head dims the flash kernel does not instantiate: the fallback covers any d.
  std::vector<AttentionCase> cases;
  for (int64_t d : {40, 96, 1, 33})
    for (const auto& lens : kSeqSets) cases.push_back({"", lens, 6, 2, d});
  return cases;
}

std::vector<AttentionCase> attention_long_cases() {
  // One long sequence (32 key tiles per query block at the end) and long packed batches.
  return {{"", {2048}, 2, 1, 256},        {"", {2048}, 4, 2, 128}, {"", {2048}, 6, 1, 64},
          {"", {700, 1, 1347}, 2, 2, 128}, {"", {1000, 129, 3000}, 6, 1, 256}};
}

std::vector<AttentionCase> attention_strided_cases() {
  std::vector<AttentionCase> cases;
  for (int64_t d : {64, 128, 256}) cases.push_back({"", {130, 1, 77}, 6, 2, d, 1.0f, 1.0f, true});
  return cases;
}

std::vector<AttentionCase> attention_perf_cases(bool quick) {
  std::vector<AttentionCase> cases = {{"", {2048}, 24, 4, 256}, {"", {8192}, 24, 4, 256},
                                      {"", std::vector<int64_t>(16, 512), 24, 4, 256}, {"", {8192}, 32, 8, 128}};
  if (quick) cases.resize(2);
  for (AttentionCase& c : cases) {
    const int64_t S = static_cast<int64_t>(c.lens.size());
    c.shape = std::string("T") + str(c.N()) + (S > 1 ? std::string(" (") + str(S) + " seqs)" : "") + " Hq" + str(c.Hq) +
              " Hkv" + str(c.Hkv) + " d" + str(c.d);
  }
  return cases;
}

// ---- KV-cache append + attention decode ----------------------------------------------------------
const Variant<cuda::AttentionDecodeParams> kDecodeAttentionFast{"fast", cuda::attention_decode_fast};
const Variant<cuda::AttentionDecodeParams> kDecodeAttentionFallback{"fallback", cuda::attention_decode_fallback};

int64_t DecodeAttentionCase::N() const { return std::accumulate(lens.begin(), lens.end(), int64_t{0}); }
int64_t DecodeAttentionCase::max_new() const {
  return lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end());
}
int64_t DecodeAttentionCase::max_len() const {
  int64_t L = 0;
  for (size_t s = 0; s < lens.size(); ++s) L = std::max(L, past[s] + lens[s]);
  return L + extra_len;
}
float DecodeAttentionCase::scale() const { return 1.0f / std::sqrt(static_cast<float>(d)); }
double DecodeAttentionCase::kv_bytes() const {
  double keys = 0;
  for (size_t s = 0; s < lens.size(); ++s) keys += static_cast<double>(past[s] + lens[s]);
  return 2.0 * keys * static_cast<double>(Hkv * d) * 2;
}
std::string DecodeAttentionCase::describe() const {
  return "Hq " + str(Hq) + " Hkv " + str(Hkv) + " d " + str(d) + " lens " + lens_str(lens) + " past " +
         lens_str(past) + (causal ? " causal" : " full") + " window " + str(window) +
         (split_keys > 0 ? " split_keys " + str(split_keys) : "");
}
bool DecodeAttentionCase::fast_ok() const { return cuda::attention_decode_fast_supported(d, sm_major()); }

DecodeAttentionData draw(const DecodeAttentionCase& c, uint64_t seed, int64_t sets) {
  Draw d{seed};
  DecodeAttentionData data;
  data.seqs = offsets_of(c.lens);
  data.layout = {c.S(), sets, c.spare};
  const int64_t N = c.N(), L = c.max_len();
  const Tensor rows = normal(d, {N, c.ld()}, DType::BF16, Device::cpu(), 1.0f);
  data.qkv = rows.to(kGpu);
  data.q = rows.slice(1, 0, c.Hq * c.d).contiguous().view({N, c.Hq, c.d}).to(kGpu);
  data.k_cache0 = normal(d, {data.layout.pool(), L, c.Hkv, c.d}, DType::BF16, kGpu, 1.0f);
  data.v_cache0 = normal(d, {data.layout.pool(), L, c.Hkv, c.d}, DType::BF16, kGpu, 1.0f);
  data.slots = device_i32(data.layout.all());
  data.past = device_i32(c.past);
  data.cu = device_i32(data.seqs.offsets);
  return data;
}

namespace {

// The pool fields KvAppendParams and AttentionDecodeParams share (slot set `set`).
template <class Params>
void fill_pool(const DecodeAttentionData& data, const DecodeAttentionCase& c, int64_t set, Params& p) {
  p.slots = data.slots.data<int32_t>() + set * data.layout.S;
  p.past_len = data.past.data<int32_t>();
  p.cu_seqlens = data.cu.data<int32_t>();
  p.num_seqs = data.layout.S;
  p.N = c.N();
  p.Hkv = c.Hkv;
  p.d = c.d;
  p.max_len = c.max_len();
  p.num_slots = data.layout.pool();
  p.max_new = c.max_new();
}

}  // namespace

cuda::KvAppendParams DecodeAttentionData::append_params(const DecodeAttentionCase& c, void* k_cache, void* v_cache,
                                                        int64_t set) const {
  cuda::KvAppendParams p;
  fill_pool(*this, c, set, p);
  p.k = bf16_at(qkv, c.Hq * c.d);
  p.ldk = c.ld();
  p.v = bf16_at(qkv, c.Hq * c.d + c.Hkv * c.d);
  p.ldv = c.ld();
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  return p;
}

cuda::AttentionDecodeParams DecodeAttentionData::params(const DecodeAttentionCase& c, const void* k_cache,
                                                        const void* v_cache, void* out, int64_t set, void* workspace,
                                                        size_t workspace_bytes) const {
  cuda::AttentionDecodeParams p;
  fill_pool(*this, c, set, p);
  p.q = q.raw_data();
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.out = out;
  p.Hq = c.Hq;
  p.causal = c.causal;
  p.window = c.window;
  p.scale = c.scale();
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  p.split_keys = c.split_keys;
  p.key_bound = c.split_keys > 0 ? c.max_len() - c.extra_len : 0;
  return p;
}

size_t DecodeAttentionData::workspace_bytes(const DecodeAttentionCase& c, int splits) const {
  if (splits < 0) return 0;
  const Knob knob(cuda::tuning::attn_decode_splits, splits);
  return cuda::attention_decode_workspace(params(c, k_cache0.raw_data(), v_cache0.raw_data(), nullptr));
}

DecodeAttentionData::Ref DecodeAttentionData::reference(const DecodeAttentionCase& c) const {
  const int64_t N = c.N(), q_cols = c.Hq * c.d, kv = c.Hkv * c.d;
  const Tensor rows = host_f32(qkv);
  const Tensor k = rows.slice(1, q_cols, q_cols + kv).contiguous().view({N, c.Hkv, c.d});
  const Tensor v = rows.slice(1, q_cols + kv, q_cols + 2 * kv).contiguous().view({N, c.Hkv, c.d});
  Ref r{host_f32(k_cache0), host_f32(v_cache0), host_poisoned({N, c.Hq, c.d})};
  const std::vector<int32_t> sl = layout.slots(0);
  ops::kv_cache_append(k, v, r.k_cache, r.v_cache, sl, c.past, seqs);
  ops::attention_decode(host_f32(q), r.k_cache, r.v_cache, sl, c.past, seqs, c.causal, c.window, c.scale(), r.out);
  return r;
}

std::vector<DecodeAttentionCase> decode_attention_check_cases() {
  struct Dims {
    int64_t Hq, Hkv, d;
    std::vector<int64_t> lens, past;
    bool causal;
    int64_t window;
  };
  std::vector<DecodeAttentionCase> cases;
  for (const Dims& x : {
           // Target (Hq 24, Hkv 4, d 256, causal): decode at contexts 1 / 63 / 1000+, verify T = 16, batches.
           Dims{24, 4, 256, {1}, {0}, true, 0}, Dims{24, 4, 256, {1}, {1029}, true, 0},
           Dims{24, 4, 256, {16}, {63}, true, 0}, Dims{24, 4, 256, {1, 1, 1}, {0, 63, 1000}, true, 0},
           Dims{24, 4, 256, {16, 5, 1, 16, 16, 16, 16, 16}, {1, 1000, 64, 7, 300, 2, 90, 513}, true, 0},
           // Drafter (Hq 32, Hkv 8, d 128): the block of 16 attends itself both ways and the context;
           // the sliding layer is causal with a window.
           Dims{32, 8, 128, {16}, {1000}, false, 0}, Dims{32, 8, 128, {16, 16, 16}, {0, 63, 1031}, false, 0},
           Dims{32, 8, 128, {16, 7}, {1000, 40}, true, 100}, Dims{32, 8, 128, {16}, {200}, false, 37},
           // GVA ratios 1, 2, 3; odd T; head dims 64 and 96 (fallback only).
           Dims{2, 2, 128, {7, 1}, {63, 1}, true, 0}, Dims{4, 2, 128, {3}, {64}, true, 0},
           Dims{6, 2, 128, {13, 2}, {129, 1000}, true, 0}, Dims{6, 2, 64, {5}, {70}, true, 3},
           Dims{3, 1, 96, {4, 2}, {10, 0}, true, 0},
           // More query rows than one CTA holds (T · group > 128): several row blocks per kv head.
           Dims{24, 4, 256, {40}, {100}, true, 0}})
    cases.push_back({"", x.lens, x.past, x.Hq, x.Hkv, x.d, x.causal, x.window});
  return cases;
}

DecodeAttentionCase decode_attention_perf_case(const std::string& model, int64_t B, int64_t T, int64_t ctx) {
  const bool target = model == "target";
  DecodeAttentionCase c{"", std::vector<int64_t>(static_cast<size_t>(B), T), std::vector<int64_t>(static_cast<size_t>(B), ctx - T),
                        target ? 24 : 32, target ? 4 : 8, target ? 256 : 128, target};
  c.spare = 0;
  c.extra_len = 0;
  c.shape = model + " B" + str(B) + " T" + str(T) + " ctx" + str(ctx) + " Hq" + str(c.Hq) + " Hkv" + str(c.Hkv) + " d" +
            str(c.d) + (c.causal ? "" : " full");
  return c;
}

}  // namespace dflash::cases
