// The FP8 reference (core/fp8.h, kernels/ops.h "fp8") and the FP8 quantization_config of
// target configs (issue 18, first step):
// - e4m3 decoding and encoding: every code round-trips; encoding is the nearest code (ties to the
//   even mantissa) by brute force over all finite codes, saturating at +-448, NaN to NaN;
// - block / group quantization: scale = amax / 448 per 128 x 128 block (weights) or per token and
//   128 columns (activations), the block's largest element lands on +-448, every element within half
//   a code step of its value, zero blocks stay zero;
// - the block-scaled GEMM equals the product of the dequantized operands (double) within 1e-5;
// - the official -FP8 checkpoints' quantization_config is read; every other scheme is refused
//   naming the field and the value; loading such a checkpoint says it is not implemented yet.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>

#include "core/fp8.h"
#include "kernels/ops.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/train_ops.h"
#include "target_model/config.h"
#include "target_model/weights.h"
#include "test_util.h"

using namespace dflash;

namespace {

// The nearest finite e4m3 code to x by exhaustive search (ties: the even code, i.e. even mantissa).
uint8_t nearest_code(float x) {
  if (std::isnan(x)) return fp8::kE4m3NaN;
  int best = -1;
  double best_d = 0;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN
    if (c == 0x80) continue;           // -0: ties with +0 resolved by the sign below
    const double d = std::abs(static_cast<double>(fp8::e4m3_to_float(static_cast<uint8_t>(c))) - x);
    if (best < 0 || d < best_d || (d == best_d && (c & 1) == 0 && (best & 1) == 1)) best = c, best_d = d;
  }
  if (best == 0 && std::signbit(x)) best = 0x80;  // -0 and tiny negatives keep their sign
  return static_cast<uint8_t>(best);
}

Tensor randn(int64_t r, int64_t c, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> n(0.0f, scale);
  Tensor t = Tensor::empty({r, c}, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = n(g);
  return t;
}

}  // namespace

TEST(Fp8E4m3, EveryCodeRoundTripsAndTheRangeIsTheFnVariant) {
  for (int c = 0; c < 256; ++c) {
    const float v = fp8::e4m3_to_float(static_cast<uint8_t>(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(fp8::e4m3_from_float(v), c) << "code " << c << " value " << v;
  }
  EXPECT_EQ(fp8::e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(fp8::e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8::e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(fp8::e4m3_from_float(1e6f), 0x7E);  // saturates
  EXPECT_EQ(fp8::e4m3_from_float(-1e6f), 0xFE);
  EXPECT_EQ(fp8::e4m3_from_float(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(fp8::e4m3_from_float(NAN), fp8::kE4m3NaN);
}

TEST(Fp8E4m3, EncodingIsTheNearestCodeTiesToEven) {
  // Every midpoint between neighbouring codes, just below and above it, and random values over the range.
  std::vector<float> xs;
  for (int c = 0; c < 0x7E; ++c) {
    const float a = fp8::e4m3_to_float(static_cast<uint8_t>(c)), b = fp8::e4m3_to_float(static_cast<uint8_t>(c + 1));
    const float mid = 0.5f * (a + b);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), a, b}) xs.insert(xs.end(), {x, -x});
  }
  std::mt19937_64 g(1);
  std::uniform_real_distribution<float> e(-14.0f, 10.0f);
  for (int i = 0; i < 20000; ++i) xs.push_back((i & 1 ? -1.0f : 1.0f) * std::exp2(e(g)));
  for (float x : {460.0f, 464.0f, 470.0f, 1e-12f, -1e-12f, 0.0f, -0.0f}) xs.push_back(x);
  int64_t bad = 0;
  for (float x : xs) {
    const uint8_t got = fp8::e4m3_from_float(x), want = nearest_code(x);
    if (got != want && ++bad <= 10) ADD_FAILURE() << "x = " << x << ": code " << int(got) << ", nearest " << int(want);
  }
  EXPECT_EQ(bad, 0) << "of " << xs.size() << " values";
}

TEST(Fp8Quantize, WeightBlocksAndActivationGroupsStayWithinHalfACodeStep) {
  const Tensor w = randn(200, 300, 3, 0.05f);  // 2 x 3 blocks, the last ones partial
  Tensor wz = w.clone();
  for (int64_t r = 128; r < 200; ++r)
    for (int64_t c = 256; c < 300; ++c) wz.data<float>()[r * 300 + c] = 0;  // an all-zero block
  const ops::Fp8Weight q = ops::quantize_fp8_weight(wz);
  ASSERT_EQ(q.q.shape(), (Shape{200, 300}));
  ASSERT_EQ(q.scale_inv.shape(), (Shape{2, 3}));
  const Tensor d = ops::dequantize_fp8(q);
  for (int64_t bn = 0; bn < 2; ++bn)
    for (int64_t bk = 0; bk < 3; ++bk) {
      float amax = 0;
      for (int64_t r = bn * 128; r < std::min<int64_t>(200, bn * 128 + 128); ++r)
        for (int64_t c = bk * 128; c < std::min<int64_t>(300, bk * 128 + 128); ++c)
          amax = std::max(amax, std::abs(wz.data<float>()[r * 300 + c]));
      const float s = q.scale_inv.data<float>()[bn * 3 + bk];
      EXPECT_FLOAT_EQ(s, std::max(amax, fp8::kAmaxFloor) / 448.0f) << bn << "," << bk;
    }
  int64_t at_max = 0;
  for (int64_t r = 0; r < 200; ++r)
    for (int64_t c = 0; c < 300; ++c) {
      const float x = wz.data<float>()[r * 300 + c], y = d.data<float>()[r * 300 + c];
      const float s = q.scale_inv.data<float>()[(r / 128) * 3 + c / 128];
      // Half a code step: 2^-4 of the value in the normal range, 2^-10 * s among the subnormals.
      EXPECT_LE(std::abs(y - x), std::max(std::abs(x) * 0.0625f, std::ldexp(s, -10)) * 1.0001f) << r << "," << c;
      at_max += (q.q.data<uint8_t>()[r * 300 + c] & 0x7F) == 0x7E;
      if (r >= 128 && c >= 256) {
        EXPECT_EQ(q.q.data<uint8_t>()[r * 300 + c], 0);
      }
    }
  EXPECT_GE(at_max, 5);  // each non-zero block's largest element is +-448
  const Tensor x = randn(5, 300, 4, 3.0f);
  const ops::Fp8Act a = ops::quantize_fp8_act(x);
  ASSERT_EQ(a.scale.shape(), (Shape{5, 3}));
  const Tensor xd = ops::dequantize_fp8(a);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float s = a.scale.data<float>()[(i / 300) * 3 + (i % 300) / 128];
    EXPECT_LE(std::abs(xd.data<float>()[i] - x.data<float>()[i]),
              std::max(std::abs(x.data<float>()[i]) * 0.0625f, std::ldexp(s, -10)) * 1.0001f);
  }
}

// cpu::fake_quantize_e4m3 (the FP8 drafter's simulated operands, drafter/ref_math.h linear_fp8): 1 x 128
// tiles equal the activation quantizer's dequantized values bit for bit; 128 x 1 tiles equal it on the
// transpose; 128 x 128 tiles stay within half a code step of the input with scale amax / 448 per tile
// and equal the weight quantizer (which divides by the scale instead of multiplying by its inverse)
// except where the two roundings differ by one code (counted: rare); NaN stays NaN; threads agree.
TEST(Fp8Quantize, FakeQuantizeTilesEqualTheQuantizers) {
  const Tensor x = randn(70, 300, 9, 2.0f);
  Tensor rows = x.clone();
  cpu::fake_quantize_e4m3(rows.data<float>(), 70, 300, 1, 128);
  const Tensor want_rows = ops::dequantize_fp8(ops::quantize_fp8_act(x));
  EXPECT_EQ(std::memcmp(rows.raw_data(), want_rows.raw_data(), rows.nbytes()), 0);
  // 128 x 1 on x equals 1 x 128 on xᵀ.
  auto transposed = [](const Tensor& m) {
    Tensor t = Tensor::empty({m.size(1), m.size(0)}, DType::F32);
    for (int64_t r = 0; r < m.size(0); ++r)
      for (int64_t c = 0; c < m.size(1); ++c) t.data<float>()[c * m.size(0) + r] = m.data<float>()[r * m.size(1) + c];
    return t;
  };
  const Tensor xt = transposed(x);
  Tensor cols = x.clone();
  cpu::fake_quantize_e4m3(cols.data<float>(), 70, 300, 128, 1);
  const Tensor want_cols = transposed(ops::dequantize_fp8(ops::quantize_fp8_act(xt)));
  EXPECT_EQ(std::memcmp(cols.raw_data(), want_cols.raw_data(), cols.nbytes()), 0);
  // 128 x 128 blocks (2 x 3, the last ones partial) against the weight quantizer.
  const Tensor w = randn(200, 300, 3, 0.05f);
  Tensor blk = w.clone();
  const int saved = cpu::cpu_threads();
  cpu::set_cpu_threads(3);
  cpu::fake_quantize_e4m3(blk.data<float>(), 200, 300, 128, 128);
  cpu::set_cpu_threads(1);
  Tensor blk1 = w.clone();
  cpu::fake_quantize_e4m3(blk1.data<float>(), 200, 300, 128, 128);
  cpu::set_cpu_threads(saved);
  EXPECT_EQ(std::memcmp(blk.raw_data(), blk1.raw_data(), blk.nbytes()), 0);
  const ops::Fp8Weight q = ops::quantize_fp8_weight(w);
  const Tensor wd = ops::dequantize_fp8(q);
  int64_t differ = 0;
  for (int64_t i = 0; i < w.numel(); ++i) {
    const float s = q.scale_inv.data<float>()[(i / 300 / 128) * 3 + (i % 300) / 128];
    const float a = blk.data<float>()[i], x0 = w.data<float>()[i];
    EXPECT_LE(std::abs(a - x0), std::max(std::abs(x0) * 0.0625f, std::ldexp(s, -10)) * 1.0001f) << i;
    if (a != wd.data<float>()[i]) {
      ++differ;
      EXPECT_LE(std::abs(a - wd.data<float>()[i]), std::max(std::abs(x0) * 0.125f, std::ldexp(s, -9)) * 1.0001f) << i;
    }
  }
  std::printf("fake_quantize_e4m3 128 x 128 vs quantize_fp8_weight: %lld of %lld values one code apart\n",
              static_cast<long long>(differ), static_cast<long long>(w.numel()));
  EXPECT_LE(differ, w.numel() / 1000);
  Tensor nan = x.clone();
  nan.data<float>()[5] = std::nanf("");
  cpu::fake_quantize_e4m3(nan.data<float>(), 70, 300, 1, 128);
  EXPECT_TRUE(std::isnan(nan.data<float>()[5]));
  EXPECT_EQ(nan.data<float>()[200], rows.data<float>()[200]);  // another row's group is untouched by it
}

TEST(Fp8Gemm, BlockScaledGemmEqualsTheDequantizedProduct) {
  for (auto [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {7, 130, 257}, {33, 256, 384}}) {
    const ops::Fp8Act a = ops::quantize_fp8_act(randn(M, K, 10 + M, 2.0f));
    const ops::Fp8Weight w = ops::quantize_fp8_weight(randn(N, K, 20 + N, 0.02f));
    Tensor out = Tensor::empty({M, N}, DType::F32);
    std::fill_n(out.data<float>(), out.numel(), NAN);  // poisoned
    ops::gemm_fp8_blockwise(a, w, out);
    const Tensor ad = ops::dequantize_fp8(a), wd = ops::dequantize_fp8(w);
    double err = 0, ref_max = 0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double ref = 0;
        for (int64_t k = 0; k < K; ++k)
          ref += static_cast<double>(ad.data<float>()[m * K + k]) * static_cast<double>(wd.data<float>()[n * K + k]);
        const float got = out.data<float>()[m * N + n];
        ASSERT_FALSE(std::isnan(got)) << m << "," << n;
        err = std::max(err, std::abs(got - ref));
        ref_max = std::max(ref_max, std::abs(ref));
      }
    EXPECT_LE(err, 1e-5 * ref_max) << M << "x" << N << "x" << K;
  }
  const ops::Fp8Act a = ops::quantize_fp8_act(randn(2, 128, 1));
  const ops::Fp8Weight w = ops::quantize_fp8_weight(randn(3, 256, 2));
  Tensor out = Tensor::empty({2, 3}, DType::F32);
  EXPECT_NE(error_of([&] { ops::gemm_fp8_blockwise(a, w, out); }).find("activation K = 128, weight K = 256"), std::string::npos);
}

// ---- quantization_config ----

namespace {

nlohmann::json tiny_config(const nlohmann::json& quant) {
  nlohmann::json j = nlohmann::json::parse(R"({"model_type": "qwen3_5_text", "hidden_size": 256, "num_hidden_layers": 4,
    "intermediate_size": 512, "vocab_size": 1000, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32})");
  if (!quant.is_null()) j["quantization_config"] = quant;
  return j;
}
const nlohmann::json kOfficial = nlohmann::json::parse(R"({"activation_scheme": "dynamic", "fmt": "e4m3",
  "quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "model.visual"]})");

std::string refusal(const std::string& key, const nlohmann::json& value) {
  nlohmann::json q = kOfficial;
  if (value.is_null()) q.erase(key);
  else q[key] = value;
  return error_of([&] { target::TargetConfig::from_json(tiny_config(q), "cfg.json"); });
}

}  // namespace

TEST(Fp8Config, TheOfficialLayoutIsReadAndEveryOtherSchemeRefused) {
  const target::TargetConfig c = target::TargetConfig::from_json(tiny_config(kOfficial), "cfg.json");
  ASSERT_TRUE(c.fp8.has_value());
  EXPECT_EQ(c.fp8->modules_to_not_convert, (std::vector<std::string>{"lm_head", "model.visual"}));
  EXPECT_FALSE(target::TargetConfig::from_json(tiny_config(nullptr), "cfg.json").fp8.has_value());
  // Beside the text fields of a multimodal config.
  nlohmann::json mm{{"model_type", "qwen3_5"}, {"text_config", tiny_config(kOfficial)}};
  mm["text_config"]["model_type"] = "qwen3_5_text";
  EXPECT_TRUE(target::TargetConfig::from_json(mm, "mm.json").fp8.has_value());

  EXPECT_NE(refusal("quant_method", "awq").find("field 'quantization_config.quant_method' is 'awq'; only 'fp8'"), std::string::npos);
  EXPECT_NE(refusal("fmt", "e5m2").find("field 'quantization_config.fmt' is 'e5m2'; only 'e4m3'"), std::string::npos);
  EXPECT_NE(refusal("activation_scheme", "static").find("'quantization_config.activation_scheme' is 'static'"), std::string::npos);
  EXPECT_NE(refusal("weight_block_size", nlohmann::json::array({64, 64})).find("weight_block_size' is [64,64]; only [128, 128]"),
            std::string::npos);
  EXPECT_NE(refusal("weight_block_size", nullptr).find("weight_block_size' is missing"), std::string::npos);
  EXPECT_NE(refusal("modules_to_not_convert", "lm_head").find("modules_to_not_convert' must be a list"), std::string::npos);
  EXPECT_NE(error_of([&] { target::TargetConfig::from_json(tiny_config(nlohmann::json("fp8")), "cfg.json"); })
                .find("field 'quantization_config' must be an object"),
            std::string::npos);
  // (Loading such checkpoints: tests/test_fp8_target.cpp.)
}
