#include "text/stop_tokens.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/tokenizer.h"

namespace dflash::text {

namespace fs = std::filesystem;
using nlohmann::json;

bool is_token_id(const std::string& spec) {
  if (spec.empty()) return false;
  for (char c : spec)
    if (c < '0' || c > '9') return false;
  return true;
}

namespace {

std::string ids_text(const std::vector<uint32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

// JSON of a file (null when the file is not there); a file that is not JSON is an error naming it.
json read_json(const fs::path& p) {
  if (!fs::exists(p)) return nullptr;
  std::ifstream in(p);
  DFLASH_CHECK_IO(in.good(), "reading", p.string());
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::exception& e) {
    DFLASH_REJECT_HINT(p.string() << ": not valid JSON (" << e.what() << ")", "fix or re-download the file");
  }
}

// eos_token_id as an int or a list of ints; `where` names the file and key in errors.
std::vector<int32_t> eos_ids(const json& v, const std::string& where) {
  std::vector<int32_t> out;
  auto one = [&](const json& x) {
    DFLASH_REQUIRE_HINT(x.is_number_integer() && x.get<int64_t>() >= 0 && x.get<int64_t>() <= INT32_MAX,
                        where << " holds " << x.dump() << ", not a token id",
                        "eos_token_id is an integer >= 0 or a list of them; fix the file or pass --stop-token");
    out.push_back(static_cast<int32_t>(x.get<int64_t>()));
  };
  if (v.is_array()) {
    for (const json& x : v) one(x);
  } else {
    one(v);
  }
  return out;
}

}  // namespace

int32_t resolve_stop_token(const std::string& spec, const Tokenizer* tok, const std::string& what) {
  if (is_token_id(spec)) {
    DFLASH_REQUIRE(spec.size() <= 10 && std::stoll(spec) <= INT32_MAX, what << " " << spec << " is not a token id (too large)");
    return static_cast<int32_t>(std::stoll(spec));
  }
  DFLASH_REQUIRE_HINT(!spec.empty(), what << " is empty", "give a token id (151645) or a token's text (<|im_end|>)");
  DFLASH_REQUIRE_HINT(tok != nullptr, what << " '" << spec << "' is text, and there is no tokenizer to look it up in",
                      "give the token's id, or a tokenizer (--tokenizer DIR, or a --model directory with tokenizer.json)");
  if (const auto id = tok->token_to_id(spec)) return static_cast<int32_t>(*id);
  std::vector<uint32_t> ids;
  try {
    ids = tok->encode(spec);
  } catch (const Error& e) {
    DFLASH_REJECT(what << " '" << spec << "': " << e.message());
  }
  DFLASH_REQUIRE_HINT(ids.size() == 1,
                      what << " '" << spec << "' is not one token: the tokenizer encodes it to " << ids.size() << " ("
                           << ids_text(ids) << ")",
                      "give one token's text (an added token such as <|im_end|>, or a vocab entry) or its id");
  return static_cast<int32_t>(ids[0]);
}

std::vector<int32_t> resolve_stop_tokens(const std::vector<std::string>& specs, const Tokenizer* tok, const std::string& what) {
  std::vector<int32_t> out;
  for (const std::string& s : specs) out.push_back(resolve_stop_token(s, tok, what));
  return out;
}

DefaultStopTokens default_stop_tokens(const std::string& path, const std::function<const Tokenizer*()>& tokenizer) {
  DefaultStopTokens d;
  const fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
  const fs::path gen = dir / "generation_config.json", cfg = dir / "config.json", tcfg = dir / "tokenizer_config.json";
  if (const json g = read_json(gen); g.is_object() && g.contains("eos_token_id") && !g["eos_token_id"].is_null()) {
    d.ids = eos_ids(g["eos_token_id"], gen.string() + ": eos_token_id");
    d.source = "generation_config.json";
    return d;
  }
  if (const json c = read_json(cfg); c.is_object()) {
    const json* v = nullptr;
    if (c.contains("eos_token_id") && !c["eos_token_id"].is_null()) v = &c["eos_token_id"];
    else if (c.contains("text_config") && c["text_config"].is_object() && c["text_config"].contains("eos_token_id") &&
             !c["text_config"]["eos_token_id"].is_null())
      v = &c["text_config"]["eos_token_id"];
    if (v) {
      d.ids = eos_ids(*v, cfg.string() + ": eos_token_id");
      d.source = "config.json";
      return d;
    }
  }
  if (const json t = read_json(tcfg); t.is_object() && t.contains("eos_token") && !t["eos_token"].is_null()) {
    const json& e = t["eos_token"];
    std::string text;
    if (e.is_string()) text = e.get<std::string>();
    else if (e.is_object() && e.contains("content") && e["content"].is_string()) text = e["content"].get<std::string>();
    DFLASH_REQUIRE_HINT(!text.empty(), tcfg.string() << ": eos_token is " << e.dump() << ", not a token's text",
                        "eos_token is a string or {\"content\": ...}; fix the file or pass --stop-token");
    const Tokenizer* tok = tokenizer ? tokenizer() : nullptr;
    if (!tok) {
      d.note = tcfg.string() + " names eos_token '" + text + "', but there is no tokenizer to resolve it";
      return d;
    }
    const auto id = tok->token_to_id(text);
    DFLASH_REQUIRE_HINT(id.has_value(), tcfg.string() << ": eos_token '" << text << "' is not a token of the tokenizer",
                        "fix the file or pass --stop-token");
    d.ids = {static_cast<int32_t>(*id)};
    d.source = "tokenizer_config.json";
    return d;
  }
  d.note = "no eos_token_id in " + dir.string() + " (generation_config.json, config.json) and no eos_token in its tokenizer_config.json";
  return d;
}

std::string describe_stop_tokens(const std::vector<int32_t>& ids, const Tokenizer* tok) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) s += ", ";
    const int32_t id = ids[i];
    if (tok && id >= 0 && static_cast<size_t>(id) < tok->vocab_size()) {
      std::string text;
      try {
        const uint32_t u = static_cast<uint32_t>(id);
        text = tok->decode(std::span<const uint32_t>(&u, 1));
      } catch (const Error&) {
        text.clear();  // an id the vocabulary does not hold: the id alone
      }
      if (!text.empty()) {
        s += json(text).dump() == "\"" + text + "\"" ? text : json(text).dump();  // control characters escaped
        s += " (" + std::to_string(id) + ")";
        continue;
      }
    }
    s += std::to_string(id);
  }
  return s.empty() ? "none" : s;
}

StopTokenChoice choose_stop_tokens(const std::vector<std::string>& specs, const std::string& what,
                                   const std::string& defaults_dir, const std::function<const Tokenizer*()>& tokenizer) {
  StopTokenChoice c;
  auto tok = [&]() -> const Tokenizer* { return tokenizer ? tokenizer() : nullptr; };
  if (!specs.empty()) {
    bool text = false;
    for (const std::string& s : specs) text = text || !is_token_id(s);
    const Tokenizer* t = text ? tok() : nullptr;
    c.ids = resolve_stop_tokens(specs, t, what);
    c.log = "stop tokens: " + describe_stop_tokens(c.ids, t) + " from " + what;
    return c;
  }
  if (defaults_dir.empty()) {
    c.log = "stop tokens: none (no " + what + " given, and no model or tokenizer directory to take the target's own from)";
    return c;
  }
  const DefaultStopTokens d = default_stop_tokens(defaults_dir, tok);
  if (d.ids.empty()) {
    c.log = "stop tokens: none (" + d.note + ")";
    return c;
  }
  c.ids = d.ids;
  c.log = "stop tokens: " + describe_stop_tokens(c.ids, tok()) + " from " + d.source;
  return c;
}

}  // namespace dflash::text
