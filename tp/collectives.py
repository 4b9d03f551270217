"""Collective helpers: plain functions on tensors over a process group, no autograd.

tp.mappings wraps them into the conjugate autograd Functions; the layers' fused backward, context parallelism, the
vocab-parallel loss, the data-parallel buckets and the debug checks call them directly. Activations are [s, b, h]
(sequence first, Megatron's): the `*_first` helpers work on dim 0 (the sequence, contiguous memory), the `*_last`
ones on the last dim (the tensor-parallel features).
"""
import torch
import torch.distributed as dist
from einops import rearrange

# torch >= 2.13 renames the tensor collectives (*_single); older releases (e.g. 2.11) only have the old names.
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# (the output, the collective's handle) of an async_op call; the handle is None under torch.compile, where the call
# runs as a functional collective: the compiler waits on its result where it is first used, and schedules the overlap
Async = tuple[torch.Tensor, dist.Work | None]


def _async(async_op: bool) -> bool:
    """Whether to issue the c10d call with async_op: not while compiling (async_op=True breaks the graph; a plain
    c10d call is traced as a functional collective)."""
    return async_op and not torch.compiler.is_compiling()


def _funcol():
    """Functional collectives: what a c10d call under torch.compile traces to, called directly there (a new output
    tensor, no handle): torch 2.11 traced the in-place calls wrongly (zero gradients through a copy, a wait on a
    tensor)."""
    from torch.distributed import _functional_collectives

    return _functional_collectives


def _returned(out: torch.Tensor, async_op: bool) -> torch.Tensor | Async:
    return (out, None) if async_op else out


def wait(handle: dist.Work | None) -> None:
    """Wait for an async collective's handle (None: nothing to wait for, e.g. under torch.compile)."""
    if handle is not None:
        handle.wait()


def _check_divisible(size: int, parts: int, what: str) -> None:
    if size % parts:
        raise ValueError(f"cannot split {what} of size {size} evenly across {parts} tensor-parallel ranks")


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, *, inplace: bool = False,
               async_op: bool = False) -> torch.Tensor | Async:
    """Sum over the group. Reduces (and returns) a contiguous copy unless `inplace` and x is already contiguous."""
    if torch.compiler.is_compiling() and not inplace:
        return _returned(_funcol().all_reduce(x.contiguous(), "sum", group), async_op)
    out = x.contiguous()
    if out is x and not inplace:
        out = x.clone()
    handle = dist.all_reduce(out, group=group, async_op=_async(async_op))
    return (out, handle) if async_op else out


def split_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's chunk of the last dim."""
    parts = dist.get_world_size(group)
    _check_divisible(x.shape[-1], parts, "the last dim")
    return x.chunk(parts, dim=-1)[dist.get_rank(group)].clone(memory_format=torch.contiguous_format)  # never a view


def gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's x along the last dim."""
    parts = dist.get_world_size(group)
    if torch.compiler.is_compiling():
        out = _funcol().all_gather_tensor(x.contiguous(), 0, group)
    else:
        out = x.new_empty((parts * x.shape[0], *x.shape[1:]))
        all_gather_into_tensor(out, x.contiguous(), group=group)
    return rearrange(out.view(parts, *x.shape), "p ... h -> ... (p h)").contiguous()


def split_first(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's chunk of dim 0 (the sequence)."""
    parts = dist.get_world_size(group)
    _check_divisible(x.shape[0], parts, "the sequence dim (dim 0)")
    return x.chunk(parts, dim=0)[dist.get_rank(group)].clone()


def gather_first(x: torch.Tensor, group: dist.ProcessGroup, *,
                 async_op: bool = False) -> torch.Tensor | Async:
    """Concatenate every rank's x along dim 0."""
    if torch.compiler.is_compiling():
        return _returned(_funcol().all_gather_tensor(x.contiguous(), 0, group), async_op)
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    handle = all_gather_into_tensor(out, x.contiguous(), group=group, async_op=_async(async_op))
    return (out, handle) if async_op else out


def reduce_scatter_first(x: torch.Tensor, group: dist.ProcessGroup, *,
                         async_op: bool = False) -> torch.Tensor | Async:
    """Sum over the group, keep this rank's chunk of dim 0."""
    parts = dist.get_world_size(group)
    _check_divisible(x.shape[0], parts, "the sequence dim (dim 0)")
    if torch.compiler.is_compiling():
        return _returned(_funcol().reduce_scatter_tensor(x.contiguous(), "sum", 0, group), async_op)
    out = x.new_empty((x.shape[0] // parts, *x.shape[1:]))
    handle = reduce_scatter_tensor(out, x.contiguous(), group=group, async_op=_async(async_op))
    return (out, handle) if async_op else out


@torch.no_grad()
def all_reduce_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup, *,
                         average: bool = False, inplace: bool = True) -> list[torch.Tensor]:
    """Sum (or average) tensors over the group, one all-reduce per dtype: in place, or (inplace=False) returned as
    new tensors, the inputs untouched."""
    size = dist.get_world_size(group)
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    out = list(tensors)
    for same in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in same])
        dist.all_reduce(flat, group=group)
        if average:
            flat /= size
        for i, reduced in zip(same, flat.split([tensors[i].numel() for i in same])):
            out[i] = tensors[i].copy_(reduced.view_as(tensors[i])) if inplace else reduced.view_as(tensors[i])
    return out
