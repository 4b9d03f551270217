"""Hugging Face's experts module on the package's expert parallelism: what `tp.parallelize` puts in the place of an
HF MoE block's `mlp.experts` (HF's plans: "moe_tp_experts", "ep_dispatch_experts").

The module keeps HF's interface, forward(hidden_states [T, h], top_k_index [T, k], top_k_weights [T, k]) -> [T, h]
with the routing left to HF's router, and HF's parameter names (gate_up_proj [E, 2F, h], down_proj [E, h, F]), each
rank holding its experts (ep) and its slice of their F (etp) from the current mesh. HF models replicate the tokens
over tp, so each tp rank takes 1/tp of them (no token computed twice; padded rows routed nowhere where tp does not
divide them), dispatches them over ep with the package's dispatcher and grouped GEMM, and the outputs are
all-gathered back.
"""
import torch
import torch.distributed as dist
from torch import nn

from ..collectives import split_first
from ..mappings import gather_from_sp_region, scatter_to_sp_region
from ..mesh import SharedGroup, current_mesh, resolve_group
from .dispatch import DISPATCHERS, dispatch_and_combine, pad_rows
from .experts import GroupedExperts


def _mesh_group(name):
    mesh = current_mesh()
    return None if mesh is None else mesh.group(name)


def _size(group):
    return 1 if group is None else dist.get_world_size(group)


class ParallelExperts(GroupedExperts):
    """HF's experts interface on ep x etp (see the module docstring). Build with `from_hf`."""

    names = ("gate_up_proj", "down_proj")
    group, expert_group = SharedGroup(), SharedGroup()

    @classmethod
    def from_hf(cls, module: nn.Module, *, group: dist.ProcessGroup | None = None,
                ep_group: dist.ProcessGroup | None = None, etp_group: dist.ProcessGroup | None = None,
                expert_group: dist.ProcessGroup | None = None, dispatcher: str = "alltoall") -> "ParallelExperts":
        """This rank's share of an HF experts module (SwiGLU experts with fused gate_up_proj / down_proj, no biases),
        groups from the current mesh unless given."""
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        extra = sorted(n for n, _ in module.named_parameters() if n not in cls.names)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3 or extra:
            raise ValueError(f"{type(module).__name__} is not Hugging Face's fused experts (gate_up_proj [E, 2F, h], "
                             f"down_proj [E, h, F], no other parameters{f'; it has {extra}' if extra else ''})")
        act = type(getattr(module, "act_fn", None)).__name__
        if act not in ("SiLU", "SiLUActivation"):
            raise ValueError(f"{type(module).__name__}: expert activation {act} is not supported (SwiGLU: SiLU)")
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher={dispatcher!r} must be one of {tuple(DISPATCHERS)}")
        ep_group = ep_group if ep_group is not None else _mesh_group("ep")
        etp_group = etp_group if etp_group is not None else _mesh_group("etp")
        E, rows, h = gate_up.shape
        new = cls(E, h, rows // 2, activation="swiglu", ep_size=_size(ep_group),
                  ep_rank=0 if ep_group is None else dist.get_rank(ep_group), etp_size=_size(etp_group),
                  etp_rank=0 if etp_group is None else dist.get_rank(etp_group), dtype=gate_up.dtype,
                  device=gate_up.device, _init=False)
        new.group, new.ep_group, new.etp_group = resolve_group(group), ep_group, etp_group
        new.expert_group = expert_group if expert_group is not None else _mesh_group("etp-ep")
        new.dispatcher = dispatcher
        with torch.no_grad():
            new.weights[0].copy_(new.shard_fc1(gate_up.detach()[new.expert_range]))
            new.weights[1].copy_(new.shard_fc2(down.detach()[new.expert_range]))
        for mine, theirs in zip(new.weights, (gate_up, down)):
            mine.requires_grad_(theirs.requires_grad)
        return new.train(module.training)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,  # [T, h], [T, k], [T, k]
                top_k_weights: torch.Tensor) -> torch.Tensor:
        split = _size(self.group) > 1  # HF replicates the tokens over tp: each rank takes its share
        tokens, indices, weights = hidden_states, top_k_index, top_k_weights
        total = tokens.shape[0]
        rows = -(-total // _size(self.group)) * _size(self.group)  # (padded when tp does not divide T)
        if split:
            tokens = scatter_to_sp_region(pad_rows(tokens, rows), self.group)
            weights = scatter_to_sp_region(pad_rows(weights, rows), self.group)
            indices = split_first(pad_rows(indices, rows, -1), self.group)  # (the padding routed nowhere)
        out = dispatch_and_combine(tokens, weights.to(tokens.dtype), indices, self.grouped, dispatcher=self.dispatcher,
                                   ep_group=self.ep_group, etp_group=self.etp_group, expert_group=self.expert_group,
                                   dropping=rows != total)
        return gather_from_sp_region(out, self.group, tensor_parallel_output_grad=False)[:total] if split else out

    def grouped(self, x: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """The experts on rows sorted by local expert (GroupedExperts.forward, which this module's forward hides)."""
        return GroupedExperts.forward(self, x, counts)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ep={self.ep_size}, dispatcher={self.dispatcher}"
