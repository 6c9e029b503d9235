#pragma once
// Conv family: the GatedDeltaNet causal depthwise short conv, prefill (fast and fallback) and its
// decode / verify update on a state pool (kernels/cuda/gdn_conv.cu). CPU reference:
// ops::causal_conv1d, ops::causal_conv1d_update (kernels/ops.h).
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// ---- Prefill ---------------------------------------------------------------------------------------
// Causal depthwise conv over C channels, channel-last, zeros before each sequence start:
//   y[t, c] = act(sum_j w[c, j] · x[t - K + 1 + j, c]),  act = silu when `silu`.
// x rows strided (ldx >= C, e.g. the [q|k|v] columns of the fused in-projection output); y contiguous.
struct ConvParams {
  const void* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;  // [C, K]
  void* y = nullptr;        // [N, C]
  const int32_t* cu_seqlens = nullptr;
  int64_t num_seqs = 0, N = 0, C = 0, K = 0;
  bool silu = true;
};
// One pass over all channels: vectorized (8 bf16 channels per thread), each input read once, K <= 4.
void causal_conv1d_fast(const ConvParams& p, Stream s);
bool causal_conv1d_fast_supported(int64_t C, int64_t K);
// One thread per (token, channel), any C and K.
void causal_conv1d_fallback(const ConvParams& p, Stream s);

// ---- Decode / verify (conventions in launch.h) -----------------------------------------------------
// Causal conv update (GatedDeltaNet short conv, channel-last). state [num_slots, K-1, C] bf16 holds
// the last K-1 conv inputs of each slot (zeros for a new sequence). For seq s the window is
// [state rows ; its T_s rows of x] and y_t[c] = act(sum_j w[c, j] · window[t + j][c]); with
// update_state the slot's state becomes the window's last K-1 rows (also when T_s < K-1).
// x rows strided (ldx >= C, e.g. the q|k|v columns of the in-projection output), y [N, C].
struct ConvUpdateParams {
  const void* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;     // [C, K]
  void* y = nullptr;           // [N, C]
  void* state = nullptr;       // [num_slots, K-1, C] bf16
  const int32_t* slots = nullptr;       // [num_seqs]
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1]
  int64_t num_seqs = 0, N = 0, C = 0, K = 0, num_slots = 0;
  bool silu = true, update_state = true;
};
// One thread per (sequence, 8 channels): the state rows and the sequence's rows stay in registers,
// 16-byte loads and stores. Needs C % 8 == 0, ldx % 8 == 0, K in [1, 4], 16-byte aligned x / y / state.
void causal_conv1d_update_fast(const ConvUpdateParams& p, Stream s);
bool causal_conv1d_update_fast_supported(int64_t C, int64_t K);
// The same results (y and new states, bit for bit) parallel over tokens, for steps with long
// sequences (a chunked prefill's prompt pieces: the vec8 kernel walks a sequence's tokens in one
// thread, ~0.63 ms for a 961-token piece at C 10240 on an H100): the prefill kernel's runs of tokens
// with each sequence's first K-1 window rows read from its slot, then (update_state) one thread per
// (sequence, 8 channels) writes the states. Two launches; the shapes and alignment of the vec8 kernel.
void causal_conv1d_update_runs(const ConvUpdateParams& p, Stream s);
// One thread per (sequence, channel); any C and K, any alignment.
void causal_conv1d_update_fallback(const ConvUpdateParams& p, Stream s);
// The kernel the fast path names for this shape ("vec8" or "fallback").
const char* causal_conv1d_update_kernel_name(int64_t C, int64_t K);

namespace detail {
// The shape checks of the two vec8 launchers (gdn_conv.cu): C % 8 == 0, K in [1, 4] and 16-byte rows
// (ldx % 8 == 0); the message of `op` names `fallback` as the launcher that takes any shape.
void check_conv_vec8_shape(const char* op, int64_t C, int64_t K, int64_t ldx, const char* fallback);
// causal_conv1d_fast's kernel over p's rows with the slots' conv states ([num_slots, K-1, C], read
// only) as the sequences' initial windows (causal_conv1d_update_runs' first launch; p checked there).
void causal_conv1d_runs_with_states(const ConvParams& p, const void* state, const int32_t* slots, int64_t num_slots,
                                    Stream s);
}  // namespace detail

}  // namespace dflash::cuda
