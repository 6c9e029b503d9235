// The sampling ops on the GPU (kernels/cuda/sampling.cu) against the CPU reference:
// argmax_rows against ops::argmax_rows on random NaN-free rows of fp32 and bf16 logits with planted
// ties (two or three equal maxima far apart, at the row's ends, rows of equal values); sample_rows
// against ops::sample_rows token for token on fresh random rows of eight kinds (wide, one dominating
// token, all equal, NaN and -inf entries, four distinct values, bf16-rounded values, normal, and
// all -inf / two +inf / all NaN), at temperatures 0.3 / 1 / 2.5 and top_p 1 / 0.95 / 0.5 / 0.01, in
// both CTA layouts, and a row's draw the same in a batch of 1 and of 70. Vocabularies from 1 to
// Qwen's 248320, rows 16-byte aligned or not, and padding past V that would win if it were read.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cuda/sampling.h"
#include "core/device.h"
#include "kernels/ops.h"
#include "core/random.h"
#include "core/rng.h"
#include "test_util.h"

namespace dflash::cuda::tuning {
extern int sample_threads;  // kernels/cuda/sampling.cu: 0 = default CTA (1024 threads), 512
}

using namespace dflash;

namespace {

// [R, ld] host logits: N(0, 1), ties of the maximum 8 planted per row by pattern r % 5, columns
// >= V hold 100 (larger than any logit: reading them would change the answer).
Tensor planted_logits(int64_t R, int64_t V, int64_t ld, uint64_t seed) {
  Tensor x = Tensor::empty({R, ld}, DType::F32);
  fill_normal(x, {seed, 1, 0}, 0.0f, 1.0f);
  float* p = x.data<float>();
  for (int64_t r = 0; r < R; ++r) {
    float* row = p + r * ld;
    for (int64_t v = V; v < ld; ++v) row[v] = 100.0f;
    const int64_t a = (r * 7919 + 13) % V, b = V - 1 - (r * 31) % V;
    switch (r % 5) {
      case 0: row[a] = row[b] = 8.0f; break;                    // two maxima (or one when a == b)
      case 1: row[0] = row[V - 1] = 8.0f; break;                // at both ends
      case 2: row[a] = row[b] = row[(a + b) / 2] = 8.0f; break;  // three
      case 3: for (int64_t v = 0; v < V; ++v) row[v] = -1.5f; break;  // all equal: id 0
      default: row[V - 1] = 8.0f; break;                        // only the last (the tail path)
    }
  }
  return x;
}

}  // namespace

TEST(CudaSampling, ArgmaxRowsMatchesCpuWithTies) {
  DFLASH_REQUIRE_GPU();
  void* stream = DeviceContext::get(0).stream();
  int cases = 0;
  for (int64_t V : {1, 7, 8, 33, 1000, 4099, 248320})
    for (int64_t pad : {0, 3, 8})
      for (DType dt : {DType::F32, DType::BF16}) {
        const int64_t R = V > 5000 ? 16 : 23, ld = V + pad;
        const Tensor host = planted_logits(R, V, ld, static_cast<uint64_t>(V * 10 + pad)).to_dtype(dt);
        std::vector<int32_t> want;
        ops::argmax_rows(host.slice(1, 0, V), want);
        const Tensor dev = host.to(Device::cuda(0));
        Tensor out = Tensor::empty({R}, DType::I32, Device::cuda(0));
        poison(out);
        cuda::argmax_rows(dev.raw_data(), dt == DType::BF16, ld, R, V, out.data<int32_t>(), stream);
        const Tensor got = out.to(Device::cpu());
        for (int64_t r = 0; r < R; ++r)
          EXPECT_EQ(got.data<int32_t>()[r], want[r]) << "V " << V << " ld " << ld << " " << dtype_name(dt) << " row " << r;
        ++cases;
      }
  std::printf("argmax_rows: %d shapes x dtypes agree with the CPU reference\n", cases);
}

TEST(CudaSampling, ArgmaxRowsRefusesBadSizes) {
  DFLASH_REQUIRE_GPU();
  void* stream = DeviceContext::get(0).stream();
  Tensor x = Tensor::zeros({2, 8}, DType::F32, Device::cuda(0));
  Tensor out = Tensor::empty({2}, DType::I32, Device::cuda(0));
  EXPECT_NE(error_of([&] { cuda::argmax_rows(x.raw_data(), false, 4, 2, 8, out.data<int32_t>(), stream); })
                .find("row stride ld=4 is smaller than V=8"),
            std::string::npos);
  EXPECT_NE(error_of([&] { cuda::argmax_rows(x.raw_data(), false, 8, 2, 0, out.data<int32_t>(), stream); }).find("1 <= V"),
            std::string::npos);
  EXPECT_NO_THROW(cuda::argmax_rows(nullptr, false, 8, 0, 8, nullptr, stream)) << "R = 0 is a no-op";
}

namespace {

// [R, ld] host logits for sample_rows: N(0, 1) rows of kind (r + seed) % 8, columns >= V hold 100
// (at any of the temperatures the largest z by far: reading them would change the answer).
Tensor sampling_logits(int64_t R, int64_t V, int64_t ld, uint64_t seed) {
  Tensor x = Tensor::empty({R, ld}, DType::F32);
  fill_normal(x, {seed, 2, 0}, 0.0f, 1.0f);
  float* p = x.data<float>();
  std::mt19937_64 g(seed);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < R; ++r) {
    float* row = p + r * ld;
    for (int64_t v = V; v < ld; ++v) row[v] = 100.0f;
    const int64_t a = static_cast<int64_t>(g() % static_cast<uint64_t>(V));
    switch ((r + static_cast<int64_t>(seed)) % 8) {
      case 0: for (int64_t v = 0; v < V; ++v) row[v] *= 3.0f; break;  // wide
      case 1: row[a] = 30.0f; break;                                  // one dominating token
      case 2: for (int64_t v = 0; v < V; ++v) row[v] = -1.5f; break;  // all equal
      case 3:                                                         // NaN and -inf entries
        for (int64_t v = 0; v < V; ++v) row[v] = v % 7 == 3 ? nan : v % 11 == 5 ? -inf : row[v];
        break;
      case 4: for (int64_t v = 0; v < V; ++v) row[v] = static_cast<float>(g() % 4) * 0.5f; break;  // 4 values
      case 5:  // bf16-rounded (groups of equal values at every level)
        for (int64_t v = 0; v < V; ++v) row[v] = bf16_to_f32(f32_to_bf16(2.0f * row[v]));
        break;
      case 6: break;  // N(0, 1)
      default:
        switch ((r / 8) % 3) {
          case 0: for (int64_t v = 0; v < V; ++v) row[v] = v % 5 == 1 ? nan : -inf; break;  // all -inf: the first
          case 1: row[a] = inf, row[(a * 7 + 3) % V] = inf; break;  // two +inf: the lower id
          default: for (int64_t v = 0; v < V; ++v) row[v] = nan; break;  // all NaN: 0
        }
    }
  }
  return x;
}

// The reference's tokens for rows of host logits [R, V] (rows ld apart), row blocks on all cores.
std::vector<int32_t> reference_tokens(const Tensor& host, int64_t V, const ops::SampleParams& sp,
                                      const std::vector<uint64_t>& streams, const std::vector<int64_t>& positions) {
  const int64_t R = host.size(0);
  std::vector<int32_t> out(static_cast<size_t>(R));
  const int64_t nthreads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 32);
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < nthreads; ++t)
    pool.emplace_back([&, t] {
      for (int64_t r = t; r < R; r += nthreads) {
        std::vector<int32_t> one;
        ops::sample_rows(host.slice(0, r, r + 1).slice(1, 0, V), sp, {streams[static_cast<size_t>(r)]},
                         {positions[static_cast<size_t>(r)]}, one);
        out[static_cast<size_t>(r)] = one[0];
      }
    });
  for (auto& th : pool) th.join();
  return out;
}

// The z values of one row, its nucleus threshold and margin, and the next value below z_c.
struct Nucleus {
  std::vector<float> z;
  float zc = 0, next = 0;  // next: the largest z < zc (zc when there is none)
  double margin = 0;
};
Nucleus nucleus_of(const float* logits, int64_t V, const ops::SampleParams& sp) {
  Nucleus n;
  n.z.resize(static_cast<size_t>(V));
  for (int64_t v = 0; v < V; ++v) n.z[static_cast<size_t>(v)] = logits[v] / sp.temperature;
  n.zc = ops::nucleus_threshold(n.z.data(), V, sp.top_p, &n.margin);
  n.next = n.zc;
  float below = -std::numeric_limits<float>::infinity();
  bool any = false;
  for (float z : n.z)
    if (z < n.zc && z >= below) below = z, any = true;
  if (any) n.next = below;
  return n;
}

struct SampleCase {
  int64_t R, V, ld;
  ops::SampleParams sp;
  uint64_t seed;
};

// Device copies of a case's inputs.
struct DeviceInputs {
  Tensor logits, streams, positions;
  std::vector<uint64_t> host_streams;
  std::vector<int64_t> host_positions;
};
DeviceInputs upload(const Tensor& host, const SampleCase& c) {
  DeviceInputs d;
  std::mt19937_64 g(c.seed * 3 + 1);
  for (int64_t r = 0; r < c.R; ++r) {
    d.host_streams.push_back(rng::mix64(c.seed * 1000 + static_cast<uint64_t>(r)));
    // positions up to 2^40: the Philox index position * V + v needs 64 bits
    d.host_positions.push_back(r % 9 == 4 ? (int64_t{1} << 40) + r : static_cast<int64_t>(g() % 1000000));
  }
  d.logits = host.to(Device::cuda(0));
  d.streams = Tensor::from_blob(d.host_streams.data(), {c.R}, DType::I64).to(Device::cuda(0));
  d.positions = Tensor::from_blob(d.host_positions.data(), {c.R}, DType::I64).to(Device::cuda(0));
  return d;
}

std::vector<int32_t> run_gpu(const DeviceInputs& d, const SampleCase& c, int row0, int rows, void* stream) {
  Tensor out = Tensor::empty({rows}, DType::I32, Device::cuda(0));
  poison(out);
  cuda::sample_rows(d.logits.data<float>() + row0 * c.ld, c.ld, rows, c.V, c.sp.temperature, c.sp.top_p, c.sp.seed,
                    reinterpret_cast<const uint64_t*>(d.streams.data<int64_t>()) + row0,
                    d.positions.data<int64_t>() + row0, out.data<int32_t>(), stream);
  return ids_of(out.to(Device::cpu()));
}

}  // namespace

// Every row's token equals the reference's, except on a row whose nucleus mass lies within 1e-5 of
// top_p (nucleus_threshold's margin: a float sum in another order may keep one value group more or
// less there), where the token must lie in the reference nucleus widened by the next value group
// (the margin is computed for the rows whose tokens differ).
TEST(CudaSampling, SampleRowsMatchesCpuTokenForToken) {
  DFLASH_REQUIRE_GPU();
  void* stream = DeviceContext::get(0).stream();
  int cases = 0, rows = 0, near = 0;
  for (int64_t V : {1, 7, 1000, 4096, 248320})
    for (int64_t R : {1, 3, 70})
      for (float T : {0.3f, 1.0f, 2.5f})
        for (float top_p : {1.0f, 0.95f, 0.5f, 0.01f}) {
          SampleCase c{R, V, V + (cases % 2 ? 3 : 0), {T, top_p, 77 + static_cast<uint64_t>(cases)},
                       static_cast<uint64_t>(1000 + cases)};
          ++cases;
          const Tensor host = sampling_logits(c.R, c.V, c.ld, c.seed);
          const DeviceInputs d = upload(host, c);
          const std::vector<int32_t> want = reference_tokens(host, V, c.sp, d.host_streams, d.host_positions);
          for (int threads : {0, 512}) {
            cuda::tuning::sample_threads = threads;
            const std::vector<int32_t> got = run_gpu(d, c, 0, static_cast<int>(R), stream);
            cuda::tuning::sample_threads = 0;
            for (int64_t r = 0; r < R; ++r) {
              const int32_t t = got[static_cast<size_t>(r)];
              rows += threads == 0;
              if (t == want[static_cast<size_t>(r)]) continue;
              const std::string what = "V " + std::to_string(V) + " ld " + std::to_string(c.ld) + " R " +
                                       std::to_string(R) + " T " + std::to_string(T) + " top_p " + std::to_string(top_p) +
                                       " row " + std::to_string(r) + " kind " + std::to_string((r + c.seed) % 8) +
                                       " threads " + std::to_string(threads);
              const Nucleus n = nucleus_of(host.data<float>() + r * c.ld, V, c.sp);
              if (top_p < 1.0f && n.margin < 1e-5) {  // the one exception: then the widened nucleus
                ASSERT_TRUE(t >= 0 && t < V) << what << ": token " << t;
                EXPECT_TRUE(n.z[static_cast<size_t>(t)] >= n.next)
                    << what << ": token " << t << " (z " << n.z[static_cast<size_t>(t)]
                    << ") outside the widened nucleus z >= " << n.next << " (margin " << n.margin << ")";
                ++near;
              } else {
                ADD_FAILURE() << what << ": token " << t << ", the reference's " << want[static_cast<size_t>(r)]
                              << " (margin " << n.margin << ", z_c " << n.zc << ")";
              }
            }
          }
        }
  std::printf("sample_rows: %d cases, %d rows (x2 CTA layouts) checked against ops::sample_rows; %d tokens differed, "
              "all on rows within 1e-5 of top_p and inside the widened nucleus\n", cases, rows, near);
}

// A row's draw depends only on its logits, the parameters, its stream and its position: the same
// in a batch of 1 as in a batch of 70 (and as the reference).
TEST(CudaSampling, SampleRowsIsBatchInvariant) {
  DFLASH_REQUIRE_GPU();
  void* stream = DeviceContext::get(0).stream();
  for (float top_p : {1.0f, 0.9f, 0.5f}) {
    const SampleCase c{70, 248320, 248320, {1.0f, top_p, 5}, 42};
    const Tensor host = sampling_logits(c.R, c.V, c.ld, c.seed);
    const DeviceInputs d = upload(host, c);
    const std::vector<int32_t> batch = run_gpu(d, c, 0, 70, stream);
    for (int r = 0; r < 70; ++r)
      EXPECT_EQ(run_gpu(d, c, r, 1, stream)[0], batch[static_cast<size_t>(r)]) << "top_p " << top_p << " row " << r;
  }
}

TEST(CudaSampling, SampleRowsRefusesBadParameters) {
  DFLASH_REQUIRE_GPU();
  void* stream = DeviceContext::get(0).stream();
  Tensor x = Tensor::zeros({2, 8}, DType::F32, Device::cuda(0));
  Tensor st = Tensor::zeros({2}, DType::I64, Device::cuda(0)), pos = Tensor::zeros({2}, DType::I64, Device::cuda(0));
  Tensor out = Tensor::empty({2}, DType::I32, Device::cuda(0));
  auto call = [&](int64_t ld, int64_t V, float T, float top_p) {
    return error_of([&] {
      cuda::sample_rows(x.data<float>(), ld, 2, V, T, top_p, 0, reinterpret_cast<const uint64_t*>(st.data<int64_t>()),
                        pos.data<int64_t>(), out.data<int32_t>(), stream);
    });
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(call(4, 8, 1, 1).find("row stride ld=4 is smaller than V=8"), std::string::npos);
  EXPECT_NE(call(8, 0, 1, 1).find("1 <= V"), std::string::npos);
  for (float T : {0.0f, -1.0f, nan}) EXPECT_NE(call(8, 8, T, 1).find("temperature"), std::string::npos) << T;
  for (float p : {0.0f, 1.5f, nan}) EXPECT_NE(call(8, 8, 1, p).find("top_p"), std::string::npos) << p;
  EXPECT_EQ(call(8, 8, 1, 1), "");
  EXPECT_NO_THROW(cuda::sample_rows(nullptr, 8, 0, 8, 1, 1, 0, nullptr, nullptr, nullptr, stream)) << "R = 0 is a no-op";
}
