"""`first_order`: torch's `once_differentiable` for the package's autograd Functions whose backward reads saved
tensors that need grad (a weight, attention's q/k/v, the logits); those linear in the incoming gradient (RoPE,
dropout's mask, the context-parallel and MoE exchanges) keep torch's, whose second backward raises where it reaches
them. (tp's mappings record their backward as the conjugate mapping: a second derivative through them is exact.)

torch's decorator marks a backward's results as not differentiable again (a second backward through them raises)
only when the incoming gradients need grad. A gradient penalty's first backward (`create_graph=True`) often starts
from gradients that need none (`y.sum()`'s ones) while the result still depends on the weights: torch's decorator
then returns plain tensors and the second backward silently misses the weights' terms. Here, under create_graph, the
results are always marked, so that second backward raises as torch's does.
"""
import functools
from collections.abc import Callable

import torch


def first_order(backward: Callable) -> Callable:
    """Decorate an autograd Function's backward: run without grad; under create_graph its results refuse a second
    backward ("trying to differentiate twice a function that was marked with @once_differentiable")."""
    once = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled() and not any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads):
            # (torch's decorator marks its results when a gradient needs grad: let one say it does, same values)
            grads = tuple(g.detach().requires_grad_() if isinstance(g, torch.Tensor) and g.is_floating_point()
                          else g for g in grads)
        return once(ctx, *grads)
    return wrapper
