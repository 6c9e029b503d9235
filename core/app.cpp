#include "core/app.h"

#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "dflash/version.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"

namespace dflash {

std::string version_string() {
  std::string s = std::string("dflash ") + kVersion + " (commit " + kGitCommit;
  s += kBuiltWithCuda ? std::string(", CUDA archs ") + kCudaArchs : std::string(", CPU only");
  return s + ")";
}

void add_common_options(CLI::App& app, std::string* log_level) {
  app.set_version_flag("--version", version_string());
  app.add_option("--log-level", *log_level, "trace|debug|info|warn|error (debug: errors name their source file:line)")
      ->capture_default_str();
}

CLI::App* add_subcommand(CLI::App& app, const std::string& name, const std::string& description, std::string* log_level) {
  CLI::App* sub = app.add_subcommand(name, description);
  add_common_options(*sub, log_level);
  return sub;
}

std::vector<int32_t> parse_token_ids(const std::string& text, const std::string& where) {
  std::vector<int32_t> ids;
  std::string tok;
  auto flush = [&] {
    if (tok.empty()) return;
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(tok.c_str(), &end, 10);
    DFLASH_REQUIRE_HINT(end && *end == '\0' && errno == 0 && v >= 0 && v <= INT32_MAX, where << ": '" << tok << "' is not a token id",
                      "token ids are non-negative integers separated by commas or spaces");
    ids.push_back(static_cast<int32_t>(v));
    tok.clear();
  };
  for (char ch : text) {
    if (ch == ',' || std::isspace(static_cast<unsigned char>(ch))) flush();
    else tok.push_back(ch);
  }
  flush();
  return ids;
}

void check_device_visible(const Device& dev, const std::string& flag) {
  if (!dev.is_cuda()) return;
  const int n = cuda_device_count();
  DFLASH_REQUIRE_HINT(dev.index < n, flag << " " << dev.str() << ": " << n << " CUDA device(s) visible",
                    "check nvidia-smi and CUDA_VISIBLE_DEVICES, or use " << flag << " cpu");
}

int run_app(CLI::App& app, int argc, char** argv, const std::function<int()>& body) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return body();
  } catch (const std::exception& e) {
    // The debug log level (--log-level debug or DFLASH_LOG_LEVEL=debug, set by init_logging) shows
    // every error's file:line, a user's included.
    const bool debug = spdlog::should_log(spdlog::level::debug);
    spdlog::shutdown();
    const auto* de = dynamic_cast<const Error*>(&e);
    const std::string text = de ? de->report(debug) : e.what();
    // Under mpirun every rank may print: say which one.
    const int rank = env_rank();
    const std::string who = rank >= 0 ? "[rank " + std::to_string(rank) + "] " : "";
    std::fprintf(stderr, "%s%s: error: %s\n", who.c_str(), app.get_name().c_str(), text.c_str());
  }
  return 1;
}

}  // namespace dflash
