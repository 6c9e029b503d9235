#include "trainer/train.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <spdlog/spdlog.h>

#include "comm/comm.h"
#include "data/loader.h"
#include "data/regenerate.h"
#include "data/synth.h"
#include "drafter/batch.h"
#include "drafter/fast_path.h"
#include "drafter/loss.h"
#include "drafter/model.h"
#include "drafter/weights.h"
#include "core/app.h"
#include "core/io/files.h"
#include "core/log.h"
#include "target_model/flops.h"
#include "target_model/model.h"
#include "target_model/runtime.h"
#include "target_model/tp.h"
#include "target_model/weights.h"
#include "bench/report.h"
#include "trainer/backend.h"
#if DFLASH_WITH_TEXT
#include "text/stop_tokens.h"
#include "text/tokenizer.h"
#endif
#include "trainer/checkpoint.h"
#include "trainer/faults.h"
#include "trainer/metrics.h"
#include "trainer/optimizer.h"
#include "trainer/prepared_data.h"

namespace fs = std::filesystem;

namespace dflash::trainer {

namespace {

// data.regenerate.stop_tokens: ids or token text (the tokenizer of data.tokenizer, else of
// model.target.path), null = the target's own eos ids read from that directory
// (text/stop_tokens.h), [] = none; logged once.
std::vector<int32_t> regenerate_stop_tokens(const TrainConfig& cfg, const target::TargetConfig& tcfg, int rank) {
  const auto& st = cfg.data.regenerate.stop_tokens;
  std::string dir = cfg.tokenizer_dir();  // data.tokenizer may name the tokenizer.json itself
  if (!dir.empty() && std::filesystem::is_regular_file(dir)) dir = std::filesystem::path(dir).parent_path().string();
  std::vector<int32_t> ids;
  std::string log;
  if (st && st->empty()) {
    log = "stop tokens: none (data.regenerate.stop_tokens: [])";
  } else {
#if DFLASH_WITH_TEXT
    std::optional<text::Tokenizer> tok;
    bool tried = false;
    const text::StopTokenChoice sc =
        text::choose_stop_tokens(st ? *st : std::vector<std::string>{}, "data.regenerate.stop_tokens", dir, [&]() -> const text::Tokenizer* {
          if (!tried && !dir.empty() && std::filesystem::exists(std::filesystem::path(dir) / "tokenizer.json")) {
            tried = true;
            try {
              tok.emplace(text::Tokenizer::from_file(dir));
            } catch (const Error& e) {  // ids still work; token text is then refused as having no tokenizer
              if (rank == 0) spdlog::warn("data.regenerate: {}/tokenizer.json not used ({})", dir, e.message());
            }
          }
          return tok ? &*tok : nullptr;
        });
    ids = sc.ids;
    log = sc.log;
#else
    for (const std::string& t : st ? *st : std::vector<std::string>{}) {
      DFLASH_REQUIRE_HINT(t.find_first_not_of("0123456789") == std::string::npos,
                          "data.regenerate.stop_tokens: '" << t << "' is text, and this build has no tokenizer (text/ was skipped)",
                          "give the token's id, or build with libonig-dev and libicu-dev");
      ids.push_back(static_cast<int32_t>(std::stoll(t)));
    }
    log = st ? "stop tokens: " + std::to_string(ids.size()) + " id(s) from data.regenerate.stop_tokens"
             : "stop tokens: none (this build has no tokenizer to read the target's own)";
#endif
  }
  for (int32_t t : ids)
    DFLASH_REQUIRE_HINT(t >= 0 && t < tcfg.vocab_size,
                        "data.regenerate: stop token " << t << " (" << log << ") is outside the target's vocabulary [0, "
                                                       << tcfg.vocab_size << ")",
                        "set data.regenerate.stop_tokens to the target's end-of-turn ids, or [] for none");
  if (rank == 0) spdlog::info("data.regenerate: {}", log);
  return ids;
}

volatile std::sig_atomic_t g_stop_requested = 0;
extern "C" void on_stop_signal(int) { g_stop_requested = 1; }

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
      // "U" a user error, "E" an internal one (run_app prints the source location of the latter).
      mine = (e.is_user_error() ? "U" : "E") + e.message() + '\x1f' + e.hint() + '\x1f' + e.where();
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
      throw StartupError(msg, m.substr(a + 1, b - a - 1), m.substr(b + 1), m[0] == 'U' ? ErrorKind::User : ErrorKind::Internal);
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
    DFLASH_REQUIRE_HINT(cuda_backend_available(ropt.local_size, &why), "parallel.device: cuda, but " << why,
                      "run one rank per GPU (mpirun -n <GPUs per node>), or set parallel.device: cpu");
  } else if (cfg.parallel.device == Backend::Auto && cfg.kernels.require_fast_path) {
    // auto would quietly take the CPU reference: exactly the slow path require_fast_path refuses.
    std::string why;
    DFLASH_REQUIRE_HINT(cuda_backend_available(ropt.local_size, &why),
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

using clock = std::chrono::steady_clock;

// What the start-up steps leave for the training steps: one run of one rank.
struct Run {
  // The configs are checked first, on every rank, before any collective.
  Run(const TrainConfig& c, int world_size, int world_rank, const RunOptions& options)
      : cfg(c), world(world_size), rank(world_rank), ropt(options), checked(checked_configs(c, world_size, options)) {}
  const TrainConfig& cfg;
  const int world, rank;
  const RunOptions& ropt;
  CheckedConfigs checked;
  comm::Layout layout;
  fs::path run_dir, ckpt_dir;
  Group g;
  std::string space_warning;         // rank 0: a checkpoint directory short of room for keep_last + 1
  ResumePoint resume;                // where the run continues from (read and checked at start-up)
  Backend device = Backend::Cpu;     // auto resolved
  std::vector<std::string> files;    // the data files the loader reads
  std::unique_ptr<data::Loader> loader;
  int64_t total = 0;                 // steps in all

  const target::TargetConfig& tcfg() const { return checked.target; }
  const drafter::DrafterConfig& dcfg() const { return checked.drafter; }
  bool on_gpu() const { return device == Backend::Cuda; }
};

// The world layout, the directories, and the communicators (CPU collectives over all ranks and the TP group).
void make_groups(Run& r) {
  const TrainConfig& cfg = r.cfg;
  r.layout = comm::make_layout(r.world, r.rank, static_cast<int>(cfg.parallel.tp));
  r.run_dir = cfg.logging.run_dir;
  r.ckpt_dir = cfg.checkpoint_dir();
  // Data files named by the config must exist (checked before anything is written).
  if (!cfg.data.train.empty()) check_train_text(cfg);
  else if (!cfg.data.synth.enabled) r.files = cfg.expand_data_files();
  if (r.world > 1) {
    r.g.world = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, 0, r.rank, Device::cpu(), cfg.parallel.timeout_s, "world");
    if (r.layout.tp_size > 1)
      r.g.tp = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, r.layout.tp_group, r.rank, Device::cpu(),
                                                    cfg.parallel.timeout_s, "tp");
  }
}

// The directories this rank writes: every rank its log under run_dir/logs; the first rank of each
// TP group its loader position into each checkpoint; rank 0 the rest of the checkpoint. A
// checkpoint holds the bf16 export and the fp32 master weights and two AdamW moments. Agreed on by
// every rank before any GPU work.
void check_directories(Run& r) {
  const TrainConfig& cfg = r.cfg;
  const fs::path& run_dir = r.run_dir;
  const fs::path& ckpt_dir = r.ckpt_dir;
  const comm::Layout& layout = r.layout;
  const int rank = r.rank, world = r.world;
  Group& g = r.g;
  const std::string ckpt_what = cfg.checkpoint.dir.empty() ? "the checkpoint directory (<logging.run_dir>/checkpoints)"
                                                           : "checkpoint.dir";
  const uint64_t ckpt_bytes = 14 * static_cast<uint64_t>(drafter_param_count(r.dcfg()));
  constexpr uint64_t kRunDirMinFree = 64ull << 20;  // logs and metrics of a long run
  std::string& space_warning = r.space_warning;
  g.agree([&] {
    const uint64_t run_free = io::check_writable_dir(run_dir.string(), "logging.run_dir");
    io::check_writable_dir((run_dir / "logs").string(), "the log directory <logging.run_dir>/logs");
    if (layout.tp_rank == 0) io::check_writable_dir(ckpt_dir.string(), ckpt_what);
    if (rank != 0) return;
    DFLASH_REQUIRE_HINT(run_free >= kRunDirMinFree,
                      "logging.run_dir '" << run_dir.string() << "' has " << io::format_bytes(run_free)
                                          << " free; the run's logs and metrics need at least "
                                          << io::format_bytes(kRunDirMinFree),
                      "free space there or set logging.run_dir to another file system");
    if (!r.ropt.csv_path.empty()) {  // found now, not when the run ends
      const fs::path csv = fs::absolute(r.ropt.csv_path);
      io::check_writable_dir(csv.parent_path().string(), "the directory of --csv");
      if (fs::exists(csv)) {
        DFLASH_REQUIRE_HINT(fs::is_regular_file(csv), "--csv " << r.ropt.csv_path << " is not a file",
                            "give a file path for the benchmark rows");
        try {  // rows are appended: an existing file must be the benchmarks' CSV
          bench::read_csv(csv.string());
        } catch (const Error& e) {
          DFLASH_REJECT_HINT("--csv " << r.ropt.csv_path << " cannot take the run's rows: " << e.message(),
                             "give a new file, or a CSV written by dflash_train / the benchmarks' --csv");
        }
      }
    }
    const uint64_t ck_free = io::free_bytes(ckpt_dir.string());
    DFLASH_REQUIRE_HINT(ck_free >= ckpt_bytes + ckpt_bytes / 20,
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
        DFLASH_REQUIRE_HINT(fs::exists(marker), ckpt_what << " '" << ckpt_dir.string()
                                                        << "' is not the directory rank 0 writes checkpoints to (a file rank 0 "
                                                           "made there is not visible here)",
                          "put checkpoint.dir (and logging.run_dir) on a file system every node of the job shares");
    });
    if (rank == 0) fs::remove(marker);
  }
}

// rank 0's start-up lines (version, settings, world, target, drafter) and run_dir/config.yaml.
void log_start(const Run& r) {
  const TrainConfig& cfg = r.cfg;
  const comm::Layout& layout = r.layout;
  init_logging(r.rank, r.ropt.log_level, (r.run_dir / "logs" / fmt::format("rank-{}.log", r.rank)).string());
  if (r.rank != 0) return;
  spdlog::info("{}", version_string());
  spdlog::info("config {}:\n{}", cfg.source, cfg.settings_table());
  if (cfg.source == TrainConfig::kEmbeddedSource &&
      (cfg.origin("model.target.path") == Origin::Override || cfg.origin("data.files") == Origin::Override))
    spdlog::warn("the embedded default is the tiny demo's recipe ({} drafter layers, block {}, mask_token_id {}, {} steps at "
                 "lr {:g}, data.max_length {}, run_dir {}): for your own model and data start from configs/my-model.yaml",
                 cfg.model.drafter.num_layers, cfg.model.drafter.block_size,
                 cfg.model.drafter.mask_token_id ? std::to_string(*cfg.model.drafter.mask_token_id) : "null",
                 cfg.training.max_steps ? std::to_string(*cfg.training.max_steps) : "?", cfg.training.lr,
                 cfg.data.max_length, cfg.logging.run_dir);
  spdlog::info("world: {} rank(s), tp {}{}, {} TP group(s){}", r.world, layout.tp_size,
               cfg.parallel.ep > 1 ? fmt::format(" (ep {}: the experts in {} groups of {} ranks)", cfg.parallel.ep,
                                                 cfg.parallel.ep, layout.tp_size / cfg.parallel.ep)
                                   : std::string(),
               layout.num_tp_groups,
               layout.num_tp_groups > 1 ? " (data parallel over the groups)" : " (no data parallelism)");
  spdlog::info("target: {}{}", r.tcfg().summary(),
               r.checked.embedded_target ? fmt::format(" (from {}: {} is not under the working directory)", r.tcfg().source,
                                                       TrainConfig::kTinyTargetPath)
                                         : "");
  spdlog::info("drafter: {}", r.dcfg().summary());
  write_text(r.run_dir / "config.yaml", cfg.to_yaml());
}

// data.synth: the synthetic corpus, written by rank 0 on first use.
void make_synthetic_corpus(Run& r) {
  const TrainConfig& cfg = r.cfg;
  const target::TargetConfig& tcfg = r.tcfg();
  const drafter::DrafterConfig& dcfg = r.dcfg();
  const int rank = r.rank;
  Group& g = r.g;
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
  r.files = {sp.string()};
}

// data.train: the JSONL of conversations prepared by rank 0 on first use (trainer/prepared_data.h:
// reused while its key matches), the other ranks waiting for it. Preparing a large corpus may take
// longer than parallel.timeout_s, so rank 0 prepares on a thread and every rank meets it in a short
// all-reduce each second until it is done (no collective waits long); its error, if any, is then
// every rank's (Group::agree).
void prepare_text(Run& r) {
  const TrainConfig& cfg = r.cfg;
  std::exception_ptr failed;
  std::atomic<bool> done{false};
  std::mutex mu;
  std::condition_variable cv;
  std::thread worker;
  if (r.rank == 0)
    worker = std::thread([&] {
      try {
        spdlog::info("data: checking the prepared data of {} ({})", cfg.data.train, cfg.prepare_path());
        const PreparedText p = prepare_train_text(cfg);
        spdlog::info("data: {}", p.log);
      } catch (...) {
        failed = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      cv.notify_all();
    });
  if (r.g.world) {
    for (;;) {
      if (r.rank == 0) {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait_for(lock, std::chrono::seconds(1), [&] { return done.load(); });
      }
      std::vector<double> flag{r.rank == 0 && done ? 1.0 : 0.0};
      r.g.sum(flag);
      if (flag[0] > 0) break;
    }
  }
  if (worker.joinable()) worker.join();
  r.g.agree([&] {
    if (failed) std::rethrow_exception(failed);
  });
  r.files = {cfg.prepare_path()};
}

// data.regenerate: the prompts of the data get the target's own responses, made on first use (a
// restart continues the parts on disk; a later run reuses the file when its settings match).
void regenerate_responses(Run& r) {
  const TrainConfig& cfg = r.cfg;
  const target::TargetConfig& tcfg = r.tcfg();
  const comm::Layout& layout = r.layout;
  const int rank = r.rank, tp = layout.tp_size;
  const RunOptions& ropt = r.ropt;
  std::vector<std::string>& files = r.files;
  Group& g = r.g;
  const Backend device = r.device;
  const auto& rc = cfg.data.regenerate;
  data::RegenerateOptions ro;
  ro.inputs = files;
  ro.out = cfg.regenerate_path();
  ro.num_prompts = rc.num_prompts > 0 ? rc.num_prompts : -1;
  ro.max_prompt_len = rc.max_prompt_len > 0 ? rc.max_prompt_len : -1;
  ro.gen.max_new_tokens = rc.max_new_tokens;
  ro.gen.stop_tokens = regenerate_stop_tokens(cfg, tcfg, rank);
  if (rc.temperature > 0)
    ro.gen.sample = ops::SampleParams{static_cast<float>(rc.temperature), static_cast<float>(rc.top_p), static_cast<uint64_t>(rc.seed)};
  ro.slots = rc.slots;
  ro.gen.step_tokens = rc.step_tokens;
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
      target::TargetRuntime rt(src, tcfg, rdev, tp, layout.tp_rank, rtp.get(), cfg.kernels.require_fast_path,
                               static_cast<int>(cfg.parallel.ep));
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

// The loader over the data files. Every token and mask of every file is checked now, each rank a
// contiguous share of the sequences, so bad data stops the run here, naming the file and the
// sequence, not when the loader reaches it hours in. Sets the run's number of steps.
void open_loader(Run& r) {
  const TrainConfig& cfg = r.cfg;
  const target::TargetConfig& tcfg = r.tcfg();
  const comm::Layout& layout = r.layout;
  const int rank = r.rank, world = r.world;
  const std::vector<std::string>& files = r.files;
  const std::string& space_warning = r.space_warning;
  Group& g = r.g;
  data::LoaderConfig lc;
  lc.files = files;
  lc.max_length = cfg.data.max_length;
  lc.seed = static_cast<uint64_t>(cfg.training.seed);
  lc.tp_group = layout.tp_group;
  lc.num_tp_groups = layout.num_tp_groups;
  lc.batch = cfg.training.batch_size;
  std::unique_ptr<data::Loader>& loader_ptr = r.loader;
  data::DatasetStats data_stats;
  const auto t_data = clock::now();
  g.agree([&] {
    loader_ptr = std::make_unique<data::Loader>(lc);
    const data::Dataset& ds = loader_ptr->dataset();
    DFLASH_REQUIRE_HINT(ds.vocab_size() <= tcfg.vocab_size,
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
                         "`dflash_data stats` shows the supervised share", {}, ErrorKind::User);
    if (nna == nseq)
      throw StartupError(fmt::format("data: none of the {} sequences in {} has two consecutive supervised tokens within "
                                     "data.max_length = {}, so no anchor block can be drawn: there is nothing to train on",
                                     nseq, where, cfg.data.max_length),
                         "an anchor needs loss_mask = 1 at two neighbouring positions; check the masks, or raise "
                         "data.max_length if the supervised tokens come late", {}, ErrorKind::User);
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
  r.total = total;
  if (rank == 0)
    spdlog::info("data: {} sequences, {} tokens in {} file(s); {} slots per epoch per TP group; {} steps in all",
                 loader.dataset().num_sequences(), loader.dataset().num_tokens(), files.size(),
                 loader.slots_per_epoch(), total);
}

// The backend (the target and the drafter on the CPU reference or one GPU per rank), its fast-path
// plans logged and written to run_dir/fast_path.json, and rank 0's start-up lines about it.
std::unique_ptr<TrainBackend> start_backend(Run& r, const LrSchedule& sched) {
  const TrainConfig& cfg = r.cfg;
  const int rank = r.rank;
  BackendSetup bs;
  bs.cfg = &cfg, bs.target = r.tcfg(), bs.drafter = r.dcfg(), bs.layout = r.layout, bs.world = r.world, bs.rank = rank;
  bs.local_rank = r.ropt.local_rank, bs.local_size = r.ropt.local_size;
  std::unique_ptr<TrainBackend> backend =
      r.on_gpu() ? make_cuda_backend(bs) : make_cpu_backend(bs, r.g.world.get(), r.g.tp.get());
  const auto& tr = cfg.training;
  {
    // Every rank's fast-path summary (they may differ across GPUs of a mixed node), then rank 0's plan.
    const std::string fp = backend->fast_path_summary();
    if (!fp.empty()) spdlog::info("fast path (rank {}): {}", rank, fp);
  }
  write_fast_path_json(r.g, *backend, rank, r.run_dir / "fast_path.json", "start-up");
  if (rank == 0) {
    spdlog::info("backend: {}", backend->describe());
    const int64_t run = backend->target_layers_run(), L = r.tcfg().num_hidden_layers;
    if (run < L)
      spdlog::info("target forward: layers 0..{} run; {} skipped (after the last captured layer, {}: no output needs them)",
                   run - 1, run + 1 == L ? fmt::format("layer {} is", run) : fmt::format("layers {}..{} are", run, L - 1),
                   run - 1);
    spdlog::info("drafter: {:.2f} M trainable parameters; schedule {} lr {:g} -> {:g}, {} warmup step(s)",
                 static_cast<double>(backend->num_params()) / 1e6, schedule_name(tr.schedule), tr.lr, tr.min_lr,
                 sched.warmup_steps());
    const std::string plan = backend->memory_plan();
    if (!plan.empty()) spdlog::info("memory plan per GPU (rank 0):\n{}", plan);
    const std::string init = backend->init_summary(), mem = backend->memory_summary();
    if (!init.empty()) spdlog::info("initialised: {}", init);
    if (!mem.empty()) spdlog::info("after loading: {}", mem);
  }
  return backend;
}

// Where the steps start: the resume point's optimizer state and loader position loaded, or step 0.
struct Progress {
  int64_t step = 0, skipped = 0, skipped_in_row = 0;
};
Progress resume_run(Run& r, TrainBackend& backend) {
  Progress p;
  const ResumePoint& resume = r.resume;
  const int rank = r.rank;
  const int64_t total = r.total;
  if (!resume.from.empty()) {
    const auto t0 = clock::now();
    const fs::path& from = resume.from;
    try {
      backend.load_optimizer((from / "optimizer.safetensors").string(), resume.state.at("optimizer"));
      r.loader->restore(resume.loader);
    } catch (const Error& e) {
      DFLASH_REJECT_HINT("checkpoint " << from.string() << " cannot be resumed: " << e.message(), older_checkpoint_hint(from));
    }
    p.step = resume.step, p.skipped = resume.skipped, p.skipped_in_row = resume.skipped_in_row;
    if (rank == 0) {
      spdlog::info("resumed from {} at step {}/{} (read in {:.1f} s)", from.string(), p.step, total,
                   std::chrono::duration<double>(clock::now() - t0).count());
      if (resume.state.value("total_steps", total) != total)
        spdlog::warn("the checkpoint was written by a run of {} steps; this one has {} (the LR schedule changes)",
                     resume.state.value("total_steps", total), total);
    }
  } else if (rank == 0 && r.cfg.checkpoint.resume == "auto") {
    spdlog::info("no complete checkpoint under {}: starting at step 0", r.ckpt_dir.string());
  }
  return p;
}

// The test hooks of the step loop (never for production runs).
struct FaultHooks {
  std::set<int64_t> nonfinite;  // DFLASH_FAULT_NONFINITE_STEPS="3,4": NaN gradient norms at these 1-based steps
  int64_t full_disk = -1;       // DFLASH_FAULT_FULL_DISK_AT_STEP=N: every log / metrics write fails from step N on
};
FaultHooks fault_hooks(const Run& r) {
  FaultHooks h;
  // DFLASH_FAULT_CUDA_ERROR (the GPU backend reads it): checked here too, so a CPU run refuses it.
  if (parse_cuda_fault(std::getenv("DFLASH_FAULT_CUDA_ERROR")).enabled())
    DFLASH_REQUIRE_HINT(r.on_gpu(), "DFLASH_FAULT_CUDA_ERROR is a GPU-backend test hook", "set parallel.device: cuda, or unset it");
  // NaN on every rank, as a non-finite gradient would be, to exercise the skip / stop logic.
  if (const char* f = std::getenv("DFLASH_FAULT_NONFINITE_STEPS")) {
    std::stringstream ss(f);
    std::string item;
    while (std::getline(ss, item, ','))
      if (!item.empty()) h.nonfinite.insert(std::stoll(item));
  }
  // (io::simulate_full_disk: half the line written, then ENOSPC.)
  const char* full_disk_env = std::getenv("DFLASH_FAULT_FULL_DISK_AT_STEP");
  h.full_disk = full_disk_env ? std::atoll(full_disk_env) : -1;
  return h;
}

// The drafter step's options; test hook (CPU backend): DFLASH_FAULT_MASK=causal_in_block |
// anchor_inclusive trains with one of the two published training-mask bugs (drafter/model.h
// MaskVariant), so the quality gate can show what such a drafter measures in speculative decoding.
drafter::StepOptions step_options(const Run& r) {
  drafter::StepOptions sopt;
  sopt.gamma = r.cfg.training.gamma;
  sopt.fp8_linears = r.cfg.model.drafter.precision == DrafterPrecision::Fp8;
  sopt.fp8_lm_head = r.cfg.model.drafter.lm_head_precision == DrafterPrecision::Fp8;
  sopt.fp8_wgrad_x_blocks = fp8_wgrad_x_blocks(r.cfg.model.drafter);
  if (const char* m = std::getenv("DFLASH_FAULT_MASK")) {
    const std::string v = m;
    DFLASH_REQUIRE_HINT(v == "causal_in_block" || v == "anchor_inclusive",
                      "DFLASH_FAULT_MASK=" << v << " is not a mask variant", "use causal_in_block or anchor_inclusive");
    DFLASH_REQUIRE_HINT(!r.on_gpu(), "DFLASH_FAULT_MASK is a CPU-backend test hook", "set parallel.device: cpu");
    sopt.mask = v == "causal_in_block" ? drafter::MaskVariant::CausalInBlock : drafter::MaskVariant::AnchorInclusive;
    if (r.rank == 0) spdlog::warn("test hook DFLASH_FAULT_MASK={}: training with a broken attention mask", v);
  }
  return sopt;
}

// This step's micro-batches with this rank's share of their anchor blocks (drafter::make_batch),
// and Σw of those blocks (no forward needed for it).
struct StepBatches {
  std::vector<MicroBatch> micro;
  double local_w = 0;
};
StepBatches next_micro_batches(Run& r, int64_t step) {
  const auto& tr = r.cfg.training;
  const drafter::BlockSampling sampling{tr.num_anchors, static_cast<uint64_t>(tr.seed), r.layout.tp_rank, r.layout.tp_size};
  StepBatches sb;
  sb.micro.resize(static_cast<size_t>(tr.micro_batches));
  for (MicroBatch& m : sb.micro) {
    const data::Batch b = r.loader->next_batch();
    std::vector<drafter::BatchSequence> seqs;
    for (size_t s = 0; s < b.sequences.size(); ++s) {
      const data::Sequence& sq = b.sequences[s];
      // Anchors at (seed, step·2^32 + the sequence's global index): the same whichever rank or slot has it.
      seqs.push_back({sq.ids, sq.mask, (static_cast<uint64_t>(step) << 32) + static_cast<uint64_t>(b.indices[s])});
      m.seqs.push_back(sq.ids);
    }
    m.batch = drafter::make_batch(seqs, sampling);
    sb.local_w = drafter::add_block_weights(m.batch, r.dcfg().block_size, tr.gamma, sb.local_w);
    m.tokens = m.batch.seqs.offsets.back();
  }
  return sb;
}

// The target forward and the drafter's forward and backward of every micro-batch (gradients of the
// global loss: grad_scale = 1 / global Σw), then the gradients summed over all ranks. This rank's
// figures; the gradient norm is of the summed gradient.
struct LocalStep {
  drafter::StepStats stats;
  StepTimes times;
  double tokens = 0, flops = 0, grad_norm = 0;
};
LocalStep forward_backward(const Run& r, TrainBackend& backend, std::vector<MicroBatch>& micro, double global_w,
                           drafter::StepOptions& sopt) {
  const int64_t B = r.dcfg().block_size;
  const int tp = r.layout.tp_size;
  LocalStep ls;
  backend.zero_grads();
  ls.stats.correct.assign(static_cast<size_t>(B), 0);
  ls.stats.counted.assign(static_cast<size_t>(B), 0);
  sopt.grad_scale = global_w > 0 ? 1.0 / global_w : 0.0;
  for (size_t mi = 0; mi < micro.size(); ++mi) {
    MicroBatch& m = micro[mi];
    if (m.seqs.empty()) continue;  // every rank of the group sees the same (empty) batch
    if (r.layout.tp_rank == 0) ls.tokens += static_cast<double>(m.tokens);
    std::vector<int64_t> lens;
    for (const auto& q : m.seqs) lens.push_back(static_cast<int64_t>(q.size()));
    ls.flops += target::forward_flops(r.tcfg(), lens, backend.target_layers_run()) / tp;
    ls.stats.add(backend.micro_step(m, sopt, mi + 1 == micro.size(), ls.times));
    if (!m.batch.blocks.empty() && global_w > 0) ls.flops += drafter::step_flops(r.dcfg(), m.batch, true);
  }
  ls.grad_norm = backend.reduce_grads(ls.times);
  return ls;
}

// Clip and update, or skip a non-finite step (the decision is identical on every rank: the norm is
// of the all-reduced gradient, the loss of the all-reduced sums); too many skipped in a row stop
// the run. Returns whether the step was applied.
bool update_or_skip(const Run& r, TrainBackend& backend, const drafter::StepStats& gs, double norm, double lr,
                    int64_t step, Progress& p, ProgressBar& bar, StepTimes& times) {
  const auto& tr = r.cfg.training;
  const double loss = gs.loss();
  if (!std::isfinite(loss) || !std::isfinite(norm)) {
    ++p.skipped;
    ++p.skipped_in_row;
    bar.clear();
    if (r.rank == 0) spdlog::warn("step {}: non-finite loss {} or grad norm {}: update skipped ({} in a row, {} in all)",
                                  step + 1, loss, norm, p.skipped_in_row, p.skipped);
    DFLASH_CHECK_HINT(p.skipped_in_row < tr.skip_nonfinite_limit,
                      p.skipped_in_row << " non-finite steps in a row (training.skip_nonfinite_limit = "
                                       << tr.skip_nonfinite_limit << "): stopping at step " << step + 1,
                      "lower training.lr, check the data, or resume from an earlier checkpoint");
    return false;
  }
  p.skipped_in_row = 0;
  if (gs.weight_sum > 0) backend.apply(lr, clip_factor(norm, tr.grad_clip), times);
  return true;
}

}  // namespace

RunResult train(const TrainConfig& cfg, int world, int rank, const RunOptions& ropt) {
  const auto t_start = clock::now();
  // ---- set-up: configs, communicators, start-up checks agreed on by every rank, logging, data ----
  Run r(cfg, world, rank, ropt);
  make_groups(r);
  check_directories(r);
  // Where the run continues from (state.json and the loader position read and checked now, not
  // after the target is loaded).
  r.g.agree([&] { r.resume = find_resume_point(cfg, r.ckpt_dir, world, r.layout.tp_size, r.layout.tp_group); });
  log_start(r);
  if (cfg.data.synth.enabled) make_synthetic_corpus(r);
  if (!cfg.data.train.empty()) prepare_text(r);
  r.device = cfg.parallel.device;  // (cuda was checked to be available by check_config)
  if (r.device == Backend::Auto) r.device = cuda_backend_available(ropt.local_size, nullptr) ? Backend::Cuda : Backend::Cpu;
  // The FP8 drafter's sizes on GPUs, before a regeneration that may run for hours (the GPU's compute
  // capability is checked by the backend's drafter plan).
  if (r.on_gpu() && cfg.model.drafter.precision == DrafterPrecision::Fp8) drafter::check_fp8_drafter_sizes(r.dcfg());
  if (cfg.data.regenerate.enabled) regenerate_responses(r);
  open_loader(r);
  data::Loader& loader = *r.loader;
  const int64_t total = r.total, B = r.dcfg().block_size;
  const auto& tr = cfg.training;
  const LrSchedule sched{tr.lr, tr.min_lr, tr.warmup_ratio, tr.schedule, total};
  std::unique_ptr<TrainBackend> backend = start_backend(r, sched);

  // ---- resume (the checkpoint was found and its JSON files read at start-up) ----
  Progress p = resume_run(r, *backend);
  io::AppendFile metrics_file;
  if (rank == 0) metrics_file = open_metrics(r.run_dir / "metrics.jsonl", p.step);
  Checkpointer checkpoints(cfg, r.dcfg(), r.layout, world, rank, total, sched, [&g = r.g] { g.barrier(); });
  auto save_checkpoint = [&](int64_t at_step, const nlohmann::json& loader_state, bool background) {
    checkpoints.save(at_step, loader_state, background, *backend, metrics_file, p.skipped, p.skipped_in_row);
  };

  // ---- the step loop ----
  RunResult result;
  drafter::StepOptions sopt = step_options(r);
  // A resumed run's starting step already has its checkpoint (the one it was read from).
  const int64_t start_step = p.step;
  int64_t last_ckpt = start_step > 0 ? start_step : -1;
  if (rank == 0 && start_step >= total)
    spdlog::warn("nothing to train: this run is complete at step {}/{} (checkpoint.resume: auto found its last "
                 "checkpoint); to train again give the new run its own logging.run_dir, or raise training.epochs / "
                 "training.max_steps to continue this one",
                 start_step, total);
  const bool fp8_target = target::resolve_precision(cfg.model.target.precision, r.tcfg()) == target::Precision::Fp8;
  ProgressBar bar(rank == 0 && cfg.logging.progress_bar && ::isatty(STDERR_FILENO), total);
  StepRate rate;  // the ETA: this start's own steps, start-up excluded
  RunMetrics metrics({rank, world, total, B, r.on_gpu(), fp8_target}, metrics_file, bar);
  const FaultHooks faults = fault_hooks(r);
  // --csv: rank 0's rows of this start's steps after its first log interval (bench/README.md's schema).
  auto write_rows = [&] {
    if (rank != 0 || ropt.csv_path.empty()) return;
    TrainRowShape sh;
    const target::TargetConfig& t = r.tcfg();
    sh.model_type = t.model_type, sh.target_layers = t.num_hidden_layers, sh.hidden = t.hidden_size;
    sh.seq_len = cfg.data.max_length;
    sh.precision = r.on_gpu() ? target::precision_name(target::resolve_precision(cfg.model.target.precision, t)) : "f32";
    if (cfg.model.target.fp8_experts) sh.precision += ",fp8x";  // MoE: the routed experts in FP8 (W8A16)
    sh.tp = r.layout.tp_size, sh.dp = r.layout.num_tp_groups;
    sh.drafter_layers = r.dcfg().num_hidden_layers, sh.block_size = B, sh.anchors = tr.num_anchors;
    sh.batch = tr.batch_size, sh.micro_batches = tr.micro_batches;
    sh.on_gpu = r.on_gpu(), sh.fp8_target = fp8_target;
    sh.fp8_drafter = cfg.model.drafter.precision == DrafterPrecision::Fp8;
    sh.fp8_lm_head = cfg.model.drafter.lm_head_precision == DrafterPrecision::Fp8;
    sh.fp8_wgrad_x_blocks = fp8_wgrad_x_blocks(cfg.model.drafter);
    sh.peak_mem_gib = backend->peak_memory_gib();
    const std::vector<bench::Row> rows = training_rows(sh, metrics.steady(), world);
    if (rows.empty()) {
      spdlog::warn("--csv {}: no rows (no step after the first log interval of {} step(s): raise training.max_steps or "
                   "lower logging.interval)", ropt.csv_path, cfg.logging.interval);
      return;
    }
    bench::CsvWriter csv(ropt.csv_path, backend->device_name());
    for (const bench::Row& row : rows) csv.write(row);
    spdlog::info("--csv: {} rows ({}) appended to {}", rows.size(), sh.shape(), ropt.csv_path);
  };

  while (p.step < total) {
    checkpoints.check();  // a background checkpoint write that failed stops the run here
    if (p.step + 1 == faults.full_disk) io::simulate_full_disk(true);
    const nlohmann::json loader_state_before = loader.state();
    const bool stop_here = ropt.stop_after_steps >= 0 && p.step >= ropt.stop_after_steps;
    StepBatches sb = next_micro_batches(r, p.step);
    // One all-reduce: the global Σw and the stop flag (ranks agree on stopping at the step boundary).
    std::vector<double> head{sb.local_w, (g_stop_requested || stop_here) ? 1.0 : 0.0};
    r.g.sum(head);
    if (head[1] > 0) {
      bar.clear();
      if (rank == 0) spdlog::warn("stop requested: writing a checkpoint at step {} and exiting", p.step);
      write_rows();  // first: a benchmark run stopped by its deadline keeps its rows if the checkpoint is cut short
      if (last_ckpt != p.step) save_checkpoint(p.step, loader_state_before, false);
      checkpoints.wait();
      write_fast_path_json(r.g, *backend, rank, r.run_dir / "fast_path.json", "stopped");
      result.step = p.step;
      result.start_step = start_step;
      result.stopped = true;
      return result;
    }
    // An error inside the step (a CUDA error, a failed collective) names this rank and the step.
    LocalStep ls;
    StepTotals tot;
    StepTimes times;
    const double lr = sched.at(p.step);
    bool applied = false;
    try {
      backend->begin_step(p.step + 1);
      ls = forward_backward(r, *backend, sb.micro, head[0], sopt);
      if (faults.nonfinite.count(p.step + 1)) ls.grad_norm = NAN;  // test hook (DFLASH_FAULT_NONFINITE_STEPS)

      // The step's statistics, summed over all ranks.
      std::vector<double> sums = pack_step(ls.stats, ls.tokens, ls.flops, ls.times, B);
      r.g.sum(sums);
      tot = unpack_step(sums, B, world);
      times = ls.times;
      times.target_s = tot.target_s, times.drafter_s = tot.drafter_s;

      applied = update_or_skip(r, *backend, tot.stats, ls.grad_norm, lr, p.step, p, bar, times);
    } catch (const Error& e) {
      bar.clear();
      throw Error(step_failure_message(rank, p.step + 1, e.message()), e.hint(), e.where(), e.kind());
    }
    metrics.add_step(tot.stats, applied, tot.tokens, tot.flops, times);
    ++p.step;
    const double elapsed = std::chrono::duration<double>(clock::now() - t_start).count();
    rate.step_done(p.step, elapsed);
    const double eta = rate.eta_s(p.step, elapsed, total);
    bar.update(p.step, tot.stats.loss(), elapsed, eta);
    if (p.step % cfg.logging.interval == 0 || p.step == total)
      metrics.end_interval(p.step, elapsed, eta, lr, ls.grad_norm, p.skipped, backend->peak_memory_gib());
    check_log_file();  // a log line that could not be written stops the run, as a failed metrics write does
    if (p.step % cfg.checkpoint.interval == 0 && p.step < total) {
      bar.clear();
      save_checkpoint(p.step, loader.state(), true);
      last_ckpt = p.step;
    }
  }
  bar.clear();

  // ---- final save, export and summary ----
  if (last_ckpt != p.step && cfg.checkpoint.at_end) save_checkpoint(p.step, loader.state(), false);
  checkpoints.wait();  // a periodic checkpoint still being written
  write_fast_path_json(r.g, *backend, rank, r.run_dir / "fast_path.json", "end of run");
  result.step = p.step;
  result.start_step = start_step;
  result.drafter_dir = (r.run_dir / "drafter").string();
  if (rank == 0) {
    write_rows();  // (before the export: a 27B drafter's takes ~15 s, which a deadline may cut)
    export_final_drafter(r.ckpt_dir, p.step, result.drafter_dir, r.dcfg(), [&] { return backend->weights(); });
    const auto& c = loader.counters();
    spdlog::info("data: {} sequences seen, {} truncated, {} skipped without an anchor, {} epoch(s) done", c.seen,
                 c.truncated, c.skipped_no_anchor, c.epochs);
    if (const std::string load = backend->expert_load(); !load.empty()) spdlog::info("{}", load);
    metrics.log_summary(p.step, p.skipped, std::chrono::duration<double>(clock::now() - t_start).count(),
                        result.drafter_dir, start_step, backend->peak_memory_gib());
  }
  r.g.barrier();
  return result;
}

}  // namespace dflash::trainer
