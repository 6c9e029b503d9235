#include "trainer/checkpoint.h"

#include <thread>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <spdlog/spdlog.h>

#include "drafter/weights.h"
#include "core/app.h"
#include "core/error.h"
#include "core/log.h"

namespace dflash::trainer {

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

std::string checkpoint_names(const std::vector<std::pair<int64_t, fs::path>>& all, size_t max) {
  std::string out;
  for (size_t i = 0; i < all.size(); ++i) {
    if (i == max) return out + fmt::format(" and {} more", all.size() - max);
    out += (i ? ", " : "") + all[i].second.filename().string();
  }
  return out;
}

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

nlohmann::json read_checkpoint_json(const fs::path& ckpt, const std::string& name) {
  const fs::path p = ckpt / name;
  std::error_code ec;
  DFLASH_REQUIRE_HINT(fs::is_regular_file(p, ec), "checkpoint " << ckpt.string() << " cannot be resumed: it has no " << name,
                    older_checkpoint_hint(ckpt));
  std::string why;
  try {
    nlohmann::json j = nlohmann::json::parse(read_text(p));
    if (j.is_object()) return j;
    why = "it is not a JSON object";
  } catch (const nlohmann::json::parse_error& e) {
    why = e.what();
  }
  DFLASH_REJECT_HINT("checkpoint " << ckpt.string() << " cannot be resumed: " << p.string() << " is corrupt (" << why << ")",
                   older_checkpoint_hint(ckpt));
}

ResumePoint find_resume_point(const TrainConfig& cfg, const fs::path& ckpt_dir, int world, int tp, int tp_group) {
  const auto all = complete_checkpoints(ckpt_dir);
  ResumePoint rp;
  const std::string& mode = cfg.checkpoint.resume;
  if (mode == "never") {
    // A new run beside an earlier run's checkpoints would write its own among them: keep_last would
    // prune by step across both runs, and auto would later resume whichever is newest.
    DFLASH_REQUIRE_HINT(all.empty(),
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
    DFLASH_REQUIRE_HINT(fs::exists(rp.from / "COMMIT"),
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
  DFLASH_REQUIRE_HINT(bad.empty(),
                    "checkpoint " << rp.from.string() << " cannot be resumed: " << (rp.from / "state.json").string() << ": "
                                  << bad,
                    older_checkpoint_hint(rp.from));
  DFLASH_REQUIRE_HINT(ws == world && wtp == tp,
                    "checkpoint " << rp.from.string() << " was written by " << ws << " rank(s) with tp " << wtp
                                  << "; this run has " << world << " rank(s) with tp " << tp
                                  << ": resuming on a different world size or tp is not supported",
                    "resume with mpirun -n " << ws << " and parallel.tp = " << wtp
                                             << ", or give the new run its own logging.run_dir to start anew");
  rp.loader = read_checkpoint_json(rp.from, fmt::format("loader-g{}.json", tp_group));
  DFLASH_REQUIRE_HINT(fs::is_regular_file(rp.from / "optimizer.safetensors"),
                    "checkpoint " << rp.from.string() << " cannot be resumed: it has no optimizer.safetensors",
                    older_checkpoint_hint(rp.from));
  // Later checkpoints than the one resumed (checkpoint.resume: PATH) belong to another run or to a
  // later point of this one: this run would overwrite them at their steps and prune by step among them.
  std::vector<std::pair<int64_t, fs::path>> later;
  for (const auto& c : all)
    if (c.first > rp.step) later.push_back(c);
  DFLASH_REQUIRE_HINT(later.empty(),
                    "checkpoint.resume: " << rp.from.string() << " is at step " << rp.step << ", but " << ckpt_dir.string()
                                          << " already holds later checkpoints (" << checkpoint_names(later)
                                          << "): this run would overwrite and prune them",
                    "resume from the newest (checkpoint.resume: auto), or give this run its own logging.run_dir or "
                    "checkpoint.dir");
  return rp;
}

Checkpointer::Checkpointer(const TrainConfig& cfg, const drafter::DrafterConfig& dcfg, const comm::Layout& layout,
                           int world, int rank, int64_t total_steps, const LrSchedule& sched, std::function<void()> barrier)
    : cfg_(cfg),
      dcfg_(dcfg),
      layout_(layout),
      world_(world),
      rank_(rank),
      total_(total_steps),
      sched_(sched),
      barrier_(std::move(barrier)),
      dir_(cfg.checkpoint_dir()),
      cfg_yaml_(cfg.to_yaml()),
      keep_last_(static_cast<size_t>(cfg.checkpoint.keep_last)) {
  const char* fault_env = std::getenv("DFLASH_FAULT_CHECKPOINT_WRITE");
  fault_step_ = fault_env ? std::atoll(fault_env) : -1;
  // DFLASH_FAULT_CHECKPOINT_PAUSE=N:MS: the step-N write pauses MS ms after the drafter's files (so a
  // test can kill the job while the background writer is active).
  if (const char* pause = std::getenv("DFLASH_FAULT_CHECKPOINT_PAUSE")) {
    const std::string v = pause;
    const size_t c = v.find(':');
    DFLASH_REQUIRE_HINT(c != std::string::npos, "DFLASH_FAULT_CHECKPOINT_PAUSE='" << v << "' is not N:MS",
                        "e.g. DFLASH_FAULT_CHECKPOINT_PAUSE=8:20000, or unset it");
    pause_step_ = std::atoll(v.substr(0, c).c_str()), pause_ms_ = std::atoll(v.substr(c + 1).c_str());
  }
}

void Checkpointer::save(int64_t at_step, const nlohmann::json& loader_state, bool background, TrainBackend& backend,
                        io::AppendFile& metrics, int64_t skipped, int64_t skipped_in_row) {
  using clock = std::chrono::steady_clock;
  const auto& tr = cfg_.training;
  // (Local names the write job captures by value: it may run after this call returns.)
  const fs::path ckpt_dir = dir_;
  const drafter::DrafterConfig& dcfg = dcfg_;
  const std::string& cfg_yaml = cfg_yaml_;
  const size_t keep_last = keep_last_;
  const int64_t fault_checkpoint = fault_step_, pause_ms = pause_step_ == at_step ? pause_ms_ : 0;
  const fs::path final_dir = ckpt_dir / fmt::format("ckpt-{}", at_step);
  const fs::path tmp = ckpt_dir / fmt::format("ckpt-{}.tmp", at_step);
  // The logs and metrics up to this step reach the disk with the checkpoint (a full NFS volume
  // reports only at fsync): a failure stops the run here.
  sync_log_file();
  if (rank_ == 0) metrics.sync();
  if (rank_ == 0) {
    writer_.wait();  // the previous checkpoint is complete (its pruning cannot touch this one)
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  barrier_();
  if (layout_.tp_rank == 0) write_text(tmp / fmt::format("loader-g{}.json", layout_.tp_group), loader_state.dump(1) + "\n");
  barrier_();
  if (rank_ == 0) {
    const auto t0 = clock::now();
    TrainBackend::CheckpointState cs = backend.checkpoint_state();
    const double copy_s = std::chrono::duration<double>(clock::now() - t0).count();
    nlohmann::json st{{"format", "dflash.checkpoint.v1"},
                      {"step", at_step},
                      {"total_steps", total_},
                      {"optimizer", cs.optimizer.json},
                      {"schedule", {{"kind", schedule_name(tr.schedule)}, {"lr", tr.lr}, {"min_lr", tr.min_lr},
                                    {"warmup_steps", sched_.warmup_steps()}, {"total_steps", total_},
                                    {"next_lr", sched_.at(std::min(at_step, total_ - 1))}}},
                      {"skipped_steps", skipped},
                      {"skipped_in_row", skipped_in_row},
                      {"rng", {{"kind", "philox"}, {"seed", tr.seed},
                               {"anchor_stream", "step * 2^32 + global sequence index (stateless)"}}},
                      {"world", {{"world_size", world_}, {"tp", layout_.tp_size}, {"num_tp_groups", layout_.num_tp_groups}}},
                      {"version", version_string()}};
    // A failed write names the checkpoint; the incomplete directory has no COMMIT marker, so resume
    // never takes it, and the newest complete checkpoint is untouched.
    auto write = [=, cs = std::move(cs), st = std::move(st)] {
      const auto t1 = clock::now();
      try {
        if (fault_checkpoint == at_step) DFLASH_FAIL("injected fault (DFLASH_FAULT_CHECKPOINT_WRITE=" << at_step << ")");
        drafter::export_hf((tmp / "drafter").string(), dcfg, cs.weights);
        if (pause_ms > 0) {  // test hook (DFLASH_FAULT_CHECKPOINT_PAUSE)
          spdlog::warn("test hook DFLASH_FAULT_CHECKPOINT_PAUSE: the write of {} pauses {} ms", final_dir.string(), pause_ms);
          std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
        }
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
        DFLASH_REJECT_HINT("checkpoint " << final_dir.string() << " could not be written: " << (de ? de->message() : e.what()),
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
    if (background) writer_.start(write);
    else write();
  }
  barrier_();
}

void export_final_drafter(const fs::path& ckpt_dir, int64_t step, const fs::path& out, const drafter::DrafterConfig& dcfg,
                          const std::function<drafter::DrafterWeights()>& weights) {
  const fs::path end_ckpt = ckpt_dir / fmt::format("ckpt-{}", step);
  if (fs::exists(end_ckpt / "COMMIT") && fs::is_directory(end_ckpt / "drafter")) {
    fs::remove_all(out);
    fs::create_directories(out);
    for (const auto& e : fs::directory_iterator(end_ckpt / "drafter")) {
      std::error_code ec;
      fs::create_hard_link(e.path(), out / e.path().filename(), ec);
      if (ec) fs::copy_file(e.path(), out / e.path().filename(), fs::copy_options::overwrite_existing);
    }
    fsync_tree(out);
  } else {
    drafter::export_hf(out.string(), dcfg, weights());
  }
}

}  // namespace dflash::trainer
