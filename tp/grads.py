"""Gradient reductions across ranks that the layers' own collectives do not cover.

- Sequence parallelism: a parameter applied to a sequence shard (norms, the row layer's bias) gets a partial
  gradient on each tp rank. `sync_grads_over_tp` sums it inside autograd, before the gradient reaches the parameter,
  so optimizers, DDP and FSDP see complete gradients with nothing called after backward (DTensor's behaviour).
  Modules built with the sync switched off tag such parameters `sequence_parallel = True` instead, and the training
  loop calls `allreduce_sequence_parallel_grads` (Megatron's finalize step, one coalesced all-reduce).
- Gradient-accumulation fusion: `weight.main_grad` is invisible to torch DDP. `ddp_ignore_main_grads` keeps DDP off
  those parameters and `allreduce_main_grads` averages them over the data-parallel group after backward.
"""
import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_reduce_coalesced
from .mesh import resolve_group


class _SumGradsOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        # not in place: autograd may have handed the same grad tensor to another input (both sides of an add)
        it = iter(all_reduce_coalesced([g for g in grads if g is not None], ctx.group, inplace=False))
        return (None, *(None if g is None else next(it) for g in grads))


def sync_grads_over_tp(*tensors: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """forward: identity · backward: one coalesced all-reduce of the tensors' grads (use on parameters in a forward)."""
    group = resolve_group(group)
    if dist.get_world_size(group) == 1 or not torch.is_grad_enabled():
        return tensors
    return _SumGradsOverTP.apply(group, *tensors)


def _grad_or_main_grad(p):
    main_grad = getattr(p, "main_grad", None)
    return p.grad if main_grad is None else main_grad


def allreduce_sequence_parallel_grads(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum, over the tp group, the grads of parameters tagged `sequence_parallel` (built with the grad sync off).

    One coalesced all-reduce; call after backward and before the optimizer step. Uses `main_grad` when present.
    """
    group = resolve_group(group)
    if any(type(p).__name__ == "DTensor" for p in module.parameters()):
        raise ValueError("allreduce_sequence_parallel_grads on DTensor (FSDP2) parameters: their `sequence_parallel` "
                         "tags do not survive the swap; sum sequence-parallel grads inside backward instead "
                         "(the layers' default)")
    grads = [g for p in module.parameters() if getattr(p, "sequence_parallel", False)
             if (g := _grad_or_main_grad(p)) is not None]
    if grads and dist.get_world_size(group) > 1:
        all_reduce_coalesced(grads, group)


def ddp_ignore_main_grads(module: nn.Module) -> list[str]:
    """Tell torch DDP (call before wrapping) to leave parameters with `main_grad` to `allreduce_main_grads`."""
    from torch.nn.parallel import DistributedDataParallel

    names = [name for name, p in module.named_parameters() if hasattr(p, "main_grad")]
    # DDP matches f"{module_name}.{param_name}" when it builds its reducer: ".weight" for the root's own parameters.
    root_names = [f".{name}" for name, p in module.named_parameters(recurse=False) if hasattr(p, "main_grad")]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names + root_names)
    return names


def allreduce_main_grads(module: nn.Module, group: dist.ProcessGroup, *, average: bool = True) -> None:
    """Average (or sum) every parameter's `main_grad` over `group` (the data-parallel group): one all-reduce per
    dtype, after backward and before the optimizer step. Megatron's DDP does this for its fp32 grad buffers."""
    grads = [p.main_grad for p in module.parameters() if getattr(p, "main_grad", None) is not None]
    if grads and dist.get_world_size(group) > 1:
        all_reduce_coalesced(grads, group, average=average)


def main_grad_of(weight: torch.Tensor) -> torch.Tensor | None:
    """weight.main_grad (gradient-accumulation fusion) or None; refused under torch DDP, which reduces only .grad.

    Called in forward, where DDP marks itself active; parameters DDP was told to ignore are the caller's to reduce.
    """
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None and torch.compiler.is_compiling() and getattr(weight, "folds_grad_into_main_grad", False):
        return None  # the wgrad goes to .grad, whose hook folds it in: a compiled backward cannot run that hook
    if main_grad is not None and not hasattr(weight, "_ddp_ignored"):
        from torch.nn.parallel import DistributedDataParallel

        if DistributedDataParallel._get_active_ddp_module() is not None:
            raise ValueError(
                f"weight.main_grad (shape {tuple(weight.shape)}) inside torch DistributedDataParallel: DDP averages "
                "only .grad, so main_grad would never be reduced over data parallelism. Exclude main_grad "
                "parameters from DDP (tp.ddp_ignore_main_grads(model) before wrapping) and call "
                "tp.allreduce_main_grads(model, dp_group) after backward")
    return main_grad
