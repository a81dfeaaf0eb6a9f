"""Record torch's CPU randn output as fixtures for apus::TorchGenerator.

Writes tests/fixtures/torch_randn.safetensors (one tensor per draw, stored in its own dtype)
and tests/fixtures/torch_randn.json, an index with one entry per tensor:

  key        tensor name in the safetensors file
  seed       value given to torch.Generator("cpu").manual_seed
  numel      element count (the shape only matters through it: randn fills contiguously)
  dtype      "f32" or "bf16"
  successive true when the draw is one of several from a single generator
  sequence   draws sharing a sequence come from one generator, in ascending `draw` order
  draw       position of the draw within its sequence
  kernel     torch's float32 Box-Muller kernel that produced it: "avx2" (x86 builds with
             AVX2 or AVX-512, the usual case) or "scalar" (ATEN_CPU_CAPABILITY=default)

diffusers' randn_tensor calls torch.randn(shape, generator=g, dtype=dtype) with the
pipeline's dtype, hence both float32 and bfloat16.  Run with the oracle venv:

  /work/venv-oracle/bin/python tools/oracle/make_rng_fixtures.py
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT_ST = os.path.join(ROOT, "tests", "fixtures", "torch_randn.safetensors")
OUT_JSON = os.path.join(ROOT, "tests", "fixtures", "torch_randn.json")

SEEDS = [0, 42, 2**32 + 7, 2**64 - 59]
SIZES = [1, 5, 15, 16, 17, 100, 1000, 128 * 3 * 4]
BIG = 6144
BIG_SEEDS = [0, 2**64 - 59]  # the big size for two seeds only, to keep the file small

# Each sequence: (name, seed, [(numel, dtype), ...]) drawn one after another from one
# generator.  They cover the cached second Box-Muller value of the small path (kept across
# calls, across a large draw in between, and across dtypes) and the state advance of the
# large path's ragged tail.
SEQUENCES = [
    ("seq_small_f32", 42, [(5, "f32"), (5, "f32"), (3, "f32")]),
    ("seq_large_f32", 7, [(17, "f32"), (100, "f32"), (16, "f32")]),
    ("seq_cache_across", 0, [(5, "f32"), (16, "f32"), (3, "bf16"), (33, "bf16"), (1, "f32")]),
    ("seq_bf16", 2**32 + 7, [(100, "bf16"), (1000, "bf16")]),
]

# Cases recorded with torch's generic (non-AVX2) float32 kernel, drawn in a child process.
SCALAR_CASES = [(0, 100), (42, 1000), (2**64 - 59, 17)]


def torch_dtype(torch, name):
    return {"f32": torch.float32, "bf16": torch.bfloat16}[name]


def draw(torch, seed, numel, dtype):
    g = torch.Generator("cpu").manual_seed(seed)
    return torch.randn(numel, generator=g, dtype=torch_dtype(torch, dtype))


def scalar_child(path):
    """Runs in a child started with ATEN_CPU_CAPABILITY=default."""
    import torch
    from safetensors.torch import save_file

    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT", torch.backends.cpu.get_cpu_capability()
    save_file({f"{s}_{n}": draw(torch, s, n, "f32") for s, n in SCALAR_CASES}, path)


def main():
    import torch
    from safetensors.torch import load_file, save_file

    capability = torch.backends.cpu.get_cpu_capability()
    # AVX2 and AVX512 builds share the float32 kernel; anything else would mislabel "avx2".
    assert capability in ("AVX2", "AVX512"), capability

    tensors, index = {}, []

    def add(key, seed, t, dtype, sequence, drawn, successive, kernel="avx2"):
        tensors[key] = t.contiguous()
        index.append({"key": key, "seed": seed, "numel": t.numel(), "dtype": dtype,
                      "successive": successive, "sequence": sequence, "draw": drawn,
                      "kernel": kernel})

    for seed in SEEDS:
        sizes = SIZES + ([BIG] if seed in BIG_SEEDS else [])
        for numel in sizes:
            for dtype in ("f32", "bf16"):
                key = f"{dtype}_s{seed}_n{numel}"
                add(key, seed, draw(torch, seed, numel, dtype), dtype, key, 0, False)

    for name, seed, draws in SEQUENCES:
        g = torch.Generator("cpu").manual_seed(seed)
        for i, (numel, dtype) in enumerate(draws):
            t = torch.randn(numel, generator=g, dtype=torch_dtype(torch, dtype))
            add(f"{name}_{i}", seed, t, dtype, name, i, True)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "scalar.safetensors")
        env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--scalar-child", path],
                       env=env, check=True)
        scalar = load_file(path)
    for seed, numel in SCALAR_CASES:
        key = f"scalar_f32_s{seed}_n{numel}"
        add(key, seed, scalar[f"{seed}_{numel}"], "f32", key, 0, False, kernel="scalar")

    os.makedirs(os.path.dirname(OUT_ST), exist_ok=True)
    save_file(tensors, OUT_ST, metadata={"torch": torch.__version__, "cpu_capability": capability})
    os.chmod(OUT_ST, 0o644)
    with open(OUT_JSON, "w") as f:
        # One case per line keeps the index small and diffs readable.
        f.write('{"torch": %s, "cpu_capability": %s, "cases": [\n' %
                (json.dumps(torch.__version__), json.dumps(capability)))
        f.write(",\n".join(json.dumps(c) for c in index))
        f.write("\n]}\n")
    print(f"{len(index)} tensors, {os.path.getsize(OUT_ST)} bytes -> {OUT_ST}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--scalar-child":
        scalar_child(sys.argv[2])
    else:
        main()
