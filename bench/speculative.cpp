#include "bench/speculative.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "core/error.h"

namespace dflash::bench {

namespace {

using clock = std::chrono::steady_clock;
double since(clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); }

bool is_stop(const GenerateOptions& o, int32_t t) {
  return std::find(o.stop_tokens.begin(), o.stop_tokens.end(), t) != o.stop_tokens.end();
}

// Appends `t` unless the generation is already complete; returns whether it is complete now.
bool push(Generation& g, const GenerateOptions& o, int32_t t) {
  g.tokens.push_back(t);
  return is_stop(o, t) || static_cast<int64_t>(g.tokens.size()) >= o.max_new_tokens;
}

void check_options(const GenerateOptions& o) {
  DFLASH_REQUIRE_HINT(o.max_new_tokens >= 1, "max new tokens = " << o.max_new_tokens << " must be >= 1",
                    "ask for at least one new token");
}

}  // namespace

void PhaseTimes::add(const PhaseTimes& o) {
  prefill += o.prefill, decode += o.decode, propose += o.propose, verify += o.verify, commit += o.commit;
  for (auto [to, from] : {std::pair{&decode_steps, &o.decode_steps}, {&propose_steps, &o.propose_steps},
                          {&verify_steps, &o.verify_steps}, {&commit_steps, &o.commit_steps}})
    to->insert(to->end(), from->begin(), from->end());
}

Generation greedy_generate(target::Decoder& target, int32_t slot, const std::vector<int32_t>& prompt,
                           const GenerateOptions& o, int64_t extra) {
  check_options(o);
  target.reset(slot);
  Generation g;
  target::ExtendOptions eo;
  eo.last_only = true;
  auto t0 = clock::now();
  int32_t next = target.extend({slot}, {prompt}, eo).next.back();
  g.times.prefill = since(t0);
  t0 = clock::now();
  bool done = push(g, o, next);
  while (!done) {
    const auto t1 = clock::now();
    next = target.extend({slot}, {{next}}, eo).next.back();
    g.times.decode_steps.push_back(since(t1));
    done = push(g, o, next);
  }
  g.times.decode = since(t0);
  for (int64_t i = 0; i < extra; ++i) {  // untimed: labels past the end
    next = target.extend({slot}, {{next}}, eo).next.back();
    g.tokens.push_back(next);
  }
  return g;
}

Generation speculative_generate(target::Decoder& target, drafter::Proposer& proposer, int32_t slot,
                                const std::vector<int32_t>& prompt, const GenerateOptions& o) {
  check_options(o);
  const drafter::DrafterConfig& dc = proposer.config();
  const int64_t B = o.block_size;
  DFLASH_REQUIRE_HINT(B >= 2 && B <= dc.block_size,
                    "block size " << B << " is outside [2, " << dc.block_size << "] (the drafter's block_size)",
                    "a drafter proposes at most block_size - 1 tokens per step");
  target.reset(slot);
  proposer.reset(slot);
  Generation g;
  // Prefill: the prompt's features become the drafter's context; x0 is the target's own token.
  target::ExtendOptions pre, verify;
  pre.capture = verify.capture = dc.target_layer_ids;
  verify.commit = false;
  auto t0 = clock::now();
  target::ExtendResult r = target.extend({slot}, {prompt}, pre);
  proposer.add_context({slot}, r.features, ops::SeqOffsets{{0, static_cast<int64_t>(prompt.size())}});
  g.times.prefill = since(t0);
  bool done = push(g, o, r.next.back());
  while (!done) {
    const int32_t x_start = g.tokens.back();
    DFLASH_CHECK(proposer.context_length(slot) == target.length(slot),
                 "speculative decoding: the drafter's context (" << proposer.context_length(slot)
                                                                 << " positions) and the target ("
                                                                 << target.length(slot) << ") disagree");
    t0 = clock::now();
    const std::vector<int32_t> drafts = proposer.propose({slot}, {x_start}, B).front();
    g.times.propose_steps.push_back(since(t0));
    g.times.propose += g.times.propose_steps.back();
    std::vector<int32_t> block{x_start};
    block.insert(block.end(), drafts.begin(), drafts.end());
    t0 = clock::now();
    r = target.extend({slot}, {block}, verify);
    g.times.verify_steps.push_back(since(t0));
    g.times.verify += g.times.verify_steps.back();
    int64_t k = 0;
    while (k < B - 1 && drafts[static_cast<size_t>(k)] == r.next[static_cast<size_t>(k)]) ++k;
    t0 = clock::now();
    target.commit(slot, k + 1);
    proposer.add_context({slot}, r.features.slice(0, 0, k + 1), ops::SeqOffsets{{0, k + 1}});
    target.synchronize();  // (a GPU's commit returns before its kernels are done: time them here)
    g.times.commit_steps.push_back(since(t0));
    g.times.commit += g.times.commit_steps.back();
    g.block_starts.push_back(static_cast<int64_t>(prompt.size() + g.tokens.size()) - 1);
    g.accept.push_back(k + 1);
    for (int64_t i = 0; i < k && !done; ++i) done = push(g, o, drafts[static_cast<size_t>(i)]);
    if (!done) done = push(g, o, r.next[static_cast<size_t>(k)]);  // the bonus token
  }
  return g;
}

AcceptEstimate training_estimate(const DrafterScorer& score, const Tensor& features, const std::vector<int32_t>& sequence,
                                 int64_t prompt_len, int64_t generated, const std::vector<int64_t>& block_starts) {
  const int64_t N = static_cast<int64_t>(sequence.size());
  DFLASH_CHECK(features.dim() == 2 && features.size(0) == N,
               "acceptance estimate: " << N << " tokens but features " << features.describe());
  drafter::DrafterBatch b;
  b.context = features;
  b.tokens = sequence;
  // Supervised: the generated tokens (the labels are the target's greedy tokens).
  b.loss_mask.assign(static_cast<size_t>(N), 0);
  for (int64_t t = prompt_len; t < N; ++t) b.loss_mask[static_cast<size_t>(t)] = 1;
  b.seqs.offsets = {0, N};
  AcceptEstimate e;
  auto run = [&](const std::vector<int64_t>& anchors) {
    b.blocks.clear();
    for (int64_t a : anchors) b.blocks.push_back({0, a});
    return score(b);
  };
  e.at_steps = run(block_starts);
  std::vector<int64_t> all;
  for (int64_t a = prompt_len; a < prompt_len + generated; ++a) all.push_back(a);
  e.at_all = run(all);
  return e;
}

DrafterScorer cpu_scorer(const drafter::DrafterConfig& config, const drafter::DrafterWeights& weights,
                         const drafter::FrozenTarget& target, int64_t block_size, drafter::DrafterMath math) {
  // The drafter as trained, with blocks of the evaluated size (the mask rule restricted to B rows).
  drafter::DrafterConfig c = config;
  c.block_size = block_size;
  drafter::StepOptions o;
  o.math = math;
  return [c, &weights, target, o](const drafter::DrafterBatch& b) { return drafter::forward_backward(c, weights, target, b, o); };
}

}  // namespace dflash::bench
