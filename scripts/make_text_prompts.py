#!/usr/bin/env python3
"""The prompt lists of the third GPU round on configs/text-target (issue 29; scripts/gpu_text3.sh).

Runs on the development machine (no torch needed), before `dflash_data prepare --prompts` tokenizes
the lists here (the GPU machine's build has no tokenizer). Writes into --out:

  windows.jsonl  {"text", "doc", "kind": "window"}: windows of this machine's Python sources and license
                 texts (the make_text_target.py sources: the standard library, Debian's Python modules,
                 /usr/share/common-licenses), named as make_text_target.py names documents
                 ("python-stdlib/json/decoder.py"), only documents of the training split
                 (sha256(name) mod 16 != 0), each window a run of whole lines (--min-chars .. --max-chars),
                 starting at a random line; about one window per --chars-per-window characters.
  train.jsonl    prompts_train.jsonl's rows (chat, code, prose: training documents) and the windows,
                 shuffled (--seed): the first N rows are a uniform sample of both.
  heldout.jsonl  prompts_heldout.jsonl unchanged (held-out documents; chat rows first is not assumed).

Checks, by document: every window's and every training prompt's document is of the training split and
none is a held-out prompt's document; and by content: a source file that contains any held-out
prompt's text (its first 64 characters; for a chat row, of the docstring) is dropped (counted), so a
held-out document present here under another name cannot leak into training.
"""
import argparse
import hashlib
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_text_target as mt  # noqa: E402  (collect_corpus, heldout: the same names and split)


# The sources of the target's own training corpus (its README's table); man pages and /usr/share/doc were
# empty on the GPU machine, so they are no training documents of the target and are left out here.
SOURCES = ("python-stdlib", "python3-dist-packages", "common-licenses")


def held_keys(rows):
    keys = []
    for r in rows:
        if "messages" in r:
            t = r["messages"][0]["content"].split("\n\n", 1)[-1]
        else:
            t = r["text"]
        t = t.strip()
        if len(t) >= 32:
            keys.append(t[:64])
    return keys


def windows_of(text, rng, n, lo, hi):
    lines = text.split("\n")
    out = []
    for _ in range(n):
        i = rng.randrange(len(lines))
        want = rng.randint(lo, hi)
        w, j = [], i
        while j < len(lines) and sum(len(x) + 1 for x in w) < want:
            w.append(lines[j])
            j += 1
        s = "\n".join(w).rstrip()
        if lo // 2 <= len(s) <= 2 * hi and len(s.split()) >= 8:  # (one very long line: no window)
            out.append(s + "\n")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="configs/text-target")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chars-per-window", type=int, default=1200)
    ap.add_argument("--max-per-doc", type=int, default=40)
    ap.add_argument("--min-chars", type=int, default=300)
    ap.add_argument("--max-chars", type=int, default=900)
    ap.add_argument("--max-windows", type=int, default=40000)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    read = lambda f: [json.loads(l) for l in open(os.path.join(a.target, f))]  # noqa: E731
    train, held = read("prompts_train.jsonl"), read("prompts_heldout.jsonl")
    held_docs = {r["doc"] for r in held}
    assert all(mt.heldout(d) for d in held_docs), "a held-out prompt's document is not of the held-out split"
    bad = [r["doc"] for r in train if mt.heldout(r["doc"]) or r["doc"] in held_docs]
    assert not bad, f"training prompts from held-out documents: {bad[:3]}"
    keys = held_keys(held)
    docs, table = mt.collect_corpus(pip=False)
    for label, base, found, kept, nbytes in table:
        if label in SOURCES:
            print(f"source {label} ({base}): {kept} of {found} files, {nbytes / 1e6:.2f} MB", file=sys.stderr)
    kept, dropped_split, dropped_content = [], 0, []
    docs = [d for d in docs if d[0].split("/", 1)[0] in SOURCES]
    for name, kind, text in docs:
        if mt.heldout(name) or name in held_docs:
            dropped_split += 1
            continue
        if any(k in text for k in keys):
            dropped_content.append(name)
            continue
        kept.append((name, kind, text))
    wins = []
    for name, kind, text in kept:
        n = min(a.max_per_doc, max(1, len(text) // a.chars_per_window))
        for w in windows_of(text, rng, n, a.min_chars, a.max_chars):
            wins.append({"text": w, "doc": name, "kind": "window"})
    rng.shuffle(wins)
    wins = wins[:a.max_windows]
    rows = train + wins
    rng.shuffle(rows)
    assert not ({r["doc"] for r in rows} & held_docs)
    os.makedirs(a.out, exist_ok=True)
    for f, rs in (("windows.jsonl", wins), ("train.jsonl", rows), ("heldout.jsonl", held)):
        with open(os.path.join(a.out, f), "w") as fh:
            for r in rs:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"documents: {len(kept)} training kept, {dropped_split} of the held-out split left out, {len(dropped_content)} "
          f"dropped for containing a held-out prompt's text {dropped_content[:5]}", file=sys.stderr)
    print(f"windows: {len(wins)} from {len({w['doc'] for w in wins})} documents; train.jsonl: {len(rows)} rows "
          f"({len(train)} of prompts_train.jsonl + {len(wins)} windows); heldout.jsonl: {len(held)} rows, "
          f"{len(held_docs)} documents, none shared", file=sys.stderr)
    print(f"sha256 train.jsonl {hashlib.sha256(open(os.path.join(a.out, 'train.jsonl'), 'rb').read()).hexdigest()[:16]}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
