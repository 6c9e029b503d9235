#include "data/dataset.h"

#include <glob.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "core/error.h"

#include <nlohmann/json.hpp>

namespace dflash::data {

namespace fs = std::filesystem;

namespace {

constexpr const char* kRebuildHint =
    "the file is corrupt or was not written by dflash_data; rebuild it with `dflash_data convert` "
    "and check it with `dflash_data validate`";

// ---- reading helpers ----

bool has_attr(hid_t obj, const char* name, const std::string& path) {
  return DFLASH_H5_CHECK(H5Aexists(obj, name), "looking for attribute '" << name << "' in '" << path << "'") > 0;
}

std::string read_string_attr(hid_t obj, const char* name, const std::string& path) {
  H5Handle attr(DFLASH_H5_CHECK(H5Aopen(obj, name, H5P_DEFAULT), "opening attribute '" << name << "' of '" << path << "'"),
                H5Aclose);
  H5Handle type(DFLASH_H5_CHECK(H5Aget_type(attr), "reading the type of attribute '" << name << "' of '" << path << "'"),
                H5Tclose);
  DFLASH_REQUIRE_HINT(H5Tget_class(type) == H5T_STRING,
                    "dataset file '" << path << "': attribute '" << name << "' is not a string", kRebuildHint);
  const htri_t is_vlen = DFLASH_H5_CHECK(H5Tis_variable_str(type), "inspecting attribute '" << name << "'");
  if (is_vlen > 0) {
    // h5py writes str attributes as variable-length strings.
    H5Handle mem(DFLASH_H5_CHECK(H5Tcopy(H5T_C_S1), "string type"), H5Tclose);
    DFLASH_H5_CHECK(H5Tset_size(mem, H5T_VARIABLE), "string type");
    DFLASH_H5_CHECK(H5Tset_cset(mem, H5Tget_cset(type)), "string type");
    char* s = nullptr;
    DFLASH_H5_CHECK(H5Aread(attr, mem, &s), "reading attribute '" << name << "' of '" << path << "'");
    std::string out = s ? s : "";
    if (s) H5free_memory(s);
    return out;
  }
  const size_t n = H5Tget_size(type);
  std::string out(n, '\0');
  H5Handle mem(DFLASH_H5_CHECK(H5Tcopy(H5T_C_S1), "string type"), H5Tclose);
  DFLASH_H5_CHECK(H5Tset_size(mem, n), "string type");
  DFLASH_H5_CHECK(H5Tset_strpad(mem, H5T_STR_NULLPAD), "string type");
  DFLASH_H5_CHECK(H5Aread(attr, mem, out.data()), "reading attribute '" << name << "' of '" << path << "'");
  out.resize(std::strlen(out.c_str()));
  return out;
}

int64_t read_int_attr(hid_t obj, const char* name, const std::string& path) {
  H5Handle attr(DFLASH_H5_CHECK(H5Aopen(obj, name, H5P_DEFAULT), "opening attribute '" << name << "' of '" << path << "'"),
                H5Aclose);
  H5Handle type(DFLASH_H5_CHECK(H5Aget_type(attr), "reading attribute '" << name << "'"), H5Tclose);
  H5Handle space(DFLASH_H5_CHECK(H5Aget_space(attr), "reading attribute '" << name << "'"), H5Sclose);
  DFLASH_REQUIRE_HINT(H5Tget_class(type) == H5T_INTEGER && H5Sget_simple_extent_npoints(space) == 1,
                    "dataset file '" << path << "': attribute '" << name << "' is not one integer", kRebuildHint);
  int64_t v = 0;
  DFLASH_H5_CHECK(H5Aread(attr, H5T_NATIVE_INT64, &v), "reading attribute '" << name << "' of '" << path << "'");
  return v;
}

// Checks the file's attributes; returns vocab_size.
int64_t check_attributes(hid_t file, const std::string& path) {
  DFLASH_REQUIRE_HINT(has_attr(file, "format", path),
                    "dataset file '" << path << "' has no 'format' attribute: it is not a " << kFormat << " file",
                    "convert token data with `dflash_data convert` (JSONL rows {\"input_ids\": [...], \"loss_mask\": [...]})");
  const std::string format = read_string_attr(file, "format", path);
  DFLASH_REQUIRE_HINT(format == kFormat,
                    "dataset file '" << path << "': attribute 'format' is '" << format << "', expected '" << kFormat << "'",
                    "convert the data with this version's `dflash_data convert`");
  DFLASH_REQUIRE_HINT(has_attr(file, "vocab_size", path),
                    "dataset file '" << path << "' has no 'vocab_size' attribute", kRebuildHint);
  const int64_t vocab = read_int_attr(file, "vocab_size", path);
  DFLASH_REQUIRE_HINT(vocab > 0 && vocab <= (int64_t{1} << 31),
                    "dataset file '" << path << "': attribute 'vocab_size' = " << vocab << " is not a valid vocabulary size",
                    kRebuildHint);
  return vocab;
}

// The chunk cache of /input_ids and /loss_mask: the trainer reads whole sequences in random order, and with
// HDF5's default (1 MiB a dataset) nearly every read of a compressed file decompresses a chunk of 65,536
// tokens again (0.019 s of a 0.025 s GPU step for 16 sequences, bench/results/h200-text3). A Dataset's
// caches hold this many elements in all (256 MiB of int32 ids, 64 MiB of mask bytes: each file gets its share,
// filled as read), enough for the whole of a dataset of up to 64 Mi tokens.
constexpr int64_t kChunkCacheElements = int64_t{64} << 20;

// A dataset-access property list whose chunk cache holds `elements` elements of `elem_size` bytes in
// chunks of `chunk` elements (all of them up to `budget`).
H5Handle chunk_cache_plist(int64_t elements, size_t elem_size, int64_t chunk, int64_t budget, const std::string& path,
                           const char* name) {
  H5Handle dapl(DFLASH_H5_CHECK(H5Pcreate(H5P_DATASET_ACCESS), "a dataset-access property list for " << name << " of '" << path << "'"),
                H5Pclose);
  const int64_t cached = std::min(elements, budget) + chunk;
  const int64_t chunks = cached / std::max<int64_t>(chunk, 1) + 1;
  // Slots: about ten a chunk (HDF5's advice for few collisions), at least its default 521.
  DFLASH_H5_CHECK(H5Pset_chunk_cache(dapl, static_cast<size_t>(std::max<int64_t>(521, 10 * chunks + 1)),
                                     static_cast<size_t>(cached) * elem_size, 0.75),
                  "setting the chunk cache of " << name << " in '" << path << "'");
  return dapl;
}

// Opens a 1-D integer dataset; returns it and its length in elements. `cache_elements` > 0: reopened with a
// chunk cache of up to that many elements (chunk_cache_plist) when it is chunked; else HDF5's default cache.
H5Handle open_1d(hid_t file, const char* name, const std::string& path, int64_t* length, int64_t cache_elements = 0) {
  const htri_t exists = DFLASH_H5_CHECK(H5Lexists(file, name, H5P_DEFAULT), "looking for " << name << " in '" << path << "'");
  DFLASH_REQUIRE_HINT(exists > 0, "dataset file '" << path << "' has no dataset " << name, kRebuildHint);
  H5Handle ds(DFLASH_H5_CHECK(H5Dopen2(file, name, H5P_DEFAULT), "opening " << name << " in '" << path << "'"), H5Dclose);
  H5Handle type(DFLASH_H5_CHECK(H5Dget_type(ds), "reading the type of " << name << " in '" << path << "'"), H5Tclose);
  H5Handle space(DFLASH_H5_CHECK(H5Dget_space(ds), "reading the shape of " << name << " in '" << path << "'"), H5Sclose);
  DFLASH_REQUIRE_HINT(H5Tget_class(type) == H5T_INTEGER,
                    "dataset file '" << path << "': dataset " << name << " does not hold integers", kRebuildHint);
  DFLASH_REQUIRE_HINT(H5Sget_simple_extent_ndims(space) == 1,
                    "dataset file '" << path << "': dataset " << name << " is not 1-dimensional", kRebuildHint);
  hsize_t dim = 0;
  H5Sget_simple_extent_dims(space, &dim, nullptr);
  *length = static_cast<int64_t>(dim);
  if (cache_elements > 0) {
    H5Handle dcpl(DFLASH_H5_CHECK(H5Dget_create_plist(ds), "reading the layout of " << name << " in '" << path << "'"), H5Pclose);
    hsize_t chunk = 0;
    if (H5Pget_layout(dcpl) == H5D_CHUNKED && H5Pget_chunk(dcpl, 1, &chunk) == 1 && chunk > 0) {
      H5Handle dapl = chunk_cache_plist(*length, H5Tget_size(type), static_cast<int64_t>(chunk), cache_elements, path, name);
      ds = H5Handle();  // closed first: HDF5 shares one object (and its cache) among the opens of a dataset
      ds = H5Handle(DFLASH_H5_CHECK(H5Dopen2(file, name, dapl), "opening " << name << " in '" << path << "'"), H5Dclose);
    }
  }
  return ds;
}

// Reads elements [start, start + count) of a 1-D dataset, converted to `mem_type`.
void read_slice(hid_t ds, hid_t mem_type, int64_t start, int64_t count, void* out, const std::string& path,
                const char* name) {
  if (count == 0) return;
  H5Handle fspace(DFLASH_H5_CHECK(H5Dget_space(ds), "reading the shape of " << name << " in '" << path << "'"), H5Sclose);
  const hsize_t off = static_cast<hsize_t>(start), n = static_cast<hsize_t>(count);
  DFLASH_H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, &off, nullptr, &n, nullptr),
                  "selecting " << name << "[" << start << ", " << start + count << ") in '" << path << "'");
  H5Handle mspace(DFLASH_H5_CHECK(H5Screate_simple(1, &n, nullptr), "memory dataspace"), H5Sclose);
  DFLASH_H5_CHECK(H5Dread(ds, mem_type, mspace, fspace, H5P_DEFAULT, out),
                  "reading " << name << "[" << start << ", " << start + count << ") in '" << path << "'");
}

struct Structure {
  int64_t vocab_size = 0;
  std::vector<int64_t> offsets;
  H5Handle ids, mask;
};

// Everything but the token contents: attributes, datasets, offsets against the lengths.
// `cache_elements`: the chunk cache of /input_ids and /loss_mask (open_1d; 0: HDF5's default).
Structure check_structure(hid_t file, const std::string& path, int64_t cache_elements = 0) {
  Structure s;
  s.vocab_size = check_attributes(file, path);
  int64_t n_ids = 0, n_mask = 0, n_off = 0;
  s.ids = open_1d(file, "/input_ids", path, &n_ids, cache_elements);
  s.mask = open_1d(file, "/loss_mask", path, &n_mask, cache_elements);
  H5Handle off = open_1d(file, "/offsets", path, &n_off);
  DFLASH_REQUIRE_HINT(n_off >= 1, "dataset file '" << path << "': /offsets is empty; it must hold sequences + 1 values starting at 0",
                    kRebuildHint);
  s.offsets.resize(static_cast<size_t>(n_off));
  read_slice(off, H5T_NATIVE_INT64, 0, n_off, s.offsets.data(), path, "/offsets");
  DFLASH_REQUIRE_HINT(s.offsets[0] == 0, "dataset file '" << path << "': /offsets[0] = " << s.offsets[0] << ", expected 0",
                    kRebuildHint);
  for (int64_t i = 0; i + 1 < n_off; ++i) {
    const int64_t a = s.offsets[i], b = s.offsets[i + 1];
    DFLASH_REQUIRE_HINT(b >= a,
                      "dataset file '" << path << "': /offsets is not monotonic at sequence " << i << " (offsets[" << i
                                       << "] = " << a << ", offsets[" << i + 1 << "] = " << b << ")",
                      kRebuildHint);
    DFLASH_REQUIRE_HINT(b != a,
                      "dataset file '" << path << "': sequence " << i << " is empty (/offsets[" << i << "] = /offsets["
                                       << i + 1 << "] = " << a << ")",
                      "drop empty rows before converting; every sequence needs at least one token");
  }
  const int64_t last = s.offsets.back();
  DFLASH_REQUIRE_HINT(last == n_ids,
                    "dataset file '" << path << "': /offsets ends at " << last << " (after sequence " << n_off - 2
                                     << ") but /input_ids holds " << n_ids << " tokens",
                    kRebuildHint);
  DFLASH_REQUIRE_HINT(n_mask == n_ids,
                    "dataset file '" << path << "': /loss_mask holds " << n_mask << " values but /input_ids holds " << n_ids
                                     << " tokens (they must have the same length)",
                    kRebuildHint);
  return s;
}

H5Handle open_file(const std::string& path) {
  DFLASH_REQUIRE_HINT(fs::exists(path), "dataset file '" << path << "' does not exist",
                    "check the path; make one with `dflash_data convert` or `dflash_data synth`");
  return H5Handle(DFLASH_H5_CHECK(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "opening dataset file '" << path << "'"),
                  H5Fclose);
}

int bucket_of(int64_t len) {
  int k = 0;
  while ((int64_t{2} << k) <= len) ++k;
  return k;
}

bool is_pattern(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

// Token contents of sequences [first, end) of one file, whole sequences at a time in blocks of about
// block_tokens: ids in [0, vocab), mask values 0/1, lengths, supervised tokens and (within the first
// anchor_window tokens, when > 0) sequences without an anchor, added to `st`. Values are read
// widened (int64 / int32) so that a wrong stored type cannot wrap into range. `first_global` >= 0
// also names the sequence's global index (several files).
void check_sequences(hid_t ids_ds, hid_t mask_ds, const std::vector<int64_t>& off, int64_t first, int64_t end, int64_t vocab,
                     const std::string& path, int64_t first_global, int64_t anchor_window, const std::string& vocab_hint,
                     int64_t block_tokens, DatasetStats& st) {
  std::vector<int64_t> ids;
  std::vector<int32_t> mask;
  auto where = [&](int64_t seq, int64_t pos) {
    std::ostringstream o;
    o << "sequence " << seq;
    if (first_global >= 0) o << " (global sequence " << first_global + seq << ")";
    o << ", position " << pos;
    return o.str();
  };
  for (int64_t a = first; a < end;) {
    int64_t b = a + 1;
    while (b < end && off[b + 1] - off[a] <= block_tokens) ++b;
    const int64_t start = off[a], n = off[b] - start;
    ids.resize(static_cast<size_t>(n));
    mask.resize(static_cast<size_t>(n));
    read_slice(ids_ds, H5T_NATIVE_INT64, start, n, ids.data(), path, "/input_ids");
    read_slice(mask_ds, H5T_NATIVE_INT32, start, n, mask.data(), path, "/loss_mask");
    for (int64_t i = a; i < b; ++i) {
      const int64_t s0 = off[i] - start, len = off[i + 1] - off[i];
      bool anchor = false;
      for (int64_t t = 0; t < len; ++t) {
        const int64_t id = ids[static_cast<size_t>(s0 + t)];
        if (id < 0 || id >= vocab)
          DFLASH_REJECT_HINT("dataset file '" << path << "': /input_ids: " << where(i, t) << ": token id " << id
                                            << " is outside [0, vocab_size = " << vocab << ")",
                           (vocab_hint.empty() ? "the file's vocab_size attribute does not match the tokenizer that made "
                                                 "the ids; reconvert with the right --vocab-size"
                                               : vocab_hint));
        const int32_t m = mask[static_cast<size_t>(s0 + t)];
        if (m != 0 && m != 1)
          DFLASH_REJECT_HINT("dataset file '" << path << "': /loss_mask: " << where(i, t) << ": value " << m << " is not 0 or 1",
                           "loss_mask marks supervised tokens with 1 and the rest with 0; reconvert the data");
        st.supervised += m;
        if (m && t > 0 && mask[static_cast<size_t>(s0 + t - 1)] && (anchor_window <= 0 || t < anchor_window)) anchor = true;
      }
      if (!anchor) ++st.no_anchor;
      st.min_length = st.sequences == 0 ? len : std::min(st.min_length, len);
      st.max_length = std::max(st.max_length, len);
      st.histogram[bucket_of(len)] += 1;
      ++st.sequences;
      st.tokens += len;
    }
    a = b;
  }
}

}  // namespace

// ---------------------------------------------------------------- writer

DatasetWriter::DatasetWriter(std::string path, int64_t vocab_size, WriterOptions options)
    : path_(std::move(path)), tmp_path_(path_ + ".tmp"), vocab_size_(vocab_size), options_(options) {
  DFLASH_REQUIRE_HINT(vocab_size_ > 0 && vocab_size_ <= (int64_t{1} << 31),
                    "writing '" << path_ << "': vocab_size = " << vocab_size_ << " is not a valid vocabulary size",
                    "pass the tokenizer's vocabulary size (e.g. --vocab-size 151936)");
  DFLASH_REQUIRE(options_.chunk_tokens >= 1, "writing '" << path_ << "': chunk_tokens must be >= 1");
  DFLASH_REQUIRE(options_.compression >= 0 && options_.compression <= 9,
               "writing '" << path_ << "': compression level " << options_.compression << " is not in 0..9");
  const fs::path parent = fs::path(path_).parent_path();
  DFLASH_REQUIRE_HINT(parent.empty() || fs::is_directory(parent),
                    "writing '" << path_ << "': the directory '" << parent.string() << "' does not exist",
                    "create it first (mkdir -p " << parent.string() << "), or check the path");

  file_ = H5Handle(DFLASH_H5_CHECK(H5Fcreate(tmp_path_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT),
                                   "creating dataset file '" << tmp_path_ << "'"),
                   H5Fclose);
  {  // attributes
    H5Handle scalar(DFLASH_H5_CHECK(H5Screate(H5S_SCALAR), "scalar dataspace"), H5Sclose);
    H5Handle str(DFLASH_H5_CHECK(H5Tcopy(H5T_C_S1), "string type"), H5Tclose);
    DFLASH_H5_CHECK(H5Tset_size(str, std::strlen(kFormat)), "string type");
    DFLASH_H5_CHECK(H5Tset_strpad(str, H5T_STR_NULLPAD), "string type");
    H5Handle fa(DFLASH_H5_CHECK(H5Acreate2(file_, "format", str, scalar, H5P_DEFAULT, H5P_DEFAULT),
                                "creating attribute 'format' in '" << tmp_path_ << "'"),
                H5Aclose);
    DFLASH_H5_CHECK(H5Awrite(fa, str, kFormat), "writing attribute 'format' in '" << tmp_path_ << "'");
    H5Handle va(DFLASH_H5_CHECK(H5Acreate2(file_, "vocab_size", H5T_STD_I64LE, scalar, H5P_DEFAULT, H5P_DEFAULT),
                                "creating attribute 'vocab_size' in '" << tmp_path_ << "'"),
                H5Aclose);
    DFLASH_H5_CHECK(H5Awrite(va, H5T_NATIVE_INT64, &vocab_size_), "writing attribute 'vocab_size' in '" << tmp_path_ << "'");
  }
  auto create = [&](const char* name, hid_t file_type) {
    const hsize_t zero = 0, unlimited = H5S_UNLIMITED, chunk = static_cast<hsize_t>(options_.chunk_tokens);
    H5Handle space(DFLASH_H5_CHECK(H5Screate_simple(1, &zero, &unlimited), "dataspace for " << name), H5Sclose);
    H5Handle dcpl(DFLASH_H5_CHECK(H5Pcreate(H5P_DATASET_CREATE), "property list for " << name), H5Pclose);
    DFLASH_H5_CHECK(H5Pset_chunk(dcpl, 1, &chunk), "chunking " << name);
    if (options_.compression > 0) {
      DFLASH_H5_CHECK(H5Pset_shuffle(dcpl), "shuffle filter for " << name);
      DFLASH_H5_CHECK(H5Pset_deflate(dcpl, static_cast<unsigned>(options_.compression)), "deflate filter for " << name);
    }
    return H5Handle(DFLASH_H5_CHECK(H5Dcreate2(file_, name, file_type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT),
                                    "creating " << name << " in '" << tmp_path_ << "'"),
                    H5Dclose);
  };
  ids_ds_ = create("/input_ids", H5T_STD_I32LE);
  mask_ds_ = create("/loss_mask", H5T_STD_U8LE);
  ids_buf_.reserve(static_cast<size_t>(options_.chunk_tokens));
  mask_buf_.reserve(static_cast<size_t>(options_.chunk_tokens));
}

DatasetWriter::~DatasetWriter() {
  if (finished_) return;
  ids_ds_.reset();
  mask_ds_.reset();
  file_.reset();
  std::error_code ec;
  fs::remove(tmp_path_, ec);
}

void DatasetWriter::append(std::span<const int32_t> ids, std::span<const uint8_t> mask) {
  DFLASH_CHECK(!finished_, "writing '" << path_ << "': append after finish");
  const int64_t seq = num_sequences();
  DFLASH_REQUIRE_HINT(!ids.empty(), "writing '" << path_ << "': sequence " << seq << " is empty",
                    "drop empty rows; every sequence needs at least one token");
  DFLASH_REQUIRE_HINT(ids.size() == mask.size(),
                    "writing '" << path_ << "': sequence " << seq << " has " << ids.size() << " input_ids but "
                                << mask.size() << " loss_mask values",
                    "input_ids and loss_mask must have one value per token");
  for (size_t t = 0; t < ids.size(); ++t) {
    DFLASH_REQUIRE_HINT(ids[t] >= 0 && ids[t] < vocab_size_,
                      "writing '" << path_ << "': sequence " << seq << ", position " << t << ": token id " << ids[t]
                                  << " is outside [0, vocab_size = " << vocab_size_ << ")",
                      "check --vocab-size against the tokenizer that produced the ids");
    DFLASH_REQUIRE_HINT(mask[t] <= 1,
                      "writing '" << path_ << "': sequence " << seq << ", position " << t << ": loss_mask value "
                                  << int(mask[t]) << " is not 0 or 1",
                      "loss_mask marks supervised tokens with 1 and the rest with 0");
  }
  // Buffer; flush whole chunks so that the datasets grow by chunks.
  size_t pos = 0;
  while (pos < ids.size()) {
    const size_t room = static_cast<size_t>(options_.chunk_tokens) - ids_buf_.size();
    const size_t take = std::min(room, ids.size() - pos);
    ids_buf_.insert(ids_buf_.end(), ids.begin() + pos, ids.begin() + pos + take);
    mask_buf_.insert(mask_buf_.end(), mask.begin() + pos, mask.begin() + pos + take);
    pos += take;
    if (ids_buf_.size() == static_cast<size_t>(options_.chunk_tokens)) flush();
  }
  offsets_.push_back(offsets_.back() + static_cast<int64_t>(ids.size()));
}

void DatasetWriter::flush() {
  if (ids_buf_.empty()) return;
  const hsize_t start = static_cast<hsize_t>(written_tokens_), n = ids_buf_.size(), total = start + n;
  auto write = [&](hid_t ds, hid_t mem_type, const void* data, const char* name) {
    DFLASH_H5_CHECK(H5Dset_extent(ds, &total), "extending " << name << " in '" << tmp_path_ << "'");
    H5Handle fspace(DFLASH_H5_CHECK(H5Dget_space(ds), "dataspace of " << name), H5Sclose);
    DFLASH_H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, &start, nullptr, &n, nullptr), "selecting in " << name);
    H5Handle mspace(DFLASH_H5_CHECK(H5Screate_simple(1, &n, nullptr), "memory dataspace"), H5Sclose);
    DFLASH_H5_CHECK(H5Dwrite(ds, mem_type, mspace, fspace, H5P_DEFAULT, data),
                    "writing " << name << " in '" << tmp_path_ << "'");
  };
  write(ids_ds_, H5T_NATIVE_INT32, ids_buf_.data(), "/input_ids");
  write(mask_ds_, H5T_NATIVE_UINT8, mask_buf_.data(), "/loss_mask");
  written_tokens_ = static_cast<int64_t>(total);
  ids_buf_.clear();
  mask_buf_.clear();
}

void DatasetWriter::finish() {
  DFLASH_CHECK(!finished_, "writing '" << path_ << "': finish called twice");
  flush();
  {
    const hsize_t n = offsets_.size();
    const hsize_t chunk = std::min<hsize_t>(n, 1 << 16);
    H5Handle space(DFLASH_H5_CHECK(H5Screate_simple(1, &n, nullptr), "dataspace for /offsets"), H5Sclose);
    H5Handle dcpl(DFLASH_H5_CHECK(H5Pcreate(H5P_DATASET_CREATE), "property list for /offsets"), H5Pclose);
    DFLASH_H5_CHECK(H5Pset_chunk(dcpl, 1, &chunk), "chunking /offsets");
    if (options_.compression > 0) {
      DFLASH_H5_CHECK(H5Pset_shuffle(dcpl), "shuffle filter for /offsets");
      DFLASH_H5_CHECK(H5Pset_deflate(dcpl, static_cast<unsigned>(options_.compression)), "deflate filter for /offsets");
    }
    H5Handle ds(DFLASH_H5_CHECK(H5Dcreate2(file_, "/offsets", H5T_STD_I64LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT),
                                "creating /offsets in '" << tmp_path_ << "'"),
                H5Dclose);
    DFLASH_H5_CHECK(H5Dwrite(ds, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, offsets_.data()),
                    "writing /offsets in '" << tmp_path_ << "'");
    ds.close("/offsets in '" + tmp_path_ + "'");
  }
  ids_ds_.close("/input_ids in '" + tmp_path_ + "'");
  mask_ds_.close("/loss_mask in '" + tmp_path_ + "'");
  DFLASH_H5_CHECK(H5Fflush(file_, H5F_SCOPE_GLOBAL), "flushing '" << tmp_path_ << "'");
  file_.close("dataset file '" + tmp_path_ + "'");
  DFLASH_CHECK_IO(std::rename(tmp_path_.c_str(), path_.c_str()) == 0, "renaming '" + tmp_path_ + "' to", path_);
  finished_ = true;
}

// ---------------------------------------------------------------- paths

std::vector<std::string> expand_paths(const std::vector<std::string>& specs) {
  std::vector<std::string> out;
  for (const std::string& spec : specs) {
    std::vector<std::string> found;
    if (is_pattern(spec) && !fs::exists(spec)) {
      glob_t g{};
      const int rc = ::glob(spec.c_str(), 0, nullptr, &g);
      if (rc == 0)
        for (size_t i = 0; i < g.gl_pathc; ++i) found.emplace_back(g.gl_pathv[i]);
      globfree(&g);
      DFLASH_REQUIRE_HINT(!found.empty(), "data files: the pattern '" << spec << "' matches no file",
                        "check the pattern; quote it so that the shell does not expand it");
    } else if (fs::is_directory(spec)) {
      for (const auto& e : fs::directory_iterator(spec))
        if (e.is_regular_file() && e.path().extension() == ".h5") found.push_back(e.path().string());
      DFLASH_REQUIRE_HINT(!found.empty(), "data files: the directory '" << spec << "' holds no *.h5 file",
                        "convert data into it with `dflash_data convert` or `dflash_data synth`");
    } else {
      DFLASH_REQUIRE_HINT(fs::exists(spec), "dataset file '" << spec << "' does not exist",
                        "check the path; make one with `dflash_data convert` or `dflash_data synth`");
      found.push_back(spec);
    }
    std::sort(found.begin(), found.end());
    out.insert(out.end(), found.begin(), found.end());
  }
  DFLASH_REQUIRE_HINT(!out.empty(), "no dataset files given", "name .h5 files, a directory or a glob pattern");
  return out;
}

// ---------------------------------------------------------------- reader

Dataset::Dataset(const std::vector<std::string>& specs) {
  const std::vector<std::string> paths = expand_paths(specs);
  // The chunk caches' budget, shared equally by the files (sequences are read in random order).
  const int64_t cache_per_file = std::max<int64_t>(1, kChunkCacheElements / static_cast<int64_t>(paths.size()));
  for (const std::string& path : paths) {
    Open o;
    o.file = open_file(path);
    Structure s = check_structure(o.file, path, cache_per_file);
    o.ids = std::move(s.ids);
    o.mask = std::move(s.mask);
    o.offsets = std::move(s.offsets);
    FileInfo info;
    info.path = path;
    info.vocab_size = s.vocab_size;
    info.num_sequences = static_cast<int64_t>(o.offsets.size()) - 1;
    info.num_tokens = o.offsets.back();
    info.first_sequence = num_sequences_;
    if (!infos_.empty())
      DFLASH_REQUIRE_HINT(info.vocab_size == infos_.front().vocab_size,
                        "dataset file '" << path << "' has vocab_size " << info.vocab_size << " but '"
                                         << infos_.front().path << "' has " << infos_.front().vocab_size,
                        "all files of one dataset must come from the same tokenizer");
    vocab_size_ = info.vocab_size;
    num_sequences_ += info.num_sequences;
    num_tokens_ += info.num_tokens;
    infos_.push_back(info);
    open_.push_back(std::move(o));
  }
}

std::pair<size_t, int64_t> Dataset::locate(int64_t i) const {
  DFLASH_CHECK(i >= 0 && i < num_sequences_, "sequence index " << i << " is outside [0, " << num_sequences_ << ")");
  // The last file whose first_sequence <= i.
  auto it = std::upper_bound(infos_.begin(), infos_.end(), i,
                             [](int64_t v, const FileInfo& f) { return v < f.first_sequence; });
  const size_t f = static_cast<size_t>(it - infos_.begin()) - 1;
  return {f, i - infos_[f].first_sequence};
}

int64_t Dataset::length(int64_t i) const {
  auto [f, j] = locate(i);
  return open_[f].offsets[j + 1] - open_[f].offsets[j];
}

Sequence Dataset::sequence(int64_t i, int64_t max_tokens) const {
  auto [f, j] = locate(i);
  const Open& o = open_[f];
  const int64_t start = o.offsets[j];
  int64_t len = o.offsets[j + 1] - start;
  if (max_tokens >= 0) len = std::min(len, max_tokens);
  Sequence s;
  s.ids.resize(static_cast<size_t>(len));
  s.mask.resize(static_cast<size_t>(len));
  read_slice(o.ids, H5T_NATIVE_INT32, start, len, s.ids.data(), infos_[f].path, "/input_ids");
  read_slice(o.mask, H5T_NATIVE_UINT8, start, len, s.mask.data(), infos_[f].path, "/loss_mask");
  return s;
}

// ---------------------------------------------------------------- JSONL rows

namespace {

constexpr const char* kRowHint =
    "each line must be a JSON object {\"input_ids\": [int, ...], \"loss_mask\": [0|1, ...]} with one mask value per id";

}  // namespace

Sequence parse_token_row(const std::string& line, const std::string& where, int64_t vocab, const std::string& vocab_name,
                         bool mask_required) {
  using nlohmann::json;
  json row;
  try {
    row = json::parse(line);
  } catch (const json::parse_error& e) {
    DFLASH_REJECT_HINT(where << ": not valid JSON (" << e.what() << ")", kRowHint);
  }
  DFLASH_REQUIRE_HINT(row.is_object(), where << ": the row is not a JSON object", kRowHint);
  const bool has_mask = mask_required || row.contains("loss_mask");
  for (const char* key : {"input_ids", "loss_mask"}) {
    if (!has_mask && std::string(key) == "loss_mask") continue;
    DFLASH_REQUIRE_HINT(row.contains(key), where << ": the row has no \"" << key << "\"", kRowHint);
    DFLASH_REQUIRE_HINT(row[key].is_array(), where << ": \"" << key << "\" is not an array", kRowHint);
  }
  const json& ids = row["input_ids"];
  const json empty = json::array();
  const json& mask = has_mask ? row["loss_mask"] : empty;
  DFLASH_REQUIRE_HINT(!ids.empty(), where << ": \"input_ids\" is empty", "drop empty rows; every sequence needs a token");
  DFLASH_REQUIRE_HINT(!has_mask || ids.size() == mask.size(),
                    where << ": \"input_ids\" has " << ids.size() << " values but \"loss_mask\" has " << mask.size(),
                    kRowHint);
  Sequence out;
  Sequence* s = &out;
  s->ids.resize(ids.size());
  s->mask.resize(has_mask ? ids.size() : 0);
  for (size_t t = 0; t < ids.size(); ++t) {
    // An integer literal beyond 64 bits parses as a float (1e+20), one beyond int64 as an unsigned:
    // both are ids far outside any vocabulary, not "not an integer" nor a wrapped negative number.
    const bool huge = (ids[t].is_number_float() && std::isfinite(ids[t].get<double>()) &&
                       std::abs(ids[t].get<double>()) >= 9007199254740992.0 /* 2^53 */) ||
                      (ids[t].is_number_unsigned() && ids[t].get<uint64_t>() > static_cast<uint64_t>(INT64_MAX));
    DFLASH_REQUIRE_HINT(!huge,
                      where << ": input_ids[" << t << "] = " << ids[t].dump() << " is far outside [0, " << vocab_name << " = " << vocab
                            << ")",
                      "token ids are integers below the tokenizer's vocabulary size; check what wrote this row");
    DFLASH_REQUIRE_HINT(ids[t].is_number_integer(), where << ": input_ids[" << t << "] = " << ids[t].dump() << " is not an integer",
                      kRowHint);
    const int64_t id = ids[t].get<int64_t>();
    DFLASH_REQUIRE_HINT(id >= 0 && id < vocab,
                      where << ": input_ids[" << t << "] = " << id << " is outside [0, " << vocab_name << " = " << vocab << ")",
                      "check " << vocab_name << " against the tokenizer that produced the ids");
    s->ids[t] = static_cast<int32_t>(id);
    if (!has_mask) continue;
    DFLASH_REQUIRE_HINT(mask[t].is_number_integer() || mask[t].is_boolean(),
                      where << ": loss_mask[" << t << "] = " << mask[t].dump() << " is not 0 or 1", kRowHint);
    const int64_t m = mask[t].is_boolean() ? int64_t{mask[t].get<bool>()} : mask[t].get<int64_t>();
    DFLASH_REQUIRE_HINT(m == 0 || m == 1, where << ": loss_mask[" << t << "] = " << m << " is not 0 or 1", kRowHint);
    s->mask[t] = static_cast<uint8_t>(m);
  }
  return out;
}


// ---------------------------------------------------------------- validation

void DatasetStats::add(const DatasetStats& o) {
  if (o.sequences == 0) return;
  min_length = sequences == 0 ? o.min_length : std::min(min_length, o.min_length);
  max_length = std::max(max_length, o.max_length);
  sequences += o.sequences;
  tokens += o.tokens;
  supervised += o.supervised;
  no_anchor += o.no_anchor;
  for (auto [k, n] : o.histogram) histogram[k] += n;
}

DatasetStats validate_file(const std::string& path, int64_t block_tokens) {
  DFLASH_CHECK(block_tokens >= 1, "validate_file: block_tokens must be >= 1");
  H5Handle file = open_file(path);
  Structure s = check_structure(file, path);
  DatasetStats st;
  check_sequences(s.ids, s.mask, s.offsets, 0, static_cast<int64_t>(s.offsets.size()) - 1, s.vocab_size, path, -1, 0, {},
                  block_tokens, st);
  return st;
}

DatasetStats Dataset::check_contents(int64_t first, int64_t end, int64_t anchor_window, const std::string& vocab_hint,
                                     int64_t block_tokens) const {
  DFLASH_CHECK(block_tokens >= 1, "check_contents: block_tokens must be >= 1");
  DFLASH_CHECK(0 <= first && first <= end && end <= num_sequences_,
               "check_contents: sequences [" << first << ", " << end << ") are outside [0, " << num_sequences_ << ")");
  DatasetStats st;
  for (size_t f = 0; f < infos_.size() && first < end; ++f) {
    const FileInfo& fi = infos_[f];
    const int64_t lo = std::max(first, fi.first_sequence), hi = std::min(end, fi.first_sequence + fi.num_sequences);
    if (lo >= hi) continue;
    check_sequences(open_[f].ids, open_[f].mask, open_[f].offsets, lo - fi.first_sequence, hi - fi.first_sequence,
                    fi.vocab_size, fi.path, fi.first_sequence, anchor_window, vocab_hint, block_tokens, st);
  }
  return st;
}

std::vector<int32_t> prompt_of(const Sequence& s) {
  size_t n = 0;
  while (n < s.ids.size() && (s.mask.empty() || !s.mask[n])) ++n;
  return std::vector<int32_t>(s.ids.begin(), s.ids.begin() + static_cast<std::ptrdiff_t>(n));
}

}  // namespace dflash::data
