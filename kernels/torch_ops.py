"""Eager torch implementation of the local-matmul primitives: the CPU fallback and the tests' reference.

Every primitive works on 2-D tensors: x [M, K], weight [N, K] (nn.Linear orientation), output [M, N].
The gated activation "swiglu" reads a fused weight [2F, K] (gate rows first, then up rows) and gives [M, F].
"""
import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "gelu", "gelu_tanh", "silu", "relu", "swiglu")


def check_activation(activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")


def _acc(t):
    """t at accumulator precision: fp32 for 16-bit dtypes, t itself otherwise (fp32 stays fp32, fp64 stays fp64)."""
    return t.float() if t.element_size() < 4 else t


# Native elementwise ops compute in fp32 internally for 16-bit inputs and round once, like the Triton epilogue,
# and each is one fused kernel (a hand-written erf/exp formula would be ~8 passes over the tensor).
_FORWARD = {
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}
_BACKWARD = {
    "gelu": lambda g, z: torch.ops.aten.gelu_backward(g, z),
    "gelu_tanh": lambda g, z: torch.ops.aten.gelu_backward(g, z, approximate="tanh"),
    "silu": torch.ops.aten.silu_backward,
    "relu": lambda g, z: torch.ops.aten.threshold_backward(g, z, 0),
}


def activation_forward(z, activation):
    """act(z), computed at accumulator precision and rounded once to z's dtype ([M, 2F] -> [M, F] for swiglu)."""
    if activation is None:
        return z
    if activation == "swiglu":
        gate, up = _acc(z).chunk(2, dim=-1)
        return (F.silu(gate) * up).to(z.dtype)
    return _FORWARD[activation](z)


def activation_backward(grad_out, z, activation):
    """grad_out · act'(z) at accumulator precision, in grad_out's dtype ([M, 2F] for swiglu)."""
    if activation is None:
        return grad_out
    if activation == "swiglu":
        g = _acc(grad_out)
        gate, up = _acc(z).chunk(2, dim=-1)
        s = torch.sigmoid(gate)
        dgate = g * up * s * (1.0 + gate * (1.0 - s))
        return torch.cat([dgate, g * gate * s], dim=-1).to(grad_out.dtype)
    return _BACKWARD[activation](grad_out, z.to(grad_out.dtype))


def linear_forward(x, weight, bias=None, activation=None):
    """y = act(x @ weight.T + bias) -> (y [M, N'], pre-activation [M, N] saved for backward, or None)."""
    z = F.linear(x, weight, bias)
    if activation is None:
        return z, None
    return activation_forward(z, activation), z


def linear_dgrad(grad_out, weight, preact=None, activation=None, *, need_input_grad=True):
    """-> (grad_input [M, K] = dz @ weight, or None; dz [M, N] = grad_out · act'(preact))."""
    dz = activation_backward(grad_out, preact, activation)
    return (dz @ weight if need_input_grad else None), dz


def linear_wgrad(dz, x, *, main_grad=None):
    """dW [N, K] = dzᵀ @ x; with an fp32 main_grad, accumulate into it in place and return None."""
    if main_grad is not None:
        accumulate_mm(main_grad, dz.t(), x)
        return None
    return dz.t() @ x


# Devices whose GEMM takes fp16/bf16 operands and writes fp32 (torch.mm's out_dtype: cuBLAS; "meta" has its shapes)
_FP32_OUT_DEVICES = ("cuda", "meta")


def accumulate_mm(main_grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """main_grad += a @ b in main_grad's precision: on CUDA the half-precision operands as they are, the product
    written in fp32 (accumulated in fp32 either way); elsewhere both operands upcast first."""
    if main_grad.dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16) and b.dtype == a.dtype and \
            a.device.type in _FP32_OUT_DEVICES:
        main_grad.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        main_grad.addmm_(a.to(main_grad.dtype), b.to(main_grad.dtype))
