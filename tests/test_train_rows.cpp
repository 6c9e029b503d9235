// dflash_train's benchmark rows (issue 31; trainer/metrics.h training_rows, `dflash_train --csv`):
// the rows' values from a run's steady state computed by hand, and a tiny CPU run whose rows agree
// with its own metrics.jsonl (the steps after the first log interval), in bench/README.md's schema.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "bench/report.h"
#include "dflash/version.h"
#include "test_util.h"
#include "trainer/config.h"
#include "trainer/metrics.h"
#include "trainer/train.h"

using namespace dflash;
using namespace dflash::trainer;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

std::map<std::string, bench::Row> by_metric(const std::vector<bench::Row>& rows) {
  std::map<std::string, bench::Row> m;
  for (const bench::Row& r : rows) EXPECT_TRUE(m.emplace(r.metric, r).second) << "metric " << r.metric << " twice";
  return m;
}

// A GPU run of 2 ranks, 10 steps after the warm-up: the figures are the steady state's sums over the
// steps and the ranks, each row named as bench/README.md's schema asks.
TEST(TrainRows, ValuesFromTheSteadyState) {
  TrainRowShape sh;
  sh.model_type = "qwen3_5", sh.target_layers = 64, sh.hidden = 5120, sh.seq_len = 4096, sh.precision = "fp8";
  sh.tp = 1, sh.dp = 2, sh.drafter_layers = 5, sh.block_size = 16, sh.anchors = 512, sh.batch = 1, sh.micro_batches = 1;
  sh.on_gpu = true, sh.fp8_target = true, sh.peak_mem_gib = 80.7;
  EXPECT_EQ(sh.shape(), "qwen3_5 L64 H5120 seq=4096 fp8 tp=1 dp=2 drafter=5x16 anchors=512 batch=1x1");
  TrainRowShape d8 = sh;
  d8.fp8_drafter = true;  // (its weight gradients' x in 128 x 1 tiles: fp8_wgrad_x_tiles 128x1)
  EXPECT_EQ(d8.shape(), "qwen3_5 L64 H5120 seq=4096 fp8 tp=1 dp=2 drafter=5x16-fp8-wgx1 anchors=512 batch=1x1");
  d8.fp8_wgrad_x_blocks = true;  // the default: 128 x 128 blocks
  EXPECT_EQ(d8.shape(), "qwen3_5 L64 H5120 seq=4096 fp8 tp=1 dp=2 drafter=5x16-fp8 anchors=512 batch=1x1");
  d8.fp8_lm_head = true;  // model.drafter.lm_head_precision: fp8
  EXPECT_EQ(d8.shape(), "qwen3_5 L64 H5120 seq=4096 fp8 tp=1 dp=2 drafter=5x16-fp8-fp8head anchors=512 batch=1x1");
  SteadyState s;
  s.warmup_steps = 10, s.steps = 10, s.seconds = 4.5, s.tokens = 10 * 2 * 4096.0, s.flops = 4.5 * 2 * 700e12;
  s.times.target_s = 2.3, s.times.drafter_s = 2.0, s.times.comm_s = 0.01, s.times.optimizer_s = 0.18;
  s.last_loss = 12.5;
  const auto m = by_metric(training_rows(sh, s, 2));
  for (const auto& [metric, r] : m) {
    EXPECT_EQ(r.bench, "dflash_train");
    EXPECT_EQ(r.kernel, "step");
    EXPECT_EQ(r.provider, "cuda");
    EXPECT_EQ(r.mode, "train");
    EXPECT_EQ(r.shape, sh.shape());
    EXPECT_EQ(r.p20, r.p50);
    EXPECT_EQ(r.p80, r.p50);
  }
  EXPECT_DOUBLE_EQ(m.at("trained_tok_s_per_gpu").p50, 4096.0 * 2 * 10 / 4.5 / 2);
  EXPECT_EQ(m.at("trained_tok_s_per_gpu").unit, "tok/s");
  EXPECT_DOUBLE_EQ(m.at("trained_tok_s").p50, 4096.0 * 2 * 10 / 4.5);
  EXPECT_DOUBLE_EQ(m.at("mfu").p50, 100.0 * 700e12 / kPeakBf16PerGpu);
  EXPECT_EQ(m.at("mfu").unit, "%");
  EXPECT_DOUBLE_EQ(m.at("mfu_fp8_peak").p50, 100.0 * 700e12 / kPeakFp8PerGpu);
  EXPECT_DOUBLE_EQ(m.at("tflops_per_gpu").p50, 700.0);
  EXPECT_DOUBLE_EQ(m.at("peak_mem_gib").p50, 80.7);
  EXPECT_EQ(m.at("peak_mem_gib").unit, "GiB");
  EXPECT_DOUBLE_EQ(m.at("step_s").p50, 0.45);
  EXPECT_DOUBLE_EQ(m.at("target_fwd_s").p50, 0.23);
  EXPECT_DOUBLE_EQ(m.at("drafter_s").p50, 0.2);
  EXPECT_DOUBLE_EQ(m.at("comm_s").p50, 0.001);
  EXPECT_DOUBLE_EQ(m.at("optimizer_s").p50, 0.018);
  EXPECT_NEAR(m.at("other_s").p50, 0.45 - 0.23 - 0.2 - 0.001 - 0.018, 1e-12);
  EXPECT_DOUBLE_EQ(m.at("tokens_per_step").p50, 8192);
  EXPECT_DOUBLE_EQ(m.at("loss").p50, 12.5);
  EXPECT_DOUBLE_EQ(m.at("warmup_steps").p50, 10);
  EXPECT_DOUBLE_EQ(m.at("steps_averaged").p50, 10);
  EXPECT_EQ(m.size(), 16u);
  // A bf16 target: no FP8-peak row. The CPU reference: no MFU, FLOP/s or memory rows (no peak to
  // compare with, no device allocator). No step after the warm-up: no rows at all.
  sh.fp8_target = false;
  EXPECT_EQ(by_metric(training_rows(sh, s, 2)).count("mfu_fp8_peak"), 0u);
  sh.on_gpu = false;
  const auto cpu = by_metric(training_rows(sh, s, 2));
  for (const char* absent : {"mfu", "mfu_fp8_peak", "tflops_per_gpu", "peak_mem_gib"}) EXPECT_EQ(cpu.count(absent), 0u) << absent;
  EXPECT_EQ(cpu.at("step_s").provider, "cpu");
  s.steps = 0;
  EXPECT_TRUE(training_rows(sh, s, 2).empty());
}

struct TrainCsv : ::testing::Test {
  fs::path dir = fs::temp_directory_path() / ("dflash_train_rows_" + std::to_string(::getpid()));
  void SetUp() override { fs::remove_all(dir); }
  void TearDown() override { fs::remove_all(dir); }
  // The tiny embedded recipe on the CPU reference, 6 steps logged every 2 (no regeneration).
  TrainConfig config() const {
    return TrainConfig::embedded_default({"parallel.device=cpu", "data.regenerate.enabled=false", "training.max_steps=6",
                                          "logging.interval=2", "checkpoint.at_end=false", "logging.progress_bar=false", "training.num_anchors=8",
                                          "logging.run_dir=" + (dir / "run").string()});
  }
};

// Six tiny steps with --csv: the rows average steps 3..6 (the first log interval left out), their
// throughput and step time are those metrics.jsonl recorded for those intervals, the split adds up to
// the step, and each row names the recipe, the build's commit and "cpu".
TEST_F(TrainCsv, TinyRunWritesItsRows) {
  RunOptions ro;
  ro.csv_path = (dir / "rows" / "train.csv").string();
  const TrainConfig cfg = config();
  const RunResult res = train(cfg, 1, 0, ro);
  EXPECT_EQ(res.step, 6);
  const std::vector<bench::CsvRow> rows = bench::read_csv(ro.csv_path);
  ASSERT_EQ(rows.size(), 12u);
  std::map<std::string, double> v;
  for (const bench::CsvRow& r : rows) {
    EXPECT_EQ(r.bench, "dflash_train");
    EXPECT_EQ(r.kernel, "step");
    EXPECT_EQ(r.provider, "cpu");
    EXPECT_EQ(r.mode, "train");
    EXPECT_EQ(r.shape, "qwen3_5_text L8 H256 seq=256 f32 tp=1 dp=1 drafter=2x8 anchors=8 batch=1x1");
    EXPECT_EQ(r.gpu, "cpu");
    EXPECT_EQ(r.commit, kGitCommit);
    EXPECT_FALSE(r.timestamp.empty());
    v[r.metric] = r.p50;
  }
  EXPECT_EQ(v.count("mfu"), 0u);
  EXPECT_EQ(v.at("warmup_steps"), 2);
  EXPECT_EQ(v.at("steps_averaged"), 4);
  // The intervals ending at steps 4 and 6 in metrics.jsonl: their tokens (tok_s x interval) and time.
  std::ifstream in(dir / "run" / "metrics.jsonl");
  std::string line;
  double tokens = 0, seconds = 0, loss = 0;
  int lines = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    ++lines;
    if (j["step"].get<int>() <= 2) continue;
    seconds += j["time_s"]["interval"].get<double>();
    tokens += j["tok_s"].get<double>() * j["time_s"]["interval"].get<double>();
    loss = j["loss"].get<double>();
  }
  EXPECT_EQ(lines, 3);
  ASSERT_GT(seconds, 0);
  // (the CSV holds 6 significant digits)
  EXPECT_NEAR(v.at("trained_tok_s_per_gpu"), tokens / seconds, 1e-5 * tokens / seconds);
  EXPECT_EQ(v.at("trained_tok_s"), v.at("trained_tok_s_per_gpu"));
  EXPECT_NEAR(v.at("step_s"), seconds / 4, 1e-5 * seconds);
  EXPECT_NEAR(v.at("tokens_per_step"), tokens / 4, 1e-4 * tokens);
  EXPECT_GT(v.at("tokens_per_step"), 0);
  EXPECT_NEAR(v.at("loss"), loss, 1e-5 * loss);
  EXPECT_NEAR(v.at("target_fwd_s") + v.at("drafter_s") + v.at("comm_s") + v.at("optimizer_s") + v.at("other_s"), v.at("step_s"),
              1e-4 * v.at("step_s"));
  EXPECT_GT(v.at("target_fwd_s"), 0);
  EXPECT_GT(v.at("drafter_s"), 0);
  // A second run appends its rows under the same header.
  fs::remove_all(dir / "run");
  train(cfg, 1, 0, ro);
  EXPECT_EQ(bench::read_csv(ro.csv_path).size(), 24u);
}

// A --csv that is not the benchmarks' CSV, or a directory, is refused at start-up naming it, before
// any step (nothing is appended to it).
TEST_F(TrainCsv, RefusesABadCsvAtStartUp) {
  fs::create_directories(dir);
  RunOptions ro;
  ro.csv_path = (dir / "notes.csv").string();
  std::ofstream(ro.csv_path) << "my notes, not a benchmark table\n";
  const TrainConfig cfg = config();
  std::string e;
  try {
    train(cfg, 1, 0, ro);
  } catch (const Error& err) {
    e = err.message();
  }
  EXPECT_THAT(e, HasSubstr("notes.csv"));
  EXPECT_FALSE(fs::exists(dir / "run" / "metrics.jsonl"));
  ro.csv_path = dir.string();
  e.clear();
  try {
    train(cfg, 1, 0, ro);
  } catch (const Error& err) {
    e = err.message();
  }
  EXPECT_THAT(e, HasSubstr("is not a file"));
}

// training.blocks_per_pass on the CPU backend: 4 steps with each micro-batch's 8 blocks in passes of 3
// train like one pass of all of them: the same loss and gradient norm at every step within 1e-10
// (the double drafter, kernels.cpu_drafter: f64, sums the passes' gradients in another order).
TEST_F(TrainCsv, BlockPassesTrainLikeOnePass) {
  auto run = [&](const std::string& name, int64_t per_pass) {
    const TrainConfig cfg = TrainConfig::embedded_default(
        {"parallel.device=cpu", "data.regenerate.enabled=false", "training.max_steps=4", "logging.interval=1",
         "checkpoint.at_end=false", "logging.progress_bar=false", "training.blocks_per_pass=" + std::to_string(per_pass), "training.num_anchors=8",
         "kernels.cpu_drafter=f64", "data.synth.path=" + (dir / "synth.h5").string(), "logging.run_dir=" + (dir / name).string()});
    train(cfg, 1, 0, RunOptions{});
    std::vector<std::pair<double, double>> out;
    std::ifstream in(dir / name / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      out.emplace_back(j["loss"].get<double>(), j["grad_norm"].get<double>());
    }
    return out;
  };
  const auto one = run("one", 0), passes = run("passes", 3);
  ASSERT_EQ(one.size(), 4u);
  ASSERT_EQ(passes.size(), 4u);
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_NEAR(passes[i].first, one[i].first, 1e-10 * one[i].first) << "step " << i + 1;
    EXPECT_NEAR(passes[i].second, one[i].second, 1e-10 * one[i].second) << "step " << i + 1;
  }
  EXPECT_NE(one[0].first, one[3].first);  // (it trained)
}

}  // namespace
