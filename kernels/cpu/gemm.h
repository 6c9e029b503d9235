#pragma once
// The CPU backend's f32 matrix product and its worker threads: the target's linear layers
// (ops::linear), the f32 drafter step (drafter/model.h, DrafterMath::F32) and its LM-head loss.
//
//   C[M, N] = (accumulate ? C : 0) + op(A)[M, K] · op(B)[K, N]      row-major, leading dimensions in elements
//   op(A) = A stored [M, K] (Trans::N, lda >= K) or A^T with A stored [K, M] (Trans::T, lda >= M)
//   op(B) = B stored [K, N] (Trans::N, ldb >= N) or B^T with B stored [N, K] (Trans::T, ldb >= K)
//
// Determinism: each element of C is one sum over k in ascending order (partial sums of kKc-long k
// ranges added to C in order), and is computed by exactly one thread: the result is the same bit for
// bit on any number of threads and for any tiling of M and N, which bit-exact resume and the
// data-parallel tests rely on. The instruction set (AVX-512, AVX2 + FMA, or portable C++) is chosen
// once per process from what the CPU has (gemm_isa() names it); on one machine every run gives the
// same bits. Cost: 2·M·N·K FLOPs; on the development machine (AMD EPYC, AVX-512) ~40-60 GFLOP/s a
// thread at the drafter's shapes, ~10x the plain double loops of the reference.
#include <cstdint>
#include <functional>

namespace dflash::cpu {

enum class Trans { N, T };

void gemm_f32(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
              int64_t ldb, bool accumulate, float* C, int64_t ldc);

// The instruction set gemm_f32 runs: "avx512", "avx2" or "portable".
const char* gemm_isa();

// Worker threads of the CPU backend (shared by every op that splits work): by default
// DFLASH_CPU_THREADS, else the hardware threads (at most 16). A run of several MPI ranks on one
// machine divides them (trainer). set_cpu_threads(n) with n >= 1 changes it for the process.
int cpu_threads();
void set_cpu_threads(int n);

// Runs fn(i) for i in [0, n) on the worker threads (core/worker_pool.h; the calling thread takes part)
// and returns when all are done; called from inside a task it runs the tasks in the calling thread. An
// exception fn throws is rethrown here (the first one; the thread that threw takes no more tasks).
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace dflash::cpu
