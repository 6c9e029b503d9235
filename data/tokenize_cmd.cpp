#include "data/tokenize_cmd.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <string_view>
#include <thread>
#include <exception>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#ifdef DFLASH_WITH_TEXT
#include "text/tokenizer.h"
#include "text/utf8.h"
#include "core/worker_pool.h"
#endif

namespace dflash::data {

using nlohmann::json;

struct TextCommands::State {
  CLI::App* tokenize = nullptr;
  CLI::App* detokenize = nullptr;
  std::string tokenizer, input = "-", out;
  int threads = 0;
};

TextCommands::TextCommands(CLI::App& app) : s_(std::make_unique<State>()) {
  s_->tokenize = app.add_subcommand("tokenize", "JSONL {\"text\": ...} per line -> {\"ids\": [...]} per line (a Hugging Face tokenizer.json)");
  s_->detokenize = app.add_subcommand("detokenize", "JSONL {\"ids\": [...]} per line -> {\"text\": ...} per line (the inverse of tokenize)");
  for (CLI::App* c : {s_->tokenize, s_->detokenize}) {
    c->add_option("--tokenizer", s_->tokenizer, "a model directory holding tokenizer.json, or the tokenizer.json itself")->required();
    c->add_option("input", s_->input, "input JSONL file, - for standard input")->capture_default_str();
    c->add_option("--out", s_->out, "output JSONL file (default: standard output)");
    c->add_option("--threads", s_->threads, "encoding threads (0: all cores, at most 16)")->capture_default_str();
  }
}

TextCommands::~TextCommands() = default;

bool TextCommands::parsed() const { return s_->tokenize->parsed() || s_->detokenize->parsed(); }

#ifndef DFLASH_WITH_TEXT
int TextCommands::run() const {
  DFLASH_FAIL_HINT("dflash_data " << (s_->tokenize->parsed() ? "tokenize" : "detokenize") << ": this build has no tokenizer (text/ was skipped)",
                   "install libonig-dev and libicu-dev (scripts/common.sh lists them) and configure again");
}
#else

namespace {

// The JSON object of one line holding `key` of the given kind (text: a string, ids: a list);
// `where` is "IN:line".
json parse_row(const std::string& line, const char* key, const std::string& where) {
  const bool text = std::string_view(key) == "text";
  const char* form = text ? "each line must be {\"text\": \"...\"}" : "each line must be {\"ids\": [...]}";
  text::check_utf8(line, where + ": the line");  // names the byte offset, which JSON's message does not
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {
    DFLASH_FAIL_HINT(where << ": not a JSON line: " << e.what(), form);
  }
  DFLASH_CHECK_HINT(j.is_object() && j.contains(key) && (text ? j[key].is_string() : j[key].is_array()),
                    where << ": the line has no " << (text ? "string" : "list") << " \"" << key << "\"", form);
  return j;
}

// One line of input -> one line of output (without the newline).
std::string tokenize_line(const text::Tokenizer& tok, const std::string& line, const std::string& where) {
  const json j = parse_row(line, "text", where);
  std::vector<uint32_t> ids;
  try {
    tok.encode(j["text"].get_ref<const std::string&>(), ids);
  } catch (const Error& e) {
    DFLASH_FAIL_HINT(where << ": " << e.message(), e.hint());
  }
  std::string out = "{\"ids\":[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out.push_back(',');
    out += std::to_string(ids[i]);
  }
  out += "]}";
  return out;
}

std::string detokenize_line(const text::Tokenizer& tok, const std::string& line, const std::string& where) {
  const json j = parse_row(line, "ids", where);
  std::vector<uint32_t> ids;
  ids.reserve(j["ids"].size());
  for (size_t k = 0; k < j["ids"].size(); ++k) {
    const json& v = j["ids"][k];
    DFLASH_CHECK_HINT(v.is_number_unsigned() && v.get<uint64_t>() < tok.vocab_size(),
                      where << ": ids[" << k << "] = " << v.dump() << " is not a token id (the tokenizer has " << tok.vocab_size() << ")",
                      "ids are integers in [0, vocab size)");
    ids.push_back(v.get<uint32_t>());
  }
  return json{{"text", tok.decode(ids)}}.dump();
}

}  // namespace

int TextCommands::run() const {
  const State& s = *s_;
  const bool enc = s.tokenize->parsed();
  const text::Tokenizer tok = text::Tokenizer::from_file(s.tokenizer);
  std::ifstream file;
  std::istream* in = &std::cin;
  const std::string in_name = s.input == "-" ? std::string("<stdin>") : s.input;
  if (s.input != "-") {
    file.open(s.input, std::ios::binary);
    DFLASH_CHECK_IO(file.good(), "opening", s.input);
    in = &file;
  }
  const std::string tmp = s.out.empty() ? std::string() : s.out + ".tmp";
  std::ofstream ofile;
  if (!s.out.empty()) {
    ofile.open(tmp, std::ios::binary | std::ios::trunc);
    DFLASH_CHECK_IO(ofile.good(), "creating", tmp);
  }
  std::ostream& out = s.out.empty() ? std::cout : ofile;
  const int threads = std::clamp(s.threads > 0 ? s.threads : static_cast<int>(std::thread::hardware_concurrency()), 1, 16);

  // Batches of lines, each encoded by the pool's threads (thread t: lines t, t + threads, ...; the
  // threads live for the whole run, so their word caches stay warm), written in order.
  WorkerPool pool(threads);
  constexpr size_t kBatch = 4096;
  std::vector<std::string> lines, results;
  int64_t first_line = 1, rows = 0;
  bool done = false;
  try {
    while (!done) {
      lines.clear();
      std::string line;
      while (lines.size() < kBatch && std::getline(*in, line)) {
        if (!line.empty() && line.back() == '\r') line.pop_back();
        lines.push_back(std::move(line));
      }
      DFLASH_CHECK_IO(!in->bad(), "reading", in_name);
      done = lines.size() < kBatch;
      results.assign(lines.size(), std::string());
      std::vector<std::exception_ptr> errors(lines.size());
      pool.run([&](int t) {
        for (size_t k = static_cast<size_t>(t); k < lines.size(); k += static_cast<size_t>(pool.threads())) {
          const std::string where = in_name + ":" + std::to_string(first_line + static_cast<int64_t>(k));
          try {
            DFLASH_CHECK_HINT(lines[k].find_first_not_of(" \t") != std::string::npos, where << ": the line is blank",
                              "one JSON object per line; the output has one line per input line");
            results[k] = enc ? tokenize_line(tok, lines[k], where) : detokenize_line(tok, lines[k], where);
          } catch (...) {
            errors[k] = std::current_exception();
          }
        }
      });
      for (size_t k = 0; k < lines.size(); ++k) {
        if (errors[k]) std::rethrow_exception(errors[k]);  // the first bad line in input order
        out << results[k] << '\n';
      }
      DFLASH_CHECK_IO(out.good(), "writing", s.out.empty() ? std::string("<stdout>") : tmp);
      first_line += static_cast<int64_t>(lines.size());
      rows += static_cast<int64_t>(lines.size());
    }
    out.flush();
    DFLASH_CHECK_IO(out.good(), "writing", s.out.empty() ? std::string("<stdout>") : tmp);
    if (!s.out.empty()) {
      ofile.close();
      DFLASH_CHECK_IO(!ofile.fail(), "closing", tmp);
      std::filesystem::rename(tmp, s.out);
      std::fprintf(stderr, "%s: %lld rows -> %s\n", enc ? "tokenize" : "detokenize", static_cast<long long>(rows), s.out.c_str());
    }
  } catch (...) {
    if (!s.out.empty()) {
      ofile.close();
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
    }
    throw;
  }
  return 0;
}
#endif

}  // namespace dflash::data
