#pragma once
// The training loader: sequences of a dflash.tokens.v1 dataset, shuffled per epoch, sharded over
// the TP groups, truncated to max_length, in batches.
//
// Order. Epoch e uses a permutation P_e of all N sequence indices (Fisher-Yates driven by Philox
// keyed on (seed, e)). Group g of G takes P_e[g], P_e[g + G], P_e[g + 2G], ... for S = N / G slots
// (the last N % G sequences of P_e are left out of that epoch and counted in dropped_remainder; the
// permutation differs per epoch, so no sequence is left out for good). Every rank of one TP group
// builds the same loader and gets the same sequences.
//
// Stream. Each group's slots of epoch 0, then epoch 1, ... form one stream; a batch is the next
// `batch` slots of it (a batch may cross an epoch boundary). A sequence is truncated to max_length
// tokens, and skipped when no position t has mask[t] && mask[t+1] afterwards (no anchor: it would
// contribute no training target). Skipped sequences leave their slot empty instead of pulling in
// the next one, so a batch holds at most `batch` sequences and every group takes the same number of
// slots per step: one LoaderPosition {epoch, cursor} describes every group, and resuming from it
// continues exactly.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/dataset.h"

namespace dflash::data {

struct LoaderConfig {
  std::vector<std::string> files;  // files, directories or glob patterns (see expand_paths)
  int64_t max_length = 4096;       // tokens per sequence after truncation (>= 2)
  uint64_t seed = 0;
  int tp_group = 0, num_tp_groups = 1;  // comm::Layout::tp_group / num_tp_groups
  int64_t batch = 1;                    // slots (sequences) per step per TP group
};

// Where the stream stands: the next slot is slot `cursor` (0 <= cursor < S) of epoch `epoch`.
struct LoaderPosition {
  int64_t epoch = 0, cursor = 0;
  int64_t batches = 0;  // batches handed out so far (the next batch's index)
  bool operator==(const LoaderPosition&) const = default;
};

// This group's counts since the start of training (they travel with the position in the JSON).
struct LoaderCounters {
  int64_t seen = 0;               // sequences handed out
  int64_t truncated = 0;          // of those, cut to max_length
  int64_t truncated_tokens = 0;   // tokens cut off by truncation
  int64_t skipped_no_anchor = 0;  // slots left empty: no two consecutive supervised tokens
  int64_t dropped_remainder = 0;  // sequences left out of an epoch because G does not divide N (all groups)
  int64_t epochs = 0;             // epochs completed
  bool operator==(const LoaderCounters&) const = default;
};

struct Batch {
  std::vector<Sequence> sequences;  // <= batch sequences, each 2 <= len <= max_length
  std::vector<int64_t> indices;     // their global sequence indices in the dataset
  int64_t epoch = 0;                // epoch of the batch's first slot
  int64_t index = 0;                // batch number since the start of training (0, 1, ...)
};

class Loader {
 public:
  explicit Loader(LoaderConfig config);

  Batch next_batch();

  LoaderPosition position() const { return pos_; }
  const LoaderCounters& counters() const { return counters_; }
  // Position and counters, for the checkpoint; restore() also checks that the dataset, seed and
  // sharding are the ones the state was saved with.
  nlohmann::json state() const;
  void restore(const nlohmann::json& state);

  // Slots per epoch per group (S = N / G).
  int64_t slots_per_epoch() const { return slots_per_epoch_; }
  // Global sequence indices of this group's slots in `epoch`, in order.
  std::vector<int64_t> epoch_order(int64_t epoch) const;
  const Dataset& dataset() const { return dataset_; }
  const LoaderConfig& config() const { return config_; }

 private:
  const std::vector<int64_t>& order_for(int64_t epoch);

  LoaderConfig config_;
  Dataset dataset_;
  int64_t slots_per_epoch_ = 0;
  LoaderPosition pos_;
  LoaderCounters counters_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> cached_order_;
};

// The permutation of [0, n) used for `epoch` (Fisher-Yates with Philox keyed on seed and epoch).
std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch);

// True when some t has mask[t] && mask[t+1].
bool has_anchor(const std::vector<uint8_t>& mask);

void to_json(nlohmann::json& j, const LoaderPosition& p);
void from_json(const nlohmann::json& j, LoaderPosition& p);
void to_json(nlohmann::json& j, const LoaderCounters& c);
void from_json(const nlohmann::json& j, LoaderCounters& c);

}  // namespace dflash::data
