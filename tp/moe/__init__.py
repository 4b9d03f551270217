"""Mixture of experts and expert parallelism: the MoE layer, its router, dispatchers, experts and aux losses.

    tp.init_mesh(tp=2, ep=2)                      # the expert layout lives on the mesh (ep, etp, edp groups)
    moe = tp.moe.MoE(hidden, ffn, num_experts=8, topk=2, sequence_parallel=True, aux_loss_coeff=1e-2)
    y = moe(x)                                    # [s/tp, b, h] -> [s/tp, b, h]
    tp.moe.aux_losses(model)                      # the last forward's aux / z losses per layer, for logging
    with tp.moe.dynamic_shapes():                 # torch.compile: the dispatch's sizes are data-dependent
        loss = torch.compile(step, fullgraph=True)(batch)   # no graph break
"""
import contextlib

import torch
import torch.distributed as dist
from torch import nn

from .capacity import capacity, keep_mask, token_order
from .dispatch import DISPATCHERS, TokenDispatcher
from .experts import GroupedExperts
from .layer import MoE, SharedExpert
from .losses import AuxLosses
from .parallel_experts import ParallelExperts
from .router import SCORES, Routing, Score, TopKRouter, check_groups

__all__ = ["MoE", "TopKRouter", "GroupedExperts", "ParallelExperts", "SharedExpert", "Routing", "AuxLosses",
           "DISPATCHERS", "SCORES", "Score", "TokenDispatcher", "capacity", "keep_mask", "token_order", "aux_losses",
           "set_aux_loss_scale", "update_expert_bias", "expert_parameters", "dynamic_shapes", "check_groups"]


def dynamic_shapes() -> contextlib.AbstractContextManager:
    """The Dynamo setting torch.compile needs to trace an MoE layer without a graph break, as a context manager (or
    a decorator of the compiled function) active while it compiles: outputs whose size is data-dependent (the rows
    an expert dispatch receives) become unbacked SymInts (`capture_dynamic_output_shape_ops`), scoped to the calls
    it wraps. Without it Dynamo breaks the graph at the dispatch. Under activation checkpointing the layer's
    bookkeeping (the last aux losses, the dropped slots, a sigmoid router's loads) is done by the forward once, not
    replayed by the recomputation (`skip_fwd_side_effects_in_bwd_under_checkpoint`: eager recomputation skips the
    loads and rewrites the same values). GPT.compile_blocks applies it to its MoE blocks."""
    return torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True,
                                      skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def aux_losses(module: nn.Module) -> list[AuxLosses]:
    """The last forward's load-balancing and z losses (and global tokens per expert) of every MoE layer of `module`
    that computes them, in module order: equal on every rank of a stage."""
    return [m.last for m in module.modules() if isinstance(m, MoE) and m.last is not None]


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """Scale the aux losses' gradient as the trainer scales its LM loss before backward (1 / the accumulated
    micro-batches, times a loss scale): every MoE layer of `module`."""
    for m in module.modules():
        if isinstance(m, MoE):
            m.aux_loss_scale = float(scale)


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters tagged `expert_parallel` (reduced over the expert-data-parallel group, not dp)."""
    return [p for p in module.parameters() if getattr(p, "expert_parallel", False)]


@torch.no_grad()
def update_expert_bias(module: nn.Module, rate: float = 1e-3, *, group: dist.ProcessGroup | None = None) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: every sigmoid router's selection bias
    b_i += rate · sign(mean load - load_i), the loads being its tokens per expert since the last update summed over
    the stage (one all-reduce per group of routers: each router's token group, or `group`, every rank that holds
    the router: a training loop whose token groups are one data-parallel rank's), then reset. The same update on
    every rank, in fp32 at least (the bias is an fp32 buffer that mixed precision keeps: `fixed_dtype_buffers`)."""
    routers = [m for m in module.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None]
    by_group = {}
    for r in routers:
        by_group.setdefault(id(r.token_group if group is None else group), []).append(r)
    for same in by_group.values():
        loads = torch.stack([r.expert_load for r in same])  # [routers, E] fp64
        over = same[0].token_group if group is None else group
        if over is not None and dist.get_world_size(over) > 1:
            dist.all_reduce(loads, group=over)
        for r, load in zip(same, loads):
            exact = torch.promote_types(r.expert_bias.dtype, torch.float32)  # (fp32 whatever a wrapper made of it)
            r.expert_bias.copy_(r.expert_bias.to(exact) + rate * torch.sign(load.mean() - load).to(exact))
            r.expert_load.zero_()
