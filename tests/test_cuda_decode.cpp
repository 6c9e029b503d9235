// CUDA decode / verify kernels (kernels/cuda/gdn_decode.cu, attention_decode.cu) against the f32
// CPU reference ops (kernels/cpu/decode.cpp): the conv update, the gated delta rule on a state
// pool and the KV-cache append + attention, fast and fallback, on fresh random bf16 inputs (the
// CPU gets the same rounded values in f32). Several sequences sit in permuted pool slots with
// unused slots between them, which must stay bit-identical, as must the whole pool when
// update_state is false; outputs (and the attention workspace) are poisoned with NaN first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cases/gdn_cases.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/conv.h"
#include "kernels/cuda/gdn.h"
#include "kernels/device.h"
#include "kernels/ops.h"
#include "kernels/random.h"
#include "test_util.h"

// Test/benchmark knob defined in attention_decode.cu (0 = the launcher's automatic choice); the GDN
// ones come with kernels/cases/gdn_cases.h.
namespace dflash::cuda::tuning {
extern int attn_decode_splits;
}  // namespace dflash::cuda::tuning

using namespace dflash;
using cases::host_f32;
using cases::Knob;

namespace {

uint64_t g_stream = 9000;

// Host f32 tensor of bf16-representable values.
Tensor randn_bf16(const Shape& s, float stddev = 1.0f) {
  Tensor t = Tensor::empty(s, DType::F32);
  fill_normal(t, {2031, g_stream++, 0}, 0.0f, stddev);
  return t.to_dtype(DType::BF16).to_dtype(DType::F32);
}
Tensor randn_f32(const Shape& s, float stddev) {
  Tensor t = Tensor::empty(s, DType::F32);
  fill_normal(t, {2031, g_stream++, 0}, 0.0f, stddev);
  return t;
}
Tensor to_gpu_bf16(const Tensor& host_f32) { return host_f32.contiguous().to_dtype(DType::BF16).to(Device::cuda(0)); }
Tensor gpu_out(const Shape& s, DType dt) {
  Tensor t = Tensor::empty(s, dt, Device::cuda(0));
  poison(t);
  return t;
}
Tensor cpu_out(const Shape& s) {
  Tensor t = Tensor::empty(s, DType::F32);
  poison(t);
  return t;
}
bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

ops::SeqOffsets offsets_of(const std::vector<int64_t>& lens) {
  ops::SeqOffsets s{{0}};
  for (int64_t l : lens) s.offsets.push_back(s.offsets.back() + l);
  return s;
}
Tensor i32_gpu(const std::vector<int64_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I32);
  for (size_t i = 0; i < v.size(); ++i) t.data<int32_t>()[i] = static_cast<int32_t>(v[i]);
  return t.to(Device::cuda(0));
}
Tensor cu_seqlens_gpu(const ops::SeqOffsets& s) { return i32_gpu(s.offsets); }
cuda::Stream stream0() { return DeviceContext::get(0).stream(); }
const int32_t* i32(const Tensor& t) { return static_cast<const int32_t*>(t.raw_data()); }
void* at_bf16(const Tensor& t, int64_t off) { return static_cast<uint16_t*>(t.raw_data()) + off; }
int sm_major() { return cuda_device_info(0).major; }

std::string lens_str(const std::vector<int64_t>& lens) {
  std::string s = "{";
  for (size_t i = 0; i < lens.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(lens[i]);
  }
  s += '}';
  return s;
}

// Pool slots of S sequences in a pool of S + 3: a permutation with unused slots between them.
std::vector<int32_t> slots_for(int64_t S) { return cases::SlotLayout{S, 1, 3}.slots(0); }
Tensor slots_gpu(const std::vector<int32_t>& slots) {
  return i32_gpu(std::vector<int64_t>(slots.begin(), slots.end()));
}

// A launcher pair under test: fast and fallback of one op, and a check that either rejects the
// parameters `p` changed by `mutate`.
template <class Params>
struct Launchers {
  void (*fast)(const Params&, cuda::Stream);
  void (*fallback)(const Params&, cuda::Stream);
  Params p;
  template <class Mutate>
  void rejects(Mutate mutate, bool on_fast) const {
    Params q = p;
    mutate(q);
    EXPECT_THROW((on_fast ? fast : fallback)(q, stream0()), Error);
  }
};

}  // namespace

// ---- conv update ---------------------------------------------------------------------------------
// Bounds (ConvUpdateCase) as causal_conv1d's (test_cuda_gdn.cpp): f32 taps in the reference's
// order, one bf16 rounding: 1e-2. The new state is a copy of bf16 inputs: exact, over the whole
// pool (updated slots as the reference, the others, and all when verifying, untouched). Fast and
// fallback use the same fmaf order: equal bit for bit.
TEST(CudaDecode, ConvUpdateFastAndFallbackMatchCpu) {
  DFLASH_REQUIRE_GPU();
  double worst_fast = 0, worst_fb = 0;
  uint64_t seed = 9000;
  for (const cases::ConvUpdateCase& c : cases::conv_update_check_cases()) {
    SCOPED_TRACE(c.describe());
    const cases::ConvUpdateData data = cases::draw(c, seed++);
    const cases::ConvUpdateData::Ref ref = data.reference(c);
    auto run = [&](const cases::Variant<cuda::ConvUpdateParams>& v, Tensor& y, Tensor& st) {
      y = gpu_out({c.N(), c.C}, DType::BF16);
      st = data.state0.clone();
      v.launch(data.params(c, y.raw_data(), st.raw_data()), stream0());
    };
    Tensor yfb, sfb;
    run(cases::kConvUpdateFallback, yfb, sfb);
    const double efb = max_rel_err(yfb, ref.y);
    worst_fb = std::max(worst_fb, efb);
    EXPECT_LT(efb, c.y_bound) << "fallback";
    EXPECT_EQ(max_rel_err(sfb, ref.state), 0.0) << "fallback state";
    ASSERT_EQ(cuda::causal_conv1d_update_fast_supported(c.C, c.K), c.K <= 4);
    if (!c.fast_ok()) continue;
    Tensor yf, sf;
    run(cases::kConvUpdateFast, yf, sf);
    const double ef = max_rel_err(yf, ref.y);
    worst_fast = std::max(worst_fast, ef);
    EXPECT_LT(ef, c.y_bound) << "fast";
    EXPECT_EQ(max_rel_err(yf, yfb), 0.0) << "fast vs fallback";
    EXPECT_EQ(max_rel_err(sf, ref.state), 0.0) << "fast state";
  }
  std::printf("causal_conv1d_update: worst normalised error vs CPU: fast %.3g, fallback %.3g\n", worst_fast, worst_fb);
}

TEST(CudaDecode, ConvUpdateRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  // One sequence of 4 tokens in slot 1 of a pool of 2.
  const cases::ConvUpdateCase c{"", {4}, 64, 4, 0, true, true, 1};
  const cases::ConvUpdateData data = cases::draw(c, 1);
  Tensor y = Tensor::empty({4, 64}, DType::BF16, Device::cuda(0)), st = data.state0.clone();
  const cuda::ConvUpdateParams p = data.params(c, y.raw_data(), st.raw_data());
  EXPECT_NO_THROW(cuda::causal_conv1d_update_fast(p, stream0()));
  const Launchers<cuda::ConvUpdateParams> op{cuda::causal_conv1d_update_fast, cuda::causal_conv1d_update_fallback, p};
  op.rejects([](cuda::ConvUpdateParams& q) { q.K = 5; }, true);
  op.rejects([](cuda::ConvUpdateParams& q) { q.C = 60; }, true);
  op.rejects([](cuda::ConvUpdateParams& q) { q.ldx = 60; q.C = 56; }, true);        // rows not 16-byte aligned
  op.rejects([&](cuda::ConvUpdateParams& q) { q.x = at_bf16(data.x, 1); q.C = 56; }, true);  // misaligned pointer
  op.rejects([](cuda::ConvUpdateParams& q) { q.ldx = 32; }, false);                 // ldx < C
  op.rejects([](cuda::ConvUpdateParams& q) { q.num_slots = 0; }, false);
  op.rejects([](cuda::ConvUpdateParams& q) { q.K = 0; }, false);
  op.rejects([](cuda::ConvUpdateParams& q) { q.state = nullptr; }, false);
  EXPECT_STREQ(cuda::causal_conv1d_update_kernel_name(10240, 4), "vec8");
  EXPECT_STREQ(cuda::causal_conv1d_update_kernel_name(10240, 5), "fallback");
  DeviceContext::get(0).synchronize();
}

// ---- gated delta rule on a state pool --------------------------------------------------------------
// q / k as gdn_prep leaves them (l2-normalised, q scaled, bf16); the CPU runs them with l2norm_qk =
// false, scale 1. Bounds (PoolCase) as the recurrent kernel's (test_cuda_delta_rule.cpp): outputs
// rounded once to bf16, 2e-2; the fp32 state 1e-3 (different summation order). Slots of sequences
// without tokens, unused slots, and every slot when verifying stay bit-identical.
namespace {

void check_pool(const cases::PoolCase& c, uint64_t seed, double* worst_out, double* worst_state) {
  SCOPED_TRACE(c.describe());
  const cases::PoolData data = cases::draw(c, seed);
  const int64_t N = c.N(), S = data.layout.S;
  const std::vector<int32_t> slots = data.layout.slots(0);
  const Tensor pool0 = host_f32(data.pool0);
  for (bool update : {true, false}) {
    const cases::PoolData::Ref ref = data.reference(update);
    // {-1, -1}: the fallback; else the fast kernel with {warps per CTA, column groups per warp}
    // (0 = automatic).
    std::vector<std::pair<int, int>> variants = {{-1, -1}};
    if (c.fast_ok()) variants.insert(variants.end(), c.fast_knobs.begin(), c.fast_knobs.end());
    for (auto [warps, cg] : variants) {
      for (bool with_out : {true, false}) {
        if (!with_out && warps > 0) continue;
        Knob knob_w(cuda::tuning::gdn_pool_warps, std::max(warps, 0));
        Knob knob_cg(cuda::tuning::gdn_pool_cg, std::max(cg, 0));
        Tensor out = gpu_out({N, c.Hv, c.dv}, DType::BF16), pool = data.pool0.clone();
        (warps < 0 ? cases::kPoolFallback : cases::kPoolFast)
            .launch(data.params(pool.data<float>(), with_out ? out.raw_data() : nullptr, update), stream0());
        const std::string what = std::string(warps < 0 ? "fallback"
                                                       : "fast warps " + std::to_string(warps) + " cg " + std::to_string(cg)) +
                                 (update ? " update" : " verify") + (with_out ? "" : " no out");
        const Tensor pool_h = pool.to(Device::cpu());
        if (with_out) {
          const double eo = max_rel_err(out, ref.out);
          EXPECT_LT(eo, c.out_bound) << "out " << what;
          *worst_out = std::max(*worst_out, eo);
        } else {
          EXPECT_TRUE(std::isnan(host_f32(out).item_at(0)) || N == 0) << "out written although null " << what;
        }
        for (int64_t s = 0; s < S; ++s) {
          const Tensor got = pool_h.select(slots[s]).contiguous(), want = ref.pool.select(slots[s]).contiguous();
          if (update && c.lens[s] > 0) {
            const double es = max_rel_err(got, want);
            EXPECT_LT(es, c.state_bound) << "state of seq " << s << " " << what;
            *worst_state = std::max(*worst_state, es);
          } else {
            EXPECT_TRUE(bit_equal(got, pool0.select(slots[s]).contiguous())) << "slot of seq " << s << " changed " << what;
          }
        }
        for (int32_t u : data.layout.unused(0))
          EXPECT_TRUE(bit_equal(pool_h.select(u).contiguous(), pool0.select(u).contiguous()))
              << "unused slot " << u << " changed " << what;
      }
    }
  }
}

}  // namespace

// The table's cases: Qwen3.6-27B decode at batch 1 and 8, verify T = 16, GVA ratios 1..3, dv 64,
// dk 64 / 256, T > 16 (several staged chunks), empty sequences, and dims only the fallback takes.
TEST(CudaDecode, DeltaRulePoolFastAndFallbackMatchCpu) {
  DFLASH_REQUIRE_GPU();
  double wo = 0, ws = 0;
  uint64_t seed = 9500;
  for (const cases::PoolCase& c : cases::pool_check_cases()) check_pool(c, seed++, &wo, &ws);
  std::printf("gated_delta_rule_pool: worst normalised error vs CPU: out %.3g, state %.3g\n", wo, ws);
}

TEST(CudaDecode, DeltaRulePoolRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  const Tensor cu = cu_seqlens_gpu(offsets_of({0})), sl = slots_gpu({0});
  Tensor pool = Tensor::zeros({1, 2, 128, 128}, DType::F32, Device::cuda(0));
  cuda::DeltaRulePoolParams p;
  p.state = pool.data<float>();
  p.slots = i32(sl);
  p.cu_seqlens = i32(cu);
  p.num_seqs = 1;
  p.Hk = 1;
  p.Hv = 2;
  p.dk = 128;
  p.dv = 128;
  p.ldv = 256;
  p.num_slots = 1;
  EXPECT_NO_THROW(cuda::gated_delta_rule_pool_fast(p, stream0()));
  EXPECT_NO_THROW(cuda::gated_delta_rule_pool_fallback(p, stream0()));
  const Launchers<cuda::DeltaRulePoolParams> op{cuda::gated_delta_rule_pool_fast, cuda::gated_delta_rule_pool_fallback, p};
  op.rejects([](cuda::DeltaRulePoolParams& q) { q.dk = 96; }, true);
  op.rejects([](cuda::DeltaRulePoolParams& q) { q.dv = 12; q.ldv = 24; }, true);
  op.rejects([](cuda::DeltaRulePoolParams& q) { q.Hk = 2; q.Hv = 3; }, false);
  op.rejects([](cuda::DeltaRulePoolParams& q) { q.dk = 2048; }, false);
  op.rejects([](cuda::DeltaRulePoolParams& q) { q.num_slots = 0; }, false);
  op.rejects([](cuda::DeltaRulePoolParams& q) { q.N = 3; }, false);      // null q / k / v / g / beta
  EXPECT_TRUE(cuda::gated_delta_rule_pool_fast_supported(128, 128, 9));
  EXPECT_TRUE(cuda::gated_delta_rule_pool_fast_supported(64, 64, 8));
  EXPECT_FALSE(cuda::gated_delta_rule_pool_fast_supported(128, 128, 7));
  EXPECT_STREQ(cuda::gated_delta_rule_pool_kernel_name(128, 128, 9), "register-resident");
  EXPECT_STREQ(cuda::gated_delta_rule_pool_kernel_name(20, 12, 9), "fallback");
  DeviceContext::get(0).synchronize();
}

// ---- KV cache append and attention over it -----------------------------------------------------------
// Append: bf16 copies, exact; the rest of the cache (other positions, unused slots) unchanged.
// Attention: bf16 q / K / V, fp32 softmax, P rounded to bf16 for P·V (fast), one bf16 rounding of
// the output: 2e-2 normalised, as the prefill flash kernels.
namespace {

struct AttnCase {
  int64_t Hq, Hkv, d;
  std::vector<int64_t> lens, past;
  bool causal;
  int64_t window;
};

void check_attention(const AttnCase& c, double* worst_fast, double* worst_fb) {
  const ops::SeqOffsets seqs = offsets_of(c.lens);
  const int64_t N = seqs.total_tokens(), S = seqs.num_sequences(), P = S + 3, row = c.Hkv * c.d;
  int64_t L = 0, max_new = 0;
  for (int64_t s = 0; s < S; ++s) {
    L = std::max(L, c.past[s] + c.lens[s]);
    max_new = std::max(max_new, c.lens[s]);
  }
  L += 5;  // capacity past the longest sequence
  const std::vector<int32_t> slots = slots_for(S);
  // The new k / v: columns of a fused [q | k | v] row (ldk = ldv = Hq·d + 2·Hkv·d).
  const int64_t ld = c.Hq * c.d + 2 * row;
  const Tensor qkv = randn_bf16({N, ld});
  const Tensor q = qkv.slice(1, 0, c.Hq * c.d).contiguous().view({N, c.Hq, c.d});
  const Tensor k = qkv.slice(1, c.Hq * c.d, c.Hq * c.d + row).contiguous().view({N, c.Hkv, c.d});
  const Tensor v = qkv.slice(1, c.Hq * c.d + row, ld).contiguous().view({N, c.Hkv, c.d});
  const Tensor kc0 = randn_bf16({P, L, c.Hkv, c.d}), vc0 = randn_bf16({P, L, c.Hkv, c.d});
  Tensor kc_ref = kc0.clone(), vc_ref = vc0.clone();
  ops::kv_cache_append(k, v, kc_ref, vc_ref, slots, c.past, seqs);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  Tensor ref = cpu_out({N, c.Hq, c.d});
  ops::attention_decode(q, kc_ref, vc_ref, slots, c.past, seqs, c.causal, c.window, scale, ref);

  const Tensor qkvd = to_gpu_bf16(qkv), qd = to_gpu_bf16(q), cu = cu_seqlens_gpu(seqs), sl = slots_gpu(slots);
  const Tensor pastd = i32_gpu(c.past);
  Tensor kc = to_gpu_bf16(kc0), vc = to_gpu_bf16(vc0);
  cuda::KvAppendParams ap;
  ap.k = at_bf16(qkvd, c.Hq * c.d);
  ap.ldk = ld;
  ap.v = at_bf16(qkvd, c.Hq * c.d + row);
  ap.ldv = ld;
  ap.k_cache = kc.raw_data();
  ap.v_cache = vc.raw_data();
  ap.slots = i32(sl);
  ap.past_len = i32(pastd);
  ap.cu_seqlens = i32(cu);
  ap.num_seqs = S;
  ap.N = N;
  ap.Hkv = c.Hkv;
  ap.d = c.d;
  ap.max_len = L;
  ap.num_slots = P;
  ap.max_new = max_new;
  cuda::kv_cache_append(ap, stream0());
  const std::string what = "Hq " + std::to_string(c.Hq) + " Hkv " + std::to_string(c.Hkv) + " d " +
                           std::to_string(c.d) + " lens " + lens_str(c.lens) + " past " + lens_str(c.past) +
                           (c.causal ? " causal" : " full") + " window " + std::to_string(c.window);
  EXPECT_EQ(max_rel_err(kc, kc_ref), 0.0) << "k cache after append " << what;
  EXPECT_EQ(max_rel_err(vc, vc_ref), 0.0) << "v cache after append " << what;

  cuda::AttentionDecodeParams p;
  p.q = qd.raw_data();
  p.k_cache = kc.raw_data();
  p.v_cache = vc.raw_data();
  p.slots = i32(sl);
  p.past_len = i32(pastd);
  p.cu_seqlens = i32(cu);
  p.num_seqs = S;
  p.N = N;
  p.Hq = c.Hq;
  p.Hkv = c.Hkv;
  p.d = c.d;
  p.max_len = L;
  p.num_slots = P;
  p.max_new = max_new;
  p.causal = c.causal;
  p.window = c.window;
  p.scale = scale;
  {
    Tensor out = gpu_out({N, c.Hq, c.d}, DType::BF16);
    p.out = out.raw_data();
    cuda::attention_decode_fallback(p, stream0());
    const double e = max_rel_err(out, ref);
    EXPECT_LT(e, 2e-2) << "fallback " << what;
    *worst_fb = std::max(*worst_fb, e);
  }
  if (!cuda::attention_decode_fast_supported(c.d, sm_major())) return;
  // Automatic splits with the workspace they want, no workspace (one split), and forced splits.
  for (int splits : {0, -1, 3, 64}) {
    Knob knob(cuda::tuning::attn_decode_splits, std::max(splits, 0));
    Tensor out = gpu_out({N, c.Hq, c.d}, DType::BF16);
    p.out = out.raw_data();
    const size_t ws_bytes = splits < 0 ? 0 : cuda::attention_decode_workspace(p);
    Tensor ws = gpu_out({std::max<int64_t>(static_cast<int64_t>(ws_bytes / 4), 1)}, DType::F32);
    p.workspace = splits < 0 ? nullptr : ws.raw_data();
    p.workspace_bytes = ws_bytes;
    cuda::attention_decode_fast(p, stream0());
    const double e = max_rel_err(out, ref);
    EXPECT_LT(e, 2e-2) << "fast splits " << splits << " (workspace " << ws_bytes << " B) " << what;
    *worst_fast = std::max(*worst_fast, e);
  }
  // Neither kernel writes the caches.
  EXPECT_EQ(max_rel_err(kc, kc_ref), 0.0) << "k cache after attention " << what;
}

}  // namespace

TEST(CudaDecode, KvAppendAndAttentionDecodeMatchCpu) {
  DFLASH_REQUIRE_GPU();
  double wf = 0, wb = 0;
  // Target (Hq 24, Hkv 4, d 256, causal): decode at contexts 1 / 63 / 1000+, verify T = 16, batches.
  check_attention({24, 4, 256, {1}, {0}, true, 0}, &wf, &wb);
  check_attention({24, 4, 256, {1}, {1029}, true, 0}, &wf, &wb);
  check_attention({24, 4, 256, {16}, {63}, true, 0}, &wf, &wb);
  check_attention({24, 4, 256, {1, 1, 1}, {0, 63, 1000}, true, 0}, &wf, &wb);
  check_attention({24, 4, 256, {16, 5, 1, 16, 16, 16, 16, 16}, {1, 1000, 64, 7, 300, 2, 90, 513}, true, 0}, &wf, &wb);
  // Drafter (Hq 32, Hkv 8, d 128): the block of 16 attends itself both ways and the context; the
  // sliding layer is causal with a window.
  check_attention({32, 8, 128, {16}, {1000}, false, 0}, &wf, &wb);
  check_attention({32, 8, 128, {16, 16, 16}, {0, 63, 1031}, false, 0}, &wf, &wb);
  check_attention({32, 8, 128, {16, 7}, {1000, 40}, true, 100}, &wf, &wb);
  check_attention({32, 8, 128, {16}, {200}, false, 37}, &wf, &wb);
  // GVA ratios 1, 2, 3; odd T; head dims 64 and 96 (fallback only).
  check_attention({2, 2, 128, {7, 1}, {63, 1}, true, 0}, &wf, &wb);
  check_attention({4, 2, 128, {3}, {64}, true, 0}, &wf, &wb);
  check_attention({6, 2, 128, {13, 2}, {129, 1000}, true, 0}, &wf, &wb);
  check_attention({6, 2, 64, {5}, {70}, true, 3}, &wf, &wb);
  check_attention({3, 1, 96, {4, 2}, {10, 0}, true, 0}, &wf, &wb);
  // More query rows than one CTA holds (T · group > 128): several row blocks per kv head.
  check_attention({24, 4, 256, {40}, {100}, true, 0}, &wf, &wb);
  std::printf("attention_decode: worst normalised error vs CPU: fast %.3g, fallback %.3g\n", wf, wb);
}

// Batch invariance, what speculative decoding needs to reproduce greedy decoding bit for bit: with
// absolute splits (split_keys), each of T = 16 verify rows equals the T = 1 decode of that token at
// its position over the same cache, exactly — across a split boundary, at several context lengths,
// for the target (causal) and the drafter's sliding layer. Without split_keys they need not.
TEST(CudaDecode, AttentionDecodeWithAbsoluteSplitsIsBatchInvariant) {
  DFLASH_REQUIRE_GPU();
  if (!cuda::attention_decode_fast_supported(256, sm_major())) GTEST_SKIP() << "no fast kernel on this GPU";
  struct Case {
    int64_t Hq, Hkv, d, past, window, split_keys;
  };
  for (const Case& c : {Case{24, 4, 256, 250, 0, 128}, Case{24, 4, 256, 1000, 0, 192}, Case{24, 4, 256, 3, 0, 64},
                        Case{32, 8, 128, 700, 100, 128}}) {
    const int64_t T = 16, L = c.past + T + 7;
    const Tensor kc = to_gpu_bf16(randn_f32({1, L, c.Hkv, c.d}, 1.0f)), vc = to_gpu_bf16(randn_f32({1, L, c.Hkv, c.d}, 1.0f));
    const Tensor q = to_gpu_bf16(randn_f32({T, c.Hq, c.d}, 1.0f)), sl = slots_gpu({0});
    cuda::AttentionDecodeParams p;
    p.k_cache = kc.raw_data(), p.v_cache = vc.raw_data(), p.slots = i32(sl);
    p.num_seqs = 1, p.Hq = c.Hq, p.Hkv = c.Hkv, p.d = c.d, p.max_len = L, p.num_slots = 1;
    p.causal = true, p.window = c.window, p.scale = 1.0f / std::sqrt(static_cast<float>(c.d)), p.split_keys = c.split_keys;
    auto run = [&](int64_t past, int64_t n, int64_t q_row) {
      const Tensor cu = cu_seqlens_gpu(offsets_of({n})), pd = i32_gpu({past});
      Tensor out = gpu_out({n, c.Hq, c.d}, DType::BF16);
      p.q = at_bf16(q, q_row * c.Hq * c.d), p.out = out.raw_data(), p.past_len = i32(pd), p.cu_seqlens = i32(cu);
      p.N = n, p.max_new = n, p.key_bound = past + n;
      Tensor ws = gpu_out({static_cast<int64_t>(cuda::attention_decode_workspace(p) / 4) + 1}, DType::F32);
      p.workspace = ws.raw_data(), p.workspace_bytes = cuda::attention_decode_workspace(p);
      cuda::attention_decode_fast(p, stream0());
      return host_f32(out);
    };
    const Tensor verify = run(c.past, T, 0);
    for (int64_t t = 0; t < T; ++t) {
      const Tensor one = run(c.past + t, 1, t);
      EXPECT_TRUE(bit_equal(one, verify.slice(0, t, t + 1).contiguous()))
          << "row " << t << " past " << c.past << " split_keys " << c.split_keys << " d " << c.d;
    }
  }
}

TEST(CudaDecode, AttentionDecodeRejectsBadSizes) {
  DFLASH_REQUIRE_GPU();
  const Tensor cu = cu_seqlens_gpu(offsets_of({1})), sl = slots_gpu({0}), past = i32_gpu({0});
  Tensor kc = Tensor::zeros({1, 8, 2, 128}, DType::BF16, Device::cuda(0)), vc = kc.clone();
  Tensor q = Tensor::zeros({1, 4, 128}, DType::BF16, Device::cuda(0)), out = q.clone();
  cuda::AttentionDecodeParams p;
  p.q = q.raw_data();
  p.k_cache = kc.raw_data();
  p.v_cache = vc.raw_data();
  p.out = out.raw_data();
  p.slots = i32(sl);
  p.past_len = i32(past);
  p.cu_seqlens = i32(cu);
  p.num_seqs = 1;
  p.N = 1;
  p.Hq = 4;
  p.Hkv = 2;
  p.d = 128;
  p.max_len = 8;
  p.num_slots = 1;
  p.max_new = 1;
  p.scale = 0.1f;
  EXPECT_NO_THROW(cuda::attention_decode_fast(p, stream0()));
  const Launchers<cuda::AttentionDecodeParams> op{cuda::attention_decode_fast, cuda::attention_decode_fallback, p};
  op.rejects([](cuda::AttentionDecodeParams& x) { x.d = 96; }, true);
  op.rejects([](cuda::AttentionDecodeParams& x) { x.Hq = 5; }, false);
  op.rejects([](cuda::AttentionDecodeParams& x) { x.scale = 0.0f; }, false);
  op.rejects([](cuda::AttentionDecodeParams& x) { x.window = -1; }, false);
  op.rejects([](cuda::AttentionDecodeParams& x) { x.max_new = 2; }, false);  // > N
  op.rejects([](cuda::AttentionDecodeParams& x) { x.num_slots = 0; }, false);
  op.rejects([](cuda::AttentionDecodeParams& x) { x.q = nullptr; }, false);
  EXPECT_TRUE(cuda::attention_decode_fast_supported(256, 9));
  EXPECT_FALSE(cuda::attention_decode_fast_supported(96, 9));
  EXPECT_STREQ(cuda::attention_decode_kernel_name(256, 9), "flash-decoding mma.sync");
  EXPECT_STREQ(cuda::attention_decode_kernel_name(96, 9), "fallback");
  cuda::KvAppendParams a;
  a.N = 1;
  a.num_seqs = 1;
  a.Hkv = 2;
  a.d = 128;
  a.max_len = 8;
  a.num_slots = 1;
  a.max_new = 1;
  a.ldk = 100;  // < Hkv·d
  EXPECT_THROW(cuda::kv_cache_append(a, stream0()), Error);
  DeviceContext::get(0).synchronize();
}
