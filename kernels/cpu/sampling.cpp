// CPU reference of the sampling ops (kernels/ops.h "sampling"): the greedy argmax over each row of
// logits, the oracle of cuda::argmax_rows.
#include <cmath>
#include <limits>

#include "kernels/cpu/common.h"

namespace dflash::ops {

void argmax_rows(const Tensor& logits, std::vector<int32_t>& out) {
  DFLASH_CHECK(logits.defined() && logits.device().is_cpu() && logits.dim() == 2 && dtype_is_float(logits.dtype()),
               "argmax_rows: logits must be a 2-D host float tensor [R, V], got "
                   << (logits.defined() ? logits.describe() : "undefined"));
  const int64_t R = logits.size(0), V = logits.size(1);
  DFLASH_CHECK(V >= 1 && V <= std::numeric_limits<int32_t>::max(),
               "argmax_rows: the vocabulary dimension V = " << V << " must be in [1, 2^31)");
  const Tensor x = logits.contiguous();
  out.assign(static_cast<size_t>(R), 0);
  std::vector<double> row(static_cast<size_t>(V));
  const size_t row_bytes = static_cast<size_t>(V) * dtype_size(x.dtype());
  for (int64_t r = 0; r < R; ++r) {
    convert_elements(static_cast<const uint8_t*>(x.raw_data()) + r * row_bytes, x.dtype(), row.data(), DType::F64, V);
    int64_t best = -1;
    for (int64_t v = 0; v < V; ++v)
      if (!std::isnan(row[v]) && (best < 0 || row[v] > row[best])) best = v;  // strictly greater: the lowest id wins
    out[r] = static_cast<int32_t>(best < 0 ? 0 : best);
  }
}

}  // namespace dflash::ops
