// dflash_doctor: the fast-path diagnostics report.
//
//   dflash_doctor --config configs/qwen3.6-27b/config.json      (random weights of those shapes)
//   dflash_doctor --model /models/Qwen3.6-27B --json doctor.json
//
// 1. Environment: GPU, compute capability, SMs, memory, driver/runtime, cuBLASLt, NCCL, MPI, build.
// 2. The per-layer plan (which kernel runs each step and why) with a one-line summary.
//    An MoE target: its weights per rank under each tensor x expert parallel layout (tp.h).
// 3. A live check on the GPU: one layer of each kind on the fast path and on the fallback with the
//    same input; outputs compared and both timed, so the report shows the fast path is right and faster.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>

#include "dflash/version.h"
#include "core/app.h"
#include "core/device.h"
#include "core/log.h"
#include "core/random.h"
#include "comm/comm.h"
#include "bench/roofline.h"
#include "drafter/config.h"
#include "target_model/fast_path.h"
#include "target_model/tp.h"
#include "target_model/weights.h"
#if DFLASH_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda/check.h"
#include "drafter/decode_cuda.h"
#include "core/cuda/env.h"
#include "bench/harness.h"
#include "target_model/model_cuda.h"
#endif

using namespace dflash;
using namespace dflash::target;
using nlohmann::json;

namespace {

json environment(int device) {
  json env;
  env["dflash"] = version_string();
  env["build"] = {{"commit", kGitCommit}, {"cuda_backend", kBuiltWithCuda}, {"cuda_archs", kCudaArchs},
#ifdef NDEBUG
                  {"assertions", false},
#else
                  {"assertions", true},
#endif
#if defined(__clang__)
                  {"compiler", "clang " __clang_version__}};
#else
                  {"compiler", "GCC " __VERSION__}};
#endif
  char mpi[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0;
  MPI_Get_library_version(mpi, &len);
  std::string mpi_s(mpi, static_cast<size_t>(std::max(0, len)));
  if (auto nl = mpi_s.find_first_of("\r\n,"); nl != std::string::npos) mpi_s.resize(nl);
  env["mpi"] = mpi_s;
  env["gpu_count"] = cuda_device_count();
#if DFLASH_WITH_CUDA
  auto v = cuda::library_versions();
  // No NVIDIA driver (a machine without a GPU): cudaDriverGetVersion reports 0.
  env["cuda_driver"] = v.driver > 0 ? cuda::version_str(v.driver) : std::string("none (no NVIDIA driver on this machine)");
  env["cuda_runtime"] = cuda::version_str(v.runtime);
  env["cublaslt"] = std::to_string(v.cublaslt / 10000) + "." + std::to_string((v.cublaslt / 100) % 100) + "." +
                    std::to_string(v.cublaslt % 100);
  env["nccl"] = std::to_string(v.nccl / 10000) + "." + std::to_string((v.nccl / 100) % 100) + "." + std::to_string(v.nccl % 100);
  if (device >= 0) {
    DeviceInfo info = cuda_device_info(device);
    env["gpu"] = {{"index", device}, {"name", info.name}, {"compute_capability", std::to_string(info.major) + "." + std::to_string(info.minor)},
                  {"sms", info.sm_count}, {"memory_gib", static_cast<double>(info.total_memory) / (1 << 30)}};
  }
#else
  (void)device;
#endif
  return env;
}

void print_environment(const json& env) {
  std::cout << "== environment\n";
  std::cout << "  " << env["dflash"].get<std::string>() << ", compiled by " << env["build"]["compiler"].get<std::string>() << "\n";
  std::cout << "  MPI: " << env["mpi"].get<std::string>() << "\n";
  if (env.contains("cuda_runtime"))
    std::cout << "  CUDA driver " << env["cuda_driver"].get<std::string>() << "; this build's CUDA runtime "
              << env["cuda_runtime"].get<std::string>() << ", cuBLASLt " << env["cublaslt"].get<std::string>() << ", NCCL "
              << env["nccl"].get<std::string>() << "\n";
  if (env.contains("gpu")) {
    const json& g = env["gpu"];
    std::cout << "  GPU " << g["index"] << ": " << g["name"].get<std::string>() << ", sm " << g["compute_capability"].get<std::string>()
              << ", " << g["sms"] << " SMs, " << g["memory_gib"].get<double>() << " GiB\n";
  } else {
    std::cout << "  GPU: none visible (" << env["gpu_count"] << " CUDA devices"
              << (kBuiltWithCuda ? "" : "; this build has no CUDA backend") << ")\n";
  }
}

#if DFLASH_WITH_CUDA
// Median of `reps` timed runs of f (after one warm-up), in ms, with CUDA events on the device stream.
template <typename F>
double time_ms(void* stream, int reps, F&& f) {
  auto s = static_cast<cudaStream_t>(stream);
  f();
  cudaEvent_t a, b;
  DFLASH_CUDA_CHECK(cudaEventCreate(&a));
  DFLASH_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    DFLASH_CUDA_CHECK(cudaEventRecord(a, s));
    f();
    DFLASH_CUDA_CHECK(cudaEventRecord(b, s));
    DFLASH_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// max |a - b| / max |b| over (out - in) deltas, in double on the host; +inf on NaN.
double delta_rel_err(const Tensor& out_a, const Tensor& out_b, const Tensor& in) {
  Tensor a = out_a.to(Device::cpu()).to_dtype(DType::F64), b = out_b.to(Device::cpu()).to_dtype(DType::F64);
  Tensor x = in.to(Device::cpu()).to_dtype(DType::F64);
  double md = 0, mr = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double da = a.data<double>()[i] - x.data<double>()[i], db = b.data<double>()[i] - x.data<double>()[i];
    if (std::isnan(da) || std::isnan(db)) return INFINITY;
    md = std::max(md, std::abs(da - db));
    mr = std::max(mr, std::abs(db));
  }
  return md / std::max(mr, 1e-30);
}

// NCCL all-reduce bus bandwidth over all ranks (nccl-tests' definition: 2(n-1)/n · bytes / time).
json nccl_bandwidth(Device dev, int rank, int world) {
  comm::Communicator group(MPI_COMM_WORLD, 0, rank, dev, 120.0, "world");
  void* stream = DeviceContext::get(dev.index).stream();
  json out;
  out["message"] = "NCCL_* settings from the environment; NCCL_NVLS_ENABLE=" +
                   std::string(std::getenv("NCCL_NVLS_ENABLE") ? std::getenv("NCCL_NVLS_ENABLE") : "(unset)");
  for (int64_t mib : {8, 64, 256, 1024}) {
    Tensor t = Tensor::empty({mib << 19}, DType::BF16, dev);  // mib MiB of bf16
    fill_normal(t, {1, 99, 0}, 0.0f, 1.0f);
    const double ms = time_ms(stream, 10, [&] { group.all_reduce_sum(t); });
    const double bytes = static_cast<double>(t.nbytes());
    out["sizes"].push_back({{"mib", static_cast<double>(mib)}, {"ms", ms},
                            {"busbw_gbs", 2.0 * (world - 1) / world * bytes / (ms / 1e3) / 1e9}});
  }
  return out;
}

json live_check(const TargetConfig& cfg, int device, const KernelPolicies& pol, int sm_major, int64_t tokens, uint64_t seed,
                Precision precision) {
  // A two-layer model with the target's shapes (one layer of each kind), random bf16 weights.
  TargetConfig mini = cfg;
  mini.num_hidden_layers = 2;
  mini.layer_types = {LayerType::LinearAttention, LayerType::FullAttention};
  const Device dev = Device::cuda(device);
  const KernelPolicies fallback = KernelPolicies::all(KernelPolicy::Fallback);
  FastPathPlan fast_plan =
      make_plan(mini, dev, KernelPolicies{pol.conv, pol.delta_rule, pol.attention}, sm_major, precision);
  FastPathPlan slow_plan = make_plan(mini, dev, fallback, sm_major, precision);
  CudaTargetModel model(mini, random_weights(mini, seed, DType::BF16, dev, precision), fast_plan);
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>(i % cfg.vocab_size);
  CudaBatch batch = model.make_batch({ids});
  Tensor h = Tensor::empty({tokens, cfg.hidden_size}, DType::BF16, dev);
  fill_normal(h, {seed, 777, 0}, 0.0f, 1.0f);
  void* stream = DeviceContext::get(device).stream();
  json out = json::array();
  for (int64_t layer : {int64_t{0}, int64_t{1}}) {
    Tensor hf = h.clone(), hs = h.clone(), scratch = h.clone();
    model.run_layer(layer, hf, batch, fast_plan.layers[static_cast<size_t>(layer)]);
    model.run_layer(layer, hs, batch, slow_plan.layers[static_cast<size_t>(layer)]);
    const double err = delta_rel_err(hf, hs, h);
    const double fast_ms = time_ms(stream, 5, [&] { model.run_layer(layer, scratch, batch, fast_plan.layers[static_cast<size_t>(layer)]); });
    const double slow_ms = time_ms(stream, 3, [&] { model.run_layer(layer, scratch, batch, slow_plan.layers[static_cast<size_t>(layer)]); });
    json r{{"layer_type", layer_type_name(mini.layer_types[static_cast<size_t>(layer)])},
           {"tokens", tokens},
           {"fast_kernels", json::array()},
           {"fallback_kernels", json::array()},
           {"max_rel_err_fast_vs_fallback", err},
           {"fast_ms", fast_ms},
           {"fallback_ms", slow_ms},
           {"speedup", slow_ms / fast_ms},
           {"outputs_match", err <= 2e-2}};
    for (const StepPlan& s : fast_plan.layers[static_cast<size_t>(layer)].steps) r["fast_kernels"].push_back(s.kernel);
    for (const StepPlan& s : slow_plan.layers[static_cast<size_t>(layer)].steps) r["fallback_kernels"].push_back(s.kernel);
    out.push_back(r);
  }
  return out;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fast-path diagnostics: environment, per-layer kernel plan, and a live fast-vs-fallback check on the GPU."};
  app.name("dflash_doctor");
  std::string log_level = "warn", model_dir, config_path, json_path, device_s, conv = "auto", dr = "auto", attn = "auto";
  bool require_fast = false, no_live = false;
  int64_t tokens = 4096, roof_context = 4096, roof_block = 16;
  uint64_t seed = 0;
  add_common_options(app, &log_level);
  auto* m = app.add_option("--model", model_dir, "Hugging Face model directory (its config.json is read)");
  auto* c = app.add_option("--config", config_path, "a config.json (random weights of its shapes)");
  m->excludes(c);
  app.add_option("--device", device_s, "cuda:N or cpu (default: cuda:0 when a GPU is visible, else cpu)");
  app.add_option("--conv", conv, "kernel policy for the GatedDeltaNet conv")->check(CLI::IsMember({"auto", "fast", "fallback"}))->capture_default_str();
  app.add_option("--delta-rule", dr, "kernel policy for the delta rule")->check(CLI::IsMember({"auto", "fast", "fallback"}))->capture_default_str();
  app.add_option("--attention", attn, "kernel policy for attention")->check(CLI::IsMember({"auto", "fast", "fallback"}))->capture_default_str();
  app.add_flag("--require-fast-path", require_fast, "fail when any layer would fall back");
  std::string precision_s = "auto";
  app.add_option("--precision", precision_s, kPrecisionHelp)->capture_default_str();
  app.add_option("--tokens", tokens, "tokens of the live check")->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_flag("--no-live", no_live, "skip the live GPU check");
  app.add_option("--roofline-context", roof_context, "context of the roofline's decode / verify / propose steps")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{1} << 24));
  app.add_option("--roofline-block", roof_block, "tokens of the roofline's verify step (and the drafter's block)")
      ->capture_default_str()->check(CLI::Range(int64_t{2}, int64_t{64}));
  app.add_option("--seed", seed, "seed of the live check's random weights and input")->capture_default_str();
  app.add_option("--json", json_path, "also write the report as JSON");

  // MPI outlives run_app: a rank that fails prints its message before MPI_Finalize, which waits for
  // every rank, so no rank's exit can make mpirun kill another before it has printed.
  std::unique_ptr<comm::MpiEnv> mpi;
  return run_app(app, argc, argv, [&]() -> int {
    // Under mpirun: every rank takes its GPU and joins the NCCL bandwidth check; rank 0 reports.
    if (env_rank() >= 0) mpi = std::make_unique<comm::MpiEnv>(&argc, &argv);
    const int world = mpi ? mpi->size() : 1, rank = mpi ? mpi->rank() : 0;
    init_logging(rank, log_level);
    DFLASH_REQUIRE_HINT(!model_dir.empty() || !config_path.empty(), "no model given", "pass --model DIR or --config config.json");
    TargetConfig cfg = TargetConfig::from_file(model_dir.empty() ? config_path : model_dir);
    const int gpus = cuda_device_count();
    Device dev = device_s.empty() ? (gpus > 0 ? Device::cuda(0) : Device::cpu()) : Device::parse(device_s);
    if (world > 1 && gpus > 0) dev = mpi->bind_device();
#if DFLASH_WITH_CUDA
    json nccl;
    if (world > 1 && dev.is_cuda()) nccl = nccl_bandwidth(dev, rank, world);
#endif
    if (rank != 0) return 0;
    check_device_visible(dev);
    KernelPolicies pol{parse_policy(conv, "--conv"), parse_policy(dr, "--delta-rule"), parse_policy(attn, "--attention"), false};
    json report;
    report["environment"] = environment(dev.is_cuda() ? dev.index : -1);
    report["model"] = {{"source", model_dir.empty() ? config_path : model_dir}, {"summary", cfg.summary()}};
    print_environment(report["environment"]);
    std::cout << "\n== model\n  " << cfg.summary() << "\n";
    if (const std::string note = cfg.state_dtype_note(); !note.empty()) std::cout << "  note: " << note << "\n";
    if (cfg.is_moe()) {
      // Per-rank weights of the layouts of target_model/tp.h (parallel.tp, parallel.ep): bf16 bytes.
      std::cout << "\n== MoE layouts: bf16 weights per rank (parallel.tp x parallel.ep; ep expert groups of tp / ep "
                   "ranks,\n   each rank holding num_experts / ep experts of moe_intermediate_size / (tp / ep); one "
                   "all-reduce of N x hidden per block)\n";
      std::printf("  %4s %4s %8s %8s %16s %16s\n", "tp", "ep", "experts", "width", "experts GiB", "all weights GiB");
      json layouts = json::array();
      for (int tp : {1, 2, 4, 8})
        for (int ep = 1; ep <= tp; ep *= 2) {
          TargetConfig l;
          try {
            l = local_config(cfg, tp, ep);
          } catch (const Error&) {
            continue;  // this tp / ep does not divide the model
          }
          const double experts = static_cast<double>(l.num_hidden_layers) * l.expert_bytes_per_layer(2.0);
          const double all = 2.0 * static_cast<double>(l.parameter_count());
          std::printf("  %4d %4d %8lld %8lld %16.2f %16.2f\n", tp, ep, static_cast<long long>(l.local_num_experts()),
                      static_cast<long long>(l.moe_intermediate_size), experts / (1 << 30), all / (1 << 30));
          layouts.push_back({{"tp", tp}, {"ep", ep}, {"experts_per_rank", l.local_num_experts()},
                             {"expert_width", l.moe_intermediate_size}, {"expert_bytes_per_rank", experts},
                             {"weight_bytes_per_rank", all}});
        }
      report["moe_layouts"] = layouts;
    }
    if (dev.is_cpu())
      std::cout << "\n  " << (gpus == 0 ? "No CUDA device is visible: showing" : "--device cpu: showing")
                << " the plan of the CPU reference backend. It is the f32 reference\n  (plain, obviously right code "
                   "for every op): it has no fast path and no fallback, so\n  --require-fast-path and "
                   "kernels.require_fast_path do not apply to it (both refuse it).\n";
    int sm_major = 0;
    if (dev.is_cuda()) sm_major = cuda_device_info(dev.index).major;
    const Precision precision = resolve_precision(parse_precision(precision_s, "--precision"), cfg);
    report["model"]["precision"] = precision_name(precision);
    if (cfg.is_moe() && cfg.fp8) {
      report["model"]["fp8_checkpoint_dequantized"] = true;
      std::cout << "\n  An FP8 Mixture-of-Experts checkpoint: its e4m3 experts, shared experts and projections are\n"
                   "  dequantized at load (exact values) and the target runs in bf16; --precision fp8 runs the W8A8\n"
                   "  block FP8 MoE on the CPU reference only (the GPU's FP8 MoE kernels are not built).\n";
    }
    FastPathPlan plan = make_plan(cfg, dev, pol, sm_major, precision);
    report["plan"] = plan.to_json();
    std::cout << "\n== fast-path plan (" << plan.device << ")\n" << plan.table() << "\n  " << plan.summary() << "\n";
    for (const std::string& f : plan.fallbacks()) std::cout << "  FALLBACK " << f << "\n";
    {
      // The decode plan (decode / verify steps on slot states): its kernels' summary and whether its
      // steps replay CUDA graphs (dflash_eval / generate_bench --no-cuda-graphs turn them off).
      const FastPathPlan dp = make_decode_plan(cfg, dev, pol, sm_major, precision);
      report["decode_plan"] = {{"summary", dp.summary()}, {"cuda_graphs", dp.cuda_graphs}, {"fallbacks", dp.fallbacks()}};
      std::cout << "  decode plan: " << dp.summary() << (dp.cuda_graphs ? "" : " (eager launches: no CUDA device)") << "\n";
      // The CUDA proposer's propose steps (drafter/decode_cuda.h): a graph per (slots, block) shape
      // unless DFLASH_PROPOSE_GRAPHS=0 (or dflash_eval --no-cuda-graphs).
      bool pgraphs = false;
#if DFLASH_WITH_CUDA
      pgraphs = dev.is_cuda() && drafter::cuda_proposer_graphs();
#endif
      report["decode_plan"]["propose_cuda_graphs"] = pgraphs;
      std::cout << "  propose steps: "
                << (pgraphs ? "CUDA graphs per (slots, block) shape"
                            : dev.is_cuda() ? "eager launches (DFLASH_PROPOSE_GRAPHS=0)" : "eager launches: no CUDA device")
                << "\n";
    }
    {
      // The memory roofline (bench/roofline.h), the same bytes and bandwidth as dflash_eval and generate_bench.
      bench::Roofline roof;
#if DFLASH_WITH_CUDA
      if (dev.is_cuda()) roof.copy_gbs = bench::copy_bandwidth_gbs(dev.index);
#endif
      const drafter::DrafterConfig dc = drafter::DrafterConfig::for_target(cfg, 5, 0, roof_block);
      const double ctx = static_cast<double>(roof_context);
      json rj{{"copy_gbs", roof.copy_gbs}, {"copy_method", bench::kCopyMethod}, {"context", roof_context},
              {"block", roof_block}, {"precision", precision_name(precision)}, {"steps", json::object()}};
      std::cout << "\n== memory roofline (bench/roofline.h): bytes a step moves / the copy bandwidth";
      if (roof.copy_gbs > 0) std::printf(" %.0f GB/s (%s)", roof.copy_gbs, bench::kCopyMethod);
      std::cout << "; context " << roof_context << ", " << precision_name(precision) << "\n";
      for (const auto& [what, b] : {std::pair{"decode", bench::target_step_bytes(cfg, precision, 1, 1, ctx)},
                                    std::pair{"verify", bench::target_step_bytes(cfg, precision, 1, roof_block, ctx)},
                                    std::pair{"propose", bench::propose_bytes(dc, 1, ctx)}}) {
        std::printf("  %-7s %s", what, bench::describe(b).c_str());
        if (roof.copy_gbs > 0) std::printf(" -> %.2f ms", roof.ms(b));
        std::printf("%s\n", std::string(what) == "propose" ? " (a 5-layer drafter)" : "");
        rj["steps"][what] = {{"weights_bytes", b.weights}, {"state_bytes", b.state}, {"kv_bytes", b.kv},
                             {"total_bytes", b.total()}, {"roofline_ms", roof.ms(b)}};
      }
      report["roofline"] = rj;
    }
    int rc = 0;
#if DFLASH_WITH_CUDA
    if (dev.is_cuda() && !no_live) {
      std::cout << "\n== live check on " << dev.str() << ": one layer of each kind, " << tokens
                << " tokens, fast path vs fallback, same input (random weights of the model's shapes)\n";
      json live = live_check(cfg, dev.index, pol, sm_major, tokens, seed, precision);
      report["live"] = live;
      for (const json& r : live) {
        std::printf("  %-16s fast %8.3f ms  fallback %9.3f ms  speed-up %6.1fx  max rel err %.2e  %s\n",
                    r["layer_type"].get<std::string>().c_str(), r["fast_ms"].get<double>(), r["fallback_ms"].get<double>(),
                    r["speedup"].get<double>(), r["max_rel_err_fast_vs_fallback"].get<double>(),
                    r["outputs_match"].get<bool>() ? "outputs match" : "OUTPUTS DIFFER");
        if (!r["outputs_match"].get<bool>()) rc = 2;
      }
    }
#endif
#if DFLASH_WITH_CUDA
    if (!nccl.is_null()) {
      report["nccl_allreduce"] = nccl;
      std::printf("\n== NCCL all-reduce over %d ranks (%s)\n", world, nccl["message"].get<std::string>().c_str());
      for (const json& r : nccl["sizes"])
        std::printf("  %8.1f MiB bf16: %8.3f ms, bus bandwidth %7.1f GB/s\n", r["mib"].get<double>(), r["ms"].get<double>(),
                    r["busbw_gbs"].get<double>());
    }
#endif
    if (!json_path.empty()) {
      std::ofstream out(json_path);
      DFLASH_CHECK_IO(out.good(), "writing", json_path);
      out << report.dump(2) << "\n";
    }
    std::cout << "\nsummary: " << plan.summary() << "\n";
    if (require_fast) {
      DFLASH_REQUIRE_HINT(!dev.is_cpu(),
                        "--require-fast-path: the plan is for the CPU reference backend ("
                            << (gpus == 0 ? "no CUDA device is visible" : "--device cpu")
                            << "), which has no fast path to require",
                        "run dflash_doctor where the GPUs are (or pass --device cuda:N)");
      plan.require_all_fast();
    }
    return rc;
  });
}
