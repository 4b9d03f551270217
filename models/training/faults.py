"""Failures the tests inject into a running job (the hidden flags --fail-at-step, --hang-at-step, --nan-grad-at-step,
--nan-weights-at-step, --slow-save-at-step, --no-space-at-step, --slow-step-s, on rank --fail-rank), each at a named
point of the trainer. Nothing happens unless one is set."""
import contextlib
import errno
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tp

from .config import FaultsConfig
from .manifest import ManifestWriter
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
    if faults.slow_step_s and _here(faults):  # a straggler: busy, as a slow device or host is (not asleep)
        end = time.thread_time() + faults.slow_step_s  # CPU time, what the step clock counts: even on a loaded host
        while time.thread_time() < end:
            pass


@torch.no_grad()
def before_forward(faults: FaultsConfig, step: int, module: torch.nn.Module) -> None:
    """Step `step` about to compute: --nan-weights-at-step puts a NaN in one of this rank's norm weights (which every
    token goes through), as a corrupted update would leave it: its loss is NaN from there on."""
    if faults.nan_weights_at_step == step and _here(faults):
        next(p for p in module.parameters() if p.dim() == 1 and p.numel()).view(-1)[0] = math.nan


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


class _SlowWriter(ManifestWriter):
    """A FileSystemWriter that pauses before writing its shards (the background write of an async save)."""

    def write_data(self, plan, planner):
        time.sleep(60)
        return super().write_data(plan, planner)


class _FullStream:
    """A file whose device fills after `room` bytes: later writes raise OSError(ENOSPC), as the kernel's would."""

    def __init__(self, file, room):
        self.file, self.room = file, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


class _FullDeviceWriter(ManifestWriter):
    """A writer whose files hold at most 4 KiB each: the device is full in the middle of the first shard."""

    def __init__(self, path):
        super().__init__(path)
        real = self.fs.create_stream

        @contextlib.contextmanager
        def create_stream(path, mode):
            with real(path, mode) as stream:
                yield _FullStream(stream, 4096)

        self.fs.create_stream = create_stream


def storage_writer(faults: FaultsConfig, step: int, path: str, async_save: bool) -> dcp.StorageWriter | None:
    """The writer of step `step`'s checkpoint: with --async-save and --slow-save-at-step there, a first attempt's
    writes pause 60 s before any shard is on disk, so that a kill lands during the background write; with
    --no-space-at-step there, the fail rank's device fills in the middle of its shard (None: the save's own)."""
    if faults.no_space_at_step == step and _here(faults):
        return _FullDeviceWriter(path)
    if async_save and faults.slow_save_at_step == step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return _SlowWriter(path)
    return None
