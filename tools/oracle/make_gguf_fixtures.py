#!/usr/bin/env python3
"""Oracle for apus's GGUF reader: block-quantised tensors written by gguf-py (PyPI `gguf`), with
gguf-py's own dequantisation as the reference values.

Writes, under tests/fixtures/gguf/:
  blocks.gguf                every block type apus reads (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
                             Q6_K) plus F32, F16 and BF16, as tensors named '<type>.quantized' (normal
                             values quantised by gguf-py where it can quantise that type) and
                             '<type>.random' (random block bytes with finite f16 scales: every bit of
                             the packing exercised; K-types have only these, gguf-py cannot quantise
                             them), a 3-D tensor, and metadata of every value type
  blocks_ref.safetensors     gguf-py's gguf.quants.dequantize of each tensor, f32, same names
  blocks.json                the metadata values and the tensors' shapes and GGML type names

Usage: make_gguf_fixtures.py [--out DIR]
"""

import argparse
import json
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants
from safetensors.numpy import save_file

ROWS, COLS = 3, 512
SEED = 20261202

QUANTISABLE = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
K_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]


def random_blocks(rng, qtype, rows, cols):
    """Random bytes in qtype's block layout, each f16 scale set to a finite value."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
    def f16(values):
        return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    n = raw.shape[0]
    scale = rng.uniform(-0.05, 0.05, size=n)
    if qtype in (T.Q8_0, T.Q4_0, T.Q5_0):
        raw[:, 0:2] = f16(scale)
    elif qtype in (T.Q4_1, T.Q5_1):
        raw[:, 0:2] = f16(scale)
        raw[:, 2:4] = f16(rng.uniform(-0.5, 0.5, size=n))
    elif qtype in (T.Q4_K, T.Q5_K):
        raw[:, 0:2] = f16(scale)
        raw[:, 2:4] = f16(rng.uniform(0, 0.02, size=n))
    elif qtype == T.Q6_K:
        raw[:, 208:210] = f16(scale)
    return raw.reshape(rows, -1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = os.path.join(ap.parse_args().out, "gguf")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(SEED)

    w = gguf.GGUFWriter(os.path.join(out, "blocks.gguf"), arch="apus-test")
    meta = {
        "test.u8": (w.add_uint8, 200), "test.i8": (w.add_int8, -100), "test.u16": (w.add_uint16, 60000),
        "test.i16": (w.add_int16, -30000), "test.u32": (w.add_uint32, 4000000000), "test.i32": (w.add_int32, -2000000000),
        "test.f32": (w.add_float32, 0.25), "test.u64": (w.add_uint64, 2**63 + 5), "test.i64": (w.add_int64, -(2**62)),
        "test.f64": (w.add_float64, 1.0 / 3.0), "test.bool": (w.add_bool, True), "test.string": (w.add_string, "grüße"),
        "test.strings": (w.add_array, ["a", "", "bc"]), "test.ints": (w.add_array, [1, -2, 3]),
    }
    for key, (add, v) in meta.items():
        add(key, v)

    refs, shapes = {}, {}
    def add(name, data, raw_dtype, ref):
        w.add_tensor(name, data, raw_dtype=raw_dtype)
        refs[name] = np.ascontiguousarray(ref.astype(np.float32))
        stored = raw_dtype.name if raw_dtype is not None else {np.float32: "F32", np.float16: "F16"}[data.dtype.type]
        shapes[name] = {"shape": list(ref.shape), "type": stored}

    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    for qtype in QUANTISABLE:
        q = quants.quantize(values, qtype)
        add(f"{qtype.name.lower()}.quantized", q, qtype, quants.dequantize(q, qtype))
    for qtype in QUANTISABLE + K_TYPES:
        q = random_blocks(rng, qtype, ROWS, COLS)
        add(f"{qtype.name.lower()}.random", q, qtype, quants.dequantize(q, qtype))
    add("f32.values", values, None, values)
    add("f16.values", values.astype(np.float16), None, values.astype(np.float16))
    bf = quants.quantize(values, T.BF16)
    add("bf16.values", bf, T.BF16, quants.dequantize(bf, T.BF16))
    cube = rng.standard_normal((2, 3, 64)).astype(np.float32)
    q = quants.quantize(cube, T.Q8_0)
    add("q8_0.cube", q, T.Q8_0, quants.dequantize(q, T.Q8_0))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_file(refs, os.path.join(out, "blocks_ref.safetensors"))
    with open(os.path.join(out, "blocks.json"), "w") as f:
        json.dump({"gguf": gguf.__name__ + " " + getattr(gguf, "__version__", "0.19.0"), "seed": SEED,
                   "metadata": {k: v for k, (_, v) in meta.items()}, "tensors": shapes}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
