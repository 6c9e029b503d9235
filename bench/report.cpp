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
#include "kernels/error.h"

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

}  // namespace

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

}  // namespace dflash::bench
