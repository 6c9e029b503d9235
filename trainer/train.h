#pragma once
// dflash_train's loop on the CPU backend (MPI collectives on host tensors): frozen target forward
// (tensor-parallel inside a TP group) capturing the drafter's feature layers, anchor blocks split
// round-robin among the ranks of the group, drafter forward/backward with the globally normalised
// loss, one gradient all-reduce over all ranks, grad-norm clip, AdamW, LR schedule, metrics,
// checkpoints (tmp dir + fsync + rename + COMMIT marker), resume and a clean stop on SIGTERM/SIGINT.
//
// Loss normalisation: before any backward of a step, every rank computes Σw of its own blocks over
// all micro-batches (it only needs the loss masks and the sampled anchors, no forward), and one
// all-reduce of that scalar gives the global Σw; every backward then uses grad_scale = 1 / global Σw,
// so the summed gradient is the gradient of the global loss whatever the split (ranks, tp, micro-batches).
// The same all-reduce carries the stop flag, so ranks agree on stopping at the step boundary.
//
// Anchors: the anchors of a sequence are drawn from Philox at (training.seed, stream = step·2^32 +
// the sequence's global index in the dataset), so they do not depend on which rank or micro-batch
// handles the sequence; no RNG state is carried between steps (the checkpoint records the rule).
#include <cstdint>
#include <string>

#include "core/error.h"
#include "trainer/config.h"

namespace dflash::trainer {

struct RunOptions {
  int64_t stop_after_steps = -1;  // test hook: stop as on SIGTERM once this many steps are done
  std::string log_level = "info";
  int local_rank = 0, local_size = 1;  // this rank's place on its node (its GPU is local_rank)
  // --csv: rank 0 appends the run's benchmark rows (trainer/metrics.h training_rows) to this file when
  // the run ends or stops; "" = none.
  std::string csv_path;
};

// An error found while a run starts (directories, checkpoints, data), agreed on by every rank:
// each rank throws the same one, so dflash_train prints it and exits 1 without aborting the job.
class StartupError : public Error {
 public:
  using Error::Error;
};

struct RunResult {
  int64_t step = 0;       // optimizer steps done (including skipped ones), of the whole run
  int64_t start_step = 0; // where this start began (the resumed checkpoint's step; 0 for a fresh run)
  bool stopped = false;   // stopped early (signal / stop_after_steps) after writing a checkpoint
  std::string drafter_dir;  // the exported drafter (empty when stopped early)
};

// Installs the SIGTERM / SIGINT handlers that request a stop at the next step boundary.
void install_stop_handlers();

// Every check that needs no collective (config, target config, tp against the world and the heads,
// the drafter config, parallel.device against this node's GPUs): identical on every rank, so under
// mpirun each rank prints the same one message and exits 1 (dflash_train calls it before train(),
// outside the path that aborts the whole job). train() runs it again.
void check_config(const TrainConfig& config, int world_size, const RunOptions& options);

// Runs training for this rank (world_size ranks under MPI; MPI must be initialised when > 1).
RunResult train(const TrainConfig& config, int world_size, int world_rank, const RunOptions& options);

}  // namespace dflash::trainer
