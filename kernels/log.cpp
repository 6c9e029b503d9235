#include "kernels/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>

#include "kernels/error.h"

namespace dflash {

int env_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"}) {
    if (const char* v = std::getenv(var)) {
      char* end = nullptr;
      long r = std::strtol(v, &end, 10);
      if (end != v && r >= 0) return static_cast<int>(r);
    }
  }
  return -1;
}

void init_logging(int rank, const std::string& level, const std::string& log_file) {
  if (rank < 0) rank = std::max(0, env_rank());
  std::string lvl = level;
  if (const char* env = std::getenv("DFLASH_LOG_LEVEL")) lvl = env;
  auto parsed = spdlog::level::from_str(lvl);
  DFLASH_CHECK_HINT(parsed != spdlog::level::off || lvl == "off", "unknown log level '" << lvl << "'",
                    "use trace, debug, info, warn, error or off");
  std::vector<spdlog::sink_ptr> sinks;
  sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  if (!log_file.empty()) sinks.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(log_file, true));
  auto logger = std::make_shared<spdlog::logger>("dflash", sinks.begin(), sinks.end());
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [rank " + std::to_string(rank) + "] [%^%l%$] %v");
  logger->set_level(parsed);
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(logger);
}

}  // namespace dflash
