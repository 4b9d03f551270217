"""Triton counter-based dropout: masks from Philox-4x32-10 (Triton's `tl.philox`, what `tl.randint4x` / `tl.rand`
run), a pure function of a 64-bit key and four 32-bit counters, so any program draws any element's bit without a
stream.

Counters (kernels.dropout's layout, the torch fallback computes the same bits): c0 the column (hidden index, or key
position) // 4, c1 the row (token position, or query position), c2 the head (0 on the residual stream), c3 the
sample's index; an element is kept when Philox's word column % 4 is >= round(p·2³²).
- _dropout_add_kernel: out = residual + keep·(x + bias)/(1 − p) on a row-major [rows, b, h] activation, one program
  per (row, sample) and column block, each Philox call serving four columns (the op is memory-bound: one call per
  element would cost more integer work than the bytes it moves); backward runs it on the output gradient (no
  residual, no bias): the mask is regenerated, never saved.
- _keep_mask_kernel: the keep mask [b, heads, m, n] of attention tiles from the tokens' global positions.
Arithmetic in fp32, one cast at the store (fp64 stays on torch: Triton passes the scale as an fp32 scalar).
"""
import contextlib

import torch
import triton
import triton.language as tl

from .configs import INTERPRET
from .triton_ops import LAUNCHES  # (the tests assert it grows to prove the Triton path ran)

BLOCK = 1024  # columns per program (the hidden size of one row, or a tile's keys)
GRAD_CHUNK = 64  # at most, rows per program of the backward with a bias gradient (partial sums: rows / chunk x h)
GRAD_PROGRAMS = 4096  # fewer rows per program (down to 8) until the grid has this many (each loads one row at a time)


@triton.jit
def _pick(w0, w1, w2, w3, which):
    """w0..w3 (uint32) picked by `which` (0..3, broadcast against them), as int64 (zero-extended)."""
    word = tl.where(which == 0, w0, tl.where(which == 1, w1, tl.where(which == 2, w2, w3)))
    return word.to(tl.int64)


@triton.jit
def _columns(col_block, H, BLOCK: tl.constexpr):
    """A column block as [BLOCK/4, 4]: its groups of four columns [BLOCK/4] (a Philox call each), each column's word
    [1, 4], the columns, and which are inside the row."""
    groups = col_block * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    which = tl.arange(0, 4)[None, :]
    cols = groups[:, None] * 4 + which
    return groups, which, cols, cols < H


@triton.jit
def _kept_row(x_ptr, bias_ptr, samples_ptr, positions_ptr, row, col_block, B, H, key, threshold, scale,
              HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """keep·(x + bias)·scale of one (token, sample) row's column block in fp32 [BLOCK/4, 4], with its offsets and
    in-bounds mask."""
    groups, which, cols, inside = _columns(col_block, H, BLOCK)
    c0 = groups[:, None].to(tl.uint32)  # [BLOCK/4, 1]: the words broadcast over the four columns in place
    zero = c0 * 0
    position = tl.load(positions_ptr + row // B).to(tl.uint32)  # (truncated to the low 32 bits)
    sample = tl.load(samples_ptr + row % B).to(tl.uint32)
    w0, w1, w2, w3 = tl.philox(key, c0, zero + position, zero, zero + sample)
    keep = _pick(w0, w1, w2, w3, which) >= threshold
    offsets = row.to(tl.int64) * H + cols
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    return tl.where(keep, x * scale, 0.0), offsets, inside


@triton.jit
def _dropout_add_kernel(x_ptr, residual_ptr, bias_ptr, out_ptr, samples_ptr, positions_ptr, B, H, key, threshold,
                        scale, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # (token, sample) row of [rows, b, h]
    y, offsets, inside = _kept_row(x_ptr, bias_ptr, samples_ptr, positions_ptr, row, tl.program_id(1), B, H, key,
                                   threshold, scale, HAS_BIAS, BLOCK)
    if HAS_RESIDUAL:
        y += tl.load(residual_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _dropout_grad_kernel(grad_ptr, dx_ptr, partial_ptr, samples_ptr, positions_ptr, ROWS, B, H, key, threshold,
                         scale, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """dx = keep·grad·scale over CHUNK rows, and the column sums of the stored (rounded) dx into partial [chunk, H]
    in fp32: the bias gradient's first stage, in the same pass."""
    chunk = tl.program_id(0)
    _groups, _which, cols, inside = _columns(tl.program_id(1), H, BLOCK)
    total = tl.zeros([BLOCK // 4, 4], dtype=tl.float32)
    for i in range(CHUNK):
        row = tl.minimum(chunk * CHUNK + i, ROWS - 1)  # (the last chunk's tail repeats the last row, not stored)
        dx, offsets, _inside = _kept_row(grad_ptr, grad_ptr, samples_ptr, positions_ptr, row, tl.program_id(1), B,
                                         H, key, threshold, scale, False, BLOCK)
        dx = dx.to(dx_ptr.dtype.element_ty)
        valid = tl.full([BLOCK // 4, 4], chunk * CHUNK + i, tl.int32) < ROWS
        tl.store(dx_ptr + offsets, dx, mask=inside & valid)
        total += tl.where(valid, dx.to(tl.float32), 0.0)
    tl.store(partial_ptr + chunk.to(tl.int64) * H + cols, total, mask=inside)


@triton.jit
def _keep_mask_kernel(out_ptr, samples_ptr, rows_ptr, cols_ptr, HEADS, M, N, first_head, key, threshold,
                      BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # (sample, head, row) of [b, heads, m, n]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < N
    col = tl.load(cols_ptr + cols, mask=inside, other=0).to(tl.uint32)  # (the low 32 bits)
    zero = col * 0
    row = tl.load(rows_ptr + pid % M).to(tl.uint32)
    head = (first_head + (pid // M) % HEADS).to(tl.uint32)
    sample = tl.load(samples_ptr + pid // (M * HEADS)).to(tl.uint32)
    w0, w1, w2, w3 = tl.philox(key, col >> 2, zero + row, zero + head, zero + sample)
    keep = _pick(w0, w1, w2, w3, col & 3) >= threshold
    tl.store(out_ptr + pid.to(tl.int64) * N + cols, keep.to(tl.int8), mask=inside)


def _check_device(*tensors):
    if not tensors[0].is_cuda and not INTERPRET:
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before kernels.dropout_triton "
                           "is imported; use the torch backend instead")


def _block(n):
    return min(BLOCK, triton.next_power_of_2(max(n, 16)))


def dropout_add(x: torch.Tensor, residual: torch.Tensor | None, bias: torch.Tensor | None, *, key: int,
                threshold: int, scale: float, samples: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """residual + keep·(x + bias)·scale for contiguous fp16/bf16/fp32 x [rows, b, h] (residual like x, bias [h]);
    samples [b] and positions [rows] int64 on x's device. Output in x's dtype promoted with the residual's."""
    _check_device(x)
    rows, b, h = x.shape
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = _block(h)
    LAUNCHES["dropout_add"] += 1
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _dropout_add_kernel[(rows * b, triton.cdiv(h, block))](
            x, residual if residual is not None else x, bias if bias is not None else x, out, samples, positions,
            b, h, key, threshold, scale, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK=block)
    return out


def dropout_grad(grad: torch.Tensor, *, key: int, threshold: int, scale: float, samples: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx = keep·grad·scale in grad's dtype, the bias gradient: dx's sum over its rows in fp32) for contiguous grad
    [rows, b, h], in one pass over grad (the column sums of each chunk of rows in the kernel, then over the chunks)."""
    _check_device(grad)
    rows, b, h = grad.shape
    dx = torch.empty_like(grad)
    if dx.numel() == 0:
        return dx, torch.zeros(h, dtype=torch.float32, device=grad.device)
    block = _block(h)
    col_blocks, chunk = triton.cdiv(h, block), GRAD_CHUNK
    while chunk > 8 and triton.cdiv(rows * b, chunk) * col_blocks < GRAD_PROGRAMS:  # (partials: 2/chunk of the bytes)
        chunk //= 2
    chunks = triton.cdiv(rows * b, chunk)
    partial = torch.empty(chunks, h, dtype=torch.float32, device=grad.device)  # [rows·b / chunk, h]
    LAUNCHES["dropout_add"] += 1
    with torch.cuda.device(grad.device) if grad.is_cuda else contextlib.nullcontext():
        _dropout_grad_kernel[(chunks, col_blocks)](
            grad, dx, partial, samples, positions, rows * b, b, h, key, threshold, scale, CHUNK=chunk, BLOCK=block)
    return dx, partial.sum(0)


def keep_mask(*, key: int, threshold: int, samples: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
              heads: int, first_head: int) -> torch.Tensor:
    """The bool keep mask [b, heads, m, n] for int64 samples [b], rows [m], cols [n] on one device."""
    _check_device(samples)
    out = torch.empty(len(samples), heads, len(rows), len(cols), dtype=torch.int8, device=samples.device)
    if out.numel() == 0:
        return out.bool()
    block = _block(len(cols))
    LAUNCHES["keep_mask"] += 1
    with torch.cuda.device(samples.device) if samples.is_cuda else contextlib.nullcontext():
        _keep_mask_kernel[(len(samples) * heads * len(rows), triton.cdiv(len(cols), block))](
            out, samples, rows, cols, heads, len(rows), len(cols), first_head, key, threshold, BLOCK=block)
    return out.view(torch.bool)

