#!/usr/bin/env python3
"""The clients people already have, unchanged, against `apus serve` on the tiny fixtures.

webuiapi (AUTOMATIC1111's API, as front ends call it) and the official openai SDK, from PyPI
(tests/clients/run.sh installs them into build/clients-venv). Every image and clip a client gets
back is held to what the engine renders for the same request through the CLI (the same pixels, the
same samples), or to what the call must do to it (its size, its format, the strength's effect),
not only to a status code.

Usage: clients_test.py APUS FIXTURES   (run by ctest through tests/clients/run.sh)
"""
import base64
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request
import wave

import numpy as np
import openai
import webuiapi
import websocket
from PIL import Image

APUS, FIXTURES = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
SCRATCH = tempfile.mkdtemp(prefix="apus_clients_")
SERVER = None
BASE = ""
AUDIO_ID = ""


def pixels(image):
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def png_pixels(data):
    return pixels(Image.open(io.BytesIO(data)))


def wav_samples(data):
    with wave.open(io.BytesIO(data)) as w:
        return w.getnchannels(), w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)


def cli(*args):
    """Runs the CLI, failing the test with its stderr when it fails."""
    p = subprocess.run([APUS, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise AssertionError("apus " + " ".join(args) + " failed:\n" + p.stderr)


def cli_image(name, *args):
    out = os.path.join(SCRATCH, name + ".png")
    cli("image", "--model", os.path.join(FIXTURES, "klein_tiny_a"), "-o", out, *args)
    with open(out, "rb") as f:
        return png_pixels(f.read())


def sa3_official_folder():
    """The tiny SA3 model in the official layout, as tests/sa3_fixtures.h assembles it."""
    d = os.path.join(SCRATCH, "sa3_official")
    os.makedirs(os.path.join(d, "t5gemma-b-b-ul2"))
    for f in ("model_config.json", "model.safetensors"):
        os.symlink(os.path.join(FIXTURES, "sa3_tiny/original", f), os.path.join(d, f))
    for src, files in (("t5gemma_tiny", ("config.json", "model.safetensors")),
                       ("t5gemma_tok", ("tokenizer.model", "tokenizer_config.json"))):
        for f in files:
            os.symlink(os.path.join(FIXTURES, src, f), os.path.join(d, "t5gemma-b-b-ul2", f))
    return d


def setUpModule():
    global SERVER, BASE, AUDIO_ID
    loras = os.path.join(SCRATCH, "loras")
    os.makedirs(loras)
    for f in ("peft.safetensors", "kohya.safetensors"):
        os.symlink(os.path.join(FIXTURES, "klein_lora", f), os.path.join(loras, f))
    SERVER = subprocess.Popen([APUS, "serve", "--model", os.path.join(FIXTURES, "klein_tiny_a"), "--model",
                               sa3_official_folder(), "--lora-dir", loras, "--port", "0",
                               "--alias", "house-painter=klein_tiny_a"],
                              stderr=subprocess.PIPE, text=True)
    said = []
    for line in SERVER.stderr:
        said.append(line)
        m = re.search(r"serving \d+ model\(s\) on (http://[0-9.]+:\d+)", line)
        if m:
            BASE = m.group(1)
            break
    if not BASE:
        raise RuntimeError("apus serve did not start:\n" + "".join(said))
    # Its later lines are not read: drained, so the server never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in SERVER.stderr], daemon=True).start()
    models = json.load(urllib.request.urlopen(BASE + "/v1/models"))["data"]
    AUDIO_ID = next(m["id"] for m in models if m["id"] != "klein_tiny_a")


def tearDownModule():
    if SERVER:
        SERVER.terminate()
        SERVER.wait(60)


class WebUiApi(unittest.TestCase):
    """webuiapi 0.9 as a script calls it: its defaults, its result objects. Its one default apus
    refuses is the sampler, "Euler a" (ancestral: noise added back each step), which FLUX.2 [klein]'s
    pipeline does not run: the refusal says how to ask for the model's own."""

    @classmethod
    def setUpClass(cls):
        host, port = BASE.rsplit("//", 1)[1].split(":")
        cls.api = webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler")
        cls.default_api = webuiapi.WebUIApi(host=host, port=int(port))

    def test_the_default_ancestral_sampler_is_refused_saying_what_to_ask_for(self):
        with self.assertRaises(RuntimeError) as e:
            self.default_api.txt2img(prompt="a fox", seed=1, width=32, height=32, steps=2)
        self.assertEqual(e.exception.args[0], 400)
        self.assertIn("WebUIApi(sampler='Euler')", e.exception.args[1])

    def test_txt2img_renders_what_the_cli_renders(self):
        r = self.api.txt2img(prompt="a red fox in snow", seed=7, width=64, height=48, steps=2)
        self.assertEqual(len(r.images), 1)
        self.assertEqual(r.images[0].size, (64, 48))
        self.assertEqual(r.info["seed"], 7)
        want = cli_image("fox7", "-p", "a red fox in snow", "-s", "7", "-W", "64", "-H", "48", "--steps", "2")
        np.testing.assert_array_equal(pixels(r.images[0]), want)
        # The PNG's parameters (webuiapi sends its text chunks back), read by png-info as A1111 reads them.
        info = self.api.png_info(r.images[0])
        self.assertIn("Seed: 7", info.info)
        self.assertIn("a red fox in snow", info.info)

    def test_n_iter_gives_consecutive_seeds(self):
        r = self.api.txt2img(prompt="a lighthouse", seed=11, width=32, height=32, steps=2, n_iter=2)
        self.assertEqual(len(r.images), 2)
        self.assertEqual(r.info["all_seeds"], [11, 12])
        want = cli_image("house12", "-p", "a lighthouse", "-s", "12", "-W", "32", "-H", "32", "--steps", "2")
        np.testing.assert_array_equal(pixels(r.images[1]), want)

    def test_a_lora_tag_applies_the_file(self):
        tagged = self.api.txt2img(prompt="a fox <lora:peft:0.7>", seed=5, width=32, height=32, steps=2)
        # The tag is taken out and the text around it left as it is, as A1111 does: "a fox ".
        want = cli_image("fox_peft", "-p", "a fox ", "-s", "5", "-W", "32", "-H", "32", "--steps", "2", "--lora",
                         os.path.join(FIXTURES, "klein_lora/peft.safetensors") + ":0.7")
        np.testing.assert_array_equal(pixels(tagged.images[0]), want)
        plain = self.api.txt2img(prompt="a fox ", seed=5, width=32, height=32, steps=2)
        self.assertGreater(np.abs(pixels(plain.images[0]) - want).max(), 0, "the LoRA must change the image")
        with self.assertRaises(RuntimeError) as e:
            self.api.txt2img(prompt="a fox <lora:nowhere:1>", seed=5, width=32, height=32, steps=2)
        self.assertIn("nowhere", str(e.exception))

    def test_img2img_keeps_more_of_the_image_at_lower_strength(self):
        source = self.api.txt2img(prompt="a red fox", seed=3, width=64, height=48, steps=2).images[0]
        path = os.path.join(SCRATCH, "source.png")
        source.save(path)
        white = os.path.join(SCRATCH, "white.png")
        Image.new("L", source.size, 255).save(white)
        # At the image's size: the whole image repainted at the strength, as the CLI's inpainting
        # with a white mask does.
        r = self.api.img2img(images=[source], prompt="a blue fox", seed=9, width=64, height=48, steps=4,
                             denoising_strength=0.5)
        want = cli_image("img2img", "-p", "a blue fox", "-s", "9", "--steps", "4", "-i", path, "--mask", white,
                         "--strength", "0.5")
        np.testing.assert_array_equal(pixels(r.images[0]), want)
        distance = []
        for strength in (0.25, 1.0):
            out = self.api.img2img(images=[source], prompt="a blue fox", seed=9, width=64, height=48, steps=4,
                                   denoising_strength=strength).images[0]
            distance.append(np.abs(pixels(out) - pixels(source)).mean())
        self.assertLess(distance[0], distance[1])
        # At webuiapi's defaults (512x512, whatever the image's size): resized, as A1111 does.
        r = self.api.img2img(images=[source], prompt="a blue fox", seed=9, steps=2)
        self.assertEqual(r.images[0].size, (512, 512))

    def test_progress_shows_a_preview_mid_run_and_interrupt_returns_the_image_so_far(self):
        result = {}

        def run():
            result["r"] = self.api.txt2img(prompt="a long render", seed=1, width=256, height=256, steps=200)

        t = threading.Thread(target=run)
        t.start()
        seen = None
        deadline = time.time() + 300
        while time.time() < deadline and t.is_alive():
            p = self.api.get_progress()
            if p["current_image"] and 0 < p["progress"] < 1 and p["state"]["sampling_step"] >= 1:
                seen = p
                break
            time.sleep(0.2)
        self.assertIsNotNone(seen, "no preview while the job ran")
        # A1111's "Approx cheap" live preview: the latent projected to RGB, 1/8 of the image's sides.
        self.assertEqual(Image.open(io.BytesIO(base64.b64decode(seen["current_image"]))).size, (32, 32))
        self.assertGreater(seen["eta_relative"], 0)
        self.api.interrupt()
        t.join(300)
        self.assertFalse(t.is_alive())
        self.assertEqual(len(result["r"].images), 1, "interrupt answers with the image so far")
        self.assertEqual(result["r"].images[0].size, (256, 256))
        self.assertEqual(self.api.get_progress()["progress"], 0)

    def test_every_discovery_call_answers_from_what_apus_has(self):
        self.assertEqual(self.api.util_get_model_names(), ["klein_tiny_a"])
        self.assertTrue(self.api.util_get_sampler_names())
        self.assertTrue(self.api.util_get_scheduler_names())
        self.assertEqual(sorted(l["name"] for l in self.api.get_loras()), ["kohya", "peft"])
        self.assertEqual([u["name"] for u in self.api.get_upscalers()][:3], ["None", "Lanczos", "Nearest"])
        self.assertIn("ram", self.api.get_memory())
        self.assertIsInstance(self.api.get_cmd_flags(), dict)
        self.assertEqual(self.api.get_options()["sd_model_checkpoint"], "klein_tiny_a")
        self.api.refresh_checkpoints()
        self.assertEqual(self.api.get_scripts(), {"txt2img": [], "img2img": []})
        self.assertEqual(self.api.get_embeddings(), {"loaded": {}, "skipped": {}})
        for call in (self.api.get_sd_vae, self.api.get_hypernetworks, self.api.get_face_restorers,
                     self.api.get_realesrgan_models, self.api.get_prompt_styles, self.api.get_latent_upscale_modes):
            self.assertEqual(call(), [], call.__name__)
        self.api.util_set_model("klein_tiny_a")
        self.assertEqual(self.api.util_get_current_model(), "klein_tiny_a")

    def test_extras_upscale_by_the_factor(self):
        image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 40, 3), dtype=np.uint8))
        r = self.api.extra_single_image(image=image, upscaler_1="Lanczos", upscaling_resize=2)
        self.assertEqual(r.image.size, (80, 48))
        self.assertLess(np.abs(pixels(r.image.resize((40, 24), Image.BOX)) - pixels(image)).mean(), 40)


class OpenAiSdk(unittest.TestCase):
    """The openai SDK's own calls; apus's fields (seed, steps) ride in extra_body."""

    @classmethod
    def setUpClass(cls):
        cls.client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused")
        cls.fox = cli_image("oa_fox", "-p", "an owl", "-s", "21", "-W", "64", "-H", "48", "--steps", "2")

    def generate(self, **kw):
        args = dict(model="klein_tiny_a", prompt="an owl", size="64x48", extra_body={"seed": 21, "steps": 2})
        args.update(kw)
        return self.client.images.generate(**args)

    def test_b64_and_url_give_the_cli_image(self):
        r = self.generate(response_format="b64_json")
        np.testing.assert_array_equal(png_pixels(base64.b64decode(r.data[0].b64_json)), self.fox)
        r = self.generate(response_format="url")
        with urllib.request.urlopen(r.data[0].url) as f:
            np.testing.assert_array_equal(png_pixels(f.read()), self.fox)

    def test_jpeg_and_webp_are_the_image_compressed_at_the_quality_asked(self):
        fox = Image.fromarray(self.fox.astype(np.uint8))
        for fmt, magic in (("jpeg", b"\xff\xd8\xff"), ("webp", b"RIFF")):
            error = {}
            for quality in (30, 95):
                r = self.generate(output_format=fmt, output_compression=quality)
                data = base64.b64decode(r.data[0].b64_json)
                self.assertTrue(data.startswith(magic), fmt)
                got = png_pixels(data)
                self.assertEqual(got.shape, self.fox.shape)
                error[quality] = np.abs(got - self.fox).mean()
                # Pillow's encoder (libjpeg, libwebp) at that quality: the same loss, near enough.
                pillow = io.BytesIO()
                fox.save(pillow, format=fmt.upper(), quality=quality)
                pillow_error = np.abs(png_pixels(pillow.getvalue()) - self.fox).mean()
                self.assertLess(abs(error[quality] - pillow_error), 0.25 * pillow_error + 0.5, (fmt, quality))
            self.assertLess(error[95], error[30], fmt)

    def test_an_openai_model_name_and_an_alias_get_the_server_image_model(self):
        for name in ("gpt-image-1", "house-painter"):  # --alias house-painter=klein_tiny_a
            r = self.generate(model=name)
            np.testing.assert_array_equal(png_pixels(base64.b64decode(r.data[0].b64_json)), self.fox, name)
        with self.assertRaises(openai.NotFoundError):
            self.generate(model="house-sitter")

    def test_edit_with_a_mask_repaints_the_white_area_only(self):
        source = os.path.join(SCRATCH, "oa_source.png")
        Image.fromarray(self.fox.astype(np.uint8)).save(source)
        # OpenAI's mask marks the area to edit with alpha 0; the CLI's repaints white.
        rgba = np.full((48, 64, 4), 255, dtype=np.uint8)
        rgba[:, 32:, 3] = 0
        openai_mask = os.path.join(SCRATCH, "oa_mask_rgba.png")
        Image.fromarray(rgba, "RGBA").save(openai_mask)
        white = np.zeros((48, 64), dtype=np.uint8)
        white[:, 32:] = 255
        mask_path = os.path.join(SCRATCH, "oa_mask.png")
        Image.fromarray(white, "L").save(mask_path)
        with open(source, "rb") as image, open(openai_mask, "rb") as m:
            r = self.client.images.edit(model="klein_tiny_a", image=image, mask=m, prompt="a cat",
                                        extra_body={"seed": 4, "steps": 2})
        got = png_pixels(base64.b64decode(r.data[0].b64_json))
        want = cli_image("oa_edit", "-p", "a cat", "-s", "4", "--steps", "2", "-i", source, "--mask", mask_path)
        np.testing.assert_array_equal(got, want)

    def test_streaming_sends_partial_images_then_the_image(self):
        events = list(self.generate(stream=True, partial_images=2))
        partial = [e for e in events if e.type == "image_generation.partial_image"]
        done = [e for e in events if e.type == "image_generation.completed"]
        self.assertTrue(1 <= len(partial) <= 2, [e.type for e in events])
        self.assertEqual(len(done), 1)
        self.assertEqual(events[-1].type, "image_generation.completed")
        np.testing.assert_array_equal(png_pixels(base64.b64decode(done[0].b64_json)), self.fox)
        self.assertEqual(png_pixels(base64.b64decode(partial[0].b64_json)).shape, self.fox.shape)

    def test_speech_gives_the_cli_clip(self):
        r = self.client.audio.speech.create(model=AUDIO_ID, voice="alloy", input="rain on a tin roof",
                                            response_format="wav", extra_body={"seconds": 1, "seed": 3, "steps": 2})
        channels, rate, got = wav_samples(r.content)
        out = os.path.join(SCRATCH, "rain.wav")
        cli("audio", "--model", os.path.join(SCRATCH, "sa3_official"), "-p", "rain on a tin roof", "-s", "3",
            "--seconds", "1", "--steps", "2", "-o", out)
        with open(out, "rb") as f:
            want_channels, want_rate, want = wav_samples(f.read())
        self.assertEqual((channels, rate), (want_channels, want_rate))
        self.assertGreater(np.abs(want).max(), 0)
        np.testing.assert_array_equal(got, want)
        # OpenAI's own model names answer with the server's audio model.
        r = self.client.audio.speech.create(model="tts-1", voice="alloy", input="rain on a tin roof",
                                            response_format="wav", extra_body={"seconds": 1, "seed": 3, "steps": 2})
        np.testing.assert_array_equal(wav_samples(r.content)[2], want)


class Page(unittest.TestCase):
    """The page in headless Chromium driven through the DevTools protocol, as a person uses it at a
    phone's width (390 px): everything in reach, a batch of two, a running request cancelled."""

    @classmethod
    def setUpClass(cls):
        if subprocess.run(["sh", "-c", "command -v chromium"], capture_output=True).returncode != 0:
            raise unittest.SkipTest("chromium is not installed")
        port = 9400 + os.getpid() % 500
        cls.profile = tempfile.mkdtemp(prefix="apus_page_")
        cls.browser = subprocess.Popen(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--user-data-dir=" + cls.profile, "--remote-debugging-port=%d" % port, "--window-size=390,844",
             BASE + "/"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                pages = json.load(urllib.request.urlopen("http://127.0.0.1:%d/json" % port))
                cls.ws = websocket.create_connection(next(p for p in pages if p["type"] == "page")["webSocketDebuggerUrl"])
                break
            except Exception:
                time.sleep(0.1)
        cls.calls = 0
        # A phone's viewport (a headless window is at least 500 px wide).
        cls.send("Emulation.setDeviceMetricsOverride",
                 {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True})

    @classmethod
    def tearDownClass(cls):
        cls.browser.kill()
        cls.browser.wait()

    @classmethod
    def send(cls, method, params):
        """A DevTools call's result."""
        cls.calls += 1
        cls.ws.send(json.dumps({"id": cls.calls, "method": method, "params": params}))
        while True:
            reply = json.loads(cls.ws.recv())
            if reply.get("id") == cls.calls:
                return reply.get("result", {})

    def js(self, expression):
        """The value of a JavaScript expression in the page (a promise awaited)."""
        r = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True})
        return r.get("result", {}).get("value")

    def open(self, query):
        """The page at BASE/?query, navigated to (the call returns once the new document is in)."""
        self.send("Page.navigate", {"url": BASE + "/?" + query})
        self.wait_for("document.readyState === 'complete'")

    def wait_for(self, expression, seconds=120):
        deadline = time.time() + seconds
        while time.time() < deadline:
            if self.js(expression):
                return
            time.sleep(0.2)
        self.fail("never true: " + expression + " (status: %r)" % self.js("document.getElementById('status').textContent"))

    def test_at_a_phones_width_everything_is_in_reach(self):
        self.open("")
        self.wait_for("document.getElementById('model').options.length > 0")
        self.assertLessEqual(self.js("window.innerWidth"), 400)
        # Nothing wider than the screen; Generate and the prompt inside it.
        self.assertLessEqual(self.js("document.documentElement.scrollWidth"), self.js("window.innerWidth"))
        for element in ("go", "prompt", "model", "seed"):
            box = self.js("(b => [b.left, b.right])(document.getElementById('%s').getBoundingClientRect())" % element)
            self.assertGreaterEqual(box[0], 0, element)
            self.assertLessEqual(box[1], self.js("window.innerWidth"), element)
        # The form folds to two columns; Generate and the prompt span both.
        form = self.js("document.getElementById('form').getBoundingClientRect().width")
        for element in ("go", "prompt"):
            self.assertGreater(self.js("document.getElementById('%s').getBoundingClientRect().width" % element),
                               0.8 * form, element)
        self.assertLess(self.js("document.getElementById('seed').getBoundingClientRect().width"), 0.6 * form)

    def test_a_batch_of_two_gives_two_cards_of_one_job(self):
        self.open("model=klein_tiny_a&prompt=two%20owls&size=32x32&steps=1&seed=40&n=2&run=1")
        self.wait_for("document.getElementById('status').textContent.startsWith('done')")
        cards = self.js("[...document.querySelectorAll('#gallery .card')].slice(0, 2).map(c => [c.dataset.job, c.textContent])")
        self.assertEqual(cards[0][0], cards[1][0])
        self.assertEqual(sorted(c[1].split(")")[0] for c in cards), ["two owls (seed 40", "two owls (seed 41"])

    def test_cancel_stops_the_running_request(self):
        self.open("model=klein_tiny_a&prompt=a%20long%20one&size=256x256&steps=200&seed=1&run=1")
        self.wait_for("!document.getElementById('cancel').classList.contains('hidden') && "
                      "/step [1-9]/.test(document.getElementById('status').textContent)")
        self.js("document.getElementById('cancel').click()")
        self.wait_for("document.getElementById('status').textContent.includes('cancelled')")
        self.assertTrue(self.js("document.getElementById('cancel').classList.contains('hidden')"))
        self.assertFalse(self.js("document.getElementById('go').disabled"))
        job = json.load(urllib.request.urlopen(BASE + "/v1/jobs?order=desc&limit=1"))["data"][0]
        self.assertEqual(job["state"], "cancelled")
        self.assertLess(job["step"], 200)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
