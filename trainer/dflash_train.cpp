// dflash_train: trains a DFlash drafter against a frozen target (see trainer/train.h).
//
//   dflash_train                                   # the embedded default (configs/tiny.yaml)
//   dflash_train configs/tiny.yaml --set training.max_steps=50
//   mpirun -n 2 dflash_train configs/tiny.yaml --set parallel.tp=2
//
// SIGTERM / SIGINT: the ranks agree at the next step boundary, write a checkpoint and exit 0;
// running the same command again continues from it (checkpoint.resume: auto).
#include <memory>

#include "comm/comm.h"
#include "core/app.h"
#include "core/log.h"
#include "trainer/config.h"
#include "trainer/train.h"

using namespace dflash;

int main(int argc, char** argv) {
  CLI::App app{"Train a DFlash drafter (YAML config; the embedded tiny config when none is given)."};
  app.name("dflash_train");
  std::string log_level = "info", config_path;
  std::vector<std::string> sets;
  int64_t stop_after = -1;
  std::string csv_path;
  add_common_options(app, &log_level);
  app.add_option("config", config_path, "YAML config (default: the embedded configs/tiny.yaml)");
  // One value per --set, so that a config named after the options (`--set a=b CONFIG.yaml`) is the config.
  app.add_option("--set", sets, "override a config key: --set training.max_steps=50 (repeatable)")->expected(1)->allow_extra_args(false)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--csv", csv_path,
                 "append the run's benchmark rows to this CSV (the benchmarks' format: trained_tok_s_per_gpu, mfu, "
                 "peak_mem_gib, the step split; averaged over the steps after the first log interval)");
  app.add_option("--stop-after-steps", stop_after,
                 "stop as on SIGTERM once this many steps are done (checkpoint, exit 0); for tests");

  // MPI outlives run_app: a rank that fails prints its message before MPI_Finalize, which waits for
  // every rank, so no rank's exit can make mpirun kill another before it has printed.
  std::unique_ptr<comm::MpiEnv> mpi;
  return run_app(app, argc, argv, [&]() -> int {
    // Under mpirun every rank runs this; config errors are found identically on every rank before
    // any collective, so each rank prints the same one message and exits 1.
    if (env_rank() >= 0) mpi = std::make_unique<comm::MpiEnv>(&argc, &argv);
    const int world = mpi ? mpi->size() : 1, rank = mpi ? mpi->rank() : 0;
    init_logging(rank, log_level);
    trainer::TrainConfig cfg = config_path.empty() ? trainer::TrainConfig::embedded_default(sets)
                                                   : trainer::TrainConfig::from_file(config_path, sets);
    trainer::install_stop_handlers();
    trainer::RunOptions ro;
    ro.stop_after_steps = stop_after;
    ro.log_level = log_level;
    ro.csv_path = csv_path;
    if (mpi) ro.local_rank = mpi->local_rank(), ro.local_size = mpi->local_size();
    trainer::check_config(cfg, world, ro);  // every rank prints the same message and exits 1
    trainer::RunResult r;
    try {
      r = trainer::train(cfg, world, rank, ro);
    } catch (const trainer::StartupError&) {
      throw;  // every rank found it alike: each prints it and exits 1, no abort needed
    } catch (const Error& e) {
      // Under mpirun one rank's failure ends the whole job (the others may be in a collective).
      if (world > 1) comm::abort_job(e.report());
      throw;
    } catch (const std::exception& e) {
      if (world > 1) comm::abort_job(e.what());
      throw;
    }
    if (rank == 0) {
      // Steps of this start and of the whole run: a resumed run trains only those after its checkpoint.
      const long long now = r.step - r.start_step, all = r.step;
      if (r.stopped)
        std::printf("stopped at step %lld after %lld step(s) in this run; run the same command again to resume\n", all, now);
      else if (r.start_step > 0)
        std::printf("trained %lld steps in this run (%lld in all); drafter exported to %s\n", now, all, r.drafter_dir.c_str());
      else
        std::printf("trained %lld steps; drafter exported to %s\n", all, r.drafter_dir.c_str());
    }
    return 0;
  });
}
