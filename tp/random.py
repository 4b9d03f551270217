"""RNG for tensor-parallel regions (Megatron's scheme).

Dropout on replicated activations must draw the same mask on every tp rank; dropout on tp-sharded activations
(attention probabilities, column-parallel outputs) must draw different masks per rank. `model_parallel_seed(seed)`
seeds the default generator with `seed` (same on every tp rank) and a tracked "model-parallel" generator with
`seed + 2718 + tp_rank`; `with tp.fork_rng():` runs its body on the tracked generator.
"""
import contextlib

import torch
import torch.distributed as dist

from .mesh import resolve_group

MODEL_PARALLEL_RNG = "model-parallel-rng"
_SEED_OFFSET = 2718  # Megatron's


class RNGStatesTracker:
    """Named generator states that `fork` swaps in and out of the default generator of a device."""

    def __init__(self):
        self.states = {}

    def reset(self):
        self.states = {}

    def add(self, name, seed, device="cpu"):
        if name in self.states:
            raise RuntimeError(f"RNG state {name!r} already exists")
        generator = torch.Generator(device=device).manual_seed(seed)
        self.states[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name=MODEL_PARALLEL_RNG, device=None):
        """Run the body on the tracked state `name`; the default generator's state is restored afterwards."""
        if name not in self.states:
            raise RuntimeError(f"RNG state {name!r} is not tracked: call tp.model_parallel_seed(seed) first")
        device = torch.device(device or torch.get_default_device())
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
            _set_state(device, self.states[name])
            try:
                yield
            finally:
                self.states[name] = _get_state(device)


def _get_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device, state):
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


_tracker = RNGStatesTracker()


def get_rng_tracker():
    return _tracker


def model_parallel_seed(seed, *, group=None, device=None):
    """Seed the default generator with `seed` and the tracked model-parallel one with seed + 2718 + tp_rank."""
    device = torch.device(device or torch.get_default_device())
    torch.manual_seed(seed)
    _tracker.reset()
    _tracker.add(MODEL_PARALLEL_RNG, seed + _SEED_OFFSET + dist.get_rank(resolve_group(group)), device=device.type)


def fork_rng(name=MODEL_PARALLEL_RNG):
    """Context manager: draw from the tracked per-tp-rank generator (dropout inside tensor-parallel regions)."""
    return _tracker.fork(name)
