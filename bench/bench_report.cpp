// bench_report: turns benchmark CSVs into JSON, a comparison with a baseline run, and plots.
//
//   bench_report bench/results/h200-a808902/target_bench.csv --baseline old.csv --html plots.html --json rows.json
#include <fstream>
#include <iostream>

#include "bench/report.h"
#include "core/app.h"
#include "core/error.h"
#include "core/log.h"

using namespace dflash;

int main(int argc, char** argv) {
  CLI::App app{"Benchmark CSVs -> JSON, ratios against a baseline (geomean per group), HTML/SVG plots."};
  app.name("bench_report");
  std::string log_level = "warn", csv, baseline, html, json_path;
  add_common_options(app, &log_level);
  app.add_option("csv", csv, "CSV written by target_bench / kernel_bench --csv")->required();
  app.add_option("--baseline", baseline, "an earlier run's CSV: print now/baseline per row and the geomean per group");
  app.add_option("--html", html, "write a self-contained HTML page with one chart per sweep");
  app.add_option("--json", json_path, "write the rows as JSON");
  return run_app(app, argc, argv, [&]() -> int {
    init_logging(-1, log_level);
    auto rows = bench::read_csv(csv);
    std::cout << rows.size() << " rows from " << csv << "\n";
    if (!baseline.empty()) std::cout << bench::comparison_table(bench::compare(rows, bench::read_csv(baseline)));
    if (!html.empty()) std::cout << bench::write_html_plots(rows, html, csv) << " charts written to " << html << "\n";
    if (!json_path.empty()) {
      std::ofstream out(json_path);
      DFLASH_CHECK_IO(out.good(), "writing", json_path);
      out << bench::rows_to_json(rows).dump(1) << "\n";
    }
    return 0;
  });
}
