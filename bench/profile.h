#pragma once
// Aggregation of per-op profiles of the target forward (target_bench --profile; host code, tested
// on every machine): per category, calls, time per forward, share of the forward and time per
// call; for each GEMM shape also TFLOP/s and the ratio to the same GEMM timed in isolation (the
// issue-4 criterion: within 5% of what cuBLASLt reaches at that shape alone).
#include <string>
#include <vector>

#include "bench/harness.h"
#include "target_model/model_cuda.h"

namespace dflash::bench {

inline constexpr double kGemmSlowRatio = 1.05;  // in-forward / isolated above this is marked

struct OpSummary {
  target::ForwardOp op = target::ForwardOp::Embedding;
  target::GemmShape gemm;       // GEMMs: one summary per shape; zero otherwise
  double calls_per_forward = 0;
  Stats per_forward_ms;         // the category's total in each forward
  double ms_per_forward = 0;    // mean of per_forward_ms
  double share = 0;             // ms_per_forward / the reference forward time (fraction)
  Stats call_us;                // every call of every forward, µs
  double mean_us = 0;
  Stats isolated_us;            // GEMMs: the same GEMM timed alone (p50 0: not measured)

  bool is_gemm() const { return target::forward_op_is_gemm(op); }
  double tflops() const { return mean_us > 0 ? gemm.flops() / (mean_us * 1e-6) / 1e12 : 0.0; }
  // In-forward / isolated, median per call over median per repeat (0 when not measured).
  double ratio() const { return isolated_us.p50 > 0 ? call_us.p50 / isolated_us.p50 : 0.0; }
  bool slow() const { return ratio() > kGemmSlowRatio; }
  // What the forward loses to this GEMM running slower than alone: calls · (mean - isolated p50).
  double excess_ms_per_forward() const {
    return isolated_us.p50 > 0 ? calls_per_forward * (mean_us - isolated_us.p50) / 1e3 : 0.0;
  }
};

struct ProfileSummary {
  int forwards = 0;
  std::vector<OpSummary> ops;  // ForwardOp order, then GEMM shape
  double ops_ms = 0;           // sum of the categories per forward (mean)
  double gemm_ms = 0;          // of which GEMMs
  double span_ms = 0;          // first op start .. last op end (mean)
  double reference_ms = 0;     // the plain (unprofiled) forward the shares are of
  double gaps_ms() const { return span_ms - ops_ms; }
};

// `forwards`: the kept profiles (the caller discards the warm-up one); `reference_ms`: the plain
// forward's p50 (0: the profiled span is used). Every forward must have ops.
ProfileSummary summarize_profile(const std::vector<target::OpProfile>& forwards, double reference_ms);

// The table target_bench prints (one line per summary, then the totals).
std::string profile_table(const ProfileSummary& s);

// CSV rows (bench target_bench, kernel "forward/<op>", provider dflash, `mode`); GEMM shapes are
// appended to `shape`. Metrics: time_per_forward ms, share %, calls count, time_per_call us;
// GEMMs also achieved TFLOP/s and, when measured, isolated_time_per_call us and
// in_forward_over_isolated x; kernel "forward/total": ops / gemms / span / gaps / reference ms.
std::vector<Row> profile_rows(const ProfileSummary& s, const std::string& mode, const std::string& shape);

}  // namespace dflash::bench
