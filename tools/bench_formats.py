#!/usr/bin/env python3
"""klein's transformer from a diffusers folder (an `apus synth` checkpoint) as the single files
users download, for timing and memory figures beside the folder's bf16 (docs/SPEED.md): BFL's
names as flux-2-klein-4b.safetensors carries them, in

  flux-2-klein-fp8.safetensors    2-D weights float8_e4m3fn scaled per tensor (amax / 448) with
                                  .weight_scale, as flux-2-klein-4b-fp8.safetensors
  flux-2-klein-Q8_0.gguf          2-D weights Q8_0 by gguf-py's quantiser, norms F32
  flux-2-klein-Q4_K_M.gguf        2-D weights whose rows hold 256 values as Q4_K (Q6_K for the
                                  second projections, as llama.cpp's _M mix), others Q8_0. gguf-py
                                  has no K-quant quantiser: those blocks are random bytes with small
                                  scales, the synthetic model's shapes and bytes but not its values

Tensor by tensor (a 4B model does not fit in memory as f32). Reuses the oracle's name tables.

Usage: bench_formats.py FOLDER/transformer OUT_DIR
"""

import os
import sys

import numpy as np
import torch
import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "oracle"))
from klein_names import bfl_transformer_plan  # noqa: E402
from make_klein_single_file_fixtures import bfl_tensor, random_k_blocks  # noqa: E402


def bfl_tensors(folder):
    """(BFL name, bf16 torch tensor) in file order, one at a time."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    handles = [safe_open(os.path.join(folder, f), framework="pt") for f in files]
    where = {k: h for h in handles for k in h.keys()}
    get = lambda k: where[k].get_tensor(k)  # noqa: E731
    for name, parts in bfl_transformer_plan(where):
        yield name, bfl_tensor(get, parts)


def main():
    folder, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    fp8 = {}
    q8 = gguf.GGUFWriter(os.path.join(out, "flux-2-klein-Q8_0.gguf"), arch="flux")
    q4 = gguf.GGUFWriter(os.path.join(out, "flux-2-klein-Q4_K_M.gguf"), arch="flux")
    q4.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    rng = np.random.default_rng(20261203)
    for name, t in bfl_tensors(folder):
        t = t.contiguous()
        if t.ndim != 2:
            fp8[name] = t
            values = t.float().numpy()
            q8.add_tensor(name, values)
            q4.add_tensor(name, values)
            continue
        values = t.float()
        scale = (values.abs().max() / 448.0).reshape(())
        fp8[name] = (values / scale).to(torch.float8_e4m3fn)
        fp8[name[: -len(".weight")] + ".weight_scale"] = scale.clone()
        values = values.numpy()
        q8.add_tensor(name, quants.quantize(values, T.Q8_0), raw_dtype=T.Q8_0)
        if values.shape[-1] % 256 == 0:
            kind = T.Q6_K if name.endswith(("linear2.weight", "mlp.2.weight", "proj.weight")) else T.Q4_K
            q4.add_tensor(name, random_k_blocks(values.shape[0], values.shape[1], kind, rng), raw_dtype=kind)
        else:
            q4.add_tensor(name, quants.quantize(values, T.Q8_0), raw_dtype=T.Q8_0)
        print(name, flush=True)
    save_file(fp8, os.path.join(out, "flux-2-klein-fp8.safetensors"))
    del fp8
    for w in (q8, q4):
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


if __name__ == "__main__":
    main()
