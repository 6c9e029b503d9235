#include "bench/eval_text.h"

#include <filesystem>
#include <mutex>
#include <optional>

#include <fmt/format.h>

#include "bench/report.h"
#include "core/error.h"
#include "text/conversation.h"
#if DFLASH_WITH_TEXT
#include "text/chat_template.h"
#include "text/tokenizer.h"
#endif

namespace dflash::bench {

using ojson = nlohmann::ordered_json;

bool have_text() {
#if DFLASH_WITH_TEXT
  return true;
#else
  return false;
#endif
}

ojson chat_messages(const ojson& row, const std::string& where) {
  const bool openai = row.contains("messages"), sharegpt = row.contains("conversations");
  if (!openai && !sharegpt) return nullptr;
  DFLASH_REQUIRE_HINT(!(openai && sharegpt), where << ": the row has both \"messages\" and \"conversations\"",
                      "give one conversation per row");
  const char* key = openai ? "messages" : "conversations";
  const ojson& conv = row[key];
  DFLASH_REQUIRE_HINT(conv.is_array() && !conv.empty(), where << ": \"" << key << "\" is not a non-empty list",
                      (openai ? "messages: [{\"role\": \"user\", \"content\": \"...\"}, ...]"
                              : "conversations: [{\"from\": \"human\", \"value\": \"...\"}, ...]"));
  ojson out = ojson::array();
  if (sharegpt) {
    out = text::sharegpt_messages(row, where);
  } else {
    for (size_t i = 0; i < conv.size(); ++i) {
      const ojson& m = conv[i];
      const std::string at = where + ": messages[" + std::to_string(i) + "]";
      DFLASH_REQUIRE(m.is_object(), at << " is not an object");
      DFLASH_REQUIRE_HINT(m.contains("role") && m["role"].is_string(), at << " has no string \"role\"",
                          "each message is {\"role\": \"user\" | \"assistant\" | \"system\" | \"tool\", \"content\": ...}");
      out.push_back(m);
    }
  }
  text::serving_messages(out, where);  // as vLLM / SGLang pass them to the template
  while (!out.empty() && out.back()["role"] == "assistant") out.erase(out.size() - 1);
  DFLASH_REQUIRE_HINT(!out.empty(), where << ": the conversation holds only assistant turns: no prompt is left",
                      "a chat prompt needs a user (or system) turn before the assistant's");
  return out;
}

std::vector<int64_t> draft_step_of_tokens(size_t n, const std::vector<int64_t>& accept) {
  std::vector<int64_t> step(n, -1);
  size_t t = 1;  // token 0: the prefill's
  for (size_t s = 0; s < accept.size() && t < n; ++s) {
    for (int64_t k = 0; k + 1 < accept[s] && t < n; ++k) step[t++] = static_cast<int64_t>(s);
    ++t;  // the bonus token
  }
  return step;
}

namespace {

// Spans of consecutive tokens with the same draft step (-1: plain).
struct Span {
  int64_t step;
  std::string text;
};
std::vector<Span> spans_of(const std::vector<std::string>& pieces, const std::vector<int64_t>& step) {
  std::vector<Span> out;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (out.empty() || out.back().step != step[i]) out.push_back({step[i], ""});
    out.back().text += pieces[i];
  }
  return out;
}

double mean_of(const std::vector<int64_t>& v) {
  double s = 0;
  for (int64_t x : v) s += static_cast<double>(x);
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}

// The last `n` bytes of s, starting on a UTF-8 character boundary.
std::string tail(const std::string& s, size_t n) {
  if (s.size() <= n) return s;
  size_t b = s.size() - n;
  while (b < s.size() && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) ++b;
  return "..." + s.substr(b);
}

}  // namespace

std::string show_text(const EvalText& text, const ShownOutput& o, bool colour, size_t prompt_tail_bytes) {
  const std::vector<int64_t> step = draft_step_of_tokens(o.tokens.size(), o.accept);
  std::string out = fmt::format("--- prompt {} ({}, {} tokens), its end:\n{}\n--- output ({} tokens, {} steps, tau {:.3f}):\n",
                                o.index, o.kind, o.prompt.size(), tail(text.decode(o.prompt), prompt_tail_bytes),
                                o.tokens.size(), o.accept.size(), mean_of(o.accept));
  // Two background shades, alternating by step, so neighbouring steps stay apart.
  static const char* kShade[2] = {"\x1b[42;30m", "\x1b[46;30m"};
  for (const Span& s : spans_of(text.pieces(o.tokens), step)) {
    if (s.step < 0) out += s.text;
    else if (colour) out += std::string(kShade[s.step % 2]) + s.text + "\x1b[0m";
    else out += "[" + s.text + "]";
  }
  return out + "\n";
}

std::string html_report(const EvalText& text, const std::vector<ShownOutput>& outputs, const std::string& title) {
  std::string h =
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>" + html_escape(title) +
      "</title>\n<style>\n"
      "body { font-family: sans-serif; margin: 2em; max-width: 70em; }\n"
      "pre { white-space: pre-wrap; word-wrap: break-word; font-family: monospace; background: #f6f6f6; padding: 0.6em; }\n"
      ".d0 { background: #b7e4c7; } .d1 { background: #a9d6f5; }\n"
      ".step { border-right: 1px dotted #999; }\n"
      ".legend span { padding: 0 0.4em; margin-right: 1em; }\n"
      "</style>\n</head>\n<body>\n<h1>" +
      html_escape(title) +
      "</h1>\n<p class=\"legend\">Output of speculative decoding (equal to the target's greedy output): "
      "<span class=\"d0\">accepted drafts of a step</span><span class=\"d1\">accepted drafts of the next step</span>"
      "<span>plain: the target's own token (the prefill's first token, and each step's bonus)</span>"
      "a dotted line ends each verify step; hover a step for its acceptance length.</p>\n";
  for (const ShownOutput& o : outputs) {
    const std::vector<int64_t> step = draft_step_of_tokens(o.tokens.size(), o.accept);
    const std::vector<std::string> pieces = text.pieces(o.tokens);
    h += fmt::format("<h2>prompt {}</h2>\n<p>{}, {} prompt tokens, {} new tokens, {} steps, tau {:.3f}</p>\n", o.index,
                     html_escape(o.kind), o.prompt.size(), o.tokens.size(), o.accept.size(), mean_of(o.accept));
    h += "<details><summary>prompt</summary>\n<pre>" + html_escape(text.decode(o.prompt)) + "</pre>\n</details>\n<pre>";
    // Token 0 alone, then one <span class="step"> per verify step: its accepted drafts coloured, the bonus plain.
    size_t t = 0;
    if (!pieces.empty()) h += html_escape(pieces[t++]);
    for (size_t s = 0; s < o.accept.size() && t < pieces.size(); ++s) {
      std::string drafts, bonus;
      while (t < pieces.size() && step[t] == static_cast<int64_t>(s)) drafts += pieces[t++];
      if (t < pieces.size()) bonus = pieces[t++];
      h += fmt::format("<span class=\"step\" title=\"step {}: {} accepted draft(s) + bonus\">", s, o.accept[s] - 1);
      if (!drafts.empty()) h += fmt::format("<span class=\"d{}\">{}</span>", s % 2, html_escape(drafts));
      h += html_escape(bonus) + "</span>";
    }
    h += "</pre>\n";
  }
  return h + "</body>\n</html>\n";
}

#if DFLASH_WITH_TEXT

struct EvalText::Impl {
  std::string path, dir;
  text::Tokenizer tok;
  mutable std::once_flag template_once;
  mutable std::optional<text::ChatTemplate> tmpl;
  Impl(const std::string& p)
      : path(p),
        dir(std::filesystem::is_directory(p) ? p : std::filesystem::path(p).parent_path().string()),
        tok(text::Tokenizer::from_file(p)) {}
};

EvalText::EvalText(const std::string& path) : impl_(std::make_unique<Impl>(path)) {}
EvalText::~EvalText() = default;
const std::string& EvalText::path() const { return impl_->path; }
const text::Tokenizer* EvalText::tokenizer() const { return &impl_->tok; }

std::vector<int32_t> EvalText::encode(const std::string& s, const std::string& where) const {
  std::vector<uint32_t> ids;
  try {
    ids = impl_->tok.encode(s);
  } catch (const Error& e) {
    DFLASH_REJECT(where << ": " << e.message());
  }
  return std::vector<int32_t>(ids.begin(), ids.end());
}

std::vector<int32_t> EvalText::encode_chat(const ojson& messages, const std::string& where) const {
  std::call_once(impl_->template_once, [&] { impl_->tmpl.emplace(text::ChatTemplate::from_dir(impl_->dir)); });
  text::ChatOptions opt;
  opt.add_generation_prompt = true;
  std::string rendered;
  try {
    rendered = impl_->tmpl->render(messages, opt);
  } catch (const Error& e) {
    DFLASH_REJECT_HINT(where << ": the chat template: " << e.message(), e.hint());
  }
  return encode(rendered, where);
}

std::string EvalText::decode(const std::vector<int32_t>& ids) const {
  const std::vector<uint32_t> u(ids.begin(), ids.end());
  return impl_->tok.decode(u);
}

std::vector<std::string> EvalText::pieces(const std::vector<int32_t>& ids) const {
  // Decode growing groups: a group whose text ends in U+FFFD (a character cut by the token
  // boundary; the decoder is lossy) takes the next token too, up to 4 tokens (a UTF-8 character's
  // bytes); a real U+FFFD in the text is then emitted as is.
  std::vector<std::string> out(ids.size());
  size_t start = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::vector<uint32_t> g(ids.begin() + static_cast<std::ptrdiff_t>(start), ids.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    std::string piece = impl_->tok.decode(g);
    const bool cut = piece.size() >= 3 && piece.compare(piece.size() - 3, 3, "\xEF\xBF\xBD") == 0;
    if (cut && i + 1 < ids.size() && i - start < 3) continue;
    out[i] = std::move(piece);
    start = i + 1;
  }
  return out;
}

#else

struct EvalText::Impl {
  std::string path;
};
EvalText::EvalText(const std::string& path) {
  DFLASH_REJECT_HINT("text prompts and decoded output need a tokenizer (" << path << "), and this build has none (text/ was skipped)",
                     "install libonig-dev and libicu-dev (scripts/common.sh lists them) and configure again; token-id prompts work without");
}
EvalText::~EvalText() = default;
const std::string& EvalText::path() const { return impl_->path; }
const text::Tokenizer* EvalText::tokenizer() const { return nullptr; }
std::vector<int32_t> EvalText::encode(const std::string&, const std::string&) const { return {}; }
std::vector<int32_t> EvalText::encode_chat(const ojson&, const std::string&) const { return {}; }
std::string EvalText::decode(const std::vector<int32_t>&) const { return {}; }
std::vector<std::string> EvalText::pieces(const std::vector<int32_t>& ids) const { return std::vector<std::string>(ids.size()); }

#endif

}  // namespace dflash::bench
