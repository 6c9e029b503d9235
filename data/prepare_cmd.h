#pragma once
// dflash_data prepare (data/prepare.h) and dump --text, the two text views of a dataset:
//   dflash_data prepare IN.jsonl --tokenizer DIR --out data.h5 [--think in|out] [--last-turn-only] [--prompts]
//       [--enable-thinking true|false] [--max-length N] [--skip-bad] [--chat-template FILE] [--threads N]
//   dflash_data dump data.h5 --text --tokenizer DIR      each sequence decoded, supervised spans marked
// Kept apart from dflash_data.cpp so the other subcommands' edits merge without touching these.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace dflash::data {

class PrepareCommands {
 public:
  // Adds `prepare` to `app`, and --text / --tokenizer / --marks to the existing `dump` subcommand
  // (whose files / first / count options the caller owns and passes here).
  PrepareCommands(CLI::App& app, std::string* log_level, CLI::App* dump, const std::vector<std::string>* dump_files,
                  const int64_t* dump_first, const int64_t* dump_count);
  ~PrepareCommands();
  bool parsed() const;  // prepare was given, or dump with --text
  int run() const;      // runs it; throws dflash::Error on bad input

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace dflash::data
