#!/usr/bin/env python3
"""Loads dflash drafter exports through transformers' AutoModel (trust_remote_code=True) and
compares what the loaded module computes with what dflash's CPU reference drafter computed.

Usage: check_automodel.py [--dump BIN] [--zlab MODEL_PY] [--out RESULT_JSON] WORK_DIR

  --dump BIN     run dump_drafter_logits BIN WORK_DIR first (tests/dump_drafter_logits.cpp)
  --zlab FILE    also load the full-attention export with z-lab's DFlashDraftModel from FILE
                 (z-lab/dflash's dflash/model.py; not part of dflash) and compare it the same way
  --out FILE     write every measured number as JSON

WORK_DIR/<variant>/ holds an export (drafter/) and reference.safetensors (inputs, dflash's
final hidden states and logits in float64); variants: 'mixed' (sliding + full layers) and 'full'.
Checks, each with its bound on max|logits - dflash's| / max|dflash's logits| over a variant:
  float64 load, one block per call (z-lab's calling convention) ............ 1e-10
  float64 load, sequence 0's context fed piece by piece through a DynamicCache 1e-10
  float64 load, input_ids + embed_tokens instead of noise_embedding ......... 1e-10
  float64 load, all blocks in one batch, contexts left-padded + attention_mask 1e-10
  float32 load ............................................................. 1e-4
  bfloat16 load (dtype='auto', the checkpoint's) ........................... 5e-2
  z-lab's module, float32, full-attention export ........................... 1e-4
    (z-lab's forward gets no mask, so its sliding layers attend like full ones: mixed is not compared)
  spec_generate on a random tiny Qwen3 target, float64: equals target.generate greedy, token for token,
    with the drafter as exported (drafts rejected) and with drafts accepted in part
Exit status 0 when every check passes, 1 when one fails, 77 (skip) when torch or transformers is
missing (as in CI).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys

SKIP = 77
try:
    import torch
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoModel, DynamicCache
except Exception as e:  # noqa: BLE001 - any missing piece means this machine cannot run the check
    print(f"check_automodel: skipped: {e}")
    sys.exit(SKIP)

BOUNDS = {"f64": 1e-10, "f64_cache": 1e-10, "f64_input_ids": 1e-10, "f64_batched": 1e-10, "f32": 1e-4, "bf16": 5e-2, "zlab_f32": 1e-4}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).abs().max() / want.abs().max())


class Reference:
    def __init__(self, variant_dir):
        r = load_file(os.path.join(variant_dir, "reference.safetensors"))
        self.dir = os.path.join(variant_dir, "drafter")
        self.cfg = json.load(open(os.path.join(self.dir, "config.json")))
        self.B = self.cfg["block_size"]
        self.mask = self.cfg["dflash_config"]["mask_token_id"]
        self.context, self.tokens = r["context"], r["tokens"].long()
        self.offsets, self.blocks = r["offsets"].tolist(), r["blocks"].tolist()
        self.embed, self.lm_head, self.logits = r["embed_tokens"], r["lm_head"], r["logits"]

    def block_ids(self, s, a):
        return torch.tensor([int(self.tokens[self.offsets[s] + a])] + [self.mask] * (self.B - 1))

    def want(self, i):
        return self.logits[i * self.B:(i + 1) * self.B]


def run_blocks(model, ref, dtype, mode="noise"):
    """Logits of every block, one call each: context = the sequence's rows before the anchor."""
    out = []
    embed = torch.nn.Embedding.from_pretrained(ref.embed.to(DEVICE, dtype))
    for s, a in ref.blocks:
        o = ref.offsets[s]
        ctx = ref.context[o:o + a].to(DEVICE, dtype)[None]
        ids = ref.block_ids(s, a).to(DEVICE)[None]
        pos = torch.arange(0, a + ref.B, device=DEVICE)[None]
        with torch.no_grad():
            if mode == "input_ids":
                h = model(position_ids=pos, input_ids=ids, embed_tokens=embed, target_hidden=ctx)
            else:
                h = model(position_ids=pos, noise_embedding=embed(ids), target_hidden=ctx)
        out.append(h[0].double().cpu() @ ref.lm_head.double().T)
    return torch.cat(out)


def run_batched(model, ref, dtype):
    """Every block in one call of batch size nb: contexts of different lengths left-padded to the
    longest, the padding masked by a [nb, keys] attention_mask (1 = a real key)."""
    C = max(a for _, a in ref.blocks)
    nb, H = len(ref.blocks), ref.embed.shape[1]
    ctx = torch.zeros(nb, C, ref.context.shape[1], dtype=dtype)
    pos = torch.zeros(nb, C + ref.B, dtype=torch.long)
    keep = torch.zeros(nb, C + ref.B, dtype=torch.long)
    ids = torch.stack([ref.block_ids(s, a) for s, a in ref.blocks])
    for i, (s, a) in enumerate(ref.blocks):
        o = ref.offsets[s]
        ctx[i, C - a:] = ref.context[o:o + a].to(dtype)
        pos[i, C - a:] = torch.arange(0, a + ref.B)
        keep[i, C - a:] = 1
    with torch.no_grad():
        h = model(position_ids=pos.to(DEVICE), attention_mask=keep.to(DEVICE), target_hidden=ctx.to(DEVICE),
                  noise_embedding=ref.embed.to(DEVICE, dtype)[ids.to(DEVICE)])
    assert h.shape == (nb, ref.B, H)
    return h.double().cpu().reshape(nb * ref.B, H) @ ref.lm_head.double().T


def run_cache(model, ref, dtype):
    """Sequence 0's blocks in anchor order with z-lab's cache protocol: each call gets the context
    rows not yet cached, then the cache is cropped back to the anchor (the module's crop_cache)."""
    crop_cache = sys.modules[type(model).__module__].crop_cache
    cache, done, got, want = DynamicCache(), 0, [], []
    embed = ref.embed.to(DEVICE, dtype)
    for i, (s, a) in enumerate(ref.blocks):
        if s != 0:
            continue
        ctx = ref.context[done:a].to(DEVICE, dtype)[None]
        pos = torch.arange(done, a + ref.B, device=DEVICE)[None]
        with torch.no_grad():
            h = model(position_ids=pos, noise_embedding=embed[ref.block_ids(s, a).to(DEVICE)][None], target_hidden=ctx,
                      past_key_values=cache, use_cache=True)
        crop_cache(cache, a)
        done = a
        got.append(h[0].double().cpu() @ ref.lm_head.double().T)
        want.append(ref.want(i))
    return torch.cat(got), torch.cat(want)


def load_automodel(path, dtype):
    model = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=dtype).to(DEVICE).eval()
    name = type(model).__name__
    module = type(model).__module__
    if name != "DFlashDraftModel" or not module.endswith("modeling_dflash"):
        raise RuntimeError(f"AutoModel gave {module}.{name}, expected modeling_dflash.DFlashDraftModel")
    return model


def load_zlab(model_py, path):
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", model_py)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.DFlashDraftModel.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()


def run_zlab(model, ref):
    out = []
    embed = ref.embed.to(DEVICE, torch.float32)
    for s, a in ref.blocks:
        o = ref.offsets[s]
        ctx = ref.context[o:o + a].to(DEVICE, torch.float32)[None]
        pos = torch.arange(0, a + ref.B, device=DEVICE)[None]
        with torch.no_grad():
            h = model(position_ids=pos, noise_embedding=embed[ref.block_ids(s, a).to(DEVICE)][None], target_hidden=ctx,
                      attention_mask=None, past_key_values=None, use_cache=False, is_causal=False)
        out.append(h[0].double().cpu() @ ref.lm_head.double().T)
    return torch.cat(out)


def check_spec_generate(ref, results):
    """Greedy speculative decoding with the export on a random tiny Qwen3 target equals the
    target's own greedy decoding, in two settings:
      random   the drafter as exported (not trained for this target): drafts are rejected
      biased   the drafter's final norm zeroed, so every draft is token 0 (the argmax of all-zero
               logits), and the target's lm_head row 0 scaled until about half of its greedy tokens
               are 0: blocks are accepted in part, so rollback (cache crops, features of the
               accepted rows) is exercised
    Float64, so a near-tie cannot flip an argmax between the T = 1 and the T = B target forwards."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = ref.cfg
    torch.manual_seed(1202)
    tcfg = Qwen3Config(hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_target_layers"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                       vocab_size=cfg["vocab_size"], max_position_embeddings=4096, tie_word_embeddings=False,
                       eos_token_id=None, bos_token_id=None, pad_token_id=0)
    target = Qwen3ForCausalLM(tcfg).to(DEVICE, torch.float64).eval()
    drafter = load_automodel(ref.dir, torch.float64)
    prompt = torch.randint(0, cfg["vocab_size"] - 1, (1, 9), device=DEVICE)
    n = 40

    def greedy():
        with torch.no_grad():
            return target.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    def run(name):
        want = greedy()
        got, acc = drafter.spec_generate(target, prompt, max_new_tokens=n, return_acceptance=True)
        same = got.shape == want.shape and bool((got == want).all())
        results.setdefault("spec_generate", {})[name] = {"equal": same, "new_tokens": n, "steps": len(acc),
                                                         "accepted": acc}
        print(f"spec_generate {name}: equals target greedy: {same}; accepted per step {acc}")
        return same, acc

    ok, _ = run("random")
    with torch.no_grad():
        drafter.norm.weight.zero_()
        row0 = target.lm_head.weight[0].clone()
        for scale in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
            target.lm_head.weight[0] = row0 * scale
            if (greedy()[0, prompt.shape[1]:] == 0).float().mean() >= 0.4:
                break
    same, acc = run("biased")
    partial = any(1 < a < ref.B for a in acc)
    results["spec_generate"]["biased"]["partial_acceptance_seen"] = partial
    if not partial:
        print("spec_generate biased: no block was accepted in part (rollback not exercised) FAIL")
    return ok and same and partial


def crop_zero_keeps_cache():
    """What this transformers does with DynamicCache.crop(0) (why the module crops by a negative count)."""
    c = DynamicCache()
    c.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), 0)
    c.crop(0)
    return c.get_seq_length()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work_dir")
    ap.add_argument("--dump")
    ap.add_argument("--zlab")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.dump:
        subprocess.run([args.dump, args.work_dir], check=True)
    results = {"torch": torch.__version__, "transformers": transformers.__version__, "device": DEVICE,
               "bounds": BOUNDS, "variants": {}}
    ok = True

    def record(variant, key, err):
        nonlocal ok
        passed = err <= BOUNDS[key]
        ok = ok and passed
        results["variants"].setdefault(variant, {})[key] = {"max_rel_err": err, "bound": BOUNDS[key], "pass": passed}
        print(f"{variant:6s} {key:14s} max|diff|/max|ref| = {err:.3e}  (bound {BOUNDS[key]:.0e}) "
              f"{'ok' if passed else 'FAIL'}")

    for variant in ("mixed", "full"):
        ref = Reference(os.path.join(args.work_dir, variant))
        m64 = load_automodel(ref.dir, torch.float64)
        record(variant, "f64", rel_err(run_blocks(m64, ref, torch.float64), ref.logits))
        got, want = run_cache(m64, ref, torch.float64)
        record(variant, "f64_cache", rel_err(got, want))
        record(variant, "f64_input_ids", rel_err(run_blocks(m64, ref, torch.float64, "input_ids"), ref.logits))
        record(variant, "f64_batched", rel_err(run_batched(m64, ref, torch.float64), ref.logits))
        m32 = load_automodel(ref.dir, torch.float32)
        record(variant, "f32", rel_err(run_blocks(m32, ref, torch.float32), ref.logits))
        m16 = load_automodel(ref.dir, "auto")
        dt = next(m16.parameters()).dtype
        results["variants"][variant]["auto_dtype"] = str(dt)
        if dt != torch.bfloat16:
            print(f"{variant}: dtype='auto' loaded {dt}, expected torch.bfloat16 (config.json dtype) FAIL")
            ok = False
        record(variant, "bf16", rel_err(run_blocks(m16, ref, torch.bfloat16), ref.logits))
        if args.zlab and variant == "full":
            try:
                z = load_zlab(args.zlab, ref.dir)
            except Exception as e:  # noqa: BLE001 - z-lab's code may not import on this transformers
                results["zlab"] = f"not run: loading z-lab's module failed: {type(e).__name__}: {e}"
                print(results["zlab"])
            else:
                record(variant, "zlab_f32", rel_err(run_zlab(z, ref), ref.logits))
    results["dynamic_cache_len_after_crop0_of_3"] = crop_zero_keeps_cache()
    print(f"DynamicCache of 3 positions after crop(0): {results['dynamic_cache_len_after_crop0_of_3']} positions")
    ok = check_spec_generate(Reference(os.path.join(args.work_dir, "mixed")), results) and ok
    results["pass"] = ok
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print("check_automodel:", "all checks passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
