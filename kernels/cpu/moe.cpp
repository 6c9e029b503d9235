// CPU reference of the mixture-of-experts ops (kernels/ops.h): qwen3_5_moe's router and experts,
// in f32, in the order transformers 5.17's Qwen3_5MoeTopKRouter / Qwen3_5MoeExperts compute them.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/fp8.h"
#include "kernels/cpu/common.h"
#include "kernels/cpu/train_ops.h"

namespace dflash::ops {

using detail::require_host_f32;
using detail::require_shape;

namespace {

float dot(const float* a, const float* b, int64_t K) {
  float s = 0;
  for (int64_t k = 0; k < K; ++k) s += a[k] * b[k];
  return s;
}

}  // namespace

void moe_route_logits(const Tensor& logits, int64_t top_k, bool renormalize, MoeRouting& r) {
  require_host_f32(logits, "moe_route_logits", "logits");
  DFLASH_CHECK(logits.dim() == 2, "moe_route_logits: logits " << logits.describe() << " must be [N, E]");
  const int64_t N = logits.size(0), E = logits.size(1);
  DFLASH_CHECK(top_k >= 1 && top_k <= E, "moe_route: top_k " << top_k << " must be in [1, " << E << "]");
  r.experts = Tensor::empty({N, top_k}, DType::I32);
  r.weights = Tensor::empty({N, top_k}, DType::F32);
  r.logits = logits.contiguous().clone();
  const float* L = r.logits.data<float>();
  std::vector<float> p(static_cast<size_t>(E));
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    float mx = -INFINITY;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, p[e] = L[n * E + e]);
    float sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - mx));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float chosen = 0;
    for (int64_t j = 0; j < top_k; ++j) chosen += p[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      r.experts.data<int32_t>()[n * top_k + j] = order[j];
      r.weights.data<float>()[n * top_k + j] = renormalize ? p[order[j]] / chosen : p[order[j]];
    }
  }
}

void moe_route(const Tensor& x, const Tensor& router, int64_t top_k, bool renormalize, MoeRouting& r) {
  require_host_f32(x, "moe_route", "x");
  require_host_f32(router, "moe_route", "router");
  DFLASH_CHECK(x.dim() == 2 && router.dim() == 2 && router.size(1) == x.size(1),
               "moe_route: x " << x.describe() << " and router " << router.describe() << " must be [N, H] and [E, H]");
  const int64_t N = x.size(0), H = x.size(1), E = router.size(0);
  DFLASH_CHECK(top_k >= 1 && top_k <= E, "moe_route: top_k " << top_k << " must be in [1, " << E << "]");
  Tensor logits = Tensor::empty({N, E}, DType::F32);
  const float* X = x.data<float>();
  const float* W = router.data<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) logits.data<float>()[n * E + e] = dot(X + n * H, W + e * H, H);
  moe_route_logits(logits, top_k, renormalize, r);
}

int64_t moe_experts(const Tensor& x, const Tensor& gate_up, const Tensor& down, const MoeRouting& r, Tensor& y,
                    int64_t expert_begin, int64_t num_experts, bool fp8_act) {
  require_host_f32(x, "moe_experts", "x");
  require_host_f32(gate_up, "moe_experts", "gate_up");
  require_host_f32(down, "moe_experts", "down");
  require_host_f32(y, "moe_experts", "y");
  require_host_f32(r.weights, "moe_experts", "weights");
  DFLASH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3,
               "moe_experts: x " << x.describe() << ", gate_up " << gate_up.describe() << ", down " << down.describe()
                                 << " must be [N, H], [E, 2I, H], [E, H, I]");
  const int64_t N = x.size(0), H = x.size(1), E = gate_up.size(0), I = gate_up.size(1) / 2;
  DFLASH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == H, "moe_experts: gate_up " << gate_up.describe()
                                                                   << " is not [E, 2I, " << H << "]");
  require_shape(down, {E, H, I}, "moe_experts", "down");
  require_shape(y, {N, H}, "moe_experts", "y");
  DFLASH_CHECK(r.experts.defined() && r.experts.device().is_cpu() && r.experts.dtype() == DType::I32 &&
                   r.experts.dim() == 2 && r.experts.size(0) == N,
               "moe_experts: experts must be [" << N << ", k] i32 on the host, got " << r.experts.describe());
  const int64_t k = r.experts.size(1);
  require_shape(r.weights, {N, k}, "moe_experts", "weights");
  const int64_t total = num_experts > 0 ? num_experts : E;
  DFLASH_CHECK(expert_begin >= 0 && expert_begin + E <= total, "moe_experts: experts [" << expert_begin << ", "
                                                                  << expert_begin + E << ") are not within [0, " << total << ")");
  const int32_t* ex = r.experts.data<int32_t>();
  const float* wt = r.weights.data<float>();
  // Tokens per held expert, in token order (transformers gathers each expert's tokens the same way).
  std::vector<std::vector<int64_t>> hits(static_cast<size_t>(E));  // flat (n * k + j)
  int64_t ran = 0;
  for (int64_t i = 0; i < N * k; ++i) {
    DFLASH_CHECK(ex[i] >= 0 && ex[i] < total, "moe_experts: expert index " << ex[i] << " (token " << i / k
                                                                            << ") is outside [0, " << total << ")");
    const int64_t e = ex[i] - expert_begin;
    if (e < 0 || e >= E) continue;  // another expert-parallel shard's
    hits[static_cast<size_t>(e)].push_back(i);
    ++ran;
  }
  const Tensor xq = fp8_act ? fake_quantize_fp8_act(x) : Tensor();  // W8A8: the tokens' quantized values
  const float* X = fp8_act ? xq.data<float>() : x.data<float>();
  const float* GU = gate_up.data<float>();
  const float* D = down.data<float>();
  float* Y = y.data<float>();
  std::fill(Y, Y + N * H, 0.0f);
  std::vector<float> act(static_cast<size_t>(I));
  for (int64_t e = 0; e < E; ++e) {
    const float* gu = GU + e * 2 * I * H;
    const float* dn = D + e * H * I;
    for (int64_t i : hits[static_cast<size_t>(e)]) {
      const int64_t n = i / k;
      const float* xr = X + n * H;
      for (int64_t c = 0; c < I; ++c) act[c] = detail::silu(dot(xr, gu + c * H, H)) * dot(xr, gu + (I + c) * H, H);
      if (fp8_act) cpu::fake_quantize_e4m3(act.data(), 1, I, 1, fp8::kBlock);
      const float w = wt[i];
      for (int64_t h = 0; h < H; ++h) Y[n * H + h] += dot(act.data(), dn + h * I, I) * w;
    }
  }
  return ran;
}

void add_sigmoid_gated(const Tensor& x, const Tensor& gate, Tensor& y) {
  require_host_f32(x, "add_sigmoid_gated", "x");
  require_host_f32(gate, "add_sigmoid_gated", "gate");
  require_host_f32(y, "add_sigmoid_gated", "y");
  DFLASH_CHECK(x.dim() == 2, "add_sigmoid_gated: x must be [N, D], got " << x.describe());
  const int64_t N = x.size(0), Dm = x.size(1);
  require_shape(gate, {N, 1}, "add_sigmoid_gated", "gate");
  require_shape(y, {N, Dm}, "add_sigmoid_gated", "y");
  const float* X = x.data<float>();
  const float* G = gate.data<float>();
  float* Y = y.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    const float s = detail::sigmoid(G[n]);
    for (int64_t d = 0; d < Dm; ++d) Y[n * Dm + d] += s * X[n * Dm + d];
  }
}

}  // namespace dflash::ops
