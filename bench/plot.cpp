#include "bench/plot.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "bench/report.h"
#include "core/error.h"

namespace dflash::bench {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A number under `key`; absent or null (how a non-finite value is written) read as NaN.
double number_or_nan(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return kNaN;
  DFLASH_REQUIRE(it->is_number(), where << ": \"" << key << "\" is not a number: " << it->dump());
  return it->get<double>();
}

int64_t integer_or(const json& j, const char* key, int64_t fallback, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  DFLASH_REQUIRE(it->is_number_integer(), where << ": \"" << key << "\" is not an integer: " << it->dump());
  return it->get<int64_t>();
}

MetricsLine parse_line(const std::string& text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    DFLASH_REJECT_HINT(where << ": the line is not JSON (" << e.what() << ")",
                     "metrics.jsonl holds one JSON object per line; a cut-off last line means the run was killed "
                     "while writing it: delete that line");
  }
  DFLASH_REQUIRE(j.is_object(), where << ": the line is not a JSON object but " << j.type_name());
  DFLASH_REQUIRE_HINT(j.contains("step"), where << ": the line has no \"step\"",
                    "pass a metrics.jsonl written by dflash_train (one object per logging interval)");
  DFLASH_REQUIRE(!j["step"].is_null(), where << ": \"step\" is null");
  MetricsLine m;
  m.step = integer_or(j, "step", 0, where);
  m.total = integer_or(j, "total", -1, where);
  m.skipped = integer_or(j, "skipped", 0, where);
  m.loss = number_or_nan(j, "loss", where);
  m.accept_len = number_or_nan(j, "accept_len", where);
  m.lr = number_or_nan(j, "lr", where);
  m.grad_norm = number_or_nan(j, "grad_norm", where);
  m.tok_s = number_or_nan(j, "tok_s", where);
  m.elapsed_s = number_or_nan(j, "elapsed_s", where);
  m.tok_s_per_gpu = number_or_nan(j, "tok_s_per_gpu", where);
  m.mfu = number_or_nan(j, "mfu", where);
  m.mem_gib = number_or_nan(j, "mem_gib", where);
  if (auto it = j.find("acc"); it != j.end() && !it->is_null()) {
    DFLASH_REQUIRE(it->is_array(), where << ": \"acc\" is not an array: " << it->dump());
    for (const json& a : *it) {
      DFLASH_REQUIRE(a.is_null() || a.is_number(), where << ": \"acc\" holds a non-number: " << a.dump());
      m.acc.push_back(a.is_null() ? kNaN : a.get<double>());
    }
  }
  return m;
}

// Mean of the finite values of `get` over lines[n/2..n-1]; NaN when there are none.
template <class F>
double second_half_mean(const std::vector<MetricsLine>& lines, F get) {
  double sum = 0;
  int64_t n = 0;
  for (size_t i = lines.size() / 2; i < lines.size(); ++i) {
    const double v = get(lines[i]);
    if (std::isfinite(v)) sum += v, ++n;
  }
  return n ? sum / static_cast<double>(n) : kNaN;
}

// Four significant digits, whole numbers from 1000 up; "n/a" for NaN.
std::string fmt(double v) {
  if (!std::isfinite(v)) return std::isnan(v) ? "n/a" : (v > 0 ? "inf" : "-inf");
  char b[64];
  std::snprintf(b, sizeof b, std::abs(v) >= 1000 ? "%.0f" : "%.4g", v);
  return b;
}

template <class F>
bench::LineSeries series(const Metrics& m, const std::string& name, F get) {
  bench::LineSeries s;
  s.name = name;
  for (const MetricsLine& l : m.lines) {
    s.x.push_back(static_cast<double>(l.step));
    s.y.push_back(get(l));
  }
  return s;
}

bench::LineChartOptions chart(const std::string& title, const std::string& y_label) {
  bench::LineChartOptions o;
  o.title = title;
  o.x_label = "step";
  o.y_label = y_label;
  return o;
}

}  // namespace

std::string resolve_metrics_path(const std::string& run_dir_or_jsonl) {
  const fs::path p(run_dir_or_jsonl);
  std::error_code ec;
  if (fs::is_directory(p, ec)) {
    const fs::path m = p / "metrics.jsonl";
    DFLASH_REQUIRE_HINT(fs::exists(m, ec), "the run directory '" << p.string() << "' has no metrics.jsonl",
                      "dflash_train writes RUN_DIR/metrics.jsonl every logging.interval steps; pass that run's "
                      "directory (or the file itself)");
    return m.string();
  }
  DFLASH_REQUIRE_HINT(fs::exists(p, ec), "metrics file '" << p.string() << "' does not exist",
                    "pass a run directory (holding metrics.jsonl) or the metrics.jsonl file itself");
  return p.string();
}

Metrics read_metrics(const std::string& jsonl_path) {
  std::ifstream in(jsonl_path);
  DFLASH_CHECK_IO(in.good(), "opening metrics file", jsonl_path);
  Metrics m;
  m.path = jsonl_path;
  std::string text;
  for (int64_t n = 1; std::getline(in, text); ++n) {
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (text.find_first_not_of(" \t") == std::string::npos) continue;
    MetricsLine l = parse_line(text, jsonl_path + ":" + std::to_string(n));
    // A resumed run: its lines from step s on replace those an earlier attempt wrote.
    while (!m.lines.empty() && m.lines.back().step >= l.step) m.lines.pop_back();
    m.lines.push_back(std::move(l));
  }
  DFLASH_CHECK_IO(!in.bad(), "reading metrics file", jsonl_path);
  DFLASH_REQUIRE_HINT(!m.lines.empty(), "metrics file '" << jsonl_path << "' is empty (no metric lines)",
                    "dflash_train writes its first line after logging.interval steps; wait for it or lower "
                    "logging.interval");
  for (const MetricsLine& l : m.lines) {
    m.positions = std::max<int64_t>(m.positions, static_cast<int64_t>(l.acc.size()));
    m.has_tok_s_per_gpu |= std::isfinite(l.tok_s_per_gpu);
    m.has_mfu |= std::isfinite(l.mfu);
    m.has_mem_gib |= std::isfinite(l.mem_gib);
  }
  return m;
}

MetricsSummary summarize(const Metrics& m) {
  DFLASH_CHECK(!m.lines.empty(), "no metric lines to summarize");
  MetricsSummary s;
  const MetricsLine& last = m.lines.back();
  s.lines = static_cast<int64_t>(m.lines.size());
  s.first_step = m.lines.front().step;
  s.last_step = last.step;
  s.total = last.total;
  s.skipped = last.skipped;
  s.last_loss = last.loss;
  s.last_accept_len = last.accept_len;
  s.elapsed_s = last.elapsed_s;
  s.best_loss = kNaN;
  for (const MetricsLine& l : m.lines)
    if (std::isfinite(l.loss) && !(l.loss >= s.best_loss)) s.best_loss = l.loss, s.best_loss_step = l.step;
  s.mean_tok_s = second_half_mean(m.lines, [](const MetricsLine& l) { return l.tok_s; });
  s.mean_tok_s_per_gpu = second_half_mean(m.lines, [](const MetricsLine& l) { return l.tok_s_per_gpu; });
  s.mean_mfu = second_half_mean(m.lines, [](const MetricsLine& l) { return l.mfu; });
  s.last_mem_gib = kNaN;
  for (const MetricsLine& l : m.lines)
    if (std::isfinite(l.mem_gib)) s.last_mem_gib = l.mem_gib;
  return s;
}

std::vector<int64_t> plotted_positions(int64_t positions) {
  std::vector<int64_t> out;
  for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{8}, positions})
    if (k >= 1 && k <= positions && std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
  return out;
}

std::string render_metrics_html(const Metrics& m, const std::string& title_in) {
  const MetricsSummary s = summarize(m);
  const std::string title = "dflash training metrics: " + (title_in.empty() ? m.path : title_in);
  std::ostringstream h;
  h << "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>" << bench::html_escape(title)
    << "</title>\n<style>body{font-family:sans-serif;margin:20px;color:#222}h1{font-size:18px}"
       "h2{font-size:15px;margin:26px 0 6px}.row{display:flex;flex-wrap:wrap;gap:12px}"
       "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 10px;text-align:left}"
       "td.v{text-align:right;font-variant-numeric:tabular-nums}</style></head><body>\n<h1>"
    << bench::html_escape(title) << "</h1>\n";

  // ---- summary ----
  auto row = [&](const std::string& k, const std::string& v) {
    h << "<tr><th>" << bench::html_escape(k) << "</th><td class=\"v\">" << bench::html_escape(v) << "</td></tr>\n";
  };
  h << "<table class=\"summary\">\n";
  row("steps", std::to_string(s.last_step) + (s.total >= 0 ? " / " + std::to_string(s.total) : ""));
  row("metric lines", std::to_string(s.lines) + " (steps " + std::to_string(s.first_step) + ".." +
                          std::to_string(s.last_step) + ")");
  row("last loss", fmt(s.last_loss));
  row("best loss", fmt(s.best_loss) + (std::isfinite(s.best_loss) ? " (step " + std::to_string(s.best_loss_step) + ")" : ""));
  row("last acceptance length", fmt(s.last_accept_len));
  row("mean tok/s (second half)", fmt(s.mean_tok_s));
  if (m.has_tok_s_per_gpu) row("mean tok/s per GPU (second half)", fmt(s.mean_tok_s_per_gpu));
  if (m.has_mfu) row("mean MFU % (second half)", fmt(s.mean_mfu));
  if (m.has_mem_gib) row("last memory GiB", fmt(s.last_mem_gib));
  row("skipped updates", std::to_string(s.skipped));
  row("elapsed s", fmt(s.elapsed_s));
  h << "</table>\n";

  // ---- charts ----
  h << "<h2>Loss</h2>\n<div class=\"row\">\n"
    << bench::line_chart_svg({series(m, "loss", [](const MetricsLine& l) { return l.loss; })}, chart("Loss", "loss"))
    << "</div>\n";

  std::vector<bench::LineSeries> acc;
  for (int64_t k : plotted_positions(m.positions))
    acc.push_back(series(m, "pos " + std::to_string(k) + (k == m.positions && k > 1 ? " (last)" : ""),
                         [k](const MetricsLine& l) {
                           return k <= static_cast<int64_t>(l.acc.size()) ? l.acc[static_cast<size_t>(k - 1)] : kNaN;
                         }));
  bench::LineChartOptions acc_opt = chart("Top-1 accuracy by block position", "accuracy");
  acc_opt.y_min = 0;  // the top from the data: early accuracies would hug a fixed 0..1 axis's floor
  h << "<h2>Accuracy and acceptance length</h2>\n<div class=\"row\">\n"
    << bench::line_chart_svg(acc, acc_opt)
    << bench::line_chart_svg({series(m, "accept_len", [](const MetricsLine& l) { return l.accept_len; })},
                             chart("Acceptance length estimate", "tokens per block"))
    << "</div>\n";

  std::vector<bench::LineSeries> tput{series(m, "tok/s", [](const MetricsLine& l) { return l.tok_s; })};
  if (m.has_tok_s_per_gpu)
    tput.push_back(series(m, "tok/s per GPU", [](const MetricsLine& l) { return l.tok_s_per_gpu; }));
  h << "<h2>Throughput</h2>\n<div class=\"row\">\n" << bench::line_chart_svg(tput, chart("Throughput", "tokens / s"));
  if (m.has_mfu)
    h << bench::line_chart_svg({series(m, "MFU %", [](const MetricsLine& l) { return l.mfu; })}, chart("MFU", "percent"));
  if (m.has_mem_gib)
    h << bench::line_chart_svg({series(m, "memory GiB", [](const MetricsLine& l) { return l.mem_gib; })},
                               chart("Device memory", "GiB"));
  h << "</div>\n";

  h << "<h2>Learning rate and grad norm</h2>\n<div class=\"row\">\n"
    << bench::line_chart_svg({series(m, "lr", [](const MetricsLine& l) { return l.lr; })}, chart("Learning rate", "lr"))
    << bench::line_chart_svg({series(m, "grad_norm", [](const MetricsLine& l) { return l.grad_norm; })},
                             chart("Grad norm (before clipping)", "L2 norm"))
    << "</div>\n</body></html>\n";
  return h.str();
}

std::string render_metrics_html(const std::string& jsonl_path) { return render_metrics_html(read_metrics(jsonl_path)); }

}  // namespace dflash::bench
