#include "data/loader.h"

#include <utility>

#include "core/error.h"
#include "core/rng.h"

namespace dflash::data {

namespace {
// Philox stream ids of the loader: one per epoch, away from the streams other code derives.
constexpr uint64_t kShuffleTag = 0x6c6f616465727368ull;  // "loadersh"
}  // namespace

std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[i] = i;
  const uint64_t stream = rng::mix64(kShuffleTag ^ rng::mix64(static_cast<uint64_t>(epoch)));
  // Fisher-Yates from the top: swap p[i] with p[j], j uniform in [0, i]. 64 random bits per draw
  // make the modulo bias < n / 2^64.
  for (int64_t i = n - 1; i > 0; --i) {
    const uint64_t r = (static_cast<uint64_t>(rng::bits(seed, stream, 2 * static_cast<uint64_t>(i))) << 32) |
                       rng::bits(seed, stream, 2 * static_cast<uint64_t>(i) + 1);
    const int64_t j = static_cast<int64_t>(r % static_cast<uint64_t>(i + 1));
    std::swap(p[i], p[j]);
  }
  return p;
}

bool has_anchor(const std::vector<uint8_t>& mask) {
  for (size_t t = 0; t + 1 < mask.size(); ++t)
    if (mask[t] && mask[t + 1]) return true;
  return false;
}

Loader::Loader(LoaderConfig config) : config_(std::move(config)), dataset_(config_.files) {
  DFLASH_REQUIRE_HINT(config_.max_length >= 2, "data loader: max_length = " << config_.max_length << " must be >= 2",
                    "a training sequence needs at least two tokens");
  DFLASH_CHECK(config_.batch >= 1, "data loader: batch = " << config_.batch << " must be >= 1");
  DFLASH_CHECK(config_.num_tp_groups >= 1 && config_.tp_group >= 0 && config_.tp_group < config_.num_tp_groups,
               "data loader: tp_group " << config_.tp_group << " is outside [0, num_tp_groups = " << config_.num_tp_groups
                                        << ")");
  const int64_t n = dataset_.num_sequences();
  slots_per_epoch_ = n / config_.num_tp_groups;
  DFLASH_REQUIRE_HINT(slots_per_epoch_ >= 1,
                    "data loader: the dataset has " << n << " sequences, fewer than the " << config_.num_tp_groups
                                                    << " TP groups that share it",
                    "use more data or fewer data-parallel groups");
}

std::vector<int64_t> Loader::epoch_order(int64_t epoch) const {
  const std::vector<int64_t> perm = epoch_permutation(dataset_.num_sequences(), config_.seed, epoch);
  std::vector<int64_t> out(static_cast<size_t>(slots_per_epoch_));
  for (int64_t s = 0; s < slots_per_epoch_; ++s) out[s] = perm[s * config_.num_tp_groups + config_.tp_group];
  return out;
}

const std::vector<int64_t>& Loader::order_for(int64_t epoch) {
  if (cached_epoch_ != epoch) {
    cached_order_ = epoch_order(epoch);
    cached_epoch_ = epoch;
  }
  return cached_order_;
}

Batch Loader::next_batch() {
  Batch b;
  b.epoch = pos_.epoch;
  b.index = pos_.batches;
  for (int64_t k = 0; k < config_.batch; ++k) {
    if (pos_.cursor == 0) counters_.dropped_remainder += dataset_.num_sequences() % config_.num_tp_groups;
    const int64_t i = order_for(pos_.epoch)[pos_.cursor];
    const int64_t len = dataset_.length(i);
    Sequence s = dataset_.sequence(i, config_.max_length);
    const bool truncated = len > config_.max_length;
    if (++pos_.cursor == slots_per_epoch_) {
      pos_.cursor = 0;
      ++pos_.epoch;
      ++counters_.epochs;
    }
    if (!has_anchor(s.mask)) {
      ++counters_.skipped_no_anchor;
      continue;
    }
    if (truncated) {
      ++counters_.truncated;
      counters_.truncated_tokens += len - config_.max_length;
    }
    ++counters_.seen;
    b.sequences.push_back(std::move(s));
    b.indices.push_back(i);
  }
  ++pos_.batches;
  return b;
}

nlohmann::json Loader::state() const {
  return {{"position", pos_},
          {"counters", counters_},
          {"num_sequences", dataset_.num_sequences()},
          {"num_tokens", dataset_.num_tokens()},
          {"seed", config_.seed},
          {"num_tp_groups", config_.num_tp_groups},
          {"tp_group", config_.tp_group}};
}

void Loader::restore(const nlohmann::json& state) {
  try {
    const int64_t n = state.at("num_sequences").get<int64_t>();
    const int64_t t = state.at("num_tokens").get<int64_t>();
    DFLASH_REQUIRE_HINT(n == dataset_.num_sequences() && t == dataset_.num_tokens(),
                      "data loader: the saved position is for a dataset of " << n << " sequences / " << t
                                                                             << " tokens, but the data files hold "
                                                                             << dataset_.num_sequences() << " / "
                                                                             << dataset_.num_tokens(),
                      "resume with the same data files, or start a new run");
    const uint64_t seed = state.at("seed").get<uint64_t>();
    DFLASH_REQUIRE_HINT(seed == config_.seed,
                      "data loader: the saved position was made with seed " << seed << ", this run uses " << config_.seed,
                      "resume with the same seed");
    const int g = state.at("num_tp_groups").get<int>();
    DFLASH_REQUIRE_HINT(g == config_.num_tp_groups,
                      "data loader: the saved position is for " << g << " TP groups, this run has " << config_.num_tp_groups,
                      "resume with the same world size and tp");
    LoaderPosition p = state.at("position").get<LoaderPosition>();
    DFLASH_CHECK(p.epoch >= 0 && p.cursor >= 0 && p.cursor < slots_per_epoch_ && p.batches >= 0,
                 "data loader: the saved position (epoch " << p.epoch << ", cursor " << p.cursor
                                                           << ") is outside the epoch of " << slots_per_epoch_ << " slots");
    LoaderCounters c = state.contains("counters") ? state.at("counters").get<LoaderCounters>() : LoaderCounters{};
    pos_ = p;
    counters_ = c;
  } catch (const nlohmann::json::exception& e) {
    DFLASH_REJECT_HINT("data loader: the saved position is malformed: " << e.what(),
                     "the checkpoint's loader state was written by another version or edited by hand");
  }
}

void to_json(nlohmann::json& j, const LoaderPosition& p) {
  j = {{"epoch", p.epoch}, {"cursor", p.cursor}, {"batches", p.batches}};
}
void from_json(const nlohmann::json& j, LoaderPosition& p) {
  j.at("epoch").get_to(p.epoch);
  j.at("cursor").get_to(p.cursor);
  p.batches = j.value("batches", int64_t{0});
}
void to_json(nlohmann::json& j, const LoaderCounters& c) {
  j = {{"seen", c.seen},
       {"truncated", c.truncated},
       {"truncated_tokens", c.truncated_tokens},
       {"skipped_no_anchor", c.skipped_no_anchor},
       {"dropped_remainder", c.dropped_remainder},
       {"epochs", c.epochs}};
}
void from_json(const nlohmann::json& j, LoaderCounters& c) {
  c.seen = j.value("seen", int64_t{0});
  c.truncated = j.value("truncated", int64_t{0});
  c.truncated_tokens = j.value("truncated_tokens", int64_t{0});
  c.skipped_no_anchor = j.value("skipped_no_anchor", int64_t{0});
  c.dropped_remainder = j.value("dropped_remainder", int64_t{0});
  c.epochs = j.value("epochs", int64_t{0});
}

}  // namespace dflash::data
