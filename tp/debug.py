"""Debug mode: cheap cross-rank checks that catch the silent failures of tensor parallelism.

A "replicated" input that differs across the tp group (pytorch#119343), or ranks passing different shapes, makes
tensor parallelism compute wrong numbers or hang without an error. With `TP_DEBUG=1` in the environment or
`tp.set_debug(True)`, the mappings, the layers and the models all-gather a 13-number summary of such inputs (shape,
two checksums, a scale, where any NaN/inf lie) over the tp group before communicating, and raise on every rank a
ValueError naming the ranks that differ. Finite values may differ by ~1e-9 of the tensor's L1 norm (rounding).
Off (the default) it costs one boolean test per call and adds no collective.
"""
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from .collectives import gather_first

_MAX_DIMS = 8
_enabled = os.environ.get("TP_DEBUG", "0") not in ("", "0")
# TP_HOST_CHECKS=1: the id range checks read the host on GPUs too (one sync per check; a bad id then raises the
# one-line ValueError instead of a device assert, which ends the process's CUDA context): the test suite's choice
_host_checks = os.environ.get("TP_HOST_CHECKS", "0") not in ("", "0")


class set_debug:
    """Turn the cross-rank checks on or off (also `TP_DEBUG=1`); every rank of a group must agree.
    `tp.set_debug(True)` sets it from now on; `with tp.set_debug(True): ...` for a block, restoring it after."""

    def __init__(self, enabled: bool = True) -> None:
        global _enabled
        self.previous, _enabled = _enabled, bool(enabled)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _enabled
        _enabled = self.previous


def is_debug() -> bool:
    """Whether the cross-rank checks are on."""
    return _enabled


def check_range(ids: torch.Tensor, limit: int, message: Callable[[int | str], str], *,
                ignore: int | None = None) -> None:
    """Every id (but `ignore`) in [0, limit), else ValueError(message(the first bad id)).

    It is a device-side assert (`torch._assert_async`: no host sync, so the launch queue never stalls and the graph
    does not break): on a GPU a bad id stops the process; on the CPU the assert fails at once, and only then is the
    bad id read for the message (tp.host_syncs counts no sync for a good batch). Debug mode or TP_HOST_CHECKS=1 make
    it a host check on a GPU too, with the same message (not under torch.compile).
    """
    if not ids.numel():
        return
    bad = (ids < 0) | (ids >= limit)
    if ignore is not None:
        bad &= ids != ignore
    if torch.compiler.is_compiling() or (ids.device.type != "cpu" and not (_enabled or _host_checks)):
        torch._assert_async(~bad.any(), message("(an id)"))
        return
    if ids.device.type == "cpu":
        try:
            torch._assert_async(~bad.any(), "an id out of range")  # (on the CPU it raises at once)
            return
        except RuntimeError:
            pass
    elif not bad.any():  # (debug mode on a GPU: the host reads the flag)
        return
    raise ValueError(message(ids[bad][0].item()))


def _summary(x):
    """[ndim, shape (padded), sums of the finite values (plain, position-weighted, |x|), position-weighted sum of
    the non-finite values' kinds] in float64: equal tensors, equal summaries; NaN/inf compared by place and kind."""
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"tp debug checks support up to {_MAX_DIMS} dims, got shape {tuple(x.shape)}")
    flat = x.detach().reshape(-1).double()
    weights = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
    finite = flat.isfinite()
    kinds = flat.isnan() * 1.0 + (flat == torch.inf) * 2.0 + (flat == -torch.inf) * 3.0  # 0 where finite
    flat = flat.where(finite, 0.0)
    sums = torch.stack([flat.sum(), (flat * weights).sum(), (kinds * weights).sum(), flat.abs().sum()])
    shape = torch.tensor([x.dim(), *x.shape] + [0] * (_MAX_DIMS - x.dim()), dtype=torch.float64, device=x.device)
    return torch.cat([shape, sums])


def _groups_of(values, same):
    """Ranks partitioned into runs of equal values (in rank order), for the message."""
    classes = []
    for rank, v in enumerate(values):
        for members in classes:
            if same(values[members[0]], v):
                members.append(rank)
                break
        else:
            classes.append([rank])
    return classes


def check(x: torch.Tensor, group: dist.ProcessGroup, what: str, *, replicated: bool, group_name: str = "tp") -> None:
    """Raise on every rank unless x has the same shape (and, if `replicated`, the same values) on all ranks;
    `group_name` names the group in the message."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    every = gather_first(_summary(x), group).view(size, -1).cpu()
    shapes = [tuple(int(d) for d in row[1:1 + int(row[0])]) for row in every]
    classes = _groups_of(shapes, lambda a, b: a == b)
    if len(classes) > 1:
        detail = "; ".join(f"ranks {c} have shape {shapes[c[0]]}" for c in classes)
        raise ValueError(f"tp debug: {what} has different shapes across the {group_name} group: {detail}")
    if replicated:
        sums = every[:, -4:]
        scale = sums[:, 3].max().item() + 1e-30

        def same(a, b):  # finite values within rounding of the largest; non-finite ones exactly in place and kind
            return bool(torch.isclose(a[:2], b[:2], rtol=0, atol=1e-9 * scale).all()) and bool(a[2] == b[2])

        classes = _groups_of(list(sums), same)
        if len(classes) > 1:
            detail = " vs ".join(f"ranks {c}" for c in classes)
            raise ValueError(f"tp debug: {what} should be replicated but differs across the {group_name} group: "
                             f"{detail}")


def check_router(weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup) -> None:
    """Raise on every rank unless a mixture-of-experts router's weight (and its selection bias) are equal across
    `group` (the ranks of one pipeline stage): each rank routes its own tokens with its copy, so a copy that drifted
    (grads not summed over tp, an optimizer step on one rank) sends the same token to other experts silently."""
    check(weight, group, "the router weight of an MoE layer", replicated=True, group_name="stage (tp-cp-dp)")
    if bias is not None:
        check(bias, group, "the router's expert bias of an MoE layer", replicated=True,
              group_name="stage (tp-cp-dp)")
