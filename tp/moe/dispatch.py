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
from ..host_syncs import to_host
from ..mappings import gather_from_sp_region, reduce_scatter_to_sp_region
from .comm import combine, dispatch, group_name
from .router import expert_counts


def pad_rows(t: torch.Tensor, rows: int, value: float = 0) -> torch.Tensor:
    """t [n, ...] with rows of `value` appended up to `rows` (t itself when it has them): padding a rank's tokens
    to its peers' count, the padding routed nowhere (indices -1)."""
    return t if t.shape[0] == rows else torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])


def _size(group):
    return 1 if group is None else dist.get_world_size(group)


def _rank(group):
    return 0 if group is None else dist.get_rank(group)


def count_table(counts: torch.Tensor, group: dist.ProcessGroup | None, etp_group: dist.ProcessGroup | None,
                ep_group: dist.ProcessGroup | None) -> torch.Tensor:
    """table [etp, ep, E] (CPU int64): every etp·ep rank's slots per global expert, from this rank's `counts` [E]
    (one all-gather of E + 2 integers, each rank's with its coordinates; then the one copy to the host)."""
    mine = torch.cat([counts, counts.new_tensor([_rank(etp_group), _rank(ep_group)])])
    size = _size(group)
    every = mine
    if size > 1:
        every = mine.new_empty(size * mine.numel())
        all_gather_into_tensor(every, mine, group=group)
    every = to_host(every.view(size, -1))  # (the one host sync: the all-to-all's split sizes)
    table = every.new_zeros(_size(etp_group), _size(ep_group), counts.shape[0])
    return table.index_put_((every[:, -2], every[:, -1]), every[:, :-2])


def alltoall_dispatch(x: torch.Tensor, counts: torch.Tensor, local_experts: int, *,
                      ep_group: dist.ProcessGroup | None, etp_group: dist.ProcessGroup | None,
                      expert_group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """x [n, h]: this rank's routed slots sorted by global expert, counts [E] of them per expert (the first Σ counts
    rows are sent) -> (the rows of this rank's experts sorted by local expert [m, h], rows per local expert [L] (CPU),
    state for alltoall_combine)."""
    table = count_table(counts, expert_group, etp_group, ep_group)
    first = _rank(ep_group) * local_experts
    local = table[:, :, first:first + local_experts].sum((0, 1))
    groups = (group_name(ep_group), group_name(etp_group))
    return dispatch(x, table, *groups), local, (table, groups, x.shape[0])


def alltoall_combine(y: torch.Tensor, state: tuple) -> torch.Tensor:
    """The experts' outputs (partial over etp), sorted by local expert, back to the ranks their slots came from:
    [n, h] in alltoall_dispatch's order, zero rows for the slots it did not send."""
    table, groups, rows = state
    return combine(y, table, *groups, rows)


def _local_slots(indices: torch.Tensor, first: int, local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = indices.flatten() - first
    slots = ((local >= 0) & (local < local_experts)).nonzero().squeeze(1)
    experts = local[slots]
    return slots[experts.argsort(stable=True)], expert_counts(experts, local_experts)


_local_slots_op = torch.library.custom_op("tp_moe::local_slots", _local_slots, mutates_args=())


@_local_slots_op.register_fake
def _(indices, first, local_experts):
    n = torch.library.get_ctx().new_dynamic_size()
    return indices.new_empty(n), indices.new_empty(local_experts)


def local_slots(indices: torch.Tensor, first: int, local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [T, k] (global experts, -1: dropped) -> (the slots t·k + j choosing experts [first, first +
    local_experts), sorted by expert (stable) [N]; slots per expert [local_experts]). Under torch.compile a custom
    op: N is a data-dependent size."""
    return (_local_slots_op if torch.compiler.is_compiling() else _local_slots)(indices, first, local_experts)


def allgather_dispatch(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, local_experts: int, *,
                       ep_rank: int, group: dist.ProcessGroup | None) -> tuple:
    """Every token of the group [G·T, h], then this rank's experts' slots -> (their rows sorted by local expert,
    rows per local expert [L], their weights, the token of each row, G·T)."""
    if _size(group) > 1:
        x = gather_from_sp_region(x, group)  # backward: reduce-scatter
        weights = gather_from_sp_region(weights, group)
        every = indices.new_empty(_size(group) * indices.shape[0], indices.shape[1])
        all_gather_into_tensor(every, indices.contiguous(), group=group)
        indices = every
    slots, counts = local_slots(indices, ep_rank * local_experts, local_experts)
    tokens = slots // indices.shape[1]
    return x.index_select(0, tokens), counts, weights.flatten()[slots], tokens, x.shape[0]


def allgather_combine(y: torch.Tensor, tokens: torch.Tensor, total: int,
                      group: dist.ProcessGroup | None) -> torch.Tensor:
    """Weighted rows [N, h] summed into their tokens [G·T, h], then the group's sum of this rank's tokens [T, h]."""
    out = y.new_zeros(total, y.shape[1]).index_add(0, tokens, y)
    return reduce_scatter_to_sp_region(out, group, check=False) if _size(group) > 1 else out


class TokenDispatcher:
    """How the routed slots reach the ranks holding their experts and come back (Megatron-Core's
    MoETokenDispatcher): `dispatch` hands this rank's experts their rows sorted by local expert, `combine` returns
    each token the weighted sum of its k slots' outputs. A subclass and its line in DISPATCHERS add one."""

    def dispatch(self, tokens: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, local_experts: int, *,
                 ep_group: dist.ProcessGroup | None, etp_group: dist.ProcessGroup | None,
                 expert_group: dist.ProcessGroup | None, dropping: bool) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """(rows for this rank's experts sorted by local expert, rows per local expert, state for `combine`)."""
        raise NotImplementedError

    def combine(self, y: torch.Tensor, state: tuple) -> torch.Tensor:
        """The experts' outputs `y` (dispatch's rows) back into this rank's tokens [T, h], weighted."""
        raise NotImplementedError

    def sent_bytes(self, ep: int, hidden: int, topk: int, element_size: int) -> float:
        """Bytes per token one forward and backward send off a rank at etp = 1 (uniform routing)."""
        raise NotImplementedError


class AllToAllDispatcher(TokenDispatcher):
    """Slots sorted by expert, one all-to-all-v over ep each way (module docstring)."""

    def dispatch(self, tokens, weights, indices, local_experts, *, ep_group, etp_group, expert_group, dropping):
        experts, topk = local_experts * _size(ep_group), indices.shape[1]
        chosen = torch.where(indices >= 0, indices, experts).flatten()  # [T·k], the dropped slots last
        order = chosen.argsort(stable=True)
        counts = expert_counts(chosen, experts + 1)[:experts]
        x = tokens.index_select(0, order // topk)  # [T·k, h] sorted by expert
        exchange = None
        if _size(ep_group) * _size(etp_group) > 1 or dropping:  # else every slot stays here: no dispatch
            x, counts, exchange = alltoall_dispatch(x, counts, local_experts, ep_group=ep_group, etp_group=etp_group,
                                                    expert_group=expert_group)
        return x, counts, (tokens, weights, order, exchange)

    def combine(self, y, state):
        tokens, weights, order, exchange = state
        if exchange is not None:
            y = alltoall_combine(y, exchange)  # [T·k, h], zero rows for the dropped slots
        y = y * weights.flatten()[order][:, None]
        return tokens.new_zeros(tokens.shape).index_add(0, order // weights.shape[1], y)

    def sent_bytes(self, ep, hidden, topk, element_size):
        return 4 * topk * hidden * element_size * (ep - 1) / ep  # the slots of (ep-1)/ep of the experts leave


class AllGatherDispatcher(TokenDispatcher):
    """Every token of the etp·ep group gathered, one reduce-scatter back (module docstring)."""

    def dispatch(self, tokens, weights, indices, local_experts, *, ep_group, etp_group, expert_group, dropping):
        x, counts, w, rows, total = allgather_dispatch(tokens, weights, indices, local_experts,
                                                       ep_rank=_rank(ep_group), group=expert_group)
        return x, counts, (w, rows, total, expert_group)

    def combine(self, y, state):
        w, rows, total, group = state
        return allgather_combine(y * w[:, None], rows, total, group)

    def sent_bytes(self, ep, hidden, topk, element_size):
        return (ep - 1) * (4 * hidden * element_size + topk * (4 + 4 + 8))  # + the routing: weights, expert ids


# name -> dispatcher: the one list (tp.moe.MoE's dispatcher, GPTConfig's moe_dispatcher, the job's --moe-dispatcher)
DISPATCHERS = {"alltoall": AllToAllDispatcher(), "allgather": AllGatherDispatcher()}


def dispatch_and_combine(tokens: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: Callable, *,
                         dispatcher: str = "alltoall", ep_group: dist.ProcessGroup | None,
                         etp_group: dist.ProcessGroup | None, expert_group: dist.ProcessGroup | None,
                         dropping: bool = False) -> torch.Tensor:
    """Σ_j weights[t, j] · expert_{indices[t, j]}(tokens[t]) for every token t of this rank (indices -1: a dropped
    slot, only where `dropping`), `experts(x sorted by local expert, rows per local expert)` computing this ep rank's
    `local_experts` experts (a GroupedExperts or a bound method of one), through DISPATCHERS[dispatcher]."""
    chosen = DISPATCHERS[dispatcher]
    x, counts, state = chosen.dispatch(tokens, weights, indices, getattr(experts, "__self__", experts).local_experts,
                                       ep_group=ep_group, etp_group=etp_group, expert_group=expert_group,
                                       dropping=dropping)
    return chosen.combine(experts(x, counts), state)
