// The MoE block of a decode / verify step (moe.h, MoeImpl::Decode): N <= 16 token rows, of which the
// first `routed` belong to sequences. Three kernels, each a warp per weight row (or output column)
// streaming that row once against the few token rows, in place of the grouped path's eleven launches
// (router GEMM, count reset, top-k, scan, scatter, two grouped GEMMs, the shared expert's two GEMMs
// and SwiGLU, the combine).
//
// Roofline at Qwen3.6-35B-A3B shapes (H 2048, E 256, k 8, I = Is = 512), one routed token: the router
// 1 MB, 8 experts' gate|up 8 x 4 MB and down 8 x 2 MB, the shared expert 6 MB: 55.6 MB, 13.1 us at
// 4.24 TB/s; a 16-token verify reads the ~100 distinct experts of its 128 choices (~0.6 GB). The
// grouped path measured 92 us a block at one token (h200-moe5-441b581: expert GEMMs 46.5 us at
// 1,083 GB/s, the rest ~10 dependent small launches).
//
// Loads (moe_dots.cuh): a lane owns the 16-byte units lane + 32·m of a row and issues kB of them per row before
// using any (16 loads of 16 bytes in flight a lane in the routed gate|up warps: 8 KB a warp). Every
// (row, token) dot product is summed in an order fixed by K alone (the lane's units in order, then
// the warp's xor butterfly), so a token's values do not depend on N or on the other tokens.
// Plain C++ (no PTX): test_moe_emulated runs these kernels on the CPU in CI (tests/cuda_emulation.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "core/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/emulatable.cuh"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_fp8.cuh"
#include "kernels/cuda/moe_dots.cuh"
#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/moe_topk.cuh"
#include "kernels/cuda/vec.cuh"

namespace dflash::cuda {

namespace {

using vec::bf16;
using moe_detail::Bf16Row;
using moe_detail::dots;
using moe_detail::Fp8Row;
using moe_detail::ldg16;
using moe_detail::pair_dots;

constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kMaxT = static_cast<int>(kMoeDecodeMaxRows);

struct DecParams {
  const bf16* x;  // [N, H]
  int N, routed, H, E, k, I, Is;
  int e0, El;                // this rank's experts [e0, e0 + El) (expert parallelism; 0, E: all)
  bool renorm;
  bool routed_before;        // topk_kernel routed every token first (else each gate|up block routes its own)
  const bf16* router;        // [E, H]
  const bf16* gate_w;        // [H] or nullptr (no shared expert)
  const float* route_by;     // the logits top-k reads: the router's, or forced ones
  const void* gate_up;       // [El, 2I, H] bf16, or e4m3 codes with gate_up_scale
  const void* down;          // [El, H, I]
  // FP8 experts (moe_fp8.cuh): the block scales [El, 2·ceil(I/128), ceil(H/128)] and [El, ceil(H/128),
  // ceil(I/128)]; nullptr: bf16 experts.
  const float* gate_up_scale;
  const float* down_scale;
  const bf16* shared_gu;     // [2 Is, H] or nullptr
  const bf16* shared_down;   // [H, Is]
  float* logits;             // [N, E]
  float* gate_logit;         // [N]
  int32_t* experts;          // [routed, k]
  float* weights;            // [routed, k]
  bf16* act;                 // [routed·k, I]
  bf16* sact;                // [routed, Is]
  bf16* out;                 // [N, H]
  int col_blocks;            // ceil(I / kWarps): gate|up blocks per routed (token, choice)
};

// Warp `row` of the grid: row < E router row `row`, row == E the shared gate; every token n < N.
// The grid's threads also write the pad rows' zeros (n >= routed: no down block runs for them).
__global__ void __launch_bounds__(kThreads) router_kernel(const DecParams p) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int row = static_cast<int>(blockIdx.x) * kWarps + (static_cast<int>(threadIdx.x) >> 5);
  {
    const int64_t units = static_cast<int64_t>(p.N - p.routed) * p.H / 8, stride = int64_t{gridDim.x} * kThreads;
    uint4* pad = reinterpret_cast<uint4*>(p.out + static_cast<int64_t>(p.routed) * p.H);
    for (int64_t u = int64_t{blockIdx.x} * kThreads + threadIdx.x; u < units; u += stride) pad[u] = make_uint4(0, 0, 0, 0);
  }
  if (row > p.E || (row == p.E && !p.gate_w)) return;
  const Bf16Row w[1] = {{row < p.E ? p.router + static_cast<int64_t>(row) * p.H : p.gate_w}};
  float acc[1][kMaxT];
  dots<Bf16Row, 1, kMaxT, 4>(w, p.x, p.H, p.N, p.H, lane, acc);
#pragma unroll
  for (int t = 0; t < kMaxT; ++t) {
    if (t < p.N) {
      const float s = vec::warp_sum(acc[0][t]);
      if (lane == 0) {
        if (row < p.E) p.logits[static_cast<int64_t>(t) * p.E + row] = s;
        else p.gate_logit[t] = s;
      }
    }
  }
}

// One warp per routed token: its top-k into experts / weights (many routed tokens: a verify, where
// the gate|up blocks would otherwise route their token 8 x col_blocks times over).
__global__ void __launch_bounds__(kThreads) topk_kernel(const DecParams p) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int n = static_cast<int>(blockIdx.x) * kWarps + (static_cast<int>(threadIdx.x) >> 5);
  if (n >= p.routed) return;
  int my_e = -1;
  float my_w = 0;
  moe_detail::warp_topk(p.route_by + static_cast<int64_t>(n) * p.E, p.E, p.k, p.renorm, lane, my_e, my_w);
  if (lane < p.k) {
    p.experts[static_cast<int64_t>(n) * p.k + lane] = my_e;
    p.weights[static_cast<int64_t>(n) * p.k + lane] = my_w;
  }
}

// Expert e's row `row` of gate|up ([2I, H]: gate rows, then up rows) and of down ([H, I]).
template <class W>
__device__ __forceinline__ W gate_up_row(const DecParams& p, int e, int row);
template <>
__device__ __forceinline__ Bf16Row gate_up_row<Bf16Row>(const DecParams& p, int e, int row) {
  return {static_cast<const bf16*>(p.gate_up) + (static_cast<int64_t>(e) * 2 * p.I + row) * p.H};
}
template <>
__device__ __forceinline__ Fp8Row gate_up_row<Fp8Row>(const DecParams& p, int e, int row) {
  const int rb = moe_detail::fp8_row_blocks(2 * p.I, p.I), kb = (p.H + 127) / 128;
  return {static_cast<const uint8_t*>(p.gate_up) + (static_cast<int64_t>(e) * 2 * p.I + row) * p.H,
          p.gate_up_scale + (static_cast<int64_t>(e) * rb + moe_detail::fp8_row_block(row, p.I)) * kb};
}
template <class W>
__device__ __forceinline__ W down_row(const DecParams& p, int e, int h);
template <>
__device__ __forceinline__ Bf16Row down_row<Bf16Row>(const DecParams& p, int e, int h) {
  return {static_cast<const bf16*>(p.down) + (static_cast<int64_t>(e) * p.H + h) * p.I};
}
template <>
__device__ __forceinline__ Fp8Row down_row<Fp8Row>(const DecParams& p, int e, int h) {
  const int rb = (p.H + 127) / 128, kb = (p.I + 127) / 128;
  return {static_cast<const uint8_t*>(p.down) + (static_cast<int64_t>(e) * p.H + h) * p.I,
          p.down_scale + (static_cast<int64_t>(e) * rb + h / 128) * kb};
}

// Blocks [0, routed·k·col_blocks): (column block, then token n and choice j): the token's choice j
// (routed by topk_kernel before, or here by warp 0), then a warp per act column c: act[n·k + j, c] = silu(x_n · gate_e[c]) * (x_n · up_e[c]). A column
// block's (token, choice) blocks are neighbours in launch order, so an expert chosen by several
// tokens of a verify has its rows read from memory once and from L2 by the others. The blocks after
// them: a warp per shared-expert column c for every routed token, with gemm_bf16's bf16 outputs and
// cuda::swiglu's silu.
template <class W>
__global__ void __launch_bounds__(kThreads) gate_up_kernel(const DecParams p) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int slots = p.routed * p.k, routed_blocks = slots * p.col_blocks;
  const int bid = static_cast<int>(blockIdx.x);
  if (bid < routed_blocks) {
    const int cb = bid / slots, r = bid - cb * slots;
    const int n = r / p.k, j = r - n * p.k;
    __shared__ int s_expert;
    if (p.routed_before) {
      if (threadIdx.x == 0) s_expert = p.experts[r];
    } else if (warp == 0) {
      int my_e = -1;
      float my_w = 0;
      moe_detail::warp_topk(p.route_by + static_cast<int64_t>(n) * p.E, p.E, p.k, p.renorm, lane, my_e, my_w);
      if (lane == j) s_expert = my_e;
      if (j == 0 && cb == 0 && lane < p.k) {  // one block writes token n's routing for the down kernel
        p.experts[static_cast<int64_t>(n) * p.k + lane] = my_e;
        p.weights[static_cast<int64_t>(n) * p.k + lane] = my_w;
      }
    }
    __syncthreads();
    const int c = cb * kWarps + warp, e = s_expert - p.e0;
    if (c >= p.I || e < 0 || e >= p.El) return;  // another rank's expert: no act row (the down kernel skips it)
    const W w[2] = {gate_up_row<W>(p, e, c), gate_up_row<W>(p, e, p.I + c)};
    float acc[2][1];
    dots<W, 2, 1, 8>(w, p.x + static_cast<int64_t>(n) * p.H, p.H, 1, p.H, lane, acc);
    const float g = vec::warp_sum(acc[0][0]), u = vec::warp_sum(acc[1][0]);
    if (lane == 0) p.act[static_cast<int64_t>(r) * p.I + c] = __float2bfloat16_rn(moe_detail::silu_expf(g) * u);
  } else {
    const int c = (bid - routed_blocks) * kWarps + warp;
    if (c >= p.Is) return;
    const Bf16Row w[2] = {{p.shared_gu + static_cast<int64_t>(c) * p.H}, {p.shared_gu + static_cast<int64_t>(p.Is + c) * p.H}};
    float acc[2][kMaxT];
    dots<Bf16Row, 2, kMaxT, 4>(w, p.x, p.H, p.routed, p.H, lane, acc);
#pragma unroll
    for (int t = 0; t < kMaxT; ++t) {
      if (t < p.routed) {
        const float g = vec::round_bf16(vec::warp_sum(acc[0][t])), u = vec::round_bf16(vec::warp_sum(acc[1][t]));
        if (lane == 0) p.sact[static_cast<int64_t>(t) * p.Is + c] = __float2bfloat16_rn(vec::silu(g) * u);
      }
    }
  }
}

// Block (routed token n, column block), a warp per output column h: moe_combine's sum of the k
// experts' bf16 down outputs, weighted in choice order, plus the sigmoid-gated bf16 shared down output
// (the tokens of a column block are launch neighbours: the rows they share come from L2).
template <class W>
__global__ void __launch_bounds__(kThreads) down_kernel(const DecParams p) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int n = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y) * kWarps + warp;
  // Token n's choices of this rank's experts, in choice order: local expert, weight, act row.
  __shared__ int32_t s_e[32], s_r[32];
  __shared__ float s_w[32];
  __shared__ int s_kn;
  if (warp == 0) {
    const bool mine = lane < p.k;
    const int e = mine ? p.experts[static_cast<int64_t>(n) * p.k + lane] - p.e0 : -1;
    const bool local = mine && e >= 0 && e < p.El;
    const unsigned ballot = __ballot_sync(0xffffffffu, local);
    if (local) {
      const int at = __popc(ballot & ((1u << lane) - 1u));
      s_e[at] = e;
      s_w[at] = p.weights[static_cast<int64_t>(n) * p.k + lane];
      s_r[at] = n * p.k + lane;
    }
    if (lane == 0) s_kn = __popc(ballot);
  }
  __syncthreads();
  const int kn = s_kn;
  if (h >= p.H) return;
  bf16* o = p.out + static_cast<int64_t>(n) * p.H + h;
  float acc = 0.0f;
  for (int j0 = 0; j0 < kn; j0 += 4) {
    W w[4];
    const bf16* a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = j0 + i < kn ? j0 + i : kn - 1;  // past the local choices: a repeat, its sum unused
      w[i] = down_row<W>(p, s_e[j], h);
      a[i] = p.act + static_cast<int64_t>(s_r[j]) * p.I;
    }
    float d[4];
    pair_dots<W, 4, 2>(w, a, p.I, lane, d);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float y = vec::round_bf16(vec::warp_sum(d[i]));
      if (j0 + i < kn) acc += y * s_w[j0 + i];
    }
  }
  if (p.shared_gu) {
    const Bf16Row w[1] = {{p.shared_down + static_cast<int64_t>(h) * p.Is}};
    const bf16* a[1] = {p.sact + static_cast<int64_t>(n) * p.Is};
    float d[1];
    pair_dots<Bf16Row, 1, 2>(w, a, p.Is, lane, d);
    const float gate = 1.0f / (1.0f + expf(-p.gate_logit[n]));
    acc += gate * vec::round_bf16(vec::warp_sum(d[0]));
  }
  if (lane == 0) *o = __float2bfloat16_rn(acc);
}

bool aligned16(const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; }

template <class Kernel>
void launch(Kernel kernel, dim3 grid, const DecParams& d, cudaStream_t st) {
  launch_kernel(kernel, grid, dim3(kThreads), 0, st, d);
}

}  // namespace

namespace tuning {
int moe_decode_topk_first = -1;
}  // namespace tuning

void moe_decode_block(const MoeBlockParams& p, const MoeDecodeBuffers& b, Stream s) {
  const int64_t Nr = p.routed < 0 ? p.N : p.routed;
  DFLASH_CHECK(p.N >= 1 && p.N <= kMoeDecodeMaxRows && Nr >= 0 && Nr <= p.N,
               "moe_decode_block: N " << p.N << " (1.." << kMoeDecodeMaxRows << "), routed " << Nr);
  DFLASH_CHECK(p.E >= 1 && p.E <= moe_detail::kMaxE && p.k >= 1 && p.k <= p.E && p.k <= 32 && p.H % 8 == 0 &&
                   p.I % 8 == 0 && p.Is % 8 == 0 && p.H < INT32_MAX / 8 && p.I < INT32_MAX / 2,
               "moe_decode_block: E " << p.E << " (1..1024), k " << p.k << " (1..min(E, 32)), H " << p.H << ", I "
                                      << p.I << ", Is " << p.Is << " (multiples of 8)");
  DFLASH_CHECK(aligned16(p.x) && aligned16(p.router) && aligned16(p.experts_gate_up) && aligned16(p.experts_down) &&
                   (!p.shared_gate_up ||
                    (aligned16(p.shared_gate_up) && aligned16(p.shared_down) && aligned16(p.shared_gate))) &&
                   aligned16(b.act) && aligned16(b.sact) && aligned16(p.out),
               "moe_decode_block: operands must be 16-byte aligned");
  DFLASH_CHECK(!p.experts_gate_up_scale == !p.experts_down_scale,
               "moe_decode_block: FP8 experts need the block scales of both gate|up and down");
  DecParams d{};
  d.x = static_cast<const bf16*>(p.x);
  d.N = static_cast<int>(p.N);
  d.routed = static_cast<int>(Nr);
  d.H = static_cast<int>(p.H);
  d.E = static_cast<int>(p.E);
  d.k = static_cast<int>(p.k);
  d.e0 = static_cast<int>(p.expert_begin);
  d.El = static_cast<int>(p.local_experts < 0 ? p.E : p.local_experts);
  DFLASH_CHECK(d.e0 >= 0 && d.El >= 1 && d.e0 + d.El <= d.E,
               "moe_decode_block: local experts [" << d.e0 << ", " << d.e0 + d.El << ") of " << d.E);
  d.I = static_cast<int>(p.I);
  d.Is = p.shared_gate_up ? static_cast<int>(p.Is) : 0;
  d.renorm = p.renormalize;
  d.router = static_cast<const bf16*>(p.router);
  d.gate_w = p.shared_gate_up ? static_cast<const bf16*>(p.shared_gate) : nullptr;
  d.route_by = p.logits_in ? p.logits_in : b.logits;
  d.gate_up = p.experts_gate_up;
  d.down = p.experts_down;
  d.gate_up_scale = p.experts_gate_up_scale;
  d.down_scale = p.experts_down_scale;
  d.shared_gu = static_cast<const bf16*>(p.shared_gate_up);
  d.shared_down = static_cast<const bf16*>(p.shared_down);
  d.logits = b.logits;
  d.gate_logit = b.gate_logit;
  d.experts = b.experts;
  d.weights = b.weights;
  d.act = static_cast<bf16*>(b.act);
  d.sact = static_cast<bf16*>(b.sact);
  d.out = static_cast<bf16*>(p.out);
  d.col_blocks = (d.I + kWarps - 1) / kWarps;
  auto st = static_cast<cudaStream_t>(s);
  const int router_rows = d.E + (d.gate_w ? 1 : 0);
  launch(router_kernel, dim3(static_cast<unsigned>((router_rows + kWarps - 1) / kWarps)), d, st);
  // A decode step (one routed token, or two) routes inside the gate|up blocks; more tokens (a verify)
  // first, once per token (tuning::moe_decode_topk_first: -1 this rule, 0 never, 1 always).
  d.routed_before = tuning::moe_decode_topk_first >= 0 ? tuning::moe_decode_topk_first == 1 : Nr > 2;
  if (d.routed_before && Nr > 0) launch(topk_kernel, dim3(static_cast<unsigned>((Nr + kWarps - 1) / kWarps)), d, st);
  const int64_t gu_blocks = Nr * p.k * d.col_blocks + (d.shared_gu ? (d.Is + kWarps - 1) / kWarps : 0);
  const bool fp8 = d.gate_up_scale != nullptr;
  if (gu_blocks > 0)
    launch(fp8 ? gate_up_kernel<Fp8Row> : gate_up_kernel<Bf16Row>, dim3(static_cast<unsigned>(gu_blocks)), d, st);
  if (Nr > 0)
    launch(fp8 ? down_kernel<Fp8Row> : down_kernel<Bf16Row>,
           dim3(static_cast<unsigned>(Nr), static_cast<unsigned>((d.H + kWarps - 1) / kWarps)), d, st);
}

}  // namespace dflash::cuda
