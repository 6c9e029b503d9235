// Skinny bf16 GEMM for decode / verify steps (issue 30; gemm.h): y[M, N] = x[M, K] · w[N, K]^T for
// 1 <= M <= 16 (the decode steps' rows are padded to 16), fp32 accumulation, bf16 out; optionally
// with SwiGLU as its prologue (x = silu(gu[:, :K]) * gu[:, K:2K], rounded to bf16 as cuda::swiglu
// stores it, so the fused call equals swiglu + gemm_skinny bit for bit). CPU reference: ops::linear.
//
// Roofline: the weight, N·K·2 bytes, read once (x and y are < 1% at M = 16): at the Qwen3.6-27B
// decode shapes 63 MB (gdn out_proj / o_proj 5120 x 6144) to 178 MB (down_proj 5120 x 17408), i.e.
// 15-42 us at the copy bandwidth (~4.24 TB/s on an H200); the FLOPs (2·16·N·K) are < 1% of the
// tensor cores' time. cuBLASLt reached 2.8-3.6 TB/s on the N = 5120 and N = 14336-16480 shapes at
// M = 16 (h200-graphs-b7c45b1's profile): its grids do not spread those weights over every SM.
//
// Design: one wave. A block of 4 warps owns 64 weight rows (4 m16 tiles) and a K range; the K
// range of a group of rows is split over ks blocks (a thread-block cluster of ks, ks <= 8, chosen so
// that the whole grid is resident at once: groups x ks <= the clusters that fit) and over the 4
// warps inside each. A warp streams its 64 rows x K-range in steps of 32 columns through a ring of
// kStages steps in shared memory filled by cp.async (16 bytes per lane and copy; each lane reads
// back only what it copied, so no barrier): per step each lane copies 8 weight units (rows g and
// g + 8 of each tile, columns 8t..8t+7: a warp request covers 8 rows x 64 bytes, the L2 fetching
// 256 bytes of the row ahead) and the x units of tokens g and g + 8 (from L2: x is reused by the 4
// tiles), then runs 16 mma.sync m16n8k16 (weight rows as the MMA's M, tokens as its N). Inside an
// MMA the k order is permuted identically for both operands (lane t's columns 8t..8t+7 serve
// logical k 2t, 2t+1, 2t+8, 2t+9 of two MMAs), so the 16-byte units are used as loaded. kStages - 1
// steps are in flight while one is multiplied (48 KB per SM at 2 blocks). The 4 warps' partial sums
// meet in shared memory (in warp order), the ks blocks' through distributed shared memory (in rank
// order): the sums are deterministic and each output depends only on its own x row and weight row,
// so a row of a T = 1 decode and of a T = 16 verify are computed alike (batch invariance).
// With programmatic dependent launch (pdl.cuh) the first kStages - 1 steps' weight copies are
// issued before waiting on the previous kernel, which wrote x.
//
// Measured on an H200 (bench/results/h200-decode4-aaaaa54 and -a84d6d9, kernel_bench --only fused,
// M 16, GB/s of the weight read, CUDA-graph replays; copy 4,234-4,257): gdn in_proj 16480 x 5120
// 3,913 / 3,883 vs cuBLASLt 3,972 / 3,890; attn qkv 14336 x 5120 3,579 / 3,560 vs 4,055 / 3,984;
// gdn out_proj 5120 x 6144 (ks 2) 2,640 / 2,634 vs 3,589 / 3,536; down 5120 x 17408 (ks 2) 2,862 /
// 2,855 vs 3,569 / 3,486; gate_up 34816 x 5120 (two waves) 3,731 / 3,678 vs 4,128 / 3,992; with the
// SwiGLU prologue 1,552 / 1,563 vs swiglu + cuBLASLt 2,931 / 3,381. Slower everywhere, so the decode
// plan keeps cuBLASLt (FastPathPlan::DecodeFusion::skinny_gemm off; dflash_eval --decode-variants
// skinny measures it: the 27B decode step 18.3 ms with it against 15.0 without). Why (estimated
// from the shapes, not profiled): at N = 5120 there are 80 row groups, clusters of 3 did not fit 80
// at once, so ks 2 put 160 blocks on 132 SMs (28 SMs with twice the bytes); the SwiGLU prologue
// recomputes silu(gate) * up for every row group (80x the work) between the loads and the MMAs.
// The stream-K split (equal k-steps per block across tiles) is built in gemm_stream.cu (session 25,
// not yet measured): tuning::gemm_skinny_streamk = 1 sends this function's non-SwiGLU calls there, and
// the decode plan's DecodeFusion::skinny_streamk the model's. Still open: SwiGLU applied once by its
// producer (the prologue here recomputes it per row group).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <mutex>

#include "core/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/skinny_mma.cuh"
#include "kernels/cuda/vec.cuh"

namespace dflash::cuda {

namespace tuning {
int gemm_skinny_ks = 0;  // 0: automatic K split (cluster size); 1..8 forces it (tests)
}  // namespace tuning

namespace {

namespace cg = cooperative_groups;
using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTiles = 4;              // m16 tiles of weight rows per warp
constexpr int kRows = 16 * kTiles;     // weight rows per block
constexpr int kStepK = 32;             // columns per step
constexpr int kStages = 4;             // ring depth (steps) per warp
constexpr int kRedLd = kRows + 4;      // padded rows of the reduction buffer: conflict-free stores
constexpr int kMaxCluster = 8;
// 16-byte units per lane and step: weights (kTiles x rows g, g + 8), x (tokens g, g + 8; with SwiGLU
// gate and up each).
constexpr int kWUnits = 2 * kTiles;
template <bool kSwiglu>
constexpr int kXUnits = kSwiglu ? 4 : 2;
template <bool kSwiglu>
constexpr size_t ring_bytes() {
  return static_cast<size_t>(kWarps) * kStages * (kWUnits + kXUnits<kSwiglu>) * 32 * 16;
}
static_assert(sizeof(float) * kWarps * 16 * kRedLd <= ring_bytes<false>(), "the reduction reuses the ring");

struct SkParams {
  const bf16* x;  // [M, ldx] (swiglu: gate columns [0, K), up columns [K, 2K))
  int64_t ldx;
  const bf16* w;  // [N, K]
  bf16* y;        // [M, ldy]
  int64_t ldy;
  int M, N, K, ks;
};

template <bool kSwiglu>
__global__ void __launch_bounds__(kThreads, 2) gemm_skinny_kernel(const SkParams p) {
  constexpr int kUnits = kWUnits + kXUnits<kSwiglu>;
  extern __shared__ __align__(16) uint4 ring[];  // [kWarps][kStages][kUnits][32 lanes]
  __shared__ __align__(16) float part[16][kRows];
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int ks = p.ks, group = static_cast<int>(blockIdx.x) / ks, rank = static_cast<int>(blockIdx.x) - group * ks;
  const int n0 = group * kRows;
  const int steps = p.K / kStepK, parts = ks * kWarps, part_id = rank * kWarps + warp;
  const int s0 = static_cast<int>(static_cast<int64_t>(steps) * part_id / parts);
  const int s1 = static_cast<int>(static_cast<int64_t>(steps) * (part_id + 1) / parts);
  uint4* my = ring + static_cast<size_t>(warp) * kStages * kUnits * 32 + lane;  // unit u of slot q: my[(q·kUnits + u)·32]

  // Weight unit j = 2 i + h: row n0 + 8 j + g (tile i, half h); N % 8 == 0, so a unit's 8 rows are
  // all in or all out. Rows past N read nothing (zeros) and are never stored.
  const bf16* wbase = p.w + static_cast<int64_t>(min(n0 + g, p.N - 1)) * p.K + 8 * t;
  const int64_t wstride = int64_t{8} * p.K;
  uint32_t wvalid = 0;
#pragma unroll
  for (int j = 0; j < kWUnits; ++j) wvalid |= (n0 + 8 * j < p.N ? 1u : 0u) << j;
  const bool xv[2] = {g < p.M, g + 8 < p.M};
  const bf16* xp[2] = {p.x + static_cast<int64_t>(xv[0] ? g : 0) * p.ldx + 8 * t,
                       p.x + static_cast<int64_t>(xv[1] ? g + 8 : 0) * p.ldx + 8 * t};
  const bool two_halves = p.M > 8;

  auto issue_w = [&](int s) {  // step s's weight units into its slot (s < s1)
    uint4* slot = my + static_cast<size_t>(s % kStages) * kUnits * 32;
#pragma unroll
    for (int j = 0; j < kWUnits; ++j) {
      const bool v = (wvalid >> j) & 1u;
      ptx::cp_async16_l2_256(slot + j * 32, v ? wbase + j * wstride + s * kStepK : p.w, v);
    }
  };
  auto issue_x = [&](int s) {
    uint4* slot = my + (static_cast<size_t>(s % kStages) * kUnits + kWUnits) * 32;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const bf16* q = xp[j] + s * kStepK;
      if constexpr (kSwiglu) {
        ptx::cp_async16_l2_256(slot + (2 * j) * 32, q, xv[j]);
        ptx::cp_async16_l2_256(slot + (2 * j + 1) * 32, q + p.K, xv[j]);
      } else {
        ptx::cp_async16_l2_256(slot + j * 32, q, xv[j]);
      }
    }
  };

  float acc[kTiles][2][4];
  skinny::zero(acc);

  // Prologue: the first kStages - 1 steps' weights before the wait (nothing in the step writes
  // them), their x after it; one commit group per step (empty past s1, so the counts stay fixed).
  pdl_launch_dependents();
#pragma unroll
  for (int q = 0; q < kStages - 1; ++q)
    if (s0 + q < s1) issue_w(s0 + q);
  pdl_wait();
#pragma unroll
  for (int q = 0; q < kStages - 1; ++q) {
    if (s0 + q < s1) issue_x(s0 + q);
    ptx::cp_async_commit_ring();
  }
  for (int s = s0; s < s1; ++s) {
    ptx::cp_async_wait_ring<kStages - 2>();  // step s has landed (this lane's copies)
    const uint4* slot = my + static_cast<size_t>(s % kStages) * kUnits * 32;
    uint4 xa[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if constexpr (kSwiglu) {
        float gf[8], uf[8];
        ptx::unpack8(slot[(kWUnits + 2 * j) * 32], gf);
        ptx::unpack8(slot[(kWUnits + 2 * j + 1) * 32], uf);
#pragma unroll
        for (int e = 0; e < 8; ++e) gf[e] = vec::silu(gf[e]) * uf[e];  // as cuda::swiglu (SwigluOp)
        xa[j] = ptx::pack8(gf);
      } else {
        xa[j] = slot[(kWUnits + j) * 32];
      }
    }
    uint4 wv[kWUnits];
#pragma unroll
    for (int j = 0; j < kWUnits; ++j) wv[j] = slot[j * 32];
    // Refill the slot consumed last step with step s + kStages - 1.
    if (s + kStages - 1 < s1) {
      issue_w(s + kStages - 1);
      issue_x(s + kStages - 1);
    }
    ptx::cp_async_commit_ring();
    skinny::step_mmas<false, kTiles>(wv, xa[0], xa[1], two_halves, acc);
  }
  ptx::cp_async_wait_ring<0>();

  // The warps' fragments (skinny::c_row / c_token) into the reduction buffer, which reuses the
  // rings: every warp must be done with its own first.
  __syncthreads();
  auto* red = reinterpret_cast<float(*)[16][kRedLd]>(ring);  // [kWarps][16][kRedLd]
  skinny::store_fragments(acc, red[warp], g, t);
  __syncthreads();
  // Thread: quads q = threadIdx, threadIdx + kThreads of the block's 16 tokens x 64 rows (token
  // q / 16, rows 4 (q % 16) ..); the warps' partials summed in warp order.
  constexpr int kQuads = 16 * kRows / 4, kPerThread = kQuads / kThreads;
  float4 sum[kPerThread];
#pragma unroll
  for (int e = 0; e < kPerThread; ++e) {
    const int q = static_cast<int>(threadIdx.x) + e * kThreads, tok = q >> 4, r4 = (q & 15) * 4;
    sum[e] = *reinterpret_cast<const float4*>(&red[0][tok][r4]);
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      const float4 v = *reinterpret_cast<const float4*>(&red[w][tok][r4]);
      sum[e].x += v.x, sum[e].y += v.y, sum[e].z += v.z, sum[e].w += v.w;
    }
  }
  auto store = [&](int q, const float4& v) {
    const int tok = q >> 4, r4 = (q & 15) * 4;
    if (tok < p.M && n0 + r4 < p.N) {
      uint2 u;
      u.x = ptx::pack_bf16(v.x, v.y);
      u.y = ptx::pack_bf16(v.z, v.w);
      *reinterpret_cast<uint2*>(p.y + static_cast<int64_t>(tok) * p.ldy + n0 + r4) = u;
    }
  };
  if (ks == 1) {
#pragma unroll
    for (int e = 0; e < kPerThread; ++e) store(static_cast<int>(threadIdx.x) + e * kThreads, sum[e]);
    return;
  }
  // The cluster's ks partials of the same outputs, summed in rank order; rank r stores the quads
  // with q % ks == r.
#pragma unroll
  for (int e = 0; e < kPerThread; ++e) {
    const int q = static_cast<int>(threadIdx.x) + e * kThreads;
    *reinterpret_cast<float4*>(&part[q >> 4][(q & 15) * 4]) = sum[e];
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  for (int q = static_cast<int>(threadIdx.x); q < kQuads; q += kThreads) {
    if (q % ks != rank) continue;
    float4 tot = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int r = 0; r < ks; ++r) {
      const float4 v = *cluster.map_shared_rank(reinterpret_cast<float4*>(&part[q >> 4][(q & 15) * 4]), r);
      tot.x += v.x, tot.y += v.y, tot.z += v.z, tot.w += v.w;
    }
    store(q, tot);
  }
  cluster.sync();  // every block's partial stays readable until all have read it
}

// Resident capacity of each kernel on a device: blocks at once for ks = 1, clusters at once for
// ks = 2..8 (cudaOccupancyMaxActiveClusters), read once per device.
struct Capacity {
  bool ready = false;
  int sms = 0;
  std::array<int, kMaxCluster + 1> clusters{};  // [ks]: clusters of ks blocks resident at once
};

template <bool kSwiglu>
const Capacity& capacity(int device) {
  static std::mutex mu;
  static std::array<Capacity, 64> caps;
  DFLASH_CHECK(device >= 0 && device < static_cast<int>(caps.size()), "gemm_skinny: device " << device << " out of range");
  std::lock_guard<std::mutex> lock(mu);
  Capacity& c = caps[static_cast<size_t>(device)];
  if (c.ready) return c;
  DeviceGuard scope(device);
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, device));
  int major = 0;
  DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  const auto kernel = gemm_skinny_kernel<kSwiglu>;
  constexpr size_t smem = ring_bytes<kSwiglu>();
  DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  DFLASH_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  c.clusters[1] = per_sm * c.sms;
  for (int ks = 2; ks <= kMaxCluster; ++ks) {
    c.clusters[static_cast<size_t>(ks)] = 0;
    if (major < 9) continue;  // thread-block clusters: sm_90
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(ks * 64));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(ks);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
      cudaGetLastError();
      n = 0;
    }
    c.clusters[static_cast<size_t>(ks)] = n;
  }
  c.ready = true;
  return c;
}

const char* shape_error(const GemmSkinnyParams& p) {
  if (p.M < 0 || p.M > 16) return "M must be in [0, 16]";
  if (p.N <= 0 || p.K <= 0) return "N and K must be positive";
  if (p.K % kStepK != 0) return "K must be a multiple of 32";
  if (p.N % 8 != 0) return "N must be a multiple of 8";
  if (p.ldy < p.N || p.ldy % 8 != 0) return "ldy must be >= N and a multiple of 8";
  if (p.ldx % 8 != 0 || p.ldx < (p.swiglu ? 2 * p.K : p.K)) return "ldx must be a multiple of 8 and >= K (2K with swiglu)";
  if (p.N >= (int64_t{1} << 30) || p.K >= (int64_t{1} << 30)) return "N and K must be < 2^30";
  return nullptr;
}

// The K split (cluster size) for this shape: the most blocks per row group (<= 8, each warp at
// least 2 steps) for which the grid is resident at once; 0 when even ks = 1 needs more than one wave.
template <bool kSwiglu>
int one_wave_splits(const GemmSkinnyParams& p, int device) {
  const Capacity& c = capacity<kSwiglu>(device);
  const int64_t groups = (p.N + kRows - 1) / kRows, steps = p.K / kStepK;
  for (int ks = kMaxCluster; ks >= 1; --ks) {
    if (ks > 1 && steps < int64_t{2} * kWarps * ks) continue;
    const int64_t cap = ks == 1 ? c.clusters[1] : c.clusters[static_cast<size_t>(ks)];
    if (groups <= cap) return ks;
  }
  return 0;
}

}  // namespace

int gemm_skinny_splits(const GemmSkinnyParams& p, int device) {
  if (shape_error(p) || p.M == 0) return 0;
  return p.swiglu ? one_wave_splits<true>(p, device) : one_wave_splits<false>(p, device);
}

const char* gemm_skinny_kernel_name() { return "gemm_skinny_bf16 (mma.sync m16n8k16, one wave, cluster split-K)"; }

void gemm_skinny(const GemmSkinnyParams& p, int device, Stream s) {
  const char* err = shape_error(p);
  DFLASH_CHECK_HINT(!err, "gemm_skinny: " << err << " (M=" << p.M << " N=" << p.N << " K=" << p.K << " ldx=" << p.ldx
                                          << " ldy=" << p.ldy << (p.swiglu ? " swiglu" : "") << ")",
                    "gemm_skinny serves decode shapes (M <= 16, K % 32 == 0, N % 8 == 0); use gemm_bf16");
  if (p.M == 0) return;
  if (tuning::gemm_skinny_streamk == 1 && gemm_bf16_stream_supported(p)) return gemm_bf16_stream(p, device, s);
  DFLASH_CHECK(p.x && p.w && p.y, "gemm_skinny: null pointer (x=" << p.x << " w=" << p.w << " y=" << p.y << ")");
  DFLASH_CHECK(vec::aligned16(p.x) && vec::aligned16(p.w) && vec::aligned16(p.y),
               "gemm_skinny: x, w and y must be 16-byte aligned (x=" << p.x << " w=" << p.w << " y=" << p.y << ")");
  DeviceGuard scope(device);
  int ks = tuning::gemm_skinny_ks;
  if (ks <= 0) {
    ks = gemm_skinny_splits(p, device);
    if (ks == 0) ks = 1;  // more than one wave (forced by the caller): row groups in waves
  }
  DFLASH_CHECK(ks >= 1 && ks <= kMaxCluster, "gemm_skinny: K split " << ks << " outside [1, " << kMaxCluster << "]");
  if (ks > 1) {
    const Capacity& c = p.swiglu ? capacity<true>(device) : capacity<false>(device);
    DFLASH_CHECK_HINT(c.clusters[static_cast<size_t>(ks)] > 0,
                      "gemm_skinny: clusters of " << ks << " blocks do not run on this GPU (they need sm_90)",
                      "set tuning::gemm_skinny_ks to 0 or 1");
  }
  const int64_t groups = (p.N + kRows - 1) / kRows;
  DFLASH_CHECK(groups * ks < (int64_t{1} << 31), "gemm_skinny: N " << p.N << " too large");
  SkParams k;
  k.x = static_cast<const bf16*>(p.x);
  k.ldx = p.ldx;
  k.w = static_cast<const bf16*>(p.w);
  k.y = static_cast<bf16*>(p.y);
  k.ldy = p.ldy;
  k.M = static_cast<int>(p.M);
  k.N = static_cast<int>(p.N);
  k.K = static_cast<int>(p.K);
  k.ks = ks;
  const dim3 grid(static_cast<unsigned>(groups * ks));
  const auto st = static_cast<cudaStream_t>(s);
  // capacity() set each kernel's dynamic shared memory limit (called above through the split, or here).
  if (p.swiglu) {
    (void)capacity<true>(device);
    launch_pdl_cluster(gemm_skinny_kernel<true>, grid, dim3(kThreads), ring_bytes<true>(), st, static_cast<unsigned>(ks), k);
  } else {
    (void)capacity<false>(device);
    launch_pdl_cluster(gemm_skinny_kernel<false>, grid, dim3(kThreads), ring_bytes<false>(), st, static_cast<unsigned>(ks), k);
  }
}

}  // namespace dflash::cuda
