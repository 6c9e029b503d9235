#include "core/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>

#include "core/error.h"

namespace dflash::io {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host would need byte swapping");

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Every dtype this reader and writer take, with its name in the safetensors header, in the order the
// messages list them: the one place the names are written.
struct DtypeName {
  DType dtype;
  const char* name;
};
constexpr DtypeName kSupported[] = {{DType::BF16, "BF16"}, {DType::F16, "F16"}, {DType::F32, "F32"},
                                    {DType::F64, "F64"},   {DType::I32, "I32"}, {DType::I64, "I64"},
                                    {DType::U8, "U8"},     {DType::F8E4M3, "F8_E4M3"}};

// Quotes a string for messages (names come from files and may hold anything).
std::string q(const std::string& s) {
  std::string out = "'";
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (out.size() > 202) out = out.substr(0, 200) + "...";
  return out + "'";
}

std::string file_ctx(const std::string& path) { return "safetensors file " + q(path); }
std::string tensor_ctx(const std::string& path, const std::string& name) {
  return file_ctx(path) + ": tensor " + q(name);
}

const char* kTruncatedHint =
    "the file looks truncated or corrupt (an interrupted download or copy?); fetch it again";

// A JSON value as a non-negative integer that fits in int64 (dims) or uint64 (offsets).
enum class IntCheck { Ok, NotInteger, Negative, TooLarge };
IntCheck as_nonneg_int(const json& v, uint64_t limit, uint64_t* out) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > limit) return IntCheck::TooLarge;
    *out = u;
    return IntCheck::Ok;
  }
  if (v.is_number_integer()) {
    int64_t i = v.get<int64_t>();
    if (i < 0) return IntCheck::Negative;
    *out = static_cast<uint64_t>(i);
    return static_cast<uint64_t>(i) > limit ? IntCheck::TooLarge : IntCheck::Ok;
  }
  if (v.is_number_float()) {
    // nlohmann stores integers beyond 64 bits as floats, so a huge "integer" lands here too.
    double d = v.get<double>();
    if (d < 0) return IntCheck::Negative;
    if (d >= 9.2e18) return IntCheck::TooLarge;
  }
  return IntCheck::NotInteger;
}

const char* int_problem(IntCheck c) {
  switch (c) {
    case IntCheck::NotInteger: return "is not an integer";
    case IntCheck::Negative: return "is negative";
    case IntCheck::TooLarge: return "is too large";
    case IntCheck::Ok: break;
  }
  return "is invalid";
}

std::string list_names(const std::vector<std::string>& names, size_t max_shown = 10) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < max_shown; ++i) s += (i ? ", " : "") + q(names[i]);
  if (names.size() > max_shown) s += ", ... (" + std::to_string(names.size()) + " in all)";
  return s;
}

// Parses and validates one tensor entry of a header.
TensorInfo parse_entry(const std::string& path, const std::string& name, const json& e, size_t data_offset,
                       size_t data_size, size_t file_size) {
  const std::string ctx = tensor_ctx(path, name);
  const char* hint = "each tensor entry must be {\"dtype\": \"BF16\", \"shape\": [..], \"data_offsets\": [begin, end]}";
  DFLASH_REQUIRE_HINT(e.is_object(), ctx << ": header entry is a JSON " << e.type_name() << ", not an object", hint);
  for (const char* key : {"dtype", "shape", "data_offsets"})
    DFLASH_REQUIRE_HINT(e.contains(key), ctx << ": header entry has no \"" << key << "\"", hint);
  const json& jd = e.at("dtype");
  const json& js = e.at("shape");
  const json& jo = e.at("data_offsets");
  DFLASH_REQUIRE_HINT(jd.is_string(), ctx << ": \"dtype\" is a JSON " << jd.type_name() << ", not a string", hint);
  DFLASH_REQUIRE_HINT(js.is_array(), ctx << ": \"shape\" is a JSON " << js.type_name() << ", not an array", hint);
  DFLASH_REQUIRE_HINT(jo.is_array() && jo.size() == 2,
                    ctx << ": \"data_offsets\" must be an array of two integers [begin, end], got " << jo.dump(),
                    hint);

  TensorInfo info;
  const std::string dts = jd.get<std::string>();
  auto dt = safetensors_dtype_from_string(dts);
  DFLASH_REQUIRE_HINT(dt.has_value(), ctx << ": dtype " << q(dts) << " is not supported",
                    "supported dtypes: " << safetensors_supported_dtypes()
                                         << " (convert the checkpoint, e.g. BOOL/I8/F8_E5M2 tensors to U8/BF16)");
  info.dtype = *dt;

  // Element count with overflow checks: the product of the non-zero dims must fit in int64, so
  // every partial product (as Tensor computes them) fits too, even when a dim is 0.
  uint64_t numel_nonzero = 1;
  bool any_zero = false;
  info.shape.reserve(js.size());
  for (size_t i = 0; i < js.size(); ++i) {
    uint64_t d = 0;
    IntCheck c = as_nonneg_int(js[i], static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), &d);
    DFLASH_REQUIRE_HINT(c == IntCheck::Ok, ctx << ": shape " << js.dump() << ": dim " << i << " (" << js[i].dump() << ") "
                                             << int_problem(c),
                      "dims must be non-negative integers");
    if (d == 0) any_zero = true;
    else
      DFLASH_REQUIRE(!__builtin_mul_overflow(numel_nonzero, d, &numel_nonzero) &&
                       numel_nonzero <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                   ctx << ": shape " << js.dump() << " has too many elements (overflows 64 bits)");
    info.shape.push_back(static_cast<int64_t>(d));
  }
  const uint64_t numel = any_zero ? 0 : numel_nonzero;
  uint64_t expect_bytes = 0;
  DFLASH_REQUIRE(!__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(info.dtype)), &expect_bytes),
               ctx << ": shape " << js.dump() << " x " << dts << " overflows 64 bits");

  uint64_t off[2] = {0, 0};
  for (size_t i = 0; i < 2; ++i) {
    IntCheck c = as_nonneg_int(jo[i], std::numeric_limits<uint64_t>::max(), &off[i]);
    DFLASH_REQUIRE_HINT(c == IntCheck::Ok, ctx << ": data_offsets " << jo.dump() << ": " << (i ? "end" : "begin") << " "
                                             << int_problem(c),
                      hint);
  }
  DFLASH_REQUIRE(off[0] <= off[1], ctx << ": data_offsets " << jo.dump() << " has begin " << off[0] << " > end " << off[1]);
  const uint64_t span = off[1] - off[0];
  DFLASH_REQUIRE_HINT(span == expect_bytes,
                    ctx << ": shape " << shape_str(info.shape) << " x " << dts << " (" << dtype_size(info.dtype)
                        << " bytes) = " << expect_bytes << " bytes, but data_offsets " << jo.dump() << " span " << span
                        << " bytes",
                    "the header is corrupt or was written with a different dtype/shape");
  DFLASH_REQUIRE_HINT(off[1] <= data_size,
                    ctx << ": data_offsets " << jo.dump() << " run past the end of the data region (" << data_size
                        << " bytes; file " << file_size << " bytes)",
                    kTruncatedHint);
  info.begin = static_cast<size_t>(off[0]);
  info.end = static_cast<size_t>(off[1]);
  info.aligned = (data_offset + info.begin) % dtype_size(info.dtype) == 0;
  return info;
}

// The format requires the tensors to tile the data region: sorted by offset, the first begins at 0,
// each begins where the previous one ended, and the last ends at the end of the file.
void check_coverage(const std::string& path, const std::map<std::string, TensorInfo>& tensors, size_t data_size) {
  std::vector<std::tuple<size_t, size_t, const std::string*>> r;
  r.reserve(tensors.size());
  for (const auto& [name, info] : tensors) r.emplace_back(info.begin, info.end, &name);
  std::sort(r.begin(), r.end(), [](const auto& a, const auto& b) {
    if (std::get<0>(a) != std::get<0>(b)) return std::get<0>(a) < std::get<0>(b);
    if (std::get<1>(a) != std::get<1>(b)) return std::get<1>(a) < std::get<1>(b);
    return *std::get<2>(a) < *std::get<2>(b);
  });
  const char* hint = "the tensors' data_offsets must cover the data region contiguously, without gaps or overlaps";
  size_t prev_begin = 0, prev_end = 0;
  const std::string* prev = nullptr;
  for (const auto& [b, e, name] : r) {
    if (b > prev_end) {
      DFLASH_REJECT_HINT(file_ctx(path) << ": gap of " << (b - prev_end) << " bytes [" << prev_end << ", " << b
                                      << ") not covered by any tensor, "
                                      << (prev ? "between tensor " + q(*prev) + " [" + std::to_string(prev_begin) +
                                                     ", " + std::to_string(prev_end) + ") and"
                                               : std::string("before the first tensor"))
                                      << " tensor " << q(*name) << " [" << b << ", " << e << ")",
                       hint);
    }
    if (b < prev_end) {
      DFLASH_REJECT_HINT(file_ctx(path) << ": tensors " << q(*prev) << " [" << prev_begin << ", " << prev_end << ") and "
                                      << q(*name) << " [" << b << ", " << e << ") overlap",
                       hint);
    }
    prev_begin = b;
    prev_end = e;
    prev = name;
  }
  if (prev_end != data_size) {
    DFLASH_REJECT_HINT(file_ctx(path) << ": the data region has " << data_size << " bytes but the tensors cover only "
                                    << prev_end << "; " << (data_size - prev_end) << " trailing bytes "
                                    << (prev ? "after the last tensor " + q(*prev) : std::string("with no tensors")),
                     "the header does not describe the whole file (corrupt, or data appended by another tool)");
  }
}

// Whole-file write through `path.tmp` + fsync + rename; the destructor removes the temporary on failure.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    DFLASH_CHECK_IO(fd_ >= 0, "create", tmp_);
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }

  void write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      size_t chunk = std::min<size_t>(n, size_t{1} << 30);
      ssize_t w = ::write(fd_, p, chunk);
      if (w < 0 && errno == EINTR) continue;
      if (w == 0) errno = 0;  // "short transfer" rather than a stale errno
      DFLASH_CHECK_IO(w > 0, "write", tmp_);
      p += w;
      n -= static_cast<size_t>(w);
    }
  }

  void commit() {
    DFLASH_CHECK_IO(::fsync(fd_) == 0, "fsync", tmp_);
    int rc = ::close(fd_);
    fd_ = -1;
    DFLASH_CHECK_IO(rc == 0, "close", tmp_);
    DFLASH_CHECK_IO(::rename(tmp_.c_str(), path_.c_str()) == 0, "rename to " + q(path_) + " from", tmp_);
    committed_ = true;
    // Make the rename itself durable; best effort (some file systems refuse fsync on directories).
    fs::path parent = fs::path(path_).parent_path();
    if (parent.empty()) parent = ".";
    int dfd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      (void)::fsync(dfd);
      ::close(dfd);
    }
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

std::string dump_json(const json& j, int indent, const std::string& what) {
  try {
    return j.dump(indent);
  } catch (const json::exception& e) {
    DFLASH_REJECT_HINT("cannot write " << what << ": " << e.what(), "tensor names and metadata must be valid UTF-8");
  }
}

void check_tensor_for_save(const std::string& path, const std::string& name, const Tensor& t,
                           std::set<std::string>& seen) {
  DFLASH_CHECK(!name.empty(), "save " << q(path) << ": a tensor has an empty name");
  DFLASH_CHECK(name != "__metadata__", "save " << q(path) << ": \"__metadata__\" is reserved and cannot name a tensor");
  DFLASH_CHECK(seen.insert(name).second, "save " << q(path) << ": duplicate tensor name " << q(name));
  DFLASH_CHECK(t.defined(), "save " << q(path) << ": tensor " << q(name) << " is undefined");
  DFLASH_REQUIRE_HINT(t.device().is_cpu(),
                    "save " << q(path) << ": tensor " << q(name) << " is on " << t.device().str()
                            << "; only host tensors can be written",
                    "copy it to the host first with .to(Device::cpu())");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// dtypes

std::optional<DType> safetensors_dtype_from_string(std::string_view s) {
  for (const DtypeName& d : kSupported)
    if (s == d.name) return d.dtype;
  return std::nullopt;
}

const char* safetensors_dtype_string(DType t) {
  for (const DtypeName& d : kSupported)
    if (d.dtype == t) return d.name;
  return "?";
}

const char* safetensors_supported_dtypes() {
  static const std::string names = [] {
    std::string s;
    for (const DtypeName& d : kSupported) s += std::string(s.empty() ? "" : ", ") + d.name;
    return s;
  }();
  return names.c_str();
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const std::string ctx = file_ctx(path);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DFLASH_CHECK_IO(fd >= 0, "open safetensors file", path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    errno = e;
    DFLASH_CHECK_IO(false, "stat", path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    DFLASH_REJECT(ctx << " is not a regular file");
  }
  file_size_ = static_cast<size_t>(st.st_size);
  if (file_size_ < 8) {
    ::close(fd);
    DFLASH_REJECT_HINT(ctx << " is " << file_size_ << " bytes, shorter than the 8-byte header length", kTruncatedHint);
  }
  void* base = ::mmap(nullptr, file_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_errno = errno;
  ::close(fd);  // the mapping keeps the file referenced
  errno = map_errno;
  DFLASH_CHECK_IO(base != MAP_FAILED, "mmap", path);
  const size_t len = file_size_;
  mapping_ = std::shared_ptr<void>(base, [len](void* p) { ::munmap(p, len); });

  const auto* bytes = static_cast<const unsigned char*>(base);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  DFLASH_REQUIRE_HINT(n <= file_size_ - 8,
                    ctx << ": header length " << n << " is larger than the rest of the file (" << (file_size_ - 8)
                        << " bytes after the 8-byte length)",
                    (n > kSafetensorsMaxHeaderBytes
                         ? "this is not a safetensors file (a PyTorch .bin / pickle checkpoint?) or it is corrupt"
                         : kTruncatedHint));
  DFLASH_REQUIRE_HINT(n <= kSafetensorsMaxHeaderBytes,
                    ctx << ": header length " << n << " exceeds the " << (kSafetensorsMaxHeaderBytes >> 20)
                        << " MiB limit",
                    "this is not a safetensors file or it is corrupt");
  data_offset_ = 8 + static_cast<size_t>(n);
  const size_t data_size = file_size_ - data_offset_;
  const char* hdr = reinterpret_cast<const char*>(bytes + 8);
  const size_t hlen = static_cast<size_t>(n);

  const char* hint_json = "the header must be one UTF-8 JSON object; the file is corrupt or not a safetensors file";
  DFLASH_REQUIRE_HINT(std::memchr(hdr, '\0', hlen) == nullptr, ctx << ": header contains a NUL byte", hint_json);

  // Parse, remembering duplicate top-level keys (nlohmann would silently keep only one of them).
  std::set<std::string> keys;
  std::vector<std::string> dups;
  json root;
  try {
    json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) {
      if (ev == json::parse_event_t::key && depth == 1 && parsed.is_string()) {
        const auto& k = parsed.get_ref<const std::string&>();
        if (!keys.insert(k).second) dups.push_back(k);
      }
      return true;
    };
    root = json::parse(hdr, hdr + hlen, cb);
  } catch (const json::exception& e) {
    DFLASH_REJECT_HINT(ctx << ": header (" << hlen << " bytes) is not valid JSON: " << e.what(), hint_json);
  }
  DFLASH_REQUIRE_HINT(root.is_object(), ctx << ": header is a JSON " << root.type_name() << ", not an object", hint_json);
  DFLASH_REQUIRE(dups.empty(), ctx << ": header names " << list_names(dups) << " more than once");

  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      DFLASH_REQUIRE_HINT(entry.is_object(), ctx << ": \"__metadata__\" is a JSON " << entry.type_name()
                                               << ", not an object",
                        "__metadata__ must map strings to strings");
      for (const auto& [k, v] : entry.items()) {
        DFLASH_REQUIRE_HINT(v.is_string(), ctx << ": __metadata__ value for " << q(k) << " is a JSON " << v.type_name()
                                             << ", not a string",
                          "__metadata__ must map strings to strings");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    tensors_.emplace(name, parse_entry(path, name, entry, data_offset_, data_size, file_size_));
  }
  check_coverage(path, tensors_, data_size);
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& kv : tensors_) out.push_back(kv.first);
  return out;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = tensors_.find(name);
  DFLASH_REQUIRE_HINT(it != tensors_.end(),
                    (is_open() ? file_ctx(path_) : std::string("safetensors file (not opened)"))
                        << " has no tensor " << q(name),
                    "check the tensor name; the file has " << tensors_.size() << " tensors");
  return it->second;
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const TensorInfo& i = info(name);
  auto* base = static_cast<char*>(mapping_.get());
  // The mapping is PROT_READ: the view is read-only in practice (Tensor has no const flavour).
  Tensor view = Tensor::from_blob(base + data_offset_ + i.begin, i.shape, i.dtype, Device::cpu(), mapping_);
  // Typed loads through a misaligned pointer are undefined behaviour (and break vector code):
  // such tensors (only in files from writers that do not align) come back as aligned copies.
  return i.aligned ? view : view.clone();
}

// ---------------------------------------------------------------------------------------------
// SafetensorsIndex

namespace {

std::string read_small_file(const std::string& path, size_t limit) {
  std::ifstream in(path, std::ios::binary);
  DFLASH_CHECK_IO(in.good(), "open", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  DFLASH_CHECK_IO(!in.bad(), "read", path);
  std::string s = ss.str();
  DFLASH_REQUIRE(s.size() <= limit, "file " << q(path) << " is " << s.size() << " bytes, larger than the "
                                          << (limit >> 20) << " MiB limit for an index");
  return s;
}

bool safe_relative(const std::string& f) {
  fs::path p(f);
  if (f.empty() || p.is_absolute()) return false;
  for (const auto& part : p)
    if (part == "..") return false;
  return true;
}

}  // namespace

SafetensorsIndex SafetensorsIndex::open(const std::string& path) {
  SafetensorsIndex ix;
  std::error_code ec;
  const fs::path p(path);
  const char* expect_hint =
      "a model directory needs model.safetensors, or model.safetensors.index.json plus the shards it names";

  if (fs::is_regular_file(p, ec)) {
    const std::string fname = p.filename().string();
    if (fname.size() > 11 && fname.compare(fname.size() - 11, 11, ".index.json") == 0) {
      ix.index_path_ = path;
    } else {
      ix.dir_ = p.parent_path().string();
      ix.files_.emplace_back(path);
    }
  } else {
    DFLASH_REQUIRE_HINT(fs::is_directory(p, ec), "no safetensors weights in " << q(path) << ": "
                                                   << (fs::exists(p, ec) ? "not a directory" : "no such directory"),
                      expect_hint);
    const fs::path index = p / "model.safetensors.index.json";
    const fs::path single = p / "model.safetensors";
    if (fs::exists(index, ec)) {
      ix.index_path_ = index.string();
    } else if (fs::exists(single, ec)) {
      ix.dir_ = path;
      ix.files_.emplace_back(single.string());
    } else {
      std::vector<std::string> found;
      for (fs::directory_iterator it(p, ec), end; !ec && it != end; it.increment(ec)) {
        const std::string f = it->path().filename().string();
        auto ends_with = [&](const char* suf) {
          size_t n = std::strlen(suf);
          return f.size() >= n && f.compare(f.size() - n, n, suf) == 0;
        };
        if (ends_with(".safetensors") || ends_with(".index.json") || ends_with(".bin") || ends_with(".pt"))
          found.push_back(f);
      }
      std::sort(found.begin(), found.end());
      DFLASH_REJECT_HINT("no safetensors weights in " << q(path),
                       expect_hint << (found.empty() ? std::string("; the directory has no weight files at all")
                                                     : "; found instead: " + list_names(found)));
    }
  }

  if (ix.index_path_.empty()) {
    for (const auto& name : ix.files_[0].names()) ix.where_.emplace(name, 0);
    return ix;
  }

  // Sharded: read the weight map.
  const std::string& ipath = ix.index_path_;
  ix.dir_ = fs::path(ipath).parent_path().string();
  const std::string ictx = "safetensors index " + q(ipath);
  const char* hint_index = "the index must be {\"metadata\": {...}, \"weight_map\": {\"tensor\": \"shard.safetensors\"}}";
  json root;
  try {
    root = json::parse(read_small_file(ipath, kSafetensorsMaxHeaderBytes));
  } catch (const json::exception& e) {
    DFLASH_REJECT_HINT(ictx << " is not valid JSON: " << e.what(), hint_index);
  }
  DFLASH_REQUIRE_HINT(root.is_object(), ictx << " is a JSON " << root.type_name() << ", not an object", hint_index);
  DFLASH_REQUIRE_HINT(root.contains("weight_map"), ictx << " has no \"weight_map\"", hint_index);
  const json& wm = root.at("weight_map");
  DFLASH_REQUIRE_HINT(wm.is_object(), ictx << ": \"weight_map\" is a JSON " << wm.type_name() << ", not an object",
                    hint_index);

  std::map<std::string, std::string> weight_map;            // tensor -> shard file name
  std::map<std::string, std::vector<std::string>> by_shard;  // shard file name -> tensors
  for (const auto& [name, v] : wm.items()) {
    DFLASH_REQUIRE_HINT(v.is_string(), ictx << ": weight_map entry for tensor " << q(name) << " is a JSON "
                                          << v.type_name() << ", not a file name",
                      hint_index);
    std::string f = v.get<std::string>();
    if (safe_relative(f)) f = fs::path(f).lexically_normal().string();  // "./a" and "a" are one shard
    DFLASH_REQUIRE(safe_relative(f), ictx << ": weight_map entry for tensor " << q(name) << " names shard " << q(f)
                                        << ", which is not a relative path inside the model directory");
    by_shard[f].push_back(name);
    weight_map.emplace(name, std::move(f));
  }

  // Open every shard once; a tensor may live in only one of them.
  std::vector<std::string> shard_names;
  for (const auto& [f, names] : by_shard) {
    const fs::path sp = fs::path(ix.dir_) / f;
    DFLASH_REQUIRE_HINT(fs::is_regular_file(sp, ec),
                      ictx << " names shard " << q(f) << " (for " << names.size() << " tensors, e.g. " << q(names[0])
                           << "), but " << q(sp.string()) << " does not exist",
                      "the checkpoint is incomplete; download every shard listed in the index");
    ix.files_.emplace_back(sp.string());
    shard_names.push_back(f);
    const size_t k = ix.files_.size() - 1;
    for (const auto& name : ix.files_[k].names()) {
      auto [it, fresh] = ix.where_.emplace(name, k);
      DFLASH_REQUIRE_HINT(fresh, ictx << ": tensor " << q(name) << " is in both shard " << q(shard_names[it->second])
                                    << " and shard " << q(f),
                        "a tensor must be stored exactly once; the shards come from different exports");
    }
  }

  const char* hint_mismatch = "the index and the shards do not match (mixed versions of the checkpoint?); fetch them again";
  for (const auto& [name, f] : weight_map) {
    auto it = ix.where_.find(name);
    if (it != ix.where_.end() && shard_names[it->second] == f) continue;
    DFLASH_REJECT_HINT(ictx << " lists tensor " << q(name) << " in shard " << q(f) << ", but that shard has no such tensor"
                          << (it != ix.where_.end() ? " (it is in shard " + q(shard_names[it->second]) + ")"
                                                    : std::string()),
                     hint_mismatch);
  }
  for (size_t k = 0; k < ix.files_.size(); ++k) {
    std::vector<std::string> extra;
    for (const auto& name : ix.files_[k].names())
      if (!weight_map.count(name)) extra.push_back(name);
    DFLASH_REQUIRE_HINT(extra.empty(), ictx << ": shard " << q(shard_names[k]) << " holds " << extra.size()
                                          << " tensor(s) missing from the weight_map: " << list_names(extra),
                      hint_mismatch);
  }
  return ix;
}

std::vector<std::string> SafetensorsIndex::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& kv : where_) out.push_back(kv.first);
  return out;
}

size_t SafetensorsIndex::shard_index(const std::string& name) const {
  auto it = where_.find(name);
  DFLASH_REQUIRE_HINT(it != where_.end(),
                    "checkpoint " << q(sharded() ? index_path_ : (files_.empty() ? dir_ : files_[0].path()))
                                  << " has no tensor " << q(name),
                    "check the tensor name; the checkpoint has " << where_.size() << " tensors");
  return it->second;
}

const TensorInfo& SafetensorsIndex::info(const std::string& name) const { return files_[shard_index(name)].info(name); }
Tensor SafetensorsIndex::tensor(const std::string& name) const { return files_[shard_index(name)].tensor(name); }
const std::string& SafetensorsIndex::file_of(const std::string& name) const {
  return files_[shard_index(name)].path();
}
const SafetensorsFile& SafetensorsIndex::shard_of(const std::string& name) const { return files_[shard_index(name)]; }

SafetensorsIndex open_checkpoint(const std::string& dir) { return SafetensorsIndex::open(dir); }

// ---------------------------------------------------------------------------------------------
// Writing

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) check_tensor_for_save(path, name, t, seen);
  // Data order: grouped by element size, largest first, given order within a group (as Hugging
  // Face's writer does). With the 8-aligned data region this aligns every tensor to its element.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return dtype_size(tensors[a].second.dtype()) > dtype_size(tensors[b].second.dtype());
  });
  std::vector<Tensor> data;
  data.reserve(tensors.size());
  json header = json::object();
  size_t offset = 0;
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    Tensor c = t.contiguous();
    const size_t nb = c.nbytes();
    header[name] = {{"dtype", safetensors_dtype_string(c.dtype())},
                    {"shape", c.shape()},
                    {"data_offsets", {offset, offset + nb}}};
    offset += nb;
    data.push_back(std::move(c));
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string h = dump_json(header, -1, "safetensors header for " + q(path));
  h.append((8 - h.size() % 8) % 8, ' ');

  unsigned char len[8];
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  AtomicFile out(path);
  out.write(len, 8);
  out.write(h.data(), h.size());
  for (const Tensor& t : data)
    if (t.nbytes()) out.write(t.raw_data(), t.nbytes());
  out.commit();
}

std::vector<std::string> save_sharded(const std::string& dir, const std::vector<std::pair<std::string, Tensor>>& tensors,
                                      size_t max_shard_bytes, const std::map<std::string, std::string>& metadata) {
  DFLASH_CHECK(max_shard_bytes > 0, "save_sharded " << q(dir) << ": max_shard_bytes must be positive");
  // Validate everything before writing anything.
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) check_tensor_for_save(dir, name, t, seen);

  std::error_code ec;
  fs::create_directories(dir, ec);
  DFLASH_CHECK(!ec && fs::is_directory(dir), "save_sharded: cannot create directory " << q(dir)
                                                                                      << (ec ? ": " + ec.message() : ""));
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  // A stale index must not describe shards we are about to replace.
  if (::unlink(index_path.c_str()) != 0) DFLASH_CHECK_IO(errno == ENOENT, "remove old index", index_path.string());

  // Greedy packing in order.
  std::vector<std::vector<size_t>> groups;
  size_t cur = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t nb = tensors[i].second.nbytes();
    if (groups.empty() || (!groups.back().empty() && cur + nb > max_shard_bytes)) {
      groups.emplace_back();
      cur = 0;
    }
    groups.back().push_back(i);
    cur += nb;
    total += nb;
  }

  std::vector<std::string> files;
  json weight_map = json::object();
  for (size_t g = 0; g < groups.size(); ++g) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", g + 1, groups.size());
    std::vector<std::pair<std::string, Tensor>> part;
    part.reserve(groups[g].size());
    for (size_t i : groups[g]) {
      part.push_back(tensors[i]);
      weight_map[tensors[i].first] = buf;
    }
    save_safetensors((fs::path(dir) / buf).string(), part, metadata);
    files.emplace_back(buf);
  }

  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  std::string text = dump_json(index, 2, "safetensors index " + q(index_path.string())) + "\n";
  AtomicFile out(index_path.string());
  out.write(text.data(), text.size());
  out.commit();
  return files;
}

}  // namespace dflash::io
