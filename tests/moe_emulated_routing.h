#pragma once
// A fixed routing for the emulated MoE kernels' tests (test_moe_emulated.cpp, test_moe_wgmma_emulated.cpp):
// choice j of token n to expert (n + step·j) % E, permuted over every expert by the (emulated)
// moe_permute. Include after moe_emulated.h.
#include <cstdint>

#include "core/tensor.h"

namespace dflash::cuda_test {

struct FixedRouting {
  Tensor ex, counts, off, tiles, cursor, src, slot;  // i32: [N k], [E], [E + 1], [E + 1], [E], [N k], [N k]
};

inline FixedRouting fixed_routing(int64_t N, int64_t E, int64_t k, int64_t step) {
  const int64_t R = N * k;
  FixedRouting r{Tensor::empty({R}, DType::I32),     Tensor::zeros({E}, DType::I32), Tensor::empty({E + 1}, DType::I32),
                 Tensor::empty({E + 1}, DType::I32), Tensor::empty({E}, DType::I32), Tensor::empty({R}, DType::I32),
                 Tensor::empty({R}, DType::I32)};
  for (int64_t i = 0; i < R; ++i) {
    r.ex.data<int32_t>()[i] = static_cast<int32_t>((i / k + step * (i % k)) % E);
    ++r.counts.data<int32_t>()[r.ex.data<int32_t>()[i]];
  }
  dflash::cuda::moe_permute(r.ex.data<int32_t>(), r.counts.data<int32_t>(), N, E, k, r.off.data<int32_t>(),
                            r.tiles.data<int32_t>(), r.cursor.data<int32_t>(), r.src.data<int32_t>(), r.slot.data<int32_t>(),
                            nullptr, 0, E);
  return r;
}

}  // namespace dflash::cuda_test
