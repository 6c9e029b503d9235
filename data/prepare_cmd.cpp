#include "data/prepare_cmd.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "core/app.h"
#include "core/error.h"
#include "data/dataset.h"
#include "data/prepare.h"
#ifdef DFLASH_WITH_TEXT
#include "text/tokenizer.h"
#endif

namespace dflash::data {

struct PrepareCommands::State {
  CLI::App* prepare = nullptr;
  CLI::App* dump = nullptr;
  PrepareOptions opt;
  std::string input, out, think = "in", enable_thinking;
  bool no_progress = false;
  // dump --text
  bool text = false;
  std::string dump_tokenizer, marks = "auto";
  const std::vector<std::string>* dump_files = nullptr;
  const int64_t *dump_first = nullptr, *dump_count = nullptr;
};

PrepareCommands::PrepareCommands(CLI::App& app, std::string* log_level, CLI::App* dump, const std::vector<std::string>* dump_files,
                                 const int64_t* dump_first, const int64_t* dump_count)
    : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.dump = dump;
  s.dump_files = dump_files;
  s.dump_first = dump_first;
  s.dump_count = dump_count;
  CLI::App* p = add_subcommand(app, "prepare",
                               "conversations JSONL (OpenAI messages, ShareGPT conversations, or {\"text\"}) -> the target's chat "
                               "template -> ids + a loss mask on the assistant turns (HDF5)",
                               log_level);
  s.prepare = p;
  p->add_option("input", s.input, "input JSONL, one conversation a line")->required();
  p->add_option("--tokenizer", s.opt.tokenizer,
                "the target's directory (tokenizer.json + tokenizer_config.json or chat_template.jinja), or a tokenizer.json")
      ->required();
  p->add_option("--out,-o", s.out, "output .h5 file (written to <out>.tmp and renamed when complete)")->required();
  p->add_option("--chat-template", s.opt.chat_template, "a .jinja chat template to use instead of the tokenizer directory's own");
  p->add_option("--think", s.think, "the <think>...</think> block of assistant turns: in or out of the loss")
      ->capture_default_str()
      ->check(CLI::IsMember({"in", "out"}));
  p->add_flag("--last-turn-only", s.opt.last_turn_only, "supervise only the last assistant turn of each conversation");
  p->add_flag("--prompts", s.opt.prompts_only,
              "every row a prompt (all-zero mask): conversations without their trailing assistant turns, with the generation "
              "prompt; text rows as they are (prompt sets for regenerate and dflash_eval)");
  p->add_option("--enable-thinking", s.enable_thinking, "the template's enable_thinking (default: the template's own default)")
      ->check(CLI::IsMember({"true", "false"}));
  p->add_option("--max-length", s.opt.max_length, "truncate longer sequences to this many tokens, and count them (0: no limit)")
      ->capture_default_str();
  p->add_flag("--skip-bad", s.opt.skip_bad, "skip (and count) bad rows instead of stopping at the first");
  p->add_option("--threads", s.opt.threads, "threads (0: all cores)")->capture_default_str();
  p->add_flag("--no-progress", s.no_progress, "no progress line on stderr");

  dump->add_flag("--text", s.text, "print each sequence decoded, its supervised spans marked (needs --tokenizer): ANSI colour "
                                   "(green) on a terminal, else \xC2\xAB...\xC2\xBB brackets; see --marks");
  dump->add_option("--tokenizer", s.dump_tokenizer, "with --text: the tokenizer directory or tokenizer.json the ids came from");
  dump->add_option("--marks", s.marks, "with --text: how supervised spans are marked: auto (colour on a terminal), color, brackets")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "color", "brackets"}));
}

PrepareCommands::~PrepareCommands() = default;

bool PrepareCommands::parsed() const {
  const State& s = *s_;
  return s.prepare->parsed() || (s.dump->parsed() && (s.text || !s.dump_tokenizer.empty() || s.marks != "auto"));
}

int PrepareCommands::run() const {
  const State& s = *s_;
  if (s.prepare->parsed()) {
    PrepareOptions opt = s.opt;
    opt.think = s.think == "out" ? ThinkMode::out : ThinkMode::in;
    if (!s.enable_thinking.empty()) opt.enable_thinking = s.enable_thinking == "true";
    opt.progress = !s.no_progress;
    const PrepareSummary sum = prepare_jsonl(s.input, s.out, opt);
    std::printf("prepare: %s -> %s\n%s\n", s.input.c_str(), s.out.c_str(), sum.describe().c_str());
    return 0;
  }
#ifndef DFLASH_WITH_TEXT
  DFLASH_REJECT_HINT("dflash_data dump --text: this build has no tokenizer (text/ was skipped)",
                     "install libonig-dev and libicu-dev (scripts/common.sh lists them) and configure again");
#else
  DFLASH_REQUIRE_HINT(s.text, "dflash_data dump: --tokenizer and --marks go with --text", "add --text to print the decoded text");
  DFLASH_REQUIRE_HINT(!s.dump_tokenizer.empty(), "dflash_data dump --text needs --tokenizer",
                      "pass the tokenizer directory (or tokenizer.json) the dataset was made with");
  const text::Tokenizer tok = text::Tokenizer::from_file(s.dump_tokenizer);
  const Dataset ds(expand_paths(*s.dump_files));
  const bool color = s.marks == "color" || (s.marks == "auto" && ::isatty(STDOUT_FILENO) != 0);
  const char* open = color ? "\033[32m" : "\xC2\xAB";   // «
  const char* close = color ? "\033[0m" : "\xC2\xBB";   // »
  const int64_t first = *s.dump_first;
  const int64_t end = *s.dump_count < 0 ? ds.num_sequences() : std::min(ds.num_sequences(), first + *s.dump_count);
  for (int64_t i = first; i < end; ++i) {
    const Sequence q = ds.sequence(i);
    size_t sup = 0;
    for (uint8_t m : q.mask) sup += m;
    std::printf("=== sequence %lld: %zu tokens, %zu supervised\n", static_cast<long long>(i), q.ids.size(), sup);
    // Runs of equal mask are decoded whole (a character split over two tokens of one run decodes right).
    std::string out;
    for (size_t a = 0; a < q.ids.size();) {
      size_t b = a;
      while (b < q.ids.size() && q.mask[b] == q.mask[a]) ++b;
      std::vector<uint32_t> run(q.ids.begin() + static_cast<std::ptrdiff_t>(a), q.ids.begin() + static_cast<std::ptrdiff_t>(b));
      std::string t;
      try {
        t = tok.decode(run);
      } catch (const Error& e) {
        DFLASH_REJECT_HINT("dump --text: sequence " << i << ": " << e.message(), "pass the tokenizer the dataset was made with");
      }
      if (q.mask[a]) out += open + t + close;
      else out += t;
      a = b;
    }
    std::fwrite(out.data(), 1, out.size(), stdout);
    if (out.empty() || out.back() != '\n') std::fputc('\n', stdout);
  }
  return 0;
#endif
}

}  // namespace dflash::data
