"""The collectives of token dispatch, as autograd Functions (each one's backward is its conjugate).

- all_to_all: `all_to_all_single` with uneven split sizes · backward: the same with the sizes swapped.
- gather_v / reduce_scatter_v: an all-gather (reduce-scatter) of dim-0 chunks whose sizes differ per rank, as a
  padded all_gather_into_tensor (reduce_scatter_tensor) of the largest chunk · backward: each other.
Sizes are host integers every rank knows (from the count exchange), so nothing else is communicated.
"""
import torch
import torch.distributed as dist

from ..collectives import all_gather_into_tensor, reduce_scatter_tensor


def _all_to_all(x, output_splits, input_splits, group):
    out = x.new_empty(sum(output_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group: dist.ProcessGroup | None) -> torch.Tensor:
    """Rows input_splits[j] of x (in order) go to rank j; rows output_splits[i] arrive from rank i."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def _gather_v(x, sizes, group):
    most = max(sizes)
    if most == 0:
        return x.new_empty(0, *x.shape[1:])
    padded = x.new_zeros(most, *x.shape[1:])
    padded[:x.shape[0]] = x
    out = x.new_empty(most * len(sizes), *x.shape[1:])
    all_gather_into_tensor(out, padded, group=group)
    return torch.cat([chunk[:n] for chunk, n in zip(out.split(most), sizes)])


def _reduce_scatter_v(x, sizes, group):
    most = max(sizes)
    if most == 0:
        return x.new_empty(0, *x.shape[1:])
    padded = x.new_zeros(most * len(sizes), *x.shape[1:])
    for chunk, piece in zip(padded.split(most), x.split(sizes)):
        chunk[:piece.shape[0]] = piece
    out = x.new_empty(most, *x.shape[1:])
    reduce_scatter_tensor(out, padded, group=group)
    return out[:sizes[dist.get_rank(group)]]


class _GatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather_v(x, sizes, group)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return _reduce_scatter_v(grad, ctx.sizes, ctx.group), None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_v(x, sizes, group)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return _gather_v(grad, ctx.sizes, ctx.group), None, None


def gather_v(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's x (sizes[r] rows on rank r) concatenated along dim 0 · backward: reduce-scatter."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherV.apply(x, list(sizes), group)


def reduce_scatter_v(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """x summed over the group, then rank r keeps its chunk (sizes[r] rows, in order) · backward: all-gather."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _ReduceScatterV.apply(x, list(sizes), group)
