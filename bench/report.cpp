#include "bench/report.h"

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "bench/harness.h"
#include "dflash/version.h"
#include "core/error.h"

namespace dflash::bench {

std::string CsvRow::key() const {
  return bench + "|" + kernel + "|" + provider + "|" + mode + "|" + metric + "|" + unit + "|" + shape;
}

namespace {

std::vector<std::string> split_csv_line(const std::string& line, const std::string& where) {
  std::vector<std::string> out;
  std::string cur;
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') { cur.push_back('"'); ++i; }
      else if (c == '"') quoted = false;
      else cur.push_back(c);
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      out.push_back(cur);
      cur.clear();
    } else if (c != '\r') {
      cur.push_back(c);
    }
  }
  DFLASH_CHECK(!quoted, where << ": unterminated quoted field");
  out.push_back(cur);
  return out;
}

double to_number(const std::string& s, const std::string& where, const char* column) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  DFLASH_CHECK(end != s.c_str() && *end == '\0', where << ": column '" << column << "' is not a number: '" << s << "'");
  return v;
}

}  // namespace

std::string html_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else if (c == '"') o += "&quot;";
    else o += c;
  }
  return o;
}

std::vector<CsvRow> read_csv(const std::string& path) {
  std::ifstream in(path);
  DFLASH_CHECK_IO(in.good(), "opening benchmark CSV", path);
  static const std::vector<std::string> kHeader = {"bench", "kernel", "provider", "mode", "metric", "unit", "shape",
                                                   "p50",   "p20",    "p80",      "noisy", "gpu",   "commit", "timestamp"};
  std::string line;
  std::getline(in, line);
  DFLASH_CHECK_HINT(split_csv_line(line, path + ":1") == kHeader, path << ": not a dflash benchmark CSV (header '" << line << "')",
                    "pass a file written by target_bench / kernel_bench --csv");
  std::vector<CsvRow> rows;
  for (int n = 2; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    const std::string where = path + ":" + std::to_string(n);
    if (split_csv_line(line, where) == kHeader) continue;  // a later run appended to the same file
    std::vector<std::string> f = split_csv_line(line, where);
    DFLASH_CHECK(f.size() == kHeader.size(), where << ": " << f.size() << " fields, expected " << kHeader.size());
    CsvRow r;
    r.bench = f[0]; r.kernel = f[1]; r.provider = f[2]; r.mode = f[3]; r.metric = f[4]; r.unit = f[5]; r.shape = f[6];
    r.p50 = to_number(f[7], where, "p50");
    r.p20 = to_number(f[8], where, "p20");
    r.p80 = to_number(f[9], where, "p80");
    r.noisy = f[10] == "1";
    r.gpu = f[11]; r.commit = f[12]; r.timestamp = f[13];
    rows.push_back(std::move(r));
  }
  return rows;
}

nlohmann::json rows_to_json(const std::vector<CsvRow>& rows) {
  nlohmann::json j = nlohmann::json::array();
  for (const CsvRow& r : rows)
    j.push_back({{"bench", r.bench}, {"kernel", r.kernel}, {"provider", r.provider}, {"mode", r.mode}, {"metric", r.metric},
                 {"unit", r.unit}, {"shape", r.shape}, {"p50", r.p50}, {"p20", r.p20}, {"p80", r.p80}, {"noisy", r.noisy},
                 {"gpu", r.gpu}, {"commit", r.commit}, {"timestamp", r.timestamp}});
  return j;
}

Comparison compare(const std::vector<CsvRow>& now, const std::vector<CsvRow>& baseline) {
  // The last row of a key wins (a file may hold several appended runs).
  std::map<std::string, const CsvRow*> base, cur;
  for (const CsvRow& r : baseline) base[r.key()] = &r;
  for (const CsvRow& r : now) cur[r.key()] = &r;
  Comparison c;
  std::map<std::string, std::pair<double, int>> logs;
  for (const auto& [k, r] : cur) {
    auto it = base.find(k);
    if (it == base.end()) { c.only_now.push_back(k); continue; }
    if (it->second->p50 <= 0 || r->p50 <= 0) continue;
    Comparison::Line l{*r, it->second->p50, r->p50 / it->second->p50};
    c.lines.push_back(l);
    auto& acc = logs[r->bench + "/" + r->metric];
    acc.first += std::log(l.ratio);
    acc.second += 1;
  }
  for (const auto& [k, r] : base)
    if (!cur.count(k)) c.only_baseline.push_back(k);
  for (const auto& [g, acc] : logs) c.geomean[g] = std::exp(acc.first / acc.second);
  return c;
}

std::string comparison_table(const Comparison& c) {
  std::ostringstream o;
  char line[512];
  std::snprintf(line, sizeof line, "%-8s %-22s %-20s %-10s %-44s %12s %12s %7s\n", "bench", "kernel", "provider", "metric",
                "shape", "now", "baseline", "ratio");
  o << line;
  for (const auto& l : c.lines) {
    std::snprintf(line, sizeof line, "%-8s %-22s %-20s %-10s %-44s %12.4g %12.4g %7.3f%s\n", l.now.bench.c_str(),
                  l.now.kernel.c_str(), l.now.provider.c_str(), l.now.metric.c_str(), l.now.shape.c_str(), l.now.p50,
                  l.baseline_p50, l.ratio, l.now.noisy ? " NOISY" : "");
    o << line;
  }
  for (const auto& [g, v] : c.geomean) o << "geomean ratio " << g << ": " << v << "\n";
  if (!c.only_now.empty()) o << c.only_now.size() << " row(s) only in this run\n";
  if (!c.only_baseline.empty()) o << c.only_baseline.size() << " row(s) only in the baseline\n";
  return o.str();
}

int write_html_plots(const std::vector<CsvRow>& rows, const std::string& path, const std::string& title) {
  // Group: (bench, kernel, metric, unit) -> ordered shapes x providers.
  struct Group {
    std::vector<std::string> shapes, providers;
    std::map<std::pair<std::string, std::string>, const CsvRow*> cell;
    std::string unit;
  };
  std::map<std::string, Group> groups;
  std::vector<std::string> order;
  for (const CsvRow& r : rows) {
    const std::string g = r.bench + " / " + r.kernel + " / " + r.metric + " (" + r.unit + ")";
    if (!groups.count(g)) order.push_back(g);
    Group& G = groups[g];
    G.unit = r.unit;
    if (std::find(G.shapes.begin(), G.shapes.end(), r.shape) == G.shapes.end()) G.shapes.push_back(r.shape);
    if (std::find(G.providers.begin(), G.providers.end(), r.provider) == G.providers.end()) G.providers.push_back(r.provider);
    G.cell[{r.shape, r.provider}] = &r;
  }
  static const char* kColors[] = {"#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377"};
  std::ostringstream h;
  h << "<!doctype html><html><head><meta charset=\"utf-8\"><title>" << html_escape(title)
    << "</title><style>body{font-family:sans-serif;margin:20px}h2{font-size:15px;margin-top:28px}"
       "text{font-size:11px}</style></head><body><h1>"
    << html_escape(title) << "</h1>\n";
  int charts = 0;
  for (const std::string& name : order) {
    const Group& G = groups[name];
    double vmax = 0;
    for (const auto& [k, r] : G.cell) vmax = std::max({vmax, r->p50, r->p80, r->p20});
    if (vmax <= 0) continue;
    const int bar = 14, gap = 10, left = 330, width = 460;
    const int row_h = bar * static_cast<int>(G.providers.size()) + gap;
    const int height = row_h * static_cast<int>(G.shapes.size()) + 40;
    h << "<h2>" << html_escape(name) << "</h2>\n<svg width=\"" << left + width + 120 << "\" height=\"" << height
      << "\" xmlns=\"http://www.w3.org/2000/svg\">\n";
    for (size_t si = 0; si < G.shapes.size(); ++si) {
      const int y0 = static_cast<int>(si) * row_h + 10;
      h << "<text x=\"" << left - 8 << "\" y=\"" << y0 + row_h / 2 << "\" text-anchor=\"end\">" << html_escape(G.shapes[si])
        << "</text>\n";
      for (size_t pi = 0; pi < G.providers.size(); ++pi) {
        auto it = G.cell.find({G.shapes[si], G.providers[pi]});
        if (it == G.cell.end()) continue;
        const CsvRow& r = *it->second;
        const int y = y0 + static_cast<int>(pi) * bar;
        const double w = width * r.p50 / vmax;
        const double lo = width * std::min(r.p20, r.p80) / vmax, hi = width * std::max(r.p20, r.p80) / vmax;
        h << "<rect x=\"" << left << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << bar - 2 << "\" fill=\""
          << kColors[pi % 6] << "\"><title>" << html_escape(r.provider) << ": " << r.p50 << " " << html_escape(r.unit)
          << "</title></rect>\n";
        if (hi > lo)
          h << "<line x1=\"" << left + lo << "\" x2=\"" << left + hi << "\" y1=\"" << y + bar / 2 - 1 << "\" y2=\"" << y + bar / 2 - 1
            << "\" stroke=\"black\"/>\n";
        h << "<text x=\"" << left + w + 4 << "\" y=\"" << y + bar - 4 << "\">" << r.p50 << (r.noisy ? " (noisy)" : "")
          << "</text>\n";
      }
    }
    int lx = left;
    for (size_t pi = 0; pi < G.providers.size(); ++pi) {
      h << "<rect x=\"" << lx << "\" y=\"" << height - 18 << "\" width=\"10\" height=\"10\" fill=\"" << kColors[pi % 6]
        << "\"/><text x=\"" << lx + 14 << "\" y=\"" << height - 9 << "\">" << html_escape(G.providers[pi]) << "</text>\n";
      lx += 20 + 7 * static_cast<int>(G.providers[pi].size());
    }
    h << "</svg>\n";
    ++charts;
  }
  h << "</body></html>\n";
  std::ofstream out(path);
  DFLASH_CHECK_IO(out.good(), "writing", path);
  out << h.str();
  DFLASH_CHECK_IO(out.good(), "writing", path);
  return charts;
}

namespace {
double quantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}
}  // namespace

Stats summarize(std::vector<double> samples, const std::vector<double>& round_medians, double noisy_threshold) {
  Stats s;
  std::sort(samples.begin(), samples.end());
  s.samples = samples;
  s.p50 = quantile(samples, 0.5);
  s.p20 = quantile(samples, 0.2);
  s.p80 = quantile(samples, 0.8);
  s.min = samples.empty() ? 0 : samples.front();
  s.max = samples.empty() ? 0 : samples.back();
  if (round_medians.size() > 1) {
    auto [mn, mx] = std::minmax_element(round_medians.begin(), round_medians.end());
    s.round_spread = (*mx - *mn) / std::max(*mn, 1e-12);
    s.noisy = s.round_spread > noisy_threshold;
  }
  return s;
}

std::string utc_timestamp() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

CsvWriter::CsvWriter(std::string path, std::string gpu_name)
    : path_(std::move(path)), gpu_(std::move(gpu_name)), timestamp_(utc_timestamp()) {
  if (path_.empty()) return;
  const bool fresh = !std::filesystem::exists(path_) || std::filesystem::file_size(path_) == 0;
  if (std::filesystem::path(path_).has_parent_path()) std::filesystem::create_directories(std::filesystem::path(path_).parent_path());
  std::ofstream out(path_, std::ios::app);
  DFLASH_CHECK_IO(out.good(), "opening CSV", path_);
  if (fresh) out << "bench,kernel,provider,mode,metric,unit,shape,p50,p20,p80,noisy,gpu,commit,timestamp\n";
}

void CsvWriter::write(const Row& r) {
  CsvRow c;
  c.bench = r.bench; c.kernel = r.kernel; c.provider = r.provider; c.mode = r.mode; c.metric = r.metric;
  c.unit = r.unit; c.shape = r.shape; c.p50 = r.p50; c.p20 = r.p20; c.p80 = r.p80; c.noisy = r.noisy;
  c.gpu = gpu_; c.commit = kGitCommit; c.timestamp = timestamp_;
  rows_.push_back(c);
  if (path_.empty()) return;
  std::ofstream out(path_, std::ios::app);
  DFLASH_CHECK_IO(out.good(), "appending to CSV", path_);
  auto q = [](const std::string& s) { return "\"" + s + "\""; };
  out << r.bench << "," << r.kernel << "," << r.provider << "," << r.mode << "," << r.metric << "," << r.unit << ","
      << q(r.shape) << "," << r.p50 << "," << r.p20 << "," << r.p80 << "," << (r.noisy ? 1 : 0) << "," << q(gpu_) << ","
      << kGitCommit << "," << timestamp_ << "\n";
  DFLASH_CHECK_IO(out.good(), "appending to CSV", path_);
}

void CsvWriter::finish(const std::string& json_path, const std::string& baseline_csv) const {
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    DFLASH_CHECK_IO(out.good(), "writing", json_path);
    out << rows_to_json(rows_).dump(1) << "\n";
    DFLASH_CHECK_IO(out.good(), "writing", json_path);
  }
  if (!baseline_csv.empty()) {
    std::printf("\n== against the baseline %s\n%s", baseline_csv.c_str(),
                comparison_table(compare(rows_, read_csv(baseline_csv))).c_str());
  }
}

namespace {

// A tick spacing of 1, 2 or 5 times a power of ten giving about `target` intervals over `range`.
double nice_step(double range, int target) {
  const double raw = range / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
}

// [lo, hi] widened to whole ticks (an end that is fixed is kept), never empty.
struct Axis {
  double lo = 0, hi = 1, step = 0.2;
  double map(double v, double a, double b) const { return a + (v - lo) / (hi - lo) * (b - a); }
};
Axis make_axis(double lo, double hi, bool fixed_lo, bool fixed_hi, int target) {
  if (!(hi > lo)) {  // one value, or a fixed end beyond all the data: open up around the fixed end
    const double at = fixed_hi && !fixed_lo ? hi : lo, pad = at != 0 ? std::abs(at) * 0.1 : 1.0;
    if (fixed_lo && !fixed_hi) hi = lo + pad;
    else if (fixed_hi && !fixed_lo) lo = hi - pad;
    else lo = at - pad, hi = at + pad, fixed_lo = fixed_hi = false;
  }
  Axis a;
  a.step = nice_step(hi - lo, target);
  a.lo = fixed_lo ? lo : std::floor(lo / a.step + 1e-9) * a.step;
  a.hi = fixed_hi ? hi : std::ceil(hi / a.step - 1e-9) * a.step;
  return a;
}

std::string num(double v, const char* f = "%.1f") {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// Tick labels of one axis in one style: plain (%g) in the usual range, else all in scientific
// notation with the digits the step needs ("5.0e-05", "1.0e-04", not "5e-05", "0.0001").
std::vector<std::pair<double, std::string>> tick_labels(const Axis& a) {
  std::vector<std::pair<double, std::string>> out;
  const double big = std::max(std::abs(a.lo), std::abs(a.hi));
  const bool sci = big > 0 && (big < 1e-3 || big >= 1e6);
  const int digits = sci ? std::max(0, static_cast<int>(std::floor(std::log10(big)) - std::floor(std::log10(a.step)))) : 0;
  for (int i = 0;; ++i) {
    const double t = a.lo + i * a.step;
    if (t > a.hi + a.step * 1e-6) break;
    const double v = std::abs(t) < a.step * 1e-9 ? 0.0 : t;
    char b[64];
    if (v == 0) std::snprintf(b, sizeof b, "0");
    else if (sci) std::snprintf(b, sizeof b, "%.*e", digits, v);
    else std::snprintf(b, sizeof b, "%g", v);
    out.push_back({t, b});
  }
  return out;
}

}  // namespace

std::string line_chart_svg(const std::vector<LineSeries>& series, const LineChartOptions& opt) {
  static const char* kLineColors[] = {"#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb", "#000000"};
  double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
  for (const LineSeries& s : series)
    for (size_t i = 0; i < std::min(s.x.size(), s.y.size()); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      xlo = std::min(xlo, s.x[i]); xhi = std::max(xhi, s.x[i]);
      ylo = std::min(ylo, s.y[i]); yhi = std::max(yhi, s.y[i]);
    }
  const bool any = std::isfinite(xlo);
  if (!any) xlo = 0, xhi = 1, ylo = 0, yhi = 1;
  if (std::isfinite(opt.y_min)) ylo = opt.y_min;
  if (std::isfinite(opt.y_max)) yhi = opt.y_max;
  const Axis ax = make_axis(xlo, xhi, false, false, 6);
  const Axis ay = make_axis(ylo, yhi, std::isfinite(opt.y_min), std::isfinite(opt.y_max), 5);
  const auto xticks = tick_labels(ax), yticks = tick_labels(ay);
  size_t ywidest = 0;
  for (const auto& t : yticks) ywidest = std::max(ywidest, t.second.size());

  // Pixels: the y tick labels (~6.5 px a character) and the rotated y label set the left margin.
  const int W = opt.width, H = opt.height;
  const int left = std::max(48, 30 + static_cast<int>(6.5 * static_cast<double>(ywidest))), right = 14;
  const int top = opt.title.empty() ? 10 : 26;
  // Legend entries flow left to right and wrap; their rows come out of the plot's height.
  std::vector<std::pair<int, int>> legend_at;  // (x, row) per series
  int lx = left, rows = series.empty() ? 0 : 1;
  for (const LineSeries& s : series) {
    const int w = 26 + 7 * static_cast<int>(s.name.size()) + 14;
    if (lx + w > W - right && lx > left) { lx = left; ++rows; }
    legend_at.push_back({lx, rows - 1});
    lx += w;
  }
  const int bottom = 42 + 16 * rows;
  const int pw = W - left - right, ph = std::max(H - top - bottom, 40);
  auto px = [&](double x) { return ax.map(x, left, left + pw); };
  auto py = [&](double y) { return ay.map(std::clamp(y, ay.lo, ay.hi), top + ph, top); };

  std::ostringstream h;
  h << "<svg class=\"chart\" width=\"" << W << "\" height=\"" << ph + top + bottom << "\" xmlns=\"http://www.w3.org/2000/svg\" "
    << "font-family=\"sans-serif\" font-size=\"11\">\n";
  if (!opt.title.empty())
    h << "<text x=\"" << left << "\" y=\"16\" font-size=\"13\" font-weight=\"bold\">" << html_escape(opt.title) << "</text>\n";
  h << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
    << "\" fill=\"none\" stroke=\"#999\"/>\n";
  // Grid and tick labels.
  for (const auto& [t, label] : yticks) {
    const double y = py(t);
    h << "<line x1=\"" << left << "\" x2=\"" << left + pw << "\" y1=\"" << num(y) << "\" y2=\"" << num(y)
      << "\" stroke=\"#e4e4e4\"/><text x=\"" << left - 4 << "\" y=\"" << num(y + 4) << "\" text-anchor=\"end\">" << label
      << "</text>\n";
  }
  for (const auto& [t, label] : xticks) {
    const double x = px(t);
    h << "<line x1=\"" << num(x) << "\" x2=\"" << num(x) << "\" y1=\"" << top << "\" y2=\"" << top + ph
      << "\" stroke=\"#e4e4e4\"/><text x=\"" << num(x) << "\" y=\"" << top + ph + 14 << "\" text-anchor=\"middle\">" << label
      << "</text>\n";
  }
  if (!opt.x_label.empty())
    h << "<text x=\"" << left + pw / 2 << "\" y=\"" << top + ph + 30 << "\" text-anchor=\"middle\">" << html_escape(opt.x_label)
      << "</text>\n";
  if (!opt.y_label.empty())
    h << "<text transform=\"translate(14," << top + ph / 2 << ") rotate(-90)\" text-anchor=\"middle\">"
      << html_escape(opt.y_label) << "</text>\n";
  if (!any)
    h << "<text x=\"" << left + pw / 2 << "\" y=\"" << top + ph / 2 << "\" text-anchor=\"middle\" fill=\"#999\">no data</text>\n";

  for (size_t si = 0; si < series.size(); ++si) {
    const LineSeries& s = series[si];
    const char* color = kLineColors[si % 8];
    const size_t n = std::min(s.x.size(), s.y.size());
    size_t finite = 0;
    std::string pts;
    auto flush = [&] {
      if (!pts.empty())
        h << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.6\" points=\"" << pts << "\"><title>"
          << html_escape(s.name) << "</title></polyline>\n";
      pts.clear();
    };
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) { flush(); continue; }
      ++finite;
      if (!pts.empty()) pts += ' ';
      pts += num(px(s.x[i])) + "," + num(py(s.y[i]));
    }
    flush();
    if (finite <= 60)
      for (size_t i = 0; i < n; ++i)
        if (std::isfinite(s.x[i]) && std::isfinite(s.y[i]))
          h << "<circle cx=\"" << num(px(s.x[i])) << "\" cy=\"" << num(py(s.y[i])) << "\" r=\"2.5\" fill=\"" << color
            << "\"><title>" << html_escape(s.name) << " at " << num(s.x[i], "%g") << ": " << num(s.y[i], "%.6g")
            << "</title></circle>\n";
    const int lxp = legend_at[si].first, ly = top + ph + 50 + 16 * legend_at[si].second;
    h << "<line x1=\"" << lxp << "\" x2=\"" << lxp + 20 << "\" y1=\"" << ly - 4 << "\" y2=\"" << ly - 4 << "\" stroke=\"" << color
      << "\" stroke-width=\"2\"/><text x=\"" << lxp + 26 << "\" y=\"" << ly << "\">" << html_escape(s.name) << "</text>\n";
  }
  h << "</svg>\n";
  return h.str();
}

}  // namespace dflash::bench
