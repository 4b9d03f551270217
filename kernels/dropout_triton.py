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


@triton.jit
def _pick(w0, w1, w2, w3, which):
    """w0..w3 (uint32) picked by `which` (0..3, broadcast against them), as int64 (zero-extended)."""
    word = tl.where(which == 0, w0, tl.where(which == 1, w1, tl.where(which == 2, w2, w3)))
    return word.to(tl.int64)


@triton.jit
def _dropout_add_kernel(x_ptr, residual_ptr, bias_ptr, out_ptr, samples_ptr, positions_ptr, B, H, key, threshold,
                        scale, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # (token, sample) row of [rows, b, h]
    groups = tl.program_id(1) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)  # [BLOCK/4]: four columns each
    which = tl.arange(0, 4)[None, :]
    cols = groups[:, None] * 4 + which  # [BLOCK/4, 4]
    inside = cols < H
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
    y = tl.where(keep, x * scale, 0.0)
    if HAS_RESIDUAL:
        y += tl.load(residual_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=inside)


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

