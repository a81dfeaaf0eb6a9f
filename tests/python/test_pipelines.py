"""The Python package against the CLI (issue 44), on the tiny fixtures: tests/python/run.sh
installs the package as a user does (`pip install .` into a fresh venv) and runs this with
APUS_CLI (the CLI built from the same tree) and APUS_FIXTURES set."""
import io
import os
import random
import signal
import subprocess
import threading
import time
import wave

import numpy as np
import pytest
from PIL import Image

import apus

CLI = os.environ["APUS_CLI"]
FIXTURES = os.environ["APUS_FIXTURES"]
KLEIN = os.path.join(FIXTURES, "klein_tiny_a")
KLEIN_BASE = os.path.join(FIXTURES, "klein_tiny_base")
KLEIN_KV = os.path.join(FIXTURES, "klein_tiny_9b_kv")
SEED = random.randrange(1, 2**31)
print(f"test_pipelines: seed {SEED}")


def cli(*args, cwd):
    """Runs the CLI; returns its error line ("" when it succeeded)."""
    done = subprocess.run([CLI, *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode == 0:
        return ""
    return done.stderr.strip().splitlines()[-1].removeprefix("error: ")


def same_file(a, b):
    with open(a, "rb") as f, open(b, "rb") as g:
        return f.read() == g.read()


@pytest.fixture(scope="module")
def klein():
    return apus.Flux2KleinPipeline.from_pretrained(KLEIN)


@pytest.fixture(scope="module")
def sa3(tmp_path_factory):
    """The tiny Stable Audio 3 model in its official layout (tests/sa3_model_dir.sh)."""
    folder = tmp_path_factory.mktemp("sa3") / "model"
    script = os.path.join(os.path.dirname(__file__), "..", "sa3_model_dir.sh")
    subprocess.run(["bash", "-c", f'source "{script}" && sa3_model_dir "{FIXTURES}" "{folder}"'], check=True)
    return str(folder)


def test_the_package_carries_its_layouts_and_stubs():
    package = os.path.dirname(apus.__file__)
    tree = os.path.join(os.path.dirname(__file__), "..", "..", "python", "apus")
    assert os.path.realpath(package) != os.path.realpath(tree), "the tree's package, not the installed one"
    assert os.environ["APUS_DATA_DIR"] == os.path.join(package, "data")
    assert os.path.isfile(os.path.join(package, "data", "flux2-klein-4b", "model_index.json"))
    with open(os.path.join(package, "_apus.pyi")) as f:
        stub = f.read()
    assert "class ImageModel" in stub and "def generate(" in stub
    assert os.path.isfile(os.path.join(package, "py.typed"))
    assert apus.__version__ == subprocess.run([CLI, "--version"], capture_output=True, text=True).stdout.split()[1]


def test_images_are_the_clis_bytes_and_pixels(klein, tmp_path):
    steps = []
    out = klein(
        prompt="a fox",
        height=32,
        width=48,
        num_inference_steps=3,
        num_images_per_prompt=2,
        seed=SEED,
        callback_on_step_end=lambda pipe, i, t, kwargs: steps.append((i, t)) or {},
    )
    assert [i for i, _ in steps] == [0, 1, 2]
    assert steps[0][1] == 1000 and steps[0][1] > steps[1][1] > steps[2][1] > 0
    assert out.seeds == [SEED, SEED + 1]
    assert cli("image", "--model", KLEIN, "-p", "a fox", "-W", "48", "-H", "32", "--steps", "3", "-s", str(SEED),
               "-n", "2", "-o", "cli.png", cwd=tmp_path) == ""
    for i in range(2):
        out.save(tmp_path / f"py-{i + 1}.png", index=i)
        assert same_file(tmp_path / f"cli-{i + 1}.png", tmp_path / f"py-{i + 1}.png"), i
        assert out.images[i].size == (48, 32)
        assert np.array_equal(np.asarray(out.images[i]), np.asarray(Image.open(tmp_path / f"cli-{i + 1}.png")))
    np_out = klein("a fox", height=32, width=48, num_inference_steps=3, seed=SEED, output_type="np", return_dict=False)
    assert isinstance(np_out, tuple) and np_out[0].shape == (1, 32, 48, 3) and np_out[0].dtype == np.float32
    assert np.array_equal(np.round(np_out[0][0] * 255).astype(np.uint8), np.asarray(out.images[0]))


def test_guidance_editing_and_loras_are_the_clis(tmp_path):
    base = apus.Flux2KleinPipeline.from_pretrained(KLEIN_BASE)
    out = base("a fox", height=32, width=32, num_inference_steps=2, guidance_scale=3.5, negative_prompt="rain",
               seed=SEED)
    out.save(tmp_path / "py.png")
    assert cli("image", "--model", KLEIN_BASE, "-p", "a fox", "-W", "32", "-H", "32", "--steps", "2", "--cfg", "3.5",
               "--negative-prompt", "rain", "-s", str(SEED), "-o", "cli.png", cwd=tmp_path) == ""
    assert same_file(tmp_path / "cli.png", tmp_path / "py.png")

    klein = apus.Flux2KleinPipeline.from_pretrained(KLEIN)
    lora = os.path.join(FIXTURES, "klein_lora", "bfl.safetensors")
    adapted = klein("a fox", height=32, width=32, num_inference_steps=2, seed=SEED, loras=[(lora, 0.7), lora])
    adapted.save(tmp_path / "py-lora.png")
    assert cli("image", "--model", KLEIN, "-p", "a fox", "-W", "32", "-H", "32", "--steps", "2", "-s", str(SEED),
               "--lora", lora + ":0.7", "--lora", lora, "-o", "cli-lora.png", cwd=tmp_path) == ""
    assert same_file(tmp_path / "cli-lora.png", tmp_path / "py-lora.png")

    exact = apus.Flux2KleinPipeline.from_pretrained(KLEIN, dtype="float32")
    exact("a fox", height=32, width=32, num_inference_steps=2, seed=SEED).save(tmp_path / "py-fp32.png")
    assert cli("image", "--model", KLEIN, "-p", "a fox", "-W", "32", "-H", "32", "--steps", "2", "-s", str(SEED),
               "--precision", "fp32", "-o", "cli-fp32.png", cwd=tmp_path) == ""
    assert same_file(tmp_path / "cli-fp32.png", tmp_path / "py-fp32.png")
    klein("a fox", height=32, width=32, num_inference_steps=2, seed=SEED).save(tmp_path / "py-bf16.png")
    assert not same_file(tmp_path / "py-bf16.png", tmp_path / "py-fp32.png"), "dtype=float32 changed nothing"

    reference = str(tmp_path / "reference.png")
    Image.fromarray(np.random.default_rng(SEED).integers(0, 256, (80, 96, 3), dtype=np.uint8)).save(reference)
    edit = klein(image=Image.open(reference), prompt="a fox", num_inference_steps=2, seed=SEED)
    edit.save(tmp_path / "py-edit.png")
    assert cli("image", "--model", KLEIN, "-p", "a fox", "-i", reference, "--steps", "2", "-s", str(SEED),
               "-o", "cli-edit.png", cwd=tmp_path) == ""
    assert same_file(tmp_path / "cli-edit.png", tmp_path / "py-edit.png")

    inpaint = apus.Flux2KleinInpaintPipeline.from_pretrained(KLEIN)
    mask = str(tmp_path / "mask.png")
    squares = np.zeros((80, 96, 3), np.uint8)
    squares[:40, :48] = squares[40:, 48:] = 255
    Image.fromarray(squares).save(mask)
    painted = inpaint("a fox", image=Image.open(reference), mask_image=Image.open(mask), strength=0.6,
                      num_inference_steps=3, seed=SEED)
    painted.save(tmp_path / "py-inpaint.png")
    assert cli("image", "--model", KLEIN, "-p", "a fox", "-i", reference, "--mask", mask, "--strength", "0.6",
               "--steps", "3", "-s", str(SEED), "-o", "cli-inpaint.png", cwd=tmp_path) == ""
    assert same_file(tmp_path / "cli-inpaint.png", tmp_path / "py-inpaint.png")

    kv = apus.DiffusionPipeline.from_pretrained(KLEIN_KV)
    assert isinstance(kv, apus.Flux2KleinKVPipeline)
    kv_out = kv(image=Image.open(reference), prompt="a fox", seed=SEED)
    kv_out.save(tmp_path / "py-kv.png")
    assert cli("image", "--model", KLEIN_KV, "-p", "a fox", "-i", reference, "-s", str(SEED), "-o", "cli-kv.png",
               cwd=tmp_path) == ""
    assert same_file(tmp_path / "cli-kv.png", tmp_path / "py-kv.png")


def test_clips_are_the_clis_bytes_and_samples(sa3, tmp_path):
    pipe = apus.StableAudio3Pipeline.from_pretrained(sa3)
    steps = []
    out = pipe("rain", duration=1, num_inference_steps=2, guidance_scale=4, negative_prompt="wind", seed=SEED,
               output_type="np", callback_on_step_end=lambda p, i, t, kw: steps.append(i))
    assert steps == [0, 1]
    out.save(tmp_path / "py.wav")
    assert cli("audio", "--model", sa3, "-p", "rain", "--seconds", "1", "--steps", "2", "--cfg", "4",
               "--negative-prompt", "wind", "-s", str(SEED), "-o", "cli.wav", cwd=tmp_path) == ""
    assert same_file(tmp_path / "cli.wav", tmp_path / "py.wav")
    with wave.open(str(tmp_path / "cli.wav")) as w:
        assert (w.getframerate(), w.getnchannels()) == (out.sample_rate, out.audios.shape[1])
        pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16).reshape(-1, w.getnchannels()).T
    # The file holds the samples rounded to 16 bits: channels and frames in diffusers' order.
    assert out.audios.shape == (1,) + pcm.shape
    assert np.max(np.abs(out.audios[0] * 32767 - pcm)) <= 1
    # The fp32 parity mode: a resident Stable Audio 3 model holds bf16 weights, so float32 opens
    # it per stage, as the CLI runs.
    exact = apus.StableAudio3Pipeline.from_pretrained(sa3, dtype="float32")
    exact("rain", duration=1, num_inference_steps=2, seed=SEED, output_type="np").save(tmp_path / "py-fp32.wav")
    assert cli("audio", "--model", sa3, "-p", "rain", "--seconds", "1", "--steps", "2", "-s", str(SEED),
               "--precision", "fp32", "-o", "cli-fp32.wav", cwd=tmp_path) == ""
    assert same_file(tmp_path / "cli-fp32.wav", tmp_path / "py-fp32.wav")
    assert exact.to("cpu") is exact and exact.device == "cpu"


def test_the_progress_bar_counts_the_steps(klein):
    bar = io.StringIO()
    klein.set_progress_bar_config(file=bar, ascii=True)
    try:
        klein("a fox", height=32, width=32, num_inference_steps=3, seed=SEED)
    finally:
        klein.set_progress_bar_config(disable=True)
    assert "3/3" in bar.getvalue(), bar.getvalue()


def test_a_step_callback_interrupt_and_an_exception_stop_the_run(klein):
    seen = []

    def interrupt(pipe, i, t, kwargs):
        seen.append(i)
        pipe._interrupt = True
        return {}

    out = klein("a fox", height=32, width=32, num_inference_steps=4, seed=SEED, callback_on_step_end=interrupt)
    assert seen == [0] and len(out.images) == 1

    class Mine(Exception):
        pass

    def fail(pipe, i, t, kwargs):
        seen.append(i)
        raise Mine("stop here")

    seen.clear()
    with pytest.raises(Mine):
        klein("a fox", height=32, width=32, num_inference_steps=4, seed=SEED, callback_on_step_end=fail)
    assert seen == [0]


def test_ctrl_c_cancels_within_a_step_and_the_pipeline_goes_on(klein, tmp_path):
    seen = []

    def ctrl_c(pipe, i, t, kwargs):
        seen.append(i)
        if i == 0:
            os.kill(os.getpid(), signal.SIGINT)

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        klein("a fox", height=1024, width=1024, num_inference_steps=200, seed=SEED, callback_on_step_end=ctrl_c)
    # A 1024x1024 step of the tiny model takes ~0.4 s here; 200 of them a minute and more.
    assert len(seen) <= 2, seen
    print(f"Ctrl-C: {len(seen)} steps reported, {time.monotonic() - started:.2f} s")
    out = klein("a fox", height=32, width=32, num_inference_steps=2, seed=SEED)
    out.save(tmp_path / "py.png")
    assert cli("image", "--model", KLEIN, "-p", "a fox", "-W", "32", "-H", "32", "--steps", "2", "-s", str(SEED),
               "-o", "cli.png", cwd=tmp_path) == ""
    assert same_file(tmp_path / "cli.png", tmp_path / "py.png")


def test_threads_on_one_pipeline_give_the_serial_bytes(klein):
    prompts = ["a fox", "a lighthouse at dawn", "rain on a tin roof"]
    serial = [np.asarray(klein(p, height=32, width=32, num_inference_steps=2, seed=SEED + k).images[0])
              for k, p in enumerate(prompts)]
    threaded = [None] * len(prompts)

    def render(k):
        threaded[k] = np.asarray(klein(prompts[k], height=32, width=32, num_inference_steps=2, seed=SEED + k).images[0])

    workers = [threading.Thread(target=render, args=(k,)) for k in range(len(prompts))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for k in range(len(prompts)):
        assert np.array_equal(serial[k], threaded[k]), k


def test_previews_come_after_every_step(klein, sa3):
    seen = []
    klein("a fox", height=32, width=32, num_inference_steps=3, seed=SEED, num_images_per_prompt=2,
          preview=lambda i, step, steps, image: seen.append((i, step, steps, image.size)))
    assert sorted(seen) == [(i, s, 3, (4, 4)) for i in range(2) for s in (1, 2, 3)]
    peaks = []
    apus.StableAudio3Pipeline.from_pretrained(sa3)("rain", duration=1, num_inference_steps=2, seed=SEED,
                                                   preview=lambda i, step, steps, p: peaks.append((step, p.size)))
    assert [s for s, _ in peaks] == [1, 2] and all(n > 0 and n % 2 == 0 for _, n in peaks)


def test_the_clis_refusals_are_python_errors_with_its_messages(klein, sa3, tmp_path):
    with pytest.raises(apus.Error) as e:
        klein("a fox", height=32, width=17, num_inference_steps=2, seed=SEED)
    assert str(e.value) == cli("image", "--model", KLEIN, "-p", "a fox", "-W", "17", "-H", "32", "--steps", "2",
                               "-o", "x.png", cwd=tmp_path)
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(apus.Error) as e:
        apus.Flux2KleinPipeline.from_pretrained(missing)
    assert str(e.value) == cli("image", "--model", missing, "-p", "a fox", "-o", "x.png", cwd=tmp_path)
    with pytest.raises(apus.Error) as e:
        apus.StableAudio3Pipeline.from_pretrained(sa3)("rain", duration=100000, num_inference_steps=2, seed=SEED)
    assert str(e.value) == cli("audio", "--model", sa3, "-p", "rain", "--seconds", "100000", "--steps", "2",
                               "-o", "x.wav", cwd=tmp_path)
    with pytest.raises(apus.Error) as e:
        klein("a fox", height=32, width=32, num_inference_steps=2, negative_prompt="rain")
    assert str(e.value) == cli("image", "--model", KLEIN, "-p", "a fox", "-W", "32", "-H", "32", "--steps", "2",
                               "--negative-prompt", "rain", "-o", "x.png", cwd=tmp_path)


@pytest.mark.parametrize(
    "arguments, named",
    [
        (dict(sigmas=[1.0, 0.5]), "sigmas"),
        (dict(latents=np.zeros(4)), "latents"),
        (dict(prompt_embeds=np.zeros(4)), "prompt_embeds"),
        (dict(output_type="latent"), "output_type"),
        (dict(max_sequence_length=256), "max_sequence_length"),
        (dict(text_encoder_out_layers=(9, 18)), "text_encoder_out_layers"),
        (dict(attention_kwargs={"scale": 0.5}), "attention_kwargs"),
        (dict(callback_on_step_end_tensor_inputs=["latents"], callback_on_step_end=lambda *a: {}),
         "callback_on_step_end_tensor_inputs"),
        (dict(callback_on_step_end=lambda p, i, t, kw: {"latents": 0}), "callback_on_step_end"),
        (dict(generator=object()), "generator"),
        (dict(num_images_per_prompt=0), "num_images_per_prompt"),
    ],
)
def test_what_apus_does_not_implement_is_refused_by_name(klein, arguments, named):
    settings = dict(prompt="a fox", height=32, width=32, num_inference_steps=2, seed=None if "generator" in arguments else SEED)
    settings.update(arguments)
    with pytest.raises(apus.Error) as e:
        klein(**settings)
    assert str(e.value).startswith(named), str(e.value)


def test_refusals_of_the_other_pipelines_and_of_opening(sa3):
    with pytest.raises(apus.Error, match="^padding_mask_crop"):
        apus.Flux2KleinInpaintPipeline.from_pretrained(KLEIN)("a fox", image=Image.new("RGB", (32, 32)),
                                                              mask_image=Image.new("RGB", (32, 32)), padding_mask_crop=8)
    pipe = apus.StableAudio3Pipeline.from_pretrained(sa3)
    for arguments, named in [(dict(logsnr_min=-5.0), "logsnr_min"), (dict(silence_padding_duration=1.0), "silence_padding_duration"),
                             (dict(prompt_embeds=np.zeros(3)), "prompt_embeds"), (dict(output_type="latent"), "output_type")]:
        with pytest.raises(apus.Error, match=f"^{named}"):
            pipe("rain", duration=1, num_inference_steps=2, seed=SEED, **arguments)
    with pytest.raises(apus.Error, match="^from_pretrained: revision="):
        apus.Flux2KleinPipeline.from_pretrained(KLEIN, revision="main")
    with pytest.raises(apus.Error, match="^dtype=float16"):
        apus.Flux2KleinPipeline.from_pretrained(KLEIN, torch_dtype="float16")
    with pytest.raises(apus.Error, match="^quant="):
        apus.Flux2KleinPipeline.from_pretrained(KLEIN, quant="int4")


@pytest.mark.parametrize("quant", ["q8_0", "fp8"])
def test_a_quantised_model_renders_with_its_codes(klein, quant):
    coded = apus.Flux2KleinPipeline.from_pretrained(KLEIN, quant=quant)
    plain = np.asarray(klein("a fox", height=32, width=32, num_inference_steps=2, seed=SEED).images[0])
    codes = np.asarray(coded("a fox", height=32, width=32, num_inference_steps=2, seed=SEED).images[0])
    assert plain.shape == codes.shape and not np.array_equal(plain, codes), f"{quant}, seed {SEED}"


def test_count_prices_the_request_without_computing_it(klein):
    small = klein.count("a fox", height=256, width=256, num_inference_steps=2)
    large = klein.count("a fox", height=512, width=512, num_inference_steps=3)
    stage = lambda cost, name: next(s for s in cost["stages"] if s["name"] == name)  # noqa: E731
    assert stage(small, "text_encoder") == stage(large, "text_encoder")
    assert (stage(small, "dit_step")["calls"], stage(large, "dit_step")["calls"]) == (2, 3)
    # 256 and 1024 image tokens beside the prompt's 512: more than twice the work per step.
    assert stage(large, "dit_step")["flops"] / 3 > 2 * stage(small, "dit_step")["flops"] / 2
