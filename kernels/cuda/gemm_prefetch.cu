// Weights into L2 ahead of their decode GEMM (issue 30; gemm.h prefetch_l2). A decode step alternates
// GEMMs that stream their weights at the memory's rate with short ops (residual + norm, the
// GatedDeltaNet chain, attention, SwiGLU) during which the memory idles: ~2.2 ms of a 15.3 ms bf16
// 27B step on an H200 (bench/results/h200-check-7e956c4). The model forks this kernel onto a side
// stream right after a GEMM, so the next GEMM's first weight bytes travel while the short ops run,
// and that GEMM finds them in L2.
//
// What is fetched: the same prefix of every weight row (bytes_per_row of row_bytes), not the first
// rows whole: a decode GEMM's blocks each own a group of rows and walk its K from the start, so every
// block starts on lines already in L2 (the first rows whole would speed only the blocks that own
// them, and the GEMM ends with its slowest block). One thread per row issues cp.async.bulk.prefetch.L2
// (sm_90; one instruction per <= 32 KB) or prefetch.global.L2 per 128-byte line (below sm_90, or
// tuning::decode_prefetch_bulk = 0).
// A prefetch is a hint: nothing is written, and a dropped one costs only its bytes' time later.
//
// Measured on H100s (27B shapes): the prefetched lines land (kernel_bench --only l2prefetch: a GEMM
// alone after a 16 MiB prefetch saves 3.6-6.4 us, a real read of the same bytes 3.9-7.5), but the decode
// step gains only sometimes: bf16 -2.1% / -2.3% at 8 / 12 MiB on one H100, +0.5% at 4 MiB, nothing at
// 16 MiB on another, fp8 +0.7% at 8 MiB (bench/results/h100-prefetch-dea16b8, h100-l2prefetch-7e34c98).
// So the decode plan leaves it off.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "core/cuda/check.h"
#include "core/error.h"
#include "kernels/cuda/gemm.h"

namespace dflash::cuda {

namespace tuning {
namespace {
int env_int(const char* name, int fallback) {
  const char* e = std::getenv(name);
  return e && *e ? std::atoi(e) : fallback;
}
}  // namespace
int decode_prefetch_mb = env_int("DFLASH_DECODE_PREFETCH_MB", 8);
int decode_prefetch_bulk = env_int("DFLASH_DECODE_PREFETCH_BULK", 1);
}  // namespace tuning

namespace {

constexpr int64_t kPrefetchAlign = 16;      // cp.async.bulk: 16-byte aligned address and size
constexpr uint32_t kBulkChunk = 32 * 1024;  // bytes per bulk prefetch instruction

template <bool kBulk>
__global__ void prefetch_l2_kernel(const char* __restrict__ w, int64_t rows, int64_t row_bytes, int64_t bytes_per_row) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += stride) {
    const char* p = w + r * row_bytes;
    for (int64_t o = 0; o < bytes_per_row; o += kBulkChunk) {
      const int64_t n = min(static_cast<int64_t>(kBulkChunk), bytes_per_row - o);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      constexpr bool bulk = kBulk;
#else
      constexpr bool bulk = false;
#endif
      if constexpr (bulk) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p + o), "r"(static_cast<uint32_t>(n))
                     : "memory");
      } else {
        for (int64_t l = 0; l < n; l += 128) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p + o + l));
      }
    }
  }
}

}  // namespace

int64_t l2_prefetch_bytes_per_row(int64_t rows, int64_t row_bytes, int64_t budget) {
  if (rows <= 0 || row_bytes < kPrefetchAlign || budget <= 0) return 0;
  const int64_t per_row = std::min(row_bytes, budget / rows) / kPrefetchAlign * kPrefetchAlign;
  return per_row;  // (0 when the budget gives a row less than 16 bytes)
}

bool prefetch_l2_supported(const L2PrefetchParams& p) {
  return p.w != nullptr && p.rows > 0 && p.bytes_per_row > 0 && p.bytes_per_row <= p.row_bytes &&
         reinterpret_cast<uintptr_t>(p.w) % kPrefetchAlign == 0 && p.row_bytes % kPrefetchAlign == 0 &&
         p.bytes_per_row % kPrefetchAlign == 0;
}

void prefetch_l2(const L2PrefetchParams& p, Stream s) {
  DFLASH_CHECK(prefetch_l2_supported(p), "prefetch_l2: need a 16-byte aligned w, row_bytes and 0 < bytes_per_row <= "
                                         "row_bytes in multiples of 16, rows > 0; got w="
                                             << p.w << " rows=" << p.rows << " row_bytes=" << p.row_bytes
                                             << " bytes_per_row=" << p.bytes_per_row);
  constexpr int kThreads = 128;
  // A few blocks: the instructions are issued in microseconds; the bytes travel after the kernel ends.
  const int blocks = static_cast<int>(std::min<int64_t>((p.rows + kThreads - 1) / kThreads, 32));
  const auto kernel = tuning::decode_prefetch_bulk ? prefetch_l2_kernel<true> : prefetch_l2_kernel<false>;
  kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(s)>>>(static_cast<const char*>(p.w), p.rows, p.row_bytes,
                                                              p.bytes_per_row);
  DFLASH_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dflash::cuda
