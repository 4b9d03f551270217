"""Megatron's --check-for-nan-in-loss-and-grad: a run that diverged stops, instead of training on (every later step
skipped for a NaN gradient norm, the job ending `loss 3.1351 -> nan`, exit 0).

A step whose global gradient norm is not finite is skipped (no update: the model stays as it was, as before); a
non-finite loss, or --max-skipped-steps consecutive skipped steps, stops the job before that step is logged or saved:
one line naming the step and the first rank whose loss (or reduced gradient) was not finite, exit code 1. The last
checkpoint and `latest` stay as they were. Every rank decides alike: the loss and the norm are global."""
import math

import torch
import torch.distributed as dist

import tp

from .failures import JobStopped


def first_rank(flag: bool) -> int | None:
    """The lowest global rank on which `flag` holds, or None (collective over every rank)."""
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag))
    return next((rank for rank, f in enumerate(flags) if f), None)


def gradients_finite(module: torch.nn.Module) -> bool:
    """Whether this rank's part of every reduced gradient is finite."""
    for p in module.parameters():
        grad = tp.optim.reduced_grad(p)[0]
        if grad is not None and grad.numel() and not torch.isfinite(grad).all():
            return False
    return True


class NanCheck:
    """The check of one rank: `after_gradients` each step once the global norm is known (with the gradients, or
    whether they were finite on this rank), `after_loss` once the global loss is; either raises JobStopped.
    `enabled` False: nothing is checked."""

    def __init__(self, *, enabled: bool, max_skipped: int):
        self.enabled, self.max_skipped = enabled, max_skipped
        self.skipped: list[int] = []  # the steps of the current run of skipped steps
        self.rank: int | None = None  # the first rank whose gradients were not finite, in that run

    def after_gradients(self, step: int, grad_norm: float, here: torch.nn.Module | bool) -> None:
        """`here`: this rank's model (its gradients still there), or whether its gradients were finite."""
        if math.isfinite(grad_norm):
            self.skipped, self.rank = [], None
            return
        if self.enabled and not self.skipped:
            finite = here if isinstance(here, bool) else gradients_finite(here)
            self.rank = first_rank(not finite)
        self.skipped.append(step)

    def after_loss(self, step: int, local_loss: float, loss: float) -> None:
        if not self.enabled:
            return
        if not math.isfinite(loss):
            rank = first_rank(not math.isfinite(local_loss))
            raise JobStopped(f"stopped at step {step}: the loss is {loss} on rank {0 if rank is None else rank} of "
                             f"{dist.get_world_size()} (--check-for-nan-in-loss-and-grad); the checkpoints and latest "
                             "are as the last save left them")
        if self.max_skipped and len(self.skipped) >= self.max_skipped:
            steps = f"{self.skipped[0]}..{self.skipped[-1]}" if len(self.skipped) > 1 else f"{self.skipped[0]}"
            raise JobStopped(f"stopped at step {step}: {len(self.skipped)} consecutive steps ({steps}) skipped for a "
                             f"non-finite gradient norm, first on rank {0 if self.rank is None else self.rank} of "
                             f"{dist.get_world_size()} (--max-skipped-steps {self.max_skipped}); the checkpoints and "
                             "latest are as the last save left them")
