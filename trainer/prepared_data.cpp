#include "trainer/prepared_data.h"

#include <filesystem>
#include <fstream>
#include <optional>

#include <fmt/format.h>

#include "core/error.h"
#include "core/io/files.h"
#include "core/io/sha256.h"
#ifdef DFLASH_WITH_TEXT
#include "data/prepare.h"
#endif

namespace dflash::trainer {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "dflash.prepared.v1";
// The files of a tokenizer directory that decide the ids and the chat template.
constexpr const char* kTokenizerFiles[] = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"};

std::string absolute(const std::string& p) { return fs::absolute(p).lexically_normal().string(); }

// data.tokenizer names a directory (or a tokenizer.json, whose directory holds the template).
fs::path tokenizer_directory(const std::string& t) { return fs::is_directory(t) ? fs::path(t) : fs::path(t).parent_path(); }

std::string tokenizer_key_name(const TrainConfig& cfg) {
  return cfg.data.tokenizer.empty() ? "model.target.path (data.tokenizer is not set)" : "data.tokenizer";
}

int64_t mtime_ns(const fs::path& p) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(fs::last_write_time(p).time_since_epoch()).count();
}

std::string key_path(const TrainConfig& cfg) { return cfg.prepare_path() + ".key.json"; }

std::optional<json> read_json_file(const std::string& path) {
  if (!fs::exists(path)) return std::nullopt;
  try {
    std::ifstream f(path);
    return json::parse(f);
  } catch (const std::exception&) {
    return std::nullopt;  // unreadable: treated as absent (the file is made again)
  }
}

std::string diff(const json& was, const json& now, const std::string& path) {
  if (was.is_object() && now.is_object()) {
    for (auto it = now.begin(); it != now.end(); ++it) {
      const std::string p = path.empty() ? it.key() : path + "." + it.key();
      // Content decides: where the input and the tokenizer lie and when the input was written do not.
      if (p == "input.mtime_ns" || p == "input.path" || p == "tokenizer.path" || p == "summary") continue;
      if (!was.contains(it.key())) return p + ": not in the earlier key";
      const std::string d = diff(was[it.key()], it.value(), p);
      if (!d.empty()) return d;
    }
    return {};
  }
  if (was != now) return fmt::format("{}: was {}, now {}", path, was.dump(), now.dump());
  return {};
}

#ifdef DFLASH_WITH_TEXT
// Whether a regenerate manifest (`<out>.json` or `<out>.parts/manifest.json`) lists `prepared` as an input.
bool made_from(const std::string& manifest, const std::string& prepared) {
  const std::optional<json> m = read_json_file(manifest);
  if (!m || !m->contains("inputs") || !(*m)["inputs"].is_array()) return false;
  for (const json& in : (*m)["inputs"])
    if (in.is_object() && in.value("path", std::string()) == prepared) return true;
  return false;
}
#endif

}  // namespace

void check_train_text(const TrainConfig& cfg) {
  const std::string& in = cfg.data.train;
  DFLASH_REQUIRE_HINT(fs::is_regular_file(in), cfg.source << ": data.train '" << in << "' "
                                                     << (fs::exists(in) ? "is not a file" : "does not exist"),
                      "data.train is a JSONL of conversations; relative paths are relative to the directory dflash_train "
                      "was started in");
  const std::string tok = cfg.tokenizer_dir();
  const fs::path dir = tokenizer_directory(tok);
  DFLASH_REQUIRE_HINT(fs::is_regular_file(fs::is_directory(tok) ? dir / "tokenizer.json" : fs::path(tok)),
                      cfg.source << ": " << tokenizer_key_name(cfg) << " '" << tok << "' holds no tokenizer.json (data.train "
                                 << "is tokenized with it)",
                      "set data.tokenizer to the target's tokenizer directory (tokenizer.json and tokenizer_config.json "
                      "with its chat template)");
  const std::string& ct = cfg.data.prepare.chat_template;
  DFLASH_REQUIRE_HINT(ct.empty() || fs::is_regular_file(ct),
                      cfg.source << ": data.prepare.chat_template '" << ct << "' " << (fs::exists(ct) ? "is not a file" : "does not exist"),
                      "name a .jinja chat template, or leave it empty for the tokenizer directory's own");
#ifndef DFLASH_WITH_TEXT
  DFLASH_REJECT_HINT(cfg.source << ": data.train needs the tokenizer, and this build has none (text/ was skipped)",
                     "install libonig-dev and libicu-dev (scripts/common.sh lists them) and configure again, or prepare "
                     "the data elsewhere with dflash_data prepare and list it in data.files");
#endif
}

json prepared_key(const TrainConfig& cfg, const json& previous) {
  const std::string in = absolute(cfg.data.train);
  const int64_t bytes = static_cast<int64_t>(fs::file_size(in)), mtime = mtime_ns(in);
  std::string sha;
  if (previous.is_object() && previous.contains("input")) {
    const json& p = previous["input"];
    if (p.value("path", std::string()) == in && p.value("bytes", int64_t{-1}) == bytes &&
        p.value("mtime_ns", int64_t{-1}) == mtime)
      sha = p.value("sha256", std::string());
  }
  if (sha.empty()) sha = io::sha256_file(in);
  const std::string tok = cfg.tokenizer_dir();
  const fs::path dir = tokenizer_directory(tok);
  json files = json::object();
  for (const char* name : kTokenizerFiles) {
    const fs::path f = dir / name;
    files[name] = fs::is_regular_file(f) ? json(io::sha256_file(f.string())) : json(nullptr);
  }
  if (!fs::is_directory(tok)) files[fs::path(tok).filename().string()] = io::sha256_file(tok);
  const PrepareSection& p = cfg.data.prepare;
  return json{{"format", kFormat},
              {"rules", data::kPrepareRules},
              {"input", {{"path", in}, {"bytes", bytes}, {"mtime_ns", mtime}, {"sha256", sha}}},
              {"tokenizer", {{"path", absolute(tok)}, {"files", files}}},
              {"options",
               {{"think", p.think},
                {"last_turn_only", p.last_turn_only},
                {"enable_thinking", p.enable_thinking ? json(*p.enable_thinking) : json(nullptr)},
                {"max_length", cfg.prepare_max_length()},
                {"skip_bad", p.skip_bad},
                {"prompts_only", p.prompts_only},
                // The template's bytes (its path aside: content decides); null = the tokenizer's own, hashed above.
                {"chat_template", p.chat_template.empty() ? json(nullptr) : json(io::sha256_file(p.chat_template))}}}};
}

std::string prepared_key_difference(const json& was, const json& now) { return diff(was, now, ""); }

PreparedText prepare_train_text(const TrainConfig& cfg) {
  check_train_text(cfg);
  PreparedText r;
  r.path = cfg.prepare_path();
  const std::string kp = key_path(cfg);
  const std::optional<json> was = read_json_file(kp);
  json now = prepared_key(cfg, was ? *was : json(nullptr));
  std::string why;
  if (!fs::exists(r.path)) why = "none made yet";
  else if (!was) why = fs::exists(kp) ? "its key " + kp + " cannot be read" : "it has no key " + kp;
  else why = prepared_key_difference(*was, now);
  if (why.empty()) {
    r.reused = true;
    // Touched or moved, same bytes: the key takes the new mtime and paths (the next start need not hash it).
    now["summary"] = was->value("summary", json(nullptr));
    if (now != *was) io::write_file_atomic(kp, now.dump(2) + "\n");
    r.log = fmt::format("using the prepared data {} (made earlier from {} with this tokenizer and these options)", r.path,
                        cfg.data.train);
    return r;
  }
#ifndef DFLASH_WITH_TEXT
  DFLASH_FAIL("data.train: this build has no tokenizer (check_train_text refuses it)");
#else
  // The old key first: from here until the new key is written, the file on disk is not trusted.
  if (fs::exists(kp)) fs::remove(kp);
  const fs::path out(r.path);
  if (out.has_parent_path()) fs::create_directories(out.parent_path());
  // Data regenerated from the earlier prepared file is stale now (its manifest names this file).
  std::string removed;
  const std::string prepared_abs = absolute(r.path), regen = cfg.regenerate_path();
  if (made_from(regen + ".json", prepared_abs)) {
    fs::remove(regen);
    fs::remove(regen + ".json");
    removed += regen;
  }
  if (made_from(regen + ".parts/manifest.json", prepared_abs)) {
    fs::remove_all(regen + ".parts");
    removed += (removed.empty() ? "" : ", ") + regen + ".parts";
  }
  data::PrepareOptions po;
  po.tokenizer = cfg.tokenizer_dir();
  po.think = cfg.data.prepare.think == "out" ? data::ThinkMode::out : data::ThinkMode::in;
  po.last_turn_only = cfg.data.prepare.last_turn_only;
  po.enable_thinking = cfg.data.prepare.enable_thinking;
  po.max_length = static_cast<size_t>(cfg.prepare_max_length());
  po.skip_bad = cfg.data.prepare.skip_bad;
  po.prompts_only = cfg.data.prepare.prompts_only;
  po.chat_template = cfg.data.prepare.chat_template;
  po.progress = cfg.logging.progress_bar;
  data::PrepareSummary s;
  try {
    s = data::prepare_jsonl(cfg.data.train, r.path, po);
  } catch (const Error& e) {
    if (!e.is_user_error()) throw;
    // dflash_data prepare's flags are this config's data.prepare keys.
    std::string hint = e.hint();
    for (size_t at; (at = hint.find("--skip-bad")) != std::string::npos;) hint.replace(at, 10, "data.prepare.skip_bad: true");
    DFLASH_REJECT_HINT("data.train: " << e.message(), hint);
  }
  now["summary"] = {{"rows", s.rows},         {"written", s.written}, {"bad_skipped", s.bad_skipped},
                    {"prompt_only", s.prompt_only}, {"truncated", s.truncated}, {"tokens", s.tokens},
                    {"supervised", s.supervised}};
  io::write_file_atomic(kp, now.dump(2) + "\n");
  r.log = fmt::format("prepared {} from {} with the tokenizer {} ({}){}:\n{}", r.path, cfg.data.train, po.tokenizer, why,
                      removed.empty() ? "" : "; removed the data regenerated from the earlier one: " + removed, s.describe());
  if (s.bad_skipped > 0) r.log += fmt::format("\nthe first bad row: {}", s.first_bad);
  return r;
#endif
}

}  // namespace dflash::trainer
