#include "trainer/train.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <sstream>

#include <spdlog/spdlog.h>

#include "comm/comm.h"
#include "data/loader.h"
#include "data/synth.h"
#include "kernels/app.h"
#include "drafter/loss.h"
#include "drafter/model.h"
#include "drafter/weights.h"
#include "kernels/log.h"
#include "target_model/model.h"
#include "target_model/tp.h"
#include "target_model/weights.h"
#include "trainer/optimizer.h"

namespace fs = std::filesystem;

namespace dflash::trainer {

namespace {

volatile std::sig_atomic_t g_stop_requested = 0;
extern "C" void on_stop_signal(int) { g_stop_requested = 1; }

// ---- files ----
void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}
void write_text(const fs::path& p, const std::string& text) {
  {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    DFLASH_CHECK_IO(f.good(), "writing", p.string());
    f << text;
    f.flush();
    DFLASH_CHECK_IO(f.good(), "writing", p.string());
  }
  fsync_path(p);
}
std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  DFLASH_CHECK_IO(f.good(), "reading", p.string());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
void fsync_tree(const fs::path& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir)) fsync_path(e.path());
  fsync_path(dir);
}

// ckpt-<step> directories with a COMMIT marker, sorted by step.
std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("ckpt-", 0) != 0 || !e.is_directory()) continue;
    const std::string num = name.substr(5);
    if (num.empty() || !std::all_of(num.begin(), num.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    if (!fs::exists(e.path() / "COMMIT")) continue;
    out.emplace_back(std::stoll(num), e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// ---- collectives that also work without MPI (world of one) ----
struct Group {
  std::unique_ptr<comm::Communicator> world, tp;
  void sum(std::vector<double>& v) {
    if (!world || v.empty()) return;
    Tensor t = Tensor::from_blob(v.data(), {static_cast<int64_t>(v.size())}, DType::F64);
    world->all_reduce_sum(t);
  }
  void barrier() {
    if (world) world->barrier();
  }
};

std::string fmt_acc(const drafter::StepStats& s, int64_t B) {
  std::string out;
  for (int64_t k = 1; k < B; ++k) out += fmt::format("{}{:.2f}", k > 1 ? " " : "", s.accuracy(k));
  return out;
}

}  // namespace

void install_stop_handlers() {
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
}

RunResult train(const TrainConfig& cfg, int world, int rank, const RunOptions& ropt) {
  using clock = std::chrono::steady_clock;
  const auto t_start = clock::now();
  cfg.validate(world);
  const comm::Layout layout = comm::make_layout(world, rank, static_cast<int>(cfg.parallel.tp));
  const int tp = layout.tp_size;

  // ---- target and drafter configs (checked on every rank before any collective) ----
  const auto& ts = cfg.model.target;
  const target::TargetConfig tcfg = target::TargetConfig::from_file(ts.path.empty() ? ts.config : ts.path);
  cfg.validate_against(tcfg);
  target::check_tp(tcfg, tp);
  const drafter::DrafterConfig dcfg = cfg.drafter_config(tcfg);
  const int64_t B = dcfg.block_size;
  const fs::path run_dir = cfg.logging.run_dir;
  const fs::path ckpt_dir = cfg.checkpoint_dir();

  // A named checkpoint must exist and be complete (checked before any collective).
  if (cfg.checkpoint.resume != "auto" && cfg.checkpoint.resume != "never")
    DFLASH_CHECK_HINT(fs::exists(fs::path(cfg.checkpoint.resume) / "COMMIT"),
                      "checkpoint.resume: '" << cfg.checkpoint.resume << "' is not a complete checkpoint (no COMMIT marker)",
                      "name a ckpt-<step> directory written by dflash_train, or use auto / never");

  // Data files named by the config must exist (checked before anything is written).
  std::vector<std::string> files;
  if (!cfg.data.synth.enabled) files = cfg.expand_data_files();

  Group g;
  if (world > 1) {
    g.world = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, 0, rank, Device::cpu(), cfg.parallel.timeout_s, "world");
    if (tp > 1)
      g.tp = std::make_unique<comm::Communicator>(MPI_COMM_WORLD, layout.tp_group, rank, Device::cpu(),
                                                  cfg.parallel.timeout_s, "tp");
  }

  if (rank == 0) fs::create_directories(run_dir / "logs");
  g.barrier();
  init_logging(rank, ropt.log_level, (run_dir / "logs" / fmt::format("rank-{}.log", rank)).string());
  if (rank == 0) {
    spdlog::info("{}", version_string());
    spdlog::info("config {}:\n{}", cfg.source, cfg.settings_table());
    spdlog::info("world: {} rank(s), tp {}, {} TP group(s) (data parallel), CPU backend", world, tp, layout.num_tp_groups);
    spdlog::info("target: {}", tcfg.summary());
    spdlog::info("drafter: {}", dcfg.summary());
    write_text(run_dir / "config.yaml", cfg.to_yaml());
  }

  // ---- data ----
  if (cfg.data.synth.enabled) {
    const fs::path sp = cfg.synth_path();
    data::SynthOptions so;
    so.sequences = cfg.data.synth.num_sequences;
    so.min_length = cfg.data.synth.min_length;
    so.max_length = cfg.data.synth.max_length;
    // Keep the mask token out of the corpus when it is the last id of the vocabulary.
    so.vocab_size = cfg.data.synth.vocab_size > 0                ? cfg.data.synth.vocab_size
                    : dcfg.mask_token_id == tcfg.vocab_size - 1 ? tcfg.vocab_size - 1
                                                                : tcfg.vocab_size;
    so.seed = static_cast<uint64_t>(cfg.data.synth.seed);
    data::check_synth_options(so);
    if (rank == 0 && !fs::exists(sp)) {
      if (sp.has_parent_path()) fs::create_directories(sp.parent_path());
      spdlog::info("data: writing the synthetic corpus {} ({} sequences, {}..{} tokens)", sp.string(), so.sequences,
                   so.min_length, so.max_length);
      data::write_synth(sp.string(), so);
    }
    g.barrier();
    files = {sp.string()};
  }
  data::LoaderConfig lc;
  lc.files = files;
  lc.max_length = cfg.data.max_length;
  lc.seed = static_cast<uint64_t>(cfg.training.seed);
  lc.tp_group = layout.tp_group;
  lc.num_tp_groups = layout.num_tp_groups;
  lc.batch = cfg.training.batch_size;
  data::Loader loader(lc);
  DFLASH_CHECK_HINT(loader.dataset().vocab_size() <= tcfg.vocab_size,
                    "data: " << files.front() << (files.size() > 1 ? " (and others)" : "") << " has vocab_size "
                             << loader.dataset().vocab_size() << ", larger than the target's vocabulary of "
                             << tcfg.vocab_size,
                    "tokenize the data with the target's tokenizer");
  DFLASH_CHECK_HINT(loader.slots_per_epoch() > 0,
                    "data: " << loader.dataset().num_sequences() << " sequence(s) cannot be shared by "
                             << layout.num_tp_groups << " TP groups",
                    "use more data or fewer ranks");
  const int64_t seq_per_step = cfg.training.batch_size * cfg.training.micro_batches;
  const int64_t steps_per_epoch = std::max<int64_t>(1, loader.slots_per_epoch() / seq_per_step);
  const int64_t total = cfg.training.max_steps ? *cfg.training.max_steps : *cfg.training.epochs * steps_per_epoch;
  if (rank == 0)
    spdlog::info("data: {} sequences, {} tokens in {} file(s); {} slots per epoch per TP group; {} steps in all",
                 loader.dataset().num_sequences(), loader.dataset().num_tokens(), files.size(),
                 loader.slots_per_epoch(), total);

  // ---- models ----
  // This trainer runs the target on the CPU reference (f32): refuse up front what cannot fit.
  target::check_cpu_reference_fits(target::local_config(tcfg, tp), tcfg,
                                   "dflash_train runs on the CPU backend for now: train on a small target; GPU "
                                   "training lands with the drafter's CUDA kernels");
  const target::TpShard shard{layout.tp_rank, tp};
  target::TargetWeights tw =
      ts.path.empty() ? target::random_weights_tp(tcfg, static_cast<uint64_t>(ts.seed), DType::F32, Device::cpu(), shard)
                      : target::load_weights_tp(tcfg, ts.path, DType::F32, Device::cpu(), shard);
  target::TargetModel tmodel(target::local_config(tcfg, tp), std::move(tw), g.tp.get());
  const drafter::FrozenTarget frozen{tmodel.weights().embed_tokens, tmodel.weights().lm_head};

  drafter::DrafterWeights dw = cfg.model.drafter.warm_start.empty()
                                   ? drafter::DrafterWeights::random(dcfg, static_cast<uint64_t>(cfg.training.seed))
                                   : drafter::import_hf(cfg.model.drafter.warm_start, DType::F32).weights;
  dw.check(dcfg);
  drafter::DrafterWeights grads = drafter::DrafterWeights::zeros(dcfg, DType::F64);
  std::vector<std::pair<std::string, Tensor*>> params;
  std::vector<Tensor*> grad_list;
  int64_t n_params = 0;
  for (auto& e : dw.entries(dcfg)) params.emplace_back(e.name, e.tensor), n_params += e.tensor->numel();
  for (auto& e : grads.entries(dcfg)) grad_list.push_back(e.tensor);
  std::vector<const Tensor*> grad_clist(grad_list.begin(), grad_list.end());
  const auto& tr = cfg.training;
  AdamW opt(params, AdamWHyper{tr.betas.at(0), tr.betas.at(1), tr.eps, tr.weight_decay});
  const LrSchedule sched{tr.lr, tr.min_lr, tr.warmup_ratio, tr.schedule, total};
  if (rank == 0)
    spdlog::info("drafter: {:.2f} M trainable parameters; schedule {} lr {:g} -> {:g}, {} warmup step(s)",
                 static_cast<double>(n_params) / 1e6, schedule_name(tr.schedule), tr.lr, tr.min_lr,
                 sched.warmup_steps());

  // ---- resume ----
  int64_t step = 0, skipped = 0, skipped_in_row = 0;
  {
    fs::path from;
    if (cfg.checkpoint.resume == "auto") {
      auto all = complete_checkpoints(ckpt_dir);
      if (!all.empty()) from = all.back().second;
    } else if (cfg.checkpoint.resume != "never") {
      from = cfg.checkpoint.resume;
    }
    if (!from.empty()) {
      const nlohmann::json st = nlohmann::json::parse(read_text(from / "state.json"));
      const int ws = st.at("world").at("world_size").get<int>(), wtp = st.at("world").at("tp").get<int>();
      DFLASH_CHECK_HINT(ws == world && wtp == tp,
                        "checkpoint " << from.string() << " was written by " << ws << " rank(s) with tp " << wtp
                                      << "; this run has " << world << " rank(s) with tp " << tp
                                      << ": resuming on a different world size or tp is not supported",
                        "resume with mpirun -n " << ws << " and parallel.tp = " << wtp
                                                 << ", or set checkpoint.resume: never (or another checkpoint.dir) to start anew");
      opt.load((from / "optimizer.safetensors").string(), st.at("optimizer"));
      loader.restore(nlohmann::json::parse(read_text(from / fmt::format("loader-g{}.json", layout.tp_group))));
      step = st.at("step").get<int64_t>();
      skipped = st.at("skipped_steps").get<int64_t>();
      skipped_in_row = st.at("skipped_in_row").get<int64_t>();
      if (rank == 0) {
        spdlog::info("resumed from {} at step {}/{}", from.string(), step, total);
        if (st.value("total_steps", total) != total)
          spdlog::warn("the checkpoint was written by a run of {} steps; this one has {} (the LR schedule changes)",
                       st.value("total_steps", total), total);
        // Drop metric lines after the checkpoint (a run that went on past it and then died).
        const fs::path mp = run_dir / "metrics.jsonl";
        if (fs::exists(mp)) {
          std::istringstream in(read_text(mp));
          std::string line, kept;
          while (std::getline(in, line)) {
            if (line.empty()) continue;
            auto j = nlohmann::json::parse(line, nullptr, false);
            if (!j.is_discarded() && j.contains("step") && j["step"].get<int64_t>() > step) continue;
            kept += line + "\n";
          }
          write_text(mp, kept);
        }
      }
    } else if (rank == 0 && cfg.checkpoint.resume == "auto") {
      spdlog::info("no complete checkpoint under {}: starting at step 0", ckpt_dir.string());
    }
  }
  std::ofstream metrics;
  if (rank == 0) {
    if (step == 0) fs::remove(run_dir / "metrics.jsonl");
    metrics.open(run_dir / "metrics.jsonl", std::ios::app);
    DFLASH_CHECK_IO(metrics.good(), "opening", (run_dir / "metrics.jsonl").string());
  }

  // ---- checkpoints ----
  auto save_checkpoint = [&](int64_t at_step, const nlohmann::json& loader_state) {
    const fs::path final_dir = ckpt_dir / fmt::format("ckpt-{}", at_step);
    const fs::path tmp = ckpt_dir / fmt::format("ckpt-{}.tmp", at_step);
    if (rank == 0) {
      fs::remove_all(tmp);
      fs::create_directories(tmp);
    }
    g.barrier();
    if (layout.tp_rank == 0) write_text(tmp / fmt::format("loader-g{}.json", layout.tp_group), loader_state.dump(1) + "\n");
    g.barrier();
    if (rank == 0) {
      drafter::export_hf((tmp / "drafter").string(), dcfg, dw);
      opt.save((tmp / "optimizer.safetensors").string());
      nlohmann::json st{{"format", "dflash.checkpoint.v1"},
                        {"step", at_step},
                        {"total_steps", total},
                        {"optimizer", opt.state_json()},
                        {"schedule", {{"kind", schedule_name(tr.schedule)}, {"lr", tr.lr}, {"min_lr", tr.min_lr},
                                      {"warmup_steps", sched.warmup_steps()}, {"total_steps", total},
                                      {"next_lr", sched.at(std::min(at_step, total - 1))}}},
                        {"skipped_steps", skipped},
                        {"skipped_in_row", skipped_in_row},
                        {"rng", {{"kind", "philox"}, {"seed", tr.seed},
                                 {"anchor_stream", "step * 2^32 + global sequence index (stateless)"}}},
                        {"world", {{"world_size", world}, {"tp", tp}, {"num_tp_groups", layout.num_tp_groups}}},
                        {"version", version_string()}};
      write_text(tmp / "state.json", st.dump(2) + "\n");
      write_text(tmp / "config.yaml", cfg.to_yaml());
      fsync_tree(tmp);
      fs::remove_all(final_dir);
      fs::rename(tmp, final_dir);
      fsync_path(ckpt_dir);
      write_text(final_dir / "COMMIT", fmt::format("step {}\n", at_step));
      fsync_path(final_dir);
      // keep_last pruning, and leftovers of interrupted writes.
      auto all = complete_checkpoints(ckpt_dir);
      for (size_t i = 0; i + static_cast<size_t>(cfg.checkpoint.keep_last) < all.size(); ++i) fs::remove_all(all[i].second);
      for (const auto& e : fs::directory_iterator(ckpt_dir)) {
        const std::string name = e.path().filename().string();
        if (name.rfind("ckpt-", 0) == 0 && !fs::exists(e.path() / "COMMIT")) fs::remove_all(e.path());
      }
      spdlog::info("checkpoint {} written", final_dir.string());
    }
    g.barrier();
  };

  // ---- the loop ----
  RunResult result;
  drafter::StepOptions sopt;
  sopt.gamma = tr.gamma;
  target::ForwardOptions fopt;
  fopt.capture = dcfg.target_layer_ids;
  const int64_t H = tcfg.hidden_size, K = dcfg.num_context_layers();
  drafter::StepStats log_stats;
  double log_tokens = 0, last_norm = 0, last_lr = 0, t_target = 0, t_drafter = 0;
  auto log_t0 = clock::now();
  int64_t last_ckpt = -1;
  const size_t n_grad = static_cast<size_t>(std::accumulate(
      grad_list.begin(), grad_list.end(), int64_t{0}, [](int64_t a, const Tensor* t) { return a + t->numel(); }));

  while (step < total) {
    const nlohmann::json loader_state_before = loader.state();
    const bool stop_here = ropt.stop_after_steps >= 0 && step >= ropt.stop_after_steps;
    // Load this step's micro-batches and sample their blocks (no forward needed for Σw).
    struct Micro {
      std::vector<std::vector<int32_t>> seqs;
      drafter::DrafterBatch batch;
      int64_t tokens = 0;
    };
    std::vector<Micro> micro(static_cast<size_t>(tr.micro_batches));
    double local_w = 0;
    for (auto& m : micro) {
      data::Batch b = loader.next_batch();
      m.batch.seqs.offsets = {0};
      int64_t blk = 0;
      for (size_t s = 0; s < b.sequences.size(); ++s) {
        const data::Sequence& sq = b.sequences[s];
        const int64_t off = m.batch.seqs.offsets.back(), S = static_cast<int64_t>(sq.ids.size());
        m.batch.tokens.insert(m.batch.tokens.end(), sq.ids.begin(), sq.ids.end());
        m.batch.loss_mask.insert(m.batch.loss_mask.end(), sq.mask.begin(), sq.mask.end());
        m.batch.seqs.offsets.push_back(off + S);
        m.seqs.push_back(sq.ids);
        const uint64_t stream = (static_cast<uint64_t>(step) << 32) + static_cast<uint64_t>(b.indices[s]);
        for (int64_t a : drafter::sample_anchors(sq.mask.data(), S, tr.num_anchors, static_cast<uint64_t>(tr.seed), stream)) {
          if (blk++ % tp != layout.tp_rank) continue;  // round-robin among the ranks of the TP group
          m.batch.blocks.push_back({static_cast<int64_t>(s), a});
          for (int64_t k = 1; k < B; ++k) local_w += drafter::block_label(sq.mask.data(), S, a, k, tr.gamma).weight;
        }
      }
      m.tokens = m.batch.seqs.offsets.back();
    }
    std::vector<double> head{local_w, (g_stop_requested || stop_here) ? 1.0 : 0.0};
    g.sum(head);
    if (head[1] > 0) {
      if (rank == 0) spdlog::warn("stop requested: writing a checkpoint at step {} and exiting", step);
      if (last_ckpt != step) save_checkpoint(step, loader_state_before);
      result.step = step;
      result.stopped = true;
      return result;
    }
    const double global_w = head[0];

    for (Tensor* t : grad_list) t->fill(0.0);
    drafter::StepStats stats;
    stats.correct.assign(static_cast<size_t>(B), 0);
    stats.counted.assign(static_cast<size_t>(B), 0);
    double step_tokens = 0;
    for (auto& m : micro) {
      if (m.seqs.empty()) continue;  // every rank of the group sees the same (empty) batch
      if (layout.tp_rank == 0) step_tokens += static_cast<double>(m.tokens);
      auto t_f0 = clock::now();
      target::ForwardResult fr = tmodel.forward(m.seqs, fopt);
      t_target += std::chrono::duration<double>(clock::now() - t_f0).count();
      const int64_t N = m.tokens;
      Tensor ctx = Tensor::empty({N, K * H}, DType::F32);
      float* cp = ctx.data<float>();
      for (int64_t j = 0; j < K; ++j) {
        const float* src = fr.layers.at(dcfg.target_layer_ids[static_cast<size_t>(j)]).data<float>();
        for (int64_t n = 0; n < N; ++n) std::memcpy(cp + n * K * H + j * H, src + n * H, sizeof(float) * H);
      }
      if (m.batch.blocks.empty() || global_w <= 0) continue;
      m.batch.context = ctx;
      sopt.grad_scale = 1.0 / global_w;
      auto t_d0 = clock::now();
      stats.add(drafter::forward_backward(dcfg, dw, frozen, m.batch, sopt, &grads));
      t_drafter += std::chrono::duration<double>(clock::now() - t_d0).count();
    }

    // One all-reduce (sum over all ranks): gradients, then the step's statistics.
    std::vector<double> buf(n_grad + 5 + 2 * static_cast<size_t>(B), 0.0);
    size_t at = 0;
    for (Tensor* t : grad_list) {
      std::memcpy(buf.data() + at, t->data<double>(), sizeof(double) * static_cast<size_t>(t->numel()));
      at += static_cast<size_t>(t->numel());
    }
    buf[at++] = stats.weighted_ce_sum;
    buf[at++] = stats.weight_sum;
    buf[at++] = stats.accept_len_sum;
    buf[at++] = static_cast<double>(stats.num_blocks);
    buf[at++] = step_tokens;
    for (int64_t k = 0; k < B; ++k) buf[at + static_cast<size_t>(k)] = static_cast<double>(stats.correct[static_cast<size_t>(k)]);
    for (int64_t k = 0; k < B; ++k) buf[at + static_cast<size_t>(B + k)] = static_cast<double>(stats.counted[static_cast<size_t>(k)]);
    g.sum(buf);
    at = 0;
    for (Tensor* t : grad_list) {
      std::memcpy(t->data<double>(), buf.data() + at, sizeof(double) * static_cast<size_t>(t->numel()));
      at += static_cast<size_t>(t->numel());
    }
    drafter::StepStats gs;
    gs.weighted_ce_sum = buf[at++];
    gs.weight_sum = buf[at++];
    gs.accept_len_sum = buf[at++];
    gs.num_blocks = std::llround(buf[at++]);
    step_tokens = buf[at++];
    gs.correct.resize(static_cast<size_t>(B));
    gs.counted.resize(static_cast<size_t>(B));
    for (int64_t k = 0; k < B; ++k) gs.correct[static_cast<size_t>(k)] = std::llround(buf[at + static_cast<size_t>(k)]);
    for (int64_t k = 0; k < B; ++k) gs.counted[static_cast<size_t>(k)] = std::llround(buf[at + static_cast<size_t>(B + k)]);

    // Clip, update (or skip a non-finite step; identical decision on every rank).
    const double loss = gs.loss();
    const double norm = global_grad_norm(grad_clist);
    last_norm = norm;
    last_lr = sched.at(step);
    if (!std::isfinite(loss) || !std::isfinite(norm)) {
      ++skipped;
      ++skipped_in_row;
      if (rank == 0) spdlog::warn("step {}: non-finite loss {} or grad norm {}: update skipped ({} in a row, {} in all)",
                                  step + 1, loss, norm, skipped_in_row, skipped);
      DFLASH_CHECK_HINT(skipped_in_row < tr.skip_nonfinite_limit,
                        skipped_in_row << " non-finite steps in a row (training.skip_nonfinite_limit = "
                                       << tr.skip_nonfinite_limit << "): stopping at step " << step + 1,
                        "lower training.lr, check the data, or resume from an earlier checkpoint");
    } else {
      skipped_in_row = 0;
      if (gs.weight_sum > 0) opt.step(grad_clist, last_lr, clip_factor(norm, tr.grad_clip));
      log_stats.add(gs);
    }
    log_tokens += step_tokens;
    ++step;

    if (step % cfg.logging.interval == 0 || step == total) {
      const double dt = std::chrono::duration<double>(clock::now() - log_t0).count();
      const double tok_s = dt > 0 ? log_tokens / dt : 0.0;
      if (rank == 0) {
        const double elapsed = std::chrono::duration<double>(clock::now() - t_start).count();
        const double eta = step > 0 ? elapsed / static_cast<double>(step) * static_cast<double>(total - step) : 0;
        spdlog::info("step {}/{} | loss {:.4f} | acc[1..{}] {} | accept {:.3f} | lr {:.3e} | gnorm {:.3f} | {:.0f} tok/s | eta {:.0f} s",
                     step, total, log_stats.loss(), B - 1, fmt_acc(log_stats, B), log_stats.accept_len(), last_lr,
                     last_norm, tok_s, eta);
        nlohmann::json acc = nlohmann::json::array();
        for (int64_t k = 1; k < B; ++k) acc.push_back(log_stats.accuracy(k));
        nlohmann::json line{{"step", step},          {"total", total},         {"loss", log_stats.loss()},
                            {"acc", acc},            {"accept_len", log_stats.accept_len()},
                            {"lr", last_lr},         {"grad_norm", last_norm}, {"tok_s", tok_s},
                            {"skipped", skipped},    {"elapsed_s", elapsed},
                            {"time_s", {{"target", t_target}, {"drafter", t_drafter}, {"interval", dt}}}};
        metrics << line.dump() << "\n";
        metrics.flush();
      }
      log_stats = drafter::StepStats{};
      log_tokens = 0;
      t_target = t_drafter = 0;
      log_t0 = clock::now();
    }
    if (step % cfg.checkpoint.interval == 0 && step < total) {
      save_checkpoint(step, loader.state());
      last_ckpt = step;
    }
  }

  if (last_ckpt != step) save_checkpoint(step, loader.state());
  result.step = step;
  result.drafter_dir = (run_dir / "drafter").string();
  if (rank == 0) {
    drafter::export_hf(result.drafter_dir, dcfg, dw);
    const auto& c = loader.counters();
    spdlog::info("data: {} sequences seen, {} truncated, {} skipped without an anchor, {} epoch(s) done", c.seen,
                 c.truncated, c.skipped_no_anchor, c.epochs);
    spdlog::info("done: {} steps ({} skipped as non-finite) in {:.1f} s; drafter exported to {}", step, skipped,
                 std::chrono::duration<double>(clock::now() - t_start).count(), result.drafter_dir);
  }
  g.barrier();
  return result;
}

}  // namespace dflash::trainer
