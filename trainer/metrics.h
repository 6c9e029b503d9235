#pragma once
// What dflash_train reports: one step's figures packed for the all-reduce that sums them over the
// ranks, the log line and metrics.jsonl record of every log interval, the progress bar, and the
// end-of-run summary; and metrics.jsonl across restarts (lines after the resumed checkpoint dropped,
// the file of a start that reached no checkpoint kept aside).
//
// metrics.jsonl, one JSON object a line per log interval: step, total, loss, acc [B-1], accept_len,
// lr, grad_norm, tok_s, tok_s_per_gpu, skipped, elapsed_s, time_s {target, drafter, comm, optimizer,
// interval, per_step}, and on a GPU mfu, mem_gib, tflops_per_gpu (+ mfu_fp8_peak with an FP8 target).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/harness.h"
#include "drafter/loss.h"
#include "core/io/files.h"
#include "trainer/backend.h"

namespace dflash::trainer {

// Dense bf16 tensor-core peak of an H100/H200 SXM (the MFU denominator), FLOP/s per GPU; and the
// dense FP8 one (an FP8 target's runs also report MFU against it).
constexpr double kPeakBf16PerGpu = 989.4e12;
constexpr double kPeakFp8PerGpu = 1978.9e12;

std::string fmt_duration(double s);  // "1h02m", "3m07s", "42s"; "?" when not finite or negative
// "0.81 0.62 0.40": the top-1 accuracy at block positions 1..B-1.
std::string fmt_acc(const drafter::StepStats& s, int64_t B);

// The remaining time of a run from this start's own step rate. The clock starts when this start's
// first step ends: start-up (config and data checks, regeneration, loading the target) and the first
// step's one-time costs (plans, allocations, first calls) are not steps, and the steps a resumed run
// did before its checkpoint took no time in this start. Times in seconds on any one clock.
class StepRate {
 public:
  // `step`: the steps done so far (of the whole run, as the log counts them), at time `t_s`.
  void step_done(int64_t step, double t_s) {
    if (first_step_ < 0) first_step_ = step, t0_ = t_s;
  }
  // Seconds left until `total` steps: 0 when done, NaN (shown as "?") until two steps of this start are done.
  double eta_s(int64_t step, double t_s, int64_t total) const {
    if (step >= total) return 0;
    if (first_step_ < 0 || step <= first_step_) return NAN;
    return (t_s - t0_) / static_cast<double>(step - first_step_) * static_cast<double>(total - step);
  }

 private:
  int64_t first_step_ = -1;
  double t0_ = 0;
};

// One status line on stderr, redrawn each step, when rank 0's stderr is a terminal; cleared before
// any log line so the two never mix.
class ProgressBar {
 public:
  ProgressBar(bool on, int64_t total) : on_(on), total_(std::max<int64_t>(total, 1)) {}
  void update(int64_t step, double loss, double elapsed_s, double eta_s);
  void clear();

 private:
  bool on_, drawn_ = false;
  int64_t total_;
};

// Metric lines of metrics.jsonl: every complete line ('\n'-terminated) that is a JSON object with an
// integer step in (previous kept step, max_step]; what is dropped is counted (a line cut by a full
// disk or a crash, lines after the checkpoint a resumed run starts from, repeats).
struct KeptMetrics {
  std::string text;
  int64_t kept = 0, dropped_after = 0, dropped_bad = 0;
};
KeptMetrics keep_metric_lines(const std::string& text, int64_t max_step);
// A metrics.jsonl of an earlier start of this run directory that reached no checkpoint: kept, under
// the next free name metrics.before-<n>.jsonl (never deleted).
void move_metrics_aside(const std::filesystem::path& mp);
// Rank 0's metrics.jsonl `mp` for a run starting at `step`: a fresh start moves an earlier file
// aside; a resumed one keeps the lines up to its step (a run that went on past the checkpoint and
// then died, or one whose last line a full disk cut, leaves lines that the resumed steps replace).
io::AppendFile open_metrics(const std::filesystem::path& mp, int64_t step);

// One step's figures of this rank, packed into one vector of doubles for the all-reduce that sums
// them over all ranks, and the sums unpacked (the times: the mean over ranks).
struct StepTotals {
  drafter::StepStats stats;
  double tokens = 0, flops = 0;
  double target_s = 0, drafter_s = 0;
};
std::vector<double> pack_step(const drafter::StepStats& stats, double tokens, double flops, const StepTimes& times,
                              int64_t block_size);
StepTotals unpack_step(const std::vector<double>& sums, int64_t block_size, int world);

// What a run measured after its first log interval (the warm-up it leaves out: start-up, first-call
// plans and allocations, the first steps' clocks), summed over those steps; the benchmark rows and the
// summary line are made from it.
struct SteadyState {
  int64_t warmup_steps = 0;  // the steps of the first log interval (left out)
  int64_t steps = 0;         // the steps after it (averaged over)
  double seconds = 0, tokens = 0, flops = 0;  // wall time of those steps; tokens and FLOPs over all ranks
  StepTimes times;           // summed over those steps (target and drafter: mean over ranks; the rest: rank 0)
  double last_loss = NAN;    // of the last log interval
};

// What names a training run in its benchmark rows (bench/README.md's schema): the target, the
// precision, the sequence length and the layout, and the drafter's recipe.
struct TrainRowShape {
  std::string model_type;         // the target's ("qwen3_5_text")
  int64_t target_layers = 0, hidden = 0;
  int64_t seq_len = 0;            // data.max_length
  std::string precision;          // "bf16" | "fp8" (GPU), ",fp8x" added with FP8 experts; "f32" on the CPU reference
  int tp = 1, dp = 1;             // parallel.tp; TP groups (data-parallel replicas)
  int64_t drafter_layers = 0, block_size = 0, anchors = 0, batch = 0, micro_batches = 0;
  bool on_gpu = false, fp8_target = false;
  bool fp8_drafter = false;       // model.drafter.precision: fp8 (the shape's drafter=5x16-fp8)
  bool fp8_lm_head = false;       // model.drafter.lm_head_precision: fp8 (drafter=5x16-fp8-fp8head)
  bool fp8_wgrad_x_blocks = false;  // the FP8 weight gradients' x in 128 x 128 blocks (the default; 128 x 1:
                                    // drafter=5x16-fp8-wgx1; rows before session 29 without the suffix were 128 x 1)
  double peak_mem_gib = 0;        // the peak allocated on any rank (GPU)
  // "qwen3_5_text L64 H5120 seq=4096 fp8 tp=1 dp=1 drafter=5x16 anchors=512 batch=1x1"
  std::string shape() const;
};
// The rows `dflash_train --csv` appends (bench dflash_train, kernel step, provider cuda | cpu, mode
// train): trained_tok_s_per_gpu and trained_tok_s (context tokens through the target per second),
// step_s and its split (target_fwd_s, drafter_s, comm_s, optimizer_s, other_s), tokens_per_step,
// loss (the last interval's), the averaging (warmup_steps left out, steps_averaged), and on a GPU
// mfu (% of the dense bf16 peak; mfu_fp8_peak too with an FP8 target), tflops_per_gpu and
// peak_mem_gib. Nothing when no step followed the first log interval.
std::vector<bench::Row> training_rows(const TrainRowShape& shape, const SteadyState& s, int world);

// The log intervals of a run: each trained step is added; every logging.interval steps rank 0 writes
// the log line and the metrics.jsonl record of the interval; the summary at the end compares the
// first and the last intervals and gives the throughput after the first (start-up, first-call plans
// and warm-up excluded).
struct RunShape {
  int rank = 0, world = 1;
  int64_t total_steps = 0, block_size = 0;
  bool on_gpu = false, fp8_target = false;
};
class RunMetrics {
 public:
  RunMetrics(const RunShape& shape, io::AppendFile& file, ProgressBar& bar);
  // A step's totals (over all ranks); `finite`: it was applied, so its loss and accuracies count.
  void add_step(const drafter::StepStats& stats, bool finite, double tokens, double flops, const StepTimes& times);
  // Ends the interval at `step` (lr and grad_norm: the last step's; mem_gib: the peak, any rank;
  // eta_s: StepRate's): the log line and the metrics.jsonl record on rank 0 (a failed write stops the run).
  void end_interval(int64_t step, double elapsed_s, double eta_s, double lr, double grad_norm, int64_t skipped,
                    double mem_gib);
  // Rank 0: "done: ..." (the steps of this start, from start_step, and of the whole run), "summary: ..."
  // and where a step's time went.
  void log_summary(int64_t step, int64_t skipped, double elapsed_s, const std::string& drafter_dir, int64_t start_step,
                   double peak_mem_gib) const;
  SteadyState steady() const;

 private:
  RunShape shape_;
  io::AppendFile& file_;
  ProgressBar& bar_;
  double peak_flops_;
  drafter::StepStats log_stats_;
  StepTimes log_times_;
  double log_tokens_ = 0, log_flops_ = 0;
  int64_t log_steps_ = 0;
  std::chrono::steady_clock::time_point log_t0_;
  double first_loss_ = NAN, last_loss_ = NAN, last_accept_ = NAN, steady_tokens_ = 0, steady_flops_ = 0, steady_s_ = 0;
  int64_t intervals_ = 0, steady_steps_ = 0, warmup_steps_ = 0;
  StepTimes steady_times_;
};

}  // namespace dflash::trainer
