// The sampling ops on the GPU (kernels/cuda/sampling.cu) against the CPU reference (ops::argmax_rows):
// random NaN-free rows of fp32 and bf16 logits with planted ties (two or three equal maxima far
// apart, at the row's ends, rows of equal values), vocabularies from 1 to Qwen's 248320, rows
// 16-byte aligned or not, and padding past V that would win if it were read.
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "kernels/cuda/launch.h"
#include "kernels/device.h"
#include "kernels/ops.h"
#include "kernels/random.h"
#include "test_util.h"

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
