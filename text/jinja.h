#pragma once
// dflash::text::jinja: a Jinja2-subset interpreter, large enough for the Qwen3 / Qwen3.5 / Qwen3.6
// chat templates, configured as transformers configures jinja2 for apply_chat_template
// (trim_blocks=True, lstrip_blocks=True, loop controls, its own tojson = json.dumps(ensure_ascii=False),
// raise_exception(msg)). Values are Python-like (None, bool, int, float, str, list, dict in insertion
// order, namespace, macro) and print as Python prints them.
//
// Supported: {{ }}, {% if/elif/else %}, {% for a[, b] in x %}...{% else %} with loop.* (index, index0,
// revindex, revindex0, first, last, length, previtem, nextitem), break/continue, {% set %} (name,
// ns.attr, block set), namespace(), {% macro %} with defaults, {% generation %} (transformers'
// assistant tracker: renders its body), comments, whitespace control (- and +). Anything else is a
// dflash::Error naming the construct and its line.
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace dflash::text::jinja {

class Template {
 public:
  // Parses `source`; `origin` names it in errors (a file path, "<string>").
  Template(const std::string& source, const std::string& origin);
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;
  ~Template();

  // Renders with `vars` (a JSON object) as the template's variables. A raise_exception(msg) in the
  // template, an unsupported construct or a type error is a dflash::Error naming origin and line.
  std::string render(const nlohmann::ordered_json& vars) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// json.dumps(v, ensure_ascii=False) as Python prints it (", " and ": " separators, insertion order).
std::string to_python_json(const nlohmann::ordered_json& v);

}  // namespace dflash::text::jinja
