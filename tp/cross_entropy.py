"""Vocabulary-parallel cross-entropy on [..., V/tp] logits: the full-vocab logits are never gathered.

Forward: one all-gather of four [tokens]-sized numbers per rank (its max logit, its sum of exps below that max,
the target logit if it holds it, and, for label smoothing, its sum of logits), combined into the log-sum-exp on
every rank (Megatron uses three all-reduces). Backward: local, softmax − smoothed one-hot. Where the fused kernels
run (kernels.ops.fused_kernels: CUDA under "auto"), kernels/cross_entropy.py computes the local numbers and the
gradient token by token from the logits, never holding the shard's fp32 softmax.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import kernels.ops
from kernels.first_order import first_order

from . import debug
from .collectives import gather_first
from .mesh import resolve_group

REDUCTIONS = ("mean", "sum", "none")


def _gather_ranks(stats, group):
    """[k, ...] from every rank -> [ranks, k, ...] (one all-gather; nothing to move on one rank)."""
    if dist.get_world_size(group) == 1:
        return stats.unsqueeze(0)
    return gather_first(stats.contiguous(), group).view(dist.get_world_size(group), *stats.shape)


def _fused(logits):
    """kernels/cross_entropy.py where its fused kernels run for these logits, else None."""
    if not kernels.ops.fused_kernels(logits.device):
        return None
    from kernels import cross_entropy as fused  # (imports triton: only where the fused kernels run)

    return fused if fused.supports(logits) else None


def _local_stats(x, local_targets, on_rank, label_smoothing, compute):
    """Torch: ([3 or 4, ...] stats of this rank's real columns x [..., v], exp(x − shift) [..., v], shift [...])."""
    local_max = x.amax(-1).to(compute) if x.shape[-1] else x.new_full(x.shape[:-1], -torch.inf, dtype=compute)
    target_logit = local_max.new_zeros(local_targets.shape)
    if x.shape[-1]:  # (a rank holding only padding columns has nothing to gather)
        target_logit = x.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).to(compute).masked_fill_(~on_rank, 0)
    logit_sum = [x.sum(-1, dtype=compute)] if label_smoothing else []
    # [..., v] in `compute` (type promotion), <= 1: no overflow; a row all -inf here (masked vocabulary) gives 0s
    shift = torch.where(local_max.isfinite(), local_max, 0.0)
    softmax = (x - shift.unsqueeze(-1)).exp_()
    return torch.stack([local_max, softmax.sum(-1), target_logit, *logit_sum]), softmax, shift


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss [...] from this rank's logits [..., V/tp] (0 where ignored); the input is never modified.
    Where the fused kernels run, the local statistics and the gradient stream the logits token by token (no fp32
    copy of the shard; backward keeps the logits and log Z); else torch keeps the local softmax [..., V/tp]."""

    @staticmethod
    def forward(ctx, logits, targets, label_smoothing, ignore_index, vocab_size, group):
        per_rank = logits.shape[-1]
        vocab_start = dist.get_rank(group) * per_rank
        real = max(0, min(per_rank, vocab_size - vocab_start))  # columns past vocab_size are padding
        x = logits[..., :real]  # [..., v] a view: padding columns never win the softmax nor count in smoothing
        compute = torch.promote_types(logits.dtype, torch.float32)  # 16-bit logits: fp32 math

        valid = targets != ignore_index
        local_targets = targets.long() - vocab_start
        on_rank = valid & (local_targets >= 0) & (local_targets < real)
        local_targets = local_targets.masked_fill(~on_rank, 0)
        ctx.fused = _fused(logits)
        if ctx.fused:
            stats = ctx.fused.vocab_stats(logits, local_targets.masked_fill(~on_rank, -1), real=real,
                                                      smoothing=bool(label_smoothing))
        else:
            stats, softmax, shift = _local_stats(x, local_targets, on_rank, label_smoothing, compute)
        # One collective: every rank's (max, sum of exp below its max, target logit, logit sum), combined here (a
        # rank's -inf max carries a zero sum: exp(-inf - max) * 0 = 0).
        stats = _gather_ranks(stats, group)
        global_max = stats[:, 0].amax(0)  # [...]
        log_z = global_max + (stats[:, 1] * (stats[:, 0] - global_max).exp()).sum(0).log()  # log Σ_V exp(logit)
        loss = log_z - stats[:, 2].sum(0)  # -log p(target)
        if label_smoothing:  # F.cross_entropy's: (1-ε)·nll + ε·mean over the vocabulary of -log p
            loss = (1 - label_smoothing) * loss + label_smoothing * (log_z - stats[:, 3].sum(0) / vocab_size)
        if ctx.fused:
            ctx.save_for_backward(logits, local_targets.masked_fill(~on_rank, -1), log_z, valid)
            ctx.real = real
        else:
            softmax.mul_((shift - log_z).exp().unsqueeze(-1))  # exp(x - log_z)
            ctx.save_for_backward(softmax, local_targets, on_rank, valid)
        ctx.label_smoothing, ctx.vocab_size, ctx.per_rank, ctx.logits_dtype = (
            label_smoothing, vocab_size, per_rank, logits.dtype)
        return loss.masked_fill(~valid, 0)  # not in place: torch 2.11's compile zeroes the grad of an in-place output

    @staticmethod
    @first_order
    def backward(ctx, grad_loss):  # [...]
        if ctx.fused:
            logits, targets, log_z, valid = ctx.saved_tensors
            grad = ctx.fused.vocab_grad(logits, targets, log_z, grad_loss.to(log_z.dtype).masked_fill(
                ~valid, 0), real=ctx.real, smoothing=ctx.label_smoothing, vocab_size=ctx.vocab_size)
            return grad, None, None, None, None, None
        softmax, local_targets, on_rank, valid = ctx.saved_tensors
        eps = ctx.label_smoothing
        # masked, not multiplied: "mean" with every token ignored sends 1/0 = inf, F.cross_entropy's grads are 0
        grad_loss = grad_loss.to(softmax.dtype).masked_fill(~valid, 0).unsqueeze(-1)  # [..., 1]
        grad = (softmax - eps / ctx.vocab_size).mul_(grad_loss) if eps else softmax * grad_loss  # [..., v]
        if grad.shape[-1]:
            grad.scatter_add_(-1, local_targets.unsqueeze(-1), grad_loss * on_rank.unsqueeze(-1) * (eps - 1))
        grad = grad.to(ctx.logits_dtype)
        if grad.shape[-1] < ctx.per_rank:  # padding columns: zero gradient
            grad = F.pad(grad, (0, ctx.per_rank - grad.shape[-1]))
        return grad, None, None, None, None, None


def _check(logits_shard, targets, label_smoothing, ignore_index, reduction, vocab_size, padded):
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} must be one of {REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    if not logits_shard.is_floating_point() or logits_shard.dim() == 0:
        raise ValueError(f"logits_shard must be a floating [..., V/tp] tensor, got {logits_shard.dtype} "
                         f"of shape {tuple(logits_shard.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be int64 or int32, got {targets.dtype}")
    if targets.shape != logits_shard.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} != logits shape without the vocab dim "
                         f"{tuple(logits_shard.shape[:-1])}")
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {padded}] (the tp group's logits cover {padded})")
    # targets are replicated: every rank raises here, before any collective (on a GPU: a device assert)
    debug.check_range(targets, vocab_size, lambda bad: f"target id {bad} is outside the vocabulary [0, {vocab_size}) "
                      f"and is not ignore_index={ignore_index}", ignore=ignore_index)


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0, *, ignore_index: int = -100,
    reduction: str = "mean", vocab_size: int | None = None, group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """F.cross_entropy over vocab-parallel logits, without gathering them.

    logits_shard: [..., V/tp], this rank's contiguous block of the vocabulary (a ColumnParallelLinear output);
    targets: [...] global vocabulary ids, identical on every rank of the group. The class dim is the last one
    (F.cross_entropy's is dim 1). `vocab_size` (default: the full V = tp·V/tp) excludes the padding columns a
    model adds to make V divisible: they never enter the softmax, nor the label-smoothing mean, and get a zero
    gradient. Label smoothing is F.cross_entropy's: (1-ε)·nll + ε·mean over the vocabulary of -log p.
    "mean" averages over non-ignored tokens (nan when every token is ignored, with zero gradients, like
    F.cross_entropy). The math runs, and the loss is returned, in fp32 for 16-bit logits (fp64 stays fp64); the
    gradient has the logits' dtype. The input is never modified; backward keeps the local softmax [..., V/tp] (in
    the math dtype), as Megatron does, or, where the fused kernels run, the logits and log Z only.
    Collectives: one all-gather of [3 or 4, ...] per rank forward, none backward.
    """
    group = resolve_group(group)
    padded = logits_shard.shape[-1] * dist.get_world_size(group) if logits_shard.dim() else 0
    vocab_size = padded if vocab_size is None else vocab_size
    if debug.is_debug():
        debug.check(targets, group, "the targets of vocab_parallel_cross_entropy", replicated=True)
        debug.check(logits_shard, group, "the logits_shard of vocab_parallel_cross_entropy", replicated=False)
    _check(logits_shard, targets, label_smoothing, ignore_index, reduction, vocab_size, padded)
    loss = _VocabParallelCrossEntropy.apply(logits_shard, targets, label_smoothing, ignore_index, vocab_size, group)
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (targets != ignore_index).sum()
    return loss
