// Device layer: device queries, the caching allocator, copies, the device context and GPU random
// fills against the CPU path. GPU tests skip where no device is visible; the first tests are safe
// (and meaningful) on any machine, with or without the CUDA backend.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/device.h"
#include "core/random.h"
#include "core/tensor.h"
#include "tests/test_util.h"

namespace dflash {
namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Host tensor of `n` elements of `dtype` with random bytes (also NaN/inf patterns: copies must not care).
Tensor random_bytes(int64_t n, DType dtype, uint32_t seed) {
  Tensor t = Tensor::empty({n}, dtype);
  std::mt19937 gen(seed);
  auto* p = static_cast<unsigned char*>(t.raw_data());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(gen());
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  Tensor ha = a.device().is_cpu() ? a : a.to(Device::cpu());
  Tensor hb = b.device().is_cpu() ? b : b.to(Device::cpu());
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.raw_data(), hb.raw_data(), ha.nbytes()) == 0;
}

// ---------------------------------------------------------------------------------------------
// Safe without a GPU

TEST(DeviceNoGpu, DeviceCountNeverThrows) {
  int n = -1;
  EXPECT_NO_THROW(n = cuda_device_count());
  EXPECT_GE(n, 0);
  EXPECT_EQ(cuda_device_count(), n);  // and again: nothing cached in a broken state
  if (!cuda_built()) {
    EXPECT_EQ(n, 0);
  }
}

TEST(DeviceNoGpu, DeviceTensorWithoutDeviceIsAClearError) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is visible";
  try {
    Tensor t = Tensor::empty({16}, DType::F32, Device::cuda(0));
    FAIL() << "allocating on cuda:0 without a device must throw";
  } catch (const Error& e) {
    if (cuda_built()) {
      EXPECT_TRUE(has(e.message(), "cuda:0 does not exist")) << e.what();
      EXPECT_TRUE(has(e.hint(), "CUDA_VISIBLE_DEVICES")) << e.what();
    } else {
      EXPECT_TRUE(has(e.message(), "this build of dflash has no CUDA backend")) << e.what();
      EXPECT_TRUE(has(e.hint(), "-DDFLASH_CUDA=ON")) << e.what();
    }
  }
  EXPECT_THROW(cuda_device_info(0), Error);
  EXPECT_THROW(DeviceContext::get(0), Error);
  EXPECT_EQ(cuda_device_count(), 0);
}

TEST(DeviceNoGpu, HostCopiesAlwaysWork) {
  Tensor a = random_bytes(1003, DType::U8, 1);
  Tensor b = Tensor::empty({1003}, DType::U8);
  memcpy_any(b.raw_data(), Device::cpu(), a.raw_data(), Device::cpu(), a.nbytes());
  EXPECT_TRUE(same_bytes(a, b));
  EXPECT_NO_THROW(memcpy_any(nullptr, Device::cpu(), nullptr, Device::cpu(), 0));
}

TEST(DeviceNoGpu, TestUtilHelpersOnHost) {
  Tensor ref = Tensor::from_vector({1, -2, 4, 0}, {4});
  Tensor got = Tensor::from_vector({1, -2, 3, 0}, {4});
  EXPECT_DOUBLE_EQ(max_rel_err(got, ref), 0.25);
  EXPECT_DOUBLE_EQ(max_rel_err(ref.to_dtype(DType::BF16), ref), 0.0);
  poison(got);
  for (int64_t i = 0; i < got.numel(); ++i) EXPECT_TRUE(std::isnan(got.item_at(i)));
  EXPECT_TRUE(std::isinf(max_rel_err(got, ref)));
  Tensor h = Tensor::zeros({3}, DType::BF16);
  poison(h);
  EXPECT_TRUE(std::isnan(h.item_at(2)));
}

// ---------------------------------------------------------------------------------------------
// GPU

TEST(Device, InfoIsSane) {
  DFLASH_REQUIRE_GPU();
  DeviceInfo info = cuda_device_info(0);
  EXPECT_FALSE(info.name.empty());
  EXPECT_GE(info.major, 5);
  EXPECT_GE(info.minor, 0);
  EXPECT_GT(info.sm_count, 0);
  EXPECT_GT(info.total_memory, size_t(1) << 30);
  EXPECT_GT(info.driver_version, 0);
  EXPECT_GT(info.runtime_version, 0);
  EXPECT_THROW(cuda_device_info(cuda_device_count()), Error);
  EXPECT_THROW(cuda_device_info(-1), Error);
}

TEST(Device, ContextHasStreamHandleAndWorkspace) {
  DFLASH_REQUIRE_GPU();
  DeviceContext& ctx = DeviceContext::get(0);
  EXPECT_EQ(&ctx, &DeviceContext::get(0));
  EXPECT_EQ(ctx.device(), 0);
  EXPECT_NE(ctx.stream(), nullptr);
  EXPECT_NE(ctx.cublaslt(), nullptr);
  EXPECT_NE(ctx.workspace(), nullptr);
  EXPECT_EQ(ctx.workspace_bytes(), size_t(32) << 20);
  EXPECT_NO_THROW(ctx.synchronize());
  EXPECT_THROW(DeviceContext::get(cuda_device_count()), Error);
}

TEST(Allocator, ReusesFreedBlocksAndCountsBytes) {
  DFLASH_REQUIRE_GPU();
  const int dev = 0;
  DeviceContext::get(dev);  // its workspace is allocated first, outside the deltas below
  device_alloc::empty_cache(dev);
  const AllocatorStats s0 = device_alloc::stats(dev);
  EXPECT_EQ(s0.reserved, s0.allocated);  // nothing cached after empty_cache

  // Small blocks round to 512 B.
  void* p = device_alloc::allocate(1000, dev);
  AllocatorStats s1 = device_alloc::stats(dev);
  EXPECT_EQ(s1.allocated, s0.allocated + 1024);
  EXPECT_EQ(s1.reserved, s0.reserved + 1024);
  EXPECT_EQ(s1.cuda_mallocs, s0.cuda_mallocs + 1);
  EXPECT_GE(s1.peak_allocated, s1.allocated);

  device_alloc::release(p, dev);
  AllocatorStats s2 = device_alloc::stats(dev);
  EXPECT_EQ(s2.allocated, s0.allocated);
  EXPECT_EQ(s2.reserved, s1.reserved);  // kept in the cache

  void* q = device_alloc::allocate(1000, dev);  // same size: served from the cache
  AllocatorStats s3 = device_alloc::stats(dev);
  EXPECT_EQ(q, p);
  EXPECT_EQ(s3.cuda_mallocs, s1.cuda_mallocs);
  EXPECT_EQ(s3.cache_hits, s1.cache_hits + 1);
  EXPECT_EQ(s3.allocated, s1.allocated);

  // Large blocks round to 2 MiB; peak tracks the high-water mark until reset.
  device_alloc::reset_peak(dev);
  void* big1 = device_alloc::allocate((size_t(3) << 20) + 1, dev);
  void* big2 = device_alloc::allocate(size_t(1) << 20, dev);
  AllocatorStats s4 = device_alloc::stats(dev);
  EXPECT_EQ(s4.allocated, s3.allocated + (size_t(4) << 20) + (size_t(2) << 20));
  EXPECT_EQ(s4.peak_allocated, s4.allocated);
  device_alloc::release(big1, dev);
  AllocatorStats s5 = device_alloc::stats(dev);
  EXPECT_EQ(s5.allocated, s4.allocated - (size_t(4) << 20));
  EXPECT_EQ(s5.peak_allocated, s4.peak_allocated);
  device_alloc::reset_peak(dev);
  EXPECT_EQ(device_alloc::stats(dev).peak_allocated, s5.allocated);

  // A tensor's storage goes through the same cache.
  {
    Tensor t = Tensor::empty({1000}, DType::F32, Device::cuda(dev));  // 4000 B -> 4096 B block
    EXPECT_EQ(device_alloc::stats(dev).allocated, s5.allocated + 4096);
  }
  EXPECT_EQ(device_alloc::stats(dev).allocated, s5.allocated);

  device_alloc::release(big2, dev);
  device_alloc::release(q, dev);
  EXPECT_EQ(device_alloc::stats(dev).allocated, s0.allocated);
  EXPECT_GT(device_alloc::stats(dev).reserved, s0.reserved);
  device_alloc::empty_cache(dev);
  AllocatorStats s6 = device_alloc::stats(dev);
  EXPECT_EQ(s6.reserved, s0.reserved);
  EXPECT_EQ(s6.reserved, s6.allocated);
}

TEST(Allocator, OutOfMemoryIsAClearErrorAndRecoverable) {
  DFLASH_REQUIRE_GPU();
  const size_t huge = size_t(1) << 50;  // 1 PiB
  try {
    device_alloc::allocate(huge, 0);
    FAIL() << "a 1 PiB allocation must fail";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.message(), "out of memory on cuda:0")) << e.what();
    EXPECT_TRUE(has(e.message(), std::to_string(huge))) << e.what();
    EXPECT_TRUE(has(e.hint(), "reduce the batch size")) << e.what();
  }
  // The failure left no error behind: the next allocation and kernel work.
  Tensor t = Tensor::empty({1024}, DType::F32, Device::cuda(0));
  fill_uniform(t, {1, 2, 0}, 0.0f, 1.0f);
  EXPECT_NO_THROW(DeviceContext::get(0).synchronize());
  EXPECT_THROW(device_alloc::allocate(16, cuda_device_count()), Error);
}

TEST(Copy, HostDeviceRoundTrip) {
  DFLASH_REQUIRE_GPU();
  uint32_t seed = 10;
  // Byte sizes 1, 3 and 1000003 (u8), and the same element counts of wider dtypes.
  for (DType dt : {DType::U8, DType::BF16, DType::F32, DType::F64, DType::I64}) {
    for (int64_t n : {int64_t(1), int64_t(3), int64_t(1000003)}) {
      Tensor host = random_bytes(n, dt, ++seed);
      Tensor dev = host.to(Device::cuda(0));
      EXPECT_TRUE(dev.device().is_cuda());
      Tensor back = dev.to(Device::cpu());
      EXPECT_TRUE(same_bytes(host, back)) << dtype_name(dt) << " n=" << n;
    }
  }
}

TEST(Copy, DeviceToDevice) {
  DFLASH_REQUIRE_GPU();
  Tensor host = random_bytes(1000003, DType::U8, 99);
  Tensor a = host.to(Device::cuda(0));
  Tensor b = a.clone();  // device -> device
  EXPECT_NE(a.raw_data(), b.raw_data());
  EXPECT_TRUE(same_bytes(host, b));

  // Unaligned sub-ranges: bytes [7, 7 + 12345) of a into bytes [1, ...) of c.
  Tensor c = Tensor::zeros({20000}, DType::U8, Device::cuda(0));
  memcpy_any(static_cast<char*>(c.raw_data()) + 1, c.device(), static_cast<const char*>(a.raw_data()) + 7, a.device(),
             12345);
  Tensor hc = c.to(Device::cpu());
  const auto* pc = static_cast<const unsigned char*>(hc.raw_data());
  const auto* ph = static_cast<const unsigned char*>(host.raw_data());
  EXPECT_EQ(pc[0], 0);
  EXPECT_EQ(std::memcmp(pc + 1, ph + 7, 12345), 0);
  EXPECT_EQ(pc[12346], 0);

  if (cuda_device_count() >= 2) {
    Tensor d = Tensor::empty({1000003}, DType::U8, Device::cuda(1));
    d.copy_from(a);
    EXPECT_TRUE(same_bytes(host, d));
  }
}

TEST(Poison, WorksOnDeviceTensors) {
  DFLASH_REQUIRE_GPU();
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor t = Tensor::zeros({257}, dt, Device::cuda(0));
    poison(t);
    Tensor h = t.to(Device::cpu());
    for (int64_t i = 0; i < h.numel(); ++i) ASSERT_TRUE(std::isnan(h.item_at(i))) << dtype_name(dt) << " " << i;
    EXPECT_TRUE(std::isinf(max_rel_err(t, Tensor::zeros({257}, dt))));
  }
}

TEST(Fill, DeviceZeroAndValueOverPoison) {
  DFLASH_REQUIRE_GPU();
  // Zero is a device memset (no host staging); other values go through the host. Both must cover
  // every byte of a poisoned tensor, for every float dtype and an odd size.
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
    for (double value : {0.0, -0.0, 1.5}) {
      Tensor t = Tensor::empty({1000003}, dt, Device::cuda(0));
      poison(t);
      t.fill(value);
      Tensor h = t.to(Device::cpu());
      for (int64_t i = 0; i < h.numel(); ++i) {
        ASSERT_EQ(h.item_at(i), value) << dtype_name(dt) << " value " << value << " element " << i;
        ASSERT_EQ(std::signbit(h.item_at(i)), std::signbit(value)) << dtype_name(dt) << " element " << i;
      }
    }
  }
  Tensor z = Tensor::zeros({4099}, DType::I32, Device::cuda(0)).to(Device::cpu());
  for (int64_t i = 0; i < z.numel(); ++i) ASSERT_EQ(z.data<int32_t>()[i], 0) << i;
}

// ---------------------------------------------------------------------------------------------
// Random fills: the GPU draws the CPU's values

// |got - ref| within `rel` of max(|ref|, 1) for every element; returns the number of elements that
// differ at all (normal fills may differ in the last bit where device and host libm differ).
int64_t expect_close(const Tensor& got, const Tensor& ref, double rel, const char* what) {
  std::vector<double> g = to_doubles(got), r = to_doubles(ref);
  EXPECT_EQ(g.size(), r.size());
  int64_t differ = 0;
  for (size_t i = 0; i < g.size() && i < r.size(); ++i) {
    if (g[i] != r[i]) ++differ;
    EXPECT_LE(std::abs(g[i] - r[i]), rel * std::max(std::abs(r[i]), 1.0)) << what << " element " << i;
    if (testing::Test::HasFailure()) break;
  }
  return differ;
}

TEST(RandomFill, GpuMatchesCpu) {
  DFLASH_REQUIRE_GPU();
  const int64_t n = 100003;  // not a multiple of 4 (RNG block) or of the launch block
  const RandomParams p{1234, 77, 0};
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
    Tensor cpu_u = Tensor::empty({n}, dt);
    fill_uniform(cpu_u, p, -2.0f, 3.0f);
    Tensor gpu_u = Tensor::empty({n}, dt, Device::cuda(0));
    poison(gpu_u);
    fill_uniform(gpu_u, p, -2.0f, 3.0f);
    EXPECT_TRUE(same_bytes(cpu_u, gpu_u)) << "uniform " << dtype_name(dt);

    Tensor cpu_n = Tensor::empty({n}, dt);
    fill_normal(cpu_n, p, 0.5f, 2.0f);
    Tensor gpu_n = Tensor::empty({n}, dt, Device::cuda(0));
    poison(gpu_n);
    fill_normal(gpu_n, p, 0.5f, 2.0f);
    // One ulp of the stored type (relative): f32 2^-23, bf16 2^-8, f16 2^-11; doubled for slack.
    const double rel = dt == DType::BF16 ? 0x1p-7 : dt == DType::F16 ? 0x1p-10 : 0x1p-22;
    int64_t differ = expect_close(gpu_n, cpu_n, rel, dtype_name(dt));
    EXPECT_LE(differ, n / 100) << "normal " << dtype_name(dt) << ": too many elements differ";
  }
}

TEST(RandomFill, ShardEqualsSliceOfFullFill) {
  DFLASH_REQUIRE_GPU();
  const int64_t rows = 37, cols = 129;  // row offsets not multiples of 4
  const RandomParams full_p{42, 5, 0};
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor full_u = Tensor::empty({rows, cols}, dt), full_n = Tensor::empty({rows, cols}, dt);
    fill_uniform(full_u, full_p, -1.0f, 1.0f);
    fill_normal(full_n, full_p, 0.0f, 0.02f);
    const int64_t r0 = 11, r1 = 30;
    RandomParams shard_p = full_p;
    shard_p.index_offset = r0 * cols;
    Tensor shard_u = Tensor::empty({r1 - r0, cols}, dt, Device::cuda(0));
    Tensor shard_n = Tensor::empty({r1 - r0, cols}, dt, Device::cuda(0));
    fill_uniform(shard_u, shard_p, -1.0f, 1.0f);
    fill_normal(shard_n, shard_p, 0.0f, 0.02f);
    Tensor want_u = full_u.slice(0, r0, r1).contiguous(), want_n = full_n.slice(0, r0, r1).contiguous();
    EXPECT_TRUE(same_bytes(want_u, shard_u)) << dtype_name(dt);
    const double rel = dt == DType::BF16 ? 0x1p-7 : 0x1p-22;
    expect_close(shard_n, want_n, rel, dtype_name(dt));
  }
}

TEST(RandomFill, RejectsWhatTheCpuPathRejects) {
  DFLASH_REQUIRE_GPU();
  Tensor ints = Tensor::empty({8}, DType::I32, Device::cuda(0));
  EXPECT_THROW(fill_uniform(ints, {}, 0.0f, 1.0f), Error);
  EXPECT_THROW(cuda::fill_normal(ints, {}, 0.0f, 1.0f), Error);
  Tensor host = Tensor::empty({8}, DType::F32);
  EXPECT_THROW(cuda::fill_uniform(host, {}, 0.0f, 1.0f), Error);
  Tensor empty = Tensor::empty({0}, DType::F32, Device::cuda(0));
  EXPECT_NO_THROW(fill_normal(empty, {}, 0.0f, 1.0f));
}

}  // namespace
}  // namespace dflash
