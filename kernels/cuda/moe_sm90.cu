// The grouped expert GEMM on Hopper warpgroup MMA (wgmma, sm_90a): moe_grouped_gemm (moe.cu) runs it
// for the prefill's wide tiles on an sm_90 device, bf16 experts (tuning::moe_wgmma). Same contract
// and tile table as the mma.sync kernel there (tiles of kMoeTileRows = 64 permuted rows of one
// expert; gate|up with SwiGLU fused, or down).
//
// Why: at 8192 tokens (Qwen3.6-35B-A3B, h200-moe5-441b581 moe_bench) the mma.sync kernel ran the
// experts' GEMMs at 176 TFLOP/s, 2.35 of the block's 2.61 ms a layer, 104 of the forward's 166 ms:
// ldmatrix traffic and 4-warp blocks cap mma.sync near a third of the tensor cores' peak, as they
// did the attention kernels (attention_sm90.cu). wgmma reads both operands from shared memory.
//
// A block: one warpgroup (128 threads), 64 rows x 128 weight rows (swiglu: 64 gate and the 64 up
// rows of the same act columns; down: 128 output columns), k tiles of 64 in wgmma.cuh's panel layout
// (128-byte swizzle) filled by cp.async, kStages deep. Per k tile: 4 k-steps x 2 wgmma m64n64k16
// (one accumulator for each 64-row half of the weight tile), committed as one group; one group stays
// in flight while the next tile's copies are issued (a stage is refilled two tiles after its use,
// past a barrier that follows every warp's wait for it). 96 KB of shared memory: two blocks an SM.
// Every output element sums its K in k-step order inside the tensor core, so its bits differ from
// the mma.sync kernel's by rounding (the tests hold both to the f32 reference).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/emulatable.cuh"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace dflash::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int BM = static_cast<int>(kMoeTileRows), BN = 128, BK = 64, kThreads = 128, kStages = 4;
constexpr int kATile = BM * BK * 2, kBTile = BN * BK * 2, kStageBytes = kATile + kBTile;
constexpr size_t kSmem = size_t(kStages) * kStageBytes + 1024;  // + the slack to align to the swizzle pattern
static_assert(BM == 64, "one warpgroup's wgmma rows");

__global__ void __launch_bounds__(kThreads) grouped_gemm_wgmma_kernel(MoeGemmParams p) {
  DFLASH_DYNAMIC_SMEM(unsigned char, smem_raw);
  unsigned char* smem = wgmma::align1024(smem_raw);
  moe_detail::TileOperands op;
  if (!moe_detail::tile_operands<2>(p, BM, op)) return;
  const int row0 = op.row0, row_end = op.row_end;
  const int K = static_cast<int>(p.K), Nout = static_cast<int>(p.Nout);
  const int col0 = static_cast<int>(blockIdx.y) * (p.swiglu ? BN / 2 : BN);
  const bf16* X = op.x;
  const bf16* W = reinterpret_cast<const bf16*>(op.w);
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;

  // Each thread's 16-byte chunks of a stage: A 64 rows x 8 chunks (4 a thread), B 128 x 8 (8).
  constexpr int ACH = BM * 8 / kThreads, BCH = BN * 8 / kThreads;
  const bf16* a_src[ACH];
  bool a_ok[ACH];
  uint32_t a_off[ACH];
#pragma unroll
  for (int c = 0; c < ACH; ++c) {
    const int idx = tid + c * kThreads, r = idx >> 3, ch = idx & 7, pos = row0 + r;
    a_ok[c] = pos < row_end;
    const int src = a_ok[c] ? (op.src_row ? op.src_row[pos] : pos) : 0;
    a_src[c] = X + static_cast<int64_t>(src) * p.ldx + ch * 8;
    a_off[c] = wgmma::panel_offset(BM, r, ch);
  }
  const bf16* b_src[BCH];
  bool b_ok[BCH];
  uint32_t b_off[BCH];
#pragma unroll
  for (int c = 0; c < BCH; ++c) {
    const int idx = tid + c * kThreads, r = idx >> 3, ch = idx & 7;
    const int wrow = moe_detail::weight_row(p, r, col0, BN, b_ok[c]);
    b_src[c] = W + static_cast<int64_t>(b_ok[c] ? wrow : 0) * K + ch * 8;
    b_off[c] = wgmma::panel_offset(BN, r, ch);
  }
  const int KT = (K + BK - 1) / BK;
  auto load = [&](int stage, int kt) {
    unsigned char* sa = smem + stage * kStageBytes;
    unsigned char* sb = sa + kATile;
    const int k0 = kt * BK;
#pragma unroll
    for (int c = 0; c < ACH; ++c) {
      const bool v = a_ok[c] && k0 + ((tid + c * kThreads) & 7) * 8 < K;
      ptx::cp_async16_zfill(sa + a_off[c], v ? a_src[c] + k0 : X, v);
    }
#pragma unroll
    for (int c = 0; c < BCH; ++c) {
      const bool v = b_ok[c] && k0 + ((tid + c * kThreads) & 7) * 8 < K;
      ptx::cp_async16_zfill(sb + b_off[c], v ? b_src[c] + k0 : W, v);
    }
  };

  float acc[2][32];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[h][i] = 0.0f;

  // Tiles kt + 1, kt + 2 in flight while tile kt multiplies; stage (kt + 2) % 4 last held tile kt - 2,
  // whose wgmma group every warp saw complete (wait<1> after issuing kt - 1) before this barrier.
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < KT) load(s, s);
    ptx::cp_async_commit_ring();
  }
  for (int kt = 0; kt < KT; ++kt) {
    ptx::cp_async_wait_ring<kStages - 3>();
    wgmma::fence_async_smem();
    __syncthreads();
    if (kt + kStages - 2 < KT) load((kt + kStages - 2) % kStages, kt + kStages - 2);
    ptx::cp_async_commit_ring();
    const unsigned char* sa = smem + (kt % kStages) * kStageBytes;
    const unsigned char* sb = sa + kATile;
    const uint64_t da = wgmma::descriptor(sa, 0, 1024);
    wgmma::fence();
    wgmma::mma_nt<BK / 16>(acc[0], da, 0, wgmma::descriptor(sb, 0, 1024), 0);
    wgmma::mma_nt<BK / 16>(acc[1], da, 0, wgmma::descriptor(sb + 64 * 128, 0, 1024), 0);
    wgmma::commit();
    wgmma::wait<1>();
  }
  wgmma::wait<0>();
  wgmma::pin(acc[0]);
  wgmma::pin(acc[1]);
  ptx::cp_async_wait_ring<0>();

  // Accumulator element (warp w, lane 4g + t) 4i + 2h + j: row 16w + g + 8h, column 8i + 2t + j of
  // its 64-column half.
  bf16* Y = op.y;
  const bool pairs = p.ldy % 2 == 0 && reinterpret_cast<uintptr_t>(Y) % 4 == 0;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int pos = row0 + 16 * warp + g + 8 * h;
    if (pos >= row_end) continue;
    bf16* yr = Y + static_cast<int64_t>(pos) * p.ldy;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int q = 4 * i + 2 * h;
      if (p.swiglu) {
        moe_detail::store2(yr, col0 + 8 * i + 2 * t, Nout, moe_detail::silu_expf(acc[0][q]) * acc[1][q],
                           moe_detail::silu_expf(acc[0][q + 1]) * acc[1][q + 1], pairs);
      } else {
#pragma unroll
        for (int half = 0; half < 2; ++half)
          moe_detail::store2(yr, col0 + 64 * half + 8 * i + 2 * t, Nout, acc[half][q], acc[half][q + 1], pairs);
      }
    }
  }
}

}  // namespace

bool moe_wgmma_supported(int device) { return wgmma::sm90a_code_runs_on(device); }

void moe_grouped_gemm_wgmma(const MoeGemmParams& p, Stream s) {
  static bool attr[64] = {};
  int dev = 0;
  DFLASH_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 64 || !attr[dev]) {
    DFLASH_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kSmem)));
    if (dev < 64) attr[dev] = true;
  }
  const int64_t cols = p.swiglu ? BN / 2 : BN;
  const dim3 grid(static_cast<unsigned>(p.max_tiles + moe_extra_tiles(p)), static_cast<unsigned>((p.Nout + cols - 1) / cols));
  launch_kernel(grouped_gemm_wgmma_kernel, grid, dim3(kThreads), kSmem, static_cast<cudaStream_t>(s), p);
}

}  // namespace dflash::cuda
