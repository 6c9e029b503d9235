#pragma once
// Sampling family: the token choice of decoding on the device (kernels/cuda/sampling.cu).
// CPU reference: ops::argmax_rows, ops::sample_rows (kernels/ops.h).
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// ---- Sampling --------------------------------------------------------------------------------------
// The token choice of decoding on the device: greedy (argmax) and temperature / top-p sampling.
// out[r] = argmax over v < V of logits[r · ld + v] for R rows of fp32 (bf16 = false) or bf16 logits,
// as ops::argmax_rows: ties go to the lowest id (also across threads), NaN entries are never chosen
// (a row without a non-NaN value gives 0). One CTA per row, 16-byte loads whatever the rows'
// alignment (a scalar head and tail around the aligned body). Needs 1 <= V < 2^31 and ld >= V.
void argmax_rows(const void* logits, bool bf16, int64_t ld, int64_t R, int64_t V, int32_t* out, Stream s);

// Temperature / top-p sampling of R rows of fp32 logits (rows ld apart), as ops::sample_rows (its
// definition, kernels/ops.h): out[r] is drawn with stream streams[r] and position positions[r]
// (device arrays [R]). The nucleus threshold may be found with float sums in another order than the
// reference's, so a row whose nucleus mass lies within ~1e-5 of top_p may keep one token more or
// less; everything else is the reference's draw exactly. Needs 1 <= V < 2^31, ld >= V, temperature > 0,
// 0 < top_p <= 1.
void sample_rows(const float* logits, int64_t ld, int64_t R, int64_t V, float temperature, float top_p, uint64_t seed,
                 const uint64_t* streams, const int64_t* positions, int32_t* out, Stream s);

}  // namespace dflash::cuda
