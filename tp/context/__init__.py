"""Context parallelism (cp): the sequence split across a cp group, and attention over the whole sequence.

Every tensor holds this rank's share of the sequence in the load-balanced layout (layout.py: chunks r and 2cp−1−r of
2·cp), and `context_parallel_attention` computes what dense causal attention on the full tensors computes, in one of
four modes:

  ring       ring.py: K and V passed around the group, overlapped with the blocks' attention (Liu et al. 2023).
  allgather  allgather.py: K and V gathered once, dK/dV reduce-scattered (Llama 3's).
  a2a        ulysses.py: DeepSpeed-Ulysses: all-to-alls trade the sequence split for a head split, attention local.
  a2a+ring   ulysses.py: a2a inside sub-groups of `a2a_size` ranks, ring across them (Megatron's a2a+p2p).

Documents (a packed window): `document_ids` [b, s] of the whole sequence, replicated on every rank of the group as
the tokens are, keeps attention inside each document (block-diagonal causal); the ring and all-gather modes skip the
blocks documents hide entirely (blocks.py).

Attention dropout (`dropout`, a tp.dropout.CounterDropout): every mode applies the mask of the serial run, each
(query, key) block drawing its tile's bits from the tokens' global positions and the heads' global indices, forward
and backward (no mask saved, none of the whole sequence materialised). `local_attention` is the same on one rank.
"""
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .allgather import AllGatherAttention, local_attention
from .blocks import document_attention_mask
from .layout import cp_group_and_size, cp_positions, cp_shard, cp_unshard
from .ring import ring_attention, whole_ring
from .ulysses import ulysses_attention

if TYPE_CHECKING:
    from ..dropout import CounterDropout

__all__ = ["MODES", "Mode", "context_parallel_attention", "cp_positions", "cp_shard", "cp_unshard",
           "document_attention_mask", "heads_split", "local_attention"]


@dataclass(frozen=True)
class Mode:
    """One way to attend over the cp group: its implementation, and whether (and over which ranks) it trades the
    sequence split for a head split."""

    # (q, k, v, causal, scale, group, heads_split or None, document_ids, dropout) -> this rank's output, cp > 1
    attention: Callable
    splits_heads: bool = False  # all-to-alls hand each rank a share of the heads
    sub_groups: bool = False  # ... within sub-groups of `a2a_size` ranks (else the whole group)


def _ring(q, k, v, causal, scale, group, split, document_ids, dropout):
    return ring_attention(q, k, v, causal, scale, whole_ring(group), document_ids, dropout)


def _allgather(q, k, v, causal, scale, group, split, document_ids, dropout):
    return AllGatherAttention.apply(q, k, v, causal, scale, group, document_ids, dropout)


# mode -> its implementation: the one list of modes (GPTConfig's cp_mode, the job's --cp-mode, bench.attention)
MODES = {"ring": Mode(_ring), "allgather": Mode(_allgather), "a2a": Mode(ulysses_attention, splits_heads=True),
         "a2a+ring": Mode(ulysses_attention, splits_heads=True, sub_groups=True)}


def heads_split(mode: str, cp: int, a2a_size: int | None = None) -> int | None:
    """The ranks `mode` splits each rank's heads over on a cp group of `cp` (None: it keeps them whole)."""
    if not MODES[mode].splits_heads:
        return None
    return a2a_size if MODES[mode].sub_groups else cp


def _check_shapes(q, k, v, cp, where):
    if not q.dim() == k.dim() == v.dim() == 4:
        raise ValueError(f"{where}: q, k, v must be [b, heads, s/cp, d], got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{where}: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    for i, what in ((0, "batch"), (2, "local sequence length"), (3, "head dim")):
        if q.shape[i] != k.shape[i]:
            raise ValueError(f"{where}: q's {what} {q.shape[i]} != k/v's {k.shape[i]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{where}: heads={q.shape[1]} is not a multiple of kv_heads={k.shape[1]}")
    if cp > 1 and q.shape[2] % 2:
        raise ValueError(f"{where}: the local sequence length {q.shape[2]} is odd, but a rank of a cp group of {cp} "
                         f"holds 2 chunks of s/(2·cp) tokens")


def _check_a2a(heads, kv_heads, mode, a2a_size, cp, where):
    """The heads split over heads_split(mode, cp, a2a_size) ranks (and a2a_size given exactly where it is used)."""
    if not MODES[mode].sub_groups and a2a_size is not None:
        users = " or ".join(repr(name) for name, m in MODES.items() if m.sub_groups)
        raise ValueError(f"{where}: a2a_size={a2a_size} is for mode {users}, not {mode!r}")
    if MODES[mode].sub_groups and (isinstance(a2a_size, bool) or not isinstance(a2a_size, int) or a2a_size < 1
                                   or cp % a2a_size):
        raise ValueError(f"{where}: mode {mode!r} needs a2a_size, a divisor of cp = {cp}; got {a2a_size!r}")
    size = heads_split(mode, cp, a2a_size)
    if size is None or cp == 1:
        return
    if heads % size:
        raise ValueError(f"{where}: mode {mode!r} splits the heads over {size} ranks: heads={heads} is not "
                         f"divisible by {size}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"{where}: mode {mode!r} splits the heads over {size} ranks: kv_heads={kv_heads} neither "
                         f"divides nor is divisible by {size}")


def _check_documents(document_ids, q, cp, where):
    if document_ids is None:
        return
    expected = (q.shape[0], cp * q.shape[2])
    if tuple(document_ids.shape) != expected:
        raise ValueError(f"{where}: document_ids must be [b, s] = {list(expected)} (the whole sequence, on every "
                         f"rank), got {tuple(document_ids.shape)}")
    if document_ids.dtype.is_floating_point or document_ids.dtype.is_complex or document_ids.dtype == torch.bool:
        raise ValueError(f"{where}: document_ids must be integers, got {document_ids.dtype}")


def _check_dropout(dropout, q, where):
    if dropout is None:
        return
    samples = dropout.samples
    if samples.dim() != 1 or len(samples) != q.shape[0] or samples.dtype.is_floating_point or samples.dtype.is_complex:
        raise ValueError(f"{where}: dropout.samples must be integers [b] = [{q.shape[0]}], got {samples.dtype} "
                         f"{tuple(samples.shape)}")
    if not 0.0 <= dropout.p < 1.0:
        raise ValueError(f"{where}: dropout.p={dropout.p} must be in [0, 1)")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                               mode: str = "ring", group: dist.ProcessGroup | None = None,
                               scale: float | None = None, document_ids: torch.Tensor | None = None,
                               a2a_size: int | None = None, dropout: "CounterDropout | None" = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence of the cp group, everything in the load-balanced
    layout: q [b, heads, s/cp, d], k and v [b, kv_heads, s/cp, d] (heads a multiple of kv_heads) -> [b, heads,
    s/cp, d], equal to F.scaled_dot_product_attention(is_causal=causal, enable_gqa=...) on the full tensors.

    mode: "ring" (p2p, overlapped), "allgather" (one all-gather forward, one reduce-scatter backward), "a2a"
    (Ulysses: 4 all-to-alls forward, 4 backward; heads divisible by cp), "a2a+ring" (a2a inside sub-groups of
    `a2a_size` consecutive ranks, ring across them); group: the cp group (default: the current mesh's); scale:
    default 1/sqrt(d); document_ids: [b, s] ints of the whole sequence in sequence order, the same on every rank
    (equal ids: one document): attention stays inside each document; dropout: attention dropout's masks
    (tp.dropout.CounterDropout, its first_head this rank's first head; None: none). One rank: SDPA itself (with
    dropout: local_attention).
    """
    (group, cp), where = cp_group_and_size(group), "context_parallel_attention"
    if mode not in MODES:  # every rank sees the same shapes and options: every rank raises, before any communication
        raise ValueError(f"{where}: unknown mode {mode!r}; expected one of {tuple(MODES)}")
    _check_shapes(q, k, v, cp, where)
    _check_a2a(q.shape[1], k.shape[1], mode, a2a_size, cp, where)
    _check_documents(document_ids, q, cp, where)
    _check_dropout(dropout, q, where)
    if cp == 1:
        return local_attention(q, k, v, causal, scale, document_ids, dropout)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return MODES[mode].attention(q, k, v, causal, scale, group, heads_split(mode, cp, a2a_size), document_ids,
                                 dropout)
