#pragma once
// dflash_data tokenize / detokenize: JSONL text <-> token ids through a Hugging Face tokenizer.json
// (text/tokenizer.h), one output line per input line, in order:
//   dflash_data tokenize --tokenizer DIR|FILE [IN.jsonl|-] [--out F]      {"text": "..."} -> {"ids": [...]}
//   dflash_data detokenize --tokenizer DIR|FILE [IN.jsonl|-] [--out F]    {"ids": [...]}  -> {"text": "..."}
// A bad line stops the run with an error naming IN:line (and the byte offset for invalid UTF-8);
// --out is written to a temporary file renamed into place at the end, so a failed run leaves none.
// In a build without text/ (no Oniguruma / ICU) the commands exist and say so when run.
#include <memory>

#include <CLI/CLI.hpp>

namespace dflash::data {

class TextCommands {
 public:
  // Adds the two subcommands to `app`.
  explicit TextCommands(CLI::App& app);
  ~TextCommands();
  bool parsed() const;  // one of them was given on the command line
  int run() const;      // runs it; throws dflash::Error on bad input

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace dflash::data
