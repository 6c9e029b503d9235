#include "trainer/train.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <set>
#include <sstream>
#include <thread>

#include <spdlog/spdlog.h>

#include "comm/comm.h"
#include "data/loader.h"
#include "data/synth.h"
#include "kernels/app.h"
#include "drafter/loss.h"
#include "drafter/model.h"
#include "drafter/weights.h"
#include "kernels/log.h"
#include "target_model/model.h"
#include "target_model/tp.h"
#include "target_model/weights.h"
#include "trainer/backend.h"
#include "trainer/optimizer.h"
#include "target_model/flops.h"
#include <unistd.h>

namespace fs = std::filesystem;

namespace dflash::trainer {

namespace {

volatile std::sig_atomic_t g_stop_requested = 0;
extern "C" void on_stop_signal(int) { g_stop_requested = 1; }

// ---- files ----
void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}
void write_text(const fs::path& p, const std::string& text) {
  {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    DFLASH_CHECK_IO(f.good(), "writing", p.string());
    f << text;
    f.flush();
    DFLASH_CHECK_IO(f.good(), "writing", p.string());
  }
  fsync_path(p);
}
std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  DFLASH_CHECK_IO(f.good(), "reading", p.string());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
void fsync_tree(const fs::path& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir)) fsync_path(e.path());
  fsync_path(dir);
}

// ckpt-<step> directories with a COMMIT marker, sorted by step.
std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("ckpt-", 0) != 0 || !e.is_directory()) continue;
    const std::string num = name.substr(5);
    if (num.empty() || !std::all_of(num.begin(), num.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (!fs::exists(e.path() / "COMMIT")) continue;
    out.emplace_back(std::stoll(num), e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// ---- collectives that also work without MPI (world of one) ----
struct Group {
  std::unique_ptr<comm::Communicator> world, tp;
  void sum(std::vector<double>& v) {
    if (!world || v.empty()) return;
    Tensor t = Tensor::from_blob(v.data(), {static_cast<int64_t>(v.size())}, DType::F64);
    world->all_reduce_sum(t);
  }
  void barrier() {
    if (world) world->barrier();
  }
  // Every rank's string, in rank order (on every rank).
  std::vector<std::string> gather(const std::string& mine) {
    if (!world) return {mine};
    const int n = world->size();
    Tensor len = Tensor::empty({1}, DType::I64), lens = Tensor::empty({n}, DType::I64);
    len.data<int64_t>()[0] = static_cast<int64_t>(mine.size());
    world->all_gather(len, lens);
    const int64_t* l = lens.data<int64_t>();
    Tensor in = Tensor::zeros({std::max<int64_t>(*std::max_element(l, l + n), 1)}, DType::U8);
    std::copy(mine.begin(), mine.end(), static_cast<char*>(in.raw_data()));
    Tensor out = Tensor::empty({n * in.size(0)}, DType::U8);
    world->all_gather(in, out);
    std::vector<std::string> all;
    for (int r = 0; r < n; ++r) all.emplace_back(static_cast<const char*>(out.raw_data()) + r * in.size(0), static_cast<size_t>(l[r]));
    return all;
  }
};

// run_dir/fast_path.json: every rank's fast-path record (written at start-up and again at the end
// with the kernel launches counted). Collective: every rank calls it.
void write_fast_path_json(Group& g, TrainBackend& backend, int rank, const fs::path& path, const char* when) {
  const std::vector<std::string> all = g.gather(backend.fast_path_json().dump());
  if (rank != 0) return;
  nlohmann::json doc{{"format", "dflash.fast_path.v1"}, {"when", when}, {"ranks", nlohmann::json::array()}};
  for (size_t r = 0; r < all.size(); ++r) {
    nlohmann::json j = nlohmann::json::parse(all[r]);
    j["rank"] = r;
    doc["ranks"].push_back(std::move(j));
  }
  write_text(path, doc.dump(1) + "\n");
}

// Dense bf16 tensor-core peak of an H100/H200 SXM (the MFU denominator), FLOP/s per GPU.
constexpr double kPeakBf16PerGpu = 989.4e12;

std::string fmt_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = std::llround(s);
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t / 60) % 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

// One status line on stderr, redrawn each step, when rank 0's stderr is a terminal; cleared before
// any log line so the two never mix.
class ProgressBar {
 public:
  ProgressBar(bool on, int64_t total) : on_(on), total_(std::max<int64_t>(total, 1)) {}
  void update(int64_t step, double loss, double elapsed) {
    if (!on_) return;
    const int width = 30;
    const int fill = static_cast<int>(static_cast<double>(width) * static_cast<double>(step) / static_cast<double>(total_));
    const double eta = step > 0 ? elapsed / static_cast<double>(step) * static_cast<double>(total_ - step) : 0;
    std::fprintf(stderr, "\r\033[K[%s%s] %lld/%lld loss %.4f  %s elapsed, eta %s", std::string(fill, '#').c_str(),
                 std::string(width - fill, '.').c_str(), static_cast<long long>(step), static_cast<long long>(total_), loss,
                 fmt_duration(elapsed).c_str(), fmt_duration(eta).c_str());
    std::fflush(stderr);
    drawn_ = true;
  }
  void clear() {
    if (!drawn_) return;
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
    drawn_ = false;
  }

 private:
  bool on_, drawn_ = false;
  int64_t total_;
};

std::string fmt_acc(const drafter::StepStats& s, int64_t B) {
  std::string out;
  for (int64_t k = 1; k < B; ++k) out += fmt::format("{}{:.2f}", k > 1 ? " " : "", s.accuracy(k));
  return out;
}

}  // namespace

void install_stop_handlers() {
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
}

namespace {
struct CheckedConfigs {
  target::TargetConfig target;
  drafter::DrafterConfig drafter;
  bool embedded_target = false;  // the default config's tiny target, from the copy in the binary
};
CheckedConfigs checked_configs(const TrainConfig& cfg, int world, const RunOptions& ropt) {
  cfg.validate(world);
  const auto& ts = cfg.model.target;
  CheckedConfigs c;
  if (cfg.source == TrainConfig::kEmbeddedSource && ts.path.empty() && ts.config == TrainConfig::kTinyTargetPath &&
      !fs::exists(ts.config)) {
    // The default config started outside the repository root: its target's copy built into the binary.
    c.embedded_target = true;
    c.target = target::TargetConfig::from_json(nlohmann::json::parse(TrainConfig::embedded_tiny_target_json()),
                                               std::string("<embedded ") + TrainConfig::kTinyTargetPath + ">");
  } else {
    c.target = target::TargetConfig::from_file(ts.path.empty() ? ts.config : ts.path);
  }
  cfg.validate_against(c.target);
  target::check_tp(c.target, static_cast<int>(cfg.parallel.tp));
  c.drafter = cfg.drafter_config(c.target);
  if (cfg.parallel.device == Backend::Cuda) {
    std::string why;
    DFLASH_CHECK_HINT(cuda_backend_available(ropt.local_size, &why), "parallel.device: cuda, but " << why,
                      "run one rank per GPU (mpirun -n <GPUs per node>), or set parallel.device: cpu");
  }
  return c;
}
}  // namespace

void check_config(const TrainConfig& cfg, int world, const RunOptions& ropt) { checked_configs(cfg, world, ropt); }

namespace {
// Writes checkpoints on a background thread (rank 0) while training goes on. The next checkpoint,
// a stop and the end of the run wait for it; an error in the writer (a full disk) surfaces there
// and stops the run, so no checkpoint is lost silently.
class BackgroundWriter {
 public:
  BackgroundWriter() = default;
  BackgroundWriter(const BackgroundWriter&) = delete;
  BackgroundWriter& operator=(const BackgroundWriter&) = delete;
  ~BackgroundWriter() {
    if (thread_.joinable()) thread_.join();
  }
  void wait() {
    if (thread_.joinable()) thread_.join();
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }
  // Without blocking: rethrows the writer's error once it has finished with one (called every step,
  // so a failed write stops the run at once, not at the next checkpoint).
  void check() {
    if (finished_.load(std::memory_order_acquire)) wait();
  }
  void start(std::function<void()> job) {
    wait();
    finished_.store(false, std::memory_order_relaxed);
    thread_ = std::thread([this, job = std::move(job)] {
      try {
        job();
      } catch (...) {
        error_ = std::current_exception();
      }
      finished_.store(true, std::memory_order_release);
    });
  }

 private:
  std::thread thread_;
  std::exception_ptr error_;
  std::atomic<bool> finished_{false};
};
}  // namespace

RunResult train(const TrainConfig& cfg, int world, int rank, const RunOptions& ropt) {
  using clock = std::chrono::steady_clock;
  const auto t_start = clock::now();
  // Target and drafter configs, checked on every rank before any collective.
  const CheckedConfigs checked = checked_configs(cfg, world, ropt);
  const target::TargetConfig& tcfg = checked.target;
  const drafter::DrafterConfig& dcfg = checked.drafter;
  const comm::Layout layout = comm::make_layout(world, rank, static_cast<int>(cfg.parallel.tp));
  const int tp = layout.tp_size;
  const int64_t B = dcfg.block_size;
  const fs::path run_dir = cfg.logging.run_dir;
  const fs::path ckpt_dir = cfg.checkpoint_dir();

  // A named checkpoint must exist and be complete (checked before any collective).
  if (cfg.checkpoint.resume != "auto" && cfg.checkpoint.resume != "never")
    DFLASH_CHECK_HINT(fs::exists(fs::path(cfg.checkpoint.resume) / "COMMIT"),
                      "checkpoint.resume: '" << cfg.checkpoint.resume << "' is not a complete checkpoint (no COMMIT marker)",
                      "name a ckpt-<step> directory written by dflash_train, or use auto / never");

  // Data files named by the config must exist (checked before anything is written).
  std::vector<std::string> files;
  if (!cfg.data.synth.enabled) files = cfg.expand_data_files();

  Group g;
  if (world > 1) {
    g.world = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, 0, rank, Device::cpu(), cfg.parallel.timeout_s, "world");
    if (tp > 1)
      g.tp = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, layout.tp_group, rank, Device::cpu(),
                                                  cfg.parallel.timeout_s, "tp");
  }

  if (rank == 0) fs::create_directories(run_dir / "logs");
  g.barrier();
  init_logging(rank, ropt.log_level, (run_dir / "logs" / fmt::format("rank-{}.log", rank)).string());
  if (rank == 0) {
    spdlog::info("{}", version_string());
    spdlog::info("config {}:\n{}", cfg.source, cfg.settings_table());
    spdlog::info("world: {} rank(s), tp {}, {} TP group(s) (data parallel)", world, tp, layout.num_tp_groups);
    spdlog::info("target: {}{}", tcfg.summary(),
                 checked.embedded_target ? fmt::format(" (from {}: {} is not under the working directory)", tcfg.source,
                                                       TrainConfig::kTinyTargetPath)
                                         : "");
    spdlog::info("drafter: {}", dcfg.summary());
    write_text(run_dir / "config.yaml", cfg.to_yaml());
  }

  // ---- data ----
  if (cfg.data.synth.enabled) {
    const fs::path sp = cfg.synth_path();
    data::SynthOptions so;
    so.sequences = cfg.data.synth.num_sequences;
    so.min_length = cfg.data.synth.min_length;
    so.max_length = cfg.data.synth.max_length;
    // Keep the mask token out of the corpus when it is the last id of the vocabulary.
    so.vocab_size = cfg.data.synth.vocab_size > 0                ? cfg.data.synth.vocab_size
                    : dcfg.mask_token_id == tcfg.vocab_size - 1 ? tcfg.vocab_size - 1
                                                                : tcfg.vocab_size;
    so.seed = static_cast<uint64_t>(cfg.data.synth.seed);
    data::check_synth_options(so);
    if (rank == 0 && !fs::exists(sp)) {
      if (sp.has_parent_path()) fs::create_directories(sp.parent_path());
      spdlog::info("data: writing the synthetic corpus {} ({} sequences, {}..{} tokens)", sp.string(), so.sequences,
                   so.min_length, so.max_length);
      data::write_synth(sp.string(), so);
    }
    g.barrier();
    files = {sp.string()};
  }
  data::LoaderConfig lc;
  lc.files = files;
  lc.max_length = cfg.data.max_length;
  lc.seed = static_cast<uint64_t>(cfg.training.seed);
  lc.tp_group = layout.tp_group;
  lc.num_tp_groups = layout.num_tp_groups;
  lc.batch = cfg.training.batch_size;
  data::Loader loader(lc);
  DFLASH_CHECK_HINT(loader.dataset().vocab_size() <= tcfg.vocab_size,
                    "data: " << files.front() << (files.size() > 1 ? " (and others)" : "") << " has vocab_size "
                             << loader.dataset().vocab_size() << ", larger than the target's vocabulary of "
                             << tcfg.vocab_size,
                    "tokenize the data with the target's tokenizer");
  DFLASH_CHECK_HINT(loader.slots_per_epoch() > 0,
                    "data: " << loader.dataset().num_sequences() << " sequence(s) cannot be shared by "
                             << layout.num_tp_groups << " TP groups",
                    "use more data or fewer ranks");
  const int64_t seq_per_step = cfg.training.batch_size * cfg.training.micro_batches;
  const int64_t steps_per_epoch = std::max<int64_t>(1, loader.slots_per_epoch() / seq_per_step);
  const int64_t total = cfg.training.max_steps ? *cfg.training.max_steps : *cfg.training.epochs * steps_per_epoch;
  if (rank == 0)
    spdlog::info("data: {} sequences, {} tokens in {} file(s); {} slots per epoch per TP group; {} steps in all",
                 loader.dataset().num_sequences(), loader.dataset().num_tokens(), files.size(),
                 loader.slots_per_epoch(), total);

  // ---- backend: the target and the drafter on the CPU reference or one GPU per rank ----
  Backend device = cfg.parallel.device;  // (cuda was checked to be available by check_config)
  if (device == Backend::Auto) device = cuda_backend_available(ropt.local_size, nullptr) ? Backend::Cuda : Backend::Cpu;
  BackendSetup bs;
  bs.cfg = &cfg, bs.target = tcfg, bs.drafter = dcfg, bs.layout = layout, bs.world = world, bs.rank = rank;
  bs.local_rank = ropt.local_rank, bs.local_size = ropt.local_size;
  std::unique_ptr<TrainBackend> backend =
      device == Backend::Cuda ? make_cuda_backend(bs) : make_cpu_backend(bs, g.world.get(), g.tp.get());
  const bool on_gpu = device == Backend::Cuda;
  const auto& tr = cfg.training;
  const LrSchedule sched{tr.lr, tr.min_lr, tr.warmup_ratio, tr.schedule, total};
  {
    // Every rank's fast-path summary (they may differ across GPUs of a mixed node), then rank 0's plan.
    const std::string fp = backend->fast_path_summary();
    if (!fp.empty()) spdlog::info("fast path (rank {}): {}", rank, fp);
  }
  write_fast_path_json(g, *backend, rank, run_dir / "fast_path.json", "start-up");
  if (rank == 0) {
    spdlog::info("backend: {}", backend->describe());
    spdlog::info("drafter: {:.2f} M trainable parameters; schedule {} lr {:g} -> {:g}, {} warmup step(s)",
                 static_cast<double>(backend->num_params()) / 1e6, schedule_name(tr.schedule), tr.lr, tr.min_lr,
                 sched.warmup_steps());
    const std::string plan = backend->memory_plan();
    if (!plan.empty()) spdlog::info("memory plan per GPU (rank 0):\n{}", plan);
    const std::string init = backend->init_summary(), mem = backend->memory_summary();
    if (!init.empty()) spdlog::info("initialised: {}", init);
    if (!mem.empty()) spdlog::info("after loading: {}", mem);
  }

  // ---- resume ----
  int64_t step = 0, skipped = 0, skipped_in_row = 0;
  {
    fs::path from;
    if (cfg.checkpoint.resume == "auto") {
      auto all = complete_checkpoints(ckpt_dir);
      if (!all.empty()) from = all.back().second;
    } else if (cfg.checkpoint.resume != "never") {
      from = cfg.checkpoint.resume;
    }
    if (!from.empty()) {
      const auto t0 = clock::now();
      const nlohmann::json st = nlohmann::json::parse(read_text(from / "state.json"));
      const int ws = st.at("world").at("world_size").get<int>(), wtp = st.at("world").at("tp").get<int>();
      DFLASH_CHECK_HINT(ws == world && wtp == tp,
                        "checkpoint " << from.string() << " was written by " << ws << " rank(s) with tp " << wtp
                                      << "; this run has " << world << " rank(s) with tp " << tp
                                      << ": resuming on a different world size or tp is not supported",
                        "resume with mpirun -n " << ws << " and parallel.tp = " << wtp
                                                 << ", or set checkpoint.resume: never (or another checkpoint.dir) to start anew");
      backend->load_optimizer((from / "optimizer.safetensors").string(), st.at("optimizer"));
      loader.restore(nlohmann::json::parse(read_text(from / fmt::format("loader-g{}.json", layout.tp_group))));
      step = st.at("step").get<int64_t>();
      skipped = st.at("skipped_steps").get<int64_t>();
      skipped_in_row = st.at("skipped_in_row").get<int64_t>();
      if (rank == 0) {
        spdlog::info("resumed from {} at step {}/{} (read in {:.1f} s)", from.string(), step, total,
                     std::chrono::duration<double>(clock::now() - t0).count());
        if (st.value("total_steps", total) != total)
          spdlog::warn("the checkpoint was written by a run of {} steps; this one has {} (the LR schedule changes)",
                       st.value("total_steps", total), total);
        // Drop metric lines after the checkpoint (a run that went on past it and then died).
        const fs::path mp = run_dir / "metrics.jsonl";
        if (fs::exists(mp)) {
          std::istringstream in(read_text(mp));
          std::string line, kept;
          while (std::getline(in, line)) {
            if (line.empty()) continue;
            auto j = nlohmann::json::parse(line, nullptr, false);
            if (!j.is_discarded() && j.contains("step") && j["step"].get<int64_t>() > step) continue;
            kept += line + "\n";
          }
          write_text(mp, kept);
        }
      }
    } else if (rank == 0 && cfg.checkpoint.resume == "auto") {
      spdlog::info("no complete checkpoint under {}: starting at step 0", ckpt_dir.string());
    }
  }
  std::ofstream metrics;
  if (rank == 0) {
    if (step == 0) fs::remove(run_dir / "metrics.jsonl");
    metrics.open(run_dir / "metrics.jsonl", std::ios::app);
    DFLASH_CHECK_IO(metrics.good(), "opening", (run_dir / "metrics.jsonl").string());
  }

  // ---- checkpoints ----
  // Every rank takes part (the loader position of each TP group); rank 0 copies the drafter and
  // optimizer state to the host and writes the files, in the background when `background` (the
  // periodic ones: the next steps run meanwhile), else before returning (stop, end of run).
  BackgroundWriter writer;
  const std::string cfg_yaml = cfg.to_yaml();
  // Test hook: DFLASH_FAULT_CHECKPOINT_WRITE=N makes the write of the step-N checkpoint fail.
  const size_t keep_last = static_cast<size_t>(cfg.checkpoint.keep_last);
  const char* fault_env = std::getenv("DFLASH_FAULT_CHECKPOINT_WRITE");
  const int64_t fault_checkpoint = fault_env ? std::atoll(fault_env) : -1;
  auto save_checkpoint = [&](int64_t at_step, const nlohmann::json& loader_state, bool background) {
    const fs::path final_dir = ckpt_dir / fmt::format("ckpt-{}", at_step);
    const fs::path tmp = ckpt_dir / fmt::format("ckpt-{}.tmp", at_step);
    if (rank == 0) {
      writer.wait();  // the previous checkpoint is complete (its pruning cannot touch this one)
      fs::remove_all(tmp);
      fs::create_directories(tmp);
    }
    g.barrier();
    if (layout.tp_rank == 0) write_text(tmp / fmt::format("loader-g{}.json", layout.tp_group), loader_state.dump(1) + "\n");
    g.barrier();
    if (rank == 0) {
      const auto t0 = clock::now();
      TrainBackend::CheckpointState cs = backend->checkpoint_state();
      const double copy_s = std::chrono::duration<double>(clock::now() - t0).count();
      nlohmann::json st{{"format", "dflash.checkpoint.v1"},
                        {"step", at_step},
                        {"total_steps", total},
                        {"optimizer", cs.optimizer.json},
                        {"schedule", {{"kind", schedule_name(tr.schedule)}, {"lr", tr.lr}, {"min_lr", tr.min_lr},
                                      {"warmup_steps", sched.warmup_steps()}, {"total_steps", total},
                                      {"next_lr", sched.at(std::min(at_step, total - 1))}}},
                        {"skipped_steps", skipped},
                        {"skipped_in_row", skipped_in_row},
                        {"rng", {{"kind", "philox"}, {"seed", tr.seed},
                                 {"anchor_stream", "step * 2^32 + global sequence index (stateless)"}}},
                        {"world", {{"world_size", world}, {"tp", tp}, {"num_tp_groups", layout.num_tp_groups}}},
                        {"version", version_string()}};
      // A failed write names the checkpoint; the incomplete directory has no COMMIT marker, so resume
      // never takes it, and the newest complete checkpoint is untouched.
      auto write = [=, &dcfg, cs = std::move(cs), st = std::move(st)] {
        try {
          const auto t1 = clock::now();
          if (fault_checkpoint == at_step) DFLASH_FAIL("injected fault (DFLASH_FAULT_CHECKPOINT_WRITE=" << at_step << ")");
          drafter::export_hf((tmp / "drafter").string(), dcfg, cs.weights);
          cs.optimizer.save((tmp / "optimizer.safetensors").string());
          write_text(tmp / "state.json", st.dump(2) + "\n");
          write_text(tmp / "config.yaml", cfg_yaml);
          fsync_tree(tmp);
          fs::remove_all(final_dir);
          fs::rename(tmp, final_dir);
          fsync_path(ckpt_dir);
          write_text(final_dir / "COMMIT", fmt::format("step {}\n", at_step));
          fsync_path(final_dir);
          // keep_last pruning, and leftovers of interrupted writes.
          auto all = complete_checkpoints(ckpt_dir);
          for (size_t i = 0; i + keep_last < all.size(); ++i) fs::remove_all(all[i].second);
          for (const auto& e : fs::directory_iterator(ckpt_dir)) {
            const std::string name = e.path().filename().string();
            if (name.rfind("ckpt-", 0) == 0 && !fs::exists(e.path() / "COMMIT")) fs::remove_all(e.path());
          }
          uintmax_t bytes = 0;
          for (const auto& e : fs::recursive_directory_iterator(final_dir))
            if (e.is_regular_file()) bytes += e.file_size();
          spdlog::info("checkpoint {} written ({:.2f} GiB: state copied in {:.1f} s, files written in {:.1f} s{})",
                       final_dir.string(), static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0), copy_s,
                       std::chrono::duration<double>(clock::now() - t1).count(), background ? " while training went on" : "");
        } catch (const std::exception& e) {
          const auto* de = dynamic_cast<const Error*>(&e);
          DFLASH_FAIL_HINT("checkpoint " << final_dir.string() << " could not be written: " << (de ? de->message() : e.what()),
                           "check the free space and permissions under " << ckpt_dir.string()
                                                                          << "; the newest complete checkpoint there is intact");
        }
      };
      if (background) writer.start(write);
      else write();
    }
    g.barrier();
  };

  // ---- the loop ----
  RunResult result;
  drafter::StepOptions sopt;
  sopt.gamma = tr.gamma;
  drafter::StepStats log_stats;
  StepTimes log_times;
  double log_tokens = 0, log_flops = 0, last_norm = 0, last_lr = 0;
  // For the end-of-run summary: the first and last logged intervals, and the throughput after the
  // first interval (start-up, first-call plans and warm-up excluded).
  double first_loss = NAN, last_loss = NAN, last_accept = NAN, steady_tokens = 0, steady_flops = 0, steady_s = 0;
  int64_t intervals = 0, steady_steps = 0;
  StepTimes steady_times;
  auto log_t0 = clock::now();
  // A resumed run's starting step already has its checkpoint (the one it was read from).
  const int64_t start_step = step;
  int64_t last_ckpt = start_step > 0 ? start_step : -1, log_steps = 0;
  if (rank == 0 && start_step >= total)
    spdlog::warn("nothing to train: this run is complete at step {}/{} (checkpoint.resume: auto found its last "
                 "checkpoint); use another logging.run_dir, checkpoint.resume: never, or more training.epochs / "
                 "training.max_steps to train again",
                 start_step, total);
  const double peak_flops = on_gpu ? kPeakBf16PerGpu : 0.0;
  ProgressBar bar(rank == 0 && cfg.logging.progress_bar && ::isatty(STDERR_FILENO), total);
  // Test hook: DFLASH_FAULT_NONFINITE_STEPS="3,4" makes the gradient norm of those (1-based) steps
  // NaN on every rank, as a non-finite gradient would, to exercise the skip / stop logic.
  std::set<int64_t> fault_nonfinite;
  if (const char* f = std::getenv("DFLASH_FAULT_NONFINITE_STEPS")) {
    std::stringstream ss(f);
    std::string item;
    while (std::getline(ss, item, ','))
      if (!item.empty()) fault_nonfinite.insert(std::stoll(item));
  }

  while (step < total) {
    if (rank == 0) writer.check();  // a background checkpoint write that failed stops the run here
    const nlohmann::json loader_state_before = loader.state();
    const bool stop_here = ropt.stop_after_steps >= 0 && step >= ropt.stop_after_steps;
    // Load this step's micro-batches and sample their blocks (no forward needed for Σw).
    std::vector<MicroBatch> micro(static_cast<size_t>(tr.micro_batches));
    double local_w = 0;
    for (auto& m : micro) {
      data::Batch b = loader.next_batch();
      m.batch.seqs.offsets = {0};
      int64_t blk = 0;
      for (size_t s = 0; s < b.sequences.size(); ++s) {
        const data::Sequence& sq = b.sequences[s];
        const int64_t off = m.batch.seqs.offsets.back(), S = static_cast<int64_t>(sq.ids.size());
        m.batch.tokens.insert(m.batch.tokens.end(), sq.ids.begin(), sq.ids.end());
        m.batch.loss_mask.insert(m.batch.loss_mask.end(), sq.mask.begin(), sq.mask.end());
        m.batch.seqs.offsets.push_back(off + S);
        m.seqs.push_back(sq.ids);
        const uint64_t stream = (static_cast<uint64_t>(step) << 32) + static_cast<uint64_t>(b.indices[s]);
        for (int64_t a : drafter::sample_anchors(sq.mask.data(), S, tr.num_anchors, static_cast<uint64_t>(tr.seed), stream)) {
          if (blk++ % tp != layout.tp_rank) continue;  // round-robin among the ranks of the TP group
          m.batch.blocks.push_back({static_cast<int64_t>(s), a});
          for (int64_t k = 1; k < B; ++k) local_w += drafter::block_label(sq.mask.data(), S, a, k, tr.gamma).weight;
        }
      }
      m.tokens = m.batch.seqs.offsets.back();
    }
    std::vector<double> head{local_w, (g_stop_requested || stop_here) ? 1.0 : 0.0};
    g.sum(head);
    if (head[1] > 0) {
      bar.clear();
      if (rank == 0) spdlog::warn("stop requested: writing a checkpoint at step {} and exiting", step);
      if (last_ckpt != step) save_checkpoint(step, loader_state_before, false);
      if (rank == 0) writer.wait();
      write_fast_path_json(g, *backend, rank, run_dir / "fast_path.json", "stopped");
      result.step = step;
      result.stopped = true;
      return result;
    }
    const double global_w = head[0];

    backend->zero_grads();
    drafter::StepStats stats;
    stats.correct.assign(static_cast<size_t>(B), 0);
    stats.counted.assign(static_cast<size_t>(B), 0);
    StepTimes times;
    double step_tokens = 0, step_flops = 0;
    sopt.grad_scale = global_w > 0 ? 1.0 / global_w : 0.0;
    for (size_t mi = 0; mi < micro.size(); ++mi) {
      MicroBatch& m = micro[mi];
      if (m.seqs.empty()) continue;  // every rank of the group sees the same (empty) batch
      if (layout.tp_rank == 0) step_tokens += static_cast<double>(m.tokens);
      std::vector<int64_t> lens;
      for (const auto& q : m.seqs) lens.push_back(static_cast<int64_t>(q.size()));
      step_flops += target::forward_flops(tcfg, lens) / tp;
      stats.add(backend->micro_step(m, sopt, mi + 1 == micro.size(), times));
      if (!m.batch.blocks.empty() && global_w > 0) step_flops += drafter::step_flops(dcfg, m.batch, true);
    }
    double norm = backend->reduce_grads(times);
    if (fault_nonfinite.count(step + 1)) norm = NAN;  // test hook (DFLASH_FAULT_NONFINITE_STEPS)

    // The step's statistics, summed over all ranks.
    std::vector<double> buf(8 + 2 * static_cast<size_t>(B), 0.0);
    size_t at = 0;
    buf[at++] = stats.weighted_ce_sum;
    buf[at++] = stats.weight_sum;
    buf[at++] = stats.accept_len_sum;
    buf[at++] = static_cast<double>(stats.num_blocks);
    buf[at++] = step_tokens;
    buf[at++] = step_flops;
    buf[at++] = times.target_s;
    buf[at++] = times.drafter_s;
    for (int64_t k = 0; k < B; ++k) buf[at + static_cast<size_t>(k)] = static_cast<double>(stats.correct[static_cast<size_t>(k)]);
    for (int64_t k = 0; k < B; ++k) buf[at + static_cast<size_t>(B + k)] = static_cast<double>(stats.counted[static_cast<size_t>(k)]);
    g.sum(buf);
    at = 0;
    drafter::StepStats gs;
    gs.weighted_ce_sum = buf[at++];
    gs.weight_sum = buf[at++];
    gs.accept_len_sum = buf[at++];
    gs.num_blocks = std::llround(buf[at++]);
    step_tokens = buf[at++];
    step_flops = buf[at++];
    times.target_s = buf[at++] / world;  // mean over ranks
    times.drafter_s = buf[at++] / world;
    gs.correct.resize(static_cast<size_t>(B));
    gs.counted.resize(static_cast<size_t>(B));
    for (int64_t k = 0; k < B; ++k) gs.correct[static_cast<size_t>(k)] = std::llround(buf[at + static_cast<size_t>(k)]);
    for (int64_t k = 0; k < B; ++k) gs.counted[static_cast<size_t>(k)] = std::llround(buf[at + static_cast<size_t>(B + k)]);

    // Clip, update (or skip a non-finite step; identical decision on every rank: the norm is of the
    // all-reduced gradient, the loss of the all-reduced sums).
    const double loss = gs.loss();
    last_norm = norm;
    last_lr = sched.at(step);
    if (!std::isfinite(loss) || !std::isfinite(norm)) {
      ++skipped;
      ++skipped_in_row;
      bar.clear();
      if (rank == 0) spdlog::warn("step {}: non-finite loss {} or grad norm {}: update skipped ({} in a row, {} in all)",
                                  step + 1, loss, norm, skipped_in_row, skipped);
      DFLASH_CHECK_HINT(skipped_in_row < tr.skip_nonfinite_limit,
                        skipped_in_row << " non-finite steps in a row (training.skip_nonfinite_limit = "
                                       << tr.skip_nonfinite_limit << "): stopping at step " << step + 1,
                        "lower training.lr, check the data, or resume from an earlier checkpoint");
    } else {
      skipped_in_row = 0;
      if (gs.weight_sum > 0) backend->apply(last_lr, clip_factor(norm, tr.grad_clip), times);
      log_stats.add(gs);
    }
    log_tokens += step_tokens;
    log_flops += step_flops;
    log_times.add(times);
    ++log_steps;
    ++step;
    const double elapsed = std::chrono::duration<double>(clock::now() - t_start).count();
    bar.update(step, gs.loss(), elapsed);

    if (step % cfg.logging.interval == 0 || step == total) {
      const double dt = std::chrono::duration<double>(clock::now() - log_t0).count();
      const double tok_s = dt > 0 ? log_tokens / dt : 0.0;
      const double mfu = peak_flops > 0 && dt > 0 ? 100.0 * log_flops / dt / (peak_flops * world) : 0.0;
      const double mem = backend->peak_memory_gib();
      if (rank == 0) {
        bar.clear();
        const double eta = step > 0 ? elapsed / static_cast<double>(step) * static_cast<double>(total - step) : 0;
        std::string perf = fmt::format("{:.0f} tok/s ({:.0f}/{})", tok_s, tok_s / world, on_gpu ? "GPU" : "rank");
        if (peak_flops > 0) perf += fmt::format(" | MFU {:.1f}% | mem {:.1f} GiB", mfu, mem);
        spdlog::info("step {}/{} | loss {:.4f} | acc[1..{}] {} | accept {:.3f} | lr {:.3e} | gnorm {:.3f} | {} | eta {}",
                     step, total, log_stats.loss(), B - 1, fmt_acc(log_stats, B), log_stats.accept_len(), last_lr,
                     last_norm, perf, fmt_duration(eta));
        nlohmann::json acc = nlohmann::json::array();
        for (int64_t k = 1; k < B; ++k) acc.push_back(log_stats.accuracy(k));
        const double n = static_cast<double>(std::max<int64_t>(log_steps, 1));
        nlohmann::json line{{"step", step},          {"total", total},         {"loss", log_stats.loss()},
                            {"acc", acc},            {"accept_len", log_stats.accept_len()},
                            {"lr", last_lr},         {"grad_norm", last_norm}, {"tok_s", tok_s},
                            {"tok_s_per_gpu", tok_s / world},
                            {"skipped", skipped},    {"elapsed_s", elapsed},
                            {"time_s", {{"target", log_times.target_s}, {"drafter", log_times.drafter_s},
                                        {"comm", log_times.comm_s}, {"optimizer", log_times.optimizer_s},
                                        {"interval", dt}, {"per_step", dt / n}}}};
        if (peak_flops > 0) line["mfu"] = mfu, line["mem_gib"] = mem, line["tflops_per_gpu"] = log_flops / dt / world / 1e12;
        metrics << line.dump() << "\n";
        metrics.flush();
      }
      if (intervals++ == 0) {
        first_loss = log_stats.loss();
      } else {
        steady_tokens += log_tokens, steady_flops += log_flops, steady_s += dt;
        steady_times.add(log_times);
        steady_steps += log_steps;
      }
      last_loss = log_stats.loss(), last_accept = log_stats.accept_len();
      log_stats = drafter::StepStats{};
      log_tokens = log_flops = 0;
      log_times = StepTimes{};
      log_steps = 0;
      log_t0 = clock::now();
    }
    if (step % cfg.checkpoint.interval == 0 && step < total) {
      bar.clear();
      save_checkpoint(step, loader.state(), true);
      last_ckpt = step;
    }
  }
  bar.clear();

  if (last_ckpt != step && cfg.checkpoint.at_end) save_checkpoint(step, loader.state(), false);
  if (rank == 0) writer.wait();  // a periodic checkpoint still being written
  write_fast_path_json(g, *backend, rank, run_dir / "fast_path.json", "end of run");
  result.step = step;
  result.drafter_dir = (run_dir / "drafter").string();
  if (rank == 0) {
    // The final drafter: when a complete checkpoint of this very step exists (checkpoint.at_end),
    // its drafter/ is that export already: hard-link its files (a copy across file systems)
    // instead of writing the same gigabytes again; otherwise export the weights.
    const fs::path end_ckpt = ckpt_dir / fmt::format("ckpt-{}", step);
    if (fs::exists(end_ckpt / "COMMIT") && fs::is_directory(end_ckpt / "drafter")) {
      const fs::path out = result.drafter_dir;
      fs::remove_all(out);
      fs::create_directories(out);
      for (const auto& e : fs::directory_iterator(end_ckpt / "drafter")) {
        std::error_code ec;
        fs::create_hard_link(e.path(), out / e.path().filename(), ec);
        if (ec) fs::copy_file(e.path(), out / e.path().filename(), fs::copy_options::overwrite_existing);
      }
      fsync_tree(out);
    } else {
      drafter::export_hf(result.drafter_dir, dcfg, backend->weights());
    }
    const auto& c = loader.counters();
    spdlog::info("data: {} sequences seen, {} truncated, {} skipped without an anchor, {} epoch(s) done", c.seen,
                 c.truncated, c.skipped_no_anchor, c.epochs);
    spdlog::info("done: {} steps ({} skipped as non-finite) in {:.1f} s; drafter exported to {}", step, skipped,
                 std::chrono::duration<double>(clock::now() - t_start).count(), result.drafter_dir);
    std::string perf = "throughput after the first log interval: ";
    if (steady_s > 0) {
      perf += fmt::format("{:.0f} tok/s ({:.0f} per {})", steady_tokens / steady_s, steady_tokens / steady_s / world,
                          on_gpu ? "GPU" : "rank");
      if (peak_flops > 0)
        perf += fmt::format(", MFU {:.1f}%, peak memory {:.1f} GiB", 100.0 * steady_flops / steady_s / (peak_flops * world),
                            backend->peak_memory_gib());
    } else {
      perf += "n/a (one interval)";
    }
    if (intervals == 0)
      spdlog::info("summary: no step trained in this run (it resumed at step {} of {})", start_step, total);
    else
      spdlog::info("summary: loss {:.4f} -> {:.4f}, acceptance length {:.3f}; {}", first_loss, last_loss, last_accept, perf);
    if (steady_steps > 0) {
      // Where a step's time goes (target and drafter: mean over ranks; the rest: rank 0).
      const double n = static_cast<double>(steady_steps), per = steady_s / n;
      const StepTimes& t = steady_times;
      const double other = per - (t.target_s + t.drafter_s + t.comm_s + t.optimizer_s) / n;
      spdlog::info("step time {:.3f} s: target forward {:.3f}, drafter forward+backward {:.3f}, gradient all-reduce wait "
                   "{:.3f}, optimizer {:.3f}, other (data, host) {:.3f}",
                   per, t.target_s / n, t.drafter_s / n, t.comm_s / n, t.optimizer_s / n, other);
    }
  }
  g.barrier();
  return result;
}

}  // namespace dflash::trainer
