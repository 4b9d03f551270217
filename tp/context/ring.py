"""Ring attention (Liu et al. 2023) over the load-balanced layout: K and V travel once around a ring of ranks
(batch_isend_irecv), the next step's transfer started before this step's attention; block outputs merged by their
log-sum-exp. Causal blocks are halved: KV from an earlier rank, every local query vs that rank's first chunk; from a
later rank, the local second chunk vs all of it; step 0, each local chunk causal on the local keys up to its end.
Backward rings K and V again, recomputes each block's probabilities from the saved lse (flash-style), and dK/dV ride
along in the accumulation dtype, collecting every rank's contribution, then take one last hop home: forward cp−1
messages of [2, b, kv_heads, n, d] per rank, backward cp−1 of them plus cp of dK/dV. Saved: the local q, K, V, output,
lse.

Documents: every rank holds the document ids of the whole sequence (as it holds the tokens), so each K/V block's ids
are known where it arrives, without sending them; blocks that documents hide entirely are skipped, the others cut
to the rows and columns that hold a visible pair (blocks.trim_blocks). Attention dropout: each block draws its
(query, key) tile's mask from the global positions on both sides (blocks.block_dropout), forward and backward.
"""
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from kernels.first_order import first_order

from ..collectives import batch_isend_irecv
from ..dropout import CounterDropout
from .blocks import Block, Side, acc_dtype, attend, attend_backward, grouped, side_of, trim_blocks


class Ring(NamedTuple):
    """A ring over ranks of `group`: `members` (group ranks, in ring order), this rank at `index` of them."""

    group: dist.ProcessGroup
    members: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.members)

    def send(self, tensor: torch.Tensor) -> tuple:
        """Start sending `tensor` to the next member and receiving the previous one's: (recv, works, tensor)."""
        peer = lambda step: dist.get_global_rank(self.group, self.members[(self.index + step) % self.size])
        recv = torch.empty_like(tensor)
        works = batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer(1), self.group),
                                   dist.P2POp(dist.irecv, recv, peer(-1), self.group)])
        return recv, works, tensor  # the send buffer is kept alive until the wait


def whole_ring(group: dist.ProcessGroup) -> Ring:
    """The ring of every rank of `group`, in rank order."""
    return Ring(group, tuple(range(dist.get_world_size(group))), dist.get_rank(group))


def wait(transfer: tuple) -> torch.Tensor:
    recv, works, _ = transfer
    for work in works:
        work.wait()
    return recv


def ring_steps(rank: int, cp: int, n: int, causal: bool):
    """The blocks of each ring step of `rank`, which then holds the KV of rank (rank − step) mod cp. Causal: every
    step computes the same c·n query x key products (c = n/2)."""
    whole, first, second = slice(None), slice(0, n // 2), slice(n // 2, None)
    for step in range(cp):
        source = (rank - step) % cp
        if not causal:
            yield [(whole, whole, False)]
        elif step == 0:  # our own chunks: each causal on itself, the second sees all of the first
            yield [(first, first, True), (second, whole, True)]
        elif source < rank:  # its chunks: one before both of ours, one after both
            yield [(whole, first, False)]
        else:  # both of its chunks lie between our two
            yield [(second, whole, False)]


def ring_plan(ring: Ring, n: int, causal: bool, documents: torch.Tensor | None,
              device: torch.device) -> tuple[Side, list[tuple[Side, list[Block]]]]:
    """(the local queries' Side, per step: (the keys' Side, the blocks to compute))."""
    s = ring.size * n
    q_side = side_of(ring.index, ring.size, s, documents, device)
    steps = [(side_of((ring.index - step) % ring.size, ring.size, s, documents, device), blocks)
             for step, blocks in enumerate(ring_steps(ring.index, ring.size, n, causal))]
    return q_side, [(k_side, blocks) for (k_side, _), blocks in zip(steps, trim_blocks(q_side, steps))]


def _forward(q, k, v, causal, scale, ring, documents, dropout):
    """(out [b, heads, n, d], lse [b, kv_heads, g, n], the plan) of this rank's queries over the ring's keys."""
    q_side, steps = ring_plan(ring, q.shape[2], causal, documents, q.device)
    qg = grouped(q, k.shape[1])
    kv = torch.stack([k, v])  # [2, b, kv_heads, n, d]: one message per step
    out, lse = torch.zeros_like(qg), qg.new_full(qg.shape[:-1], -math.inf)
    for step, (k_side, blocks) in enumerate(steps):
        incoming = ring.send(kv) if step < ring.size - 1 else None  # overlaps this step's attention
        for block in blocks:
            attend(out, lse, qg, kv, block, (q_side, k_side), scale, dropout)
        kv = wait(incoming) if incoming else kv
    return out.flatten(1, 2).to(q.dtype), lse, (q_side, steps)


def _backward(dout, q, k, v, out, lse, scale, ring, plan, dropout):
    """(dq, dk, dv): K and V around the ring again, dK/dV riding along to their owner."""
    kv_heads, (q_side, steps) = k.shape[1], plan
    qg, dout = grouped(q, kv_heads), grouped(dout, kv_heads)
    delta = (dout * grouped(out, kv_heads)).sum(-1)
    kv, dq, dkv_transfer = torch.stack([k, v]), torch.zeros_like(qg), None
    for step, (k_side, blocks) in enumerate(steps):
        incoming = ring.send(kv) if step < ring.size - 1 else None
        # dK/dV of the KV we hold, carrying the contributions of the ranks it visited before us
        dkv = wait(dkv_transfer) if dkv_transfer else kv.new_zeros(kv.shape, dtype=qg.dtype)
        for block in blocks:
            attend_backward(dq, dkv, qg, kv, dout, lse, delta, block, (q_side, k_side), scale, dropout)
        dkv_transfer = ring.send(dkv)  # to its next holder; after the last step, to its owner
        kv = wait(incoming) if incoming else kv
    dkv = wait(dkv_transfer)
    return dq.flatten(1, 2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """forward: KV around the ring, blocks merged by lse · backward: KV around again, dK/dV accumulated on the way.
    apply(q, k, v, causal, scale, ring, documents, dropout) on [b, heads, n, d] shares; documents [b, ring.size·n]
    or None; dropout a tp.dropout.CounterDropout or None."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, ring, documents, dropout):
        out, lse, plan = _forward(q, k, v, causal, scale, ring, documents, dropout)
        ctx.scale, ctx.ring, ctx.plan, ctx.dropout = scale, ring, plan, dropout
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @first_order
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return *_backward(dout, q, k, v, out, lse, ctx.scale, ctx.ring, ctx.plan, ctx.dropout), *[None] * 5


# Under torch.compile the same forward and backward run as custom ops (Dynamo cannot trace point-to-point
# communication): the ring travels as its group's name, members and place, dropout as its fields.
def _ring_of(group, members, index):
    return Ring(dist.distributed_c10d._resolve_process_group(group), tuple(members), index)


def _dropout_of(p, seed, module, samples, first_head):
    return None if samples is None else CounterDropout(p, seed, module, samples, first_head)


@torch.library.custom_op("tp_context::ring_attention", mutates_args=())
def _ring_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, group: str,
             members: list[int], index: int, documents: torch.Tensor | None, p: float, seed: int, module: int,
             samples: torch.Tensor | None, first_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, _ = _forward(q, k, v, causal, scale, _ring_of(group, members, index), documents,
                           _dropout_of(p, seed, module, samples, first_head))
    return out.contiguous(), lse  # (out has q's strides: the fake's are contiguous)


@torch.library.custom_op("tp_context::ring_attention_backward", mutates_args=())
def _ring_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, causal: bool, scale: float, group: str, members: list[int], index: int,
                      documents: torch.Tensor | None, p: float, seed: int, module: int,
                      samples: torch.Tensor | None,
                      first_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ring = _ring_of(group, members, index)
    plan = ring_plan(ring, q.shape[2], causal, documents, q.device)
    grads = _backward(dout, q, k, v, out, lse, scale, ring, plan, _dropout_of(p, seed, module, samples, first_head))
    # (contiguous, as the fake's; copies: an op's outputs may not alias each other, and dk, dv are views of one)
    return tuple(g.clone(memory_format=torch.contiguous_format) for g in grads)


@_ring_op.register_fake
def _(q, k, v, *args):
    kv_heads = k.shape[1]
    lse = q.new_empty(q.shape[0], kv_heads, q.shape[1] // kv_heads, q.shape[2], dtype=acc_dtype(q.dtype))
    return q.new_empty(q.shape), lse


@_ring_backward_op.register_fake
def _(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, output):
    q, k, v, causal, scale, group, members, index, documents, p, seed, module, samples, first_head = inputs
    ctx.save_for_backward(q, k, v, *output, documents, samples)
    ctx.options = causal, scale, group, members, index, p, seed, module, first_head


def _ring_op_backward(ctx, dout, _):
    q, k, v, out, lse, documents, samples = ctx.saved_tensors
    causal, scale, group, members, index, p, seed, module, first_head = ctx.options
    grads = _ring_backward_op(dout, q, k, v, out, lse, causal, scale, group, members, index, documents, p, seed,
                              module, samples, first_head)
    return *grads, *[None] * 11


_ring_op.register_autograd(_ring_op_backward, setup_context=_save)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, ring: Ring,
                   documents: torch.Tensor | None, dropout: "CounterDropout | None") -> torch.Tensor:
    """Ring attention of [b, heads, n, d] shares (RingAttention's arguments): the autograd Function eagerly, its
    custom ops under torch.compile."""
    if not torch.compiler.is_compiling():
        return RingAttention.apply(q, k, v, causal, scale, ring, documents, dropout)
    drop = (0.0, 0, 0, None, 0) if dropout is None else tuple(dropout)
    out, _ = _ring_op(q, k, v, causal, scale, ring.group.group_name, list(ring.members), ring.index, documents,
                      *drop)
    return out
