#!/usr/bin/env python3
"""Quantize a tiny bf16 checkpoint into a compressed-tensors `pack-quantized` fixture.

Usage: quantize_fixture.py INPUT_DIR OUTPUT_DIR

Reads INPUT_DIR/model.safetensors and config.json (a tiny qwen3_5_moe_text checkpoint) and writes to
OUTPUT_DIR:
  config.json                   the input config plus a `quantization_config` with a mixed scheme:
                                routed experts INT4 (group 32: the tiny widths are below 128), shared
                                experts INT6 gapless per channel, every other Linear and the embedding
                                INT8 per channel; router, shared-expert gate, in_proj_a/b and mtp.fc bf16
  model.safetensors             quantized Linears as `X.weight_packed` (int32), `X.weight_scale`,
                                `X.weight_shape` (int32 [out, in]); other tensors copied unchanged
  quant_reference.safetensors   for every quantized `X`: `X.q` (int8, the signed integers) and
                                `X.dequant` (f32, q times the stored scale) for the loader's tests
  generation_config.json        copied when present

Quantization is symmetric max-abs as compressed-tensors computes it: per group (or row)
scale = max|w| / ((2^b - 1) / 2), rounded to the scale's storage dtype, then
q = clip(round_half_even(w / scale), -2^(b-1), 2^(b-1) - 1). Packing: the unsigned code q + 2^(b-1),
LSB-first along the input dimension; INT4 8 and INT8 4 codes per int32 (rows padded with code 0);
INT6 gapless: rows zero-padded to a multiple of 32 codes, value j at bits [6j, 6j+6) of the row's
little-endian bit stream, 32 codes in 6 words.

Only numpy is needed: safetensors files are read and written directly (their format is an 8-byte
header length, a JSON header, and the raw little-endian data), since numpy has no bfloat16.
"""

import json
import re
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

QUANT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "routed_experts": {
            # Per-expert Linears, and the fused 3-D form (`experts.gate_up_proj`) a dummy source uses.
            "targets": [r"re:.*mlp\.experts\.(\d+\.)?(gate|up|down|gate_up)_proj$"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                        "strategy": "group", "group_size": 32},
        },
        "shared_experts": {
            "targets": [r"re:.*mlp\.shared_expert\.(gate|up|down)_proj$"],
            "format": "int6-gapless",
            "weights": {"num_bits": 6, "type": "int", "symmetric": True, "strategy": "channel"},
        },
        "projections": {
            "targets": ["Linear", "model.embed_tokens"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        },
    },
    "ignore": [r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$", r"re:.*in_proj_[ab]$", "mtp.fc"],
}

# Scale storage dtype per group: exercise every float dtype the loader accepts.
SCALE_DTYPE = {"routed_experts": "BF16", "shared_experts": "F16", "projections": "BF16"}


def read_safetensors(path):
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        s, e = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], raw[base + s:base + e])
    return out


def write_safetensors(path, tensors):
    """tensors: name -> (dtype string, shape, bytes); written in sorted name order."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def bf16_bytes_to_f32(data, shape):
    u = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
    return u.view(np.float32).reshape(shape)


def f32_to_bf16_bits(x):
    """Round f32 to bf16, nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + 0x7FFF + ((u >> 16) & 1)
    return (rounded >> 16).astype("<u2")


def round_scale(s, dtype):
    if dtype == "BF16":
        bits = f32_to_bf16_bits(s)
        return (bits.astype(np.uint32) << 16).view(np.float32), bits.tobytes()
    if dtype == "F16":
        h = s.astype("<f2")
        return h.astype(np.float32), h.tobytes()
    f = s.astype("<f4")
    return f, f.tobytes()


def scheme_for(module, is_linear):
    """compressed-tensors matching: ignore first; then exact names, regexes (re.match), class name."""
    def hit(target):
        if target.startswith("re:"):
            return re.match(target[3:], module) is not None
        if target == "Linear":
            return is_linear
        return target == module

    if any(hit(t) for t in QUANT_CONFIG["ignore"]):
        return None
    groups = QUANT_CONFIG["config_groups"]
    for kind in ("exact", "regex", "class"):
        for gname, g in groups.items():
            for t in g["targets"]:
                is_kind = ("regex" if t.startswith("re:") else "class" if t == "Linear" else "exact")
                if is_kind == kind and hit(t):
                    return gname
    return None


def pack(q, bits):
    """q: int array [out, in] of signed values -> uint32 words [out, words_per_row]."""
    out_f, in_f = q.shape
    codes = (q.astype(np.int64) + (1 << (bits - 1))).astype(np.uint64)
    if bits == 6:
        padded = -(-in_f // 32) * 32
        c = np.zeros((out_f, padded), dtype=np.uint64)
        c[:, :in_f] = codes
        words = np.zeros((out_f, padded // 32 * 6), dtype=np.uint64)
        for j in range(padded):
            bit = 6 * j
            w, s = bit // 32, bit % 32
            words[:, w] |= (c[:, j] << np.uint64(s)) & np.uint64(0xFFFFFFFF)
            if s + 6 > 32:
                words[:, w + 1] |= c[:, j] >> np.uint64(32 - s)
        return words.astype(np.uint32)
    per = 32 // bits
    padded = -(-in_f // per) * per
    c = np.zeros((out_f, padded), dtype=np.uint64)
    c[:, :in_f] = codes
    c = c.reshape(out_f, padded // per, per)
    shifts = (np.arange(per, dtype=np.uint64) * np.uint64(bits))
    return (c << shifts).sum(axis=2).astype(np.uint32)


def quantize(w, bits, group_size, scale_dtype):
    out_f, in_f = w.shape
    g = group_size or in_f
    cols = -(-in_f // g)
    half_range = ((1 << bits) - 1) / 2.0
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    amax = np.zeros((out_f, cols), dtype=np.float32)
    for c in range(cols):
        amax[:, c] = np.abs(w[:, c * g:(c + 1) * g]).max(axis=1)
    scale = np.where(amax > 0, amax / np.float32(half_range), np.float32(1.0)).astype(np.float32)
    scale, scale_bytes = round_scale(scale, scale_dtype)
    full = np.repeat(scale, g, axis=1)[:, :in_f]
    q = np.clip(np.rint(w / full), qmin, qmax).astype(np.int8)
    deq = q.astype(np.float32) * full
    return q, scale, scale_bytes, deq


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: quantize_fixture.py INPUT_DIR OUTPUT_DIR")
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    dst.mkdir(parents=True, exist_ok=True)
    tensors = read_safetensors(src / "model.safetensors")
    out, ref = {}, {}
    counts = {}
    for name, (dtype, shape, data) in sorted(tensors.items()):
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        group = None
        if module is not None and len(shape) == 2:
            group = scheme_for(module, is_linear=not module.endswith("embed_tokens"))
        if group is None:
            out[name] = (dtype, shape, data)
            continue
        assert dtype == "BF16", f"{name}: expected bf16, found {dtype}"
        wcfg = QUANT_CONFIG["config_groups"][group]["weights"]
        bits = wcfg["num_bits"]
        gs = wcfg.get("group_size") if wcfg["strategy"] == "group" else 0
        w = bf16_bytes_to_f32(data, shape)
        q, scale, scale_bytes, deq = quantize(w, bits, gs, SCALE_DTYPE[group])
        words = pack(q, bits)
        out[module + ".weight_packed"] = ("I32", words.shape, words.astype("<u4").tobytes())
        out[module + ".weight_scale"] = (SCALE_DTYPE[group], scale.shape, scale_bytes)
        out[module + ".weight_shape"] = ("I32", [2], np.array(shape, dtype="<i4").tobytes())
        ref[module + ".q"] = ("I8", q.shape, q.tobytes())
        ref[module + ".dequant"] = ("F32", deq.shape, deq.astype("<f4").tobytes())
        counts[group] = counts.get(group, 0) + 1
    write_safetensors(dst / "model.safetensors", out)
    write_safetensors(dst / "quant_reference.safetensors", ref)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = QUANT_CONFIG
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if (src / "generation_config.json").exists():
        shutil.copy(src / "generation_config.json", dst / "generation_config.json")
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
