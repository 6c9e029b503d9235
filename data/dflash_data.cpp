// dflash_data: make, check and describe dflash.tokens.v1 dataset files.
//
//   dflash_data convert chat.jsonl more.jsonl --vocab-size 151936 --out data/train.h5
//   dflash_data validate data/               (a file, a directory of *.h5 or a glob pattern)
//   dflash_data stats data/train.h5
//   dflash_data dump data/train.h5 --first 10 --count 2   (JSONL rows, convert's input format)
//   dflash_data prepare chat.jsonl --tokenizer /models/Qwen3-8B --out data/train.h5   (data/prepare.h)
//   dflash_data dump data/train.h5 --text --tokenizer /models/Qwen3-8B   (decoded, supervised spans marked)
//   dflash_data synth --out data/synth.h5 --sequences 2000 --min-len 64 --max-len 512 --vocab-size 1024
//   dflash_data regenerate chat.h5 --model /models/Qwen3.6-27B --device cuda --out data/regen.h5 --max-new-tokens 2048
//   mpirun -n 8 dflash_data regenerate chat.h5 --model DIR --device cuda --tp 2 --out data/regen.h5
//
// regenerate's stop tokens: --stop-token ids or token text ('<|im_end|>', through --tokenizer DIR,
// default the --model directory); without any, the target's own end-of-turn ids from that directory
// (text/stop_tokens.h: generation_config.json, config.json, tokenizer_config.json), logged once;
// --no-default-stop-tokens generates to --max-new-tokens. A random target (--config) has no defaults.
//
// regenerate replaces the responses of a dataset by the target's own (data/regenerate.h): each
// sequence's prompt (its tokens before the first loss_mask = 1) + the target's greedy or sampled
// response, many sequences at once on the target's slot pool, data parallel over TP groups under
// mpirun, resumable (parts under <out>.parts; a restart continues and makes the same file).
//
// convert reads JSONL rows {"input_ids": [...], "loss_mask": [...]} (the output of a tokenizer and
// chat-template step); both keys are required, loss_mask holds 0/1 per token. Blank lines are
// skipped; any other bad row stops the conversion with an error naming file:line, and no output
// file is left behind.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "data/dataset.h"
#include "data/prepare_cmd.h"
#include "data/regenerate.h"
#include "data/synth.h"
#include "data/tokenize_cmd.h"
#include "core/app.h"
#include "core/error.h"
#include "core/log.h"
#include "target_model/cli.h"
#include "target_model/runtime.h"
#ifdef DFLASH_WITH_TEXT
#include "text/stop_tokens.h"
#include "text/tokenizer.h"
#endif

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
  auto* convert = add_subcommand(app, "convert", "JSONL rows {\"input_ids\": [...], \"loss_mask\": [...]} -> HDF5", &log_level);
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
  auto* validate = add_subcommand(app, "validate", "check every invariant of dataset files", &log_level);
  std::vector<std::string> val_files;
  validate->add_option("files", val_files, "files, directories or glob patterns")->required();

  // stats
  auto* stats = add_subcommand(app, "stats", "sequences, tokens, supervised tokens, length histogram", &log_level);
  std::vector<std::string> stat_files;
  stats->add_option("files", stat_files, "files, directories or glob patterns")->required();

  // synth
  auto* synth = add_subcommand(app, "synth", "write a deterministic synthetic corpus with learnable structure", &log_level);
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

  // dump
  auto* dump = add_subcommand(app, "dump", "print sequences as JSONL rows {\"input_ids\": [...], \"loss_mask\": [...]} (convert's input)", &log_level);
  std::vector<std::string> dump_files;
  int64_t dump_first = 0, dump_count = -1;
  dump->add_option("files", dump_files, "files, directories or glob patterns")->required();
  dump->add_option("--first", dump_first, "index of the first sequence printed")->capture_default_str()->check(CLI::NonNegativeNumber);
  dump->add_option("--count", dump_count, "sequences printed (default: all)")->check(CLI::NonNegativeNumber);

  // regenerate
  auto* regen = add_subcommand(app, "regenerate", "replace the responses by the target's own (greedy or sampled)", &log_level);
  RegenerateOptions ropt;
  target::TargetOptions target;
  std::string device = "cpu";
  int tp = 1, ep = 1;
  double temperature = 0, top_p = 1, timeout_s = 600;
  uint64_t sample_seed = 0;
  bool no_progress = false, require_fast = false, no_default_stops = false;
  std::vector<std::string> stop_specs;
  std::string regen_tokenizer;
  regen->add_option("inputs", ropt.inputs, "dflash.tokens.v1 files, directories or glob patterns (the prompts)")->required();
  regen->add_option("--out,-o", ropt.out, "output .h5 file (parts are kept under <out>.parts until it is complete)")->required();
  target::add_target_options(*regen, target, {.random = "seeded random target weights (benches, demos)",
                                               .seed_flag = "--weight-seed"});
  regen->add_option("--device", device, "where the target runs: cpu, cuda (under mpirun: the GPU of the node-local rank) or cuda:N")->capture_default_str();
  regen->add_option("--tp", tp, "tensor-parallel size of the target (under mpirun; the TP groups share the prompts)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  regen->add_option("--ep", ep, "MoE targets: expert groups within a TP group (divides --tp and num_experts; each holds num_experts / ep experts)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  regen->add_option("--max-new-tokens", ropt.gen.max_new_tokens, "new tokens per response (at most)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  regen->add_option("--stop-token", stop_specs, "end a response after this token, kept: an id or a token's text, e.g. "
                                                "'<|im_end|>' (repeatable; default: the target's own eos ids from the "
                                                "--model directory's generation_config.json / config.json / tokenizer_config.json)");
  regen->add_flag("--no-default-stop-tokens", no_default_stops, "without --stop-token, stop only at --max-new-tokens");
  regen->add_option("--tokenizer", regen_tokenizer, "the tokenizer for text stop tokens and the defaults: a directory or "
                                                    "tokenizer.json (default: the --model directory)");
  regen->add_option("--temperature", temperature, "0: greedy; > 0: sample at this temperature")->capture_default_str();
  regen->add_option("--top-p", top_p, "nucleus sampling: keep the smallest set of tokens with this much probability")
      ->capture_default_str();
  regen->add_option("--seed", sample_seed, "sampling seed (a sequence's draws depend on it and its index)")->capture_default_str();
  regen->add_option("--num-prompts", ropt.num_prompts, "use the first N sequences (default: all)")->check(CLI::PositiveNumber);
  regen->add_option("--max-prompt-len", ropt.max_prompt_len, "skip (and count) prompts longer than this")->check(CLI::PositiveNumber);
  regen->add_option("--slots", ropt.slots, "sequences in flight per TP group (the state pool)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  regen->add_option("--prefill-tokens", ropt.gen.prefill_tokens, "prompt tokens per packed prefill")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  regen->add_option("--step-tokens", ropt.gen.step_tokens, "N > 0: chunked prefill inside the decode steps, N tokens per "
                                                         "step (decode rows first, then prompt pieces); 0: prompts "
                                                         "prefilled whole between decode steps")
      ->capture_default_str();  // checked with the other decoding options (target::check_generate_config)
  regen->add_option("--part-size", ropt.part_size, "input sequences per part (the unit of resumption and of data parallelism)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  regen->add_flag("--no-progress", no_progress, "no progress line on stderr");
  regen->add_flag("--require-fast-path", require_fast, "refuse to run when a prefill or decode step would use a fallback kernel");
  regen->add_option("--timeout", timeout_s, "seconds a collective may take before the job is ended")->capture_default_str();
  regen->add_option("--chunk-tokens", ropt.writer.chunk_tokens, "HDF5 chunk size in tokens")->capture_default_str();
  regen->add_option("--compression", ropt.writer.compression, "deflate level 0..9 (0: none)")->capture_default_str();

  const TextCommands text_cmds(app);  // tokenize, detokenize (data/tokenize_cmd.h)
  // prepare, dump --text (data/prepare_cmd.h)
  const PrepareCommands prepare_cmds(app, &log_level, dump, &dump_files, &dump_first, &dump_count);
  std::unique_ptr<comm::MpiEnv> mpi;
  return run_app(app, argc, argv, [&]() -> int {
    if (text_cmds.parsed()) {
      init_logging(-1, log_level);
      return text_cmds.run();
    }
    if (prepare_cmds.parsed()) {
      init_logging(-1, log_level);
      return prepare_cmds.run();
    }
    if (*regen && (tp > 1 || env_rank() >= 0)) mpi = std::make_unique<comm::MpiEnv>(&argc, &argv);
    const int world = mpi ? mpi->size() : 1, rank = mpi ? mpi->rank() : 0;
    init_logging(mpi ? rank : -1, log_level);
    if (*regen) {
      target::TargetSource src = target.source();
      src.check();
      const comm::Layout layout = comm::make_layout(world, rank, tp);
      const Device dev = Device::parse(device);
      const Device rank_dev = device == "cuda" && mpi ? Device::cuda(mpi->local_rank()) : dev;  // one GPU per rank
      if (temperature < 0 || !std::isfinite(temperature))
        DFLASH_REJECT_HINT("--temperature " << temperature << " must be >= 0", "0 is greedy decoding");
      if (temperature > 0) ropt.gen.sample = ops::SampleParams{static_cast<float>(temperature), static_cast<float>(top_p), sample_seed};
      else DFLASH_REQUIRE_HINT(top_p == 1.0, "--top-p " << top_p << " needs --temperature > 0", "greedy decoding keeps no nucleus");
      ropt.progress = !no_progress;
      const target::TargetConfig cfg = src.read_config();
      target::check_tp(cfg, tp, ep);
      {  // stop tokens: given (ids or text), else the target's own
        const std::string tok_dir = !regen_tokenizer.empty() ? regen_tokenizer : target.src.model_dir;
        std::string stop_log;
#ifdef DFLASH_WITH_TEXT
        std::optional<text::Tokenizer> tok;
        bool tried = false;
        const text::StopTokenChoice sc = text::choose_stop_tokens(
            stop_specs, "--stop-token", no_default_stops ? "" : tok_dir, [&]() -> const text::Tokenizer* {
              if (!tried) {
                tried = true;
                if (!regen_tokenizer.empty()) {
                  try {
                    tok.emplace(text::Tokenizer::from_file(regen_tokenizer));
                  } catch (const Error& e) {
                    DFLASH_REJECT_HINT("--tokenizer " << regen_tokenizer << ": " << e.message(), e.hint());
                  }
                }
                else if (!tok_dir.empty() && std::filesystem::exists(std::filesystem::path(tok_dir) / "tokenizer.json")) {
                  try {
                    tok.emplace(text::Tokenizer::from_file(tok_dir));
                  } catch (const Error& e) {  // the model's own, not asked for: ids still work
                    if (rank == 0) spdlog::warn("{}/tokenizer.json not used ({})", tok_dir, e.message());
                  }
                }
              }
              return tok ? &*tok : nullptr;
            });
        ropt.gen.stop_tokens = sc.ids;
        stop_log = sc.log;
#else
        for (const std::string& sp : stop_specs) {
          DFLASH_REQUIRE_HINT(!sp.empty() && sp.find_first_not_of("0123456789") == std::string::npos,
                              "--stop-token '" << sp << "' is text, and this build has no tokenizer (text/ was skipped)",
                              "give the token's id, or build with libonig-dev and libicu-dev");
          ropt.gen.stop_tokens.push_back(static_cast<int32_t>(std::stoll(sp)));
        }
        stop_log = stop_specs.empty() ? (tok_dir.empty() ? "stop tokens: none (no --stop-token given)"
                                                        : "stop tokens: none (this build has no tokenizer to read the target's own)")
                                      : "stop tokens: " + std::to_string(ropt.gen.stop_tokens.size()) + " id(s) from --stop-token";
#endif
        if (stop_specs.empty() && no_default_stops) stop_log = "stop tokens: none (--no-default-stop-tokens)";
        if (stop_specs.empty())
          for (int32_t t : ropt.gen.stop_tokens)
            DFLASH_REQUIRE_HINT(t < cfg.vocab_size, "the default stop token " << t << " (" << stop_log << ") is outside the "
                                                    "target's vocabulary [0, " << cfg.vocab_size << ")",
                                "pass --stop-token, or --no-default-stop-tokens");
        if (rank == 0) std::fprintf(stderr, "regenerate: %s\n", stop_log.c_str());
      }
      target::check_generate_config(ropt.gen, cfg.vocab_size);
      ropt.target_identity = src.identity(cfg);
      const int64_t max_len = regenerate_max_len(ropt);
      std::unique_ptr<comm::Communicator> tp_comm;
      if (tp > 1) tp_comm = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, layout.tp_group, rank, rank_dev, timeout_s, "tp");
      std::unique_ptr<comm::Communicator> world_comm;
      if (world > 1) world_comm = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, 0, rank, Device::cpu(), timeout_s, "world");
      const auto t_load = std::chrono::steady_clock::now();
      target::TargetRuntime rt(src, cfg, rank_dev, tp, layout.tp_rank, tp_comm.get(), require_fast, ep);
      const std::unique_ptr<target::Decoder> dec = rt.make_decoder(ropt.slots, max_len);
      if (rank == 0)
        std::fprintf(stderr, "regenerate: target %s on %s, %lld slot(s) of %lld tokens, loaded in %.1f s%s%s\n",
                     ropt.target_identity.c_str(), dec->describe().c_str(), static_cast<long long>(ropt.slots),
                     static_cast<long long>(max_len),
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count(),
                     rt.plans().empty() ? "" : "\n  kernels ", rt.plans().c_str());
      RegenerateLayout lay;
      lay.group = layout.tp_group;
      lay.num_groups = layout.num_tp_groups;
      lay.writer = layout.tp_rank == 0;
      lay.leader = rank == 0;
      if (world_comm) lay.barrier = [&] { world_comm->barrier(); };
      const RegenerateSummary sum = regenerate(*dec, ropt, lay);
      if (rank == 0) std::printf("%s\n", format_summary(sum, ropt).c_str());
      return 0;
    }
    if (*dump) {
      const Dataset ds(expand_paths(dump_files));
      const int64_t end = dump_count < 0 ? ds.num_sequences() : std::min(ds.num_sequences(), dump_first + dump_count);
      for (int64_t i = dump_first; i < end; ++i) {
        const Sequence q = ds.sequence(i);
        std::printf("%s\n", json{{"input_ids", q.ids}, {"loss_mask", q.mask}}.dump().c_str());
      }
      return 0;
    }
    if (*convert) {
      DFLASH_REQUIRE_HINT(conv_vocab > 0, "convert: --vocab-size = " << conv_vocab << " must be positive",
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
      DFLASH_REQUIRE_HINT(rows > 0, "convert: the input holds no rows", "check the input files");
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
