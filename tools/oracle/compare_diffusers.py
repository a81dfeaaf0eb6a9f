"""One diffusers script, run twice: through diffusers and through apus, the import the only change
(issue 44). The oracle venv has torch and diffusers; install apus into it first:

    build/oracle-venv/bin/pip install .
    build/oracle-venv/bin/python tools/oracle/compare_diffusers.py [FIXTURES]

Each case is a function of the pipelines' module, called once with `diffusers` and once with
`apus`; the images are compared pixel by pixel. The bound is the engine's own against the oracle
in fp32 (the op contract's roundings: a pixel may round the other way), stated per case.
"""
import os
import sys
import tempfile

import numpy as np
import torch


def text_to_image(lib, fixtures):
    pipe = lib.Flux2KleinPipeline.from_pretrained(f"{fixtures}/klein_tiny_a", dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    steps = []
    image = pipe(
        prompt="a red fox in tall grass",
        height=64,
        width=96,
        num_inference_steps=4,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(7),
        callback_on_step_end=lambda p, i, t, kwargs: steps.append((i, float(t))) or {},
        callback_on_step_end_tensor_inputs=[],
    ).images[0]
    return np.asarray(image), steps


def guided_batch(lib, fixtures):
    pipe = lib.Flux2KleinPipeline.from_pretrained(f"{fixtures}/klein_tiny_base", dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        prompt=["a lighthouse at dawn", "rain on a tin roof"],
        height=48,
        width=48,
        num_inference_steps=3,
        guidance_scale=3.5,
        generator=[torch.Generator().manual_seed(s) for s in (1, 2)],
    ).images
    return np.stack([np.asarray(i) for i in images]), []


def one_generator_batch(lib, fixtures):
    pipe = lib.Flux2KleinPipeline.from_pretrained(f"{fixtures}/klein_tiny_a", dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        prompt="a lighthouse at dawn",
        height=32,
        width=48,
        num_inference_steps=2,
        guidance_scale=1.0,
        num_images_per_prompt=3,
        generator=torch.Generator().manual_seed(3),
    ).images
    return np.stack([np.asarray(i) for i in images]), []


def sa3_folder(fixtures):
    """The tiny Stable Audio 3 pipeline in diffusers' layout, as tests/sa3_fixtures.h links it."""
    folder = tempfile.mkdtemp(prefix="apus_sa3_diffusers_")
    for name, part in [("model_index.json", "sa3_tiny/pipeline/model_index.json"),
                       ("scheduler", "sa3_tiny/pipeline/scheduler"),
                       ("duration_embedder", "sa3_tiny/pipeline/duration_embedder"),
                       ("transformer", "sa3_tiny/dit_diff"), ("vae", "sa3_tiny/same_l"),
                       ("text_encoder", "t5gemma_tiny"), ("tokenizer", "t5gemma_tok")]:
        os.symlink(os.path.abspath(os.path.join(fixtures, part)), os.path.join(folder, name))
    return folder


def text_to_audio(lib, fixtures):
    pipe = lib.StableAudio3Pipeline.from_pretrained(sa3_folder(fixtures), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    steps = []
    audios = pipe(
        "rain on a tin roof",
        duration=1.0,
        num_inference_steps=4,
        generator=[torch.Generator().manual_seed(5)],
        output_type="np",
        callback_on_step_end=lambda p, i, t, kwargs: steps.append((i, float(t))) or {},
        callback_on_step_end_tensor_inputs=[],
    ).audios
    return np.asarray(audios), steps


CASES = {"text_to_image": text_to_image, "guided_batch": guided_batch, "one_generator_batch": one_generator_batch}
AUDIO_CASES = {"text_to_audio": text_to_audio}


def main() -> int:
    fixtures = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
    import apus
    import diffusers

    worst = 0
    for name, case in CASES.items():
        ours, our_steps = case(apus, fixtures)
        theirs, their_steps = case(diffusers, fixtures)
        diff = np.abs(ours.astype(int) - theirs.astype(int))
        steps_agree = [i for i, _ in our_steps] == [i for i, _ in their_steps] and np.allclose(
            [t for _, t in our_steps], [t for _, t in their_steps], rtol=1e-4
        )
        print(f"{name}: {ours.shape}, max |apus - diffusers| {diff.max()} of 255, mean {diff.mean():.4f}, "
              f"{np.count_nonzero(diff)} of {diff.size} values differ; callbacks agree: {steps_agree}")
        worst = max(worst, int(diff.max()))
        if not steps_agree:
            print(f"  apus {our_steps}\n  diffusers {their_steps}")
            return 1
    # Reported, not held: on these components diffusers' StableAudio3Pipeline (0.42.1) does not
    # reproduce the official generate() it ports (apus renders the same clip from this folder and
    # from the official layout, and the official layout's clip is the official code's:
    # tests/fixtures/sa3_pipeline_ref); the callbacks' sigmas agree, the clips differ.
    for name, case in AUDIO_CASES.items():
        ours, our_steps = case(apus, fixtures)
        theirs, their_steps = case(diffusers, fixtures)
        print(f"{name}: {ours.shape} against {theirs.shape}, max |apus - diffusers| "
              f"{np.abs(ours - theirs).max() if ours.shape == theirs.shape else 'shapes differ'}; "
              f"callbacks: apus {our_steps}, diffusers {their_steps}")
    # fp32 on both sides: what differs is summation order, at most one rounding of a pixel.
    return 0 if worst <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
