#!/usr/bin/env python3
"""Renders tests/data/chat_templates/conversations.json through each chat template there with
python3-jinja2, configured as transformers' apply_chat_template configures it
(transformers/utils/chat_template_utils.py: ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True) with loop controls, its own tojson = json.dumps(ensure_ascii=False),
raise_exception and strftime_now as globals), and writes the renders to
tests/data/chat_templates/goldens.tar.xz (goldens.json), read by tests/test_chat_template.cpp.

Each conversation is rendered with add_generation_prompt False/True crossed with enable_thinking
unset/True/False, with the variables dflash's ChatTemplate passes (text/chat_template.cpp):
eos_token, messages, tools, documents=None, add_generation_prompt, enable_thinking when set.
A render that raises records {"error": message, "raised": true if raise_exception raised it}.

Usage: python3 tests/reference/make_chat_goldens.py   (from the repository root)
"""
import datetime
import io
import json
import lzma
import os
import tarfile

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "chat_templates")
TEMPLATES = ["qwen3", "qwen3_5_think", "qwen3_5_nothink", "qwen3_6", "qwen3_5_think_training", "qwen3_6_training"]
# TRL's training templates wrap each assistant turn's supervised part in {% generation %}: the
# extension below (transformers' AssistantTracker renders the body unchanged) marks it, and the
# marks give "generation_spans", byte offsets in the UTF-8 text, the reference for dflash's spans.
OPEN, CLOSE = "\ue000GEN<", "\ue000GEN>"
EOS = "<|im_end|>"


class Raised(Exception):
    pass


def raise_exception(message):
    raise Raised(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


class Generation(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        return OPEN + caller() + CLOSE


def unmark(marked):
    """The text without the marks, and the [begin, end) byte offsets of each marked part."""
    text, spans, pos = "", [], 0
    while True:
        o = marked.find(OPEN, pos)
        if o < 0:
            return text + marked[pos:], spans
        c = marked.find(CLOSE, o)
        text += marked[pos:o]
        begin = len(text.encode("utf-8"))
        text += marked[o + len(OPEN):c]
        spans.append([begin, len(text.encode("utf-8"))])
        pos = c + len(CLOSE)


def env():
    e = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[jinja2.ext.loopcontrols, Generation])
    e.filters["tojson"] = tojson
    e.globals["raise_exception"] = raise_exception
    e.globals["strftime_now"] = strftime_now
    return e


def main():
    convs = json.load(open(os.path.join(HERE, "conversations.json"), encoding="utf-8"))["conversations"]
    e = env()
    out = {}
    for name in TEMPLATES:
        tpl = e.from_string(open(os.path.join(HERE, name + ".jinja"), encoding="utf-8").read())
        rows = []
        for c in convs:
            for gen in (False, True):
                for think in (None, True, False):
                    kw = dict(eos_token=EOS, messages=c["messages"], tools=c.get("tools"), documents=None,
                              add_generation_prompt=gen)
                    if think is not None:
                        kw["enable_thinking"] = think
                    row = {"conversation": c["name"], "add_generation_prompt": gen, "enable_thinking": think}
                    try:
                        row["text"], spans = unmark(tpl.render(**kw))
                        if name.endswith("_training"):
                            row["generation_spans"] = spans
                    except Raised as ex:
                        row["error"], row["raised"] = str(ex), True
                    except Exception as ex:  # a type error in the template, as jinja2 reports it
                        row["error"], row["raised"] = f"{type(ex).__name__}: {ex}", False
                    rows.append(row)
        out[name] = rows
    data = json.dumps({"jinja2": jinja2.__version__, "templates": out}, ensure_ascii=False, indent=0).encode("utf-8")
    # A tar.xz (reproducible: fixed metadata), unpacked by tests/CMakeLists.txt at configure time.
    info = tarfile.TarInfo("goldens.json")
    info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o644, "", ""
    with lzma.open(os.path.join(HERE, "goldens.tar.xz"), "wb", preset=9) as xz:
        with tarfile.open(fileobj=xz, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            tar.addfile(info, io.BytesIO(data))
    print(f"{sum(len(v) for v in out.values())} renders, {len(data)} bytes -> goldens.tar.xz")


if __name__ == "__main__":
    main()
