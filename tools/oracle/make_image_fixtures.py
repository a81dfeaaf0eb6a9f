"""Input images as diffusers' load_image hands them to the official pipelines: PIL decodes the
file, PIL.ImageOps.exif_transpose turns it upright, convert("RGB") drops alpha and expands grey
and palettes. Writes small PNG and JPEG files of every colour type apus reads to
tests/fixtures/images/ and the RGB bytes PIL makes of each to tests/fixtures/images_ref.safetensors.

    build/oracle-venv/bin/python tools/oracle/make_image_fixtures.py
"""
import argparse
import io
import os

import numpy as np
import torch
from PIL import Image, ImageOps
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def content(w, h, seed):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255.0 / w, yy * 255.0 / h, ((xx // 8 + yy // 8) % 2) * 200.0 + 20], axis=-1)
    return np.clip(base + rng.normal(0, 25, size=(h, w, 3)), 0, 255).astype(np.uint8)


def exif_with_orientation(value):
    exif = Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()


NEAREST_SIZES = ((90, 62), (101, 67), (20, 13), (45, 80))


def write_nearest_fixtures(r):
    """A1111's Nearest upscaler is PIL's resize with NEAREST: a small noisy source and its resizes
    up, down and to sides that are no multiple of it (resize/small_45x31*.png)."""
    src = Image.fromarray(content(45, 31, 7), "RGB")
    src.save(os.path.join(r, "small_45x31.png"))
    for w, h in NEAREST_SIZES:
        src.resize((w, h), resample=Image.Resampling.NEAREST).save(os.path.join(r, f"small_45x31_nearest_{w}x{h}.png"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures"))
    args = ap.parse_args()
    d = os.path.join(args.out, "images")
    os.makedirs(d, exist_ok=True)
    rgb = content(40, 24, 1)
    files = {}
    # PNG: every colour type the reader converts.
    Image.fromarray(rgb, "RGB").save(os.path.join(d, "rgb.png"))
    rgba = np.concatenate([rgb, np.arange(40 * 24, dtype=np.uint8).reshape(24, 40, 1)], axis=-1)
    Image.fromarray(rgba, "RGBA").save(os.path.join(d, "rgba.png"))
    gray = rgb[..., 0]
    Image.fromarray(gray, "L").save(os.path.join(d, "gray.png"))
    Image.fromarray(np.stack([gray, rgb[..., 1]], axis=-1), "LA").save(os.path.join(d, "gray_alpha.png"))
    pal = Image.fromarray(rgb, "RGB").quantize(colors=16)
    pal.info["transparency"] = 3
    pal.save(os.path.join(d, "palette.png"), transparency=3)
    Image.fromarray(gray > 128).save(os.path.join(d, "bilevel.png"))
    Image.fromarray(rgb, "RGB").save(os.path.join(d, "interlaced.png"), interlace=1)  # Adam7 if supported
    # JPEG: baseline 4:2:0, progressive, 4:4:4, greyscale, and EXIF orientations 3, 6 and 8.
    Image.fromarray(rgb, "RGB").save(os.path.join(d, "baseline.jpg"), quality=90)
    Image.fromarray(rgb, "RGB").save(os.path.join(d, "progressive.jpg"), quality=85, progressive=True)
    Image.fromarray(rgb, "RGB").save(os.path.join(d, "full_chroma.jpg"), quality=95, subsampling=0)
    Image.fromarray(gray, "L").save(os.path.join(d, "gray.jpg"), quality=90)
    # WebP: lossy, lossless, lossy with alpha.
    Image.fromarray(rgb, "RGB").save(os.path.join(d, "lossy.webp"), quality=80)
    Image.fromarray(rgb, "RGB").save(os.path.join(d, "lossless.webp"), lossless=True)
    Image.fromarray(rgba, "RGBA").save(os.path.join(d, "alpha.webp"), quality=80)
    for o in (3, 6, 8):
        Image.fromarray(rgb, "RGB").save(os.path.join(d, f"orientation{o}.jpg"), quality=90,
                                         exif=exif_with_orientation(o))
    # References over 1024x1024 pixels: Flux2ImageProcessor._resize_to_target_area resizes them with
    # PIL's Lanczos filter. Sharp edges (a checkerboard over gradients) show every tap; stored as
    # the source and PIL's result, both PNG.
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    r = os.path.join(args.out, "resize")
    os.makedirs(r, exist_ok=True)
    for name, (w, h) in (("photo_1100x1000", (1100, 1000)), ("photo_2400x1600", (2400, 1600))):
        yy, xx = np.mgrid[0:h, 0:w]
        # Large flat cells keep the PNGs small; their edges carry the filter's every tap.
        checker = (((xx // 37) + (yy // 23)) % 2) * 200.0
        src = np.stack([checker + 20, 235 - checker, np.where((xx // 91 + yy // 53) % 3 == 0, 240.0, 30.0)], axis=-1)
        src = np.clip(src, 0, 255).astype(np.uint8)
        Image.fromarray(src, "RGB").save(os.path.join(r, f"{name}.png"))
        resized = Flux2ImageProcessor._resize_to_target_area(Image.fromarray(src, "RGB"), 1024 * 1024)
        resized.save(os.path.join(r, f"{name}_pil_lanczos.png"))
        print(name, "->", resized.size)

    write_nearest_fixtures(r)

    out = {}
    for name in sorted(os.listdir(d)):
        with Image.open(os.path.join(d, name)) as im:
            im = ImageOps.exif_transpose(im)
            arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
        out[name] = torch.from_numpy(arr.copy())
        print(name, arr.shape)
    save_file(out, os.path.join(args.out, "images_ref.safetensors"),
              metadata={"generator": "tools/oracle/make_image_fixtures.py", "pillow": Image.__version__})


if __name__ == "__main__":
    main()
