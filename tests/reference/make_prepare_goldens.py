#!/usr/bin/env python3
"""Goldens for `dflash_data prepare` (data/prepare.h): per configuration (template, --think,
--last-turn-only, --enable-thinking, --max-length), the input rows and, per row, the expected ids
and loss mask, or that the row is bad. Written to tests/data/prepare/goldens.tar.xz (goldens.json),
read by tests/test_prepare.cpp.

What is independent of dflash's C++ here is the mask:
  * the render: python3-jinja2, configured as transformers' apply_chat_template (the environment of
    make_chat_goldens.py), of the messages as vLLM passes them to it (serving_messages: null content
    as "", tool-call arguments written as JSON strings parsed with json.loads);
  * the assistant spans: on TRL's training templates the {% generation %} blocks (what TRL's
    assistant mask marks); on Qwen3's own template SpecForge's way, a regex over the render,
    <|im_start|>assistant\\n(.*?<|im_end|>\\n), required to find exactly one span per assistant
    message (a row where it does not is left out of that configuration);
  * the think block (--think out): a span that starts with <think> loses <think>...</think> and
    the newlines after it;
  * token offsets: each id's bytes from tokenizer.json itself (the GPT-2 byte-to-unicode table;
    added tokens by their content), accumulated, a token holding part of a character widened to the
    whole character (Hugging Face's byte-level offsets); the bytes must add up to the text;
  * the rule: a token is supervised iff its byte range overlaps a supervised span (transformers'
    return_assistant_tokens_mask / SpecForge).
The ids come from dflash's tokenizer (`dflash_data tokenize`), whose parity with Hugging Face is
proven by tests/data/tokenizers/goldens.tar.xz; where NFC changes a text, offsets and spans are
compared in the NFC text (span edges are ASCII markup, unchanged by it).

Usage (from the repository root, after building dflash_data):
  python3 tests/reference/make_prepare_goldens.py build-cpu/data/dflash_data
"""
import io
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import unicodedata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_chat_goldens as chat  # noqa: E402  (the jinja2 environment of transformers)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TEMPLATES = os.path.join(ROOT, "tests", "data", "chat_templates")
OUT = os.path.join(ROOT, "tests", "data", "prepare")
EOS = "<|im_end|>"


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def token_bytes_table(tokenizer_json):
    tj = json.load(open(tokenizer_json, encoding="utf-8"))
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    table = {}
    for tok, i in tj["model"]["vocab"].items():
        table[i] = bytes(char_to_byte[c] for c in tok)
    for a in tj["added_tokens"]:
        table[a["id"]] = a["content"].encode("utf-8")
    return table


def rows_corpus():
    """The input rows: every conversation of the chat-template fixtures as an OpenAI messages row
    (with its tools), plus ShareGPT rows, plain text rows and rows with split characters."""
    convs = json.load(open(os.path.join(TEMPLATES, "conversations.json"), encoding="utf-8"))["conversations"]
    rows = []
    for c in convs:
        r = {"messages": c["messages"]}
        if c.get("tools"):
            r["tools"] = c["tools"]
        rows.append(r)
    rows += [
        {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "2+2 = 4."}]},
        {"conversations": [{"from": "system", "value": "You answer in French."}, {"from": "human", "value": "Hello"},
                           {"from": "gpt", "value": "Bonjour !"}, {"from": "human", "value": "Thanks"},
                           {"from": "gpt", "value": "De rien."}]},
        {"system": "Be terse.", "conversations": [{"from": "user", "value": "Name a colour."}, {"from": "assistant", "value": "Blue"}]},
        {"conversations": [{"from": "human", "value": "Only a question, no answer yet?"}]},
        {"text": "Plain text: every token is supervised, even <|im_end|> inside it."},
        {"text": "\U0001D11E clef, \u4f60\u597d, emoji \U0001F469\u200d\U0001F4bb and tabs\t\tend"},
        {"messages": [{"role": "user", "content": "Draw a clef"},
                      {"role": "assistant", "content": "\U0001D11E\U0001D11E here \U0001D11E"}]},
        {"messages": [{"role": "user", "content": "Think first"},
                      {"role": "assistant", "content": "\U0001D11E answer", "reasoning_content": "\U0001D11E thought"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r1"},
                      {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "reasoning_content": "r2"}]},
        {"messages": [{"role": "user", "content": "Is 51 prime?"},
                      {"role": "assistant", "content": "No: 51 = 3 x 17.", "reasoning": "5 + 1 = 6: divisible by 3."}]},
    ]
    return rows


def serving_messages(messages):
    """The messages as vLLM's chat_utils hands them to the template (SGLang does the same): a
    missing or null content as "" (vLLM: [] joined, SGLang: ""), an assistant's "reasoning" copied to
    reasoning_content when it has none, an assistant's empty tool_calls
    list dropped, each call's arguments that are a JSON string json.loads-ed (keys in their order),
    missing / null / "" arguments as {}. Where vLLM coerces bad arguments to {} with a warning,
    prepare refuses the row: ValueError here."""
    out = json.loads(json.dumps(messages))  # a copy
    for i, m in enumerate(out):
        if m.get("content") is None:
            m["content"] = ""
        if m.get("role") == "assistant" and isinstance(m.get("reasoning"), str) and "reasoning_content" not in m:
            m["reasoning_content"] = m["reasoning"]  # vLLM: result_msg["reasoning_content"] = reasoning
        if m.get("role") != "assistant" or not isinstance(m.get("tool_calls"), list):
            continue
        if not m["tool_calls"]:
            del m["tool_calls"]
            continue
        for k, call in enumerate(m["tool_calls"]):
            if not isinstance(call, dict):
                raise ValueError(f"messages[{i}].tool_calls[{k}] is not an object")
            fn = call.get("function", call)
            if not isinstance(fn, dict):
                raise ValueError(f"messages[{i}].tool_calls[{k}].function is not an object")
            args = fn.get("arguments")
            if args is None or args == "":
                fn["arguments"] = {}
            elif isinstance(args, str):
                parsed = json.loads(args)
                if not isinstance(parsed, dict):
                    raise ValueError(f"messages[{i}].tool_calls[{k}] arguments decode to {type(parsed).__name__}")
                fn["arguments"] = parsed
            elif not isinstance(args, dict):
                raise ValueError(f"messages[{i}].tool_calls[{k}] arguments are {type(args).__name__}")
    return out


def to_messages(row):
    """(messages, tools, kind) of a row as prepare reads it; kind: chat or text."""
    if "text" in row:
        return None, None, "text"
    if "messages" in row:
        return serving_messages(row["messages"]), row.get("tools"), "chat"
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
    msgs = [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]
    if row.get("system") and (not msgs or msgs[0]["role"] != "system"):
        msgs.insert(0, {"role": "system", "content": row["system"]})
    return msgs, None, "chat"


def byte_len(s):
    return len(s.encode("utf-8"))


def regex_spans(text, n_assistant):
    """SpecForge's spans: the assistant turns found by a regex over the render (byte offsets)."""
    spans = [[byte_len(text[:m.start(1)]), byte_len(text[:m.end(1)])]
             for m in re.finditer(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>\n)", text, re.S)]
    return spans if len(spans) == n_assistant else None


def cut_think(tb, span):
    """The span without its leading <think>...</think> block and the newlines after it."""
    b, e = span
    if not tb[b:e].startswith(b"<think>"):
        return [span]
    c = tb.find(b"</think>", b, e)
    if c < 0:
        return [span]
    te = c + len(b"</think>")
    while te < e and tb[te:te + 1] in (b"\n", b"\r"):
        te += 1
    return [[te, e]] if te < e else []


def offsets(tb, ids, table):
    """Each token's byte range, widened to whole characters."""
    out, at = [], 0
    for i in ids:
        n = len(table[i])
        out.append([at, at + n])
        at += n
    assert at == len(tb), "the tokens' bytes do not add up to the text"

    def cont(k):
        return k < len(tb) and (tb[k] & 0xC0) == 0x80
    for o in out:
        while o[0] > 0 and cont(o[0]):
            o[0] -= 1
        while cont(o[1]):
            o[1] += 1
    return out


CONFIGS = [
    # name, template (None: the tokenizer directory's own = qwen3.jinja), options, span source
    ("qwen3_own", None, {}, "regex"),
    ("qwen3_own_nothink", None, {"enable_thinking": False}, "regex"),
    ("qwen3_own_think_out", None, {"think": "out"}, "regex"),
    ("qwen3_own_last_turn", None, {"last_turn_only": True}, "regex"),
    ("qwen3_own_max24", None, {"max_length": 24}, "regex"),
    ("qwen3_5_training", "qwen3_5_think_training.jinja", {}, "generation"),
    ("qwen3_5_training_last_think_out", "qwen3_5_think_training.jinja", {"last_turn_only": True, "think": "out"}, "generation"),
    ("qwen3_6_training_nothink", "qwen3_6_training.jinja", {"enable_thinking": False}, "generation"),
]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    dflash_data = sys.argv[1]
    tokdir = tempfile.mkdtemp()
    with tarfile.open(os.path.join(ROOT, "tests", "data", "tokenizers", "qwen3.tar.xz")) as t:
        t.extractall(tokdir)
    table = token_bytes_table(os.path.join(tokdir, "tokenizer.json"))
    own = json.load(open(os.path.join(tokdir, "tokenizer_config.json"), encoding="utf-8"))["chat_template"]
    env = chat.env()
    rows = rows_corpus()

    # Renders first (every configuration), then one tokenize run for all texts.
    plans = []  # (config, row index, text or None, spans or None, error or None)
    for name, tname, opts, source in CONFIGS:
        tpl = env.from_string(own if tname is None else open(os.path.join(TEMPLATES, tname), encoding="utf-8").read())
        for k, row in enumerate(rows):
            msgs, tools, kind = to_messages(row)
            if kind == "text":
                plans.append((name, k, row["text"], "all", None))
                continue
            n_asst = sum(m["role"] == "assistant" for m in msgs)
            kw = dict(eos_token=EOS, messages=msgs, tools=tools, documents=None, add_generation_prompt=n_asst == 0)
            if "enable_thinking" in opts:
                kw["enable_thinking"] = opts["enable_thinking"]
            try:
                text, gen_spans = chat.unmark(tpl.render(**kw))
            except chat.Raised as ex:
                plans.append((name, k, None, None, str(ex)))
                continue
            except Exception as ex:
                plans.append((name, k, None, None, f"{type(ex).__name__}: {ex}"))
                continue
            if n_asst == 0:
                spans = []
            elif source == "generation":
                spans = gen_spans
                assert len(spans) == n_asst, (name, k, "generation blocks", len(spans), n_asst)
            else:
                spans = regex_spans(text, n_asst)
                if spans is None:  # the regex cannot tell this row's turns apart: not in this configuration
                    continue
            plans.append((name, k, text, spans, None))

    texts = [p[2] for p in plans if p[2] is not None]
    with tempfile.TemporaryDirectory() as work:
        with open(os.path.join(work, "in.jsonl"), "w", encoding="utf-8") as f:
            for t in texts:
                f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
        subprocess.run([dflash_data, "tokenize", "--tokenizer", tokdir, os.path.join(work, "in.jsonl"), "--out",
                        os.path.join(work, "ids.jsonl")], check=True)
        ids_all = [json.loads(l)["ids"] for l in open(os.path.join(work, "ids.jsonl"))]
    assert len(ids_all) == len(texts)

    out = {}
    it = iter(ids_all)
    stats = {}
    for name, tname, opts, source in CONFIGS:
        out[name] = {"chat_template": tname, "options": opts, "span_source": source, "rows": []}
    for name, k, text, spans, err in plans:
        cfg = out[name]
        entry = {"row": json.dumps(rows[k], ensure_ascii=False)}
        if err is not None:
            entry["error"] = err
            cfg["rows"].append(entry)
            continue
        ids = next(it)
        # The tokens' bytes add up to the NFC text (the tokenizer's normalizer). Span edges lie at
        # ASCII markup, which NFC never joins to its neighbours, so an edge's offset in the NFC text
        # is the NFC prefix's length.
        nfc = unicodedata.normalize("NFC", text)
        tb = nfc.encode("utf-8")
        if nfc != text and spans not in ("all", []):
            raw = text.encode("utf-8")
            edge = lambda b: byte_len(unicodedata.normalize("NFC", raw[:b].decode("utf-8")))
            spans = [[edge(b), edge(e)] for b, e in spans]
        opts = cfg["options"]
        if spans == "all":
            mask = [1] * len(ids)
        else:
            sup = spans[-1:] if opts.get("last_turn_only") else spans
            if opts.get("think") == "out":
                sup = [r for s in sup for r in cut_think(tb, s)]
            offs = offsets(tb, ids, table)
            mask = [int(any(b < se and sb < e for sb, se in sup)) for b, e in offs]
        entry["prompt_only"] = spans == []
        if opts.get("max_length") and len(ids) > opts["max_length"]:
            ids, mask = ids[:opts["max_length"]], mask[:opts["max_length"]]
            entry["truncated"] = True
        entry["ids"], entry["mask"] = ids, mask
        cfg["rows"].append(entry)
        s = stats.setdefault(name, [0, 0, 0])
        s[0] += 1
        s[1] += len(ids)
        s[2] += sum(mask)

    data = json.dumps({"jinja2": chat.jinja2.__version__, "configs": out}, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    os.makedirs(OUT, exist_ok=True)
    info = tarfile.TarInfo("goldens.json")
    info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o644, "", ""
    with lzma.open(os.path.join(OUT, "goldens.tar.xz"), "wb", preset=9) as xz:
        with tarfile.open(fileobj=xz, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            tar.addfile(info, io.BytesIO(data))
    for name, (n, t, m) in stats.items():
        bad = sum("error" in e for e in out[name]["rows"])
        print(f"{name}: {n} rows ({bad} bad), {t} tokens, {m} supervised")
    print(f"{len(data)} bytes -> tests/data/prepare/goldens.tar.xz")


if __name__ == "__main__":
    main()
