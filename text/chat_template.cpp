#include "text/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "text/jinja.h"

namespace dflash::text {

using ojson = nlohmann::ordered_json;

namespace {

ojson to_ordered(const nlohmann::json& j) { return ojson::parse(j.dump()); }

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DFLASH_CHECK_IO(f.good(), "open", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// tokenizer_config.json's tokens are a string or an AddedToken object {"content": ...}.
std::string token_text(const nlohmann::json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) return (*it)["content"].get<std::string>();
  return "";
}

const char* kProbeUser = "DFLASH_PROBE_USER_7f3a";
const char* kProbeAssistant[2] = {"DFLASH_PROBE_ASSISTANT_1c9e", "DFLASH_PROBE_ASSISTANT_b24d"};

}  // namespace

struct ChatTemplate::Impl {
  std::string source, origin, bos, eos;
  jinja::Template tmpl;
  std::string header, end_of_turn;  // found by probing
  std::string probe_error;          // non-empty: probing failed, render_with_spans refuses

  Impl(std::string src, std::string org, std::string b, std::string e)
      : source(std::move(src)), origin(std::move(org)), bos(std::move(b)), eos(std::move(e)), tmpl(source, origin) {}

  std::string render(const ojson& messages, const ChatOptions& opt) const {
    DFLASH_REQUIRE_HINT(messages.is_array(), origin << ": the messages must be a JSON array of {\"role\": ..., \"content\": ...}",
                        "pass the conversation's \"messages\" list");
    for (size_t i = 0; i < messages.size(); ++i)
      DFLASH_REQUIRE_HINT(messages[i].is_object() && messages[i].contains("role") && messages[i]["role"].is_string(),
                          origin << ": message " << i << " is not an object with a string \"role\"",
                          "each message is {\"role\": \"user\"|\"assistant\"|\"system\"|\"tool\", \"content\": ...}");
    // The variables transformers' apply_chat_template passes: its special tokens, messages, tools,
    // documents, add_generation_prompt, then the extra keyword arguments (enable_thinking, ...).
    ojson vars = ojson::object();
    if (!bos.empty()) vars["bos_token"] = bos;
    if (!eos.empty()) vars["eos_token"] = eos;
    vars["messages"] = messages;
    vars["tools"] = !opt.tools_ordered.is_null() ? opt.tools_ordered : to_ordered(opt.tools);
    vars["documents"] = nullptr;
    vars["add_generation_prompt"] = opt.add_generation_prompt;
    DFLASH_REQUIRE_HINT(opt.extra.is_object(), origin << ": ChatOptions::extra must be a JSON object", "pass {\"name\": value, ...}");
    for (auto it = opt.extra.begin(); it != opt.extra.end(); ++it) vars[it.key()] = to_ordered(it.value());
    if (opt.enable_thinking) vars["enable_thinking"] = *opt.enable_thinking;
    return tmpl.render(vars);
  }

  // Finds the assistant header and end-of-turn marker: renders [user] and [user, assistant X] for
  // two placeholders X; the second minus the first is header + (think block) + X + end marker.
  void probe() {
    try {
      ojson user = ojson::array({{{"role", "user"}, {"content", kProbeUser}}});
      std::string base = render(user, {});
      std::string found_header, found_end;
      for (int k = 0; k < 2; ++k) {
        ojson conv = user;
        conv.push_back({{"role", "assistant"}, {"content", kProbeAssistant[k]}});
        std::string full = render(conv, {});
        if (full.compare(0, base.size(), base) != 0) {
          probe_error = "rendering [user, assistant] does not start with the rendering of [user]";
          return;
        }
        std::string rest = full.substr(base.size());
        size_t a = rest.find(kProbeAssistant[k]);
        if (a == std::string::npos || rest.find(kProbeAssistant[k], a + 1) != std::string::npos) {
          probe_error = "the assistant's content does not appear exactly once in the render";
          return;
        }
        std::string pre = rest.substr(0, a), post = rest.substr(a + std::string(kProbeAssistant[k]).size());
        size_t think = pre.find("<think>");
        if (think != std::string::npos) pre = pre.substr(0, think);
        if (pre.empty() || post.empty()) {
          probe_error = "no assistant header or no end-of-turn marker around the assistant's content";
          return;
        }
        if (k == 1 && (pre != found_header || post != found_end)) {
          probe_error = "the assistant header or end-of-turn marker depends on the content";
          return;
        }
        found_header = pre;
        found_end = post;
      }
      header = found_header;
      end_of_turn = found_end;
    } catch (const Error& e) {
      probe_error = std::string("rendering a placeholder conversation failed: ") + e.message();
    }
  }

  void require_probed() const {
    DFLASH_REQUIRE_HINT(probe_error.empty(),
                        origin << ": cannot find the assistant turns of this chat template (" << probe_error << ")",
                        "assistant spans need a template that renders each assistant turn as header + content + "
                        "end-of-turn marker, like the Qwen3 / Qwen3.5 / Qwen3.6 templates");
  }

  Rendered render_with_spans(const ojson& messages, const ChatOptions& opt) const {
    require_probed();
    Rendered r;
    r.text = render(messages, opt);
    const std::string& t = r.text;
    size_t cursor = 0;
    ChatOptions prefix_opt = opt;
    prefix_opt.add_generation_prompt = false;
    // The header appears once per assistant message (and once for a generation prompt) unless some
    // text quotes it; only then is each turn's start bounded by rendering the messages before it.
    size_t assistants = 0, headers = 0;
    for (const auto& m : messages) assistants += m["role"] == "assistant";
    for (size_t p = t.find(header); p != std::string::npos; p = t.find(header, p + 1)) ++headers;
    const bool quoted = headers > assistants + (opt.add_generation_prompt ? 1 : 0);
    for (size_t i = 0; i < messages.size(); ++i) {
      if (messages[i]["role"] != "assistant") continue;
      // The conversation before this message, where it renders as a prefix of the whole, bounds
      // where this turn can start (a user message quoting the header cannot be taken for it).
      if (quoted && i > 0) {
        try {
          ojson head(ojson::value_t::array);
          for (size_t k = 0; k < i; ++k) head.push_back(messages[k]);
          std::string p = render(head, prefix_opt);
          if (p.size() <= t.size() && t.compare(0, p.size(), p) == 0) cursor = std::max(cursor, p.size());
        } catch (const Error&) {
          // a prefix the template refuses (e.g. no user query yet): the sequential search stands
        }
      }
      size_t h = t.find(header, cursor);
      DFLASH_REQUIRE_HINT(h != std::string::npos,
                          origin << ": message " << i << " (assistant): its header " << nlohmann::json(header).dump()
                                 << " is not in the rendered text",
                          "the template renders this conversation unlike its probe; check the message's fields");
      AssistantSpan s;
      s.message = i;
      s.begin = h + header.size();
      size_t e = t.find(end_of_turn, s.begin);
      DFLASH_REQUIRE_HINT(e != std::string::npos,
                          origin << ": message " << i << " (assistant): no end-of-turn marker "
                                 << nlohmann::json(end_of_turn).dump() << " after its header",
                          "the template renders this conversation unlike its probe; check the message's fields");
      s.end = e + end_of_turn.size();
      s.think_begin = s.think_end = s.begin;
      if (t.compare(s.begin, 7, "<think>") == 0) {
        size_t c = t.find("</think>", s.begin);
        if (c != std::string::npos && c < e) {
          size_t te = c + 8;
          while (te < e && (t[te] == '\n' || t[te] == '\r')) ++te;  // the newlines after it, not content's spaces
          s.think_end = te;
        }
      }
      r.assistant.push_back(s);
      cursor = s.end;
    }
    return r;
  }
};

ChatTemplate::ChatTemplate(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;
ChatTemplate::~ChatTemplate() = default;

ChatTemplate ChatTemplate::from_string(const std::string& source, const std::string& origin, const std::string& bos_token,
                                       const std::string& eos_token) {
  auto impl = std::make_unique<Impl>(source, origin, bos_token, eos_token);
  impl->probe();
  return ChatTemplate(std::move(impl));
}

ChatTemplate ChatTemplate::from_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  fs::path cfg_path = fs::path(dir) / "tokenizer_config.json", jinja_path = fs::path(dir) / "chat_template.jinja";
  nlohmann::json cfg = nlohmann::json::object();
  bool have_cfg = fs::exists(cfg_path);
  if (have_cfg) {
    try {
      cfg = nlohmann::json::parse(read_file(cfg_path.string()));
    } catch (const nlohmann::json::exception& e) {
      DFLASH_REJECT_HINT(cfg_path.string() << ": not valid JSON (" << e.what() << ")", "fix or re-download the file");
    }
  }
  std::string bos = token_text(cfg, "bos_token"), eos = token_text(cfg, "eos_token");
  // transformers prefers a chat_template.jinja saved beside the config.
  if (fs::exists(jinja_path)) return from_string(read_file(jinja_path.string()), jinja_path.string(), bos, eos);
  DFLASH_REQUIRE_HINT(have_cfg, dir << ": neither tokenizer_config.json nor chat_template.jinja is there",
                      "pass the model directory that holds the tokenizer files");
  auto it = cfg.find("chat_template");
  DFLASH_REQUIRE_HINT(it != cfg.end() && !it->is_null(), cfg_path.string() << ": no \"chat_template\" in it",
                      "add the model's chat template (a chat_template.jinja beside it, or the \"chat_template\" key)");
  if (it->is_string()) return from_string(it->get<std::string>(), cfg_path.string() + " (chat_template)", bos, eos);
  if (it->is_array()) {  // named templates: [{"name": "default", "template": ...}, ...]
    for (auto& t : *it)
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string())
        return from_string(t["template"].get<std::string>(), cfg_path.string() + " (chat_template \"default\")", bos, eos);
    DFLASH_REJECT_HINT(cfg_path.string() << ": \"chat_template\" is a list without a \"default\" entry",
                       "name one template \"default\"");
  }
  DFLASH_REJECT_HINT(cfg_path.string() << ": \"chat_template\" is neither a string nor a list of named templates",
                     "fix the file");
}

std::string ChatTemplate::render(const nlohmann::json& messages, const ChatOptions& opt) const {
  return impl_->render(to_ordered(messages), opt);
}
std::string ChatTemplate::render(const nlohmann::ordered_json& messages, const ChatOptions& opt) const {
  return impl_->render(messages, opt);
}
Rendered ChatTemplate::render_with_spans(const nlohmann::json& messages, const ChatOptions& opt) const {
  return impl_->render_with_spans(to_ordered(messages), opt);
}
Rendered ChatTemplate::render_with_spans(const nlohmann::ordered_json& messages, const ChatOptions& opt) const {
  return impl_->render_with_spans(messages, opt);
}
const std::string& ChatTemplate::source() const { return impl_->source; }
const std::string& ChatTemplate::origin() const { return impl_->origin; }
const std::string& ChatTemplate::assistant_header() const {
  impl_->require_probed();
  return impl_->header;
}
const std::string& ChatTemplate::end_of_turn() const {
  impl_->require_probed();
  return impl_->end_of_turn;
}

}  // namespace dflash::text
