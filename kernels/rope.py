"""Fused rotary position embedding (RoPE, rotate-half convention: Hugging Face's and Megatron's), as Liger-Kernel's
rope: y = x·cos + rotate_half(x)·sin on q and k heads [b, n, s, d] in one pass, backward the transposed rotation
(dx = dy·cos − rotate_half(dy·sin), the same kernel with sin negated). The caller (models/rope.py) builds cos and sin
(its tables, or per-token angles for documents) and takes care of the layouts it supports: a partial rotation
(rotary_percent: the kernel runs on the rotated slice) and interleaved pairs (reordered before the rotation).

Layout (Liger's): the jit kernel, its host launcher, the custom op torch.compile sees as one op, the autograd
Function and the public `apply_rope` at the bottom.
- _rope_kernel: one program per (sample, head) and BLOCK_S positions, both halves of each row at once: x1·cos −
  x2·sin and x2·cos + x1·sin (cos and sin are the same on both halves: the angles are cat(freqs, freqs)); any
  strides over (b, n, s) with d contiguous, the output contiguous [b, n, s, d]. Arithmetic in fp32 (fp64 for fp64).
Importing this module imports triton: the caller imports it only where kernels.ops.fused_kernels says it runs.
"""
import torch
import triton
import triton.language as tl

from .opaque import opaque_under_compile
from .rms_norm import launch_device, warps
from .triton_ops import LAUNCHES

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, N, S, HALF, stride_xb, stride_xn, stride_xs, stride_cb,
                 stride_cs, SIGN: tl.constexpr, FP64: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    acc = tl.float64 if FP64 else tl.float32
    head = tl.program_id(0)  # sample · N + head
    b, n = head // N, head % N
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    j = tl.arange(0, BLOCK_D)
    inside = (s < S)[:, None] & (j < HALF)[None, :]
    x_row = x_ptr + b.to(tl.int64) * stride_xb + n.to(tl.int64) * stride_xn + s.to(tl.int64)[:, None] * stride_xs
    x1 = tl.load(x_row + j[None, :], mask=inside, other=0.0).to(acc)
    x2 = tl.load(x_row + HALF + j[None, :], mask=inside, other=0.0).to(acc)
    angle = b.to(tl.int64) * stride_cb + s.to(tl.int64)[:, None] * stride_cs + j[None, :]
    cos = tl.load(cos_ptr + angle, mask=inside, other=0.0).to(acc)
    sin = tl.load(sin_ptr + angle, mask=inside, other=0.0).to(acc) * SIGN  # (backward: the inverse rotation)
    out_row = out_ptr + head.to(tl.int64) * S * 2 * HALF + s.to(tl.int64)[:, None] * 2 * HALF
    tl.store(out_row + j[None, :], (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(out_row + HALF + j[None, :], (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=inside)


@opaque_under_compile("rope")
def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x [b, n, s, d] (d contiguous) rotated by cos/sin [b or 1, s, d/2] (contiguous, the angles once): contiguous."""
    b, n, s, d = x.shape
    out = torch.empty((b, n, s, d), dtype=x.dtype, device=x.device)
    if out.numel():
        block_d = triton.next_power_of_2(d // 2)
        block_s = max(1, min(64, 2048 // block_d, triton.next_power_of_2(s)))
        LAUNCHES["rope"] += 1
        with launch_device(x):
            _rope_kernel[(b * n, triton.cdiv(s, block_s))](
                x, cos, sin, out, n, s, d // 2, x.stride(0), x.stride(1), x.stride(2),
                cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), SIGN=-1.0 if inverse else 1.0,
                FP64=x.dtype == torch.float64, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=warps(block_s * block_d))
    return out


@_rope.register_fake
def _(x, cos, sin, inverse):
    return x.new_empty(x.shape)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope(x, cos, sin, False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rope(grad if grad.stride(-1) == 1 else grad.contiguous(), cos, sin, True), None, None


def supports(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the kernel covers these operands (else the caller keeps its torch code): a float x [b, n, s, d] with
    an even d and cos of its dtype [s, d] or [b, 1, s, d]; gradients for x only."""
    return (x.dim() == 4 and x.dtype in DTYPES and x.shape[-1] % 2 == 0 and cos.dtype == x.dtype
            and cos.shape[-2:] == x.shape[-2:] and cos.dim() in (2, 4) and not cos.requires_grad)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin for x [b, n, s, d] and the angles' cos/sin [s, d] (one table for every sample)
    or [b, 1, s, d] (per sample), in one kernel forward and one backward: a contiguous [b, n, s, d] in x's dtype."""
    if not supports(x, cos):
        raise ValueError(f"apply_rope: x {x.dtype} {tuple(x.shape)} with cos {cos.dtype} {tuple(cos.shape)} is not "
                         "supported")
    cos, sin = (t.reshape(-1, *t.shape[-2:])[..., : x.shape[-1] // 2].contiguous() for t in (cos, sin))
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _Rope.apply(x, cos, sin)
