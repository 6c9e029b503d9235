#include "core/log.h"

#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>

#include "core/error.h"
#include "core/io/files.h"

namespace dflash {

namespace {
// The log file: every line appended with a checked write (io::AppendFile). spdlog swallows what a
// sink throws, so the first failure is kept here (and the file is written no more) for
// log_file_error() to report; the run stops there instead of going on without its log.
class CheckedFileSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit CheckedFileSink(const std::string& path) : file_(path) {}
  // Throws (a copy of) the first failed write, if any.
  void check() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) throw *error_;
  }
  void sync() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) throw *error_;
    file_.sync();
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    if (error_) return;
    spdlog::memory_buf_t buf;
    formatter_->format(msg, buf);
    try {
      file_.append(std::string_view(buf.data(), buf.size()));
    } catch (const Error& e) {
      error_ = e;
    }
  }
  void flush_() override {}

 private:
  io::AppendFile file_;
  std::optional<Error> error_;
};

std::shared_ptr<CheckedFileSink> g_file_sink;
}  // namespace

void check_log_file() {
  if (g_file_sink) g_file_sink->check();
}

void sync_log_file() {
  if (g_file_sink) g_file_sink->sync();
}

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
  DFLASH_REQUIRE_HINT(parsed != spdlog::level::off || lvl == "off", "unknown log level '" << lvl << "'",
                    "use trace, debug, info, warn, error or off");
  std::vector<spdlog::sink_ptr> sinks;
  sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  g_file_sink.reset();
  if (!log_file.empty()) {
    g_file_sink = std::make_shared<CheckedFileSink>(log_file);  // appends: a resumed run keeps the earlier lines
    sinks.push_back(g_file_sink);
  }
  auto logger = std::make_shared<spdlog::logger>("dflash", sinks.begin(), sinks.end());
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [rank " + std::to_string(rank) + "] [%^%l%$] %v");
  logger->set_level(parsed);
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(logger);
}

}  // namespace dflash
