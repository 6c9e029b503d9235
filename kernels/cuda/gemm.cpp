// bf16 GEMM through cuBLASLt: y[M, N] (row stride ldy) = x[M, K] (row stride ldx) · w[N, K]^T
// (+ y), fp32 accumulation (CUBLAS_COMPUTE_32F, fp32 alpha/beta), bf16 output.
//
// Row-major trick: a row-major [R, C] matrix with row stride ld is the column-major [C, R] matrix
// with leading dimension ld, i.e. its transpose. So we ask cuBLASLt (column-major) for
//   yᵀ [N, M] (ld ldy) = op(A) · B  with  A = w seen as column-major [K, N] (ld K), op = T,
//                                        B = x seen as column-major [K, M] (ld ldx), op = N,
// which is y = x · wᵀ in row-major terms, with no copies.
//
// Roofline (H200, dense bf16 ~ 990 TFLOP/s with fp32 accumulation, ~4.8 TB/s): 2·M·N·K FLOPs over
// 2·(M·K + N·K + M·N) bytes (+ M·N when accumulating). Decode-like M (< ~300) is bound by reading
// w; prefill / training batches (M in the thousands) are tensor-core bound. cuBLASLt picks the
// kernel (wgmma on sm_90); we only make sure the steady state costs one cublasLtMatmul call: the
// descriptors and the heuristic's algorithm are built once per (device, M, N, K, ldx, ldy,
// accumulate) and cached.
//
// Alignment: we require 16-byte aligned pointers and row strides (K, ldx, ldy multiples of 8) and
// tell the heuristic so; that is what the fast Hopper kernels need, every shape of the target
// model meets it, and a misaligned view is almost always an indexing mistake upstream.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <compare>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <map>
#include <memory>
#include <mutex>

#include "kernels/cuda/check.h"
#include "kernels/cuda/launch.h"
#include "kernels/device.h"
#include "kernels/error.h"

namespace dflash::cuda {

namespace {

constexpr uint32_t kAlignBytes = 16;
constexpr int kCandidates = 16;  // heuristic answers timed when autotuning

std::atomic<bool> g_autotune{std::getenv("DFLASH_GEMM_AUTOTUNE") != nullptr &&
                             std::string(std::getenv("DFLASH_GEMM_AUTOTUNE")) == "1"};

struct GemmKey {
  int device;
  int64_t M, N, K, ldx, ldy;
  bool accumulate;
  auto operator<=>(const GemmKey&) const = default;
};

// Descriptors and algorithm for one key. Created once, kept until exit (like the DeviceContext
// they run on: destroying cuBLASLt objects from static destructors after the driver is gone is
// not safe, and the driver reclaims everything at process end).
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

std::mutex g_mutex;
// Heap-allocated and never freed for the same reason; values are stable pointers so a plan can be
// used after the lock is released.
auto* g_plans = new std::map<GemmKey, std::unique_ptr<GemmPlan>>();

// Makes `device` current for the call and restores the caller's device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    DFLASH_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) {
      DFLASH_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
  }
  ~DeviceScope() {
    if (switched_) DFLASH_CUDA_WARN(cudaSetDevice(prev_));
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = 0;
  bool switched_ = false;
};

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) % kAlignBytes) == 0; }

// Runs one candidate algorithm of a plan on the real operands (enqueued on the call's stream).
using RunFn = std::function<void(const GemmPlan&, const cublasLtMatmulAlgo_t&)>;

// Times each candidate on the real operands (one warm-up, then 3 runs between CUDA events on
// `stream`) and returns the fastest. Only for non-accumulating calls: the candidates overwrite y,
// which the real call then writes again.
cublasLtMatmulAlgo_t fastest(const GemmPlan& plan, const cublasLtMatmulHeuristicResult_t* results, int found,
                             cudaStream_t stream, const RunFn& run) {
  cudaEvent_t a, b;
  DFLASH_CUDA_CHECK(cudaEventCreate(&a));
  DFLASH_CUDA_CHECK(cudaEventCreate(&b));
  float best_ms = INFINITY;
  cublasLtMatmulAlgo_t best = results[0].algo;
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    run(plan, results[i].algo);
    DFLASH_CUDA_CHECK(cudaEventRecord(a, stream));
    for (int r = 0; r < 3; ++r) run(plan, results[i].algo);
    DFLASH_CUDA_CHECK(cudaEventRecord(b, stream));
    DFLASH_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (ms < best_ms) {
      best_ms = ms;
      best = results[i].algo;
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best;
}

std::unique_ptr<GemmPlan> make_plan(const GemmKey& k, cublasLtHandle_t handle, size_t workspace_bytes, bool autotune,
                                    cudaStream_t stream, const RunFn& run) {
  auto plan = std::make_unique<GemmPlan>();
  // On failure below the partially built plan leaks a few descriptors; that only happens on a
  // configuration error, which ends the run anyway.
  DFLASH_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  DFLASH_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  DFLASH_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  // Column-major views (rows, cols, ld): A = w as [K, N], B = x as [K, M], C = D = y as [N, M].
  DFLASH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, static_cast<uint64_t>(k.K),
                                                 static_cast<uint64_t>(k.N), k.K));
  DFLASH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, static_cast<uint64_t>(k.K),
                                                 static_cast<uint64_t>(k.M), k.ldx));
  DFLASH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, CUDA_R_16BF, static_cast<uint64_t>(k.N),
                                                 static_cast<uint64_t>(k.M), k.ldy));

  cublasLtMatmulPreference_t pref = nullptr;
  DFLASH_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  struct PrefGuard {
    cublasLtMatmulPreference_t p;
    ~PrefGuard() { cublasLtMatmulPreferenceDestroy(p); }
  } pref_guard{pref};
  const uint64_t ws = workspace_bytes;
  DFLASH_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    DFLASH_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &kAlignBytes, sizeof(kAlignBytes)));

  cublasLtMatmulHeuristicResult_t results[kCandidates]{};
  int found = 0;
  DFLASH_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, plan->op, plan->a, plan->b, plan->c, plan->c, pref,
                                                     autotune ? kCandidates : 1, results, &found));
  DFLASH_CHECK_HINT(found > 0 && results[0].state == CUBLAS_STATUS_SUCCESS,
                    "gemm_bf16: cuBLASLt found no algorithm for M=" << k.M << " N=" << k.N << " K=" << k.K
                                                                    << " ldx=" << k.ldx << " ldy=" << k.ldy,
                    "this GPU / cuBLASLt version may not support bf16 GEMM with fp32 accumulation (needs sm_80+)");
  plan->algo = results[0].algo;
  if (autotune && found > 1) plan->algo = fastest(*plan, results, found, stream, run);
  return plan;
}

}  // namespace

void gemm_bf16(const GemmParams& p, int device) {
  DFLASH_CHECK(p.M >= 0 && p.N > 0 && p.K > 0,
               "gemm_bf16: need M >= 0, N > 0, K > 0, got M=" << p.M << " N=" << p.N << " K=" << p.K);
  DFLASH_CHECK(p.ldx >= p.K, "gemm_bf16: x row stride ldx=" << p.ldx << " is smaller than K=" << p.K);
  DFLASH_CHECK(p.ldy >= p.N, "gemm_bf16: y row stride ldy=" << p.ldy << " is smaller than N=" << p.N);
  if (p.M == 0) return;
  DFLASH_CHECK(p.x != nullptr && p.w != nullptr && p.y != nullptr,
               "gemm_bf16: null pointer (x=" << p.x << " w=" << p.w << " y=" << p.y << ") for M=" << p.M);
  DFLASH_CHECK_HINT(aligned16(p.x) && aligned16(p.w) && aligned16(p.y) && p.K % 8 == 0 && p.ldx % 8 == 0 &&
                        p.ldy % 8 == 0,
                    "gemm_bf16: operands must be 16-byte aligned with row strides a multiple of 8 elements, got x="
                        << p.x << " w=" << p.w << " y=" << p.y << " K=" << p.K << " ldx=" << p.ldx
                        << " ldy=" << p.ldy,
                    "slice activations at column offsets that are multiples of 8 and keep hidden sizes a multiple "
                    "of 8 (every Qwen3.5 projection is); a misaligned view usually means a wrong offset");

  DeviceContext& ctx = DeviceContext::get(device);
  DeviceScope scope(device);
  auto handle = static_cast<cublasLtHandle_t>(ctx.cublaslt());

  const auto stream = static_cast<cudaStream_t>(ctx.stream());
  const float alpha = 1.0f, beta = p.accumulate ? 1.0f : 0.0f;
  const RunFn run = [&](const GemmPlan& pl, const cublasLtMatmulAlgo_t& algo) {
    DFLASH_CUBLAS_CHECK(cublasLtMatmul(handle, pl.op, &alpha, p.w, pl.a, p.x, pl.b, &beta, p.y, pl.c, p.y, pl.c, &algo,
                                       ctx.workspace(), ctx.workspace_bytes(), stream));
  };
  const GemmKey key{device, p.M, p.N, p.K, p.ldx, p.ldy, p.accumulate};
  const GemmPlan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_plans->find(key);
    if (it == g_plans->end())
      it = g_plans->emplace(key, make_plan(key, handle, ctx.workspace_bytes(), g_autotune.load() && !p.accumulate,
                                           stream, run)).first;
    plan = it->second.get();
  }

  run(*plan, plan->algo);
}

void set_gemm_autotune(bool on) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_autotune.exchange(on) != on) g_plans->clear();  // plans made under the other setting go
}

bool gemm_autotune() { return g_autotune.load(); }

}  // namespace dflash::cuda
