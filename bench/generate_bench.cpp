// generate_bench: the target's batched generation throughput (the engine of dflash_data
// regenerate, target_model/generate.h) over the number of sequences in flight, on one GPU with
// random weights: per point, `slots` prompts of --prompt-len random tokens prefilled in packed
// batches, then --max-new-tokens decode steps of every sequence. A decode step reads every weight
// once whatever the batch; the GDN states (read and written, fp32) and the KV cache grow with it —
// the table states each point's bytes per step against the copy bandwidth of the run.
//
//   generate_bench --config configs/qwen3.6-27b/config.json --slots 1,8,32,64,128 --csv gen.csv
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "bench/harness.h"
#include "bench/report.h"
#include "dflash/version.h"
#include "core/app.h"
#include "core/device.h"
#include "core/log.h"
#include "core/rng.h"
#include "target_model/generate.h"
#include "target_model/runtime.h"

using namespace dflash;

int main(int argc, char** argv) {
  CLI::App app{"Batched generation throughput of the target (random weights) over the sequences in flight."};
  app.name("generate_bench");
  std::string log_level = "warn", config_path = "configs/qwen3.6-27b/config.json", device = "cuda", csv_path;
  std::vector<int64_t> slot_counts{1, 8, 32, 64, 128};
  int64_t prompt_len = 512, max_new = 512, waves = 1;
  uint64_t seed = 0;
  add_common_options(app, &log_level);
  app.add_option("--config", config_path, "the target's config.json (random weights)")->capture_default_str();
  app.add_option("--seed", seed, "seed of the random weights and prompts")->capture_default_str();
  app.add_option("--slots", slot_counts, "sequences in flight, one point each")->delimiter(',')->capture_default_str();
  app.add_option("--prompt-len", prompt_len, "tokens per prompt")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--max-new-tokens", max_new, "new tokens per sequence")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--waves", waves, "prompts per point = waves x slots")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--device", device, "cuda[:N]")->capture_default_str();
  app.add_option("--csv", csv_path, "append the rows to this CSV");
  std::string precision_s = "auto";
  app.add_option("--precision", precision_s, target::kPrecisionHelp)->capture_default_str();
  return run_app(app, argc, argv, [&]() -> int {
    init_logging(-1, log_level);
    const Device dev = Device::parse(device);
    DFLASH_REQUIRE_HINT(!dev.is_cpu(), "generate_bench measures a GPU", "pass --device cuda");
    const target::TargetSource src{"", config_path, true, seed, target::parse_precision(precision_s, "--precision")};
    const target::TargetConfig cfg = src.read_config();
    const auto t0 = std::chrono::steady_clock::now();
    target::TargetRuntime rt(src, cfg, dev, 1, 0, nullptr, false);
    std::printf("== generate_bench: %s\n", version_string().c_str());
    std::printf("target %s, random weights, loaded in %.1f s\nkernels %s\n", cfg.summary().c_str(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), rt.plans().c_str());
    const double copy = bench::copy_bandwidth_gbs(dev.index);
    const double wbytes = rt.decode_weight_bytes();
    // Per sequence per decode step: GDN recurrent state read + written (fp32), conv state read +
    // written (bf16), the KV cache read at the mean context (bf16).
    int64_t gdn = 0, attn = 0;
    for (target::LayerType t : cfg.layer_types) (t == target::LayerType::LinearAttention ? gdn : attn) += 1;
    const double state = 2.0 * static_cast<double>(gdn) *
                         (4.0 * static_cast<double>(cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim) +
                          2.0 * static_cast<double>((cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim()));
    const double ctx = static_cast<double>(prompt_len) + 0.5 * static_cast<double>(max_new);
    const double kv = static_cast<double>(attn) * ctx * 2.0 * static_cast<double>(cfg.num_key_value_heads * cfg.head_dim) * 2.0;
    std::printf("copy bandwidth %.0f GB/s; a decode step reads %.2f GB of weights + %.1f MB of state and KV per sequence "
                "(context %.0f)\n\n",
                copy, wbytes / 1e9, (state + kv) / 1e6, ctx);
    std::printf("%6s %8s %10s %10s %9s %11s %11s %9s %9s %7s  %s\n", "slots", "prompts", "prefill_s", "decode_s", "ms/step",
                "decode_t/s", "total_t/s", "GB/step", "roof_ms", "% roof", "bound");
    bench::CsvWriter csv(csv_path, cuda_device_info(dev.index).name);
    for (int64_t S : slot_counts) {
      DFLASH_REQUIRE_HINT(S >= 1, "--slots " << S << " must be >= 1", "sequences in flight per point");
      std::vector<target::GenRequest> reqs;
      for (int64_t i = 0; i < S * waves; ++i) {
        target::GenRequest r;
        r.id = static_cast<uint64_t>(i);
        for (int64_t t = 0; t < prompt_len; ++t)
          r.prompt.push_back(static_cast<int32_t>(rng::bits(seed + 1, static_cast<uint64_t>(i), static_cast<uint64_t>(t)) %
                                                  static_cast<uint64_t>(cfg.vocab_size)));
        reqs.push_back(std::move(r));
      }
      target::GenerateConfig gc;
      gc.max_new_tokens = max_new;
      const std::unique_ptr<target::Decoder> dec = rt.make_decoder(S, prompt_len + max_new);
      {  // warm-up: one short generation (allocations, cuBLAS heuristics)
        target::GenerateConfig w = gc;
        w.max_new_tokens = 4;
        target::generate_batch(*dec, {reqs.begin(), reqs.begin() + std::min<int64_t>(S, 2)}, w, [](target::GenResult&&) {});
      }
      const target::GenStats st = target::generate_batch(*dec, reqs, gc, [](target::GenResult&&) {});
      const double step_ms = 1e3 * st.decode_s / static_cast<double>(std::max<int64_t>(st.decode_steps, 1));
      const double occ = st.occupancy();
      const double bytes = wbytes + occ * (state + kv);
      const double roof_ms = copy > 0 ? 1e3 * bytes / (copy * 1e9) : 0;
      const double decode_tps = static_cast<double>(st.decode_rows) / st.decode_s;
      const double total_tps = static_cast<double>(st.generated) / st.seconds();
      const char* bound = wbytes > occ * (state + kv) ? "weights" : "state+KV";
      std::printf("%6lld %8lld %10.2f %10.2f %9.2f %11.0f %11.0f %9.2f %9.2f %6.1f%%  %s\n", static_cast<long long>(S),
                  static_cast<long long>(reqs.size()), st.prefill_s, st.decode_s, step_ms, decode_tps, total_tps, bytes / 1e9,
                  roof_ms, roof_ms > 0 ? 100.0 * roof_ms / step_ms : 0.0, bound);
      const std::string shape = "slots=" + std::to_string(S) + ",prompt=" + std::to_string(prompt_len) +
                                ",new=" + std::to_string(max_new) + ",prompts=" + std::to_string(reqs.size()) +
                                (rt.weights().fp8_projections() > 0 ? ",fp8" : "");
      auto row = [&](const std::string& metric, const std::string& unit, double v) {
        csv.write({"generate_bench", "generate_batch", "cuda", "greedy", metric, unit, shape, v, v, v, false});
      };
      row("generated_tok_s", "tok/s", total_tps);
      row("decode_tok_s", "tok/s", decode_tps);
      row("decode_step_ms", "ms", step_ms);
      row("decode_step_roofline_ms", "ms", roof_ms);
      row("prefill_tok_s", "tok/s", static_cast<double>(st.prompt_tokens) / st.prefill_s);
    }
    return 0;
  });
}
