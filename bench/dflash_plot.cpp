// dflash_plot: a training run's metrics.jsonl as one self-contained HTML page (summary table and
// inline SVG charts over the step axis; no scripts, no external resources; see bench/plot.h).
//
//   dflash_plot runs/tiny                         # writes runs/tiny/metrics.html
//   dflash_plot runs/tiny/metrics.jsonl --out /tmp/tiny.html
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/app.h"
#include "core/error.h"
#include "core/log.h"
#include "bench/plot.h"

using namespace dflash;

int main(int argc, char** argv) {
  CLI::App app{"Render a training run's metrics.jsonl as one self-contained HTML page with SVG charts."};
  app.name("dflash_plot");
  std::string log_level = "warn", input, out;
  add_common_options(app, &log_level);
  app.add_option("run", input, "run directory (holding metrics.jsonl) or the metrics.jsonl file")->required();
  app.add_option("--out", out, "HTML file to write (default: metrics.html next to metrics.jsonl)");
  return run_app(app, argc, argv, [&]() -> int {
    init_logging(-1, log_level);
    const std::string path = bench::resolve_metrics_path(input);
    const bench::Metrics m = bench::read_metrics(path);
    if (out.empty()) out = (std::filesystem::path(path).parent_path() / "metrics.html").string();
    const std::string html = bench::render_metrics_html(m);
    std::ofstream f(out);
    DFLASH_CHECK_IO(f.good(), "writing", out);
    f << html;
    f.close();
    DFLASH_CHECK_IO(f.good(), "writing", out);
    const bench::MetricsSummary s = bench::summarize(m);
    std::printf("wrote %s: %lld metric lines, steps %lld..%lld, last loss %.4g\n", out.c_str(),
                static_cast<long long>(s.lines), static_cast<long long>(s.first_step), static_cast<long long>(s.last_step),
                s.last_loss);
    return 0;
  });
}
