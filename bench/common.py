"""Shared benchmark plumbing: medians, a call timer, a machine description, table printing and JSON output, the
memory one step saves for backward."""
import json
import os
import platform
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # the committed results


def machine():
    """A one-line description of where the numbers were taken."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores (torch {torch.__version__})"


def median(xs):
    return statistics.median(xs)


def print_table(rows, columns):
    """rows: list of dicts; columns: list of (key, header, format)."""
    cells = [[header for _, header, _ in columns]]
    cells += [[fmt.format(row[key]) if row.get(key) is not None else "-" for key, _, fmt in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    print("\n".join(lines))
    return "\n".join(lines)


def scratch_path(name):
    """Where a benchmark writes by default: a temporary folder, never the committed bench/results/."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), "tp-bench", name)


def at_least(minimum):
    """An argparse type: an integer >= minimum (argparse names the flag in its one-line error)."""
    import argparse

    def parse(text):
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not >= {minimum}")
        return value

    return parse


def parser(doc, name, *, iters, warmup):
    """The flags every side-by-side benchmark over TP degrees takes: --iters --warmup --tp --out."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=at_least(1), default=iters)
    p.add_argument("--warmup", type=at_least(0), default=warmup)
    p.add_argument("--tp", type=at_least(1), nargs="+", default=[1, 2, 4])
    p.add_argument("--out", default=scratch_path(f"{name}.json"),
                   help=f"JSON output (the committed table is bench/results/{name}.json: pass it to refresh it)")
    return p


def check_out(p, flag, path, *, directory=False):
    """An output path the benchmark will write (a file, or a directory): refused before it runs, argparse's one-line
    usage error naming the flag (models.training.launch's checks, as models.train's path flags)."""
    from models.training.launch import check_writable_dir, check_writable_file

    try:
        (check_writable_dir if directory else check_writable_file)(flag, path)
    except ValueError as e:
        p.error(str(e))


def write_json(path, payload):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def time_call(fn, *, cuda=False, min_reps=3, min_seconds=0.05, max_reps=200):
    """Median time of fn() in seconds, after one warm-up call.

    cuda=True: triton.testing.do_bench (device events, L2 flushed between calls). Otherwise perf_counter around
    each call, at least `min_reps` calls and `min_seconds` in all (at most `max_reps`).
    """
    fn()
    if cuda:
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median") * 1e-3
    times = []
    while len(times) < max_reps and (len(times) < min_reps or sum(times) < min_seconds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def round_robin_times(steps, *, iters, warmup, sync=lambda: None, reduce=median):
    """{name: reduce(seconds of each iteration)} (default: the median) of each step function, the steps run in turn
    within every iteration (so machine noise hits all alike), each timed between two sync() calls (dist.barrier: the
    slowest rank's time). `reduce=list` keeps every iteration's time, for per-iteration ratios."""
    times = {name: [] for name in steps}
    for i in range(warmup + iters):
        for name, step in steps.items():
            sync()
            start = time.perf_counter()
            step()
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: reduce(ts) for name, ts in times.items()}


class _Largest(TorchDispatchMode):
    """The byte size of the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.bytes = max([self.bytes, *sizes])
        return out


def step_memory(step):
    """(saved bytes, largest op output bytes) of one step(): the distinct storages autograd saves for backward
    (saved_tensors_hooks; inputs included), and the largest tensor any op returns in forward or backward."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Largest() as largest:
        step()
    return sum(saved.values()), largest.bytes
