#!/usr/bin/env python3
"""Makes a block-FP8 checkpoint in the layout of the official Qwen3.x-*-FP8 releases from a bf16 /
f16 / f32 one, with nothing but the Python standard library (its own e4m3 encoder, independent of
dflash's core/fp8.h, so that loading the result checks dflash's reading of the format rather
than its own writing of it).

The layout (Qwen3.6-27B-FP8's config.json and safetensors index):
  config.json: quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
      "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": [...]} at the top level
  tensors: names under model.language_model. (lm_head.weight at the top); each quantized Linear
      weight [N, K] as F8_E4M3 codes (the "fn" variant: no infinities, max 448) and beside it
      <name>_scale_inv [ceil(N/128), ceil(K/128)], the dequantization scale of each 128 x 128 block
      (value ~= code * scale_inv, scale_inv = amax / 448);
  quantized: linear_attn.in_proj_qkv / in_proj_z / out_proj, self_attn.q/k/v/o_proj, mlp.gate/up/
      down_proj; everything else (embeddings, lm_head, norms, conv1d, A_log, dt_bias, in_proj_a/b)
      stays as stored (bf16), and the small projections are listed in modules_to_not_convert.

Usage: python3 tests/reference/make_fp8_checkpoint.py SRC_DIR OUT_DIR [--scale-dtype F32|BF16]
(tests/data/fp8/tiny_a was made from tests/data/hf/tiny_a with the defaults.)
"""
import json
import math
import os
import struct
import sys

QUANTIZED = (".linear_attn.in_proj_qkv.weight", ".linear_attn.in_proj_z.weight", ".linear_attn.out_proj.weight",
             ".self_attn.q_proj.weight", ".self_attn.k_proj.weight", ".self_attn.v_proj.weight",
             ".self_attn.o_proj.weight", ".mlp.gate_proj.weight", ".mlp.up_proj.weight", ".mlp.down_proj.weight")
NOT_CONVERTED = (".linear_attn.in_proj_a", ".linear_attn.in_proj_b")
BLOCK = 128
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-10


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    return header, data, meta


def to_floats(dtype, raw):
    if dtype == "BF16":
        return [struct.unpack("<f", b"\0\0" + raw[i:i + 2])[0] for i in range(0, len(raw), 2)]
    if dtype == "F16":
        return list(struct.unpack("<%de" % (len(raw) // 2), raw))
    if dtype == "F32":
        return list(struct.unpack("<%df" % (len(raw) // 4), raw))
    raise SystemExit("unsupported source dtype " + dtype)


def f32(x):
    """x rounded to float32 (scales and quotients are float32 in the official tooling)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def e4m3(x):
    """The e4m3fn code nearest to x, ties to even, saturating at +-448."""
    if x != x:
        return 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a >= E4M3_MAX:
        return sign | 0x7E
    if a == 0:
        return sign
    m, e = math.frexp(a)           # a = m * 2^e, m in [0.5, 1)
    be = max(e - 1, -6)            # binade exponent; subnormals share 2^-6's quantum
    q = a / math.ldexp(1.0, be - 3)  # in units of the quantum: [8, 16) in a binade, [0, 8) below
    n = round(q)                   # Python rounds half to even
    if n == 16:
        n, be = 8, be + 1
    if be == -6 and n < 8:
        return sign | n
    exp = be + 7
    if exp > 15 or (exp == 15 and n - 8 > 6):
        return sign | 0x7E
    return sign | (exp << 3) | (n - 8)


def quantize(values, rows, cols):
    rb, cb = -(-rows // BLOCK), -(-cols // BLOCK)
    codes = bytearray(rows * cols)
    scales = []
    for br in range(rb):
        for bc in range(cb):
            r0, r1, c0, c1 = br * BLOCK, min(rows, (br + 1) * BLOCK), bc * BLOCK, min(cols, (bc + 1) * BLOCK)
            amax = 0.0
            for r in range(r0, r1):
                for c in range(c0, c1):
                    amax = max(amax, abs(values[r * cols + c]))
            s = f32(max(amax, AMAX_FLOOR) / E4M3_MAX)
            scales.append(s)
            for r in range(r0, r1):
                for c in range(c0, c1):
                    v = max(-E4M3_MAX, min(E4M3_MAX, f32(values[r * cols + c] / s)))
                    codes[r * cols + c] = e4m3(v)
    return bytes(codes), scales, [rb, cb]


def official_name(name):
    if name.startswith("model.") and not name.startswith("model.language_model."):
        return "model.language_model." + name[len("model."):]
    return name


def main():
    args = sys.argv[1:]
    scale_dtype = "F32"
    if "--scale-dtype" in args:
        i = args.index("--scale-dtype")
        scale_dtype = args[i + 1]
        del args[i:i + 2]
    if len(args) != 2 or scale_dtype not in ("F32", "BF16"):
        raise SystemExit(__doc__)
    src, out = args
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors") and not f.startswith("golden"))
    tensors = []  # (name, dtype, shape, bytes)
    for fn in files:
        header, data, _ = read_safetensors(os.path.join(src, fn))
        for name, e in sorted(header.items()):
            b, en = e["data_offsets"]
            raw = data[b:en]
            oname = official_name(name)
            if name.endswith(QUANTIZED):
                rows, cols = e["shape"]
                codes, scales, sshape = quantize(to_floats(e["dtype"], raw), rows, cols)
                tensors.append((oname, "F8_E4M3", e["shape"], codes))
                if scale_dtype == "F32":
                    sraw = struct.pack("<%df" % len(scales), *scales)
                else:  # bf16, rounded to nearest even
                    sraw = b"".join(struct.pack("<H", ((struct.unpack("<I", struct.pack("<f", s))[0] + 0x7FFF +
                                                        ((struct.unpack("<I", struct.pack("<f", s))[0] >> 16) & 1)) >> 16))
                                    for s in scales)
                tensors.append((oname + "_scale_inv", scale_dtype, sshape, sraw))
            else:
                tensors.append((oname, e["dtype"], e["shape"], raw))
    header, offset, blob = {"__metadata__": {"format": "pt"}}, 0, bytearray()
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blob += raw
        offset += len(raw)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hj)) + hj + bytes(blob))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    layers = cfg["num_hidden_layers"]
    keep = ["lm_head", "model.language_model.embed_tokens"]
    for i, t in enumerate(cfg.get("layer_types", [])):
        if t == "linear_attention":
            keep += ["model.language_model.layers.%d%s" % (i, m) for m in NOT_CONVERTED]
    assert len(cfg.get("layer_types", [])) in (0, layers)
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": keep}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    print("wrote %s: %d tensors, %d of them e4m3" % (out, len(tensors), sum(t[1] == "F8_E4M3" for t in tensors)))


if __name__ == "__main__":
    main()
