"""Ulysses attention (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509) and its hierarchical form.

a2a: one all-to-all per tensor turns this rank's tokens of every head, [b, heads, s/cp, d], into every token of
heads/cp heads, [b, heads/cp, s, d]; attention is then local (SDPA: causal, GQA, the document mask); one all-to-all
turns the output back. Forward 4 all-to-alls (q, k, v, out), backward the same 4 reversed, each moving the (cp−1)/cp
of its tensor that leaves the rank: per link the volume does not grow with cp, where the ring's does. The heads must
split over cp; kv heads fewer than cp are replicated (each rank then holds one), as DeepSpeed does.

a2a+ring (Megatron's hierarchical a2a+p2p): the all-to-alls run inside sub-groups of `a2a_size` consecutive cp ranks
(an NVLink domain), and ring attention (ring.py) runs across the cp/a2a_size sub-groups. A sub-group's ranks together
hold the head-tail share of a layout of cp/a2a_size ranks (layout.py), so after its all-to-all each rank holds that
share for heads/a2a_size heads: the ring's own layout, its causal halving and document skipping unchanged. The
sub-group all-to-all is one all_to_all_single on the cp group sending nothing outside the sub-group (no extra process
groups); the ring's p2p runs on the cp group too.
"""
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .allgather import local_attention
from .layout import rank_order, sequence_order
from .ring import Ring, ring_attention

if TYPE_CHECKING:
    from ..dropout import CounterDropout


def subgroups(group: dist.ProcessGroup, a2a_size: int) -> tuple[tuple[int, ...], Ring]:
    """(this rank's all-to-all sub-group: a2a_size consecutive group ranks, the ring across the sub-groups through
    the members at this rank's place in each)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    first = rank // a2a_size * a2a_size
    return tuple(range(first, first + a2a_size)), Ring(group, tuple(range(rank % a2a_size, cp, a2a_size)),
                                                       rank // a2a_size)


def _exchange(send, group, members):
    """[a, ...] part i to members[i] -> [a, ...] part i from members[i] (one all_to_all_single on `group`)."""
    recv = torch.empty_like(send)
    if len(members) == dist.get_world_size(group):
        dist.all_to_all_single(recv, send, group=group)
    else:
        splits = [int(g in members) for g in range(dist.get_world_size(group))]  # rows of dim 0 per group rank
        dist.all_to_all_single(recv, send, splits, splits, group=group)
    return recv


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup, members: tuple[int, ...]) -> torch.Tensor:
    """[b, heads, n, d] this rank's tokens -> [b, heads/a, a·n, d] the sub-group's tokens (in their head-tail
    order) of this rank's heads/a heads."""
    send = x.unflatten(1, (len(members), -1)).movedim(1, 0).contiguous()  # [a, b, h/a, n, d]: heads of member i
    return sequence_order(_exchange(send, group, members), 2)


def sequence_to_heads(y: torch.Tensor, group: dist.ProcessGroup, members: tuple[int, ...]) -> torch.Tensor:
    """The inverse of heads_to_sequence: [b, heads/a, a·n, d] -> [b, heads, n, d]."""
    send = rank_order(y, 2, len(members)).contiguous()  # [a, b, h/a, n, d]: tokens of member i
    return _exchange(send, group, members).movedim(0, 1).flatten(1, 2)


class _AllToAll(torch.autograd.Function):
    """heads_to_sequence (to_sequence) or sequence_to_heads forward; the other one backward."""

    @staticmethod
    def forward(ctx, x, to_sequence, group, members):
        ctx.to_sequence, ctx.group, ctx.members = to_sequence, group, members
        return (heads_to_sequence if to_sequence else sequence_to_heads)(x, group, members)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        inverse = sequence_to_heads if ctx.to_sequence else heads_to_sequence
        return inverse(grad, ctx.group, ctx.members), None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                      group: dist.ProcessGroup, a2a_size: int, documents: torch.Tensor | None,
                      dropout: "CounterDropout | None" = None) -> torch.Tensor:
    """Attention of [b, heads, n, d] shares over the whole sequence: all-to-all inside sub-groups of `a2a_size` cp
    ranks, then SDPA (a2a_size = cp) or ring attention across the sub-groups; documents [b, cp·n] or None; dropout:
    attention dropout's masks, this rank then holding the heads from its place in the sub-group on."""
    members, ring = subgroups(group, a2a_size)
    if dropout is not None:  # heads_to_sequence hands member i the i-th a2a_size-th of the heads
        dropout = dropout.heads_from(members.index(dist.get_rank(group)) * (q.shape[1] // a2a_size))
    if k.shape[1] < a2a_size:  # GQA: kv head j serves query heads j·g..; each rank gets one (replicated) kv head
        k, v = (t.repeat_interleave(a2a_size // k.shape[1], dim=1) for t in (k, v))
    q, k, v = (_AllToAll.apply(t, True, group, members) for t in (q, k, v))  # [b, heads/a, a·n, d]
    if ring.size == 1:
        out = local_attention(q, k, v, causal, scale, documents, dropout)
    else:
        out = ring_attention(q, k, v, causal, scale, ring, documents, dropout)
    return _AllToAll.apply(out, False, group, members)  # [b, heads, n, d]
