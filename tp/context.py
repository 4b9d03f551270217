"""Context parallelism (cp): the sequence split across a cp group, and attention over the whole sequence.

Layout (load-balanced, "head-tail"; Megatron's get_batch_on_this_cp_rank, torch's _HeadTailLoadBalancer): the sequence
is cut into 2·cp equal chunks of c = s/(2·cp) tokens and rank r holds chunks r and 2cp−1−r, concatenated: its n = s/cp
tokens are in increasing position order, and under a causal mask every rank does the same work.

`context_parallel_attention` in two modes (ring attention, Liu et al. 2023; the all-gather of Llama 3's context
parallelism, Dubey et al. 2024):
  ring       K and V travel once around the group (batch_isend_irecv), the next step's transfer started before this
             step's attention; block outputs merged by their log-sum-exp; causal blocks are halved (KV from an
             earlier rank: every local query vs that rank's first chunk; from a later rank: the local second chunk
             vs all of it; step 0: each local chunk causal on the local keys up to its end). Backward rings K and V
             again, recomputes each block's probabilities from the saved lse (flash-style), and dK/dV ride along in
             the accumulation dtype, collecting every rank's contribution, then take one last hop home: forward
             cp−1 messages of [2, b, kv_heads, n, d] per rank, backward cp−1 of them plus cp of dK/dV. Saved: the
             local q, K, V, output, lse.
  allgather  Llama 3's: one all-gather of K and V (packed) forward; each local chunk attends to the keys up to its own
             end ([c, ≤ s] scores); one reduce-scatter of dK/dV (accumulation dtype) backward. Saves the gathered KV.
Blocks are matmul-softmax in the accumulation dtype (fp64 for fp64 inputs, else fp32; autocast off), so the same code
runs on any device and dtype; outputs and gradients come back in the inputs' dtype. No attention dropout under cp > 1.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .collectives import gather_first, reduce_scatter_first
from .mesh import get_mesh

MODES = ("ring", "allgather")


def _cp_group(group):
    return get_mesh().cp_group if group is None else group


def _check_chunks(size, cp, what):
    if size % (2 * cp):
        raise ValueError(f"{what} of size {size} is not divisible by 2·cp = {2 * cp} (cp = {cp})")


# ---- the layout ---------------------------------------------------------------------------------------------------


def _sequence_order(parts, dim):
    """[cp, ..., n, ...] every rank's share (n at `dim` of a share) -> [..., cp·n, ...] in sequence order."""
    halves = parts.unflatten(dim + 1, (2, -1))  # [cp, ..., 2, c, ...]
    chunks = torch.cat([halves.select(dim + 1, 0), halves.select(dim + 1, 1).flip(0)])  # chunk t at index t
    return chunks.movedim(0, dim).flatten(dim, dim + 1)


def _rank_order(full, dim, cp):
    """The inverse of _sequence_order: [..., s, ...] -> [cp, ..., s/cp, ...], rank r's share at index r."""
    chunks = full.unflatten(dim, (2 * cp, -1)).movedim(dim, 0)  # [2cp, ..., c, ...]
    return torch.stack([chunks[:cp], chunks[cp:].flip(0)], dim + 1).flatten(dim + 1, dim + 2)


def _own_share(x, dim, cp, rank):
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def cp_shard(x: torch.Tensor, dim: int, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's share of the full x along `dim`: chunks r and 2cp−1−r (no communication).

    Autograd: the gradient lands in this rank's slots of x, zeros elsewhere, so a replicated x (the full tokens'
    embeddings on every cp rank) gets a partial gradient per rank that sums over the cp group to the full one (the
    dp×cp gradient reduction does that sum for parameters).
    """
    group = _cp_group(group)
    cp = dist.get_world_size(group)
    if cp == 1:
        return x
    _check_chunks(x.shape[dim], cp, f"cp_shard: dim {dim}")
    return _own_share(x, dim, cp, dist.get_rank(group))


class _CPUnshard(torch.autograd.Function):
    """forward: all-gather, reorder into the sequence · backward: keep this rank's slots of the gradient."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        cp = dist.get_world_size(group)
        parts = gather_first(x.movedim(dim, 0), group).unflatten(0, (cp, -1))  # [cp, n, ...]
        return _sequence_order(parts, 0).movedim(0, dim)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        group = ctx.group
        return _own_share(grad, ctx.dim, dist.get_world_size(group), dist.get_rank(group)), None, None


def cp_unshard(x: torch.Tensor, dim: int, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The full tensor from every rank's share along `dim` (one all-gather). Backward keeps this rank's slots of
    the gradient (no reduction): the consumer (the loss on full logits) is computed identically on every cp rank."""
    group = _cp_group(group)
    cp = dist.get_world_size(group)
    if cp == 1:
        return x
    if x.shape[dim] % 2:
        raise ValueError(f"cp_unshard: dim {dim} of size {x.shape[dim]} is odd; a share is 2 chunks (cp = {cp})")
    return _CPUnshard.apply(x, dim % x.dim(), group)


def cp_positions(seq_len: int, *, group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (LongTensor [seq_len/cp]) this rank holds, in its local order (for RoPE, learned
    position embeddings)."""
    group = _cp_group(group)
    cp, positions = dist.get_world_size(group), torch.arange(seq_len, device=device)
    if cp == 1:
        return positions
    _check_chunks(seq_len, cp, "cp_positions: seq_len")
    return _own_share(positions, 0, cp, dist.get_rank(group))


# ---- block attention: q [b, kv_heads, g, m, d] (g query heads per kv head) vs k, v [b, kv_heads, n, d] -----------


def _causal_mask(m, n, device):
    """True where key j is in the future of query i, queries aligned to the last m keys (j > i + n − m)."""
    return torch.ones(m, n, dtype=torch.bool, device=device).triu(n - m + 1)


def _finite(lse):
    """lse with fully masked rows (−inf) at 0, so that exp(score − lse) is exp(−inf) = 0 there, never NaN."""
    return lse.masked_fill(lse == -math.inf, 0)


def _scores(q, k, scale, causal):
    s = torch.einsum("bkgmd,bknd->bkgmn", q, k) * scale  # [b, kv_heads, g, m, n]
    return s.masked_fill(_causal_mask(s.shape[-2], s.shape[-1], s.device), -math.inf) if causal else s


def _block_forward(q, k, v, scale, causal):
    """(out [b, kv, g, m, d], lse [b, kv, g, m]) of q over one KV block; fully masked rows give 0 and −inf."""
    s = _scores(q, k, scale, causal)
    lse = s.logsumexp(-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.einsum("bkgmn,bknd->bkgmd", p, v), lse


def _block_backward(q, k, v, dout, lse, delta, scale, causal):
    """(dq, dk, dv) of one block, its probabilities recomputed from the final lse; delta = rowsum(dout · out)."""
    p = torch.exp(_scores(q, k, scale, causal) - _finite(lse).unsqueeze(-1))  # [b, kv, g, m, n]
    ds = p * (torch.einsum("bkgmd,bknd->bkgmn", dout, v) - delta.unsqueeze(-1))
    dq = torch.einsum("bkgmn,bknd->bkgmd", ds, k) * scale
    dk = torch.einsum("bkgmn,bkgmd->bknd", ds, q) * scale
    return dq, dk, torch.einsum("bkgmn,bkgmd->bknd", p, dout)


def _merge(out, lse, block_out, block_lse):
    """Fold a block's (out, lse) into the running ones, in place: lse = log(e^lse + e^block_lse), out weighted."""
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(torch.exp(block_lse - safe).unsqueeze(-1) * block_out)
    lse.copy_(new)


def _no_autocast(x):
    """The blocks run in the accumulation dtype even inside torch.autocast (which would round scores to 16 bits)."""
    return torch.autocast(x.device.type, enabled=False)


def _attend(out, lse, q, kv, rows, cols, causal, scale):
    """Attention of q's `rows` over kv's `cols` ([2, b, kv, n, d]), merged into out and lse."""
    k, v = kv[:, :, :, cols].to(q.dtype)
    with _no_autocast(q):
        _merge(out[..., rows, :], lse[..., rows], *_block_forward(q[..., rows, :], k, v, scale, causal))


def _attend_backward(dq, dkv, q, kv, dout, lse, delta, rows, cols, causal, scale):
    """One block's gradients, accumulated into dq ([b, kv, g, n, d]) and dkv ([2, b, kv, n', d])."""
    k, v = kv[:, :, :, cols].to(q.dtype)
    with _no_autocast(q):
        dq_block, dk, dv = _block_backward(q[..., rows, :], k, v, dout[..., rows, :], lse[..., rows],
                                           delta[..., rows], scale, causal)
    dq[..., rows, :] += dq_block
    dkv[:, :, :, cols] += torch.stack([dk, dv])


# ---- ring -----------------------------------------------------------------------------------------------------------


def _ring_steps(rank, cp, n, causal):
    """The blocks (q rows, kv rows, masked) of each ring step of `rank`, which then holds the KV of rank
    (rank − step) mod cp. Causal: every step computes the same c·n query x key products (c = n/2)."""
    whole, first, second = slice(None), slice(0, n // 2), slice(n // 2, None)
    for step in range(cp):
        source = (rank - step) % cp
        if not causal:
            yield [(whole, whole, False)]
        elif step == 0:  # our own chunks: each causal on itself, the second sees all of the first
            yield [(first, first, True), (second, whole, True)]
        elif source < rank:  # its chunks: one before both of ours, one after both
            yield [(whole, first, False)]
        else:  # both of its chunks lie between our two
            yield [(second, whole, False)]


def _ring_send(tensor, group):
    """Start sending `tensor` to the next rank of the ring and receiving the previous rank's; (recv, works, tensor)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    recv = torch.empty_like(tensor)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % cp), group),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % cp), group)])
    return recv, works, tensor  # the send buffer is kept alive until the wait


def _wait(transfer):
    recv, works, _ = transfer
    for work in works:
        work.wait()
    return recv


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(x, kv_heads):
    """[b, heads, n, d] -> [b, kv_heads, g, n, d] in the accumulation dtype."""
    return x.unflatten(1, (kv_heads, -1)).to(_acc_dtype(x.dtype))


class _RingAttention(torch.autograd.Function):
    """forward: KV around the ring, blocks merged by lse · backward: KV around again, dK/dV accumulated on the way."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group):
        cp, rank, n = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
        qg = _grouped(q, k.shape[1])
        kv = torch.stack([k, v])  # [2, b, kv_heads, n, d]: one message per step
        out, lse = torch.zeros_like(qg), qg.new_full(qg.shape[:-1], -math.inf)
        for step, blocks in enumerate(_ring_steps(rank, cp, n, causal)):
            incoming = _ring_send(kv, group) if step < cp - 1 else None  # overlaps this step's attention
            for rows, cols, masked in blocks:
                _attend(out, lse, qg, kv, rows, cols, masked, scale)
            kv = _wait(incoming) if incoming else kv
        out = out.flatten(1, 2).to(q.dtype)
        ctx.causal, ctx.scale, ctx.group = causal, scale, group
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, kv_heads = ctx.group, k.shape[1]
        cp, rank, n = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
        qg, dout = _grouped(q, kv_heads), _grouped(dout, kv_heads)
        delta = (dout * _grouped(out, kv_heads)).sum(-1)
        kv, dq, dkv_transfer = torch.stack([k, v]), torch.zeros_like(qg), None
        for step, blocks in enumerate(_ring_steps(rank, cp, n, ctx.causal)):
            incoming = _ring_send(kv, group) if step < cp - 1 else None
            # dK/dV of the KV we hold, carrying the contributions of the ranks it visited before us
            dkv = _wait(dkv_transfer) if dkv_transfer else kv.new_zeros(kv.shape, dtype=qg.dtype)
            for rows, cols, masked in blocks:
                _attend_backward(dq, dkv, qg, kv, dout, lse, delta, rows, cols, masked, ctx.scale)
            dkv_transfer = _ring_send(dkv, group)  # to its next holder; after the last step, to its owner
            kv = _wait(incoming) if incoming else kv
        dkv = _wait(dkv_transfer)
        return dq.flatten(1, 2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


# ---- all-gather -----------------------------------------------------------------------------------------------------


def _allgather_blocks(rank, cp, n, causal):
    """(q rows, key range of the gathered sequence, masked): each local chunk vs the keys up to its own end."""
    if not causal:
        yield slice(None), slice(None), False
        return
    c = n // 2
    yield slice(0, c), slice(0, (rank + 1) * c), True
    yield slice(c, n), slice(0, (2 * cp - rank) * c), True


class _AllGatherAttention(torch.autograd.Function):
    """forward: all-gather K and V, local queries vs the sequence · backward: reduce-scatter dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group):
        cp, rank, n = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
        parts = gather_first(torch.stack([k, v]), group).unflatten(0, (cp, 2))  # [cp, 2, b, kv_heads, n, d]
        kv = _sequence_order(parts, 3)  # [2, b, kv_heads, s, d]
        qg = _grouped(q, k.shape[1])
        out, lse = torch.zeros_like(qg), qg.new_full(qg.shape[:-1], -math.inf)
        for rows, cols, masked in _allgather_blocks(rank, cp, n, causal):
            _attend(out, lse, qg, kv, rows, cols, masked, scale)
        out = out.flatten(1, 2).to(q.dtype)
        ctx.causal, ctx.scale, ctx.group, ctx.dtypes = causal, scale, group, (k.dtype, v.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        group, kv_heads = ctx.group, kv.shape[2]
        cp, rank, n = dist.get_world_size(group), dist.get_rank(group), q.shape[2]
        qg, dout = _grouped(q, kv_heads), _grouped(dout, kv_heads)
        delta = (dout * _grouped(out, kv_heads)).sum(-1)
        dq, dkv = torch.zeros_like(qg), kv.new_zeros(kv.shape, dtype=qg.dtype)  # dkv: [2, b, kv_heads, s, d]
        for rows, cols, masked in _allgather_blocks(rank, cp, n, ctx.causal):
            _attend_backward(dq, dkv, qg, kv, dout, lse, delta, rows, cols, masked, ctx.scale)
        dkv = reduce_scatter_first(_rank_order(dkv, 3, cp).flatten(0, 1), group)  # [2, b, kv_heads, n, d]
        return dq.flatten(1, 2).to(q.dtype), dkv[0].to(ctx.dtypes[0]), dkv[1].to(ctx.dtypes[1]), None, None, None


# ---- the public function --------------------------------------------------------------------------------------------


def _check_attention(q, k, v, mode, cp):
    """Refuse bad inputs before any communication (every rank sees the same shapes, so every rank raises)."""
    where = "context_parallel_attention"
    if mode not in MODES:
        raise ValueError(f"{where}: unknown mode {mode!r}; expected one of {MODES}")
    if not q.dim() == k.dim() == v.dim() == 4:
        raise ValueError(f"{where}: q, k, v must be [b, heads, s/cp, d], got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{where}: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    for i, what in ((0, "batch"), (2, "local sequence length"), (3, "head dim")):
        if q.shape[i] != k.shape[i]:
            raise ValueError(f"{where}: q's {what} {q.shape[i]} != k/v's {k.shape[i]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{where}: heads={q.shape[1]} is not a multiple of kv_heads={k.shape[1]}")
    if cp > 1 and q.shape[2] % 2:
        raise ValueError(f"{where}: the local sequence length {q.shape[2]} is odd, but a rank of a cp group of {cp} "
                         f"holds 2 chunks of s/(2·cp) tokens")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                               mode: str = "ring", group: dist.ProcessGroup | None = None,
                               scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence of the cp group, everything in the load-balanced
    layout: q [b, heads, s/cp, d], k and v [b, kv_heads, s/cp, d] (heads a multiple of kv_heads) -> [b, heads,
    s/cp, d], equal to F.scaled_dot_product_attention(is_causal=causal, enable_gqa=...) on the full tensors.

    mode "ring" (p2p, overlapped) or "allgather" (one all-gather forward, one reduce-scatter backward); group: the
    cp group (default: the current mesh's); scale: default 1/sqrt(d). One rank: SDPA itself. No dropout.
    """
    group = _cp_group(group)
    cp = dist.get_world_size(group)
    _check_attention(q, k, v, mode, cp)
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return (_RingAttention if mode == "ring" else _AllGatherAttention).apply(q, k, v, causal, scale, group)
