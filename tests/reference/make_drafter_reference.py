#!/usr/bin/env python3
"""An independent PyTorch implementation of the DFlash drafter step (forward + decay-weighted
loss, gradients by autograd) on fixed inputs, for dflash's C++ drafter to match.

Written from the DFlash description (issue 6 / z-lab's DFlashDraftModel), not from dflash's C++:
  ctx = hidden_norm(fc(target hidden states of target_layer_ids))        (plain RMSNorm x̂·w)
  block input = embed([anchor token, mask × (B-1)])
  Qwen3 layers (plain RMSNorm pre-norm, q/k norm per head, full-head neox RoPE, GQA); queries from
  the block only, keys/values = [k/v(ctx) ; k/v(block)] with the same projections
  mask (query j of the block anchored at a): context keys at positions < a; own-block keys: all on
  full_attention layers, offsets <= j on sliding_attention layers; sliding layers also keep only
  keys at positions >= a + j - (window - 1); never keys of another block or sequence
  labels: block position k = 1..B-1 predicts token a + k, weight [a+k < S]·loss_mask[a+k]·exp(-(k-1)/γ)
  loss = Σ w·CE / Σ w, logits through the frozen lm_head; embeddings and lm_head get no gradient.

Runs in float64 on the CPU. Output (OUT_DIR, default tests/data/drafter_ref):
  config.json, model.safetensors   the drafter (z-lab names, float64) as dflash imports it
  reference.safetensors            context, tokens, loss_mask, offsets, blocks (seq, anchor),
                                   embed_tokens, lm_head, loss, grad.<tensor name>, grad.context
Usage: python3 tests/reference/make_drafter_reference.py [OUT_DIR]
"""
import json
import math
import os
import sys

import torch
from safetensors.torch import save_file

torch.set_default_dtype(torch.float64)
G = torch.Generator().manual_seed(20261130)

CFG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
           intermediate_size=48, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=61, block_size=4,
           layer_types=["full_attention", "sliding_attention"], sliding_window=6,
           dflash_config={"mask_token_id": 60, "target_layer_ids": [1, 4, 7]}, num_target_layers=10)
GAMMA = 7.0
H, L, NH, NKV, D, I, V, B = (CFG[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "num_key_value_heads", "head_dim", "intermediate_size",
                                             "vocab_size", "block_size"))
K = len(CFG["dflash_config"]["target_layer_ids"])
MASK = CFG["dflash_config"]["mask_token_id"]


def randn(*shape, std=1.0):
    return (torch.randn(*shape, generator=G) * std).requires_grad_(True)


def params():
    p = {"fc.weight": randn(H, K * H, std=(K * H) ** -0.5)}
    for i in range(L):
        q = f"layers.{i}."
        p[q + "self_attn.q_proj.weight"] = randn(NH * D, H, std=H ** -0.5)
        p[q + "self_attn.k_proj.weight"] = randn(NKV * D, H, std=H ** -0.5)
        p[q + "self_attn.v_proj.weight"] = randn(NKV * D, H, std=H ** -0.5)
        p[q + "self_attn.o_proj.weight"] = randn(H, NH * D, std=(NH * D) ** -0.5)
        p[q + "mlp.gate_proj.weight"] = randn(I, H, std=H ** -0.5)
        p[q + "mlp.up_proj.weight"] = randn(I, H, std=H ** -0.5)
        p[q + "mlp.down_proj.weight"] = randn(H, I, std=I ** -0.5)
        for n, dim in (("self_attn.q_norm.weight", D), ("self_attn.k_norm.weight", D),
                       ("input_layernorm.weight", H), ("post_attention_layernorm.weight", H)):
            p[q + n] = (1 + 0.1 * torch.randn(dim, generator=G)).requires_grad_(True)
    for n in ("hidden_norm.weight", "norm.weight"):
        p[n] = (1 + 0.1 * torch.randn(H, generator=G)).requires_grad_(True)
    return p


def rms(x, w, eps=CFG["rms_norm_eps"]):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos):  # x [T, heads, D], neox halves over the full head dim
    half = D // 2
    inv = CFG["rope_theta"] ** (-torch.arange(0, half, dtype=torch.float64) * 2 / D)
    ang = pos[:, None].double() * inv[None, :]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def allowed(sliding, a, j, key_in_block, key):  # key: context position or block offset
    qpos, kpos = a + j, (a + key if key_in_block else key)
    if key_in_block:
        if sliding and key > j:
            return False
    elif kpos >= a:  # strictly before the anchor
        return False
    if sliding and kpos < qpos - (CFG["sliding_window"] - 1):
        return False
    return True


def step(p, context, tokens, loss_mask, offsets, blocks, embed, lm_head):
    ctx_all = rms(context @ p["fc.weight"].T, p["hidden_norm.weight"])
    total_wce, total_w = 0.0, 0.0
    for s, a in blocks:
        o0, o1 = offsets[s], offsets[s + 1]
        S = o1 - o0
        ctx = ctx_all[o0:o1]
        ids = torch.tensor([tokens[o0 + a]] + [MASK] * (B - 1))
        h = embed[ids]
        cpos, bpos = torch.arange(S), torch.arange(a, a + B)
        for i in range(L):
            q_ = f"layers.{i}."
            sliding = CFG["layer_types"][i] == "sliding_attention"
            x = rms(h, p[q_ + "input_layernorm.weight"])
            q = rope(rms((x @ p[q_ + "self_attn.q_proj.weight"].T).view(B, NH, D), p[q_ + "self_attn.q_norm.weight"]), bpos)
            kc = rope(rms((ctx @ p[q_ + "self_attn.k_proj.weight"].T).view(S, NKV, D), p[q_ + "self_attn.k_norm.weight"]), cpos)
            kb = rope(rms((x @ p[q_ + "self_attn.k_proj.weight"].T).view(B, NKV, D), p[q_ + "self_attn.k_norm.weight"]), bpos)
            vc = (ctx @ p[q_ + "self_attn.v_proj.weight"].T).view(S, NKV, D)
            vb = (x @ p[q_ + "self_attn.v_proj.weight"].T).view(B, NKV, D)
            keys, vals = torch.cat([kc, kb]), torch.cat([vc, vb])
            allow = torch.tensor([[allowed(sliding, a, j, t >= S, t - S if t >= S else t) for t in range(S + B)]
                                  for j in range(B)])
            outs = []
            for hh in range(NH):
                g = hh // (NH // NKV)
                sc = (q[:, hh] @ keys[:, g].T) / math.sqrt(D)
                sc = sc.masked_fill(~allow, float("-inf"))
                outs.append(torch.softmax(sc, dim=-1) @ vals[:, g])
            h = h + torch.cat(outs, dim=-1) @ p[q_ + "self_attn.o_proj.weight"].T
            y = rms(h, p[q_ + "post_attention_layernorm.weight"])
            act = torch.nn.functional.silu(y @ p[q_ + "mlp.gate_proj.weight"].T) * (y @ p[q_ + "mlp.up_proj.weight"].T)
            h = h + act @ p[q_ + "mlp.down_proj.weight"].T
        logits = rms(h, p["norm.weight"]) @ lm_head.T
        for k in range(1, B):
            t = a + k
            if t >= S:
                continue
            w = float(loss_mask[o0 + t]) * math.exp(-(k - 1) / GAMMA)
            if w == 0:
                continue
            ce = torch.nn.functional.cross_entropy(logits[k][None], torch.tensor([tokens[o0 + t]]))
            total_wce = total_wce + w * ce
            total_w += w
    return total_wce / total_w


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "data", "drafter_ref")
    os.makedirs(out_dir, exist_ok=True)
    lens = [20, 11]
    offsets = [0, 20, 31]
    N = offsets[-1]
    tokens = torch.randint(0, V - 1, (N,), generator=G)
    loss_mask = (torch.rand(N, generator=G) > 0.25).to(torch.uint8)
    loss_mask[0:3] = 0
    blocks = [(0, 3), (0, 9), (0, 17), (1, 2), (1, 8)]  # includes blocks running past the end
    context = torch.randn(N, K * H, generator=G).requires_grad_(True)
    embed = torch.randn(V, H, generator=G)
    lm_head = torch.randn(V, H, generator=G) * H ** -0.5
    p = params()
    loss = step(p, context, tokens.tolist(), loss_mask.tolist(), offsets, blocks, embed, lm_head)
    loss.backward()
    ref = {"context": context.detach(), "tokens": tokens.to(torch.int32), "loss_mask": loss_mask,
           "offsets": torch.tensor(offsets, dtype=torch.int64), "blocks": torch.tensor(blocks, dtype=torch.int64),
           "embed_tokens": embed, "lm_head": lm_head, "loss": loss.detach().reshape(1),
           "grad.context": context.grad}
    for n, t in p.items():
        ref["grad." + n] = t.grad
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out_dir, "reference.safetensors"),
              metadata={"gamma": str(GAMMA), "torch": torch.__version__})
    save_file({n: t.detach().contiguous() for n, t in p.items()}, os.path.join(out_dir, "model.safetensors"))
    cfg = dict(CFG, architectures=["DFlashDraftModel"], model_type="qwen3", max_position_embeddings=4096,
               use_sliding_window=True)  # transformers reads the window as None without it
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(f"loss {loss.item():.12f}; wrote {out_dir}")


if __name__ == "__main__":
    main()
