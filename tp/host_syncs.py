"""Counting host syncs on any device, the CPU included: `with count_host_syncs() as syncs: step()`, then
`len(syncs)` and `print(syncs.summary())`.

A host sync is a read of a tensor's values (or of a size only its values decide) by the host: on a GPU the host then
waits for every kernel queued before it, and the launch queue runs dry. In PyTorch each such read goes through a few
aten ops, which a TorchDispatchMode sees whatever the device: `_local_scalar_dense` (`.item()`, `bool(t)`, `int(t)`,
`float(t)`, `if t:`), the ops whose output size depends on the values (`nonzero`, `masked_select`, the `unique`s,
`repeat_interleave` without `output_size`, indexing with a boolean mask, `bincount`), `equal`, and a copy from the
device to the host (`.cpu()`, `.to("cpu")` of a device tensor); `.tolist()` and `.numpy()`, which read a CPU tensor
without an aten op, are counted by wrapping them while a counter is open. On the CPU nothing waits, but the same
code on a GPU would: a CPU run counts what a GPU run would sync, and a test on the CPU can hold the count. Two
helpers say what a read is: `host_values(t)` reads a tensor that lives on the host on every device (timings, sizes
reduced over gloo: not counted), `to_host(t)` is a read a step needs (counted, on the CPU too).

CUDA's own `torch.cuda.set_sync_debug_mode("warn")` sees the CUDA runtime's syncs on a GPU, including blocking
host-to-device copies and `torch.cuda.synchronize()`, which are no reads of values and are not counted here.
"""
import contextlib
import os
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# ops that read values on the host whatever their arguments
_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.nonzero.default, aten.masked_select.default,
          aten._unique.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
          aten.bincount.default, aten.repeat_interleave.Tensor}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_HOST_READS = {"tolist": torch.Tensor.tolist, "numpy": torch.Tensor.numpy}
_THIS = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


@dataclass(frozen=True)
class HostSync:
    """One host sync: the op (`aten._local_scalar_dense.default`, `tolist`, ...) and where it was called from (the
    innermost frames outside torch, innermost last: "file.py:line function")."""
    op: str
    where: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.op} at {' <- '.join(reversed(self.where))}"


class HostSyncs(list):
    """The HostSync of each host sync, in order."""

    def summary(self) -> str:
        """One line per distinct (op, place) with its count, most frequent first."""
        counts: dict[str, int] = {}
        for sync in self:
            counts[str(sync)] = counts.get(str(sync), 0) + 1
        return "\n".join(f"{n} x {line}" for line, n in sorted(counts.items(), key=lambda kv: -kv[1]))


_quiet = [0]  # > 0 while a read is under way that is counted already or not at all: its ops are not counted
_counting: list[tuple[HostSyncs, str]] = []  # the counters open now (HostSyncs, device type), innermost last


def host_values(t: torch.Tensor) -> list:
    """t.tolist() for a tensor that lives on the host on every device (the host's own numbers: timings, sizes
    reduced over gloo), not counted by count_host_syncs: nothing waits for a device. A device tensor: ValueError."""
    if t.device.type != "cpu":
        raise ValueError(f"host_values: a tensor on {t.device}, not on the host (read it with .tolist(): a host sync)")
    return _quietly(t.tolist)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """t.cpu(), counted by count_host_syncs as the host sync it is on a device even where t is already on the host
    (on the CPU .cpu() is no op to see): for the reads a step needs (the split sizes of a variable all-to-all)."""
    _record("to_host", t)
    return _quietly(t.cpu)


def _record(op, t):
    if not _quiet[0]:
        for seen, device in _counting:
            if _on(device, t):
                seen.append(HostSync(op, _where()))


def _quietly(read, *args, **kwargs):
    _quiet[0] += 1
    try:
        return read(*args, **kwargs)
    finally:
        _quiet[0] -= 1


def _where(frames: int = 3) -> tuple[str, ...]:
    ours = [f for f in traceback.extract_stack() if not f.filename.startswith(_TORCH) and f.filename != _THIS]
    return tuple(f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}" for f in ours[-frames:])


def _on(device, t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == device


def _is_sync(func, args, kwargs, device) -> bool:
    if func in _READS:
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
            return False
        return any(_on(device, a) for a in args)
    if func in _INDEXING:  # a boolean mask becomes its nonzero indices (a value-dependent size)
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masks = any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
        return masks and _on(device, args[0])
    if func in (aten._to_copy.default, aten.copy_.default):  # device -> host
        source, target = (args[0], kwargs.get("device")) if func is aten._to_copy.default else (args[1], args[0].device)
        return device != "cpu" and _on(device, source) and torch.device(target or source.device).type == "cpu"
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, seen, device):
        super().__init__()
        self.seen, self.device = seen, device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _quiet[0] and _is_sync(func, args, kwargs, self.device):
            self.seen.append(HostSync(str(func), _where()))
        return func(*args, **kwargs)


def _reading(name, method):
    """Tensor.tolist / .numpy counted: they read a CPU tensor without an aten op (patched on torch.Tensor while a
    counter is open: a TorchFunctionMode would not see them in the backward pass)."""
    def read(self, *args, **kwargs):
        _record(name, self)
        return _quietly(method, self, *args, **kwargs)  # (its copy to the host is this one sync)
    return read


@contextlib.contextmanager
def count_host_syncs(device: torch.device | str | None = None) -> Iterator[HostSyncs]:
    """The host syncs inside the block, on tensors of `device` (default: CUDA when available, else the CPU, where
    every tensor of a CPU run lives): a HostSyncs list, filled as they happen, the backward pass's included (autograd
    carries the dispatch mode into it). On a GPU, torch.cuda.set_sync_debug_mode("warn") is the cross-check."""
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    seen = HostSyncs()
    if not _counting:
        for name, method in _HOST_READS.items():
            setattr(torch.Tensor, name, _reading(name, method))
    _counting.append((seen, kind))
    try:
        with _Dispatch(seen, kind):
            yield seen
    finally:
        _counting[:] = [c for c in _counting if c[0] is not seen]
        if not _counting:
            for name, method in _HOST_READS.items():
                setattr(torch.Tensor, name, method)
