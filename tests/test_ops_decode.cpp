// CPU reference of the decode / verify ops (kernels/cpu/decode.cpp): extending in pieces equals
// one pass over the whole sequence (conv update vs causal_conv1d, the delta rule on a state pool vs
// gated_delta_rule, KV-cache attention vs causal_attention), with several sequences in permuted
// pool slots, unused slots that must not change, and verify calls (update_state = false) that must
// leave the pool bit-identical; the non-causal and windowed attention against a brute-force loop.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "kernels/cpu/gemm.h"
#include "kernels/ops.h"
#include "core/random.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::ops;

namespace {

HostDraws g_draws{777};
SeqOffsets offsets_of(const std::vector<int64_t>& lens) {
  SeqOffsets s{{0}};
  for (int64_t l : lens) s.offsets.push_back(s.offsets.back() + l);
  return s;
}

// Rows [r0, r0 + n) of a row-major tensor, as a contiguous copy / the destination of one.
Tensor rows(const Tensor& t, int64_t r0, int64_t n) { return t.slice(0, r0, r0 + n).contiguous(); }
void put_rows(Tensor& dst, int64_t r0, const Tensor& src) { dst.slice(0, r0, r0 + src.size(0)).copy_from(src); }

// The pieces in which sequences of the given lengths are extended: step i brings piece i of every
// sequence (0 tokens once a sequence is done), piece sizes cycling through `sizes` from a
// different start per sequence, so one call mixes T = 1, 2, 3, 7 (and 0).
struct Plan {
  std::vector<std::vector<int64_t>> pieces;  // [step][seq] tokens
  std::vector<std::vector<int64_t>> start;   // [step][seq] first token within the sequence
};
Plan plan_pieces(const std::vector<int64_t>& lens, const std::vector<int64_t>& sizes) {
  Plan p;
  std::vector<int64_t> done(lens.size(), 0);
  for (int64_t step = 0;; ++step) {
    bool any = false;
    std::vector<int64_t> piece(lens.size()), start(lens.size());
    for (size_t s = 0; s < lens.size(); ++s) {
      const int64_t want = sizes[(static_cast<size_t>(step) + s) % sizes.size()];
      piece[s] = std::min(want, lens[s] - done[s]);
      start[s] = done[s];
      done[s] += piece[s];
      any = any || piece[s] > 0;
    }
    if (!any) break;
    p.pieces.push_back(piece);
    p.start.push_back(start);
  }
  return p;
}

// Packs rows [start, start + piece) of each sequence's part of `whole` (packed by `whole_seqs`).
Tensor gather_piece(const Tensor& whole, const SeqOffsets& whole_seqs, const std::vector<int64_t>& start,
                    const std::vector<int64_t>& piece) {
  int64_t n = 0;
  for (int64_t t : piece) n += t;
  Shape shape = whole.shape();
  shape[0] = n;
  Tensor out = Tensor::empty(shape, DType::F32);
  int64_t r = 0;
  for (size_t s = 0; s < piece.size(); ++s) {
    if (piece[s] == 0) continue;
    put_rows(out, r, rows(whole, whole_seqs.offsets[s] + start[s], piece[s]));
    r += piece[s];
  }
  return out;
}
void scatter_piece(Tensor& whole, const SeqOffsets& whole_seqs, const std::vector<int64_t>& start,
                   const std::vector<int64_t>& piece, const Tensor& part) {
  int64_t r = 0;
  for (size_t s = 0; s < piece.size(); ++s) {
    if (piece[s] == 0) continue;
    put_rows(whole, whole_seqs.offsets[s] + start[s], rows(part, r, piece[s]));
    r += piece[s];
  }
}

// Random delta-rule inputs for N tokens (decays in (-0.5, -0.01), betas in (0.05, 0.95)), chunk size 4
// (the chunked form crosses several chunks).
DeltaRuleParams draw_delta_rule(int64_t N, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv) {
  DeltaRuleParams p;
  p.q = g_draws.randn({N, Hk, dk});
  p.k = g_draws.randn({N, Hk, dk});
  p.v = g_draws.randn({N, Hv, dv});
  p.g = g_draws.uniform({N, Hv}, -0.5f, -0.01f);
  p.beta = g_draws.uniform({N, Hv}, 0.05f, 0.95f);
  p.chunk_size = 4;
  return p;
}

const std::vector<int64_t> kLens = {13, 1, 9};           // three sequences
const std::vector<int32_t> kSlots = {4, 0, 2};           // in a pool of 6: slots 1, 3, 5 unused
const std::vector<int64_t> kPieceSizes = {1, 2, 3, 7};
constexpr int64_t kPool = 6;

}  // namespace

// ---- conv update ---------------------------------------------------------------------------------
TEST(OpsDecode, ConvUpdateInPiecesEqualsWholeConv) {
  const SeqOffsets whole = offsets_of(kLens);
  const int64_t N = whole.total_tokens(), C = 5;
  const Plan plan = plan_pieces(kLens, kPieceSizes);
  for (int64_t K = 1; K <= 4; ++K) {
    for (bool silu : {true, false}) {
      const Tensor x = g_draws.randn({N, C}), w = g_draws.randn({C, K}, 0.5f);
      Tensor ref = poisoned_f32({N, C});
      causal_conv1d(x, w, whole, silu, ref);
      // New sequences start from zeros; the unused slots hold random values that must survive.
      Tensor pool = g_draws.randn({kPool, K - 1, C});
      for (int32_t s : kSlots) pool.select(s).copy_from(Tensor::zeros({K - 1, C}, DType::F32));
      const Tensor pool0 = pool.clone();
      Tensor y = poisoned_f32({N, C});
      for (size_t step = 0; step < plan.pieces.size(); ++step) {
        const SeqOffsets seqs = offsets_of(plan.pieces[step]);
        const Tensor xp = gather_piece(x, whole, plan.start[step], plan.pieces[step]);
        // A verify call first: same outputs, pool untouched.
        const Tensor before = pool.clone();
        Tensor yv = poisoned_f32({seqs.total_tokens(), C}), yp = poisoned_f32({seqs.total_tokens(), C});
        causal_conv1d_update(xp, w, pool, kSlots, seqs, silu, /*update_state=*/false, yv);
        EXPECT_TRUE(bit_equal(pool, before)) << "update_state = false changed the pool, K " << K;
        causal_conv1d_update(xp, w, pool, kSlots, seqs, silu, /*update_state=*/true, yp);
        EXPECT_TRUE(bit_equal(yv, yp)) << "K " << K << " step " << step;
        scatter_piece(y, whole, plan.start[step], plan.pieces[step], yp);
      }
      EXPECT_LT(max_rel_err(y, ref), 1e-6) << "K " << K << (silu ? " silu" : "");
      // Final state: the last K-1 inputs of each sequence (zeros before its start).
      for (size_t s = 0; s < kLens.size(); ++s)
        for (int64_t r = 0; r < K - 1; ++r)
          for (int64_t c = 0; c < C; ++c) {
            const int64_t src = kLens[s] - (K - 1) + r;
            const float want = src >= 0 ? x.data<float>()[(whole.offsets[s] + src) * C + c] : 0.0f;
            EXPECT_EQ(pool.data<float>()[(kSlots[s] * (K - 1) + r) * C + c], want) << "seq " << s << " row " << r;
          }
      for (int32_t u : {1, 3, 5}) EXPECT_TRUE(bit_equal(pool.select(u).contiguous(), pool0.select(u).contiguous()));
    }
  }
}

// ---- gated delta rule on a state pool --------------------------------------------------------------
// Speculative decoding's scheme: each step verifies a block of tokens (update_state = false, pool
// untouched) whose outputs must equal the whole-sequence run, then commits the accepted prefix
// (update_state = true, no output), here the piece of the plan.
TEST(OpsDecode, DeltaRulePoolInPiecesEqualsWholeRule) {
  const SeqOffsets whole = offsets_of(kLens);
  const int64_t N = whole.total_tokens(), S = whole.num_sequences(), Hk = 2, dk = 8, dv = 6;
  const Plan plan = plan_pieces(kLens, kPieceSizes);
  double worst = 0;
  for (int64_t ratio : {1, 2, 3}) {
    const int64_t Hv = Hk * ratio;
    DeltaRuleParams p = draw_delta_rule(N, Hk, Hv, dk, dv);
    // Start from non-zero states (a sequence that already holds context).
    Tensor pool = g_draws.randn({kPool, Hv, dk, dv}, 0.3f);
    const Tensor pool0 = pool.clone();
    DeltaRuleParams pw = p;
    pw.initial_state = Tensor::empty({S, Hv, dk, dv}, DType::F32);
    for (int64_t s = 0; s < S; ++s) pw.initial_state.select(s).copy_from(pool.select(kSlots[s]));
    Tensor ref_rec = poisoned_f32({N, Hv, dv}), ref_chk = poisoned_f32({N, Hv, dv});
    Tensor fin_rec = poisoned_f32({S, Hv, dk, dv}), fin_chk = poisoned_f32({S, Hv, dk, dv});
    gated_delta_rule(pw, whole, DeltaRuleAlgo::Recurrent, ref_rec, &fin_rec);
    gated_delta_rule(pw, whole, DeltaRuleAlgo::Chunked, ref_chk, &fin_chk);

    Tensor out = poisoned_f32({N, Hv, dv});
    for (size_t step = 0; step < plan.pieces.size(); ++step) {
      // Verify: the piece plus up to 2 more tokens (the drafted ones that will be rejected).
      std::vector<int64_t> verify = plan.pieces[step];
      for (size_t s = 0; s < verify.size(); ++s)
        verify[s] = std::min(kLens[s] - plan.start[step][s], verify[s] + 2);
      auto piece_params = [&](const std::vector<int64_t>& piece) {
        DeltaRuleParams q = p;
        for (auto [dst, src] : {std::pair{&q.q, &p.q}, {&q.k, &p.k}, {&q.v, &p.v}, {&q.g, &p.g}, {&q.beta, &p.beta}})
          *dst = gather_piece(*src, whole, plan.start[step], piece);
        return q;
      };
      const SeqOffsets vseqs = offsets_of(verify), cseqs = offsets_of(plan.pieces[step]);
      const Tensor before = pool.clone();
      Tensor vout = poisoned_f32({vseqs.total_tokens(), Hv, dv});
      gated_delta_rule_pool(piece_params(verify), vseqs, pool, kSlots, /*update_state=*/false, &vout);
      EXPECT_TRUE(bit_equal(pool, before)) << "verify changed the pool, ratio " << ratio << " step " << step;
      // The verified outputs of the accepted prefix are the outputs of the step.
      Tensor vfull = Tensor::zeros({N, Hv, dv}, DType::F32);
      scatter_piece(vfull, whole, plan.start[step], verify, vout);
      Tensor part = gather_piece(vfull, whole, plan.start[step], plan.pieces[step]);
      scatter_piece(out, whole, plan.start[step], plan.pieces[step], part);
      // Commit: re-run the accepted tokens, state only.
      Tensor none;
      gated_delta_rule_pool(piece_params(plan.pieces[step]), cseqs, pool, kSlots, /*update_state=*/true,
                            step % 2 ? &none : nullptr);
    }
    const double e_rec = max_rel_err(out, ref_rec), e_chk = max_rel_err(out, ref_chk);
    EXPECT_LT(e_rec, 1e-5) << "vs recurrent, GVA ratio " << ratio;
    EXPECT_LT(e_chk, 1e-5) << "vs chunked, GVA ratio " << ratio;
    worst = std::max({worst, e_rec, e_chk});
    for (int64_t s = 0; s < S; ++s) {
      EXPECT_LT(max_rel_err(pool.select(kSlots[s]).contiguous(), fin_rec.select(s).contiguous()), 1e-5) << s;
      EXPECT_LT(max_rel_err(pool.select(kSlots[s]).contiguous(), fin_chk.select(s).contiguous()), 1e-5) << s;
    }
    for (int32_t u : {1, 3, 5}) EXPECT_TRUE(bit_equal(pool.select(u).contiguous(), pool0.select(u).contiguous()));
  }
  std::printf("gated_delta_rule_pool in pieces vs whole: worst normalised error %.3g\n", worst);
}

// ---- attention over a KV cache -----------------------------------------------------------------
TEST(OpsDecode, CausalAttentionDecodeInPiecesEqualsWholeAttention) {
  const SeqOffsets whole = offsets_of(kLens);
  const int64_t N = whole.total_tokens(), d = 8, L = 16;
  const Plan plan = plan_pieces(kLens, kPieceSizes);
  for (auto [Hq, Hkv] : {std::pair<int64_t, int64_t>{4, 2}, {3, 1}, {2, 2}}) {
    const Tensor q = g_draws.randn({N, Hq, d}), k = g_draws.randn({N, Hkv, d}), v = g_draws.randn({N, Hkv, d});
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    Tensor ref = poisoned_f32({N, Hq, d});
    causal_attention(q, k, v, whole, scale, ref);
    Tensor kc = g_draws.randn({kPool, L, Hkv, d}), vc = g_draws.randn({kPool, L, Hkv, d});  // stale contents never read
    const Tensor kc0 = kc.clone();
    std::vector<int64_t> past(kLens.size(), 0);
    Tensor out = poisoned_f32({N, Hq, d});
    for (size_t step = 0; step < plan.pieces.size(); ++step) {
      const SeqOffsets seqs = offsets_of(plan.pieces[step]);
      const auto& st = plan.start[step];
      kv_cache_append(gather_piece(k, whole, st, plan.pieces[step]), gather_piece(v, whole, st, plan.pieces[step]), kc,
                      vc, kSlots, past, seqs);
      Tensor o = poisoned_f32({seqs.total_tokens(), Hq, d});
      attention_decode(gather_piece(q, whole, st, plan.pieces[step]), kc, vc, kSlots, past, seqs, /*causal=*/true,
                       /*window=*/0, scale, o);
      scatter_piece(out, whole, st, plan.pieces[step], o);
      for (size_t s = 0; s < past.size(); ++s) past[s] += plan.pieces[step][s];
    }
    EXPECT_LT(max_rel_err(out, ref), 1e-5) << "Hq " << Hq << " Hkv " << Hkv;
    for (int32_t u : {1, 3, 5}) EXPECT_TRUE(bit_equal(kc.select(u).contiguous(), kc0.select(u).contiguous()));
  }
}

// Non-causal (the drafter's full layer: the new block sees itself both ways and all the context)
// and windowed causal (its sliding layer) against a double-precision loop over the attended keys.
TEST(OpsDecode, AttentionDecodeNonCausalAndWindowedMatchBruteForce) {
  const int64_t Hq = 6, Hkv = 2, d = 8, L = 40;
  const std::vector<int64_t> lens = {1, 5, 16}, past = {0, 17, 23};
  const std::vector<int32_t> slots = {3, 1, 0};
  const SeqOffsets seqs = offsets_of(lens);
  const int64_t N = seqs.total_tokens();
  const Tensor q = g_draws.randn({N, Hq, d}), kc = g_draws.randn({4, L, Hkv, d}), vc = g_draws.randn({4, L, Hkv, d});
  const float scale = 0.3f;
  for (auto [causal, window] : {std::pair<bool, int64_t>{false, 0}, {true, 4}, {true, 1}, {false, 7}, {true, 100}}) {
    Tensor out = poisoned_f32({N, Hq, d});
    attention_decode(q, kc, vc, slots, past, seqs, causal, window, scale, out);
    Tensor ref = Tensor::empty({N, Hq, d}, DType::F64);
    for (size_t s = 0; s < lens.size(); ++s)
      for (int64_t t = 0; t < lens[s]; ++t)
        for (int64_t h = 0; h < Hq; ++h) {
          const int64_t n = seqs.offsets[s] + t, pos = past[s] + t, kh = h / (Hq / Hkv);
          std::vector<double> score, keys;
          for (int64_t kp = 0; kp < past[s] + lens[s]; ++kp) {
            if (causal && kp > pos) continue;
            if (window > 0 && kp < pos - (window - 1)) continue;
            double dot = 0;
            for (int64_t e = 0; e < d; ++e)
              dot += double(q.data<float>()[(n * Hq + h) * d + e]) *
                     kc.data<float>()[((slots[s] * L + kp) * Hkv + kh) * d + e];
            score.push_back(dot * scale);
            keys.push_back(static_cast<double>(kp));
          }
          double mx = -INFINITY, den = 0;
          for (double x : score) mx = std::max(mx, x);
          for (double& x : score) den += (x = std::exp(x - mx));
          for (int64_t e = 0; e < d; ++e) {
            double acc = 0;
            for (size_t i = 0; i < score.size(); ++i)
              acc += score[i] / den *
                     vc.data<float>()[((slots[s] * L + static_cast<int64_t>(keys[i])) * Hkv + kh) * d + e];
            ref.data<double>()[(n * Hq + h) * d + e] = acc;
          }
        }
    EXPECT_LT(max_rel_err(out, ref), 1e-5) << (causal ? "causal" : "non-causal") << " window " << window;
  }
}

// The decode attention and the delta rule split their (sequence, head) pairs over the CPU backend's
// worker threads: the outputs and states are the same bits on 1, 2 and 3 threads (CPU speculative
// decoding's equality with greedy decoding, and bit-exact resume, rely on it).
TEST(OpsDecode, AttentionAndDeltaRuleGiveTheSameBitsOnAnyThreadCount) {
  const std::vector<int64_t> lens = {1, 5, 16, 2}, past = {0, 17, 23, 3};
  const std::vector<int32_t> slots = {3, 1, 0, 4};
  const SeqOffsets seqs = offsets_of(lens);
  const int64_t N = seqs.total_tokens(), S = seqs.num_sequences(), Hq = 6, Hkv = 2, d = 8, L = 40, Hk = 2,
                Hv = 6, dk = 8, dv = 6;
  const Tensor q = g_draws.randn({N, Hq, d}), kc = g_draws.randn({5, L, Hkv, d}), vc = g_draws.randn({5, L, Hkv, d});
  DeltaRuleParams p = draw_delta_rule(N, Hk, Hv, dk, dv);
  p.initial_state = g_draws.randn({S, Hv, dk, dv}, 0.3f);
  const Tensor pool0 = g_draws.randn({5, Hv, dk, dv}, 0.3f);
  const int saved = cpu::cpu_threads();
  std::vector<Tensor> attn, rec, chk, rec_state, chk_state, pool_out, pools;
  for (int threads : {1, 2, 3}) {
    cpu::set_cpu_threads(threads);
    attn.push_back(poisoned_f32({N, Hq, d}));
    attention_decode(q, kc, vc, slots, past, seqs, /*causal=*/true, /*window=*/0, 0.3f, attn.back());
    rec.push_back(poisoned_f32({N, Hv, dv}));
    chk.push_back(poisoned_f32({N, Hv, dv}));
    rec_state.push_back(poisoned_f32({S, Hv, dk, dv}));
    chk_state.push_back(poisoned_f32({S, Hv, dk, dv}));
    gated_delta_rule(p, seqs, DeltaRuleAlgo::Recurrent, rec.back(), &rec_state.back());
    gated_delta_rule(p, seqs, DeltaRuleAlgo::Chunked, chk.back(), &chk_state.back());
    pools.push_back(pool0.clone());
    pool_out.push_back(poisoned_f32({N, Hv, dv}));
    DeltaRuleParams pp = p;
    pp.initial_state = Tensor();
    gated_delta_rule_pool(pp, seqs, pools.back(), slots, /*update_state=*/true, &pool_out.back());
  }
  cpu::set_cpu_threads(saved);
  // Every output written (the poison is NaN, which max_rel_err reports as infinite), and close to its twin.
  for (const Tensor* t : {&attn[0], &rec[0], &chk[0], &rec_state[0], &chk_state[0], &pool_out[0]})
    EXPECT_LT(max_rel_err(*t, *t), 1.0) << "an output was not written";
  EXPECT_LT(max_rel_err(chk[0], rec[0]), 1e-5);
  for (size_t i = 1; i < attn.size(); ++i) {
    EXPECT_TRUE(bit_equal(attn[i], attn[0])) << "attention_decode on " << i + 1 << " threads";
    EXPECT_TRUE(bit_equal(rec[i], rec[0]) && bit_equal(rec_state[i], rec_state[0])) << "recurrent, " << i + 1 << " threads";
    EXPECT_TRUE(bit_equal(chk[i], chk[0]) && bit_equal(chk_state[i], chk_state[0])) << "chunked, " << i + 1 << " threads";
    EXPECT_TRUE(bit_equal(pool_out[i], pool_out[0]) && bit_equal(pools[i], pools[0])) << "pool, " << i + 1 << " threads";
  }
}

TEST(OpsDecode, RejectsBadSlotsAndLengths) {
  const SeqOffsets seqs = offsets_of({2, 1});
  const Tensor x = g_draws.randn({3, 4}), w = g_draws.randn({4, 3});
  Tensor pool = Tensor::zeros({3, 2, 4}, DType::F32), y = poisoned_f32({3, 4});
  EXPECT_NO_THROW(causal_conv1d_update(x, w, pool, {2, 0}, seqs, true, true, y));
  EXPECT_THROW(causal_conv1d_update(x, w, pool, {3, 0}, seqs, true, true, y), Error);   // outside the pool
  EXPECT_THROW(causal_conv1d_update(x, w, pool, {-1, 0}, seqs, true, false, y), Error);
  EXPECT_THROW(causal_conv1d_update(x, w, pool, {1, 1}, seqs, true, true, y), Error);   // one slot, two writers
  EXPECT_NO_THROW(causal_conv1d_update(x, w, pool, {1, 1}, seqs, true, false, y));      // readers may share
  EXPECT_THROW(causal_conv1d_update(x, w, pool, {1}, seqs, true, false, y), Error);     // one slot per sequence
  Tensor bad_state = Tensor::zeros({3, 3, 4}, DType::F32);
  EXPECT_THROW(causal_conv1d_update(x, w, bad_state, {0, 1}, seqs, true, false, y), Error);  // not K-1 rows

  const Tensor k = g_draws.randn({3, 1, 4});
  Tensor kc = Tensor::zeros({2, 5, 1, 4}, DType::F32), vc = kc.clone();
  EXPECT_NO_THROW(kv_cache_append(k, k, kc, vc, {0, 1}, {3, 4}, seqs));
  EXPECT_THROW(kv_cache_append(k, k, kc, vc, {0, 1}, {4, 4}, seqs), Error);  // 4 + 2 > 5
  const Tensor q = g_draws.randn({3, 2, 4});
  Tensor o = poisoned_f32({3, 2, 4});
  EXPECT_THROW(attention_decode(q, kc, vc, {0, 1}, {3, 5}, seqs, true, 0, 0.5f, o), Error);
  EXPECT_THROW(attention_decode(q, kc, vc, {0, 1}, {3, 4}, seqs, true, -1, 0.5f, o), Error);
  EXPECT_NO_THROW(attention_decode(q, kc, vc, {1, 1}, {3, 4}, seqs, true, 2, 0.5f, o));
}
