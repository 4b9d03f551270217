"""All-gather attention, Llama 3's context parallelism (Dubey et al. 2024): one all-gather of K and V (packed)
forward; each local chunk attends to the keys up to its own end ([c, ≤ s] scores); one reduce-scatter of dK/dV (in
the accumulation dtype) backward. Saves the gathered KV. With documents, each chunk's key range is cut to the
documents its queries belong to (blocks.trim_blocks)."""
import math

import torch
import torch.distributed as dist

from ..collectives import gather_first, reduce_scatter_first
from .blocks import attend, attend_backward, grouped, side_of, trim_blocks
from .layout import rank_order, sequence_order


def allgather_blocks(rank: int, cp: int, n: int, causal: bool):
    """(q rows, key range of the gathered sequence, causal): each local chunk vs the keys up to its own end."""
    if not causal:
        yield slice(None), slice(None), False
        return
    c = n // 2
    yield slice(0, c), slice(0, (rank + 1) * c), True
    yield slice(c, n), slice(0, (2 * cp - rank) * c), True


def _plan(rank, cp, n, causal, documents, device):
    q_side, k_side = side_of(rank, cp, cp * n, documents, device), side_of(0, 1, cp * n, documents, device)
    return (q_side, k_side), trim_blocks(q_side, [(k_side, list(allgather_blocks(rank, cp, n, causal)))])[0]


class AllGatherAttention(torch.autograd.Function):
    """forward: all-gather K and V, local queries vs the sequence · backward: reduce-scatter dK/dV.
    apply(q, k, v, causal, scale, group, documents) on [b, heads, n, d] shares; documents [b, cp·n] or None."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, documents):
        cp, rank, n = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
        parts = gather_first(torch.stack([k, v]), group).unflatten(0, (cp, 2))  # [cp, 2, b, kv_heads, n, d]
        kv = sequence_order(parts, 3)  # [2, b, kv_heads, s, d]
        sides, blocks = _plan(rank, cp, n, causal, documents, q.device)
        qg = grouped(q, k.shape[1])
        out, lse = torch.zeros_like(qg), qg.new_full(qg.shape[:-1], -math.inf)
        for block in blocks:
            attend(out, lse, qg, kv, block, sides, scale)
        out = out.flatten(1, 2).to(q.dtype)
        ctx.scale, ctx.group, ctx.dtypes, ctx.plan = scale, group, (k.dtype, v.dtype), (sides, blocks)
        ctx.save_for_backward(q, kv, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        group, kv_heads, (sides, blocks) = ctx.group, kv.shape[2], ctx.plan
        qg, dout = grouped(q, kv_heads), grouped(dout, kv_heads)
        delta = (dout * grouped(out, kv_heads)).sum(-1)
        dq, dkv = torch.zeros_like(qg), kv.new_zeros(kv.shape, dtype=qg.dtype)  # dkv: [2, b, kv_heads, s, d]
        for block in blocks:
            attend_backward(dq, dkv, qg, kv, dout, lse, delta, block, sides, ctx.scale)
        cp = dist.get_world_size(group)
        dkv = reduce_scatter_first(rank_order(dkv, 3, cp).flatten(0, 1), group)  # [2, b, kv_heads, n, d]
        return dq.flatten(1, 2).to(q.dtype), dkv[0].to(ctx.dtypes[0]), dkv[1].to(ctx.dtypes[1]), None, None, None, None
