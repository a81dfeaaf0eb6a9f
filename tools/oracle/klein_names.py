"""diffusers' klein names -> BFL's original ones (flux-2-klein-4b.safetensors, ae.safetensors), as
plans over names only, so that the torch-based oracle and the dependency-free peer-file writer
(tools/peer_files.py) share one table.

A transformer plan entry is (BFL name, parts): the BFL tensor is its parts concatenated along dim 0,
each part (diffusers name, half) with half None for the whole tensor, 0 or 1 for the first or
second half of its rows.
"""

import re

DOUBLE = {  # diffusers' name within transformer_blocks.N -> BFL's within double_blocks.N
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.to_out.0.weight": "img_attn.proj.weight",
    "ff.linear_in.weight": "img_mlp.0.weight",
    "ff.linear_out.weight": "img_mlp.2.weight",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
    "attn.to_add_out.weight": "txt_attn.proj.weight",
    "ff_context.linear_in.weight": "txt_mlp.0.weight",
    "ff_context.linear_out.weight": "txt_mlp.2.weight",
}
SINGLE = {
    "attn.to_qkv_mlp_proj.weight": "linear1.weight",
    "attn.to_out.weight": "linear2.weight",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
}
TOP = {
    "x_embedder.weight": "img_in.weight",
    "context_embedder.weight": "txt_in.weight",
    "time_guidance_embed.timestep_embedder.linear_1.weight": "time_in.in_layer.weight",
    "time_guidance_embed.timestep_embedder.linear_2.weight": "time_in.out_layer.weight",
    "double_stream_modulation_img.linear.weight": "double_stream_modulation_img.lin.weight",
    "double_stream_modulation_txt.linear.weight": "double_stream_modulation_txt.lin.weight",
    "single_stream_modulation.linear.weight": "single_stream_modulation.lin.weight",
    "proj_out.weight": "final_layer.linear.weight",
}


def _block_numbers(names, prefix):
    return sorted({int(k.split(".")[1]) for k in names if k.startswith(prefix)})


def bfl_transformer_plan(names):
    """[(BFL name, [(diffusers name, half)])] for a diffusers klein transformer's tensor names."""
    plan = []
    for n in _block_numbers(names, "transformer_blocks."):
        p = f"transformer_blocks.{n}."
        plan.append((f"double_blocks.{n}.img_attn.qkv.weight", [(p + f"attn.to_{x}.weight", None) for x in "qkv"]))
        plan.append((f"double_blocks.{n}.txt_attn.qkv.weight", [(p + f"attn.add_{x}_proj.weight", None) for x in "qkv"]))
        plan += [(f"double_blocks.{n}.{theirs}", [(p + ours, None)]) for ours, theirs in DOUBLE.items()]
    for n in _block_numbers(names, "single_transformer_blocks."):
        plan += [(f"single_blocks.{n}.{theirs}", [(f"single_transformer_blocks.{n}.{ours}", None)])
                 for ours, theirs in SINGLE.items()]
    plan += [(theirs, [(ours, None)]) for ours, theirs in TOP.items()]
    # diffusers' final norm holds (scale, shift), BFL's (shift, scale)
    plan.append(("final_layer.adaLN_modulation.1.weight", [("norm_out.linear.weight", 1), ("norm_out.linear.weight", 0)]))
    used = {name for _, parts in plan for name, _ in parts}
    assert used == set(names), sorted(used ^ set(names))
    return plan


_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_VAE_QUANT = {"quant_conv.weight": "encoder.quant_conv.weight", "quant_conv.bias": "encoder.quant_conv.bias",
              "post_quant_conv.weight": "decoder.post_quant_conv.weight",
              "post_quant_conv.bias": "decoder.post_quant_conv.bias"}


def vae_ldm_name(k, up_blocks):
    """(BFL ldm name, whether the tensor becomes a 1x1 conv weight) for one of diffusers'
    AutoencoderKLFlux2 names (quant convs nested, as in ae.safetensors); None for a name BFL's file
    does not carry."""
    if k == "bn.num_batches_tracked":
        return None
    n = k.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
    n = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", n)
    n = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", n)
    n = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m.group(1)) + 1}.", n)
    n = re.sub(r"^decoder\.up_blocks\.(\d+)\.resnets\.", lambda m: f"decoder.up.{up_blocks - 1 - int(m.group(1))}.block.", n)
    n = re.sub(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.", lambda m: f"decoder.up.{up_blocks - 1 - int(m.group(1))}.upsample.", n)
    m = re.match(r"^(encoder|decoder)\.mid_block\.attentions\.0\.(.+)\.(weight|bias)$", n)
    if m:
        return (f"{m.group(1)}.mid.attn_1.{_VAE_ATTN[m.group(2)]}.{m.group(3)}",
                m.group(2) != "group_norm" and m.group(3) == "weight")
    return _VAE_QUANT.get(n, n), False
