#!/usr/bin/env python3
"""A tiny random Qwen3.5 vision tower and what transformers computes with it: the reference the
vision model is built against.

    python3 make_vision_fixtures.py IMAGES_DIR OUT_DIR

IMAGES_DIR holds make_image_fixtures.py's output (its rgb_png case is one of the two images).
Writes OUT_DIR/qwen3_5_vision_tiny/:

  config.json        the vision config (make_fixtures.py's QWEN3_5_VISION_KWARGS with two blocks)
  model.safetensors  its weights as the multimodal checkpoint names them (model.visual.*), bf16
  reference.json     per image: grid_thw and the preprocessed patches' file; per patch: the 2-D
                     rotary positions (merge order) and the interpolated position embedding; the
                     hidden states after the patch embedding + positions and after each block; the
                     merger's output; and for a text-image-text token sequence, get_rope_index's
                     3-D positions and delta

References are computed in float64 from the bf16 weights on the CPU (eager attention).
Needs torch, transformers >= 5, safetensors and numpy.
"""

import inspect
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import QWEN3_5_TEXT_KWARGS, QWEN3_5_VISION_KWARGS  # noqa: E402

SEED = 20261203
VISION = dict(QWEN3_5_VISION_KWARGS, depth=2, hidden_act="gelu_pytorch_tanh")
# The second image: a tall grid, preprocessed here by the same processor as make_image_fixtures.py.
SECOND = dict(height=90, width=40, min_pixels=32 * 32, max_pixels=64 * 64)


def floats(t):
    return [float(x) for x in t.detach().to(torch.float64).reshape(-1).tolist()]


def second_image(images_dir):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    manifest = json.loads((images_dir / "manifest.json").read_text())
    s = manifest["settings"]
    y, x = np.mgrid[0 : SECOND["height"], 0 : SECOND["width"]]
    rgb = np.stack([(x * 6) % 256, (y * 3) % 256, ((x + y) * 5) % 256], axis=-1).astype(np.uint8)
    proc = Qwen2VLImageProcessorPil(min_pixels=SECOND["min_pixels"], max_pixels=SECOND["max_pixels"], **s)
    res = proc(images=[Image.fromarray(rgb)], return_tensors="np")
    return res["pixel_values"].astype(np.float32), res["image_grid_thw"][0].tolist(), rgb


def main():
    images_dir, out = Path(sys.argv[1]), Path(sys.argv[2]) / "qwen3_5_vision_tiny"
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    cfg = Qwen3_5MoeConfig(text_config=dict(QWEN3_5_TEXT_KWARGS), vision_config=dict(VISION))
    cfg.vision_config._attn_implementation = "eager"
    model = q35.Qwen3_5MoeVisionModel(cfg.vision_config).eval()
    # Random weights, rounded to bf16: unit-scale activations through LayerNorm'd blocks.
    sd = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm.weight"):
                v = 1.0 + 0.1 * torch.randn(p.shape)
            elif name.endswith("bias"):
                v = 0.1 * torch.randn(p.shape)
            elif name == "pos_embed.weight":
                v = 0.5 * torch.randn(p.shape)
            else:
                fan_in = p[0].numel()
                v = torch.randn(p.shape) / fan_in**0.5
            p.copy_(v.to(torch.bfloat16).to(p.dtype))
            sd["model.visual." + name] = p.detach().to(torch.bfloat16).contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg.vision_config.to_dict(), indent=1, default=str) + "\n")
    model = model.to(torch.float64)

    first = json.loads((images_dir / "manifest.json").read_text())
    case = next(c for c in first["cases"] if c["name"] == "rgb_png")
    pv1 = np.fromfile(images_dir / "rgb_png.f32", dtype="<f4").reshape(case["shape"])
    pv2, grid2, rgb2 = second_image(images_dir)
    np.ascontiguousarray(pv2, dtype="<f4").tofile(out / "second.f32")
    from PIL import Image

    Image.fromarray(rgb2).save(out / "second.png")
    grids = [case["grid_thw"], grid2]
    pixel_values = torch.from_numpy(np.concatenate([pv1, pv2])).to(torch.float64)
    grid_thw = torch.tensor(grids, dtype=torch.long)

    captured = {}
    hooks = [model.patch_embed.register_forward_hook(lambda m, i, o: captured.__setitem__("patch_embed", o))]
    for k, blk in enumerate(model.blocks):
        hooks.append(blk.register_forward_hook(lambda m, i, o, k=k: captured.__setitem__(f"block{k}", o)))
    rope_in = {}
    hooks.append(
        model.rotary_pos_emb.register_forward_hook(lambda m, i, o: rope_in.__setitem__("position_ids", i[1]))
    )
    with torch.no_grad():
        res = model(pixel_values, grid_thw=grid_thw)
    for h in hooks:
        h.remove()
    merged = res.pooler_output if hasattr(res, "pooler_output") else res
    # The position embedding added to each patch: the first block's input minus the patch embedding.
    first_in = {}
    hook = model.blocks[0].register_forward_pre_hook(lambda m, a: first_in.__setitem__("x", a[0]))
    with torch.no_grad():
        model(pixel_values, grid_thw=grid_thw)
    hook.remove()
    pos = first_in["x"] - captured["patch_embed"]

    # get_rope_index over text, the two images, text.
    wrap = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    start, end, img = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id
    merge = VISION["spatial_merge_size"]
    ids = [1, 2, 3, start] + [img] * (grids[0][1] * grids[0][2] // merge**2) + [end, 4, 5]
    ids += [start] + [img] * (grids[1][1] * grids[1][2] // merge**2) + [end, 6, 7, 8]
    input_ids = torch.tensor([ids])
    sig = inspect.signature(wrap.model.get_rope_index).parameters
    kw = {"image_grid_thw": grid_thw}
    if "mm_token_type_ids" in sig:
        kw["mm_token_type_ids"] = (input_ids == img).to(torch.int32)
    if "attention_mask" in sig:
        kw["attention_mask"] = torch.ones_like(input_ids)
    positions, delta = wrap.model.get_rope_index(input_ids, **kw)

    ref = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": SEED,
        "images": [
            {"file": "../images/rgb_png.f32", "grid_thw": grids[0], "patches": int(pv1.shape[0])},
            {"file": "second.f32", "png": "second.png", "grid_thw": grids[1], "patches": int(pv2.shape[0]),
             "preprocessor": SECOND},
        ],
        "rotary_position_ids": rope_in["position_ids"].tolist(),
        "pos_embeds": floats(pos),
        "patch_embed": floats(captured["patch_embed"]),
        "blocks": [floats(captured[f"block{k}"]) for k in range(len(model.blocks))],
        "merger": floats(merged),
        "merger_shape": list(merged.shape),
        "rope_index": {"input_ids": ids, "positions": positions[:, 0].tolist(), "delta": int(delta.reshape(-1)[0])},
    }
    (out / "reference.json").write_text(json.dumps(ref) + "\n")
    print(f"wrote {out}: {len(ids)} tokens, merger {list(merged.shape)}, transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
