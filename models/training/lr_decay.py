"""The learning-rate decay styles (Megatron's --lr-decay-style), one function each in `DECAY_STYLES`: from where a
step stands in the decay, the share of the way from --lr down to --min-lr it has not yet gone (1: --lr, 0: --min-lr).
A new style is one function and its entry; the job's --lr-decay-style choices are the keys."""
import math
from typing import NamedTuple


class Decay(NamedTuple):
    """Where a step stands: `progress` through the decay (0 at its start, after warm-up; 1 at its end), and the step
    counts wsd reads."""

    progress: float
    step: int
    decay_steps: int
    wsd_decay_steps: int | None


def cosine(d: Decay) -> float:
    return 0.5 * (1 + math.cos(math.pi * d.progress))


def linear(d: Decay) -> float:
    return 1.0 - d.progress


def constant(d: Decay) -> None:
    """None: --lr itself, never decayed (not lr·(floor + (1 - floor)), which may round away from it)."""
    return None


def wsd(d: Decay) -> float:
    """Warmup-stable-decay: --lr until the last `wsd_decay_steps` of the decay (default 10 % of it), then linear."""
    anneal = d.wsd_decay_steps or max(1, math.ceil(0.1 * d.decay_steps))
    return min(1.0, max(0.0, (d.decay_steps - d.step) / anneal))


DECAY_STYLES = {"cosine": cosine, "linear": linear, "constant": constant, "wsd": wsd}
