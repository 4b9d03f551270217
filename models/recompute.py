"""Activation recomputation: which parts of each transformer block drop their activations in forward and recompute
them in backward. GPTConfig's `recompute` (the job's --recompute; Megatron's --recompute-granularity) is one of
GRANULARITIES; under "selective", `recompute_modules` names the parts (MODULES: Megatron-Core's --recompute-modules
names); under "full", `recompute_method` (METHODS) and `recompute_num_layers` group the blocks of each model chunk.
GPTConfig, the job and the planner read these registries; models/block.py and models/gpt.py recompute the parts.

Parts of a block: "core", the attention core (softmax(QKᵀ)V from the kept q, k, v: Korthikanti et al. 2022's
selective recomputation, arXiv:2205.05198 §5); "block", the whole block from its input; "mlp", a dense layer's MLP
from its input; "moe", an MoE layer's whole MLP (router, dispatch, experts, shared expert) from its input;
"shared_expert", an MoE layer's shared expert from its input; and two whose output is not kept either, as
Megatron-Core >= 0.12 does (its CheckpointWithoutOutput; here tp.recompute.DiscardedOutput): "norm", both pre-norms
(their outputs are the next linears' saved inputs: freed once those ran, refilled from the kept norm input when the
attention's or the MLP's output gradient arrives), and "expert_act", the experts' activation (fc2's saved input:
freed, refilled from the kept pre-activation when fc2's output gradient arrives).
"""
import functools

import torch
from torch.utils.checkpoint import checkpoint

import tp
from kernels.torch_ops import activation_backward, activation_forward
from tp.moe.experts import grouped_linear
from tp.recompute import DiscardedOutput

# granularity -> the parts of a block it recomputes (selective: those of the default modules, core_attn)
GRANULARITIES = {"none": frozenset(), "selective": frozenset({"core"}), "full": frozenset({"block"})}
# Megatron-Core's --recompute-modules name -> the part of a block it recomputes (under selective granularity)
MODULES = {"core_attn": "core", "mlp": "mlp", "moe": "moe", "moe_act": "expert_act", "layernorm": "norm",
           "shared_experts": "shared_expert"}
DEFAULT_MODULES = ("core_attn",)
OUTPUT_DISCARDING = frozenset({"norm", "expert_act"})  # the parts recomputed by tp.recompute.DiscardedOutput


def uniform_groups(layers: int, group: int) -> list[range]:
    """Megatron's "uniform": every block recomputed, the input of each `group` consecutive ones kept."""
    return [range(start, min(start + group, layers)) for start in range(0, layers, group)]


def block_groups(layers: int, count: int) -> list[range]:
    """Megatron's "block": the first `count` blocks recomputed (each from its input), the others not."""
    return [range(i, i + 1) for i in range(min(count, layers))]


# --recompute-method: (a model chunk's blocks, --recompute-num-layers) -> the groups recomputed, each from its input
METHODS = {"uniform": uniform_groups, "block": block_groups}


def recompute_parts(granularity: str, modules: tuple[str, ...] | None = None) -> frozenset[str]:
    """The parts of every block that `granularity` recomputes, under "selective" those of `modules` (MODULES names;
    None: the default, core_attn)."""
    if granularity == "selective" and modules is not None:
        return frozenset(MODULES[m] for m in modules)
    return GRANULARITIES[granularity]


def recomputes(granularity: str, part: str, modules: tuple[str, ...] | None = None) -> bool:
    """Whether `granularity` (a GRANULARITIES name; "selective" with `modules`) recomputes `part` of every block."""
    return part in recompute_parts(granularity, modules)


def recompute_groups(layers: int, method: str = "uniform", num_layers: int = 1) -> list[range]:
    """The groups of a model chunk's `layers` blocks that full recomputation runs from their input (METHODS)."""
    return METHODS[method](layers, num_layers)


class RecomputedSharedExpert(tp.moe.SharedExpert):
    """A shared expert recomputed from its input in backward ("shared_expert")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


class _Activation(torch.autograd.Function):
    """act(z) with the backward the experts' fused GEMM computes (kernels.torch_ops): the same gradients."""

    @staticmethod
    def forward(ctx, z, activation):
        ctx.save_for_backward(z)
        ctx.activation = activation
        return activation_forward(z, activation)

    @staticmethod
    def backward(ctx, grad):
        z, = ctx.saved_tensors
        return activation_backward(grad, z, ctx.activation), None


class ActivationRecomputingExperts(tp.moe.GroupedExperts):
    """Grouped experts whose activation's output (fc2's input) is not kept ("expert_act"): fc1 without the fused
    activation keeps its input, the activation keeps the pre-activation, and fc2's input is refilled from it when
    fc2's output gradient arrives (Megatron-Core's moe_act)."""

    def forward(self, x: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:  # [N, h]
        w1, w2 = self.weights
        preact = grouped_linear(x, w1, counts, fp8=self.fp8_scaling(0))  # [N, (2)F/etp]
        hidden = DiscardedOutput(functools.partial(_Activation.apply, activation=self.activation), preact)
        out = grouped_linear(hidden.output, w2, counts, fp8=self.fp8_scaling(1))
        hidden.discard(out)
        return out


def recompute_inside_moe(moe: tp.moe.MoE, parts: frozenset[str]) -> None:
    """Set up `moe`'s experts and shared expert to recompute what `parts` asks ("expert_act", "shared_expert"; not
    under "moe", which recomputes the whole layer): fixed when the block is built."""
    if "moe" in parts:
        return
    if "expert_act" in parts:
        moe.experts.__class__ = ActivationRecomputingExperts  # (the same module and parameters, another forward)
    if "shared_expert" in parts and moe.shared is not None:
        moe.shared.__class__ = RecomputedSharedExpert
