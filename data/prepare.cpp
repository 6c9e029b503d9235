#include "data/prepare.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/dataset.h"
#ifdef DFLASH_WITH_TEXT
#include "text/chat_template.h"
#include "text/conversation.h"
#include "text/tokenizer.h"
#include "text/utf8.h"
#include "core/worker_pool.h"
#endif

namespace dflash::data {

namespace fs = std::filesystem;

std::string PrepareSummary::describe() const {
  std::ostringstream os;
  char share[32];
  std::snprintf(share, sizeof share, "%.1f%%", tokens ? 100.0 * static_cast<double>(supervised) / static_cast<double>(tokens) : 0.0);
  os << "rows:        " << rows << "\n"
     << "written:     " << written << " sequences\n"
     << "tokens:      " << tokens << " (" << supervised << " supervised, " << share << ")\n"
     << "prompt-only: " << prompt_only << " (all-zero mask, with the generation prompt)\n"
     << "truncated:   " << truncated << "\n"
     << "bad rows:    " << bad_skipped << (bad_skipped ? " skipped" : "");
  if (served_arguments + served_content + served_reasoning > 0)
    os << "\nas served:   " << served_arguments << " rows' tool-call arguments parsed from JSON strings (or {}), " << served_content
       << " rows' null content as \"\", " << served_reasoning << " rows' \"reasoning\" as reasoning_content (vLLM's rules)";
  if (!first_bad.empty()) os << "\n  first bad row: " << first_bad;
  return os.str();
}

#ifndef DFLASH_WITH_TEXT
PrepareSummary prepare_jsonl(const std::string&, const std::string&, const PrepareOptions&, const text::Tokenizer&) {
  DFLASH_REJECT_HINT("prepare: this build has no tokenizer (text/ was skipped)",
                     "install libonig-dev and libicu-dev (scripts/common.sh lists them) and configure again");
}
PrepareSummary prepare_jsonl(const std::string&, const std::string&, const PrepareOptions&) {
  DFLASH_REJECT_HINT("prepare: this build has no tokenizer (text/ was skipped)",
                     "install libonig-dev and libicu-dev (scripts/common.sh lists them) and configure again");
}
#else

namespace {

using ojson = nlohmann::ordered_json;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DFLASH_CHECK_IO(f.good(), "opening", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  DFLASH_CHECK_IO(!f.bad(), "reading", path);
  return ss.str();
}

// tokenizer_config.json's bos / eos: a string or {"content": ...}.
std::string config_token(const nlohmann::json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) return (*it)["content"].get<std::string>();
  return "";
}

bool known_role(const std::string& r) { return r == "system" || r == "user" || r == "assistant" || r == "tool"; }

struct Row {
  Sequence seq;
  bool prompt_only = false, truncated = false;
  text::ServingChanges served;  // what the serving rules changed in the row's messages
  std::string error;  // non-empty: a bad row ("IN:line: ...")
  std::string hint;
};

struct Preparer {
  const PrepareOptions& o;
  const text::Tokenizer& tok;
  std::optional<text::ChatTemplate> tmpl;
  std::string tmpl_error, tmpl_hint;  // the template could not be loaded: chat rows are refused with this

  Preparer(const PrepareOptions& opt, const text::Tokenizer& t) : o(opt), tok(t) {
    const fs::path dir = fs::is_directory(opt.tokenizer) ? fs::path(opt.tokenizer) : fs::path(opt.tokenizer).parent_path();
    try {
      if (opt.chat_template.empty()) {
        tmpl.emplace(text::ChatTemplate::from_dir(dir.empty() ? "." : dir.string()));
      } else {
        nlohmann::json cfg = nlohmann::json::object();
        const fs::path cfg_path = dir / "tokenizer_config.json";
        if (fs::exists(cfg_path)) {
          try {
            cfg = nlohmann::json::parse(read_file(cfg_path.string()));
          } catch (const nlohmann::json::exception& e) {
            DFLASH_REJECT_HINT(cfg_path.string() << ": not valid JSON (" << e.what() << ")", "fix or re-download the file");
          }
        }
        tmpl.emplace(text::ChatTemplate::from_string(read_file(opt.chat_template), opt.chat_template, config_token(cfg, "bos_token"),
                                                     config_token(cfg, "eos_token")));
      }
      (void)tmpl->assistant_header();  // throws when the template's assistant turns cannot be found
    } catch (const Error& e) {
      tmpl.reset();
      tmpl_error = e.message();
      tmpl_hint = e.hint();
    }
  }

  // One line -> one sequence, or the row's error. `where` is "IN:line".
  Row prepare(const std::string& line, const std::string& where) const {
    Row r;
    try {
      r = prepare_or_throw(line, where);
    } catch (const Error& e) {
      r.error = e.message();
      r.hint = e.hint();
      if (r.error.rfind(where, 0) != 0) r.error = where + ": " + r.error;
    }
    return r;
  }

  Row prepare_or_throw(const std::string& line, const std::string& where) const {
    const size_t bad = text::invalid_utf8_offset(line);
    if (bad != text::kValidUtf8) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned char>(line[bad]));
      DFLASH_REJECT_HINT(where << ": invalid UTF-8 at byte " << bad << " of the line (" << hex << ")",
                         "the input must be UTF-8 text; re-encode the file (e.g. iconv -t UTF-8)");
    }
    ojson j;
    try {
      j = ojson::parse(line);
    } catch (const ojson::exception& e) {
      DFLASH_REJECT_HINT(where << ": not valid JSON: " << e.what(), "one JSON object per line");
    }
    const char* forms = "a row is {\"messages\": [{\"role\", \"content\"}, ...]}, {\"conversations\": [{\"from\", \"value\"}, ...]} or {\"text\": \"...\"}";
    DFLASH_REQUIRE_HINT(j.is_object(), where << ": the row is not a JSON object", forms);
    Row r;
    if (j.contains("text") && !j.contains("messages") && !j.contains("conversations")) {
      DFLASH_REQUIRE_HINT(j["text"].is_string(), where << ": \"text\" is not a string (" << j["text"].type_name() << ")", forms);
      const std::string& t = j["text"].get_ref<const std::string&>();
      DFLASH_REQUIRE_HINT(!t.empty(), where << ": \"text\" is empty", "drop the row, or give it text");
      std::vector<uint32_t> ids = tok.encode(t);
      r.seq.ids.assign(ids.begin(), ids.end());
      r.seq.mask.assign(ids.size(), o.prompts_only ? 0 : 1);  // plain text: every token a target, or all of it a prompt
      r.prompt_only = o.prompts_only;
      finish(r);
      return r;
    }
    ojson messages = ojson::array();
    if (j.contains("messages")) {
      DFLASH_REQUIRE_HINT(!j.contains("conversations"), where << ": the row has both \"messages\" and \"conversations\"", forms);
      const ojson& m = j["messages"];
      DFLASH_REQUIRE_HINT(m.is_array(), where << ": \"messages\" is not a list (" << m.type_name() << ")", forms);
      for (size_t i = 0; i < m.size(); ++i) {
        DFLASH_REQUIRE_HINT(m[i].is_object(), where << ": messages[" << i << "] is not an object", "each message is {\"role\": ..., \"content\": ...}");
        DFLASH_REQUIRE_HINT(m[i].contains("role") && m[i]["role"].is_string(), where << ": messages[" << i << "] has no string \"role\"",
                            "each message is {\"role\": ..., \"content\": ...}");
        const std::string& role = m[i]["role"].get_ref<const std::string&>();
        DFLASH_REQUIRE_HINT(known_role(role), where << ": messages[" << i << "].role = \"" << role << "\" is not a known role",
                            "roles: system, user, assistant, tool");
      }
      messages = m;
      r.served = text::serving_messages(messages, where);  // as vLLM / SGLang pass them to the template
    } else if (j.contains("conversations")) {
      messages = text::sharegpt_messages(j, where);
    } else {
      DFLASH_REJECT_HINT(where << ": the row has none of \"messages\", \"conversations\", \"text\"", forms);
    }
    DFLASH_REQUIRE_HINT(!messages.empty(), where << ": the conversation has no messages", "drop the row, or give it messages");
    if (!tmpl) DFLASH_REJECT_HINT(where << ": no chat template: " << tmpl_error, tmpl_hint);

    if (o.prompts_only) {
      // The prompt: the conversation without its trailing assistant turns.
      while (!messages.empty() && messages.back()["role"] == "assistant") messages.erase(messages.size() - 1);
      DFLASH_REQUIRE_HINT(!messages.empty(), where << ": with --prompts the conversation has no turn before its assistant turns",
                          "drop the row, or give it a user turn");
    }
    size_t assistants = 0;
    for (const auto& m : messages) assistants += m["role"] == "assistant";
    r.prompt_only = assistants == 0 || o.prompts_only;
    text::ChatOptions co;
    co.add_generation_prompt = r.prompt_only;  // a prompt-only row is made ready for regenerate
    co.enable_thinking = o.enable_thinking;
    if (j.contains("tools") && !j["tools"].is_null()) {
      DFLASH_REQUIRE_HINT(j["tools"].is_array(), where << ": \"tools\" is not a list", "tools: a list of tool schemas");
      co.tools_ordered = j["tools"];
    }
    text::Rendered rendered;
    try {
      rendered = tmpl->render_with_spans(messages, co);
    } catch (const Error& e) {
      DFLASH_REJECT_HINT(where << ": the chat template refused the row: " << e.message(),
                         e.hint().empty() ? std::string("check the row's messages against what the template accepts") : e.hint());
    }
    // The supervised byte ranges of the text.
    std::vector<std::pair<size_t, size_t>> ranges;
    for (size_t k = 0; k < rendered.assistant.size() && !o.prompts_only; ++k) {
      if (o.last_turn_only && k + 1 != rendered.assistant.size()) continue;
      const text::AssistantSpan& s = rendered.assistant[k];
      if (o.think == ThinkMode::out && s.think_end > s.think_begin) {
        if (s.think_begin > s.begin) ranges.push_back({s.begin, s.think_begin});
        if (s.end > s.think_end) ranges.push_back({s.think_end, s.end});
      } else {
        ranges.push_back({s.begin, s.end});
      }
    }
    const text::Tokenizer::Encoding enc = tok.encode_with_offsets(rendered.text);
    r.seq.ids.assign(enc.ids.begin(), enc.ids.end());
    r.seq.mask.assign(enc.ids.size(), 0);
    // A token is supervised when its bytes overlap a range (ranges and offsets both ascend).
    size_t q = 0;
    for (size_t t = 0; t < enc.ids.size(); ++t) {
      const auto [b, e] = enc.offsets[t];
      while (q < ranges.size() && ranges[q].second <= b) ++q;
      if (q < ranges.size() && ranges[q].first < e && b < ranges[q].second) r.seq.mask[t] = 1;
    }
    DFLASH_REQUIRE_HINT(!r.seq.ids.empty(), where << ": the conversation renders to no tokens", "drop the row");
    finish(r);
    return r;
  }

  void finish(Row& r) const {
    DFLASH_REQUIRE_HINT(!r.seq.ids.empty(), "the row has no tokens", "drop the row");
    if (o.max_length > 0 && r.seq.ids.size() > o.max_length) {
      r.seq.ids.resize(o.max_length);
      r.seq.mask.resize(o.max_length);
      r.truncated = true;
    }
  }
};

// The progress line on stderr: rows, the share of the input read, tokens, rate, eta.
class Progress {
 public:
  Progress(bool on, uint64_t total_bytes)
      : on_(on), tty_(::isatty(STDERR_FILENO) != 0), total_(total_bytes), start_(clock::now()), last_(start_) {}
  void update(size_t rows, uint64_t bytes, size_t tokens, bool force = false) {
    if (!on_) return;
    const auto now = clock::now();
    if (!force && now - last_ < (tty_ ? std::chrono::milliseconds(200) : std::chrono::milliseconds(15000))) return;
    last_ = now;
    const double el = std::chrono::duration<double>(now - start_).count();
    const double frac = total_ ? std::min(1.0, static_cast<double>(bytes) / static_cast<double>(total_)) : 1.0;
    const double eta = frac > 0 ? el * (1 - frac) / frac : 0;
    std::fprintf(stderr, "%sprepare: %zu rows (%.0f%%), %zu tokens, %.1f MB/s, eta %.0f s%s", tty_ ? "\r\033[K" : "", rows, 100 * frac,
                 tokens, el > 0 ? static_cast<double>(bytes) / el / 1e6 : 0.0, eta, tty_ ? "" : "\n");
    std::fflush(stderr);
    drawn_ = tty_;
  }
  void clear() {
    if (drawn_) std::fprintf(stderr, "\r\033[K");
    drawn_ = false;
  }
  ~Progress() { clear(); }

 private:
  using clock = std::chrono::steady_clock;
  bool on_, tty_, drawn_ = false;
  uint64_t total_;
  clock::time_point start_, last_;
};

}  // namespace

PrepareSummary prepare_jsonl(const std::string& in_jsonl, const std::string& out_h5, const PrepareOptions& options) {
  DFLASH_REQUIRE_HINT(!options.tokenizer.empty(), "prepare: no tokenizer given", "pass --tokenizer DIR (the target's directory) or a tokenizer.json");
  const text::Tokenizer tok = text::Tokenizer::from_file(options.tokenizer);
  return prepare_jsonl(in_jsonl, out_h5, options, tok);
}

PrepareSummary prepare_jsonl(const std::string& in_jsonl, const std::string& out_h5, const PrepareOptions& options,
                             const text::Tokenizer& tokenizer) {
  DFLASH_REQUIRE_HINT(!options.tokenizer.empty(), "prepare: no tokenizer given", "pass --tokenizer DIR (the target's directory) or a tokenizer.json");
  DFLASH_REQUIRE_HINT(!out_h5.empty(), "prepare: no output file given", "pass --out data.h5");
  DFLASH_REQUIRE_HINT(fs::absolute(in_jsonl) != fs::absolute(out_h5), "prepare: the output " << out_h5 << " is the input",
                      "write the dataset to another file");
  const Preparer prep(options, tokenizer);
  std::ifstream in(in_jsonl, std::ios::binary);
  DFLASH_CHECK_IO(in.good(), "opening", in_jsonl);
  std::error_code ec;
  const uintmax_t size = fs::file_size(in_jsonl, ec);
  const unsigned threads = std::clamp(options.threads ? options.threads : std::thread::hardware_concurrency(), 1u, 64u);

  DatasetWriter w(out_h5, static_cast<int64_t>(prep.tok.vocab_size()));
  PrepareSummary sum;
  Progress bar(options.progress, ec ? 0 : size);
  WorkerPool pool(static_cast<int>(threads));
  constexpr size_t kBatch = 1024;
  std::vector<std::string> lines;
  std::vector<int64_t> numbers;  // 1-based line number of each line of the batch
  std::vector<Row> rows;
  int64_t lineno = 0;
  uint64_t bytes = 0;
  bool done = false;
  while (!done) {
    lines.clear();
    numbers.clear();
    std::string line;
    while (lines.size() < kBatch && std::getline(in, line)) {
      ++lineno;
      bytes += line.size() + 1;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") == std::string::npos) continue;  // blank lines are skipped, not counted
      lines.push_back(std::move(line));
      numbers.push_back(lineno);
    }
    DFLASH_CHECK_IO(!in.bad(), "reading", in_jsonl);
    done = lines.size() < kBatch;
    rows.assign(lines.size(), Row());
    pool.run([&](int t) {
      for (size_t k = static_cast<size_t>(t); k < lines.size(); k += static_cast<size_t>(pool.threads()))
        rows[k] = prep.prepare(lines[k], in_jsonl + ":" + std::to_string(numbers[k]));
    });
    for (Row& r : rows) {
      ++sum.rows;
      if (!r.error.empty()) {
        if (!options.skip_bad) {
          bar.clear();
          DFLASH_REJECT_HINT(r.error, (r.hint.empty() ? std::string() : r.hint + "; ") + "--skip-bad skips (and counts) bad rows");
        }
        if (sum.bad_skipped == 0) sum.first_bad = r.error;
        ++sum.bad_skipped;
        continue;
      }
      w.append(r.seq);
      ++sum.written;
      sum.prompt_only += r.prompt_only;
      sum.truncated += r.truncated;
      sum.served_arguments += r.served.arguments > 0;
      sum.served_content += r.served.content > 0;
      sum.served_reasoning += r.served.reasoning > 0;
      sum.tokens += r.seq.ids.size();
      for (uint8_t m : r.seq.mask) sum.supervised += m;
    }
    bar.update(sum.rows, bytes, sum.tokens);
  }
  bar.update(sum.rows, bytes, sum.tokens, true);
  bar.clear();
  DFLASH_REQUIRE_HINT(sum.written > 0,
                      "prepare: " << in_jsonl << " gave no sequence (" << sum.rows << " rows, " << sum.bad_skipped << " bad)"
                                  << (sum.first_bad.empty() ? "" : "; first bad row: " + sum.first_bad),
                      "check the input file");
  w.finish();
  return sum;
}

#endif

}  // namespace dflash::data
