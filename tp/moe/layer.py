"""The mixture-of-experts layer: router -> token dispatch over ep -> grouped experts -> combine, plus shared experts.

Activations are Megatron's [s, b, h]. Under tensor parallelism the tokens each tp rank routes are its own: with
sequence parallelism the layer's input already is [s/tp, b, h] (Megatron's requirement for MoE with tp > 1); without
it the input is replicated over tp, so each tp rank takes a 1/tp share of the tokens (ceil(T/tp) rows, the last ranks
fewer when tp does not divide T: a prompt of odd length, generation's one token a step), routes and dispatches only
those, and the outputs are all-gathered back: no token is routed or computed twice. Every rank thus routes different
tokens; ep ranks exchange them (ep ranks are data-parallel ranks of the dense part, or its tp ranks under SP). With
context parallelism each rank routes its share of the sequence; the aux losses still cover the whole micro-batch
(tp.moe.losses).

Communication per layer and step at ep > 1 ("alltoall"): forward one all-gather of E + 2 integers (the counts) and one
all-to-all each way over ep; backward the same two all-to-alls; nothing else over ep. With etp > 1 add an
all-gather and a reduce-scatter over etp each way; with aux / z losses one all-reduce of 2E + 2 numbers over the
stage; with a capacity factor 4 small all-reduces, plus one per byte of the tokens' index (the global threshold);
without SP at tp > 1, one all-gather over tp of the output forward and one of the input's gradient backward.
"""
import math

import torch
import torch.distributed as dist
from torch import nn

from ..grads import sync_grads_over_tp
from ..layers import ColumnParallelLinear, RowParallelLinear
from ..mappings import gather_from_sp_region, scatter_to_sp_region
from ..mesh import SharedGroup, current_mesh, resolve_group
from .capacity import keep_mask, token_order
from .dispatch import DISPATCHERS, dispatch_and_combine, pad_rows
from .experts import GroupedExperts
from .losses import AuxLosses, attach_aux_grad, aux_losses, sequence_aux_loss
from .router import TopKRouter


def _normal(std):
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


class SharedExpert(nn.Module):
    """An FFN every token goes through, tp-sharded like the dense MLP (column -> row, SP as the block's), optionally
    times sigmoid(x·w_g) (Qwen2-MoE's gate, w_g [1, h] replicated)."""

    group = SharedGroup()

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, activation: str = "swiglu", gate: bool = False,
                 sequence_parallel: bool = False, group: dist.ProcessGroup | None = None, init_std: float = 0.02,
                 output_std: float | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, fp8_recipe: str | None = None, _init: bool = True) -> None:
        super().__init__()
        self.group, self.sequence_parallel = resolve_group(group), sequence_parallel
        swiglu = activation == "swiglu"
        self.fc1 = ColumnParallelLinear(hidden_size, 2 * ffn_hidden_size if swiglu else ffn_hidden_size, bias=False,
                                        activation=activation, sequence_parallel=sequence_parallel, group=self.group,
                                        init_method=_normal(init_std), dtype=dtype, device=device,
                                        fp8_recipe=fp8_recipe, _init=_init)
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, bias=False, sequence_parallel=sequence_parallel,
                                     group=self.group, init_method=_normal(output_std or init_std), dtype=dtype,
                                     device=device, fp8_recipe=fp8_recipe, _init=_init)
        self.gate = None
        if gate:
            self.gate = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
            if _init:
                with torch.no_grad():
                    _normal(init_std)(self.gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s(/tp), b, h]
        y = self.fc2(self.fc1(x))
        if self.gate is None:
            return y
        gate = self.gate
        if self.sequence_parallel and dist.get_world_size(self.group) > 1:  # each tp rank gates its own tokens
            gate, = sync_grads_over_tp(gate, group=self.group)
        return torch.sigmoid(x @ gate.t()) * y


def _mesh_group(name):
    mesh = current_mesh()
    return None if mesh is None else mesh.group(name)


class MoE(nn.Module):
    """A mixture-of-experts FFN: [s(/tp), b, h] -> the same (see the module docstring).

    Groups default to the current mesh's: `group` tp, `ep_group`, `etp_group`, `expert_group` (etp·ep: the count
    exchange, the allgather dispatcher), `token_group` (the stage's tp·cp·dp ranks, holding the micro-batch's
    tokens: the aux losses' statistics and the capacity threshold), `cp_group` and `dp_group` (where a token sits
    in the micro-batches: the capacity's tie order), `sequence_group` (tp·cp: the ranks holding the rest of this
    rank's sequences, the sequence-wise loss); `data_parallel_size` the dense dp size (how many micro-batches
    the token group holds). Each may be passed explicitly (None without a mesh: one rank). `fp8_recipe` (one of
    kernels.FP8_RECIPES) runs the experts' and the shared expert's GEMMs in float8; the router stays in the layer's
    dtype (docs/fp8.md).
    """

    group, ep_group, etp_group, expert_group, token_group, sequence_group, cp_group, dp_group = (
        SharedGroup() for _ in range(8))

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, topk: int = 2, *,
                 activation: str = "swiglu", score: str = "softmax", norm_topk_prob: bool = True,
                 shared_expert_size: int = 0, shared_expert_gate: bool = False, aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, capacity_factor: float | None = None, dispatcher: str = "alltoall",
                 sequence_parallel: bool = False, grad_sync: bool = True, group: dist.ProcessGroup | None = None,
                 ep_group: dist.ProcessGroup | None = None, etp_group: dist.ProcessGroup | None = None,
                 expert_group: dist.ProcessGroup | None = None, token_group: dist.ProcessGroup | None = None,
                 cp_group: dist.ProcessGroup | None = None, dp_group: dist.ProcessGroup | None = None,
                 data_parallel_size: int | None = None, init_std: float = 0.02, output_std: float | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 num_groups: int = 1, group_topk: int | None = None, scaling_factor: float = 1.0,
                 seq_aux_loss_coeff: float = 0.0, sequence_group: dist.ProcessGroup | None = None,
                 fp8_recipe: str | None = None, _init: bool = True) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.ep_group = ep_group if ep_group is not None else _mesh_group("ep")
        self.etp_group = etp_group if etp_group is not None else _mesh_group("etp")
        self.expert_group = expert_group if expert_group is not None else _mesh_group("etp-ep")
        self.token_group = token_group if token_group is not None else _mesh_group("tp-cp-dp")
        self.sequence_group = sequence_group if sequence_group is not None else _mesh_group("tp-cp")
        self.seq_aux_loss_coeff = seq_aux_loss_coeff
        self.cp_group = cp_group if cp_group is not None else _mesh_group("cp")
        self.dp_group = dp_group if dp_group is not None else _mesh_group("dp")
        mesh = current_mesh()
        self.data_parallel_size = data_parallel_size or (mesh.dp_size if mesh is not None else 1)
        _check(num_experts, topk, ffn_hidden_size, dispatcher, capacity_factor, self.ep_group, self.etp_group)
        self.num_experts, self.topk, self.dispatcher = num_experts, topk, dispatcher
        self.aux_loss_coeff, self.z_loss_coeff, self.capacity_factor = aux_loss_coeff, z_loss_coeff, capacity_factor
        self.sequence_parallel, self.tp_size = sequence_parallel, _size(self.group)
        self.aux_loss_scale = 1.0  # the trainer's loss scale (tp.moe.set_aux_loss_scale)
        self.last = None  # the last forward's AuxLosses (tp.moe.aux_losses)
        self.dropped_slots = None  # with a capacity factor: the last forward's dropped slots on this rank (a tensor)
        factory = dict(dtype=dtype, device=device, _init=_init)
        self.router = TopKRouter(hidden_size, num_experts, topk, score=score, norm_topk_prob=norm_topk_prob,
                                 group=self.group, grad_sync=grad_sync, check_group=self.token_group,
                                 init_std=init_std, num_groups=num_groups, group_topk=group_topk,
                                 scaling_factor=scaling_factor, **factory)
        self.router.token_group = self.token_group
        self.experts = GroupedExperts(num_experts, hidden_size, ffn_hidden_size, activation=activation,
                                      ep_size=_size(self.ep_group), ep_rank=_rank(self.ep_group),
                                      etp_size=_size(self.etp_group), etp_rank=_rank(self.etp_group),
                                      init_std=init_std, output_std=output_std, fp8_recipe=fp8_recipe, **factory)
        self.experts.ep_group, self.experts.etp_group = self.ep_group, self.etp_group
        self.shared = None
        if shared_expert_size:
            self.shared = SharedExpert(hidden_size, shared_expert_size, activation=activation,
                                       gate=shared_expert_gate, sequence_parallel=sequence_parallel,
                                       group=self.group, init_std=init_std, output_std=output_std,
                                       fp8_recipe=fp8_recipe, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s(/tp), b, h]
        tokens = x.reshape(-1, x.shape[-1])  # [T, h]
        total = tokens.shape[0]
        replicated = self.tp_size > 1 and not self.sequence_parallel
        share = -(-total // self.tp_size) if replicated else total  # rows a rank routes at most (the last fewer)
        mine = total
        if replicated:  # each tp rank routes its own share: rows [rank·share, ...) of T padded to tp·share
            mine = min(share, max(0, total - _rank(self.group) * share))
            tokens = scatter_to_sp_region(pad_rows(tokens, share * self.tp_size), self.group)[:mine]  # [T/tp, h]
        routing = self.router(tokens)
        weights, indices = routing.weights, routing.indices
        if self.aux_loss_coeff or self.z_loss_coeff:
            aux, self.last = aux_losses(routing.probs, routing.logits, indices, aux_coeff=self.aux_loss_coeff,
                                        z_coeff=self.z_loss_coeff, group=self.token_group)
            weights = attach_aux_grad(weights, aux, self.data_parallel_size * self.aux_loss_scale)
        else:
            self.last = None
        if self.seq_aux_loss_coeff:
            first = _rank(self.group) * share if replicated else 0
            weights = self._sequence_aux_loss(routing, weights, x.shape[1] if x.dim() > 2 else 1, first)
        if self.capacity_factor is not None:
            kept, _ = keep_mask(weights, indices, self.num_experts, self.capacity_factor, self.token_group,
                                order=self._token_order(x, replicated, share), max_rows=share)
            indices = torch.where(kept, indices, -1)
            self.dropped_slots = (~kept).sum()
        uneven = replicated and share * self.tp_size != total
        if uneven:  # every rank dispatches `share` rows (the allgather dispatcher's rule), its padding routed nowhere
            tokens, weights = pad_rows(tokens, share), pad_rows(weights, share)
            indices = pad_rows(indices, share, -1)
        out = dispatch_and_combine(tokens, weights.to(tokens.dtype), indices, self.experts, dispatcher=self.dispatcher,
                                   ep_group=self.ep_group, etp_group=self.etp_group, expert_group=self.expert_group,
                                   dropping=self.capacity_factor is not None or uneven)
        if replicated:  # backward: split
            out = gather_from_sp_region(pad_rows(out[:mine], share), self.group, tensor_parallel_output_grad=False)
        out = out[:total].view(x.shape)
        return out if self.shared is None else out + self.shared(x)

    def _sequence_aux_loss(self, routing, weights, batch, first):
        """The weights with the sequence-wise loss's gradient attached (self.last.sequence its value). Row r of this
        rank's tokens is row `first` + r of the layer's [s(/tp), b] input flattened, of sequence (first + r) mod b."""
        rows = torch.arange(first, first + len(weights), device=weights.device)
        loss, value = sequence_aux_loss(routing.probs, routing.indices, rows % batch, batch,
                                        coeff=self.seq_aux_loss_coeff, group=self.sequence_group)
        if self.last is None:
            zero = torch.zeros_like(value)
            self.last = AuxLosses(zero, zero, None)
        self.last.sequence = value
        return attach_aux_grad(weights, loss, self.aux_loss_scale)  # (a mean per micro-batch, as the LM loss)

    def _token_order(self, x, replicated, share):
        """The global index of each token this rank routes (capacity ties go to the lower): its place in the
        micro-batch, after those of the lower dp ranks when the token group holds several micro-batches."""
        pooled = _size(self.token_group) > self.tp_size * _size(self.cp_group)  # (tp.moe's default: tp·cp·dp)
        batch = x.shape[1] if x.dim() > 2 else 1
        first = _rank(self.dp_group) * batch if pooled else 0
        order = token_order(x.shape[0], batch, sequence_parallel=self.sequence_parallel, group=self.group,
                            cp_group=self.cp_group, first_sample=first, device=x.device)
        return order[_rank(self.group) * share:][:share] if replicated else order

    def extra_repr(self) -> str:
        extra = f", capacity_factor={self.capacity_factor}" if self.capacity_factor is not None else ""
        return (f"dispatcher={self.dispatcher}, ep={_size(self.ep_group)}, etp={_size(self.etp_group)}, "
                f"aux_loss_coeff={self.aux_loss_coeff}, z_loss_coeff={self.z_loss_coeff}{extra}"
                + (f", seq_aux_loss_coeff={self.seq_aux_loss_coeff}" if self.seq_aux_loss_coeff else ""))


def _size(group):
    return 1 if group is None else dist.get_world_size(group)


def _rank(group):
    return 0 if group is None else dist.get_rank(group)


def _check(num_experts, topk, ffn, dispatcher, capacity_factor, ep_group, etp_group):
    """The configuration's errors, one line each, on every rank before any collective."""
    if num_experts < 1 or num_experts % _size(ep_group):
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={_size(ep_group)}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"moe_router_topk={topk} must be between 1 and num_experts={num_experts}")
    if ffn % _size(etp_group):
        raise ValueError(f"moe_ffn_hidden_size={ffn} is not divisible by etp={_size(etp_group)}")
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"moe_dispatcher={dispatcher!r} must be one of {tuple(DISPATCHERS)}")
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and 0 < capacity_factor
                                            < math.inf):
        raise ValueError(f"moe_capacity_factor={capacity_factor!r} must be a positive number (or None: dropless)")
