// Tensor: shapes, views, strided copies, dtype conversion, and the CPU-only-build device API.
#include <gtest/gtest.h>

#include <cmath>

#include "core/device.h"
#include "core/random.h"
#include "core/tensor.h"
#include "test_util.h"

using namespace dflash;

TEST(Tensor, EmptyShapesAndAlignment) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::BF16);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % 64, 0u);
  EXPECT_EQ(t.describe(), "bf16[2, 3, 4] cpu");
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_THROW(t.size(3), Error);
  EXPECT_THROW(Tensor::empty({2, -1}, DType::F32), Error);
  Tensor s = Tensor::empty({}, DType::F32);
  EXPECT_EQ(s.numel(), 1);
  Tensor z = Tensor::zeros({0, 5}, DType::F32);
  EXPECT_EQ(z.numel(), 0);
}

TEST(Tensor, ViewSliceSelect) {
  std::vector<float> v(24);
  for (int i = 0; i < 24; ++i) v[i] = static_cast<float>(i);
  Tensor t = Tensor::from_vector(v, {4, 6});
  Tensor r = t.view({2, -1, 3});
  EXPECT_EQ(r.shape(), (Shape{2, 4, 3}));
  EXPECT_THROW(t.view({5, -1}), Error);
  EXPECT_THROW(t.view({-1, -1}), Error);
  Tensor cols = t.slice(1, 2, 5);  // [4, 3], strided
  EXPECT_FALSE(cols.is_contiguous());
  EXPECT_THROW(cols.view({12}), Error);
  Tensor c = cols.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j) EXPECT_EQ(c.data<float>()[i * 3 + j], static_cast<float>(i * 6 + 2 + j));
  Tensor row = t.select(2);
  EXPECT_EQ(row.shape(), (Shape{6}));
  EXPECT_EQ(row.item_at(0), 12.0);
  EXPECT_THROW(t.select(4), Error);
  EXPECT_THROW(t.slice(0, 3, 5), Error);
  // Strided destination.
  Tensor dst = Tensor::zeros({4, 6}, DType::F32);
  Tensor window = dst.slice(1, 2, 5);
  window.copy_from(cols);
  EXPECT_EQ(dst.item_at(2), 2.0);
  EXPECT_EQ(dst.item_at(0), 0.0);
  EXPECT_EQ(dst.item_at(23), 0.0);
  EXPECT_EQ(dst.item_at(22), 22.0);
}

TEST(Tensor, DtypeConversionsRoundTrip) {
  Tensor f = Tensor::from_vector({1.0f, -2.5f, 3.14159f, 1e-3f, 65504.0f, -0.0f}, {6});
  for (DType t : {DType::BF16, DType::F16, DType::F64}) {
    Tensor back = f.to_dtype(t).to_dtype(DType::F32);
    const double tol = t == DType::BF16 ? 1.0 / 256 : t == DType::F16 ? 1.0 / 2048 : 0.0;
    for (int i = 0; i < 6; ++i)
      EXPECT_LE(std::abs(back.data<float>()[i] - f.data<float>()[i]), tol * std::abs(f.data<float>()[i]) + 1e-12)
          << dtype_name(t) << " " << i;
  }
  Tensor ints = Tensor::from_vector({0, 7, 255}, {3}).to_dtype(DType::I64).to_dtype(DType::I32);
  EXPECT_EQ(ints.data<int32_t>()[1], 7);
  EXPECT_EQ(dtype_from_name("bf16"), DType::BF16);
  EXPECT_FALSE(dtype_from_name("bf17").has_value());
}

TEST(Tensor, FillAndClone) {
  Tensor t = Tensor::empty({3, 2}, DType::BF16);
  t.fill(1.5);
  Tensor c = t.clone();
  t.fill(0);
  EXPECT_EQ(c.item_at(5), 1.5);
  EXPECT_EQ(t.item_at(5), 0.0);
  EXPECT_THROW(c.copy_from(Tensor::empty({3, 2}, DType::F32)), Error);
  EXPECT_THROW(c.copy_from(Tensor::empty({2, 3}, DType::BF16)), Error);
}

TEST(Tensor, DeviceParsing) {
  EXPECT_EQ(Device::parse("cpu"), Device::cpu());
  EXPECT_EQ(Device::parse("cuda:3"), Device::cuda(3));
  EXPECT_EQ(Device::parse("cuda"), Device::cuda(0));
  EXPECT_THROW(Device::parse("tpu"), Error);
  EXPECT_THROW(Device::parse("cuda:x"), Error);
}

TEST(Tensor, RandomFillIsAFunctionOfSeedStreamAndIndex) {
  Tensor a = Tensor::empty({1000}, DType::F32), b = Tensor::empty({1000}, DType::F32);
  fill_normal(a, {42, 7, 0}, 0.0f, 1.0f);
  fill_normal(b, {42, 7, 0}, 0.0f, 1.0f);
  EXPECT_EQ(max_rel_err(a, b), 0.0);
  // A shard drawn on its own equals the same rows of the whole tensor.
  Tensor shard = Tensor::empty({300}, DType::F32);
  fill_normal(shard, {42, 7, 500}, 0.0f, 1.0f);
  EXPECT_EQ(max_rel_err(shard, a.slice(0, 500, 800)), 0.0);
  double mean = 0, var = 0;
  for (int i = 0; i < 1000; ++i) mean += a.data<float>()[i] / 1000.0;
  for (int i = 0; i < 1000; ++i) var += std::pow(a.data<float>()[i] - mean, 2) / 1000.0;
  EXPECT_NEAR(mean, 0.0, 0.1);
  EXPECT_NEAR(var, 1.0, 0.15);
  Tensor u = Tensor::empty({1000}, DType::BF16);
  fill_uniform(u, {42, 8, 0}, -1.0f, 1.0f);
  for (int i = 0; i < 1000; ++i) {
    EXPECT_GE(u.item_at(i), -1.0);
    EXPECT_LE(u.item_at(i), 1.0);
  }
  Tensor ints = Tensor::empty({4}, DType::I32);
  EXPECT_THROW(fill_uniform(ints, {}, 0, 1), Error);
}
