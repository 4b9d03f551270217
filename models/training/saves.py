"""The checkpoints a training job writes into --save's DIR (checkpoint_dirs.py's convention): DIR/step-N, then
DIR/latest moved to it once every rank's part and the manifest are on disk, then (--keep-last K) the older step
directories removed. With --async-save the tensors are staged to CPU and written in the background; `latest` moves
when rank 0's write is done (`poll`), which DCP completes only after every rank's.

A save that finds the device full ends the job in one line (failures.JobStopped): "no space left on device at PATH
(this save needs about N GB)"; its step directory is removed and `latest` still names the previous checkpoint. Any
other failure of a save is raised as it is."""
import os
import shutil
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from tp.mesh import Mesh

from . import checkpoint, checkpoint_dirs, faults, manifest
from .config import JobConfig
from .failures import JobStopped


class Saves:
    """One rank's side of the job's saves (collective: every rank calls `save`, `finish` together)."""

    def __init__(self, job: JobConfig, mesh: Mesh, *, size_bytes: int):
        self.job, self.mesh, self.rank0 = job, mesh, mesh.rank == 0
        self.root = job.checkpoint.save
        self.size_bytes = size_bytes  # (the estimate a full device's line gives when no earlier save tells better)
        # --async-save: DCP's writing thread runs its collectives on a gloo group of its own (never the training's)
        self.group = dist.new_group(backend="gloo") if job.checkpoint.async_save and self.root else None
        self.pending = None  # (the Future of an async save in flight, its step directory's name)

    def save(self, step: int, model: Any, optimizer: torch.optim.Optimizer, extra: dict) -> float:
        """Write DIR/step-N, then point DIR/latest at it: a kill mid-save never spoils the previous checkpoint, and
        what it half wrote is removed here, at the next save. Returns the seconds the step loop was blocked."""
        started = time.perf_counter()
        self.finish()  # (one save in flight at a time)
        name = checkpoint_dirs.step_name(step)
        if self.rank0:
            removed = checkpoint_dirs.remove_unfinished(self.root, step)
            if removed:
                print(f"removed unfinished checkpoint{'s' * (len(removed) > 1)} {', '.join(removed)} in {self.root}",
                      file=sys.stderr, flush=True)
        dist.barrier()
        path = os.path.join(self.root, name)
        try:
            future = checkpoint.save(path, model, optimizer, mesh=self.mesh, step=step, extra=extra,
                                     async_group=self.group, storage_writer=faults.storage_writer(
                                         self.job.faults, step, path, self.group is not None))
        except BaseException as e:  # noqa: B036 (torch's CheckpointException is a BaseException)
            self.failed(e, name)
            raise
        if future is not None:
            self.pending = future, name
            return time.perf_counter() - started
        faults.during_save(self.job.faults, step)
        dist.barrier()
        if self.rank0:
            self.commit(name)
        dist.barrier()
        return time.perf_counter() - started

    def poll(self) -> None:
        """An async save whose write is done on this rank: (rank 0) point `latest` at it."""
        if self.pending and self.pending[0].done():
            self.finish()

    def finish(self) -> None:
        """Wait for the async save in flight (if any) and, on rank 0, commit it."""
        if not self.pending:
            return
        future, name = self.pending
        self.pending = None
        try:
            future.result()  # (raises the write's error, on every rank: DCP spreads it)
        except BaseException as e:  # noqa: B036
            self.failed(e, name)
            raise
        if self.rank0:
            self.commit(name)

    def commit(self, name: str) -> None:
        """(rank 0) `latest` names step directory `name`; then --keep-last's older step directories go."""
        checkpoint_dirs.commit(self.root, name)
        keep = self.job.checkpoint.keep_last
        if keep:
            checkpoint_dirs.keep_last(self.root, keep)

    def failed(self, error: BaseException, name: str) -> None:
        """A save that raised `error`: on a full device, its step directory removed and JobStopped raised with the
        one line; otherwise nothing (the caller raises `error`). Every rank gets the error and removes what it can:
        the launcher may stop the job on one rank's line before another handles it, and nodes need not share the
        file system."""
        if not manifest.no_space(error):
            return
        path = os.path.join(self.root, name)
        shutil.rmtree(path, ignore_errors=True)  # (ranks of one file system race: whatever one left, another takes)
        raise JobStopped(f"no space left on device at {path} (this save needs about "
                         f"{self.needed_bytes() / 1e9:.2g} GB)") from None

    def needed_bytes(self) -> int:
        """What a save takes: the size of the newest complete checkpoint in DIR (its manifest), else the estimate."""
        last = checkpoint_dirs.committed(self.root)
        listed = manifest.read(last) if last else None
        return sum(f["size"] for f in listed["files"].values()) if listed else self.size_bytes
