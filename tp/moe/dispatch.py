"""Token dispatch over the expert-parallel group: tokens to the ranks holding their experts, and back.

Experts are numbered globally; ep rank j holds experts [j·E/ep, (j+1)·E/ep), split over its etp group (each etp rank
one slice of every local expert's FFN). Both dispatchers hand the experts their rows sorted by local expert (the
grouped GEMM's input) and combine each token's k outputs weighted by its routing weights.

- "alltoall" (Megatron's default): this rank's routed slots sorted by expert, the per-expert counts exchanged (one
  all-gather of E numbers over the etp·ep group: every rank then knows every split size), one all-to-all-v over ep
  each way; with etp > 1 the received rows are all-gathered over etp (and the partial outputs reduce-scattered back).
  Backward: the same two all-to-alls, the sizes reused.
- "allgather" (for small ep): every token, choice and weight of the etp·ep group all-gathered, each rank computing its
  experts' share of every token, one reduce-scatter back (it sums the ep ranks' experts and the etp partial sums).
  Needs the same number of tokens on every rank of the group.
"""
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..collectives import all_gather_into_tensor
from ..mappings import gather_from_sp_region, reduce_scatter_to_sp_region
from .comm import all_to_all, gather_v, reduce_scatter_v

DISPATCHERS = ("alltoall", "allgather")


def _size(group):
    return 1 if group is None else dist.get_world_size(group)


def _rank(group):
    return 0 if group is None else dist.get_rank(group)


class Plan:
    """Where this rank's routed slots go and come from (host integers, from the count exchange)."""

    def __init__(self, table: list[list[list[int]]], ep_rank: int, etp_rank: int, local_experts: int) -> None:
        # table[etp][ep][e]: how many slots the rank (etp, ep) routes to global expert e
        L, mine = local_experts, slice(ep_rank * local_experts, (ep_rank + 1) * local_experts)
        row = table[etp_rank][ep_rank]
        self.input_splits = [sum(row[j * L:(j + 1) * L]) for j in range(len(row) // L)]
        self.output_splits = [sum(table[etp_rank][i][mine]) for i in range(len(table[etp_rank]))]
        self.etp_sizes = [sum(sum(src[mine]) for src in per_etp) for per_etp in table]
        # the rows after the etp gather, chunk (etp r, source ep i, local expert e): their sizes, in that order
        self.chunks = [n for per_etp in table for src in per_etp for n in src[mine]]
        self.counts = [sum(per_etp[i][ep_rank * L + e] for per_etp in table for i in range(len(per_etp)))
                       for e in range(L)]  # rows per local expert, after sorting


def _exchange_counts(counts, group, etp_group, ep_group):
    """table[etp][ep][e] of every rank of the etp·ep group (one all-gather of E + 2 integers)."""
    coords = counts.new_tensor([_rank(etp_group), _rank(ep_group)])
    mine = torch.cat([counts, coords])
    size = _size(group)
    every = mine.new_empty(size * mine.numel())
    if size > 1:
        all_gather_into_tensor(every, mine, group=group)
    else:
        every = mine
    table = [[None] * _size(ep_group) for _ in range(_size(etp_group))]
    for row in every.view(size, -1).tolist():
        table[row[-2]][row[-1]] = row[:-2]
    return table


def _expert_major(plan, etp, ep, local_experts, device):
    """The permutation sorting the gathered rows (etp r, source i, expert e) by (e, r, i)."""
    sizes = torch.tensor(plan.chunks, device=device)
    r, i, e = torch.meshgrid(torch.arange(etp), torch.arange(ep), torch.arange(local_experts), indexing="ij")
    key = (e * etp * ep + r * ep + i).flatten().to(device)
    return torch.repeat_interleave(key, sizes, output_size=sum(plan.chunks)).argsort(stable=True)


def alltoall_dispatch(x: torch.Tensor, experts: torch.Tensor, local_experts: int, *,
                      ep_group: dist.ProcessGroup | None, etp_group: dist.ProcessGroup | None,
                      expert_group: dist.ProcessGroup | None) -> tuple[torch.Tensor, list[int], object]:
    """x [N, h]: this rank's routed slots, sorted by (global) expert `experts` [N] -> (the rows of this rank's
    experts sorted by local expert, rows per local expert, state for alltoall_combine)."""
    E = local_experts * _size(ep_group)
    table = _exchange_counts(torch.bincount(experts, minlength=E), expert_group, etp_group, ep_group)
    plan = Plan(table, _rank(ep_group), _rank(etp_group), local_experts)
    received = all_to_all(x, plan.output_splits, plan.input_splits, ep_group)  # [(source i, expert e), h]
    gathered = gather_v(received, plan.etp_sizes, etp_group)  # [(etp r, source i, expert e), h]
    order = None
    if _size(etp_group) * _size(ep_group) > 1 and local_experts > 1:
        order = _expert_major(plan, _size(etp_group), _size(ep_group), local_experts, x.device)
        gathered = gathered.index_select(0, order)
    return gathered, plan.counts, (plan, order)


def alltoall_combine(y: torch.Tensor, state: object, *, ep_group: dist.ProcessGroup | None,
                     etp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The experts' outputs (partial over etp), sorted by local expert, back to the ranks their slots came from."""
    plan, order = state
    if order is not None:
        y = y.new_zeros(y.shape).index_copy(0, order, y)  # the inverse permutation
    y = reduce_scatter_v(y, plan.etp_sizes, etp_group)
    return all_to_all(y, plan.input_splits, plan.output_splits, ep_group)


def allgather_dispatch(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, local_experts: int, *,
                       ep_rank: int, group: dist.ProcessGroup | None) -> tuple:
    """Every token of the group [G·T, h], then this rank's experts' slots -> (their rows sorted by local expert,
    rows per local expert, their weights, the token of each row)."""
    if _size(group) > 1:
        x = gather_from_sp_region(x, group)  # backward: reduce-scatter
        weights = gather_from_sp_region(weights, group)
        every = indices.new_empty(_size(group) * indices.shape[0], indices.shape[1])
        all_gather_into_tensor(every, indices.contiguous(), group=group)
        indices = every
    first = ep_rank * local_experts
    local = indices - first
    slots = ((local >= 0) & (local < local_experts)).flatten().nonzero().squeeze(1)  # [N] slot = token·k + j
    experts = local.flatten()[slots]
    order = experts.argsort(stable=True)
    slots = slots[order]
    counts = torch.bincount(experts, minlength=local_experts).tolist()
    tokens = slots // indices.shape[1]
    return x.index_select(0, tokens), counts, weights.flatten()[slots], tokens, x.shape[0]


def allgather_combine(y: torch.Tensor, tokens: torch.Tensor, total: int,
                      group: dist.ProcessGroup | None) -> torch.Tensor:
    """Weighted rows [N, h] summed into their tokens [G·T, h], then the group's sum of this rank's tokens [T, h]."""
    out = y.new_zeros(total, y.shape[1]).index_add(0, tokens, y)
    return reduce_scatter_to_sp_region(out, group, check=False) if _size(group) > 1 else out


def dispatch_and_combine(tokens: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: Callable, *,
                         dispatcher: str = "alltoall", ep_group: dist.ProcessGroup | None,
                         etp_group: dist.ProcessGroup | None, expert_group: dist.ProcessGroup | None,
                         pad_to: int | None = None) -> torch.Tensor:
    """Σ_j weights[t, j] · expert_{indices[t, j]}(tokens[t]) for every token t of this rank (indices -1: a dropped
    slot), `experts(x sorted by local expert, rows per local expert, pad_to)` computing this ep rank's
    `local_experts` experts (a GroupedExperts or a bound method of one)."""
    local, topk = getattr(experts, "__self__", experts).local_experts, indices.shape[1]
    if dispatcher == "allgather":
        x, counts, w, rows, total = allgather_dispatch(tokens, weights, indices, local, ep_rank=_rank(ep_group),
                                                       group=expert_group)
        return allgather_combine(experts(x, counts, pad_to) * w[:, None], rows, total, expert_group)
    slots = (indices >= 0).flatten().nonzero().squeeze(1)  # kept slots, token·k + j
    chosen = indices.flatten()[slots]
    order = chosen.argsort(stable=True)
    slots, chosen = slots[order], chosen[order]
    x, counts, state = alltoall_dispatch(tokens.index_select(0, slots // topk), chosen, local, ep_group=ep_group,
                                         etp_group=etp_group, expert_group=expert_group)
    y = alltoall_combine(experts(x, counts, pad_to), state, ep_group=ep_group, etp_group=etp_group)
    y = y * weights.flatten()[slots][:, None]  # [slots, h], this rank's slots in their sorted order
    return tokens.new_zeros(tokens.shape).index_add(0, slots // topk, y)
