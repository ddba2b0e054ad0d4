#!/usr/bin/env python3
"""Write a random-weight, full-size checkpoint in the layout of the official block-scaled FP8 releases.

Usage:  python3 scripts/fp8_checkpoint.py CONFIG OUT_DIR [--shard-gib 4] [--seed 0]

CONFIG is a Hugging Face config.json of a Qwen3-Next or Qwen3.5/3.6 MoE model (e.g.
configs/models/qwen3.5-35b-a3b.json). OUT_DIR gets config.json (CONFIG with the FP8
`quantization_config` of the releases: quant_method fp8, fmt e4m3, activation_scheme dynamic,
weight_block_size [128, 128], modules_to_not_convert) and model-0000K-of-0000N.safetensors shards with
model.safetensors.index.json, as `save_pretrained` shards them.

What it is for: the load time of a real FP8 checkpoint on a GPU host that cannot download one
(`sanmai bench --model OUT_DIR` prints the load time beside the time to read the files again from the
page cache). The weights are random; the names, dtypes and shapes are the releases':

- the tensor names and shapes are those of the transformers model class built on the meta device from
  CONFIG, the fused 3-D routed experts written per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`),
  as the releases store them; with `mtp_num_hidden_layers` / `num_nextn_predict_layers` > 0 the MTP head
  (`mtp.fc`, its norms and one full-attention MoE layer, which transformers does not build) is added with
  the shapes of the model's own full-attention layer;
- every converted Linear (each nn.Linear and routed expert projection outside `modules_to_not_convert`,
  the list tests/reference/make_fp8_fixtures.py writes, plus the vision tower) is float8_e4m3fn with a
  float32 `weight_scale_inv` per 128x128 block (edge blocks partial); everything else is bf16.

Values: FP8 codes of N(0, 64) and scales of 0.02 / 64 (weights of about N(0, 0.02^2)), bf16 tensors
N(0, 0.02^2). Needs torch and transformers >= 5 (the GPU, when there is one, draws the numbers).
"""

import argparse
import json
import math
import os
import re
import sys
import time

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))
import make_fp8_fixtures as fx  # noqa: E402  (modules_to_not_convert, should_convert)

FUSED = re.compile(r"^(?P<p>.*\.experts)\.(?P<w>gate_up_proj|down_proj)$")
BLOCK = 128


def meta_model(cfg_json):
    import transformers

    cfg = transformers.AutoConfig.for_model(**cfg_json)
    cls = getattr(transformers, cfg_json["architectures"][0])
    with torch.device("meta"):
        model = cls(cfg)
    return cfg, model


def text_config(cfg):
    return getattr(cfg, "text_config", None) or cfg


def tensor_list(cfg, model):
    """(name, shape, convert) in the checkpoint's layout."""
    linear, experts = fx.converted_modules(model)
    tc = text_config(cfg)
    prefix = "model.language_model." if hasattr(cfg, "text_config") else "model."
    not_convert = fx.not_converted_list(tc.model_type.removesuffix("_text"), prefix, tc.num_hidden_layers, tc.layer_types)
    not_convert.append("model.visual")
    out = []
    for name, p in model.state_dict(keep_vars=True).items():
        m = FUSED.match(name)
        if m:
            e, rows, cols = p.shape
            for i in range(e):
                if m["w"] == "gate_up_proj":
                    out.append((f"{m['p']}.{i}.gate_proj.weight", (rows // 2, cols), True))
                    out.append((f"{m['p']}.{i}.up_proj.weight", (rows // 2, cols), True))
                else:
                    out.append((f"{m['p']}.{i}.down_proj.weight", (rows, cols), True))
            continue
        module = name.removesuffix(".weight") if name.endswith(".weight") else None
        is_linear = module in linear or any(module and module.startswith(x + ".") for x in experts)
        convert = bool(is_linear) and len(p.shape) == 2 and fx.should_convert(module, not_convert)
        out.append((name, tuple(p.shape), convert))
    mtp = getattr(tc, "mtp_num_hidden_layers", 0) or getattr(tc, "num_nextn_predict_layers", 0) or 0
    if mtp:
        h = tc.hidden_size
        full = tc.layer_types.index("full_attention")
        src = f"{prefix}layers.{full}."
        out.append(("mtp.fc.weight", (h, 2 * h), True))
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out.append((f"mtp.{n}.weight", (h,), False))
        out += [("mtp.layers.0." + n[len(src) :], s, c) for n, s, c in out if n.startswith(src)]
    return out, not_convert


def draw(shape, convert, gen, device):
    if not convert:
        return (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
    q = (torch.randn(shape, generator=gen, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = tuple(math.ceil(d / BLOCK) for d in shape)
    inv = torch.full(blocks, 0.02 / 64, dtype=torch.float32)
    return q.cpu(), inv


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--shard-gib", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    with open(a.config) as f:
        cfg_json = json.load(f)
    cfg, model = meta_model(cfg_json)
    tensors, not_convert = tensor_list(cfg, model)
    os.makedirs(a.out, exist_ok=True)
    cfg_json["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": not_convert,
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg_json, f, indent=2)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(a.seed)
    limit = int(a.shard_gib * 2**30)
    shards, cur, size, total = [], {}, 0, 0
    started = time.time()
    for name, shape, convert in tensors:
        t = draw(shape, convert, gen, device)
        if convert:
            q, inv = t
            cur[name] = q
            cur[name.removesuffix("weight") + "weight_scale_inv"] = inv
            size += q.numel() + inv.numel() * 4
        else:
            cur[name] = t
            size += t.numel() * 2
        if size >= limit:
            shards.append(cur)
            total += size
            save_shard(a.out, shards, cur)
            cur, size = {}, 0
    if cur:
        shards.append(cur)
        total += size
        save_shard(a.out, shards, cur)
    n = len(shards)
    index = {}
    for k in range(n):
        old = os.path.join(a.out, f"shard-{k + 1}.safetensors")
        new = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        os.rename(old, os.path.join(a.out, new))
    for k, s in enumerate(shards):
        for name in s:
            index[name] = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=1)
    converted = sum(1 for _, _, c in tensors if c)
    print(
        f"{a.out}: {len(index)} tensors ({converted} FP8 weights with block scales), "
        f"{total / 1e9:.2f} GB in {n} shards, {time.time() - started:.0f} s",
        flush=True,
    )


def save_shard(out, shards, cur):
    save_file(cur, os.path.join(out, f"shard-{len(shards)}.safetensors"), metadata={"format": "pt"})
    for k in list(cur):  # the shard's tensors are written; keep only the names for the index
        cur[k] = None


if __name__ == "__main__":
    main()
