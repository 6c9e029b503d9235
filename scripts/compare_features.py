#!/usr/bin/env python3
"""Relative error of captured hidden states between two dflash_features outputs (e.g. the FP8 and
the bf16 target on the same tokens): per layer max |a - b| / max |b| and ||a - b||_F / ||b||_F.

Usage: python3 scripts/compare_features.py TEST.safetensors REFERENCE.safetensors
Needs numpy (the GPU machine has it; the safetensors are read directly, no other package).
"""
import json
import struct
import sys

import numpy as np

DT = {"F32": np.float32, "BF16": np.uint16}


def read(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__" or not name.startswith("hidden."):
            continue
        b, en = e["data_offsets"]
        a = np.frombuffer(data[b:en], dtype=DT[e["dtype"]]).reshape(e["shape"])
        if e["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = a.astype(np.float64)
    return out


def main():
    a, b = read(sys.argv[1]), read(sys.argv[2])
    print("layer   max|a-b|/max|b|   ||a-b||/||b||")
    for name in sorted(b, key=lambda s: int(s.split(".")[1])):
        d = a[name] - b[name]
        print("%5s   %15.3e   %13.3e" % (name.split(".")[1], np.abs(d).max() / np.abs(b[name]).max(),
                                         np.linalg.norm(d) / np.linalg.norm(b[name])))


if __name__ == "__main__":
    main()
