"""dflash's PyTorch DFlash drafter, for transformers' AutoModel.

Every drafter export of dflash (drafter::export_hf) carries this file; its config.json maps
AutoModel to it, so

    from transformers import AutoModel
    drafter = AutoModel.from_pretrained(export_dir, trust_remote_code=True)

gives a DFlashDraftModel with the interface of z-lab's published drafters:

    hidden = drafter(position_ids=positions, noise_embedding=target.model.embed_tokens(block_ids),
                     target_hidden=features, past_key_values=cache, use_cache=True)
    logits = target.lm_head(hidden)

  target_hidden    [b, C, k*H]  the target's hidden states after the decoder layers
                                dflash_config.target_layer_ids (transformers' hidden_states[id + 1]),
                                concatenated, for the C context tokens not yet in `past_key_values`
  noise_embedding  [b, B, H]    the target's embeddings of [anchor token, mask x (B - 1)]
                                (or input_ids [b, B] with embed_tokens, the target's embedding)
  position_ids     [b, C + B]   positions of those context tokens, then of the block
  attention_mask   optional [b, cached + C + B] key padding mask (1 = a real key), for batches
                   of contexts of different lengths (left-padded)
  past_key_values  a transformers Cache holding the context keys/values of earlier calls; the
                   caller crops it back to the context after each call: crop_cache(cache, anchor)
                   of this file (z-lab's loop calls cache.crop(anchor), which transformers 5.17
                   deprecates and which keeps everything for anchor 0)
  returns          [b, B, H]    the final-normed hidden states; row j predicts the token at
                                anchor + j (row 0 is the anchor itself)

The math is dflash's drafter; its CPU reference is drafter/model.cpp of the dflash repository:
  ctx = hidden_norm(fc(target_hidden))
  per layer: x = input_layernorm(h); q = rope(q_norm(q_proj x)) at the block positions;
             keys / values = [k/v_proj(ctx) ; k/v_proj(x)] with k_norm and rope on the keys;
             a block query at position p attends
               - context keys at positions before the block (the anchor's position),
               - on full_attention layers every key of its own block, on sliding_attention layers
                 the block keys at positions <= p,
               - on sliding_attention layers only keys at positions >= p - (sliding_window - 1);
             h += o_proj(attention); h += down_proj(silu(gate_proj y) * up_proj y) with
             y = post_attention_layernorm(h)
  out = norm(h)
RMSNorm is plain (x * rsqrt(mean(x^2) + eps) * w, in float32 or wider); RoPE rotates the two
halves of each head (neox) over the whole head_dim, angles in float64. The decay-weighted
training loss is not part of this module.

Written for dflash; it shares no code with z-lab's, SGLang's or vLLM's implementations.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.modeling_utils import PreTrainedModel


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list:
    """z-lab's rule (dflash's default_target_layer_ids): evenly spaced from 1 to L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


class DFlashRMSNorm(nn.Module):
    """Plain RMSNorm, x * rsqrt(mean(x^2) + eps) * w, computed in float32 for 16-bit inputs."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (wide * self.weight.to(wide.dtype)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos / sin [b, T, head_dim / 2] of angle pos * theta^(-2i / head_dim), computed in float64."""
    half = head_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=positions.device) * 2.0 / head_dim)
    angle = positions.to(torch.float64)[..., None] * inv_freq
    return angle.cos().to(dtype), angle.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, T, d]: rotates (x1, x2) = the two halves of each head by the angles."""
    half = x.shape[-1] // 2
    c, s = cos[:, None], sin[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def crop_cache(cache, length: int) -> None:
    """Keeps the first `length` positions of a transformers Cache. Through a negative crop (drop
    that many), which every transformers version reads the same way: in 5.17 crop(0) keeps
    everything and a positive crop is deprecated."""
    drop = cache.get_seq_length() - int(length)
    if drop > 0:
        cache.crop(-drop)


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in params:  # a per-layer-type form; the drafter has one RoPE for all layers
        params = params["full_attention"]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"DFlash drafter: rope_parameters.rope_type is {rope_type!r}; only 'default' RoPE is supported")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("DFlash drafter: config has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        if getattr(config, "attention_bias", False):
            raise ValueError("DFlash drafter: attention_bias must be false (dflash's drafter has no biases)")
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"DFlash drafter: num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        H = config.hidden_size
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_k, allowed, past_key_values=None):
        """x [b, B, H] normed block rows, ctx [b, C, H] projected context, allowed [b, B, keys]."""
        b, q_len, _ = x.shape
        d = self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, d)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)
        n = kv_in.shape[1]
        k = self.k_norm(self.k_proj(kv_in).view(b, n, self.num_kv_heads, d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, n, self.num_kv_heads, d).transpose(1, 2)
        q = apply_rope(q, *rope_q)
        k = apply_rope(k, *rope_k)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (d ** -0.5)
        wide = torch.float32 if scores.dtype in (torch.float16, torch.bfloat16) else scores.dtype
        scores = scores.to(wide).masked_fill(~allowed[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, q_len, self.num_heads * d)
        return self.o_proj(out)


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"DFlash drafter: hidden_act is {config.hidden_act!r}; only 'silu' is supported")
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, y):
        return self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, ctx, rope_q, rope_k, allowed, past_key_values=None):
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope_q, rope_k, allowed, past_key_values)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = Qwen3Config  # model_type "qwen3", as AutoConfig reads config.json
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        # Only tensors missing from a checkpoint are initialised: what dflash's random init does.
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, DFlashRMSNorm):
            module.weight.data.fill_(1.0)


class DFlashDraftModel(DFlashPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        L, H = config.num_hidden_layers, config.hidden_size
        dflash_config = getattr(config, "dflash_config", None) or {}
        ids = dflash_config.get("target_layer_ids")
        if ids is None:
            ids = default_target_layer_ids(config.num_target_layers, L)
        self.target_layer_ids = [int(i) for i in ids]
        self.mask_token_id = dflash_config.get("mask_token_id")
        self.block_size = int(getattr(config, "block_size", 16))
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * L
        if len(layer_types) != L:
            raise ValueError(f"DFlash drafter: layer_types has {len(layer_types)} entries for {L} layers")
        for i, t in enumerate(layer_types):
            if t not in ("full_attention", "sliding_attention"):
                raise ValueError(f"DFlash drafter: layer_types[{i}] is {t!r}")
        self.layer_types = list(layer_types)
        self.sliding_window = getattr(config, "sliding_window", None)
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("DFlash drafter: sliding_attention layers need sliding_window (keys, > 0)")
        self.rope_theta = _rope_theta(config)
        self.head_dim = getattr(config, "head_dim", None) or H // config.num_attention_heads
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(L)])
        self.norm = DFlashRMSNorm(H, config.rms_norm_eps)
        self.post_init()

    def _allowed(self, position_ids, q_len, past_len, attention_mask):
        """Boolean [b, q_len, keys] per layer type; keys = cached context, new context, block."""
        q_pos = position_ids[:, -q_len:]
        cached = position_ids[:, :1] - past_len + torch.arange(past_len, device=position_ids.device)
        k_pos = torch.cat([cached, position_ids], dim=1)
        n_keys = k_pos.shape[1]
        in_block = torch.arange(n_keys, device=k_pos.device) >= n_keys - q_len
        kp, qp = k_pos[:, None, :], q_pos[:, :, None]
        before_block = kp < q_pos[:, :1, None]
        full = torch.where(in_block, torch.ones_like(before_block), before_block)
        out = {"full_attention": full}
        if self.sliding_window:
            window = kp >= qp - (int(self.sliding_window) - 1)
            out["sliding_attention"] = torch.where(in_block, kp <= qp, before_block) & window
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[1] != n_keys:
                raise ValueError(f"DFlash drafter: attention_mask must be a [batch, {n_keys}] key padding mask "
                                 f"(cached + new context + block), got {tuple(attention_mask.shape)}")
            keep = attention_mask.bool()[:, None, :]
            out = {t: m & keep for t, m in out.items()}
        return out

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        noise_embedding: Optional[torch.Tensor] = None,
        target_hidden: Optional[torch.Tensor] = None,
        past_key_values=None,
        use_cache: bool = False,
        input_ids: Optional[torch.LongTensor] = None,
        embed_tokens=None,
        **kwargs,
    ) -> torch.Tensor:
        # kwargs: z-lab's loop passes is_causal=False; the masks above are what this model uses.
        if noise_embedding is None:
            if input_ids is None or embed_tokens is None:
                raise ValueError("DFlash drafter: pass noise_embedding, or input_ids with embed_tokens "
                                 "(the target's input embedding)")
            noise_embedding = embed_tokens(input_ids)
        if target_hidden is None:
            raise ValueError("DFlash drafter: target_hidden (the target's captured hidden states) is required")
        h = noise_embedding.to(self.fc.weight.dtype)
        b, q_len, _ = h.shape
        want = self.fc.in_features
        if target_hidden.shape[-1] != want:
            raise ValueError(f"DFlash drafter: target_hidden has {target_hidden.shape[-1]} features per token, "
                             f"expected {want} ({len(self.target_layer_ids)} target layers x hidden size)")
        ctx = self.hidden_norm(self.fc(target_hidden.to(h.dtype)))
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(b, -1)
        if position_ids.shape[1] != ctx.shape[1] + q_len:
            raise ValueError(f"DFlash drafter: position_ids covers {position_ids.shape[1]} tokens, expected "
                             f"{ctx.shape[1]} context + {q_len} block")
        cache = past_key_values
        past_len = cache.get_seq_length() if cache is not None else 0
        allowed = self._allowed(position_ids, q_len, past_len, attention_mask)
        rope_k = rope_cos_sin(position_ids, self.head_dim, self.rope_theta, h.dtype)
        rope_q = tuple(t[:, -q_len:] for t in rope_k)
        for layer, layer_type in zip(self.layers, self.layer_types):
            h = layer(h, ctx, rope_q, rope_k, allowed[layer_type], cache)
        return self.norm(h)

    def _features(self, hidden_states) -> torch.Tensor:
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @torch.inference_mode()
    def spec_generate(self, target, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: Optional[list] = None, temperature: float = 0.0,
                      block_size: Optional[int] = None, return_acceptance: bool = False):
        """Greedy speculative decoding of `target` (a transformers causal LM whose KV cache can be
        cropped, i.e. an attention-only model) with this drafter: the output equals the target's
        own greedy output token for token. Batch size 1. Returns the ids [1, prompt + new]
        (and the accepted lengths per step when return_acceptance)."""
        if temperature and temperature > 0:
            raise NotImplementedError("DFlash drafter: spec_generate is greedy only (temperature 0), the "
                                      "setting in which it reproduces the target's output exactly")
        if input_ids.shape[0] != 1:
            raise ValueError("DFlash drafter: spec_generate takes one sequence (batch size 1)")
        if self.mask_token_id is None:
            raise ValueError("DFlash drafter: config has no dflash_config.mask_token_id")
        from transformers import DynamicCache

        B = int(block_size or self.block_size)
        stops = set(stop_token_ids or [])
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        device = input_ids.device
        target_cache, draft_cache = DynamicCache(), DynamicCache()
        n0 = input_ids.shape[1]
        out = target(input_ids, past_key_values=target_cache, use_cache=True, output_hidden_states=True)
        tokens = input_ids[0].tolist() + [int(out.logits[0, -1].argmax())]
        features = self._features(out.hidden_states)
        accepted = []
        while len(tokens) - n0 < max_new_tokens and not (stops & set(tokens[n0:])):
            start = len(tokens) - 1  # position of the anchor: the newest token, not yet run by the target
            block = torch.tensor([[tokens[-1]] + [self.mask_token_id] * (B - 1)], device=device)
            positions = torch.arange(draft_cache.get_seq_length(), start + B, device=device)[None]
            hidden = self(position_ids=positions, noise_embedding=embed(block), target_hidden=features,
                          past_key_values=draft_cache, use_cache=True)
            crop_cache(draft_cache, start)
            draft = head(hidden[:, 1:].to(head.weight.dtype)).argmax(-1)[0].tolist()
            verify = torch.tensor([[tokens[-1]] + draft], device=device)
            out = target(verify, past_key_values=target_cache, use_cache=True, output_hidden_states=True,
                         position_ids=torch.arange(start, start + B, device=device)[None])
            greedy = out.logits[0].argmax(-1).tolist()
            k = 0
            while k < B - 1 and draft[k] == greedy[k]:
                k += 1
            tokens += draft[:k] + [greedy[k]]
            crop_cache(target_cache, start + k + 1)
            features = self._features(out.hidden_states)[:, : k + 1]
            accepted.append(k + 1)
        new = tokens[n0:n0 + max_new_tokens]
        for i, t in enumerate(new):
            if t in stops:
                new = new[: i + 1]
                break
        ids = torch.tensor([tokens[:n0] + new], device=device)
        return (ids, accepted) if return_acceptance else ids
