#include "kernels/app.h"

#include <cstdio>
#include <iostream>

#include "dflash/version.h"
#include "kernels/error.h"
#include "kernels/log.h"

namespace dflash {

std::string version_string() {
  std::string s = std::string("dflash ") + kVersion + " (commit " + kGitCommit;
  s += kBuiltWithCuda ? std::string(", CUDA archs ") + kCudaArchs : std::string(", CPU only");
  return s + ")";
}

void add_common_options(CLI::App& app, std::string* log_level) {
  app.set_version_flag("--version", version_string());
  app.add_option("--log-level", *log_level, "trace|debug|info|warn|error")->capture_default_str();
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
    spdlog::shutdown();
    // Under mpirun every rank may print: say which one.
    const int rank = env_rank();
    const std::string who = rank >= 0 ? "[rank " + std::to_string(rank) + "] " : "";
    std::fprintf(stderr, "%s%s: error: %s\n", who.c_str(), app.get_name().c_str(), e.what());
  }
  return 1;
}

}  // namespace dflash
