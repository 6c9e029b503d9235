#pragma once
// dflash::text::Tokenizer: text <-> token ids from a Hugging Face tokenizer.json, giving exactly
// the ids of HF tokenizers' `encode(text, add_special_tokens=False)` (added tokens found in the
// text as HF finds them) and its `decode(ids, skip_special_tokens=False)`.
//
// Supported (anything else is refused at load with the field and value named, never silently
// encoded differently):
//   model           BPE: vocab, merges ("a b" or ["a", "b"]), unk_token, fuse_unk, byte_fallback,
//                   ignore_merges (dropout null, no subword prefix / suffix)
//   normalizer      null, NFC, NFKC, Sequence of those
//   pre_tokenizer   null, Split (pattern Regex or String; behavior Removed, Isolated,
//                   MergedWithPrevious, MergedWithNext, Contiguous; invert), ByteLevel
//                   (add_prefix_space, use_regex), Sequence of those with ByteLevel last
//   added_tokens    special, lstrip, rstrip, normalized, single_word; ids as HF assigns them (the
//                   content's vocab id, else the next free id; the "id" field is only checked)
//   decoder         ByteLevel
//   post_processor  null, ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing,
//                   Sequence (none adds anything when special tokens are not added)
//   truncation, padding: null
// decode(encode(s)) == the normalizer's form of s for every valid UTF-8 s; invalid UTF-8 input
// is an error naming the byte offset.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dflash::text {

struct TokenizerOptions {
  // Use the hand-written splitter for the Qwen pre-tokenizer patterns (qwen_split.h) instead of
  // Oniguruma. Same splits (tested); false forces the general engine.
  bool fast_paths = true;
};

struct AddedToken {
  std::string content;
  uint32_t id = 0;
  bool special = false, lstrip = false, rstrip = false, normalized = true, single_word = false;
};

class Tokenizer {
 public:
  // `path`: a tokenizer.json or a directory holding one. Errors name the file.
  static Tokenizer from_file(const std::string& path, TokenizerOptions opt = {});
  // `origin` names the source in errors.
  static Tokenizer from_json(const std::string& json_text, const std::string& origin, TokenizerOptions opt = {});

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Thread-safe (one Tokenizer serves every thread).
  std::vector<uint32_t> encode(std::string_view text) const;
  void encode(std::string_view text, std::vector<uint32_t>& out) const;  // appends
  // encode() plus where each token comes from: offsets[k] = [begin, end) byte range of `text`
  // that token k stands for, as Hugging Face's offsets (in bytes, not chars): consecutive, in
  // order, together covering the text. A token made of some of the bytes of one character (a
  // byte-level piece of an emoji, say) gets that character's whole range, so two such tokens share
  // it. An added token's range includes the whitespace its lstrip / rstrip took. Where the
  // normalizer changed the text, every token within a changed stretch (between normalization
  // boundaries) gets that stretch's range in the input.
  struct Encoding {
    std::vector<uint32_t> ids;
    std::vector<std::pair<size_t, size_t>> offsets;
  };
  Encoding encode_with_offsets(std::string_view text) const;
  // Throws naming the first id that is neither in the vocab nor an added token.
  std::string decode(std::span<const uint32_t> ids) const;

  // The normalizer applied to s (s where there is none): what decode(encode(s)) gives back.
  std::string normalize(std::string_view s) const;

  size_t vocab_size() const;  // largest id + 1 (model vocab and added tokens)
  std::optional<uint32_t> token_to_id(std::string_view token) const;
  const std::vector<AddedToken>& added_tokens() const;
  // One line: model, vocab size, merges, normalizer, pre-tokenizer steps, added tokens, fast path.
  std::string describe() const;
  // Whether the pre-tokenizer runs a hand-written fast path (see TokenizerOptions).
  bool uses_fast_path() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash::text
