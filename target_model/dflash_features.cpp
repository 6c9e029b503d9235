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
#include <thread>

#include <unistd.h>

#include "dflash/version.h"
#include "core/app.h"
#include "core/log.h"
#include <spdlog/fmt/fmt.h>
#include "target_model/cli.h"
#include "target_model/model.h"
#include "core/io/safetensors.h"
#include "target_model/runtime.h"
#include "target_model/tp.h"
#include "comm/comm.h"
#include "core/device.h"
#if DFLASH_WITH_CUDA
#include "target_model/model_cuda.h"
#endif

using namespace dflash;
using namespace dflash::target;

namespace {

std::vector<int64_t> parse_layers(const std::string& spec, int64_t n_layers) {
  std::vector<int64_t> ids;
  if (spec == "all") {
    for (int64_t i = 0; i < n_layers; ++i) ids.push_back(i);
    return ids;
  }
  for (int32_t v : parse_token_ids(spec, "--layers")) ids.push_back(v);
  DFLASH_REQUIRE_HINT(!ids.empty(), "--layers '" << spec << "' names no layer", "give ids like 1,16,31 or 'all'");
  return ids;
}

// Test hook for the failure-handling tests: DFLASH_FAULT_RANK=N makes rank N throw (or, with
// DFLASH_FAULT=hang, stop) after the model is built, while the others go on into the collectives.
void inject_fault(int rank) {
  const char* r = std::getenv("DFLASH_FAULT_RANK");
  if (r == nullptr || std::atoi(r) != rank) return;
  const char* kind = std::getenv("DFLASH_FAULT");
  if (kind != nullptr && std::string(kind) == "hang") {
    spdlog::warn("DFLASH_FAULT=hang: rank {} stops here", rank);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  DFLASH_FAIL("injected fault on rank " << rank << " (DFLASH_FAULT_RANK)");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Run the target model on token ids and save the captured hidden states (safetensors)."};
  app.name("dflash_features");
  std::string log_level = "info", out_path = "features.safetensors", layers = "all";
  std::string tokens_file, out_dtype = "f32", delta_rule = "chunked", device = "cpu";
  std::vector<std::string> token_lists;
  bool final_norm = false;
  TargetOptions target;
  add_common_options(app, &log_level);
  add_target_options(app, target, {.model = "Hugging Face model directory (config.json + safetensors)",
                                    .config = "config.json (with --random-weights)",
                                    .random = "seeded random weights instead of a checkpoint",
                                    .seed = "seed for --random-weights"});
  app.add_option("--tokens", token_lists, "one sequence of token ids, comma separated (repeatable)");
  app.add_option("--tokens-file", tokens_file, "file with one sequence of token ids per line");
  app.add_option("--layers", layers, "decoder layer ids to capture, e.g. 1,16,31, or 'all'")->capture_default_str();
  app.add_flag("--final-norm", final_norm, "also save the output of the final norm");
  app.add_option("--out", out_path, "output safetensors file")->capture_default_str();
  app.add_option("--dtype", out_dtype, "dtype of the saved states")->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
  app.add_option("--delta-rule", delta_rule, "GatedDeltaNet algorithm of the CPU reference")
      ->check(CLI::IsMember({"chunked", "recurrent"}))->capture_default_str();
  app.add_option("--device", device, "where the target runs: cpu or cuda[:N]")->capture_default_str();
  std::string conv_pol = "auto", dr_pol = "auto", attn_pol = "auto", plan_json;
  bool require_fast = false;
  app.add_option("--conv", conv_pol, "kernel policy of the GatedDeltaNet conv (GPU)")->check(CLI::IsMember({"auto", "fast", "fallback"}));
  app.add_option("--delta-rule-kernel", dr_pol, "kernel policy of the delta rule (GPU)")->check(CLI::IsMember({"auto", "fast", "fallback"}));
  app.add_option("--attention", attn_pol, "kernel policy of attention (GPU)")->check(CLI::IsMember({"auto", "fast", "fallback"}));
  app.add_flag("--require-fast-path", require_fast, "refuse to run when any layer would use a fallback kernel");
  app.add_option("--plan-json", plan_json, "write the fast-path plan and the kernel counters as JSON");
  int tp = 1;
  double timeout_s = 600;
  app.add_option("--tp", tp, "tensor-parallel size (run under mpirun with a multiple of tp ranks)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  int ep = 1;
  app.add_option("--ep", ep, "MoE targets: expert groups within a TP group (divides --tp and num_experts; each holds "
                             "num_experts / ep experts)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--timeout", timeout_s, "seconds a collective may take before the job is ended")->capture_default_str();

  // MPI outlives run_app: a rank that fails prints its message before MPI_Finalize, which waits for
  // every rank, so no rank's exit can make mpirun kill another before it has printed.
  std::unique_ptr<comm::MpiEnv> mpi;
  return run_app(app, argc, argv, [&]() -> int {
    // Under mpirun (or with --tp > 1) every rank runs this; the checks below fail identically on
    // every rank before any collective, so each rank prints the same one message and exits 1.
    if (tp > 1 || env_rank() >= 0) mpi = std::make_unique<comm::MpiEnv>(&argc, &argv);
    const int world = mpi ? mpi->size() : 1, rank = mpi ? mpi->rank() : 0;
    init_logging(rank, log_level);
    const comm::Layout layout = comm::make_layout(world, rank, tp);
    DFLASH_REQUIRE_HINT(!target.src.model_dir.empty() || target.src.random_weights, "no weights given",
                      "pass --model DIR, or --config FILE --random-weights");
    Device dev = Device::parse(device);
    if (dev.is_cuda() && world > 1 && device == "cuda") dev = mpi->bind_device();  // one GPU per rank
    check_device_visible(dev);
    std::vector<std::vector<int32_t>> seqs;
    for (size_t i = 0; i < token_lists.size(); ++i) seqs.push_back(parse_token_ids(token_lists[i], "--tokens #" + std::to_string(i + 1)));
    if (!tokens_file.empty()) {
      std::ifstream in(tokens_file);
      DFLASH_CHECK_IO(in.good(), "opening token file", tokens_file);
      std::string line;
      for (int ln = 1; std::getline(in, line); ++ln) {
        auto ids = parse_token_ids(line, tokens_file + ":" + std::to_string(ln));
        if (!ids.empty()) seqs.push_back(std::move(ids));
      }
    }
    DFLASH_REQUIRE_HINT(!seqs.empty(), "no token sequences given", "pass --tokens 1,2,3 or --tokens-file FILE");
    for (size_t i = 0; i < seqs.size(); ++i)
      DFLASH_REQUIRE(!seqs[i].empty(), "sequence " << i + 1 << " has no token ids");

    auto t0 = std::chrono::steady_clock::now();
    std::vector<int64_t> opt_layers;
    TargetConfig cfg = target.src.read_config();
    spdlog::info("target {}", cfg.summary());
    opt_layers = parse_layers(layers, cfg.num_hidden_layers);
    for (int64_t id : opt_layers)
      DFLASH_REQUIRE_HINT(id >= 0 && id < cfg.num_hidden_layers, "--layers: capture layer id " << id << " is out of range",
                        "layer ids are 0.." << cfg.num_hidden_layers - 1 << " (id i = output of decoder layer i)");
    check_tp(cfg, tp, ep);
    const TargetConfig local = local_config(cfg, tp, ep);  // == cfg when tp = 1
    const TpShard shard{layout.tp_rank, tp, ep};
    KernelPolicies pol{parse_policy(conv_pol, "--conv"), parse_policy(dr_pol, "--delta-rule-kernel"),
                       parse_policy(attn_pol, "--attention"), require_fast};
    const int sm = dev.is_cuda() ? cuda_device_info(dev.index).major : 0;
    const TargetSource source = target.source();
    FastPathPlan plan = make_plan(local, dev, pol, sm, resolve_precision(source.precision, cfg));
    // From here on ranks talk to each other: a rank that fails ends the whole job, so that the
    // others are not left waiting in a collective.
    std::unique_ptr<comm::Communicator> tp_comm;
    if (tp > 1) tp_comm = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, layout.tp_group, rank, dev, timeout_s, "tp");
    spdlog::info("fast path: {}", plan.summary());
    for (const std::string& f : plan.fallbacks()) spdlog::warn("fallback: {}", f);
    ForwardOptions opt;
    opt.capture = opt_layers;
    opt.final_norm = final_norm;
    opt.delta_rule = delta_rule == "chunked" ? ops::DeltaRuleAlgo::Chunked : ops::DeltaRuleAlgo::Recurrent;
    PathCounters cpu_counters;
    opt.counters = &cpu_counters;
    ForwardResult r;
    double load_s = 0, fwd_s = 0;
    std::string counters_str, expert_load;
    nlohmann::json counters_json;
    try {
      if (dev.is_cpu()) {
        check_cpu_reference_fits(local, cfg, "the CPU reference is for small models; run big targets on the GPU (--device cuda)");
        TargetWeights w = load_target_shard(source, cfg, dev, shard);
        TargetModel model(local, std::move(w), tp_comm.get());
        inject_fault(rank);
        auto t1 = std::chrono::steady_clock::now();
        load_s = std::chrono::duration<double>(t1 - t0).count();
        r = model.forward(seqs, opt);
        fwd_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
        counters_str = cpu_counters.str();
        counters_json = cpu_counters.to_json();
        if (cfg.is_moe()) {
          // Load balance over the expert groups: (token, expert) pairs each ran, all layers.
          const std::vector<int64_t>& load = model.expert_load();
          int64_t sum = 0, most = 0;
          for (int64_t v : load) sum += v, most = std::max(most, v);
          std::string per;
          for (int64_t v : load) per += (per.empty() ? "" : " ") + std::to_string(v);
          expert_load = fmt::format("token-expert pairs per expert group (ep {}): {} of {} (max / mean {:.2f})", ep, per,
                                    sum, sum > 0 ? static_cast<double>(most) * static_cast<double>(load.size()) / static_cast<double>(sum) : 0.0);
        }
      } else {
#if DFLASH_WITH_CUDA
        TargetWeights w = load_target_shard(source, cfg, dev, shard);
        CudaTargetModel model(local, std::move(w), plan, tp_comm.get());
        inject_fault(rank);
        CudaBatch batch = model.make_batch(seqs);
        DeviceContext::get(dev.index).synchronize();
        auto t1 = std::chrono::steady_clock::now();
        load_s = std::chrono::duration<double>(t1 - t0).count();
        r = model.forward(batch, opt);
        DeviceContext::get(dev.index).synchronize();
        fwd_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
        for (auto& [id, t] : r.layers) t = t.to(Device::cpu()).to_dtype(DType::F32);
        if (final_norm) r.final_hidden = r.final_hidden.to(Device::cpu()).to_dtype(DType::F32);
        counters_str = model.counters().str();
        counters_json = model.counters().to_json();
        auto mm = model.counters().mismatches(model.plan(), 1);
        DFLASH_CHECK(mm.empty(), "kernel counters disagree with the plan: " << mm.front());
#else
        DFLASH_REJECT_HINT("--device " << device << ": this build has no CUDA backend", "reconfigure with -DDFLASH_CUDA=ON");
#endif
      }
    } catch (const std::exception& e) {
      if (world > 1) comm::abort_job(e.what());
      throw;
    }
    const int64_t N = r.offsets.back();
    if (rank != 0) return 0;  // every rank of a TP group holds the same hidden states; rank 0 writes
    spdlog::info("{} sequences, {} tokens on {}: load {:.2f} s, forward {:.3f} s ({:.0f} tok/s, first call included)",
                 seqs.size(), N, dev.str(), load_s, fwd_s, static_cast<double>(N) / fwd_s);
    spdlog::info("kernels run: {}", counters_str);
    if (!expert_load.empty()) spdlog::info("{}", expert_load);
    if (!plan_json.empty()) {
      nlohmann::json pj{{"plan", plan.to_json()}, {"counters", counters_json}};
      std::ofstream pf(plan_json);
      DFLASH_CHECK_IO(pf.good(), "writing", plan_json);
      pf << pj.dump(2) << "\n";
    }

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
    const TargetSource& src = target.src;
    const std::string from =
        src.random_weights ? src.config_path + " (random, seed " + std::to_string(src.seed) + ")" : src.model_dir;
    io::save_safetensors(out_path, tensors,
                         {{"layer_ids", ids_meta}, {"source", from}, {"dflash_commit", kGitCommit},
                          {"format", "dflash.features.v1"}});
    spdlog::info("wrote {} ({} captured layers)", out_path, r.layers.size());
    return 0;
  });
}
