"""Eager torch implementation of the local-matmul primitives: the CPU fallback and the tests' reference.

Every primitive works on 2-D tensors: x [M, K], weight [N, K] (nn.Linear orientation), output [M, N].
The gated activation "swiglu" reads a fused weight [2F, K] (gate rows first, then up rows) and gives [M, F].
"""
import math

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "gelu", "gelu_tanh", "silu", "relu", "swiglu")


def check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")


def activation_forward(z, activation):
    """act(z) computed in fp32, cast back to z's dtype."""
    zf = z.float()
    if activation is None:
        return z
    if activation == "gelu":
        out = F.gelu(zf)
    elif activation == "gelu_tanh":
        out = F.gelu(zf, approximate="tanh")
    elif activation == "silu":
        out = F.silu(zf)
    elif activation == "relu":
        out = F.relu(zf)
    else:  # swiglu: [M, 2F] -> [M, F]
        gate, up = zf.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out.to(z.dtype)


def activation_backward(grad_out, z, activation):
    """d act(z) / dz · grad_out, in fp32, cast back to grad_out's dtype ([M, 2F] for swiglu)."""
    if activation is None:
        return grad_out
    g, zf = grad_out.float(), z.float()
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(zf * (1.0 / math.sqrt(2.0))))
        pdf = torch.exp(-0.5 * zf * zf) * (1.0 / math.sqrt(2.0 * math.pi))
        dz = g * (cdf + zf * pdf)
    elif activation == "gelu_tanh":
        k = math.sqrt(2.0 / math.pi)
        inner = k * (zf + 0.044715 * zf**3)
        t = torch.tanh(inner)
        dz = g * (0.5 * (1.0 + t) + 0.5 * zf * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * zf * zf))
    elif activation == "silu":
        s = torch.sigmoid(zf)
        dz = g * s * (1.0 + zf * (1.0 - s))
    elif activation == "relu":
        dz = g * (zf > 0)
    else:  # swiglu
        gate, up = zf.chunk(2, dim=-1)
        s = torch.sigmoid(gate)
        dgate = g * up * s * (1.0 + gate * (1.0 - s))
        dup = g * gate * s
        dz = torch.cat([dgate, dup], dim=-1)
    return dz.to(grad_out.dtype)


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
        main_grad.addmm_(dz.t().to(main_grad.dtype), x.to(main_grad.dtype))
        return None
    return dz.t() @ x
