#pragma once
// Shared scaffolding for every dflash binary: CLI11 with --version (git commit embedded at build
// time), logging, and one place that turns exceptions into one clear message and a non-zero exit.
#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dflash {

// "dflash 0.1.0 (commit abc123, CUDA sm 90)" or "(commit abc123, CPU only)".
std::string version_string();

// Adds --version and --log-level to `app` (a program or one of its subcommands).
void add_common_options(CLI::App& app, std::string* log_level);
// A subcommand of `app` that takes the common options too, into the same `log_level`: every program
// and every subcommand answers --version and --log-level, before or after the subcommand's name.
CLI::App* add_subcommand(CLI::App& app, const std::string& name, const std::string& description, std::string* log_level);

// Token ids separated by commas or whitespace ("1,2, 3 4"); `where` names the source in errors
// (e.g. "ids.txt:3"). Ids are non-negative int32.
std::vector<int32_t> parse_token_ids(const std::string& text, const std::string& where);

// Parses argv into `app`, then runs `body`. Returns the process exit code: 0 on success, non-zero
// after printing exactly one error report (dflash::Error with its hint, CLI errors with usage). A
// user error (core/error.h) reads as a message to the user; an internal one names its file:line, and
// at the debug log level every error does.
int run_app(CLI::App& app, int argc, char** argv, const std::function<int()>& body);

}  // namespace dflash
