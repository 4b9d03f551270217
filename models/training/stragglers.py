"""Naming the slow rank: every --log-interval steps each rank's step time is gathered (one all-gather of two numbers
over every rank), the log row gets `slowest_rank`, `rank_step_s_max` and `rank_step_s_min`, and rank 0 warns when
one rank's step time is --straggler-factor times the median of the other ranks' three gathers running.

A rank's step time here is its own work, not its waiting for others: in a synchronous job every rank's wall time per
step is the same (the fast ones wait in collectives for the slow one), so the wall clock cannot name the straggler.
On CPU the work is the step's CPU time of the training thread (gloo's collectives and receives wait without it);
on GPUs, the step's wall time less the pipeline's waits for its inputs (ScheduleStats: total_s - busy_s), which is
what can be measured without synchronizing the device. The time each rank waited (wall - work) is logged too, as
`rank_wait_s_max`.
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist

from tp.collectives import all_gather_into_tensor
from tp.host_syncs import host_values

PERSISTENT = 3  # gathers running before a rank is called a straggler


class StepClock:
    """A rank's clock for one step: `start()`, then `stop(stats)` -> (work seconds, wall seconds)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def stop(self, stats) -> tuple[float, float]:
        wall = time.perf_counter() - self.wall
        work = wall - max(0.0, stats.total_s - stats.busy_s) if self.cuda else time.thread_time() - self.cpu
        return min(work, wall), wall


class Stragglers:
    """Collective every `interval` steps (every rank calls `gather` each step)."""

    def __init__(self, *, interval: int, factor: float, rank0: bool):
        self.interval, self.factor, self.rank0 = interval, factor, rank0
        self.running: dict[int, int] = {}  # rank -> gathers running it was slower than factor x median
        self.warned: set[int] = set()

    def gather(self, step: int, work_s: float, wall_s: float, total: int) -> dict:
        """On every --log-interval-th step (and the last): {slowest_rank, rank_step_s_max, rank_step_s_min,
        rank_wait_s_max}; else {}."""
        if step % self.interval and step != total:
            return {}
        mine = torch.tensor([work_s, wall_s - work_s], dtype=torch.float64, device="cpu")  # (the host's clocks)
        every = mine.new_empty(2 * dist.get_world_size())
        all_gather_into_tensor(every, mine)  # (over gloo: no device involved)
        work, waits = zip(*host_values(every.view(-1, 2)))
        slowest = max(range(len(work)), key=work.__getitem__)
        if self.rank0:
            self._watch(step, work)
        return {"slowest_rank": slowest, "rank_step_s_max": work[slowest], "rank_step_s_min": min(work),
                "rank_wait_s_max": max(waits)}

    def _watch(self, step, work):
        for rank, seconds in enumerate(work):
            others = work[:rank] + work[rank + 1:]  # (with the rank itself, two ranks' median is their mean)
            if not others:
                return
            median = statistics.median(others)
            slow = seconds > self.factor * median
            self.running[rank] = self.running.get(rank, 0) + 1 if slow else 0
            if self.running[rank] >= PERSISTENT and rank not in self.warned:
                self.warned.add(rank)
                print(f"warning: rank {rank} is a straggler: its steps took {seconds:.3g} s at step {step}, "
                      f"{seconds / median:.1f}x the median {median:.3g} s of the other ranks ({PERSISTENT} checks "
                      "running; see slowest_rank in the log)", file=sys.stderr, flush=True)
