"""Failures the tests inject into a running job (the hidden flags --fail-at-step, --hang-at-step, --nan-grad-at-step,
--slow-save-at-step, on rank --fail-rank), each at a named point of the trainer. Nothing happens unless one is set."""
import math
import os
import time

import torch
import torch.distributed as dist

import tp

from .config import FaultsConfig
from .model import data_parallel_chunks


def _here(faults: FaultsConfig) -> bool:
    return dist.get_rank() == faults.fail_rank


def before_step(faults: FaultsConfig, step: int) -> None:
    """Step `step` (from 1) about to run: --fail-at-step raises, --hang-at-step sleeps (the others time out in their
    next collective)."""
    if faults.fail_at_step == step and _here(faults):
        raise RuntimeError(f"injected failure at step {step} on rank {faults.fail_rank}")
    if faults.hang_at_step == step and _here(faults):
        time.sleep(1e9)


def after_gradients(faults: FaultsConfig, step: int, module: torch.nn.Module) -> None:
    """The gradients of step `step` reduced, not yet clipped: --nan-grad-at-step puts a NaN in this rank's part of a
    reduced gradient, as an overflow would leave it."""
    if faults.nan_grad_at_step != step or not _here(faults):
        return
    for chunk in data_parallel_chunks(module):
        chunk.finish_grad_sync()
    grad = next(g for p in module.parameters() if (g := tp.optim.reduced_grad(p)[0]) is not None and g.numel())
    grad.view(-1)[0] = math.nan


def during_save(faults: FaultsConfig, step: int) -> None:
    """The checkpoint of step `step` written, `latest` not yet moved: --slow-save-at-step pauses a first attempt's
    ranks there, so that a kill lands mid-save."""
    if faults.slow_save_at_step == step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        time.sleep(60)
