#!/usr/bin/env python3
"""Makes the Hugging Face golden data that keeps dflash's CPU reference honest.

Runs on the GPU machine (torch 2.11, transformers 5.17) but computes on the CPU in float32 with
transformers' own pure-torch Qwen3.5 code (the fla / causal-conv1d kernel packages are blocked
so the reference path is the one that runs), plus a float64 run of the same models for measuring
how far float32 itself is from exact.

Output (under OUT_DIR, default tests/data/hf):
  <name>/config.json, model*.safetensors[, index]   the checkpoint, via save_pretrained
  <name>/golden.safetensors                         per sequence length T:
      ids.T          i32 [T]       token ids
      layer.T.i      f32 [T, H]    output of decoder layer i (float32 run)
      exact.T.i      f32 [T, H]    the same from the float64 run, rounded to f32
      embed.T        f32 [T, H]    output_hidden_states[0] (the embeddings)
      final.T        f32 [T, H]    after the final norm
  gdn_ops.safetensors     inputs/outputs of torch_chunk_gated_delta_rule and
                          torch_recurrent_gated_delta_rule (GVA, initial state, final state)

Usage: python3 tests/reference/make_golden.py [OUT_DIR]
"""
import json
import os
import sys

# Block the optional kernel packages before transformers looks for them.
for blocked in ("fla", "causal_conv1d", "kernels"):
    sys.modules[blocked] = None

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as mq  # noqa: E402

SEQ_LENS = (1, 37, 130)

CONFIGS = {
    # Hv/Hk = 2, dk != dv, conv kernel 4, 1 full-attention layer in 4, bf16 checkpoint.
    "tiny_a": dict(
        vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        rms_norm_eps=1e-6, partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        save_dtype="bfloat16", shard=None,
    ),
    # Hv/Hk = 3, GQA 4, conv kernel 3, mixed layer pattern, f16 sharded checkpoint.
    "tiny_b": dict(
        vocab_size=500, hidden_size=128, intermediate_size=208, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=3,
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "linear_attention", "full_attention", "linear_attention"],
        rms_norm_eps=1e-5, partial_rotary_factor=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
        save_dtype="float16", shard="700KB",
    ),
}


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
            else:  # linear weights [out, in]
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def run(model, ids):
    """Returns raw decoder-layer outputs (hooks), HF hidden_states and the final normed output."""
    outs = []
    hooks = [layer.register_forward_hook(lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o)[0]))
             for layer in model.model.layers]
    with torch.no_grad():
        res = model.model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    for h in hooks:
        h.remove()
    hs = [h[0] for h in res.hidden_states]
    return outs, hs, res.last_hidden_state[0]


def make_model(name, spec, out_dir, seed):
    spec = dict(spec)
    save_dtype, shard = spec.pop("save_dtype"), spec.pop("shard")
    cfg = Qwen3_5TextConfig(**spec)
    cfg._attn_implementation = "eager"
    want = spec["rope_parameters"]["partial_rotary_factor"]
    got = cfg.rope_parameters.get("partial_rotary_factor")
    print(f"{name}: rope_parameters {cfg.rope_parameters} (wanted partial_rotary_factor {want})")
    if got != want:
        print(f"WARNING {name}: transformers set partial_rotary_factor {got}; config.json records it")
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    randomize(model, gen)
    # The checkpoint dtype defines the weights: round once, then compute from the rounded values.
    model = model.to(getattr(torch, save_dtype))
    path = os.path.join(out_dir, name)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    m32 = model.to(torch.float32)
    m32.config._attn_implementation = "eager"
    # Module.to(dtype) also rounds the RoPE inv_freq buffer to the checkpoint dtype, which
    # from_pretrained never does (it is built in float32): rebuild it so the golden data has the
    # float32 frequencies a real load uses.
    m32.model.rotary_emb = mq.Qwen3_5TextRotaryEmbedding(config=m32.config)
    import copy
    m64 = copy.deepcopy(m32).to(torch.float64)
    tensors = {}
    report = {}
    for T in SEQ_LENS:
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen)
        ids[0] = cfg.vocab_size - 1  # the largest valid id is exercised
        tensors[f"ids.{T}"] = ids.to(torch.int32)
        l32, hs32, f32 = run(m32, ids)
        l64, _, f64 = run(m64, ids)
        for i, (a, b) in enumerate(zip(l32, l64)):
            tensors[f"layer.{T}.{i}"] = a.float().clone()
            tensors[f"exact.{T}.{i}"] = b.float().clone()
        # transformers' hidden_states[i + 1] is layer i's output except the last entry, which is
        # taken after the final norm: check that here so the tests need only the layer outputs.
        assert len(hs32) == len(l32) + 1
        for i in range(len(l32) - 1):
            assert torch.equal(hs32[i + 1], l32[i])
        assert torch.equal(hs32[-1], f32)
        tensors[f"embed.{T}"] = hs32[0].float().clone()
        tensors[f"final.{T}"] = f32.float().clone()
        rel = max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(l32, l64))
        report[T] = rel
    save_file(tensors, os.path.join(path, "golden.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    print(f"{name}: saved {path}; HF float32 vs float64 max rel err per T: {report}")


def make_gdn_ops(out_dir, seed):
    """Direct op-level golden data for the delta rule: GVA (Hv = 2 Hk), an initial state, T = 130."""
    g = torch.Generator().manual_seed(seed)
    B, T, Hk, Hv, dk, dv = 2, 130, 2, 4, 16, 24
    q = torch.randn(B, T, Hk, dk, generator=g)
    k = torch.randn(B, T, Hk, dk, generator=g)
    v = torch.randn(B, T, Hv, dv, generator=g)
    gate = -torch.rand(B, T, Hv, generator=g) * 2.0  # log-decay <= 0
    beta = torch.rand(B, T, Hv, generator=g)
    s0 = torch.randn(B, Hv, dk, dv, generator=g) * 0.3
    # Value head j reads key head j // (Hv / Hk): repeat q/k explicitly (older transformers ops
    # expect equal head counts; the saved q/k stay un-repeated, as dflash's ops take them).
    qr, kr = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
    oc, sc = mq.torch_chunk_gated_delta_rule(qr, kr, v, g=gate, beta=beta, initial_state=s0,
                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    orr, sr = mq.torch_recurrent_gated_delta_rule(qr, kr, v, g=gate, beta=beta, initial_state=s0,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    o64, s64 = mq.torch_recurrent_gated_delta_rule(qr.double(), kr.double(), v.double(), g=gate.double(),
                                                   beta=beta.double(), initial_state=s0.double(),
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    save_file({"q": q, "k": k, "v": v, "g": gate, "beta": beta, "initial_state": s0,
               "out_chunk": oc.contiguous(), "state_chunk": sc.contiguous(),
               "out_recurrent": orr.contiguous(), "state_recurrent": sr.contiguous(),
               "out_f64": o64.contiguous(), "state_f64": s64.contiguous()},
              os.path.join(out_dir, "gdn_ops.safetensors"),
              metadata={"note": "q/k are NOT l2-normalized: the op normalizes them (use_qk_l2norm_in_kernel)"})
    print("gdn_ops: chunk vs f64", ((oc.double() - o64).abs().max() / o64.abs().max()).item())


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "data", "hf")
    os.makedirs(out_dir, exist_ok=True)
    for fn in (mq.torch_chunk_gated_delta_rule, mq.torch_recurrent_gated_delta_rule, mq.causal_conv1d_fn):
        print("reference path:", getattr(fn, "__module__", "?"), getattr(fn, "__qualname__", fn))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    for i, (name, spec) in enumerate(CONFIGS.items()):
        make_model(name, spec, out_dir, seed=1234 + i)
    make_gdn_ops(out_dir, seed=99)
    with open(os.path.join(out_dir, "VERSIONS.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__,
                   "script": "tests/reference/make_golden.py"}, f, indent=1)


if __name__ == "__main__":
    main()
