#pragma once
// Logging through spdlog's default logger, with the MPI rank in every line:
//   [2026-11-30 08:00:00.123] [rank 0] [info] message
#include <spdlog/spdlog.h>

#include <string>

namespace dflash {

// rank < 0: read the rank from the launcher's environment (Open MPI, PMI, Slurm), else 0.
// level: "trace", "debug", "info", "warn", "error"; also from DFLASH_LOG_LEVEL when set.
// log_file: when non-empty, lines also go to that file.
void init_logging(int rank = -1, const std::string& level = "info", const std::string& log_file = {});

// Rank from the environment (OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID), -1 when none is set.
int env_rank();

}  // namespace dflash
