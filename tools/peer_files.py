#!/usr/bin/env python3
"""An `apus synth` klein folder as the single files stable-diffusion.cpp's FLUX.2 klein example
loads (docs/flux2.md there: --diffusion-model, --vae, --llm), for the side-by-side timings in
docs/SPEED.md. The bytes are the folder's own (bf16 stays bf16); only names and layouts change:

  flux-2-klein-4b.safetensors   the transformer in BFL's names (qkv fused, final adaLN halves swapped)
  flux2_ae.safetensors          the VAE in BFL's ldm names (attention projections as 1x1 convs)
  qwen_3_4b.safetensors         the text encoder's shards in one file, transformers' names

Plain Python (no torch): safetensors is an 8-byte header length, a JSON header and the raw data.

Usage: peer_files.py FOLDER OUT_DIR
"""

import json
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "oracle"))
from klein_names import bfl_transformer_plan, vae_ldm_name  # noqa: E402


def read_headers(folder):
    """{name: (path, data start, entry)} over every .safetensors file of folder."""
    tensors = {}
    for f in sorted(os.listdir(folder)):
        if not f.endswith(".safetensors"):
            continue
        path = os.path.join(folder, f)
        with open(path, "rb") as h:
            (size,) = struct.unpack("<Q", h.read(8))
            header = json.loads(h.read(size))
        header.pop("__metadata__", None)
        tensors.update({k: (path, 8 + size, v) for k, v in header.items()})
    return tensors


def write(out_path, entries):
    """entries: [(name, dtype, shape, [(path, offset, length)])], written in order."""
    header, at = {}, 0
    for name, dtype, shape, pieces in entries:
        length = sum(p[2] for p in pieces)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + length]}
        at += length
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out_path, "wb") as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        for _, _, _, pieces in entries:
            for path, offset, length in pieces:
                with open(path, "rb") as h:
                    h.seek(offset)
                    while length:
                        chunk = h.read(min(length, 64 << 20))
                        out.write(chunk)
                        length -= len(chunk)
    print(out_path, len(entries), "tensors", flush=True)


def piece(tensors, name, half=None):
    path, base, entry = tensors[name]
    begin, end = entry["data_offsets"]
    if half is None:
        return entry, (path, base + begin, end - begin)
    assert entry["shape"][0] % 2 == 0, name
    mid = (end - begin) // 2
    return entry, (path, base + begin + half * mid, mid)


def transformer(folder):
    tensors = read_headers(folder)
    entries = []
    for name, parts in bfl_transformer_plan(tensors):
        got = [piece(tensors, k, half) for k, half in parts]
        rows = sum(e["shape"][0] // (1 if h is None else 2) for (e, _), (_, h) in zip(got, parts))
        first = got[0][0]
        assert all(e["dtype"] == first["dtype"] and e["shape"][1:] == first["shape"][1:] for e, _ in got), name
        entries.append((name, first["dtype"], [rows] + first["shape"][1:], [p for _, p in got]))
    return entries


def vae(folder):
    with open(os.path.join(folder, "config.json")) as f:
        up_blocks = len(json.load(f)["up_block_types"])
    tensors = read_headers(folder)
    entries = []
    for k in tensors:
        named = vae_ldm_name(k, up_blocks)
        if named:
            entry, p = piece(tensors, k)
            entries.append((named[0], entry["dtype"], entry["shape"] + ([1, 1] if named[1] else []), [p]))
    return entries


def merged(folder):
    tensors = read_headers(folder)
    return [(k, tensors[k][2]["dtype"], tensors[k][2]["shape"], [piece(tensors, k)[1]]) for k in tensors]


def main():
    folder, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    write(os.path.join(out, "flux-2-klein-4b.safetensors"), transformer(os.path.join(folder, "transformer")))
    write(os.path.join(out, "flux2_ae.safetensors"), vae(os.path.join(folder, "vae")))
    write(os.path.join(out, "qwen_3_4b.safetensors"), merged(os.path.join(folder, "text_encoder")))


if __name__ == "__main__":
    main()
