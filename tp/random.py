"""RNG for tensor-parallel regions (Megatron's scheme).

Dropout on replicated activations must draw the same mask on every tp rank; dropout on tp-sharded activations
(attention probabilities, column-parallel outputs) must draw different masks per rank. `model_parallel_seed(seed)`
seeds the default generator with `seed + 100·pp_rank` (same on every tp rank, different per pipeline stage) and a
tracked "model-parallel" generator with that + 2718 + tp_rank; `with tp.fork_rng():` runs its body on the tracked
generator. On a machine with CUDA the tracked generator is the current GPU's (where dropout runs), else the CPU's.
"""
import contextlib

import torch
import torch.distributed as dist

from . import mesh as _mesh
from .mesh import resolve_group

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_OFFSET, _PP_STRIDE = 2718, 100  # Megatron's


def _default_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _get_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device, state):
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states, each for one device, that `fork` swaps in and out of that device's default generator."""

    def __init__(self):
        self.states = {}  # name -> (device, state)

    def reset(self):
        self.states = {}

    def add(self, name, seed, device=None):
        if name in self.states:
            raise RuntimeError(f"RNG state {name!r} already exists")
        device = torch.device(device) if device is not None else _default_device()
        self.states[name] = (device, torch.Generator(device=device).manual_seed(seed).get_state())

    @contextlib.contextmanager
    def fork(self, name=MODEL_PARALLEL_RNG):
        """Run the body on the tracked state `name`; the device's default generator is restored afterwards."""
        if name not in self.states:
            raise RuntimeError(f"RNG state {name!r} is not tracked: call tp.model_parallel_seed(seed) first")
        device, state = self.states[name]
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
            _set_state(device, state)
            try:
                yield
            finally:
                self.states[name] = (device, _get_state(device))


_tracker = RNGStatesTracker()


def get_rng_tracker():
    return _tracker


def model_parallel_seed(seed, *, group=None, device=None):
    """Seed the default generators with seed + 100·pp_rank and the tracked model-parallel one with that
    + 2718 + tp_rank. `device`: where the tracked generator lives (default: the current GPU, else the CPU)."""
    pp_rank = _mesh._current.pp_rank if _mesh._current is not None else 0
    seed = seed + _PP_STRIDE * pp_rank
    torch.manual_seed(seed)  # CPU and every GPU
    _tracker.reset()
    _tracker.add(MODEL_PARALLEL_RNG, seed + _TP_OFFSET + dist.get_rank(resolve_group(group)), device=device)


def fork_rng(name=MODEL_PARALLEL_RNG):
    """Context manager: draw from the tracked per-tp-rank generator (dropout inside tensor-parallel regions)."""
    return _tracker.fork(name)
