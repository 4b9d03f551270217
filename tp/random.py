"""RNG for tensor-parallel regions (Megatron's scheme), safe under activation recomputation.

Dropout on replicated activations must draw the same mask on every tp rank; dropout on tp-sharded activations
(attention probabilities, column-parallel outputs) must draw different masks per rank. `model_parallel_seed(seed)`
seeds the default generators with `seed + 100·pp_rank` (same on every tp rank, different per pipeline stage) and
gives the tracked "model-parallel" stream the seed `that + 2718 + tp_rank`; `with tp.fork_rng():` runs its body on
that stream. On a machine with CUDA the stream lives on the current GPU (where dropout runs), else on the CPU.
These streams are for users' own code and the models `tp.parallelize` shards: their masks depend on the split. The
package's GPT draws counter-based masks keyed by global position instead (tp.dropout), the same at every split.

Why forks derive their state from the default generator: `torch.utils.checkpoint` saves and restores the default
generators around a recomputed region, never other generators. Each fork therefore starts from its stream's seed
mixed with the default generator's position (a draw on CPU; the Philox offset on CUDA, read without a device sync)
and advances the default generator past what it used. The recomputation replays the same default state, so it
replays the same tp masks: plain `torch.utils.checkpoint` (either `use_reentrant`) gives identical gradients.
"""
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .mesh import current_mesh, resolve_group

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_OFFSET, _PP_STRIDE = 2718, 100  # Megatron's
_MASK64 = (1 << 64) - 1


def _default_device():
    """The default device's generator draws the tracked streams: a GPU job's (its default device), else the CPU's,
    also on a machine with a GPU (CPU tensors' dropout draws from the CPU generator: a CUDA stream would leave it
    unforked, the same mask on every tp rank)."""
    device = torch.get_default_device()
    if device.type != "cuda":
        return torch.device("cpu")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def derive_seed(seed: int, position: int) -> int:
    """A 63-bit seed from two integers (splitmix64's finaliser): nearby inputs give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@contextlib.contextmanager
def _fork_cpu(seed: int) -> Iterator[None]:
    position = int(torch.randint(0, 2**62, (1,)).item())  # advances the default stream alike on every tp rank
    with torch.random.fork_rng(devices=[], device_type="cpu"):
        torch.default_generator.manual_seed(derive_seed(seed, position))
        yield


@contextlib.contextmanager
def _fork_cuda(seed: int, device: torch.device) -> Iterator[None]:
    default = torch.cuda.default_generators[device.index if device.index is not None else 0]
    offset = default.get_offset()
    with torch.random.fork_rng(devices=[device], device_type="cuda"):
        default.manual_seed(derive_seed(seed, default.initial_seed()))
        default.set_offset(offset)
        try:
            yield
        finally:
            used = default.get_offset() - offset
    default.set_offset(offset + used)  # the next fork (and replicated dropout) starts past what this one used


class RNGStatesTracker:
    """Named per-tp-rank streams, each a seed on one device; `fork(name)` runs a block on that stream."""

    def __init__(self) -> None:
        self.seeds = {}  # name -> (device, seed)

    def reset(self) -> None:
        """Forget every stream."""
        self.seeds = {}

    def add(self, name: str, seed: int, device: torch.device | str | None = None) -> None:
        """Track stream `name` with this seed, on `device` (default: the current GPU, else the CPU)."""
        if name in self.seeds:
            raise RuntimeError(f"RNG state {name!r} already exists")
        self.seeds[name] = (torch.device(device) if device is not None else _default_device(), seed)

    def get_states(self) -> dict[str, tuple[torch.device, int]]:
        """The streams' seeds (all the tracker holds: a fork's state derives from the default generators)."""
        return dict(self.seeds)

    def set_states(self, states: dict[str, tuple[torch.device, int]]) -> None:
        """Restore what get_states returned."""
        self.seeds = dict(states)

    def fork(self, name: str = MODEL_PARALLEL_RNG) -> contextlib.AbstractContextManager[None]:
        """Context manager: the body draws from stream `name` (via the device's default generator)."""
        if name not in self.seeds:
            raise RuntimeError(f"RNG state {name!r} is not tracked: call tp.model_parallel_seed(seed) first")
        device, seed = self.seeds[name]
        return _fork_cuda(seed, device) if device.type == "cuda" else _fork_cpu(seed)


_tracker = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker of per-tp-rank RNG streams."""
    return _tracker


def model_parallel_seed(seed: int, *, group: dist.ProcessGroup | None = None,
                        device: torch.device | str | None = None) -> None:
    """Seed the default generators with seed + 100·pp_rank and the tracked model-parallel stream with that
    + 2718 + tp_rank. `device`: where the tracked stream lives (default: the current GPU, else the CPU)."""
    tp_rank = dist.get_rank(resolve_group(group))  # (raises without a mesh or group, before anything is reseeded)
    mesh = current_mesh()
    pp_rank = mesh.pp_rank if mesh is not None else 0
    seed = seed + _PP_STRIDE * pp_rank
    torch.manual_seed(seed)  # CPU and every GPU
    _tracker.reset()
    _tracker.add(MODEL_PARALLEL_RNG, seed + _TP_OFFSET + tp_rank, device=device)


def fork_rng(name: str = MODEL_PARALLEL_RNG) -> contextlib.AbstractContextManager[None]:
    """Context manager: draw from the tracked per-tp-rank stream (dropout inside tensor-parallel regions)."""
    return _tracker.fork(name)


def get_rng_state() -> dict[str, Any]:
    """Everything needed to resume the random streams exactly (training checkpoints): default CPU/CUDA states and
    the tracker's seeds."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda, "tracker": _tracker.get_states()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the random streams from get_rng_state's dict."""
    torch.set_rng_state(state["cpu"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    _tracker.set_states(state["tracker"])
