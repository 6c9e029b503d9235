#pragma once
// Hopper warpgroup MMA (wgmma, sm_90a only) for the attention kernels and the MoE grouped GEMM
// (moe_sm90.cu; tests/cuda_emulation.h emulates mma_ss and makes the fences no-ops): shared-memory matrix
// descriptors for the 128-byte-swizzled tile layout below, the fences and the bf16 m64n64k16
// instruction with A from shared memory (SS) or from registers (RS). Force-inlined one-liners.
//
// Tile layout ("panels"): a [rows, D] bf16 tile is stored as D/64 panels of [rows, 64]; a panel row
// is 128 bytes, its 16-byte chunk c sits at chunk position c ^ (row & 7) (the hardware's 128-byte
// swizzle), and every panel starts on a 1024-byte boundary. The same bytes serve as a K-major
// operand (rows = M or N, the 64 columns = K: Q and K in S = Q·Kᵀ) and as an MN-major operand
// (rows = K, columns = N: V in O += P·V), so one cp.async loader fills all three.
#include <cstdint>

#include "kernels/cuda/flash_tile.cuh"
#include "kernels/cuda/ptx.cuh"

namespace dflash::cuda::wgmma {

// Byte offset of (row, 16-byte chunk) in a panel tile of `rows` rows.
__device__ __forceinline__ uint32_t panel_offset(int rows, int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading-dimension byte offset
// (K-major: unused; MN-major: the stride between 64-element panels), stride byte offset (between
// groups of 8 rows: 1024). Offsets within the 14-bit address field can be added to it directly
// (in units of 16 bytes) as long as the pattern's 1024-byte alignment is kept in the base.
__device__ __forceinline__ uint64_t descriptor(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint32_t addr = ptx::smem_addr(smem);
  uint64_t d = static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32;
  d |= uint64_t(1) << 62;  // 128-byte swizzle
  return d;
}

#ifdef DFLASH_CUDA_EMULATION  // (tests/cuda_emulation.h: an emulated wgmma completes when issued)
__device__ __forceinline__ void fence() {}
__device__ __forceinline__ void commit() {}
template <int N>
__device__ __forceinline__ void wait() {}
__device__ __forceinline__ void fence_async_smem() {}
template <int R>
__device__ __forceinline__ void pin(float (&)[R]) {}
__device__ __forceinline__ void pin(uint32_t (&)[4]) {}
#else
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes (st.shared, cp.async) visible to the async
// proxy that wgmma reads through; put it before the barrier that precedes the wgmma.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving reads or writes of accumulator registers across an in-flight wgmma.
template <int R>
__device__ __forceinline__ void pin(float (&r)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
__device__ __forceinline__ void pin(uint32_t (&r)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
#endif
template <int P>
__device__ __forceinline__ void pin(float (&r)[P][32]) {
#pragma unroll
  for (int p = 0; p < P; ++p) pin(r[p]);
}
template <int K>
__device__ __forceinline__ void pin(uint32_t (&r)[K][4]) {
#pragma unroll
  for (int k = 0; k < K; ++k) pin(r[k]);
}

// d[64x64] (+)= A[64x16] · B[16x64], A and B K-major in shared memory. The accumulator layout per
// warp w of the warpgroup: rows 16w + g and 16w + g + 8 (g = lane / 4), n-tile i (8 columns) in
// d[4i .. 4i+3] as in mma.sync m16n8: (g, 8i+2t), (g, 8i+2t+1), (g+8, 8i+2t), (g+8, 8i+2t+1).
__device__ __forceinline__ void mma_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31 }, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#elif defined(DFLASH_CUDA_EMULATION)
  ::emu::wgmma_ss(d, desc_a, desc_b, accumulate);
#endif
}

// d[64x64] += A[64x16] · B[16x64], A from registers (the m16n8k16 A fragment of the warp's 16
// rows), B in shared memory: MN-major (TRANS_B = 1: V in P·V, K in dS·K) or K-major (TRANS_B = 0:
// K in S = Q·Kᵀ with Q in registers).
template <int TRANS_B>
__device__ __forceinline__ void mma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31 }, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(TRANS_B));
#elif defined(DFLASH_CUDA_EMULATION)
  (void)d, (void)a, (void)desc_b;
  ::emu::not_emulated("wgmma with A from registers");
#endif
}
__device__ __forceinline__ void mma_rs_tb(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  mma_rs<1>(d, a, desc_b);
}

// acc[64x64] (+)= A[64, 16·KS] · B[64, 16·KS]ᵀ, both K-major panel tiles (a_panel / b_panel: bytes
// from one 64-column panel to the next); issues all KS k-steps. The caller fences before, commits
// and waits after.
template <int KS>
__device__ __forceinline__ void mma_nt(float (&acc)[32], uint64_t desc_a, uint32_t a_panel, uint64_t desc_b,
                                       uint32_t b_panel) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
    mma_ss(acc, desc_a + (((ks / 4) * a_panel + (ks % 4) * 32) >> 4),
           desc_b + (((ks / 4) * b_panel + (ks % 4) * 32) >> 4), 1);
}

// The same with A from registers: KS A fragments (load_a_fragments) and B K-major in shared memory.
template <int KS>
__device__ __forceinline__ void mma_nt_rs(float (&acc)[32], const uint32_t (&a)[KS][4], uint64_t desc_b,
                                          uint32_t b_panel) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) mma_rs<0>(acc, a[ks], desc_b + (((ks / 4) * b_panel + (ks % 4) * 32) >> 4));
}

// The A fragments of this warp's 16 rows (of its warpgroup's 64) of a panel tile of `rows` rows,
// k-steps 0 .. KS-1, by ldmatrix (the tile must be complete and visible to the warp).
template <int KS>
__device__ __forceinline__ void load_a_fragments(uint32_t (&f)[KS][4], const unsigned char* tile, int rows,
                                                 int row0) {
  const int lane = threadIdx.x & 31;
  const int row = row0 + ((threadIdx.x >> 5) & 3) * 16 + (lane & 15);
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) ptx::ldmatrix_x4(f[ks], tile + panel_offset(rows, row, 2 * ks + (lane >> 4)));
}

// The A fragments, k-steps 0 .. KK-1, of this warp's 16 rows of A = Tᵀ, where T is a one-panel tile
// [16·KK rows (A's k), 64 columns (A's rows, the warpgroup's 64)], by ldmatrix.trans: a transposed
// operand without a transposing copy (the dSᵀ tiles of the block-attention dQ pass).
template <int KK>
__device__ __forceinline__ void load_a_fragments_trans(uint32_t (&f)[KK][4], const unsigned char* tile) {
  const int lane = threadIdx.x & 31, m = lane >> 3;
  const int chunk = 2 * ((threadIdx.x >> 5) & 3) + (m & 1);
#pragma unroll
  for (int kk = 0; kk < KK; ++kk)
    ptx::ldmatrix_x4_trans(f[kk], tile + panel_offset(16 * KK, 16 * kk + (m >> 1) * 8 + (lane & 7), chunk));
}

// Writes A fragments (k-steps 0 .. KK-1 of this warp's 16 rows, as p_fragment makes them) into a
// one-panel tile [64 rows, 16·KK ≤ 64 columns]: the bf16 values the wgmma consumed, as a tile.
template <int KK>
__device__ __forceinline__ void store_a_fragments(unsigned char* tile, const uint32_t (&f)[KK][4]) {
  const int lane = threadIdx.x & 31;
  const int r0 = ((threadIdx.x >> 5) & 3) * 16 + (lane >> 2), t4 = (lane & 3) * 4;
#pragma unroll
  for (int kk = 0; kk < KK; ++kk) {
    ptx::sts_u32(tile + panel_offset(64, r0, 2 * kk) + t4, f[kk][0]);
    ptx::sts_u32(tile + panel_offset(64, r0 + 8, 2 * kk) + t4, f[kk][1]);
    ptx::sts_u32(tile + panel_offset(64, r0, 2 * kk + 1) + t4, f[kk][2]);
    ptx::sts_u32(tile + panel_offset(64, r0 + 8, 2 * kk + 1) + t4, f[kk][3]);
  }
}

// Bulk (TMA engine) copy of `bytes` (a multiple of 16) from shared to global memory, one thread
// issuing; the writers of the shared bytes fence_async_smem() and meet at a barrier first. The
// waits: .read — the shared source may be overwritten; plain — the global writes are done.
__device__ __forceinline__ void bulk_store(void* gmem, const void* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(gmem), "r"(ptx::smem_addr(smem)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// acc = A·Bᵀ as one committed wgmma group, A from registers (mma_nt_rs): zeroes acc, fences,
// issues, commits.
template <int KS>
__device__ __forceinline__ void issue_nt_rs(float (&acc)[32], const uint32_t (&a)[KS][4], uint64_t desc_b,
                                            uint32_t b_panel) {
#pragma unroll
  for (int e = 0; e < 32; ++e) acc[e] = 0.0f;
  pin(acc);
  fence();
  mma_nt_rs<KS>(acc, a, desc_b, b_panel);
  commit();
}

// acc = A·Bᵀ as one committed wgmma group (mma_nt): zeroes acc, fences, issues, commits. The
// caller waits (wait<N>) and pins acc before reading it.
template <int KS>
__device__ __forceinline__ void issue_nt(float (&acc)[32], uint64_t desc_a, uint32_t a_panel, uint64_t desc_b,
                                         uint32_t b_panel) {
#pragma unroll
  for (int e = 0; e < 32; ++e) acc[e] = 0.0f;
  pin(acc);
  fence();
  mma_nt<KS>(acc, desc_a, a_panel, desc_b, b_panel);
  commit();
}

// acc[P][64x64] += A[64, 16·KK] · B[16·KK, 64·P]: A as KK register fragments (p_fragment), B an
// MN-major panel tile of 16·KK rows (desc_b made with LBO = b_panel, the panel stride in bytes).
template <int KK, int P>
__device__ __forceinline__ void mma_nn_rs(float (&acc)[P][32], const uint32_t (&a)[KK][4], uint64_t desc_b,
                                          uint32_t b_panel) {
#pragma unroll
  for (int kk = 0; kk < KK; ++kk)
#pragma unroll
    for (int p = 0; p < P; ++p) mma_rs_tb(acc[p], a[kk], desc_b + ((p * b_panel + kk * 16 * 128) >> 4));
}

// Zeroes an accumulator of P 64-column panels (before its first accumulating product).
template <int P>
__device__ __forceinline__ void zero(float (&acc)[P][32]) {
#pragma unroll
  for (int p = 0; p < P; ++p)
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[p][e] = 0.0f;
}

// Multiplies this thread's accumulator elements of rows r0 / r0 + 8 by s0 / s1 (online softmax);
// skipped when every factor of the warp is 1 (no row's running max moved: most key tiles).
template <int P>
__device__ __forceinline__ void scale_rows(float (&acc)[P][32], float s0, float s1) {
  if (__all_sync(0xffffffffu, s0 == 1.0f && s1 == 1.0f)) return;
#pragma unroll
  for (int p = 0; p < P; ++p)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      acc[p][4 * i] *= s0;
      acc[p][4 * i + 1] *= s0;
      acc[p][4 * i + 2] *= s1;
      acc[p][4 * i + 3] *= s1;
    }
}

// acc += A·B (mma_nn_rs) run to completion: the operand registers pinned around it, fence, issue,
// commit, wait for every group of the warpgroup.
template <int KK, int P>
__device__ __forceinline__ void mma_nn_rs_sync(float (&acc)[P][32], uint32_t (&a)[KK][4], uint64_t desc_b,
                                               uint32_t b_panel) {
  pin(acc);
  pin(a);
  fence();
  mma_nn_rs<KK, P>(acc, a, desc_b, b_panel);
  commit();
  wait<0>();
  pin(acc);
  pin(a);
}

// One key tile of a flash forward on wgmma, after its masked scores s (the S = Q·Kᵀ accumulator):
// the online softmax (flash::online_softmax), P as register fragments, the output rows rescaled,
// then O += P·V run to completion (V an MN-major panel tile: desc_v with LBO = v_panel).
template <int NT, int P>
__device__ __forceinline__ void softmax_pv(float (&s)[NT][4], float (&o)[P][32], float& m0, float& m1, float& l0,
                                           float& l1, float scale_log2, uint64_t desc_v, uint32_t v_panel) {
  float alpha0, alpha1;
  flash::online_softmax<NT>(s, m0, m1, l0, l1, scale_log2, alpha0, alpha1);
  uint32_t pa[NT / 2][4];
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) flash::p_fragment<NT>(s, kk, pa[kk]);
  scale_rows<P>(o, alpha0, alpha1);
  mma_nn_rs_sync<NT / 2, P>(o, pa, desc_v, v_panel);
}

// Writes this thread's accumulator elements of acc[P][64x64] (rows r0 and r0 + 8 of a panel tile
// of `rows` rows, r0 = the warp's first row + lane / 4) as bf16, times s0 / s1 per row.
template <int P>
__device__ __forceinline__ void store_rows(unsigned char* tile, int rows, int r0, const float (&acc)[P][32], float s0,
                                           float s1) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int p = 0; p < P; ++p)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      *reinterpret_cast<uint32_t*>(tile + panel_offset(rows, r0, 8 * p + i) + 4 * t) =
          ptx::pack_bf16(acc[p][4 * i] * s0, acc[p][4 * i + 1] * s0);
      *reinterpret_cast<uint32_t*>(tile + panel_offset(rows, r0 + 8, 8 * p + i) + 4 * t) =
          ptx::pack_bf16(acc[p][4 * i + 2] * s1, acc[p][4 * i + 3] * s1);
    }
}

// The first 1024-byte boundary at or after p (dynamic shared memory is only 16-byte aligned by
// contract; allocate 1024 bytes of slack).
__device__ __forceinline__ unsigned char* align1024(unsigned char* p) {
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(p) + 1023) & ~uintptr_t(1023));
}

// Host: whether this build's sm_90a code can run on CUDA device `device` (an sm_90 GPU and a binary
// that holds the code; cached per device). Defined in attention_sm90.cu.
bool sm90a_code_runs_on(int device);

}  // namespace dflash::cuda::wgmma
