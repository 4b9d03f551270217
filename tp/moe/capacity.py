"""Capacity: at most C = ceil(T·k / E · capacity_factor) routed slots per expert, over the micro-batch's global tokens.

Policy (deterministic, independent of the split): each expert keeps its C slots of highest routing weight over all
the micro-batch's tokens, slots of equal weight in the order of their tokens' global index (`token_order`: sample,
then position in the sequence), so exactly C when more were routed; the others are dropped (the token keeps its
other experts; a token whose every slot is dropped passes through the layer as zero, plus the shared expert). The
decision is a function of the routing weights (and the tokens' places) alone: equal weights bit for bit at two
splits give equal decisions, and a weight one ulp off flips at most the slots it passes, not a whole run of ties.

The C-th slot is found without gathering the weights: a radix select on keys (the weight's fp32 bit pattern,
monotonic for non-negative floats, above the complement of the token's index), 8 bits per round, each round one
all-reduce of an [E, 256] histogram over the group that holds the micro-batch's tokens: 4 rounds for the weight and
one per byte of the token index (6 for up to 65,536 tokens).
"""
import math

import torch
import torch.distributed as dist

from ..context.layout import cp_positions
from .router import expert_counts

_BITS, _WEIGHT_ROUNDS = 8, 4  # 4 rounds of 8 bits: the fp32 weight


def capacity(tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(tokens·k / E · capacity_factor), tokens counted over the whole micro-batch."""
    return math.ceil(tokens * topk / num_experts * capacity_factor)


def _histogram(keys, experts, active, shift, num_experts):
    digits = (keys >> shift) & ((1 << _BITS) - 1)
    flat = torch.where(active, experts * (1 << _BITS) + digits, num_experts << _BITS)
    return expert_counts(flat, (num_experts + 1) << _BITS)[:num_experts << _BITS].view(num_experts, -1)


def token_order(rows: int, batch: int, *, sequence_parallel: bool, group: dist.ProcessGroup | None,
                cp_group: dist.ProcessGroup | None, first_sample: int = 0,
                device: torch.device | str | None = None) -> torch.Tensor:
    """Each token's global index among the micro-batch's tokens, (first_sample + b)·s + its position in the sequence,
    for an activation's rows [rows, b] flattened (rows = s/cp, or s/cp/tp under sequence parallelism: the cp rank's
    load-balanced share, the tp rank's slice of it): [rows·b] int64, the order keep_mask breaks ties in."""
    tp_size = dist.get_world_size(group) if sequence_parallel and group is not None else 1
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    seq = rows * tp_size * cp_size
    positions = torch.arange(seq, device=device) if cp_size == 1 else cp_positions(seq, group=cp_group, device=device)
    if tp_size > 1:
        positions = positions.chunk(tp_size)[dist.get_rank(group)]
    samples = first_sample + torch.arange(batch, device=device)
    return (samples[None, :] * seq + positions[:, None]).flatten()


def keep_mask(weights: torch.Tensor, indices: torch.Tensor, num_experts: int, capacity_factor: float,
              group: dist.ProcessGroup | None, *,
              order: torch.Tensor | None = None, max_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept [T, k] bool, C): the slots each expert keeps under the policy above, and the capacity (a 0-d int64
    tensor on the device: computed there, nothing is read on the host). `order` [T]: each token's index among the
    group's tokens (token_order; unique, below T x the group's size), which breaks ties; None: slots tied with the
    C-th are all kept (an expert may then exceed C). `max_rows`: the most rows a rank of the group holds, where
    they differ (default: this rank's), so that every rank packs the order into the same bits."""
    ranks = 1 if group is None else dist.get_world_size(group)
    reduce = ranks > 1
    tokens = torch.tensor([weights.shape[0]], dtype=torch.int64, device=weights.device)
    keys = weights.detach().float().contiguous().view(torch.int32).to(torch.int64)  # >= 0: order-preserving
    index_bits = 0
    if order is not None:  # below the weight: among equal weights the lower index is the larger key
        rows = weights.shape[0] if max_rows is None else max_rows
        index_bits = _round_up(max(1, (rows * ranks - 1).bit_length()), _BITS)
        keys = (keys << index_bits) | ((1 << index_bits) - 1 - order)[:, None]
    keys, experts = keys.flatten(), indices.flatten()
    rounds = _WEIGHT_ROUNDS + index_bits // _BITS
    prefix = torch.zeros(num_experts, dtype=torch.int64, device=weights.device)  # the C-th key's bits found so far
    need = None  # per expert: how many of the slots under the prefix must still be kept
    for r in range(rounds):
        shift = _BITS * (rounds - 1 - r)
        active = (keys >> (shift + _BITS)) == prefix[experts] if r else torch.ones_like(keys, dtype=torch.bool)
        hist = _histogram(keys, experts, active, shift, num_experts)  # [E, 256]
        if r == 0:
            hist = torch.cat([hist.flatten(), tokens])
        if reduce:
            dist.all_reduce(hist, group=group)
        if r == 0:
            hist, tokens = hist[:-1].view(num_experts, -1), hist[-1]
            # capacity()'s float arithmetic in fp64 on the device (the same IEEE operations: the same C)
            cap = (tokens.double() * indices.shape[-1] / num_experts * capacity_factor).ceil().long()
            need = cap.expand(num_experts)
            total = hist.sum(1)
        above = hist.flip(1).cumsum(1).flip(1)  # slots with this digit or a larger one
        digit = (above >= need[:, None]).sum(1).clamp(min=1) - 1  # the largest digit reaching `need`
        need = need - (above.gather(1, (digit + 1).clamp(max=(1 << _BITS) - 1)[:, None]).squeeze(1)
                       * (digit < (1 << _BITS) - 1))
        prefix = (prefix << _BITS) | digit
    threshold = torch.where(total > cap, prefix, torch.zeros_like(prefix))  # under capacity: keep every slot
    return keys.view_as(indices) >= threshold[indices], cap


def _round_up(n, multiple):
    return -(-n // multiple) * multiple
