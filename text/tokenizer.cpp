#include "text/tokenizer.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <unordered_map>
#include <sstream>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/error.h"
#include "text/bpe.h"
#include "text/normalizer.h"
#include "text/qwen_split.h"
#include "text/regex.h"
#include "text/utf8.h"

namespace dflash::text {

using nlohmann::json;

namespace {

// The GPT-2 pattern of ByteLevel's use_regex (HF pre_tokenizers/byte_level.rs).
const char* const kByteLevelPattern = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior parse_behavior(const std::string& b) {
  if (b == "Removed") return Behavior::Removed;
  if (b == "Isolated") return Behavior::Isolated;
  if (b == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::MergedWithNext;
  if (b == "Contiguous") return Behavior::Contiguous;
  DFLASH_FAIL("tokenizer.json: pre_tokenizer Split behavior \"" << b
              << "\" is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
}

// One pre-tokenizer step: a regex split (Split, or ByteLevel's own regex), or the ByteLevel prefix space.
struct Step {
  std::string what;  // for describe()
  std::unique_ptr<Regex> regex;
  std::optional<QwenSplitter> fast;
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  bool prefix_space = false;  // ByteLevel add_prefix_space: prepend ' ' unless the piece starts with one
  bool split = false;
};

// Rust regex \w (Unicode): Alphabetic, marks, decimal digits, connector punctuation, join controls.
bool is_word_char(uint32_t c) {
  if (u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_ALPHABETIC)) return true;
  if (u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_JOIN_CONTROL)) return true;
  const int t = u_charType(static_cast<UChar32>(c));
  return t == U_NON_SPACING_MARK || t == U_ENCLOSING_MARK || t == U_COMBINING_SPACING_MARK || t == U_DECIMAL_DIGIT_NUMBER ||
         t == U_CONNECTOR_PUNCTUATION;
}
bool is_white_space(uint32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE); }

uint32_t last_char(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  size_t n;
  return decode_utf8(s, i, n);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DFLASH_CHECK_IO(in.good(), "opening", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  DFLASH_CHECK_IO(!in.bad(), "reading", path);
  return ss.str();
}

// A piece of the text after added-token extraction: either an added token's id or text to encode.
struct Piece {
  std::string_view text;
  int64_t token = -1;
  size_t begin = 0, end = 0;  // a token's range in the searched string (its stripped whitespace included)
};

}  // namespace

struct Tokenizer::Impl {
  std::string origin;
  Normalizer normalizer;
  std::vector<Step> steps;
  bool byte_level = false;
  std::optional<Bpe> bpe;
  std::vector<AddedToken> added;
  // Added-token matching (leftmost-longest, as HF's Aho-Corasick): per first byte, the indices of
  // tokens (into `added`) starting with it, longest first. Two sets: raw text and normalized text.
  struct Matcher {
    std::vector<std::vector<uint32_t>> by_first = std::vector<std::vector<uint32_t>>(256);
    std::vector<std::string> pattern;  // per index into `added` (normalized content for the normalized set)
    bool any = false;
  };
  Matcher raw, norm;
  std::vector<std::string> id_to_string;  // decode: added content or vocab string per id
  std::vector<char> is_added;
  // Bytes of input each id stands for when the model emits it (-1: not known, e.g. an unk token).
  std::vector<int32_t> token_bytes;
  bool fast = false;

  void find_added(std::string_view s, const Matcher& m, std::vector<Piece>& out) const;
  // `offs` (optional) gets each token's byte range in s.
  void encode_segment(std::string_view s, std::vector<uint32_t>& out, std::vector<Span>* offs = nullptr) const;
};

void Tokenizer::Impl::find_added(std::string_view s, const Matcher& m, std::vector<Piece>& out) const {
  if (!m.any || s.empty()) {
    if (!s.empty()) out.push_back({s, -1});
    return;
  }
  size_t start_offset = 0;
  size_t p = 0;
  while (p < s.size()) {
    const auto& cands = m.by_first[static_cast<unsigned char>(s[p])];
    const AddedToken* hit = nullptr;
    size_t hit_len = 0;
    for (uint32_t k : cands) {
      const std::string& pat = m.pattern[k];
      if (s.compare(p, pat.size(), pat) == 0) {
        hit = &added[k];
        hit_len = pat.size();
        break;  // longest first
      }
    }
    if (hit == nullptr) {
      ++p;
      continue;
    }
    size_t start = p, stop = p + hit_len;
    p = stop;  // the automaton goes on after the match whatever the strips below take
    if (hit->single_word) {
      const bool start_space = start == 0 || !is_word_char(last_char(s.substr(0, start)));
      bool stop_space = stop == s.size();
      if (!stop_space) {
        size_t n;
        stop_space = !is_word_char(decode_utf8(s, stop, n));
      }
      if (!start_space || !stop_space) continue;
    }
    if (hit->lstrip) {
      size_t ns = start;
      while (ns > 0) {
        size_t b = ns - 1;
        while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
        size_t n;
        if (!is_white_space(decode_utf8(s, b, n))) break;
        ns = b;
      }
      start = std::max(ns, start_offset);
    }
    if (hit->rstrip) {
      while (stop < s.size()) {
        size_t n;
        if (!is_white_space(decode_utf8(s, stop, n))) break;
        stop += n;
      }
    }
    if (start_offset < start) out.push_back({s.substr(start_offset, start - start_offset), -1});
    out.push_back({std::string_view(), static_cast<int64_t>(hit->id), start, stop});
    start_offset = stop;
  }
  if (start_offset < s.size()) out.push_back({s.substr(start_offset), -1});
}

// Pre-tokenizer steps and the model over one normalized stretch of text without added tokens.
void Tokenizer::Impl::encode_segment(std::string_view s, std::vector<uint32_t>& out, std::vector<Span>* offs) const {
  thread_local std::vector<std::string_view> pieces, next;
  thread_local std::vector<Span> matches;
  thread_local std::vector<std::pair<Span, bool>> marked;
  thread_local std::deque<std::string> made;  // storage of pieces a step creates (prefix space)
  thread_local std::vector<size_t> made_base;  // where each made piece's text (after its space) starts in s
  made.clear();
  made_base.clear();
  pieces.assign(1, s);
  for (const Step& st : steps) {
    next.clear();
    for (std::string_view piece : pieces) {
      if (st.prefix_space && (piece.empty() || piece[0] != ' ')) {
        made_base.push_back(piece.data() >= s.data() && piece.data() <= s.data() + s.size() ? static_cast<size_t>(piece.data() - s.data()) : 0);
        made.emplace_back(" ");
        made.back().append(piece);
        piece = made.back();
      }
      if (!st.split) {
        next.push_back(piece);
        continue;
      }
      matches.clear();
      if (st.fast) st.fast->find_all(piece, matches);
      else st.regex->find_all(piece, matches);
      // HF Pattern::find_matches: the whole piece as (span, is_match) covering it in order.
      marked.clear();
      size_t prev = 0;
      for (const Span& m : matches) {
        if (prev != m.first) marked.push_back({{prev, m.first}, false});
        marked.push_back({m, true});
        prev = m.second;
      }
      if (prev != piece.size()) marked.push_back({{prev, piece.size()}, false});
      if (st.invert)
        for (auto& mk : marked) mk.second = !mk.second;
      auto emit = [&](Span sp) {
        if (sp.second > sp.first) next.push_back(piece.substr(sp.first, sp.second - sp.first));
      };
      switch (st.behavior) {
        case Behavior::Isolated:
          for (auto& mk : marked) emit(mk.first);
          break;
        case Behavior::Removed:
          for (auto& mk : marked)
            if (!mk.second) emit(mk.first);
          break;
        case Behavior::MergedWithPrevious: {
          std::vector<Span> acc;
          bool prev_match = false;
          for (auto& [sp, is_match] : marked) {
            if (is_match && !prev_match && !acc.empty()) acc.back().second = sp.second;
            else acc.push_back(sp);
            prev_match = is_match;
          }
          for (const Span& sp : acc) emit(sp);
          break;
        }
        case Behavior::MergedWithNext: {
          std::vector<Span> acc;
          bool prev_match = false;
          for (auto it = marked.rbegin(); it != marked.rend(); ++it) {
            if (it->second && !prev_match && !acc.empty()) acc.back().first = it->first.first;
            else acc.push_back(it->first);
            prev_match = it->second;
          }
          for (auto it = acc.rbegin(); it != acc.rend(); ++it) emit(*it);
          break;
        }
        case Behavior::Contiguous: {
          std::vector<Span> acc;
          bool prev_match = false;
          for (auto& [sp, is_match] : marked) {
            if (is_match == prev_match && !acc.empty()) acc.back().second = sp.second;
            else acc.push_back(sp);
            prev_match = is_match;
          }
          for (const Span& sp : acc) emit(sp);
          break;
        }
      }
    }
    std::swap(pieces, next);
  }
  if (offs == nullptr) {
    for (std::string_view piece : pieces)
      if (!piece.empty()) bpe->encode_word(piece, out);
    return;
  }
  // Where a piece starts in s: a view into s, or into a piece the prefix-space step made (" " +
  // a view of s; its leading space is `pre` = 1 byte that is not in s).
  auto locate = [&](std::string_view piece, size_t& lo, size_t& pre) {
    const char* p = piece.data();
    lo = 0, pre = 0;
    if (p >= s.data() && p <= s.data() + s.size()) {
      lo = static_cast<size_t>(p - s.data());
      return;
    }
    for (size_t m = 0; m < made.size(); ++m)
      if (p >= made[m].data() && p <= made[m].data() + made[m].size()) {
        const size_t k = static_cast<size_t>(p - made[m].data());
        pre = k == 0 ? 1 : 0;
        lo = made_base[m] + (k == 0 ? 0 : k - 1);
        return;
      }
  };
  for (std::string_view piece : pieces) {
    if (piece.empty()) continue;
    const size_t first = out.size();
    bpe->encode_word(piece, out);
    size_t lo, pre;
    locate(piece, lo, pre);
    // Each token's bytes from the vocab; where they do not add up to the piece (an unk token), every
    // token of the piece gets the whole piece.
    size_t at = 0;
    bool known = true;
    for (size_t k = first; k < out.size() && known; ++k) {
      known = token_bytes[out[k]] >= 0;
      if (known) at += static_cast<size_t>(token_bytes[out[k]]);
    }
    known = known && at == piece.size();
    at = 0;
    for (size_t k = first; k < out.size(); ++k) {
      if (!known) {
        offs->push_back({lo, lo + piece.size() - pre});
        continue;
      }
      const size_t a = at, b = at + static_cast<size_t>(token_bytes[out[k]]);
      at = b;
      offs->push_back({lo + (a < pre ? 0 : a - pre), lo + (b < pre ? 0 : b - pre)});
    }
  }
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::string& path, TokenizerOptions opt) {
  std::string file = path;
  if (std::filesystem::is_directory(path)) file = (std::filesystem::path(path) / "tokenizer.json").string();
  DFLASH_CHECK_HINT(std::filesystem::exists(file), "tokenizer file '" << file << "' does not exist",
                    "pass a Hugging Face model directory holding tokenizer.json, or the tokenizer.json itself");
  return from_json(read_text(file), file, opt);
}

namespace {

void check_known_keys(const json& j, std::initializer_list<const char*> keys, const std::string& where) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (const char* k : keys) known = known || it.key() == k;
    DFLASH_CHECK_HINT(known, "tokenizer.json: " << where << " has the field \"" << it.key() << "\" (= " << it.value().dump().substr(0, 80)
                                                << "), which this tokenizer does not implement",
                      "supported fields: see text/tokenizer.h; ids could differ from Hugging Face's otherwise");
  }
}

void add_pre_tokenizer(const json& j, std::vector<Step>& steps, bool& byte_level, bool fast) {
  if (j.is_null()) return;
  DFLASH_CHECK(j.is_object() && j.contains("type") && j["type"].is_string(), "tokenizer.json: pre_tokenizer must be an object with a \"type\"");
  const std::string type = j["type"];
  DFLASH_CHECK_HINT(!byte_level, "tokenizer.json: pre_tokenizer " << type << " comes after ByteLevel",
                    "supported pre-tokenizer sequences end with ByteLevel");
  if (type == "Sequence") {
    DFLASH_CHECK(j.contains("pretokenizers") && j["pretokenizers"].is_array(), "tokenizer.json: pre_tokenizer Sequence without \"pretokenizers\"");
    for (const auto& p : j["pretokenizers"]) add_pre_tokenizer(p, steps, byte_level, fast);
  } else if (type == "Split") {
    check_known_keys(j, {"type", "pattern", "behavior", "invert"}, "pre_tokenizer Split");
    DFLASH_CHECK(j.contains("pattern") && j["pattern"].is_object(), "tokenizer.json: pre_tokenizer Split without a \"pattern\" object");
    const auto& pat = j["pattern"];
    std::string regex;
    if (pat.contains("Regex") && pat["Regex"].is_string()) regex = pat["Regex"];
    else if (pat.contains("String") && pat["String"].is_string()) regex = regex_escape(pat["String"].get<std::string>());
    else DFLASH_FAIL("tokenizer.json: pre_tokenizer Split pattern must be {\"Regex\": ...} or {\"String\": ...}, got " << pat.dump());
    Step st;
    st.split = true;
    st.regex = std::make_unique<Regex>(regex);
    if (fast) st.fast = QwenSplitter::for_pattern(regex);
    st.behavior = parse_behavior(j.value("behavior", std::string("Isolated")));
    st.invert = j.value("invert", false);
    st.what = std::string("Split(") + (st.fast ? "qwen fast path" : "regex") + ", " + j.value("behavior", std::string("Isolated")) +
              (st.invert ? ", invert" : "") + ")";
    steps.push_back(std::move(st));
  } else if (type == "ByteLevel") {
    check_known_keys(j, {"type", "add_prefix_space", "trim_offsets", "use_regex"}, "pre_tokenizer ByteLevel");
    const bool prefix = j.value("add_prefix_space", true), use_regex = j.value("use_regex", true);
    Step st;
    st.prefix_space = prefix;
    st.split = use_regex;
    if (use_regex) st.regex = std::make_unique<Regex>(kByteLevelPattern);
    st.what = std::string("ByteLevel(") + (prefix ? "prefix space" : "no prefix") + (use_regex ? ", regex" : "") + ")";
    steps.push_back(std::move(st));
    byte_level = true;
  } else {
    DFLASH_FAIL_HINT("tokenizer.json: pre_tokenizer type \"" << type << "\" is not supported",
                     "supported pre-tokenizers: Split, ByteLevel, Sequence of those, or none (null)");
  }
}

void check_post_processor(const json& j) {
  if (j.is_null()) return;
  const std::string type = j.value("type", std::string("?"));
  if (type == "Sequence") {
    for (const auto& p : j.value("processors", json::array())) check_post_processor(p);
    return;
  }
  DFLASH_CHECK_HINT(type == "ByteLevel" || type == "TemplateProcessing" || type == "RobertaProcessing" || type == "BertProcessing",
                    "tokenizer.json: post_processor type \"" << type << "\" is not supported",
                    "supported: ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing, Sequence (they add nothing when "
                    "special tokens are not added, which is how dflash encodes)");
}

}  // namespace

Tokenizer Tokenizer::from_json(const std::string& text, const std::string& origin, TokenizerOptions opt) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    DFLASH_FAIL("tokenizer '" << origin << "' is not valid JSON: " << e.what());
  }
  try {
    DFLASH_CHECK(j.is_object(), "tokenizer.json must hold an object");
    for (const char* k : {"truncation", "padding"})
      DFLASH_CHECK_HINT(!j.contains(k) || j[k].is_null(), "tokenizer.json: " << k << " = " << j[k].dump().substr(0, 80) << " is not supported",
                        "set it to null: dflash encodes whole texts and cuts sequences itself");
    auto impl = std::make_unique<Impl>();
    impl->origin = origin;
    impl->normalizer = Normalizer::from_json(j.value("normalizer", json()));
    add_pre_tokenizer(j.value("pre_tokenizer", json()), impl->steps, impl->byte_level, opt.fast_paths);
    for (const auto& st : impl->steps) impl->fast = impl->fast || st.fast.has_value();
    check_post_processor(j.value("post_processor", json()));

    const json dec = j.value("decoder", json());
    DFLASH_CHECK_HINT(dec.is_object() && dec.value("type", std::string()) == "ByteLevel",
                      "tokenizer.json: decoder " << (dec.is_null() ? std::string("null") : "type \"" + dec.value("type", std::string("?")) + "\"")
                                                 << " is not supported",
                      "supported decoder: ByteLevel (the GPT-2 / Qwen / Llama-3 byte-level kind)");

    DFLASH_CHECK(j.contains("model") && j["model"].is_object(), "tokenizer.json has no \"model\" object");
    const json& model = j["model"];
    const std::string mtype = model.value("type", std::string(model.contains("merges") ? "BPE" : "?"));
    DFLASH_CHECK_HINT(mtype == "BPE", "tokenizer.json: model type \"" << mtype << "\" is not supported",
                      "supported model: BPE (WordPiece, Unigram and WordLevel are not implemented)");
    impl->bpe.emplace(Bpe::from_json(model, impl->byte_level));

    // Added tokens get their ids as HF's AddedVocabulary::add_tokens gives them (the "id" field is
    // not used there, only warned about): the id of the same content already added or in the model
    // vocab, else the next free id from the model vocab's size on. A content listed again replaces
    // the earlier entry's options; an empty content is ignored.
    size_t n_ids = impl->bpe->id_to_token().size();
    uint32_t next_id = static_cast<uint32_t>(impl->bpe->vocab().size());
    std::unordered_map<std::string, uint32_t> added_ids;
    std::map<uint32_t, AddedToken> by_id;
    for (const auto& a : j.value("added_tokens", json::array())) {
      check_known_keys(a, {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"}, "an added_tokens entry");
      AddedToken t;
      DFLASH_CHECK(a.contains("content") && a["content"].is_string(), "tokenizer.json: an added_tokens entry needs a \"content\": " << a.dump());
      t.content = a["content"].get<std::string>();
      check_utf8(t.content, "tokenizer.json: added token content");
      if (t.content.empty()) continue;
      t.special = a.value("special", false);
      t.lstrip = a.value("lstrip", false);
      t.rstrip = a.value("rstrip", false);
      t.normalized = a.value("normalized", !t.special);
      t.single_word = a.value("single_word", false);
      if (auto it = added_ids.find(t.content); it != added_ids.end()) t.id = it->second;
      else if (auto v = impl->bpe->vocab().find(t.content); v != impl->bpe->vocab().end()) t.id = v->second;
      else t.id = next_id++;
      if (a.contains("id") && a["id"].is_number_unsigned() && a["id"].get<uint64_t>() != t.id)
        spdlog::warn("{}: added token '{}' is listed with id {} but gets id {} (as in Hugging Face tokenizers)", origin, t.content,
                     a["id"].get<uint64_t>(), t.id);
      added_ids[t.content] = t.id;
      n_ids = std::max(n_ids, size_t(t.id) + 1);
      by_id[t.id] = std::move(t);
    }
    for (auto& [id, t] : by_id) impl->added.push_back(std::move(t));
    impl->raw.pattern.resize(impl->added.size());
    impl->norm.pattern.resize(impl->added.size());
    for (uint32_t k = 0; k < impl->added.size(); ++k) {
      const AddedToken& t = impl->added[k];
      Impl::Matcher& m = t.normalized ? impl->norm : impl->raw;
      m.pattern[k] = t.normalized ? impl->normalizer.apply(t.content) : t.content;
      if (m.pattern[k].empty()) continue;
      m.by_first[static_cast<unsigned char>(m.pattern[k][0])].push_back(k);
      m.any = true;
    }
    for (Impl::Matcher* m : {&impl->raw, &impl->norm})
      for (auto& v : m->by_first)
        std::stable_sort(v.begin(), v.end(), [&](uint32_t a, uint32_t b) { return m->pattern[a].size() > m->pattern[b].size(); });

    impl->token_bytes.assign(n_ids, -1);
    for (size_t i = 0; i < impl->bpe->id_to_token().size(); ++i) {
      const std::string& t = impl->bpe->id_to_token()[i];
      if (t.empty()) continue;
      if (!impl->byte_level) {  // raw text, or a byte-fallback <0xXX> token
        const bool fallback = t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>';
        impl->token_bytes[i] = fallback ? 1 : static_cast<int32_t>(t.size());
        continue;
      }
      int32_t n = 0;
      for (size_t k = 0; k < t.size() && n >= 0;) {  // every character a byte image
        size_t len;
        n = char_to_byte(decode_utf8(t, k, len)) < 0 ? -1 : n + 1;
        k += len;
      }
      impl->token_bytes[i] = n;
    }
    impl->id_to_string.assign(n_ids, std::string());
    impl->is_added.assign(n_ids, 0);
    const auto& vt = impl->bpe->id_to_token();
    for (size_t i = 0; i < vt.size(); ++i) impl->id_to_string[i] = vt[i];
    for (const auto& t : impl->added) {
      impl->id_to_string[t.id] = t.content;
      impl->is_added[t.id] = 1;
    }
    return Tokenizer(std::move(impl));
  } catch (const Error& e) {
    DFLASH_FAIL_HINT(origin << ": " << e.message(), e.hint());
  } catch (const json::exception& e) {
    DFLASH_FAIL("tokenizer '" << origin << "': unexpected JSON layout: " << e.what());
  }
}

void Tokenizer::encode(std::string_view text, std::vector<uint32_t>& out) const {
  check_utf8(text, "text to encode");
  const Impl& im = *impl_;
  thread_local std::vector<Piece> outer, inner;
  outer.clear();
  im.find_added(text, im.raw, outer);
  for (const Piece& p : outer) {
    if (p.token >= 0) {
      out.push_back(static_cast<uint32_t>(p.token));
      continue;
    }
    std::string normalized;
    std::string_view seg = p.text;
    if (!im.normalizer.empty()) {
      normalized = im.normalizer.apply(p.text);
      seg = normalized;
    }
    inner.clear();
    im.find_added(seg, im.norm, inner);
    for (const Piece& q : inner) {
      if (q.token >= 0) out.push_back(static_cast<uint32_t>(q.token));
      else im.encode_segment(q.text, out);
    }
  }
}

Tokenizer::Encoding Tokenizer::encode_with_offsets(std::string_view text) const {
  check_utf8(text, "text to encode");
  const Impl& im = *impl_;
  Encoding enc;
  std::vector<Piece> outer, inner;
  std::vector<Span> seg_offs, align;  // align: per byte of a normalized segment, its range in text
  im.find_added(text, im.raw, outer);
  for (const Piece& p : outer) {
    if (p.token >= 0) {
      enc.ids.push_back(static_cast<uint32_t>(p.token));
      enc.offsets.push_back({p.begin, p.end});
      continue;
    }
    const size_t base = static_cast<size_t>(p.text.data() - text.data());
    std::string normalized;
    std::string_view seg = p.text;
    bool identity = true;
    if (!im.normalizer.empty()) {
      normalized = im.normalizer.apply(p.text);
      if (normalized != p.text) {
        seg = normalized;
        identity = false;
        // Normalize between boundaries, piece by piece: an unchanged piece maps byte for byte, a
        // changed one maps each of its bytes to the whole original piece. Should the pieces not add
        // up to the whole (they do for NFC and NFKC), every byte maps to the whole segment.
        align.clear();
        std::string joined;
        const std::vector<size_t> cuts = im.normalizer.boundaries(p.text);
        for (size_t c = 0; c + 1 < cuts.size(); ++c) {
          const std::string_view orig = p.text.substr(cuts[c], cuts[c + 1] - cuts[c]);
          const std::string part = im.normalizer.apply(orig);
          joined += part;
          for (size_t k = 0; k < part.size(); ++k)
            align.push_back(part == orig ? Span{base + cuts[c] + k, base + cuts[c] + k + 1}
                                         : Span{base + cuts[c], base + cuts[c + 1]});
        }
        if (joined != normalized) align.assign(normalized.size(), Span{base, base + p.text.size()});
      }
    }
    // A token of no bytes of the segment (the space a ByteLevel prefix step added) takes the range
    // of the character after it, as HF aligns a prepended character.
    auto map = [&](size_t a, size_t b) -> Span {
      if (a >= b && a < seg.size()) b = a + 1;
      if (identity) return {base + a, base + b};
      if (a >= b) return {base + p.text.size(), base + p.text.size()};
      return {align[a].first, align[b - 1].second};
    };
    inner.clear();
    im.find_added(seg, im.norm, inner);
    for (const Piece& q : inner) {
      if (q.token >= 0) {
        enc.ids.push_back(static_cast<uint32_t>(q.token));
        enc.offsets.push_back(map(q.begin, q.end));
        continue;
      }
      const size_t qoff = static_cast<size_t>(q.text.data() - seg.data());
      seg_offs.clear();
      im.encode_segment(q.text, enc.ids, &seg_offs);
      for (const Span& o : seg_offs) enc.offsets.push_back(map(qoff + o.first, qoff + o.second));
    }
  }
  DFLASH_CHECK(enc.ids.size() == enc.offsets.size(), "encode_with_offsets: " << enc.ids.size() << " ids but " << enc.offsets.size() << " offsets");
  // A token holding part of a character's bytes stands for the whole character (HF's byte-level alignments).
  auto cont = [&](size_t i) { return i < text.size() && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80; };
  for (auto& [b, e] : enc.offsets) {
    while (b > 0 && cont(b)) --b;
    while (cont(e)) ++e;
  }
  return enc;
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  encode(text, ids);
  return ids;
}

std::string Tokenizer::decode(std::span<const uint32_t> ids) const {
  const Impl& im = *impl_;
  std::string bytes;
  for (size_t k = 0; k < ids.size(); ++k) {
    const uint32_t id = ids[k];
    DFLASH_CHECK(id < im.id_to_string.size() && (im.is_added[id] || !im.id_to_string[id].empty()),
                 "decode: id " << id << " (position " << k << ") is not in the tokenizer's vocabulary of " << im.id_to_string.size() << " ids");
    // ByteLevel decoder: a token whose characters are all byte images becomes those bytes; any
    // other token (an added token with other characters) goes in as its UTF-8 text.
    const std::string& t = im.id_to_string[id];
    const size_t mark = bytes.size();
    bool all = true;
    for (size_t i = 0; i < t.size();) {
      size_t n;
      const int b = char_to_byte(decode_utf8(t, i, n));
      if (b < 0) { all = false; break; }
      bytes.push_back(static_cast<char>(b));
      i += n;
    }
    if (!all) {
      bytes.resize(mark);
      bytes += t;
    }
  }
  return utf8_lossy(bytes);
}

std::string Tokenizer::normalize(std::string_view s) const {
  check_utf8(s, "text to normalize");
  return impl_->normalizer.apply(s);
}

size_t Tokenizer::vocab_size() const { return impl_->id_to_string.size(); }

std::optional<uint32_t> Tokenizer::token_to_id(std::string_view token) const {
  for (const auto& t : impl_->added)
    if (t.content == token) return t.id;
  const auto& v = impl_->bpe->vocab();
  if (auto it = v.find(token); it != v.end()) return it->second;
  return std::nullopt;
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }
bool Tokenizer::uses_fast_path() const { return impl_->fast; }

std::string Tokenizer::describe() const {
  const Impl& im = *impl_;
  std::ostringstream os;
  os << "BPE, " << im.id_to_string.size() << " ids, " << im.bpe->merges() << " merges, normalizer "
     << im.normalizer.describe() << ", pre-tokenizer ";
  if (im.steps.empty()) os << "none";
  for (size_t i = 0; i < im.steps.size(); ++i) os << (i ? " > " : "") << im.steps[i].what;
  os << ", " << im.added.size() << " added tokens";
  return os.str();
}

}  // namespace dflash::text
