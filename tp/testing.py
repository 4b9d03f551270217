"""Multi-rank test harness: run a function on N ranks as real processes (gloo on CPU; see TP_TEST_DEVICE).

Workers are spawned once per world size and reused across calls (spawning is the slow part). A failure on any
rank raises `RankError` with every failing rank's traceback; a hang raises `RankTimeout` with the Python stack of
every rank that did not answer (where it is stuck), and the workers are killed (the next call spawns fresh ones). A
call after which the ranks have created different numbers of process groups fails too, and respawns them: their next
groups would pair up wrongly (a gloo connection error, or a hang, in some later test).
Each call gets `timeout` seconds (default: `TP_TEST_TIMEOUT`, else 60) and starts from a clean rank: no mesh,
`torch.manual_seed(0)` on every rank, debug mode and the tracked RNG streams as at start-up. Under pytest, the ranks
import test modules with pytest's assertion rewriting, so a bare `assert` reports its values as it would in the
test process.

In pytest, decorate a module-level function; its parameters can be parametrized as usual:

    from tp.testing import distributed

    @pytest.mark.parametrize("tp_size", [1, 2, 4])
    @distributed(world_size=4)
    def test_something(tp_size):
        mesh = tp.init_mesh(tp=tp_size)      # the mesh is destroyed after the body, on every rank
        ...                                  # runs on 4 ranks; asserts fail the test with the rank's traceback

Outside pytest: `run(fn, world_size=4, **kwargs)` returns the list of per-rank return values.

`TP_TEST_DEVICE` picks where the ranks' tensors live: `cpu` (the default) gloo on CPU tensors; `cuda` gloo on CUDA
tensors, every rank's default device a GPU (ranks share the GPUs round-robin: gloo takes CUDA tensors for all-reduce,
broadcast and all-gather, point-to-point through host copies, and several ranks may share one GPU, which NCCL
refuses); `nccl` NCCL for CUDA tensors, one GPU per rank, and gloo for the host's ("cpu:gloo,cuda:nccl", as a job
runs). Without CUDA every mode is the CPU's.

Each rank runs torch's intra-op work on `OMP_NUM_THREADS` threads (torch's own reading of it; 1 when it is unset), at
most its share of the machine's cores (cores // world_size, at least 1): the ranks never oversubscribe the machine.
(A reduction may split, and round, otherwise over another thread count: `OMP_NUM_THREADS=2 python -m pytest` runs
the suite so where the cores allow.)
"""
import ast
import atexit
import datetime
import faulthandler
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import pickle
import queue
import re
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .mesh import collective_device

DEFAULT_TIMEOUT = float(os.environ.get("TP_TEST_TIMEOUT", 60))
_GRACE = 5.0  # seconds the other ranks get to report after one rank failed
_STARTUP_TIMEOUT = 300.0  # spawning the ranks and importing torch, on a loaded machine
_DUMP_WAIT = 2.0  # seconds a stuck rank gets to dump its stack


class RankError(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class RankTimeout(TimeoutError):
    """Some ranks did not finish in time (a hang, usually a collective another rank never joined)."""


TEST_DEVICES = ("cpu", "cuda", "nccl")


def device_mode() -> str:
    """TP_TEST_DEVICE (cpu, cuda or nccl; see the module's docstring), "cpu" without CUDA."""
    mode = os.environ.get("TP_TEST_DEVICE", "cpu") or "cpu"
    if mode not in TEST_DEVICES:
        raise ValueError(f"TP_TEST_DEVICE={mode!r} must be one of {', '.join(TEST_DEVICES)}")
    return mode if torch.cuda.is_available() else "cpu"


def _backend(world_size):
    mode = device_mode()
    if mode == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"TP_TEST_DEVICE=nccl needs one GPU per rank: {world_size} ranks, "
                         f"{torch.cuda.device_count()} GPUs (TP_TEST_DEVICE=cuda shares them over gloo)")
    return "cpu:gloo,cuda:nccl" if mode == "nccl" else "gloo"  # (nccl: the host's numbers over gloo, as in a job)


def device() -> torch.device:
    """The device tests on this rank should use: its GPU under TP_TEST_DEVICE=cuda or nccl, else the CPU."""
    return torch.get_default_device() if device_mode() != "cpu" else collective_device()


class _AssertRewriter(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the named modules with pytest's assertion rewriting (a worker's view of pytest's import hook)."""

    def __init__(self):
        self.modules = set()

    def find_spec(self, name, path, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path) if name in self.modules else None
        return spec and importlib.util.spec_from_file_location(name, spec.origin, loader=self)

    def exec_module(self, module):
        from _pytest.assertion.rewrite import rewrite_asserts  # only asked to rewrite when the parent runs pytest

        path = module.__spec__.origin
        with open(path, "rb") as f:
            source = f.read()
        tree = ast.parse(source, path)
        rewrite_asserts(tree, source, path)
        exec(compile(tree, path, "exec", dont_inherit=True), module.__dict__)


def _rewritten_by_pytest(module):
    """Whether pytest imported this module (of this process) with assertion rewriting: a test module."""
    rewrite = sys.modules.get("_pytest.assertion.rewrite")
    return rewrite is not None and isinstance(getattr(sys.modules[module], "__loader__", None),
                                              rewrite.AssertionRewritingHook)


def _resolve(module, qualname):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__wrapped__", obj)


def _threads(world_size):
    """The leading count of OMP_NUM_THREADS (WorkerPool sets 1 for the workers when it is unset), at most this rank's
    share of the cores."""
    count = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(int(count) if count.isdigit() else 1, cores // world_size))


def _stack_path(workdir, rank):
    return Path(workdir, f"stack{rank}")


def _stuck_thread_first(dump: str) -> str:
    """faulthandler's dump of every thread with the current one (where the rank is stuck) first, without the threads
    that only run the worker's multiprocessing queues and the interpreter's threading machinery, nor the process's
    start-up frames below the worker's."""
    blocks = re.split(r"\n(?=\S)", dump.strip())  # one per thread: its header line, then its indented frames
    frames = [re.findall(r'File "([^"]+)"', block) for block in blocks]
    plumbing = [bool(f) and all("multiprocessing" in p or p.endswith("threading.py") for p in f) for f in frames]
    below_worker = re.compile(r"(line \d+ in _worker)\n.*", re.DOTALL)  # the process's start-up frames
    kept = [below_worker.sub(r"\1", b) for b, drop in zip(blocks, plumbing) if not drop]
    kept.sort(key=lambda block: not block.startswith("Current thread"))
    return "\n".join(kept) + "\n" if kept else ""


def _worker(rank, world_size, workdir, tasks, results, collective_timeout):
    # The parent sends SIGUSR1 when this rank hangs and reads the stacks from this file for its report.
    faulthandler.register(signal.SIGUSR1, file=open(_stack_path(workdir, rank), "w"), all_threads=True)
    sys.meta_path.insert(0, rewriter := _AssertRewriter())
    torch.set_num_threads(threads := _threads(world_size))
    backend = _backend(world_size)
    if device_mode() != "cpu":  # test bodies that build tensors without a device get this rank's GPU
        gpu = rank % torch.cuda.device_count()
        torch.cuda.set_device(gpu)
        torch.set_default_device(f"cuda:{gpu}")
    dist.init_process_group(
        backend, init_method=f"file://{os.path.join(workdir, 'store')}", rank=rank, world_size=world_size,
        # beyond any call's timeout: the harness reports a hang, with every stuck rank's stack, before gloo would
        timeout=datetime.timedelta(seconds=collective_timeout),
    )
    import tp  # (after the process group, so import errors surface as task errors below)

    fresh_debug = tp.is_debug()

    results.put((0, rank, True, "ready", None))  # call timeouts start counting once every rank is up

    while (task := tasks.get()) is not None:
        task_id, module, qualname, rewrite_asserts, kwargs = task
        if rewrite_asserts:
            rewriter.modules.add(module)
        try:
            torch.manual_seed(0)  # every call, on every rank: results never depend on the tests run before
            ok, value = True, _resolve(module, qualname)(**kwargs)
            pickle.dumps(value)  # fail here, with a traceback, rather than silently in the queue's feeder thread
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
            ok, value = False, traceback.format_exc()
        finally:  # the next test starts from a clean rank (but keeps the process groups: creating them is slow)
            tp.destroy_mesh(keep_groups=True)
            torch.set_default_dtype(torch.float32)
            torch.set_num_threads(threads)  # (the training job sets 1 for itself)
            tp.set_debug(fresh_debug)
            tp.get_rng_tracker().reset()
        results.put((task_id, rank, ok, value, _groups_made()))


def _groups_made():
    """How many process groups this rank has created: equal on every rank unless a call left them out of step."""
    return getattr(dist.distributed_c10d._world, "group_count", None)


class WorkerPool:
    """`world_size` spawned ranks sharing one default process group, running submitted functions whose timeout is
    at most `timeout` (the process group's own timeout is twice that)."""

    def __init__(self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be >= 1")
        self.world_size, self.timeout = world_size, timeout
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="tp-testing-")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the workers only
        self._procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, self._dir.name, self._tasks[r], self._results, 2 * timeout),
                daemon=True,
                name=f"tp-rank{r}",
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False
        self._task_id = 0
        self._wait_until_started()

    def _wait_until_started(self):
        """Block until every rank has joined the process group (spawning and imports are not a call's time)."""
        started, deadline = set(), time.monotonic() + _STARTUP_TIMEOUT
        while len(started) < self.world_size:
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            late = time.monotonic() > deadline
            if dead or late:
                self.close()
                what = f"died (exit codes {[self._procs[r].exitcode for r in dead]})" if dead else \
                    f"did not start within {_STARTUP_TIMEOUT:.0f}s"
                raise RankError(f"ranks {dead or sorted(set(range(self.world_size)) - started)} of "
                                f"{self.world_size} {what} while starting the worker pool")
            try:
                task_id, rank, *_ = self._results.get(timeout=1.0)
                if task_id == 0:
                    started.add(rank)
            except queue.Empty:
                pass

    def run(self, fn: Callable[..., Any], kwargs: dict[str, Any] | None = None, *,
            timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
        """Run fn(**kwargs) on every rank; returns the per-rank results in rank order."""
        __tracebackhide__ = True  # pytest shows the ranks' tracebacks, not this loop
        fn = getattr(fn, "__wrapped__", fn)
        if timeout > self.timeout:
            raise ValueError(f"timeout={timeout} exceeds the {self.timeout}s this pool's process group was built for "
                             "(tp.testing.run respawns the pool for it)")
        if "<" in fn.__qualname__:  # <lambda>, <locals>: the ranks import the body by its module and name
            raise ValueError(f"{fn.__qualname__} cannot run on the ranks: pass a module-level function")
        self._task_id += 1
        task = (self._task_id, fn.__module__, fn.__qualname__, _rewritten_by_pytest(fn.__module__), kwargs or {})
        for q in self._tasks:
            q.put(task)
        outcome, groups_made, deadline = {}, {}, time.monotonic() + timeout
        while len(outcome) < self.world_size:
            failed = any(not ok for ok, _ in outcome.values())
            now = time.monotonic()
            if failed:
                deadline = min(deadline, now + _GRACE)
            if now >= deadline:
                break
            try:
                task_id, rank, ok, value, groups = self._results.get(timeout=min(1.0, deadline - now))
                if task_id == self._task_id:  # never mistake a late answer to an earlier call for this one
                    outcome[rank], groups_made[rank] = (ok, value), groups
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in outcome]
                for r in dead:
                    outcome[r] = (False, f"rank {r} died (exit code {self._procs[r].exitcode})")
        missing = [r for r in range(self.world_size) if r not in outcome]
        stacks = {}
        if missing:  # stuck (in a collective, usually): take their stacks, then kill them (never reused)
            stacks = self._stacks(missing)
            for r in missing:
                self._procs[r].kill()
        # a rank that created process groups the others did not (a body that failed on some ranks between two
        # new_group calls) would pair its next group with the wrong one of theirs: respawn, as for a dead rank
        out_of_step = len(set(groups_made.values())) > 1
        if missing or out_of_step or not all(p.is_alive() for p in self._procs):
            self.close()
        errors = {r: v for r, (ok, v) in sorted(outcome.items()) if not ok}
        report = "".join([f"\n---- rank {r} ----\n{tb}" for r, tb in errors.items()] +
                         [f"\n---- rank {r} stuck here ----\n{stack}" for r, stack in stacks.items()])
        name = f"{fn.__module__}.{fn.__qualname__}"
        if errors:
            hung = f"\nranks {missing} did not report and were killed" if missing else ""
            raise RankError(f"{name} failed on ranks {sorted(errors)} of {self.world_size}{hung}{report}")
        if out_of_step:
            counts = dict(sorted(groups_made.items()))
            raise RankError(f"{name}: the ranks created different numbers of process groups ({counts}; a new_group "
                            "call left out on some ranks): the workers were respawned")
        if missing:
            raise RankTimeout(f"{name}: ranks {missing} of {self.world_size} did not finish within {timeout:.0f}s "
                              f"(set by timeout= or TP_TEST_TIMEOUT){report}")
        return [outcome[r][1] for r in range(self.world_size)]

    def _stacks(self, ranks):
        """Each of these (stuck) ranks' Python stacks, dumped by faulthandler on SIGUSR1 (see `_worker`)."""
        paths = {r: _stack_path(self._dir.name, r) for r in ranks}
        # a rank whose file does not exist yet has not registered the dump, and SIGUSR1 would just kill it
        started = [r for r in ranks if paths[r].exists() and self._procs[r].is_alive()]
        for r in started:
            os.kill(self._procs[r].pid, signal.SIGUSR1)
        deadline = time.monotonic() + _DUMP_WAIT
        while time.monotonic() < deadline and not all(paths[r].stat().st_size for r in started):
            time.sleep(0.05)
        time.sleep(0.05)  # a dump that has begun is done in microseconds
        not_started = "(no stack: still starting up, or dead)\n"
        return {r: (_stuck_thread_first(paths[r].read_text()) or "(no stack dumped)\n") if r in started
                else not_started for r in ranks}

    def close(self) -> None:
        """Stop the workers (the pool is then broken: `pool` spawns a new one)."""
        self.broken = True
        for q in self._tasks:
            try:
                q.put_nowait(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        self._dir.cleanup()


_pools = {}
# The shared pools take calls of up to this many seconds, whatever the first call asked: a pool built for the default
# minute was respawned (its gloo timeout is fixed at start-up) by the first call asking longer, once per world size and
# longer timeout. A hang is still reported at each call's own timeout; only the gloo timeout behind it is longer.
SHARED_TIMEOUT = 600.0


def pool(world_size: int, timeout: float = DEFAULT_TIMEOUT) -> WorkerPool:
    """The shared pool of `world_size` ranks, (re)spawned when missing, broken or built for a shorter timeout (shared
    pools are built for SHARED_TIMEOUT, or longer when the call or TP_TEST_TIMEOUT asks it)."""
    current = _pools.get(world_size)
    if current is None or current.broken or current.timeout < timeout:
        if current is not None and not current.broken:
            current.close()
        _pools[world_size] = WorkerPool(world_size, timeout=max(timeout, DEFAULT_TIMEOUT, SHARED_TIMEOUT))
    return _pools[world_size]


@atexit.register
def shutdown() -> None:
    """Stop every pool's workers."""
    for p in _pools.values():
        if not p.broken:
            p.close()
    _pools.clear()


def run(fn: Callable[..., Any], world_size: int, *, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> list[Any]:
    """Run the module-level function fn(**kwargs) on `world_size` ranks; returns per-rank results."""
    __tracebackhide__ = True
    return pool(world_size, timeout).run(fn, kwargs, timeout=timeout)


def distributed(world_size: int, *,
                timeout: float = DEFAULT_TIMEOUT) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Decorator: the (module-level) test body runs on `world_size` ranks, with pytest's arguments as kwargs."""

    def decorate(fn):
        @functools.wraps(fn)
        def test(**kwargs):
            __tracebackhide__ = True
            run(fn, world_size, timeout=timeout, **kwargs)

        return test

    return decorate
