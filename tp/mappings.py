"""The conjugate autograd mappings between tensor-parallel regions (Megatron's vocabulary).

Activation layout: [s, b, h] (sequence first, Megatron's), so sequence-parallel gathers and scatters work on dim 0
and move contiguous memory; tensor-parallel splits and gathers work on the last dim (the plain collectives are in
tp.collectives). Every function takes an optional `group` (default: the current mesh's tp group) and does no
communication when the group has one rank. In debug mode (tp.set_debug) each first checks its input across the group;
`check=False`, where offered, skips that: the caller (a layer) has checked the input its x was computed from.
"""
import torch
import torch.distributed as dist

from . import debug
from .collectives import all_reduce, gather_first, gather_last, reduce_scatter_first, split_first, split_last
from .mesh import resolve_group

# ---- autograd Functions: one per conjugate pair ------------------------------------------------------------------


def _mapping(name, fwd, bwd):
    """An autograd Function: forward(x) = fwd(x, group), backward(g) = bwd(g, group), which runs as its conjugate
    mapping's forward (`conjugate`, set by _conjugates), so a second derivative through it is exact (the mappings are
    linear: the backward's own backward is fwd). Only applied to groups of more than one rank. (Static methods closing
    over fwd and bwd: torch.compile traces those, not class methods.)"""

    def forward(ctx, x, group):
        ctx.group = group
        return fwd(x, group)

    def backward(ctx, grad):
        if torch.is_grad_enabled():  # (create_graph: the backward recorded as the conjugate mapping)
            return mapping.conjugate.apply(grad, ctx.group), None
        return bwd(grad, ctx.group), None

    mapping = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                      "backward": staticmethod(backward)})
    return mapping


def _conjugates(a, b):
    """a's backward is b's forward and b's backward a's forward."""
    a.conjugate, b.conjugate = b, a


def _identity(x, group):
    return x


_CopyToTP = _mapping("_CopyToTP", _identity, all_reduce)
_ReduceFromTP = _mapping("_ReduceFromTP", all_reduce, _identity)
_conjugates(_CopyToTP, _ReduceFromTP)


class _ReduceFromTPInPlace(torch.autograd.Function):
    """reduce_from_tp_region in x's own storage (no copy), for fresh matmul outputs nobody else holds.

    mark_dirty tells autograd: anything that saved x for backward then fails loudly instead of using the sum.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        if not x.is_contiguous():
            return all_reduce(x, group)
        ctx.mark_dirty(x)
        return all_reduce(x, group, inplace=True)

    @staticmethod
    def backward(ctx, grad):
        return (_CopyToTP.apply(grad, ctx.group) if torch.is_grad_enabled() else grad), None


_ScatterToTP = _mapping("_ScatterToTP", split_last, gather_last)
_GatherFromTP = _mapping("_GatherFromTP", gather_last, split_last)
_ScatterToSP = _mapping("_ScatterToSP", split_first, gather_first)
_GatherFromSP = _mapping("_GatherFromSP", gather_first, reduce_scatter_first)
_GatherFromSPReplicatedGrad = _mapping("_GatherFromSPReplicatedGrad", gather_first, split_first)
_ReduceScatterToSP = _mapping("_ReduceScatterToSP", reduce_scatter_first, gather_first)
_conjugates(_ScatterToTP, _GatherFromTP)
_conjugates(_ScatterToSP, _GatherFromSPReplicatedGrad)
_conjugates(_GatherFromSP, _ReduceScatterToSP)


def _apply(mapping: type[torch.autograd.Function], x: torch.Tensor, group: dist.ProcessGroup | None, *,
           replicated: bool, check: bool = True) -> torch.Tensor:
    """mapping(x) on groups of more than one rank (one rank: not even an autograd node). `replicated`: x must be
    equal on every rank (else only its shape), which debug mode checks unless `check` is False."""
    group = resolve_group(group)
    if dist.get_world_size(group) == 1:
        return x
    if check and debug.is_debug():
        debug.check(x, group, f"the input of {mapping.__name__.lstrip('_')}", replicated=replicated)
    return mapping.apply(x, group)


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """forward: identity · backward: all-reduce."""
    return _apply(_CopyToTP, x, group, replicated=True)


def reduce_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None, *, in_place: bool = False,
                          check: bool = True) -> torch.Tensor:
    """forward: all-reduce (`in_place`: into x's storage, for a fresh output nobody else holds; not under
    torch.compile, whose functional all-reduce writes a new buffer the compiler may reuse) · backward: identity."""
    in_place = in_place and not torch.compiler.is_compiling()
    return _apply(_ReduceFromTPInPlace if in_place else _ReduceFromTP, x, group, replicated=False, check=check)


def scatter_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """forward: split(last dim) · backward: all-gather(last dim)."""
    return _apply(_ScatterToTP, x, group, replicated=True)


def gather_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """forward: all-gather(last dim) · backward: split(last dim)."""
    return _apply(_GatherFromTP, x, group, replicated=False)


def scatter_to_sp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """forward: split(sequence dim 0) · backward: all-gather(sequence dim 0)."""
    return _apply(_ScatterToSP, x, group, replicated=True)


def gather_from_sp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                          tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """forward: all-gather(sequence dim 0) · backward: reduce-scatter(sequence dim 0).

    With tensor_parallel_output_grad=False (the gathered tensor feeds computation replicated on every rank, e.g.
    a final norm or the loss, so its gradient is already complete on each): backward is split(sequence dim 0).
    """
    mapping = _GatherFromSP if tensor_parallel_output_grad else _GatherFromSPReplicatedGrad
    return _apply(mapping, x, group, replicated=False)


def reduce_scatter_to_sp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                                check: bool = True) -> torch.Tensor:
    """forward: reduce-scatter(sequence dim 0) · backward: all-gather(sequence dim 0)."""
    return _apply(_ReduceScatterToSP, x, group, replicated=False, check=check)
