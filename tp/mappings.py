"""The conjugate autograd mappings between tensor-parallel regions (Megatron's vocabulary).

Activation layout: [s, b, h] (sequence first, Megatron's), so sequence-parallel gathers and scatters work on dim 0
and move contiguous memory; tensor-parallel splits and gathers work on the last dim. Every function takes an
optional `group` (default: the current mesh's tp group) and does no communication when the group has one rank.
"""
import torch
import torch.distributed as dist
from einops import rearrange

from . import debug
from .mesh import resolve_group

# torch >= 2.13 renames the tensor collectives (*_single); older releases (e.g. 2.11) only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check_divisible(size, parts, what):
    if size % parts:
        raise ValueError(f"cannot split {what} of size {size} evenly across {parts} tensor-parallel ranks")


# ---- collective helpers: plain functions on tensors, no autograd -------------------------------------------------


def all_reduce(x, group, *, inplace=False, async_op=False):
    """Sum over the group. Reduces (and returns) a contiguous copy unless `inplace` and x is already contiguous."""
    out = x.contiguous()
    if out is x and not inplace:
        out = x.clone()
    handle = dist.all_reduce(out, group=group, async_op=async_op)
    return (out, handle) if async_op else out


def split_last(x, group):
    """This rank's chunk of the last dim."""
    parts = dist.get_world_size(group)
    _check_divisible(x.shape[-1], parts, "the last dim")
    return x.chunk(parts, dim=-1)[dist.get_rank(group)].clone(memory_format=torch.contiguous_format)  # never a view


def gather_last(x, group):
    """Concatenate every rank's x along the last dim."""
    parts = dist.get_world_size(group)
    out = x.new_empty((parts * x.shape[0], *x.shape[1:]))
    _all_gather(out, x.contiguous(), group=group)
    return rearrange(out.view(parts, *x.shape), "p ... h -> ... (p h)").contiguous()


def split_first(x, group):
    """This rank's chunk of dim 0 (the sequence)."""
    parts = dist.get_world_size(group)
    _check_divisible(x.shape[0], parts, "the sequence dim (dim 0)")
    return x.chunk(parts, dim=0)[dist.get_rank(group)].clone()


def gather_first(x, group, *, async_op=False):
    """Concatenate every rank's x along dim 0."""
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    handle = _all_gather(out, x.contiguous(), group=group, async_op=async_op)
    return (out, handle) if async_op else out


def reduce_scatter_first(x, group, *, async_op=False):
    """Sum over the group, keep this rank's chunk of dim 0."""
    parts = dist.get_world_size(group)
    _check_divisible(x.shape[0], parts, "the sequence dim (dim 0)")
    out = x.new_empty((x.shape[0] // parts, *x.shape[1:]))
    handle = _reduce_scatter(out, x.contiguous(), group=group, async_op=async_op)
    return (out, handle) if async_op else out


# ---- autograd Functions: one per conjugate pair ------------------------------------------------------------------


class _Mapping(torch.autograd.Function):
    """forward(x) = fwd(x), backward(g) = bwd(g). Only applied to groups of more than one rank."""

    fwd = bwd = None

    @classmethod
    def forward(cls, ctx, x, group):
        ctx.group = group
        return cls.fwd(x, group)

    @classmethod
    @torch.autograd.function.once_differentiable
    def backward(cls, ctx, grad):
        return cls.bwd(grad, ctx.group), None


def _identity(x, group):
    return x


def _mapping(name, fwd, bwd):
    return type(name, (_Mapping,), {"fwd": staticmethod(fwd), "bwd": staticmethod(bwd)})


_CopyToTP = _mapping("_CopyToTP", _identity, all_reduce)
_ReduceFromTP = _mapping("_ReduceFromTP", all_reduce, _identity)


class _ReduceFromTPInPlace(torch.autograd.Function):
    """reduce_from_tp_region in x's own storage (no copy), for fresh matmul outputs nobody else holds.

    mark_dirty tells autograd: anything that saved x for backward then fails loudly instead of using the sum.
    """

    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return all_reduce(x, group)
        ctx.mark_dirty(x)
        return all_reduce(x, group, inplace=True)

    @staticmethod
    def backward(ctx, grad):
        return grad, None

_ScatterToTP = _mapping("_ScatterToTP", split_last, gather_last)
_GatherFromTP = _mapping("_GatherFromTP", gather_last, split_last)
_ScatterToSP = _mapping("_ScatterToSP", split_first, gather_first)
_GatherFromSP = _mapping("_GatherFromSP", gather_first, reduce_scatter_first)
_GatherFromSPReplicatedGrad = _mapping("_GatherFromSPReplicatedGrad", gather_first, split_first)
_ReduceScatterToSP = _mapping("_ReduceScatterToSP", reduce_scatter_first, gather_first)


def _apply(mapping, x, group, *, replicated):
    """mapping(x) on groups of more than one rank (one rank: not even an autograd node). `replicated`: x must be
    equal on every rank (else only its shape), which debug mode checks."""
    group = resolve_group(group)
    if dist.get_world_size(group) == 1:
        return x
    if debug._enabled:
        debug.check(x, group, f"the input of {mapping.__name__.lstrip('_')}", replicated=replicated)
    return mapping.apply(x, group)


def copy_to_tp_region(x, group=None):
    """forward: identity · backward: all-reduce."""
    return _apply(_CopyToTP, x, group, replicated=True)


def reduce_from_tp_region(x, group=None):
    """forward: all-reduce · backward: identity."""
    return _apply(_ReduceFromTP, x, group, replicated=False)


def scatter_to_tp_region(x, group=None):
    """forward: split(last dim) · backward: all-gather(last dim)."""
    return _apply(_ScatterToTP, x, group, replicated=True)


def gather_from_tp_region(x, group=None):
    """forward: all-gather(last dim) · backward: split(last dim)."""
    return _apply(_GatherFromTP, x, group, replicated=False)


def scatter_to_sp_region(x, group=None):
    """forward: split(sequence dim 0) · backward: all-gather(sequence dim 0)."""
    return _apply(_ScatterToSP, x, group, replicated=True)


def gather_from_sp_region(x, group=None, *, tensor_parallel_output_grad=True):
    """forward: all-gather(sequence dim 0) · backward: reduce-scatter(sequence dim 0).

    With tensor_parallel_output_grad=False (the gathered tensor feeds computation replicated on every rank, e.g.
    a final norm or the loss, so its gradient is already complete on each): backward is split(sequence dim 0).
    """
    mapping = _GatherFromSP if tensor_parallel_output_grad else _GatherFromSPReplicatedGrad
    return _apply(mapping, x, group, replicated=False)


def reduce_scatter_to_sp_region(x, group=None):
    """forward: reduce-scatter(sequence dim 0) · backward: all-gather(sequence dim 0)."""
    return _apply(_ReduceScatterToSP, x, group, replicated=False)
