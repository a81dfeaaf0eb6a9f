"""The pipelines: diffusers' classes, call signatures and results over apus's engine (_apus).

Every argument diffusers' pipeline takes is either run as diffusers runs it or refused with
apus.Error naming it; what apus adds (seed, negative_prompt where diffusers has only embeddings,
LoRA files, previews, int8, the cost count) comes as keyword-only arguments.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import warnings
from typing import Any, Callable, List, Optional, Sequence, Union

import numpy as np
from PIL import Image

from . import _apus
from ._apus import Error

# A callback_on_step_end_tensor_inputs left as diffusers' default ["latents"]: apus hands callbacks
# no tensors (the latents stay in the engine), so only an explicit request for them is refused.
_DEFAULT_TENSOR_INPUTS = object()
# The engine's progress line after each sampler step (src/pipeline/stage.h, timed_step).
_STEP_LINE = re.compile(r"step (\d+)/(\d+)\s+sigma ([-+0-9.eE]+)")


def _refuse(message: str) -> None:
    raise Error(message)


def _require_default(name: str, value: Any, default: Any, why: str) -> None:
    if value is not None and value != default:
        _refuse(f"{name}={value!r}: {why} (apus runs {default!r})")


def _require_none(name: str, value: Any, why: str) -> None:
    if value is not None:
        _refuse(f"{name}: {why}")


def _is_torch_generator(g: Any) -> bool:
    return type(g).__module__.startswith("torch") and hasattr(g, "initial_seed")


def _seed_of(g: Any) -> int:
    """The seed a fresh CPU torch.Generator was given: apus draws torch's CPU normals bit for bit."""
    if not _is_torch_generator(g):
        _refuse(f"generator: a torch.Generator expected, got {type(g).__name__}")
    import torch

    if g.device.type != "cpu":
        _refuse(
            f"generator: on {g.device}; apus reproduces torch's CPU generator (diffusers' usual "
            "torch.Generator().manual_seed(s)), not the device's"
        )
    seed = g.initial_seed()
    if not torch.equal(g.get_state(), torch.Generator().manual_seed(seed).get_state()):
        _refuse(
            f"generator: it has drawn since manual_seed({seed}); apus starts from the seed, so pass a fresh "
            f"torch.Generator().manual_seed({seed}) (or seed=)"
        )
    return seed


def _seeds(generator: Any, seed: Optional[int], batch: int, one_draw: bool) -> List[tuple]:
    """(seed, noise index) per output, as diffusers' generator argument gives them (or apus's seed,
    seed + 1, ...). One generator for a batch: diffusers draws the batch's noise from it in one
    torch.randn, each output's noise its part of that draw (noise index i), which the engine does
    for klein (`one_draw`); Stable Audio 3 draws from the generator at every step, interleaving the
    outputs."""
    if generator is not None and seed is not None:
        _refuse("generator and seed: pass one of them")
    if generator is None:
        return [(None if seed is None else seed + i, 0) for i in range(batch)]
    generators = list(generator) if isinstance(generator, (list, tuple)) else [generator]
    if len(generators) == 1 and batch > 1:
        if one_draw:
            return [(_seed_of(generators[0]), i) for i in range(batch)]
        _refuse(
            f"generator: one generator for {batch} outputs; diffusers' Stable Audio 3 draws every step's "
            f"noise for the whole batch from it, which apus does not replicate: pass a list of {batch} "
            "generators (each output's own, as diffusers reads a list) or seed= (outputs get seed, seed + 1, ...)"
        )
    if len(generators) != batch:
        _refuse(
            f"generator: a list of {len(generators)} generators for an effective batch size of {batch} "
            "(prompts x images per prompt)"
        )
    return [(_seed_of(g), 0) for g in generators]


def _prompts(prompt: Union[str, Sequence[str], None], per_prompt: int, what: str) -> List[str]:
    if prompt is None:
        _refuse("prompt: required (apus has no prompt_embeds)")
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        _refuse("prompt: a string or a non-empty list of strings expected")
    if not isinstance(per_prompt, int) or per_prompt < 1:
        _refuse(f"{what}={per_prompt!r}: expected 1 or more")
    return [p for p in prompts for _ in range(per_prompt)]


def _rgb(image: Any, name: str) -> tuple:
    """(width, height, RGB bytes) of a PIL image or an HxWx3 array (uint8, or float in [0, 1] as diffusers' np)."""
    if isinstance(image, Image.Image):
        rgb = image.convert("RGB")
        return rgb.width, rgb.height, rgb.tobytes()
    if isinstance(image, np.ndarray):
        a = image
        if a.ndim == 4 and a.shape[0] == 1:
            a = a[0]
        if a.ndim != 3 or a.shape[2] not in (1, 3):
            _refuse(f"{name}: an array of shape {image.shape}; expected height x width x 3 (or x 1)")
        if a.dtype != np.uint8:
            if not np.issubdtype(a.dtype, np.floating):
                _refuse(f"{name}: an array of {a.dtype}; expected uint8 or floats in [0, 1]")
            a = (np.clip(a, 0, 1) * 255).round().astype(np.uint8)
        if a.shape[2] == 1:
            a = np.repeat(a, 3, axis=2)
        return a.shape[1], a.shape[0], np.ascontiguousarray(a).tobytes()
    _refuse(f"{name}: a PIL image or a numpy array expected, got {type(image).__name__}")


def _interruptible(call: Callable[[], Any], stop: "_apus.Flag") -> Any:
    """Runs `call` so that Ctrl-C stops it: on the main thread the engine runs on a worker while
    this thread waits, and a KeyboardInterrupt sets the stop flag (the engine ends between two
    ops), waits for the worker and is raised again."""
    if threading.current_thread() is not threading.main_thread():
        return call()
    box: dict = {}

    def work() -> None:
        try:
            box["result"] = call()
        except BaseException as e:  # noqa: BLE001: raised again on the caller's thread
            box["error"] = e

    worker = threading.Thread(target=work, name="apus", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
    except KeyboardInterrupt:
        stop.set()
        worker.join()
        raise
    if "error" in box:
        raise box["error"]
    return box["result"]


class _Bar:
    """tqdm when installed and not disabled (diffusers' set_progress_bar_config), else nothing."""

    def __init__(self, total: int, config: dict) -> None:
        self.bar = None
        if config.get("disable"):
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, **config)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclasses.dataclass
class Flux2PipelineOutput:
    """diffusers' Flux2PipelineOutput; apus adds each output's seed and save() as `apus image -o`."""

    images: Any
    seeds: List[int] = dataclasses.field(default_factory=list)
    outputs: Any = dataclasses.field(default=None, repr=False)

    def save(self, path: str, index: int = 0, quality: int = 90) -> None:
        """Writes output `index` as the CLI does (.png, .jpg, .webp; the settings in its metadata)."""
        self.outputs.write(index, os.fspath(path), quality)


@dataclasses.dataclass
class AudioPipelineOutput:
    """diffusers' AudioPipelineOutput (audios: batch x channels x samples); apus adds the rate,
    each output's seed and save() as `apus audio -o`."""

    audios: Any
    sample_rate: int = 0
    seeds: List[int] = dataclasses.field(default_factory=list)
    outputs: Any = dataclasses.field(default=None, repr=False)

    def save(self, path: str, index: int = 0) -> None:
        """Writes output `index` as the CLI does (.wav 16-bit or .flac; the settings in its metadata)."""
        self.outputs.write(index, os.fspath(path))


class DiffusionPipeline:
    """What every apus pipeline shares: opening, the device, progress, callbacks and interrupts."""

    _model_class: Any = None  # _apus.ImageModel or _apus.AudioModel
    _class_names: tuple = ()  # model_index.json's _class_name values this pipeline reads

    def __init__(self, model: Any, parts: dict, device: str, weights_given: bool, fp32: bool) -> None:
        self._model = model
        self._parts = parts
        self._device = device
        self._weights_given = weights_given
        self._fp32 = fp32
        self._interrupt = False
        self._progress_bar_config: dict = {}

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: Union[str, os.PathLike],
        *,
        dtype: Any = None,
        torch_dtype: Any = None,
        text_encoder: Optional[str] = None,
        vae: Optional[str] = None,
        tokenizer: Optional[str] = None,
        config: Optional[str] = None,
        quant: Optional[str] = None,
        device: str = "cpu",
        weights: Optional[str] = None,
        **kwargs: Any,
    ) -> "DiffusionPipeline":
        """A diffusers folder, a Hugging Face cache's ORG/NAME, or one checkpoint file with its parts
        (text_encoder, vae, tokenizer, config: files or folders, as the CLI's options). dtype (or
        diffusers' older torch_dtype) bfloat16 or None runs the engine's bf16 path, float32 its fp32
        parity mode. quant="int8": the int8 tier; quant="q8_0": the weights as GGUF Q8_0 blocks;
        quant="fp8": the fp8 tier.
        weights: "resident" (kept across calls; the default) or "per_stage" (each stage's weights mapped while it runs; the default for Stable Audio 3 in
        float32, whose resident weights are bf16). On DiffusionPipeline itself the class comes from
        model_index.json."""
        for name in kwargs:
            _refuse(f"from_pretrained: {name}= is not implemented by apus")
        if dtype is not None and torch_dtype is not None:
            _refuse("dtype and torch_dtype: pass one of them")
        path = os.path.expanduser(os.fspath(pretrained_model_name_or_path))
        if cls is DiffusionPipeline:
            cls = _pipeline_class_of(path)
        parts = dict(
            model=path,
            text_encoder=os.path.expanduser(text_encoder or ""),
            vae=os.path.expanduser(vae or ""),
            tokenizer=os.path.expanduser(tokenizer or ""),
            config=os.path.expanduser(config or ""),
            quant=quant,
        )
        fp32 = _is_fp32(dtype if dtype is not None else torch_dtype)
        parts["weights"] = weights or cls._weights_for(fp32)
        return cls(cls._model_class.open(**parts, device=device), parts, device, weights is not None, fp32)

    def to(self, device: Any = None, dtype: Any = None) -> "DiffusionPipeline":
        """diffusers' to(): a device ("cpu", "cuda", "cuda:1", a torch.device) opens the model there
        again (nothing happens when it is there already); a dtype as from_pretrained's torch_dtype."""
        if device is not None and not isinstance(device, str) and hasattr(device, "type"):
            device = str(device)
        if device is not None and not isinstance(device, str):
            dtype, device = device, None
        device = self._device if device is None else "cuda:0" if device == "cuda" else device
        fp32 = self._fp32 if dtype is None else _is_fp32(dtype)
        weights = self._parts["weights"] if self._weights_given else self._weights_for(fp32)
        if device != self._device or weights != self._parts["weights"]:
            self._model = self._model_class.open(**dict(self._parts, weights=weights), device=device)
            self._parts["weights"], self._device = weights, device
        self._fp32 = fp32
        return self

    @property
    def device(self) -> str:
        return self._device

    @classmethod
    def _weights_for(cls, fp32: bool) -> str:
        return "resident"

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        self._progress_bar_config = dict(kwargs)

    @property
    def interrupt(self) -> bool:
        """Set (pipe._interrupt = True, as in diffusers' callbacks) to end the sampling after the
        current step; the output is decoded from the latents as they are."""
        return self._interrupt

    @property
    def model_label(self) -> str:
        return self._model.label

    def _run(
        self,
        requests: list,
        total_steps: int,
        callback: Optional[Callable],
        tensor_inputs: Any,
        previews: list,
        timestep: Callable[[float], float],
    ) -> Any:
        if tensor_inputs is not _DEFAULT_TENSOR_INPUTS and list(tensor_inputs or []):
            _refuse(
                f"callback_on_step_end_tensor_inputs={list(tensor_inputs)}: apus hands callbacks no tensors "
                "(the latents stay in the engine); leave it unset or pass []"
            )
        stop, finish = _apus.Flag(), _apus.Flag()
        bar = _Bar(total_steps, self._progress_bar_config)
        self._interrupt = False

        def progress(line: str) -> None:
            step = _STEP_LINE.match(line)
            if not step:
                return
            bar.update()
            if callback is not None:
                returned = callback(self, int(step.group(1)) - 1, timestep(float(step.group(3))), {})
                if returned:
                    _refuse(
                        f"callback_on_step_end returned {sorted(returned)}: apus cannot take tensors back "
                        "into the engine; return {} or None"
                    )
            if self._interrupt:
                finish.set()

        try:
            return _interruptible(lambda: self._model.generate(requests, progress, previews, stop, finish), stop)
        finally:
            bar.close()


def _is_fp32(dtype: Any) -> bool:
    name = None if dtype is None else str(dtype).replace("torch.", "")
    if name not in (None, "bfloat16", "float32"):
        _refuse(f"dtype={dtype}: apus runs bfloat16 (the default) or float32 (its parity mode)")
    return name == "float32"


def _pipeline_class_of(path: str) -> type:
    index = os.path.join(path, "model_index.json")
    if not os.path.isfile(index):
        _refuse(f"{path}: no model_index.json; open a single file through its pipeline's class")
    with open(index, encoding="utf-8") as f:
        name = json.load(f).get("_class_name")
    for cls in (Flux2KleinPipeline, Flux2KleinKVPipeline, StableAudio3Pipeline):
        if name in cls._class_names:
            return cls
    _refuse(f"{index}: _class_name {name!r}; apus runs Flux2KleinPipeline, Flux2KleinKVPipeline, StableAudio3Pipeline")


def _images(outputs: Any, output_type: str) -> Any:
    frames = []
    for i in range(len(outputs)):
        width, height, rgb = outputs.rgb(i)
        frames.append((width, height, rgb))
    if output_type == "pil":
        return [Image.frombytes("RGB", (w, h), rgb) for w, h, rgb in frames]
    arrays = np.stack([np.frombuffer(rgb, np.uint8).reshape(h, w, 3) for w, h, rgb in frames])
    # diffusers' np and pt images are floats in [0, 1]: apus's are its 8-bit pixels / 255.
    arrays = arrays.astype(np.float32) / 255
    if output_type == "np":
        return arrays
    import torch

    return torch.from_numpy(arrays).permute(0, 3, 1, 2).contiguous()


def _check_output_type(output_type: str, allowed: tuple) -> None:
    if output_type not in allowed:
        _refuse(f"output_type={output_type!r}: apus returns {', '.join(repr(a) for a in allowed)} (no latents)")
    if output_type == "pt":
        try:
            import torch  # noqa: F401
        except ImportError:
            _refuse("output_type='pt': torch is not installed; pass output_type='np'")


class _Flux2Klein(DiffusionPipeline):
    _model_class = _apus.ImageModel

    def _image_requests(
        self,
        prompt: Any,
        height: Optional[int],
        width: Optional[int],
        num_inference_steps: int,
        guidance_scale: Optional[float],
        num_images_per_prompt: int,
        generator: Any,
        seed: Optional[int],
        negative_prompt: Optional[str],
        loras: Sequence,
        diffusers_args: dict,
    ) -> list:
        _require_none("sigmas", diffusers_args.get("sigmas"), "custom schedules are not implemented; the engine runs the model's")
        for name in ("latents", "prompt_embeds", "negative_prompt_embeds"):
            _require_none(name, diffusers_args.get(name), "not implemented by apus (pass prompt, seed or generator)")
        if diffusers_args.get("attention_kwargs"):
            _refuse(f"attention_kwargs={diffusers_args['attention_kwargs']!r}: not implemented (LoRA scales go in loras=)")
        _require_default("max_sequence_length", diffusers_args.get("max_sequence_length"), 512, "the text encoder reads 512 tokens")
        layers = diffusers_args.get("text_encoder_out_layers")
        _require_default("text_encoder_out_layers", None if layers is None else tuple(layers), (9, 18, 27), "the model's taps")
        prompts = _prompts(prompt, num_images_per_prompt, "num_images_per_prompt")
        seeds = _seeds(generator, seed, len(prompts), one_draw=True)
        cfg = None
        if guidance_scale is not None:
            if self._model.takes_guidance:
                cfg = float(guidance_scale)
            elif guidance_scale > 1:
                # diffusers' behaviour for the step-distilled models, its warning's words.
                warnings.warn(f"Guidance scale {guidance_scale} is ignored for step-wise distilled models.", stacklevel=3)
        requests = []
        for text, (s, index) in zip(prompts, seeds):
            r = _apus.ImageRequest()
            r.prompt = text
            r.width, r.height = width, height
            r.steps = num_inference_steps
            r.cfg = cfg
            r.negative_prompt = negative_prompt
            r.seed, r.noise_index = s, index
            r.fp32 = self._fp32
            for lora in loras:
                file, scale = (lora, 1.0) if isinstance(lora, (str, os.PathLike)) else lora
                r.add_lora(os.path.expanduser(os.fspath(file)), float(scale))
            requests.append(r)
        return requests

    def _render(self, requests: list, output_type: str, return_dict: bool, callback: Any, tensor_inputs: Any, preview: Any) -> Any:
        _check_output_type(output_type, ("pil", "np", "pt"))
        previews = []
        if preview is not None:
            previews = [
                (lambda step, steps, image, i=i: preview(i, step, steps, Image.frombytes("RGB", image[:2], image[2])))
                for i in range(len(requests))
            ]
        # diffusers' Flux2 timesteps are its sigmas x 1000.
        outputs = self._run(requests, requests[0].steps or 0, callback, tensor_inputs, previews, lambda s: s * 1000)
        images = _images(outputs, output_type)
        if not return_dict:
            return (images,)
        return Flux2PipelineOutput(images, [outputs.seed(i) for i in range(len(outputs))], outputs)

    def count(self, prompt: str = "", **kwargs: Any) -> dict:
        """The request's counted FLOPs and bytes per stage (apus count), without computing it; the
        arguments as the call's."""
        requests = self._image_requests(
            prompt,
            kwargs.pop("height", None),
            kwargs.pop("width", None),
            kwargs.pop("num_inference_steps", self._default_steps),
            kwargs.pop("guidance_scale", None),
            1,
            None,
            None,
            kwargs.pop("negative_prompt", None),
            kwargs.pop("loras", ()),
            {},
        )
        batch = kwargs.pop("num_images_per_prompt", 1)
        for name in kwargs:
            _refuse(f"count: {name}= is not counted")
        return self._model.count(requests[0], batch)


class Flux2KleinPipeline(_Flux2Klein):
    """diffusers' Flux2KleinPipeline: text to image and multi-reference editing (image=)."""

    _class_names = ("Flux2KleinPipeline",)
    _default_steps = 50

    def __call__(
        self,
        image: Any = None,
        prompt: Union[str, List[str], None] = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: int = 50,
        sigmas: Optional[List[float]] = None,
        guidance_scale: float = 4.0,
        num_images_per_prompt: int = 1,
        generator: Any = None,
        latents: Any = None,
        prompt_embeds: Any = None,
        negative_prompt_embeds: Any = None,
        output_type: str = "pil",
        return_dict: bool = True,
        attention_kwargs: Optional[dict] = None,
        callback_on_step_end: Optional[Callable] = None,
        callback_on_step_end_tensor_inputs: Any = _DEFAULT_TENSOR_INPUTS,
        max_sequence_length: int = 512,
        text_encoder_out_layers: tuple = (9, 18, 27),
        *,
        seed: Optional[int] = None,
        negative_prompt: Optional[str] = None,
        loras: Sequence = (),
        preview: Optional[Callable] = None,
    ) -> Any:
        """As diffusers' call; pipe("a prompt") also reads its first argument as the prompt.
        apus adds: seed (outputs get seed, seed + 1, ...), negative_prompt (-base models), loras
        (files, or (file, scale) pairs), preview(index, step, steps, PIL image) after each step."""
        if isinstance(image, str) and prompt is None:
            image, prompt = None, image
        requests = self._image_requests(
            prompt, height, width, num_inference_steps, guidance_scale, num_images_per_prompt, generator, seed,
            negative_prompt, loras, locals(),
        )
        references = [] if image is None else image if isinstance(image, (list, tuple)) else [image]
        for k, ref in enumerate(references):
            w, h, rgb = _rgb(ref, f"image[{k}]")
            for r in requests:
                r.add_reference(w, h, rgb)
        return self._render(requests, output_type, return_dict, callback_on_step_end, callback_on_step_end_tensor_inputs, preview)


class Flux2KleinKVPipeline(Flux2KleinPipeline):
    """diffusers' Flux2KleinKVPipeline (the -kv models: the references' keys and values cached)."""

    _class_names = ("Flux2KleinKVPipeline",)
    _default_steps = 4

    def __call__(
        self,
        image: Any = None,
        prompt: Union[str, List[str], None] = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: int = 4,
        sigmas: Optional[List[float]] = None,
        num_images_per_prompt: int = 1,
        generator: Any = None,
        latents: Any = None,
        prompt_embeds: Any = None,
        output_type: str = "pil",
        return_dict: bool = True,
        attention_kwargs: Optional[dict] = None,
        callback_on_step_end: Optional[Callable] = None,
        callback_on_step_end_tensor_inputs: Any = _DEFAULT_TENSOR_INPUTS,
        max_sequence_length: int = 512,
        text_encoder_out_layers: tuple = (9, 18, 27),
        *,
        seed: Optional[int] = None,
        loras: Sequence = (),
        preview: Optional[Callable] = None,
    ) -> Any:
        return super().__call__(
            image, prompt, height, width, num_inference_steps, sigmas, None, num_images_per_prompt, generator,
            latents, prompt_embeds, None, output_type, return_dict, attention_kwargs, callback_on_step_end,
            callback_on_step_end_tensor_inputs, max_sequence_length, text_encoder_out_layers,
            seed=seed, loras=loras, preview=preview,
        )


class Flux2KleinInpaintPipeline(_Flux2Klein):
    """diffusers' Flux2KleinInpaintPipeline: repaints `image` where `mask_image` is white."""

    _default_steps = 50

    def __call__(
        self,
        prompt: Union[str, List[str], None] = None,
        image: Any = None,
        image_reference: Any = None,
        mask_image: Any = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        padding_mask_crop: Optional[int] = None,
        strength: float = 0.8,
        num_inference_steps: int = 50,
        sigmas: Optional[List[float]] = None,
        guidance_scale: float = 8.0,
        num_images_per_prompt: int = 1,
        generator: Any = None,
        latents: Any = None,
        prompt_embeds: Any = None,
        negative_prompt_embeds: Any = None,
        output_type: str = "pil",
        return_dict: bool = True,
        attention_kwargs: Optional[dict] = None,
        callback_on_step_end: Optional[Callable] = None,
        callback_on_step_end_tensor_inputs: Any = _DEFAULT_TENSOR_INPUTS,
        max_sequence_length: int = 512,
        text_encoder_out_layers: tuple = (9, 18, 27),
        *,
        seed: Optional[int] = None,
        negative_prompt: Optional[str] = None,
        loras: Sequence = (),
        preview: Optional[Callable] = None,
    ) -> Any:
        """As diffusers' call; apus adds what Flux2KleinPipeline's call adds."""
        _require_none("padding_mask_crop", padding_mask_crop, "not implemented by apus (the whole image is repainted)")
        if image is None or mask_image is None:
            _refuse("image and mask_image: both required")
        w, h, rgb = _rgb(image[0] if isinstance(image, (list, tuple)) and len(image) == 1 else image, "image")
        mw, mh, mask = _rgb(mask_image[0] if isinstance(mask_image, (list, tuple)) and len(mask_image) == 1 else mask_image, "mask_image")
        floored = (w // 16 * 16, h // 16 * 16)
        if (width, height) != (None, None) and (width, height) != floored:
            _refuse(f"height={height}, width={width}: apus repaints at the image's size, floored to 16 ({floored[1]}x{floored[0]})")
        requests = self._image_requests(
            prompt, None, None, num_inference_steps, guidance_scale, num_images_per_prompt, generator, seed,
            negative_prompt, loras, locals(),
        )
        references = [] if image_reference is None else image_reference if isinstance(image_reference, (list, tuple)) else [image_reference]
        if len(references) > 1:
            _refuse(f"image_reference: {len(references)} images; the inpainting pipeline takes one")
        for r in requests:
            r.set_inpaint(w, h, rgb, mw, mh, mask, float(strength))
            for k, ref in enumerate(references):
                r.add_reference(*_rgb(ref, f"image_reference[{k}]"))
        return self._render(requests, output_type, return_dict, callback_on_step_end, callback_on_step_end_tensor_inputs, preview)


class StableAudio3Pipeline(DiffusionPipeline):
    """diffusers' StableAudio3Pipeline: text (and audio) to audio."""

    _model_class = _apus.AudioModel
    _class_names = ("StableAudio3Pipeline",)

    @classmethod
    def _weights_for(cls, fp32: bool) -> str:
        # A resident Stable Audio 3 model holds its weights in bf16; fp32 reads them per stage.
        return "per_stage" if fp32 else "resident"

    def __call__(
        self,
        prompt: Union[str, List[str], None] = None,
        duration: float = 10.0,
        num_inference_steps: Optional[int] = None,
        logsnr_min: float = -6.2,
        logsnr_max: float = 2.0,
        silence_padding_duration: float = 0.0,
        guidance_scale: float = 1.0,
        negative_prompt: Union[str, List[str], None] = None,
        num_waveforms_per_prompt: int = 1,
        generator: Any = None,
        latents: Any = None,
        prompt_embeds: Any = None,
        encoder_attention_mask: Any = None,
        negative_prompt_embeds: Any = None,
        negative_encoder_attention_mask: Any = None,
        return_dict: bool = True,
        callback_on_step_end: Optional[Callable] = None,
        callback_on_step_end_tensor_inputs: Any = _DEFAULT_TENSOR_INPUTS,
        output_type: Optional[str] = None,
        *,
        seed: Optional[int] = None,
        apg: float = 1.0,
        init_audio: Optional[tuple] = None,
        init_noise_level: Optional[float] = None,
        inpaint_audio: Optional[tuple] = None,
        inpaint_regions: Sequence = (),
        chunked_decode: Optional[bool] = None,
        loras: Sequence = (),
        preview: Optional[Callable] = None,
    ) -> Any:
        """As diffusers' call. output_type: "pt" (diffusers' default, when torch is installed, else
        "np"): audios is batch x channels x samples. apus adds: seed, apg (adaptive projected
        guidance share), init_audio / inpaint_audio as (sample_rate, array of samples x channels
        or samples) with init_noise_level and inpaint_regions [(start, end) seconds],
        chunked_decode, loras, preview(index, step, steps, peaks) after each step."""
        _require_default("logsnr_min", logsnr_min, -6.2, "the model's schedule")
        _require_default("logsnr_max", logsnr_max, 2.0, "the model's schedule")
        _require_default("silence_padding_duration", silence_padding_duration, 0.0, "not implemented by apus")
        for name in ("latents", "prompt_embeds", "encoder_attention_mask", "negative_prompt_embeds", "negative_encoder_attention_mask"):
            _require_none(name, locals()[name], "not implemented by apus (pass prompt, seed or generator)")
        if output_type is None:
            try:
                import torch  # noqa: F401

                output_type = "pt"
            except ImportError:
                output_type = "np"
        _check_output_type(output_type, ("pt", "np"))
        if isinstance(negative_prompt, (list, tuple)):
            if len(set(negative_prompt)) != 1:
                _refuse("negative_prompt: one text for the whole batch")
            negative_prompt = negative_prompt[0]
        prompts = _prompts(prompt, num_waveforms_per_prompt, "num_waveforms_per_prompt")
        seeds = _seeds(generator, seed, len(prompts), one_draw=False)
        requests = []
        for text, (s, _) in zip(prompts, seeds):
            r = _apus.AudioRequest()
            r.prompt = text
            r.seconds = float(duration)
            r.steps = num_inference_steps
            r.cfg = float(guidance_scale)
            r.apg = float(apg)
            r.negative_prompt = negative_prompt
            r.seed = s
            r.fp32 = self._fp32
            r.chunked_decode = chunked_decode
            if init_audio is not None:
                r.set_init_audio(*_clip(init_audio, "init_audio"))
            r.init_noise_level = init_noise_level
            if inpaint_audio is not None:
                r.set_inpaint_audio(*_clip(inpaint_audio, "inpaint_audio"))
            r.inpaint_regions = [(float(a), float(b)) for a, b in inpaint_regions]
            for lora in loras:
                file, scale = (lora, 1.0) if isinstance(lora, (str, os.PathLike)) else lora
                r.add_lora(os.path.expanduser(os.fspath(file)), float(scale))
            requests.append(r)
        previews = []
        if preview is not None:
            previews = [(lambda step, steps, peaks, i=i: preview(i, step, steps, np.asarray(peaks, np.float32))) for i in range(len(requests))]
        steps = num_inference_steps or self._model.default_steps
        outputs = self._run(requests, steps, callback_on_step_end, callback_on_step_end_tensor_inputs, previews, lambda s: s)
        clips = []
        rate = 0
        for i in range(len(outputs)):
            rate, channels, samples = outputs.samples(i)
            clips.append(np.frombuffer(samples, np.float32).reshape(-1, channels).T)
        audios = np.stack(clips)
        if output_type == "pt":
            import torch

            audios = torch.from_numpy(audios.copy())
        if not return_dict:
            return (audios,)
        return AudioPipelineOutput(audios, rate, [outputs.seed(i) for i in range(len(outputs))], outputs)


def _clip(clip: Any, name: str) -> tuple:
    """(sample_rate, channels, float32 bytes) of (sample_rate, samples x channels or samples)."""
    if not isinstance(clip, tuple) or len(clip) != 2:
        _refuse(f"{name}: (sample_rate, samples) expected")
    rate, samples = clip
    a = np.asarray(samples, dtype=np.float32)
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2:
        _refuse(f"{name}: samples of shape {a.shape}; expected frames or frames x channels")
    return int(rate), a.shape[1], np.ascontiguousarray(a).tobytes()
