#pragma once
// Shared scaffolding for every dflash binary: CLI11 with --version (git commit embedded at build
// time), logging, and one place that turns exceptions into one clear message and a non-zero exit.
#include <CLI/CLI.hpp>

#include <functional>
#include <string>

namespace dflash {

// "dflash 0.1.0 (commit abc123, CUDA sm 90)" or "(commit abc123, CPU only)".
std::string version_string();

// Adds --version and --log-level to `app`.
void add_common_options(CLI::App& app, std::string* log_level);

// Parses argv into `app`, then runs `body`. Returns the process exit code: 0 on success, non-zero
// after printing exactly one error report (dflash::Error with its hint, CLI errors with usage).
int run_app(CLI::App& app, int argc, char** argv, const std::function<int()>& body);

}  // namespace dflash
