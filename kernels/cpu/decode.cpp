// CPU reference of the decode / verify ops (kernels/ops.h "decode / verify"): the conv update, the
// gated delta rule on a state pool, the KV-cache append and attention over a KV cache. Each works
// per sequence on its pool slot; all are plain f32 loops, the oracle of tests/test_cuda_decode.cpp.
// The delta rule gathers the slots' states and runs the recurrent gated_delta_rule (gdn.cpp), so
// "extending in pieces equals the whole" holds for it by construction of that op.
#include <algorithm>
#include <cmath>
#include <set>

#include "kernels/cpu/common.h"
#include "kernels/cpu/gemm.h"

namespace dflash::ops {

namespace {

// Slots: one per sequence, each in [0, P); distinct when the op writes the pool (two sequences
// updating one slot would race on the GPU and depend on the order here).
void check_slots(const std::vector<int32_t>& slots, const SeqOffsets& seqs, int64_t P, bool writes, const char* op) {
  DFLASH_CHECK(static_cast<int64_t>(slots.size()) == seqs.num_sequences(),
               op << ": " << slots.size() << " slots for " << seqs.num_sequences() << " sequences");
  std::set<int32_t> seen;
  for (size_t s = 0; s < slots.size(); ++s) {
    DFLASH_CHECK(slots[s] >= 0 && slots[s] < P,
                 op << ": slot " << slots[s] << " of sequence " << s << " is outside the pool of " << P << " slots");
    DFLASH_CHECK(!writes || seen.insert(slots[s]).second,
                 op << ": slot " << slots[s] << " is used by two sequences of one call that writes the pool");
  }
}

void check_past_len(const std::vector<int64_t>& past_len, const SeqOffsets& seqs, int64_t L, const char* op) {
  DFLASH_CHECK(static_cast<int64_t>(past_len.size()) == seqs.num_sequences(),
               op << ": " << past_len.size() << " past lengths for " << seqs.num_sequences() << " sequences");
  for (int64_t s = 0; s < seqs.num_sequences(); ++s) {
    const int64_t T = seqs.offsets[s + 1] - seqs.offsets[s];
    DFLASH_CHECK(past_len[s] >= 0 && past_len[s] + T <= L,
                 op << ": sequence " << s << " has past length " << past_len[s] << " and " << T
                    << " new tokens, beyond the cache length " << L);
  }
}

// The KV-cache ops' tensors: f32 host `rows` (k or q, named `rows_name`, [N, heads, d]) and a k / v
// cache pair [P, L, Hkv, d] with the rows' d. The caller checks the rows' heads against Hkv.
struct CacheDims {
  int64_t N, heads, d, P, L, Hkv;
};
CacheDims check_kv_cache(const char* op, const Tensor& rows, const char* rows_name, const Tensor& k_cache,
                         const Tensor& v_cache) {
  detail::require_host_f32(rows, op, rows_name);
  detail::require_host_f32(k_cache, op, "k_cache");
  detail::require_host_f32(v_cache, op, "v_cache");
  DFLASH_CHECK(rows.dim() == 3 && k_cache.dim() == 4,
               op << ": " << rows_name << " [N, heads, d] and k_cache [P, L, Hkv, d] expected, got "
                  << rows.describe() << ", " << k_cache.describe());
  const CacheDims c{rows.size(0), rows.size(1), rows.size(2), k_cache.size(0), k_cache.size(1), k_cache.size(2)};
  detail::require_shape(k_cache, {c.P, c.L, c.Hkv, c.d}, op, "k_cache");
  detail::require_shape(v_cache, {c.P, c.L, c.Hkv, c.d}, op, "v_cache");
  return c;
}

}  // namespace

void causal_conv1d_update(const Tensor& x, const Tensor& w, Tensor& conv_state, const std::vector<int32_t>& slots,
                          const SeqOffsets& seqs, bool silu, bool update_state, Tensor& y) {
  using detail::require_host_f32;
  using detail::require_shape;
  const char* op = "causal_conv1d_update";
  require_host_f32(x, op, "x");
  require_host_f32(w, op, "w");
  require_host_f32(conv_state, op, "conv_state");
  require_host_f32(y, op, "y");
  DFLASH_CHECK(x.dim() == 2 && w.dim() == 2 && conv_state.dim() == 3,
               op << ": x [N, C], w [C, K], conv_state [P, K-1, C] expected, got " << x.describe() << ", "
                  << w.describe() << ", " << conv_state.describe());
  const int64_t N = x.size(0), C = x.size(1), K = w.size(1), P = conv_state.size(0);
  DFLASH_CHECK(K >= 1, op << ": kernel size must be >= 1");
  require_shape(w, {C, K}, op, "w");
  require_shape(conv_state, {P, K - 1, C}, op, "conv_state");
  require_shape(y, {N, C}, op, "y");
  DFLASH_CHECK(x.raw_data() != y.raw_data(), op << ": x and y must not alias");
  seqs.validate(N, op);
  check_slots(slots, seqs, P, update_state, op);
  const float* X = x.data<float>();
  const float* Wt = w.data<float>();
  float* Y = y.data<float>();
  std::vector<float> window;
  for (int64_t s = 0; s < seqs.num_sequences(); ++s) {
    const int64_t begin = seqs.offsets[s], T = seqs.offsets[s + 1] - begin;
    float* state = conv_state.data<float>() + slots[static_cast<size_t>(s)] * (K - 1) * C;
    // window = [state (K-1 rows) ; x rows of the sequence], [K-1+T, C]
    window.assign(static_cast<size_t>((K - 1 + T) * C), 0.0f);
    std::copy_n(state, (K - 1) * C, window.begin());
    std::copy_n(X + begin * C, T * C, window.begin() + (K - 1) * C);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) {
        float acc = 0;
        for (int64_t j = 0; j < K; ++j) acc += Wt[c * K + j] * window[static_cast<size_t>((t + j) * C + c)];
        Y[(begin + t) * C + c] = silu ? detail::silu(acc) : acc;
      }
    if (update_state) std::copy_n(window.begin() + T * C, (K - 1) * C, state);
  }
}

void gated_delta_rule_pool(const DeltaRuleParams& p, const SeqOffsets& seqs, Tensor& state_pool,
                           const std::vector<int32_t>& slots, bool update_state, Tensor* out) {
  const char* op = "gated_delta_rule_pool";
  detail::require_host_f32(state_pool, op, "state_pool");
  DFLASH_CHECK(p.q.defined() && p.v.defined() && p.q.dim() == 3 && p.v.dim() == 3,
               op << ": q [N, Hk, dk] and v [N, Hv, dv] expected");
  const int64_t N = p.q.size(0), Hv = p.v.size(1), dk = p.q.size(2), dv = p.v.size(2), S = seqs.num_sequences();
  DFLASH_CHECK(state_pool.dim() == 4, op << ": state_pool [P, Hv, dk, dv] expected, got " << state_pool.describe());
  const int64_t P = state_pool.size(0);
  detail::require_shape(state_pool, {P, Hv, dk, dv}, op, "state_pool");
  check_slots(slots, seqs, P, update_state, op);
  // Gather the slots' states, run the recurrence from them, scatter the final states back.
  const int64_t per_slot = Hv * dk * dv;
  DeltaRuleParams rp = p;
  rp.initial_state = Tensor::empty({S, Hv, dk, dv}, DType::F32);
  for (int64_t s = 0; s < S; ++s)
    std::copy_n(state_pool.data<float>() + slots[static_cast<size_t>(s)] * per_slot, per_slot,
                rp.initial_state.data<float>() + s * per_slot);
  const bool want_out = out != nullptr && out->defined();
  Tensor scratch = want_out ? Tensor() : Tensor::empty({N, Hv, dv}, DType::F32);
  Tensor final_state = update_state ? Tensor::empty({S, Hv, dk, dv}, DType::F32) : Tensor();
  gated_delta_rule(rp, seqs, DeltaRuleAlgo::Recurrent, want_out ? *out : scratch,
                   update_state ? &final_state : nullptr);
  if (update_state)
    for (int64_t s = 0; s < S; ++s)
      std::copy_n(final_state.data<float>() + s * per_slot, per_slot,
                  state_pool.data<float>() + slots[static_cast<size_t>(s)] * per_slot);
}

void kv_cache_append(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                     const std::vector<int32_t>& slots, const std::vector<int64_t>& past_len, const SeqOffsets& seqs) {
  const char* op = "kv_cache_append";
  const auto [N, heads, d, P, L, Hkv] = check_kv_cache(op, k, "k", k_cache, v_cache);
  DFLASH_CHECK(heads == Hkv, op << ": k has " << heads << " heads, the cache " << Hkv);
  detail::require_host_f32(v, op, "v");
  detail::require_shape(v, {N, Hkv, d}, op, "v");
  seqs.validate(N, op);
  check_slots(slots, seqs, P, true, op);
  check_past_len(past_len, seqs, L, op);
  const int64_t row = Hkv * d;
  for (int64_t s = 0; s < seqs.num_sequences(); ++s)
    for (int64_t n = seqs.offsets[s]; n < seqs.offsets[s + 1]; ++n) {
      const int64_t dst = (slots[static_cast<size_t>(s)] * L + past_len[s] + (n - seqs.offsets[s])) * row;
      std::copy_n(k.data<float>() + n * row, row, k_cache.data<float>() + dst);
      std::copy_n(v.data<float>() + n * row, row, v_cache.data<float>() + dst);
    }
}

void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const std::vector<int32_t>& slots,
                      const std::vector<int64_t>& past_len, const SeqOffsets& seqs, bool causal, int64_t window,
                      float scale, Tensor& out) {
  const char* op = "attention_decode";
  const auto [N, Hq, d, P, L, Hkv] = check_kv_cache(op, q, "q", k_cache, v_cache);
  detail::require_host_f32(out, op, "out");
  detail::require_shape(out, {N, Hq, d}, op, "out");
  DFLASH_CHECK(Hkv > 0 && Hq % Hkv == 0, op << ": " << Hq << " query heads are not a multiple of " << Hkv << " kv heads");
  DFLASH_CHECK(window >= 0, op << ": window must be >= 0 (0 = none), got " << window);
  seqs.validate(N, op);
  check_slots(slots, seqs, P, false, op);
  check_past_len(past_len, seqs, L, op);
  const int64_t group = Hq / Hkv;
  // Every (sequence, query head) writes its own output rows: they run on the CPU backend's worker
  // threads, the same bits on any thread count.
  cpu::parallel_for(seqs.num_sequences() * Hq, [&](int64_t sh) {
    const int64_t s = sh / Hq, h = sh % Hq, kh = h / group;
    const int64_t begin = seqs.offsets[s], T = seqs.offsets[s + 1] - begin, past = past_len[s];
    const float* Kc = k_cache.data<float>() + slots[static_cast<size_t>(s)] * L * Hkv * d;
    const float* Vc = v_cache.data<float>() + slots[static_cast<size_t>(s)] * L * Hkv * d;
    std::vector<float> scores;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t pos = past + t;
      const int64_t hi = causal ? pos : past + T - 1;                   // last key attended
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - (window - 1)) : 0;  // first key
      const float* qr = q.data<float>() + ((begin + t) * Hq + h) * d;
      float* orow = out.data<float>() + ((begin + t) * Hq + h) * d;
      std::fill(orow, orow + d, 0.0f);
      if (hi < lo) continue;  // no key (cannot happen for causal or window: a query sees itself)
      scores.assign(static_cast<size_t>(hi - lo + 1), 0.0f);
      float mx = -INFINITY;
      for (int64_t kp = lo; kp <= hi; ++kp) {
        const float* kr = Kc + (kp * Hkv + kh) * d;
        float dot = 0;
        for (int64_t e = 0; e < d; ++e) dot += qr[e] * kr[e];
        scores[static_cast<size_t>(kp - lo)] = dot * scale;
        mx = std::max(mx, dot * scale);
      }
      float denom = 0;
      for (float& sc : scores) denom += (sc = std::exp(sc - mx));
      for (int64_t kp = lo; kp <= hi; ++kp) {
        const float pr = scores[static_cast<size_t>(kp - lo)] / denom;
        const float* vr = Vc + (kp * Hkv + kh) * d;
        for (int64_t e = 0; e < d; ++e) orow[e] += pr * vr[e];
      }
    }
  });
}

}  // namespace dflash::ops
