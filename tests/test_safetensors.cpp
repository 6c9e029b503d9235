// Safetensors reader/writer: round trips (every dtype, awkward shapes, metadata, shards) and
// hand-crafted bad files that must each raise a dflash::Error naming the file and the tensor.
#include "core/io/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"

namespace fs = std::filesystem;
using dflash::Device;
using dflash::DType;
using dflash::Shape;
using dflash::Tensor;
namespace io = dflash::io;

namespace {

constexpr DType kAllDTypes[] = {DType::BF16, DType::F16, DType::F32, DType::F64, DType::I32, DType::I64, DType::U8, DType::F8E4M3};

// Runs `f`, which must throw dflash::Error whose text contains every one of `parts`.
template <typename F>
void expect_message(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
  } catch (const dflash::Error& e) {
    const std::string what = e.what();
    for (const auto& p : parts) EXPECT_NE(what.find(p), std::string::npos) << "message lacks \"" << p << "\":\n" << what;
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected dflash::Error, got another exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected dflash::Error, nothing was thrown";
}

#define EXPECT_DFLASH_ERROR(stmt, ...)                       \
  do {                                                       \
    SCOPED_TRACE(#stmt);                                     \
    EXPECT_THROW(stmt, ::dflash::Error);                     \
    expect_message([&] { stmt; }, {__VA_ARGS__});            \
  } while (0)

// Tensor filled with random bytes (any bit pattern, NaNs included: the round trip is bit-exact).
Tensor random_tensor(const Shape& shape, DType dt, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dt);
  auto* p = static_cast<unsigned char*>(t.raw_data());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(rng());
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape() || a.nbytes() != b.nbytes()) return false;
  Tensor ca = a.contiguous(), cb = b.contiguous();
  return a.nbytes() == 0 || std::memcmp(ca.raw_data(), cb.raw_data(), a.nbytes()) == 0;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& bytes) {
  // Unlink first: rewriting a truncated file makes ext4 flush it on close (slow in loops).
  std::error_code ec;
  fs::remove(path, ec);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A hand-made safetensors file: u64 length (the header's size unless given), header, data.
void write_raw(const std::string& path, const std::string& header, const std::string& data,
               std::optional<uint64_t> n = std::nullopt) {
  write_file(path, le64(n.value_or(header.size())) + header + data);
}

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) /
           ("dflash_st_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string p(const std::string& f) const { return (dir_ / f).string(); }

  fs::path dir_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Round trips

TEST_F(Safetensors, DtypeStrings) {
  for (DType t : kAllDTypes) {
    auto back = io::safetensors_dtype_from_string(io::safetensors_dtype_string(t));
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(*back, t);
  }
  EXPECT_FALSE(io::safetensors_dtype_from_string("BOOL").has_value());
  EXPECT_FALSE(io::safetensors_dtype_from_string("bf16").has_value());
  EXPECT_FALSE(io::safetensors_dtype_from_string("F8_E5M2").has_value());
}

TEST_F(Safetensors, RoundTripEveryDtypeAndShapeBitExact) {
  std::mt19937 rng(1234);
  std::vector<std::pair<std::string, Tensor>> tensors;
  const std::vector<std::pair<std::string, Shape>> shapes = {
      {"scalar", {}}, {"empty", {0}}, {"box", {3, 5, 7}}, {"empty2d", {4, 0}}, {"one", {1}}};
  for (DType dt : kAllDTypes)
    for (const auto& [sname, shape] : shapes)
      tensors.emplace_back(std::string("t.") + io::safetensors_dtype_string(dt) + "." + sname, random_tensor(shape, dt, rng));
  // A strided view is written as its contiguous copy.
  Tensor base = random_tensor({4, 6}, DType::F32, rng);
  Tensor strided = base.slice(1, 1, 4);
  ASSERT_FALSE(strided.is_contiguous());
  tensors.emplace_back("strided", strided);

  const std::string path = p("all.safetensors");
  io::save_safetensors(path, tensors);
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  Tensor kept;
  {
    io::SafetensorsFile f(path);
    EXPECT_EQ(f.path(), path);
    EXPECT_EQ(f.size(), tensors.size());
    EXPECT_TRUE(f.metadata().empty());
    EXPECT_EQ(f.data_offset() % 8, 0u);
    std::vector<std::string> expect_names;
    size_t total = 0;
    for (const auto& [name, t] : tensors) {
      expect_names.push_back(name);
      total += t.nbytes();
    }
    std::sort(expect_names.begin(), expect_names.end());
    EXPECT_EQ(f.names(), expect_names);
    EXPECT_EQ(f.file_size(), f.data_offset() + total);

    // Data is grouped by element size, largest first, in the given order within a group.
    std::vector<size_t> order(tensors.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return dflash::dtype_size(tensors[a].second.dtype()) > dflash::dtype_size(tensors[b].second.dtype());
    });
    size_t expect_begin = 0;
    for (size_t i : order) {
      const auto& [name, t] = tensors[i];
      SCOPED_TRACE(name);
      ASSERT_TRUE(f.has(name));
      const io::TensorInfo& info = f.info(name);
      EXPECT_EQ(info.dtype, t.dtype());
      EXPECT_EQ(info.shape, t.shape());
      EXPECT_EQ(info.begin, expect_begin);
      EXPECT_EQ(info.nbytes(), t.nbytes());
      EXPECT_TRUE(info.aligned);
      EXPECT_EQ((f.data_offset() + info.begin) % dflash::dtype_size(t.dtype()), 0u);
      expect_begin = info.end;
      Tensor v = f.tensor(name);
      // Zero-copy: the view points into the mapping.
      EXPECT_EQ(v.raw_data(), f.tensor(name).raw_data());
      EXPECT_TRUE(v.device().is_cpu());
      EXPECT_TRUE(v.is_contiguous());
      EXPECT_TRUE(same_bytes(v, t));
    }
    EXPECT_FALSE(f.has("nope"));
    EXPECT_DFLASH_ERROR(f.info("nope"), path, "'nope'");
    EXPECT_DFLASH_ERROR(f.tensor("nope"), path, "'nope'");
    kept = f.tensor("t.F32.box");
  }
  // The view keeps the mapping alive after the file object is gone.
  EXPECT_TRUE(same_bytes(kept, tensors[2 * 5 + 2].second));
  EXPECT_EQ(tensors[2 * 5 + 2].first, "t.F32.box");
  for (int64_t i = 0; i < strided.numel(); ++i) EXPECT_EQ(io::SafetensorsFile(path).tensor("strided").item_at(i), strided.item_at(i));
}

TEST_F(Safetensors, WrittenLayoutFollowsTheFormat) {
  std::mt19937 rng(7);
  Tensor a = random_tensor({3}, DType::BF16, rng);
  Tensor b = random_tensor({2, 2}, DType::I64, rng);
  const std::string path = p("layout.safetensors");
  io::save_safetensors(path, {{"b", b}, {"a", a}}, {{"format", "pt"}});
  const std::string bytes = read_file(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + n + 32 + 6);
  const std::string header = bytes.substr(8, n);
  auto j = nlohmann::json::parse(header);
  EXPECT_EQ(j["b"]["dtype"].get<std::string>(), "I64");
  EXPECT_EQ(j["b"]["shape"], nlohmann::json::array({2, 2}));
  EXPECT_EQ(j["b"]["data_offsets"], nlohmann::json::array({0, 32}));
  EXPECT_EQ(j["a"]["dtype"].get<std::string>(), "BF16");
  EXPECT_EQ(j["a"]["data_offsets"], nlohmann::json::array({32, 38}));
  EXPECT_EQ(j["__metadata__"]["format"].get<std::string>(), "pt");
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n, b.raw_data(), 32), 0);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n + 32, a.raw_data(), 6), 0);
  // Padding is spaces only.
  size_t last = header.find_last_not_of(' ');
  EXPECT_EQ(header[last], '}');

  // Larger elements come first whatever the given order, so every tensor stays aligned.
  io::save_safetensors(path, {{"a", a}, {"b", b}});
  io::SafetensorsFile f(path);
  EXPECT_EQ(f.info("b").begin, 0u);
  EXPECT_EQ(f.info("a").begin, 32u);
}

TEST_F(Safetensors, MisalignedDataComesBackAsAlignedCopy) {
  // The F32 tensor starts at an odd file offset (the header is padded to make sure of it).
  const std::string path = p("misaligned.safetensors");
  std::string header = R"({"u": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},)"
                       R"( "w": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}})";
  while ((8 + header.size() + 1) % 2 == 0) header += ' ';
  std::string data(9, '\0');
  data[0] = 7;
  const float vals[2] = {1.5f, -2.25f};
  std::memcpy(&data[1], vals, 8);
  write_raw(path, header, data);
  io::SafetensorsFile f(path);
  EXPECT_FALSE(f.info("w").aligned);
  EXPECT_TRUE(f.info("u").aligned);
  Tensor w = f.tensor("w");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w.raw_data()) % 4, 0u);
  EXPECT_EQ(w.item_at(0), 1.5);
  EXPECT_EQ(w.item_at(1), -2.25);
  EXPECT_EQ(f.tensor("u").item_at(0), 7.0);
}

TEST_F(Safetensors, MetadataRoundTrip) {
  std::mt19937 rng(3);
  const std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"empty", ""}, {"unicode", "h\xc3\xa9llo \xe2\x9c\x93"}, {"quote\"d", "a\\b\n{}"}};
  const std::string path = p("meta.safetensors");
  io::save_safetensors(path, {{"w", random_tensor({2}, DType::F16, rng)}}, meta);
  io::SafetensorsFile f(path);
  EXPECT_EQ(f.metadata(), meta);
  EXPECT_EQ(f.names(), std::vector<std::string>{"w"});
}

TEST_F(Safetensors, EmptyTensorList) {
  const std::string path = p("none.safetensors");
  io::save_safetensors(path, {});
  io::SafetensorsFile f(path);
  EXPECT_EQ(f.size(), 0u);
  EXPECT_TRUE(f.names().empty());

  const std::string raw = p("raw_empty.safetensors");
  write_raw(raw, "{}", "");
  EXPECT_EQ(io::SafetensorsFile(raw).size(), 0u);
  // Zero-size tensors anywhere in the tiling are fine.
  write_raw(raw, R"({"z": {"dtype": "F32", "shape": [0, 5], "data_offsets": [0, 0]},)"
                 R"( "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},)"
                 R"( "z2": {"dtype": "I64", "shape": [0], "data_offsets": [2, 2]}})",
            "xy");
  io::SafetensorsFile g(raw);
  EXPECT_EQ(g.size(), 3u);
  EXPECT_EQ(g.tensor("a").item_at(1), static_cast<double>('y'));
  EXPECT_EQ(g.tensor("z").numel(), 0);
}

TEST_F(Safetensors, OverwriteReplacesTheFile) {
  std::mt19937 rng(5);
  const std::string path = p("over.safetensors");
  Tensor a = random_tensor({100}, DType::F32, rng);
  Tensor b = random_tensor({3}, DType::U8, rng);
  io::save_safetensors(path, {{"a", a}});
  Tensor view = io::SafetensorsFile(path).tensor("a");
  io::save_safetensors(path, {{"b", b}});
  io::SafetensorsFile f(path);
  EXPECT_EQ(f.names(), std::vector<std::string>{"b"});
  EXPECT_TRUE(same_bytes(f.tensor("b"), b));
  // The old view still sees the old (now unlinked) file: rename never rewrites it in place.
  EXPECT_TRUE(same_bytes(view, a));
}

TEST_F(Safetensors, ShardedRoundTripThroughOpenCheckpoint) {
  std::mt19937 rng(11);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (int i = 0; i < 9; ++i)
    tensors.emplace_back("layers." + std::to_string(i) + ".weight",
                         random_tensor({i + 1, 10}, kAllDTypes[static_cast<size_t>(i) % 7], rng));
  tensors.emplace_back("big", random_tensor({400}, DType::F32, rng));  // larger than a shard: alone
  tensors.emplace_back("scalar", random_tensor({}, DType::F64, rng));
  const std::string dir = p("ckpt");
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  auto files = io::save_sharded(dir, tensors, 400, meta);
  ASSERT_GE(files.size(), 3u);
  for (size_t i = 0; i < files.size(); ++i) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, files.size());
    EXPECT_EQ(files[i], buf);
    EXPECT_TRUE(fs::exists(fs::path(dir) / buf));
    EXPECT_EQ(io::SafetensorsFile((fs::path(dir) / buf).string()).metadata(), meta);
  }
  auto index = nlohmann::json::parse(read_file(dir + "/model.safetensors.index.json"));
  size_t total = 0;
  for (const auto& kv : tensors) total += kv.second.nbytes();
  EXPECT_EQ(index["metadata"]["total_size"].get<size_t>(), total);
  EXPECT_EQ(index["weight_map"].size(), tensors.size());

  io::SafetensorsIndex ck = io::open_checkpoint(dir);
  EXPECT_TRUE(ck.sharded());
  EXPECT_EQ(ck.files().size(), files.size());
  EXPECT_EQ(ck.size(), tensors.size());
  std::vector<std::string> names;
  for (const auto& kv : tensors) names.push_back(kv.first);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(ck.names(), names);
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(ck.has(name));
    EXPECT_EQ(fs::path(ck.file_of(name)).filename().string(), index["weight_map"][name].get<std::string>());
    EXPECT_EQ(ck.shard_of(name).path(), ck.file_of(name));
    EXPECT_EQ(ck.info(name).shape, t.shape());
    EXPECT_TRUE(same_bytes(ck.tensor(name), t));
  }
  // The big tensor sits alone in its shard.
  EXPECT_EQ(ck.shard_of("big").size(), 1u);
  EXPECT_DFLASH_ERROR(ck.tensor("missing"), "model.safetensors.index.json", "'missing'");

  // The index file itself can be given too.
  EXPECT_EQ(io::open_checkpoint(dir + "/model.safetensors.index.json").size(), tensors.size());

  // Re-saving with fewer shards replaces the index (stale shards are simply unreferenced).
  io::save_sharded(dir, {tensors[0]}, 1 << 20);
  io::SafetensorsIndex again = io::open_checkpoint(dir);
  EXPECT_EQ(again.names(), std::vector<std::string>{tensors[0].first});
}

TEST_F(Safetensors, SingleFileCheckpoint) {
  std::mt19937 rng(13);
  Tensor w = random_tensor({2, 3}, DType::BF16, rng);
  const std::string dir = p("single");
  fs::create_directories(dir);
  io::save_safetensors(dir + "/model.safetensors", {{"w", w}});
  io::SafetensorsIndex ck = io::open_checkpoint(dir);
  EXPECT_FALSE(ck.sharded());
  EXPECT_EQ(ck.names(), std::vector<std::string>{"w"});
  EXPECT_EQ(ck.file_of("w"), dir + "/model.safetensors");
  EXPECT_TRUE(same_bytes(ck.tensor("w"), w));
  // A path to the file works as well.
  EXPECT_EQ(io::open_checkpoint(dir + "/model.safetensors").size(), 1u);
  // An index wins over model.safetensors.
  io::save_sharded(dir, {{"v", w}}, 1 << 20);
  EXPECT_EQ(io::open_checkpoint(dir).names(), std::vector<std::string>{"v"});
}

TEST_F(Safetensors, IndexShardNamesAreNormalized) {
  std::mt19937 rng(47);
  const std::string dir = p("norm");
  io::save_sharded(dir, {{"a", random_tensor({4}, DType::F32, rng)}, {"b", random_tensor({4}, DType::F32, rng)}}, 1 << 20);
  const std::string ipath = dir + "/model.safetensors.index.json";
  auto index = nlohmann::json::parse(read_file(ipath));
  index["weight_map"]["a"] = "./model-00001-of-00001.safetensors";
  write_file(ipath, index.dump());
  io::SafetensorsIndex ck = io::open_checkpoint(dir);
  EXPECT_EQ(ck.files().size(), 1u);
  EXPECT_EQ(ck.size(), 2u);
}

TEST_F(Safetensors, ViewsOutliveTheCheckpoint) {
  std::mt19937 rng(17);
  Tensor w = random_tensor({64}, DType::F32, rng);
  io::save_sharded(p("c"), {{"w", w}}, 16);
  Tensor v;
  {
    io::SafetensorsIndex ck = io::open_checkpoint(p("c"));
    v = ck.tensor("w");
  }
  EXPECT_TRUE(same_bytes(v, w));
}

// ---------------------------------------------------------------------------------------------
// Writer refusals

TEST_F(Safetensors, SaveRefusesBadInput) {
  std::mt19937 rng(19);
  Tensor t = random_tensor({2}, DType::F32, rng);
  const std::string path = p("bad.safetensors");
  EXPECT_DFLASH_ERROR(io::save_safetensors(path, {{"a", t}, {"b", t}, {"a", t}}), "duplicate", "'a'");
  EXPECT_DFLASH_ERROR(io::save_safetensors(path, {{"__metadata__", t}}), "__metadata__");
  EXPECT_DFLASH_ERROR(io::save_safetensors(path, {{"", t}}), "empty name");
  EXPECT_DFLASH_ERROR(io::save_safetensors(path, {{"u", Tensor()}}), "'u'", "undefined");
  // A tensor that claims to live on a GPU (never dereferenced: it is refused first).
  float dummy[2] = {0, 0};
  Tensor gpu = Tensor::from_blob(dummy, {2}, DType::F32, Device::cuda(0));
  EXPECT_DFLASH_ERROR(io::save_safetensors(path, {{"g", gpu}}), "'g'", "cuda:0");
  EXPECT_DFLASH_ERROR(io::save_sharded(p("sh"), {{"a", t}, {"a", t}}, 100), "duplicate", "'a'");
  EXPECT_DFLASH_ERROR(io::save_sharded(p("sh"), {{"g", gpu}}, 100), "'g'", "cuda:0");
  EXPECT_DFLASH_ERROR(io::save_safetensors(p("no/such/dir/x.safetensors"), {{"a", t}}), "no/such/dir/x.safetensors");
  EXPECT_DFLASH_ERROR(io::save_safetensors(path, {{"bad\xff", t}}), "UTF-8");
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_FALSE(fs::exists(p("sh") + "/model.safetensors.index.json"));
}

// ---------------------------------------------------------------------------------------------
// Bad files: each is a dflash::Error naming the file (and the tensor where there is one)

TEST_F(Safetensors, TruncatedFile) {
  std::mt19937 rng(23);
  const std::string path = p("trunc.safetensors");
  io::save_safetensors(path, {{"a", random_tensor({4}, DType::F32, rng)}, {"last", random_tensor({8}, DType::F32, rng)}});
  const auto size = fs::file_size(path);
  fs::resize_file(path, size - 5);
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'last'", "past the end", "truncated");
  // Every shorter cut is refused cleanly too.
  const std::string full = p("full.safetensors");
  io::save_safetensors(full, {{"a", random_tensor({4}, DType::F32, rng)}, {"z", random_tensor({0}, DType::BF16, rng)}},
                   {{"k", "v"}});
  const std::string bytes = read_file(full);
  for (size_t n = 0; n < bytes.size(); ++n) {
    write_file(path, bytes.substr(0, n));
    EXPECT_THROW(io::SafetensorsFile f(path), dflash::Error) << "cut at " << n;
  }
  write_file(path, bytes);
  EXPECT_NO_THROW(io::SafetensorsFile f(path));
}

TEST_F(Safetensors, ShorterThanEightBytes) {
  const std::string path = p("tiny.safetensors");
  write_file(path, "abc");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "3 bytes", "8-byte");
  write_file(path, "");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "0 bytes");
}

TEST_F(Safetensors, HeaderLongerThanTheFile) {
  const std::string path = p("long.safetensors");
  write_raw(path, "{}", "", 1000);
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "header length 1000");
  write_raw(path, "{}", "", ~uint64_t{0});
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "not a safetensors file");
}

TEST_F(Safetensors, HeaderOverTheSizeLimit) {
  // A sparse file larger than the limit, whose header length claims more than 100 MiB.
  const std::string path = p("huge.safetensors");
  const uint64_t n = io::kSafetensorsMaxHeaderBytes + 8;
  write_raw(path, "", "", n);
  fs::resize_file(path, n + 16);
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "MiB limit");
}

TEST_F(Safetensors, HeaderNotJson) {
  const std::string path = p("garbage.safetensors");
  write_raw(path, "{\"a\": {\"dtype\": ", "");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "not valid JSON");
  write_raw(path, "\x80\x81\x82 not json at all", "");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "not valid JSON");
  write_raw(path, "{\"\xff\xfe\": 1}", "");  // ill-formed UTF-8
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "not valid JSON");
  write_raw(path, std::string("{}\0\0", 4), "");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "NUL");
  write_raw(path, "[1, 2]", "");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "not an object");
  write_raw(path, "", "");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "not valid JSON");
  write_raw(path, R"({"a": 5})", "");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'a'", "not an object");
  write_raw(path, R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},)"
                  R"( "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})",
            "xy");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'a'", "more than once");
  write_raw(path, R"({"__metadata__": {"k": 1}})", "");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'k'", "not a string");
  write_raw(path, R"({"__metadata__": [1]})", "");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "__metadata__");
}

TEST_F(Safetensors, OffsetPastTheEnd) {
  const std::string path = p("past.safetensors");
  write_raw(path, R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", std::string(8, 'x'));
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "past the end", "8 bytes");
  write_raw(path, R"({"w": {"dtype": "U8", "shape": [0], "data_offsets": [18446744073709551615, 18446744073709551615]}})",
            "");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "past the end");
}

TEST_F(Safetensors, GapBetweenTensors) {
  const std::string path = p("gap.safetensors");
  write_raw(path, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                  R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}})",
            std::string(20, 'x'));
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "gap", "'a'", "'b'", "[8, 12)");
  // A gap before the first tensor.
  write_raw(path, R"({"b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", std::string(12, 'x'));
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "gap", "before the first tensor", "'b'");
  // Trailing bytes nobody owns.
  write_raw(path, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", std::string(11, 'x'));
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "3 trailing bytes", "'a'");
  write_raw(path, "{}", "zz");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "2 trailing bytes");
}

TEST_F(Safetensors, OverlappingTensors) {
  const std::string path = p("overlap.safetensors");
  write_raw(path, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                  R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
            std::string(12, 'x'));
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "overlap", "'a'", "'b'");
  // Two tensors sharing the same bytes.
  write_raw(path, R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                  R"( "b": {"dtype": "I32", "shape": [], "data_offsets": [0, 4]}})",
            std::string(4, 'x'));
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "overlap", "'a'", "'b'");
}

TEST_F(Safetensors, ShapeTimesDtypeMismatch) {
  const std::string path = p("size.safetensors");
  write_raw(path, R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", std::string(8, 'x'));
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "12 bytes", "span 8 bytes");
  write_raw(path, R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 6]}})", std::string(6, 'x'));
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "12 bytes", "span 6 bytes");
}

TEST_F(Safetensors, BadShapes) {
  const std::string path = p("shape.safetensors");
  // One tensor 'w' of this dtype and "shape", its data offsets spanning exactly `data`.
  struct BadShape {
    const char* dtype;
    const char* shape;
    std::string data;
    const char* problem;
  };
  const BadShape cases[] = {
      {"U8", "[-1]", "", "negative"},
      {"U8", "[1.5]", "x", "not an integer"},
      {"U8", R"(["2"])", "xx", "not an integer"},
      {"U8", "[18446744073709551615]", "x", "too large"},
      {"U8", "[99999999999999999999999]", "x", "too large"},
      // Products that would wrap around 64 bits must not sneak past the size check.
      {"U8", "[4294967296, 4294967296]", "", "overflow"},
      {"F64", "[2305843009213693952]", "", "overflow"},
      {"F32", "[4611686018427387904, 4, 0]", "", "overflow"},
  };
  for (const BadShape& c : cases) {
    write_raw(path,
              std::string(R"({"w": {"dtype": ")") + c.dtype + R"(", "shape": )" + c.shape + R"(, "data_offsets": [0, )" +
                  std::to_string(c.data.size()) + "]}}",
              c.data);
    EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", c.problem);
  }
  write_raw(path, R"({"w": {"dtype": "U8", "shape": 3, "data_offsets": [0, 3]}})", "xyz");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "\"shape\"", "not an array");
}

TEST_F(Safetensors, UnknownDtype) {
  const std::string path = p("dtype.safetensors");
  write_raw(path, R"({"w": {"dtype": "BF17", "shape": [1], "data_offsets": [0, 2]}})", "xx");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "'BF17'", "BF16, F16, F32, F64, I32, I64, U8");
  write_raw(path, R"({"m": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}})", "xx");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'m'", "'BOOL'", "not supported");
  write_raw(path, R"({"w": {"dtype": 16, "shape": [1], "data_offsets": [0, 2]}})", "xx");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "\"dtype\"", "not a string");
}

TEST_F(Safetensors, MissingOrMalformedOffsets) {
  const std::string path = p("offsets.safetensors");
  write_raw(path, R"({"w": {"dtype": "F32", "shape": [1]}})", "xxxx");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "data_offsets");
  write_raw(path, R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", "xxxx");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "\"dtype\"");
  write_raw(path, R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", "xxxx");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "\"shape\"");
  write_raw(path, R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}})", "xxxx");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "two integers");
  write_raw(path, R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": "0-4"}})", "xxxx");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "two integers");
  write_raw(path, R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", "xxxx");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "negative");
  write_raw(path, R"({"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}})", "xxxx");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(path), path, "'w'", "begin 4 > end 0");
}

TEST_F(Safetensors, NotAFile) {
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(p("absent.safetensors")), "absent.safetensors", "No such file");
  EXPECT_DFLASH_ERROR(io::SafetensorsFile f(dir_.string()), dir_.string(), "not a regular file");
}

TEST_F(Safetensors, RandomHeaderCorruptionNeverCrashes) {
  std::mt19937 rng(29);
  const std::string good = p("good.safetensors");
  io::save_safetensors(good,
                   {{"a", random_tensor({2, 3}, DType::F32, rng)},
                    {"b", random_tensor({5}, DType::BF16, rng)},
                    {"c", random_tensor({}, DType::I64, rng)}},
                   {{"format", "pt"}});
  const std::string bytes = read_file(good);
  const std::string path = p("fuzz.safetensors");
  const char alphabet[] = "{}[]\":,0123456789-.eE abcdefFIUBOL\x00\xff";
  int opened = 0, refused = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    std::string b = bytes;
    int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) {
      size_t pos = rng() % b.size();
      b[pos] = (rng() % 2) ? alphabet[rng() % (sizeof alphabet - 1)] : static_cast<char>(rng());
    }
    write_file(path, b);
    try {
      io::SafetensorsFile f(path);
      for (const auto& n : f.names()) {
        Tensor t = f.tensor(n);
        if (t.numel() > 0) (void)t.item_at(t.numel() - 1);  // every byte of a view is readable
      }
      ++opened;
    } catch (const dflash::Error&) {
      ++refused;
    }
  }
  EXPECT_EQ(opened + refused, 2000);
  EXPECT_GT(refused, 0);
}

// ---------------------------------------------------------------------------------------------
// Bad checkpoints

TEST_F(Safetensors, NoWeightsInDirectory) {
  const std::string dir = p("empty_model");
  fs::create_directories(dir);
  EXPECT_DFLASH_ERROR(io::open_checkpoint(dir), "no safetensors weights in", dir, "model.safetensors.index.json");
  write_file(dir + "/pytorch_model.bin", "x");
  EXPECT_DFLASH_ERROR(io::open_checkpoint(dir), "no safetensors weights in", "pytorch_model.bin");
  EXPECT_DFLASH_ERROR(io::open_checkpoint(p("does_not_exist")), "no safetensors weights in", "does_not_exist");
}

TEST_F(Safetensors, IndexNamesMissingShard) {
  std::mt19937 rng(31);
  const std::string dir = p("m");
  io::save_sharded(dir, {{"a", random_tensor({8}, DType::F32, rng)}, {"b", random_tensor({8}, DType::F32, rng)}}, 32);
  ASSERT_TRUE(fs::exists(dir + "/model-00002-of-00002.safetensors"));
  fs::remove(dir + "/model-00002-of-00002.safetensors");
  EXPECT_DFLASH_ERROR(io::open_checkpoint(dir), "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                      "does not exist");
}

TEST_F(Safetensors, IndexNamesTensorAbsentFromShard) {
  std::mt19937 rng(37);
  const std::string dir = p("m");
  io::save_sharded(dir, {{"a", random_tensor({8}, DType::F32, rng)}, {"b", random_tensor({8}, DType::F32, rng)}}, 32);
  const std::string ipath = dir + "/model.safetensors.index.json";
  auto index = nlohmann::json::parse(read_file(ipath));
  index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors";
  write_file(ipath, index.dump());
  EXPECT_DFLASH_ERROR(io::open_checkpoint(dir), "'ghost'", "model-00001-of-00002.safetensors", ipath);

  // A tensor listed in the wrong shard (shard 1 holds a and b, shard 2 holds c).
  io::save_sharded(dir,
               {{"a", random_tensor({8}, DType::F32, rng)},
                {"b", random_tensor({8}, DType::F32, rng)},
                {"c", random_tensor({8}, DType::F32, rng)}},
               64);
  index = nlohmann::json::parse(read_file(ipath));
  ASSERT_EQ(index["weight_map"]["a"].get<std::string>(), "model-00001-of-00002.safetensors");
  index["weight_map"]["a"] = "model-00002-of-00002.safetensors";
  write_file(ipath, index.dump());
  EXPECT_DFLASH_ERROR(io::open_checkpoint(dir), "'a'", "model-00002-of-00002.safetensors",
                      "it is in shard 'model-00001-of-00002.safetensors'");
}

TEST_F(Safetensors, ShardHoldsTensorMissingFromIndex) {
  std::mt19937 rng(41);
  const std::string dir = p("m");
  // Shard 1 holds a and b, shard 2 holds c; the index forgets b.
  io::save_sharded(dir,
               {{"a", random_tensor({8}, DType::F32, rng)},
                {"b", random_tensor({8}, DType::F32, rng)},
                {"c", random_tensor({8}, DType::F32, rng)}},
               64);
  const std::string ipath = dir + "/model.safetensors.index.json";
  auto index = nlohmann::json::parse(read_file(ipath));
  ASSERT_EQ(index["weight_map"]["b"].get<std::string>(), "model-00001-of-00002.safetensors");
  index["weight_map"].erase("b");
  write_file(ipath, index.dump());
  EXPECT_DFLASH_ERROR(io::open_checkpoint(dir), "'b'", "model-00001-of-00002.safetensors", "missing from the weight_map");
  // A shard file the index never mentions is not opened (stale files in a model directory are fine).
  index["weight_map"]["b"] = "model-00001-of-00002.safetensors";
  index["weight_map"].erase("c");
  write_file(ipath, index.dump());
  EXPECT_EQ(io::open_checkpoint(dir).names(), (std::vector<std::string>{"a", "b"}));
}

TEST_F(Safetensors, DuplicateTensorAcrossShards) {
  std::mt19937 rng(43);
  const std::string dir = p("m");
  Tensor a = random_tensor({8}, DType::F32, rng);
  io::save_sharded(dir, {{"a", a}, {"b", random_tensor({8}, DType::F32, rng)}}, 32);
  // Shard 2 now also holds "a".
  io::save_safetensors(dir + "/model-00002-of-00002.safetensors", {{"b", random_tensor({8}, DType::F32, rng)}, {"a", a}});
  EXPECT_DFLASH_ERROR(io::open_checkpoint(dir), "'a'", "both", "model-00001-of-00002.safetensors",
                      "model-00002-of-00002.safetensors");
}

TEST_F(Safetensors, BadIndexFiles) {
  const std::string dir = p("m");
  fs::create_directories(dir);
  const std::string ipath = dir + "/model.safetensors.index.json";
  write_file(ipath, "{ not json");
  EXPECT_DFLASH_ERROR(io::open_checkpoint(dir), ipath, "not valid JSON");
  write_file(ipath, R"({"metadata": {}})");
  EXPECT_DFLASH_ERROR(io::open_checkpoint(dir), ipath, "weight_map");
  write_file(ipath, R"({"weight_map": {"a": 3}})");
  EXPECT_DFLASH_ERROR(io::open_checkpoint(dir), ipath, "'a'");
  write_file(ipath, R"({"weight_map": {"a": "../outside.safetensors"}})");
  EXPECT_DFLASH_ERROR(io::open_checkpoint(dir), ipath, "'a'", "relative path");
  write_file(ipath, R"({"weight_map": {"a": "/etc/passwd"}})");
  EXPECT_DFLASH_ERROR(io::open_checkpoint(dir), ipath, "'a'", "relative path");
  // A corrupt shard is reported with the shard's own path.
  write_file(ipath, R"({"weight_map": {"a": "s.safetensors"}})");
  write_raw(dir + "/s.safetensors", R"({"a": {"dtype": "BF17", "shape": [1], "data_offsets": [0, 2]}})", "xx");
  EXPECT_DFLASH_ERROR(io::open_checkpoint(dir), dir + "/s.safetensors", "'a'", "BF17");
}
