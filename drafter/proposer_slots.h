#pragma once
// Internal to drafter/: the slot bookkeeping and argument checks the CPU and CUDA proposers
// (decode.cpp, decode_cuda.cpp) share, so both refuse the same inputs with the same messages.
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "drafter/config.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "core/tensor.h"

namespace dflash::drafter {

class ProposerSlots {
 public:
  ProposerSlots(const DrafterConfig& c, int64_t num_slots, int64_t max_len, std::string who)
      : block_size_(c.block_size), vocab_(c.vocab_size), width_(c.context_dim()), layers_(c.num_context_layers()),
        hidden_(c.hidden_size), max_len_(max_len), who_(std::move(who)) {
    DFLASH_CHECK(num_slots >= 1 && num_slots < (int64_t{1} << 31),
                 who_ << ": num_slots must be in [1, 2^31), got " << num_slots);
    DFLASH_CHECK(max_len >= c.block_size && max_len < (int64_t{1} << 31),
                 who_ << ": max_len " << max_len << " must hold at least one block (block_size " << c.block_size
                      << ") and be below 2^31");
    len_.assign(static_cast<size_t>(num_slots), 0);
  }

  int64_t num_slots() const { return static_cast<int64_t>(len_.size()); }
  int64_t max_len() const { return max_len_; }
  const std::string& who() const { return who_; }
  int64_t length(int32_t slot) const { return len_[index(slot, "context_length")]; }
  void reset(int32_t slot) { len_[index(slot, "reset")] = 0; }

  // add_context's checks (features [N, k·H]; one sequence per slot, distinct slots, every slot's
  // context within max_len); nothing changes when one fails.
  void check_add(const std::vector<int32_t>& slots, const Tensor& features, const ops::SeqOffsets& seqs) const {
    DFLASH_CHECK(features.defined() && features.dim() == 2 && features.size(1) == width_,
                 who_ << ": add_context: features must be [N, " << width_ << "] (k = " << layers_
                      << " captured layers × hidden " << hidden_ << "), got "
                      << (features.defined() ? features.describe() : "undefined"));
    seqs.validate(features.size(0), "add_context");
    check_slots(slots, seqs.num_sequences(), "add_context");
    for (size_t s = 0; s < slots.size(); ++s) {
      const int64_t T = seqs.offsets[s + 1] - seqs.offsets[s], n = len_[slots[s]];
      DFLASH_CHECK(n + T <= max_len_, who_ << ": add_context: slot " << slots[s] << " holds " << n << " context positions; "
                                           << T << " more exceed max_len " << max_len_);
    }
  }
  void commit_add(const std::vector<int32_t>& slots, const ops::SeqOffsets& seqs) {
    for (size_t s = 0; s < slots.size(); ++s) len_[slots[s]] += seqs.offsets[s + 1] - seqs.offsets[s];
  }

  // propose's checks: 2 <= block_size <= the drafter's, one start token (in the vocabulary) per
  // distinct slot, every block inside max_len.
  void check_propose(const std::vector<int32_t>& slots, const std::vector<int32_t>& x_start, int64_t block_size) const {
    DFLASH_CHECK(block_size >= 2 && block_size <= block_size_,
                 who_ << ": propose: block_size " << block_size << " is outside [2, " << block_size_
                      << "] (the drafter's block_size)");
    DFLASH_CHECK(x_start.size() == slots.size(),
                 who_ << ": propose: " << x_start.size() << " start tokens for " << slots.size() << " slots");
    check_slots(slots, static_cast<int64_t>(slots.size()), "propose");
    for (size_t s = 0; s < slots.size(); ++s) {
      DFLASH_CHECK(x_start[s] >= 0 && x_start[s] < vocab_, who_ << ": propose: start token " << x_start[s] << " of slot "
                                                                << slots[s] << " is outside the vocabulary [0, "
                                                                << vocab_ << ")");
      const int64_t n = len_[slots[s]];
      DFLASH_CHECK(n + block_size <= max_len_, who_ << ": propose: slot " << slots[s] << " holds " << n
                                                    << " context positions; a block of " << block_size
                                                    << " beyond them exceeds max_len " << max_len_);
    }
  }

 private:
  size_t index(int32_t slot, const char* op) const {
    DFLASH_CHECK(slot >= 0 && slot < num_slots(),
                 who_ << ": " << op << ": slot " << slot << " is outside the pool of " << num_slots() << " slots");
    return static_cast<size_t>(slot);
  }
  void check_slots(const std::vector<int32_t>& slots, int64_t num_seqs, const char* op) const {
    DFLASH_CHECK(static_cast<int64_t>(slots.size()) == num_seqs,
                 who_ << ": " << op << ": " << slots.size() << " slots for " << num_seqs << " sequences");
    std::set<int32_t> seen;
    for (int32_t slot : slots) {
      index(slot, op);
      DFLASH_CHECK(seen.insert(slot).second, who_ << ": " << op << ": slot " << slot << " appears twice in one call");
    }
  }

  int64_t block_size_, vocab_, width_, layers_, hidden_, max_len_;
  std::string who_;
  std::vector<int64_t> len_;  // [num_slots] context positions held
};

}  // namespace dflash::drafter
