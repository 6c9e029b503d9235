#pragma once
// Element types and the scalar conversions every backend agrees on (bf16 rounds to nearest even).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace dflash {

// F8E4M3: e4m3 codes (core/fp8.h) as the block-FP8 checkpoints store their weights; a value is
// only meaningful with its block scale, so the models keep one beside every such tensor.
enum class DType : uint8_t { BF16, F16, F32, F64, I32, I64, U8, F8E4M3 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::BF16: case DType::F16: return 2;
    case DType::F32: case DType::I32: return 4;
    case DType::F64: case DType::I64: return 8;
    case DType::U8: case DType::F8E4M3: return 1;
  }
  return 0;
}

constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U8: return "u8";
    case DType::F8E4M3: return "f8e4m3";
  }
  return "?";
}

constexpr bool dtype_is_float(DType t) {
  return t == DType::BF16 || t == DType::F16 || t == DType::F32 || t == DType::F64;
}

// Parses our own short names ("bf16", "f32", ...).
std::optional<DType> dtype_from_name(std::string_view name);

inline float bits_to_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// bf16 <-> f32. Round to nearest, ties to even; NaN stays a (quiet) NaN; overflow rounds to inf.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}
inline float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

// IEEE binary16 <-> f32, round to nearest even, subnormals handled.
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);

}  // namespace dflash
