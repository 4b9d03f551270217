"""The B/W split of zero-bubble pipeline schedules: under `defer_wgrad()` backward computes only the input gradient
(B) and queues each weight-gradient GEMM, with the dz and x it needs, for `DeferredWgrads.run()` (W) to compute later
into `main_grad` or, through autograd from the weight's own gradient edge, into `.grad` (so hooks, replica sums and
gradient accumulation see it as if backward had produced it). The parallel linears' backward asks
`defer_weight_grad` (tp.linear_functions), and so does the experts' grouped GEMM (tp.moe.experts, with its own
weight-gradient function); any autograd Function with a weight can do the same.
"""
import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

import kernels

_deferred = None  # the DeferredWgrads that backward fills, under defer_wgrad()


class DeferredWgrads:
    """Weight-gradient GEMMs that backward left under `defer_wgrad()`; `run()` computes them (the W of a
    zero-bubble schedule), each into `main_grad` or, through autograd, into `.grad`."""

    def __init__(self) -> None:
        self._jobs = []

    def __len__(self) -> int:
        return len(self._jobs)

    def run(self, *, touch: Iterable[torch.Tensor] = ()) -> None:
        """Compute the queued weight gradients: `main_grad` ones in place, the rest summed per weight and handed to
        autograd in one call. `touch`: parameters whose accumulators run in that same call too (with zeros), so
        that every one of them fires its grad hooks exactly once there (DDP's reducer, armed just before)."""
        jobs, self._jobs = self._jobs, []
        edges, grads = {}, {}
        with torch.no_grad():  # as inside backward
            for dz, x, main_grad, dtype, node, slot, wgrad in jobs:
                grad = wgrad(dz, x, main_grad=main_grad)
                if grad is not None:
                    key = (id(node), slot)
                    edges[key] = GradientEdge(node, slot)
                    grads[key] = grad.to(dtype) if key not in grads else grads[key] + grad.to(dtype)
        for param in touch:
            edge = get_gradient_edge(param)
            key = (id(edge.node), edge.output_nr)
            if key not in grads:
                edges[key], grads[key] = edge, torch.zeros_like(param)
        if edges:  # (autograd runs each node once per call, however many of these edges reach it)
            torch.autograd.backward(list(edges.values()), list(grads.values()))


@contextlib.contextmanager
def defer_wgrad() -> Iterator[DeferredWgrads]:
    """forward: every linear goes through the Functions (the torch backend's plain F.linear cannot split) ·
    backward: each weight-gradient GEMM is queued in the yielded DeferredWgrads instead of computed."""
    global _deferred
    previous, _deferred = _deferred, DeferredWgrads()
    try:
        yield _deferred
    finally:
        _deferred = previous


def deferring() -> bool:
    """Whether backward is running under defer_wgrad() (its weight gradients queued, not computed)."""
    return _deferred is not None


def _repeatable(node):
    """Whether autograd may run `node` (the weight's gradient edge) again after backward freed the graph: a
    parameter's accumulator, or a Function that saves no tensors and says so (`repeatable_backward = True`)."""
    return type(node).__name__ == "AccumulateGrad" or getattr(getattr(node, "_forward_cls", None),
                                                              "repeatable_backward", False)


def defer_weight_grad(ctx: torch.autograd.function.FunctionCtx, index: int, dz: torch.Tensor, x: torch.Tensor, *,
                      wgrad: Callable[..., torch.Tensor | None] = kernels.linear_wgrad) -> bool:
    """In a linear Function's backward: under defer_wgrad(), queue the weight gradient dzᵀ·x of input `index` for
    later and return True (backward then returns None for it); otherwise False (compute it now). `wgrad(dz, x,
    main_grad=)` computes it then (into main_grad, returning None, or returning it): a plain linear's by default."""
    if _deferred is None:
        return False
    node, slot = ctx.next_functions[index]
    if not _repeatable(node):  # a weight the graph computed (not a parameter): its gradient now
        return False
    _deferred._jobs.append((dz, x, ctx.main_grad, ctx.weight_dtype, node, slot, wgrad))
    return True
