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
          s = parse_token_row(line, in + ":" + std::to_string(lineno), conv_vocab, "--vocab-size", true);
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
