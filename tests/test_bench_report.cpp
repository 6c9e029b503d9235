// The benchmark statistics, CSV round trip, baseline comparison and plots (host code).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "bench/harness.h"
#include "bench/report.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::bench;
namespace fs = std::filesystem;

namespace {
std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("dflash_bench_" + std::to_string(::getpid()) + "_" + name)).string();
}
}  // namespace

TEST(BenchStats, QuantilesAndNoise) {
  Stats s = summarize({5, 1, 4, 2, 3}, {1.0, 1.01}, 0.05);
  EXPECT_DOUBLE_EQ(s.p50, 3);
  EXPECT_DOUBLE_EQ(s.p20, 1.8);  // linear interpolation between order statistics
  EXPECT_DOUBLE_EQ(s.p80, 4.2);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 5);
  EXPECT_FALSE(s.noisy);
  Stats n = summarize({1, 2}, {1.0, 1.2}, 0.05);
  EXPECT_TRUE(n.noisy);
  EXPECT_NEAR(n.round_spread, 0.2, 1e-12);
}

TEST(BenchReport, CsvRoundTripCompareAndPlot) {
  const std::string a = temp_path("a.csv"), b = temp_path("b.csv"), html = temp_path("p.html");
  fs::remove(a);
  fs::remove(b);
  {
    CsvWriter w(a, "NVIDIA H200");
    w.write({"gdn", "gated_delta_rule", "chunk_fast", "fwd", "time", "ms", "T8192, 16/48 heads", 0.6, 0.59, 0.61, false});
    w.write({"gdn", "gated_delta_rule", "recurrent", "fwd", "time", "ms", "T8192, 16/48 heads", 4.6, 4.5, 4.7, true});
    w.write({"conv", "causal_conv1d", "fused", "fwd", "time", "ms", "T8192", 0.11, 0.1, 0.12, false});
    CsvWriter w2(b, "NVIDIA H200");
    w2.write({"gdn", "gated_delta_rule", "chunk_fast", "fwd", "time", "ms", "T8192, 16/48 heads", 1.2, 1.1, 1.3, false});
    w2.write({"gdn", "gated_delta_rule", "recurrent", "fwd", "time", "ms", "T8192, 16/48 heads", 4.6, 4.5, 4.7, false});
    w2.write({"gdn", "gated_delta_rule", "old_kernel", "fwd", "time", "ms", "T8192, 16/48 heads", 9, 9, 9, false});
  }
  auto rows = read_csv(a);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].shape, "T8192, 16/48 heads");  // the quoted comma survives
  EXPECT_DOUBLE_EQ(rows[1].p50, 4.6);
  EXPECT_TRUE(rows[1].noisy);
  EXPECT_EQ(rows[0].gpu, "NVIDIA H200");
  EXPECT_FALSE(rows[0].commit.empty());
  Comparison c = compare(rows, read_csv(b));
  ASSERT_EQ(c.lines.size(), 2u);
  EXPECT_NEAR(c.geomean.at("gdn/time"), std::sqrt(0.5 * 1.0), 1e-12);
  EXPECT_EQ(c.only_now.size(), 1u);
  EXPECT_EQ(c.only_baseline.size(), 1u);
  EXPECT_NE(comparison_table(c).find("geomean ratio gdn/time"), std::string::npos);
  EXPECT_EQ(write_html_plots(rows, html, "test"), 2);
  std::ifstream in(html);
  std::string page((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(page.find("<svg"), std::string::npos);
  EXPECT_NE(page.find("chunk_fast"), std::string::npos);
  EXPECT_EQ(rows_to_json(rows).size(), 3u);
  fs::remove(a);
  fs::remove(b);
  fs::remove(html);
}

TEST(BenchReport, BadFilesAreClearErrors) {
  const std::string p = temp_path("bad.csv");
  std::ofstream(p) << "a,b,c\n1,2,3\n";
  EXPECT_NE(error_of([&] { read_csv(p); }).find("not a dflash benchmark CSV"), std::string::npos);
  std::ofstream(p) << "bench,kernel,provider,mode,metric,unit,shape,p50,p20,p80,noisy,gpu,commit,timestamp\n"
                      "gdn,k,p,fwd,time,ms,\"s\",fast,1,1,0,g,c,t\n";
  EXPECT_NE(error_of([&] { read_csv(p); }).find(":2: column 'p50' is not a number"), std::string::npos);
  std::ofstream(p) << "bench,kernel,provider,mode,metric,unit,shape,p50,p20,p80,noisy,gpu,commit,timestamp\ngdn,k\n";
  EXPECT_NE(error_of([&] { read_csv(p); }).find("2 fields, expected 14"), std::string::npos);
  EXPECT_NE(error_of([&] { read_csv(p + ".missing"); }).find("No such file"), std::string::npos);
  fs::remove(p);
}
