"""Reference image preprocessing for the vision tower: transformers' PIL-backend Qwen2-VL image
processor (`Qwen2VLImageProcessorPil`, the processor the Qwen3.5/3.6 and qwen4_exp checkpoints name)
with Qwen3.5's settings (patch 16, merge 2, temporal patch 2, mean and std 0.5), over images this
script draws itself and saves in every format the server decodes.

    python make_image_fixtures.py OUT_DIR

Writes OUT_DIR/NAME.{png,jpg,webp,gif} (the inputs), OUT_DIR/NAME.f32 (pixel_values, little-endian
float32, [patches, 3 * 2 * 16 * 16]) and OUT_DIR/manifest.json (per case: the input file, the
processor settings, image_grid_thw, the pixel_values shape, transformers' and Pillow's versions).
Needs numpy, Pillow and transformers (no torch: the PIL backend is numpy).
"""

import json
import sys
from pathlib import Path

import numpy as np
import PIL
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

QWEN35 = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5],
              image_std=[0.5, 0.5, 0.5], rescale_factor=1 / 255)


def pattern(h, w, seed):
    """A deterministic RGB image with edges, gradients and noise (what resampling must get right)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    r = (x * 255 // max(w - 1, 1)).astype(np.uint8)
    g = ((np.sin(y / 3.0) * 0.5 + 0.5) * 255).astype(np.uint8)
    b = (((x // 7 + y // 5) % 2) * 200 + rng.integers(0, 56, (h, w))).astype(np.uint8)
    return np.stack([r, g, b], axis=-1)


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    cases = []

    def case(name, img, fmt, min_pixels, max_pixels, **save):
        path = out / f"{name}.{fmt}"
        img.save(path, **save)
        # What the server reads is the file: decode it again as transformers' callers do.
        src = Image.open(path)
        proc = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, **QWEN35)
        res = proc(images=[src], return_tensors="np")
        pv = np.ascontiguousarray(res["pixel_values"], dtype="<f4")
        pv.tofile(out / f"{name}.f32")
        cases.append({"name": name, "file": path.name, "min_pixels": min_pixels,
                      "max_pixels": max_pixels, "image_size": [src.height, src.width],
                      "grid_thw": res["image_grid_thw"][0].tolist(), "shape": list(pv.shape)})

    rgb = Image.fromarray(pattern(45, 70, 1))
    # Upscaled to min_pixels; resized along both axes.
    case("rgb_png", rgb, "png", 64 * 64, 128 * 128)
    # Downscaled to max_pixels (the antialiasing support widens).
    case("large_png", Image.fromarray(pattern(150, 230, 2)), "png", 32 * 32, 96 * 96)
    # Already a multiple of 32: no resampling.
    case("exact_png", Image.fromarray(pattern(64, 96, 3)), "png", 32 * 32, 128 * 128)
    case("rgb_jpeg", rgb, "jpg", 64 * 64, 128 * 128, quality=90)
    case("gray_png", rgb.convert("L"), "png", 64 * 64, 128 * 128)
    rgba = rgb.copy()
    rgba.putalpha(Image.fromarray((pattern(45, 70, 4)[:, :, 2]).astype(np.uint8)))
    case("rgba_png", rgba, "png", 64 * 64, 128 * 128)
    case("palette_gif", rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=64), "gif",
         64 * 64, 128 * 128)
    case("rgb_webp", rgb, "webp", 64 * 64, 128 * 128, lossless=True)
    manifest = {"transformers": transformers.__version__, "pillow": PIL.__version__,
                "processor": "Qwen2VLImageProcessorPil", "settings": QWEN35, "cases": cases}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
