#!/usr/bin/env bash
# dflash_eval on text (the tiny random target, vocab 4096, with the 4k cut of Qwen3's tokenizer in
# tests/data/tokenizers/qwen3_4k: ChatML specials at 4086..4095, the Qwen3.5 chat template, a
# generation_config.json with eos [4088, 4086]):
#   text   chat (OpenAI and ShareGPT), raw text and id rows; the default stop ids read from the
#          fixture; --show prints the decoded text; --json holds prompt_text / output_text; --html
#          is well-formed (balanced tags, only the page's own tags, < and & escaped in the text)
#   stop   a stop token given by text stops where the same token given by id does (a vocab entry
#          the greedy output reaches, and an added token)
#   bad    unknown stop text, text without a tokenizer, chat rows without a tokenizer, bad chat rows
#   regen  dflash_data regenerate (DFLASH_EVAL is dflash_data): the default stop ids from --tokenizer,
#          none for a random target without one, stop tokens by text == by id
# Usage: eval_text_test.sh MODE DFLASH_EVAL|DFLASH_DATA TINY_CONFIG TOKENIZER_DIR WORKDIR
set -euo pipefail
mode="$1" eval="$2" cfg="$3" tok="$4" work="$5"
rm -rf "$work" && mkdir -p "$work" && cd "$work"
fail() { echo "FAIL: $*"; exit 1; }
common=(--config "$cfg" --random-weights --random-drafter 1 --block-size 4 --no-estimate)

cat > chat.jsonl <<'EOF'
{"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say <hello> & goodbye."}, {"role": "assistant", "content": "DROPPED_ANSWER"}]}
{"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "DROPPED_ANSWER"}]}
{"prompt": "The quick brown fox"}
{"text": "Once upon a time"}
{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}
EOF

echo "1 2 3 4 5" > ids.txt

case "$mode" in
text)
  "$eval" "${common[@]}" --tokenizer "$tok" --prompts chat.jsonl --max-new-tokens 8 --show 2 --html out.html --json out.json \
    > out.txt 2>&1 || { cat out.txt; fail "text run"; }
  grep -q "^stop tokens: <|im_end|> (4088), <|endoftext|> (4086) from generation_config.json$" out.txt || { cat out.txt; fail "default stop tokens"; }
  grep -q "Say <hello> & goodbye.<|im_end|>" out.txt || { cat out.txt; fail "--show: the decoded prompt"; }
  grep -q "What is 2+2?" out.txt || { cat out.txt; fail "--show: the second prompt"; }
  [ "$(grep -c '^--- output (8 tokens' out.txt)" = 2 ] || { cat out.txt; fail "--show: two outputs"; }
  grep -q "outputs: all 5 prompt(s) equal target-only greedy decoding" out.txt || { cat out.txt; fail "outputs"; }
  python3 - "$tok" <<'PY'
import json, re, sys
from html.parser import HTMLParser
j = json.load(open('out.json'))
assert j['stop_tokens'] == [4088, 4086], j['stop_tokens']
ps = j['prompts']
assert [p['kind'] for p in ps] == ['chat', 'chat', 'text', 'text', 'ids'], [p['kind'] for p in ps]
want0 = ('<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay <hello> & goodbye.<|im_end|>\n'
         '<|im_start|>assistant\n')
assert ps[0]['prompt_text'].startswith(want0), repr(ps[0]['prompt_text'])
assert ps[1]['prompt_text'].startswith('<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n'), repr(ps[1]['prompt_text'])
assert all('DROPPED_ANSWER' not in p['prompt_text'] for p in ps), 'a trailing assistant turn was kept'
assert ps[2]['prompt_text'] == 'The quick brown fox' and ps[3]['prompt_text'] == 'Once upon a time'
# Ids -> text through the fixture's vocabulary (byte-level: decode the GPT-2 byte images).
tj = json.load(open(sys.argv[1] + '/tokenizer.json'))
inv = {v: k for k, v in tj['model']['vocab'].items()}
for t in tj['added_tokens']: inv[t['id']] = t['content']
bs = list(range(ord('!'), ord('~') + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
cs = bs[:] + [256 + n for n in range(256) if n not in bs]
bs += [b for b in range(256) if b not in bs]
byte_of = {chr(c): b for b, c in zip(bs, cs)}
def decode(ids):
    out = b''
    for i in ids:
        s = inv[i]
        out += bytes(byte_of[ch] for ch in s) if all(ch in byte_of for ch in s) else s.encode()
    return out.decode('utf-8', errors='replace')
for p in ps:
    assert p['output_text'] == decode(p['output_ids']), (p['output_text'], decode(p['output_ids']))
    assert len(p['output_ids']) == p['generated'] == 8
html = open('out.html', encoding='utf-8').read()
allowed = {'html', 'head', 'meta', 'title', 'style', 'body', 'h1', 'h2', 'p', 'span', 'details', 'summary', 'pre'}
void = {'meta'}
class P(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=False); self.stack = []; self.steps = 0
    def handle_starttag(self, tag, attrs):
        assert tag in allowed, f'unexpected tag <{tag}> (unescaped text?)'
        if tag == 'span' and ('class', 'step') in attrs: self.steps += 1
        if tag not in void: self.stack.append(tag)
    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f'</{tag}> closes {self.stack[-1:]}'
        self.stack.pop()
p = P(); p.feed(html); p.close()
assert not p.stack, f'unclosed tags {p.stack}'
assert p.steps == sum(len(q['accept']) for q in ps), (p.steps, [len(q['accept']) for q in ps])
assert 'Say &lt;hello&gt; &amp; goodbye.' in html
assert not re.search(r'&(?!(amp|lt|gt|quot|#39);)', html), 'a bare & in the page'
assert '&lt;|im_start|&gt;' in html
print('json and html ok')
PY
  ;;
stop)
  # The greedy output of prompt 2 without stop tokens; then stop at its 4th token, by id and by its vocab spelling.
  "$eval" "${common[@]}" --tokenizer "$tok" --prompts chat.jsonl --num-prompts 3 --max-new-tokens 10 --no-default-stop-tokens \
    --json free.json > free.txt 2>&1 || { cat free.txt; fail "free run"; }
  grep -q "^stop tokens: none (--no-default-stop-tokens)$" free.txt || { cat free.txt; fail "--no-default-stop-tokens"; }
  read -r id text < <(python3 - "$tok" <<'PY'
import json, sys
ids = json.load(open('free.json'))['prompts'][2]['output_ids']
assert len(ids) == 10, ids
inv = {v: k for k, v in json.load(open(sys.argv[1] + '/tokenizer.json'))['model']['vocab'].items()}
print(ids[3], inv[ids[3]])
PY
)
  "$eval" "${common[@]}" --tokenizer "$tok" --prompts chat.jsonl --num-prompts 3 --max-new-tokens 10 --stop-token "$id" \
    --json by_id.json > by_id.txt 2>&1 || { cat by_id.txt; fail "stop by id"; }
  "$eval" "${common[@]}" --tokenizer "$tok" --prompts chat.jsonl --num-prompts 3 --max-new-tokens 10 --stop-token "$text" \
    --json by_text.json > by_text.txt 2>&1 || { cat by_text.txt; fail "stop by text '$text'"; }
  grep -q "^stop tokens: .* ($id) from --stop-token$" by_text.txt || { cat by_text.txt; fail "stop log"; }
  "$eval" "${common[@]}" --tokenizer "$tok" --prompts chat.jsonl --num-prompts 1 --max-new-tokens 4 --stop-token '<|im_end|>' \
    --json im_text.json > im_text.txt 2>&1 || { cat im_text.txt; fail "stop by <|im_end|>"; }
  "$eval" "${common[@]}" --tokenizer "$tok" --prompts chat.jsonl --num-prompts 1 --max-new-tokens 4 --stop-token 4088 \
    --json im_id.json > im_id.txt 2>&1 || { cat im_id.txt; fail "stop by 4088"; }
  python3 - "$id" <<'PY'
import json, sys
stop = int(sys.argv[1])
out = lambda f: [p['output_ids'] for p in json.load(open(f))['prompts']]
free, by_id, by_text = out('free.json'), out('by_id.json'), out('by_text.json')
assert by_id == by_text, (by_id, by_text)
assert json.load(open('by_text.json'))['stop_tokens'] == [stop]
for f, b in zip(free, by_id):  # each output is the free one cut after the first stop token
    want = f[:f.index(stop) + 1] if stop in f else f
    assert b == want, (b, want)
assert len(by_id[2]) <= 4
assert out('im_text.json') == out('im_id.json')
assert json.load(open('im_text.json'))['stop_tokens'] == [4088]
print('stop by text == stop by id')
PY
  ;;
bad)
  expect() {  # expect REGEX command...: the command fails and its output matches REGEX
    local regex="$1"; shift
    if "$@" > err.txt 2>&1; then cat err.txt; fail "'$*' succeeded"; fi
    grep -Eq -- "$regex" err.txt || { cat err.txt; fail "'$*': expected $regex"; }
  }
  expect "--stop-token '<\|nope\|>' is not one token: the tokenizer encodes it to [0-9]+ \(\[" \
    "$eval" "${common[@]}" --tokenizer "$tok" --prompts chat.jsonl --stop-token '<|nope|>'
  expect "--stop-token '<\|im_end\|>' is text, and there is no tokenizer" \
    "$eval" "${common[@]}" --prompts ids.txt --stop-token '<|im_end|>'
  expect "chat.jsonl:1: a chat row needs a tokenizer, and there is none" "$eval" "${common[@]}" --prompts chat.jsonl
  expect "--show: decoded text needs a tokenizer" "$eval" "${common[@]}" --prompts chat.jsonl --show 1
  expect "error: --tokenizer no_such_dir: tokenizer file 'no_such_dir' does not exist" "$eval" "${common[@]}" --tokenizer no_such_dir --prompts chat.jsonl
  echo '{"conversations": [{"from": "robot", "value": "hi"}]}' > bad_from.jsonl
  expect "bad_from.jsonl:1: conversations\[0\].from = \"robot\" is not a known speaker" "$eval" "${common[@]}" --tokenizer "$tok" --prompts bad_from.jsonl
  # OpenAI tool calls: a malformed arguments string is named (as dflash_data prepare names it)
  echo '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}, {"role": "tool", "content": "r"}]}' > bad_args.jsonl
  expect "bad_args.jsonl:1: messages\[1\].tool_calls\[0\].function.arguments is a string but not valid JSON" \
    "$eval" "${common[@]}" --tokenizer "$tok" --prompts bad_args.jsonl
  echo '{"messages": [{"role": "assistant", "content": "only me"}]}' > only_assistant.jsonl
  expect "only_assistant.jsonl:1: the conversation holds only assistant turns" \
    "$eval" "${common[@]}" --tokenizer "$tok" --prompts only_assistant.jsonl
  echo '{"prompt": 5}' > bad_prompt.jsonl
  expect "bad_prompt.jsonl:1: \"prompt\" is not a string" "$eval" "${common[@]}" --tokenizer "$tok" --prompts bad_prompt.jsonl
  ;;
regen)  # DFLASH_EVAL is dflash_data here: regenerate's default stop ids from --tokenizer, and text == id
  data="$eval"
  "$data" synth --out p.h5 --sequences 4 --min-len 6 --max-len 12 --vocab-size 4000 > /dev/null
  rg=(--config "$cfg" --random-weights --max-new-tokens 6 --no-progress)
  "$data" regenerate p.h5 --out def.h5 "${rg[@]}" --tokenizer "$tok" > def.txt 2>&1 || { cat def.txt; fail "regenerate with defaults"; }
  grep -q "^regenerate: stop tokens: <|im_end|> (4088), <|endoftext|> (4086) from generation_config.json$" def.txt || { cat def.txt; fail "default log"; }
  "$data" regenerate p.h5 --out none.h5 "${rg[@]}" > none.txt 2>&1 || { cat none.txt; fail "regenerate, random target"; }
  grep -q "^regenerate: stop tokens: none (no --stop-token given" none.txt || { cat none.txt; fail "no defaults without a directory"; }
  "$data" regenerate p.h5 --out by_text.h5 "${rg[@]}" --tokenizer "$tok" --stop-token '<|im_end|>' --stop-token '<|endoftext|>' > t.txt 2>&1 || { cat t.txt; fail "text"; }
  "$data" regenerate p.h5 --out by_id.h5 "${rg[@]}" --stop-token 4088 --stop-token 4086 > i.txt 2>&1 || { cat i.txt; fail "ids"; }
  python3 - <<'PY'
import json
m = lambda f: json.load(open(f))['decoding']
assert m('def.h5.json')['stop_tokens'] == [4088, 4086], m('def.h5.json')
assert m('by_text.h5.json') == m('by_id.h5.json') == m('def.h5.json'), (m('by_text.h5.json'), m('by_id.h5.json'))
assert m('none.h5.json')['stop_tokens'] == []
PY
  "$data" dump by_text.h5 > by_text.jsonl && "$data" dump by_id.h5 > by_id.jsonl && cmp by_text.jsonl by_id.jsonl || fail "outputs differ"
  # Chunked prefill inside the decode steps: the same file (the CPU reference computes each row on its own).
  "$data" regenerate p.h5 --out chunked.h5 "${rg[@]}" --stop-token 4088 --stop-token 4086 --step-tokens 3 > c.txt 2>&1 || { cat c.txt; fail "chunked"; }
  "$data" dump chunked.h5 > chunked.jsonl && cmp chunked.jsonl by_id.jsonl || fail "chunked prefill changed the output"
  if "$data" regenerate p.h5 --out x.h5 "${rg[@]}" --stop-token '<|im_end|>' > err.txt 2>&1; then fail "text without a tokenizer"; fi
  grep -q "stop-token '<|im_end|>' is text, and there is no tokenizer" err.txt || { cat err.txt; fail "text without a tokenizer: message"; }
  ;;
*) fail "unknown mode $mode" ;;
esac
echo "eval_text_test.sh $mode: passed"
echo OK
