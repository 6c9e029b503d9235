#pragma once
// The CPU backend's f32 matrix product and its worker threads: the target's linear layers
// (ops::linear), the f32 drafter step (drafter/model.h, DrafterMath::F32) and its LM-head loss.
//
//   C[M, N] = (accumulate ? C : 0) + op(A)[M, K] · op(B)[K, N]      row-major, leading dimensions in elements
//   op(A) = A stored [M, K] (Trans::N, lda >= K) or A^T with A stored [K, M] (Trans::T, lda >= M)
//   op(B) = B stored [K, N] (Trans::N, ldb >= N) or B^T with B stored [N, K] (Trans::T, ldb >= K)
//
// Determinism: each element of C is one fixed-order sum (fused multiply-adds over k in ascending order
// in the packed path, with partial sums of kKc-long k ranges added to C in order; 8 interleaved lanes
// and one reduction tree in the NT path) and is computed by exactly one thread: the result is the same
// bit for bit on any number of threads and for any tiling of M and N, which bit-exact resume and the
// data-parallel tests rely on. The instruction set (AVX-512, AVX2 + FMA, or portable C++) is chosen
// once per process from what the CPU has (gemm_isa() names it) and each runs the same arithmetic, so
// the bits do not depend on the CPU either (an AVX2 machine's products are an AVX-512 machine's).
// Cost: 2·M·N·K FLOPs; ~40-60 GFLOP/s a thread at the drafter's shapes on AMD EPYC (AVX-512 or AVX2),
// ~10x the plain double loops of the reference.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dflash::cpu {

enum class Trans { N, T };

void gemm_f32(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
              int64_t ldb, bool accumulate, float* C, int64_t ldc);

// The instruction set gemm_f32 runs: "avx512", "avx2" or "portable" (the best this CPU has). Every one
// computes the same bits (one order of sums for all of them), so the choice moves only the speed.
const char* gemm_isa();
// The instruction sets this CPU runs, best first; set_gemm_isa switches the process to one of them (tests
// of the same-bits promise; throws std::invalid_argument naming it when it is unknown or the CPU lacks it).
std::vector<std::string> gemm_isas();
void set_gemm_isa(const std::string& name);

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
