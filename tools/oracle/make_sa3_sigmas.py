"""Stable Audio 3's sampling schedules from the official code (tests/fixtures/sa3_sigmas_ref.*).

The official build_schedule with the default LogSNRShift (rate 0, anchor_logsnr -6.2, logsnr_end 2)
on the CPU, for every step count apus accepts (1..200) from full noise and from an audio-to-audio
noise level. torch evaluates the sigmoid in fp32 in two ways within one tensor: its vectorised
loop (SLEEF's expf) over whole pairs of vectors, the scalar loop (libm's expf) over the rest, so
where a value lands depends on the tensor's length and the vector width: this script insists on
torch's AVX-512 kernels (16 floats a vector), the machine the fixtures were made on.

    APUS_SA3_OFFICIAL=/path/to/stable-audio-3 python make_sa3_sigmas.py --out tests/fixtures
"""

import json
import os
import sys

import oracle_env
import torch
from safetensors.torch import save_file

STEPS = range(1, 201)  # apus's 1..200
SIGMA_MAX = {"full": 1.0, "init_0.6": 0.6}


def main():
    args = oracle_env.official_sa3_args("make_sa3_sigmas")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        sys.exit(f"make_sa3_sigmas: torch runs its {capability} kernels here; the fixture holds the AVX512 ones")
    from stable_audio_3.inference.distribution_shift import LogSNRShift
    from stable_audio_3.inference.sampling import build_schedule

    # What the official DiffusionCond model sets when model_config.json has no
    # sampling_distribution_shift_options, with the sequence length as generate() passes it (a tensor
    # of one length per sample; rate 0 makes the value itself irrelevant).
    shift = LogSNRShift(rate=0, anchor_logsnr=-6.2, logsnr_end=2.0)
    ref = {}
    for name, sigma_max in SIGMA_MAX.items():
        schedules = [build_schedule(steps, sigma_max, shift, torch.tensor([512]), 512, True, "cpu").reshape(-1)
                     for steps in STEPS]
        ref[name] = torch.cat(schedules).contiguous()
    save_file(ref, os.path.join(args.out, "sa3_sigmas_ref.safetensors"))
    with open(os.path.join(args.out, "sa3_sigmas_ref.json"), "w") as f:
        json.dump({"steps": [STEPS.start, STEPS.stop - 1], "sigma_max": SIGMA_MAX, "torch": torch.__version__,
                   "cpu_capability": capability,
                   "layout": "each tensor: the schedules for steps 1, 2, ... one after another, steps + 1 sigmas each"},
                  f, indent=1)
    os.chmod(os.path.join(args.out, "sa3_sigmas_ref.safetensors"), 0o644)
    print(f"sa3 sigmas: {len(STEPS)} step counts x {len(SIGMA_MAX)} noise levels")


if __name__ == "__main__":
    main()
