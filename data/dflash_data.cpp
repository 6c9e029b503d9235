// dflash_data: make, check and describe dflash.tokens.v1 dataset files.
//
//   dflash_data convert chat.jsonl more.jsonl --vocab-size 151936 --out data/train.h5
//   dflash_data validate data/               (a file, a directory of *.h5 or a glob pattern)
//   dflash_data stats data/train.h5
//   dflash_data synth --out data/synth.h5 --sequences 2000 --min-len 64 --max-len 512 --vocab-size 1024
//
// convert reads JSONL rows {"input_ids": [...], "loss_mask": [...]} (the output of a tokenizer and
// chat-template step); both keys are required, loss_mask holds 0/1 per token. Blank lines are
// skipped; any other bad row stops the conversion with an error naming file:line, and no output
// file is left behind.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/dataset.h"
#include "data/synth.h"
#include "kernels/app.h"
#include "kernels/error.h"
#include "kernels/log.h"

using namespace dflash;
using namespace dflash::data;
using nlohmann::json;

namespace {

constexpr const char* kRowHint =
    "each line must be a JSON object {\"input_ids\": [int, ...], \"loss_mask\": [0|1, ...]} with one mask value per id";

// Parses one JSONL row into `s`; `where` is "file:line".
void parse_row(const std::string& line, const std::string& where, int64_t vocab, Sequence* s) {
  json row;
  try {
    row = json::parse(line);
  } catch (const json::parse_error& e) {
    DFLASH_FAIL_HINT(where << ": not valid JSON (" << e.what() << ")", kRowHint);
  }
  DFLASH_CHECK_HINT(row.is_object(), where << ": the row is not a JSON object", kRowHint);
  for (const char* key : {"input_ids", "loss_mask"}) {
    DFLASH_CHECK_HINT(row.contains(key), where << ": the row has no \"" << key << "\"", kRowHint);
    DFLASH_CHECK_HINT(row[key].is_array(), where << ": \"" << key << "\" is not an array", kRowHint);
  }
  const json& ids = row["input_ids"];
  const json& mask = row["loss_mask"];
  DFLASH_CHECK_HINT(!ids.empty(), where << ": \"input_ids\" is empty", "drop empty rows; every sequence needs a token");
  DFLASH_CHECK_HINT(ids.size() == mask.size(),
                    where << ": \"input_ids\" has " << ids.size() << " values but \"loss_mask\" has " << mask.size(),
                    kRowHint);
  s->ids.resize(ids.size());
  s->mask.resize(ids.size());
  for (size_t t = 0; t < ids.size(); ++t) {
    // An integer literal beyond 64 bits parses as a float (1e+20), one beyond int64 as an unsigned:
    // both are ids far outside any vocabulary, not "not an integer" nor a wrapped negative number.
    const bool huge = (ids[t].is_number_float() && std::isfinite(ids[t].get<double>()) &&
                       std::abs(ids[t].get<double>()) >= 9007199254740992.0 /* 2^53 */) ||
                      (ids[t].is_number_unsigned() && ids[t].get<uint64_t>() > static_cast<uint64_t>(INT64_MAX));
    DFLASH_CHECK_HINT(!huge,
                      where << ": input_ids[" << t << "] = " << ids[t].dump() << " is far outside [0, --vocab-size = " << vocab
                            << ")",
                      "token ids are integers below the tokenizer's vocabulary size; check what wrote this row");
    DFLASH_CHECK_HINT(ids[t].is_number_integer(), where << ": input_ids[" << t << "] = " << ids[t].dump() << " is not an integer",
                      kRowHint);
    const int64_t id = ids[t].get<int64_t>();
    DFLASH_CHECK_HINT(id >= 0 && id < vocab,
                      where << ": input_ids[" << t << "] = " << id << " is outside [0, --vocab-size = " << vocab << ")",
                      "check --vocab-size against the tokenizer that produced the ids");
    DFLASH_CHECK_HINT(mask[t].is_number_integer() || mask[t].is_boolean(),
                      where << ": loss_mask[" << t << "] = " << mask[t].dump() << " is not 0 or 1", kRowHint);
    const int64_t m = mask[t].is_boolean() ? int64_t{mask[t].get<bool>()} : mask[t].get<int64_t>();
    DFLASH_CHECK_HINT(m == 0 || m == 1, where << ": loss_mask[" << t << "] = " << m << " is not 0 or 1", kRowHint);
    s->ids[t] = static_cast<int32_t>(id);
    s->mask[t] = static_cast<uint8_t>(m);
  }
}

std::string percent(int64_t a, int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", b > 0 ? 100.0 * static_cast<double>(a) / static_cast<double>(b) : 0.0);
  return buf;
}

void print_stats(const DatasetStats& st, size_t files) {
  std::printf("files:             %zu\n", files);
  std::printf("sequences:         %lld\n", static_cast<long long>(st.sequences));
  std::printf("tokens:            %lld\n", static_cast<long long>(st.tokens));
  std::printf("supervised tokens: %lld (%s)\n", static_cast<long long>(st.supervised), percent(st.supervised, st.tokens).c_str());
  if (st.sequences > 0)
    std::printf("length:            min %lld, mean %.1f, max %lld\n", static_cast<long long>(st.min_length),
                static_cast<double>(st.tokens) / static_cast<double>(st.sequences), static_cast<long long>(st.max_length));
  std::printf("length histogram (tokens: sequences):\n");
  for (auto [k, n] : st.histogram) {
    const long long lo = 1ll << k, hi = (2ll << k) - 1;
    std::printf("  %8lld - %-8lld %10lld  %s\n", lo, hi, static_cast<long long>(n), percent(n, st.sequences).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Make, check and describe dflash.tokens.v1 dataset files (HDF5)."};
  app.name("dflash_data");
  std::string log_level = "info";
  add_common_options(app, &log_level);
  app.require_subcommand(1);

  // convert
  auto* convert = app.add_subcommand("convert", "JSONL rows {\"input_ids\": [...], \"loss_mask\": [...]} -> HDF5");
  std::vector<std::string> conv_inputs;
  std::string conv_out;
  int64_t conv_vocab = 0;
  WriterOptions wopt;
  convert->add_option("inputs", conv_inputs, "JSONL files")->required();
  convert->add_option("--out,-o", conv_out, "output .h5 file")->required();
  convert->add_option("--vocab-size", conv_vocab, "the tokenizer's vocabulary size")->required();
  convert->add_option("--chunk-tokens", wopt.chunk_tokens, "HDF5 chunk size in tokens")->capture_default_str();
  convert->add_option("--compression", wopt.compression, "deflate level 0..9 (0: none)")->capture_default_str();

  // validate
  auto* validate = app.add_subcommand("validate", "check every invariant of dataset files");
  std::vector<std::string> val_files;
  validate->add_option("files", val_files, "files, directories or glob patterns")->required();

  // stats
  auto* stats = app.add_subcommand("stats", "sequences, tokens, supervised tokens, length histogram");
  std::vector<std::string> stat_files;
  stats->add_option("files", stat_files, "files, directories or glob patterns")->required();

  // synth
  auto* synth = app.add_subcommand("synth", "write a deterministic synthetic corpus with learnable structure");
  SynthOptions sopt;
  std::string synth_out;
  synth->add_option("--out,-o", synth_out, "output .h5 file")->required();
  synth->add_option("--sequences", sopt.sequences, "number of sequences")->capture_default_str();
  synth->add_option("--min-len", sopt.min_length, "shortest sequence, tokens")->capture_default_str();
  synth->add_option("--max-len", sopt.max_length, "longest sequence, tokens")->capture_default_str();
  synth->add_option("--vocab-size", sopt.vocab_size, "vocabulary size")->capture_default_str();
  synth->add_option("--seed", sopt.seed, "seed")->capture_default_str();
  synth->add_option("--chunk-tokens", wopt.chunk_tokens, "HDF5 chunk size in tokens")->capture_default_str();
  synth->add_option("--compression", wopt.compression, "deflate level 0..9 (0: none)")->capture_default_str();

  return run_app(app, argc, argv, [&]() -> int {
    init_logging(-1, log_level);
    if (*convert) {
      DFLASH_CHECK_HINT(conv_vocab > 0, "convert: --vocab-size = " << conv_vocab << " must be positive",
                        "pass the tokenizer's vocabulary size");
      DatasetWriter w(conv_out, conv_vocab, wopt);
      int64_t rows = 0, supervised = 0;
      Sequence s;
      for (const std::string& in : conv_inputs) {
        std::ifstream f(in);
        DFLASH_CHECK_IO(f.good(), "opening JSONL file", in);
        std::string line;
        int64_t lineno = 0;
        while (std::getline(f, line)) {
          ++lineno;
          if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
          parse_row(line, in + ":" + std::to_string(lineno), conv_vocab, &s);
          w.append(s);
          for (uint8_t m : s.mask) supervised += m;
          ++rows;
        }
        DFLASH_CHECK_IO(!f.bad(), "reading JSONL file", in);
      }
      DFLASH_CHECK_HINT(rows > 0, "convert: the input holds no rows", "check the input files");
      w.finish();
      std::printf("wrote %s: %lld sequences, %lld tokens (%lld supervised)\n", conv_out.c_str(),
                  static_cast<long long>(w.num_sequences()), static_cast<long long>(w.num_tokens()),
                  static_cast<long long>(supervised));
    } else if (*validate) {
      for (const std::string& path : expand_paths(val_files)) {
        const DatasetStats st = validate_file(path);
        std::printf("ok %s: %lld sequences, %lld tokens, %lld supervised\n", path.c_str(),
                    static_cast<long long>(st.sequences), static_cast<long long>(st.tokens),
                    static_cast<long long>(st.supervised));
      }
    } else if (*stats) {
      const std::vector<std::string> paths = expand_paths(stat_files);
      DatasetStats total;
      for (const std::string& path : paths) total.add(validate_file(path));
      print_stats(total, paths.size());
    } else if (*synth) {
      write_synth(synth_out, sopt, wopt);
      std::printf("wrote %s: %lld synthetic sequences (seed %llu, vocab %lld)\n", synth_out.c_str(),
                  static_cast<long long>(sopt.sequences), static_cast<unsigned long long>(sopt.seed),
                  static_cast<long long>(sopt.vocab_size));
    }
    return 0;
  });
}
