#pragma once
// Benchmark rows as data: reading the CSV the benches write, comparing a run with a baseline
// (ratio per row, geometric mean per group), JSON, and a self-contained HTML/SVG page per sweep.
// Host-only (no CUDA), so it is tested on every machine.
#include <nlohmann/json.hpp>

#include <limits>
#include <map>
#include <string>
#include <vector>

#include "bench/harness.h"

namespace dflash::bench {

struct CsvRow {
  std::string bench, kernel, provider, mode, metric, unit, shape, gpu, commit, timestamp;
  double p50 = 0, p20 = 0, p80 = 0;
  bool noisy = false;
  // Identity of a measurement across runs (everything but the numbers, GPU, commit and time).
  std::string key() const;
};

// Parses a file written by CsvWriter (quoted fields may hold commas). Errors name the file and line.
std::vector<CsvRow> read_csv(const std::string& path);
nlohmann::json rows_to_json(const std::vector<CsvRow>& rows);

struct Comparison {
  struct Line {
    CsvRow now;
    double baseline_p50 = 0;
    double ratio = 0;  // now / baseline (for times: < 1 is faster)
  };
  std::vector<Line> lines;                  // rows present in both runs
  std::map<std::string, double> geomean;    // per "bench/metric" group: geometric mean of ratios
  std::vector<std::string> only_now, only_baseline;  // keys present in one run only
};
Comparison compare(const std::vector<CsvRow>& now, const std::vector<CsvRow>& baseline);
std::string comparison_table(const Comparison& c);

// One HTML page with an inline SVG bar chart per (bench, kernel, metric) sweep: shapes along the
// x axis, one bar per provider, the p20..p80 range as a whisker. Returns the number of charts.
int write_html_plots(const std::vector<CsvRow>& rows, const std::string& path, const std::string& title);

// Escapes <, >, & and " for HTML text and attribute values.
std::string html_escape(const std::string& s);

// A multi-series line chart over a numeric x axis as one inline <svg> element (no scripts, no
// external resources): linear axes with "nice" ticks, one coloured polyline per series, a legend.
// A non-finite y (or x) breaks that series' line; series with few points also get a dot per point
// with its value as a hover title. An empty chart (no finite point) still renders, saying "no data".
struct LineSeries {
  std::string name;
  std::vector<double> x, y;  // same length
};
struct LineChartOptions {
  std::string title, x_label, y_label;
  int width = 560, height = 280;  // pixels, the whole <svg>
  // Fixed ends of the y range (e.g. y_min = 0 for accuracies), each on its own; NaN: from the data.
  double y_min = std::numeric_limits<double>::quiet_NaN(), y_max = std::numeric_limits<double>::quiet_NaN();
};
std::string line_chart_svg(const std::vector<LineSeries>& series, const LineChartOptions& opt);

}  // namespace dflash::bench
