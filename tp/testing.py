"""Multi-rank test harness: run a function on N ranks as real processes (gloo on CPU, NCCL with >= N GPUs).

Workers are spawned once per world size and reused across calls (spawning is the slow part). A failure on any
rank raises `RankError` with every failing rank's traceback; a hang raises `RankTimeout` naming the ranks that did
not answer, and the workers are killed (the next call spawns fresh ones).

In pytest, decorate a module-level function; its parameters can be parametrized as usual:

    from tp.testing import distributed

    @pytest.mark.parametrize("tp_size", [1, 2, 4])
    @distributed(world_size=4)
    def test_something(tp_size):
        mesh = tp.init_mesh(tp=tp_size)      # the mesh is destroyed after the body, on every rank
        ...                                  # runs on 4 ranks; asserts fail the test with the rank's traceback

Outside pytest: `run(fn, world_size=4, **kwargs)` returns the list of per-rank return values.
"""
import atexit
import datetime
import functools
import importlib
import os
import pickle
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT = float(os.environ.get("TP_TEST_TIMEOUT", 180))
_GRACE = 5.0  # seconds the other ranks get to report after one rank failed


class RankError(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class RankTimeout(TimeoutError):
    """Some ranks did not finish in time (a hang, usually a collective another rank never joined)."""


def _backend(world_size):
    return "nccl" if torch.cuda.device_count() >= world_size else "gloo"


def device():
    """The device tests on this rank should use: its own GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resolve(module, qualname):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__wrapped__", obj)


def _worker(rank, world_size, store_path, tasks, results):
    torch.set_num_threads(1)
    backend = _backend(world_size)
    if backend == "nccl":  # test bodies that build tensors without a device get this rank's GPU
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
    dist.init_process_group(
        backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT),
    )
    import tp  # noqa: F401  (after the process group, so import errors surface as task errors below)

    while (task := tasks.get()) is not None:
        task_id, module, qualname, kwargs = task
        try:
            value = _resolve(module, qualname)(**kwargs)
            pickle.dumps(value)  # fail here, with a traceback, rather than silently in the queue's feeder thread
            results.put((task_id, rank, True, value))
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
            results.put((task_id, rank, False, traceback.format_exc()))
        finally:  # the next test starts from a clean rank (but keeps the process groups: creating them is slow)
            tp.destroy_mesh(keep_groups=True)
            torch.set_default_dtype(torch.float32)


class WorkerPool:
    """`world_size` spawned ranks sharing one default process group, running submitted functions."""

    def __init__(self, world_size):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="tp-testing-")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the workers only
        self._procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, os.path.join(self._dir.name, "store"), self._tasks[r],
                                      self._results), daemon=True, name=f"tp-rank{r}",
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False
        self._task_id = 0

    def run(self, fn, kwargs=None, *, timeout=DEFAULT_TIMEOUT):
        """Run fn(**kwargs) on every rank; returns the per-rank results in rank order."""
        __tracebackhide__ = True  # pytest shows the ranks' tracebacks, not this loop
        fn = getattr(fn, "__wrapped__", fn)
        self._task_id += 1
        for q in self._tasks:
            q.put((self._task_id, fn.__module__, fn.__qualname__, kwargs or {}))
        outcome, deadline = {}, time.monotonic() + timeout
        while len(outcome) < self.world_size:
            failed = any(not ok for ok, _ in outcome.values())
            now = time.monotonic()
            if failed:
                deadline = min(deadline, now + _GRACE)
            if now >= deadline:
                break
            try:
                task_id, rank, ok, value = self._results.get(timeout=min(1.0, deadline - now))
                if task_id == self._task_id:  # never mistake a late answer to an earlier call for this one
                    outcome[rank] = (ok, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in outcome]
                for r in dead:
                    outcome[r] = (False, f"rank {r} died (exit code {self._procs[r].exitcode})")
        missing = [r for r in range(self.world_size) if r not in outcome]
        if missing:
            self.close()  # the missing ranks are stuck (in a collective, usually): never reuse them
        errors = {r: v for r, (ok, v) in sorted(outcome.items()) if not ok}
        name = f"{fn.__module__}.{fn.__qualname__}"
        if errors:
            report = "\n".join(f"---- rank {r} ----\n{tb}" for r, tb in errors.items())
            hung = f"\nranks {missing} did not report and were killed" if missing else ""
            raise RankError(f"{name} failed on ranks {sorted(errors)} of {self.world_size}{hung}\n{report}")
        if missing:
            raise RankTimeout(f"{name}: ranks {missing} of {self.world_size} did not finish within {timeout:.0f}s")
        return [outcome[r][1] for r in range(self.world_size)]

    def close(self):
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


def pool(world_size):
    """The shared pool of `world_size` ranks, (re)spawned when missing or broken."""
    if world_size not in _pools or _pools[world_size].broken:
        _pools[world_size] = WorkerPool(world_size)
    return _pools[world_size]


@atexit.register
def shutdown():
    """Stop every pool's workers."""
    for p in _pools.values():
        if not p.broken:
            p.close()
    _pools.clear()


def run(fn, world_size, *, timeout=DEFAULT_TIMEOUT, **kwargs):
    """Run the module-level function fn(**kwargs) on `world_size` ranks; returns per-rank results."""
    __tracebackhide__ = True
    return pool(world_size).run(fn, kwargs, timeout=timeout)


def distributed(world_size, *, timeout=DEFAULT_TIMEOUT):
    """Decorator: the (module-level) test body runs on `world_size` ranks, with pytest's arguments as kwargs."""

    def decorate(fn):
        @functools.wraps(fn)
        def test(**kwargs):
            __tracebackhide__ = True
            run(fn, world_size, timeout=timeout, **kwargs)

        return test

    return decorate
