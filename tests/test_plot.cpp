// dflash_plot's library: reading metrics.jsonl (errors name file:line), the summary numbers, and
// the HTML page (one inline SVG per chart, the series names, no scripts or external resources).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "bench/report.h"
#include "core/error.h"
#include "bench/plot.h"

using namespace dflash;
using namespace dflash::bench;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("dflash_plot_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream(p) << text;
}

// Four lines as dflash_train writes them (block size 16: acc has 15 positions); with `newer`, also
// tok_s_per_gpu, mfu and mem_gib.
std::string synthetic_metrics(bool newer) {
  std::string s;
  const double loss[] = {5.0, 3.5, 2.25, 2.5};
  const double tok_s[] = {100, 200, 1000, 3000};
  for (int i = 0; i < 4; ++i) {
    std::string acc = "[";
    for (int k = 1; k <= 15; ++k) {
      if (k > 1) acc += ',';
      acc += std::to_string(0.5 / k + 0.1 * i);
    }
    acc += "]";
    s += "{\"step\":" + std::to_string(10 * (i + 1)) + ",\"total\":40,\"loss\":" + std::to_string(loss[i]) +
         ",\"acc\":" + acc + ",\"accept_len\":" + std::to_string(1.5 + 0.25 * i) +
         ",\"lr\":" + std::to_string(1e-4 * (i + 1)) + ",\"grad_norm\":" + (i == 1 ? "null" : std::to_string(1.0 + i)) +
         ",\"tok_s\":" + std::to_string(tok_s[i]) + ",\"skipped\":" + std::to_string(i == 3 ? 1 : 0) +
         ",\"elapsed_s\":" + std::to_string(2.0 * (i + 1)) +
         ",\"time_s\":{\"target\":0.5,\"drafter\":1.0,\"interval\":2.0}";
    if (newer) s += ",\"tok_s_per_gpu\":" + std::to_string(tok_s[i] / 2) + ",\"mfu\":" + std::to_string(10.0 + i) +
                    ",\"mem_gib\":" + std::to_string(40.0 + i);
    s += "}\n";
  }
  return s;
}

size_t count(const std::string& hay, const std::string& needle) {
  size_t n = 0;
  for (size_t at = hay.find(needle); at != std::string::npos; at = hay.find(needle, at + 1)) ++n;
  return n;
}

// The message of the dflash::Error `f` throws ("" when it does not).
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Plot, ReadsAndSummarizesOlderRuns) {
  const fs::path d = temp_dir("old");
  write_file(d / "metrics.jsonl", synthetic_metrics(false));
  EXPECT_EQ(resolve_metrics_path(d.string()), (d / "metrics.jsonl").string());
  const Metrics m = read_metrics(resolve_metrics_path(d.string()));
  ASSERT_EQ(m.lines.size(), 4u);
  EXPECT_EQ(m.positions, 15);
  EXPECT_FALSE(m.has_mfu);
  EXPECT_FALSE(m.has_tok_s_per_gpu);
  EXPECT_FALSE(m.has_mem_gib);
  EXPECT_TRUE(std::isnan(m.lines[1].grad_norm));  // null: a non-finite norm
  EXPECT_TRUE(std::isnan(m.lines[0].mfu));
  EXPECT_DOUBLE_EQ(m.lines[2].acc[0], 0.7);

  const MetricsSummary s = summarize(m);
  EXPECT_EQ(s.last_step, 40);
  EXPECT_EQ(s.total, 40);
  EXPECT_EQ(s.first_step, 10);
  EXPECT_DOUBLE_EQ(s.last_loss, 2.5);
  EXPECT_DOUBLE_EQ(s.best_loss, 2.25);
  EXPECT_EQ(s.best_loss_step, 30);
  EXPECT_DOUBLE_EQ(s.last_accept_len, 2.25);
  EXPECT_DOUBLE_EQ(s.mean_tok_s, 2000);  // lines 2 and 3 of 4
  EXPECT_TRUE(std::isnan(s.mean_mfu));
  EXPECT_EQ(s.skipped, 1);

  EXPECT_EQ(plotted_positions(15), (std::vector<int64_t>{1, 2, 4, 8, 15}));
  EXPECT_EQ(plotted_positions(3), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(plotted_positions(8), (std::vector<int64_t>{1, 2, 4, 8}));

  const std::string html = render_metrics_html(m);
  // Loss, accuracy, acceptance length, throughput, lr, grad norm: no MFU or memory chart.
  EXPECT_EQ(count(html, "<svg"), 6u);
  EXPECT_EQ(count(html, "</svg>"), 6u);
  for (const char* name : {">loss<", ">pos 1<", ">pos 2<", ">pos 4<", ">pos 8<", ">pos 15 (last)<", ">accept_len<",
                           ">tok/s<", ">lr<", ">grad_norm<"})
    EXPECT_NE(html.find(name), std::string::npos) << name;
  EXPECT_EQ(html.find("MFU"), std::string::npos);
  EXPECT_EQ(html.find("tok/s per GPU"), std::string::npos);
  // The summary table.
  EXPECT_NE(html.find("<th>steps</th><td class=\"v\">40 / 40</td>"), std::string::npos);
  EXPECT_NE(html.find("<th>last loss</th><td class=\"v\">2.5</td>"), std::string::npos);
  EXPECT_NE(html.find("<th>best loss</th><td class=\"v\">2.25 (step 30)</td>"), std::string::npos);
  EXPECT_NE(html.find("<th>last acceptance length</th><td class=\"v\">2.25</td>"), std::string::npos);
  EXPECT_NE(html.find("<th>mean tok/s (second half)</th><td class=\"v\">2000</td>"), std::string::npos);
  // Self-contained: no scripts, nothing fetched.
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("src="), std::string::npos);
  EXPECT_EQ(html.find("href="), std::string::npos);
  fs::remove_all(d);
}

TEST(Plot, NewerRunsAddPerGpuThroughputMfuAndMemory) {
  const fs::path d = temp_dir("new");
  write_file(d / "metrics.jsonl", synthetic_metrics(true));
  const Metrics m = read_metrics((d / "metrics.jsonl").string());
  EXPECT_TRUE(m.has_mfu);
  EXPECT_TRUE(m.has_tok_s_per_gpu);
  EXPECT_TRUE(m.has_mem_gib);
  const MetricsSummary s = summarize(m);
  EXPECT_DOUBLE_EQ(s.mean_tok_s_per_gpu, 1000);
  EXPECT_DOUBLE_EQ(s.mean_mfu, 12.5);
  EXPECT_DOUBLE_EQ(s.last_mem_gib, 43);
  const std::string html = render_metrics_html(m);
  EXPECT_EQ(count(html, "<svg"), 8u);  // + MFU and memory
  for (const char* name : {">tok/s per GPU<", ">MFU %<", ">memory GiB<"})
    EXPECT_NE(html.find(name), std::string::npos) << name;
  EXPECT_NE(html.find("<th>mean MFU % (second half)</th><td class=\"v\">12.5</td>"), std::string::npos);
  EXPECT_NE(html.find("<th>mean tok/s per GPU (second half)</th><td class=\"v\">1000</td>"), std::string::npos);
  fs::remove_all(d);
}

TEST(Plot, NullMfuOnTheCpuBackendDrawsNoMfuChart) {
  const fs::path d = temp_dir("cpu");
  write_file(d / "metrics.jsonl",
             "{\"step\":1,\"loss\":3,\"acc\":[0.5],\"accept_len\":1.5,\"lr\":1e-3,\"grad_norm\":1,\"tok_s\":50,\"mfu\":null}\n"
             "\n"
             "{\"step\":2,\"loss\":2,\"acc\":[0.6],\"accept_len\":1.6,\"lr\":1e-3,\"grad_norm\":1,\"tok_s\":70,\"mfu\":null}\n");
  const Metrics m = read_metrics((d / "metrics.jsonl").string());
  EXPECT_EQ(m.lines.size(), 2u);  // the blank line is skipped
  EXPECT_FALSE(m.has_mfu);
  const std::string html = render_metrics_html(m);
  EXPECT_EQ(count(html, "<svg"), 6u);
  EXPECT_NE(html.find(">pos 1<"), std::string::npos);
  EXPECT_NE(html.find("<th>steps</th><td class=\"v\">2</td>"), std::string::npos);  // no "total"
  fs::remove_all(d);
}

TEST(Plot, ResumedRunReplacesLinesFromTheResumeStep) {
  const fs::path d = temp_dir("resume");
  write_file(d / "metrics.jsonl",
             "{\"step\":10,\"loss\":4}\n{\"step\":20,\"loss\":3}\n{\"step\":30,\"loss\":9}\n"
             "{\"step\":30,\"loss\":2.75}\n{\"step\":40,\"loss\":2.5}\n");
  const Metrics m = read_metrics((d / "metrics.jsonl").string());
  ASSERT_EQ(m.lines.size(), 4u);
  EXPECT_DOUBLE_EQ(m.lines[2].loss, 2.75);
  EXPECT_EQ(m.positions, 0);
  // No acc at all: the accuracy chart is drawn empty rather than failing.
  EXPECT_NE(render_metrics_html(m).find("no data"), std::string::npos);
  fs::remove_all(d);
}

TEST(Plot, BadInputNamesFileAndLine) {
  const fs::path d = temp_dir("bad");
  const std::string ok = "{\"step\":1,\"loss\":3}\n";

  EXPECT_NE(error_of([&] { resolve_metrics_path((d / "nope.jsonl").string()); }).find("nope.jsonl' does not exist"),
            std::string::npos);
  EXPECT_NE(error_of([&] { resolve_metrics_path(d.string()); }).find("has no metrics.jsonl"), std::string::npos);
  EXPECT_NE(error_of([&] { read_metrics((d / "nope.jsonl").string()); }).find("nope.jsonl"), std::string::npos);

  write_file(d / "empty.jsonl", "\n\n");
  EXPECT_NE(error_of([&] { read_metrics((d / "empty.jsonl").string()); }).find("empty.jsonl' is empty"),
            std::string::npos);

  write_file(d / "notjson.jsonl", ok + "{\"step\":2,\"loss\":\n");
  EXPECT_NE(error_of([&] { read_metrics((d / "notjson.jsonl").string()); }).find("notjson.jsonl:2: the line is not JSON"),
            std::string::npos);

  write_file(d / "array.jsonl", ok + ok + "[1,2]\n");
  EXPECT_NE(error_of([&] { read_metrics((d / "array.jsonl").string()); }).find("array.jsonl:3: the line is not a JSON object"),
            std::string::npos);

  write_file(d / "nostep.jsonl", ok + "\n{\"loss\":3}\n");
  EXPECT_NE(error_of([&] { read_metrics((d / "nostep.jsonl").string()); }).find("nostep.jsonl:3: the line has no \"step\""),
            std::string::npos);

  write_file(d / "badloss.jsonl", "{\"step\":1,\"loss\":\"high\"}\n");
  EXPECT_NE(error_of([&] { read_metrics((d / "badloss.jsonl").string()); }).find("badloss.jsonl:1: \"loss\" is not a number"),
            std::string::npos);

  write_file(d / "badstep.jsonl", "{\"step\":1.5}\n");
  EXPECT_NE(error_of([&] { read_metrics((d / "badstep.jsonl").string()); }).find("badstep.jsonl:1: \"step\" is not an integer"),
            std::string::npos);
  fs::remove_all(d);
}

TEST(LineChart, AxesLegendGapsAndFixedRange) {
  bench::LineSeries a{"alpha", {0, 1, 2, 3}, {1, 2, NAN, 4}}, b{"b<&>", {0, 3}, {2, 2}};
  bench::LineChartOptions o;
  o.title = "T";
  o.x_label = "step";
  const std::string svg = bench::line_chart_svg({a, b}, o);
  EXPECT_EQ(count(svg, "<svg"), 1u);
  EXPECT_EQ(count(svg, "<polyline"), 3u);  // alpha broken by its NaN into two pieces, and b
  EXPECT_EQ(count(svg, "<circle"), 5u);    // one dot per finite point
  EXPECT_NE(svg.find(">alpha<"), std::string::npos);
  EXPECT_NE(svg.find(">b&lt;&amp;&gt;<"), std::string::npos);
  EXPECT_EQ(svg.find("b<&>"), std::string::npos);
  o.y_min = 0;
  o.y_max = 1;
  const std::string fixed = bench::line_chart_svg({a}, o);
  EXPECT_NE(fixed.find(">0<"), std::string::npos);
  EXPECT_NE(fixed.find(">1<"), std::string::npos);
  EXPECT_NE(bench::line_chart_svg({}, o).find("no data"), std::string::npos);
  // Only the bottom fixed, all the data below it, or a single value: still finite axes.
  bench::LineChartOptions floor0;
  floor0.y_min = 0;
  for (const bench::LineSeries& s : {bench::LineSeries{"neg", {1, 2}, {-3, -2}}, bench::LineSeries{"one", {5}, {7}}}) {
    const std::string svg1 = bench::line_chart_svg({s}, floor0) + bench::line_chart_svg({s}, {});
    EXPECT_EQ(svg1.find("nan"), std::string::npos) << s.name;
    EXPECT_EQ(svg1.find("inf"), std::string::npos) << s.name;
  }
}
