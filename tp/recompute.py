"""Recomputation that keeps neither a function's intermediates nor its output (Megatron-Core's
CheckpointWithoutOutput, megatron/core/tensor_parallel/random.py, >= 0.12).

`DiscardedOutput(fn, *inputs, params=...)` runs fn once in forward without recording its graph, its node keeping only
`inputs` (`params`: every parameter fn reads: the node returns their gradients from the recomputed graph, so the
backward that runs it accumulates each once, hooks and DDP's reducer included; the node needs a gradient when they
do). Its `output` is then usually kept by its consumers for their backward (a norm's output is
the next linear's saved input, an activation's output the next GEMM's): once they ran forward, `discard(after)` frees
the output's storage and registers its refill on `after`, a tensor whose gradient arrives before theirs (their
output). When it does, fn runs again on the kept inputs, with autograd: the output's storage is refilled (the
consumers' backward reads it), and the function's own backward runs through that recorded graph.

fn must draw no random numbers. An input that other paths also read gets the same sum of gradients as through fn's
own graph, in another order (rounding-level differences).
"""
from collections.abc import Callable, Iterable

import torch

from kernels.linear import KEPT_BY_PRODUCER


class _Run(torch.autograd.Function):
    """fn(*inputs) without its graph; backward through the recomputed one."""

    @staticmethod
    def forward(ctx, fn, count, *inputs_and_params):
        inputs = inputs_and_params[:count]
        with torch.no_grad():
            output = fn(*inputs)
        ctx.fn, ctx.recomputed, ctx.params = fn, None, inputs_and_params[count:]
        ctx.save_for_backward(*inputs)
        return output

    @staticmethod
    def backward(ctx, grad):
        inputs, output = ctx.recomputed or _recompute(ctx)
        ctx.recomputed = None
        # The parameters' gradients are this node's, accumulated once by the backward that runs it (accumulated inside
        # here as well, DDP's reducer would see each parameter ready twice).
        wanted = [t for t in (*inputs, *ctx.params) if t.requires_grad]
        _check_declared(output, wanted)
        found = iter(torch.autograd.grad(output, wanted, grad, allow_unused=True) if wanted else ())
        return (None, None, *(next(found) if t.requires_grad else None for t in (*inputs, *ctx.params)))


def _check_declared(output, wanted):
    """Refuse a recomputed graph that reaches a leaf needing a gradient other than fn's inputs and params: the node
    returns only theirs, so that one would get none."""
    known, seen, todo = {id(t) for t in wanted}, set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # (an AccumulateGrad node's tensor)
        if leaf is not None and id(leaf) not in known:
            raise RuntimeError(f"DiscardedOutput: fn reads a tensor that needs a gradient but is not among its inputs "
                               f"or params: a {type(leaf).__name__} of shape {tuple(leaf.shape)}; pass it in params")
        todo.extend(next_node for next_node, _ in node.next_functions)


def _recompute(ctx):
    """(the kept inputs as leaves, fn's output on them with its graph), kept on the node for its backward."""
    inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
    with torch.enable_grad():
        ctx.recomputed = inputs, ctx.fn(*inputs)
    return ctx.recomputed


class DiscardedOutput:
    """fn(*inputs) (tensors) whose output's storage can be freed after forward and refilled in backward (the module
    docstring)."""

    def __init__(self, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor,
                 params: Iterable[torch.Tensor] = ()) -> None:
        self.output = _Run.apply(fn, len(inputs), *inputs, *params)
        setattr(self.output, KEPT_BY_PRODUCER, True)  # (refilled in backward: a consumer need not keep a copy)
        self.node = self.output.grad_fn  # (None when nothing needs a gradient)
        self.nbytes = 0  # the output's, once discarded

    def discard(self, after: torch.Tensor) -> None:
        """Free the output's storage now; refill it when `after`'s gradient arrives (nothing without a backward)."""
        if self.node is None or not after.requires_grad:
            return
        storage = self.output.untyped_storage()
        if any(x.untyped_storage().data_ptr() == storage.data_ptr() for x in self.node.saved_tensors):
            raise ValueError("DiscardedOutput: fn's output shares its storage with an input, which is kept")
        self.nbytes = storage.nbytes()
        storage.resize_(0)
        after.register_hook(self._refill)

    def _refill(self, grad: torch.Tensor) -> None:
        _, output = _recompute(self.node)
        source = output.untyped_storage()
        if source.nbytes() != self.nbytes:
            raise RuntimeError(f"DiscardedOutput: fn's recomputed output holds {source.nbytes()} bytes, the "
                               f"discarded one {self.nbytes}")
        self.output.untyped_storage().resize_(self.nbytes)
        self.output.untyped_storage().copy_(source)
