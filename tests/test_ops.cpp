// CPU reference ops against straightforward double-precision formulas, and the two delta-rule
// algorithms against each other and against transformers' torch implementation (golden data).
// Outputs are poisoned (NaN) before every run so an unwritten element fails the comparison.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "kernels/ops.h"
#include "core/random.h"
#include "core/io/safetensors.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::ops;

namespace {

HostDraws g_draws{12345};
float at(const Tensor& t, int64_t i) { return t.data<float>()[i]; }

SeqOffsets offsets_of(std::vector<int64_t> lens) {
  SeqOffsets s{{0}};
  for (int64_t l : lens) s.offsets.push_back(s.offsets.back() + l);
  return s;
}

}  // namespace

TEST(Ops, LinearMatchesDoubleLoop) {
  for (auto [M, K, N] : {std::tuple{1, 1, 1}, {3, 17, 5}, {7, 64, 130}}) {
    Tensor x = g_draws.randn({M, K}), w = g_draws.randn({N, K}), y = poisoned_f32({M, N});
    linear(x, w, y);
    Tensor ref = Tensor::empty({M, N}, DType::F64);
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        double s = 0;
        for (int k = 0; k < K; ++k) s += double(at(x, m * K + k)) * at(w, n * K + k);
        ref.data<double>()[m * N + n] = s;
      }
    EXPECT_LT(max_rel_err(y, ref), 1e-5) << M << "x" << K << "x" << N;
    Tensor y2 = y.clone();
    linear(x, w, y2, /*accumulate=*/true);
    for (int64_t i = 0; i < y.numel(); ++i) EXPECT_FLOAT_EQ(at(y2, i), 2 * at(y, i));
  }
  Tensor x = g_draws.randn({2, 3}), w = g_draws.randn({4, 5}), y = poisoned_f32({2, 4});
  EXPECT_THROW(linear(x, w, y), Error);
}

TEST(Ops, RmsNormBothKindsAndGated) {
  const int64_t M = 5, D = 24;
  Tensor x = g_draws.randn({M, D}), w = g_draws.randn({D}, 0.3f), z = g_draws.randn({M, D});
  for (auto kind : {RmsNormKind::ZeroCentered, RmsNormKind::Plain}) {
    Tensor y = poisoned_f32({M, D});
    rms_norm(x, w, 1e-6f, kind, y);
    Tensor ref = Tensor::empty({M, D}, DType::F64);
    for (int m = 0; m < M; ++m) {
      double ss = 0;
      for (int d = 0; d < D; ++d) ss += double(at(x, m * D + d)) * at(x, m * D + d);
      double inv = 1 / std::sqrt(ss / D + 1e-6);
      for (int d = 0; d < D; ++d)
        ref.data<double>()[m * D + d] =
            at(x, m * D + d) * inv * (kind == RmsNormKind::ZeroCentered ? 1.0 + at(w, d) : at(w, d));
    }
    EXPECT_LT(max_rel_err(y, ref), 1e-6);
  }
  Tensor y = poisoned_f32({M, D});
  gated_rms_norm(x, z, w, 1e-6f, y);
  for (int m = 0; m < M; ++m) {
    double ss = 0;
    for (int d = 0; d < D; ++d) ss += double(at(x, m * D + d)) * at(x, m * D + d);
    for (int d = 0; d < D; ++d) {
      double zz = at(z, m * D + d);
      double want = at(x, m * D + d) / std::sqrt(ss / D + 1e-6) * at(w, d) * zz / (1 + std::exp(-zz));
      EXPECT_NEAR(at(y, m * D + d), want, 1e-5);
    }
  }
}

TEST(Ops, CausalConvRespectsSequenceStarts) {
  for (int64_t K : {1, 2, 3, 4}) {
    SeqOffsets seqs = offsets_of({1, 5, 2, 9});
    const int64_t N = seqs.total_tokens(), C = 7;
    Tensor x = g_draws.randn({N, C}), w = g_draws.randn({C, K}), y = poisoned_f32({N, C});
    causal_conv1d(x, w, seqs, /*silu=*/true, y);
    for (int64_t s = 0; s < seqs.num_sequences(); ++s)
      for (int64_t t = seqs.offsets[s]; t < seqs.offsets[s + 1]; ++t)
        for (int64_t c = 0; c < C; ++c) {
          double acc = 0;
          for (int64_t j = 0; j < K; ++j) {
            int64_t src = t - (K - 1) + j;
            if (src >= seqs.offsets[s]) acc += double(at(w, c * K + j)) * at(x, src * C + c);
          }
          EXPECT_NEAR(at(y, t * C + c), acc / (1 + std::exp(-acc)), 1e-5) << "K=" << K << " t=" << t;
        }
  }
}

TEST(Ops, RopeRotatesOnlyTheRotaryDims) {
  SeqOffsets seqs = offsets_of({3, 4});
  Tensor x = g_draws.randn({7, 2, 16}), y = x.clone();
  rope_neox_inplace(y, seqs, 8, 10000.0);
  for (int64_t t = 0; t < 7; ++t) {
    const int64_t pos = t < 3 ? t : t - 3;
    for (int64_t h = 0; h < 2; ++h) {
      const float* a = x.data<float>() + (t * 2 + h) * 16;
      const float* b = y.data<float>() + (t * 2 + h) * 16;
      for (int i = 0; i < 4; ++i) {
        double ang = pos * std::pow(10000.0, -2.0 * i / 8);
        EXPECT_NEAR(b[i], a[i] * std::cos(ang) - a[i + 4] * std::sin(ang), 1e-5);
        EXPECT_NEAR(b[i + 4], a[i + 4] * std::cos(ang) + a[i] * std::sin(ang), 1e-5);
      }
      for (int i = 8; i < 16; ++i) EXPECT_EQ(b[i], a[i]);  // pass-through dims untouched
    }
  }
  EXPECT_THROW(rope_neox_inplace(y, seqs, 7, 1e4), Error);
}

TEST(Ops, CausalAttentionGqaMatchesSoftmaxFormula) {
  SeqOffsets seqs = offsets_of({1, 6, 3});
  const int64_t N = seqs.total_tokens(), Hq = 6, Hkv = 2, D = 8;
  Tensor q = g_draws.randn({N, Hq, D}), k = g_draws.randn({N, Hkv, D}), v = g_draws.randn({N, Hkv, D}), o = poisoned_f32({N, Hq, D});
  const float scale = 0.35f;
  causal_attention(q, k, v, seqs, scale, o);
  Tensor ref = Tensor::empty({N, Hq, D}, DType::F64);
  for (int64_t s = 0; s < seqs.num_sequences(); ++s)
    for (int64_t t = seqs.offsets[s]; t < seqs.offsets[s + 1]; ++t)
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t kh = h / (Hq / Hkv);
        std::vector<double> p;
        double mx = -1e300, den = 0;
        for (int64_t j = seqs.offsets[s]; j <= t; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += double(at(q, (t * Hq + h) * D + d)) * at(k, (j * Hkv + kh) * D + d);
          p.push_back(dot * scale);
          mx = std::max(mx, p.back());
        }
        for (double& e : p) den += (e = std::exp(e - mx));
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t j = seqs.offsets[s]; j <= t; ++j)
            acc += p[size_t(j - seqs.offsets[s])] / den * at(v, (j * Hkv + kh) * D + d);
          ref.data<double>()[(t * Hq + h) * D + d] = acc;
        }
      }
  EXPECT_LT(max_rel_err(o, ref), 1e-5);
}

TEST(Ops, GdnGatesMatchFormula) {
  Tensor a = g_draws.randn({9, 3}, 5.0f), b = g_draws.randn({9, 3}), A_log = g_draws.randn({3}), dt = g_draws.randn({3});
  a.data<float>()[0] = 40.0f;  // beyond softplus' threshold
  Tensor g = poisoned_f32({9, 3}), beta = poisoned_f32({9, 3});
  gdn_gates(a, b, A_log, dt, g, beta);
  for (int64_t i = 0; i < 27; ++i) {
    double x = double(at(a, i)) + at(dt, i % 3);
    double sp = x > 20 ? x : std::log1p(std::exp(x));
    EXPECT_NEAR(at(g, i), -std::exp(double(at(A_log, i % 3))) * sp, 1e-4 * (1 + std::abs(at(g, i))));
    EXPECT_NEAR(at(beta, i), 1 / (1 + std::exp(-double(at(b, i)))), 1e-6);
  }
}

TEST(Ops, EmbeddingRejectsOutOfVocabIds) {
  Tensor table = g_draws.randn({10, 4});
  std::vector<int32_t> ids{0, 9, 3};
  Tensor it = Tensor::from_blob(ids.data(), {3}, DType::I32), y = poisoned_f32({3, 4});
  embedding(it, table, y);
  for (int d = 0; d < 4; ++d) EXPECT_EQ(at(y, 4 + d), at(table, 36 + d));
  ids[2] = 10;
  try {
    embedding(it, table, y);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 10 at position 2"), std::string::npos) << e.what();
  }
}

// The chunked (UT transform) and token-recurrent delta rules compute the same function: packed
// sequences of awkward lengths (1, chunk - 1, chunk, chunk + 1, several chunks), GVA ratios 1-3,
// with and without an initial state, several chunk sizes.
TEST(Ops, DeltaRuleChunkedEqualsRecurrent) {
  struct Case { std::vector<int64_t> lens; int64_t Hk, Hv, dk, dv, chunk; bool init; };
  for (const Case& cs : {Case{{1}, 1, 1, 8, 8, 64, false}, Case{{63, 64, 65}, 2, 4, 16, 24, 64, true},
                         Case{{130, 7}, 2, 6, 32, 16, 64, false}, Case{{33, 1, 50}, 3, 3, 8, 12, 16, true},
                         Case{{5}, 1, 2, 4, 4, 1, true}}) {
    SeqOffsets seqs = offsets_of(cs.lens);
    const int64_t N = seqs.total_tokens(), S = seqs.num_sequences();
    DeltaRuleParams p;
    p.q = g_draws.randn({N, cs.Hk, cs.dk});
    p.k = g_draws.randn({N, cs.Hk, cs.dk});
    p.v = g_draws.randn({N, cs.Hv, cs.dv});
    p.g = g_draws.uniform({N, cs.Hv}, -2.0f, 0.0f);
    p.beta = g_draws.uniform({N, cs.Hv}, 0.0f, 1.0f);
    if (cs.init) p.initial_state = g_draws.randn({S, cs.Hv, cs.dk, cs.dv}, 0.5f);
    p.chunk_size = cs.chunk;
    Tensor oc = poisoned_f32({N, cs.Hv, cs.dv}), orr = poisoned_f32({N, cs.Hv, cs.dv});
    Tensor sc = poisoned_f32({S, cs.Hv, cs.dk, cs.dv}), sr = poisoned_f32({S, cs.Hv, cs.dk, cs.dv});
    gated_delta_rule(p, seqs, DeltaRuleAlgo::Chunked, oc, &sc);
    gated_delta_rule(p, seqs, DeltaRuleAlgo::Recurrent, orr, &sr);
    EXPECT_LT(max_rel_err(oc, orr), 2e-5) << "N=" << N << " chunk=" << cs.chunk;
    EXPECT_LT(max_rel_err(sc, sr), 2e-5) << "N=" << N << " chunk=" << cs.chunk;
  }
}

// The delta rule against transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule
// (tests/data/hf/gdn_ops.safetensors, made by tests/reference/make_golden.py): B = 2 sequences of
// 130 tokens, Hk = 2, Hv = 4, dk = 16, dv = 24, an initial state, q/k l2-normalised by the op.
TEST(Ops, DeltaRuleMatchesTransformers) {
  const std::string path = std::string(DFLASH_TEST_DATA_DIR) + "/hf/gdn_ops.safetensors";
  io::SafetensorsFile f = io::SafetensorsFile::open(path);
  auto packed = [&](const char* name) {  // [B, T, ...] -> [B*T, ...]
    Tensor t = f.tensor(name).to_dtype(DType::F32);
    Shape s = t.shape();
    Shape ps{s[0] * s[1]};
    ps.insert(ps.end(), s.begin() + 2, s.end());
    return t.view(ps);
  };
  DeltaRuleParams p;
  p.q = packed("q");
  p.k = packed("k");
  p.v = packed("v");
  p.g = packed("g");
  p.beta = packed("beta");
  p.initial_state = f.tensor("initial_state").to_dtype(DType::F32);
  const int64_t B = 2, T = 130, Hv = 4, dv = 24;
  SeqOffsets seqs = offsets_of({T, T});
  Tensor hf_out = f.tensor("out_chunk").to_dtype(DType::F32);  // [B, T, Hv, dv]
  Tensor exact = f.tensor("out_f64").to_dtype(DType::F64);
  Tensor exact_state = f.tensor("state_f64").to_dtype(DType::F64);
  for (auto algo : {DeltaRuleAlgo::Chunked, DeltaRuleAlgo::Recurrent}) {
    Tensor o = poisoned_f32({B * T, Hv, dv}), s = poisoned_f32(p.initial_state.shape());
    gated_delta_rule(p, seqs, algo, o, &s);
    const double e_hf = max_rel_err(o, hf_out), e_exact = max_rel_err(o, exact), e_state = max_rel_err(s, exact_state);
    std::printf("delta rule %s: max rel err vs transformers f32 %.2e, vs f64 %.2e, state vs f64 %.2e\n",
                algo == DeltaRuleAlgo::Chunked ? "chunked" : "recurrent", e_hf, e_exact, e_state);
    EXPECT_LT(e_hf, 1e-5);
    EXPECT_LT(e_exact, 1e-5);
    EXPECT_LT(e_state, 1e-5);
  }
}

TEST(Ops, DeltaRuleValidatesShapes) {
  SeqOffsets seqs = offsets_of({4});
  DeltaRuleParams p;
  p.q = g_draws.randn({4, 2, 8});
  p.k = g_draws.randn({4, 2, 8});
  p.v = g_draws.randn({4, 3, 8});  // 3 value heads do not group over 2 key heads
  p.g = g_draws.randn({4, 3});
  p.beta = g_draws.randn({4, 3});
  Tensor o = poisoned_f32({4, 3, 8});
  EXPECT_THROW(gated_delta_rule(p, seqs, DeltaRuleAlgo::Chunked, o), Error);
  SeqOffsets wrong = offsets_of({3});
  p.v = g_draws.randn({4, 4, 8});
  p.g = g_draws.randn({4, 4});
  p.beta = g_draws.randn({4, 4});
  Tensor o2 = poisoned_f32({4, 4, 8});
  EXPECT_THROW(gated_delta_rule(p, wrong, DeltaRuleAlgo::Chunked, o2), Error);
}
