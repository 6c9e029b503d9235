#pragma once
// The token dataset format `dflash.tokens.v1` (HDF5), its writer, reader and validator.
//
//   /input_ids  int32 [tokens]          all sequences back to back
//   /loss_mask  uint8 [tokens]          1 = the token is supervised (a training target), else 0
//   /offsets    int64 [sequences + 1]   sequence i is tokens [offsets[i], offsets[i+1])
//   attributes on the root group: format = "dflash.tokens.v1" (string), vocab_size (int64)
//
// Invariants (checked by validate_file): offsets[0] == 0, offsets strictly increasing (no empty
// sequence), offsets[last] == len(input_ids) == len(loss_mask), 0 <= id < vocab_size, mask in {0, 1}.
// A dataset may span several files; sequences are numbered globally in file order.
#include <hdf5.h>

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "data/hdf5_check.h"

namespace dflash::data {

inline constexpr const char* kFormat = "dflash.tokens.v1";

struct Sequence {
  std::vector<int32_t> ids;   // [len] token ids
  std::vector<uint8_t> mask;  // [len] 0/1 loss mask
};

struct WriterOptions {
  int64_t chunk_tokens = 1 << 16;  // HDF5 chunk of /input_ids and /loss_mask, in tokens (elements)
  int compression = 4;             // deflate level 0..9; 0 = uncompressed
};

// Writes a dataset file incrementally: sequences are buffered up to one chunk and then appended by
// extending the datasets, so memory stays O(chunk) plus 8 bytes per sequence (the offsets are kept
// until finish() because their count is unknown). Everything goes to `path + ".tmp"`, which
// finish() renames to `path`; a writer destroyed without finish() removes the temporary file, so an
// interrupted conversion never leaves a file that looks complete.
class DatasetWriter {
 public:
  DatasetWriter(std::string path, int64_t vocab_size, WriterOptions options = {});
  ~DatasetWriter();
  DatasetWriter(const DatasetWriter&) = delete;
  DatasetWriter& operator=(const DatasetWriter&) = delete;

  // Appends one sequence. Throws (naming the file and the sequence index) when it is empty, the
  // lengths differ, an id is outside [0, vocab_size) or a mask value is not 0/1.
  void append(std::span<const int32_t> ids, std::span<const uint8_t> mask);
  void append(const Sequence& s) { append(s.ids, s.mask); }
  // Flushes, writes /offsets, closes (checked) and renames the file into place.
  void finish();

  int64_t num_sequences() const { return static_cast<int64_t>(offsets_.size()) - 1; }
  int64_t num_tokens() const { return offsets_.back(); }
  const std::string& path() const { return path_; }

 private:
  void flush();

  std::string path_, tmp_path_;
  int64_t vocab_size_;
  WriterOptions options_;
  H5Handle file_, ids_ds_, mask_ds_;
  std::vector<int32_t> ids_buf_;
  std::vector<uint8_t> mask_buf_;
  std::vector<int64_t> offsets_{0};
  int64_t written_tokens_ = 0;  // tokens already in the file
  bool finished_ = false;
};

// The prompt of a sequence: its tokens before the first loss_mask = 1 (all of them when none is
// supervised, or when the mask is empty). What dflash_eval decodes from and regenerate answers.
std::vector<int32_t> prompt_of(const Sequence& s);

// One JSONL row {"input_ids": [...], "loss_mask": [...]} (dflash_data convert, dflash_eval's prompts):
// ids integers in [0, vocab) (`vocab_name` names that bound in messages, e.g. "--vocab-size"),
// loss_mask 0/1 or booleans, one per id. Without mask_required a row may omit loss_mask (the
// returned mask is then empty). Throws naming `where` ("file:line"), the field and the value.
Sequence parse_token_row(const std::string& line, const std::string& where, int64_t vocab, const std::string& vocab_name,
                         bool mask_required);

// Dataset files named by `specs`: a file, a directory (its *.h5 files, sorted) or a glob pattern
// (sorted matches). Throws when a spec matches nothing.
std::vector<std::string> expand_paths(const std::vector<std::string>& specs);

struct FileInfo {
  std::string path;
  int64_t vocab_size = 0;
  int64_t num_sequences = 0;
  int64_t num_tokens = 0;
  int64_t first_sequence = 0;  // global index of its sequence 0
};

// What validate_file / stats / Dataset::check_contents report for a file (or a sum of files).
struct DatasetStats {
  int64_t sequences = 0, tokens = 0, supervised = 0;
  int64_t min_length = 0, max_length = 0;
  // Sequences with no two consecutive supervised tokens (within the first `anchor_window` tokens
  // when the check was given one): the trainer finds no anchor block in them and skips them.
  int64_t no_anchor = 0;
  // Power-of-2 buckets: histogram[k] = number of sequences with 2^k <= length < 2^(k+1).
  std::map<int, int64_t> histogram;
  void add(const DatasetStats& o);
};

// Read access to one or several dataset files. Opening checks the format attribute, the datasets
// and the offsets (cheap: the offsets are read into memory, 8 bytes per sequence); token contents
// are checked by validate_file. sequence(i) reads only that sequence's slice (a hyperslab).
class Dataset {
 public:
  explicit Dataset(const std::vector<std::string>& specs);
  Dataset(Dataset&&) = default;
  Dataset& operator=(Dataset&&) = default;

  int64_t num_sequences() const { return num_sequences_; }
  int64_t num_tokens() const { return num_tokens_; }
  // The largest vocab_size over the files (files made with different tokenizers are refused).
  int64_t vocab_size() const { return vocab_size_; }
  const std::vector<FileInfo>& files() const { return infos_; }

  int64_t length(int64_t i) const;
  // Sequence i (global index); reads at most `max_tokens` tokens from its start when >= 0.
  Sequence sequence(int64_t i, int64_t max_tokens = -1) const;
  // Which file holds global sequence i, and its index there.
  std::pair<size_t, int64_t> locate(int64_t i) const;

  // Checks the token contents of global sequences [first, end) as validate_file does (every id in
  // [0, vocab_size), every mask value 0 or 1), reading whole sequences in blocks of about
  // `block_tokens`; `anchor_window` > 0 counts no_anchor within each sequence's first
  // anchor_window tokens (the trainer's max_length). Throws at the first violation naming the
  // file, the dataset, the sequence (in the file and globally) and the position; `hint` (when
  // non-empty) replaces the default hint of an id outside the vocabulary. Returns the range's stats.
  DatasetStats check_contents(int64_t first, int64_t end, int64_t anchor_window = 0, const std::string& vocab_hint = {},
                              int64_t block_tokens = 1 << 20) const;

 private:
  struct Open {
    H5Handle file, ids, mask;
    std::vector<int64_t> offsets;  // [sequences + 1]
  };
  std::vector<Open> open_;
  std::vector<FileInfo> infos_;
  int64_t num_sequences_ = 0, num_tokens_ = 0, vocab_size_ = 0;
};


// Checks every invariant of the format and every token of the file, reading in blocks of
// `block_tokens`. Throws dflash::Error naming the file, the dataset and the sequence index (with a
// hint) at the first violation; returns the file's statistics when it is valid.
DatasetStats validate_file(const std::string& path, int64_t block_tokens = 1 << 20);

}  // namespace dflash::data
