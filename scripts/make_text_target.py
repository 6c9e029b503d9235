#!/usr/bin/env python3
"""Makes configs/text-target: a small Qwen3.5-shaped target that has learned real text (issue 29).

Runs on the GPU machine (torch 2.11, transformers 5.17, tokenizers 0.23; Ubuntu 24.04), on a GPU or
on the CPU (--device cpu: the same steps, slower). Everything comes from what ships on that machine:

  corpus    documents that Ubuntu 24.04 installs, named by path:
              - the Python standard library's sources (/usr/lib/python3.X/**/*.py): code with
                docstrings and comments, the bulk of the corpus and what the chat examples are made of;
              - the Debian-packaged Python modules (/usr/lib/python3/dist-packages/**/*.py): more code
                of the same kind, from the distribution itself;
              - with --pip-packages (used for the committed checkpoint), also the Python packages
                installed beside torch (the directory python finds torch in; on that machine
                /opt/torch/.venv/lib/python3.12/site-packages: torch, transformers, numpy, ...; 32 MB of
                its 25,127 .py files at most, in the order of sha256(path)): the distribution's own code
                is 18 MB there (7 M tokens: 60 s of training passed over it 3 times; with these, 145 s
                of training, 47 M tokens, pass over the 28.7 M training tokens 1.6 times);
              - the license texts (/usr/share/common-licenses): long, regular English prose;
              - the man pages (/usr/share/man/man{1,5,7,8}, groff with the markup stripped): prose about
                commands, the "prose" prompts beside the licenses;
              - /usr/share/doc/*/README*, *.txt, *.md (plain or gzipped): more prose; the copyright files
                (the common licenses again, many times over) and changelogs (dates, names, e-mail
                addresses) are left out.
            Files that are not UTF-8, shorter than 200 characters or longer than 256 KiB are skipped,
            exact duplicates kept once. A document is held out when sha256(its name) mod 16 == 0,
            so the split is by document, deterministic, and does not depend on what else is there.
  tokenizer a byte-level BPE of 4,096 ids trained with `tokenizers` on the training documents: NFC,
            the Qwen3.5 pre-tokenizer regex (tests/data/tokenizers/PROVENANCE.md) + ByteLevel(use_regex
            false), 4,090 BPE ids, then <|endoftext|> <|im_start|> <|im_end|> <think> </think> and the mask
            token <|mask|> (4095, the last id); tokenizer_config.json carries the Qwen3.5 chat template
            (tests/data/chat_templates/qwen3_5_think.jinja), generation_config.json the end-of-turn ids.
  chat      each documented function of a training .py file becomes a conversation: the user asks for
            the function by signature and docstring, the assistant answers with its source, rendered
            with the chat template; these are trained on beside the raw documents.
  model     Qwen3_5ForCausalLM (qwen3_5_text): hidden 256, 4 layers in the real 3:1 pattern
            (3 GatedDeltaNet + 1 gated full attention), vocab 4,096, untied embeddings; AdamW, bf16
            autocast, cosine schedule, windows of 256 tokens; the held-out loss (held-out documents)
            is measured every --eval-every steps and the best checkpoint is kept.
  prompts   prompts_train.jsonl / prompts_heldout.jsonl: chat rows {"messages": [{"role": "user", ...}]}
            (kind "chat"), raw-text code completions {"text": a function's signature and docstring}
            (kind "code") and prose openings {"text": ...} (kind "prose"), each with its "doc"; the
            two lists come from disjoint documents (the split above); prompts_code.jsonl is the code rows
            of prompts_train.jsonl (the demo's prompts, configs/text.yaml).

Output (--out, default configs/text-target): config.json, model.safetensors (bf16), tokenizer.json,
tokenizer_config.json, generation_config.json, prompts_train.jsonl, prompts_heldout.jsonl, prompts_code.jsonl,
README.md (the provenance: corpus, seed, steps, losses, greedy samples), train_log.csv.
--golden DIR also writes the golden data of tests/test_text_target.cpp: golden.safetensors (every
decoder layer's output for real held-out text of 1, 37 and 130 tokens, transformers on the CPU in
float32 and float64 from the saved bf16 checkpoint) and tokens.jsonl (HF's ids of texts and rendered
chats). --prompt-ids DIR writes the prompts tokenized (JSONL rows {"input_ids", "loss_mask"} for
`dflash_data convert`, prompt tokens only).

  python3 scripts/make_text_target.py --train-seconds 240          # what made the committed checkpoint
  python3 scripts/make_text_target.py --steps N                    # the same number of steps (README)
"""
import argparse
import ast
import csv
import glob
import gzip
import hashlib
import json
import math
import os
import random
import re
import sys
import textwrap
import time

# The optional kernel packages are blocked, as in tests/reference/make_golden.py: the pure-torch
# GatedDeltaNet path is the one that runs, in training and in the golden data.
for _blocked in ("fla", "causal_conv1d", "kernels"):
    sys.modules[_blocked] = None

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB = 4096
# (content, special): ids 4090..4095 in this order; the mask token is the last id.
ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<think>", False),
         ("</think>", False), ("<|mask|>", True)]
BPE_VOCAB = VOCAB - len(ADDED)
EOT, IM_START, IM_END, THINK, END_THINK, MASK = range(BPE_VOCAB, VOCAB)
MAX_FILE = 256 << 10
MIN_FILE = 200
HELDOUT_MOD = 16
MAX_DOCSTRING = 800  # --max-docstring: the longest docstring of a chat example / prompt
# Bytes taken from each source at most (the corpus stays a few minutes' training on one GPU).
CAPS = {"python-stdlib": 40e6, "python3-dist-packages": 16e6, "python-pip-packages": 32e6, "common-licenses": 4e6, "man-pages": 16e6,
        "usr-share-doc": 8e6}


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------- corpus
def heldout(name):
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % HELDOUT_MOD == 0


def read_text(path):
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE + 1)
        if path.endswith(".gz"):
            raw = gzip.decompress(raw) if len(raw) <= MAX_FILE else b""
        if len(raw) > MAX_FILE:
            return None
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


_GROFF_ESC = re.compile(r"\\f(\[[^\]]*\]|\(..|.)|\\\*(\[[^\]]*\]|\(..|.)|\\&|\\%|\\c")


def degroff(src):
    """Man-page groff to plain text, crudely: requests dropped, the text of font/section macros kept."""
    out = []
    for line in src.splitlines():
        if line.startswith(('.\\"', "'\\\"", '\\"')):
            continue
        if line.startswith((".", "'")):
            parts = line[1:].split(None, 1)
            if not parts:
                continue
            macro, rest = parts[0], (parts[1] if len(parts) > 1 else "")
            if macro in ("SH", "SS"):
                out.append("")
                line = rest.replace('"', "")
            elif macro in ("B", "I", "BR", "RB", "BI", "IB", "IR", "RI", "SM", "SB"):
                line = rest.replace('"', "")
                if macro in ("BR", "RB", "BI", "IB", "IR", "RI"):
                    line = line.replace(" ", "")
            elif macro in ("PP", "LP", "P", "TP", "IP", "HP", "sp", "br"):
                out.append("")
                if macro == "IP" and rest:
                    line = rest.split('"')[1] if rest.startswith('"') and rest.count('"') >= 2 else rest.split()[0]
                else:
                    continue
            else:
                continue
        line = _GROFF_ESC.sub("", line)
        line = line.replace("\\-", "-").replace("\\(em", "--").replace("\\(en", "-").replace("\\e", "\\")
        line = re.sub(r"\\\(..", "", line).replace("\\ ", " ")
        out.append(line)
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def collect_corpus(pip=False):
    """[(name, kind, text)] sorted by name; kind: code / prose. And the source table for the README."""
    import sysconfig
    stdlib = sysconfig.get_paths()["stdlib"]
    # The pip-installed packages: where python finds torch (the packages beside it: transformers, numpy, ...).
    pip_dir = f"/usr/local/lib/python{sys.version_info[0]}.{sys.version_info[1]}/dist-packages"
    if pip:
        import importlib.util
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.origin:
            pip_dir = os.path.dirname(os.path.dirname(spec.origin))
    sources = [
        ("python-stdlib", stdlib, sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)), "code"),
        ("python3-dist-packages", "/usr/lib/python3/dist-packages",
         sorted(glob.glob("/usr/lib/python3/dist-packages/**/*.py", recursive=True)), "code"),
        ("python-pip-packages", pip_dir,
         sorted(glob.glob(os.path.join(pip_dir, "**", "*.py"), recursive=True)) if pip else [], "code"),
        ("common-licenses", "/usr/share/common-licenses", sorted(glob.glob("/usr/share/common-licenses/*")), "prose"),
        ("man-pages", "/usr/share/man",
         sorted(p for s in ("1", "5", "7", "8") for p in glob.glob(f"/usr/share/man/man{s}/*.gz")), "prose"),
        ("usr-share-doc", "/usr/share/doc",
         sorted(p for p in glob.glob("/usr/share/doc/**/*", recursive=True)
                if re.search(r"/(README[^/]*|[^/]*\.(txt|md)(\.gz)?)$", p) and "changelog" not in p.lower()), "prose"),
    ]
    docs, seen, table = [], set(), []
    for label, base, paths, kind in sources:
        mine = []
        for p in paths:  # sorted: the first of exact duplicates is kept
            if not os.path.isfile(p) or os.path.islink(p):
                continue
            if label == "python-stdlib" and ("site-packages" in p or "dist-packages" in p):
                continue
            text = read_text(p)
            if text is None:
                continue
            if label == "man-pages":
                text = degroff(text)
            text = text.replace("\r\n", "\n")
            if len(text) < MIN_FILE:
                continue
            h = hashlib.sha256(text.encode()).hexdigest()
            if h in seen:
                continue
            seen.add(h)
            mine.append((f"{label}/{os.path.relpath(p, base)}", kind, text))
        cap = CAPS[label]
        if sum(len(d[2].encode()) for d in mine) > cap:  # a uniform, deterministic subset: by sha256(name)
            mine.sort(key=lambda d: hashlib.sha256(d[0].encode()).hexdigest())
            keep, n = [], 0
            for d in mine:
                if n >= cap:
                    break
                keep.append(d)
                n += len(d[2].encode())
            mine = keep
        nbytes = sum(len(d[2].encode()) for d in mine)
        docs += mine
        table.append((label, base, len(paths), len(mine), nbytes))
        log(f"corpus: {label} ({base}): {len(mine)} of {len(paths)} files, {nbytes / 1e6:.2f} MB (cap {cap / 1e6:.0f} MB)")
    docs.sort(key=lambda d: d[0])
    return docs, table


# -------------------------------------------------------------------------------------- chat + prompts
def render_chat(user, assistant=None):
    """The Qwen3.5 template's rendering (checked against transformers' apply_chat_template in main)."""
    s = f"<|im_start|>user\n{user.strip()}<|im_end|>\n<|im_start|>assistant\n<think>\n"
    if assistant is None:
        return s
    return s + f"\n</think>\n\n{assistant.strip()}<|im_end|>\n"


def functions_of(name, text):
    """The module's docstring and (signature, docstring, source, head) of each documented function."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "", []
    lines_of = [l + "\n" for l in text.split("\n")]  # ast counts lines at \n only (not at \f, as splitlines does)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or not (20 <= len(doc) <= MAX_DOCSTRING) or node.name.startswith("__"):
            continue
        try:
            args = ast.unparse(node.args)
        except Exception:  # noqa: BLE001  (odd nodes: skipped)
            continue
        if node.end_lineno - node.lineno > 60:
            continue
        # The def line through the end of the body (decorators left out), dedented.
        src = textwrap.dedent("".join(lines_of[node.lineno - 1:node.end_lineno])).rstrip() + "\n"
        lines = src.rstrip("\n").split("\n")
        if not (4 <= len(lines) <= 60) or len(src) > 2400:
            continue
        body0 = node.body[0]
        head_lines = body0.end_lineno - node.lineno + 1  # def line(s) through the docstring's end
        if head_lines >= len(lines) - 1:
            continue
        head = "\n".join(lines[:head_lines]) + "\n"
        out.append((f"{node.name}({args})", doc, src, head))
    return ast.get_docstring(tree) or "", out


def chat_user(sig, doc):
    return f"Write the Python function `{sig}`.\n\n{doc}"


def prose_openings(text, rng, n):
    """Up to n openings of paragraphs (200..600 characters, cut at a space) of a prose document."""
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) >= 300]
    rng.shuffle(paras)
    out = []
    for p in paras[:n]:
        cut = p.rfind(" ", 0, rng.randint(200, 400))
        if cut > 100:
            out.append(p[:cut])
    return out


def make_examples_and_prompts(docs, seed):
    """Chat training texts (training documents only) and the two prompt lists."""
    rng = random.Random(seed)
    chats = {"train": [], "heldout": []}
    prompts = {"train": [], "heldout": []}
    for name, kind, text in docs:
        split = "heldout" if heldout(name) else "train"
        if kind == "code":
            mdoc, funcs = functions_of(name, text)
            if len(mdoc) >= 300:  # a module's docstring is prose too
                cut = mdoc.rfind(" ", 0, rng.randint(200, 400))
                if cut > 100:
                    prompts[split].append({"text": mdoc[:cut], "doc": name, "kind": "prose"})
            for sig, doc, src, head in funcs:
                chats[split].append(render_chat(chat_user(sig, doc), src))
                prompts[split].append({"messages": [{"role": "user", "content": chat_user(sig, doc)}],
                                       "doc": name, "kind": "chat"})
                prompts[split].append({"text": head, "doc": name, "kind": "code"})
        else:
            for t in prose_openings(text, rng, 4):
                prompts[split].append({"text": t, "doc": name, "kind": "prose"})
    for split in prompts:
        rng.shuffle(prompts[split])
        rng.shuffle(chats[split])
    # Held-out: a balanced, fixed list (by kind, in shuffled order).
    ho = prompts["heldout"]
    by_kind = {k: [p for p in ho if p["kind"] == k] for k in ("chat", "code", "prose")}
    want = {"chat": 48, "code": 48, "prose": 32}
    prompts["heldout"] = [p for k in ("chat", "code", "prose") for p in by_kind[k][:want[k]]]
    rng.shuffle(prompts["heldout"])
    # Both lists: the chat rows first (dflash_data prepare makes them prompts for regeneration; the
    # first N of a list are N chat prompts), then code, then prose, each in shuffled order.
    order = {"chat": 0, "code": 1, "prose": 2}
    for split in prompts:
        prompts[split].sort(key=lambda p: order[p["kind"]])
    train_docs = {p["doc"] for p in prompts["train"]}
    assert not train_docs & {p["doc"] for p in prompts["heldout"]}, "prompt lists share a document"
    return chats, prompts


def prompt_text(row):
    return render_chat(row["messages"][0]["content"]) if "messages" in row else row["text"]


# -------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts, out_dir):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, min_frequency=2, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.time()
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.get_vocab_size() == BPE_VOCAB, f"BPE trained {tok.get_vocab_size()} ids, not {BPE_VOCAB}"
    for content, special in ADDED:
        t = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([t])
    for i, (content, _) in enumerate(ADDED):
        assert tok.token_to_id(content) == BPE_VOCAB + i, (content, tok.token_to_id(content))
    assert tok.get_vocab_size() == VOCAB
    log(f"tokenizer: BPE of {BPE_VOCAB} + {len(ADDED)} added tokens trained in {time.time() - t0:.1f} s")
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(ROOT, "tests", "data", "chat_templates", "qwen3_5_think.jinja"), encoding="utf-8") as f:
        template = f.read()
    added = {str(BPE_VOCAB + i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": s} for i, (c, s) in enumerate(ADDED)}
    config = {"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 4096, "chat_template": template,
              "added_tokens_decoder": added}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [IM_END, EOT], "pad_token_id": EOT, "do_sample": False}, f, indent=2)
    return tok


# ------------------------------------------------------------------------------------------------ model
def model_config():
    from transformers import Qwen3_5TextConfig
    kw = dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        full_attention_interval=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=IM_END, pad_token_id=EOT)
    try:
        return Qwen3_5TextConfig(**kw)
    except TypeError:  # a config class that takes no full_attention_interval: layer_types says the same
        kw.pop("full_attention_interval")
        return Qwen3_5TextConfig(**kw)


def stream_of(tok, texts, rng):
    import numpy as np
    enc = tok.encode_batch(texts, add_special_tokens=False)
    order = list(range(len(enc)))
    rng.shuffle(order)
    parts = []
    for i in order:
        parts.append(np.asarray(enc[i].ids, dtype=np.int64))
        parts.append(np.asarray([EOT], dtype=np.int64))
    return np.concatenate(parts)


def train_model(args, tok, train_texts, heldout_texts, out_dir):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers
    rng = random.Random(args.seed)
    train = torch.from_numpy(stream_of(tok, train_texts, rng))
    held = torch.from_numpy(stream_of(tok, heldout_texts, rng))
    log(f"data: {train.numel() / 1e6:.2f} M training tokens, {held.numel() / 1e6:.3f} M held-out tokens")
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    cfg = model_config()
    cfg._attn_implementation = "sdpa"
    model = transformers.Qwen3_5ForCausalLM(cfg).to(dev)
    nparams = sum(p.numel() for p in model.parameters())
    log(f"model: {nparams / 1e6:.2f} M parameters, layer types {cfg.layer_types}")
    T, Bsz = args.seq_len, args.batch
    gen = torch.Generator().manual_seed(args.seed)
    n_eval = 64
    eval_off = torch.linspace(0, held.numel() - T - 2, n_eval).long()
    eval_x = torch.stack([held[o:o + T + 1] for o in eval_off]).to(dev)
    train_dev = train.to(dev)
    span = torch.arange(T + 1)[None]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    amp = dict(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")

    def loss_of(x):
        with torch.autocast(**amp):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))

    def evaluate():
        model.eval()
        with torch.no_grad():
            l = sum(loss_of(eval_x[i:i + 16]).item() for i in range(0, n_eval, 16)) / (n_eval // 16)
        model.train()
        return l

    total = args.steps
    warmup = 100
    rows, best, best_state, step_t = [], float("inf"), None, None
    t0 = time.time()
    step = 0
    while True:
        if total is None and step in (20, 60):  # the time budget fixes the step count: steps 21..60 timed
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if step == 20:
                t20 = time.time()
            else:
                step_t = (time.time() - t20) / 40
                # evaluations: ~2 steps' time each
                total = max(200, 60 + int((args.train_seconds - (time.time() - t0)) / (step_t * (1 + 2 / args.eval_every))))
                log(f"train: {step_t * 1000:.1f} ms a step: {total} steps in the {args.train_seconds} s budget")
        if total is not None and step >= total:
            break
        plan = total if total is not None else 10 ** 9
        lr = args.lr * min(1.0, (step + 1) / warmup)
        if step >= warmup:
            lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, plan - warmup))))
        for g in opt.param_groups:
            g["lr"] = lr
        off = torch.randint(0, train.numel() - T - 1, (Bsz, 1), generator=gen)
        x = train_dev[(off + span).to(dev)]
        loss = loss_of(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % args.eval_every == 0 or step == total:
            tl, hl = loss.item(), evaluate()
            rows.append((step, round(time.time() - t0, 1), lr, tl, hl))
            log(f"step {step}/{total}: train loss {tl:.4f} held-out {hl:.4f} ({time.time() - t0:.0f} s)")
            if hl < best:
                best = hl
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    best_step = min(rows, key=lambda r: r[4])[0]
    with open(os.path.join(out_dir, "train_log.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "seconds", "lr", "train_loss", "heldout_loss"])
        w.writerows(rows)
    info = dict(steps=total, best_step=best_step, best_heldout=best, last=rows[-1], params=nparams,
                train_tokens=int(train.numel()), heldout_tokens=int(held.numel()), seconds=time.time() - t0,
                batch=Bsz, seq_len=T, lr=args.lr, device=str(dev), step_ms=None if step_t is None else step_t * 1000)
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return info


def greedy(model, tok, text, n):
    """n greedy tokens (fewer at an end-of-turn / end-of-text token), full forwards without a cache."""
    import torch
    ids = tok.encode(text, add_special_tokens=False).ids
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(input_ids=torch.tensor([ids + out]), use_cache=False).logits[0, -1].argmax())
            out.append(t)
            if t in (IM_END, EOT):
                break
    return tok.decode(out, skip_special_tokens=False)


def chat_renderer(out_dir):
    """render(messages, add_generation_prompt): transformers' apply_chat_template on the saved tokenizer
    (jinja2 with transformers' settings when AutoTokenizer cannot load it; the reason is printed)."""
    try:
        import transformers
        auto = transformers.AutoTokenizer.from_pretrained(out_dir)
        return lambda m, g: auto.apply_chat_template(m, tokenize=False, add_generation_prompt=g)
    except Exception as e:  # noqa: BLE001
        log(f"WARNING: AutoTokenizer could not load {out_dir} ({type(e).__name__}: {e}); rendering with jinja2")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise jinja2.exceptions.TemplateError(msg)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        env.globals["raise_exception"] = raise_exception
        with open(os.path.join(out_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            tmpl = env.from_string(json.load(f)["chat_template"])
        return lambda m, g: tmpl.render(messages=m, add_generation_prompt=g)


def load_f32(out_dir):
    import transformers
    m = transformers.Qwen3_5ForCausalLM.from_pretrained(out_dir, dtype="float32").eval()
    m.config._attn_implementation = "eager"
    return m


# ----------------------------------------------------------------------------------------------- golden
def write_golden(out_dir, golden_dir, tok, heldout_texts, prompts):
    import copy
    import torch
    import transformers
    from safetensors.torch import save_file
    os.makedirs(golden_dir, exist_ok=True)
    m32 = load_f32(out_dir)
    m64 = copy.deepcopy(m32).to(torch.float64)

    def run(model, ids):
        outs = []
        hooks = [layer.register_forward_hook(lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o)[0]))
                 for layer in model.model.layers]
        with torch.no_grad():
            res = model.model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
        for h in hooks:
            h.remove()
        return outs, [h[0] for h in res.hidden_states], res.last_hidden_state[0]

    text = max(heldout_texts[:50], key=len)
    all_ids = tok.encode(text, add_special_tokens=False).ids
    tensors, report = {}, {}
    for T in (1, 37, 130):
        ids = torch.tensor(all_ids[:T])
        ids[0] = VOCAB - 1 if T == 1 else ids[0]  # the largest id (the mask token) is exercised
        tensors[f"ids.{T}"] = ids.to(torch.int32)
        l32, hs32, f32 = run(m32, ids)
        l64, _, _ = run(m64, ids)
        for i, (a, b) in enumerate(zip(l32, l64)):
            tensors[f"layer.{T}.{i}"] = a.float().clone()
            tensors[f"exact.{T}.{i}"] = b.float().clone()
        for i in range(len(l32) - 1):
            assert torch.equal(hs32[i + 1], l32[i])
        tensors[f"embed.{T}"] = hs32[0].float().clone()
        tensors[f"final.{T}"] = f32.float().clone()
        report[T] = max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(l32, l64))
    save_file(tensors, os.path.join(golden_dir, "golden.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__, "text": text[:200]})
    log(f"golden: HF float32 vs float64 max rel err per T: {report}")
    # HF's ids: the tokenizers library on texts, and transformers' apply_chat_template on chat prompts.
    render = chat_renderer(out_dir)
    rows = []
    for p in prompts[:16]:
        if "messages" in p:
            rendered = render(p["messages"], True)
            assert rendered == prompt_text(p), "the chat template renders differently from render_chat"
            rows.append({"name": f"chat prompt ({p['doc']})", "text": rendered})
        else:
            rows.append({"name": f"{p['kind']} prompt ({p['doc']})", "text": p["text"]})
    for s in ["caf\u00e9 = 'cafe\u0301'  # NFC", "    def f(self):\n\t\treturn x\r\n", "\u4f60\u597d\uff0c\u4e16\u754c \U0001f600",
              "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n<|mask|><|endoftext|>", "It's we'LL   x\n\n\n  y"]:
        rows.append({"name": "edge", "text": s})
    with open(os.path.join(golden_dir, "tokens.jsonl"), "w", encoding="utf-8") as f:
        for r in rows:
            r["ids"] = tok.encode(r["text"], add_special_tokens=False).ids
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    with open(os.path.join(golden_dir, "VERSIONS.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__,
                   "script": "scripts/make_text_target.py --golden"}, f, indent=1)


# ----------------------------------------------------------------------------------------------- readme
def write_readme(out_dir, args, table, info, counts, samples, versions):
    L = ["# text-target: a small Qwen3.5-shaped target trained on real text", "",
         "Made by `scripts/make_text_target.py` (issue 29) on the GPU machine; running it again there makes it again",
         f"(`python3 scripts/make_text_target.py --steps {info['steps']} --seed {args.seed}"
         f"{' --pip-packages' if args.pip_packages else ''}{f' --chat-repeat {args.chat_repeat}' if args.chat_repeat != 1 else ''}"
         f"{f' --max-train-prompts {args.max_train_prompts}' if args.max_train_prompts else ''}"
         f"{f' --lr {args.lr}' if args.lr != 3e-3 else ''}`; GPU arithmetic is not",
         "bit-reproducible, so expect the same losses to about 0.01, not the same bytes).", "",
         f"Versions: {versions}.", "", "## Corpus (what Ubuntu 24.04 installs on that machine)", "",
         "| source | path | files found | documents kept | MB |", "|---|---|---:|---:|---:|"]
    for label, base, found, kept, nbytes in table:
        L.append(f"| {label} | {base} | {found} | {kept} | {nbytes / 1e6:.2f} |")
    L += ["", "Kept: UTF-8, 200 characters .. 256 KiB, exact duplicates once; man pages with their groff markup stripped.",
          f"Held out by document: sha256(name) mod {HELDOUT_MOD} == 0 (name = source label / path under it).",
          f"Documents: {counts['train_docs']} training, {counts['heldout_docs']} held out; chat examples (a documented",
          f"function of a training file: signature + docstring as the user turn, its source as the assistant turn):",
          f"{counts['chats']} (each {args.chat_repeat} time(s) in the training stream); tokens: {info['train_tokens'] / 1e6:.2f} M training, {info['heldout_tokens'] / 1e6:.3f} M held out.",
          "", "## Tokenizer", "",
          f"Byte-level BPE trained with `tokenizers` on the training documents: NFC, the Qwen3.5 split regex +",
          f"ByteLevel(use_regex false); ids 0..{BPE_VOCAB - 1} BPE, then " +
          ", ".join(f"{c} {BPE_VOCAB + i}" for i, (c, _) in enumerate(ADDED)) + " (the mask token, last).",
          "The chat template is tests/data/chat_templates/qwen3_5_think.jinja; eos ids: <|im_end|>, <|endoftext|>.",
          "", "## Model and training", "",
          f"Qwen3_5ForCausalLM: hidden 256, 4 layers (3 GatedDeltaNet + 1 gated attention), intermediate 512, "
          f"vocab {VOCAB}, untied, {info['params'] / 1e6:.2f} M parameters, saved in bf16.",
          f"Seed {args.seed}; {info['steps']} steps of {info['batch']} x {info['seq_len']} tokens on {info['device']} "
          f"({info['seconds']:.0f} s), AdamW lr {info['lr']} (100 warm-up steps, cosine to 10%), weight decay 0.1,",
          f"betas (0.9, 0.95), grad clip 1.0, bf16 autocast. Passes over the training tokens: "
          f"{info['steps'] * info['batch'] * info['seq_len'] / info['train_tokens']:.1f}.",
          f"Kept: step {info['best_step']}, the lowest held-out loss {info['best_heldout']:.4f} (64 windows of "
          f"{info['seq_len']} tokens of held-out documents); last step {info['last'][0]}: train {info['last'][3]:.4f}, "
          f"held-out {info['last'][4]:.4f}. Every evaluation: train_log.csv.", "",
          "## Prompts", "",
          f"prompts_train.jsonl ({counts['prompts_train']} rows) and prompts_heldout.jsonl ({counts['prompts_heldout']} rows:"
          " 48 chat, 48 code, 32 prose where there are that many) come from disjoint documents (`doc`); in each, the"
          " chat rows come first, then code, then prose. prompts_code.jsonl holds the code rows of prompts_train.jsonl"
          " (the demo's prompts, configs/text.yaml).",
          "Kinds: `chat` ({\"messages\": [user turn]}), `code` ({\"text\": a function's def line(s) and docstring}),"
          " `prose` ({\"text\": the opening of a paragraph}).", "", "## Greedy samples (held-out prompts)", ""]
    for kind, prompt, out in samples:
        L += [f"{kind} prompt:", "```", prompt.rstrip(), "```", "continuation (greedy, 80 tokens):", "```", out.rstrip(), "```", ""]
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(L))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "configs", "text-target"))
    ap.add_argument("--golden", help="also write the golden data of tests/test_text_target.cpp here")
    ap.add_argument("--prompt-ids", help="also write the prompts tokenized here (JSONL for dflash_data convert)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, help="training steps (default: as many as --train-seconds allows)")
    ap.add_argument("--train-seconds", type=float, default=240)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--pip-packages", action="store_true", help="add the pip-installed Python packages to the corpus")
    ap.add_argument("--chat-repeat", type=int, default=1,
                    help="each training chat example this many times in the training stream (the chat format learned)")
    ap.add_argument("--max-train-prompts", type=int, default=0,
                    help="at most this many training prompt rows, each kind cut in proportion (0: all)")
    ap.add_argument("--max-docstring", type=int, default=MAX_DOCSTRING, help="longest docstring of a chat example")
    args = ap.parse_args()
    globals()["MAX_DOCSTRING"] = args.max_docstring
    import torch
    import transformers
    import tokenizers
    if args.threads:
        torch.set_num_threads(args.threads)
    versions = (f"Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
                f"tokenizers {tokenizers.__version__}")
    log(versions)
    os.makedirs(args.out, exist_ok=True)
    docs, table = collect_corpus(args.pip_packages)
    train_docs = [d for d in docs if not heldout(d[0])]
    held_docs = [d for d in docs if heldout(d[0])]
    log(f"corpus: {len(train_docs)} training documents, {len(held_docs)} held out")
    chats, prompts = make_examples_and_prompts(docs, args.seed)
    log(f"chat examples: {len(chats['train'])} training, {len(chats['heldout'])} held out; prompts: "
        f"{len(prompts['train'])} training, {len(prompts['heldout'])} held out")
    tok = train_tokenizer([d[2] for d in train_docs], args.out)
    # The template as transformers renders it equals render_chat (the chat examples use render_chat).
    render = chat_renderer(args.out)
    msgs = [{"role": "user", "content": "Write f.\n"}, {"role": "assistant", "content": "def f():\n    pass\n"}]
    assert render(msgs, False) == render_chat("Write f.", "def f():\n    pass"), repr(render(msgs, False))
    assert render(msgs[:1], True) == render_chat("Write f."), repr(render(msgs[:1], True))
    if args.max_train_prompts and len(prompts["train"]) > args.max_train_prompts:
        # The first rows of each kind (each kind is in shuffled order), in proportion: the list stays chat, code, prose.
        frac = args.max_train_prompts / len(prompts["train"])
        cut = []
        for kind in ("chat", "code", "prose"):
            rows = [p for p in prompts["train"] if p["kind"] == kind]
            cut += rows[:int(len(rows) * frac)]
        log(f"prompts: {len(cut)} of {len(prompts['train'])} training rows kept (--max-train-prompts)")
        prompts["train"] = cut
    for split in ("train", "heldout"):
        with open(os.path.join(args.out, f"prompts_{split}.jsonl"), "w", encoding="utf-8") as f:
            for p in prompts[split]:
                f.write(json.dumps(p, ensure_ascii=False) + "\n")
    # The demo's prompt set (configs/text.yaml): the code rows of prompts_train.jsonl, in its order.
    with open(os.path.join(args.out, "prompts_code.jsonl"), "w", encoding="utf-8") as f:
        for p in prompts["train"]:
            if p["kind"] == "code":
                f.write(json.dumps(p, ensure_ascii=False) + "\n")
    if args.prompt_ids:
        os.makedirs(args.prompt_ids, exist_ok=True)
        for split in ("train", "heldout"):
            enc = tok.encode_batch([prompt_text(p) for p in prompts[split]], add_special_tokens=False)
            with open(os.path.join(args.prompt_ids, f"{split}.jsonl"), "w") as f, \
                 open(os.path.join(args.prompt_ids, f"{split}.kinds"), "w") as fk:
                for p, e in zip(prompts[split], enc):
                    f.write(json.dumps({"input_ids": e.ids, "loss_mask": [0] * len(e.ids)}) + "\n")
                    fk.write(p["kind"] + "\n")
    info = train_model(args, tok, [d[2] for d in train_docs] + chats["train"] * args.chat_repeat, [d[2] for d in held_docs] + chats["heldout"],
                       args.out)
    log(f"train: {json.dumps(info)}")
    m = load_f32(args.out)
    samples = []
    for kind in ("chat", "code", "prose"):
        p = next((p for p in prompts["heldout"] if p["kind"] == kind), None)
        if p is not None:
            samples.append((kind, prompt_text(p), greedy(m, tok, prompt_text(p), 80)))
            log(f"--- greedy {kind}:\n{prompt_text(p)}\n>>>\n{samples[-1][2]}")
    counts = dict(train_docs=len(train_docs), heldout_docs=len(held_docs), chats=len(chats["train"]),
                  prompts_train=len(prompts["train"]), prompts_heldout=len(prompts["heldout"]))
    write_readme(args.out, args, table, info, counts, samples, versions)
    if args.golden:
        write_golden(args.out, args.golden, tok, [d[2] for d in held_docs], prompts["heldout"])
    log("done")


if __name__ == "__main__":
    main()
