// dflash_eval's text pieces (bench/eval_text.h) on the 4k cut of Qwen3's tokenizer: chat rows
// (OpenAI, ShareGPT, trailing assistant turns dropped), the per-token pieces (their concatenation
// is the decoded text, also across a character split over tokens), and the accepted-draft marking
// of --show and --html on hand-made outputs whose steps are known.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "bench/eval_text.h"
#include "core/error.h"

using namespace dflash;
using namespace dflash::bench;
using ojson = nlohmann::ordered_json;

namespace {

const std::string kTok = std::string(DFLASH_TEST_DATA_DIR) + "/tokenizers/qwen3_4k";

const EvalText& tok() {
  static const EvalText t(kTok);
  return t;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "";
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x;
  return s;
}

}  // namespace

TEST(EvalText, ChatRows) {
  const ojson openai = ojson::parse(R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                                                     {"role": "user", "content": "again"}, {"role": "assistant", "content": "b"}]})");
  const ojson m = chat_messages(openai, "r:1");
  ASSERT_EQ(m.size(), 3u);  // the last assistant turn dropped, the earlier one kept
  EXPECT_EQ(m.back()["content"], "again");
  const ojson sharegpt = ojson::parse(R"({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                                            {"from": "gpt", "value": "x"}]})");
  EXPECT_EQ(chat_messages(sharegpt, "r:2"), ojson::parse(R"([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}])"));
  EXPECT_TRUE(chat_messages(ojson::parse(R"({"text": "t"})"), "r:3").is_null());
  EXPECT_NE(error_of([] { chat_messages(ojson::parse(R"({"messages": []})"), "r:4"); }).find("r:4: \"messages\" is not a non-empty list"),
            std::string::npos);
  EXPECT_NE(error_of([] { chat_messages(ojson::parse(R"({"messages": [{"content": "x"}]})"), "r:5"); }).find("r:5: messages[0] has no string \"role\""),
            std::string::npos);
  // Rendered with the fixture's template and its generation prompt.
  const std::vector<int32_t> ids = tok().encode_chat(chat_messages(openai, "r:1"), "r:1");
  const std::string s = tok().decode(ids);
  EXPECT_NE(s.find("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"), std::string::npos) << s;
  EXPECT_EQ(s.find("b<|im_end|>"), std::string::npos) << s;
}

TEST(EvalText, PiecesJoinToTheText) {
  for (const std::string s : {std::string("Hello, world! <|im_end|>\n"), std::string("caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80 x")}) {
    const std::vector<int32_t> ids = tok().encode(s, "t");
    const std::vector<std::string> p = tok().pieces(ids);
    ASSERT_EQ(p.size(), ids.size());
    EXPECT_EQ(join(p), s);
    EXPECT_EQ(tok().decode(ids), s);
  }
  // The 4k vocabulary splits CJK and emoji into byte tokens: some pieces are "" (their character
  // is completed by a later token), and none holds a replacement character.
  const std::vector<int32_t> ids = tok().encode("\xE6\x97\xA5\xF0\x9F\x98\x80", "t");
  ASSERT_GT(ids.size(), 2u);
  const std::vector<std::string> p = tok().pieces(ids);
  for (const std::string& x : p) EXPECT_EQ(x.find("\xEF\xBF\xBD"), std::string::npos);
}

TEST(EvalText, DraftStepsOfTokens) {
  // Token 0 from the prefill; step 0 accepts 2 drafts + bonus, step 1 none + bonus, step 2 3 drafts
  // (cut after 2 by the end of the generation).
  EXPECT_EQ(draft_step_of_tokens(9, {3, 1, 4}), (std::vector<int64_t>{-1, 0, 0, -1, -1, 2, 2, 2, -1}));
  EXPECT_EQ(draft_step_of_tokens(7, {3, 1, 4}), (std::vector<int64_t>{-1, 0, 0, -1, -1, 2, 2}));
  EXPECT_EQ(draft_step_of_tokens(1, {}), (std::vector<int64_t>{-1}));
}

TEST(EvalText, ShowAndHtmlMarkTheAcceptedDrafts) {
  // One token per word: " a" .. " i" are single tokens of the vocabulary.
  std::vector<int32_t> toks;
  std::string words;
  for (const char* w : {" a", " b", " c", " d", " e", " f", " g", " h", " <"}) {
    const std::vector<int32_t> one = tok().encode(w, "w");
    ASSERT_EQ(one.size(), 1u) << w;
    toks.push_back(one[0]);
  }
  ShownOutput o{3, "chat", tok().encode("<|im_start|>user\nq<|im_end|>\n", "p"), toks, {3, 1, 5}};
  const std::string plain = show_text(tok(), o, false);
  EXPECT_NE(plain.find("--- prompt 3 (chat, "), std::string::npos) << plain;
  EXPECT_NE(plain.find("<|im_start|>user\nq<|im_end|>\n"), std::string::npos) << plain;
  EXPECT_NE(plain.find("--- output (9 tokens, 3 steps, tau 3.000):\n a[ b c] d e[ f g h <]\n"), std::string::npos) << plain;
  const std::string colour = show_text(tok(), o, true);
  EXPECT_NE(colour.find(" a\x1b[42;30m b c\x1b[0m d e\x1b[42;30m f g h <\x1b[0m"), std::string::npos) << colour;

  const std::string h = html_report(tok(), {o}, "t <1>");
  EXPECT_NE(h.find("<title>t &lt;1&gt;</title>"), std::string::npos);
  EXPECT_NE(h.find("<pre> a<span class=\"step\" title=\"step 0: 2 accepted draft(s) + bonus\"><span class=\"d0\"> b c</span> d</span>"
                   "<span class=\"step\" title=\"step 1: 0 accepted draft(s) + bonus\"> e</span>"
                   "<span class=\"step\" title=\"step 2: 4 accepted draft(s) + bonus\"><span class=\"d0\"> f g h &lt;</span></span></pre>"),
            std::string::npos)
      << h;
  EXPECT_NE(h.find("&lt;|im_start|&gt;user\nq&lt;|im_end|&gt;"), std::string::npos);
}
