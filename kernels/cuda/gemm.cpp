// GEMMs through cuBLASLt, fp32 accumulation (CUBLAS_COMPUTE_32F, fp32 alpha/beta), bf16 A and B:
//   gemm_ex:   D[M, N] (row stride ldd) = alpha · op(A) · op(B) + beta · D, D bf16 or fp32
//              (gemm.h: A [M, K] or, trans_a, stored [K, M]; B [K, N] or, trans_b, [N, K]);
//   gemm_bf16: y[M, N] = x[M, K] · w[N, K]ᵀ (+ y), the special case A = x, B = w, trans_b, bf16 D.
//
// Row-major trick: a row-major [R, C] matrix with row stride ld is the column-major [C, R] matrix
// with leading dimension ld, i.e. its transpose. Row-major D = op(A)·op(B) is column-major
// Dᵀ [N, M] (ld ldd) = op(B)ᵀ · op(A)ᵀ, so cuBLASLt's first operand is B's storage and its second
// A's storage, with no copies:
//   B, !trans_b: storage row-major [K, N] = column-major [N, K] (ld ldb) = op(B)ᵀ      -> op N
//   B,  trans_b: storage row-major [N, K] = column-major [K, N] (ld ldb) = op(B)       -> op T
//   A, !trans_a: storage row-major [M, K] = column-major [K, M] (ld lda) = op(A)ᵀ      -> op N
//   A,  trans_a: storage row-major [K, M] = column-major [M, K] (ld lda) = op(A)       -> op T
// (gemm_bf16: first operand w as column-major [K, N] with op T, second x as [K, M] with op N.)
//
// Roofline (H200, dense bf16 ~ 990 TFLOP/s with fp32 accumulation, ~4.8 TB/s): 2·M·N·K FLOPs over
// 2·(M·K + N·K) + (2 or 4)·M·N bytes (+ M·N read when accumulating). Decode-like M (< ~300) is
// bound by reading the weight; prefill / training batches (M in the thousands) are tensor-core
// bound. cuBLASLt picks the kernel (wgmma on sm_90); we only make sure the steady state costs one
// cublasLtMatmul call: the descriptors and the heuristic's algorithm are built once per (device,
// M, N, K, lda, ldb, ldd, transposes, output dtype, alpha == 0, beta == 0) and cached.
//
// Alignment: by default we require 16-byte aligned pointers and row strides that keep every row
// 16-byte aligned (multiples of 8 elements for bf16, 4 for fp32 D) and tell the heuristic so; that
// is what the fast Hopper kernels need, every Qwen3.5 shape meets it, and a misaligned view is
// almost always an indexing mistake upstream. With `unaligned` (a model whose sizes are not
// multiples of 8, planned as the gemm step's fallback) each operand's alignment is the largest
// power of two up to 16 bytes dividing its address and its row stride in bytes (at least the
// element size), the heuristic is told exactly that, and the plan is cached per alignment too.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
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
#include <utility>

#include "core/cuda/check.h"
#include "kernels/cuda/gemm.h"
#include "core/device.h"
#include "core/error.h"

namespace dflash::cuda {

namespace {

constexpr uint32_t kAlignBytes = 16;
constexpr int kCandidates = 16;  // heuristic answers timed when autotuning

std::atomic<bool> g_autotune{std::getenv("DFLASH_GEMM_AUTOTUNE") != nullptr &&
                             std::string(std::getenv("DFLASH_GEMM_AUTOTUNE")) == "1"};

struct GemmKey {
  int device;
  int64_t M, N, K, lda, ldb, ldd;
  bool trans_a, trans_b, d_f32, alpha_zero, beta_zero;
  uint32_t align_a = kAlignBytes, align_b = kAlignBytes, align_d = kAlignBytes;  // bytes, each a power of two <= 16
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

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) % kAlignBytes) == 0; }
bool elem_aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The alignment (bytes, a power of two <= 16) of every row of a matrix at p with row stride ld
// elements of elem_bytes each.
uint32_t row_alignment(const void* p, int64_t ld, int64_t elem_bytes) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(p) | static_cast<uint64_t>(ld * elem_bytes) | kAlignBytes;
  return static_cast<uint32_t>(bits & (~bits + 1));  // lowest set bit
}

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

// cuBLASLt's heuristic answers (up to `want`, best first) for plan's descriptors under the preference
// every plan uses: the device context's workspace and the operands' alignment (16 bytes for A, B, C
// and D unless told otherwise: what the launchers check; align_first / align_second are cuBLASLt's A
// and B, i.e. our B and A). Returns cuBLASLt's status; `found` answers are in results.
cublasStatus_t heuristic(cublasLtHandle_t handle, const GemmPlan& plan, size_t workspace_bytes, int want,
                         cublasLtMatmulHeuristicResult_t* results, int& found, uint32_t align_first = kAlignBytes,
                         uint32_t align_second = kAlignBytes, uint32_t align_d = kAlignBytes) {
  cublasLtMatmulPreference_t pref = nullptr;
  DFLASH_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  struct PrefGuard {
    cublasLtMatmulPreference_t p;
    ~PrefGuard() { cublasLtMatmulPreferenceDestroy(p); }
  } pref_guard{pref};
  const uint64_t ws = workspace_bytes;
  DFLASH_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_first},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_second},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d}};
  for (const auto& [attr, bytes] : aligns)
    DFLASH_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &bytes, sizeof(bytes)));
  return cublasLtMatmulAlgoGetHeuristic(handle, plan.op, plan.a, plan.b, plan.c, plan.c, pref, want, results, &found);
}

std::unique_ptr<GemmPlan> make_plan(const GemmKey& k, const char* who, cublasLtHandle_t handle, size_t workspace_bytes,
                                    bool autotune, cudaStream_t stream, const RunFn& run) {
  auto plan = std::make_unique<GemmPlan>();
  // On failure below the partially built plan leaks a few descriptors; that only happens on a
  // configuration error, which ends the run anyway.
  DFLASH_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // cuBLASLt's A is our B, its B is our A (see the top of the file).
  const cublasOperation_t op_first = k.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = k.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  DFLASH_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
  DFLASH_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
  // Column-major views (rows, cols, ld) of the storage.
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  if (k.trans_b)
    DFLASH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, u(k.K), u(k.N), k.ldb));
  else
    DFLASH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, u(k.N), u(k.K), k.ldb));
  if (k.trans_a)
    DFLASH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, u(k.M), u(k.K), k.lda));
  else
    DFLASH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, u(k.K), u(k.M), k.lda));
  DFLASH_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan->c, k.d_f32 ? CUDA_R_32F : CUDA_R_16BF, u(k.N), u(k.M), k.ldd));

  cublasLtMatmulHeuristicResult_t results[kCandidates]{};
  int found = 0;
  DFLASH_CUBLAS_CHECK(heuristic(handle, *plan, workspace_bytes, autotune ? kCandidates : 1, results, found, k.align_b,
                                k.align_a, k.align_d));
  DFLASH_CHECK_HINT(found > 0 && results[0].state == CUBLAS_STATUS_SUCCESS,
                    who << ": cuBLASLt found no algorithm for M=" << k.M << " N=" << k.N << " K=" << k.K
                        << " lda=" << k.lda << " ldb=" << k.ldb << " ldd=" << k.ldd << " trans_a=" << k.trans_a
                        << " trans_b=" << k.trans_b << " D " << (k.d_f32 ? "fp32" : "bf16") << ", alignment A "
                        << k.align_a << " B " << k.align_b << " D " << k.align_d << " bytes",
                    "this GPU / cuBLASLt version may not support bf16 GEMM with fp32 accumulation (needs sm_80+)");
  plan->algo = results[0].algo;
  if (autotune && found > 1) plan->algo = fastest(*plan, results, found, stream, run);
  return plan;
}

// Runs one validated GEMM (M, N, K > 0) through the cached plan of its key.
void run_gemm(const GemmExParams& p, const char* who, int device) {
  DeviceContext& ctx = DeviceContext::get(device);
  DeviceGuard scope(device);
  auto handle = static_cast<cublasLtHandle_t>(ctx.cublaslt());
  const auto stream = static_cast<cudaStream_t>(ctx.stream());
  const float alpha = p.alpha, beta = p.beta;
  // cuBLASLt's A is our B and its B our A (see the top of the file).
  const RunFn run = [&](const GemmPlan& pl, const cublasLtMatmulAlgo_t& algo) {
    DFLASH_CUBLAS_CHECK(cublasLtMatmul(handle, pl.op, &alpha, p.b, pl.a, p.a, pl.b, &beta, p.d, pl.c, p.d, pl.c, &algo,
                                       ctx.workspace(), ctx.workspace_bytes(), stream));
  };
  GemmKey key{device,    p.M,       p.N,     p.K,           p.lda,         p.ldb,
              p.ldd,     p.trans_a, p.trans_b, p.d_f32, p.alpha == 0.0f, p.beta == 0.0f};
  if (p.unaligned) {
    key.align_a = row_alignment(p.a, p.lda, 2);
    key.align_b = row_alignment(p.b, p.ldb, 2);
    key.align_d = row_alignment(p.d, p.ldd, p.d_f32 ? 4 : 2);
  }
  const GemmPlan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_plans->find(key);
    // Autotuning runs the candidates on the real operands: only when they overwrite D (beta 0).
    if (it == g_plans->end())
      it = g_plans->emplace(key, make_plan(key, who, handle, ctx.workspace_bytes(),
                                           g_autotune.load() && p.beta == 0.0f, stream, run)).first;
    plan = it->second.get();
  }
  run(*plan, plan->algo);
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
  DFLASH_CHECK_HINT(p.unaligned || (aligned16(p.x) && aligned16(p.w) && aligned16(p.y) && p.K % 8 == 0 &&
                                     p.ldx % 8 == 0 && p.ldy % 8 == 0),
                    "gemm_bf16: operands must be 16-byte aligned with row strides a multiple of 8 elements, got x="
                        << p.x << " w=" << p.w << " y=" << p.y << " K=" << p.K << " ldx=" << p.ldx
                        << " ldy=" << p.ldy,
                    "slice activations at column offsets that are multiples of 8; a model whose sizes are not "
                    "multiples of 8 plans its gemm step as the fallback, which sets GemmParams::unaligned");
  DFLASH_CHECK(elem_aligned(p.x, 2) && elem_aligned(p.w, 2) && elem_aligned(p.y, 2),
               "gemm_bf16: bf16 operands must be 2-byte aligned, got x=" << p.x << " w=" << p.w << " y=" << p.y);

  GemmExParams e;
  e.a = p.x;
  e.lda = p.ldx;
  e.b = p.w;
  e.ldb = p.K;
  e.trans_b = true;
  e.d = p.y;
  e.ldd = p.ldy;
  e.M = p.M;
  e.N = p.N;
  e.K = p.K;
  e.beta = p.accumulate ? 1.0f : 0.0f;
  e.unaligned = p.unaligned;
  run_gemm(e, "gemm_bf16", device);
}

namespace detail {
// elementwise.cu: D = beta · D over a row-major view (beta 0 writes zeros without reading D).
void scale_matrix(void* d, bool d_f32, int64_t M, int64_t N, int64_t ldd, float beta, Stream s);
}  // namespace detail

void gemm_ex(const GemmExParams& p, int device) {
  DFLASH_CHECK(p.M >= 0 && p.N >= 0 && p.K >= 0,
               "gemm_ex: need M, N, K >= 0, got M=" << p.M << " N=" << p.N << " K=" << p.K);
  const int64_t a_cols = p.trans_a ? p.M : p.K, b_cols = p.trans_b ? p.K : p.N;
  DFLASH_CHECK(p.lda >= std::max<int64_t>(a_cols, 1),
               "gemm_ex: A row stride lda=" << p.lda << " is smaller than its row length " << a_cols
                                            << (p.trans_a ? " (M, trans_a)" : " (K)"));
  DFLASH_CHECK(p.ldb >= std::max<int64_t>(b_cols, 1),
               "gemm_ex: B row stride ldb=" << p.ldb << " is smaller than its row length " << b_cols
                                            << (p.trans_b ? " (K, trans_b)" : " (N)"));
  DFLASH_CHECK(p.ldd >= std::max<int64_t>(p.N, 1), "gemm_ex: D row stride ldd=" << p.ldd << " is smaller than N=" << p.N);
  if (p.M == 0 || p.N == 0) return;
  DFLASH_CHECK(p.d != nullptr, "gemm_ex: null D pointer for M=" << p.M << " N=" << p.N);
  const int64_t d_mult = p.d_f32 ? 4 : 8;
  DFLASH_CHECK_HINT(p.unaligned || (aligned16(p.d) && p.ldd % d_mult == 0),
                    "gemm_ex: cuBLASLt's fast kernels need D 16-byte aligned with ldd a multiple of "
                        << d_mult << " elements (" << (p.d_f32 ? "fp32" : "bf16") << "), got d=" << p.d
                        << " ldd=" << p.ldd,
                    "slice at column offsets that are multiples of 8 and keep row strides multiples of 8 (pad a "
                    "vocabulary-wide D to a multiple of 8 columns); a model whose sizes are not multiples of 8 "
                    "plans its gemm step as the fallback, which sets GemmExParams::unaligned");
  DFLASH_CHECK(elem_aligned(p.d, p.d_f32 ? 4 : 2), "gemm_ex: D must be element-aligned, got d=" << p.d);
  if (p.K == 0) {
    DeviceGuard scope(device);
    detail::scale_matrix(p.d, p.d_f32, p.M, p.N, p.ldd, p.beta, DeviceContext::get(device).stream());
    return;
  }
  DFLASH_CHECK(p.a != nullptr && p.b != nullptr,
               "gemm_ex: null pointer (a=" << p.a << " b=" << p.b << ") for M=" << p.M << " N=" << p.N << " K=" << p.K);
  DFLASH_CHECK_HINT(p.unaligned || (aligned16(p.a) && aligned16(p.b) && p.lda % 8 == 0 && p.ldb % 8 == 0),
                    "gemm_ex: cuBLASLt's fast kernels need bf16 A and B 16-byte aligned with lda and ldb multiples of "
                    "8 elements, got a="
                        << p.a << " lda=" << p.lda << " b=" << p.b << " ldb=" << p.ldb,
                    "slice at column offsets that are multiples of 8 and keep row strides multiples of 8; a model "
                    "whose sizes are not multiples of 8 plans its gemm step as the fallback (GemmExParams::unaligned)");
  DFLASH_CHECK(elem_aligned(p.a, 2) && elem_aligned(p.b, 2),
               "gemm_ex: bf16 A and B must be 2-byte aligned, got a=" << p.a << " b=" << p.b);
  run_gemm(p, "gemm_ex", device);
}

void set_gemm_autotune(bool on) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_autotune.exchange(on) != on) g_plans->clear();  // plans made under the other setting go
}

bool gemm_autotune() { return g_autotune.load(); }

// ==== gemm_fp8: block-scaled e4m3 GEMM (issue 18) ==================================================
// y[M, N] bf16 = x[M, K] · w[N, K]^T with e4m3 codes and f32 block scales, through cuBLASLt's
// Hopper block-scaling modes (cuBLAS >= 12.9, sm_90): with the row-major trick above, cuBLASLt's
// first operand is the weight, column-major [K, N] with op T, scale mode BLK128x128_32F; its second
// the activation codes, column-major [K, M] (ld ldx) with op N, scale mode VEC128_32F; D bf16 [N, M]
// (ld ldy), CUBLAS_COMPUTE_32F. The kernel applies both scales per 128-deep K block in fp32 (the
// DeepSeek-V3 recipe's promotion), so the result is the reference's sum of per-group products.
//
// Scale layouts (gemm.h "FP8"; neither is fully specified by the cuBLASLt documentation we had):
//   activations, VEC128 on [K, M]: scale of (token m, group g) at x_scale[g * fp8_act_scale_ld(M) + m]
//       (the token index contiguous; fp8_act_scale_ld(M) = M, as M is a multiple of 4 here)
//   weights, BLK128x128 on [K, N]: scale of (block nb, kb) at w_scale[nb * fp8_weight_scale_ld(K) + kb],
//       fp8_weight_scale_ld(K) = ceil(K/128) rounded up to a multiple of 4 (NVIDIA's
//       CUDALibrarySamples size such a tensor roundoff(ceil(inner/128), 4) * ceil(outer/128))
// Verified on an H200 (cuBLASLt 13.1, version 130100) by CudaFp8.ScaleLayoutsAreCublasLts
// (tests/test_cuda_fp8.cpp): random codes, random power-of-two scales arranged in each candidate
// layout, the other operand's scales all 1, the product compared with ops::gemm_fp8_blockwise. At
// M = 32, N = 384, K = 640 (5 K blocks, padded 8): token-contiguous activation scales matched
// (2.4e-3), group-contiguous ones did not (0.77, 0.93); K-block-contiguous weight scales with rows
// padded to 4 matched (2.8e-3), unpadded rows (1.5) and N-block-contiguous layouts (1.2, 1.5) did not.
//
// Token counts: with block scaling that cuBLASLt has no kernel (CUBLAS_STATUS_NOT_SUPPORTED from the
// heuristic) for M % 4 != 0 (measured: M = 1, 2, 3, 7, 15, 17, 31 refused; 4, 8, 16, 32, 64, 128,
// 1000, 8192 run), so gemm_fp8 requires M % 4 == 0 and says so up front. The activation scale layout
// is that of the padded problem (fp8_act_scale_ld(M) = M rounded up to 4, the padding entries 1), so
// a caller with M % 4 != 0 quantizes its M rows and runs the GEMM on M rounded up to 4 rows of codes
// and output (the extra output rows are garbage). Per-tensor scales take any M (M = 1 ran).
//
// Alignment: cuBLASLt's FP8 kernels need 16-byte aligned pointers (codes, scales, D) and 16-byte
// aligned columns: K % 16 == 0, ldx % 16 == 0 (bytes = elements), ldy % 8 == 0 (bf16).
//
// Fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM): with block scaling the same cuBLASLt returns
// no algorithm for any shape tried (kernel_bench --only fp8, every 27B shape at M 1 / 64 / 8192), so
// it stays off; tuning::gemm_fp8_fast_accum (kernel_bench) forces it on or off.
namespace tuning {
int gemm_fp8_fast_accum = -1;  // -1: kFp8FastAccum; 0 / 1: off / on
}  // namespace tuning

namespace {

constexpr bool kFp8FastAccum = false;

struct Fp8Key {
  int device;
  int64_t M, N, K, ldx, ldy;
  bool tensor_scales, w_vec_scales, y_f32, accumulate;
  bool fast_accum, autotune;  // plans made under another autotune setting are not reused
  auto operator<=>(const Fp8Key&) const = default;
};

// A GemmPlan and the lock that makes "set this call's scale pointers, enqueue" atomic: the scale
// pointers are attributes of the plan's (shared) matmul descriptor, read when cublasLtMatmul enqueues.
struct Fp8Plan {
  GemmPlan plan;
  std::mutex mutex;
};

auto* g_fp8_plans = new std::map<Fp8Key, std::unique_ptr<Fp8Plan>>();

void set_fp8_scales(const GemmPlan& plan, const void* w_scale, const void* x_scale) {
  // cuBLASLt's A is the weight, its B the activations.
  DFLASH_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale, sizeof(w_scale)));
  DFLASH_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale, sizeof(x_scale)));
}

std::string fp8_shape_text(const Fp8Key& k, int device) {
  const DeviceInfo info = cuda_device_info(device);
  std::string s = "M=" + std::to_string(k.M) + " N=" + std::to_string(k.N) + " K=" + std::to_string(k.K) +
                  " ldx=" + std::to_string(k.ldx) + " ldy=" + std::to_string(k.ldy) +
                  (k.tensor_scales ? " (per-tensor scales)"
                                   : (k.w_vec_scales ? " (VEC128 x VEC128 scales)" : " (VEC128 x BLK128x128 scales)")) +
                  (k.y_f32 ? (k.accumulate ? " fp32 D += " : " fp32 D") : "") +
                  (k.fast_accum ? " fast-accum" : "") + " on " + info.name + " (sm_" + std::to_string(info.major) +
                  std::to_string(info.minor) + "), cuBLASLt " + std::to_string(cublasLtGetVersion());
  return s;
}

std::unique_ptr<Fp8Plan> make_fp8_plan(const Fp8Key& k, const GemmFp8Params& p, cublasLtHandle_t handle,
                                       size_t workspace_bytes, bool autotune, cudaStream_t stream, const RunFn& run) {
  auto out = std::make_unique<Fp8Plan>();
  GemmPlan& plan = out->plan;
  DFLASH_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_w = CUBLAS_OP_T, op_x = CUBLAS_OP_N;  // the "TN" form FP8 needs
  DFLASH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_w, sizeof(op_w)));
  DFLASH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_x, sizeof(op_x)));
  if (!k.tensor_scales) {
    const int32_t mode_w = k.w_vec_scales ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const int32_t mode_x = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    DFLASH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_w, sizeof(mode_w)));
    DFLASH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_x, sizeof(mode_x)));
  }
  const int8_t fast = k.fast_accum ? 1 : 0;
  DFLASH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  set_fp8_scales(plan, p.w_scale, p.x_scale);
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  DFLASH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_8F_E4M3, u(k.K), u(k.N), k.K));
  DFLASH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_8F_E4M3, u(k.K), u(k.M), k.ldx));
  DFLASH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.c, k.y_f32 ? CUDA_R_32F : CUDA_R_16BF, u(k.N), u(k.M), k.ldy));

  cublasLtMatmulHeuristicResult_t results[kCandidates]{};
  int found = 0;
  const cublasStatus_t st = heuristic(handle, plan, workspace_bytes, autotune ? kCandidates : 1, results, found);
  DFLASH_CHECK_HINT(st == CUBLAS_STATUS_SUCCESS && found > 0 && results[0].state == CUBLAS_STATUS_SUCCESS,
                    "gemm_fp8: cuBLASLt found no algorithm (status " << static_cast<int>(st) << ", " << found
                                                                     << " answers) for " << fp8_shape_text(k, k.device),
                    "block-scaled FP8 GEMMs need an sm_90 GPU and cuBLAS >= 12.9; run the bf16 target "
                    "(model.target.precision: bf16) on other GPUs");
  plan.algo = results[0].algo;
  if (autotune && found > 1) plan.algo = fastest(plan, results, found, stream, run);
  return out;
}

}  // namespace

int64_t fp8_weight_scale_ld(int64_t K) { return ((K + 127) / 128 + 3) / 4 * 4; }

const char* gemm_fp8_kernel_name() {
  return kFp8FastAccum ? "cublasLt e4m3 VEC128xBLK128x128 fast-accum" : "cublasLt e4m3 VEC128xBLK128x128";
}

void gemm_fp8(const GemmFp8Params& p, int device) {
  DFLASH_CHECK(p.M >= 0 && p.N > 0 && p.K > 0,
               "gemm_fp8: need M >= 0, N > 0, K > 0, got M=" << p.M << " N=" << p.N << " K=" << p.K);
  DFLASH_CHECK(p.ldx >= p.K, "gemm_fp8: x row stride ldx=" << p.ldx << " is smaller than K=" << p.K);
  DFLASH_CHECK(p.ldy >= p.N, "gemm_fp8: y row stride ldy=" << p.ldy << " is smaller than N=" << p.N);
  DFLASH_CHECK(!p.accumulate || p.y_f32, "gemm_fp8: accumulate needs the fp32 output (y_f32)");
  DFLASH_CHECK(!p.w_vec_scales || !p.tensor_scales, "gemm_fp8: w_vec_scales and tensor_scales exclude each other");
  DFLASH_CHECK(!p.y_f32 || p.ldy % 4 == 0, "gemm_fp8: an fp32 y needs ldy % 4 == 0, got ldy=" << p.ldy);
  if (p.M == 0) return;
  DFLASH_CHECK(p.x != nullptr && p.w != nullptr && p.y != nullptr && p.x_scale != nullptr && p.w_scale != nullptr,
               "gemm_fp8: null pointer (x=" << static_cast<const void*>(p.x) << " x_scale=" << p.x_scale
                                            << " w=" << static_cast<const void*>(p.w) << " w_scale=" << p.w_scale
                                            << " y=" << p.y << ") for M=" << p.M);
  DFLASH_CHECK_HINT(aligned16(p.x) && aligned16(p.w) && aligned16(p.y) && aligned16(p.x_scale) &&
                        aligned16(p.w_scale) && p.K % 16 == 0 && p.ldx % 16 == 0 && p.ldy % 8 == 0,
                    "gemm_fp8: cuBLASLt's FP8 kernels need 16-byte aligned codes, scales and output, K and ldx "
                    "multiples of 16 and ldy a multiple of 8, got x="
                        << static_cast<const void*>(p.x) << " w=" << static_cast<const void*>(p.w) << " y=" << p.y
                        << " x_scale=" << p.x_scale << " w_scale=" << p.w_scale << " K=" << p.K << " ldx=" << p.ldx
                        << " ldy=" << p.ldy,
                    "slice activations and outputs at column offsets that are multiples of 16; every Qwen3.5 "
                    "projection's K is a multiple of 128");
  if (tuning::gemm_fp8_stream != 0 && gemm_fp8_stream_supported(p) && (tuning::gemm_fp8_stream == 1 || p.M % 4 != 0)) {
    // The streaming kernel (issue 30) on sm_90: always when forced on, else only where cuBLASLt has
    // no block-scaled kernel (M % 4 != 0); the model's decode steps call it directly where the plan says.
    static int major[64] = {};
    if (device >= 0 && device < 64 && major[device] == 0)
      DFLASH_CUDA_CHECK(cudaDeviceGetAttribute(&major[device], cudaDevAttrComputeCapabilityMajor, device));
    if (device >= 0 && device < 64 && major[device] == 9) {
      gemm_fp8_stream(p, device, DeviceContext::get(device).stream());
      return;
    }
  }
  DFLASH_CHECK_HINT(p.tensor_scales || p.M % 4 == 0,
                    "gemm_fp8: block-scaled FP8 GEMMs need M (tokens) a multiple of 4, got M="
                        << p.M << " (N=" << p.N << " K=" << p.K
                        << "): cuBLASLt has no block-scaled kernel for other M on sm_90",
                    "pad the token rows to a multiple of 4: quantize the M rows (their scale buffer already has "
                    "the padded layout) and run the GEMM on M rounded up to 4 rows of codes and output");
  DeviceContext& ctx = DeviceContext::get(device);
  DeviceGuard scope(device);
  auto handle = static_cast<cublasLtHandle_t>(ctx.cublaslt());
  const auto stream = static_cast<cudaStream_t>(ctx.stream());
  const bool fast = tuning::gemm_fp8_fast_accum < 0 ? kFp8FastAccum : tuning::gemm_fp8_fast_accum != 0;
  const float alpha = 1.0f, beta = p.accumulate ? 1.0f : 0.0f;
  const RunFn run = [&](const GemmPlan& pl, const cublasLtMatmulAlgo_t& algo) {
    set_fp8_scales(pl, p.w_scale, p.x_scale);
    DFLASH_CUBLAS_CHECK(cublasLtMatmul(handle, pl.op, &alpha, p.w, pl.a, p.x, pl.b, &beta, p.y, pl.c, p.y, pl.c, &algo,
                                       ctx.workspace(), ctx.workspace_bytes(), stream));
  };
  const bool autotune = g_autotune.load() && !p.accumulate;  // timing candidates would add to y
  const Fp8Key key{device, p.M, p.N, p.K, p.ldx, p.ldy, p.tensor_scales, p.w_vec_scales, p.y_f32, p.accumulate,
                   fast, autotune};
  Fp8Plan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_fp8_plans->find(key);
    if (it == g_fp8_plans->end())
      it = g_fp8_plans->emplace(key, make_fp8_plan(key, p, handle, ctx.workspace_bytes(), autotune,
                                                   stream, run)).first;
    plan = it->second.get();
  }
  std::lock_guard<std::mutex> lock(plan->mutex);
  run(plan->plan, plan->plan.algo);
}

}  // namespace dflash::cuda
