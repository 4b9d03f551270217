"""Fused RMSNorm with the residual add (Liger-Kernel's fused_add_rms_norm, Hugging Face's RMSNorm numerics):
s = x + residual, out = weight · (s · rstd) with rstd = 1/√(mean(s²) + eps), the statistics in fp32 whatever s's
dtype (HF's `hidden_states.to(torch.float32)`, fp64 included), the normalised s cast to s's dtype before the weight
multiplies it in the output's dtype (HF's `weight * hidden.to(input_dtype)`).

Layout (Liger's): the jit kernels, the host launchers, the custom ops torch.compile sees as one op each, and the
autograd Function with its public entry `rms_norm` at the bottom.
- _rms_norm_forward_kernel: ROWS rows per program, the whole hidden size in one tile: reads x (and the residual),
  writes out, s (the new residual stream) and rstd [rows] (fp32) for backward. One read, two writes.
- _rms_norm_backward_kernel: dx = rstd·(dn − n·mean(dn·n)) with n = s·rstd and dn = dy·weight, plus the gradient
  arriving on s; each program also sums dy·n over its rows into one fp32 row of dweight partials (summed by torch
  after: no atomics, deterministic).
Importing this module imports triton: the dispatch (models/norm.py) imports it only when kernels.ops.fused_kernels
says the fused kernels run.
"""
import contextlib

import torch
import triton
import triton.language as tl

from .configs import INTERPRET
from .first_order import first_order
from .opaque import opaque_under_compile
from .triton_ops import LAUNCHES

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HIDDEN = 65536  # one tile per row: a wider row would spill


@triton.jit
def _rms_norm_forward_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, rstd_ptr, rows, H, eps,
                             HAS_RESIDUAL: tl.constexpr, FP64: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK: tl.constexpr):
    acc = tl.float64 if FP64 else tl.float32
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK)
    inside = (row < rows)[:, None] & (col < H)[None, :]
    offsets = row.to(tl.int64)[:, None] * H + col[None, :]
    s = tl.load(x_ptr + offsets, mask=inside, other=0.0)
    if HAS_RESIDUAL:  # rounded to the stream's dtype, as torch's x + residual is
        s = (s.to(acc) + tl.load(residual_ptr + offsets, mask=inside, other=0.0).to(acc)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + offsets, s, mask=inside)
    s = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / H + eps)  # [ROWS]
    normed = (s * rstd[:, None]).to(x_ptr.dtype.element_ty).to(acc)
    weight = tl.load(weight_ptr + col, mask=col < H, other=0.0).to(acc)
    tl.store(out_ptr + offsets, (normed * weight[None, :]).to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(rstd_ptr + row, rstd.to(rstd_ptr.dtype.element_ty), mask=row < rows)


@triton.jit
def _rms_norm_backward_kernel(grad_ptr, grad_sum_ptr, sum_ptr, weight_ptr, rstd_ptr, dx_ptr, dweight_ptr, rows, H,
                              HAS_GRAD_SUM: tl.constexpr, FP64: tl.constexpr, ROWS: tl.constexpr,
                              BLOCK: tl.constexpr):
    acc = tl.float64 if FP64 else tl.float32
    program = tl.program_id(0)
    row = program * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK)
    inside = (row < rows)[:, None] & (col < H)[None, :]
    offsets = row.to(tl.int64)[:, None] * H + col[None, :]
    rstd = tl.load(rstd_ptr + row, mask=row < rows, other=0.0)
    normed = tl.load(sum_ptr + offsets, mask=inside, other=0.0).to(tl.float32) * rstd[:, None]
    grad = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(acc)
    weight = tl.load(weight_ptr + col, mask=col < H, other=0.0).to(acc)
    dnormed = (grad * weight[None, :]).to(tl.float32)
    dx = rstd[:, None] * (dnormed - normed * (tl.sum(dnormed * normed, axis=1) / H)[:, None])
    if HAS_GRAD_SUM:  # the new residual's own gradient joins the norm's, in the stream's dtype
        dx = dx.to(dx_ptr.dtype.element_ty).to(acc) + tl.load(grad_sum_ptr + offsets, mask=inside, other=0.0).to(acc)
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=inside)
    dweight = tl.sum(grad * normed.to(sum_ptr.dtype.element_ty).to(acc), axis=0)  # [BLOCK]
    tl.store(dweight_ptr + program.to(tl.int64) * H + col, dweight, mask=col < H)


def _launch_shape(rows, hidden):
    block = triton.next_power_of_2(max(hidden, 16))
    per_program = max(1, min(16, 4096 // block, triton.next_power_of_2(max(rows, 1))))  # ~4k elements a program
    return block, per_program, triton.cdiv(rows, per_program)


def warps(elements: int) -> int:
    """Warps for a program holding `elements` values per tensor (Liger-Kernel's calculate_settings: wide rows spill
    registers at 4 warps)."""
    return 32 if elements >= 32768 else 16 if elements >= 8192 else 8 if elements >= 2048 else 4


def launch_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Where a fused kernel on `t` launches: its CUDA device, or the interpreter for CPU tensors (which needs
    TRITON_INTERPRET=1 before the kernels were imported: else one line saying so)."""
    if not t.is_cuda and not INTERPRET:
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before the kernels are "
                           "imported; use the torch backend instead")
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@opaque_under_compile("rms_norm_forward")
def _forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, s = x + residual (an empty tensor without a residual: s is x), rstd [rows]) for contiguous x [rows, H]."""
    rows, hidden = x.shape
    fp64 = torch.float64 in (x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    total = torch.empty_like(x) if residual is not None else x.new_empty(0)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if x.numel():
        block, per_program, programs = _launch_shape(rows, hidden)
        LAUNCHES["rms_norm_forward"] += 1
        with launch_device(x):
            _rms_norm_forward_kernel[(programs,)](x, residual if residual is not None else x, weight, out, total,
                                                  rstd, rows, hidden, eps, HAS_RESIDUAL=residual is not None,
                                                  FP64=fp64, ROWS=per_program, BLOCK=block,
                                                  num_warps=warps(per_program * block))
    return out, total, rstd


@opaque_under_compile("rms_norm_backward")
def _backward(grad: torch.Tensor, grad_sum: torch.Tensor | None, total: torch.Tensor, weight: torch.Tensor,
              rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [rows, H] in s's dtype: the norm's gradient plus grad_sum's, dweight [H] in the weight's dtype)."""
    rows, hidden = total.shape
    fp64 = torch.float64 in (total.dtype, weight.dtype)
    dx = torch.empty_like(total)
    block, per_program, programs = _launch_shape(rows, hidden)
    partials = torch.zeros(max(programs, 1), hidden, dtype=torch.float64 if fp64 else torch.float32,
                           device=total.device)
    if total.numel():
        LAUNCHES["rms_norm_backward"] += 1
        with launch_device(total):
            _rms_norm_backward_kernel[(programs,)](grad, grad_sum if grad_sum is not None else grad, total, weight,
                                                   rstd, dx, partials, rows, hidden,
                                                   HAS_GRAD_SUM=grad_sum is not None, FP64=fp64, ROWS=per_program,
                                                   BLOCK=block, num_warps=warps(per_program * block))
    return dx, partials.sum(0).to(weight.dtype)


@_forward.register_fake
def _(x, residual, weight, eps):
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
            torch.empty_like(x) if residual is not None else x.new_empty(0),
            x.new_empty(x.shape[0], dtype=torch.float32))


@_backward.register_fake
def _(grad, grad_sum, total, weight, rstd):
    return torch.empty_like(total), weight.new_empty(weight.shape)


class _FusedAddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        residual2d = None if residual is None else residual.reshape(x2d.shape).contiguous()
        out, total, rstd = _forward(x2d, residual2d, weight.contiguous(), eps)
        total = x2d if residual is None else total
        ctx.save_for_backward(total, weight, rstd)
        ctx.shape, ctx.has_residual = x.shape, residual is not None
        out = out.view(x.shape)
        return (out, total.view(x.shape)) if ctx.has_residual else (out, None)

    @staticmethod
    @first_order
    def backward(ctx, grad_out, grad_sum):
        total, weight, rstd = ctx.saved_tensors
        grad_out = grad_out.reshape(total.shape).contiguous()
        grad_sum = None if grad_sum is None else grad_sum.reshape(total.shape).to(total.dtype).contiguous()
        dx, dweight = _backward(grad_out, grad_sum, total, weight.contiguous(), rstd)
        dx = dx.view(ctx.shape)
        return dx, dx if ctx.has_residual else None, dweight, None


def supports(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether the kernels cover these operands (else the caller keeps its torch code): float dtypes, a weight [H]
    in x's dtype or fp32, a residual like x, H <= MAX_HIDDEN."""
    return (x.dtype in DTYPES and weight.dim() == 1 and weight.shape[0] == x.shape[-1] <= MAX_HIDDEN
            and weight.dtype in (x.dtype, torch.float32) and weight.device == x.device
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight · RMSNorm(s), s) with s = x + residual (s = x without one), for x [..., H] and weight [H], in one
    kernel forward and one backward. The output has x's dtype promoted with the weight's; statistics in fp32.
    Callers check `supports` first."""
    if not supports(x, weight, residual):
        raise ValueError(f"rms_norm kernel: x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} "
                         f"{tuple(weight.shape)}, residual "
                         f"{None if residual is None else (residual.dtype, tuple(residual.shape))} not supported")
    out, total = _FusedAddRMSNorm.apply(x, residual, weight, eps)
    return out, x if total is None else total
