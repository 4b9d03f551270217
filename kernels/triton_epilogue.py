"""The third candidate of backend "auto" (ops.BACKENDS["triton_epilogue"]): torch's GEMM (cuBLAS on a GPU, the bias
in its epilogue) with Triton's elementwise passes around it. Same contract as kernels.torch_ops / kernels.triton_ops.

- forward: z = x·Wᵀ + b by torch, then one Triton pass y = act(z) (SwiGLU: silu(gate)·up reading z's two halves,
  where torch runs two passes and a temporary); z is the saved pre-activation, as in the other backends;
- dgrad: kernels.triton_ops' act' pass (dz = g·act'(z), one pass), then dx = dz·W by torch;
- wgrad: torch's.

Where the Triton GEMM loses to cuBLAS on a shape but the fused elementwise pass still pays, "auto" can take both.
"""
import torch
import triton
import triton.language as tl

from . import torch_ops, triton_ops
from .activations import act_fwd, swiglu_fwd
from .configs import INTERPRET
from .dtypes import TRITON_DTYPES
from .opaque import opaque_under_compile
from .triton_ops import LAUNCHES, device_of

__all__ = ["linear_forward", "linear_dgrad", "linear_wgrad"]


@triton.jit
def _act_fwd_kernel(z_ptr, y_ptr, M, F, stride_zm, stride_zn, stride_ym, stride_yn, ACTIVATION: tl.constexpr,
                    ACC_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # y [M, F] = act(z); for swiglu z is [M, 2F]: gate = z[:, :F], up = z[:, F:]
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < F)
    z_ptrs = z_ptr + offs_m[:, None] * stride_zm + offs_n[None, :] * stride_zn
    if ACTIVATION == "swiglu":
        gate = tl.load(z_ptrs, mask=mask, other=0.0).to(ACC_DTYPE)
        up = tl.load(z_ptrs + F * stride_zn, mask=mask, other=0.0).to(ACC_DTYPE)
        y = swiglu_fwd(gate, up)
    else:
        y = act_fwd(tl.load(z_ptrs, mask=mask, other=0.0).to(ACC_DTYPE), ACTIVATION)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty),
             mask=mask)


@opaque_under_compile("epilogue_act_fwd")
def _act_fwd(z: torch.Tensor, activation: str, F: int) -> torch.Tensor:
    M = z.shape[0]
    y = torch.empty(M, F, dtype=z.dtype, device=z.device)
    if M and F:
        LAUNCHES["act_fwd"] += 1
        block = 32 if INTERPRET else 64
        acc = tl.float64 if z.dtype == torch.float64 else tl.float32
        with device_of(z):
            _act_fwd_kernel[(triton.cdiv(M, block), triton.cdiv(F, block))](
                z, y, M, F, z.stride(0), z.stride(1), y.stride(0), y.stride(1), ACTIVATION=activation,
                ACC_DTYPE=acc, BLOCK_M=block, BLOCK_N=block)
    return y


@opaque_under_compile("epilogue_act_bwd")
def _act_bwd(grad_out: torch.Tensor, weight: torch.Tensor, preact: torch.Tensor, activation: str) -> torch.Tensor:
    return triton_ops.linear_dgrad(grad_out, weight, preact, activation, need_input_grad=False)[1]


@_act_fwd.register_fake
def _(z, activation, F):
    return z.new_empty(z.shape[0], F)


@_act_bwd.register_fake
def _(grad_out, weight, preact, activation):
    return grad_out.new_empty(preact.shape)


def linear_forward(x, weight, bias=None, activation=None):
    """y = act(x @ weight.T + bias) -> (y, pre-activation or None); see torch_ops.linear_forward."""
    torch_ops.check_activation(activation)
    if activation is None or x.dtype not in TRITON_DTYPES:
        return torch_ops.linear_forward(x, weight, bias, activation)
    z = torch.nn.functional.linear(x, weight, bias)  # [M, rows]
    if activation == "swiglu" and z.shape[1] % 2:
        raise ValueError(f"swiglu needs an even number of output rows, got weight {tuple(weight.shape)}")
    return _act_fwd(z, activation, z.shape[1] // 2 if activation == "swiglu" else z.shape[1]), z


def linear_dgrad(grad_out, weight, preact=None, activation=None, *, need_input_grad=True):
    """-> (grad_input = dz @ weight or None, dz = grad_out · act'(preact)); see torch_ops.linear_dgrad."""
    if activation is None or grad_out.dtype not in TRITON_DTYPES:
        return torch_ops.linear_dgrad(grad_out, weight, preact, activation, need_input_grad=need_input_grad)
    dz = _act_bwd(grad_out, weight, preact, activation)
    return (dz @ weight if need_input_grad else None), dz


linear_wgrad = torch_ops.linear_wgrad
