"""The load-balanced ("head-tail") layout of a sequence over a cp group, and moving tensors in and out of it.

The sequence is cut into 2·cp equal chunks of c = s/(2·cp) tokens and rank r holds chunks r and 2cp−1−r, concatenated
(Megatron's get_batch_on_this_cp_rank, torch's _HeadTailLoadBalancer): its n = s/cp tokens are in increasing position
order, and under a causal mask every rank does the same work. The ranks a0..a0+a−1 of an aligned sub-group of a
ranks together hold two contiguous runs of a·c tokens, the head-tail share of sub-group a0/a in a layout of cp/a
ranks: the a2a+ring mode relies on it.
"""
import torch
import torch.distributed as dist

from ..collectives import gather_first
from ..mesh import resolve_cp_group


def cp_group_and_size(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int]:
    """(the cp group: `group`, else the current mesh's, else None without a mesh; its size, 1 for None)."""
    group = resolve_cp_group(group)
    return group, 1 if group is None else dist.get_world_size(group)


def check_dim(x: torch.Tensor, dim: int, what: str) -> int:
    """dim as a non-negative index of x's dims, or one line naming it."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{what}: dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def check_chunks(size: int, cp: int, what: str) -> None:
    if size % (2 * cp):
        raise ValueError(f"{what} of size {size} is not divisible by 2·cp = {2 * cp} (cp = {cp})")


def sequence_order(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """[cp, ..., n, ...] every rank's share (n at `dim` of a share) -> [..., cp·n, ...] in sequence order."""
    halves = parts.unflatten(dim + 1, (2, -1))  # [cp, ..., 2, c, ...]
    chunks = torch.cat([halves.select(dim + 1, 0), halves.select(dim + 1, 1).flip(0)])  # chunk t at index t
    return chunks.movedim(0, dim).flatten(dim, dim + 1)


def rank_order(full: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """The inverse of sequence_order: [..., s, ...] -> [cp, ..., s/cp, ...], rank r's share at index r."""
    chunks = full.unflatten(dim, (2 * cp, -1)).movedim(dim, 0)  # [2cp, ..., c, ...]
    return torch.stack([chunks[:cp], chunks[cp:].flip(0)], dim + 1).flatten(dim + 1, dim + 2)


def own_share(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """Chunks rank and 2cp−1−rank of x along `dim` (no communication)."""
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def cp_shard(x: torch.Tensor, dim: int, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's share of the full x along `dim`: chunks r and 2cp−1−r (no communication).

    Autograd: the gradient lands in this rank's slots of x, zeros elsewhere, so a replicated x (the full tokens'
    embeddings on every cp rank) gets a partial gradient per rank that sums over the cp group to the full one (the
    dp×cp gradient reduction does that sum for parameters).
    """
    check_dim(x, dim, "cp_shard")
    group, cp = cp_group_and_size(group)
    if cp == 1:
        return x
    check_chunks(x.shape[dim], cp, f"cp_shard: dim {dim}")
    return own_share(x, dim, cp, dist.get_rank(group))


class _CPUnshard(torch.autograd.Function):
    """forward: all-gather, reorder into the sequence · backward: keep this rank's slots of the gradient."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        cp = dist.get_world_size(group)
        parts = gather_first(x.movedim(dim, 0), group).unflatten(0, (cp, -1))  # [cp, n, ...]
        return sequence_order(parts, 0).movedim(0, dim)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        group = ctx.group
        return own_share(grad, ctx.dim, dist.get_world_size(group), dist.get_rank(group)), None, None


def cp_unshard(x: torch.Tensor, dim: int, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The full tensor from every rank's share along `dim` (one all-gather). Backward keeps this rank's slots of
    the gradient (no reduction): the consumer (the loss on full logits) is computed identically on every cp rank."""
    check_dim(x, dim, "cp_unshard")
    group, cp = cp_group_and_size(group)
    if cp == 1:
        return x
    if x.shape[dim] % 2:
        raise ValueError(f"cp_unshard: dim {dim} of size {x.shape[dim]} is odd; a share is 2 chunks (cp = {cp})")
    return _CPUnshard.apply(x, dim % x.dim(), group)


def cp_positions(seq_len: int, *, group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (LongTensor [seq_len/cp]) this rank holds, in its local order (for RoPE, learned
    position embeddings)."""
    group, cp = cp_group_and_size(group)
    positions = torch.arange(seq_len, device=device)
    if cp == 1:
        return positions
    check_chunks(seq_len, cp, "cp_positions: seq_len")
    return own_share(positions, 0, cp, dist.get_rank(group))
