#include "trainer/config.h"

#include <glob.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include "comm/comm.h"
#include "core/error.h"
#include "target_model/tp.h"

namespace dflash::trainer {

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::Cosine: return "cosine";
    case Schedule::Linear: return "linear";
    case Schedule::Constant: return "constant";
  }
  return "?";
}

namespace {

// ---------------------------------------------------------------------------------------------
// Scalars. Values are read from the YAML text with our own strict rules (yaml-cpp's as<T>
// differs between 0.7 and 0.8 and accepts "1.5" as an int in places): a number or a boolean must
// be a plain (unquoted) scalar that parses completely.

// Thrown by a field's parser when a value has the wrong type or range; the caller adds the
// source, key and expected form.
struct BadValue {};

bool is_plain(const YAML::Node& n) { return n.IsScalar() && n.Tag() != "!"; }

std::string flow_text(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "null";
  if (n.IsScalar()) return n.Tag() == "!" ? "\"" + n.Scalar() + "\"" : n.Scalar();
  YAML::Emitter e;
  e << YAML::Flow << n;
  return e.c_str();
}

std::optional<int64_t> to_int(const YAML::Node& n) {
  if (!is_plain(n)) return std::nullopt;
  std::string s = n.Scalar();
  if (!s.empty() && s[0] == '+') s.erase(0, 1);
  int64_t v = 0;
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, v);
  if (s.empty() || ec != std::errc() || p != end) return std::nullopt;
  return v;
}

std::optional<double> to_double(const YAML::Node& n) {
  if (!is_plain(n)) return std::nullopt;
  const std::string& s = n.Scalar();
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

std::optional<bool> to_bool(const YAML::Node& n) {
  if (!is_plain(n)) return std::nullopt;
  std::string s = n.Scalar();
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  if (s == "true" || s == "on" || s == "yes") return true;
  if (s == "false" || s == "off" || s == "no") return false;
  return std::nullopt;
}

// Strings accept any scalar; an empty value (`key:`) is "".
std::optional<std::string> to_str(const YAML::Node& n) {
  if (n.IsNull()) return std::string();
  if (!n.IsScalar()) return std::nullopt;
  return n.Scalar();
}

// YAML text of values (to_yaml and the settings table).
std::string show(int64_t v) { return std::to_string(v); }
std::string show(bool v) { return v ? "true" : "false"; }
std::string show(const std::optional<int64_t>& v) { return v ? std::to_string(*v) : "null"; }
std::string show(double v) {
  char buf[64];
  auto [p, ec] = std::to_chars(buf, buf + sizeof buf, v);  // shortest text that reads back exactly
  std::string s(buf, p);
  const size_t e = s.find('e');
  if (e != std::string::npos) {  // "6e-04" -> "6e-4", "1e+09" -> "1e9"
    size_t d = e + 1;
    if (d < s.size() && s[d] == '+') s.erase(d, 1);
    if (d < s.size() && s[d] == '-') ++d;
    while (d + 1 < s.size() && s[d] == '0') s.erase(d, 1);
  }
  return s;
}
std::string show(const std::string& v) {
  std::string o = "\"";
  for (unsigned char ch : v) {
    if (ch == '"' || ch == '\\') o += '\\', o += static_cast<char>(ch);
    else if (ch == '\n') o += "\\n";
    else if (ch == '\t') o += "\\t";
    else if (ch < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", ch);
      o += b;
    } else o += static_cast<char>(ch);
  }
  return o + "\"";
}
template <class T>
std::string show(const std::vector<T>& v) {
  std::string o = "[";
  for (size_t i = 0; i < v.size(); ++i) o += (i ? ", " : "") + show(v[i]);
  return o + "]";
}

// ---------------------------------------------------------------------------------------------
// The schema: every key, its expected form, how to read it and how to write it.

struct Field {
  std::string key;       // "training.lr"
  std::string expected;  // "a positive number"
  std::function<void(TrainConfig&, const YAML::Node&)> parse;  // throws BadValue
  std::function<std::string(const TrainConfig&)> show;          // YAML text of the value
};

#define DFLASH_MEMBER(m) [](auto& c) -> auto& { return c.m; }

std::string int_expected(int64_t min) {
  if (min == 1) return "a positive integer";
  if (min == 0) return "a non-negative integer";
  return "an integer >= " + std::to_string(min);
}

template <class Get>
Field int_field(std::string key, int64_t min, Get get) {
  return {std::move(key), int_expected(min),
          [=](TrainConfig& c, const YAML::Node& n) {
            auto v = to_int(n);
            if (!v || *v < min) throw BadValue{};
            get(c) = *v;
          },
          [=](const TrainConfig& c) { return show(get(c)); }};
}

template <class Get>
Field opt_int_field(std::string key, int64_t min, std::string what, Get get) {
  return {std::move(key), what + " (" + int_expected(min) + ") or null",
          [=](TrainConfig& c, const YAML::Node& n) {
            if (n.IsNull()) {
              get(c).reset();
              return;
            }
            auto v = to_int(n);
            if (!v || *v < min) throw BadValue{};
            get(c) = *v;
          },
          [=](const TrainConfig& c) { return show(get(c)); }};
}

enum class Range { Positive, NonNegative, Unit };  // > 0, >= 0, [0, 1)

bool in_range(double v, Range r) {
  switch (r) {
    case Range::Positive: return v > 0;
    case Range::NonNegative: return v >= 0;
    case Range::Unit: return v >= 0 && v < 1;
  }
  return false;
}
const char* range_expected(Range r) {
  switch (r) {
    case Range::Positive: return "a positive number";
    case Range::NonNegative: return "a number >= 0";
    case Range::Unit: return "a number in [0, 1)";
  }
  return "?";
}

template <class Get>
Field num_field(std::string key, Range r, Get get) {
  return {std::move(key), range_expected(r),
          [=](TrainConfig& c, const YAML::Node& n) {
            auto v = to_double(n);
            if (!v || !in_range(*v, r)) throw BadValue{};
            get(c) = *v;
          },
          [=](const TrainConfig& c) { return show(get(c)); }};
}

template <class Get>
Field bool_field(std::string key, Get get) {
  return {std::move(key), "true or false",
          [=](TrainConfig& c, const YAML::Node& n) {
            auto v = to_bool(n);
            if (!v) throw BadValue{};
            get(c) = *v;
          },
          [=](const TrainConfig& c) { return show(get(c)); }};
}

// true, false or null (unset: the default of whatever reads it).
template <class Get>
Field opt_bool_field(std::string key, std::string what, Get get) {
  return {std::move(key), "true, false or null (" + what + ")",
          [=](TrainConfig& c, const YAML::Node& n) {
            if (n.IsNull()) {
              get(c).reset();
              return;
            }
            auto v = to_bool(n);
            if (!v) throw BadValue{};
            get(c) = *v;
          },
          [=](const TrainConfig& c) { return get(c) ? show(*get(c)) : std::string("null"); }};
}

template <class Get>
Field string_field(std::string key, std::string what, bool allow_empty, Get get) {
  return {std::move(key), std::move(what),
          [=](TrainConfig& c, const YAML::Node& n) {
            auto v = to_str(n);
            if (!v || (!allow_empty && v->empty())) throw BadValue{};
            get(c) = *v;
          },
          [=](const TrainConfig& c) { return show(get(c)); }};
}

// A list; a single scalar counts as a one-element list when `scalar_ok`.
template <class Get, class Item>
Field list_field(std::string key, std::string what, bool scalar_ok, size_t exact_size, Item item, Get get) {
  return {std::move(key), std::move(what),
          [=](TrainConfig& c, const YAML::Node& n) {
            auto& out = get(c);
            std::remove_reference_t<decltype(out)> v;
            if (n.IsSequence()) {
              for (const YAML::Node& x : n) v.push_back(item(x));
            } else if (scalar_ok && n.IsScalar()) {
              v.push_back(item(n));
            } else if (!n.IsNull()) {
              throw BadValue{};
            }
            if (exact_size && v.size() != exact_size) throw BadValue{};
            out = std::move(v);
          },
          [=](const TrainConfig& c) { return show(get(c)); }};
}

template <class Enum, class Get>
Field enum_field(std::string key, std::vector<std::pair<std::string, Enum>> choices, Get get) {
  std::string what = "one of";
  for (size_t i = 0; i < choices.size(); ++i) what += (i ? ", " : " ") + choices[i].first;
  return {std::move(key), what,
          [=](TrainConfig& c, const YAML::Node& n) {
            if (!n.IsScalar()) throw BadValue{};
            for (const auto& [name, value] : choices)
              if (n.Scalar() == name) {
                get(c) = value;
                return;
              }
            throw BadValue{};
          },
          [=](const TrainConfig& c) {
            for (const auto& [name, value] : choices)
              if (get(c) == value) return name;
            return std::string("?");
          }};
}

const std::vector<Field>& schema() {
  using target::KernelPolicy;
  static const std::vector<Field> fields = [] {
    const std::vector<std::pair<std::string, KernelPolicy>> policies = {
        {"auto", KernelPolicy::Auto}, {"fast", KernelPolicy::Fast}, {"fallback", KernelPolicy::Fallback}};
    auto int_item = [](int64_t min) {
      return [=](const YAML::Node& x) {
        auto v = to_int(x);
        if (!v || *v < min) throw BadValue{};
        return *v;
      };
    };
    auto string_item = [](const YAML::Node& x) {
      if (!x.IsScalar() || x.Scalar().empty()) throw BadValue{};
      return x.Scalar();
    };
    auto beta_item = [](const YAML::Node& x) {
      auto v = to_double(x);
      if (!v || !in_range(*v, Range::Unit)) throw BadValue{};
      return *v;
    };
    std::vector<Field> f;
    f.push_back(string_field("model.target.path", "a Hugging Face model directory (a string)", true,
                             DFLASH_MEMBER(model.target.path)));
    f.push_back(string_field("model.target.config", "a config.json path (a string)", true,
                             DFLASH_MEMBER(model.target.config)));
    f.push_back(bool_field("model.target.random_weights", DFLASH_MEMBER(model.target.random_weights)));
    f.push_back(int_field("model.target.seed", 0, DFLASH_MEMBER(model.target.seed)));
    f.push_back(enum_field<target::Precision>(
        "model.target.precision",
        {{"auto", target::Precision::Auto}, {"bf16", target::Precision::Bf16}, {"fp8", target::Precision::Fp8}},
        DFLASH_MEMBER(model.target.precision)));
    f.push_back(bool_field("model.target.fp8_experts", DFLASH_MEMBER(model.target.fp8_experts)));
    f.push_back(string_field("model.drafter.config", "a drafter config.json path (a string)", true,
                             DFLASH_MEMBER(model.drafter.config)));
    f.push_back(string_field("model.drafter.warm_start", "an exported drafter directory (a string)", true,
                             DFLASH_MEMBER(model.drafter.warm_start)));
    f.push_back(int_field("model.drafter.num_layers", 1, DFLASH_MEMBER(model.drafter.num_layers)));
    f.push_back(int_field("model.drafter.block_size", 2, DFLASH_MEMBER(model.drafter.block_size)));
    f.push_back(opt_int_field("model.drafter.mask_token_id", 0, "a token id", DFLASH_MEMBER(model.drafter.mask_token_id)));
    f.push_back(list_field("model.drafter.target_layer_ids",
                           "a list of target layer ids (integers >= 0; [] = the default for num_layers)", false, 0,
                           int_item(0), DFLASH_MEMBER(model.drafter.target_layer_ids)));
    f.push_back(opt_int_field("model.drafter.num_attention_heads", 1, "a head count (null = the target's)",
                              DFLASH_MEMBER(model.drafter.num_attention_heads)));
    f.push_back(opt_int_field("model.drafter.num_key_value_heads", 1, "a head count (null = the target's)",
                              DFLASH_MEMBER(model.drafter.num_key_value_heads)));
    f.push_back(opt_int_field("model.drafter.head_dim", 2, "a head dimension (null = the target's)",
                              DFLASH_MEMBER(model.drafter.head_dim)));
    f.push_back(opt_int_field("model.drafter.intermediate_size", 1, "an MLP width (null = the target's)",
                              DFLASH_MEMBER(model.drafter.intermediate_size)));
    f.push_back(enum_field<DrafterPrecision>("model.drafter.precision",
                                             {{"bf16", DrafterPrecision::Bf16}, {"fp8", DrafterPrecision::Fp8}},
                                             DFLASH_MEMBER(model.drafter.precision)));
    f.push_back(enum_field<DrafterPrecision>("model.drafter.lm_head_precision",
                                             {{"bf16", DrafterPrecision::Bf16}, {"fp8", DrafterPrecision::Fp8}},
                                             DFLASH_MEMBER(model.drafter.lm_head_precision)));
    f.push_back(enum_field<Fp8WgradTiles>("model.drafter.fp8_wgrad_x_tiles",
                                          {{"auto", Fp8WgradTiles::Auto}, {"128x1", Fp8WgradTiles::Columns}, {"128x128", Fp8WgradTiles::Blocks}},
                                          DFLASH_MEMBER(model.drafter.fp8_wgrad_x_tiles)));
    f.push_back(list_field("data.files", "a list of HDF5 files or globs (strings)", true, 0, string_item,
                           DFLASH_MEMBER(data.files)));
    f.push_back(string_field("data.train", "a JSONL file of conversations (a string; \"\" = none)", true,
                             DFLASH_MEMBER(data.train)));
    f.push_back(string_field("data.tokenizer",
                             "a tokenizer directory (a string; \"\" = the target's model directory, model.target.path)", true,
                             DFLASH_MEMBER(data.tokenizer)));
    f.push_back(int_field("data.max_length", 2, DFLASH_MEMBER(data.max_length)));
    f.push_back(bool_field("data.synth.enabled", DFLASH_MEMBER(data.synth.enabled)));
    f.push_back(string_field("data.synth.path", "an HDF5 file path (a string; \"\" = <run_dir>/data/synth.h5)", true,
                             DFLASH_MEMBER(data.synth.path)));
    f.push_back(int_field("data.synth.num_sequences", 1, DFLASH_MEMBER(data.synth.num_sequences)));
    f.push_back(int_field("data.synth.min_length", 2, DFLASH_MEMBER(data.synth.min_length)));
    f.push_back(int_field("data.synth.max_length", 2, DFLASH_MEMBER(data.synth.max_length)));
    f.push_back(int_field("data.synth.seed", 0, DFLASH_MEMBER(data.synth.seed)));
    f.push_back(int_field("data.synth.vocab_size", 0, DFLASH_MEMBER(data.synth.vocab_size)));
    f.push_back(string_field("data.prepare.path", "an HDF5 file path (a string; \"\" = <run_dir>/data/prepared.h5)", true,
                             DFLASH_MEMBER(data.prepare.path)));
    f.push_back(enum_field<std::string>("data.prepare.think", {{"in", "in"}, {"out", "out"}}, DFLASH_MEMBER(data.prepare.think)));
    f.push_back(bool_field("data.prepare.last_turn_only", DFLASH_MEMBER(data.prepare.last_turn_only)));
    f.push_back(opt_bool_field("data.prepare.enable_thinking", "null = the chat template's default",
                               DFLASH_MEMBER(data.prepare.enable_thinking)));
    f.push_back(int_field("data.prepare.max_length", 0, DFLASH_MEMBER(data.prepare.max_length)));
    f.push_back(bool_field("data.prepare.skip_bad", DFLASH_MEMBER(data.prepare.skip_bad)));
    f.push_back(bool_field("data.prepare.prompts_only", DFLASH_MEMBER(data.prepare.prompts_only)));
    f.push_back(string_field("data.prepare.chat_template",
                             "a chat template .jinja file (a string; \"\" = the tokenizer directory's own)", true,
                             DFLASH_MEMBER(data.prepare.chat_template)));
    f.push_back(bool_field("data.regenerate.enabled", DFLASH_MEMBER(data.regenerate.enabled)));
    f.push_back(string_field("data.regenerate.path",
                             "an HDF5 file path (a string; \"\" = <run_dir>/data/regenerated.h5)", true,
                             DFLASH_MEMBER(data.regenerate.path)));
    f.push_back(int_field("data.regenerate.max_new_tokens", 1, DFLASH_MEMBER(data.regenerate.max_new_tokens)));
    f.push_back(num_field("data.regenerate.temperature", Range::NonNegative, DFLASH_MEMBER(data.regenerate.temperature)));
    f.push_back(num_field("data.regenerate.top_p", Range::Positive, DFLASH_MEMBER(data.regenerate.top_p)));
    f.push_back(int_field("data.regenerate.seed", 0, DFLASH_MEMBER(data.regenerate.seed)));
    // null (the target's own), or a list of ids / token texts.
    f.push_back({"data.regenerate.stop_tokens",
                 "null (the target's own eos ids) or a list of token ids (integers >= 0) and token texts (\"<|im_end|>\")",
                 [](TrainConfig& c, const YAML::Node& n) {
                   auto& out = c.data.regenerate.stop_tokens;
                   if (n.IsNull()) {
                     out.reset();
                     return;
                   }
                   if (!n.IsSequence()) throw BadValue{};
                   std::vector<std::string> v;
                   for (const YAML::Node& x : n) {
                     if (!x.IsScalar() || x.Scalar().empty()) throw BadValue{};
                     const std::string& t = x.Scalar();
                     // A number must be a token id (an integer >= 0); anything else is token text.
                     if (t.find_first_not_of("+-0123456789.eE") == std::string::npos && t.find_first_of("0123456789") != std::string::npos &&
                         t.find_first_not_of("0123456789") != std::string::npos)
                       throw BadValue{};
                     v.push_back(t);
                   }
                   out = std::move(v);
                 },
                 [](const TrainConfig& c) {
                   const auto& v = c.data.regenerate.stop_tokens;
                   if (!v) return std::string("null");
                   std::string o = "[";
                   for (size_t i = 0; i < v->size(); ++i) {
                     const std::string& t = (*v)[i];
                     o += (i ? ", " : "") + (t.find_first_not_of("0123456789") == std::string::npos ? t : show(t));
                   }
                   return o + "]";
                 }});
    f.push_back(int_field("data.regenerate.num_prompts", 0, DFLASH_MEMBER(data.regenerate.num_prompts)));
    f.push_back(int_field("data.regenerate.max_prompt_len", 0, DFLASH_MEMBER(data.regenerate.max_prompt_len)));
    f.push_back(int_field("data.regenerate.slots", 1, DFLASH_MEMBER(data.regenerate.slots)));
    f.push_back(int_field("data.regenerate.step_tokens", 0, DFLASH_MEMBER(data.regenerate.step_tokens)));
    f.push_back(int_field("parallel.tp", 1, DFLASH_MEMBER(parallel.tp)));
    f.push_back(int_field("parallel.ep", 1, DFLASH_MEMBER(parallel.ep)));
    f.push_back(num_field("parallel.timeout_s", Range::Positive, DFLASH_MEMBER(parallel.timeout_s)));
    f.push_back(enum_field<Backend>("parallel.device",
                                    {{"auto", Backend::Auto}, {"cpu", Backend::Cpu}, {"cuda", Backend::Cuda}},
                                    DFLASH_MEMBER(parallel.device)));
    f.push_back(int_field("training.batch_size", 1, DFLASH_MEMBER(training.batch_size)));
    f.push_back(int_field("training.micro_batches", 1, DFLASH_MEMBER(training.micro_batches)));
    f.push_back(int_field("training.num_anchors", 1, DFLASH_MEMBER(training.num_anchors)));
    f.push_back(int_field("training.blocks_per_pass", 0, DFLASH_MEMBER(training.blocks_per_pass)));
    f.push_back(num_field("training.gamma", Range::Positive, DFLASH_MEMBER(training.gamma)));
    f.push_back(opt_int_field("training.epochs", 1, "a number of epochs", DFLASH_MEMBER(training.epochs)));
    f.push_back(opt_int_field("training.max_steps", 1, "a number of optimizer steps", DFLASH_MEMBER(training.max_steps)));
    f.push_back(num_field("training.lr", Range::Positive, DFLASH_MEMBER(training.lr)));
    f.push_back(num_field("training.warmup_ratio", Range::Unit, DFLASH_MEMBER(training.warmup_ratio)));
    f.push_back(enum_field<Schedule>(
        "training.schedule", {{"cosine", Schedule::Cosine}, {"linear", Schedule::Linear}, {"constant", Schedule::Constant}},
        DFLASH_MEMBER(training.schedule)));
    f.push_back(num_field("training.min_lr", Range::NonNegative, DFLASH_MEMBER(training.min_lr)));
    f.push_back(num_field("training.weight_decay", Range::NonNegative, DFLASH_MEMBER(training.weight_decay)));
    f.push_back(list_field("training.betas", "a list of two numbers in [0, 1)", false, 2, beta_item,
                           DFLASH_MEMBER(training.betas)));
    f.push_back(num_field("training.eps", Range::Positive, DFLASH_MEMBER(training.eps)));
    f.push_back(num_field("training.grad_clip", Range::NonNegative, DFLASH_MEMBER(training.grad_clip)));
    f.push_back(int_field("training.seed", 0, DFLASH_MEMBER(training.seed)));
    f.push_back(int_field("training.skip_nonfinite_limit", 1, DFLASH_MEMBER(training.skip_nonfinite_limit)));
    f.push_back(enum_field<KernelPolicy>("kernels.conv", policies,
                                                                                 DFLASH_MEMBER(kernels.conv)));
    f.push_back(enum_field<KernelPolicy>(
        "kernels.delta_rule", policies, DFLASH_MEMBER(kernels.delta_rule)));
    f.push_back(enum_field<KernelPolicy>(
        "kernels.attention", policies, DFLASH_MEMBER(kernels.attention)));
    f.push_back(bool_field("kernels.require_fast_path", DFLASH_MEMBER(kernels.require_fast_path)));
    f.push_back(enum_field<drafter::DrafterMath>("kernels.cpu_drafter",
                                                 {{"f32", drafter::DrafterMath::F32}, {"f64", drafter::DrafterMath::F64}},
                                                 DFLASH_MEMBER(kernels.cpu_drafter)));
    f.push_back(string_field("checkpoint.dir", "a directory (a string; \"\" = <run_dir>/checkpoints)", true,
                             DFLASH_MEMBER(checkpoint.dir)));
    f.push_back(int_field("checkpoint.interval", 1, DFLASH_MEMBER(checkpoint.interval)));
    f.push_back(int_field("checkpoint.keep_last", 1, DFLASH_MEMBER(checkpoint.keep_last)));
    f.push_back(string_field("checkpoint.resume", "auto, never or a checkpoint directory", false,
                             DFLASH_MEMBER(checkpoint.resume)));
    f.push_back(bool_field("checkpoint.at_end", DFLASH_MEMBER(checkpoint.at_end)));
    f.push_back(int_field("logging.interval", 1, DFLASH_MEMBER(logging.interval)));
    f.push_back(string_field("logging.run_dir", "a directory (a non-empty string)", false, DFLASH_MEMBER(logging.run_dir)));
    f.push_back(bool_field("logging.progress_bar", DFLASH_MEMBER(logging.progress_bar)));
    return f;
  }();
  return fields;
}

#undef DFLASH_MEMBER

const Field* find_field(const std::string& key) {
  for (const Field& f : schema())
    if (f.key == key) return &f;
  return nullptr;
}

// The direct children of a section ("" = top level), in schema order: "target", "drafter", ...
std::vector<std::string> children(const std::string& section) {
  const std::string prefix = section.empty() ? "" : section + ".";
  std::vector<std::string> out;
  for (const Field& f : schema()) {
    if (f.key.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string rest = f.key.substr(prefix.size());
    const std::string child = rest.substr(0, rest.find('.'));
    if (std::find(out.begin(), out.end(), child) == out.end()) out.push_back(child);
  }
  return out;
}

bool is_section(const std::string& key) { return !find_field(key) && !children(key).empty(); }

std::string join(const std::vector<std::string>& v) {
  std::string o;
  for (size_t i = 0; i < v.size(); ++i) o += (i ? ", " : "") + v[i];
  return o;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

// "<where>: unknown key 'training.lrr'; valid keys of 'training': batch_size, ..." (+ a did-you-mean hint).
[[noreturn]] void unknown_key(const std::string& where, const std::string& key) {
  const size_t dot = key.rfind('.');
  const std::string section = dot == std::string::npos ? "" : key.substr(0, dot);
  // The longest known ancestor: for "modl.target.path" the top level.
  std::string known = section;
  while (!known.empty() && !is_section(known)) {
    const size_t d = known.rfind('.');
    known = d == std::string::npos ? "" : known.substr(0, d);
  }
  const std::vector<std::string> valid = children(known);
  std::string hint;
  const std::string typed = known.empty() ? key.substr(0, key.find('.')) : key.substr(known.size() + 1);
  const std::string typed_head = typed.substr(0, typed.find('.'));
  size_t best = 3;  // suggest only close names
  for (const std::string& v : valid) {
    const size_t dist = edit_distance(typed_head, v);
    if (dist < best) best = dist, hint = "did you mean '" + (known.empty() ? v : known + "." + v) + "'?";
  }
  std::ostringstream m;
  m << where << ": unknown key '" << key << "'; ";
  if (known.empty()) m << "valid top-level sections: " << join(valid);
  else m << "valid keys of '" << known << "': " << join(valid);
  if (hint.empty()) DFLASH_REJECT(m.str());
  DFLASH_REJECT_HINT(m.str(), hint);
}

[[noreturn]] void bad_value(const std::string& where, const Field& f, const YAML::Node& n) {
  DFLASH_REJECT(where << ": " << f.key << " must be " << f.expected << ", got '" << flow_text(n) << "'");
}

std::string where_in_file(const std::string& source, const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  return m.line >= 0 ? source + ":" + std::to_string(m.line + 1) : source;
}

void set_field(TrainConfig& c, const Field& f, const YAML::Node& n, const std::string& where) {
  try {
    f.parse(c, n);
  } catch (const BadValue&) {
    bad_value(where, f, n);
  }
}

// Reads the keys of `map` (the section `section`, "" = top level) into `c`.
void load_section(TrainConfig& c, const YAML::Node& map, const std::string& section, const std::string& source,
                  std::map<std::string, Origin>& origins) {
  std::set<std::string> seen;
  for (const auto& kv : map) {
    const std::string where = where_in_file(source, kv.first);
    DFLASH_REQUIRE(kv.first.IsScalar(), where << ": keys must be plain names, got '" << flow_text(kv.first) << "'");
    const std::string key = section.empty() ? kv.first.Scalar() : section + "." + kv.first.Scalar();
    DFLASH_REQUIRE(seen.insert(key).second, where << ": key '" << key << "' appears twice");
    if (const Field* f = find_field(key)) {
      set_field(c, *f, kv.second, where);
      origins[key] = Origin::File;
    } else if (is_section(key)) {
      if (kv.second.IsNull()) continue;  // an empty section keeps its defaults
      DFLASH_REQUIRE(kv.second.IsMap(), where << ": " << key << " must be a section (a map with keys "
                                            << join(children(key)) << "), got '" << flow_text(kv.second) << "'");
      load_section(c, kv.second, key, source, origins);
    } else {
      unknown_key(where, key);
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------

TrainConfig TrainConfig::from_string(const std::string& yaml, const std::string& source,
                                     const std::vector<std::string>& overrides) {
  TrainConfig c;
  c.source = source;
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    DFLASH_REJECT_HINT(source << ":" << e.mark.line + 1 << ": not valid YAML: " << e.msg,
                     "a config is a YAML map of sections: model, data, parallel, training, kernels, checkpoint, logging");
  }
  if (!root.IsNull()) {
    DFLASH_REQUIRE_HINT(root.IsMap(), source << ": the config must be a YAML map of sections, got '" << flow_text(root) << "'",
                      "valid top-level sections: " << join(children("")));
    load_section(c, root, "", source, c.origins_);
  }
  c.file_source_ = !c.data.train.empty() ? DataSource::Train : c.data.synth.enabled ? DataSource::Synth : DataSource::Files;
  for (const std::string& o : overrides) c.apply_override(o);
  return c;
}

TrainConfig TrainConfig::from_file(const std::string& path, const std::vector<std::string>& overrides) {
  DFLASH_REQUIRE_HINT(std::filesystem::is_regular_file(path), "config file '" << path << "' does not exist",
                    "pass a YAML config such as configs/tiny.yaml");
  std::ifstream in(path);
  DFLASH_CHECK_IO(in.good(), "opening config", path);
  std::stringstream text;
  text << in.rdbuf();
  return from_string(text.str(), path, overrides);
}

TrainConfig TrainConfig::embedded_default(const std::vector<std::string>& overrides) {
  return from_string(embedded_default_yaml(), kEmbeddedSource, overrides);
}

void TrainConfig::apply_override(const std::string& assignment) {
  const std::string where = "--set " + assignment;
  const size_t eq = assignment.find('=');
  DFLASH_REQUIRE_HINT(eq != std::string::npos && eq > 0, where << ": expected key.path=value",
                    "for example --set training.lr=3e-4 or --set model.drafter.target_layer_ids=[1,16,31]");
  std::string key = assignment.substr(0, eq);
  while (!key.empty() && std::isspace(static_cast<unsigned char>(key.back()))) key.pop_back();
  while (!key.empty() && std::isspace(static_cast<unsigned char>(key.front()))) key.erase(0, 1);
  YAML::Node value;
  try {
    value = YAML::Load(assignment.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    DFLASH_REJECT_HINT(where << ": the value is not valid YAML (" << e.msg << ")",
                     "a value is read as YAML: quote one that starts with * & ! [ { or holds ': ', "
                     "e.g. --set 'data.files=\"*.h5\"'");
  }
  const Field* f = find_field(key);
  if (!f) {
    if (is_section(key)) {
      std::vector<std::string> keys;
      for (const std::string& ch : children(key)) keys.push_back(key + "." + ch);
      DFLASH_REJECT(where << ": '" << key << "' is a section; set one of its keys: " << join(keys));
    }
    unknown_key(where, key);
  }
  set_field(*this, *f, value, where);
  origins_[key] = Origin::Override;
  resolve_alternatives(key, where);
}

// Pairs of keys that exclude each other: --set of one (to a value that selects it) resets the other
// unless it was --set too. The file's data.regenerate goes with the file's source of data (the
// embedded default regenerates its synthetic prompts, configs/qwen3.6-27b.yaml its data.files): a --set
// that switches to the other source turns it off, unless data.regenerate.enabled is --set too.
void TrainConfig::resolve_alternatives(const std::string& key, const std::string& where) {
  // Resets `k` to the YAML `value`; returns whether it changed.
  auto displace = [&](const std::string& k, const char* value) {
    if (origin(k) == Origin::Override) return false;
    const Field& f = *find_field(k);
    const std::string before = f.show(*this);
    set_field(*this, f, YAML::Load(value), where);
    if (f.show(*this) == before) return false;
    notes_.push_back(where + ": " + k + " = " + f.show(*this) + " instead of " + before + " (from " +
                     (origin(k) == Origin::Default ? std::string("the defaults") : source) + ")");
    origins_[k] = Origin::Implied;
    return true;
  };
  const TargetSection& t = model.target;
  if (key == "model.target.path" && !t.path.empty()) {
    displace("model.target.config", "\"\"");
    displace("model.target.random_weights", "false");
  } else if (key == "model.target.config" && !t.config.empty()) {
    displace("model.target.path", "\"\"");
    displace("model.target.random_weights", "true");  // a config.json has no weights
  } else if (key == "model.drafter.config" && !model.drafter.config.empty()) {
    displace("model.drafter.warm_start", "\"\"");
  } else if (key == "model.drafter.warm_start" && !model.drafter.warm_start.empty()) {
    displace("model.drafter.config", "\"\"");
  } else if (key == "data.files" && !data.files.empty()) {
    displace("data.synth.enabled", "false");
    displace("data.train", "\"\"");
    if (file_source_ != DataSource::Files) displace("data.regenerate.enabled", "false");
  } else if (key == "data.synth.enabled" && data.synth.enabled) {
    displace("data.files", "[]");
    displace("data.train", "\"\"");
    if (file_source_ != DataSource::Synth) displace("data.regenerate.enabled", "false");
  } else if (key == "data.train" && !data.train.empty()) {
    displace("data.files", "[]");
    displace("data.synth.enabled", "false");
    if (file_source_ != DataSource::Train) displace("data.regenerate.enabled", "false");
  } else if (key == "training.epochs" && training.epochs) {
    displace("training.max_steps", "null");
  } else if (key == "training.max_steps" && training.max_steps) {
    displace("training.epochs", "null");
  }
}

Origin TrainConfig::origin(const std::string& key) const {
  auto it = origins_.find(key);
  return it == origins_.end() ? Origin::Default : it->second;
}

std::vector<std::string> TrainConfig::keys() {
  std::vector<std::string> out;
  for (const Field& f : schema()) out.push_back(f.key);
  return out;
}

bool TrainConfig::operator==(const TrainConfig& o) const {
  return model == o.model && data == o.data && parallel == o.parallel && training == o.training &&
         kernels == o.kernels && checkpoint == o.checkpoint && logging == o.logging;
}

// ---------------------------------------------------------------------------------------------
// Validation

void TrainConfig::validate(int world_size) const {
  const std::string& s = source.empty() ? std::string("config") : source;
  // Every value's type and range again, for configs built or changed in code.
  {
    TrainConfig scratch;
    for (const Field& f : schema()) {
      const std::string text = f.show(*this);
      const YAML::Node n = YAML::Load(text);
      set_field(scratch, f, n, s);
    }
  }
  const TargetSection& t = model.target;
  DFLASH_REQUIRE_HINT(t.path.empty() != t.config.empty(),
                    s << ": model.target: set exactly one of model.target.path and model.target.config"
                      << (t.path.empty() ? " (neither is set)" : " (both are set)"),
                    "model.target.path: a Hugging Face model directory; model.target.config: a config.json "
                    "with model.target.random_weights: true");
  DFLASH_REQUIRE_HINT(t.config.empty() || t.random_weights,
                    s << ": model.target.config names only an architecture, so model.target.random_weights must be true",
                    "set model.target.random_weights: true, or give a model directory as model.target.path");

  const DrafterSection& d = model.drafter;
  DFLASH_REQUIRE(d.config.empty() || d.warm_start.empty(),
               s << ": model.drafter.config and model.drafter.warm_start are exclusive (a warm start brings its config.json)");
  // With a drafter config.json (config or warm_start), fields given as well must agree with it:
  // drafter_config() checks that when it reads the file.
  if (d.config.empty() && d.warm_start.empty()) {
    DFLASH_REQUIRE_HINT(d.mask_token_id.has_value(),
                      s << ": model.drafter.mask_token_id must be set (a token id of the target's vocabulary)",
                      "use a token the data never contains, e.g. a reserved special token (Qwen3.6: 248070)");
    std::set<int64_t> ids;
    for (size_t i = 0; i < d.target_layer_ids.size(); ++i)
      DFLASH_REQUIRE(ids.insert(d.target_layer_ids[i]).second,
                   s << ": model.drafter.target_layer_ids[" << i << "] = " << d.target_layer_ids[i]
                     << " appears twice; expected distinct target layer ids");
    DFLASH_REQUIRE(data.max_length > d.block_size,
                 s << ": data.max_length (" << data.max_length << ") must be greater than model.drafter.block_size ("
                   << d.block_size << ") so that one anchor block fits in a sequence");
  }

  DFLASH_REQUIRE_HINT(!data.files.empty() || data.synth.enabled || !data.train.empty(),
                    s << ": data.files is empty, data.train is not set and data.synth.enabled is false; there is nothing "
                         "to train on",
                    "list HDF5 token files (dflash_data convert / prepare make them), name a JSONL of conversations as "
                    "data.train, or set data.synth.enabled: true");
  DFLASH_REQUIRE(data.files.empty() || !data.synth.enabled,
               s << ": data.files and data.synth.enabled: true are exclusive; use one source of data");
  DFLASH_REQUIRE(data.files.empty() || data.train.empty(),
               s << ": data.files and data.train are exclusive; use one source of data (data.train is prepared into "
                    "token files itself)");
  DFLASH_REQUIRE(!data.synth.enabled || data.train.empty(),
               s << ": data.train and data.synth.enabled: true are exclusive; use one source of data");
  if (!data.train.empty()) {
    auto same_file = [](const std::string& a, const std::string& b) {
      return std::filesystem::absolute(a).lexically_normal() == std::filesystem::absolute(b).lexically_normal();
    };
    DFLASH_REQUIRE_HINT(!same_file(prepare_path(), data.train),
                      s << ": data.prepare.path '" << prepare_path() << "' is data.train itself; preparing would replace the input",
                      "leave data.prepare.path empty (<run_dir>/data/prepared.h5) or name another file");
    DFLASH_REQUIRE_HINT(!data.prepare.prompts_only || data.regenerate.enabled,
                        s << ": data.prepare.prompts_only: true makes prompts without responses, and data.regenerate.enabled "
                             "is false: nothing would be supervised",
                        "set data.regenerate.enabled: true (the target writes the responses), or prompts_only: false");
    DFLASH_REQUIRE_HINT(!data.regenerate.enabled || !same_file(prepare_path(), regenerate_path()),
                      s << ": data.prepare.path and data.regenerate.path are the same file '" << prepare_path()
                        << "'; the regenerated data is made from the prepared one",
                      "leave both empty (<run_dir>/data/prepared.h5 and regenerated.h5) or name two files");
  }
  if (!data.train.empty())
    DFLASH_REQUIRE_HINT(!tokenizer_dir().empty(),
                      s << ": data.train needs a tokenizer: data.tokenizer is not set and model.target has no model "
                           "directory to read one from (model.target.path is not set: the target is a config.json with "
                           "random weights)",
                      "set data.tokenizer to a directory holding the target's tokenizer.json and tokenizer_config.json, "
                      "or model.target.path to a Hugging Face model directory");
  DFLASH_REQUIRE(data.synth.min_length <= data.synth.max_length,
               s << ": data.synth.min_length (" << data.synth.min_length << ") must be <= data.synth.max_length ("
                 << data.synth.max_length << ")");

  if (data.regenerate.enabled) {
    DFLASH_REQUIRE_HINT(data.regenerate.top_p <= 1, s << ": data.regenerate.top_p (" << show(data.regenerate.top_p) << ") must be <= 1",
                      "top_p = 1 keeps every token");
    DFLASH_REQUIRE_HINT(data.regenerate.top_p == 1 || data.regenerate.temperature > 0,
                      s << ": data.regenerate.top_p (" << show(data.regenerate.top_p) << ") needs data.regenerate.temperature > 0",
                      "temperature 0 is greedy decoding, which keeps no nucleus");
  }

  DFLASH_REQUIRE_HINT(training.epochs.has_value() != training.max_steps.has_value(),
                    s << ": set exactly one of training.epochs and training.max_steps"
                      << (training.epochs ? " (both are set)" : " (neither is set)"),
                    "unset the other with null, e.g. --set training.epochs=null");
  DFLASH_REQUIRE(training.min_lr <= training.lr, s << ": training.min_lr (" << show(training.min_lr)
                                                 << ") must be <= training.lr (" << show(training.lr) << ")");

  if (kernels.require_fast_path)
    for (const char* k : {"kernels.conv", "kernels.delta_rule", "kernels.attention"})
      DFLASH_REQUIRE_HINT(find_field(k)->show(*this) != "fallback",
                        s << ": kernels.require_fast_path: true contradicts " << k << ": fallback",
                        "set " << k << " to auto or fast, or require_fast_path to false");

  DFLASH_REQUIRE_HINT(!(kernels.require_fast_path && parallel.device == Backend::Cpu),
                    s << ": kernels.require_fast_path: true contradicts parallel.device: cpu (the CPU backend is the f32 "
                         "reference: it has no fast path, every op runs its plain reference code)",
                    "train on GPUs (parallel.device: cuda or auto), or set kernels.require_fast_path: false to run the CPU "
                    "reference on purpose");

  DFLASH_REQUIRE_HINT(!(model.drafter.precision == DrafterPrecision::Fp8 && parallel.device == Backend::Cpu &&
                        kernels.cpu_drafter == drafter::DrafterMath::F64),
                    s << ": model.drafter.precision: fp8 contradicts kernels.cpu_drafter: f64 (the simulated FP8 linears "
                         "run on the f32 step; the double reference is the unquantized oracle)",
                    "set kernels.cpu_drafter: f32, or model.drafter.precision: bf16");
  DFLASH_REQUIRE_HINT(!(model.drafter.fp8_wgrad_x_tiles == Fp8WgradTiles::Blocks &&
                        model.drafter.precision != DrafterPrecision::Fp8),
                    s << ": model.drafter.fp8_wgrad_x_tiles: 128x128 applies to FP8 linears, but model.drafter.precision "
                         "is bf16",
                    "set model.drafter.precision: fp8, or drop model.drafter.fp8_wgrad_x_tiles");
  DFLASH_REQUIRE_HINT(!(model.drafter.lm_head_precision == DrafterPrecision::Fp8 && parallel.device == Backend::Cpu &&
                        kernels.cpu_drafter == drafter::DrafterMath::F64),
                    s << ": model.drafter.lm_head_precision: fp8 contradicts kernels.cpu_drafter: f64 (the simulated FP8 "
                         "LM head runs on the f32 step; the double reference is the unquantized oracle)",
                    "set kernels.cpu_drafter: f32, or model.drafter.lm_head_precision: bf16");

  DFLASH_REQUIRE(world_size >= 1, s << ": world size " << world_size << " must be >= 1");
  try {
    comm::make_layout(world_size, 0, static_cast<int>(std::min<int64_t>(parallel.tp, 1 << 30)));
  } catch (const Error& e) {
    DFLASH_REJECT_HINT(s << ": " << e.message(), e.hint());
  }
  // The expert groups live inside a TP group (target_model/tp.h), so ep divides tp and the world.
  DFLASH_REQUIRE_HINT(parallel.tp % parallel.ep == 0,
                      s << ": parallel.ep = " << parallel.ep << " does not divide parallel.tp = " << parallel.tp
                        << " (the experts are split over the ranks of a TP group: ep groups of tp / ep ranks)",
                      "choose ep among the divisors of tp (ep = tp: each rank holds whole experts), or raise parallel.tp");
}

drafter::DrafterConfig TrainConfig::drafter_config(const target::TargetConfig& target) const {
  const std::string& s = source.empty() ? std::string("config") : source;
  const DrafterSection& d = model.drafter;
  if (!d.config.empty() || !d.warm_start.empty()) {
    const std::string key = !d.config.empty() ? "model.drafter.config" : "model.drafter.warm_start";
    const std::string path = !d.config.empty() ? d.config : d.warm_start;
    drafter::DrafterConfig c = drafter::DrafterConfig::from_file(path);
    auto agree = [&](const char* k, bool ok, const std::string& given, const std::string& in_file) {
      DFLASH_REQUIRE_HINT(origin(k) == Origin::Default || ok,
                        s << ": " << k << " = " << given << " disagrees with " << key << " (" << path << "), which has "
                          << in_file,
                        "remove " << k << " (the drafter's config.json defines it), or drop " << key);
    };
    auto ids_str = [](const std::vector<int64_t>& v) {
      std::string out = "[";
      for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
      return out + "]";
    };
    agree("model.drafter.num_layers", d.num_layers == c.num_hidden_layers, std::to_string(d.num_layers),
          std::to_string(c.num_hidden_layers) + " layers");
    agree("model.drafter.block_size", d.block_size == c.block_size, std::to_string(d.block_size),
          "block_size " + std::to_string(c.block_size));
    agree("model.drafter.mask_token_id", !d.mask_token_id || *d.mask_token_id == c.mask_token_id,
          d.mask_token_id ? std::to_string(*d.mask_token_id) : "null", "mask_token_id " + std::to_string(c.mask_token_id));
    agree("model.drafter.target_layer_ids", d.target_layer_ids.empty() || d.target_layer_ids == c.target_layer_ids,
          ids_str(d.target_layer_ids), "target_layer_ids " + ids_str(c.target_layer_ids));
    auto agree_dim = [&](const char* k, const std::optional<int64_t>& given, int64_t in_file, const char* field) {
      agree(k, !given || *given == in_file, given ? std::to_string(*given) : "null",
            std::string(field) + " " + std::to_string(in_file));
    };
    agree_dim("model.drafter.num_attention_heads", d.num_attention_heads, c.num_attention_heads, "num_attention_heads");
    agree_dim("model.drafter.num_key_value_heads", d.num_key_value_heads, c.num_key_value_heads, "num_key_value_heads");
    agree_dim("model.drafter.head_dim", d.head_dim, c.head_dim, "head_dim");
    agree_dim("model.drafter.intermediate_size", d.intermediate_size, c.intermediate_size, "intermediate_size");
    try {
      c.check_target(target);
    } catch (const Error& e) {
      DFLASH_REJECT_HINT(s << ": " << key << " (" << path << "): " << e.message(), "check model.target and " << key);
    }
    return c;
  }
  DFLASH_REQUIRE(d.mask_token_id.has_value(), s << ": model.drafter.mask_token_id must be set");
  DFLASH_REQUIRE_HINT(*d.mask_token_id < target.vocab_size,
                      s << ": model.drafter.mask_token_id = " << *d.mask_token_id << " is outside the target's vocabulary [0, "
                        << target.vocab_size << ")",
                      "set model.drafter.mask_token_id to an id of the target's vocabulary that the data never holds (a "
                      "reserved token; Qwen3.5/3.6: 248070); configs/my-model.yaml is the recipe for your own model");
  for (size_t i = 0; i < d.target_layer_ids.size(); ++i)
    DFLASH_REQUIRE(d.target_layer_ids[i] < target.num_hidden_layers,
                 s << ": model.drafter.target_layer_ids[" << i << "] = " << d.target_layer_ids[i]
                   << " is outside the target's layers [0, " << target.num_hidden_layers << ")");
  DFLASH_REQUIRE(d.num_layers <= target.num_hidden_layers || !d.target_layer_ids.empty(),
               s << ": model.drafter.num_layers (" << d.num_layers << ") is more than the target's "
                 << target.num_hidden_layers << " layers; give model.drafter.target_layer_ids explicitly");
  drafter::DrafterConfig c = drafter::DrafterConfig::for_target(target, d.num_layers, *d.mask_token_id, d.block_size);
  if (!d.target_layer_ids.empty()) c.target_layer_ids = d.target_layer_ids;
  if (d.num_attention_heads) c.num_attention_heads = *d.num_attention_heads;
  if (d.num_key_value_heads) c.num_key_value_heads = *d.num_key_value_heads;
  if (d.head_dim) c.head_dim = *d.head_dim;
  if (d.intermediate_size) c.intermediate_size = *d.intermediate_size;
  try {
    c.validate();
  } catch (const Error& e) {
    DFLASH_REJECT_HINT(s << ": the drafter made from model.drafter: " << e.message(),
                     "model.drafter.num_attention_heads must be a multiple of num_key_value_heads and head_dim even");
  }
  return c;
}

void TrainConfig::validate_against(const target::TargetConfig& target) const {
  const std::string& s = source.empty() ? std::string("config") : source;
  try {
    target::check_tp(target, static_cast<int>(parallel.tp), static_cast<int>(std::min<int64_t>(parallel.ep, 1 << 30)));
  } catch (const Error& e) {
    DFLASH_REJECT_HINT(s << ": " << e.message(), e.hint());
  }
  DFLASH_REQUIRE_HINT(!model.target.fp8_experts || target.is_moe(),
                      s << ": model.target.fp8_experts: " << target.source << " is a dense model (no experts to store in FP8)",
                      "set model.target.fp8_experts: false (model.target.precision: fp8 is the dense FP8 target)");
  const drafter::DrafterConfig c = drafter_config(target);
  DFLASH_REQUIRE(data.max_length > c.block_size, s << ": data.max_length (" << data.max_length
                                                 << ") must be greater than the drafter's block_size (" << c.block_size
                                                 << ") so that one anchor block fits in a sequence");
  if (data.regenerate.stop_tokens)  // ids are checked here, token text where it is resolved (the trainer's regenerate step)
    for (size_t i = 0; i < data.regenerate.stop_tokens->size(); ++i) {
      const std::string& t = (*data.regenerate.stop_tokens)[i];
      if (t.find_first_not_of("0123456789") != std::string::npos) continue;
      DFLASH_REQUIRE_HINT(t.size() <= 10 && std::stoll(t) < target.vocab_size,
                          s << ": data.regenerate.stop_tokens[" << i << "] = " << t
                            << " is outside the target's vocabulary [0, " << target.vocab_size << ")",
                          "stop tokens are ids of the target's tokenizer (e.g. its eos_token_id)");
    }
  if (data.synth.enabled)
    DFLASH_REQUIRE_HINT(data.synth.vocab_size <= target.vocab_size,
                      s << ": data.synth.vocab_size (" << data.synth.vocab_size << ") is larger than the target's vocabulary ("
                        << target.vocab_size << ")",
                      "use at most " << target.vocab_size << ", or 0 for the whole vocabulary");
}

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::Auto: return "auto";
    case Backend::Cpu: return "cpu";
    case Backend::Cuda: return "cuda";
  }
  return "?";
}

target::KernelPolicies TrainConfig::kernel_policies() const {
  target::KernelPolicies p;
  p.conv = kernels.conv;
  p.delta_rule = kernels.delta_rule;
  p.attention = kernels.attention;
  p.require_fast_path = kernels.require_fast_path;
  return p;
}

std::string TrainConfig::checkpoint_dir() const {
  return checkpoint.dir.empty() ? (std::filesystem::path(logging.run_dir) / "checkpoints").string() : checkpoint.dir;
}

std::string TrainConfig::synth_path() const {
  return data.synth.path.empty() ? (std::filesystem::path(logging.run_dir) / "data" / "synth.h5").string()
                                 : data.synth.path;
}

std::string TrainConfig::regenerate_path() const {
  return data.regenerate.path.empty() ? (std::filesystem::path(logging.run_dir) / "data" / "regenerated.h5").string()
                                      : data.regenerate.path;
}

std::string TrainConfig::prepare_path() const {
  return data.prepare.path.empty() ? (std::filesystem::path(logging.run_dir) / "data" / "prepared.h5").string()
                                   : data.prepare.path;
}

std::string TrainConfig::tokenizer_dir() const { return !data.tokenizer.empty() ? data.tokenizer : model.target.path; }

int64_t TrainConfig::prepare_max_length() const {
  return data.prepare.max_length > 0 ? data.prepare.max_length : data.max_length;
}

std::vector<std::string> TrainConfig::expand_data_files() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < data.files.size(); ++i) {
    const std::string& p = data.files[i];
    if (p.find_first_of("*?[") == std::string::npos) {
      DFLASH_REQUIRE_HINT(std::filesystem::exists(p), source << ": data.files[" << i << "] '" << p << "' does not exist",
                        "relative paths are relative to the directory dflash_train was started in");
      out.push_back(p);
      continue;
    }
    glob_t g{};
    const int rc = ::glob(p.c_str(), 0, nullptr, &g);
    std::vector<std::string> found(g.gl_pathv, g.gl_pathv + (rc == 0 ? g.gl_pathc : 0));
    globfree(&g);
    DFLASH_REQUIRE_HINT(!found.empty(), source << ": data.files[" << i << "] pattern '" << p << "' matches no file",
                      "relative paths are relative to the directory dflash_train was started in");
    out.insert(out.end(), found.begin(), found.end());
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// ---------------------------------------------------------------------------------------------
// Output

std::string TrainConfig::to_yaml() const {
  std::ostringstream o;
  o << "# dflash_train effective config" << (source.empty() ? "" : " (from " + source + ")") << "\n";
  std::vector<std::string> open;  // the sections of the previous key
  for (const Field& f : schema()) {
    std::vector<std::string> parts;
    std::stringstream ss(f.key);
    for (std::string p; std::getline(ss, p, '.');) parts.push_back(p);
    size_t common = 0;
    while (common < open.size() && common + 1 < parts.size() && open[common] == parts[common]) ++common;
    open.resize(common);
    for (size_t i = common; i + 1 < parts.size(); ++i) {
      o << std::string(2 * i, ' ') << parts[i] << ":\n";
      open.push_back(parts[i]);
    }
    o << std::string(2 * (parts.size() - 1), ' ') << parts.back() << ": " << f.show(*this) << "\n";
  }
  return o.str();
}

std::string TrainConfig::settings_table() const {
  const TrainConfig defaults;
  struct Row {
    std::string key, value, from, dflt;
  };
  std::vector<Row> rows = {{"key", "value", "from", "default (when changed)"}};
  for (const Field& f : schema()) {
    const std::string v = f.show(*this), dv = f.show(defaults);
    const Origin og = origin(f.key);
    rows.push_back({f.key, v,
                    og == Origin::Default ? "default" : og == Origin::File ? "file" : og == Origin::Override ? "--set" : "implied",
                    v == dv ? "" : dv});
  }
  size_t w[3] = {0, 0, 0};
  for (const Row& r : rows) {
    w[0] = std::max(w[0], r.key.size());
    w[1] = std::max(w[1], r.value.size());
    w[2] = std::max(w[2], r.from.size());
  }
  std::ostringstream o;
  o << "settings (" << (source.empty() ? "defaults" : source) << "):\n";
  for (const Row& r : rows) {
    std::string line = "  " + r.key + std::string(w[0] - r.key.size() + 2, ' ') + r.value +
                       std::string(w[1] - r.value.size() + 2, ' ') + r.from;
    if (!r.dflt.empty()) line += std::string(w[2] - r.from.size() + 2, ' ') + r.dflt;
    o << line << "\n";
  }
  if (!notes_.empty()) o << "implied by --set (what was --set wins over the config's alternatives):\n";
  for (const std::string& n : notes_) o << "  " << n << "\n";
  return o.str();
}

}  // namespace dflash::trainer
