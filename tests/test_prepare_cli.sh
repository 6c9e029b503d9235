#!/usr/bin/env bash
# dflash_data prepare + dump --text from the command line on the real Qwen3 tokenizer: the three
# row forms, the options (--think, --last-turn-only, --prompts, --enable-thinking, --max-length,
# --chat-template, --threads), the summary, dump --text's marks, and bad rows (the error names
# IN:line and the field; --skip-bad counts them; no output or .tmp is left behind).
#   test_prepare_cli.sh DFLASH_DATA TOKENIZER_DIR CHAT_TEMPLATES_DIR WORK_DIR
set -euo pipefail
data="$1" tok="$2" tpl="$3" work="$4"
rm -rf "$work" && mkdir -p "$work" && cd "$work"

cat > in.jsonl <<'ROWS'
{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there", "reasoning_content": "greet back"}]}
{"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "four"}, {"from": "human", "value": "and 3+3?"}, {"from": "gpt", "value": "six"}]}
{"text": "plain words"}

{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A prompt only"}]}
ROWS
"$data" prepare in.jsonl --tokenizer "$tok" --out a.h5 --threads 2 --no-progress > sum.txt
grep -q '^rows:        4$' sum.txt
grep -q '^written:     4 sequences$' sum.txt
grep -q '^prompt-only: 1 ' sum.txt
grep -q '^bad rows:    0' sum.txt
"$data" validate a.h5 | grep -q '4 sequences'
"$data" dump a.h5 --text --tokenizer "$tok" > text.txt
# The supervised spans are exactly the assistant turns: header outside, think block and <|im_end|>\n inside.
python3 - <<'PY'
t = open('text.txt', encoding='utf-8').read()
want = [
    '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n\u00ab<think>\ngreet back\n</think>\n\nHello there<|im_end|>\n\u00bb',
    '<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n\u00abfour<|im_end|>\n\u00bb<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n\u00ab<think>\n\n</think>\n\nsix<|im_end|>\n\u00bb',
    '\u00abplain words\u00bb',
    '<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nA prompt only<|im_end|>\n<|im_start|>assistant\n',
]
for w in want:
    assert w in t, f'missing from dump --text:\n{w!r}\n--- got:\n{t}'
assert t.count('=== sequence') == 4, t
print('dump --text marks the assistant turns')
PY
"$data" dump a.h5 --text --tokenizer "$tok" --marks color --first 2 --count 1 | grep -q $'\033\\[32mplain words\033\\[0m'

# --think out: the think block leaves the loss; --last-turn-only: only the last turn; --enable-thinking false.
"$data" prepare in.jsonl --tokenizer "$tok" --out b.h5 --think out --last-turn-only --enable-thinking false --no-progress > /dev/null
"$data" dump b.h5 --text --tokenizer "$tok" --count 2 > b.txt
python3 - <<'PY'
t = open('b.txt', encoding='utf-8').read()
for w in ['assistant\n<think>\ngreet back\n</think>\n\n\u00abHello there<|im_end|>\n\u00bb',  # think out
          'assistant\nfour<|im_end|>\n<|im_start|>user',                                         # not the last turn
          'assistant\n<think>\n\n</think>\n\n\u00absix<|im_end|>\n\u00bb']:
    assert w in t, f'missing from dump --text:\n{w!r}\n--- got:\n{t}'
PY

# --max-length truncates and counts; --chat-template takes another template (TRL's Qwen3.5 training one).
"$data" prepare in.jsonl --tokenizer "$tok" --out c.h5 --max-length 8 --chat-template "$tpl/qwen3_5_think_training.jinja" --no-progress > c.txt
grep -q '^truncated:   3$' c.txt
"$data" stats c.h5 | grep -q 'min 2, mean .*, max 8'

# --prompts: every row a prompt (all-zero mask): trailing assistant turns dropped and the generation
# prompt after the last user turn; text rows as they are.
"$data" prepare in.jsonl --tokenizer "$tok" --out p.h5 --prompts --enable-thinking false --no-progress > p.txt
grep -q '^prompt-only: 4 ' p.txt
"$data" dump p.h5 --text --tokenizer "$tok" > p_text.txt
python3 - <<'PY'
t = open('p_text.txt', encoding='utf-8').read()
assert '\u00ab' not in t, f'a prompt set has no supervised token:\n{t}'
for w in ['<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n',
          'and 3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n',
          'plain words']:
    assert w in t, f'missing from dump --text:\n{w!r}\n--- got:\n{t}'
assert 'Hello there' not in t and 'six' not in t, t
PY
printf '{"messages": [{"role": "assistant", "content": "only me"}]}\n' > asst.jsonl
expect_fail() {  # expect_fail REGEX command...: the command fails and its stderr matches REGEX
  local regex="$1"; shift
  if "$@" 2> err.txt > /dev/null; then echo "FAIL: '$*' succeeded"; exit 1; fi
  grep -Eq -e "$regex" err.txt || { echo "FAIL: '$*' said:"; cat err.txt; echo "expected: $regex"; exit 1; }
}
cp in.jsonl bad.jsonl
printf '{"messages": [{"role": "wizard", "content": "x"}]}\n{"text": "bad \xC3( byte"}\n{"conversations": 7}\n' >> bad.jsonl
expect_fail 'bad.jsonl:6: messages\[0\].role = "wizard" is not a known role' "$data" prepare bad.jsonl --tokenizer "$tok" --out bad.h5
grep -q -- '--skip-bad' err.txt
test ! -e bad.h5 && test ! -e bad.h5.tmp
"$data" prepare bad.jsonl --tokenizer "$tok" --out bad.h5 --skip-bad > skip.txt
grep -q '^bad rows:    3 skipped$' skip.txt
grep -q 'first bad row: bad.jsonl:6: ' skip.txt
grep -q '^written:     4 sequences$' skip.txt
printf '{"text": "bad \xC3( byte"}\n' > utf8.jsonl
expect_fail 'utf8.jsonl:1: invalid UTF-8 at byte 14 of the line \(0xC3\)' "$data" prepare utf8.jsonl --tokenizer "$tok" --out u.h5
expect_fail '--think: maybe not in \{in,out\}' "$data" prepare in.jsonl --tokenizer "$tok" --out x.h5 --think maybe
expect_fail 'asst.jsonl:1: with --prompts the conversation has no turn before its assistant turns' \
  "$data" prepare asst.jsonl --tokenizer "$tok" --out asst.h5 --prompts
expect_fail 'dump --text needs --tokenizer' "$data" dump a.h5 --text
expect_fail 'dump: --tokenizer and --marks go with --text' "$data" dump a.h5 --tokenizer "$tok"
echo OK
