"""Triton jit helpers for the activations fused into the matmul kernels.

All helpers take and return blocks in the accumulator precision (fp32; fp64 for fp64 inputs): the kernels upcast
before calling them (bf16 elementwise math gives NaN under the interpreter, and fp32 is what the GPU epilogue uses
anyway). Only tl.exp / tl.erf are used:
libdevice (tanh, ...) raises under the interpreter, and the same formulas compile on Triton 3.6 and 3.9.
The activation is a constexpr string ("none", "gelu", "gelu_tanh", "silu", "relu"), so each kernel
specialisation contains only its own branch.
"""
import triton
import triton.language as tl

_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1/sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1/sqrt(2*pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2/pi)
_GELU_TANH_C = tl.constexpr(0.044715)
# (Module constants go on the right of a block: under the interpreter `constexpr * block` wraps the block in a
# constexpr, which tl.exp then rejects.)


@triton.jit
def _sigmoid(x):
    # exp(-x) overflows to inf for very negative x, giving 1/inf = 0: the right limit, no NaN.
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # 1 - 2/(1+e^{2x}) saturates cleanly to ±1 at both ends (e^{2x} -> inf or 0), unlike (e^x-e^-x)/(e^x+e^-x).
    return 1.0 - 2.0 / (1.0 + tl.exp(2.0 * x))


@triton.jit
def act_fwd(z, ACTIVATION: tl.constexpr):
    """act(z) for the elementwise (non-gated) activations."""
    if ACTIVATION == "gelu":
        return 0.5 * z * (1.0 + tl.erf(z * _SQRT1_2))
    elif ACTIVATION == "gelu_tanh":
        return 0.5 * z * (1.0 + _tanh((z + z * z * z * _GELU_TANH_C) * _SQRT_2_OVER_PI))
    elif ACTIVATION == "silu":
        return z * _sigmoid(z)
    elif ACTIVATION == "relu":
        return tl.maximum(z, 0.0)
    else:
        return z


@triton.jit
def act_bwd(g, z, ACTIVATION: tl.constexpr):
    """g · act'(z) for the elementwise (non-gated) activations."""
    if ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.erf(z * _SQRT1_2))
        pdf = tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
        return g * (cdf + z * pdf)
    elif ACTIVATION == "gelu_tanh":
        t = _tanh((z + z * z * z * _GELU_TANH_C) * _SQRT_2_OVER_PI)
        dinner = (1.0 + z * z * _GELU_TANH_C * 3.0) * _SQRT_2_OVER_PI
        return g * (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * dinner)
    elif ACTIVATION == "silu":
        s = _sigmoid(z)
        return g * s * (1.0 + z * (1.0 - s))
    elif ACTIVATION == "relu":
        return tl.where(z > 0.0, g, 0.0)
    else:
        return g


@triton.jit
def swiglu_fwd(gate, up):
    return gate * _sigmoid(gate) * up


@triton.jit
def swiglu_bwd(g, gate, up):
    """-> (d gate, d up) of silu(gate) · up."""
    s = _sigmoid(gate)
    silu = gate * s
    return g * up * s * (1.0 + gate * (1.0 - s)), g * silu
