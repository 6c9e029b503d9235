#pragma once
// What the standalone Hopper probes share (fp8_gemv_probe.cu, fp8_gemm_probe.cu; not part of the build): the
// CUDA error check, e4m3 decoding for their references, mbarrier waits and arrivals, and 2-D TMA maps of byte
// matrices (cuTensorMapEncodeTiled from the driver, without linking libcuda).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

__device__ __forceinline__ float e4m3_value(uint32_t v) {
  const uint32_t s = v >> 7, e = (v >> 3) & 15, m = v & 7;
  float f = e == 0 ? ldexpf(static_cast<float>(m), -9) : ldexpf(static_cast<float>(8 + m), static_cast<int>(e) - 10);
  return s ? -f : f;
}

__device__ __forceinline__ uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(b)) : "memory");
}
// Waits for the phase of the given parity. The spin is inside the asm: a C++ loop around try_wait is a divergent
// path to ptxas, which then serializes wgmma chains in flight around it (C7518). CLUSTER: acquire at cluster
// scope (arrivals released by the other CTA of a cluster).
template <bool CLUSTER = false>
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  if (CLUSTER)
    asm volatile(
        "{\n .reg .pred P1;\n LAB_WAIT:\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 P1, [%0], %1;\n"
        " @P1 bra DONE;\n bra LAB_WAIT;\n DONE:\n }\n" ::"r"(saddr(b)),
        "r"(parity)
        : "memory");
  else
    asm volatile(
        "{\n .reg .pred P1;\n LAB_WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n @P1 bra DONE;\n"
        " bra LAB_WAIT;\n DONE:\n }\n" ::"r"(saddr(b)),
        "r"(parity)
        : "memory");
}

// A bulk copy global -> shared (cp.async.bulk) and a 2-D TMA box copy, each counted on an mbarrier's transaction
// bytes; HINT: with an L2 cache policy (createpolicy), else plain.
template <bool HINT>
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, uint64_t* b, uint64_t policy = 0) {
  if (HINT)
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
            saddr(dst)),
        "l"(src), "r"(bytes), "r"(saddr(b)), "l"(policy)
        : "memory");
  else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(saddr(dst)),
                 "l"(src), "r"(bytes), "r"(saddr(b))
                 : "memory");
}

template <bool HINT>
__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* tm, int col, int row, uint64_t* b, uint64_t policy = 0) {
  if (HINT)
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
        "%3}], [%4], %5;" ::"r"(saddr(dst)),
        "l"(tm), "r"(col), "r"(row), "r"(saddr(b)), "l"(policy)
        : "memory");
  else
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            saddr(dst)),
        "l"(tm), "r"(col), "r"(row), "r"(saddr(b))
        : "memory");
}

// A 2-D TMA map of a row-major matrix [rows, cols] of `dtype` (elem_bytes each, row stride cols), boxes of box_rows x
// box_cols elements.
inline CUtensorMap matrix_map(const void* p, CUtensorMapDataType dtype, uint32_t elem_bytes, int64_t rows, int64_t cols,
                              uint32_t box_rows, uint32_t box_cols, bool swizzle128) {
  using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static EncodeTiled encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    if (fn == nullptr || q != cudaDriverEntryPointSuccess) {
      std::fprintf(stderr, "cuTensorMapEncodeTiled not found\n");
      std::exit(1);
    }
    encode = reinterpret_cast<EncodeTiled>(fn);
  }
  CUtensorMap m{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * elem_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows}, estr[2] = {1, 1};
  const CUresult r = encode(&m, dtype, 2, const_cast<void*>(p), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            swizzle128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", static_cast<int>(r));
    std::exit(1);
  }
  return m;
}
// Of a byte matrix, boxes of box_rows x 128 bytes.
inline CUtensorMap byte_matrix_map(const uint8_t* p, int64_t rows, int64_t cols, uint32_t box_rows, bool swizzle128) {
  return matrix_map(p, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, rows, cols, box_rows, 128, swizzle128);
}
