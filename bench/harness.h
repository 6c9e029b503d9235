#pragma once
// Timing harness shared by the benchmarks (time_cuda in harness.cpp; the statistics and CSV
// writing in report.cpp, host code tested on every machine): CUDA events around the timed region, warm-up outside
// it, repeated rounds (order shuffled per round from a recorded seed), median with p20/p80 and
// min/max, a "noisy" mark when rounds disagree, and normalized CSV rows naming the GPU and commit.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "target_model/fast_path.h"

namespace dflash::bench {

struct Stats {
  double p50 = 0, p20 = 0, p80 = 0, min = 0, max = 0;
  double round_spread = 0;  // (max - min) / min of the per-round medians
  bool noisy = false;
  std::vector<double> samples;  // every timed iteration, ms
};
Stats summarize(std::vector<double> samples, const std::vector<double>& round_medians, double noisy_threshold);

// Times `fn` (which enqueues work on `stream`) `iters` times per round after `warmup` calls,
// each iteration bracketed by CUDA events. Returns per-iteration milliseconds.
std::vector<double> time_cuda(void* stream, int warmup, int iters, const std::function<void()>& fn);

// The device-to-device copy bandwidth of this GPU now (read + write bytes per second / 1e9, the best
// of 10 copies of 1 GiB after 2 untimed): the memory roofline (roofline.h) every decode benchmark and
// dflash_doctor state their steps against. Every tool measures it at its start, before the model is on the GPU.
double copy_bandwidth_gbs(int device);

struct Row {
  std::string bench, kernel, provider, mode, metric, unit, shape;
  double p50 = 0, p20 = 0, p80 = 0;
  bool noisy = false;
};

struct CsvRow;

// Appends rows to a CSV file (header written when the file is new; no file when path is empty)
// and keeps them for --json / --baseline:
// bench,kernel,provider,mode,metric,unit,shape,p50,p20,p80,noisy,gpu,commit,timestamp
class CsvWriter {
 public:
  CsvWriter(std::string path, std::string gpu_name);
  void write(const Row& r);
  const std::string& path() const { return path_; }
  const std::vector<CsvRow>& rows() const { return rows_; }
  // Writes --json and prints the --baseline comparison (either may be empty).
  void finish(const std::string& json_path, const std::string& baseline_csv) const;

 private:
  std::string path_, gpu_, timestamp_;
  std::vector<CsvRow> rows_;
};

std::string utc_timestamp();  // 2026-11-30T08:00:00Z

// A variant of a decode plan's fused kernels by name (dflash_eval --decode-variants, generate_bench
// --decode-variant): fused (the plan as is), no_pdl, skinny (+ SwiGLU in down_proj), skinny_no_swiglu,
// no_skinny (cuBLASLt for every decode GEMM: the MoE targets' plans take the skinny GEMM), skinny_streamk
// (the skinny GEMMs, bf16 ones on the stream-K kernel: cuda::gemm_bf16_stream; no SwiGLU in down_proj),
// no_gdn_chain, gdn_chain_all (the fused chain at any number of sequences), no_commit, no_overlap,
// moe_decode (MoE targets: the MoE decode kernels, off in the plan: slower in the 35B-A3B decode),
// moe_wgmma (MoE targets: the decode / verify steps' expert GEMMs on the wgmma kernel), prefetch / no_prefetch
// (the next GEMM's weights into L2 after each decode GEMM: DecodeFusion::prefetch), packed / no_packed (FP8: the
// streaming kernel on packed copies), side_gemms / no_side_gemms (FP8: the bf16 b|a GEMM on a side stream beside
// the in_proj's FP8 GEMM: DecodeFusion::fp8_side_gemms), gate_quant / no_gate_quant (FP8: the attention's output
// gate writing o_proj's FP8 input: cuda::tuning::gate_quant), unfused (every fusion and PDL off). Sets `fusion`
// and the process-wide switches cuda::tuning::pdl and gate_quant (save them first with VariantSwitches::save()
// and restore them after the variant ran); an unknown name throws, naming `option` and the variants.
inline constexpr const char* kDecodeVariantNames =
    "fused, no_pdl, skinny, skinny_no_swiglu, no_skinny, skinny_streamk, no_gdn_chain, gdn_chain_all, no_commit, no_overlap, moe_decode, moe_wgmma, prefetch, no_prefetch, packed, no_packed, side_gemms, no_side_gemms, gate_quant, no_gate_quant, unfused";
void apply_decode_variant(const std::string& name, target::FastPathPlan::DecodeFusion& fusion, const char* option);
// The process-wide switches apply_decode_variant may set, to put back after a variant.
struct VariantSwitches {
  int pdl = 0, gate_quant = 0;
  static VariantSwitches save();
  void restore() const;
};

}  // namespace dflash::bench
