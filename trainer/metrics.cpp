#include "trainer/metrics.h"

#include <cstdio>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/error.h"
#include "trainer/checkpoint.h"

namespace fs = std::filesystem;

namespace dflash::trainer {

std::string fmt_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = std::llround(s);
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t / 60) % 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

void ProgressBar::update(int64_t step, double loss, double elapsed, double eta) {
  if (!on_) return;
  const int width = 30;
  const int fill = static_cast<int>(static_cast<double>(width) * static_cast<double>(step) / static_cast<double>(total_));
  std::fprintf(stderr, "\r\033[K[%s%s] %lld/%lld loss %.4f  %s elapsed, eta %s", std::string(fill, '#').c_str(),
               std::string(width - fill, '.').c_str(), static_cast<long long>(step), static_cast<long long>(total_), loss,
               fmt_duration(elapsed).c_str(), fmt_duration(eta).c_str());
  std::fflush(stderr);
  drawn_ = true;
}
void ProgressBar::clear() {
  if (!drawn_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  drawn_ = false;
}

std::string fmt_acc(const drafter::StepStats& s, int64_t B) {
  std::string out;
  for (int64_t k = 1; k < B; ++k) out += fmt::format("{}{:.2f}", k > 1 ? " " : "", s.accuracy(k));
  return out;
}

KeptMetrics keep_metric_lines(const std::string& text, int64_t max_step) {
  KeptMetrics k;
  int64_t last = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) {  // a cut last line
      if (text.find_first_not_of(" \t\r", pos) != std::string::npos) ++k.dropped_bad;
      break;
    }
    const std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) {
      ++k.dropped_bad;
      continue;
    }
    const int64_t st = j["step"].get<int64_t>();
    if (st > max_step) {
      ++k.dropped_after;
      continue;
    }
    if (st <= last) {
      ++k.dropped_bad;
      continue;
    }
    last = st;
    k.text += line + "\n";
    ++k.kept;
  }
  return k;
}

void move_metrics_aside(const fs::path& mp) {
  std::error_code ec;
  if (!fs::exists(mp, ec) || fs::file_size(mp, ec) == 0) return;
  fs::path to;
  for (int n = 1;; ++n) {
    to = mp.parent_path() / fmt::format("metrics.before-{}.jsonl", n);
    if (!fs::exists(to, ec)) break;
  }
  fs::rename(mp, to, ec);
  DFLASH_CHECK_HINT(!ec, "moving the earlier " << mp.string() << " to " << to.string() << " failed: " << ec.message(),
                    "check the permissions of " << mp.parent_path().string());
  spdlog::info("metrics: the earlier {} (from a start that reached no checkpoint) is kept as {}", mp.string(),
               to.string());
}

io::AppendFile open_metrics(const fs::path& mp, int64_t step) {
  if (step == 0) {
    move_metrics_aside(mp);
  } else if (fs::exists(mp)) {
    const KeptMetrics k = keep_metric_lines(read_text(mp), step);
    if (k.dropped_after || k.dropped_bad) {
      io::write_file_atomic(mp.string(), k.text);
      spdlog::info("metrics: kept {} line(s) of {} up to step {}; dropped {} after it and {} cut or invalid", k.kept,
                   mp.string(), step, k.dropped_after, k.dropped_bad);
    }
  }
  return io::AppendFile(mp.string());
}

std::vector<double> pack_step(const drafter::StepStats& stats, double tokens, double flops, const StepTimes& times,
                              int64_t block_size) {
  const int64_t B = block_size;
  std::vector<double> buf(8 + 2 * static_cast<size_t>(B), 0.0);
  size_t at = 0;
  buf[at++] = stats.weighted_ce_sum;
  buf[at++] = stats.weight_sum;
  buf[at++] = stats.accept_len_sum;
  buf[at++] = static_cast<double>(stats.num_blocks);
  buf[at++] = tokens;
  buf[at++] = flops;
  buf[at++] = times.target_s;
  buf[at++] = times.drafter_s;
  for (int64_t k = 0; k < B; ++k) buf[at + static_cast<size_t>(k)] = static_cast<double>(stats.correct[static_cast<size_t>(k)]);
  for (int64_t k = 0; k < B; ++k) buf[at + static_cast<size_t>(B + k)] = static_cast<double>(stats.counted[static_cast<size_t>(k)]);
  return buf;
}

StepTotals unpack_step(const std::vector<double>& buf, int64_t block_size, int world) {
  const int64_t B = block_size;
  DFLASH_CHECK(buf.size() == 8 + 2 * static_cast<size_t>(B), "unpack_step: " << buf.size() << " values for block size " << B);
  StepTotals t;
  drafter::StepStats& gs = t.stats;
  size_t at = 0;
  gs.weighted_ce_sum = buf[at++];
  gs.weight_sum = buf[at++];
  gs.accept_len_sum = buf[at++];
  gs.num_blocks = std::llround(buf[at++]);
  t.tokens = buf[at++];
  t.flops = buf[at++];
  t.target_s = buf[at++] / world;  // mean over ranks
  t.drafter_s = buf[at++] / world;
  gs.correct.resize(static_cast<size_t>(B));
  gs.counted.resize(static_cast<size_t>(B));
  for (int64_t k = 0; k < B; ++k) gs.correct[static_cast<size_t>(k)] = std::llround(buf[at + static_cast<size_t>(k)]);
  for (int64_t k = 0; k < B; ++k) gs.counted[static_cast<size_t>(k)] = std::llround(buf[at + static_cast<size_t>(B + k)]);
  return t;
}

RunMetrics::RunMetrics(const RunShape& shape, io::AppendFile& file, ProgressBar& bar)
    : shape_(shape),
      file_(file),
      bar_(bar),
      peak_flops_(shape.on_gpu ? kPeakBf16PerGpu : 0.0),
      log_t0_(std::chrono::steady_clock::now()) {}

void RunMetrics::add_step(const drafter::StepStats& stats, bool finite, double tokens, double flops, const StepTimes& times) {
  if (finite) log_stats_.add(stats);
  log_tokens_ += tokens;
  log_flops_ += flops;
  log_times_.add(times);
  ++log_steps_;
}

void RunMetrics::end_interval(int64_t step, double elapsed_s, double eta, double lr, double grad_norm, int64_t skipped,
                              double mem_gib) {
  using clock = std::chrono::steady_clock;
  const int64_t B = shape_.block_size;
  const double dt = std::chrono::duration<double>(clock::now() - log_t0_).count();
  const double tok_s = dt > 0 ? log_tokens_ / dt : 0.0;
  const double mfu = peak_flops_ > 0 && dt > 0 ? 100.0 * log_flops_ / dt / (peak_flops_ * shape_.world) : 0.0;
  if (shape_.rank == 0) {
    bar_.clear();
    std::string perf = fmt::format("{:.0f} tok/s ({:.0f}/{})", tok_s, tok_s / shape_.world, shape_.on_gpu ? "GPU" : "rank");
    if (peak_flops_ > 0 && shape_.fp8_target)
      perf += fmt::format(" | MFU {:.1f}% (fp8 peak {:.1f}%) | mem {:.1f} GiB", mfu, mfu * kPeakBf16PerGpu / kPeakFp8PerGpu, mem_gib);
    else if (peak_flops_ > 0)
      perf += fmt::format(" | MFU {:.1f}% | mem {:.1f} GiB", mfu, mem_gib);
    spdlog::info("step {}/{} | loss {:.4f} | acc[1..{}] {} | accept {:.3f} | lr {:.3e} | gnorm {:.3f} | {} | eta {}",
                 step, shape_.total_steps, log_stats_.loss(), B - 1, fmt_acc(log_stats_, B), log_stats_.accept_len(), lr,
                 grad_norm, perf, fmt_duration(eta));
    nlohmann::json acc = nlohmann::json::array();
    for (int64_t k = 1; k < B; ++k) acc.push_back(log_stats_.accuracy(k));
    const double n = static_cast<double>(std::max<int64_t>(log_steps_, 1));
    nlohmann::json line{{"step", step},          {"total", shape_.total_steps},         {"loss", log_stats_.loss()},
                        {"acc", acc},            {"accept_len", log_stats_.accept_len()},
                        {"lr", lr},         {"grad_norm", grad_norm}, {"tok_s", tok_s},
                        {"tok_s_per_gpu", tok_s / shape_.world},
                        {"skipped", skipped},    {"elapsed_s", elapsed_s},
                        {"time_s", {{"target", log_times_.target_s}, {"drafter", log_times_.drafter_s},
                                    {"comm", log_times_.comm_s}, {"optimizer", log_times_.optimizer_s},
                                    {"interval", dt}, {"per_step", dt / n}}}};
    if (peak_flops_ > 0) line["mfu"] = mfu, line["mem_gib"] = mem_gib, line["tflops_per_gpu"] = log_flops_ / dt / shape_.world / 1e12;
    if (peak_flops_ > 0 && shape_.fp8_target) line["mfu_fp8_peak"] = mfu * kPeakBf16PerGpu / kPeakFp8PerGpu;
    file_.append(line.dump() + "\n");  // a failed write (a full disk) stops the run here
  }
  if (intervals_++ == 0) {
    first_loss_ = log_stats_.loss();
    warmup_steps_ = log_steps_;
  } else {
    steady_tokens_ += log_tokens_, steady_flops_ += log_flops_, steady_s_ += dt;
    steady_times_.add(log_times_);
    steady_steps_ += log_steps_;
  }
  last_loss_ = log_stats_.loss(), last_accept_ = log_stats_.accept_len();
  log_stats_ = drafter::StepStats{};
  log_tokens_ = log_flops_ = 0;
  log_times_ = StepTimes{};
  log_steps_ = 0;
  log_t0_ = clock::now();
}

void RunMetrics::log_summary(int64_t step, int64_t skipped, double elapsed_s, const std::string& drafter_dir, int64_t start_step,
                             double peak_mem_gib) const {
  if (shape_.rank != 0) return;
  // A resumed start trains only the steps after its checkpoint: say both counts.
  if (step == start_step)
    spdlog::info("done: no step trained in this run ({} of {} steps were done before it); drafter exported to {}", step,
                 shape_.total_steps, drafter_dir);
  else if (start_step > 0)
    spdlog::info("done: {} steps in this run (steps {}..{} of {}; {} skipped as non-finite in all) in {:.1f} s; drafter "
                 "exported to {}", step - start_step, start_step + 1, step, shape_.total_steps, skipped, elapsed_s, drafter_dir);
  else
    spdlog::info("done: {} steps ({} skipped as non-finite) in {:.1f} s; drafter exported to {}", step, skipped, elapsed_s,
                 drafter_dir);
  std::string perf = "throughput after the first log interval: ";
  if (steady_s_ > 0) {
    perf += fmt::format("{:.0f} tok/s ({:.0f} per {})", steady_tokens_ / steady_s_, steady_tokens_ / steady_s_ / shape_.world,
                        shape_.on_gpu ? "GPU" : "rank");
    if (peak_flops_ > 0)
      perf += fmt::format(", MFU {:.1f}%{}, peak memory {:.1f} GiB", 100.0 * steady_flops_ / steady_s_ / (peak_flops_ * shape_.world),
                          shape_.fp8_target ? fmt::format(" ({:.1f}% of the FP8 peak)",
                                                   100.0 * steady_flops_ / steady_s_ / (kPeakFp8PerGpu * shape_.world))
                                     : std::string(),
                          peak_mem_gib);
  } else {
    perf += "n/a (one interval)";
  }
  if (intervals_ == 0)
    spdlog::info("summary: no step trained in this run (it resumed at step {} of {})", start_step, shape_.total_steps);
  else
    spdlog::info("summary: loss {:.4f} -> {:.4f}, acceptance length {:.3f}; {}", first_loss_, last_loss_, last_accept_, perf);
  if (steady_steps_ > 0) {
    // Where a step's time goes (target and drafter: mean over ranks; the rest: rank 0).
    const double n = static_cast<double>(steady_steps_), per = steady_s_ / n;
    const StepTimes& t = steady_times_;
    const double other = per - (t.target_s + t.drafter_s + t.comm_s + t.optimizer_s) / n;
    spdlog::info("step time {:.3f} s: target forward {:.3f}, drafter forward+backward {:.3f}, gradient all-reduce wait "
                 "{:.3f}, optimizer {:.3f}, other (data, host) {:.3f}",
                 per, t.target_s / n, t.drafter_s / n, t.comm_s / n, t.optimizer_s / n, other);
  }
}

SteadyState RunMetrics::steady() const {
  SteadyState s;
  s.warmup_steps = warmup_steps_;
  s.steps = steady_steps_;
  s.seconds = steady_s_, s.tokens = steady_tokens_, s.flops = steady_flops_;
  s.times = steady_times_;
  s.last_loss = last_loss_;
  return s;
}

std::string TrainRowShape::shape() const {
  return fmt::format("{} L{} H{} seq={} {} tp={} dp={} drafter={}x{}{}{}{} anchors={} batch={}x{}", model_type,
                     target_layers, hidden, seq_len, precision, tp, dp, drafter_layers, block_size,
                     fp8_drafter ? "-fp8" : "", fp8_drafter && !fp8_wgrad_x_blocks ? "-wgx1" : "", fp8_lm_head ? "-fp8head" : "",
                     anchors, batch, micro_batches);
}

std::vector<bench::Row> training_rows(const TrainRowShape& sh, const SteadyState& s, int world) {
  std::vector<bench::Row> rows;
  if (s.steps <= 0 || !(s.seconds > 0)) return rows;
  const std::string shape = sh.shape(), provider = sh.on_gpu ? "cuda" : "cpu";
  auto row = [&](const std::string& metric, const std::string& unit, double v) {
    rows.push_back({"dflash_train", "step", provider, "train", metric, unit, shape, v, v, v, false});
  };
  const double n = static_cast<double>(s.steps), per = s.seconds / n, tok_s = s.tokens / s.seconds;
  const StepTimes& t = s.times;
  row("trained_tok_s_per_gpu", "tok/s", tok_s / world);
  row("trained_tok_s", "tok/s", tok_s);
  if (sh.on_gpu) {
    const double achieved = s.flops / s.seconds / world;  // FLOP/s per GPU
    row("mfu", "%", 100.0 * achieved / kPeakBf16PerGpu);
    if (sh.fp8_target) row("mfu_fp8_peak", "%", 100.0 * achieved / kPeakFp8PerGpu);
    row("tflops_per_gpu", "TFLOP/s", achieved / 1e12);
    row("peak_mem_gib", "GiB", sh.peak_mem_gib);
  }
  row("step_s", "s", per);
  row("target_fwd_s", "s", t.target_s / n);
  row("drafter_s", "s", t.drafter_s / n);
  row("comm_s", "s", t.comm_s / n);
  row("optimizer_s", "s", t.optimizer_s / n);
  row("other_s", "s", per - (t.target_s + t.drafter_s + t.comm_s + t.optimizer_s) / n);
  row("tokens_per_step", "tokens", s.tokens / n);
  if (std::isfinite(s.last_loss)) row("loss", "nats", s.last_loss);
  row("warmup_steps", "steps", static_cast<double>(s.warmup_steps));
  row("steps_averaged", "steps", n);
  return rows;
}

}  // namespace dflash::trainer
