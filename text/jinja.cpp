#include "text/jinja.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <optional>
#include <unordered_map>
#include <vector>

#include "core/error.h"

namespace dflash::text::jinja {
namespace {

using ojson = nlohmann::ordered_json;

// ---------------------------------------------------------------- UTF-8 and Python string helpers
std::u32string decode(const std::string& s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    char32_t cp = n == 1 ? c : n == 2 ? (c & 0x1f) : n == 3 ? (c & 0x0f) : (c & 0x07);
    for (int k = 1; k < n && i + k < s.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
    out.push_back(cp);
    i += n;
  }
  return out;
}
std::string encode(const std::u32string& u) {
  std::string out;
  out.reserve(u.size());
  for (char32_t c : u) {
    if (c < 0x80) {
      out += static_cast<char>(c);
    } else if (c < 0x800) {
      out += static_cast<char>(0xc0 | (c >> 6));
      out += static_cast<char>(0x80 | (c & 0x3f));
    } else if (c < 0x10000) {
      out += static_cast<char>(0xe0 | (c >> 12));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (c & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (c >> 18));
      out += static_cast<char>(0x80 | ((c >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (c & 0x3f));
    }
  }
  return out;
}
// Python's str.isspace().
bool py_space(char32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}
// str.strip / lstrip / rstrip with Python's semantics (chars: nullptr = whitespace).
std::string py_strip(const std::string& s, const std::string* chars, bool left, bool right) {
  std::u32string u = decode(s), set = chars ? decode(*chars) : std::u32string();
  auto strip_it = [&](char32_t c) { return chars ? set.find(c) != std::u32string::npos : py_space(c); };
  size_t b = 0, e = u.size();
  if (left) while (b < e && strip_it(u[b])) ++b;
  if (right) while (e > b && strip_it(u[e - 1])) --e;
  return encode(u.substr(b, e - b));
}
std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  int prec = 1;
  for (; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*e", prec - 1, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  std::string e = buf;  // d.ddde[+-]XX
  size_t epos = e.find('e');
  std::string mant = e.substr(0, epos);
  int exp = std::atoi(e.c_str() + epos + 1);
  bool neg = mant[0] == '-';
  if (neg) mant = mant.substr(1);
  std::string digits;
  for (char c : mant) if (c != '.') digits += c;
  std::string out;
  if (exp < -4 || exp >= 16) {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  } else if (exp < 0) {
    out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
  } else {
    if (digits.size() <= static_cast<size_t>(exp) + 1) {
      out = digits + std::string(static_cast<size_t>(exp) + 1 - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
    }
  }
  return neg ? "-" + out : out;
}
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          out += b;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

// ---------------------------------------------------------------- values
struct Expr;
struct Node;
using ExprP = std::shared_ptr<Expr>;
using Body = std::vector<std::shared_ptr<Node>>;

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, as Python's dict

struct Value {
  enum class K { Undef, None, Bool, Int, Float, Str, List, Dict, Ns, Macro, Func } k = K::Undef;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                // Str; the name of an undefined variable; Func's name
  std::shared_ptr<List> l;      // List
  std::shared_ptr<Dict> d;      // Dict, Ns (a namespace or a loop object: attributes, mutable)
  const Node* macro = nullptr;  // Macro

  static Value none() { Value v; v.k = K::None; return v; }
  static Value boolean(bool x) { Value v; v.k = K::Bool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.k = K::Int; v.i = x; return v; }
  static Value real(double x) { Value v; v.k = K::Float; v.f = x; return v; }
  static Value str(std::string x) { Value v; v.k = K::Str; v.s = std::move(x); return v; }
  static Value list(List x = {}) { Value v; v.k = K::List; v.l = std::make_shared<List>(std::move(x)); return v; }
  static Value dict(Dict x = {}, K k = K::Dict) { Value v; v.k = k; v.d = std::make_shared<Dict>(std::move(x)); return v; }
  static Value undefined(std::string name) { Value v; v.s = std::move(name); return v; }
  static Value func(std::string name) { Value v; v.k = K::Func; v.s = std::move(name); return v; }

  bool is_num() const { return k == K::Bool || k == K::Int || k == K::Float; }
  double num() const { return k == K::Float ? f : k == K::Int ? static_cast<double>(i) : (b ? 1 : 0); }
  const Value* find(const std::string& key) const {
    for (auto& [kk, vv] : *d) if (kk == key) return &vv;
    return nullptr;
  }
};

Value from_json(const ojson& j) {
  switch (j.type()) {
    case ojson::value_t::null: return Value::none();
    case ojson::value_t::boolean: return Value::boolean(j.get<bool>());
    case ojson::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case ojson::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      return u <= static_cast<uint64_t>(INT64_MAX) ? Value::integer(static_cast<int64_t>(u)) : Value::real(static_cast<double>(u));
    }
    case ojson::value_t::number_float: return Value::real(j.get<double>());
    case ojson::value_t::string: return Value::str(j.get<std::string>());
    case ojson::value_t::array: {
      List l;
      for (auto& e : j) l.push_back(from_json(e));
      return Value::list(std::move(l));
    }
    case ojson::value_t::object: {
      Dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d.emplace_back(it.key(), from_json(it.value()));
      return Value::dict(std::move(d));
    }
    default: return Value::none();
  }
}

std::string py_repr_str(const std::string& s) {
  char q = (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == static_cast<unsigned char>(q)) { out += '\\'; out += q; }
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) { char b[8]; std::snprintf(b, sizeof b, "\\x%02x", c); out += b; }
    else out += static_cast<char>(c);
  }
  return out + q;
}

std::string to_str(const Value& v, bool repr = false);
std::string to_str(const Value& v, bool repr) {
  switch (v.k) {
    case Value::K::Undef: return "";
    case Value::K::None: return "None";
    case Value::K::Bool: return v.b ? "True" : "False";
    case Value::K::Int: return std::to_string(v.i);
    case Value::K::Float: return py_float(v.f);
    case Value::K::Str: return repr ? py_repr_str(v.s) : v.s;
    case Value::K::List: {
      std::string out = "[";
      for (size_t n = 0; n < v.l->size(); ++n) out += (n ? ", " : "") + to_str((*v.l)[n], true);
      return out + "]";
    }
    case Value::K::Dict: {
      std::string out = "{";
      for (size_t n = 0; n < v.d->size(); ++n) out += (n ? ", " : "") + py_repr_str((*v.d)[n].first) + ": " + to_str((*v.d)[n].second, true);
      return out + "}";
    }
    case Value::K::Ns: return "<Namespace>";
    case Value::K::Macro: return "<Macro>";
    case Value::K::Func: return "<function " + v.s + ">";
  }
  return "";
}

bool truthy(const Value& v) {
  switch (v.k) {
    case Value::K::Undef: case Value::K::None: return false;
    case Value::K::Bool: return v.b;
    case Value::K::Int: return v.i != 0;
    case Value::K::Float: return v.f != 0;
    case Value::K::Str: return !v.s.empty();
    case Value::K::List: return !v.l->empty();
    case Value::K::Dict: return !v.d->empty();
    default: return true;
  }
}

bool equal(const Value& a, const Value& b) {
  if (a.is_num() && b.is_num()) {
    if (a.k != Value::K::Float && b.k != Value::K::Float) return a.num() == b.num() && (a.k == Value::K::Bool ? a.b : a.i) == (b.k == Value::K::Bool ? b.b : b.i);
    return a.num() == b.num();
  }
  if (a.k != b.k) return false;
  switch (a.k) {
    case Value::K::Undef: case Value::K::None: return true;
    case Value::K::Str: return a.s == b.s;
    case Value::K::List:
      if (a.l->size() != b.l->size()) return false;
      for (size_t n = 0; n < a.l->size(); ++n) if (!equal((*a.l)[n], (*b.l)[n])) return false;
      return true;
    case Value::K::Dict:
      if (a.d->size() != b.d->size()) return false;
      for (auto& [k, v] : *a.d) {
        const Value* o = b.find(k);
        if (!o || !equal(v, *o)) return false;
      }
      return true;
    default: return a.d == b.d && a.macro == b.macro && a.s == b.s;
  }
}

// json.dumps options transformers' tojson passes through: indent (None: one line), sort_keys, ensure_ascii.
struct JsonOpts {
  int indent = -1;
  bool sort_keys = false, ensure_ascii = false;
};
void dump_json(const Value& v, std::string& out, int line, const std::string& origin, const JsonOpts& o = {}, int level = 0);

// ---------------------------------------------------------------- AST
struct Expr {
  enum class T { Lit, Name, Attr, Item, Slice, Call, Filter, Test, Not, Neg, Pos, Bin, And, Or, Cond, ListLit, DictLit };
  T t;
  int line = 0;
  Value lit;
  std::string name;  // Name, Attr's attribute, Filter / Test name, Bin's operator
  std::vector<ExprP> a;
  std::vector<std::pair<std::string, ExprP>> kw;
  bool negate = false;  // Test: "is not"
};

struct Node {
  enum class T { Text, Out, If, For, Set, SetBlock, Macro, Break, Continue, Gen } t;
  int line = 0;
  std::string text;                              // Text
  ExprP expr;                                    // Out, Set's value, For's iterable
  std::vector<std::pair<ExprP, Body>> branches;  // If (a null condition: else)
  Body body, else_body;                          // For, SetBlock, Macro, Gen
  std::vector<std::string> targets;              // For's names; Set: {name} or {ns, attr}; Macro: params
  std::vector<ExprP> defaults;                   // Macro: a default per parameter (null: none)
  std::string name;                              // Macro's name
};

// ---------------------------------------------------------------- lexer
struct Tok {
  enum class T { Name, Str, Int, Float, Op, End } t;
  std::string s;
  int line;
};
struct Seg {  // a piece of the template: text, {{ ... }} or {% ... %}
  enum class T { Text, Var, Block } t;
  std::string text;
  std::vector<Tok> toks;
  int line;
};

[[noreturn]] void fail(const std::string& origin, int line, const std::string& what, const std::string& hint = "") {
  DFLASH_REJECT_HINT(origin << ":" << line << ": " << what, hint);
}

const char* kUnsupportedHint =
    "dflash's Jinja subset covers the Qwen3 / Qwen3.5 / Qwen3.6 chat templates (docs/data.md, \"Chat templates\"); "
    "simplify the template or open an issue with it";

std::vector<Seg> lex(std::string src, const std::string& origin) {
  // jinja2 normalizes newlines and drops one trailing newline (keep_trailing_newline=False).
  std::string norm;
  norm.reserve(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] == '\r') {
      norm += '\n';
      if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
    } else {
      norm += src[i];
    }
  }
  if (!norm.empty() && norm.back() == '\n') norm.pop_back();
  src.swap(norm);

  std::vector<Seg> segs;
  size_t pos = 0;
  int line = 1;
  bool line_starting = true;
  auto count_lines = [&](size_t from, size_t to) {
    for (size_t k = from; k < to; ++k) line += src[k] == '\n';
  };
  while (pos <= src.size()) {
    size_t open = pos;
    while (true) {
      open = src.find('{', open);
      if (open == std::string::npos || open + 1 >= src.size()) { open = std::string::npos; break; }
      char c = src[open + 1];
      if (c == '{' || c == '%' || c == '#') break;
      ++open;
    }
    std::string text = src.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
    if (open == std::string::npos) {
      if (!text.empty()) segs.push_back({Seg::T::Text, text, {}, line});
      break;
    }
    char kind = src[open + 1];
    char sign = open + 2 < src.size() ? src[open + 2] : 0;
    if (sign != '-' && sign != '+') sign = 0;
    if (sign == '-') {
      size_t e = text.size();
      while (e > 0 && std::isspace(static_cast<unsigned char>(text[e - 1]))) --e;
      text.resize(e);
    } else if (sign != '+' && kind != '{') {  // lstrip_blocks
      size_t l_pos = text.rfind('\n');
      l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
      if (l_pos > 0 || line_starting) {
        bool ws = true;
        for (size_t k = l_pos; k < text.size(); ++k) ws = ws && (text[k] == ' ' || text[k] == '\t' || text[k] == '\v' || text[k] == '\f');
        if (ws) text.resize(l_pos);
      }
    }
    if (!text.empty()) segs.push_back({Seg::T::Text, text, {}, line});
    count_lines(pos, open);
    int tag_line = line;
    size_t p = open + 2 + (sign ? 1 : 0);
    char end_sign = 0;
    size_t after = 0;
    Seg seg{kind == '{' ? Seg::T::Var : Seg::T::Block, "", {}, tag_line};
    if (kind == '#') {
      size_t close = src.find("#}", p);
      if (close == std::string::npos) fail(origin, tag_line, "unclosed comment {#");
      if (close > p && (src[close - 1] == '-' || src[close - 1] == '+')) end_sign = src[close - 1];
      count_lines(p, close);
      after = close + 2;
    } else {
      int depth = 0;
      while (true) {
        while (p < src.size() && std::isspace(static_cast<unsigned char>(src[p]))) {
          line += src[p] == '\n';
          ++p;
        }
        if (p >= src.size()) fail(origin, tag_line, std::string("unclosed tag {") + kind);
        char c = src[p];
        const char* close = kind == '{' ? "}}" : "%}";
        if (depth == 0 && (c == '-' || c == '+') && src.compare(p + 1, 2, close) == 0) {
          end_sign = c;
          after = p + 3;
          break;
        }
        if (depth == 0 && src.compare(p, 2, close) == 0) {
          after = p + 2;
          break;
        }
        if (c == '"' || c == '\'') {
          std::string s;
          size_t q = p + 1;
          while (q < src.size() && src[q] != c) {
            if (src[q] == '\\' && q + 1 < src.size()) {
              char e = src[++q];
              switch (e) {
                case 'n': s += '\n'; break;
                case 't': s += '\t'; break;
                case 'r': s += '\r'; break;
                case '\\': s += '\\'; break;
                case '\'': s += '\''; break;
                case '"': s += '"'; break;
                case '0': s += '\0'; break;
                case 'a': s += '\a'; break;
                case 'b': s += '\b'; break;
                case 'f': s += '\f'; break;
                case 'v': s += '\v'; break;
                case 'x': case 'u': case 'U': {  // Python's \xhh, \uXXXX, \UXXXXXXXX
                  size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
                  if (q + n >= src.size() || !std::all_of(src.begin() + q + 1, src.begin() + q + 1 + n, [](char h) { return std::isxdigit(static_cast<unsigned char>(h)); }))
                    fail(origin, line, std::string("a malformed \\") + e + " escape in a string literal");
                  s += encode(std::u32string(1, static_cast<char32_t>(std::stoul(src.substr(q + 1, n), nullptr, 16))));
                  q += n;
                  break;
                }
                default: s += '\\'; s += e;
              }
            } else {
              line += src[q] == '\n';
              s += src[q];
            }
            ++q;
          }
          if (q >= src.size()) fail(origin, line, "unterminated string literal");
          seg.toks.push_back({Tok::T::Str, s, line});
          p = q + 1;
        } else if (std::isdigit(static_cast<unsigned char>(c))) {
          size_t q = p;
          bool fl = false;
          while (q < src.size() && (std::isdigit(static_cast<unsigned char>(src[q])) || src[q] == '_' ||
                                    (src[q] == '.' && !fl && q + 1 < src.size() && std::isdigit(static_cast<unsigned char>(src[q + 1]))))) {
            fl = fl || src[q] == '.';
            ++q;
          }
          if (q < src.size() && (src[q] == 'e' || src[q] == 'E')) {  // an exponent: 1e20, 1.5e-7
            size_t r = q + 1;
            if (r < src.size() && (src[r] == '+' || src[r] == '-')) ++r;
            if (r < src.size() && std::isdigit(static_cast<unsigned char>(src[r]))) {
              while (r < src.size() && std::isdigit(static_cast<unsigned char>(src[r]))) ++r;
              fl = true;
              q = r;
            }
          }
          std::string num;
          for (size_t k = p; k < q; ++k) if (src[k] != '_') num += src[k];
          seg.toks.push_back({fl ? Tok::T::Float : Tok::T::Int, num, line});
          p = q;
        } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
          size_t q = p;
          while (q < src.size() && (std::isalnum(static_cast<unsigned char>(src[q])) || src[q] == '_')) ++q;
          seg.toks.push_back({Tok::T::Name, src.substr(p, q - p), line});
          p = q;
        } else {
          static const char* two[] = {"==", "!=", "<=", ">=", "//", "**"};
          std::string op(1, c);
          for (const char* t : two) if (src.compare(p, 2, t) == 0) op = t;
          if (op.size() == 1 && std::string("+-*/%~<>=()[]{}.,:|").find(c) == std::string::npos)
            fail(origin, line, std::string("unexpected character '") + c + "' in a tag");
          if (op == "(" || op == "[" || op == "{") ++depth;
          if (op == ")" || op == "]" || op == "}") --depth;
          seg.toks.push_back({Tok::T::Op, op, line});
          p += op.size();
        }
      }
      seg.toks.push_back({Tok::T::End, "", line});
      segs.push_back(std::move(seg));
    }
    // After the tag: "-" eats all whitespace, trim_blocks one newline (blocks and comments).
    size_t next = after;
    if (end_sign == '-') {
      while (next < src.size() && std::isspace(static_cast<unsigned char>(src[next]))) ++next;
    } else if (end_sign != '+' && kind != '{' && next < src.size() && src[next] == '\n') {
      ++next;
    }
    count_lines(after, next);
    line_starting = next > 0 && src[next - 1] == '\n';
    pos = next;
    if (pos >= src.size()) break;
  }
  return segs;
}

// ---------------------------------------------------------------- parser
class Parser {
 public:
  Parser(std::vector<Seg> segs, std::string origin) : segs_(std::move(segs)), origin_(std::move(origin)) {}

  Body parse_template() {
    std::string end;
    Body b = parse_body({}, end);
    return b;
  }

 private:
  std::vector<Seg> segs_;
  std::string origin_;
  size_t si_ = 0;
  const std::vector<Tok>* toks_ = nullptr;
  size_t ti_ = 0;

  [[noreturn]] void err(int line, const std::string& what) { fail(origin_, line, what); }
  [[noreturn]] void unsupported(int line, const std::string& what) { fail(origin_, line, "unsupported Jinja construct: " + what, kUnsupportedHint); }
  const Tok& peek(size_t k = 0) { return (*toks_)[std::min(ti_ + k, toks_->size() - 1)]; }
  const Tok& next() { const Tok& t = peek(); if (ti_ < toks_->size() - 1) ++ti_; return t; }
  bool is_op(const char* s, size_t k = 0) { return peek(k).t == Tok::T::Op && peek(k).s == s; }
  bool is_name(const char* s, size_t k = 0) { return peek(k).t == Tok::T::Name && peek(k).s == s; }
  void expect_op(const char* s) {
    if (!is_op(s)) err(peek().line, std::string("expected '") + s + "', found '" + peek().s + "'");
    next();
  }
  std::string expect_name() {
    if (peek().t != Tok::T::Name) err(peek().line, "expected a name, found '" + peek().s + "'");
    return next().s;
  }
  void expect_end() {
    if (peek().t != Tok::T::End) err(peek().line, "unexpected '" + peek().s + "' at the end of a tag");
  }

  // Parses nodes until a block tag whose keyword is in `ends` (left current, its keyword in `end`).
  Body parse_body(const std::vector<std::string>& ends, std::string& end) {
    Body body;
    while (si_ < segs_.size()) {
      Seg& s = segs_[si_];
      if (s.t == Seg::T::Text) {
        auto n = std::make_shared<Node>();
        n->t = Node::T::Text;
        n->text = s.text;
        n->line = s.line;
        body.push_back(n);
        ++si_;
        continue;
      }
      toks_ = &s.toks;
      ti_ = 0;
      if (s.t == Seg::T::Var) {
        auto n = std::make_shared<Node>();
        n->t = Node::T::Out;
        n->line = s.line;
        n->expr = parse_expr();
        expect_end();
        body.push_back(n);
        ++si_;
        continue;
      }
      if (peek().t != Tok::T::Name) err(s.line, "expected a statement keyword after {%");
      std::string kw = peek().s;
      if (std::find(ends.begin(), ends.end(), kw) != ends.end()) {
        end = kw;
        return body;
      }
      next();
      ++si_;
      body.push_back(parse_stmt(kw, s.line));
    }
    if (!ends.empty()) err(segs_.empty() ? 1 : segs_.back().line, "missing {% " + ends.back() + " %}");
    return body;
  }

  // Re-enters the tokens of the current block tag (after parse_body stopped on it).
  void enter_current() {
    toks_ = &segs_[si_].toks;
    ti_ = 1;
  }

  std::shared_ptr<Node> parse_stmt(const std::string& kw, int line) {
    auto n = std::make_shared<Node>();
    n->line = line;
    std::string end;
    if (kw == "if") {
      n->t = Node::T::If;
      ExprP cond = parse_expr();
      expect_end();
      while (true) {
        Body b = parse_body({"elif", "else", "endif"}, end);
        n->branches.emplace_back(cond, std::move(b));
        enter_current();
        ++si_;
        if (end == "endif") { expect_end(); break; }
        if (end == "else") {
          expect_end();
          Body eb = parse_body({"endif"}, end);
          n->branches.emplace_back(nullptr, std::move(eb));
          enter_current();
          ++si_;
          expect_end();
          break;
        }
        cond = parse_expr();
        expect_end();
      }
    } else if (kw == "for") {
      n->t = Node::T::For;
      n->targets.push_back(expect_name());
      while (is_op(",")) { next(); n->targets.push_back(expect_name()); }
      if (!is_name("in")) err(peek().line, "expected 'in' in a for loop");
      next();
      n->expr = parse_expr(/*no_cond=*/true);
      if (is_name("if")) unsupported(line, "a for loop filter ({% for x in y if cond %})");
      if (is_name("recursive")) unsupported(line, "a recursive for loop");
      expect_end();
      n->body = parse_body({"else", "endfor"}, end);
      enter_current();
      ++si_;
      expect_end();
      if (end == "else") {
        n->else_body = parse_body({"endfor"}, end);
        enter_current();
        ++si_;
        expect_end();
      }
    } else if (kw == "set") {
      std::string name = expect_name();
      n->targets.push_back(name);
      if (is_op(".")) { next(); n->targets.push_back(expect_name()); }
      if (is_op(",")) unsupported(line, "tuple assignment in {% set %}");
      if (is_op("=")) {
        next();
        n->t = Node::T::Set;
        n->expr = parse_expr();
        expect_end();
      } else {
        if (is_op("|")) unsupported(line, "a filtered block set");
        expect_end();
        if (n->targets.size() != 1) err(line, "a block set takes a plain name");
        n->t = Node::T::SetBlock;
        n->body = parse_body({"endset"}, end);
        enter_current();
        ++si_;
        expect_end();
      }
    } else if (kw == "macro") {
      n->t = Node::T::Macro;
      n->name = expect_name();
      expect_op("(");
      while (!is_op(")")) {
        n->targets.push_back(expect_name());
        ExprP def;
        if (is_op("=")) { next(); def = parse_expr(); }
        n->defaults.push_back(def);
        if (!is_op(",")) break;
        next();
      }
      expect_op(")");
      expect_end();
      n->body = parse_body({"endmacro"}, end);
      enter_current();
      ++si_;
      expect_end();
    } else if (kw == "break" || kw == "continue") {
      n->t = kw == "break" ? Node::T::Break : Node::T::Continue;
      expect_end();
    } else if (kw == "generation") {
      n->t = Node::T::Gen;
      expect_end();
      n->body = parse_body({"endgeneration"}, end);
      enter_current();
      ++si_;
      expect_end();
    } else {
      unsupported(line, "{% " + kw + " %}");
    }
    return n;
  }

  ExprP mk(Expr::T t, int line) {
    auto e = std::make_shared<Expr>();
    e->t = t;
    e->line = line;
    return e;
  }

  ExprP parse_expr(bool no_cond = false) {
    ExprP e = parse_or();
    if (no_cond) return e;
    while (is_name("if")) {
      int line = next().line;
      auto c = mk(Expr::T::Cond, line);
      c->a.push_back(e);
      c->a.push_back(parse_or());
      if (is_name("else")) {
        next();
        c->a.push_back(parse_expr());
      } else {
        c->a.push_back(nullptr);
      }
      e = c;
    }
    return e;
  }
  ExprP parse_or() {
    ExprP e = parse_and();
    while (is_name("or")) {
      auto o = mk(Expr::T::Or, next().line);
      o->a = {e, parse_and()};
      e = o;
    }
    return e;
  }
  ExprP parse_and() {
    ExprP e = parse_not();
    while (is_name("and")) {
      auto o = mk(Expr::T::And, next().line);
      o->a = {e, parse_not()};
      e = o;
    }
    return e;
  }
  ExprP parse_not() {
    if (is_name("not")) {
      auto o = mk(Expr::T::Not, next().line);
      o->a = {parse_not()};
      return o;
    }
    return parse_compare();
  }
  ExprP parse_compare() {
    ExprP e = parse_math1();
    while (true) {
      std::string op;
      if (peek().t == Tok::T::Op && (peek().s == "==" || peek().s == "!=" || peek().s == "<" || peek().s == ">" || peek().s == "<=" || peek().s == ">=")) {
        op = peek().s;
        next();
      } else if (is_name("in")) {
        op = "in";
        next();
      } else if (is_name("not") && is_name("in", 1)) {
        op = "not in";
        next();
        next();
      } else {
        break;
      }
      auto b = mk(Expr::T::Bin, peek().line);
      b->name = op;
      b->a = {e, parse_math1()};
      e = b;
    }
    return e;
  }
  ExprP bin(const std::string& op, ExprP l, ExprP r, int line) {
    auto b = mk(Expr::T::Bin, line);
    b->name = op;
    b->a = {std::move(l), std::move(r)};
    return b;
  }
  ExprP parse_math1() {
    ExprP e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Tok& t = next();
      std::string op = t.s;
      e = bin(op, e, parse_concat(), t.line);
    }
    return e;
  }
  ExprP parse_concat() {
    ExprP e = parse_math2();
    while (is_op("~")) {
      int line = next().line;
      e = bin("~", e, parse_math2(), line);
    }
    return e;
  }
  ExprP parse_math2() {
    ExprP e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Tok& t = next();
      std::string op = t.s;
      e = bin(op, e, parse_pow(), t.line);
    }
    return e;
  }
  ExprP parse_pow() {
    ExprP e = parse_unary();
    while (is_op("**")) {
      int line = next().line;
      e = bin("**", e, parse_unary(), line);
    }
    return e;
  }
  ExprP parse_unary(bool with_filter = true) {
    ExprP e;
    if (is_op("-") || is_op("+")) {
      const Tok& t = next();
      e = mk(t.s == "-" ? Expr::T::Neg : Expr::T::Pos, t.line);
      e->a = {parse_unary(false)};
    } else {
      e = parse_primary();
    }
    e = parse_postfix(e);
    if (with_filter) e = parse_filters(e);
    return e;
  }
  void parse_args(ExprP& call) {  // after "(": positional and keyword arguments through ")"
    while (!is_op(")")) {
      if (peek().t == Tok::T::Name && is_op("=", 1)) {
        std::string k = next().s;
        next();
        call->kw.emplace_back(k, parse_expr());
      } else {
        call->a.push_back(parse_expr());
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
  }
  ExprP parse_postfix(ExprP e) {
    while (true) {
      if (is_op(".")) {
        int line = next().line;
        auto a = mk(Expr::T::Attr, line);
        if (peek().t == Tok::T::Int) {
          a->t = Expr::T::Item;
          auto idx = mk(Expr::T::Lit, line);
          idx->lit = Value::integer(std::stoll(next().s));
          a->a = {e, idx};
        } else {
          a->name = expect_name();
          a->a = {e};
        }
        e = a;
      } else if (is_op("[")) {
        int line = next().line;
        ExprP parts[3];
        bool slice = false;
        int k = 0;
        while (true) {
          if (is_op(":")) {
            slice = true;
            next();
            if (++k > 2) err(line, "too many ':' in a slice");
            continue;
          }
          if (is_op("]")) break;
          parts[k] = parse_expr();
          if (!is_op(":") && !is_op("]")) err(peek().line, "expected ']' or ':' in a subscript");
        }
        next();
        if (slice) {
          auto s = mk(Expr::T::Slice, line);
          s->a = {e, parts[0], parts[1], parts[2]};
          e = s;
        } else {
          if (!parts[0]) err(line, "an empty subscript []");
          auto it = mk(Expr::T::Item, line);
          it->a = {e, parts[0]};
          e = it;
        }
      } else if (is_op("(")) {
        int line = next().line;
        auto c = mk(Expr::T::Call, line);
        c->a.push_back(e);
        parse_args(c);
        e = c;
      } else {
        return e;
      }
    }
  }
  ExprP parse_filters(ExprP e) {
    while (true) {
      if (is_op("|")) {
        int line = next().line;
        auto f = mk(Expr::T::Filter, line);
        f->name = expect_name();
        f->a.push_back(e);
        if (is_op("(")) { next(); parse_args(f); }
        e = f;
      } else if (is_name("is")) {
        int line = next().line;
        auto t = mk(Expr::T::Test, line);
        if (is_name("not")) { next(); t->negate = true; }
        // "is none" / "is true" / "is false": keywords that are also test names.
        t->name = expect_name();
        t->a.push_back(e);
        if (is_op("(")) {
          next();
          parse_args(t);
        } else if (peek().t == Tok::T::Str || peek().t == Tok::T::Int || peek().t == Tok::T::Float ||
                   (peek().t == Tok::T::Name && !is_name("and") && !is_name("or") && !is_name("if") && !is_name("else") &&
                    !is_name("is") && !is_name("in") && !is_name("not"))) {
          t->a.push_back(parse_primary());
        }
        e = t;
      } else {
        return e;
      }
    }
  }
  ExprP parse_primary() {
    const Tok& t = peek();
    int line = t.line;
    if (t.t == Tok::T::Str) {
      auto e = mk(Expr::T::Lit, line);
      std::string s;
      while (peek().t == Tok::T::Str) s += next().s;  // adjacent literals concatenate
      e->lit = Value::str(s);
      return e;
    }
    if (t.t == Tok::T::Int || t.t == Tok::T::Float) {
      auto e = mk(Expr::T::Lit, line);
      e->lit = t.t == Tok::T::Int ? Value::integer(std::stoll(t.s)) : Value::real(std::stod(t.s));
      next();
      return e;
    }
    if (t.t == Tok::T::Name) {
      std::string n = next().s;
      auto e = mk(Expr::T::Lit, line);
      if (n == "true" || n == "True") { e->lit = Value::boolean(true); return e; }
      if (n == "false" || n == "False") { e->lit = Value::boolean(false); return e; }
      if (n == "none" || n == "None") { e->lit = Value::none(); return e; }
      e->t = Expr::T::Name;
      e->name = n;
      return e;
    }
    if (is_op("(")) {
      next();
      ExprP e = parse_expr();
      if (is_op(",")) unsupported(line, "a tuple literal");
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto e = mk(Expr::T::ListLit, line);
      while (!is_op("]")) {
        e->a.push_back(parse_expr());
        if (!is_op(",")) break;
        next();
      }
      expect_op("]");
      return e;
    }
    if (is_op("{")) {
      next();
      auto e = mk(Expr::T::DictLit, line);
      while (!is_op("}")) {
        e->a.push_back(parse_expr());
        expect_op(":");
        e->a.push_back(parse_expr());
        if (!is_op(",")) break;
        next();
      }
      expect_op("}");
      return e;
    }
    if (t.t == Tok::T::End) err(line, "unexpected end of a tag (an expression is missing)");
    err(line, "unexpected '" + t.s + "' in an expression");
  }
};

// ---------------------------------------------------------------- evaluator
using Frame = std::unordered_map<std::string, Value>;

enum class Flow { Normal, Break, Continue };

struct Renderer {
  const std::string& origin;
  std::vector<std::shared_ptr<Frame>> frames;
  int depth = 0;

  [[noreturn]] void err(int line, const std::string& what, const std::string& hint = "") { fail(origin, line, what, hint); }
  [[noreturn]] void unsupported(int line, const std::string& what) { fail(origin, line, "unsupported Jinja construct: " + what, kUnsupportedHint); }

  Value lookup(const std::string& name) {
    for (auto it = frames.rbegin(); it != frames.rend(); ++it) {
      auto f = (*it)->find(name);
      if (f != (*it)->end()) return f->second;
    }
    return Value::undefined(name);
  }

  static const char* type_name(const Value& v) {
    switch (v.k) {
      case Value::K::Undef: return "undefined";
      case Value::K::None: return "None";
      case Value::K::Bool: return "bool";
      case Value::K::Int: return "int";
      case Value::K::Float: return "float";
      case Value::K::Str: return "str";
      case Value::K::List: return "list";
      case Value::K::Dict: return "dict";
      case Value::K::Ns: return "namespace";
      case Value::K::Macro: return "macro";
      case Value::K::Func: return "function";
    }
    return "?";
  }
  void require_defined(const Value& v, int line) {
    if (v.k == Value::K::Undef) err(line, "'" + v.s + "' is undefined");
  }

  // Python's methods, which jinja2's getattr returns (bound) before any dict key of that name.
  static bool is_method(const Value& obj, const std::string& name) {
    static const char* str_m[] = {"capitalize", "casefold", "center", "count", "encode", "endswith", "expandtabs", "find", "format",
                                  "format_map", "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit", "isidentifier",
                                  "islower", "isnumeric", "isprintable", "isspace", "istitle", "isupper", "join", "ljust", "lower",
                                  "lstrip", "maketrans", "partition", "removeprefix", "removesuffix", "replace", "rfind", "rindex",
                                  "rjust", "rpartition", "rsplit", "rstrip", "split", "splitlines", "startswith", "strip", "swapcase",
                                  "title", "translate", "upper", "zfill"};
    static const char* dict_m[] = {"clear", "copy", "fromkeys", "get", "items", "keys", "pop", "popitem", "setdefault", "update", "values"};
    static const char* list_m[] = {"append", "clear", "copy", "count", "extend", "index", "insert", "pop", "remove", "reverse", "sort"};
    auto in = [&](auto& arr) { return std::any_of(std::begin(arr), std::end(arr), [&](const char* m) { return name == m; }); };
    return obj.k == Value::K::Str ? in(str_m) : obj.k == Value::K::Dict ? in(dict_m) : obj.k == Value::K::List ? in(list_m) : false;
  }

  Value getattr(const Value& obj, const std::string& name, int line) {
    require_defined(obj, line);
    if (is_method(obj, name)) unsupported(line, std::string("the ") + type_name(obj) + " method ." + name + " (not called, or not supported)");
    if (obj.k == Value::K::Dict || obj.k == Value::K::Ns) {
      const Value* v = obj.find(name);
      if (v) return *v;
      if (obj.k == Value::K::Ns && obj.find("index0") && (name == "cycle" || name == "depth" || name == "depth0" || name == "changed"))
        unsupported(line, "loop." + name);
    }
    return Value::undefined(name);
  }

  Value getitem(const Value& obj, const Value& key, int line) {
    require_defined(obj, line);
    if (obj.k == Value::K::Dict || obj.k == Value::K::Ns) {
      if (key.k == Value::K::Str) {
        const Value* v = obj.find(key.s);
        if (v) return *v;
      }
      return Value::undefined(to_str(key));
    }
    if ((obj.k == Value::K::List || obj.k == Value::K::Str) && (key.k == Value::K::Int || key.k == Value::K::Bool)) {
      int64_t i = key.k == Value::K::Int ? key.i : key.b;
      if (obj.k == Value::K::List) {
        int64_t n = static_cast<int64_t>(obj.l->size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value::undefined("[" + std::to_string(i) + "]");
        return (*obj.l)[static_cast<size_t>(i)];
      }
      std::u32string u = decode(obj.s);
      int64_t n = static_cast<int64_t>(u.size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::undefined("[" + std::to_string(i) + "]");
      return Value::str(encode(std::u32string(1, u[static_cast<size_t>(i)])));
    }
    if (obj.k == Value::K::Str || obj.k == Value::K::List) {
      if (key.k == Value::K::Str) return getattr(obj, key.s, line);
      err(line, std::string("indices must be integers, not ") + type_name(key));
    }
    return Value::undefined(to_str(key));
  }

  Value slice(const Value& obj, const Value* b, const Value* e, const Value* st, int line) {
    require_defined(obj, line);
    auto as_int = [&](const Value* v, const char* what) -> std::optional<int64_t> {
      if (!v || v->k == Value::K::None || v->k == Value::K::Undef) return std::nullopt;
      if (v->k != Value::K::Int) err(line, std::string("slice ") + what + " must be an integer");
      return v->i;
    };
    auto ob = as_int(b, "start"), oe = as_int(e, "stop"), os = as_int(st, "step");
    int64_t step = os.value_or(1);
    if (step == 0) err(line, "slice step cannot be zero");
    std::u32string u;
    int64_t n;
    if (obj.k == Value::K::List) {
      n = static_cast<int64_t>(obj.l->size());
    } else if (obj.k == Value::K::Str) {
      u = decode(obj.s);
      n = static_cast<int64_t>(u.size());
    } else {
      err(line, std::string("cannot slice a ") + type_name(obj));
    }
    auto clamp = [&](std::optional<int64_t> v, int64_t def) {
      if (!v) return def;
      int64_t x = *v;
      if (x < 0) x += n;
      if (step > 0) return std::clamp<int64_t>(x, 0, n);
      return std::clamp<int64_t>(x, -1, n - 1);
    };
    int64_t start = clamp(ob, step > 0 ? 0 : n - 1), stop = clamp(oe, step > 0 ? n : -1);
    List l;
    std::u32string out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (obj.k == Value::K::List) l.push_back((*obj.l)[static_cast<size_t>(i)]);
      else out.push_back(u[static_cast<size_t>(i)]);
    }
    return obj.k == Value::K::List ? Value::list(std::move(l)) : Value::str(encode(out));
  }

  // Python's `in`.
  bool contains(const Value& hay, const Value& needle, int line) {
    switch (hay.k) {
      case Value::K::Str:
        if (needle.k != Value::K::Str) err(line, std::string("'in <string>' requires a string, not ") + type_name(needle));
        return hay.s.find(needle.s) != std::string::npos;
      case Value::K::List:
        for (auto& v : *hay.l) if (equal(v, needle)) return true;
        return false;
      case Value::K::Dict:
        return needle.k == Value::K::Str && hay.find(needle.s);
      case Value::K::Undef:
        return false;
      default:
        err(line, std::string("'in' on a ") + type_name(hay));
    }
  }

  List iterate(const Value& v, int line) {
    switch (v.k) {
      case Value::K::List: return *v.l;
      case Value::K::Dict: {
        List l;
        for (auto& [k, _] : *v.d) l.push_back(Value::str(k));
        return l;
      }
      case Value::K::Str: {
        List l;
        for (char32_t c : decode(v.s)) l.push_back(Value::str(encode(std::u32string(1, c))));
        return l;
      }
      case Value::K::Undef: return {};
      default: err(line, std::string("a ") + type_name(v) + " is not iterable");
    }
  }

  int64_t length(const Value& v, int line) {
    switch (v.k) {
      case Value::K::Str: return static_cast<int64_t>(decode(v.s).size());
      case Value::K::List: return static_cast<int64_t>(v.l->size());
      case Value::K::Dict: return static_cast<int64_t>(v.d->size());
      case Value::K::Undef: return 0;
      default: err(line, std::string("a ") + type_name(v) + " has no length");
    }
  }

  Value arith(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "~") return Value::str(to_str(a) + to_str(b));
    require_defined(a, line);
    require_defined(b, line);
    if (op == "+") {
      if (a.k == Value::K::Str && b.k == Value::K::Str) return Value::str(a.s + b.s);
      if (a.k == Value::K::List && b.k == Value::K::List) {
        List l = *a.l;
        l.insert(l.end(), b.l->begin(), b.l->end());
        return Value::list(std::move(l));
      }
    }
    if (a.is_num() && b.is_num()) {
      bool ints = a.k != Value::K::Float && b.k != Value::K::Float;
      int64_t x = a.k == Value::K::Int ? a.i : a.b, y = b.k == Value::K::Int ? b.i : b.b;
      if (op == "+") return ints ? Value::integer(x + y) : Value::real(a.num() + b.num());
      if (op == "-") return ints ? Value::integer(x - y) : Value::real(a.num() - b.num());
      if (op == "*") return ints ? Value::integer(x * y) : Value::real(a.num() * b.num());
      if (op == "/" || op == "//" || op == "%") {
        if (b.num() == 0) err(line, "division by zero");
        if (op == "/") return Value::real(a.num() / b.num());
        if (ints) {
          int64_t q = x / y, r = x % y;
          if (r != 0 && ((r < 0) != (y < 0))) { --q; r += y; }
          return Value::integer(op == "//" ? q : r);
        }
        double q = std::floor(a.num() / b.num());
        return Value::real(op == "//" ? q : a.num() - q * b.num());
      }
      if (op == "**") return ints && y >= 0 ? Value::integer(static_cast<int64_t>(std::pow(x, y))) : Value::real(std::pow(a.num(), b.num()));
    }
    if (op == "*" && a.k == Value::K::Str && b.k == Value::K::Int) {
      std::string s;
      for (int64_t k = 0; k < b.i; ++k) s += a.s;
      return Value::str(s);
    }
    err(line, "unsupported operand types for " + op + ": " + type_name(a) + " and " + type_name(b));
  }

  bool less(const Value& a, const Value& b, int line) {
    if (a.is_num() && b.is_num()) return a.num() < b.num();
    if (a.k == Value::K::Str && b.k == Value::K::Str) return a.s < b.s;
    err(line, std::string("cannot order a ") + type_name(a) + " and a " + type_name(b));
  }

  // Arguments of a call / filter / test: positional values and keyword values.
  struct Args {
    std::vector<Value> pos;
    std::vector<std::pair<std::string, Value>> kw;
  };
  Args eval_args(const Expr& e, size_t first) {
    Args a;
    for (size_t k = first; k < e.a.size(); ++k) a.pos.push_back(eval(*e.a[k]));
    for (auto& [k, v] : e.kw) a.kw.emplace_back(k, eval(*v));
    return a;
  }
  // Positional argument `i` or keyword `name`, or nullptr.
  const Value* arg(const Args& a, size_t i, const char* name) {
    if (i < a.pos.size()) return &a.pos[i];
    for (auto& [k, v] : a.kw) if (k == name) return &v;
    return nullptr;
  }
  void max_args(const Args& a, size_t n, const std::string& what, int line, std::initializer_list<const char*> names = {}) {
    if (a.pos.size() > n) err(line, what + " takes at most " + std::to_string(n) + " arguments");
    for (auto& [k, _] : a.kw)
      if (std::find_if(names.begin(), names.end(), [&](const char* s) { return k == s; }) == names.end())
        unsupported(line, what + " with the argument " + k + "=");
  }
  std::string str_arg(const Value* v, const std::string& what, int line) {
    if (!v || v->k != Value::K::Str) err(line, what + " takes a string argument");
    return v->s;
  }

  Value str_method(const std::string& s, const std::string& m, const Args& a, int line) {
    const std::string what = "str." + m + "()";
    if (m == "startswith" || m == "endswith") {
      max_args(a, 1, what, line);
      std::string p = str_arg(arg(a, 0, ""), what, line);
      bool r = m == "startswith" ? s.compare(0, p.size(), p) == 0 && s.size() >= p.size()
                                 : s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
      return Value::boolean(r);
    }
    if (m == "strip" || m == "lstrip" || m == "rstrip") {
      max_args(a, 1, what, line);
      const Value* c = arg(a, 0, "");
      std::string chars;
      bool has = c && c->k != Value::K::None;
      if (has) chars = str_arg(c, what, line);
      return Value::str(py_strip(s, has ? &chars : nullptr, m != "rstrip", m != "lstrip"));
    }
    if (m == "split" || m == "rsplit") {
      max_args(a, 2, what, line, {"sep", "maxsplit"});
      const Value* sepv = arg(a, 0, "sep");
      const Value* maxv = arg(a, 1, "maxsplit");
      int64_t maxsplit = maxv && maxv->k == Value::K::Int ? maxv->i : -1;
      if (m == "rsplit" && maxsplit >= 0) unsupported(line, "str.rsplit() with maxsplit");
      List out;
      if (!sepv || sepv->k == Value::K::None) {
        std::u32string u = decode(s);
        size_t i = 0;
        int64_t splits = 0;
        while (true) {
          while (i < u.size() && py_space(u[i])) ++i;
          if (i >= u.size()) break;
          if (maxsplit >= 0 && splits >= maxsplit) {
            size_t e = u.size();
            while (e > i && py_space(u[e - 1])) --e;
            out.push_back(Value::str(encode(u.substr(i, e - i))));
            break;
          }
          size_t j = i;
          while (j < u.size() && !py_space(u[j])) ++j;
          out.push_back(Value::str(encode(u.substr(i, j - i))));
          ++splits;
          i = j;
        }
        return Value::list(std::move(out));
      }
      std::string sep = str_arg(sepv, what, line);
      if (sep.empty()) err(line, what + ": empty separator");
      size_t i = 0;
      int64_t splits = 0;
      while (true) {
        size_t j = (maxsplit >= 0 && splits >= maxsplit) ? std::string::npos : s.find(sep, i);
        if (j == std::string::npos) {
          out.push_back(Value::str(s.substr(i)));
          break;
        }
        out.push_back(Value::str(s.substr(i, j - i)));
        i = j + sep.size();
        ++splits;
      }
      return Value::list(std::move(out));
    }
    if (m == "replace") {
      max_args(a, 3, what, line);
      std::string from = str_arg(arg(a, 0, ""), what, line), to = str_arg(arg(a, 1, ""), what, line);
      const Value* cnt = arg(a, 2, "");
      int64_t count = cnt && cnt->k == Value::K::Int ? cnt->i : -1;
      if (from.empty()) unsupported(line, "str.replace() with an empty pattern");
      std::string out;
      size_t i = 0;
      int64_t done = 0;
      while (count < 0 || done < count) {
        size_t j = s.find(from, i);
        if (j == std::string::npos) break;
        out += s.substr(i, j - i) + to;
        i = j + from.size();
        ++done;
      }
      return Value::str(out + s.substr(i));
    }
    if (m == "lower" || m == "upper") {
      max_args(a, 0, what, line);
      std::u32string u = decode(s);
      for (auto& c : u) c = static_cast<char32_t>(m == "lower" ? u_tolower(static_cast<UChar32>(c)) : u_toupper(static_cast<UChar32>(c)));
      return Value::str(encode(u));
    }
    if (m == "find") {
      max_args(a, 1, what, line);
      std::string p = str_arg(arg(a, 0, ""), what, line);
      size_t j = s.find(p);
      return Value::integer(j == std::string::npos ? -1 : static_cast<int64_t>(decode(s.substr(0, j)).size()));
    }
    if (m == "count") {
      max_args(a, 1, what, line);
      std::string p = str_arg(arg(a, 0, ""), what, line);
      if (p.empty()) unsupported(line, "str.count('')");
      int64_t n = 0;
      for (size_t j = s.find(p); j != std::string::npos; j = s.find(p, j + p.size())) ++n;
      return Value::integer(n);
    }
    unsupported(line, "the string method " + what);
  }

  Value call(const Expr& e) {
    const Expr& callee = *e.a[0];
    int line = e.line;
    if (callee.t == Expr::T::Attr) {
      Value obj = eval(*callee.a[0]);
      if (obj.k == Value::K::Str) return str_method(obj.s, callee.name, eval_args(e, 1), line);
      if (obj.k == Value::K::Dict) {
        Args a = eval_args(e, 1);
        const std::string& m = callee.name;
        if (m == "items" || m == "keys" || m == "values") {
          max_args(a, 0, "dict." + m + "()", line);
          List l;
          for (auto& [k, v] : *obj.d) {
            if (m == "items") l.push_back(Value::list({Value::str(k), v}));
            else l.push_back(m == "keys" ? Value::str(k) : v);
          }
          return Value::list(std::move(l));
        }
        if (m == "get") {
          max_args(a, 2, "dict.get()", line);
          const Value* k = arg(a, 0, "");
          if (!k) err(line, "dict.get() takes a key");
          const Value* d = arg(a, 1, "");
          const Value* v = k->k == Value::K::Str ? obj.find(k->s) : nullptr;
          return v ? *v : d ? *d : Value::none();
        }
      }
      Value f = getattr(obj, callee.name, line);
      if (f.k == Value::K::Undef) {
        if (obj.k == Value::K::List) unsupported(line, "the list method ." + callee.name + "()");
        err(line, std::string("'") + type_name(obj) + "' has no callable attribute '" + callee.name + "'");
      }
      return call_value(f, eval_args(e, 1), line);
    }
    Value f = eval(callee);
    if (f.k == Value::K::Undef) err(line, "'" + f.s + "' is undefined (not a function the template may call)", kUnsupportedHint);
    return call_value(f, eval_args(e, 1), line);
  }

  Value call_value(const Value& f, const Args& a, int line) {
    if (f.k == Value::K::Macro) return call_macro(*f.macro, a, line);
    if (f.k != Value::K::Func) err(line, std::string("a ") + type_name(f) + " is not callable");
    if (f.s == "raise_exception") {
      const Value* m = arg(a, 0, "");
      DFLASH_REJECT_HINT(origin << ":" << line << ": the chat template raised an exception: " << (m ? to_str(*m) : ""),
                         "the conversation does not fit what this template accepts (its message above says why)");
    }
    if (f.s == "namespace" || f.s == "dict") {
      if (!a.pos.empty() && !(a.pos.size() == 1 && a.pos[0].k == Value::K::Dict)) err(line, f.s + "() takes keyword arguments");
      Dict d;
      if (!a.pos.empty()) d = *a.pos[0].d;
      for (auto& [k, v] : a.kw) {
        auto it = std::find_if(d.begin(), d.end(), [&](auto& p) { return p.first == k; });
        if (it != d.end()) it->second = v;
        else d.emplace_back(k, v);
      }
      return Value::dict(std::move(d), f.s == "namespace" ? Value::K::Ns : Value::K::Dict);
    }
    if (f.s == "range") {
      std::vector<int64_t> n;
      for (auto& v : a.pos) {
        if (v.k != Value::K::Int) err(line, "range() takes integers");
        n.push_back(v.i);
      }
      if (n.empty() || n.size() > 3 || !a.kw.empty()) err(line, "range() takes 1 to 3 integers");
      int64_t start = n.size() > 1 ? n[0] : 0, stop = n.size() > 1 ? n[1] : n[0], step = n.size() > 2 ? n[2] : 1;
      if (step == 0) err(line, "range() step cannot be zero");
      List l;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) l.push_back(Value::integer(i));
      return Value::list(std::move(l));
    }
    if (f.s == "strftime_now") {
      std::string fmt = str_arg(arg(a, 0, ""), "strftime_now()", line);
      std::time_t t = std::time(nullptr);
      std::tm tm{};
      localtime_r(&t, &tm);
      char buf[256];
      size_t n = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
      return Value::str(std::string(buf, n));
    }
    unsupported(line, "the function " + f.s + "()");
  }

  Value call_macro(const Node& m, const Args& a, int line) {
    if (a.pos.size() > m.targets.size()) err(line, "macro " + m.name + "() takes " + std::to_string(m.targets.size()) + " arguments");
    if (++depth > 64) err(line, "macro recursion deeper than 64");
    auto frame = std::make_shared<Frame>();
    std::vector<std::shared_ptr<Frame>> saved = frames;
    frames = {saved.front(), frame};
    for (size_t k = 0; k < m.targets.size(); ++k) {
      const Value* v = k < a.pos.size() ? &a.pos[k] : nullptr;
      for (auto& [kn, kv] : a.kw) if (kn == m.targets[k]) v = &kv;
      if (v) (*frame)[m.targets[k]] = *v;
      else if (m.defaults[k]) (*frame)[m.targets[k]] = eval(*m.defaults[k]);
      else (*frame)[m.targets[k]] = Value::undefined(m.targets[k]);
    }
    for (auto& [kn, _] : a.kw)
      if (std::find(m.targets.begin(), m.targets.end(), kn) == m.targets.end()) err(line, "macro " + m.name + "() has no parameter " + kn);
    std::string out;
    exec(m.body, out);
    frames = saved;
    --depth;
    return Value::str(out);
  }

  Value filter(const Expr& e) {
    Value v = eval(*e.a[0]);
    Args a = eval_args(e, 1);
    const std::string& f = e.name;
    int line = e.line;
    const std::string what = "the filter |" + f;
    if (f == "length" || f == "count") { max_args(a, 0, what, line); return Value::integer(length(v, line)); }
    if (f == "tojson") {  // transformers' own: json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
      max_args(a, 2, what, line, {"ensure_ascii", "indent", "sort_keys"});
      JsonOpts o;
      const Value* ea = arg(a, 99, "ensure_ascii");
      const Value* in = arg(a, 1, "indent");
      const Value* sk = arg(a, 99, "sort_keys");
      if (a.pos.size() > 0) o.ensure_ascii = truthy(a.pos[0]);
      if (ea) o.ensure_ascii = truthy(*ea);
      if (sk) o.sort_keys = truthy(*sk);
      if (in && in->k != Value::K::None) {
        if (in->k != Value::K::Int || in->i < 0) unsupported(line, "|tojson(indent=...) other than a non-negative integer");
        o.indent = static_cast<int>(in->i);
      }
      std::string out;
      dump_json(v, out, line, origin, o);
      return Value::str(out);
    }
    if (f == "trim") {
      max_args(a, 1, what, line, {"chars"});
      const Value* c = arg(a, 0, "chars");
      std::string chars = c ? str_arg(c, what, line) : "";
      return Value::str(py_strip(to_str(v), c ? &chars : nullptr, true, true));
    }
    if (f == "string" || f == "safe") { max_args(a, 0, what, line); return Value::str(to_str(v)); }
    if (f == "lower" || f == "upper") { max_args(a, 0, what, line); return str_method(to_str(v), f, {}, line); }
    if (f == "replace") { max_args(a, 3, what, line); return str_method(to_str(v), "replace", a, line); }
    if (f == "default" || f == "d") {
      max_args(a, 2, what, line, {"default_value", "boolean"});
      const Value* d = arg(a, 0, "default_value");
      const Value* b = arg(a, 1, "boolean");
      bool use = v.k == Value::K::Undef || (b && truthy(*b) && !truthy(v));
      return use ? (d ? *d : Value::str("")) : v;
    }
    if (f == "items") {
      max_args(a, 0, what, line);
      if (v.k == Value::K::Undef) return Value::list();
      if (v.k != Value::K::Dict) err(line, std::string("|items on a ") + type_name(v) + ", not a mapping");
      List l;
      for (auto& [k, x] : *v.d) l.push_back(Value::list({Value::str(k), x}));
      return Value::list(std::move(l));
    }
    if (f == "list") { max_args(a, 0, what, line); return Value::list(iterate(v, line)); }
    if (f == "join") {
      max_args(a, 1, what, line, {"d"});
      const Value* d = arg(a, 0, "d");
      std::string sep = d ? to_str(*d) : "", out;
      List l = iterate(v, line);
      for (size_t k = 0; k < l.size(); ++k) out += (k ? sep : "") + to_str(l[k]);
      return Value::str(out);
    }
    if (f == "first" || f == "last") {
      max_args(a, 0, what, line);
      List l = iterate(v, line);
      if (l.empty()) return Value::undefined(f);
      return f == "first" ? l.front() : l.back();
    }
    if (f == "int") {
      max_args(a, 0, what, line);
      if (v.k == Value::K::Int) return v;
      if (v.k == Value::K::Bool) return Value::integer(v.b);
      if (v.k == Value::K::Float) return Value::integer(static_cast<int64_t>(v.f));
      if (v.k == Value::K::Str) {
        try { return Value::integer(std::stoll(py_strip(v.s, nullptr, true, true))); } catch (...) { return Value::integer(0); }
      }
      return Value::integer(0);
    }
    unsupported(line, what);
  }

  bool test(const Expr& e) {
    Value v = eval(*e.a[0]);
    Args a = eval_args(e, 1);
    const std::string& t = e.name;
    int line = e.line;
    bool r;
    using K = Value::K;
    if (t == "defined") r = v.k != K::Undef;
    else if (t == "undefined") r = v.k == K::Undef;
    else if (t == "none") r = v.k == K::None;
    else if (t == "string") r = v.k == K::Str;
    else if (t == "mapping") r = v.k == K::Dict;
    else if (t == "iterable") r = v.k == K::Str || v.k == K::List || v.k == K::Dict || v.k == K::Undef;
    else if (t == "sequence") r = v.k == K::Str || v.k == K::List || v.k == K::Dict || v.k == K::Undef;
    else if (t == "number") r = v.k == K::Int || v.k == K::Float || v.k == K::Bool;
    else if (t == "integer") r = v.k == K::Int;
    else if (t == "float") r = v.k == K::Float;
    else if (t == "boolean") r = v.k == K::Bool;
    else if (t == "true") r = v.k == K::Bool && v.b;
    else if (t == "false") r = v.k == K::Bool && !v.b;
    else if (t == "callable") r = v.k == K::Macro || v.k == K::Func;
    else if (t == "odd" || t == "even") {
      if (v.k != K::Int) err(line, "'is " + t + "' on a non-integer");
      r = (v.i % 2 != 0) == (t == "odd");
    } else if (t == "divisibleby") {
      if (v.k != K::Int || a.pos.size() != 1 || a.pos[0].k != K::Int || a.pos[0].i == 0) err(line, "'is divisibleby' takes integers");
      r = v.i % a.pos[0].i == 0;
    } else if (t == "eq" || t == "equalto" || t == "==" || t == "ne" || t == "!=") {
      if (a.pos.size() != 1) err(line, "'is " + t + "' takes one argument");
      r = equal(v, a.pos[0]) == (t == "eq" || t == "equalto" || t == "==");
    } else {
      unsupported(line, "the test 'is " + t + "'");
    }
    return r != e.negate;
  }

  Value eval(const Expr& e) {
    using T = Expr::T;
    switch (e.t) {
      case T::Lit: return e.lit;
      case T::Name: return lookup(e.name);
      case T::Attr: return getattr(eval(*e.a[0]), e.name, e.line);
      case T::Item: {
        Value o = eval(*e.a[0]);
        return getitem(o, eval(*e.a[1]), e.line);
      }
      case T::Slice: {
        Value o = eval(*e.a[0]);
        Value p[3];
        for (int k = 0; k < 3; ++k) if (e.a[k + 1]) p[k] = eval(*e.a[k + 1]);
        return slice(o, e.a[1] ? &p[0] : nullptr, e.a[2] ? &p[1] : nullptr, e.a[3] ? &p[2] : nullptr, e.line);
      }
      case T::Call: return call(e);
      case T::Filter: return filter(e);
      case T::Test: return Value::boolean(test(e));
      case T::Not: return Value::boolean(!truthy(eval(*e.a[0])));
      case T::Neg: case T::Pos: {
        Value v = eval(*e.a[0]);
        if (!v.is_num()) err(e.line, std::string("unary ") + (e.t == T::Neg ? "-" : "+") + " on a " + type_name(v));
        if (e.t == T::Pos) return v.k == Value::K::Bool ? Value::integer(v.b) : v;
        return v.k == Value::K::Float ? Value::real(-v.f) : Value::integer(-(v.k == Value::K::Int ? v.i : v.b));
      }
      case T::And: {
        Value l = eval(*e.a[0]);
        return truthy(l) ? eval(*e.a[1]) : l;
      }
      case T::Or: {
        Value l = eval(*e.a[0]);
        return truthy(l) ? l : eval(*e.a[1]);
      }
      case T::Cond: {
        if (truthy(eval(*e.a[1]))) return eval(*e.a[0]);
        return e.a[2] ? eval(*e.a[2]) : Value::undefined("<inline if>");
      }
      case T::ListLit: {
        List l;
        for (auto& x : e.a) l.push_back(eval(*x));
        return Value::list(std::move(l));
      }
      case T::DictLit: {
        Dict d;
        for (size_t k = 0; k + 1 < e.a.size(); k += 2) {
          Value key = eval(*e.a[k]);
          if (key.k != Value::K::Str) unsupported(e.line, "a dict literal with a non-string key");
          d.emplace_back(key.s, eval(*e.a[k + 1]));
        }
        return Value::dict(std::move(d));
      }
      case T::Bin: {
        const std::string& op = e.name;
        Value l = eval(*e.a[0]), r = eval(*e.a[1]);
        if (op == "==") return Value::boolean(equal(l, r));
        if (op == "!=") return Value::boolean(!equal(l, r));
        if (op == "<") return Value::boolean(less(l, r, e.line));
        if (op == ">") return Value::boolean(less(r, l, e.line));
        if (op == "<=") return Value::boolean(!less(r, l, e.line));
        if (op == ">=") return Value::boolean(!less(l, r, e.line));
        if (op == "in") return Value::boolean(contains(r, l, e.line));
        if (op == "not in") return Value::boolean(!contains(r, l, e.line));
        return arith(op, l, r, e.line);
      }
    }
    return {};
  }

  Flow exec(const Body& body, std::string& out) {
    for (auto& np : body) {
      const Node& n = *np;
      switch (n.t) {
        case Node::T::Text: out += n.text; break;
        case Node::T::Out: out += to_str(eval(*n.expr)); break;
        case Node::T::If:
          for (auto& [cond, b] : n.branches) {
            if (!cond || truthy(eval(*cond))) {
              Flow f = exec(b, out);
              if (f != Flow::Normal) return f;
              break;
            }
          }
          break;
        case Node::T::For: {
          Value seq = eval(*n.expr);
          List items = iterate(seq, n.line);
          if (items.empty()) {
            Flow f = exec(n.else_body, out);
            if (f != Flow::Normal) return f;
            break;
          }
          int64_t len = static_cast<int64_t>(items.size());
          for (int64_t k = 0; k < len; ++k) {
            auto frame = std::make_shared<Frame>();
            Dict loop = {{"index0", Value::integer(k)},
                         {"index", Value::integer(k + 1)},
                         {"revindex0", Value::integer(len - k - 1)},
                         {"revindex", Value::integer(len - k)},
                         {"first", Value::boolean(k == 0)},
                         {"last", Value::boolean(k == len - 1)},
                         {"length", Value::integer(len)},
                         {"previtem", k > 0 ? items[static_cast<size_t>(k - 1)] : Value::undefined("loop.previtem")},
                         {"nextitem", k + 1 < len ? items[static_cast<size_t>(k + 1)] : Value::undefined("loop.nextitem")}};
            (*frame)["loop"] = Value::dict(std::move(loop), Value::K::Ns);
            const Value& it = items[static_cast<size_t>(k)];
            if (n.targets.size() == 1) {
              (*frame)[n.targets[0]] = it;
            } else {
              List parts = iterate(it, n.line);
              if (parts.size() != n.targets.size())
                err(n.line, "cannot unpack " + std::to_string(parts.size()) + " values into " + std::to_string(n.targets.size()) + " loop variables");
              for (size_t t = 0; t < parts.size(); ++t) (*frame)[n.targets[t]] = parts[t];
            }
            frames.push_back(frame);
            Flow f = exec(n.body, out);
            frames.pop_back();
            if (f == Flow::Break) break;
          }
          break;
        }
        case Node::T::Set: {
          Value v = eval(*n.expr);
          if (n.targets.size() == 1) {
            (*frames.back())[n.targets[0]] = v;
          } else {
            Value ns = lookup(n.targets[0]);
            if (ns.k != Value::K::Ns) err(n.line, "cannot assign the attribute " + n.targets[1] + " of '" + n.targets[0] + "', which is not a namespace()");
            auto it = std::find_if(ns.d->begin(), ns.d->end(), [&](auto& p) { return p.first == n.targets[1]; });
            if (it != ns.d->end()) it->second = v;
            else ns.d->emplace_back(n.targets[1], v);
          }
          break;
        }
        case Node::T::SetBlock: {
          std::string s;
          exec(n.body, s);
          (*frames.back())[n.targets[0]] = Value::str(s);
          break;
        }
        case Node::T::Macro: {
          Value m;
          m.k = Value::K::Macro;
          m.macro = &n;
          (*frames.back())[n.name] = m;
          break;
        }
        case Node::T::Break: return Flow::Break;
        case Node::T::Continue: return Flow::Continue;
        case Node::T::Gen: {
          Flow f = exec(n.body, out);
          if (f != Flow::Normal) return f;
          break;
        }
      }
    }
    return Flow::Normal;
  }
};

void dump_json(const Value& v, std::string& out, int line, const std::string& origin, const JsonOpts& o, int level) {
  auto newline = [&](int lvl) {
    if (o.indent >= 0) out += "\n" + std::string(static_cast<size_t>(o.indent * lvl), ' ');
  };
  const char* item_sep = o.indent >= 0 ? "," : ", ";
  auto str = [&](const std::string& s) {
    std::string j = json_string(s);
    if (!o.ensure_ascii) return j;
    std::string a;
    for (char32_t c : decode(j)) {
      if (c < 0x80) { a += static_cast<char>(c); continue; }
      auto u = [&](unsigned x) { char b[16]; std::snprintf(b, sizeof b, "\\u%04x", x); a += b; };
      if (c >= 0x10000) { u(0xd800 + ((c - 0x10000) >> 10)); u(0xdc00 + ((c - 0x10000) & 0x3ff)); }
      else u(static_cast<unsigned>(c));
    }
    return a;
  };
  switch (v.k) {
    case Value::K::None: out += "null"; return;
    case Value::K::Bool: out += v.b ? "true" : "false"; return;
    case Value::K::Int: out += std::to_string(v.i); return;
    case Value::K::Float:
      out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity") : py_float(v.f);
      return;
    case Value::K::Str: out += str(v.s); return;
    case Value::K::List:
      if (v.l->empty()) { out += "[]"; return; }
      out += '[';
      for (size_t k = 0; k < v.l->size(); ++k) {
        if (k) out += item_sep;
        newline(level + 1);
        dump_json((*v.l)[k], out, line, origin, o, level + 1);
      }
      newline(level);
      out += ']';
      return;
    case Value::K::Dict: {
      if (v.d->empty()) { out += "{}"; return; }
      std::vector<const std::pair<std::string, Value>*> items;
      for (auto& kv : *v.d) items.push_back(&kv);
      if (o.sort_keys) std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += item_sep;
        newline(level + 1);
        out += str(items[k]->first) + ": ";
        dump_json(items[k]->second, out, line, origin, o, level + 1);
      }
      newline(level);
      out += '}';
      return;
    }
    default:
      fail(origin, line, std::string("|tojson: a ") + Renderer::type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

struct Template::Impl {
  std::string origin;
  Body body;
};

Template::Template(const std::string& source, const std::string& origin) : impl_(std::make_unique<Impl>()) {
  impl_->origin = origin;
  Parser p(lex(source, origin), origin);
  impl_->body = p.parse_template();
}
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;
Template::~Template() = default;

std::string Template::render(const nlohmann::ordered_json& vars) const {
  DFLASH_REQUIRE(vars.is_object(), impl_->origin << ": the template variables must be a JSON object");
  Renderer r{impl_->origin, {}};
  auto globals = std::make_shared<Frame>();
  for (const char* f : {"raise_exception", "namespace", "range", "dict", "strftime_now"}) (*globals)[f] = Value::func(f);
  for (auto it = vars.begin(); it != vars.end(); ++it) (*globals)[it.key()] = from_json(it.value());
  r.frames.push_back(globals);
  std::string out;
  r.exec(impl_->body, out);
  return out;
}

std::string to_python_json(const nlohmann::ordered_json& v) {
  std::string out;
  dump_json(from_json(v), out, 0, "<json>");
  return out;
}

}  // namespace dflash::text::jinja
