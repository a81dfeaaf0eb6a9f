"""apus from Python: FLUX.2 [klein] and Stable Audio 3 with diffusers' call signatures.

    import apus
    pipe = apus.Flux2KleinPipeline.from_pretrained("~/FLUX.2-klein-4B")
    image = pipe("a lighthouse at dawn", num_inference_steps=4, generator=torch.Generator().manual_seed(42)).images[0]

A diffusers script changes its import; what diffusers accepts and apus does not implement is
refused with apus.Error naming the argument. docs/USAGE.md ("Python") lists what apus adds.
"""
import os as _os

# The published layouts the engine reads (a single-file checkpoint's configs) ship in the package.
_data = _os.path.join(_os.path.dirname(__file__), "data")
if _os.path.isdir(_data):
    _os.environ.setdefault("APUS_DATA_DIR", _data)

from ._apus import Cancelled, Error, version  # noqa: E402
from .pipelines import (  # noqa: E402
    AudioPipelineOutput,
    DiffusionPipeline,
    Flux2KleinInpaintPipeline,
    Flux2KleinKVPipeline,
    Flux2KleinPipeline,
    Flux2PipelineOutput,
    StableAudio3Pipeline,
)

__version__ = version()
__all__ = [
    "AudioPipelineOutput",
    "Cancelled",
    "DiffusionPipeline",
    "Error",
    "Flux2KleinInpaintPipeline",
    "Flux2KleinKVPipeline",
    "Flux2KleinPipeline",
    "Flux2PipelineOutput",
    "StableAudio3Pipeline",
    "version",
]
