"""The image metrics `apus gate` computes (src/gate/metrics.cpp), by the libraries they follow:
scikit-image's structural_similarity and peak_signal_noise_ratio, piq's gmsd. The images are
formulas the C++ test (tests/test_gate.cpp) draws alike, so the fixture holds only the scores.

    python3 -m venv build/metrics-venv && build/metrics-venv/bin/pip install \
        scikit-image==0.26.0 piq==0.8.0 torch==2.9.1 --extra-index-url https://download.pytorch.org/whl/cpu
    build/metrics-venv/bin/python tools/oracle/make_gate_metric_fixtures.py
"""
import json
import pathlib

import numpy as np
import piq
import torch
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

OUT = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "gate_metrics_ref.json"


def image(w, h, kind):
    y, x, c = np.meshgrid(np.arange(h), np.arange(w), np.arange(3), indexing="ij")
    base = (x * 13 + y * 7 + c * 50 + ((x * y) % 17) * 5) % 256
    if kind == "base":
        return base.astype(np.uint8)
    if kind == "noisy":
        return np.clip(base + (x * 31 + y * 17 + c * 11) % 23 - 11, 0, 255).astype(np.uint8)
    if kind == "blurred":  # a 3x3 box blur of the base, edges replicated
        p = np.pad(base.astype(np.float64), ((1, 1), (1, 1), (0, 0)), mode="edge")
        acc = sum(p[1 + dy:1 + dy + h, 1 + dx:1 + dx + w] for dy in (-1, 0, 1) for dx in (-1, 0, 1))
        return np.floor(acc / 9 + 0.5).astype(np.uint8)
    raise ValueError(kind)


def luma(im):
    f = im.astype(np.float64)
    return 0.299 * f[..., 0] + 0.587 * f[..., 1] + 0.114 * f[..., 2]


def scores(a, b):
    ssim = structural_similarity(luma(a), luma(b), gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
                                 data_range=255)
    ta = torch.from_numpy(a.astype(np.float64) / 255).permute(2, 0, 1)[None]
    tb = torch.from_numpy(b.astype(np.float64) / 255).permute(2, 0, 1)[None]
    return {"psnr": float(peak_signal_noise_ratio(b, a, data_range=255)), "ssim": float(ssim),
            "gmsd": float(piq.gmsd(ta, tb, data_range=1.0))}


cases = []
for w, h in [(64, 48), (33, 21)]:
    for kind in ["noisy", "blurred"]:
        cases.append({"width": w, "height": h, "image": kind, "reference": "base",
                      **scores(image(w, h, kind), image(w, h, "base"))})
OUT.write_text(json.dumps({"cases": cases}, indent=2) + "\n")
print(json.dumps(cases, indent=2))
