#pragma once
// dflash_train's checkpoints: finding the one a run resumes from (checked before any GPU work),
// writing new ones (ckpt-<step>.tmp filled and fsynced, renamed, then the COMMIT marker; rank 0 in
// the background while training goes on), keep_last pruning, and the final drafter export.
//
// A checkpoint directory ckpt-<step>/ holds drafter/ (the HF export), optimizer.safetensors (fp32
// masters and both AdamW moments), state.json (step, schedule, skipped-step counters, the anchor
// RNG rule, the world layout), loader-g<group>.json (each TP group's data position), config.yaml
// and COMMIT. Only a directory with COMMIT is complete; resume never takes another.
#include <atomic>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "drafter/config.h"
#include "core/io/files.h"
#include "trainer/backend.h"
#include "trainer/config.h"
#include "trainer/optimizer.h"

namespace dflash::trainer {

namespace fs = std::filesystem;

// ---- files ----
void fsync_path(const fs::path& p);  // (best effort: a path that cannot be opened is skipped)
void fsync_tree(const fs::path& dir);
void write_text(const fs::path& p, const std::string& text);  // truncates, writes, fsyncs; throws naming p
std::string read_text(const fs::path& p);

// ckpt-<step> directories under `dir` with a COMMIT marker, sorted by step.
std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const fs::path& dir);
// "ckpt-8, ckpt-12" (for messages), at most `max` of them named.
std::string checkpoint_names(const std::vector<std::pair<int64_t, fs::path>>& all, size_t max = 6);
// What a user can do when checkpoint `bad` cannot be resumed ("an older complete checkpoint exists: ...").
std::string older_checkpoint_hint(const fs::path& bad);
// A JSON object file of checkpoint `ckpt`; a missing or unparsable file names itself and the checkpoint.
nlohmann::json read_checkpoint_json(const fs::path& ckpt, const std::string& name);

// Where a run continues from: a complete checkpoint with its state.json and this TP group's loader
// position read and checked (before any GPU work), or none (step 0).
struct ResumePoint {
  fs::path from;  // empty: start at step 0
  nlohmann::json state, loader;
  int64_t step = 0, skipped = 0, skipped_in_row = 0;
};
// checkpoint.resume (auto / never / PATH) against the checkpoints under ckpt_dir; throws naming the
// checkpoint and the way out when it cannot be resumed (world size, tp, later checkpoints, files).
ResumePoint find_resume_point(const TrainConfig& cfg, const fs::path& ckpt_dir, int world, int tp, int tp_group);

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

// The run's checkpoint writer. save() is collective: every rank takes part (the first rank of each
// TP group writes its loader position); rank 0 copies the drafter and optimizer state to the host
// and writes the files, in the background when `background` (the periodic ones: the next steps run
// meanwhile), else before returning (stop, end of run).
class Checkpointer {
 public:
  // `barrier`: a barrier over all ranks (a no-op in a world of one).
  Checkpointer(const TrainConfig& cfg, const drafter::DrafterConfig& dcfg, const comm::Layout& layout, int world, int rank,
               int64_t total_steps, const LrSchedule& sched, std::function<void()> barrier);
  // Skipped-step counters are the run's at `at_step`; `metrics` is rank 0's metrics.jsonl (synced with
  // the log first: a full disk reports at fsync, and stops the run here).
  void save(int64_t at_step, const nlohmann::json& loader_state, bool background, TrainBackend& backend,
            io::AppendFile& metrics, int64_t skipped, int64_t skipped_in_row);
  // Rank 0: rethrows a failed background write (check: without waiting; wait: after it finished).
  void check() {
    if (rank_ == 0) writer_.check();
  }
  void wait() {
    if (rank_ == 0) writer_.wait();
  }
  const fs::path& dir() const { return dir_; }

 private:
  const TrainConfig& cfg_;
  drafter::DrafterConfig dcfg_;
  comm::Layout layout_;
  int world_, rank_;
  int64_t total_;
  LrSchedule sched_;
  std::function<void()> barrier_;
  fs::path dir_;
  std::string cfg_yaml_;
  size_t keep_last_;
  int64_t fault_step_;  // test hook: DFLASH_FAULT_CHECKPOINT_WRITE=N fails the write of the step-N checkpoint
  int64_t pause_step_ = -1, pause_ms_ = 0;  // test hook: DFLASH_FAULT_CHECKPOINT_PAUSE=N:MS
  BackgroundWriter writer_;  // (last: joined before the members its job reads)
};

// Rank 0, at the end of a run: the final drafter into `out`. When a complete checkpoint of this very
// step exists (checkpoint.at_end), its drafter/ is that export already: its files are hard-linked (a
// copy across file systems) instead of writing the same gigabytes again; otherwise `weights()` is
// exported.
void export_final_drafter(const fs::path& ckpt_dir, int64_t step, const fs::path& out, const drafter::DrafterConfig& dcfg,
                          const std::function<drafter::DrafterWeights()>& weights);

}  // namespace dflash::trainer
