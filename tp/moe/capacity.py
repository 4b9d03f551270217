"""Capacity: at most C = ceil(T·k / E · capacity_factor) routed slots per expert, over the micro-batch's global tokens.

Policy (deterministic, independent of the split): each expert keeps the slots with the highest routing weight, its
C-th largest weight over all the micro-batch's tokens being the threshold; slots below it are dropped (the token
keeps its other experts; a token whose every slot is dropped passes through the layer as zero, plus the shared
expert). Slots tied with the threshold are all kept, so an expert may exceed C by the ties (exact fp32 ties only).

The threshold is found without gathering the weights: a radix select on the weights' fp32 bit patterns (monotonic
for non-negative floats), 8 bits per round, each round one all-reduce of an [E, 256] histogram over the group that
holds the micro-batch's tokens (4 rounds: 4 small all-reduces per MoE layer with a capacity factor).
"""
import math

import torch
import torch.distributed as dist

from .router import expert_counts

_BITS, _ROUNDS = 8, 4


def capacity(tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(tokens·k / E · capacity_factor), tokens counted over the whole micro-batch."""
    return math.ceil(tokens * topk / num_experts * capacity_factor)


def _histogram(keys, experts, active, shift, num_experts):
    digits = (keys >> shift) & ((1 << _BITS) - 1)
    flat = torch.where(active, experts * (1 << _BITS) + digits, num_experts << _BITS)
    return expert_counts(flat, (num_experts + 1) << _BITS)[:num_experts << _BITS].view(num_experts, -1)


def keep_mask(weights: torch.Tensor, indices: torch.Tensor, num_experts: int, capacity_factor: float,
              group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept [T, k] bool, C): the slots each expert keeps under the policy above, and the capacity (a 0-d int64
    tensor on the device: computed there, nothing is read on the host)."""
    reduce = group is not None and dist.get_world_size(group) > 1
    tokens = torch.tensor([weights.shape[0]], dtype=torch.int64, device=weights.device)
    keys = weights.detach().float().contiguous().view(torch.int32).to(torch.int64).flatten()  # >= 0: order-preserving
    experts = indices.flatten()
    prefix = torch.zeros(num_experts, dtype=torch.int64, device=weights.device)  # the threshold's bits found so far
    need = None  # per expert: how many of the slots under the prefix must still be kept
    for r in range(_ROUNDS):
        shift = _BITS * (_ROUNDS - 1 - r)
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
