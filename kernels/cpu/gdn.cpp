// CPU reference for the gated delta rule: the token-recurrent form and the chunked (WY / UT
// transform) form. They compute the same function; tests hold them to each other and to
// transformers' torch implementation.
//
// Chunked form, per chunk of L <= C tokens with cumulative log-decay G_i = g_0 + ... + g_i:
//   A_ij   = beta_i (k_i . k_j) exp(G_i - G_j)            for j < i   (strictly lower)
//   (I + A) U = beta * V,   (I + A) W = beta * exp(G) * K  (forward substitution)
//   V'     = U - W S                                      (the part of V the state does not predict)
//   O      = exp(G) * Q S + tril((Q K^T) * exp(G_i - G_j)) V'
//   S     <- exp(G_{L-1}) S + (exp(G_{L-1} - G) * K)^T V'
#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/cpu/gemm.h"

namespace dflash::ops {

namespace {

struct Dims {
  int64_t N, Hk, Hv, dk, dv, S;
};

// Copies q/k of one (token range, key head) into dense [L, dk] buffers, L2-normalised if asked,
// q scaled.
void gather_qk(const float* src, int64_t t0, int64_t L, int64_t Hk, int64_t kh, int64_t dk, bool l2, float scale,
               float* dst) {
  for (int64_t i = 0; i < L; ++i) {
    const float* row = src + ((t0 + i) * Hk + kh) * dk;
    float inv = 1.0f;
    if (l2) {
      float ss = 0;
      for (int64_t d = 0; d < dk; ++d) ss += row[d] * row[d];
      inv = 1.0f / std::sqrt(ss + 1e-6f);
    }
    for (int64_t d = 0; d < dk; ++d) dst[i * dk + d] = row[d] * inv * scale;
  }
}

void recurrent_head(const DeltaRuleParams& p, const Dims& dm, int64_t begin, int64_t end, int64_t h, float scale,
                    float* state /* [dk, dv] */, float* out) {
  const int64_t kh = h / (dm.Hv / dm.Hk), dk = dm.dk, dv = dm.dv;
  const float* V = p.v.data<float>();
  const float* G = p.g.data<float>();
  const float* B = p.beta.data<float>();
  std::vector<float> q(static_cast<size_t>(dk)), k(static_cast<size_t>(dk)), kv(static_cast<size_t>(dv));
  for (int64_t t = begin; t < end; ++t) {
    gather_qk(p.q.data<float>(), t, 1, dm.Hk, kh, dk, p.l2norm_qk, scale, q.data());
    gather_qk(p.k.data<float>(), t, 1, dm.Hk, kh, dk, p.l2norm_qk, 1.0f, k.data());
    const float decay = std::exp(G[t * dm.Hv + h]);
    const float beta = B[t * dm.Hv + h];
    const float* v = V + (t * dm.Hv + h) * dv;
    for (int64_t i = 0; i < dk * dv; ++i) state[i] *= decay;
    std::fill(kv.begin(), kv.end(), 0.0f);
    for (int64_t a = 0; a < dk; ++a)
      for (int64_t c = 0; c < dv; ++c) kv[static_cast<size_t>(c)] += state[a * dv + c] * k[static_cast<size_t>(a)];
    for (int64_t c = 0; c < dv; ++c) kv[static_cast<size_t>(c)] = (v[c] - kv[static_cast<size_t>(c)]) * beta;
    for (int64_t a = 0; a < dk; ++a)
      for (int64_t c = 0; c < dv; ++c) state[a * dv + c] += k[static_cast<size_t>(a)] * kv[static_cast<size_t>(c)];
    float* o = out + (t * dm.Hv + h) * dv;
    for (int64_t c = 0; c < dv; ++c) {
      float acc = 0;
      for (int64_t a = 0; a < dk; ++a) acc += state[a * dv + c] * q[static_cast<size_t>(a)];
      o[c] = acc;
    }
  }
}

void chunked_head(const DeltaRuleParams& p, const Dims& dm, int64_t begin, int64_t end, int64_t h, float scale,
                  float* S /* [dk, dv] */, float* out) {
  const int64_t kh = h / (dm.Hv / dm.Hk), dk = dm.dk, dv = dm.dv, C = p.chunk_size;
  const float* V = p.v.data<float>();
  const float* Gp = p.g.data<float>();
  const float* Bp = p.beta.data<float>();
  std::vector<float> q(static_cast<size_t>(C * dk)), k(static_cast<size_t>(C * dk));
  std::vector<float> G(static_cast<size_t>(C)), beta(static_cast<size_t>(C));
  std::vector<float> A(static_cast<size_t>(C * C)), U(static_cast<size_t>(C * dv)), W(static_cast<size_t>(C * dk));
  std::vector<float> Vn(static_cast<size_t>(C * dv));
  auto at = [](std::vector<float>& m, int64_t r, int64_t c, int64_t cols) -> float& {
    return m[static_cast<size_t>(r * cols + c)];
  };
  for (int64_t t0 = begin; t0 < end; t0 += C) {
    const int64_t L = std::min(C, end - t0);
    gather_qk(p.q.data<float>(), t0, L, dm.Hk, kh, dk, p.l2norm_qk, scale, q.data());
    gather_qk(p.k.data<float>(), t0, L, dm.Hk, kh, dk, p.l2norm_qk, 1.0f, k.data());
    float cum = 0;
    for (int64_t i = 0; i < L; ++i) {
      cum += Gp[(t0 + i) * dm.Hv + h];
      G[static_cast<size_t>(i)] = cum;
      beta[static_cast<size_t>(i)] = Bp[(t0 + i) * dm.Hv + h];
    }
    // A (strictly lower) and the right-hand sides.
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j < i; ++j) {
        float dot = 0;
        for (int64_t d = 0; d < dk; ++d) dot += at(k, i, d, dk) * at(k, j, d, dk);
        at(A, i, j, C) = beta[static_cast<size_t>(i)] * dot * std::exp(G[static_cast<size_t>(i)] - G[static_cast<size_t>(j)]);
      }
      const float* v = V + ((t0 + i) * dm.Hv + h) * dv;
      for (int64_t c = 0; c < dv; ++c) at(U, i, c, dv) = beta[static_cast<size_t>(i)] * v[c];
      const float eg = std::exp(G[static_cast<size_t>(i)]);
      for (int64_t d = 0; d < dk; ++d) at(W, i, d, dk) = beta[static_cast<size_t>(i)] * eg * at(k, i, d, dk);
    }
    // Forward substitution: row i -= sum_{j<i} A_ij row j (rows j already solved).
    for (int64_t i = 1; i < L; ++i)
      for (int64_t j = 0; j < i; ++j) {
        const float a = at(A, i, j, C);
        for (int64_t c = 0; c < dv; ++c) at(U, i, c, dv) -= a * at(U, j, c, dv);
        for (int64_t d = 0; d < dk; ++d) at(W, i, d, dk) -= a * at(W, j, d, dk);
      }
    // V' = U - W S
    for (int64_t i = 0; i < L; ++i)
      for (int64_t c = 0; c < dv; ++c) {
        float acc = at(U, i, c, dv);
        for (int64_t d = 0; d < dk; ++d) acc -= at(W, i, d, dk) * S[d * dv + c];
        at(Vn, i, c, dv) = acc;
      }
    // O = exp(G) Q S + tril(Q K^T * decay) V'
    for (int64_t i = 0; i < L; ++i) {
      float* o = out + ((t0 + i) * dm.Hv + h) * dv;
      const float eg = std::exp(G[static_cast<size_t>(i)]);
      for (int64_t c = 0; c < dv; ++c) {
        float acc = 0;
        for (int64_t d = 0; d < dk; ++d) acc += at(q, i, d, dk) * S[d * dv + c];
        o[c] = acc * eg;
      }
      for (int64_t j = 0; j <= i; ++j) {
        float dot = 0;
        for (int64_t d = 0; d < dk; ++d) dot += at(q, i, d, dk) * at(k, j, d, dk);
        const float w = dot * std::exp(G[static_cast<size_t>(i)] - G[static_cast<size_t>(j)]);
        for (int64_t c = 0; c < dv; ++c) o[c] += w * at(Vn, j, c, dv);
      }
    }
    // S <- exp(G_last) S + (exp(G_last - G) K)^T V'
    const float glast = G[static_cast<size_t>(L - 1)];
    const float chunk_decay = std::exp(glast);
    for (int64_t i = 0; i < dk * dv; ++i) S[i] *= chunk_decay;
    for (int64_t j = 0; j < L; ++j) {
      const float w = std::exp(glast - G[static_cast<size_t>(j)]);
      for (int64_t d = 0; d < dk; ++d) {
        const float kd = at(k, j, d, dk) * w;
        for (int64_t c = 0; c < dv; ++c) S[d * dv + c] += kd * at(Vn, j, c, dv);
      }
    }
  }
}

}  // namespace

void gated_delta_rule(const DeltaRuleParams& p, const SeqOffsets& seqs, DeltaRuleAlgo algo, Tensor& out,
                      Tensor* final_state) {
  using detail::require_host_f32;
  using detail::require_shape;
  const char* op = "gated_delta_rule";
  for (auto [t, name] : {std::pair{&p.q, "q"}, {&p.k, "k"}, {&p.v, "v"}, {&p.g, "g"}, {&p.beta, "beta"}, {&out, "out"}})
    require_host_f32(*t, op, name);
  DFLASH_CHECK(p.q.dim() == 3 && p.v.dim() == 3, op << ": q [N, Hk, dk] and v [N, Hv, dv] expected, got "
                                                    << p.q.describe() << ", " << p.v.describe());
  Dims dm{p.q.size(0), p.q.size(1), p.v.size(1), p.q.size(2), p.v.size(2), seqs.num_sequences()};
  require_shape(p.k, {dm.N, dm.Hk, dm.dk}, op, "k");
  require_shape(p.v, {dm.N, dm.Hv, dm.dv}, op, "v");
  require_shape(p.g, {dm.N, dm.Hv}, op, "g");
  require_shape(p.beta, {dm.N, dm.Hv}, op, "beta");
  require_shape(out, {dm.N, dm.Hv, dm.dv}, op, "out");
  DFLASH_CHECK(dm.Hk > 0 && dm.Hv % dm.Hk == 0,
               op << ": " << dm.Hv << " value heads are not a multiple of " << dm.Hk << " key heads");
  DFLASH_CHECK(algo != DeltaRuleAlgo::Chunked || p.chunk_size >= 1, op << ": chunk_size must be >= 1");
  seqs.validate(dm.N, op);
  const Shape state_shape{dm.S, dm.Hv, dm.dk, dm.dv};
  if (p.initial_state.defined()) {
    require_host_f32(p.initial_state, op, "initial_state");
    require_shape(p.initial_state, state_shape, op, "initial_state");
  }
  if (final_state != nullptr) {
    require_host_f32(*final_state, op, "final_state");
    require_shape(*final_state, state_shape, op, "final_state");
  }
  const float scale = p.scale > 0 ? p.scale : 1.0f / std::sqrt(static_cast<float>(dm.dk));
  // Every (sequence, value head) is its own recurrence writing its own rows of out and its own state:
  // they run on the CPU backend's worker threads, the same bits on any thread count.
  cpu::parallel_for(dm.S * dm.Hv, [&](int64_t sh) {
    const int64_t s = sh / dm.Hv, h = sh % dm.Hv;
    std::vector<float> state(static_cast<size_t>(dm.dk * dm.dv));
    const int64_t soff = sh * dm.dk * dm.dv;
    if (p.initial_state.defined())
      std::copy_n(p.initial_state.data<float>() + soff, dm.dk * dm.dv, state.begin());
    if (algo == DeltaRuleAlgo::Chunked)
      chunked_head(p, dm, seqs.offsets[s], seqs.offsets[s + 1], h, scale, state.data(), out.data<float>());
    else
      recurrent_head(p, dm, seqs.offsets[s], seqs.offsets[s + 1], h, scale, state.data(), out.data<float>());
    if (final_state != nullptr) std::copy(state.begin(), state.end(), final_state->data<float>() + soff);
  });
}

}  // namespace dflash::ops
