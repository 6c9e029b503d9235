// generate_bench: the target's batched generation throughput (the engine of dflash_data
// regenerate, target_model/generate.h) over the number of sequences in flight, on one GPU with
// random weights: per point, `slots` prompts of --prompt-len random tokens prefilled in packed
// batches, then --max-new-tokens decode steps of every sequence. A decode step reads every weight
// once whatever the batch; the GDN states (read and written, fp32) and the KV cache grow with it —
// the table states each point's bytes per step against the copy bandwidth of the run (bench/roofline.h).
// --step-tokens N > 0 runs chunked prefill inside the decode steps (generate.h): the prompts' pieces
// ride on the decode steps, N tokens per step; a list runs each point with each schedule. A mixed
// step also computes its prompt pieces, so its time is above the decode roofline by design; the
// figure that counts is generated_tok_s (the prefill included). --waves W runs W x slots prompts a
// point, so freed slots take new prompts; --min-new-tokens stops each sequence after its own length
// drawn from [min, max] (as responses end at their stop tokens), so sequences end and new prompts
// come in at different steps: the stream that continuous batching and chunked prefill are for.
//
//   generate_bench --config configs/qwen3.6-27b/config.json --slots 1,8,32,64,128 --step-tokens 0,160,512 --csv gen.csv
//   generate_bench --slots 64 --waves 4 --min-new-tokens 256 --max-new-tokens 768 --step-tokens 0,256,1024
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <numeric>

#include "bench/harness.h"
#include "bench/profile.h"
#include "bench/report.h"
#include "bench/roofline.h"
#include "dflash/version.h"
#include "core/app.h"
#include "core/device.h"
#include "core/log.h"
#include "core/rng.h"
#include "kernels/cuda/pdl.cuh"
#include "target_model/decode.h"
#include "target_model/generate.h"
#include "target_model/runtime.h"

using namespace dflash;

namespace {

// --profile: the op table of `steps` eager steps (one more first, discarded: it grows the event pool).
void print_profile(target::CudaTargetModel& model, const char* what, int64_t steps,
                   const std::function<void()>& step) {
  target::OpProfiler prof;
  std::vector<target::OpProfile> profiles;
  model.set_profiler(&prof);
  for (int64_t i = 0; i <= steps; ++i) {
    step();
    target::OpProfile op = prof.collect();
    if (i > 0) profiles.push_back(std::move(op));
  }
  model.set_profiler(nullptr);
  if (profiles.empty()) return;
  const bench::ProfileSummary ps = bench::summarize_profile(profiles, 0.0);
  std::printf("\n%6s where %s goes (%zu steps, ms per step):\n%s\n", "", what, profiles.size(), bench::profile_table(ps).c_str());
}

// Every slot refilled with its point's prompts, then the op profiles of a decode step of all S slots and,
// with T > S, of a mixed step: S - 1 decode rows and one prompt piece of T - S + 1 tokens in the last slot
// (the chunked-prefill step of generate.h, its pieces' rows on the decode path).
void profile_point(target::CudaTargetModel& model, target::Decoder& dec, const std::vector<target::GenRequest>& reqs,
                   int64_t S, int64_t T, int64_t steps) {
  target::ExtendOptions eo;
  eo.last_only = true;
  constexpr int64_t kSlotsPerPrefill = 16;
  std::vector<int32_t> next(static_cast<size_t>(S));
  for (int64_t s0 = 0; s0 < S; s0 += kSlotsPerPrefill) {
    std::vector<int32_t> slots;
    std::vector<std::vector<int32_t>> prompts;
    for (int64_t s = s0; s < std::min(S, s0 + kSlotsPerPrefill); ++s) {
      dec.reset(static_cast<int32_t>(s));
      slots.push_back(static_cast<int32_t>(s));
      prompts.push_back(reqs[static_cast<size_t>(s)].prompt);
    }
    const target::ExtendResult r = dec.extend(slots, prompts, eo);
    for (size_t j = 0; j < slots.size(); ++j) next[static_cast<size_t>(slots[j])] = r.next[j];
  }
  // One step: decode rows of slots [0, D) and, when given, a prompt piece in the last slot.
  const auto step = [&](int64_t D, std::vector<int32_t> piece) {
    std::vector<int32_t> rows(static_cast<size_t>(D));
    std::iota(rows.begin(), rows.end(), 0);
    std::vector<std::vector<int32_t>> toks;
    for (int64_t s = 0; s < D; ++s) toks.push_back({next[static_cast<size_t>(s)]});
    if (!piece.empty()) {
      rows.push_back(static_cast<int32_t>(S - 1));
      toks.push_back(std::move(piece));
    }
    const target::ExtendResult r = dec.extend(rows, toks, eo);
    for (int64_t s = 0; s < D; ++s) next[static_cast<size_t>(s)] = r.next[static_cast<size_t>(s)];
  };
  print_profile(model, ("a decode step of " + std::to_string(S) + " sequences").c_str(), steps, [&] { step(S, {}); });
  const int64_t piece = T - (S - 1);
  if (T <= 0 || S < 2 || piece <= target::kMaxVerifyTokens) return;
  // The last slot takes a prompt in pieces, its context growing piece by piece; when the next piece would not
  // fit the slot, the slot starts over (the steps' contexts then average over 0 .. max_len).
  if (piece > dec.max_len()) {
    std::printf("%6s no mixed-step profile: a %lld-token piece does not fit the %lld-token slot\n", "",
                static_cast<long long>(piece), static_cast<long long>(dec.max_len()));
    return;
  }
  const int32_t last = static_cast<int32_t>(S - 1);
  const std::vector<int32_t>& src = reqs[static_cast<size_t>(last)].prompt;
  int64_t at = 0;
  dec.reset(last);
  print_profile(model,
                ("a mixed step (" + std::to_string(S - 1) + " decode rows + a " + std::to_string(piece) + "-token piece)").c_str(),
                steps, [&] {
                  if (dec.length(last) + piece > dec.max_len()) dec.reset(last);
                  std::vector<int32_t> p;
                  for (int64_t i = 0; i < piece; ++i, ++at) p.push_back(src[static_cast<size_t>(at % static_cast<int64_t>(src.size()))]);
                  step(S - 1, std::move(p));
                });
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Batched generation throughput of the target (random weights) over the sequences in flight."};
  app.name("generate_bench");
  std::string log_level = "warn", config_path = "configs/qwen3.6-27b/config.json", device = "cuda", csv_path;
  std::vector<int64_t> slot_counts{1, 8, 32, 64, 128};
  std::vector<int64_t> step_tokens{0};
  int64_t prompt_len = 512, max_new = 512, min_new = 0, waves = 1;
  uint64_t seed = 0;
  add_common_options(app, &log_level);
  app.add_option("--config", config_path, "the target's config.json (random weights)")->capture_default_str();
  app.add_option("--seed", seed, "seed of the random weights and prompts")->capture_default_str();
  app.add_option("--slots", slot_counts, "sequences in flight, one point each")->delimiter(',')->capture_default_str();
  app.add_option("--prompt-len", prompt_len, "tokens per prompt")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--max-new-tokens", max_new, "new tokens per sequence")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--step-tokens", step_tokens, "tokens per step with chunked prefill inside the decode steps (0: prompts "
                                              "prefilled in their own extends); a list runs every point with each")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--waves", waves, "prompts per point = waves x slots")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--min-new-tokens", min_new,
                 "each sequence stops after a length drawn uniformly from [this, --max-new-tokens] (as responses that end "
                 "at their own stop token; 0: every one at --max-new-tokens)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--device", device, "cuda[:N]")->capture_default_str();
  app.add_option("--csv", csv_path, "append the rows to this CSV");
  std::string precision_s = "auto";
  app.add_option("--precision", precision_s, target::kPrecisionHelp)->capture_default_str();
  bool fp8_experts = false;
  app.add_flag("--fp8-experts", fp8_experts, "MoE targets: the routed experts stored in FP8 (as dflash_eval); CSV shapes say 'fp8x'");
  bool no_graphs = false;
  app.add_flag("--no-cuda-graphs", no_graphs, "launch every decode step's kernels eagerly instead of replaying CUDA "
                                             "graphs (to compare; CSV rows get ',eager')");
  int64_t profile_steps = 0;
  app.add_option("--profile", profile_steps,
                 "after each point, time every op of this many steps (eager, one discarded first): a decode step of "
                 "every slot and, with --step-tokens N > slots, a mixed step of slots - 1 decode rows and one "
                 "(N - slots + 1)-token prompt piece")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  std::string variant = "fused";
  app.add_option("--decode-variant", variant,
                 std::string("a variant of the decode plan's fused kernels for every point (as dflash_eval --decode-variants: ") +
                     bench::kDecodeVariantNames + "); CSV rows get ',<variant>' unless fused")
      ->capture_default_str();
  return run_app(app, argc, argv, [&]() -> int {
    init_logging(-1, log_level);
    const Device dev = Device::parse(device);
    DFLASH_REQUIRE_HINT(!dev.is_cpu(), "generate_bench measures a GPU", "pass --device cuda");
    DFLASH_REQUIRE_HINT(min_new <= max_new, "--min-new-tokens " << min_new << " is above --max-new-tokens " << max_new,
                        "the lengths are drawn from [min, max]; 0 stops every sequence at --max-new-tokens");
    const bool spread = min_new > 0 && min_new < max_new;
    target::TargetSource src{"", config_path, true, seed, target::parse_precision(precision_s, "--precision")};
    src.fp8_experts = fp8_experts;
    const target::TargetConfig cfg = src.read_config();
    // The copy bandwidth before the weights are on the GPU (as dflash_eval and dflash_doctor measure it).
    const double copy = bench::copy_bandwidth_gbs(dev.index);
    const auto t0 = std::chrono::steady_clock::now();
    target::TargetRuntime rt(src, cfg, dev, 1, 0, nullptr, false);
    rt.set_cuda_graphs(!no_graphs);
    target::FastPathPlan plan = rt.decode_plan();  // the decoders' plan, with --decode-variant applied
    bench::apply_decode_variant(variant, plan.fusion, "--decode-variant");
    std::printf("== generate_bench: %s\n", version_string().c_str());
    if (variant != "fused")
      std::printf("decode variant %s: fused kernels %s, PDL %s\n", variant.c_str(),
                  plan.fusion.any() ? plan.fusion.str().c_str() : "none", cuda::pdl_enabled() ? "on" : "off");
    std::printf("target %s, random weights, loaded in %.1f s\nkernels %s\n", cfg.summary().c_str(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), rt.plans().c_str());
    // The roofline (bench/roofline.h): a decode step's bytes at the mean context of the decode steps.
    const target::Precision prec = rt.weights().precision();
    const double mean_new = spread ? 0.5 * static_cast<double>(min_new + max_new) : static_cast<double>(max_new);
    const double ctx = static_cast<double>(prompt_len) + 0.5 * mean_new;
    const bench::Roofline roof{copy};
    // Mean sequences in flight `occ` (fractional): the bytes between those of floor(occ) and ceil(occ) sequences.
    auto step_bytes = [&](double occ) {
      const int64_t lo = std::max<int64_t>(1, static_cast<int64_t>(occ));
      const bench::StepBytes a = bench::target_step_bytes(rt.local_config(), prec, lo, 1, ctx, fp8_experts);
      const bench::StepBytes b = bench::target_step_bytes(rt.local_config(), prec, lo + 1, 1, ctx, fp8_experts);
      const double f = std::max(0.0, occ - static_cast<double>(lo));
      return bench::StepBytes{a.weights + f * (b.weights - a.weights), a.state + f * (b.state - a.state), a.kv + f * (b.kv - a.kv)};
    };
    const bench::StepBytes one = step_bytes(1);
    std::printf("copy bandwidth %.0f GB/s (%s); a decode step of one sequence moves %s (context %.0f; roofline.h)\n\n",
                copy, bench::kCopyMethod, bench::describe(one).c_str(), ctx);
    std::printf("%6s %6s %8s %10s %10s %9s %11s %11s %9s %9s %7s  %s\n", "slots", "step_t", "prompts", "prefill_s", "decode_s",
                "ms/step", "decode_t/s", "total_t/s", "GB/step", "roof_ms", "% roof", "bound");
    bench::CsvWriter csv(csv_path, cuda_device_info(dev.index).name);
    for (int64_t T : step_tokens)
      DFLASH_REQUIRE_HINT(T >= 0, "--step-tokens " << T << " must be >= 0", "0: separate prefills; N: tokens per mixed step");
    for (int64_t S : slot_counts) {
      for (int64_t T : step_tokens) {
        DFLASH_REQUIRE_HINT(S >= 1, "--slots " << S << " must be >= 1", "sequences in flight per point");
        std::vector<target::GenRequest> reqs;
        for (int64_t i = 0; i < S * waves; ++i) {
          target::GenRequest r;
          r.id = static_cast<uint64_t>(i);
          for (int64_t t = 0; t < prompt_len; ++t)
            r.prompt.push_back(static_cast<int32_t>(rng::bits(seed + 1, static_cast<uint64_t>(i), static_cast<uint64_t>(t)) %
                                                    static_cast<uint64_t>(cfg.vocab_size)));
          if (spread)  // the same lengths at every point: a function of (seed, request)
            r.max_new_tokens = min_new + static_cast<int64_t>(rng::bits(seed + 2, static_cast<uint64_t>(i), 0) %
                                                              static_cast<uint64_t>(max_new - min_new + 1));
          reqs.push_back(std::move(r));
        }
        target::GenerateConfig gc;
        gc.max_new_tokens = max_new;
        gc.step_tokens = T;
        const std::unique_ptr<target::Decoder> dec = target::make_cuda_decoder(*rt.cuda_model(), S, prompt_len + max_new, plan);
        {  // warm-up: one short generation (allocations, cuBLAS heuristics)
          target::GenerateConfig w = gc;
          w.max_new_tokens = 4;
          std::vector<target::GenRequest> few(reqs.begin(), reqs.begin() + std::min<int64_t>(S, 2));
          for (target::GenRequest& r : few) r.max_new_tokens = 0;  // the warm-up's 4 tokens
          target::generate_batch(*dec, few, w, [](target::GenResult&&) {});
        }
        const target::GenStats st = target::generate_batch(*dec, reqs, gc, [](target::GenResult&&) {});
        const target::GraphStats gs = dec->graph_stats();
        const double step_ms = 1e3 * st.decode_s / static_cast<double>(std::max<int64_t>(st.decode_steps, 1));
        const double occ = st.occupancy();
        const bench::StepBytes sb = step_bytes(occ);
        const double bytes = sb.total(), roof_ms = roof.ms(sb);
        const double decode_tps = static_cast<double>(st.decode_rows) / st.decode_s;
        const double total_tps = static_cast<double>(st.generated) / st.seconds();
        const char* bound = sb.weights > sb.state + sb.kv ? "weights" : "state+KV";
        std::printf("%6lld %6lld %8lld %10.2f %10.2f %9.2f %11.0f %11.0f %9.2f %9.2f %6.1f%%  %s\n", static_cast<long long>(S),
                    static_cast<long long>(T), static_cast<long long>(reqs.size()), st.prefill_s, st.decode_s, step_ms,
                    decode_tps, total_tps, bytes / 1e9, roof_ms, roof_ms > 0 ? 100.0 * roof_ms / step_ms : 0.0, bound);
        if (!no_graphs)
          std::printf("%6s CUDA graphs: %llu shape(s) captured, %llu replay(s), %llu eager step(s), %llu capture(s) failed\n",
                      "", static_cast<unsigned long long>(gs.captures), static_cast<unsigned long long>(gs.replays),
                      static_cast<unsigned long long>(gs.eager), static_cast<unsigned long long>(gs.capture_failures));
        if (T > 0)
          std::printf("%6s chunked prefill: %lld of %lld decode steps carried %lld prompt tokens; %lld steps of pieces alone\n",
                      "", static_cast<long long>(st.mixed_steps), static_cast<long long>(st.decode_steps),
                      static_cast<long long>(st.mixed_prompt_tokens), static_cast<long long>(st.prefills));
        if (profile_steps > 0) profile_point(*rt.cuda_model(), *dec, reqs, S, T, profile_steps);
        const std::string shape = "slots=" + std::to_string(S) + ",prompt=" + std::to_string(prompt_len) +
                                  ",new=" + (spread ? std::to_string(min_new) + "-" : std::string()) + std::to_string(max_new) +
                                  ",prompts=" + std::to_string(reqs.size()) +
                                  (T > 0 ? ",step_tokens=" + std::to_string(T) : "") +
                                  (prec == target::Precision::Fp8 ? ",fp8" : "") + (fp8_experts ? ",fp8x" : "") +
                                  (no_graphs ? ",eager" : "") + (variant != "fused" ? "," + variant : "");
        auto row = [&](const std::string& metric, const std::string& unit, double v) {
          csv.write({"generate_bench", "generate_batch", "cuda", "greedy", metric, unit, shape, v, v, v, false});
        };
        row("generated_tok_s", "tok/s", total_tps);
        row("decode_tok_s", "tok/s", decode_tps);
        row("decode_step_ms", "ms", step_ms);
        row("decode_step_bytes", "GB", bytes / 1e9);
        row("decode_step_roofline_ms", "ms", roof_ms);
        row("decode_step_roofline_pct", "%", 100.0 * roof.share(sb, step_ms));
        row("d2d_bandwidth", "GB/s", copy);
        // Chunked prefill: the prompt tokens of the steps of pieces alone (the rest rode on decode steps).
        if (st.prefill_s > 0)
          row("prefill_tok_s", "tok/s", static_cast<double>(st.prompt_tokens - st.mixed_prompt_tokens) / st.prefill_s);
        if (T > 0)
          row("mixed_step_share", "%",
              100.0 * static_cast<double>(st.mixed_steps) / static_cast<double>(std::max<int64_t>(st.decode_steps, 1)));
      }
    }
    return 0;
  });
}
