"""`--profile-steps A:B`: torch.profiler over optimizer steps A..B (from 1, both included) on every rank, or the
`--profile-ranks` given; one Chrome/Perfetto trace per rank, `DIR/rank-N.json` (`--profile-dir`, default
LOG_DIR/profile): open it in https://ui.perfetto.dev or chrome://tracing. CPU activity, and CUDA where present; the
pipeline runner names every action (`F stage=1 chunk=0 micro=3`, `B ...`, `W ...`, and the `recv for ...` waits
for its inputs), the trainer its phases (`step N`, `clip_grad_norm`, `optimizer.step`, `loss all-reduce`), and the
collectives appear as torch records them (`gloo:all_reduce`, `nccl:all_reduce`, `gloo:send`...). On CUDA, also the
allocator's history over the window, `DIR/rank-N-memory.pickle` (torch.cuda.memory._dump_snapshot: drag it onto
https://pytorch.org/memory_viz)."""
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from .config import JobConfig

MEMORY_ENTRIES = 100_000  # allocator events kept in a CUDA memory snapshot


def profile_dir(job: JobConfig) -> str:
    return job.profiling.profile_dir or os.path.join(job.logging.log_dir or ".", "profile")


class StepProfiler:
    """`step(n)`: a context manager around optimizer step n (from 1) that starts the profiler at step A and writes the
    trace after step B on the ranks profiled; a no-op elsewhere."""

    def __init__(self, job: JobConfig):
        self.window = job.profiling.window()
        ranks = job.profiling.ranks()
        self.rank = dist.get_rank()
        if self.window is None or (ranks is not None and self.rank not in ranks):
            self.window = None
        self.dir, self.profiler = profile_dir(job), None
        self.cuda = torch.cuda.is_available()
        self.export_s = 0.0  # writing the trace: not training (take_export_s)

    @contextlib.contextmanager
    def step(self, n: int):
        if self.window and n == self.window[0]:
            self._start()
        with record_function(f"step {n}") if self.profiler else contextlib.nullcontext():
            yield
        if self.profiler and n == self.window[1]:
            self._stop()

    def _start(self):
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.profiler = profile(activities=activities, record_shapes=False)
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
        with _quiet_stderr():
            self.profiler.__enter__()

    def take_export_s(self) -> float:
        """Seconds the last step spent stopping the profiler and writing its trace (0 for others), once."""
        seconds, self.export_s = self.export_s, 0.0
        return seconds

    def _stop(self):
        started = time.perf_counter()
        with _quiet_stderr():
            self.profiler.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"rank-{self.rank}.json")
        self.profiler.export_chrome_trace(path)
        if self.cuda:
            torch.cuda.memory._dump_snapshot(os.path.join(self.dir, f"rank-{self.rank}-memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.profiler = None
        self.export_s = time.perf_counter() - started
        if self.rank == 0:
            print(f"profile of steps {self.window[0]}..{self.window[1]}: {self.dir}/rank-N.json (one per rank "
                  "profiled; open in ui.perfetto.dev)", flush=True)

    def close(self) -> None:
        """A run that ended inside the window (a resumed one started in it): stop without writing."""
        if self.profiler:
            with _quiet_stderr():
                self.profiler.__exit__(None, None, None)
            self.profiler = None
            if self.rank == 0:
                print("note: the run ended inside --profile-steps: no trace written", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints a line to stderr as it starts and stops: not on the job's terminal."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
