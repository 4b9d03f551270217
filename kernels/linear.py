"""kernels.linear: a differentiable y = act(x @ weight.T + bias) built only on the dispatched primitives of ops.py,
so the same code runs the fused Triton kernels on GPU (or under TRITON_INTERPRET=1) and eager torch elsewhere.

What the backward keeps from the forward: x (flattened to 2-D), the weight and, when there is an activation, the
pre-activation z = x·Wᵀ + b. Recomputing z in the backward would cost a full extra GEMM per layer; storing it costs one
[tokens, N] activation (the same size as the output), which is the trade Megatron and Liger make too.

B/W split (zero-bubble pipeline schedules): under `defer_wgrad()` backward computes only the input gradient (B) and
queues each weight-gradient GEMM, with the dz and x it needs, for `DeferredWgrads.run()` (W) to compute later into
`main_grad` or, through autograd from the weight's own gradient edge, into `.grad` (so hooks, replica sums and
gradient accumulation see it as if backward had produced it).
"""
import contextlib

import torch
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge, get_gradient_edge

from . import ops, torch_ops


def linear(x, weight, bias=None, *, activation=None):
    """act(x @ weight.T + bias) for x [..., K], weight [N, K] (any strides), bias [N] or None.

    activation: None, "gelu" (erf), "gelu_tanh", "silu", "relu" or "swiglu" (fused weight [2F, K], gate rows first,
    output silu(x·Wgᵀ + bg) ⊙ (x·Wuᵀ + bu) of width F). The output has x's dtype. If `weight.main_grad` exists
    (an fp32 [N, K] buffer) the weight gradient is accumulated into it in place and weight.grad is left untouched.
    """
    ops.check_activation(activation)
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} features but weight is {tuple(weight.shape)}")
    if ops.backend_for(x) == "torch" and not hasattr(weight, "main_grad") and _deferred is None:
        # Nothing to fuse or accumulate: autograd's own ops are the same math with less Python per call.
        return torch_ops.activation_forward(F.linear(x, weight, bias), activation)
    return _LinearFunction.apply(x, weight, bias, activation)


def swiglu_linear(x, weight, bias=None):
    """linear(x, weight, bias, activation="swiglu"): weight is the fused [2F, K] gate/up matrix."""
    return linear(x, weight, bias, activation="swiglu")


def _flatten(t):
    # [..., K] -> [tokens, K]; reshape(-1, K) would be ambiguous for K == 0.
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        ctx.main_grad = ops.main_grad_of(weight)  # on the parameter, not on an autocast copy of it
        ctx.x_shape, ctx.bias_dtype, ctx.weight_dtype = x.shape, None if bias is None else bias.dtype, weight.dtype
        x, weight, bias = ops.autocast_operands(x, weight, bias)
        x2d = _flatten(x)
        y, preact = ops.linear_forward(x2d, weight, bias, activation)
        ctx.save_for_backward(x2d, weight, preact)
        ctx.activation = activation
        # detach: a plain tensor rather than a view of one made in here, so callers may modify it in place (the
        # row-parallel layer all-reduces its matmul output in its own storage).
        return y.view(*x.shape[:-1], y.shape[-1]).detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x2d, weight, preact = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_2d = _flatten(grad_y).to(weight.dtype)
        # dz (= grad through the activation) comes back even without dx: wgrad and dbias reuse it.
        grad_x, dz = ops.linear_dgrad(grad_2d, weight, preact, ctx.activation, need_input_grad=need_x)
        # With main_grad: accumulated in place (α = β = 1), no low-precision dW, weight.grad stays None.
        grad_w = None
        if need_w and not defer_weight_grad(ctx, 1, dz, x2d):
            grad_w = ops.linear_wgrad(dz, x2d, main_grad=ctx.main_grad)
        grad_b = ops.bias_grad(dz, ctx.bias_dtype) if need_b else None
        return (None if grad_x is None else grad_x.view(ctx.x_shape)), grad_w, grad_b, None


# ---- B/W split ---------------------------------------------------------------------------------------------------

_deferred = None  # the DeferredWgrads that backward fills, under defer_wgrad()


class DeferredWgrads:
    """Weight-gradient GEMMs that backward left under `defer_wgrad()`; `run()` computes them (the W of a
    zero-bubble schedule), each into `main_grad` or, through autograd, into `.grad`."""

    def __init__(self):
        self._jobs = []

    def __len__(self):
        return len(self._jobs)

    def run(self, *, touch=()):
        """Compute the queued weight gradients: `main_grad` ones in place, the rest summed per weight and handed to
        autograd in one call. `touch`: parameters whose accumulators run in that same call too (with zeros), so
        that every one of them fires its grad hooks exactly once there (DDP's reducer, armed just before)."""
        jobs, self._jobs = self._jobs, []
        edges, grads = {}, {}
        with torch.no_grad():  # as inside backward
            for dz, x, main_grad, dtype, node, slot in jobs:
                grad = ops.linear_wgrad(dz, x, main_grad=main_grad)
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
def defer_wgrad():
    """forward: every linear goes through the Functions (the torch backend's plain F.linear cannot split) ·
    backward: each weight-gradient GEMM is queued in the yielded DeferredWgrads instead of computed."""
    global _deferred
    previous, _deferred = _deferred, DeferredWgrads()
    try:
        yield _deferred
    finally:
        _deferred = previous


def _repeatable(node):
    """Whether autograd may run `node` (the weight's gradient edge) again after backward freed the graph: a
    parameter's accumulator, or a Function that saves no tensors and says so (`repeatable_backward = True`)."""
    return type(node).__name__ == "AccumulateGrad" or getattr(getattr(node, "_forward_cls", None),
                                                              "repeatable_backward", False)


def defer_weight_grad(ctx, index, dz, x):
    """In a linear Function's backward: under defer_wgrad(), queue the weight gradient dzᵀ·x of input `index` for
    later and return True (backward then returns None for it); otherwise False (compute it now)."""
    if _deferred is None:
        return False
    node, slot = ctx.next_functions[index]
    if not _repeatable(node):  # a weight the graph computed (not a parameter): its gradient now
        return False
    _deferred._jobs.append((dz, x, ctx.main_grad, ctx.weight_dtype, node, slot))
    return True
