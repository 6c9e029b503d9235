// dflash_features: runs the frozen target on token ids and saves the captured hidden states.
//
//   dflash_features --model DIR --tokens 1,2,3 --tokens 4,5 --layers 1,5,9 --out features.safetensors
//   dflash_features --config configs/tiny/config.json --random-weights --tokens-file ids.txt --layers all
//
// Output (safetensors): hidden.<id> f32|bf16 [N, H] per captured layer id (output of decoder layer
// id, transformers' hidden_states[id + 1]), final_norm [N, H] with --final-norm, input_ids i32 [N],
// offsets i64 [S + 1]; metadata: layer_ids, source, commit.
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

#include "dflash/version.h"
#include "kernels/app.h"
#include "kernels/log.h"
#include "target_model/model.h"
#include "target_model/safetensors.h"

using namespace dflash;
using namespace dflash::target;

namespace {

std::vector<int32_t> parse_ids(const std::string& text, const std::string& where) {
  std::vector<int32_t> ids;
  std::string tok;
  std::istringstream in(text);
  auto flush = [&] {
    if (tok.empty()) return;
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(tok.c_str(), &end, 10);
    DFLASH_CHECK_HINT(end && *end == '\0' && errno == 0 && v >= 0 && v <= INT32_MAX,
                      where << ": '" << tok << "' is not a token id", "token ids are non-negative integers separated by commas or spaces");
    ids.push_back(static_cast<int32_t>(v));
    tok.clear();
  };
  for (char ch; in.get(ch);) {
    if (ch == ',' || std::isspace(static_cast<unsigned char>(ch))) flush();
    else tok.push_back(ch);
  }
  flush();
  return ids;
}

std::vector<int64_t> parse_layers(const std::string& spec, int64_t n_layers) {
  std::vector<int64_t> ids;
  if (spec == "all") {
    for (int64_t i = 0; i < n_layers; ++i) ids.push_back(i);
    return ids;
  }
  for (int32_t v : parse_ids(spec, "--layers")) ids.push_back(v);
  DFLASH_CHECK_HINT(!ids.empty(), "--layers '" << spec << "' names no layer", "give ids like 1,16,31 or 'all'");
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Run the target model on token ids and save the captured hidden states (safetensors)."};
  app.name("dflash_features");
  std::string log_level = "info", model_dir, config_path, out_path = "features.safetensors", layers = "all";
  std::string tokens_file, out_dtype = "f32", delta_rule = "chunked", device = "cpu";
  std::vector<std::string> token_lists;
  bool random_weights = false, final_norm = false;
  uint64_t seed = 0;
  add_common_options(app, &log_level);
  auto* model_opt = app.add_option("--model", model_dir, "Hugging Face model directory (config.json + safetensors)");
  auto* config_opt = app.add_option("--config", config_path, "config.json (with --random-weights)");
  model_opt->excludes(config_opt);
  app.add_flag("--random-weights", random_weights, "seeded random weights instead of a checkpoint")->needs(config_opt);
  app.add_option("--seed", seed, "seed for --random-weights")->capture_default_str();
  app.add_option("--tokens", token_lists, "one sequence of token ids, comma separated (repeatable)");
  app.add_option("--tokens-file", tokens_file, "file with one sequence of token ids per line");
  app.add_option("--layers", layers, "decoder layer ids to capture, e.g. 1,16,31, or 'all'")->capture_default_str();
  app.add_flag("--final-norm", final_norm, "also save the output of the final norm");
  app.add_option("--out", out_path, "output safetensors file")->capture_default_str();
  app.add_option("--dtype", out_dtype, "dtype of the saved states")->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
  app.add_option("--delta-rule", delta_rule, "GatedDeltaNet algorithm of the CPU reference")
      ->check(CLI::IsMember({"chunked", "recurrent"}))->capture_default_str();
  app.add_option("--device", device, "where the target runs")->capture_default_str();

  return run_app(app, argc, argv, [&]() -> int {
    init_logging(-1, log_level);
    DFLASH_CHECK_HINT(!model_dir.empty() || random_weights, "no weights given",
                      "pass --model DIR, or --config FILE --random-weights");
    DFLASH_CHECK_HINT(Device::parse(device).is_cpu(), "--device " << device << ": the CUDA target forward is not built yet",
                      "use --device cpu");
    std::vector<std::vector<int32_t>> seqs;
    for (size_t i = 0; i < token_lists.size(); ++i) seqs.push_back(parse_ids(token_lists[i], "--tokens #" + std::to_string(i + 1)));
    if (!tokens_file.empty()) {
      std::ifstream in(tokens_file);
      DFLASH_CHECK_IO(in.good(), "opening token file", tokens_file);
      std::string line;
      for (int ln = 1; std::getline(in, line); ++ln) {
        auto ids = parse_ids(line, tokens_file + ":" + std::to_string(ln));
        if (!ids.empty()) seqs.push_back(std::move(ids));
      }
    }
    DFLASH_CHECK_HINT(!seqs.empty(), "no token sequences given", "pass --tokens 1,2,3 or --tokens-file FILE");
    for (size_t i = 0; i < seqs.size(); ++i)
      DFLASH_CHECK(!seqs[i].empty(), "sequence " << i + 1 << " has no token ids");

    auto t0 = std::chrono::steady_clock::now();
    std::vector<int64_t> opt_layers;
    TargetConfig cfg = TargetConfig::from_file(random_weights ? config_path : model_dir);
    spdlog::info("target {}", cfg.summary());
    opt_layers = parse_layers(layers, cfg.num_hidden_layers);
    for (int64_t id : opt_layers)
      DFLASH_CHECK_HINT(id >= 0 && id < cfg.num_hidden_layers, "--layers: capture layer id " << id << " is out of range",
                        "layer ids are 0.." << cfg.num_hidden_layers - 1 << " (id i = output of decoder layer i)");
    // The CPU reference holds f32 weights: refuse up front what this machine cannot hold.
    const double need = static_cast<double>(cfg.parameter_count()) * 4.0;
    const double have = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
    DFLASH_CHECK_HINT(need < 0.8 * have, "the CPU reference needs " << need / 1e9 << " GB for the f32 weights of this "
                                         << cfg.summary() << ", but this machine has " << have / 1e9 << " GB",
                      "the CPU reference is for small models; run big targets on the GPU");
    TargetWeights w = random_weights ? dflash::target::random_weights(cfg, seed, DType::F32, Device::cpu())
                                     : load_weights(cfg, model_dir, DType::F32, Device::cpu());
    TargetModel model(cfg, std::move(w));
    auto t1 = std::chrono::steady_clock::now();
    ForwardOptions opt;
    opt.capture = opt_layers;
    opt.final_norm = final_norm;
    opt.delta_rule = delta_rule == "chunked" ? ops::DeltaRuleAlgo::Chunked : ops::DeltaRuleAlgo::Recurrent;
    ForwardResult r = model.forward(seqs, opt);
    auto t2 = std::chrono::steady_clock::now();
    const double load_s = std::chrono::duration<double>(t1 - t0).count();
    const double fwd_s = std::chrono::duration<double>(t2 - t1).count();
    const int64_t N = r.offsets.back();
    spdlog::info("{} sequences, {} tokens: load {:.2f} s, forward {:.3f} s ({:.0f} tok/s on the CPU reference, "
                 "GatedDeltaNet {})", seqs.size(), N, load_s, fwd_s, static_cast<double>(N) / fwd_s, delta_rule);

    const DType dt = out_dtype == "bf16" ? DType::BF16 : DType::F32;
    std::vector<std::pair<std::string, Tensor>> tensors;
    std::string ids_meta;
    for (const auto& [id, t] : r.layers) {
      tensors.emplace_back("hidden." + std::to_string(id), t.to_dtype(dt));
      ids_meta += (ids_meta.empty() ? "" : ",") + std::to_string(id);
      double ss = 0;
      for (int64_t i = 0; i < t.numel(); ++i) ss += static_cast<double>(t.data<float>()[i]) * t.data<float>()[i];
      spdlog::info("  layer {:3d} ({:16s}) rms {:.4f}", id, layer_type_name(cfg.layer_types[static_cast<size_t>(id)]),
                   std::sqrt(ss / static_cast<double>(t.numel())));
    }
    if (final_norm) tensors.emplace_back("final_norm", r.final_hidden.to_dtype(dt));
    std::vector<int32_t> flat;
    for (const auto& s : seqs) flat.insert(flat.end(), s.begin(), s.end());
    tensors.emplace_back("input_ids", Tensor::from_blob(flat.data(), {N}, DType::I32));
    tensors.emplace_back("offsets", Tensor::from_blob(r.offsets.data(), {static_cast<int64_t>(r.offsets.size())}, DType::I64));
    std::filesystem::path out(out_path);
    if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path());
    save_safetensors(out_path, tensors,
                     {{"layer_ids", ids_meta}, {"source", random_weights ? config_path + " (random, seed " + std::to_string(seed) + ")" : model_dir},
                      {"dflash_commit", kGitCommit}, {"format", "dflash.features.v1"}});
    spdlog::info("wrote {} ({} captured layers)", out_path, r.layers.size());
    return 0;
  });
}
