"""Run an oracle script and record every draw it makes from a torch generator.

    python trace_draws.py LOG.pkl SCRIPT.py [script args...]

The fixtures' random weights are torch.randn / torch.rand draws: the C++ fixture generator
(tools/fixture_gen) replays torch's generator bit for bit, so a weight that is a simple function of
one draw need not be committed (tools/oracle/fixture_recipes.py finds which ones are).  What it
needs from the oracle is each draw's stream: the seed, and every draw made from that generator
before it.  A stream is recognised by the generator's state: a draw continues a stream when the
state it starts from is the state that stream's last draw left; it starts a stream when the state
is a fresh `manual_seed(s)` one.  A generator advanced by something not recorded here (a module's
own init, torch.randint) starts from neither, and its draws are marked unusable.
"""
import hashlib
import pickle
import runpy
import sys

import torch

_fresh_state = {}  # seed -> hash of a fresh manual_seed(seed) state
_streams = []  # {"seed": s, "calls": [(kind, dtype, numel)], "usable": bool}
_stream_after = {}  # hash of the state after a stream's last draw -> stream index
_draws = []  # (stream, call index, kind, dtype, shape, fp32 values)


def _state_hash(gen):
    return hashlib.sha256(gen.get_state().numpy().tobytes()).hexdigest()


def _fresh_hash(seed):
    if seed not in _fresh_state:
        _fresh_state[seed] = _state_hash(torch.Generator().manual_seed(seed))
    return _fresh_state[seed]


def _stream_for(gen):
    before = _state_hash(gen)
    if before in _stream_after:
        return _stream_after.pop(before)
    seed = gen.initial_seed()
    usable = before == _fresh_hash(seed)
    _streams.append({"seed": seed, "calls": [], "usable": usable})
    return len(_streams) - 1


def _recorded(kind, original):
    def draw(*args, **kwargs):
        gen = kwargs.get("generator") or torch.default_generator
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return original(*args, **kwargs)
        stream = _stream_for(gen)
        out = original(*args, **kwargs)
        dtype = str(out.dtype).replace("torch.", "")
        call = len(_streams[stream]["calls"])
        _streams[stream]["calls"].append((kind, dtype, out.numel()))
        _draws.append((stream, call, kind, dtype, tuple(out.shape), out.detach().float().numpy().copy()))
        _stream_after[_state_hash(gen)] = stream
        return out

    return draw


def main():
    log, script, *args = sys.argv[1:]
    torch.randn = _recorded("randn", torch.randn)
    torch.rand = _recorded("rand", torch.rand)
    torch.randn_like = _recorded("randn", torch.randn_like)
    torch.rand_like = _recorded("rand", torch.rand_like)
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        with open(log, "wb") as f:
            pickle.dump({"script": script, "streams": _streams, "draws": _draws}, f)
        print(f"trace_draws: {len(_draws)} draws in {len(_streams)} streams -> {log}", file=sys.stderr)


if __name__ == "__main__":
    main()
