#!/usr/bin/env bash
# dflash_data tokenize / detokenize from the command line: the Qwen3 goldens through the exact
# interface outside checks call ({"text"} -> {"ids"} -> {"text"}, line for line), standard input,
# and bad rows (the error names IN:line; no --out file is left behind).
#   test_tokenizer_cli.sh DFLASH_DATA TOKENIZER_DIR WORK_DIR
set -euo pipefail
data="$1" tok="$2" work="$3"
rm -rf "$work" && mkdir -p "$work" && cd "$work"

python3 - "$tok/qwen3.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1], encoding='utf-8')]
with open('in.jsonl', 'w', encoding='utf-8') as f:
    for r in rows: f.write(json.dumps({'text': r['text']}, ensure_ascii=False) + '\n')
with open('want_ids.jsonl', 'w') as f:
    for r in rows: f.write(json.dumps(r['ids']) + '\n')
PY
"$data" tokenize --tokenizer "$tok" in.jsonl --out ids.jsonl --threads 2
"$data" detokenize --tokenizer "$tok/tokenizer.json" ids.jsonl --out back.jsonl
"$data" tokenize --tokenizer "$tok" --threads 1 < in.jsonl > ids_stdin.jsonl
cmp ids.jsonl ids_stdin.jsonl
python3 - <<'PY'
import json, unicodedata
got = [json.loads(l)['ids'] for l in open('ids.jsonl')]
want = [json.loads(l) for l in open('want_ids.jsonl')]
texts = [json.loads(l)['text'] for l in open('in.jsonl', encoding='utf-8')]
back = [json.loads(l)['text'] for l in open('back.jsonl', encoding='utf-8')]
assert len(got) == len(want) == len(back), (len(got), len(want), len(back))
bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
assert not bad, f'ids differ from HF on rows {bad[:10]}'
bad = [i for i, (b, t) in enumerate(zip(back, texts)) if b != unicodedata.normalize('NFC', t)]
assert not bad, f'detokenize is not the NFC text on rows {bad[:10]}'
print(f'{len(got)} rows: ids equal HF, detokenize gives the text back')
PY

expect_fail() {  # expect_fail REGEX command...: the command fails and its stderr matches REGEX
  local regex="$1"; shift
  if "$@" 2> err.txt; then echo "FAIL: '$*' succeeded"; exit 1; fi
  grep -Eq "$regex" err.txt || { echo "FAIL: '$*' said:"; cat err.txt; echo "expected: $regex"; exit 1; }
}
printf '{"text": "fine"}\n{"text": "also fine"}\n{"txt": "no text"}\n' > no_text.jsonl
expect_fail 'no_text.jsonl:3: the line has no string "text"' "$data" tokenize --tokenizer "$tok" no_text.jsonl --out o1.jsonl
test ! -e o1.jsonl && test ! -e o1.jsonl.tmp
printf '{"text": "ok"}\n{"text": "bad \xC3( byte"}\n' > bad_utf8.jsonl
expect_fail 'bad_utf8.jsonl:2: the line: invalid UTF-8 at byte 14 \(0xC3\)' "$data" tokenize --tokenizer "$tok" bad_utf8.jsonl
printf '{"text": "ok"}\n\n' > blank.jsonl
expect_fail 'blank.jsonl:2: the line is blank' "$data" tokenize --tokenizer "$tok" blank.jsonl
printf '{"ids": [1, 2]}\n{"ids": [3, 999999]}\n' > bad_ids.jsonl
expect_fail 'bad_ids.jsonl:2: ids\[1\] = 999999 is not a token id' "$data" detokenize --tokenizer "$tok" bad_ids.jsonl --out o2.jsonl
test ! -e o2.jsonl
printf '{"ids": [1, -2]}\n' > neg_ids.jsonl
expect_fail 'neg_ids.jsonl:1: ids\[1\] = -2 is not a token id' "$data" detokenize --tokenizer "$tok" neg_ids.jsonl
expect_fail "tokenizer file '.*no_such' does not exist" "$data" tokenize --tokenizer "$work/no_such" in.jsonl
echo OK
