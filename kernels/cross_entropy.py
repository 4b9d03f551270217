"""Fused kernels of the vocabulary-parallel cross-entropy (tp/cross_entropy.py) on this rank's vocabulary shard: one
program per token (the loss is chunked over tokens), each streaming its row of logits in BLOCK-wide pieces, so the
fp32 logits (or softmax) of the whole shard are never materialised, as Liger-Kernel's cross-entropy does; the tp
collectives stay with the caller, between the two kernels.

Layout (Liger's): the jit kernels, the host launchers, the custom ops torch.compile sees as one op each.
- _vocab_stats_kernel: per token, over its real columns: the max logit, Σ exp(logit − max) (online softmax, rescaled
  at each new max; a row all −inf keeps a zero sum), the target logit (0 when the target is on another rank) and,
  for label smoothing, Σ logit: [3 or 4, tokens] in fp32 (fp64 for fp64) for the caller's one all-gather.
- _vocab_grad_kernel: the gradient, (softmax − ε/V − (1 − ε)·onehot) · grad_loss, written in the logits' dtype
  straight from the logits and log Z (nothing saved but the input); padding columns get 0.
Importing this module imports triton: the caller imports it only where kernels.ops.fused_kernels says they run.
"""
import torch
import triton
import triton.language as tl

from .configs import INTERPRET
from .opaque import opaque_under_compile
from .rms_norm import launch_device, warps
from .triton_ops import LAUNCHES

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BLOCK = 4096  # vocabulary columns a step (interpreter: 64, so tests cross several blocks)
INTERPRETER_BLOCK = 64


@triton.jit
def _vocab_stats_kernel(logits_ptr, targets_ptr, stats_ptr, tokens, real, stride, SMOOTHING: tl.constexpr,
                        FP64: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.float64 if FP64 else tl.float32
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    target = tl.load(targets_ptr + row)  # the local column, or -1 when another rank holds it (or it is ignored)
    top = tl.full([], float("-inf"), acc)
    exp_sum = tl.zeros([], acc)
    target_logit = tl.zeros([], acc)
    logit_sum = tl.zeros([], acc)
    for start in range(0, real, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < real, other=float("-inf")).to(acc)
        new_top = tl.maximum(top, tl.max(x, axis=0))
        # shifts as the torch code's: the max where finite, else 0 (exp(−inf − 0) = 0 keeps an empty sum at 0)
        old_shift = tl.where(top > float("-inf"), top, 0.0)
        new_shift = tl.where(new_top > float("-inf"), new_top, 0.0)
        exp_sum = exp_sum * tl.exp(old_shift - new_shift) + tl.sum(tl.exp(x - new_shift), axis=0)
        top = new_top
        target_logit += tl.sum(tl.where(cols == target, x, 0.0), axis=0)
        if SMOOTHING:
            logit_sum += tl.sum(tl.where(cols < real, x, 0.0), axis=0)
    tl.store(stats_ptr + row, top)
    tl.store(stats_ptr + tokens + row, exp_sum)
    tl.store(stats_ptr + 2 * tokens + row, target_logit)
    if SMOOTHING:
        tl.store(stats_ptr + 3 * tokens + row, logit_sum)


@triton.jit
def _vocab_grad_kernel(logits_ptr, targets_ptr, log_z_ptr, grad_loss_ptr, out_ptr, smoothing_ptr, real, stride,
                       FP64: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.float64 if FP64 else tl.float32
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    offsets = row.to(tl.int64) * stride + cols
    x = tl.load(logits_ptr + offsets, mask=cols < real, other=float("-inf")).to(acc)
    grad_loss = tl.load(grad_loss_ptr + row).to(acc)  # 0 for ignored tokens
    target = tl.load(targets_ptr + row)
    # (ε/V, ε − 1) from a tensor in the math dtype: a Python float would reach the kernel as an fp32 scalar
    grad = (tl.exp(x - tl.load(log_z_ptr + row).to(acc)) - tl.load(smoothing_ptr)) * grad_loss
    grad += tl.where(cols == target, tl.load(smoothing_ptr + 1) * grad_loss, 0.0)
    grad = tl.where(cols < real, grad, 0.0)
    tl.store(out_ptr + offsets, grad.to(out_ptr.dtype.element_ty), mask=cols < stride)


def _block(width):
    return min(INTERPRETER_BLOCK if INTERPRET else BLOCK, triton.next_power_of_2(max(width, 16)))


@opaque_under_compile("vocab_stats")
def _stats(logits: torch.Tensor, targets: torch.Tensor, real: int, smoothing: bool) -> torch.Tensor:
    """[3 (4 with smoothing), tokens]: max, Σ exp(x − max), target logit (, Σ x) over the first `real` columns of
    contiguous logits [tokens, V/tp]; targets [tokens] int64 local columns, −1 for none."""
    tokens = logits.shape[0]
    fp64 = logits.dtype == torch.float64
    stats = torch.empty(4 if smoothing else 3, tokens, dtype=torch.float64 if fp64 else torch.float32,
                        device=logits.device)
    if tokens:
        LAUNCHES["vocab_stats"] += 1
        with launch_device(logits):
            _vocab_stats_kernel[(tokens,)](logits, targets, stats, tokens, real, logits.shape[1],
                                           SMOOTHING=smoothing, FP64=fp64, BLOCK=_block(real),
                                           num_warps=warps(_block(real)))
    return stats


@opaque_under_compile("vocab_grad")
def _grad(logits: torch.Tensor, targets: torch.Tensor, log_z: torch.Tensor, grad_loss: torch.Tensor, real: int,
          smoothing: float, vocab_size: int) -> torch.Tensor:
    """The logits' gradient [tokens, V/tp] in their dtype; grad_loss [tokens] already 0 for ignored tokens."""
    out = torch.empty_like(logits)
    constants = log_z.new_empty(2)  # filled on the device: torch.tensor(list) is a host copy, a GPU sync per step
    constants[0], constants[1] = smoothing / vocab_size, smoothing - 1.0
    if out.numel():
        block = _block(logits.shape[1])
        LAUNCHES["vocab_grad"] += 1
        with launch_device(logits):
            _vocab_grad_kernel[(logits.shape[0], triton.cdiv(logits.shape[1], block))](
                logits, targets, log_z, grad_loss, out, constants, real, logits.shape[1],
                FP64=logits.dtype == torch.float64, BLOCK=block, num_warps=warps(block))
    return out


@_stats.register_fake
def _(logits, targets, real, smoothing):
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.new_empty(4 if smoothing else 3, logits.shape[0], dtype=dtype)


@_grad.register_fake
def _(logits, targets, log_z, grad_loss, real, smoothing, vocab_size):
    return torch.empty_like(logits)


def vocab_stats(logits: torch.Tensor, targets: torch.Tensor, *, real: int, smoothing: bool) -> torch.Tensor:
    """[3 or 4, ...]: this shard's max logit, Σ exp(logit − max), target logit (0 off the shard) and, with
    `smoothing`, Σ logit, per token of logits [..., V/tp] over its first `real` columns; targets [...] are local
    column indices, −1 where another rank holds the target (or the token is ignored). fp32 (fp64 for fp64)."""
    flat = logits.reshape(-1, logits.shape[-1]).contiguous()
    stats = _stats(flat, targets.reshape(-1).long().contiguous(), real, smoothing)
    return stats.view(stats.shape[0], *logits.shape[:-1])


def vocab_grad(logits: torch.Tensor, targets: torch.Tensor, log_z: torch.Tensor, grad_loss: torch.Tensor, *,
               real: int, smoothing: float, vocab_size: int) -> torch.Tensor:
    """d loss / d logits [..., V/tp] in the logits' dtype: (exp(logit − log_z) − ε/V − (1 − ε)·onehot(target)) ·
    grad_loss on the first `real` columns, 0 on the rest; grad_loss [...] is 0 for ignored tokens."""
    flat = logits.reshape(-1, logits.shape[-1]).contiguous()
    grad = _grad(flat, targets.reshape(-1).long().contiguous(), log_z.reshape(-1).contiguous(),
                grad_loss.reshape(-1).contiguous(), real, smoothing, vocab_size)
    return grad.view(logits.shape)


def supports(logits: torch.Tensor) -> bool:
    """Whether the kernels cover these logits (else the caller keeps its torch code)."""
    return logits.dtype in DTYPES and logits.dim() >= 1
