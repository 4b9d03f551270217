"""`first_order`: torch's `once_differentiable` for the package's autograd Functions whose backward reads saved
tensors that need grad (a weight, attention's q/k/v, the logits); those linear in the incoming gradient (RoPE,
dropout's mask, the context-parallel and MoE exchanges) keep torch's, whose second backward raises where it reaches
them. (tp's mappings record their backward as the conjugate mapping: a second derivative through them is exact.)

torch's decorator marks a backward's results as not differentiable again (a second backward through them raises)
only when the incoming gradients need grad. A gradient penalty's first backward (`create_graph=True`) often starts
from gradients that need none (`y.sum()`'s ones) while the result still depends on the weights: torch's decorator
then returns plain tensors and the second backward silently misses the weights' terms; and its error node hangs off
detached copies, so `autograd.grad(penalty, weight)` blames the weight ("not used in the graph"). Here, under
create_graph, the results pass through a node that reads the saved tensors and gradients, and any second derivative
through them raises one line naming the Function.
"""
import functools
from collections.abc import Callable

import torch


class _FirstOrder(torch.autograd.Function):
    """Passes a backward's results through unchanged, its node reading what they depend on (the saved tensors and
    incoming gradients that need grad), so that any second derivative through them, `.backward()` or
    `autograd.grad(..., weight)`, reaches this node and its one line (torch's decorator ties its error node to
    detached copies: `autograd.grad(..., weight)` said the weight was "not used in the graph")."""

    @staticmethod
    def forward(ctx, name, count, *tensors):
        ctx.name = name
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.name} is first-order: a second derivative through it (create_graph=True: a gradient "
                           "penalty, a Hessian-vector product) is not supported")


def first_order(backward: Callable) -> Callable:
    """Decorate an autograd Function's backward: run without grad; under create_graph its results, when anything
    they depend on needs grad, refuse a second derivative in one line naming the Function."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            results = backward(ctx, *grads)
        if not torch.is_grad_enabled():  # (no create_graph: nothing to refuse)
            return results
        single = not isinstance(results, tuple)
        results = (results,) if single else results
        reads = [t for t in (*ctx.saved_tensors, *grads) if isinstance(t, torch.Tensor) and t.requires_grad]
        tensors = [r for r in results if isinstance(r, torch.Tensor)]
        if reads and tensors:
            passed = iter(_FirstOrder.apply(type(ctx).__name__, len(tensors), *tensors, *reads))
            results = tuple(next(passed) if isinstance(r, torch.Tensor) else r for r in results)
        return results[0] if single else results
    return wrapper
