#pragma once
// Training curves from a run's metrics.jsonl (written by trainer/train.cpp, one JSON object per
// logging interval) as one self-contained HTML page: a summary table, then inline SVG charts over
// the step axis (loss; accuracy at a few block positions and the acceptance length; throughput and
// MFU; learning rate and grad norm). Host-only: no CUDA, no scripts, no external resources.
#include <cstdint>
#include <string>
#include <vector>

namespace dflash::bench {

// One line of metrics.jsonl. A key that is absent or null (JSON has no NaN: a non-finite value is
// written as null) reads as NaN, which leaves a gap in its chart.
struct MetricsLine {
  int64_t step = 0;
  int64_t total = -1;        // the run's total steps (-1: absent)
  int64_t skipped = 0;       // updates skipped so far (non-finite loss or grad norm)
  double loss = 0, accept_len = 0, lr = 0, grad_norm = 0, tok_s = 0, elapsed_s = 0;
  std::vector<double> acc;   // (B-1): top-1 accuracy at block positions 1..B-1
  double tok_s_per_gpu = 0, mfu = 0, mem_gib = 0;  // newer runs; mfu in percent
};

struct Metrics {
  std::string path;                // the metrics.jsonl read
  std::vector<MetricsLine> lines;  // by increasing step
  int64_t positions = 0;           // the longest acc array (B-1)
  bool has_tok_s_per_gpu = false, has_mfu = false, has_mem_gib = false;  // some line has a finite value
};

// RUN_DIR -> RUN_DIR/metrics.jsonl; a file path is returned as it is. Throws when neither exists.
std::string resolve_metrics_path(const std::string& run_dir_or_jsonl);

// Reads a metrics.jsonl. Blank lines are skipped. Errors name the file and line: the file cannot
// be read, a line is not a JSON object, has no integer "step", or a known key has a value of the
// wrong type; a file without any line is an error too. When a step is not above the previous
// line's (a run resumed from an earlier checkpoint), the later lines replace the earlier ones
// from that step on.
Metrics read_metrics(const std::string& jsonl_path);

struct MetricsSummary {
  int64_t lines = 0, first_step = 0, last_step = 0, total = -1, skipped = 0;
  double last_loss = 0, best_loss = 0;  // best: the lowest finite loss (NaN when none)
  int64_t best_loss_step = 0;
  double last_accept_len = 0, elapsed_s = 0;
  // Means over the second half of the lines (lines[n/2..n-1]: past warm-up and compilation);
  // NaN where no line of that half has the value.
  double mean_tok_s = 0, mean_tok_s_per_gpu = 0, mean_mfu = 0;
  double last_mem_gib = 0;
};
MetricsSummary summarize(const Metrics& m);

// Block positions to draw: 1, 2, 4, 8 and the last (B-1), those that exist, each once.
std::vector<int64_t> plotted_positions(int64_t positions);

// The whole HTML page. `title` defaults to the metrics path.
std::string render_metrics_html(const Metrics& m, const std::string& title = {});
std::string render_metrics_html(const std::string& jsonl_path);

}  // namespace dflash::bench
