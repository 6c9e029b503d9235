// Streaming FP8 skinny GEMM for decode / verify (issue 30): y[M, N] = x[M, K] · w[N, K]^T for M <= 16
// with gemm_fp8's operands (e4m3 codes, per-token 1 x 128 activation scales, 128 x 128 weight block
// scales; layouts in gemm.h "FP8"), fp32 accumulation, bf16 out. gemm_fp8 dispatches here for
// M % 4 != 0 (cuBLASLt has no block-scaled kernel there) or when tuning::gemm_fp8_stream == 1.
//
// Measured on an H200 (bench/results/h200-fp8dec-*, kernel_bench --only fp8, weight_read GB/s, copy
// 4,268): gate/up 34816 x 5120 M 1 / 4 / 16: 2,713 / 2,687 / 2,152 (cuBLASLt block-scaled: - / 3,150
// / 2,852); down 5120 x 17408 M 4 / 16: 2,503 / 2,005 (cuBLASLt 2,704 / 2,525); gdn in_proj 16384 x
// 5120 M 4: 2,914 (cuBLASLt 2,657). Used in every step of the fp8 decode it made the step slower
// (14.72 vs 12.11 ms), so it is not the default. Short of the goal (>= 3,600 GB/s): one batch of
// loads per warp then the math (no overlap inside a warp; 8-warp blocks, 2 per SM); at M 16 the
// x fragments come from L2 per warp (doubling the bytes a warp loads). Next: a cp.async ring of W
// stages in shared memory per block, x staged once per block, and occupancy measured.
//
// Work layout: a block of 8 warps = RW row warps x KW k warps; a warp owns 16 weight rows and a
// contiguous run of 128-wide K groups. Per group each lane issues four 16-byte loads of the weight
// (rows g and g + 8 of its 16, bytes 16t and 64 + 16t of the group: a warp reads every 128-byte
// line of its 16 rows whole), kGroupsPerBatch groups' loads issued before any math (bytes in flight),
// and runs mma.sync m16n8k32 e4m3 (the weight rows as the MMA's M, tokens as its N; one n8 tile for
// M <= 8, two for M <= 16). Inside an MMA the k order is permuted identically for both operands, so
// each lane's 16-byte units are used as loaded. Per group the code-product sums are scaled by the
// weight block's scale and each token's group scale (fp32), as ops::gemm_fp8_blockwise does; the KW
// partial sums meet in shared memory. RW is chosen so the grid covers the SMs twice (split-K where N
// is small).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/gemm.h"

namespace dflash::cuda {

namespace tuning {
int gemm_fp8_stream = -1;  // -1: only where cuBLASLt has no kernel (M % 4 != 0); 0: never; 1: whenever supported
}  // namespace tuning

namespace {

constexpr int kWarps = 8;
constexpr int kGroupsPerBatch = 4;

__device__ __forceinline__ uint4 ld_stream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // the host dispatch runs this kernel on sm_90 only
#endif
}

template <int RW, bool kTwo>
__global__ void __launch_bounds__(kWarps * 32) gemm_fp8_stream_kernel(
    const uint8_t* __restrict__ x, int64_t ldx, const float* __restrict__ xs, int64_t ldxs,
    const uint8_t* __restrict__ w, const float* __restrict__ ws, int64_t ldws, __nv_bfloat16* __restrict__ y,
    int64_t ldy, int M, int N, int K) {
  constexpr int KW = kWarps / RW;
  __shared__ float red[KW > 1 ? KW - 1 : 1][RW][32][8];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rw = warp % RW, kw = warp / RW;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = (blockIdx.x * RW + rw) * 16;
  const int G = K / 128;
  const int gbeg = static_cast<int>(static_cast<int64_t>(G) * kw / KW);
  const int gend = static_cast<int>(static_cast<int64_t>(G) * (kw + 1) / KW);
  const bool live = row0 < N;
  const int ra = min(row0 + g, N - 1), rb = min(row0 + g + 8, N - 1);
  const uint8_t* wa = w + static_cast<int64_t>(ra) * K + 16 * t;
  const uint8_t* wb = w + static_cast<int64_t>(rb) * K + 16 * t;
  const int t0 = g, t1 = g + 8;  // the tokens whose codes this lane supplies (B operand columns)
  const uint8_t* x0 = x + static_cast<int64_t>(t0) * ldx + 16 * t;
  const uint8_t* x1 = x + static_cast<int64_t>(t1) * ldx + 16 * t;
  const float* wsr = ws + static_cast<int64_t>(live ? row0 / 128 : 0) * ldws;
  float acc0[4] = {0, 0, 0, 0}, acc1[4] = {0, 0, 0, 0};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  if (live) {
    for (int gb = gbeg; gb < gend; gb += kGroupsPerBatch) {
      uint4 a[kGroupsPerBatch][2][2], b0[kGroupsPerBatch][2], b1[kGroupsPerBatch][2];
#pragma unroll
      for (int u = 0; u < kGroupsPerBatch; ++u) {
        const int grp = gb + u;
        const bool in = grp < gend;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int64_t off = static_cast<int64_t>(grp) * 128 + 64 * j;
          a[u][0][j] = in ? ld_stream(wa + off) : zero;
          a[u][1][j] = in ? ld_stream(wb + off) : zero;
          b0[u][j] = in && t0 < M ? __ldg(reinterpret_cast<const uint4*>(x0 + off)) : zero;
          b1[u][j] = kTwo && in && t1 < M ? __ldg(reinterpret_cast<const uint4*>(x1 + off)) : zero;
        }
      }
#pragma unroll
      for (int u = 0; u < kGroupsPerBatch; ++u) {
        const int grp = gb + u;
        if (grp >= gend) break;
        float d0[4] = {0, 0, 0, 0}, d1[4] = {0, 0, 0, 0};
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t A0 = word(a[u][0][j], 2 * h), A1 = word(a[u][1][j], 2 * h);
            const uint32_t A2 = word(a[u][0][j], 2 * h + 1), A3 = word(a[u][1][j], 2 * h + 1);
            mma_e4m3(d0, A0, A1, A2, A3, word(b0[u][j], 2 * h), word(b0[u][j], 2 * h + 1));
            if (kTwo) mma_e4m3(d1, A0, A1, A2, A3, word(b1[u][j], 2 * h), word(b1[u][j], 2 * h + 1));
          }
        const float sw = __ldg(wsr + grp);
        const float* xg = xs + static_cast<int64_t>(grp) * ldxs;
        const int c = 2 * t;
        const float s0 = c < M ? sw * __ldg(xg + c) : 0.0f, s1 = c + 1 < M ? sw * __ldg(xg + c + 1) : 0.0f;
        acc0[0] += d0[0] * s0;
        acc0[1] += d0[1] * s1;
        acc0[2] += d0[2] * s0;
        acc0[3] += d0[3] * s1;
        if (kTwo) {
          const float s2 = c + 8 < M ? sw * __ldg(xg + c + 8) : 0.0f;
          const float s3 = c + 9 < M ? sw * __ldg(xg + c + 9) : 0.0f;
          acc1[0] += d1[0] * s2;
          acc1[1] += d1[1] * s3;
          acc1[2] += d1[2] * s2;
          acc1[3] += d1[3] * s3;
        }
      }
    }
  }
  if constexpr (KW > 1) {
    if (kw > 0) {
      float* r = red[kw - 1][rw][lane];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        r[i] = acc0[i];
        r[4 + i] = acc1[i];
      }
    }
    __syncthreads();
    if (kw > 0) return;
#pragma unroll
    for (int k = 0; k < KW - 1; ++k) {
      const float* r = red[k][rw][lane];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc0[i] += r[i];
        acc1[i] += r[4 + i];
      }
    }
  }
  if (!live) return;
  // C fragment: (row g, tokens 2t, 2t+1) in [0], [1]; row g + 8 in [2], [3]; acc1: tokens + 8.
  const int rows[2] = {row0 + g, row0 + g + 8};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = rows[i / 2], tok = 2 * t + (i & 1);
    if (row >= N) continue;
    if (tok < M) y[static_cast<int64_t>(tok) * ldy + row] = __float2bfloat16(acc0[i]);
    if (kTwo && tok + 8 < M) y[static_cast<int64_t>(tok + 8) * ldy + row] = __float2bfloat16(acc1[i]);
  }
}

template <bool kTwo>
void launch_rw(int rw, const GemmFp8Params& p, cudaStream_t st) {
  auto go = [&](auto kernel, int RW) {
    const unsigned grid = static_cast<unsigned>((p.N + 16 * RW - 1) / (16 * RW));
    kernel<<<grid, kWarps * 32, 0, st>>>(p.x, p.ldx, p.x_scale, fp8_act_scale_ld(p.M), p.w, p.w_scale,
                                         fp8_weight_scale_ld(p.K), static_cast<__nv_bfloat16*>(p.y), p.ldy,
                                         static_cast<int>(p.M), static_cast<int>(p.N), static_cast<int>(p.K));
  };
  switch (rw) {
    case 8: go(gemm_fp8_stream_kernel<8, kTwo>, 8); break;
    case 4: go(gemm_fp8_stream_kernel<4, kTwo>, 4); break;
    case 2: go(gemm_fp8_stream_kernel<2, kTwo>, 2); break;
    default: go(gemm_fp8_stream_kernel<1, kTwo>, 1); break;
  }
  DFLASH_CUDA_CHECK_LAST();
}

}  // namespace

bool gemm_fp8_stream_supported(const GemmFp8Params& p) {
  return !p.tensor_scales && !p.w_vec_scales && !p.y_f32 && !p.accumulate && p.M >= 1 && p.M <= 16 && p.K % 128 == 0 && p.N >= 1 && p.N * p.K < (int64_t{1} << 40) &&
         p.K < (int64_t{1} << 30) && p.N < (int64_t{1} << 30);
}

void gemm_fp8_stream(const GemmFp8Params& p, int sm_count, Stream s) {
  DFLASH_CHECK_HINT(gemm_fp8_stream_supported(p),
                    "gemm_fp8_stream: the streaming FP8 GEMM needs block scales, 1 <= M <= 16 and K a multiple "
                    "of 128, got M=" << p.M << " N=" << p.N << " K=" << p.K
                                     << (p.tensor_scales ? " (tensor scales)" : ""),
                    "run gemm_fp8 (cuBLASLt) for other shapes; checkpoints' FP8 projections have K a multiple of 128");
  DFLASH_CHECK(p.x != nullptr && p.w != nullptr && p.y != nullptr && p.x_scale != nullptr && p.w_scale != nullptr,
               "gemm_fp8_stream: null pointer for M=" << p.M << " N=" << p.N << " K=" << p.K);
  DFLASH_CHECK(p.ldx >= p.K && p.ldx % 16 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.w) % 16 == 0 && p.ldy >= p.N,
               "gemm_fp8_stream: needs 16-byte aligned codes with ldx a multiple of 16 (>= K) and ldy >= N, got ldx="
                   << p.ldx << " ldy=" << p.ldy << " K=" << p.K << " N=" << p.N);
  const int64_t tiles = (p.N + 15) / 16, want = 2 * std::max(sm_count, 1);
  int rw = 8;
  while (rw > 1 && (tiles + rw - 1) / rw < want) rw /= 2;
  const auto st = static_cast<cudaStream_t>(s);
  if (p.M > 8)
    launch_rw<true>(rw, p, st);
  else
    launch_rw<false>(rw, p, st);
}

const char* gemm_fp8_stream_kernel_name() { return "dflash e4m3 stream (mma m16n8k32, M <= 16)"; }

}  // namespace dflash::cuda
