#pragma once
// Small device helpers shared by the CUDA kernels: shared-memory addresses, ldmatrix, the bf16
// m16n8k16 tensor-core MMA, cp.async group commit, and bf16 packing (8 values <-> 16 bytes). Each is one instruction or a
// few; they are force-inlined so the kernels compile exactly as if written in place.
#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace dflash::cuda::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices from shared memory (row addresses from lanes 0-31), optionally transposed.
// (Under DFLASH_CUDA_EMULATION, kernels/cuda/emulatable.cuh, the CPU runs the non-transposed x4
// load, mma_bf16, mma_e4m3, ldg_stream16 and the cp.async ring's copies, commit and wait; the rest stays device-only.)
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
#ifdef DFLASH_CUDA_EMULATION
  ::emu::ldmatrix_x4(r, p);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t& r0, uint32_t& r1, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(smem_addr(p)));
}

// c[16x8] += a[16x16] (row) · b[16x8] (col), bf16 in, f32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef DFLASH_CUDA_EMULATION
  ::emu::mma_bf16(c, a, b0, b1);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// f32 -> tf32 (round to nearest, ties away) and c[16x8] += a[16x8] (row) . b[8x8] (col) in tf32.
__device__ __forceinline__ uint32_t tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// For ring buffers refilled in place (norm.cu, gdn_conv.cu): a 16-byte global -> shared copy
// that bypasses L1 (cp.async.cg), the group commit, and the wait for all but the N most recent
// commit groups, with "memory" clobbers so the compiler keeps shared-memory reads of a slot before the copy that
// refills it.
__device__ __forceinline__ void cp_async16_ring(void* smem, const void* gmem) {
#ifdef DFLASH_CUDA_EMULATION
  std::memcpy(smem, gmem, 16);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem) : "memory");
#endif
}
// The same copy, zero-filling the 16 bytes instead where !valid (gmem must still be a valid address).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
#ifdef DFLASH_CUDA_EMULATION
  if (valid) std::memcpy(smem, gmem, 16);
  else std::memset(smem, 0, 16);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
#endif
}
#ifdef DFLASH_CUDA_EMULATION  // the emulated copies complete at once
__device__ __forceinline__ void cp_async_commit_ring() {}
template <int N>
__device__ __forceinline__ void cp_async_wait_ring() {}
#else
__device__ __forceinline__ void cp_async_commit_ring() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_ring() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

// The ring copy of the streaming GEMMs (gemm_skinny.cu, fp8_stream.cu): 16 bytes global -> shared
// bypassing L1 and asking L2 for the 256 bytes around it (a weight row read ahead); !valid writes
// zeros without reading (gmem must still be a valid address).
__device__ __forceinline__ void cp_async16_l2_256(void* smem, const void* gmem, bool valid) {
#ifdef DFLASH_CUDA_EMULATION
  if (valid) std::memcpy(smem, gmem, 16);
  else std::memset(smem, 0, 16);
#else
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
#endif
}

// 16 bytes global -> registers for data read once (a streamed weight): non-coherent, not kept in
// L1. p must be 16-byte aligned and the bytes unchanged while the kernel runs.
__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
  uint4 v;
#ifdef DFLASH_CUDA_EMULATION
  std::memcpy(&v, p, 16);
#else
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
#endif
  return v;
}

// c[16x8] += a[16x32] (row) · b[32x8] (col), e4m3 in, f32 accumulate (sm_89+; traps below). Lane
// l = 4 g + t holds a: (g, 4t..4t+3), (g+8, 4t..), (g, 4t+16..), (g+8, 4t+16..), four codes a
// register, the lowest byte first; b: (k 4t..4t+3, n g), (k 4t+16.., n g); c as mma_bf16's.
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef DFLASH_CUDA_EMULATION
  ::emu::mma_e4m3(c, a, b0, b1);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // callers run it on sm_89+ only
#endif
}

// Shared-memory load of two floats / store of one 32-bit word through the shared window (a generic
// pointer the compiler cannot place in shared memory would become a slower generic access).
__device__ __forceinline__ float2 lds_f2(const void* p) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(smem_addr(p)));
  return v;
}
__device__ __forceinline__ void sts_u32(void* p, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem_addr(p)), "r"(v) : "memory");
}

// ---- Bulk copies into shared memory completed on an mbarrier (sm_90; gemm_stream.cu's packed path) ----
// A ring slot's barrier: mbar_init(bar, 1) once (then mbar_init_fence before any copy signals it); per
// fill one thread calls bulk_load(dst, src, bytes, bar) (it arms the barrier with the bytes to expect
// and issues one cp.async.bulk the copy engine completes on it), and every reader waits with
// mbar_wait(bar, phase), phase 0 for the slot's first fill, 1 for its second, and so on alternately.
// dst, src and bytes multiples of 16. Emulated (DFLASH_CUDA_EMULATION) the copy is a memcpy done at
// once and the barrier calls do nothing.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
#ifndef DFLASH_CUDA_EMULATION
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#else
  (void)bar, (void)count;
#endif
}
// Orders this thread's earlier generic accesses of shared memory before later copy-engine ones.
__device__ __forceinline__ void proxy_async_fence() {
#ifndef DFLASH_CUDA_EMULATION
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Makes initialized barriers visible to the copy engine (the async proxy).
__device__ __forceinline__ void mbar_init_fence() {
#ifndef DFLASH_CUDA_EMULATION
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
  proxy_async_fence();
}
// An L2 policy for data read once (the copies' lines leave L2 first); 0 emulated.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy = 0;
#ifndef DFLASH_CUDA_EMULATION
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
#endif
  return policy;
}
// evict_first: the copy carries `policy` (l2_evict_first_policy) as its L2 cache hint.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar, bool evict_first = false,
                                          uint64_t policy = 0) {
#ifndef DFLASH_CUDA_EMULATION
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  if (evict_first)
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(
            smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
        : "memory");
  else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
#else
  (void)bar, (void)evict_first, (void)policy;
  std::memcpy(dst, src, bytes);
#endif
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
#ifndef DFLASH_CUDA_EMULATION
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(phase)
        : "memory");
  } while (!done);
#else
  (void)bar, (void)phase;
#endif
}

// Two f32 -> one register of two bf16 (round to nearest even); lo goes to the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Eight bf16 (one 16-byte load) -> f32.
__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

// Eight f32 -> eight bf16 (one 16-byte store), round to nearest even.
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return u;
}

}  // namespace dflash::cuda::ptx
