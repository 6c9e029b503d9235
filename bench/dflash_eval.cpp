// dflash_eval: speculative decoding with a trained DFlash drafter against target-only greedy
// decoding on the same prompts: the measured acceptance length tau, its histogram, the acceptance
// per block position, tokens/s of both and the speed-up, where a step's time goes, and the trainer's
// acceptance-length estimate on the same prompts beside the measured tau. Any token where the two
// outputs differ is a failure (exit 3), reported with the prompt and the position.
//
//   dflash_eval --model DIR --drafter runs/x/drafter --prompts data.h5 --num-prompts 8 --max-new-tokens 128
//   dflash_eval --config configs/tiny/config.json --random-weights --drafter runs/tiny/drafter --prompts p.txt
//   mpirun -n 2 dflash_eval ... --tp 2
//
// Prompts: a dflash.tokens.v1 file (the prompt of a sequence is its tokens before the first
// loss_mask = 1; a sequence without supervised tokens is a whole prompt), a JSONL file of rows
// {"input_ids": [...], "loss_mask": [...]} (the same rule; loss_mask optional), or a text file of
// token ids, one prompt per line. JSONL rows may also be text (bench/eval_text.h): chat rows
// {"messages": [...]} / {"conversations": [...]} rendered with the target's chat template and its
// generation prompt (trailing assistant turns dropped), {"prompt": "..."} / {"text": "..."}
// tokenized raw; the tokenizer is --tokenizer DIR, else the --model directory's.
//
// Stop tokens: --stop-token ids or token text ("<|im_end|>"); without any, the target's own
// end-of-turn ids (text/stop_tokens.h: generation_config.json, config.json, tokenizer_config.json)
// from the tokenizer directory; --no-default-stop-tokens runs to --max-new-tokens.
//
//   dflash_eval --model DIR --drafter D --prompts chat.jsonl --show 2 --html eval.html
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <sstream>
#include <tuple>
#include <utility>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "bench/eval_text.h"
#include "bench/greedy_estimate.h"
#include "bench/harness.h"
#if DFLASH_WITH_CUDA
#include "bench/profile.h"
#endif
#include "bench/report.h"
#include "bench/roofline.h"
#include "bench/speculative.h"
#include "comm/comm.h"
#include "data/dataset.h"
#include "dflash/version.h"
#include "drafter/decode.h"
#include "drafter/weights.h"
#include "core/app.h"
#include "core/device.h"
#include "core/io/files.h"
#include "core/log.h"
#include "target_model/cli.h"
#include "target_model/decode.h"
#include "target_model/model.h"
#include "target_model/runtime.h"
#include "target_model/tp.h"
#if DFLASH_WITH_TEXT
#include "text/stop_tokens.h"
#endif
#if DFLASH_WITH_CUDA
#include <cuda_runtime.h>

#include "drafter/decode_cuda.h"
#include "drafter/model_cuda.h"
#include "core/cuda/check.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/pdl.cuh"
#include "target_model/model_cuda.h"
#endif

using namespace dflash;
using json = nlohmann::json;

namespace {

struct Prompt {
  std::vector<int32_t> ids;
  std::string kind;  // "ids", "text" or "chat"
};

// `text(where, what)`: the tokenizer, or an error naming `where` and `what` needs it.
using TextFor = std::function<const bench::EvalText&(const std::string& where, const std::string& what)>;

std::vector<Prompt> read_prompts(const std::string& path, int64_t limit, int64_t vocab, const TextFor& text) {
  std::vector<Prompt> out;
  const std::string ext = std::filesystem::path(path).extension().string();
  auto check = [&](const std::vector<int32_t>& p, const std::string& where) {
    DFLASH_REQUIRE_HINT(!p.empty(), where << ": the prompt is empty (its first token is already supervised, or its text is empty)",
                      "a prompt needs at least one token before the first loss_mask = 1");
  };
  if (ext == ".h5" || ext == ".hdf5") {
    data::Dataset ds({path});
    for (int64_t i = 0; i < ds.num_sequences() && static_cast<int64_t>(out.size()) < limit; ++i) {
      const data::Sequence s = ds.sequence(i);
      out.push_back({data::prompt_of(s), "ids"});
      check(out.back().ids, path + ": sequence " + std::to_string(i));
    }
  } else {
    std::ifstream in(path);
    DFLASH_CHECK_IO(in.good(), "opening prompt file", path);
    std::string line;
    for (int ln = 1; std::getline(in, line) && static_cast<int64_t>(out.size()) < limit; ++ln) {
      const std::string where = path + ":" + std::to_string(ln);
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      if (line.find('{') != std::string::npos) {
        // The row's keys tell its form: chat, raw text, or token ids.
        nlohmann::ordered_json row;
        try {
          row = nlohmann::ordered_json::parse(line);
        } catch (const nlohmann::json::exception&) {
          row = nullptr;  // parse_token_row names the JSON error
        }
        if (const nlohmann::ordered_json messages = row.is_object() ? bench::chat_messages(row, where) : nullptr; !messages.is_null()) {
          out.push_back({text(where, "a chat row").encode_chat(messages, where), "chat"});
        } else if (row.is_object() && !row.contains("input_ids") && (row.contains("prompt") || row.contains("text"))) {
          const char* key = row.contains("prompt") ? "prompt" : "text";
          DFLASH_REQUIRE_HINT(row[key].is_string(), where << ": \"" << key << "\" is not a string", "text rows are {\"" << key << "\": \"...\"}");
          out.push_back({text(where, "a text row").encode(row[key].get<std::string>(), where), "text"});
        } else {
          const data::Sequence seq = data::parse_token_row(line, where, vocab, "the target's vocabulary", false);
          out.push_back({data::prompt_of(seq), "ids"});
        }
      } else {
        out.push_back({parse_token_ids(line, where), "ids"});
      }
      check(out.back().ids, where);
    }
  }
  DFLASH_REQUIRE_HINT(!out.empty(), "no prompts in " << path, "give a .h5 dataset, a JSONL file or a file of token ids");
  return out;
}

struct PromptReport {
  int64_t prompt_len = 0, generated = 0;
  std::string kind;
  std::vector<int32_t> prompt, tokens;  // the new tokens: the speculative output
  std::vector<int64_t> accept;
  bench::PhaseTimes greedy, spec;
  drafter::StepStats est_steps, est_all;
  int64_t mismatch_at = -1;  // first position where the outputs differ
  int32_t want = -1, got = -1;
};

// One --decode-variants run: a variant of the decode plan's fused kernels, timed on fresh decoders.
struct VariantRow {
  std::string name, fusion, kernels, vs_main;
  bool pdl = false, same = false;
  double decode_ms = 0, decode_gpu_ms = 0, verify_ms = 0, commit_ms = 0, propose_ms = 0;
};

double mean(const std::vector<int64_t>& v) {
  return v.empty() ? 0.0 : static_cast<double>(std::accumulate(v.begin(), v.end(), int64_t{0})) / static_cast<double>(v.size());
}

// Median, p20, p80 (ms) of per-step times in seconds (bench::PhaseTimes' step lists).
bench::Stats step_ms(const std::vector<double>& seconds) {
  std::vector<double> ms;
  for (double v : seconds) ms.push_back(1e3 * v);
  return bench::summarize(ms, {}, 0.0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Speculative decoding with a DFlash drafter vs target-only greedy decoding: measured acceptance "
               "length, speed-up and the training-time estimate on the same prompts."};
  app.name("dflash_eval");
  std::string log_level = "warn", drafter_dir, prompts_path, device = "cpu", csv_path, json_path, tokenizer_path, html_path;
  target::TargetOptions target;
  int64_t num_prompts = 16, max_new = 64, block_size = 0, show = 0;
  std::vector<std::string> stop_specs;
  bool no_default_stops = false;
  int tp = 1, ep = 1;
  double timeout_s = 600;
  add_common_options(app, &log_level);
  target::add_target_options(app, target);
  int64_t random_drafter = 0;
  bool no_estimate = false, require_fast = false, no_graphs = false;
  auto* drafter_opt = app.add_option("--drafter", drafter_dir, "an exported drafter directory (config.json + model.safetensors)");
  auto* random_drafter_opt = app.add_option("--random-drafter", random_drafter,
                                            "instead: an untrained drafter of this many layers for the target (benches: "
                                            "its tau is ~1; the speed of each phase is what it measures)");
  drafter_opt->excludes(random_drafter_opt);
  app.add_flag("--no-estimate", no_estimate, "skip the trainer's acceptance estimate (on a GPU it holds the drafter's "
                                              "training state: fp32 masters and gradients)");
  app.add_flag("--no-cuda-graphs", no_graphs, "GPU: launch every decode / verify / commit / propose step's kernels eagerly instead of "
                                             "replaying CUDA graphs (to compare; CSV rows get ',eager')");
  std::string cpu_drafter = "f32";
  app.add_option("--cpu-drafter", cpu_drafter, "CPU: the drafter's arithmetic, f32 (threaded GEMM, the trainer's default) or "
                                               "f64 (the double reference); proposals and estimate use the same")
      ->capture_default_str()->check(CLI::IsMember({"f32", "f64"}));
  std::string draft_precision = "bf16";
  app.add_option("--draft-precision", draft_precision,
                 "GPU: the propose step's GEMMs in bf16, or fp8 (the drafter's projections and the lm_head quantized "
                 "once to e4m3 with 128 x 128 block scales, on the streaming FP8 GEMM: about half the bytes a propose "
                 "reads; the drafts may differ, the output stays the target's greedy output; the trainer's estimate "
                 "stays the bf16 drafter's; CSV rows get ',draft_fp8')")
      ->capture_default_str()->check(CLI::IsMember({"bf16", "fp8"}));
  app.add_flag("--require-fast-path", require_fast, "refuse to run when any decode or prefill step would use a fallback kernel");
  std::string decode_variants;
  app.add_option("--decode-variants", decode_variants,
                 std::string("GPU: afterwards time the first prompt's decode, propose, verify and commit steps again with "
                             "fresh decoders of these variants of the decode plan (comma-separated, repeats allowed; fused = the "
                             "plan as is, unfused = every fusion and PDL off; bench/harness.h says what each does: ") +
                     bench::kDecodeVariantNames + "); the A/B table of issue 30's fused decode kernels, CSV kernel 'variant:<name>'");
  int64_t variant_tokens = 32;
  app.add_option("--variant-tokens", variant_tokens, "new tokens per --decode-variants run")->capture_default_str()
      ->check(CLI::PositiveNumber);
  int64_t profile_steps = 0, sweep_reps = 20;
  std::vector<int64_t> sweep_blocks;
  app.add_option("--profile", profile_steps, "GPU: afterwards time every op of this many target decode steps (after one "
                                             "warm-up) and print where a step goes")->check(CLI::NonNegativeNumber);
  app.add_option("--verify-sweep", sweep_blocks, "afterwards time the verify step (and the propose step) at these block "
                                                 "sizes on the last prompt's state, e.g. 1,4,8,16, with the speed-up each "
                                                 "implies at given tau (the MoE question: a verify of B tokens reads more experts)")
      ->delimiter(',');
  app.add_option("--verify-sweep-reps", sweep_reps, "timed steps per block size of --verify-sweep (after 2 warm-ups)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  int64_t commit_probe = 0;
  app.add_option("--commit-probe", commit_probe, "afterwards time the commit step's two parts apart on the last prompt's "
                                                 "state, this many steps each: the target's commit alone, the drafter's "
                                                 "context update alone, and both as the loop runs them")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--prompts", prompts_path, "prompts: a dflash.tokens.v1 .h5 file, JSONL rows (chat {\"messages\"} / "
                                            "{\"conversations\"}, text {\"prompt\"} / {\"text\"}, or {\"input_ids\"}) or a "
                                            "token-id text file")->required();
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json and chat template: a directory or the tokenizer.json "
                                                "(default: the --model directory, when it has one)");
  app.add_option("--num-prompts", num_prompts, "use the first N prompts")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--max-new-tokens", max_new, "new tokens per prompt")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--block-size", block_size, "tokens per verify step (2 .. the drafter's block_size; default: the drafter's)");
  app.add_option("--stop-token", stop_specs, "end a generation after this token: an id or a token's text, e.g. '<|im_end|>' "
                                            "(repeatable; default: the target's own eos ids from the tokenizer directory's "
                                            "generation_config.json / config.json / tokenizer_config.json)");
  app.add_flag("--no-default-stop-tokens", no_default_stops, "without --stop-token, stop only at --max-new-tokens");
  app.add_option("--show", show, "print the first N prompts' decoded end, output and accepted draft tokens (ANSI colours "
                                 "alternating per step on a terminal, else [brackets] around each step's accepted drafts)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--html", html_path, "write one HTML page of every prompt's output, each step's accepted drafts coloured");
  app.add_option("--device", device, "where the target and the drafter run: cpu or cuda[:N]")->capture_default_str();
  app.add_option("--tp", tp, "tensor-parallel size of the target (under mpirun)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--ep", ep, "MoE targets: expert groups within a TP group (divides --tp and num_experts; each holds num_experts / ep experts)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--timeout", timeout_s, "seconds a collective may take before the job is ended")->capture_default_str();
  app.add_option("--csv", csv_path, "append the summary rows to this CSV (the benchmarks' format)");
  app.add_option("--json", json_path, "write the whole report (every prompt) as JSON (with the decoded prompt_text and "
                                      "output_text when a tokenizer is known)");

  std::unique_ptr<comm::MpiEnv> mpi;
  return run_app(app, argc, argv, [&]() -> int {
    const comm::Layout layout = comm::start_ranks(mpi, &argc, &argv, tp, log_level);
    const int world = layout.world_size, rank = layout.world_rank;
    DFLASH_REQUIRE_HINT(world == tp, "dflash_eval runs one TP group: mpirun -n " << world << " with --tp " << tp,
                      "start it with mpirun -n " << tp);
    DFLASH_REQUIRE_HINT(!target.src.model_dir.empty() || target.src.random_weights, "no target given",
                      "pass --model DIR, or --config FILE --random-weights");
    const Device dev = Device::parse(device);
    const bool draft_fp8 = draft_precision == "fp8";
    DFLASH_REQUIRE_HINT(!draft_fp8 || dev.is_cuda(), "--draft-precision fp8 proposes on the GPU only, got --device " << device,
                        "pass --device cuda, or drop --draft-precision");

    // ---- the target and the drafter, checked against each other before anything is loaded ----
    const target::TargetConfig cfg = target.src.read_config();
    DFLASH_REQUIRE_HINT(!drafter_dir.empty() || random_drafter > 0, "no drafter given",
                      "pass --drafter DIR (an exported drafter), or --random-drafter LAYERS for a speed benchmark");
    drafter::LoadedDrafter d;
    if (random_drafter > 0) {
      d.config = drafter::DrafterConfig::for_target(cfg, random_drafter, cfg.vocab_size - 1, 16);
      d.weights = drafter::DrafterWeights::random(d.config, target.src.seed + 1);
      drafter_dir = "<random, " + std::to_string(random_drafter) + " layers>";
    } else {
      try {
        d = drafter::import_hf(drafter_dir, DType::F32);
        d.config.check_target(cfg);
      } catch (const Error& e) {
        DFLASH_REJECT_HINT("--drafter " << drafter_dir << ": " << e.message(), e.hint());
      }
    }
    const drafter::DrafterConfig& dc = d.config;
    if (block_size == 0) block_size = dc.block_size;
    DFLASH_REQUIRE_HINT(block_size >= 2 && block_size <= dc.block_size,
                      "--block-size " << block_size << " is outside [2, " << dc.block_size << "] (the drafter's block_size)",
                      "a drafter proposes at most block_size - 1 tokens per step");

    // ---- text: the tokenizer (explicit, or the model directory's when it has one), stop tokens, prompts ----
    const std::string tok_dir = !tokenizer_path.empty() ? tokenizer_path : target.src.model_dir;
    std::unique_ptr<bench::EvalText> text;
    bool text_tried = false;
    auto load_text = [&]() -> const bench::EvalText* {
      if (!text_tried) {
        text_tried = true;
        if (!tokenizer_path.empty()) {
          try {
            text = std::make_unique<bench::EvalText>(tokenizer_path);  // asked for: its errors stop the run
          } catch (const Error& e) {
            DFLASH_REJECT_HINT("--tokenizer " << tokenizer_path << ": " << e.message(), e.hint());
          }
        } else if (!tok_dir.empty() && bench::have_text() && std::filesystem::exists(std::filesystem::path(tok_dir) / "tokenizer.json")) {
          try {
            text = std::make_unique<bench::EvalText>(tok_dir);
          } catch (const Error& e) {  // the model's own: without it, token ids still work
            if (rank == 0) spdlog::warn("{}/tokenizer.json not used ({}): no decoded text", tok_dir, e.message());
          }
        }
      }
      return text.get();
    };
    const TextFor text_for = [&](const std::string& where, const std::string& what) -> const bench::EvalText& {
      const bench::EvalText* t = load_text();
      DFLASH_REQUIRE_HINT(t != nullptr, where << ": " << what << " needs a tokenizer, and there is none"
                                              << (tok_dir.empty() ? "" : " in " + tok_dir),
                          "pass --tokenizer DIR (the target's tokenizer.json and tokenizer_config.json), or --model DIR that has them");
      return *t;
    };
    if (show > 0) text_for("--show", "decoded text");
    if (!html_path.empty()) text_for("--html", "decoded text");
    std::vector<int32_t> stop_tokens;
    std::string stop_log;
    {
#if DFLASH_WITH_TEXT
      const text::StopTokenChoice sc = text::choose_stop_tokens(stop_specs, "--stop-token", no_default_stops ? "" : tok_dir, [&] {
        const bench::EvalText* t = load_text();
        return t ? t->tokenizer() : nullptr;
      });
      stop_tokens = sc.ids;
      stop_log = sc.log;
#else
      for (const std::string& sp : stop_specs) {
        DFLASH_REQUIRE_HINT(!sp.empty() && sp.find_first_not_of("0123456789") == std::string::npos,
                            "--stop-token '" << sp << "' is text, and this build has no tokenizer (text/ was skipped)",
                            "give the token's id, or build with libonig-dev and libicu-dev");
        stop_tokens.push_back(static_cast<int32_t>(std::stoll(sp)));
      }
      stop_log = stop_specs.empty() ? (tok_dir.empty() ? "stop tokens: none (no --stop-token given)"
                                                        : "stop tokens: none (this build has no tokenizer to read the target's own)")
                                    : "stop tokens: " + fmt::format("{}", fmt::join(stop_tokens, ", ")) + " from --stop-token";
#endif
      if (stop_specs.empty() && no_default_stops) stop_log = "stop tokens: none (--no-default-stop-tokens)";
    }
    for (int32_t t : stop_tokens)
      DFLASH_REQUIRE_HINT(t >= 0 && t < cfg.vocab_size,
                          (stop_specs.empty() ? "the default stop token " : "--stop-token ")
                              << t << " is outside the vocabulary [0, " << cfg.vocab_size << ")",
                          (stop_specs.empty() ? "the tokenizer directory's eos ids are not this target's: pass --stop-token or "
                                                "--no-default-stop-tokens"
                                              : "stop tokens are ids of the target's tokenizer"));
    target::check_tp(cfg, tp, ep);
    const std::vector<Prompt> prompts = read_prompts(prompts_path, num_prompts, cfg.vocab_size, text_for);
    int64_t longest = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      longest = std::max<int64_t>(longest, static_cast<int64_t>(prompts[i].ids.size()));
      for (int32_t t : prompts[i].ids)
        DFLASH_REQUIRE_HINT(t < cfg.vocab_size,
                          prompts_path << ": prompt " << i << " holds token id " << t << ", outside the target's vocabulary [0, "
                                       << cfg.vocab_size << ")",
                          "tokenize the prompts with the target's tokenizer");
    }
    // Room for the prompt, the new tokens, a whole last block and the estimate's labels past the end.
    DFLASH_REQUIRE_HINT(sweep_blocks.empty() || tp == 1, "--verify-sweep runs on one rank (tp 1), here tp " << tp,
                        "time the block sizes without mpirun");
    int64_t sweep_max = block_size;
    for (int64_t b : sweep_blocks) {
      DFLASH_REQUIRE_HINT(b >= 1 && b <= dc.block_size, "--verify-sweep " << b << " is outside [1, " << dc.block_size
                                                                         << "] (the drafter's block_size)",
                          "a verify step holds x_start and at most block_size - 1 drafts");
      sweep_max = std::max(sweep_max, b);
    }
    DFLASH_REQUIRE_HINT(commit_probe == 0 || tp == 1, "--commit-probe runs on one rank (tp 1), here tp " << tp,
                        "time the commit step without mpirun");
    // (--commit-probe commits one token per probe step: 2 N + 2 steps per context-update setting (two under FP8
    // propose), then 2 N + 2 steps of commit + propose: at most 6 N + 6 more positions.)
    const int64_t max_len = longest + max_new + 2 * std::max(block_size, sweep_max) + 6 * commit_probe + 6;

    std::unique_ptr<comm::Communicator> tp_comm;
    if (tp > 1) tp_comm = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, layout.tp_group, rank, dev, timeout_s, "tp");
    std::unique_ptr<target::Decoder> dec;
    std::unique_ptr<drafter::Proposer> prop;
    bench::DrafterScorer scorer;
    bench::Roofline roof;  // the copy bandwidth of this run (GPU; roofline.h)
#if DFLASH_WITH_CUDA
    // Measured before the weights are on the GPU, as generate_bench and dflash_doctor measure it.
    if (!dev.is_cpu()) roof.copy_gbs = bench::copy_bandwidth_gbs(dev.index);
#endif
    const auto t_load = std::chrono::steady_clock::now();
    const target::TargetSource src = target.source();
    target::TargetRuntime rt(src, cfg, dev, tp, layout.tp_rank, tp_comm.get(), require_fast, ep);
    rt.set_cuda_graphs(!no_graphs);
    const std::string plans = rt.plans();
    dec = rt.make_decoder(1, max_len);
    const target::TargetWeights& tw = rt.weights();
#if DFLASH_WITH_CUDA
    std::unique_ptr<drafter::CudaDrafter> cuda_scorer;
    target::CudaTargetModel* cuda_model = rt.cuda_model();
#endif
    if (dev.is_cpu()) {
      const drafter::FrozenTarget frozen{tw.embed_tokens, tw.lm_head};
      const drafter::DrafterMath math = cpu_drafter == "f64" ? drafter::DrafterMath::F64 : drafter::DrafterMath::F32;
      prop = drafter::make_cpu_proposer(dc, d.weights, frozen, 1, max_len, math);
      scorer = bench::cpu_scorer(dc, d.weights, frozen, block_size, math);
    } else {
#if DFLASH_WITH_CUDA
      // (--no-cuda-graphs launches the propose steps eagerly too.)
      prop = drafter::make_cuda_proposer(dc, d.weights, tw.embed_tokens, tw.lm_head, dev, 1, max_len, draft_fp8, !no_graphs);
      if (!no_estimate) {
        drafter::DrafterConfig sc = dc;
        sc.block_size = block_size;
        cuda_scorer = std::make_unique<drafter::CudaDrafter>(sc, d.weights, tw.embed_tokens, tw.lm_head, dev);
        scorer = [&](const drafter::DrafterBatch& b) { return cuda_scorer->step(b, drafter::StepOptions{}, false); };
      }
#endif
    }
    if (no_estimate) scorer = nullptr;
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();

    bench::GenerateOptions go;
    go.max_new_tokens = max_new;
    go.stop_tokens = stop_tokens;
    go.block_size = block_size;
    std::vector<PromptReport> reports;
    int64_t mismatches = 0;
    if (rank == 0) std::printf("%s\n", stop_log.c_str());
    const bool colour = isatty(fileno(stdout)) != 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::vector<int32_t>& p = prompts[i].ids;
      PromptReport rep;
      rep.prompt_len = static_cast<int64_t>(p.size());
      rep.kind = prompts[i].kind;
      rep.prompt = p;
      // The estimate's labels need block_size - 1 greedy tokens past the timed ones.
      const int64_t extra = scorer ? block_size - 1 : 0;
      const bench::Generation greedy = bench::greedy_generate(*dec, 0, p, go, extra);
      const bench::Generation spec = bench::speculative_generate(*dec, *prop, 0, p, go);
      const int64_t n_greedy = static_cast<int64_t>(greedy.tokens.size()) - extra;
      rep.generated = n_greedy;
      rep.accept = spec.accept;
      rep.tokens = spec.tokens;
      rep.greedy = greedy.times;
      rep.spec = spec.times;
      for (int64_t t = 0; t < std::max<int64_t>(n_greedy, static_cast<int64_t>(spec.tokens.size())); ++t) {
        const int32_t want = t < n_greedy ? greedy.tokens[static_cast<size_t>(t)] : -1;
        const int32_t got = t < static_cast<int64_t>(spec.tokens.size()) ? spec.tokens[static_cast<size_t>(t)] : -1;
        if (want != got) {
          rep.mismatch_at = t, rep.want = want, rep.got = got;
          ++mismatches;
          break;
        }
      }
      if (scorer) {
        // The trainer's estimate on this prompt: the drafter's training forward over prompt + the
        // target's greedy tokens, with the target's features of one forward over that sequence.
        const bench::AcceptEstimate est = bench::greedy_training_estimate(*dec, dc.target_layer_ids, scorer, p,
                                                                          greedy.tokens, n_greedy, spec.block_starts);
        rep.est_steps = est.at_steps;
        rep.est_all = est.at_all;
      }
      if (rank == 0)
        std::printf("prompt %3zu: %4lld tokens, %4lld new, %3zu steps, tau %.3f%s%s\n", i,
                    static_cast<long long>(rep.prompt_len), static_cast<long long>(n_greedy), spec.accept.size(),
                    mean(spec.accept),
                    scorer ? fmt::format(" (estimate at these blocks {:.3f}, at every position {:.3f})",
                                         rep.est_steps.accept_len(), rep.est_all.accept_len())
                                 .c_str()
                           : "",
                    rep.mismatch_at >= 0 ? "  OUTPUT DIFFERS" : "");
      if (rank == 0 && static_cast<int64_t>(i) < show)
        std::printf("%s", bench::show_text(*text, {i, rep.kind, rep.prompt, rep.tokens, rep.accept}, colour).c_str());
      reports.push_back(std::move(rep));
    }
    if (rank != 0) return mismatches ? 3 : 0;

    // ---- summary ----
    std::vector<int64_t> all_accept;
    bench::PhaseTimes g, s;
    int64_t tokens = 0;
    drafter::StepStats est_steps, est_all;
    for (const PromptReport& r : reports) {
      all_accept.insert(all_accept.end(), r.accept.begin(), r.accept.end());
      g.add(r.greedy);
      s.add(r.spec);
      tokens += r.generated;
      est_steps.add(r.est_steps);
      est_all.add(r.est_all);
    }
    const int64_t steps = static_cast<int64_t>(all_accept.size());
    const double tau = mean(all_accept);
    std::vector<int64_t> hist(static_cast<size_t>(block_size + 1), 0);
    for (int64_t a : all_accept) ++hist[static_cast<size_t>(a)];
    const double tps_g = static_cast<double>(tokens) / g.steps(), tps_s = static_cast<double>(tokens) / s.steps();
    std::printf("\n== dflash_eval: %s\n", version_string().c_str());
    std::printf("target  %s on %s (%s), tp %d\n", cfg.summary().c_str(), dec->describe().c_str(), dev.str().c_str(), tp);
    if (!plans.empty()) std::printf("kernels %s\n", plans.c_str());
    std::printf("drafter %s (%s)%s\n", dc.summary().c_str(), drafter_dir.c_str(),
                draft_fp8 ? "; proposes with FP8 weights (e4m3, 128 x 128 block scales; the estimate is the bf16 drafter's)"
                          : "");
    std::printf("%zu prompt(s) from %s, %lld new tokens each (at most), block %lld; loaded in %.1f s\n", prompts.size(),
                prompts_path.c_str(), static_cast<long long>(max_new), static_cast<long long>(block_size), load_s);
    std::printf("\ntau (mean acceptance length over %lld steps): %.3f\n", static_cast<long long>(steps), tau);
    if (scorer)
      std::printf("  the trainer's estimate on the same prompts: %.3f at the same blocks, %.3f at every generated position\n",
                  est_steps.accept_len(), est_all.accept_len());
    else
      std::printf("  the trainer's estimate: not computed (--no-estimate)\n");
    std::printf("acceptance length histogram:");
    for (int64_t a = 1; a <= block_size; ++a) std::printf(" %lld:%lld", static_cast<long long>(a), static_cast<long long>(hist[a]));
    std::printf("\nacceptance per block position k (share of steps whose draft k was accepted):");
    for (int64_t k = 1; k < block_size; ++k) {
      int64_t n = 0;
      for (int64_t a : all_accept) n += a > k;
      std::printf(" %.2f", steps ? static_cast<double>(n) / static_cast<double>(steps) : 0.0);
    }
    std::printf("\ntarget-only greedy: %lld tokens in %.3f s = %.1f tok/s (prefill %.3f s apart)\n",
                static_cast<long long>(tokens), g.steps(), tps_g, g.prefill);
    std::printf("speculative:        %lld tokens in %.3f s = %.1f tok/s; speed-up %.2fx\n", static_cast<long long>(tokens),
                s.steps(), tps_s, tps_s / tps_g);
    const double nsteps = static_cast<double>(std::max<int64_t>(steps, 1));
    const double t_dec = g.decode / static_cast<double>(std::max<int64_t>(tokens, 1));
    const double t_prop = s.propose / nsteps, t_ver = s.verify / nsteps, t_com = s.commit / nsteps;
    std::printf("  a step (means): propose %.2f ms, verify %.2f ms, commit %.2f ms (target decode step %.2f ms; verify = %.2fx "
                "decode, propose = %.1f%% of verify)\n",
                1e3 * t_prop, 1e3 * t_ver, 1e3 * t_com, 1e3 * t_dec, t_ver / t_dec, 100.0 * t_prop / t_ver);
    // Medians of the per-step times (the CSV rows' p50, with p20 / p80): apart from one-off costs the
    // means carry (a shape's first, eager step and its graph capture; the commit after an eager verify).
    const bench::Stats st_dec = step_ms(g.decode_steps), st_prop = step_ms(s.propose_steps);
    const bench::Stats st_ver = step_ms(s.verify_steps), st_com = step_ms(s.commit_steps);
    std::printf("  medians (p20-p80): propose %.2f (%.2f-%.2f) ms, verify %.2f (%.2f-%.2f), commit %.3f (%.3f-%.3f), "
                "decode %.2f (%.2f-%.2f); the means above include each shape's first step and graph capture\n",
                st_prop.p50, st_prop.p20, st_prop.p80, st_ver.p50, st_ver.p20, st_ver.p80, st_com.p50, st_com.p20,
                st_com.p80, st_dec.p50, st_dec.p20, st_dec.p80);
    const double projected = 6.0 * t_dec / (t_prop + t_ver + t_com);
    std::printf("  projected speed-up at tau = 6: %.2fx (6 x decode step / (propose + verify + commit))\n", projected);
    // The roofline (bench/roofline.h) at the mean context of the timed steps, this rank's shard.
    double ctx = 0;
    for (const PromptReport& r : reports)
      ctx += static_cast<double>(r.prompt_len) + 0.5 * static_cast<double>(r.generated);
    ctx /= static_cast<double>(std::max<size_t>(reports.size(), 1));
    const target::Precision prec = tw.precision();
    const bool fp8x = target.src.fp8_experts;
    const bench::StepBytes b_dec = bench::target_step_bytes(rt.local_config(), prec, 1, 1, ctx, fp8x);
    const bench::StepBytes b_ver = bench::target_step_bytes(rt.local_config(), prec, 1, block_size, ctx, fp8x);
    const bench::StepBytes b_prop = bench::propose_bytes(dc, 1, ctx, draft_fp8);
    if (roof.copy_gbs > 0) {
      std::printf("  roofline (bytes a step moves / the copy bandwidth, %.0f GB/s: %s; context %.0f; the steps' medians):\n",
                  roof.copy_gbs, bench::kCopyMethod, ctx);
      for (const auto& [what, b, ms] : {std::tuple{"decode", b_dec, st_dec.p50}, std::tuple{"verify", b_ver, st_ver.p50},
                                        std::tuple{"propose", b_prop, st_prop.p50}})
        std::printf("    %-7s %s -> %.2f ms; the step (%.2f ms) is %.1f%% of it\n", what, bench::describe(b).c_str(),
                    roof.ms(b), ms, 100.0 * roof.share(b, ms));
    }
    if (!dec->kernels_run().empty()) std::printf("  decode kernels run: %s\n", dec->kernels_run().c_str());
    if (!prop->graph_stats().empty()) std::printf("  propose: %s\n", prop->graph_stats().c_str());

    // ---- --verify-sweep: the step costs against the block size B on the last prompt's state ----
    // Each timed step is a propose of B - 1 drafts and a verify of [x_start, drafts] (commit = false,
    // the drafter's features captured, as in speculative decoding), never committed: the context
    // stays where the last prompt ended. B = 1 is a verify of x_start alone (a decode step's work).
    // The speed-up a block implies at acceptance length tau (<= B) is tau x decode step / (propose +
    // verify + commit), with this run's decode and commit steps.
    struct SweepRow {
      int64_t B;
      double propose_ms, verify_ms;
      bench::StepBytes bytes;
    };
    std::vector<SweepRow> sweep;
    const std::vector<double> sweep_taus{3.0, 5.0, 7.0};
    if (!sweep_blocks.empty()) {
      using clk = std::chrono::steady_clock;
      const int32_t x_start = reports.back().tokens.empty() ? 0 : reports.back().tokens.back();
      target::ExtendOptions vo;
      vo.capture = dc.target_layer_ids;
      vo.commit = false;
      const double sweep_ctx = static_cast<double>(dec->length(0));
      for (int64_t B : sweep_blocks) {
        double prop_s = 0, ver_s = 0;
        for (int64_t it = 0; it < sweep_reps + 2; ++it) {
          std::vector<int32_t> block{x_start};
          auto t0 = clk::now();
          if (B > 1) {
            const std::vector<int32_t> drafts = prop->propose({0}, {x_start}, B).front();
            block.insert(block.end(), drafts.begin(), drafts.end());
          }
          auto t1 = clk::now();
          (void)dec->extend({0}, {block}, vo);
          auto t2 = clk::now();
          if (it >= 2) {  // the first two capture the shapes' graphs
            prop_s += std::chrono::duration<double>(t1 - t0).count();
            ver_s += std::chrono::duration<double>(t2 - t1).count();
          }
        }
        sweep.push_back({B, 1e3 * prop_s / static_cast<double>(sweep_reps), 1e3 * ver_s / static_cast<double>(sweep_reps),
                         bench::target_step_bytes(rt.local_config(), prec, 1, B, sweep_ctx, target.src.fp8_experts)});
      }
      std::printf("\nverify step against block size B (%lld steps each, context %.0f; decode step %.2f ms, commit %.2f ms "
                  "from the run above; speed-up at tau = tau x decode / (propose + verify + commit)):\n",
                  static_cast<long long>(sweep_reps), sweep_ctx, 1e3 * t_dec, 1e3 * t_com);
      std::printf("  %3s %10s %10s %9s %11s %10s", "B", "verify ms", "/ decode", "propose", "roofline ms", "experts <=");
      for (double t : sweep_taus) std::printf("  x @tau %.0f", t);
      std::printf("\n");
      for (const SweepRow& w : sweep) {
        const int64_t experts =
            cfg.is_moe() ? std::min<int64_t>(cfg.num_experts, w.B * cfg.num_experts_per_tok) : 0;
        std::printf("  %3lld %10.3f %9.2fx %9.3f %11.3f %10s", static_cast<long long>(w.B), w.verify_ms,
                    w.verify_ms / (1e3 * t_dec), w.propose_ms, roof.ms(w.bytes),
                    cfg.is_moe() ? std::to_string(experts).c_str() : "-");
        for (double t : sweep_taus) {
          if (t > static_cast<double>(w.B) || w.B < 2) std::printf("  %8s", "-");
          else std::printf("  %7.2fx", t * 1e3 * t_dec / (w.propose_ms + w.verify_ms + 1e3 * t_com));
        }
        std::printf("\n");
      }
    }
    // ---- --commit-probe N: the commit step's two parts apart, on the last prompt's state ----
    // Each probe step proposes a block and verifies it as speculative decoding does, then commits one
    // token (x_start): on even steps the target's commit alone (then a synchronisation), then the
    // drafter's context update of that token alone (then one); on odd steps both as the loop runs
    // them (the target's commit beside the context update on the GPU, one synchronisation). The first
    // two steps are warm-ups (graph captures). The medians say which part the commit step waits for.
    // Under FP8 propose every pair of steps runs twice, the context update on its bf16 weights and on
    // the FP8 copies (drafter::cuda_context_fp8): the A/B of the commit step in one process.
    bench::Stats cp_target, cp_context, cp_both, cp_context8, cp_both8, cp_context_gpu, cp_beside_gpu, cp_serial, cp_pipe;
    const bool cp_fp8 = draft_fp8;  // (a CUDA device, checked at start-up)
    if (commit_probe > 0) {
      using clk = std::chrono::steady_clock;
      auto sec = [](clk::time_point a, clk::time_point b) { return std::chrono::duration<double>(b - a).count(); };
      target::ExtendOptions vo;
      vo.capture = dc.target_layer_ids;
      vo.commit = false;
      int32_t x = reports.back().tokens.empty() ? 0 : reports.back().tokens.back();
      std::vector<double> t_target, t_context, t_both, t_context8, t_both8;
      const int64_t modes = cp_fp8 ? 2 : 1;
      // On a GPU also the context update's device span (events on the proposer's stream around it; bf16
      // setting): alone, and beside the target's commit (the first event before the commit forks it).
      std::vector<double> g_context, g_beside;
#if DFLASH_WITH_CUDA
      const int saved_ctx_fp8 = drafter::cuda_context_fp8;
      cudaEvent_t ce[2] = {nullptr, nullptr};
      const cudaStream_t cs = dev.is_cuda() ? static_cast<cudaStream_t>(DeviceContext::get(dev.index).stream()) : nullptr;
      if (cs) for (cudaEvent_t& e : ce) DFLASH_CUDA_CHECK(cudaEventCreate(&e));
      auto mark = [&](int i) { if (cs) DFLASH_CUDA_CHECK(cudaEventRecord(ce[i], cs)); };
#else
      auto mark = [](int) {};
#endif
      for (int64_t it = 0; it < modes * (2 * commit_probe + 2); ++it) {
        const bool fp8_ctx = (it / 2) % modes == 1;  // steps 2j, 2j+1 of one setting, then of the other
#if DFLASH_WITH_CUDA
        if (cp_fp8) drafter::cuda_context_fp8 = fp8_ctx ? 1 : 0;
#endif
        std::vector<int32_t> block{x};
        const std::vector<int32_t> drafts = prop->propose({0}, {x}, block_size).front();
        block.insert(block.end(), drafts.begin(), drafts.end());
        const target::ExtendResult r = dec->extend({0}, {block}, vo);
        const bool apart = it % 2 == 0;
        const auto t0 = clk::now();
        if (!apart) mark(0);
        dec->commit(0, 1);
        if (apart) dec->synchronize();
        const auto t1 = clk::now();
        if (apart) mark(0);
        prop->add_context({0}, r.features.slice(0, 0, 1), ops::SeqOffsets{{0, 1}});
        mark(1);
        dec->synchronize();
        const auto t2 = clk::now();
#if DFLASH_WITH_CUDA
        if (cs && it >= 2 * modes && !fp8_ctx) {
          float ms = 0;
          DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, ce[0], ce[1]));
          (apart ? g_context : g_beside).push_back(ms * 1e-3);
        }
#endif
        if (it >= 2 * modes && apart) t_target.push_back(sec(t0, t1)), (fp8_ctx ? t_context8 : t_context).push_back(sec(t1, t2));
        if (it >= 2 * modes && !apart) (fp8_ctx ? t_both8 : t_both).push_back(sec(t0, t2));
        x = r.next[0];
      }
#if DFLASH_WITH_CUDA
      drafter::cuda_context_fp8 = saved_ctx_fp8;
      if (cs) for (cudaEvent_t& e : ce) DFLASH_CUDA_CHECK(cudaEventDestroy(e));
#endif
      cp_target = step_ms(t_target), cp_context = step_ms(t_context), cp_both = step_ms(t_both);
      std::printf("\ncommit step apart (%lld steps each, context %lld, one token committed; medians, p20-p80): target commit "
                  "%.3f (%.3f-%.3f) ms, drafter context update %.3f (%.3f-%.3f) ms, both as the loop runs them %.3f "
                  "(%.3f-%.3f) ms\n",
                  static_cast<long long>(commit_probe), static_cast<long long>(dec->length(0)), cp_target.p50,
                  cp_target.p20, cp_target.p80, cp_context.p50, cp_context.p20, cp_context.p80, cp_both.p50, cp_both.p20,
                  cp_both.p80);
      if (!g_context.empty()) {
        cp_context_gpu = step_ms(g_context), cp_beside_gpu = step_ms(g_beside);
        std::printf("  the context update's device span (events on its stream; medians, p20-p80): alone %.3f (%.3f-%.3f) "
                    "ms, beside the target's commit %.3f (%.3f-%.3f) ms\n",
                    cp_context_gpu.p50, cp_context_gpu.p20, cp_context_gpu.p80, cp_beside_gpu.p50, cp_beside_gpu.p20,
                    cp_beside_gpu.p80);
      }
      if (cp_fp8) {
        cp_context8 = step_ms(t_context8), cp_both8 = step_ms(t_both8);
        std::printf("  the context update on the FP8 copies (drafter::cuda_context_fp8; DFLASH_CONTEXT_FP8=1): %.3f "
                    "(%.3f-%.3f) ms alone, commit step %.3f (%.3f-%.3f) ms\n",
                    cp_context8.p50, cp_context8.p20, cp_context8.p80, cp_both8.p50, cp_both8.p20, cp_both8.p80);
      }
      // The commit step and the next propose together, alternately with the synchronisation the loop has
      // between them (speculative_generate waits there to time the commit) and without it (pipelined: the
      // propose queued behind the context update while the target's commit may still run on its side
      // stream; the next verify waits for it): what a loop that does not time its phases would save.
      std::vector<int32_t> next_drafts = prop->propose({0}, {x}, block_size).front();
      std::vector<double> t_serial, t_pipe;
      for (int64_t it = 0; it < 2 * commit_probe + 2; ++it) {
        std::vector<int32_t> block{x};
        block.insert(block.end(), next_drafts.begin(), next_drafts.end());
        const target::ExtendResult r = dec->extend({0}, {block}, vo);
        const bool pipelined = it % 2 == 1;
        const auto t0 = clk::now();
        dec->commit(0, 1);
        prop->add_context({0}, r.features.slice(0, 0, 1), ops::SeqOffsets{{0, 1}});
        if (!pipelined) dec->synchronize();
        x = r.next[0];
        next_drafts = prop->propose({0}, {x}, block_size).front();
        const auto t1 = clk::now();
        if (it >= 2) (pipelined ? t_pipe : t_serial).push_back(sec(t0, t1));
      }
      dec->synchronize();
      cp_serial = step_ms(t_serial), cp_pipe = step_ms(t_pipe);
      std::printf("  commit step + the next propose (medians, p20-p80): with the loop's synchronisation between them %.3f "
                  "(%.3f-%.3f) ms, pipelined %.3f (%.3f-%.3f) ms\n",
                  cp_serial.p50, cp_serial.p20, cp_serial.p80, cp_pipe.p50, cp_pipe.p20, cp_pipe.p80);
    }
#if DFLASH_WITH_CUDA
    std::vector<VariantRow> variant_rows;
    if (!decode_variants.empty() && cuda_model) {
      // Fresh decoders of variants of the decode plan on the same model and drafter, the first prompt,
      // variant_tokens new tokens: target-only greedy (decode step) and speculative (propose, verify,
      // commit per step); their greedy tokens must equal the main run's.
      const std::vector<int32_t>& p0 = prompts[0].ids;
      bench::GenerateOptions vgo = go;
      vgo.max_new_tokens = std::min<int64_t>(variant_tokens, max_new);
      vgo.stop_tokens.clear();
      const bench::Generation ref = bench::greedy_generate(*dec, 0, p0, vgo);
      // Variants whose GEMMs round otherwise (the skinny GEMM, the MoE decode kernels' dot products, wgmma).
      // (fp8_side_gemms puts an FP8 target's bf16 b|a GEMM on gemm_skinny instead of cuBLASLt)
      const bool fp8_target = cuda_model->weights().fp8_projections() > 0;
      const auto gemms_of = [fp8_target](const target::FastPathPlan::DecodeFusion& f) {
        return std::make_tuple(f.skinny_gemm, f.skinny_streamk, f.moe_decode, f.moe_wgmma, fp8_target && f.fp8_side_gemms);
      };
      const auto ref_gemms = gemms_of(rt.decode_plan().fusion);
      const auto vstream = static_cast<cudaStream_t>(cuda_model->stream());
      std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(vgo.max_new_tokens));
      for (cudaEvent_t& e : ev) DFLASH_CUDA_CHECK(cudaEventCreate(&e));
      std::stringstream names(decode_variants);
      for (std::string name; std::getline(names, name, ',');) {
        target::FastPathPlan plan = rt.decode_plan();
        target::FastPathPlan::DecodeFusion& f = plan.fusion;
        const bench::VariantSwitches switches = bench::VariantSwitches::save();
        bench::apply_decode_variant(name, f, "--decode-variants");
        VariantRow row;
        row.name = name;
        row.fusion = plan.fusion.any() ? plan.fusion.str() : "none";
        if (fp8_target && cuda::tuning::gate_quant != 0) row.fusion += ",gate_quant";
        row.pdl = cuda::pdl_enabled();
        {
          auto vdec = target::make_cuda_decoder(*cuda_model, 1, max_len, plan);
          // Target-only greedy decoding: host time per step, and the device time of each step
          // (events around it on the decoder's stream: the staging copy, the graph, the token back).
          target::ExtendOptions eo;
          eo.last_only = true;
          vdec->reset(0);
          std::vector<int32_t> tokens{vdec->extend({0}, {p0}, eo).next.back()};
          const auto t0 = std::chrono::steady_clock::now();
          for (size_t i = 1; i < static_cast<size_t>(vgo.max_new_tokens); ++i) {
            DFLASH_CUDA_CHECK(cudaEventRecord(ev[2 * i], vstream));
            tokens.push_back(vdec->extend({0}, {{tokens.back()}}, eo).next.back());
            DFLASH_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], vstream));
          }
          const double host_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          DFLASH_CUDA_CHECK(cudaStreamSynchronize(vstream));
          double gpu_ms = 0;
          for (size_t i = 1; i < static_cast<size_t>(vgo.max_new_tokens); ++i) {
            float ms = 0;
            DFLASH_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
            gpu_ms += ms;
          }
          const double steps = static_cast<double>(std::max<int64_t>(vgo.max_new_tokens - 1, 1));
          row.decode_ms = 1e3 * host_s / steps;
          row.decode_gpu_ms = gpu_ms / steps;
          const bench::Generation sp = bench::speculative_generate(*vdec, *prop, 0, p0, vgo);
          // Speculative decoding must give this variant's own greedy tokens; against the main run's
          // only when both ran the same GEMM kernels (another GEMM rounds otherwise).
          row.same = sp.tokens.size() >= tokens.size() && std::equal(tokens.begin(), tokens.end(), sp.tokens.begin());
          const bool other_gemms = gemms_of(f) != ref_gemms;
          row.vs_main = other_gemms ? "other GEMMs" : tokens == ref.tokens ? "yes" : "NO";
          if (!other_gemms && tokens != ref.tokens) row.same = false;
          row.propose_ms = step_ms(sp.times.propose_steps).p50;
          row.verify_ms = step_ms(sp.times.verify_steps).p50;
          row.commit_ms = step_ms(sp.times.commit_steps).p50;
          row.kernels = vdec->kernels_run();
        }
        switches.restore();
        variant_rows.push_back(row);
      }
      for (cudaEvent_t& e : ev) DFLASH_CUDA_CHECK(cudaEventDestroy(e));
      std::printf("\ndecode plan variants (fresh decoders, prompt 0, %lld new tokens; decode: host time per step and its device "
                  "time; verify / commit / propose: medians of the steps; same: speculative == the variant's greedy (and == the main "
                  "run's greedy where the GEMMs are the same)):\n",
                  static_cast<long long>(vgo.max_new_tokens));
      std::printf("%-16s %10s %10s %10s %10s %10s  %-5s %-11s %-4s %s\n", "variant", "decode ms", "dec gpu ms", "verify ms",
                  "commit ms", "propose ms", "same", "vs main", "pdl", "fusions");
      for (const VariantRow& v : variant_rows)
        std::printf("%-16s %10.3f %10.3f %10.3f %10.3f %10.3f  %-5s %-11s %-4s %s\n", v.name.c_str(), v.decode_ms,
                    v.decode_gpu_ms, v.verify_ms, v.commit_ms, v.propose_ms, v.same ? "yes" : "NO", v.vs_main.c_str(),
                    v.pdl ? "on" : "off", v.fusion.c_str());
      for (const VariantRow& v : variant_rows) {
        std::printf("  %s: %s\n", v.name.c_str(), v.kernels.c_str());
        if (!v.same) ++mismatches;
      }
    }
    if (profile_steps > 0 && cuda_model) {
      // Where a target decode step goes: every op bracketed by events, T = 1 steps on the first prompt.
      target::OpProfiler prof;
      std::vector<target::OpProfile> profiles;
      target::ExtendOptions eo;
      eo.last_only = true;
      dec->reset(0);
      int32_t next = dec->extend({0}, {prompts[0].ids}, eo).next.back();
      cuda_model->set_profiler(&prof);
      for (int64_t i = 0; i <= profile_steps && dec->length(0) < max_len; ++i) {
        next = dec->extend({0}, {{next}}, eo).next.back();
        target::OpProfile op = prof.collect();
        if (i > 0) profiles.push_back(std::move(op));  // the first one grew the event pool
      }
      cuda_model->set_profiler(nullptr);
      if (!profiles.empty()) {
        const bench::ProfileSummary ps = bench::summarize_profile(profiles, 1e3 * t_dec);
        std::printf("\nwhere a target decode step goes (%zu steps at context %lld, ms per step; the reference is the "
                    "unprofiled step, %.2f ms):\n%s\n",
                    profiles.size(), static_cast<long long>(prompts[0].ids.size()), 1e3 * t_dec, bench::profile_table(ps).c_str());
      }
    }
#endif

    if (!csv_path.empty()) {
      bench::CsvWriter csv(csv_path, dev.is_cpu() ? "cpu" : cuda_device_info(dev.index).name);
      // "qwen3_5 L64 H5120 ctx=4128 block=16 bf16,prompts=1,max_new=64": model, mean context of the
      // timed steps, block, precision, then the run.
      const std::string shape = fmt::format("{} L{} H{} ctx={:.0f} block={} {},prompts={},max_new={}", cfg.model_type,
                                            cfg.num_hidden_layers, cfg.hidden_size, ctx, block_size,
                                            dev.is_cpu() ? "f32" : target::precision_name(prec), prompts.size(), max_new) +
                                (target.src.fp8_experts ? ",fp8x" : "") + (no_graphs && !dev.is_cpu() ? ",eager" : "") +
                                (draft_fp8 ? ",draft_fp8" : "");
      auto row = [&](const std::string& kernel, const std::string& metric, const std::string& unit, double v) {
        csv.write({"dflash_eval", kernel, dev.is_cpu() ? "cpu" : "cuda", "tp" + std::to_string(tp), metric, unit, shape, v, v, v, false});
      };
      row("speculative", "tau", "tokens", tau);
      if (scorer) {
        row("speculative", "tau_estimate_same_blocks", "tokens", est_steps.accept_len());
        row("speculative", "tau_estimate_all_positions", "tokens", est_all.accept_len());
      }
      row("speculative", "tok_s", "tok/s", tps_s);
      row("greedy", "tok_s", "tok/s", tps_g);
      row("speculative", "speedup", "x", tps_s / tps_g);
      // The step times: median, p20, p80 of the steps (the means are in the log and the tok/s rows).
      auto step_row = [&](const std::string& kernel, const std::string& metric, const bench::Stats& st) {
        csv.write({"dflash_eval", kernel, dev.is_cpu() ? "cpu" : "cuda", "tp" + std::to_string(tp), metric, "ms", shape,
                   st.p50, st.p20, st.p80, false});
      };
      step_row("speculative", "propose_step_ms", st_prop);
      step_row("speculative", "verify_step_ms", st_ver);
      step_row("speculative", "commit_step_ms", st_com);
      step_row("greedy", "decode_step_ms", st_dec);
      row("speculative", "projected_speedup_tau6", "x", projected);
      row("greedy", "decode_step_bytes", "GB", b_dec.total() / 1e9);
      row("speculative", "verify_step_bytes", "GB", b_ver.total() / 1e9);
      row("speculative", "propose_step_bytes", "GB", b_prop.total() / 1e9);
      if (roof.copy_gbs > 0) {
        row("greedy", "decode_step_roofline_ms", "ms", roof.ms(b_dec));
        row("greedy", "decode_step_roofline_pct", "%", 100.0 * roof.share(b_dec, st_dec.p50));
        row("speculative", "verify_step_roofline_ms", "ms", roof.ms(b_ver));
        row("speculative", "verify_step_roofline_pct", "%", 100.0 * roof.share(b_ver, st_ver.p50));
        row("speculative", "propose_step_roofline_ms", "ms", roof.ms(b_prop));
        row("speculative", "propose_step_roofline_pct", "%", 100.0 * roof.share(b_prop, st_prop.p50));
        row("copy", "d2d_bandwidth", "GB/s", roof.copy_gbs);
      }
      row("speculative", "mismatches", "prompts", static_cast<double>(mismatches));
      if (commit_probe > 0) {
        step_row("commit_probe", "target_commit_ms", cp_target);
        step_row("commit_probe", "context_update_ms", cp_context);
        step_row("commit_probe", "commit_step_ms", cp_both);
        step_row("commit_probe", "commit_propose_serial_ms", cp_serial);
        step_row("commit_probe", "commit_propose_pipelined_ms", cp_pipe);
        if (!cp_context_gpu.samples.empty()) {
          step_row("commit_probe", "context_update_gpu_ms", cp_context_gpu);
          step_row("commit_probe", "context_update_beside_commit_gpu_ms", cp_beside_gpu);
        }
        if (cp_fp8) {
          step_row("commit_probe", "context_update_fp8_ms", cp_context8);
          step_row("commit_probe", "commit_step_fp8_context_ms", cp_both8);
        }
      }
      for (const SweepRow& w : sweep) {
        // The sweep's rows: kernel verify_sweep, the block size in the metric's name.
        const std::string b = "_b" + std::to_string(w.B);
        row("verify_sweep", "verify_step_ms" + b, "ms", w.verify_ms);
        row("verify_sweep", "verify_over_decode" + b, "x", w.verify_ms / (1e3 * t_dec));
        if (w.B > 1) row("verify_sweep", "propose_step_ms" + b, "ms", w.propose_ms);
        if (roof.copy_gbs > 0) row("verify_sweep", "verify_step_roofline_ms" + b, "ms", roof.ms(w.bytes));
        for (double t : sweep_taus)
          if (w.B >= 2 && t <= static_cast<double>(w.B))
            row("verify_sweep", fmt::format("projected_speedup_tau{:.0f}{}", t, b), "x",
                t * 1e3 * t_dec / (w.propose_ms + w.verify_ms + 1e3 * t_com));
      }
#if DFLASH_WITH_CUDA
      for (const VariantRow& v : variant_rows) {
        row("variant:" + v.name, "decode_step_ms", "ms", v.decode_ms);
        row("variant:" + v.name, "decode_step_gpu_ms", "ms", v.decode_gpu_ms);
        row("variant:" + v.name, "verify_step_ms", "ms", v.verify_ms);
        row("variant:" + v.name, "commit_step_ms", "ms", v.commit_ms);
        row("variant:" + v.name, "propose_step_ms", "ms", v.propose_ms);
      }
#endif
    }
    if (!json_path.empty()) {
      json j{{"format", "dflash.eval.v1"}, {"version", version_string()}, {"target", cfg.summary()},
             {"drafter", drafter_dir}, {"device", dev.str()}, {"tp", tp}, {"block_size", block_size},
             {"max_new_tokens", max_new}, {"tau", tau}, {"steps", steps}, {"histogram", hist},
             {"tau_estimate_same_blocks", est_steps.accept_len()}, {"tau_estimate_all_positions", est_all.accept_len()},
             {"greedy_tok_s", tps_g}, {"speculative_tok_s", tps_s}, {"speedup", tps_s / tps_g},
             {"time_s", {{"greedy_prefill", g.prefill}, {"greedy_decode", g.decode}, {"spec_prefill", s.prefill},
                         {"propose", s.propose}, {"verify", s.verify}, {"commit", s.commit}}},
             {"mismatches", mismatches}, {"prompts", json::array()}};
      j["stop_tokens"] = stop_tokens;
      if (text) j["tokenizer"] = text->path();
      for (const PromptReport& r : reports) {
        json pj{{"kind", r.kind}, {"prompt_len", r.prompt_len}, {"generated", r.generated}, {"accept", r.accept},
                {"tau", mean(r.accept)}, {"estimate_same_blocks", r.est_steps.accept_len()},
                {"estimate_all_positions", r.est_all.accept_len()}, {"mismatch_at", r.mismatch_at}, {"output_ids", r.tokens}};
        if (text) {
          pj["prompt_text"] = text->decode(r.prompt);
          pj["output_text"] = text->decode(r.tokens);
        }
        j["prompts"].push_back(std::move(pj));
      }
      io::write_file_atomic(json_path, j.dump(2) + "\n");
    }
    if (!html_path.empty()) {
      std::vector<bench::ShownOutput> shown;
      for (size_t i = 0; i < reports.size(); ++i)
        shown.push_back({i, reports[i].kind, reports[i].prompt, reports[i].tokens, reports[i].accept});
      const std::string title = fmt::format("dflash_eval: {} prompt(s), tau {:.3f}, drafter {}", reports.size(), tau, drafter_dir);
      io::write_file_atomic(html_path, bench::html_report(*text, shown, title));
      std::printf("wrote %s\n", html_path.c_str());
    }
    if (mismatches) {
      for (size_t i = 0; i < reports.size(); ++i)
        if (reports[i].mismatch_at >= 0)
          std::fprintf(stderr, "dflash_eval: prompt %zu: speculative decoding gave token %d at new position %lld where the "
                               "target's greedy decoding gave %d\n",
                       i, reports[i].got, static_cast<long long>(reports[i].mismatch_at), reports[i].want);
      std::fprintf(stderr, "dflash_eval: FAILED: %lld of %zu prompt(s) differ from target-only greedy decoding\n",
                   static_cast<long long>(mismatches), reports.size());
      return 3;
    }
    std::printf("outputs: all %zu prompt(s) equal target-only greedy decoding, token for token\n", reports.size());
    return 0;
  });
}
