#!/usr/bin/env python3
"""Makes the Hugging Face golden data of dflash's CPU reference MoE target (qwen3_5_moe).

Runs on the GPU machine (torch 2.11, transformers 5.17) but computes on the CPU, in float32 and
again in float64, through transformers' own pure-torch code: the fla / causal_conv1d / kernels
packages are blocked (GatedDeltaNet and the router take their torch paths) and the experts run
their eager per-expert loop (`_experts_implementation = "eager"`).

One tiny random qwen3_5_moe_text model (4 layers, 3 GatedDeltaNet + 1 attention, 8 experts,
top-2, a shared expert behind its sigmoid gate), saved with save_pretrained in bf16.

Output (under OUT_DIR, default tests/data/hf_moe):
  tiny_moe/config.json, model.safetensors     the checkpoint, via save_pretrained (5.17 writes the
                                              experts one tensor each: mlp.experts.N.gate_proj.weight)
  tiny_moe/golden.safetensors                 per sequence length T (1, 37, 130):
      ids.T                i32 [T]       token ids
      layer.T.i            f32 [T, H]    output of decoder layer i (float32 run)
      exact.T.i            f32 [T, H]    the same from the float64 run, rounded to f32
      embed.T / final.T    f32 [T, H]    embeddings / after the final norm (float32 run)
      router.T.i.experts   i32 [T, k]    layer i's top-k experts per token, best first (float32 run)
      router.T.i.weights   f32 [T, k]    their renormalised weights (float32 run)
      router.T.i.logits    f32 [T, E]    the router logits (float32 run)
      router64.T.i.experts i32 [T, k]    the float64 run's choices
      router64.T.i.weights f32 [T, k]    the float64 run's weights, rounded to f32
  VERSIONS.json, checkpoint_names.txt         versions; the tensor names save_pretrained wrote

Usage: python3 tests/reference/make_golden_moe.py [OUT_DIR]
"""
import copy
import json
import os
import sys

for blocked in ("fla", "causal_conv1d", "kernels"):
    sys.modules[blocked] = None

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mq  # noqa: E402

SEQ_LENS = (1, 37, 130)

SPEC = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=24, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def eager_experts(model):
    """Pins the experts to transformers' eager per-expert loop, and says what is set."""
    for obj in (model.config,):
        try:
            obj._experts_implementation = "eager"
        except Exception as e:  # noqa: BLE001
            print("could not set config._experts_implementation:", repr(e))
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("eager")
        except Exception as e:  # noqa: BLE001
            print("set_experts_implementation('eager') failed:", repr(e))
    print("experts implementation:", getattr(model.config, "_experts_implementation", "<no attribute>"))


def randomize(model, gen):
    """Replaces HF's init (norm weights 0, tiny linears) by weights that exercise every term."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + 1.0)
            elif "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):  # router [E, H]: decisive choices (few near-ties)
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / p.shape[-1] ** 0.5))
            else:  # linear weights [out, in], experts [E, out, in]
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def run(model, ids):
    """Decoder-layer outputs, HF hidden_states, the final normed output, and each router's output."""
    outs, routes = [], []
    hooks = [layer.register_forward_hook(lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o)[0]))
             for layer in model.model.layers]
    hooks += [layer.mlp.gate.register_forward_hook(lambda m, a, o: routes.append(o)) for layer in model.model.layers]
    with torch.no_grad():
        res = model.model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    for h in hooks:
        h.remove()
    assert len(routes) == len(outs) == len(model.model.layers), (len(routes), len(outs))
    return outs, [h[0] for h in res.hidden_states], res.last_hidden_state[0], routes


def check_block_formula(model, ids):
    """The MoE block's output against the formula dflash implements, written out (float64 model)."""
    seen = []
    layer = model.model.layers[0]
    hook = layer.mlp.register_forward_hook(lambda m, a, o: seen.append((a[0][0], o[0] if o.dim() == 3 else o)))
    with torch.no_grad():
        model.model(input_ids=ids[None], use_cache=False)
        hook.remove()
        x, y = seen[0]
        mlp = layer.mlp
        p = torch.softmax(x @ mlp.gate.weight.T, dim=-1)
        w, idx = torch.topk(p, model.config.num_experts_per_tok, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        ref = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(idx.shape[1]):
                e = int(idx[t, j])
                g, u = (mlp.experts.gate_up_proj[e] @ x[t]).chunk(2)
                ref[t] += w[t, j] * (mlp.experts.down_proj[e] @ (torch.nn.functional.silu(g) * u))
        ref += torch.sigmoid(x @ mlp.shared_expert_gate.weight.T) * mlp.shared_expert(x)
    print(f"MoE block vs the written-out formula (f64, layer 0, T={x.shape[0]}): max rel diff "
          f"{((y - ref).abs().max() / ref.abs().max()).item():.3e}")


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "data", "hf_moe")
    os.makedirs(out_dir, exist_ok=True)
    for fn in (mq.torch_chunk_gated_delta_rule, mq.causal_conv1d_fn):
        print("reference path:", getattr(fn, "__module__", "?"), getattr(fn, "__qualname__", fn))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    seed = 4321
    cfg = Qwen3_5MoeTextConfig(**SPEC)
    cfg._attn_implementation = "eager"
    try:
        cfg._experts_implementation = "eager"
    except Exception as e:  # noqa: BLE001
        print("could not set cfg._experts_implementation:", repr(e))
    print("config:", {k: getattr(cfg, k, "<absent>") for k in (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "output_router_logits",
        "router_aux_loss_coef", "rope_parameters")})
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    eager_experts(model)
    gen = torch.Generator().manual_seed(seed)
    randomize(model, gen)
    model = model.to(torch.bfloat16)  # the checkpoint dtype defines the weights
    path = os.path.join(out_dir, "tiny_moe")
    model.save_pretrained(path, safe_serialization=True)
    names = []
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as s:
                for k in s.keys():
                    t = s.get_tensor(k)
                    names.append(f"{k} {list(t.shape)} {t.dtype}")
    with open(os.path.join(out_dir, "checkpoint_names.txt"), "w") as f:
        f.write("\n".join(sorted(names)) + "\n")
    print("saved tensors of layer 0:", [n for n in names if ".layers.0." in n])

    m32 = model.to(torch.float32)
    m32.config._attn_implementation = "eager"
    eager_experts(m32)
    # Module.to(dtype) rounds the RoPE inv_freq buffer too, which from_pretrained never does.
    m32.model.rotary_emb = mq.Qwen3_5MoeTextRotaryEmbedding(config=m32.config)
    m64 = copy.deepcopy(m32).to(torch.float64)

    try:
        check_block_formula(m64, torch.randint(0, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(1)))
    except Exception as e:  # noqa: BLE001
        print("block formula check FAILED:", repr(e))
    tensors, report = {}, {}
    for T in SEQ_LENS:
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen)
        ids[0] = cfg.vocab_size - 1
        tensors[f"ids.{T}"] = ids.to(torch.int32)
        l32, hs32, f32, r32 = run(m32, ids)
        l64, _, _, r64 = run(m64, ids)
        for i, (a, b) in enumerate(zip(l32, l64)):
            tensors[f"layer.{T}.{i}"] = a.float().clone()
            tensors[f"exact.{T}.{i}"] = b.float().clone()
        assert len(hs32) == len(l32) + 1
        for i in range(len(l32) - 1):
            assert torch.equal(hs32[i + 1], l32[i])
        assert torch.equal(hs32[-1], f32)
        tensors[f"embed.{T}"] = hs32[0].float().clone()
        tensors[f"final.{T}"] = f32.float().clone()
        same = 0
        for i, ((lg, w, e), (_, w64, e64)) in enumerate(zip(r32, r64)):
            tensors[f"router.{T}.{i}.experts"] = e.to(torch.int32).contiguous()
            tensors[f"router.{T}.{i}.weights"] = w.float().contiguous()
            tensors[f"router.{T}.{i}.logits"] = lg.float().contiguous()
            tensors[f"router64.{T}.{i}.experts"] = e64.to(torch.int32).contiguous()
            tensors[f"router64.{T}.{i}.weights"] = w64.float().contiguous()
            same += int(torch.equal(e, e64))
        rel = max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(l32, l64))
        report[T] = (rel, f"{same}/{len(r32)} layers route identically in f32 and f64")
    save_file(tensors, os.path.join(path, "golden.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    print(f"tiny_moe: saved {path}; HF float32 vs float64 max rel err per T: {report}")

    with open(os.path.join(out_dir, "VERSIONS.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__,
                   "script": "tests/reference/make_golden_moe.py",
                   "experts_implementation": str(getattr(m32.config, "_experts_implementation", None))}, f, indent=1)

    # What save_pretrained wrote is what from_pretrained reads back to the same model.
    try:
        back = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        back.config._attn_implementation = "eager"
        eager_experts(back)
        ids = tensors["ids.37"].long()
        lb, _, _, _ = run(back, ids)
        diff = max(((a - tensors[f"layer.37.{i}"]).abs().max() / tensors[f"layer.37.{i}"].abs().max()).item()
                   for i, a in enumerate(lb))
        print(f"from_pretrained round trip, T=37: max rel diff {diff:.3e}")
    except Exception as e:  # noqa: BLE001
        print("from_pretrained round trip FAILED:", repr(e))
        raise


if __name__ == "__main__":
    main()
