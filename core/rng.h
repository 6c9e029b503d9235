#pragma once
// Counter-based RNG (Philox4x32-10, Salmon et al. 2011). A value is a pure function of
// (seed, stream, index), so the CPU and the GPU produce the same numbers for the same seed, any
// thread layout draws the same stream, and a slice of a tensor (a tensor-parallel shard) can be
// generated without generating the rest.
//
// Element i of a stream uses counter (i / 4, 0, stream_lo, stream_hi) and takes output word i % 4.
// uniform: (u >> 8) * 2^-24, in [0, 1), exact in f32 on every backend.
// normal:  Box-Muller on the pair of words (2j, 2j+1) of block i/4; element i takes cos or sin.
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DFLASH_HD __host__ __device__ __forceinline__
#else
#define DFLASH_HD inline
#endif

namespace dflash::rng {

struct U32x4 { uint32_t x, y, z, w; };

DFLASH_HD uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

DFLASH_HD U32x4 philox4x32_10(U32x4 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)  // device code only: the host compiler of a .cu file warns on the pragma
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    uint32_t lo0 = mulhilo(M0, c.x, &hi0);
    uint32_t lo1 = mulhilo(M1, c.z, &hi1);
    c = U32x4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += W0;
    k1 += W1;
  }
  return c;
}

DFLASH_HD U32x4 block(uint64_t seed, uint64_t stream, uint64_t block_index) {
  U32x4 c{static_cast<uint32_t>(block_index), static_cast<uint32_t>(block_index >> 32),
          static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)};
  return philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

DFLASH_HD uint32_t word(const U32x4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

DFLASH_HD uint32_t bits(uint64_t seed, uint64_t stream, uint64_t index) {
  return word(block(seed, stream, index >> 2), static_cast<int>(index & 3));
}

// In [0, 1) with 24 random bits.
DFLASH_HD float u32_to_unit(uint32_t u) { return static_cast<float>(u >> 8) * (1.0f / 16777216.0f); }

DFLASH_HD float uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return u32_to_unit(bits(seed, stream, index));
}

// Standard normal. Uses (0, 1] for the log argument so it is never log(0).
DFLASH_HD float normal(uint64_t seed, uint64_t stream, uint64_t index) {
  U32x4 v = block(seed, stream, index >> 2);
  int pair = static_cast<int>(index & 2);
  float u1 = (static_cast<float>(word(v, pair) >> 8) + 1.0f) * (1.0f / 16777216.0f);
  float u2 = u32_to_unit(word(v, pair + 1));
  // double math on the host and device keeps the CPU and GPU results within one f32 ulp.
  double r = sqrt(-2.0 * log(static_cast<double>(u1)));
  double theta = 6.283185307179586 * static_cast<double>(u2);
  return static_cast<float>((index & 1) ? r * sin(theta) : r * cos(theta));
}

// 64-bit mix (splitmix64 finalizer): derives independent stream ids from names and indices.
DFLASH_HD uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace dflash::rng
