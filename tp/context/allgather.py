"""All-gather attention, Llama 3's context parallelism (Dubey et al. 2024): one all-gather of K and V (packed)
forward; each local chunk attends to the keys up to its own end ([c, ≤ s] scores); one reduce-scatter of dK/dV (in
the accumulation dtype) backward. Saves the gathered KV. With documents, each chunk's key range is cut to the
documents its queries belong to (blocks.trim_blocks).

On one rank (no group) the same Function is attention with dropout (`local_attention`): SDPA cannot take a mask
drawn from global coordinates, so the probabilities are materialised as SDPA's math path does, and backward
recomputes them (and the mask) from the saved lse."""
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kernels.first_order import first_order

from ..collectives import gather_first, reduce_scatter_first
from .blocks import attend, attend_backward, dense_attention, grouped, side_of, trim_blocks
from .layout import rank_order, sequence_order

if TYPE_CHECKING:
    from ..dropout import CounterDropout


def allgather_blocks(rank: int, cp: int, n: int, causal: bool):
    """(q rows, key range of the gathered sequence, causal): each local chunk vs the keys up to its own end."""
    if not causal or cp == 1:
        yield slice(None), slice(None), causal
        return
    c = n // 2
    yield slice(0, c), slice(0, (rank + 1) * c), True
    yield slice(c, n), slice(0, (2 * cp - rank) * c), True


def _plan(rank, cp, n, causal, documents, device):
    q_side, k_side = side_of(rank, cp, cp * n, documents, device), side_of(0, 1, cp * n, documents, device)
    return (q_side, k_side), trim_blocks(q_side, [(k_side, list(allgather_blocks(rank, cp, n, causal)))])[0]


class AllGatherAttention(torch.autograd.Function):
    """forward: all-gather K and V, local queries vs the sequence · backward: reduce-scatter dK/dV.
    apply(q, k, v, causal, scale, group, documents, dropout) on [b, heads, n, d] shares; group None: one rank;
    documents [b, cp·n] or None; dropout a tp.dropout.CounterDropout or None."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, documents, dropout):
        cp, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
        n = q.shape[2]
        kv = torch.stack([k, v])  # [2, b, kv_heads, n, d]
        if cp > 1:
            kv = sequence_order(gather_first(kv, group).unflatten(0, (cp, 2)), 3)  # [2, b, kv_heads, s, d]
        sides, blocks = _plan(rank, cp, n, causal, documents, q.device)
        qg = grouped(q, k.shape[1])
        out, lse = torch.zeros_like(qg), qg.new_full(qg.shape[:-1], -math.inf)
        for block in blocks:
            attend(out, lse, qg, kv, block, sides, scale, dropout)
        out = out.to(q.dtype).flatten(1, 2)  # a view last: torch 2.11's compile zeroes the grad of a `.to` no-op
        ctx.scale, ctx.group, ctx.dtypes, ctx.plan = scale, group, (k.dtype, v.dtype), (sides, blocks)
        ctx.dropout, ctx.cp = dropout, cp
        ctx.save_for_backward(q, kv, out, lse)
        return out

    @staticmethod
    @first_order
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        group, kv_heads, (sides, blocks) = ctx.group, kv.shape[2], ctx.plan
        qg, dout = grouped(q, kv_heads), grouped(dout, kv_heads)
        delta = (dout * grouped(out, kv_heads)).sum(-1)
        dq, dkv = torch.zeros_like(qg), kv.new_zeros(kv.shape, dtype=qg.dtype)  # dkv: [2, b, kv_heads, s, d]
        for block in blocks:
            attend_backward(dq, dkv, qg, kv, dout, lse, delta, block, sides, ctx.scale, ctx.dropout)
        if ctx.cp > 1:
            dkv = reduce_scatter_first(rank_order(dkv, 3, ctx.cp).flatten(0, 1), group)  # [2, b, kv_heads, n, d]
        return (dq.flatten(1, 2).to(q.dtype), dkv[0].to(ctx.dtypes[0]), dkv[1].to(ctx.dtypes[1]),
                None, None, None, None, None)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
                    documents: torch.Tensor | None, dropout: "CounterDropout | None") -> torch.Tensor:
    """Attention of [b, heads, s, d] over its own sequence (GQA, documents): SDPA, or with attention dropout the
    blocks with each (query, key) tile's counter-based mask."""
    if dropout is None:
        return dense_attention(q, k, v, causal, scale, documents)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return AllGatherAttention.apply(q, k, v, causal, scale, None, documents, dropout)
