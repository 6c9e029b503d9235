// Probe (issue 31): can a block-scaled FP8 GEMM of our own beat cuBLASLt's at the prefill / training shapes?
// cuBLASLt's block-scaled e4m3 kernels (1 x 128 activation scales, 128 x 128 weight scales) run the Qwen3.6-27B
// GEMMs at M 8192 at 1,150-1,290 TFLOP/s on an H200, 77-91% of its own per-tensor FP8 kernels (docs/fp8.md), and
// those GEMMs are ~70% of the FP8 target forward and most of the FP8 drafter step: the lever behind both of
// issue 31's FP8 goals. DeepSeek's published design (DeepGEMM) reaches per-tensor speed with the same scales on
// Hopper: TMA loads of 128 x 128 tiles into a shared-memory ring fed by one producer warp, two consumer
// warpgroups issuing wgmma (m64nNk32 e4m3) for each 128-deep K block into a temporary accumulator, then
// "promoting" it into the main fp32 accumulator times the two scales (the tensor cores' fp8 sums are only ~14
// bits deep, so each K block is summed apart), the other warpgroup's wgmma running meanwhile.
//
// This probe is that design, written for this repository from the published description (no code taken):
//   y[M, N] (bf16) = sum over K blocks kb of sa[kb][m] * sb[n / 128][kb] * (a[m, kb-block] . b[n, kb-block])
// a: e4m3 [M, K] row-major, b: e4m3 [N, K] row-major (gemm_fp8's x and w), sa: fp32 [K/128][M] (token-
// contiguous, like fp8_act_scale_ld), sb: fp32 [N/128][K/128]. Tiles of 128 x (128 * NH) on a persistent grid
// (one CTA an SM, tiles rastered in groups of 16 row blocks for L2 reuse); 384 threads: warpgroup 0 the
// producer (one lane issues the TMA copies and the scale row's bulk copy; 40 registers after setmaxnreg),
// warpgroups 1-2 the consumers (64 rows each; 232 registers). NH = 2 runs the two 128-column halves of a
// 256-wide tile one after the other into the same temporary. Variants (`probe M V`): 0 128 x 128, 1 128 x 256,
// 2 128 x 128 without the promotion (timing only), 3 128 x 256 on 2-CTA clusters sharing B by TMA multicast,
// 4 128 x 256 with A from registers (one shared-memory read of A a K block), 5 both 3 and 4, 6 4 with the TMA-store
// epilogue, 7 all three, 8 4 on 2 x 2 clusters sharing A and B by multicast, 9 8 with the TMA-store epilogue, 10 7
// without the promotion (A from shared memory; timing only: what the promotion costs), 11 7 with the two consumer
// warpgroups' chains ordered to alternate (ORD).
// Standalone (not part of the build): nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 -I../.. -Xptxas -v
// fp8_gemm_probe.cu -o probe (bench/probes/run_gemm_probe.sh; plain -arch=sm_90a made compute_90 PTX, which has
// no wgmma); check ptxas's C75xx lines, which say when the wgmma chains get serialized. Each variant's output is
// checked on sampled rows against a plain fp32 reference kernel; it prints ms and TFLOP/s per shape, the
// comparison being kernel_bench --only fp8's gemm_fp8 rows (cuBLASLt) in the same device call.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <vector>

#include "kernels/cuda/wgmma.cuh"
#include "probe_util.cuh"

namespace {

constexpr int kBM = 128, kBK = 128;
constexpr int kThreads = 384;
constexpr int kGroupM = 16;  // raster: row blocks per group

// Cluster pieces: a consumer warp frees a stage in every CTA of its cluster, and the copies are multicast.
__device__ __forceinline__ void mbar_arrive_peer(uint64_t* b, uint32_t peer) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(saddr(b)), "r"(peer));
  // (the default .release.cta, as CUTLASS's cluster barriers: the first H100 run used .release.cluster, and the
  // clusters ran at half the speed of the plain kernel with twice its L2 and DRAM traffic, SMs 26% busy; the
  // stage's reads are complete before the arrival anyway: wgmma waited, ldmatrix returned)
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {  // every thread of both CTAs (not .aligned: lanes arrive apart)
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ void tma_2d_multicast(void* dst, const CUtensorMap* tm, int col, int row, uint64_t* b,
                                                 uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
      "%3}], [%4], %5;" ::"r"(saddr(dst)),
      "l"(tm), "r"(col), "r"(row), "r"(saddr(b)), "h"(mask)
      : "memory");
}
// The TMA store of a box of y from shared memory (bulk group of the issuing thread) and a named barrier of one
// consumer warpgroup (ids 1, 2; 0 is __syncthreads').
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* tm, const void* src, int col, int row) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(tm), "r"(col), "r"(row),
               "r"(saddr(src))
               : "memory");
}
__device__ __forceinline__ void warpgroup_sync(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }
// ORD's turn tokens between the two consumer warpgroups (named barriers 3 and 4 of 256 threads: one warpgroup
// arrives, the other waits).
__device__ __forceinline__ void turn_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void turn_wait(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
namespace wg = dflash::cuda::wgmma;  // the project's descriptor (128-byte swizzle), fences, waits and pins

// The 64 fp32 accumulators of an m64n128 wgmma as asm operands %0 .. %63 (both forms below).
#define WGMMA_N128_D                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "   \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define WGMMA_N128_D_OPERANDS(d)                                                                                \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),     \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),    \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),    \
      "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),    \
      "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),    \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),    \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d[64 x 128] (+)= A[64 x 32] . B[32 x 128], e4m3 operands K-major in shared memory, fp32 accumulators in the
// standard layout: warp w of the warpgroup holds rows 16w + g and 16w + g + 8 (g = lane / 4), d[4i + {0,1}] at
// row 16w + g, columns 8i + 2q + {0,1} (q = lane % 4), d[4i + {2,3}] at row 16w + g + 8.
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
               WGMMA_N128_D ", %64, %65, p, 1, 1;\n}\n"
               : WGMMA_N128_D_OPERANDS(d)
               : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// The same with A from registers: this warp's 16 rows x 32 bytes as the m16n8k32 A fragment (a0: row g, bytes 4q ..
// 4q + 3; a1: row g + 8; a2 / a3: bytes 16 + 4q), which is byte for byte the bf16 m16n8k16 fragment that
// wgmma::load_a_fragments reads by ldmatrix from the same 128-byte-swizzled rows.
__device__ __forceinline__ void wgmma_m64n128k32_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                    int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\nwgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
               WGMMA_N128_D ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
               : WGMMA_N128_D_OPERANDS(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

struct Args {
  const float* sa;  // [K/128][M]
  const float* sb;  // [N/128][K/128]
  __nv_bfloat16* y; // [M, N]
  int M, N, K;
};

template <int NH, int S, bool TS = false>
struct Layout {
  static constexpr int kA = kBM * kBK;            // bytes of an A tile
  static constexpr int kB = NH * 128 * kBK;       // bytes of a B tile
  static constexpr int kSa = kBM * 4;             // the tile rows' scales of one K block
  static constexpr int kStage = kA + kB;
  static constexpr int kOut = TS ? 2 * 64 * 128 * 2 : 0;  // TS: a consumer warpgroup's 64 x 128 bf16 of y
  // + alignment slack; TS has no room for it (S 4: 227 KB, the opt-in limit, with 960 bytes to spare) and checks that
  // the dynamic shared memory starts 1024-aligned, as it does without static shared memory
  static constexpr int kBytes = S * kStage + kOut + S * kSa + 2 * S * 8 + (TS ? 0 : 1024);
};

// A K-major tile of 128-byte rows as the TMA writes it (128-byte swizzle, 8-row groups 1024 bytes apart); a K step
// of 32 bytes inside the swizzle atom advances the start address, as wgmma.cuh's kernels do.
__device__ __forceinline__ uint64_t sw128(const void* smem) { return wg::descriptor(smem, 16, 1024); }

__device__ __forceinline__ void tile_coords(int t, int mbn, int nbn, int& mb, int& nb) {
  const int in_group = kGroupM * nbn, group = t / in_group, first = group * kGroupM;
  const int gm = min(mbn - first, kGroupM), r = t % in_group;
  mb = first + r % gm, nb = r / gm;
}

// (Tried: two temporaries, block kb + 1's chain issued before block kb is promoted under wait_group 1. ptxas
// serializes it, C7514: accumulator registers of one wgmma read while another is in flight; so each block waits
// for its chain, as DeepGEMM's kernels do, and the other warpgroup's chain fills the tensor cores meanwhile.)
// NOPROMO (timing only): every K block's chains accumulate straight into acc (no scales, no per-block wait
// but the one that frees the previous stage, wait_group 1): the same loads and wgmma without the promotion, i.e.
// the structure's per-tensor ceiling; its output is not the GEMM's and is not checked.
// CM (cluster size; NH 2): CM 2: CTAs in clusters of two take the two row blocks of a pair of tiles with the same
// 256 columns; each loads its own A and one 128-row half of B, multicast into both CTAs' stage (B's L2 reads halved:
// 32 KB a K block a CTA instead of 48). CM 4: clusters of 2 x 2 take the four tiles of 2 row blocks x 2 column
// blocks; CTA (i, j) (rank i + 2j) loads the j-th 64-row half of A_i for (i, 0) and (i, 1) and the i-th 128-row half
// of B_j for (0, j) and (1, j) (24 KB a K block a CTA). A stage is refilled once every CTA's consumers freed it.
// TS: the epilogue through shared memory: each consumer warpgroup writes a 128-column half of its 64 rows of y as bf16
// (two 64 x 64 panels, 128-byte swizzle: conflict-free 4-byte stores) and one lane stores them by TMA, so the
// tensor cores wait for 32 shared-memory stores a thread instead of 32 scattered global ones (each touching 8 rows),
// and the global writes drain while the next tile's chains run.
// RS (promoted): each consumer warp reads its 16 rows of the A tile into registers once per K block (ldmatrix) and
// both 128-column halves' chains take A from there, so A is read from shared memory once, not NH times (with NH 2
// the wgmma reads of a K block fall from 48 to 40 KB a warpgroup: the shared-memory side of the question).
// ORD (promoted; session 35's ncu: without it the tensor pipe is busy 70% of the time, 91% without the promotion,
// and the warps wait for their siblings at the warpgroup-wide wgmma fence / wait): the two consumer warpgroups take
// turns to issue their chains. Warpgroup 1 (c 0) issues a chain and then passes the turn (named barrier 3) to
// warpgroup 2 (c 1), which issues its chain and passes it back (barrier 4); both issue the same number of chains,
// and warpgroup 1 takes the last pass after its loop. Two chains issued at once interleave in the tensor pipe
// and complete together, so both warpgroups then promote while the tensor cores idle; in turns, one warpgroup's
// chain completes while the other's is queued behind it, and each promotion runs under the other's chain.
template <int NH, int S, bool NOPROMO = false, int CM = 1, bool RS = false, bool TS = false, bool ORD = false>
__global__ void __launch_bounds__(kThreads, 1) gemm_kernel(Args a, const __grid_constant__ CUtensorMap ta,
                                                           const __grid_constant__ CUtensorMap tb,
                                                           const __grid_constant__ CUtensorMap ty) {
  using L = Layout<NH, S, TS>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  if constexpr (TS) {
    if (saddr(smem_raw) % 1024 != 0) __trap();  // no slack (Layout): a misaligned base would overrun
  }
  uint8_t* out_s = smem + S * L::kStage;  // TS (1024-aligned: kStage is a multiple of 1024)
  float* sa_s = reinterpret_cast<float*>(out_s + L::kOut);
  uint64_t* full = reinterpret_cast<uint64_t*>(out_s + L::kOut + S * L::kSa);
  uint64_t* empty = full + S;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  constexpr bool MC = CM > 1;
  static_assert(CM == 1 || CM == 2 || CM == 4, "clusters of 1, 2 or 4");
  static_assert(!MC || NH == 2, "clusters: 256-column tiles");
  static_assert(!RS || !NOPROMO, "RS: promoted");
  static_assert(!ORD || !NOPROMO, "ORD: promoted");
  const uint32_t rank = MC ? cluster_rank() : 0;
  const int ci = static_cast<int>(rank & 1), cj = static_cast<int>(rank >> 1);  // CM 4: this CTA's (i, j)
  if (threadIdx.x == 0) {
    // every consumer thread frees a stage; clusters: lane 0 of each consumer warp of every CTA
    for (int s = 0; s < S; ++s) mbar_init(full + s, 1), mbar_init(empty + s, MC ? 8 * CM : 256);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (MC) cluster_sync();
  else __syncthreads();
  const int mbn = a.M / kBM, nbn = a.N / (128 * NH), kbn = a.K / kBK;
  // the tiles this CTA runs: t = first, first + stride, ... < tiles; clusters: groups of CM tiles (CM 2: row blocks
  // 2p, 2p + 1; CM 4: those times column blocks 2r, 2r + 1)
  const int tiles = CM == 4 ? mbn / 2 * (nbn / 2) : CM == 2 ? mbn / 2 * nbn : mbn * nbn;
  const int first = static_cast<int>(blockIdx.x) / CM, stride = static_cast<int>(gridDim.x) / CM;
  auto coords = [&](int t, int& mb, int& nb) {
    if constexpr (CM == 4) {
      tile_coords(t, mbn / 2, nbn / 2, mb, nb);
      mb = 2 * mb + ci, nb = 2 * nb + cj;
    } else if constexpr (CM == 2) {
      tile_coords(t, mbn / 2, nbn, mb, nb);
      mb = 2 * mb + static_cast<int>(rank);
    } else {
      tile_coords(t, mbn, nbn, mb, nb);
    }
  };
  if (wg == 0) {  // producer
    // 40: the 16,384 registers the consumers' 168 -> 232 take must come from this warpgroup (128 x (168 - 40));
    // CM 4's producer spills 16 bytes at 40 (one lane's local memory, in L1)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (warp == 0 && lane == 0) {
      int it = 0;
      for (int t = first; t < tiles; t += stride) {
        int mb, nb;
        coords(t, mb, nb);
        for (int kb = 0; kb < kbn; ++kb, ++it) {
          const int s = it % S;
          mbar_wait(empty + s, ((it / S) & 1) ^ 1);  // (clusters too: CTA-scope acquire, see mbar_arrive_peer)
          mbar_expect_tx(full + s, L::kStage + L::kSa);
          uint8_t* st = smem + s * L::kStage;
          if constexpr (CM == 4) {  // A's half j to (i, 0), (i, 1) (ta's boxes: 64 rows); B's half i to (0, j), (1, j)
            tma_2d_multicast(st + cj * 64 * kBK, &ta, kb * kBK, mb * kBM + cj * 64, full + s,
                             static_cast<uint16_t>((1u << ci) | (1u << (ci + 2))));
            tma_2d_multicast(st + L::kA + ci * 128 * kBK, &tb, kb * kBK, (nb * NH + ci) * 128, full + s,
                             static_cast<uint16_t>(3u << (2 * cj)));
          } else if constexpr (CM == 2) {
            tma_2d<false>(st, &ta, kb * kBK, mb * kBM, full + s);
            tma_2d_multicast(st + L::kA + rank * 128 * kBK, &tb, kb * kBK, (nb * NH + static_cast<int>(rank)) * 128, full + s, 3);
          } else {
            tma_2d<false>(st, &ta, kb * kBK, mb * kBM, full + s);
#pragma unroll
            for (int h = 0; h < NH; ++h) tma_2d<false>(st + L::kA + h * 128 * kBK, &tb, kb * kBK, (nb * NH + h) * 128, full + s);
          }
          bulk_g2s<false>(sa_s + s * kBM, a.sa + static_cast<int64_t>(kb) * a.M + mb * kBM, L::kSa, full + s);
        }
      }
    }
    if constexpr (MC) cluster_sync();  // the peer's last multicasts and arrivals land before this CTA exits
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int c = wg - 1;                      // consumer warpgroup: rows 64c .. 64c + 63 of the tile
  const int g = lane / 4, q = lane % 4;
  const int r0 = c * 64 + warp * 16 + g;     // this thread's two rows: r0, r0 + 8
  float acc[NH][64];
  float tmp[64];
  // Frees stage s for the producer(s): every consumer thread arrives (plain), or lane 0 of each warp on every CTA
  // of the cluster (after its warp's reads: the caller waited for them).
  auto release = [&](int s) {
    if constexpr (MC) {
      __syncwarp();
      if (lane == 0) {
#pragma unroll
        for (int p = 0; p < CM; ++p) mbar_arrive_peer(empty + s, static_cast<uint32_t>(p));  // (p == rank: its own)
      }
    } else {
      mbar_arrive(empty + s);
    }
  };
  int it = 0;
  bool first_chain = true;  // ORD
  for (int t = first; t < tiles; t += stride) {
    int mb, nb;
    coords(t, mb, nb);
#pragma unroll
    for (int h = 0; h < NH; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
    if constexpr (NOPROMO) {
      for (int kb = 0; kb < kbn; ++kb, ++it) {
        const int s = it % S;
        mbar_wait(full + s, (it / S) & 1);
        const uint8_t* st = smem + s * L::kStage;
        wg::fence();
#pragma unroll
        for (int h = 0; h < NH; ++h)
#pragma unroll
          for (int k = 0; k < kBK / 32; ++k)
            wgmma_m64n128k32(acc[h], sw128(st + c * 64 * kBK + 32 * k), sw128(st + L::kA + h * 128 * kBK + 32 * k), 1);
        wg::commit();
        wg::wait<1>();
        if (kb > 0) release((it - 1) % S);
      }
      wg::wait<0>();
#pragma unroll
      for (int h = 0; h < NH; ++h) wg::pin(acc[h]);
      release((it - 1) % S);
    } else
    for (int kb = 0; kb < kbn; ++kb, ++it) {
      const int s = it % S;
      mbar_wait(full + s, (it / S) & 1);
      const float sa0 = sa_s[s * kBM + r0], sa1 = sa_s[s * kBM + r0 + 8];
      const uint8_t* st = smem + s * L::kStage;
      uint32_t af[kBK / 32][4];  // RS: this warp's A fragments of the K block (one panel: A's 128 rows x 128 bytes)
      if constexpr (RS) wg::load_a_fragments<kBK / 32>(af, st, kBM, c * 64);
#pragma unroll
      for (int h = 0; h < NH; ++h) {
        const float sb = __ldg(a.sb + static_cast<int64_t>(nb * NH + h) * kbn + kb);
        if constexpr (ORD) {
          if (c == 1 || !first_chain) turn_wait(4 - c);  // warpgroup 1's very first chain needs no turn
          first_chain = false;
        }
        wg::fence();
#pragma unroll
        for (int k = 0; k < kBK / 32; ++k) {
          if constexpr (RS)
            wgmma_m64n128k32_rs(tmp, af[k], sw128(st + L::kA + h * 128 * kBK + 32 * k), k);
          else
            wgmma_m64n128k32(tmp, sw128(st + c * 64 * kBK + 32 * k), sw128(st + L::kA + h * 128 * kBK + 32 * k), k);
        }
        wg::commit();
        if constexpr (ORD) turn_arrive(3 + c);  // the other warpgroup's turn (3: warpgroup 2's, 4: warpgroup 1's)
        wg::wait<0>();
        wg::pin(tmp);
        if constexpr (RS) wg::pin(af);  // read by the chain until it completed
        if (h == NH - 1) release(s);  // the stage's operands are read
        const float s0 = sa0 * sb, s1 = sa1 * sb;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          acc[h][4 * i] += tmp[4 * i] * s0;
          acc[h][4 * i + 1] += tmp[4 * i + 1] * s0;
          acc[h][4 * i + 2] += tmp[4 * i + 2] * s1;
          acc[h][4 * i + 3] += tmp[4 * i + 3] * s1;
        }
      }
    }
    if constexpr (TS) {
      uint8_t* ob = out_s + c * (L::kOut / 2);
      const int wr = warp * 16 + g;  // this thread's rows wr, wr + 8 of the warpgroup's 64 (both have row & 7 == g)
      const bool leader = threadIdx.x % 128 == 0;
#pragma unroll
      for (int h = 0; h < NH; ++h) {
        if (t != first || h > 0) {  // the previous TMA store has read the buffer
          if (leader) wg::bulk_wait_read<0>();
          warpgroup_sync(1 + c);
        }
#pragma unroll
        for (int i = 0; i < 16; ++i) {  // n8 tile i: columns 8i + 2q, 8i + 2q + 1 (panel i / 8, 16-byte chunk i % 8)
          uint8_t* p = ob + (i / 8) * 8192 + wr * 128 + (((i % 8) ^ g) << 4) + 4 * q;
          const __nv_bfloat162 v0 = __floats2bfloat162_rn(acc[h][4 * i], acc[h][4 * i + 1]);
          const __nv_bfloat162 v1 = __floats2bfloat162_rn(acc[h][4 * i + 2], acc[h][4 * i + 3]);
          *reinterpret_cast<__nv_bfloat162*>(p) = v0;
          *reinterpret_cast<__nv_bfloat162*>(p + 8 * 128) = v1;
        }
        wg::fence_async_smem();
        warpgroup_sync(1 + c);
        if (leader) {
          const int col = (nb * NH + h) * 128, row = mb * kBM + c * 64;
          tma_store_2d(&ty, ob, col, row);
          tma_store_2d(&ty, ob + 8192, col + 64, row);
          wg::bulk_commit();
        }
      }
      continue;
    }
    const int64_t row = static_cast<int64_t>(mb) * kBM + r0;
#pragma unroll
    for (int h = 0; h < NH; ++h) {
      const int col0 = (nb * NH + h) * 128 + 2 * q;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        *reinterpret_cast<__nv_bfloat162*>(a.y + row * a.N + col0 + 8 * i) =
            __floats2bfloat162_rn(acc[h][4 * i], acc[h][4 * i + 1]);
        *reinterpret_cast<__nv_bfloat162*>(a.y + (row + 8) * a.N + col0 + 8 * i) =
            __floats2bfloat162_rn(acc[h][4 * i + 2], acc[h][4 * i + 3]);
      }
    }
  }
  if constexpr (ORD) {
    if (c == 0 && !first_chain) turn_wait(4);  // warpgroup 2's last pass of the turn: no arrival left pending
  }
  if constexpr (TS) {
    if (threadIdx.x % 128 == 0) wg::bulk_wait<0>();  // the last stores are done before the CTA's memory goes
  }
  if constexpr (MC) cluster_sync();
}

// The reference on sampled rows (every `step`-th): one thread an output, fp32 sums per K block as the GEMM.
__global__ void reference_kernel(const uint8_t* x, const uint8_t* w, Args a, int step, float* ref) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x, i = blockIdx.y;
  const int64_t m = static_cast<int64_t>(i) * step;
  if (n >= a.N || m >= a.M) return;
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(x + m * a.K);
  const uint32_t* wr = reinterpret_cast<const uint32_t*>(w + static_cast<int64_t>(n) * a.K);
  float sum = 0.0f;
  for (int kb = 0; kb < a.K / 128; ++kb) {
    float part = 0.0f;
    for (int k4 = kb * 32; k4 < kb * 32 + 32; ++k4) {
      const uint32_t xv = xr[k4], wv = wr[k4];
#pragma unroll
      for (int j = 0; j < 4; ++j) part += e4m3_value((xv >> (8 * j)) & 0xFF) * e4m3_value((wv >> (8 * j)) & 0xFF);
    }
    sum += part * a.sa[static_cast<int64_t>(kb) * a.M + m] * a.sb[static_cast<int64_t>(n / 128) * (a.K / 128) + kb];
  }
  ref[static_cast<int64_t>(i) * a.N + n] = sum;
}

// Outputs left unwritten (the poison, a NaN) or not finite, over the whole of y.
__global__ void count_nonfinite(const __nv_bfloat16* y, int64_t n, unsigned long long* count) {
  unsigned long long c = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    c += !isfinite(__bfloat162float(y[i]));
  if (c) atomicAdd(count, c);
}

__global__ void fill_codes(uint8_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    uint32_t v = h & 0xFF;
    if ((v & 0x7F) > 0x5F) v &= 0xDF;  // magnitudes up to ~2^4: no NaN codes, sums far from the bf16 range's edge
    p[i] = static_cast<uint8_t>(v);
  }
}
__global__ void fill_scales(float* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2246822519u ^ seed;
    h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    p[i] = ldexpf(1.0f + static_cast<float>(h & 1023) / 1024.0f, static_cast<int>((h >> 10) % 5) - 8);
  }
}

struct Shape {
  const char* name;
  int M, N, K;
};

float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int NH, int S, bool NOPROMO = false, int CM = 1, bool RS = false, bool TS = false, bool ORD = false>
void run(const char* variant, const Shape& sh, int sms, const uint8_t* x, const uint8_t* w, Args a, float* dref,
         int step) {
  using L = Layout<NH, S, TS>;
  if (sh.N % (128 * NH) != 0) {
    std::printf("%-14s %-10s skipped (N %% %d)\n", sh.name, variant, 128 * NH);
    return;
  }
  constexpr bool MC = CM > 1;
  if (CM == 4 && (sh.M / kBM) % 2 + (sh.N / 256) % 2 != 0) {
    std::printf("%-14s %-10s skipped (2 x 2 tiles)\n", sh.name, variant);
    return;
  }
  auto kernel = gemm_kernel<NH, S, NOPROMO, CM, RS, TS, ORD>;
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes));
  const CUtensorMap ta = byte_matrix_map(x, sh.M, sh.K, CM == 4 ? 64 : 128, true), tb = byte_matrix_map(w, sh.N, sh.K, 128, true);
  const CUtensorMap ty = matrix_map(a.y, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, sh.M, sh.N, 64, 64, true);
  const int tiles = (sh.M / kBM) * (sh.N / (128 * NH));
  const int grid = std::min(tiles, sms) / CM * CM;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CM, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid), cfg.blockDim = dim3(kThreads), cfg.dynamicSmemBytes = L::kBytes, cfg.stream = nullptr;
  cfg.attrs = attr, cfg.numAttrs = 1;
  if (MC) {  // a persistent grid must be co-resident: as many clusters as fit at once (a GPC may strand an SM)
    int clusters = 0;
    CK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
    if (clusters < 1) {
      std::printf("%-14s %-10s skipped: no cluster of %d fits\n", sh.name, variant, CM);
      return;
    }
    cfg.gridDim = dim3(std::min(grid, CM * clusters));
  }
  auto launch = [&] { CK(cudaLaunchKernelEx(&cfg, kernel, a, ta, tb, ty)); };
  CK(cudaMemset(a.y, 0xFF, static_cast<size_t>(sh.M) * sh.N * 2));  // poisoned: NaN bf16
  launch();
  CK(cudaDeviceSynchronize());
  // every output written and finite, then the sampled rows against the reference
  unsigned long long* dcount;
  unsigned long long nonfinite = 0;
  CK(cudaMalloc(&dcount, 8));
  CK(cudaMemset(dcount, 0, 8));
  count_nonfinite<<<1024, 256>>>(a.y, static_cast<int64_t>(sh.M) * sh.N, dcount);
  CK(cudaMemcpy(&nonfinite, dcount, 8, cudaMemcpyDeviceToHost));
  CK(cudaFree(dcount));
  double max_ref = 0, max_err = 0;
  int64_t bad = 0;
  const int rows = NOPROMO ? 0 : (sh.M + step - 1) / step;  // (no promotion: not the GEMM, nothing to compare)
  std::vector<float> ref(static_cast<size_t>(rows) * sh.N);
  if (rows > 0) CK(cudaMemcpy(ref.data(), dref, ref.size() * 4, cudaMemcpyDeviceToHost));
  std::vector<uint16_t> got(static_cast<size_t>(sh.N));
  for (int i = 0; i < rows; ++i)
    for (int n = 0; n < sh.N; ++n) max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[static_cast<size_t>(i) * sh.N + n])));
  int shown = 0;
  for (int i = 0; i < rows; ++i) {
    CK(cudaMemcpy(got.data(), a.y + static_cast<int64_t>(i) * step * sh.N, static_cast<size_t>(sh.N) * 2, cudaMemcpyDeviceToHost));
    for (int n = 0; n < sh.N; ++n) {
      const double r = ref[static_cast<size_t>(i) * sh.N + n], v = bf16_to_float(got[n]);
      if (!std::isfinite(v)) ++bad;
      max_err = std::max(max_err, std::fabs(v - r));
      if ((!std::isfinite(v) || std::fabs(v - r) > 1e-2 * max_ref) && shown++ < 6)  // where it goes wrong, for layout bugs
        std::printf("  mismatch at row %d col %d: got %.5g want %.5g\n", i * step, n, v, r);
    }
  }
  // time
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int rep = 0; rep < 23; ++rep) {
    CK(cudaEventRecord(e0));
    launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t = 0;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (rep >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double p50 = ms[ms.size() / 2], best = ms.front();
  const double flop = 2.0 * sh.M * static_cast<double>(sh.N) * sh.K;
  const bool ok = NOPROMO || (bad == 0 && nonfinite == 0 && max_err <= 1e-2 * max_ref);
  std::printf("%-14s %-10s M%-6d N%-6d K%-6d grid %4u  p50 %8.3f ms %7.1f TFLOP/s  best %7.1f  max|err|/max|ref| %.2e  unwritten %llu  %s\n",
              sh.name, variant, sh.M, sh.N, sh.K, cfg.gridDim.x, p50, flop / (p50 * 1e-3) / 1e12, flop / (best * 1e-3) / 1e12,
              max_ref > 0 ? max_err / max_ref : 0.0, nonfinite, NOPROMO ? "(timing only)" : ok ? "ok" : "FAIL");
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
}

}  // namespace

int main(int argc, char** argv) {  // fp8_gemm_probe [M [variant [shape index]]]
  setvbuf(stdout, nullptr, _IOLBF, 0);
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("fp8_gemm_probe on %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  const int only_m = argc > 1 ? std::atoi(argv[1]) : 8192;
  const Shape shapes[] = {{"gdn_in_proj", only_m, 16384, 5120}, {"gdn_out_proj", only_m, 5120, 6144},
                          {"attn_qkv", only_m, 14336, 5120},    {"mlp_gate_up", only_m, 34816, 5120},
                          {"mlp_down", only_m, 5120, 17408},    {"lm_head", only_m, 248320, 5120}};
  int64_t max_x = 0, max_w = 0, max_y = 0;
  for (const Shape& s : shapes) {
    max_x = std::max<int64_t>(max_x, static_cast<int64_t>(s.M) * s.K);
    max_w = std::max<int64_t>(max_w, static_cast<int64_t>(s.N) * s.K);
    max_y = std::max<int64_t>(max_y, static_cast<int64_t>(s.M) * s.N);
  }
  uint8_t *x, *w;
  float *sa, *sb, *ref;
  __nv_bfloat16* y;
  CK(cudaMalloc(&x, max_x));
  CK(cudaMalloc(&w, max_w));
  CK(cudaMalloc(&y, max_y * 2));
  CK(cudaMalloc(&sa, max_x / 128 * 4));
  CK(cudaMalloc(&sb, max_w / (128 * 128) * 4 + 4));
  const int step = 61;
  CK(cudaMalloc(&ref, static_cast<size_t>((only_m + step - 1) / step) * 248320 * 4));
  fill_codes<<<1024, 256>>>(x, max_x, 0x1234u);
  fill_codes<<<1024, 256>>>(w, max_w, 0xBEEFu);
  fill_scales<<<256, 256>>>(sa, max_x / 128, 7u);
  fill_scales<<<256, 256>>>(sb, max_w / (128 * 128), 11u);
  CK(cudaDeviceSynchronize());
  // the variants of the header's list, -1 all (one process each is safer: a trapped kernel ends the process)
  const int variant = argc > 2 ? std::atoi(argv[2]) : -1;
  const int only_shape = argc > 3 ? std::atoi(argv[3]) : -1;  // (one shape: for a profiler's single launch)
  for (const Shape& s : shapes) {
    if (only_shape >= 0 && &s != &shapes[only_shape % std::size(shapes)]) continue;
    Args a{sa, sb, y, s.M, s.N, s.K};
    if (variant != 2 && variant != 10) {  // the checked variants' reference
      const int rows = (s.M + step - 1) / step;
      reference_kernel<<<dim3((s.N + 127) / 128, rows), 128>>>(x, w, a, step, ref);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
    }
    if (variant < 0 || variant == 0) run<1, 6>("bn128 s6", s, prop.multiProcessorCount, x, w, a, ref, step);
    if (variant < 0 || variant == 1) run<2, 4>("bn256 s4", s, prop.multiProcessorCount, x, w, a, ref, step);
    if (variant < 0 || variant == 2) run<1, 6, true>("bn128 nopromo", s, prop.multiProcessorCount, x, w, a, ref, step);
    if (variant < 0 || variant == 3) run<2, 4, false, 2>("bn256 mc2", s, prop.multiProcessorCount, x, w, a, ref, step);
    if (variant < 0 || variant == 4) run<2, 4, false, 1, true>("bn256 rs", s, prop.multiProcessorCount, x, w, a, ref, step);
    if (variant < 0 || variant == 5) run<2, 4, false, 2, true>("bn256 mc2 rs", s, prop.multiProcessorCount, x, w, a, ref, step);
    if (variant < 0 || variant == 6) run<2, 4, false, 1, true, true>("bn256 rs ts", s, prop.multiProcessorCount, x, w, a, ref, step);
    if (variant < 0 || variant == 7) run<2, 4, false, 2, true, true>("bn256 mc2rsts", s, prop.multiProcessorCount, x, w, a, ref, step);
    if (variant < 0 || variant == 8) run<2, 4, false, 4, true>("bn256 mc4 rs", s, prop.multiProcessorCount, x, w, a, ref, step);
    if (variant < 0 || variant == 9) run<2, 4, false, 4, true, true>("bn256 mc4rsts", s, prop.multiProcessorCount, x, w, a, ref, step);
    if (variant < 0 || variant == 10) run<2, 4, true, 2, false, true>("mc2ts nopromo", s, prop.multiProcessorCount, x, w, a, ref, step);
    if (variant < 0 || variant == 11) run<2, 4, false, 2, true, true, true>("mc2rsts ord", s, prop.multiProcessorCount, x, w, a, ref, step);
    std::fflush(stdout);
  }
  return 0;
}
