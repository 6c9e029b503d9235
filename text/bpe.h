#pragma once
// tokenizer.json "model" of type BPE: vocab, merges (both the "a b" and the ["a", "b"] form), unk
// token (fused or not), byte_fallback (<0xXX> tokens), ignore_merges. Merging follows HF's
// models/bpe/word.rs exactly: the pair of lowest merge rank first, the leftmost among equals, a
// queued pair applied when its pair still yields the queued token.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash::text {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, uint32_t, StringHash, std::equal_to<>>;

// The GPT-2 byte <-> printable character table of the ByteLevel pre-tokenizer and decoder.
uint32_t byte_to_char(uint8_t b);
// The byte a ByteLevel character stands for, or -1 when c is not one of the 256.
int char_to_byte(uint32_t c);

class Bpe {
 public:
  // `byte_level`: the pre-tokenizer ends with ByteLevel, so the words given to encode_word are raw
  // bytes and the model's characters are their ByteLevel images (one per byte).
  static Bpe from_json(const nlohmann::json& model, bool byte_level);
  Bpe(Bpe&&) noexcept;
  Bpe& operator=(Bpe&&) noexcept;
  ~Bpe();

  // Appends the ids of one pre-token (non-empty). Thread-safe; results are cached per thread.
  void encode_word(std::string_view word, std::vector<uint32_t>& out) const;

  const TokenMap& vocab() const { return vocab_; }
  // The vocab string of every id ("" where the id is not in the vocab).
  const std::vector<std::string>& id_to_token() const { return id_to_token_; }
  size_t merges() const { return merge_count_; }

 private:
  Bpe() = default;
  struct MergeTable;
  void merge_word(std::string_view word, std::vector<uint32_t>& out) const;
  void initial_symbols(std::string_view word, std::vector<uint32_t>& ids) const;

  TokenMap vocab_;
  std::vector<std::string> id_to_token_;
  std::unique_ptr<MergeTable> merges_;
  size_t merge_count_ = 0;
  bool byte_level_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  std::optional<uint32_t> unk_;
  int64_t byte_ids_[256];   // byte_level: the id of each byte's character, -1 when not in the vocab
  uint64_t serial_ = 0;     // tells this model's per-thread word cache from another's
};

}  // namespace dflash::text
