// The CPU backend's f32 GEMM (kernels/cpu/gemm.h): packed panels and a register-tile micro-kernel per
// instruction set, in the way of BLIS / GotoBLAS: for each task's C tile [<= kMc, <= nc], for each k
// range of kKc: op(B) is packed into 16-column panels ([kc][16], zero-padded), op(A) into MR-row panels
// ([kc][MR], zero-padded), and the micro-kernel sums an MR x 16 tile over the range from zero with one
// fused multiply-add per k (ascending), then adds it to C (or stores it, for the first range when not
// accumulating). Padded rows and columns are computed and dropped, so an element's value does not depend
// on where its tile starts, on M, N or on the thread that computes it (gemm.h: determinism).
#include "kernels/cpu/gemm.h"

// GCC 12's AVX-512 headers start some casts from _mm256_undefined_pd(), which -O3 reports as
// maybe-uninitialized where they are inlined (the upper bits are never read).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/worker_pool.h"

namespace dflash::cpu {

namespace {

constexpr int kNr = 16;        // columns of a micro-tile (one AVX-512 vector, two AVX2 vectors)
constexpr int64_t kKc = 256;   // k range packed at a time
constexpr int64_t kMc = 96;    // rows of a task's tile (a multiple of every MR below)
constexpr int64_t kNc = 512;   // columns of a task's tile at most

// c[mr x nr] (row stride ldc) = (add ? c : 0) + Σ_k ap[k][i] · bp[k][j]; ap [kc][MR], bp [kc][16].
using MicroKernel = void (*)(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, int mr, int nr,
                             bool add);

// Writes an MR x 16 accumulator tile held in `acc` (row-major, 16 floats a row) to C.
inline void store_tile(const float* acc, int mr, int nr, float* c, int64_t ldc, bool add) {
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) c[i * ldc + j] = add ? c[i * ldc + j] + acc[i * kNr + j] : acc[i * kNr + j];
}

template <int MR>
void micro_portable(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, int mr, int nr, bool add) {
  float acc[MR * kNr] = {};
  for (int64_t k = 0; k < kc; ++k)
    for (int i = 0; i < MR; ++i) {
      const float a = ap[k * MR + i];
      for (int j = 0; j < kNr; ++j) acc[i * kNr + j] = std::fma(a, bp[k * kNr + j], acc[i * kNr + j]);
    }
  store_tile(acc, mr, nr, c, ldc, add);
}

__attribute__((target("avx2,fma"))) void micro_avx2(int64_t kc, const float* ap, const float* bp, float* c,
                                                    int64_t ldc, int mr, int nr, bool add) {
  constexpr int MR = 6;
  __m256 lo[MR], hi[MR];
  for (int i = 0; i < MR; ++i) lo[i] = _mm256_setzero_ps(), hi[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(bp + k * kNr), b1 = _mm256_load_ps(bp + k * kNr + 8);
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(ap + k * MR + i);
      lo[i] = _mm256_fmadd_ps(a, b0, lo[i]);
      hi[i] = _mm256_fmadd_ps(a, b1, hi[i]);
    }
  }
  if (mr == MR && nr == kNr) {
    for (int i = 0; i < MR; ++i) {
      float* p = c + i * ldc;
      _mm256_storeu_ps(p, add ? _mm256_add_ps(_mm256_loadu_ps(p), lo[i]) : lo[i]);
      _mm256_storeu_ps(p + 8, add ? _mm256_add_ps(_mm256_loadu_ps(p + 8), hi[i]) : hi[i]);
    }
    return;
  }
  alignas(64) float acc[MR * kNr];
  for (int i = 0; i < MR; ++i) _mm256_store_ps(acc + i * kNr, lo[i]), _mm256_store_ps(acc + i * kNr + 8, hi[i]);
  store_tile(acc, mr, nr, c, ldc, add);
}

__attribute__((target("avx512f"))) void micro_avx512(int64_t kc, const float* ap, const float* bp, float* c,
                                                     int64_t ldc, int mr, int nr, bool add) {
  constexpr int MR = 12;
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b = _mm512_load_ps(bp + k * kNr);
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(ap[k * MR + i]), b, acc[i]);
  }
  const __mmask16 m = static_cast<__mmask16>(nr == kNr ? 0xffff : (1u << nr) - 1);
  for (int i = 0; i < mr; ++i) {
    float* p = c + i * ldc;
    const __m512 v = add ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, p), acc[i]) : acc[i];
    _mm512_mask_storeu_ps(p, m, v);
  }
}

// The NT product (op(A) = A [M, K], op(B) = B^T with B [N, K]: both operands contiguous along k, the
// linear layers' forward) needs no packing: each element is a dot product of two rows, summed in 8
// lanes (lane l takes k = l, l + 8, ... by fused multiply-adds; a K tail is read masked as zeros and
// multiplied like the rest) and the lanes reduced by one fixed tree, ((l0 + l4) + (l2 + l6)) + ((l1 +
// l5) + (l3 + l7)). Every instruction set runs this same arithmetic (AVX-512 machines on 8-float
// vectors too, with the 32 registers AVX-512 gives them), so the product has the same bits on any
// x86-64 CPU: an AVX2 machine and an AVX-512 one train the same drafter and print the same tau. A call
// covers mi <= MI rows of A and nj <= NJ rows of B, sharing their loads; rows past mi / nj repeat row 0
// and are dropped, so an element's bits do not depend on its neighbours (M = 1 decoding runs at the
// speed of the rest, with the same bits).
using DotKernel = void (*)(int64_t K, const float* a, int64_t lda, int mi, const float* b, int64_t ldb, int nj, float* c,
                           int64_t ldc, bool add);

constexpr int kDotLanes = 8;

template <int MI, int NJ>
void dot_portable(int64_t K, const float* a, int64_t lda, int mi, const float* b, int64_t ldb, int nj, float* c,
                  int64_t ldc, bool add) {
  const int64_t k_end = (K + kDotLanes - 1) / kDotLanes * kDotLanes;  // the masked tail's zero products too
  for (int i = 0; i < mi; ++i)
    for (int j = 0; j < nj; ++j) {
      float lane[kDotLanes] = {};
      const float* x = a + i * lda;
      const float* w = b + j * ldb;
      for (int64_t k = 0; k < k_end; ++k)
        lane[k % kDotLanes] = std::fma(k < K ? x[k] : 0.0f, k < K ? w[k] : 0.0f, lane[k % kDotLanes]);
      const float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
      c[i * ldc + j] = add ? c[i * ldc + j] + s : s;
    }
}

__attribute__((target("avx2,fma"), always_inline)) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // (0+4, 1+5, 2+6, 3+7)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                        // (0+4)+(2+6), (1+5)+(3+7)
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// The 8-lane kernel on 8-float vectors: dot_avx2 instantiates it for AVX2's 16 registers (2 x 4 rows),
// dot_avx512 inlines it where AVX-512 gives 32 (4 x 4 rows); the same instructions per element either way.
template <int MI, int NJ>
__attribute__((target("avx2,fma"), always_inline)) inline void dot8(int64_t K, const float* a, int64_t lda, int mi,
                                                                   const float* b, int64_t ldb, int nj, float* c,
                                                                   int64_t ldc, bool add) {
  const float* x[MI];
  const float* w[NJ];
  for (int i = 0; i < MI; ++i) x[i] = a + (i < mi ? i : 0) * lda;
  for (int j = 0; j < NJ; ++j) w[j] = b + (j < nj ? j : 0) * ldb;
  __m256 acc[MI][NJ];
  for (int i = 0; i < MI; ++i)
    for (int j = 0; j < NJ; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MI], wv[NJ];
    for (int i = 0; i < MI; ++i) xv[i] = _mm256_loadu_ps(x[i] + k);
    for (int j = 0; j < NJ; ++j) wv[j] = _mm256_loadu_ps(w[j] + k);
    for (int i = 0; i < MI; ++i)
      for (int j = 0; j < NJ; ++j) acc[i][j] = _mm256_fmadd_ps(xv[i], wv[j], acc[i][j]);
  }
  if (k < K) {
    alignas(32) int32_t m[8];
    for (int l = 0; l < 8; ++l) m[l] = k + l < K ? -1 : 0;
    const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
    __m256 xv[MI], wv[NJ];
    for (int i = 0; i < MI; ++i) xv[i] = _mm256_maskload_ps(x[i] + k, mask);
    for (int j = 0; j < NJ; ++j) wv[j] = _mm256_maskload_ps(w[j] + k, mask);
    for (int i = 0; i < MI; ++i)
      for (int j = 0; j < NJ; ++j) acc[i][j] = _mm256_fmadd_ps(xv[i], wv[j], acc[i][j]);
  }
  for (int i = 0; i < mi; ++i)
    for (int j = 0; j < nj; ++j) {
      const float s = hsum8(acc[i][j]);
      c[i * ldc + j] = add ? c[i * ldc + j] + s : s;
    }
}

__attribute__((target("avx2,fma"))) void dot_avx2(int64_t K, const float* a, int64_t lda, int mi, const float* b,
                                                  int64_t ldb, int nj, float* c, int64_t ldc, bool add) {
  dot8<2, 4>(K, a, lda, mi, b, ldb, nj, c, ldc, add);
}

__attribute__((target("avx512f,avx512vl,avx2,fma"))) void dot_avx512(int64_t K, const float* a, int64_t lda, int mi,
                                                                     const float* b, int64_t ldb, int nj, float* c,
                                                                     int64_t ldc, bool add) {
  dot8<4, 4>(K, a, lda, mi, b, ldb, nj, c, ldc, add);
}

struct Isa {
  const char* name;
  int mr;
  MicroKernel kernel;
  int dot_mi, dot_nj;
  DotKernel dot;
};

// Every instruction set this build has, best first; those the CPU runs are the ones gemm_isas() names.
const Isa kIsas[] = {{"avx512", 12, micro_avx512, 4, 4, dot_avx512},
                     {"avx2", 6, micro_avx2, 2, 4, dot_avx2},
                     {"portable", 4, micro_portable<4>, 2, 2, dot_portable<2, 2>}};

bool cpu_runs(const Isa& i) {
  __builtin_cpu_init();
  if (std::strcmp(i.name, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  if (std::strcmp(i.name, "avx2") == 0) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return true;
}

std::atomic<const Isa*> g_isa{nullptr};

const Isa& isa() {
  const Isa* i = g_isa.load(std::memory_order_acquire);
  if (i == nullptr) {
    for (const Isa& c : kIsas)
      if (cpu_runs(c)) {
        i = &c;
        break;
      }
    g_isa.store(i, std::memory_order_release);
  }
  return *i;
}

// A 64-byte aligned scratch buffer per thread (the packed panels), grown on demand.
struct Scratch {
  struct Free {
    void operator()(float* p) const { ::operator delete[](p, std::align_val_t(64)); }
  };
  std::unique_ptr<float[], Free> p;
  size_t n = 0;
  float* get(size_t want) {
    if (want > n) {
      p.reset(static_cast<float*>(::operator new[](want * sizeof(float), std::align_val_t(64))));
      n = want;
    }
    return p.get();
  }
};

// op(B)[k0 .. k0+kc, j0 .. j0+nc] into ceil(nc / 16) panels [kc][16], zero-padded.
void pack_b(Trans tb, const float* B, int64_t ldb, int64_t k0, int64_t kc, int64_t j0, int64_t nc, float* bp) {
  for (int64_t jp = 0; jp < nc; jp += kNr) {
    const int nr = static_cast<int>(std::min<int64_t>(kNr, nc - jp));
    float* dst = bp + jp * kc;
    if (tb == Trans::N) {
      for (int64_t k = 0; k < kc; ++k) {
        const float* src = B + (k0 + k) * ldb + j0 + jp;
        float* d = dst + k * kNr;
        std::memcpy(d, src, sizeof(float) * static_cast<size_t>(nr));
        for (int j = nr; j < kNr; ++j) d[j] = 0.0f;
      }
    } else {
      for (int j = 0; j < kNr; ++j) {
        if (j >= nr) {
          for (int64_t k = 0; k < kc; ++k) dst[k * kNr + j] = 0.0f;
          continue;
        }
        const float* src = B + (j0 + jp + j) * ldb + k0;
        for (int64_t k = 0; k < kc; ++k) dst[k * kNr + j] = src[k];
      }
    }
  }
}

// op(A)[i0 .. i0+mc, k0 .. k0+kc] into ceil(mc / MR) panels [kc][MR], zero-padded.
void pack_a(Trans ta, const float* A, int64_t lda, int64_t i0, int64_t mc, int64_t k0, int64_t kc, int MR, float* ap) {
  for (int64_t ip = 0; ip < mc; ip += MR) {
    const int mr = static_cast<int>(std::min<int64_t>(MR, mc - ip));
    float* dst = ap + ip * kc;
    if (ta == Trans::N) {
      for (int i = 0; i < MR; ++i) {
        if (i >= mr) {
          for (int64_t k = 0; k < kc; ++k) dst[k * MR + i] = 0.0f;
          continue;
        }
        const float* src = A + (i0 + ip + i) * lda + k0;
        for (int64_t k = 0; k < kc; ++k) dst[k * MR + i] = src[k];
      }
    } else {
      for (int64_t k = 0; k < kc; ++k) {
        const float* src = A + (k0 + k) * lda + i0 + ip;
        float* d = dst + k * MR;
        for (int i = 0; i < mr; ++i) d[i] = src[i];
        for (int i = mr; i < MR; ++i) d[i] = 0.0f;
      }
    }
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- worker threads ----

int default_threads() {
  if (const char* e = std::getenv("DFLASH_CPU_THREADS")) {
    const int n = std::atoi(e);
    if (n >= 1) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp<unsigned>(hw, 1, 16));
}

std::atomic<int> g_threads{0};
thread_local bool t_in_task = false;  // this thread is running a parallel_for task: nested calls run inline

// The pool parallel_for runs on (core/worker_pool.h), made for the current thread count on first use.
std::mutex g_pool_mu;  // one parallel region at a time
std::unique_ptr<WorkerPool> g_pool;

}  // namespace

const char* gemm_isa() { return isa().name; }

std::vector<std::string> gemm_isas() {
  std::vector<std::string> names;
  for (const Isa& i : kIsas)
    if (cpu_runs(i)) names.emplace_back(i.name);
  return names;
}

void set_gemm_isa(const std::string& name) {
  for (const Isa& i : kIsas)
    if (name == i.name) {
      if (!cpu_runs(i)) throw std::invalid_argument("set_gemm_isa: this CPU cannot run \"" + name + "\"");
      g_isa.store(&i, std::memory_order_release);
      return;
    }
  throw std::invalid_argument("set_gemm_isa: no instruction set \"" + name + "\" (avx512, avx2 or portable)");
}

int cpu_threads() {
  int n = g_threads.load();
  if (n <= 0) {
    n = default_threads();
    g_threads.store(n);
  }
  return n;
}

void set_cpu_threads(int n) { g_threads.store(std::max(1, n)); }

void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  const int threads = cpu_threads();
  if (n <= 0) return;
  if (n == 1 || threads <= 1 || t_in_task) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> serial(g_pool_mu);
  if (!g_pool || g_pool->threads() != threads) g_pool = std::make_unique<WorkerPool>(threads);
  std::atomic<int64_t> next{0};
  g_pool->run([&](int) {
    struct InTask {
      InTask() { t_in_task = true; }
      ~InTask() { t_in_task = false; }
    } in_task;
    for (int64_t i; (i = next.fetch_add(1)) < n;) fn(i);
  });
}

void gemm_f32(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
              int64_t ldb, bool accumulate, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.0f);
    return;
  }
  const Isa& I = isa();
  const int threads = cpu_threads();
  if (ta == Trans::N && tb == Trans::T) {
    // Tasks of <= kDotRows rows x tn columns; tn gives the threads enough tasks when it is worth it.
    constexpr int64_t kDotRows = 16;
    const int64_t mt = ceil_div(M, kDotRows);
    int64_t tn = std::min<int64_t>(256, N);
    if (threads > 1 && 2.0 * static_cast<double>(M) * N * K > 2e6)
      tn = std::min(tn, std::max<int64_t>(16, ceil_div(ceil_div(N, ceil_div(2 * threads, mt)), 4) * 4));
    const int64_t nt = ceil_div(N, tn);
    parallel_for(mt * nt, [&](int64_t t) {
      const int64_t i0 = (t / nt) * kDotRows, j0 = (t % nt) * tn;
      const int64_t i1 = std::min(M, i0 + kDotRows), j1 = std::min(N, j0 + tn);
      for (int64_t j = j0; j < j1; j += I.dot_nj)
        for (int64_t i = i0; i < i1; i += I.dot_mi)
          I.dot(K, A + i * lda, lda, static_cast<int>(std::min<int64_t>(I.dot_mi, i1 - i)), B + j * ldb, ldb,
                static_cast<int>(std::min<int64_t>(I.dot_nj, j1 - j)), C + i * ldc + j, ldc, accumulate);
    });
    return;
  }
  const int64_t mt = ceil_div(M, kMc);
  int64_t nc = std::min<int64_t>(kNc, ceil_div(N, kNr) * kNr);
  // Enough tasks for the threads when the product is worth splitting (~1 MFLOP a task at least).
  if (threads > 1 && 2.0 * static_cast<double>(M) * N * K > 2e6) {
    const int64_t want_nt = ceil_div(2 * threads, mt);
    nc = std::min(nc, std::max<int64_t>(2 * kNr, ceil_div(ceil_div(N, want_nt), kNr) * kNr));
  }
  const int64_t nt = ceil_div(N, nc);
  auto task = [&](int64_t t) {
    static thread_local Scratch sa, sb;
    const int64_t i0 = (t / nt) * kMc, j0 = (t % nt) * nc;
    const int64_t mc = std::min(kMc, M - i0), ncc = std::min(nc, N - j0);
    float* ap = sa.get(static_cast<size_t>(ceil_div(kMc, I.mr) * I.mr * kKc));
    float* bp = sb.get(static_cast<size_t>(ceil_div(kNc, kNr) * kNr * kKc));
    for (int64_t k0 = 0; k0 < K; k0 += kKc) {
      const int64_t kc = std::min(kKc, K - k0);
      const bool add = accumulate || k0 > 0;
      pack_b(tb, B, ldb, k0, kc, j0, ncc, bp);
      pack_a(ta, A, lda, i0, mc, k0, kc, I.mr, ap);
      for (int64_t jp = 0; jp < ncc; jp += kNr)
        for (int64_t ip = 0; ip < mc; ip += I.mr)
          I.kernel(kc, ap + ip * kc, bp + jp * kc, C + (i0 + ip) * ldc + j0 + jp, ldc,
                   static_cast<int>(std::min<int64_t>(I.mr, mc - ip)), static_cast<int>(std::min<int64_t>(kNr, ncc - jp)),
                   add);
    }
  };
  parallel_for(mt * nt, task);
}

}  // namespace dflash::cpu
