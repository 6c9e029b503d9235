#pragma once
// Logging through spdlog's default logger, with the MPI rank in every line:
//   [2026-11-30 08:00:00.123] [rank 0] [info] message
#include <spdlog/spdlog.h>

#include <string>

namespace dflash {

// rank < 0: read the rank from the launcher's environment (Open MPI, PMI, Slurm), else 0.
// level: "trace", "debug", "info", "warn", "error"; also from DFLASH_LOG_LEVEL when set.
// log_file: when non-empty, lines are also appended to that file, each write checked.
void init_logging(int rank = -1, const std::string& level = "info", const std::string& log_file = {});

// Throws the first failed write to the log file ("writing '.../rank-0.log' failed: No space left on
// device", with its hint); nothing while every line has been written. spdlog itself swallows sink
// errors, so long-running programs call this (cheap) and stop instead of going on without a log.
void check_log_file();
// fsync of the log file; throws when that or an earlier write failed.
void sync_log_file();

// Rank from the environment (OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID), -1 when none is set.
int env_rank();

}  // namespace dflash
