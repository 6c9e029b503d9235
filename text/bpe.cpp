#include "text/bpe.h"

#include <atomic>
#include <cstdio>
#include <algorithm>
#include <functional>

#include "core/error.h"
#include "text/utf8.h"

namespace dflash::text {

namespace {

struct ByteTables {
  uint32_t to_char[256];
  std::unordered_map<uint32_t, uint8_t> to_byte;
  ByteTables() {
    // Printable Latin-1 bytes stand for themselves; the other 68 take U+0100.. in byte order.
    bool direct[256] = {};
    for (int b = '!'; b <= '~'; ++b) direct[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) to_char[b] = direct[b] ? static_cast<uint32_t>(b) : next++;
    for (int b = 0; b < 256; ++b) to_byte[to_char[b]] = static_cast<uint8_t>(b);
  }
};
const ByteTables& byte_tables() {
  static const ByteTables t;
  return t;
}

std::atomic<uint64_t> g_serial{1};

}  // namespace

uint32_t byte_to_char(uint8_t b) { return byte_tables().to_char[b]; }
int char_to_byte(uint32_t c) {
  const auto& m = byte_tables().to_byte;
  auto it = m.find(c);
  return it == m.end() ? -1 : it->second;
}

// Open-addressing map (a, b) -> (rank, merged id): the merge lookup is the inner loop of encoding.
struct Bpe::MergeTable {
  struct Slot {
    uint64_t key = ~0ull;  // (a << 32) | b; ~0 = empty (no id is 2^32 - 1)
    uint32_t rank = 0, id = 0;
  };
  std::vector<Slot> slots;
  uint64_t mask = 0;
  explicit MergeTable(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    slots.resize(cap);
    mask = cap - 1;
  }
  static uint64_t hash(uint64_t k) { return (k * 0x9E3779B97F4A7C15ull) >> 20; }
  // A pair listed twice keeps its last entry, as HF's map (collected from the list in order) does.
  void put(uint32_t a, uint32_t b, uint32_t rank, uint32_t id) {
    const uint64_t k = (uint64_t(a) << 32) | b;
    for (uint64_t i = hash(k) & mask;; i = (i + 1) & mask) {
      if (slots[i].key == ~0ull || slots[i].key == k) {
        slots[i] = {k, rank, id};
        return;
      }
    }
  }
  const Slot* get(uint32_t a, uint32_t b) const {
    const uint64_t k = (uint64_t(a) << 32) | b;
    for (uint64_t i = hash(k) & mask;; i = (i + 1) & mask) {
      if (slots[i].key == k) return &slots[i];
      if (slots[i].key == ~0ull) return nullptr;
    }
  }
};

Bpe::Bpe(Bpe&&) noexcept = default;
Bpe& Bpe::operator=(Bpe&&) noexcept = default;
Bpe::~Bpe() = default;

Bpe Bpe::from_json(const nlohmann::json& m, bool byte_level) {
  Bpe bpe;
  bpe.byte_level_ = byte_level;
  bpe.serial_ = g_serial.fetch_add(1);
  auto opt_string = [&](const char* key) -> std::string {
    if (!m.contains(key) || m[key].is_null()) return {};
    DFLASH_CHECK(m[key].is_string(), "tokenizer.json: model." << key << " must be a string or null");
    return m[key].get<std::string>();
  };
  auto opt_bool = [&](const char* key) {
    if (!m.contains(key) || m[key].is_null()) return false;
    DFLASH_CHECK(m[key].is_boolean(), "tokenizer.json: model." << key << " must be true or false");
    return m[key].get<bool>();
  };
  if (m.contains("dropout") && !m["dropout"].is_null()) {
    DFLASH_CHECK(m["dropout"].is_number() && m["dropout"].get<double>() == 0.0,
                 "tokenizer.json: model.dropout = " << m["dropout"].dump() << " is not supported (encoding would be random); set it to null");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const std::string v = opt_string(key);
    DFLASH_CHECK_HINT(v.empty(), "tokenizer.json: model." << key << " = \"" << v << "\" is not supported",
                      "supported BPE models have no subword prefix or suffix (the GPT-2 / Qwen / Llama-3 byte-level kind)");
  }
  bpe.byte_fallback_ = opt_bool("byte_fallback");
  bpe.fuse_unk_ = opt_bool("fuse_unk");
  bpe.ignore_merges_ = opt_bool("ignore_merges");

  DFLASH_CHECK(m.contains("vocab") && m["vocab"].is_object(), "tokenizer.json: model.vocab must be an object {token: id}");
  uint32_t max_id = 0;
  for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
    DFLASH_CHECK(it.value().is_number_unsigned() && it.value().get<uint64_t>() < 0xFFFFFFF0ull,
                 "tokenizer.json: model.vocab[\"" << it.key() << "\"] must be a non-negative id, got " << it.value().dump());
    const uint32_t id = it.value().get<uint32_t>();
    check_utf8(it.key(), "tokenizer.json: a model.vocab key");
    bpe.vocab_.emplace(it.key(), id);
    max_id = std::max(max_id, id);
  }
  bpe.id_to_token_.assign(bpe.vocab_.empty() ? 0 : max_id + 1, std::string());
  for (const auto& [tok, id] : bpe.vocab_) bpe.id_to_token_[id] = tok;

  const std::string unk = opt_string("unk_token");
  if (!unk.empty()) {
    auto it = bpe.vocab_.find(unk);
    DFLASH_CHECK(it != bpe.vocab_.end(), "tokenizer.json: model.unk_token \"" << unk << "\" is not in model.vocab");
    bpe.unk_ = it->second;
  }

  DFLASH_CHECK(m.contains("merges") && m["merges"].is_array(), "tokenizer.json: model.merges must be a list");
  const auto& merges = m["merges"];
  bpe.merges_ = std::make_unique<MergeTable>(merges.size());
  bpe.merge_count_ = merges.size();
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& e = merges[r];
    std::string a, b;
    if (e.is_string()) {  // "a b": the legacy form, split at the first space
      const std::string s = e.get<std::string>();
      const size_t sp = s.find(' ');
      DFLASH_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
                   "tokenizer.json: model.merges[" << r << "] = \"" << s << "\" is not two tokens separated by one space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      DFLASH_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(),
                   "tokenizer.json: model.merges[" << r << "] must be \"a b\" or [\"a\", \"b\"], got " << e.dump());
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    }
    auto ia = bpe.vocab_.find(a), ib = bpe.vocab_.find(b), iab = bpe.vocab_.find(a + b);
    DFLASH_CHECK(ia != bpe.vocab_.end() && ib != bpe.vocab_.end(),
                 "tokenizer.json: model.merges[" << r << "] names a token that is not in the vocab: \"" << (ia == bpe.vocab_.end() ? a : b) << "\"");
    DFLASH_CHECK(iab != bpe.vocab_.end(), "tokenizer.json: model.merges[" << r << "]: the merged token \"" << a + b << "\" is not in the vocab");
    bpe.merges_->put(ia->second, ib->second, static_cast<uint32_t>(r), iab->second);
  }

  for (int b = 0; b < 256; ++b) {
    std::string c;
    append_utf8(c, byte_to_char(static_cast<uint8_t>(b)));
    auto it = bpe.vocab_.find(c);
    bpe.byte_ids_[b] = it == bpe.vocab_.end() ? -1 : static_cast<int64_t>(it->second);
  }
  return bpe;
}

// The model's first symbols of a word, one per character (HF BPE::merge_word): a character in the
// vocab is its id; else its <0xXX> byte tokens when byte_fallback has them all; else the unk token
// (consecutive unks fused into one with fuse_unk); else it is dropped, as HF drops it.
void Bpe::initial_symbols(std::string_view word, std::vector<uint32_t>& ids) const {
  std::optional<uint32_t> pending_unk;
  std::string ch;
  auto add_char = [&](std::string_view c) {
    if (auto it = vocab_.find(c); it != vocab_.end()) {
      if (pending_unk) { ids.push_back(*pending_unk); pending_unk.reset(); }
      ids.push_back(it->second);
      return;
    }
    if (byte_fallback_) {
      std::vector<uint32_t> bytes;
      for (unsigned char b : c) {
        char name[8];
        std::snprintf(name, sizeof name, "<0x%02X>", b);
        auto bt = vocab_.find(std::string_view(name));
        if (bt == vocab_.end()) { bytes.clear(); break; }
        bytes.push_back(bt->second);
      }
      if (!bytes.empty()) {  // as HF: added without flushing a pending unk first
        ids.insert(ids.end(), bytes.begin(), bytes.end());
        return;
      }
    }
    if (unk_) {
      if (pending_unk && !fuse_unk_) ids.push_back(*pending_unk);
      pending_unk = *unk_;
    }
  };
  if (byte_level_) {
    for (unsigned char b : word) {
      if (byte_ids_[b] >= 0) {
        if (pending_unk) { ids.push_back(*pending_unk); pending_unk.reset(); }
        ids.push_back(static_cast<uint32_t>(byte_ids_[b]));
      } else {
        ch.clear();
        append_utf8(ch, byte_to_char(b));
        add_char(ch);
      }
    }
  } else {
    for (size_t i = 0; i < word.size();) {
      size_t n;
      decode_utf8(word, i, n);
      add_char(word.substr(i, n));
      i += n;
    }
  }
  if (pending_unk) ids.push_back(*pending_unk);
}

void Bpe::merge_word(std::string_view word, std::vector<uint32_t>& out) const {
  if (ignore_merges_) {
    std::string key;
    if (byte_level_) {
      for (unsigned char b : word) append_utf8(key, byte_to_char(b));
    } else {
      key.assign(word);
    }
    if (auto it = vocab_.find(key); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  thread_local std::vector<uint32_t> id;
  id.clear();
  initial_symbols(word, id);
  const int n = static_cast<int>(id.size());
  if (n <= 1) {
    out.insert(out.end(), id.begin(), id.end());
    return;
  }
  thread_local std::vector<int> next, prev;
  thread_local std::vector<char> alive;
  next.resize(n);
  prev.resize(n);
  alive.assign(n, 1);
  for (int i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  struct Item {
    uint32_t rank;
    int pos;
    uint32_t id;
    bool operator>(const Item& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  // A min-heap on (rank, pos) kept in a per-thread vector (no allocation per word).
  thread_local std::vector<Item> heap;
  heap.clear();
  const auto cmp = std::greater<Item>{};
  auto push = [&](Item it) {
    heap.push_back(it);
    std::push_heap(heap.begin(), heap.end(), cmp);
  };
  for (int i = 0; i + 1 < n; ++i)
    if (const auto* m = merges_->get(id[i], id[i + 1])) push({m->rank, i, m->id});
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), cmp);
    const Item top = heap.back();
    heap.pop_back();
    const int p = top.pos;
    if (!alive[p] || next[p] < 0) continue;
    const int q = next[p];
    const auto* m = merges_->get(id[p], id[q]);
    if (m == nullptr || m->id != top.id) continue;  // stale: the pair changed since it was queued
    id[p] = top.id;
    alive[q] = 0;
    next[p] = next[q];
    if (next[q] >= 0) prev[next[q]] = p;
    if (prev[p] >= 0)
      if (const auto* pm = merges_->get(id[prev[p]], id[p])) push({pm->rank, prev[p], pm->id});
    if (next[p] >= 0)
      if (const auto* nm = merges_->get(id[p], id[next[p]])) push({nm->rank, p, nm->id});
  }
  for (int i = 0; i >= 0; i = next[i]) out.push_back(id[i]);
}

void Bpe::encode_word(std::string_view word, std::vector<uint32_t>& out) const {
  // Per-thread cache of short words (most pre-tokens of real text repeat). Bounded: cleared when full.
  struct Cache {
    uint64_t owner = 0;
    std::unordered_map<std::string, std::vector<uint32_t>, StringHash, std::equal_to<>> map;
  };
  constexpr size_t kMaxWord = 64, kMaxEntries = 1 << 17;
  thread_local Cache cache;
  if (word.size() > kMaxWord) {
    merge_word(word, out);
    return;
  }
  if (cache.owner != serial_) {
    cache.map.clear();
    cache.owner = serial_;
  }
  if (auto it = cache.map.find(word); it != cache.map.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const size_t start = out.size();
  merge_word(word, out);
  if (cache.map.size() >= kMaxEntries) cache.map.clear();
  cache.map.emplace(std::string(word), std::vector<uint32_t>(out.begin() + static_cast<std::ptrdiff_t>(start), out.end()));
}

}  // namespace dflash::text
