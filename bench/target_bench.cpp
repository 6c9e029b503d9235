// target_bench: the single-GPU isolation benchmark of the target forward (decoder stack, no LM
// head) at 2048 / 4096 / 8192 tokens, on the fast path and on the explicit fallback.
//
//   target_bench --config configs/qwen3.6-27b/config.json --random-weights --csv results.csv
//
// Per length: load time, weight and peak activation memory, ms p50/p20/p80, tok/s, achieved
// TFLOP/s and MFU (FLOPs counted from the config), and which path each layer used. A "fast" run in
// which any layer would fall back is refused; `--path both` times the same model on both paths.
//
// --profile: after the timing, per length and path, a few forwards with the model's op profiler
// attached (two CUDA events around every op on the model's stream; the first forward is discarded)
// and a table per op category: calls, ms per forward, share of the plain forward, µs per call; for
// the GEMMs also M, N, K, TFLOP/s and the same GEMM (gemm_bf16, same shape and strides) timed alone
// in the same run, with the ratio in-forward / alone (issue 4: within 5%). Rows go to the CSV too.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <map>
#include <memory>
#include <random>

#include "bench/harness.h"
#include "bench/profile.h"
#include "bench/report.h"
#include "comm/comm.h"
#include "core/app.h"
#include "kernels/cuda/gemm.h"
#include "core/device.h"
#include "core/log.h"
#include "core/random.h"
#include "target_model/cli.h"
#include "target_model/flops.h"
#include "target_model/model_cuda.h"
#include "target_model/runtime.h"
#include "target_model/tp.h"

using namespace dflash;
using namespace dflash::target;

namespace {

double forward_flops(const TargetConfig& c, int64_t T, int64_t seqs) {
  return target::forward_flops(c, std::vector<int64_t>(static_cast<size_t>(seqs), T));
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    const std::string tok = s.substr(pos, end - pos);
    char* e = nullptr;
    const long long x = std::strtoll(tok.c_str(), &e, 10);
    DFLASH_REQUIRE_HINT(e && *e == '\0' && x > 0, "--seq: '" << tok << "' is not a positive token count", "e.g. --seq 2048,4096,8192");
    v.push_back(x);
    pos = end + 1;
  }
  return v;
}

// The GEMM `g` through the forward's launcher (cuda::gemm_bf16, same shape and row strides) on
// fresh random operands of the forward's scales, alone: warm-up, 3 rounds of 10 calls. µs per call.
// An FP8 GEMM (g.fp8) is cuda::gemm_fp8 on those operands quantized (block scales, 1 x 128 groups).
bench::Stats time_gemm_alone(const GemmShape& g, Device dev, void* stream) {
  Tensor x = Tensor::empty({g.M, g.ldx}, DType::BF16, dev), w = Tensor::empty({g.N, g.K}, DType::BF16, dev);
  Tensor y = Tensor::empty({g.M, g.ldy}, DType::BF16, dev);
  fill_normal(x, {4321, 1, 0}, 0.0f, 1.0f);
  fill_normal(w, {4321, 2, 0}, 0.0f, 1.0f / std::sqrt(static_cast<float>(g.K)));
  const cuda::GemmParams p{x.raw_data(), g.ldx, w.raw_data(), y.raw_data(), g.ldy, g.M, g.N, g.K, false};
  Tensor xq, xs, wq, ws;
  cuda::GemmFp8Params f;
  if (g.fp8) {
    xq = Tensor::empty({g.M, g.K}, DType::F8E4M3, dev);
    xs = Tensor::empty({static_cast<int64_t>(cuda::fp8_act_scale_elems(g.M, g.K))}, DType::F32, dev);
    wq = Tensor::empty({g.N, g.K}, DType::F8E4M3, dev);
    ws = Tensor::empty({(g.N + 127) / 128, cuda::fp8_weight_scale_ld(g.K)}, DType::F32, dev);
    cuda::Fp8ActQuantParams qp;
    qp.x = x.raw_data();
    qp.ldx = g.ldx;
    qp.q = static_cast<uint8_t*>(xq.raw_data());
    qp.ldq = g.K;
    qp.scale = xs.data<float>();
    qp.M = g.M;
    qp.K = g.K;
    cuda::quantize_fp8_act(qp, stream);
    cuda::quantize_fp8_weight(w.raw_data(), g.N, g.K, static_cast<uint8_t*>(wq.raw_data()), ws.data<float>(),
                              cuda::fp8_weight_scale_ld(g.K), stream);
    f.x = static_cast<const uint8_t*>(xq.raw_data());
    f.ldx = g.K;
    f.x_scale = xs.data<float>();
    f.w = static_cast<const uint8_t*>(wq.raw_data());
    f.w_scale = ws.data<float>();
    f.y = y.raw_data();
    f.ldy = g.ldy;
    f.M = g.M;
    f.N = g.N;
    f.K = g.K;
  }
  std::vector<double> us, medians;
  for (int r = 0; r < 3; ++r) {
    std::vector<double> ms = bench::time_cuda(stream, r == 0 ? 3 : 1, 10, [&] {
      if (g.fp8) cuda::gemm_fp8(f, dev.index);
      else cuda::gemm_bf16(p, dev.index);
    });
    for (double& t : ms) t *= 1e3;
    us.insert(us.end(), ms.begin(), ms.end());
    std::sort(ms.begin(), ms.end());
    medians.push_back(ms[ms.size() / 2]);
  }
  return bench::summarize(us, medians, 0.05);
}

// `forwards` forwards of `b` with an op profiler attached; the first (which creates the profiler's
// events) is dropped. Then every GEMM shape seen is timed alone. `plain_ms`: the unprofiled p50.
bench::ProfileSummary profile_forward(CudaTargetModel& model, const CudaBatch& b, int forwards, double plain_ms,
                                      void* stream) {
  OpProfiler profiler;
  std::vector<OpProfile> kept;
  {
    struct Attached {  // detached also when a forward throws
      CudaTargetModel& m;
      ~Attached() { m.set_profiler(nullptr); }
    } attached{model};
    model.set_profiler(&profiler);
    for (int i = 0; i < forwards; ++i) {
      model.forward(b, {});
      OpProfile p = profiler.collect();
      if (i > 0) kept.push_back(std::move(p));
    }
  }
  bench::ProfileSummary s = bench::summarize_profile(kept, plain_ms);
  for (bench::OpSummary& o : s.ops)
    if (o.is_gemm()) o.isolated_us = time_gemm_alone(o.gemm, model.device(), stream);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Single-GPU isolation benchmark of the target forward (decoder stack) on the fast path and the fallback."};
  app.name("target_bench");
  std::string log_level = "info", seq_s = "2048,4096,8192", path = "both", csv;
  TargetOptions target;
  int64_t batch = 1;
  int warmup = 2, iters = 5, rounds = 2, fallback_iters = 2;
  add_common_options(app, &log_level);
  add_target_options(app, target, {.model = "Hugging Face model directory",
                                    .config = "config.json (with --random-weights)",
                                    .random = "seeded random bf16 weights drawn on the GPU",
                                    .seed = "weights, tokens and round-order seed"});
  app.add_option("--seq", seq_s, "tokens per sequence, comma separated")->capture_default_str();
  app.add_option("--batch", batch, "sequences per forward")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--path", path, "fast, fallback or both")->check(CLI::IsMember({"fast", "fallback", "both"}))->capture_default_str();
  app.add_option("--warmup", warmup, "untimed forwards before each measurement")->capture_default_str();
  app.add_option("--iters", iters, "timed forwards per round (fast path)")->capture_default_str();
  app.add_option("--fallback-iters", fallback_iters, "timed forwards per round on the fallback")->capture_default_str();
  app.add_option("--rounds", rounds, "rounds; path order shuffled per round")->capture_default_str();
  app.add_option("--csv", csv, "append CSV rows to this file");
  int tp = 1;
  app.add_option("--tp", tp, "tensor-parallel size: run under mpirun -n <tp>, one GPU per rank")
      ->capture_default_str()->check(CLI::PositiveNumber);
  bool autotune = false;
  app.add_flag("--gemm-autotune", autotune, "time cuBLASLt's top 16 algorithms per GEMM shape on first use and keep the fastest");
  std::string json_path, baseline;
  app.add_option("--json", json_path, "also write this run's rows as JSON");
  app.add_option("--baseline", baseline, "an earlier CSV: print now/baseline per row and the geomean per group");
  bool profile = false;
  int profile_forwards = 3;
  app.add_flag("--profile", profile,
               "after the timing: per-op profile of each timed path and length (CUDA events around every op), "
               "with each GEMM also timed alone");
  app.add_option("--profile-forwards", profile_forwards, "profiled forwards per length and path; the first is discarded")
      ->capture_default_str()->check(CLI::Range(2, 1000));

  // MPI outlives run_app: a rank that fails prints its message before MPI_Finalize, which waits for
  // every rank, so no rank's exit can make mpirun kill another before it has printed.
  std::unique_ptr<comm::MpiEnv> mpi;
  return run_app(app, argc, argv, [&]() -> int {
    if (tp > 1 || env_rank() >= 0) mpi = std::make_unique<comm::MpiEnv>(&argc, &argv);
    const int rank = mpi ? mpi->rank() : 0, world = mpi ? mpi->size() : 1;
    const bool lead = rank == 0;  // rank 0 prints and writes the CSV; every rank runs the same forward
    auto say = [&](const char* fmt, auto... args) {
      if (lead) std::printf(fmt, args...);
    };
    init_logging(rank, log_level);
    const comm::Layout layout = comm::make_layout(world, rank, tp);
    DFLASH_REQUIRE_HINT(world == tp, "target_bench runs one TP group: start it with mpirun -n " << tp << " (got " << world << " ranks)",
                      "use mpirun -n <tp> target_bench --tp <tp>");
    DFLASH_REQUIRE_HINT(!target.src.model_dir.empty() || target.src.random_weights, "no weights given", "pass --model DIR or --config FILE --random-weights");
    DFLASH_REQUIRE_HINT(cuda_device_count() > 0, "target_bench needs a CUDA GPU and none is visible",
                      "run it on the GPU machine; check nvidia-smi / CUDA_VISIBLE_DEVICES");
    const Device dev = world > 1 ? mpi->bind_device() : Device::cuda(0);
    const int di = dev.index;
    if (autotune) cuda::set_gemm_autotune(true);
    const DeviceInfo info = cuda_device_info(di);
    const std::vector<int64_t> seqs = parse_list(seq_s);
    TargetConfig cfg = target.src.read_config();
    check_tp(cfg, tp);
    const TargetConfig local = local_config(cfg, tp);
    say("target_bench on %d x %s (sm %d.%d, %d SMs), %s\n  %s\n", tp, info.name.c_str(), info.major, info.minor,
        info.sm_count, version_string().c_str(), cfg.summary().c_str());

    TargetSource source = target.source();
    source.precision = resolve_precision(source.precision, cfg);
    const Precision precision = source.precision;
    const bool fp8 = precision == Precision::Fp8;
    FastPathPlan fast = make_plan(local, dev, {}, info.major, precision);
    FastPathPlan slow = make_plan(local, dev, KernelPolicies::all(KernelPolicy::Fallback),
                                  info.major, precision);
    say("  fast path plan (per rank): %s\n", fast.summary().c_str());
    if (path != "fallback") fast.require_all_fast();  // never time a "fast" run that falls back

    std::unique_ptr<comm::Communicator> group;
    if (tp > 1) group = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, layout.tp_group, rank, dev, 600.0, "tp");
    auto t0 = std::chrono::steady_clock::now();
    const TpShard shard{layout.tp_rank, tp};
    TargetWeights w = load_target_shard(source, cfg, dev, shard);
    const size_t weight_bytes = w.bytes();
    const int64_t fp8_projections = w.fp8_projections();
    CudaTargetModel model(local, std::move(w), fast, group.get());
    DeviceContext::get(di).synchronize();
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    say("  weights: %.2f GiB per GPU (%s, %lld FP8 projections), loaded in %.1f s\n", static_cast<double>(weight_bytes) / (1 << 30),
        precision_name(precision), static_cast<long long>(fp8_projections), load_s);
    void* stream = DeviceContext::get(di).stream();
    auto out = std::make_unique<bench::CsvWriter>(lead ? csv : std::string(), info.name);
    constexpr double kPeakBf16 = 989e12;  // H100/H200 SXM dense bf16 datasheet peak; MFU is against it
    constexpr double kPeakFp8 = 1979e12;  // and dense FP8 (an FP8 forward also reports MFU against this)

    say("\n%-8s %-9s %10s %10s %10s %11s %10s %9s %7s %10s %s\n", "tokens", "path", "ms p50", "p20", "p80", "tok/s",
        "tok/s/GPU", "TFLOP/s", "MFU", "act GiB", "noisy");
    std::mt19937_64 order_rng(target.src.seed);
    std::string profiles;  // --profile tables, printed after the timing table
    for (int64_t T : seqs) {
      std::vector<std::vector<int32_t>> tokens(static_cast<size_t>(batch));
      std::mt19937 tok_rng(static_cast<uint32_t>(target.src.seed + static_cast<uint64_t>(T)));
      for (auto& s : tokens) {
        s.resize(static_cast<size_t>(T));
        for (auto& id : s) id = static_cast<int32_t>(tok_rng() % static_cast<uint32_t>(cfg.vocab_size));
      }
      CudaBatch b = model.make_batch(tokens);
      std::vector<std::string> paths;
      if (path != "fallback") paths.push_back("fast");
      if (path != "fast") paths.push_back("fallback");
      std::map<std::string, std::vector<double>> samples, medians;
      std::map<std::string, double> act_gib;
      for (int r = 0; r < rounds; ++r) {
        std::shuffle(paths.begin(), paths.end(), order_rng);
        for (const std::string& p : paths) {
          model.set_plan(p == "fast" ? fast : slow);
          model.counters().reset();
          DeviceContext::get(di).synchronize();
          device_alloc::reset_peak(di);
          const int n = p == "fast" ? iters : fallback_iters;
          std::vector<double> ms = bench::time_cuda(stream, r == 0 ? warmup : 0, n, [&] { model.forward(b, {}); });
          const uint64_t forwards = static_cast<uint64_t>(n + (r == 0 ? warmup : 0));
          auto mm = model.counters().mismatches(model.plan(), forwards);
          DFLASH_CHECK(mm.empty(), "kernel counters disagree with the " << p << " plan: " << mm.front());
          act_gib[p] = static_cast<double>(device_alloc::stats(di).peak_allocated - weight_bytes) / (1 << 30);
          samples[p].insert(samples[p].end(), ms.begin(), ms.end());
          std::vector<double> sorted = ms;
          std::sort(sorted.begin(), sorted.end());
          medians[p].push_back(sorted[sorted.size() / 2]);
        }
      }
      const double flops = forward_flops(cfg, T, batch);
      const std::string shape = cfg.model_type + " L" + std::to_string(cfg.num_hidden_layers) + " H" +
                                std::to_string(cfg.hidden_size) + " T" + std::to_string(T) + " B" + std::to_string(batch) +
                                (cuda::gemm_autotune() ? " gemm-autotune" : "") + (tp > 1 ? " TP" + std::to_string(tp) : "") +
                                (fp8 ? " fp8" : "") + (source.fp8_experts ? " fp8x" : "");
      std::map<std::string, double> p50;
      for (const std::string& p : {std::string("fast"), std::string("fallback")}) {
        if (!samples.count(p)) continue;
        bench::Stats s = bench::summarize(samples[p], medians[p], 0.05);
        p50[p] = s.p50;
        const double tokens_n = static_cast<double>(T * batch);
        // Per GPU: the group's tokens over its GPUs, and each GPU's share of the FLOPs.
        const double tps = tokens_n / (s.p50 / 1e3), tflops = flops / tp / (s.p50 / 1e3) / 1e12;
        say("%-8lld %-9s %10.2f %10.2f %10.2f %11.0f %10.0f %9.1f %6.1f%% %10.2f %s\n", static_cast<long long>(T * batch),
            p.c_str(), s.p50, s.p20, s.p80, tps, tps / tp, tflops, 100.0 * tflops * 1e12 / kPeakBf16, act_gib[p],
            s.noisy ? "NOISY" : "");
        if (fp8) say("%-8s %-9s MFU against the dense FP8 peak (1979 TFLOP/s): %.1f%%\n", "", "", 100.0 * tflops * 1e12 / kPeakFp8);
        if (out) {
          auto row = [&](const std::string& metric, const std::string& unit, double a, double b2, double c2) {
            out->write({"target_bench", "forward", "dflash", p, metric, unit, shape, a, b2, c2, s.noisy});
          };
          row("time", "ms", s.p50, s.p20, s.p80);
          row("throughput", "tok/s", tokens_n / (s.p50 / 1e3), tokens_n / (s.p80 / 1e3), tokens_n / (s.p20 / 1e3));
          row("throughput_per_gpu", "tok/s", tps / tp, tokens_n / tp / (s.p80 / 1e3), tokens_n / tp / (s.p20 / 1e3));
          row("achieved_per_gpu", "TFLOP/s", tflops, flops / tp / (s.p80 / 1e3) / 1e12, flops / tp / (s.p20 / 1e3) / 1e12);
          row("mfu", "%", 100.0 * tflops * 1e12 / kPeakBf16, 0, 0);
          if (fp8) row("mfu_fp8_peak", "%", 100.0 * tflops * 1e12 / kPeakFp8, 0, 0);
          row("activation_memory", "GiB", act_gib[p], act_gib[p], act_gib[p]);
        }
      }
      if (p50.count("fast") && p50.count("fallback"))
        say("%-8s fast path speed-up over the fallback: %.1fx\n", "", p50["fallback"] / p50["fast"]);
      if (profile)
        for (const auto& [p, plain_ms] : p50) {
          model.set_plan(p == "fast" ? fast : slow);
          const bench::ProfileSummary ps = profile_forward(model, b, profile_forwards, plain_ms, stream);
          char title[200];
          std::snprintf(title, sizeof title, "\n== profile: %s path, %lld tokens, mean of %d forwards (1 more discarded)\n",
                        p.c_str(), static_cast<long long>(T * batch), ps.forwards);
          profiles += title + bench::profile_table(ps);
          for (const bench::Row& row : bench::profile_rows(ps, p, shape)) out->write(row);
        }
    }
    if (!profiles.empty())
      say("%s\nshare: of the plain forward's p50; alone: the same gemm_bf16 / gemm_fp8 call (shape, strides) timed by itself in "
          "this run; ratio: p50 per call in the forward / alone (SLOW above %.2f); excess: calls x (mean - alone)\n",
          profiles.c_str(), bench::kGemmSlowRatio);
    if (lead && !csv.empty()) std::printf("\nCSV rows appended to %s\n", out->path().c_str());
    if (lead) out->finish(json_path, baseline);
    return 0;
  });
}
