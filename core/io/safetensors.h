#pragma once
// Safetensors reading (zero-copy, mmap'd) and writing, single files and sharded Hugging Face
// checkpoints (model.safetensors.index.json + model-0000i-of-0000N.safetensors).
//
// File layout: u64 little-endian N, N bytes of JSON header, then the data region. The header maps
// each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
// data region) plus an optional "__metadata__" object of string -> string.
//
// Opening validates everything up front (header, dtypes, shapes, byte ranges, and that the tensors
// tile the data region exactly, as the format requires) and reports any problem as a dflash::Error
// naming the file and the tensor. After a successful open, tensor() cannot fail on a name it has.
//
// Tensors returned by tensor() are read-only zero-copy views into a PROT_READ mapping of the file:
// they stay valid after the SafetensorsFile (and SafetensorsIndex) objects are gone, since every
// view holds the mapping alive; writing through them faults. clone() one to get a writable copy.
// A tensor whose data is not aligned to its element size in the file (info().aligned false; never
// in files from save_safetensors() or Hugging Face's writer, which pad the header to 8 bytes and
// order tensors by element size) is returned as an aligned, owned copy instead of a view.
// The file must not be truncated while mapped (reading a view past the new end raises SIGBUS).
#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace dflash::io {

// Where one tensor lives inside a file.
struct TensorInfo {
  DType dtype = DType::F32;
  Shape shape;
  size_t begin = 0, end = 0;  // byte range relative to the data region
  bool aligned = true;         // the data's file offset is a multiple of the element size
  size_t nbytes() const { return end - begin; }
};

// Safetensors dtype strings we read and write: "BF16", "F16", "F32", "F64", "I32", "I64", "U8",
// "F8_E4M3" (e4m3 codes, DType::F8E4M3).
std::optional<DType> safetensors_dtype_from_string(std::string_view s);
const char* safetensors_dtype_string(DType t);
// "BF16, F16, F32, F64, I32, I64, U8" (for messages).
const char* safetensors_supported_dtypes();

// Largest header accepted (a real header is at most a few MiB; a larger N means a corrupt file).
inline constexpr size_t kSafetensorsMaxHeaderBytes = size_t{100} << 20;

class SafetensorsFile {
 public:
  SafetensorsFile() = default;  // empty, not opened (has() is false for every name)
  explicit SafetensorsFile(const std::string& path);
  static SafetensorsFile open(const std::string& path) { return SafetensorsFile(path); }

  const std::string& path() const { return path_; }
  bool is_open() const { return mapping_ != nullptr; }
  size_t size() const { return tensors_.size(); }  // number of tensors
  std::vector<std::string> names() const;          // sorted
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws dflash::Error naming the file and the tensor when `name` is absent.
  const TensorInfo& info(const std::string& name) const;
  // Zero-copy, read-only CPU view (see the note at the top).
  Tensor tensor(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  size_t file_size() const { return file_size_; }
  size_t data_offset() const { return data_offset_; }  // 8 + N: where the data region starts
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }

 private:
  std::string path_;
  std::shared_ptr<void> mapping_;  // base of the whole-file mapping; the deleter munmaps
  size_t file_size_ = 0, data_offset_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A model directory's weights: either model.safetensors.index.json plus the shards it names, or
// a single model.safetensors. One lookup over all files.
class SafetensorsIndex {
 public:
  SafetensorsIndex() = default;
  // `path` is a model directory (index preferred over model.safetensors), or a .safetensors file.
  static SafetensorsIndex open(const std::string& path);

  const std::string& dir() const { return dir_; }
  bool sharded() const { return !index_path_.empty(); }
  const std::string& index_path() const { return index_path_; }  // empty when not sharded
  const std::vector<SafetensorsFile>& files() const { return files_; }

  size_t size() const { return where_.size(); }
  std::vector<std::string> names() const;  // sorted
  bool has(const std::string& name) const { return where_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;
  Tensor tensor(const std::string& name) const;
  // The file holding `name` (path of the shard as opened).
  const std::string& file_of(const std::string& name) const;
  const SafetensorsFile& shard_of(const std::string& name) const;

 private:
  size_t shard_index(const std::string& name) const;
  std::string dir_, index_path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index into files_
};

// Same as SafetensorsIndex::open(dir).
SafetensorsIndex open_checkpoint(const std::string& dir);

// Writes host tensors (any supported dtype; strided ones are made contiguous). The header is
// padded with spaces so the data region starts 8-byte aligned; the data is laid out grouped by
// element size, largest first, in the given order within a group, so every tensor is aligned to
// its element size (Hugging Face orders the same way). Writes
// `path + ".tmp"`, fsyncs it and renames it to `path`, so `path` is never a partial file.
// Refuses empty, duplicate or "__metadata__" names, undefined and non-CPU tensors.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Writes `dir`/model-0000i-of-0000N.safetensors (tensors packed in order, a new shard started
// when the next tensor would push the current one past max_shard_bytes of data; a tensor larger
// than that gets a shard of its own) and then model.safetensors.index.json with
// {"metadata": {"total_size": bytes}, "weight_map": {name: shard}}. The index is written last (also
// via tmp + rename), so a complete index means complete shards. Always writes an index, even for
// one shard. `metadata` goes into every shard's __metadata__. Creates `dir` when missing.
// Returns the shard file names (without the directory) in order.
std::vector<std::string> save_sharded(const std::string& dir,
                                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                                      size_t max_shard_bytes,
                                      const std::map<std::string, std::string>& metadata = {});

}  // namespace dflash::io
