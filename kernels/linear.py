"""kernels.linear: a differentiable y = act(x @ weight.T + bias) built only on the dispatched primitives of ops.py,
so the same code runs the fused Triton kernels on GPU (or under TRITON_INTERPRET=1) and eager torch elsewhere.

What the backward keeps from the forward: x (flattened to 2-D), the weight and, when there is an activation, the
pre-activation z = x·Wᵀ + b. Recomputing z in the backward would cost a full extra GEMM per layer; storing it costs one
[tokens, N] activation (the same size as the output), which is the trade Megatron and Liger make too.

The tensor-parallel layers (tp.layers) run their own Function over the same primitives, with the collectives, the
data-parallel checks and the pipeline's deferred weight gradients that a local matmul must not know about.
"""
import torch
import torch.nn.functional as F

from . import fp8, ops, torch_ops
from .first_order import first_order


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           activation: str | None = None, fp8_recipe: str | None = None) -> torch.Tensor:
    """act(x @ weight.T + bias) for x [..., K], weight [N, K] (any strides), bias [N] or None.

    activation: None, "gelu" (erf), "gelu_tanh", "silu", "relu" or "swiglu" (fused weight [2F, K], gate rows first,
    output silu(x·Wgᵀ + bg) ⊙ (x·Wuᵀ + bu) of width F). The output has x's dtype. If `weight.main_grad` exists
    (an fp32 [N, K] buffer) the weight gradient is accumulated into it in place and weight.grad is left untouched.
    fp8_recipe: None, or one of kernels.fp8.FP8_RECIPES ("tensorwise", "rowwise"): the three GEMMs in float8 (x and
    the weight e4m3, the output gradient e5m2 under tensorwise and e4m3 under rowwise; weight dims multiples of 16).
    """
    ops.check_activation(activation)
    _check_operands(x, weight, bias, activation)
    fp8.check_features(fp8_recipe, weight.shape[1], weight.shape[0], "the weight")
    if fp8_recipe is None and ops.backend_for(x) == "torch" and not hasattr(weight, "main_grad"):
        # Nothing to fuse or accumulate: autograd's own ops are the same math with less Python per call.
        return torch_ops.activation_forward(F.linear(x, weight, bias), activation)
    return _LinearFunction.apply(x, weight, bias, activation, fp8_recipe and fp8.Fp8Scaling(fp8_recipe))


def _check_operands(x, weight, bias, activation):
    """One line, the same on every backend, for operands none of them takes."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} features but weight is {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [out_features] = ({weight.shape[0]},), got shape {tuple(bias.shape)}")
    if activation == "swiglu" and weight.shape[0] % 2:
        raise ValueError(f"activation='swiglu' needs an even number of weight rows (gate, up), got weight shape "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"x is {x.dtype} but weight is {weight.dtype} (outside autocast the operands share one dtype)")


def swiglu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  fp8_recipe: str | None = None) -> torch.Tensor:
    """linear(x, weight, bias, activation="swiglu"): weight is the fused [2F, K] gate/up matrix."""
    return linear(x, weight, bias, activation="swiglu", fp8_recipe=fp8_recipe)


def _flatten(t):
    # [..., K] -> [tokens, K]; reshape(-1, K) would be ambiguous for K == 0.
    return t.reshape(t.shape[:-1].numel(), t.shape[-1])


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation, fp8_scaling):
        ctx.main_grad = getattr(weight, "main_grad", None)  # on the parameter, not on an autocast copy of it
        ctx.x_shape, ctx.bias_dtype = x.shape, None if bias is None else bias.dtype
        x, weight, bias = ops.autocast_operands(x, weight, bias)
        x2d = _flatten(x)
        ctx.kept = keeps_operands(fp8_scaling, x2d, weight)
        if ctx.kept:  # x cast once: the wgrad's too, saved at one byte an element (unless its producer keeps x)
            y, preact, x8 = fp8.linear_forward_keeping_input(x2d, weight, bias, activation, fp8=fp8_scaling,
                                                             fused_cast=ops.fused_kernels(x.device))
            ctx.x_dtype, ctx.recast = x8.dtype, getattr(x, KEPT_BY_PRODUCER, False)
            x2d = x2d if ctx.recast else x8.data
        else:
            y, preact = ops.linear_forward(x2d, weight, bias, activation, fp8=fp8_scaling)
        ctx.save_for_backward(x2d, weight, preact, *((x8.scale,) if ctx.kept else ()))
        ctx.activation, ctx.fp8 = activation, fp8_scaling
        # detach: a plain tensor rather than a view of one made in here, so callers may modify it in place (the
        # row-parallel layer all-reduces its matmul output in its own storage).
        return y.view(*x.shape[:-1], y.shape[-1]).detach()

    @staticmethod
    @first_order
    def backward(ctx, grad_y):
        x2d, weight, preact, *x_scale = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_2d = _flatten(grad_y).to(weight.dtype)
        # dz (= grad through the activation) comes back even without dx: wgrad and dbias reuse it.
        grad_x, dz, dz_for_w = dgrad_and_wgrad_operand(ctx, grad_2d, weight, preact, need_x)
        if ctx.kept:
            x2d = kept_input(ctx, x2d, x_scale[0])
        # With main_grad: accumulated in place (α = β = 1), no low-precision dW, weight.grad stays None.
        grad_w = ops.linear_wgrad(dz_for_w, x2d, main_grad=ctx.main_grad, fp8=ctx.fp8) if need_w else None
        grad_b = ops.bias_grad(dz, ctx.bias_dtype) if need_b else None
        return (None if grad_x is None else grad_x.view(ctx.x_shape)), grad_w, grad_b, None, None


# Set (True) on a tensor whose producer keeps it for backward anyway (tp.recompute's DiscardedOutput refills a norm's
# output then): a tensorwise fp8 linear saves it as it is rather than an e4m3 copy beside it, and casts it again in
# its wgrad under the forward's scale (the same bits; no amax, no all-reduce).
KEPT_BY_PRODUCER = "kept_by_producer"


def kept_input(ctx, saved: torch.Tensor, scale: torch.Tensor) -> fp8.Fp8Operand:
    """The x a linear Function kept for its wgrad, as an Fp8Operand: its e4m3 cast, or (ctx.recast) x cast again."""
    if ctx.recast:
        return fp8.cast_kept(saved, scale, fused_cast=ops.fused_kernels(saved.device))
    return fp8.Fp8Operand(saved, scale, ctx.x_dtype)


def keeps_operands(fp8_scaling: fp8.Fp8Scaling | None, x2d: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a linear's Function keeps the fp8 casts of x and dz for its wgrad (kernels.fp8.keeps_operands), its
    operands non-empty."""
    return fp8.keeps_operands(fp8_scaling) and x2d.numel() > 0 and weight.numel() > 0


def dgrad_and_wgrad_operand(ctx, grad_2d: torch.Tensor, weight: torch.Tensor, preact: torch.Tensor | None,
                            need_input_grad: bool
                            ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | fp8.Fp8Operand]:
    """A linear Function's dgrad -> (grad_input or None, dz, the dz its wgrad takes: the fp8 cast the dgrad kept
    when `ctx.kept`, else dz)."""
    if not ctx.kept:
        grad_x, dz = ops.linear_dgrad(grad_2d, weight, preact, ctx.activation, need_input_grad=need_input_grad,
                                      fp8=ctx.fp8)
        return grad_x, dz, dz
    grad_x, dz, dz8 = fp8.linear_dgrad_keeping_grad(grad_2d, weight, preact, ctx.activation, fp8=ctx.fp8,
                                                    need_input_grad=need_input_grad,
                                                    fused_cast=ops.fused_kernels(grad_2d.device))
    return grad_x, dz, dz if dz8 is None else dz8
