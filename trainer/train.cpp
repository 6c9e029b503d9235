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
#include "data/regenerate.h"
#include "data/synth.h"
#include "kernels/app.h"
#include "kernels/io.h"
#include "drafter/loss.h"
#include "drafter/model.h"
#include "drafter/weights.h"
#include "kernels/log.h"
#include "target_model/model.h"
#include "target_model/runtime.h"
#include "target_model/tp.h"
#include "target_model/weights.h"
#include "trainer/backend.h"
#include "trainer/optimizer.h"
#include "target_model/flops.h"

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

// The ckpt-<step> directories under `dir` that are complete, as "ckpt-8, ckpt-12" (for messages).
std::string checkpoint_names(const std::vector<std::pair<int64_t, fs::path>>& all, size_t max = 6) {
  std::string out;
  for (size_t i = 0; i < all.size(); ++i) {
    if (i == max) return out + fmt::format(" and {} more", all.size() - max);
    out += (i ? ", " : "") + all[i].second.filename().string();
  }
  return out;
}

// Metric lines of metrics.jsonl: every complete line ('\n'-terminated) that is a JSON object with an
// integer step in (previous kept step, max_step]; what is dropped is counted (a line cut by a full
// disk or a crash, lines after the checkpoint a resumed run starts from, repeats).
struct KeptMetrics {
  std::string text;
  int64_t kept = 0, dropped_after = 0, dropped_bad = 0;
};
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

// A metrics.jsonl of an earlier start of this run directory that reached no checkpoint: kept, under
// the next free name metrics.before-<n>.jsonl (never deleted).
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

// Trainable parameters of a drafter of config c (from the shapes alone: no weights needed).
int64_t drafter_param_count(const drafter::DrafterConfig& c) {
  drafter::DrafterWeights w;
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  int64_t n = 0;
  for (const auto& e : w.entries(c)) n += shape_numel(e.shape);
  return n;
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
  // Runs `check` on this rank; when it throws on any rank, every rank throws the error of the
  // lowest failing rank as a StartupError (each prints the same message and exits 1, none aborts
  // the job). Collective: every rank calls it.
  void agree(const std::function<void()>& check) {
    std::string mine;
    try {
      check();
    } catch (const Error& e) {
      mine = "E" + e.message() + '\x1f' + e.hint() + '\x1f' + e.where();
    } catch (const std::exception& e) {
      mine = std::string("E") + e.what() + "\x1f\x1f";
    }
    const std::vector<std::string> all = gather(mine);
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r].empty()) continue;
      const std::string& m = all[r];
      const size_t a = m.find('\x1f'), b = m.find('\x1f', a + 1);
      std::string msg = m.substr(1, a - 1);
      if (all.size() > 1) msg = fmt::format("rank {}: {}", r, msg);
      throw StartupError(msg, m.substr(a + 1, b - a - 1), m.substr(b + 1));
    }
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

// Dense bf16 tensor-core peak of an H100/H200 SXM (the MFU denominator), FLOP/s per GPU; and the
// dense FP8 one (an FP8 target's runs also report MFU against it).
constexpr double kPeakBf16PerGpu = 989.4e12;
constexpr double kPeakFp8PerGpu = 1978.9e12;

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

// Where a run continues from: a complete checkpoint with its state.json and this TP group's loader
// position read and checked (before any GPU work), or none (step 0).
struct ResumePoint {
  fs::path from;  // empty: start at step 0
  nlohmann::json state, loader;
  int64_t step = 0, skipped = 0, skipped_in_row = 0;
};

// "an older complete checkpoint exists: ..." / "no older complete checkpoint exists ...": what a
// user can do when checkpoint `bad` cannot be resumed.
std::string older_checkpoint_hint(const fs::path& bad) {
  const fs::path dir = bad.parent_path();
  auto all = complete_checkpoints(dir);
  std::erase_if(all, [&](const auto& c) { return c.second.filename() == bad.filename(); });
  if (all.empty())
    return fmt::format("no other complete checkpoint exists under {}: move {} away and start the run again from step 0",
                       dir.string(), bad.string());
  const auto& prev = all.back();
  return fmt::format("an older complete checkpoint exists: {} (step {}); move {} out of {} and run again: "
                     "checkpoint.resume: auto then resumes from the newest remaining one",
                     prev.second.string(), prev.first, bad.string(), dir.string());
}

// Reads a JSON file of checkpoint `ckpt`; a missing or unparsable file names itself and the checkpoint.
nlohmann::json read_checkpoint_json(const fs::path& ckpt, const std::string& name) {
  const fs::path p = ckpt / name;
  std::error_code ec;
  DFLASH_CHECK_HINT(fs::is_regular_file(p, ec), "checkpoint " << ckpt.string() << " cannot be resumed: it has no " << name,
                    older_checkpoint_hint(ckpt));
  std::string why;
  try {
    nlohmann::json j = nlohmann::json::parse(read_text(p));
    if (j.is_object()) return j;
    why = "it is not a JSON object";
  } catch (const nlohmann::json::parse_error& e) {
    why = e.what();
  }
  DFLASH_FAIL_HINT("checkpoint " << ckpt.string() << " cannot be resumed: " << p.string() << " is corrupt (" << why << ")",
                   older_checkpoint_hint(ckpt));
}

ResumePoint find_resume_point(const TrainConfig& cfg, const fs::path& ckpt_dir, int world, int tp, int tp_group) {
  const auto all = complete_checkpoints(ckpt_dir);
  ResumePoint rp;
  const std::string& mode = cfg.checkpoint.resume;
  if (mode == "never") {
    // A new run beside an earlier run's checkpoints would write its own among them: keep_last would
    // prune by step across both runs, and auto would later resume whichever is newest.
    DFLASH_CHECK_HINT(all.empty(),
                      "checkpoint.resume: never, but " << ckpt_dir.string() << " holds complete checkpoints of an earlier run ("
                                                       << checkpoint_names(all)
                                                       << "); a new run there would mix its checkpoints with them",
                      "give the new run its own directory (--set logging.run_dir=NEW_DIR, or checkpoint.dir), or continue "
                      "the earlier run with checkpoint.resume: auto, or move those checkpoints away to start over here");
    return rp;
  }
  if (mode == "auto") {
    if (all.empty()) return rp;
    rp.from = all.back().second;
  } else {
    rp.from = mode;
    DFLASH_CHECK_HINT(fs::exists(rp.from / "COMMIT"),
                      "checkpoint.resume: '" << mode << "' is not a complete checkpoint (no COMMIT marker)",
                      "name a ckpt-<step> directory written by dflash_train, or use auto / never");
  }
  rp.state = read_checkpoint_json(rp.from, "state.json");
  int ws = 0, wtp = 0;
  std::string bad;  // what is wrong with state.json's fields
  try {
    rp.step = rp.state.at("step").get<int64_t>();
    ws = rp.state.at("world").at("world_size").get<int>();
    wtp = rp.state.at("world").at("tp").get<int>();
    rp.skipped = rp.state.at("skipped_steps").get<int64_t>();
    rp.skipped_in_row = rp.state.at("skipped_in_row").get<int64_t>();
    if (!rp.state.at("optimizer").is_object()) bad = "'optimizer' is not an object";
    else if (rp.step < 0) bad = fmt::format("step {} is negative", rp.step);
  } catch (const nlohmann::json::exception& e) {
    bad = fmt::format("it lacks a field or has a wrong type ({})", e.what());
  }
  DFLASH_CHECK_HINT(bad.empty(),
                    "checkpoint " << rp.from.string() << " cannot be resumed: " << (rp.from / "state.json").string() << ": "
                                  << bad,
                    older_checkpoint_hint(rp.from));
  DFLASH_CHECK_HINT(ws == world && wtp == tp,
                    "checkpoint " << rp.from.string() << " was written by " << ws << " rank(s) with tp " << wtp
                                  << "; this run has " << world << " rank(s) with tp " << tp
                                  << ": resuming on a different world size or tp is not supported",
                    "resume with mpirun -n " << ws << " and parallel.tp = " << wtp
                                             << ", or give the new run its own logging.run_dir to start anew");
  rp.loader = read_checkpoint_json(rp.from, fmt::format("loader-g{}.json", tp_group));
  DFLASH_CHECK_HINT(fs::is_regular_file(rp.from / "optimizer.safetensors"),
                    "checkpoint " << rp.from.string() << " cannot be resumed: it has no optimizer.safetensors",
                    older_checkpoint_hint(rp.from));
  // Later checkpoints than the one resumed (checkpoint.resume: PATH) belong to another run or to a
  // later point of this one: this run would overwrite them at their steps and prune by step among them.
  std::vector<std::pair<int64_t, fs::path>> later;
  for (const auto& c : all)
    if (c.first > rp.step) later.push_back(c);
  DFLASH_CHECK_HINT(later.empty(),
                    "checkpoint.resume: " << rp.from.string() << " is at step " << rp.step << ", but " << ckpt_dir.string()
                                          << " already holds later checkpoints (" << checkpoint_names(later)
                                          << "): this run would overwrite and prune them",
                    "resume from the newest (checkpoint.resume: auto), or give this run its own logging.run_dir or "
                    "checkpoint.dir");
  return rp;
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
  cfg.validate_against(c.target);  // (checks tp against the heads, naming the config)
  c.drafter = cfg.drafter_config(c.target);
  if (cfg.parallel.device == Backend::Cuda) {
    std::string why;
    DFLASH_CHECK_HINT(cuda_backend_available(ropt.local_size, &why), "parallel.device: cuda, but " << why,
                      "run one rank per GPU (mpirun -n <GPUs per node>), or set parallel.device: cpu");
  } else if (cfg.parallel.device == Backend::Auto && cfg.kernels.require_fast_path) {
    // auto would quietly take the CPU reference: exactly the slow path require_fast_path refuses.
    std::string why;
    DFLASH_CHECK_HINT(cuda_backend_available(ropt.local_size, &why),
                      "kernels.require_fast_path: true, but parallel.device: auto would train on the CPU reference (it has "
                      "no fast path): " << why,
                      "run on a node with one GPU per rank, or set kernels.require_fast_path: false and parallel.device: "
                      "cpu to use the CPU reference on purpose");
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

  // ---- start-up checks, agreed on by every rank before any GPU work ----
  // The directories this rank writes: every rank its log under run_dir/logs; the first rank of each
  // TP group its loader position into each checkpoint; rank 0 the rest of the checkpoint. A
  // checkpoint holds the bf16 export and the fp32 master weights and two AdamW moments.
  const std::string ckpt_what = cfg.checkpoint.dir.empty() ? "the checkpoint directory (<logging.run_dir>/checkpoints)"
                                                           : "checkpoint.dir";
  const uint64_t ckpt_bytes = 14 * static_cast<uint64_t>(drafter_param_count(dcfg));
  constexpr uint64_t kRunDirMinFree = 64ull << 20;  // logs and metrics of a long run
  std::string space_warning;
  g.agree([&] {
    const uint64_t run_free = io::check_writable_dir(run_dir.string(), "logging.run_dir");
    io::check_writable_dir((run_dir / "logs").string(), "the log directory <logging.run_dir>/logs");
    if (layout.tp_rank == 0) io::check_writable_dir(ckpt_dir.string(), ckpt_what);
    if (rank != 0) return;
    DFLASH_CHECK_HINT(run_free >= kRunDirMinFree,
                      "logging.run_dir '" << run_dir.string() << "' has " << io::format_bytes(run_free)
                                          << " free; the run's logs and metrics need at least "
                                          << io::format_bytes(kRunDirMinFree),
                      "free space there or set logging.run_dir to another file system");
    const uint64_t ck_free = io::free_bytes(ckpt_dir.string());
    DFLASH_CHECK_HINT(ck_free >= ckpt_bytes + ckpt_bytes / 20,
                      ckpt_what << " '" << ckpt_dir.string() << "' has " << io::format_bytes(ck_free)
                                << " free, less than one checkpoint of this drafter ("
                                << io::format_bytes(ckpt_bytes) << "): the first checkpoint would fail",
                      "free space there, or set checkpoint.dir to a file system with room for checkpoint.keep_last + 1 = "
                          << cfg.checkpoint.keep_last + 1 << " checkpoints (" << io::format_bytes(ckpt_bytes * (cfg.checkpoint.keep_last + 1))
                          << ")");
    const uint64_t peak = ckpt_bytes * static_cast<uint64_t>(cfg.checkpoint.keep_last + 1);
    if (ck_free < peak)
      space_warning = fmt::format("{} '{}' has {} free; checkpoint.keep_last = {} complete checkpoints plus the one being "
                                  "written need {} ({} each): a later checkpoint may fail for lack of space",
                                  ckpt_what, ckpt_dir.string(), io::format_bytes(ck_free), cfg.checkpoint.keep_last,
                                  io::format_bytes(peak), io::format_bytes(ckpt_bytes));
  });
  if (world > 1) {
    // Every rank that writes into a checkpoint must see the same directory (rank 0 collects it).
    const fs::path marker = ckpt_dir / g.gather(fmt::format(".dflash-shared-{}", ::getpid())).front();
    g.agree([&] {
      if (rank == 0) write_text(marker, "rank 0\n");
    });
    g.agree([&] {
      if (layout.tp_rank == 0)
        DFLASH_CHECK_HINT(fs::exists(marker), ckpt_what << " '" << ckpt_dir.string()
                                                        << "' is not the directory rank 0 writes checkpoints to (a file rank 0 "
                                                           "made there is not visible here)",
                          "put checkpoint.dir (and logging.run_dir) on a file system every node of the job shares");
    });
    if (rank == 0) fs::remove(marker);
  }
  // Where the run continues from (state.json and the loader position read and checked now, not
  // after the target is loaded).
  ResumePoint resume;
  g.agree([&] { resume = find_resume_point(cfg, ckpt_dir, world, tp, layout.tp_group); });

  init_logging(rank, ropt.log_level, (run_dir / "logs" / fmt::format("rank-{}.log", rank)).string());
  if (rank == 0) {
    spdlog::info("{}", version_string());
    spdlog::info("config {}:\n{}", cfg.source, cfg.settings_table());
    spdlog::info("world: {} rank(s), tp {}, {} TP group(s){}", world, tp, layout.num_tp_groups,
                 layout.num_tp_groups > 1 ? " (data parallel over the groups)" : " (no data parallelism)");
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
    g.agree([&] {
      if (rank != 0 || fs::exists(sp)) return;
      if (sp.has_parent_path()) fs::create_directories(sp.parent_path());
      spdlog::info("data: writing the synthetic corpus {} ({} sequences, {}..{} tokens)", sp.string(), so.sequences,
                   so.min_length, so.max_length);
      data::write_synth(sp.string(), so);
    });
    files = {sp.string()};
  }
  Backend device = cfg.parallel.device;  // (cuda was checked to be available by check_config)
  if (device == Backend::Auto) device = cuda_backend_available(ropt.local_size, nullptr) ? Backend::Cuda : Backend::Cpu;
  if (cfg.data.regenerate.enabled) {
    // The prompts of the data get the target's own responses, made on first use (a restart continues
    // the parts on disk; a later run reuses the file when its settings match).
    const auto& rc = cfg.data.regenerate;
    data::RegenerateOptions ro;
    ro.inputs = files;
    ro.out = cfg.regenerate_path();
    ro.num_prompts = rc.num_prompts > 0 ? rc.num_prompts : -1;
    ro.max_prompt_len = rc.max_prompt_len > 0 ? rc.max_prompt_len : -1;
    ro.gen.max_new_tokens = rc.max_new_tokens;
    for (int64_t t : rc.stop_tokens) ro.gen.stop_tokens.push_back(static_cast<int32_t>(t));
    if (rc.temperature > 0)
      ro.gen.sample = ops::SampleParams{static_cast<float>(rc.temperature), static_cast<float>(rc.top_p), static_cast<uint64_t>(rc.seed)};
    ro.slots = rc.slots;
    ro.progress = cfg.logging.progress_bar;
    const target::TargetSource src = cfg.model.target.source();
    ro.target_identity = src.identity(tcfg);
    data::RegenerateSummary rs;
    if (data::regenerated_file_matches(ro)) {
      if (rank == 0) spdlog::info("data: using the regenerated data {} (made earlier with these settings)", ro.out);
    } else {
      if (rank == 0)
        spdlog::info("data: regenerating the responses of {} with the target into {} ({} new tokens at most, {})", files.front(),
                     ro.out, ro.gen.max_new_tokens,
                     ro.gen.sample ? fmt::format("temperature {:g}, top_p {:g}", rc.temperature, rc.top_p) : "greedy");
      g.agree([&] {
        if (rank == 0) fs::create_directories(fs::path(ro.out).parent_path());
      });
      const Device rdev = device == Backend::Cuda ? Device::cuda(ropt.local_rank) : Device::cpu();
      std::unique_ptr<comm::Communicator> rtp;
      if (tp > 1)
        rtp = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, layout.tp_group, rank, rdev, cfg.parallel.timeout_s,
                                                   "regenerate-tp");
      {  // the target lives only while it regenerates (training loads its own)
        target::TargetRuntime rt(src, tcfg, rdev, tp, layout.tp_rank, rtp.get(), cfg.kernels.require_fast_path);
        const std::unique_ptr<target::Decoder> dec = rt.make_decoder(ro.slots, data::regenerate_max_len(ro));
        data::RegenerateLayout lay;
        lay.group = layout.tp_group, lay.num_groups = layout.num_tp_groups;
        lay.writer = layout.tp_rank == 0, lay.leader = rank == 0;
        if (g.world) lay.barrier = [&] { g.world->barrier(); };
        rs = data::regenerate(*dec, ro, lay);
      }
      if (rank == 0) spdlog::info("data: {}", data::format_summary(rs, ro));
    }
    files = {ro.out};
  }
  data::LoaderConfig lc;
  lc.files = files;
  lc.max_length = cfg.data.max_length;
  lc.seed = static_cast<uint64_t>(cfg.training.seed);
  lc.tp_group = layout.tp_group;
  lc.num_tp_groups = layout.num_tp_groups;
  lc.batch = cfg.training.batch_size;
  std::unique_ptr<data::Loader> loader_ptr;
  // Every token and mask of every file is checked now, each rank a contiguous share of the
  // sequences, so bad data stops the run here, naming the file and the sequence, not when the
  // loader reaches it hours in.
  data::DatasetStats data_stats;
  const auto t_data = clock::now();
  g.agree([&] {
    loader_ptr = std::make_unique<data::Loader>(lc);
    const data::Dataset& ds = loader_ptr->dataset();
    DFLASH_CHECK_HINT(ds.vocab_size() <= tcfg.vocab_size,
                      "data: " << files.front() << (files.size() > 1 ? " (and others)" : "") << " has vocab_size "
                               << ds.vocab_size() << ", larger than the target's vocabulary of " << tcfg.vocab_size,
                      "tokenize the data with the target's tokenizer");
    const int64_t n = ds.num_sequences();
    data_stats = ds.check_contents(n * rank / world, n * (rank + 1) / world, cfg.data.max_length,
                                   fmt::format("the target's vocabulary has {} ids; tokenize the data with the target's "
                                               "tokenizer and convert it with --vocab-size {}",
                                               tcfg.vocab_size, tcfg.vocab_size));
  });
  data::Loader& loader = *loader_ptr;
  {
    std::vector<double> v{static_cast<double>(data_stats.sequences), static_cast<double>(data_stats.tokens),
                          static_cast<double>(data_stats.supervised), static_cast<double>(data_stats.no_anchor)};
    g.sum(v);
    const int64_t nseq = std::llround(v[0]), ntok = std::llround(v[1]), nsup = std::llround(v[2]), nna = std::llround(v[3]);
    const std::string where = files.front() + (files.size() > 1 ? fmt::format(" and {} more file(s)", files.size() - 1) : "");
    // Identical sums on every rank: every rank refuses alike.
    if (nsup == 0)
      throw StartupError(fmt::format("data: no token of the {} sequences in {} is supervised (every loss_mask value is 0): "
                                     "there is nothing to train on", nseq, where),
                         "set loss_mask = 1 on the tokens the drafter should learn to predict (the responses); "
                         "`dflash_data stats` shows the supervised share");
    if (nna == nseq)
      throw StartupError(fmt::format("data: none of the {} sequences in {} has two consecutive supervised tokens within "
                                     "data.max_length = {}, so no anchor block can be drawn: there is nothing to train on",
                                     nseq, where, cfg.data.max_length),
                         "an anchor needs loss_mask = 1 at two neighbouring positions; check the masks, or raise "
                         "data.max_length if the supervised tokens come late");
    if (rank == 0) {
      spdlog::info("data: checked {} sequences, {} tokens ({} supervised) of {} file(s) in {:.2f} s on {} rank(s)", nseq, ntok,
                   nsup, files.size(), std::chrono::duration<double>(clock::now() - t_data).count(), world);
      if (nna > 0 && static_cast<double>(nna) >= 0.05 * static_cast<double>(nseq))
        spdlog::warn("data: {} of {} sequences ({:.1f}%) have no two consecutive supervised tokens within data.max_length = "
                     "{}: the loader skips them (each leaves its batch slot empty)",
                     nna, nseq, 100.0 * static_cast<double>(nna) / static_cast<double>(nseq), cfg.data.max_length);
      if (!space_warning.empty()) spdlog::warn("{}", space_warning);
    }
  }
  const int64_t seq_per_step = cfg.training.batch_size * cfg.training.micro_batches;
  const int64_t steps_per_epoch = std::max<int64_t>(1, loader.slots_per_epoch() / seq_per_step);
  const int64_t total = cfg.training.max_steps ? *cfg.training.max_steps : *cfg.training.epochs * steps_per_epoch;
  if (rank == 0)
    spdlog::info("data: {} sequences, {} tokens in {} file(s); {} slots per epoch per TP group; {} steps in all",
                 loader.dataset().num_sequences(), loader.dataset().num_tokens(), files.size(),
                 loader.slots_per_epoch(), total);

  // ---- backend: the target and the drafter on the CPU reference or one GPU per rank ----
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

  // ---- resume (the checkpoint was found and its JSON files read at start-up) ----
  int64_t step = 0, skipped = 0, skipped_in_row = 0;
  if (!resume.from.empty()) {
    const auto t0 = clock::now();
    const fs::path& from = resume.from;
    try {
      backend->load_optimizer((from / "optimizer.safetensors").string(), resume.state.at("optimizer"));
      loader.restore(resume.loader);
    } catch (const Error& e) {
      DFLASH_FAIL_HINT("checkpoint " << from.string() << " cannot be resumed: " << e.message(), older_checkpoint_hint(from));
    }
    step = resume.step, skipped = resume.skipped, skipped_in_row = resume.skipped_in_row;
    if (rank == 0) {
      spdlog::info("resumed from {} at step {}/{} (read in {:.1f} s)", from.string(), step, total,
                   std::chrono::duration<double>(clock::now() - t0).count());
      if (resume.state.value("total_steps", total) != total)
        spdlog::warn("the checkpoint was written by a run of {} steps; this one has {} (the LR schedule changes)",
                     resume.state.value("total_steps", total), total);
    }
  } else if (rank == 0 && cfg.checkpoint.resume == "auto") {
    spdlog::info("no complete checkpoint under {}: starting at step 0", ckpt_dir.string());
  }
  io::AppendFile metrics;
  if (rank == 0) {
    const fs::path mp = run_dir / "metrics.jsonl";
    if (step == 0) {
      move_metrics_aside(mp);
    } else if (fs::exists(mp)) {
      // Keep the lines up to the checkpoint's step: a run that went on past it and then died, or one
      // whose last line a full disk cut, leaves lines that the resumed steps replace.
      const KeptMetrics k = keep_metric_lines(read_text(mp), step);
      if (k.dropped_after || k.dropped_bad) {
        io::write_file_atomic(mp.string(), k.text);
        spdlog::info("metrics: kept {} line(s) of {} up to step {}; dropped {} after it and {} cut or invalid", k.kept,
                     mp.string(), step, k.dropped_after, k.dropped_bad);
      }
    }
    metrics = io::AppendFile(mp.string());
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
    // The logs and metrics up to this step reach the disk with the checkpoint (a full NFS volume
    // reports only at fsync): a failure stops the run here.
    sync_log_file();
    if (rank == 0) metrics.sync();
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
        const auto t1 = clock::now();
        try {
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
        } catch (const std::exception& e) {
          const auto* de = dynamic_cast<const Error*>(&e);
          DFLASH_FAIL_HINT("checkpoint " << final_dir.string() << " could not be written: " << (de ? de->message() : e.what()),
                           "check the free space and permissions under " << ckpt_dir.string()
                                                                          << "; the newest complete checkpoint there is intact");
        }
        // The checkpoint is complete. keep_last pruning among this run's checkpoints up to this step
        // (start-up refused a directory with later ones), and leftovers of interrupted writes; a failure
        // here costs disk space, not the checkpoint: it is reported and the run goes on.
        std::error_code ec;
        auto all = complete_checkpoints(ckpt_dir);
        std::erase_if(all, [&](const auto& c) { return c.first > at_step; });
        for (size_t i = 0; i + keep_last < all.size(); ++i)
          if (fs::remove_all(all[i].second, ec) == static_cast<std::uintmax_t>(-1) || ec)
            spdlog::warn("checkpoint.keep_last: could not remove {}: {}", all[i].second.string(), ec.message());
        for (const auto& e : fs::directory_iterator(ckpt_dir, ec)) {
          const std::string name = e.path().filename().string();
          if (name.rfind("ckpt-", 0) == 0 && e.path() != final_dir && !fs::exists(e.path() / "COMMIT")) fs::remove_all(e.path(), ec);
        }
        {
          uintmax_t bytes = 0;
          for (auto it = fs::recursive_directory_iterator(final_dir, ec); !ec && it != fs::recursive_directory_iterator();
               it.increment(ec))
            if (it->is_regular_file(ec)) bytes += it->file_size(ec);
          spdlog::info("checkpoint {} written ({:.2f} GiB: state copied in {:.1f} s, files written in {:.1f} s{})",
                       final_dir.string(), static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0), copy_s,
                       std::chrono::duration<double>(clock::now() - t1).count(), background ? " while training went on" : "");
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
  // Test hook (CPU backend): DFLASH_FAULT_MASK=causal_in_block | anchor_inclusive trains with one of
  // the two published training-mask bugs (drafter/model.h MaskVariant), so the quality gate can
  // show what such a drafter measures in speculative decoding.
  if (const char* m = std::getenv("DFLASH_FAULT_MASK")) {
    const std::string v = m;
    DFLASH_CHECK_HINT(v == "causal_in_block" || v == "anchor_inclusive",
                      "DFLASH_FAULT_MASK=" << v << " is not a mask variant", "use causal_in_block or anchor_inclusive");
    DFLASH_CHECK_HINT(!on_gpu, "DFLASH_FAULT_MASK is a CPU-backend test hook", "set parallel.device: cpu");
    sopt.mask = v == "causal_in_block" ? drafter::MaskVariant::CausalInBlock : drafter::MaskVariant::AnchorInclusive;
    if (rank == 0) spdlog::warn("test hook DFLASH_FAULT_MASK={}: training with a broken attention mask", v);
  }
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
                 "checkpoint); to train again give the new run its own logging.run_dir, or raise training.epochs / "
                 "training.max_steps to continue this one",
                 start_step, total);
  const double peak_flops = on_gpu ? kPeakBf16PerGpu : 0.0;
  const bool fp8_target = target::resolve_precision(cfg.model.target.precision, tcfg) == target::Precision::Fp8;
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

  // Test hook: DFLASH_FAULT_FULL_DISK_AT_STEP=N makes every log and metrics write from step N on
  // fail as on a full disk (io::simulate_full_disk: half the line written, then ENOSPC).
  const char* full_disk_env = std::getenv("DFLASH_FAULT_FULL_DISK_AT_STEP");
  const int64_t fault_full_disk = full_disk_env ? std::atoll(full_disk_env) : -1;

  while (step < total) {
    if (rank == 0) writer.check();  // a background checkpoint write that failed stops the run here
    if (step + 1 == fault_full_disk) io::simulate_full_disk(true);
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
        if (peak_flops > 0 && fp8_target)
          perf += fmt::format(" | MFU {:.1f}% (fp8 peak {:.1f}%) | mem {:.1f} GiB", mfu, mfu * kPeakBf16PerGpu / kPeakFp8PerGpu, mem);
        else if (peak_flops > 0)
          perf += fmt::format(" | MFU {:.1f}% | mem {:.1f} GiB", mfu, mem);
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
        if (peak_flops > 0 && fp8_target) line["mfu_fp8_peak"] = mfu * kPeakBf16PerGpu / kPeakFp8PerGpu;
        metrics.append(line.dump() + "\n");  // a failed write (a full disk) stops the run here
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
    check_log_file();  // a log line that could not be written stops the run, as a failed metrics write does
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
        perf += fmt::format(", MFU {:.1f}%{}, peak memory {:.1f} GiB", 100.0 * steady_flops / steady_s / (peak_flops * world),
                            fp8_target ? fmt::format(" ({:.1f}% of the FP8 peak)",
                                                     100.0 * steady_flops / steady_s / (kPeakFp8PerGpu * world))
                                       : std::string(),
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
