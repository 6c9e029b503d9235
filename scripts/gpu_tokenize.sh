#!/usr/bin/env bash
# The tokenizer's speed beside Hugging Face tokenizers (Python), on the GPU machine (Ubuntu 24.04,
# `tokenizers` 0.23 installed there) or any machine: the same documents (the Python standard
# library's top-level sources, one document per file), the same tokenizer (Qwen3's, the fixture in
# tests/data/tokenizers), one thread and 16.
#   dflash: tokenize_bench --threads 1,16 (encode per document; 16 threads share the documents)
#   HF:     Tokenizer.encode per document on one thread, encode_batch on all documents with
#           RAYON_NUM_THREADS=16, add_special_tokens=False; untimed warm-up pass first, as ours.
# Also checks that both give the same ids on every document, and runs the tokenizer tests.
# Writes $OUT (default ./tokenize-out): tokenize.csv (uniform rows: bench tokenize, metrics
# mb_per_s / tok_per_s, providers dflash / hf_tokenizers), summary.txt, build.log, tests.log.
#
# text/ needs Oniguruma and ICU headers (libonig-dev, libicu-dev). Where they cannot be installed
# (the GPU machine has no package registry), fetch them on a Debian machine first:
#   bash scripts/gpu_tokenize.sh fetch-deps      # -> .deps/text (Debian 12 packages, unpacked, ~20 MB)
# and send .deps/text with the tree (~33 MB); this script finds it there (DFLASH_TEXT_DEPS_FORCE=1
# uses it even where the system has the packages, to test it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEPS="${DFLASH_TEXT_DEPS:-$ROOT/.deps/text}"

if [ "${1:-}" = "fetch-deps" ]; then
  tmp="$(mktemp -d)"
  (cd "$tmp" && apt-get download libonig5 libonig-dev libicu72 libicu-dev)
  rm -rf "$DEPS" && mkdir -p "$DEPS"
  for d in "$tmp"/*.deb; do dpkg-deb -x "$d" "$DEPS"; done
  # Keep what the build and the run need: headers, pkg-config file, libonig, libicuuc, libicudata.
  find "$DEPS" -name '*.a' -delete
  find "$DEPS/usr/lib" -name 'libicu*' ! -name 'libicuuc*' ! -name 'libicudata*' -delete
  rm -rf "$DEPS/usr/share" "$DEPS/usr/bin" "$DEPS/usr/sbin" "$tmp"
  du -sh "$DEPS"
  exit 0
fi

OUT="${OUT:-$PWD/tokenize-out}"
mkdir -p "$OUT"
BUILD="${DFLASH_BUILD:-/tmp/dflash-tokenize-build}"
JOBS="${DFLASH_JOBS:-$(nproc)}"
THREADS="${TOKENIZE_THREADS:-16}"
SECONDS_PER_ROW="${TOKENIZE_SECONDS:-5}"

read -r -a cmake_extra <<< "${DFLASH_CMAKE_ARGS:-}"  # e.g. -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
if [ -n "${DFLASH_TEXT_DEPS_FORCE:-}" ] || ! pkg-config --exists oniguruma 2>/dev/null || [ ! -e /usr/include/unicode/normalizer2.h ]; then
  if [ -d "$DEPS/usr/include" ]; then
    echo "using Oniguruma / ICU from $DEPS"
    pc="$DEPS/pc" && mkdir -p "$pc"
    sed "s|=/usr|=$DEPS/usr|" "$DEPS"/usr/lib/x86_64-linux-gnu/pkgconfig/oniguruma.pc > "$pc/oniguruma.pc"
    export PKG_CONFIG_PATH="$pc${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
    export LD_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # FindICU does not search <root>/lib/<multiarch> for a root given this way: name the files.
    cmake_extra+=("-DICU_ROOT=$DEPS/usr" "-DICU_INCLUDE_DIR=$DEPS/usr/include"
      "-DICU_UC_LIBRARY_RELEASE=$DEPS/usr/lib/x86_64-linux-gnu/libicuuc.so")
  else
    echo "error: no Oniguruma / ICU headers (libonig-dev, libicu-dev) and no $DEPS" >&2
    echo "---> HINT: apt-get install libonig-dev libicu-dev, or run 'bash scripts/gpu_tokenize.sh fetch-deps' on a Debian machine and send .deps/text" >&2
    exit 1
  fi
fi

echo "configuring and building in $BUILD (log: $OUT/build.log)"
{
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA=OFF "${cmake_extra[@]}"
  cmake --build "$BUILD" -j "$JOBS" --target tokenize_bench test_tokenizer dflash_data_tool
} > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
grep -q 'text/ (tokenizer) skipped' "$OUT/build.log" && { grep 'skipped' "$OUT/build.log"; exit 1; }
TOK="$BUILD/tests/tokenizers"

# The corpus: one {"text"} row per top-level .py file of the newest Python standard library here.
PYLIB="$(ls -d /usr/lib/python3.[0-9]* 2>/dev/null | sort -V | tail -1)"
CORPUS_NAME="$(basename "$PYLIB")-stdlib"
python3 - "$PYLIB" "$OUT/docs.jsonl" <<'PY'
import glob, json, os, sys
with open(sys.argv[2], 'w', encoding='utf-8') as f:
    for p in sorted(glob.glob(os.path.join(sys.argv[1], '*.py'))):
        try: t = open(p, encoding='utf-8').read()
        except UnicodeDecodeError: continue
        f.write(json.dumps({'text': t}, ensure_ascii=False) + '\n')
PY

(cd "$BUILD" && ctest -R 'Tokenizer|cli_tokenize' --output-on-failure) > "$OUT/tests.log" 2>&1 || true
"$BUILD/bench/tokenize_bench" --tokenizer "$TOK" --jsonl "$OUT/docs.jsonl" --threads "1,$THREADS" --seconds "$SECONDS_PER_ROW" \
  --csv "$OUT/tokenize.csv" --corpus-name "$CORPUS_NAME" --tokenizer-name qwen3 | tee "$OUT/summary.txt"
"$BUILD/data/dflash_data" tokenize --tokenizer "$TOK" "$OUT/docs.jsonl" --out "$OUT/ids.jsonl"

COMMIT="${DFLASH_GIT_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
RAYON_NUM_THREADS="$THREADS" python3 - "$TOK/tokenizer.json" "$OUT/docs.jsonl" "$OUT/ids.jsonl" "$OUT/tokenize.csv" \
    "$CORPUS_NAME" "$THREADS" "$SECONDS_PER_ROW" "${COMMIT:0:12}" <<'PY' | tee -a "$OUT/summary.txt"
import json, os, statistics, sys, time
import tokenizers
from tokenizers import Tokenizer
tok_path, docs_path, ids_path, csv_path, corpus, threads, secs, commit = sys.argv[1:]
threads, secs = int(threads), float(secs)
tok = Tokenizer.from_file(tok_path)
docs = [json.loads(l)['text'] for l in open(docs_path, encoding='utf-8')]
mb = sum(len(d.encode('utf-8')) for d in docs) / 1e6

def timed(fn):
    fn()  # warm-up
    times, total = [], 0.0
    while len(times) < 3 or total < secs:
        t0 = time.perf_counter(); n = fn(); times.append(time.perf_counter() - t0); total += times[-1]
    times.sort()
    q = lambda p: times[int(p * (len(times) - 1) + 0.5)]
    return n, q(0.5), q(0.2), q(0.8)

single = lambda: sum(len(tok.encode(d, add_special_tokens=False).ids) for d in docs)
batch = lambda: sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False))
cpu = next((l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')), 'cpu')
gpu = f'cpu: {cpu}, {os.cpu_count()} threads'
stamp = time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())
rows = []
for mode, fn, t in (('encode', single, 1), ('encode_batch', batch, threads)):
    n, p50, p20, p80 = timed(fn)
    shape = f'tokenizer=qwen3,threads={t},corpus={corpus}'
    for metric, unit, amount in (('mb_per_s', 'MB/s', mb), ('tok_per_s', 'tok/s', n)):
        rows.append(f'tokenize,encode,hf_tokenizers,{mode},{metric},{unit},"{shape}",{amount / p50:.6g},{amount / p80:.6g},'
                    f'{amount / p20:.6g},0,"{gpu}",{commit},{stamp}')
    print(f'HF tokenizers {tokenizers.__version__} {mode:12s} threads {t:3d}: {mb / p50:8.2f} MB/s  {n / p50:12.0f} tok/s')
with open(csv_path, 'a') as f:
    f.write('\n'.join(rows) + '\n')

import csv
rate = {(r['provider'], r['mode'], r['metric'], r['shape']): float(r['p50']) for r in csv.DictReader(open(csv_path))}
shape = lambda t: f'tokenizer=qwen3,threads={t},corpus={corpus}'
for t, hf_mode in ((1, 'encode'), (threads, 'encode_batch')):
    a, b = rate.get(('dflash', 'encode', 'mb_per_s', shape(t))), rate.get(('hf_tokenizers', hf_mode, 'mb_per_s', shape(t)))
    if a and b: print(f'threads {t:3d}: dflash {a:.2f} MB/s, HF {hf_mode} {b:.2f} MB/s: {a / b:.2f}x')
ours = [json.loads(l)['ids'] for l in open(ids_path)]
theirs = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
bad = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
print(f'parity: {len(docs) - len(bad)} of {len(docs)} documents give HF\'s ids' + (f' (differ: {bad[:10]})' if bad else ''))
PY
grep -E 'tests passed|tests failed' "$OUT/tests.log" | tee -a "$OUT/summary.txt"
rm -f "$OUT/docs.jsonl" "$OUT/ids.jsonl"
