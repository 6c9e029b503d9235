// Causal flash-attention forward on Hopper warpgroup MMA (wgmma, sm_90a): the kernel that
// flash_attention_fwd (attention.cu) picks on an sm_90 device for head dims 128 and 256. Same
// contract as the mma.sync kernel there: GQA, varlen (cu_seqlens), bf16 in and out, fp32 softmax.
//
// One CTA owns 128 query rows of one (sequence, query head) and runs two warpgroups of 64 rows
// each; key/value tiles of 64 rows stream through shared memory (cp.async, two stages, from the
// diagonal tile down to tile 0, as in attention.cu). Per warpgroup and key tile:
//   S[64, 64]  = Q Kᵀ  : D/16 wgmma m64n64k16, Q and K both read from shared memory (K-major);
//   online softmax in registers (flash_tile.cuh, shared with the mma.sync kernels), P to bf16;
//   O[64, D]  += P V   : 4 k-steps x D/64 wgmma m64n64k16, P from registers, V from shared memory
//                        (MN-major, trans-b).
// Q, K and V tiles use wgmma.cuh's panel layout (128-byte swizzle), written by cp.async and made
// visible to the tensor cores' async proxy with fence.proxy.async before each barrier.
//
// Roofline (Qwen3.6-27B prefill, T = 8192, Hq 24, Hkv 4, d 256, causal): 0.82 TFLOP; at the
// ~990 TFLOP/s dense bf16 peak 0.83 ms. With mma.sync the shared-memory bandwidth capped the
// kernel near 430 TFLOP/s (3.12 ms measured = 264 TFLOP/s): wgmma reads its shared operands
// without ldmatrix, Q once per key tile per warpgroup instead of per warp.
// Not done (FlashAttention-3): a producer warp with TMA, ping-pong scheduling of the two
// warpgroups and overlapping the softmax of one tile with the S product of the next.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

#include "core/cuda/check.h"
#include "kernels/cuda/flash_tile.cuh"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/wgmma.cuh"
#include "core/error.h"

namespace dflash::cuda {

namespace {

using bf16 = __nv_bfloat16;
using flash::FlashArgs;

template <int D_>
struct WgTiling {
  static constexpr int D = D_, kBlockM = 128, kBlockN = 64, kThreads = 256, kPanels = D / 64;
  static constexpr int kQBytes = kBlockM * D * 2;     // Q tile [128, D]
  static constexpr int kTileBytes = kBlockN * D * 2;  // one K or V tile [64, D]
  // Q, two stages of K and V, and the slack to align the base to the 1024-byte swizzle pattern.
  static constexpr size_t kSmemBytes = size_t(kQBytes) + 4 * kTileBytes + 1024;
  static_assert(D % 64 == 0, "head dim must be a multiple of 64");
};

// Rows [0, ROWS) of a [*, D] global matrix (row stride ld elements) into a panel tile; rows >=
// valid are zero-filled (their source address is row 0, which is always valid).
template <int D, int ROWS, int kThreads>
__device__ __forceinline__ void load_panels(unsigned char* s, const bf16* g, int64_t ld, int valid, int tid) {
  constexpr int kChunks = D / 8;
  static_assert((ROWS * kChunks) % kThreads == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int step = 0; step < ROWS * kChunks / kThreads; ++step) {
    const int i = step * kThreads + tid;
    const int r = i / kChunks, c = i % kChunks;
    const bool ok = r < valid;
    flash::cp_async_16(s + wgmma::panel_offset(ROWS, r, c), g + (ok ? r : 0) * ld + c * 8, ok ? 16 : 0);
  }
}

template <int D>
__global__ void __launch_bounds__(256, 1) flash_fwd_wgmma_kernel(const FlashArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = WgTiling<D>;
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, P = Cfg::kPanels, KS = D / 16;
  constexpr int NT = BN / 8;  // n-tiles of S

  const int h = blockIdx.x;
  const int m_block = gridDim.y - 1 - blockIdx.y;  // longest blocks first
  const int seq = blockIdx.z;
  const int begin = a.cu_seqlens[seq];
  const int seqlen = a.cu_seqlens[seq + 1] - begin;
  const int m_start = m_block * BM;
  if (m_start >= seqlen) return;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* sQ = wgmma::align1024(smem_raw);
  unsigned char* sK = sQ + Cfg::kQBytes;     // [2] K tiles
  unsigned char* sV = sK + 2 * Cfg::kTileBytes;  // [2] V tiles

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wg = warp / 4, wq = warp % 4;  // warpgroup, warp within it
  const int kh = h / a.group;
  const int64_t ldq = int64_t(a.Hq) * D;
  const bf16* qg = a.q + (int64_t(begin + m_start) * a.Hq + h) * D;
  const bf16* kg = a.k + int64_t(begin) * a.ldk + int64_t(kh) * D;
  const bf16* vg = a.v + int64_t(begin) * a.ldv + int64_t(kh) * D;

  const int n_blocks = min((seqlen + BN - 1) / BN, (m_start + BM + BN - 1) / BN);
  auto load_kv = [&](int j, int stage) {
    const int valid = min(BN, seqlen - j * BN);
    load_panels<D, BN, 256>(sK + stage * Cfg::kTileBytes, kg + int64_t(j) * BN * a.ldk, a.ldk, valid, tid);
    load_panels<D, BN, 256>(sV + stage * Cfg::kTileBytes, vg + int64_t(j) * BN * a.ldv, a.ldv, valid, tid);
  };
  // cp.async groups as in attention.cu: Q, tile n_blocks-1, tile n_blocks-2 (maybe empty).
  load_panels<D, BM, 256>(sQ, qg, ldq, min(BM, seqlen - m_start), tid);
  ptx::cp_async_commit();
  load_kv(n_blocks - 1, 0);
  ptx::cp_async_commit();
  if (n_blocks >= 2) load_kv(n_blocks - 2, 1);
  ptx::cp_async_commit();

  float o[P][32];
  wgmma::zero(o);
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  const int g = lane >> 2, t = lane & 3;
  const int wg_row0 = m_start + 64 * wg;        // first query row (in the sequence) of this warpgroup
  const int q_row0 = wg_row0 + 16 * wq + g;     // row of accumulator elements 0/1; +8 for 2/3
  // Q of this warpgroup: panel p at + p·BM·128 bytes, k-step within a panel at + 32 bytes.
  const uint64_t desc_q = wgmma::descriptor(sQ + 64 * wg * 128, 0, 1024);

  for (int it = 0; it < n_blocks; ++it) {
    const int j = n_blocks - 1 - it, stage = it & 1;
    const int n_start = j * BN;
    flash::cp_async_wait<1>();
    wgmma::fence_async_smem();
    __syncthreads();

    // Warpgroup-uniform: a tile whose first key lies past the warpgroup's last row, or a
    // warpgroup entirely past the end of the sequence, does nothing.
    if (n_start <= wg_row0 + 63 && wg_row0 < seqlen) {
      const uint64_t desc_k = wgmma::descriptor(sK + stage * Cfg::kTileBytes, 0, 1024);
      const uint64_t desc_v = wgmma::descriptor(sV + stage * Cfg::kTileBytes, BN * 128, 1024);
      float s[NT][4];
      float(&sf)[NT * 4] = reinterpret_cast<float(&)[NT * 4]>(s);
      wgmma::issue_nt<KS>(sf, desc_q, BM * 128, desc_k, BN * 128);
      wgmma::wait<0>();
      wgmma::pin(sf);

      if (n_start + BN - 1 > wg_row0 || n_start + BN > seqlen) {
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = n_start + i * 8 + 2 * t + (e & 1);
            const int qpos = q_row0 + (e >> 1) * 8;
            if (key > qpos || key >= seqlen) s[i][e] = -INFINITY;
          }
      }
      wgmma::softmax_pv<NT, P>(s, o, m0, m1, l0, l1, a.scale_log2, desc_v, BN * 128);
    }

    __syncthreads();  // every warpgroup is done with this stage before it is refilled
    if (j >= 2) load_kv(j - 2, stage);
    ptx::cp_async_commit();
  }

  // Normalise, stage the warp's 16 rows in its own rows of the Q tile (read only by this warp's
  // finished wgmma), and write them out with 16-byte stores.
  float inv0, inv1;
  flash::finish_rows(l0, l1, inv0, inv1);
  wgmma::store_rows<P>(sQ, BM, 64 * wg + 16 * wq + g, o, inv0, inv1);
  __syncwarp();
  bf16* og = a.out + (int64_t(begin + m_start) * a.Hq + h) * D;
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int step = 0; step < kChunks / 2; ++step) {  // 16 rows · kChunks chunks over 32 lanes
    const int i = step * 32 + lane;
    const int r = 64 * wg + 16 * wq + i / kChunks, c = i % kChunks;
    if (m_start + r < seqlen)
      *reinterpret_cast<uint4*>(og + r * ldq + c * 8) =
          *reinterpret_cast<const uint4*>(sQ + wgmma::panel_offset(BM, r, c));
  }
#endif
}

template <int D>
void launch(const AttentionParams& p, cudaStream_t stream) {
  using Cfg = WgTiling<D>;
  const auto kernel = flash_fwd_wgmma_kernel<D>;
  DFLASH_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(Cfg::kSmemBytes)));
  const dim3 grid(static_cast<unsigned>(p.Hq), static_cast<unsigned>((p.max_seqlen + Cfg::kBlockM - 1) / Cfg::kBlockM),
                  static_cast<unsigned>(p.num_seqs));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(flash::flash_args(p));
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace

namespace wgmma {
bool sm90a_code_runs_on(int device) {
  static std::mutex mu;
  static int known[64] = {};  // 0 unknown, 1 yes, 2 no
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0 || device >= 64) return false;
  if (known[device] == 0) {
    int major = 0, minor = 0, prev = 0;
    DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    bool ok = major == 9 && minor == 0;  // sm_90a code runs on sm_90 exactly
    if (ok) {
      DFLASH_CUDA_CHECK(cudaGetDevice(&prev));
      DFLASH_CUDA_CHECK(cudaSetDevice(device));
      cudaFuncAttributes attr{};
      ok = cudaFuncGetAttributes(&attr, flash_fwd_wgmma_kernel<256>) == cudaSuccess;
      (void)cudaGetLastError();  // a missing image is an answer, not an error
      DFLASH_CUDA_CHECK(cudaSetDevice(prev));
    }
    known[device] = ok ? 1 : 2;
  }
  return known[device] == 1;
}
}  // namespace wgmma

bool flash_attention_wgmma_available(int64_t d, int device) {
  return (d == 128 || d == 256) && wgmma::sm90a_code_runs_on(device);
}

// Called by flash_attention_fwd (attention.cu) after it validated p.
void flash_attention_fwd_wgmma(const AttentionParams& p, Stream s) {
  int device = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&device));
  DFLASH_CHECK_HINT(flash_attention_wgmma_available(p.d, device),
                    "flash_attention_fwd: the wgmma kernel cannot run head dim " << p.d << " on CUDA device " << device,
                    "it needs head dim 128 or 256, an sm_90 GPU and a build with sm_90a code; use FlashImpl::Auto");
  const auto stream = static_cast<cudaStream_t>(s);
  if (p.d == 128) launch<128>(p, stream);
  else launch<256>(p, stream);
}

}  // namespace dflash::cuda
