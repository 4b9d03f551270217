"""Attention blocks: q [b, kv_heads, g, m, d] (g query heads per kv head) against k, v [b, kv_heads, n, d], the pieces
ring and all-gather attention are made of, with their masks and the plan that skips what a mask hides entirely.

A block is (query rows, key columns, causal) of the local queries and the keys a rank holds. Which query sees which
key follows from each token's global position and document id (a `Side` of the block): causal hides keys at later
positions, documents hide keys of other documents. Without documents every block the modes build holds visible
pairs; with documents `trim_blocks` cuts each block down to the rows and columns that hold one, and drops it when
none does: a packed window's cross-document blocks cost no compute.

Blocks are matmul-softmax in the accumulation dtype (fp64 for fp64 inputs, else fp32; autocast off), so the same code
runs on any device and dtype. A fully masked row gives out 0 and lse −inf, never NaN. Attention dropout multiplies
each block's probabilities by its (query, key) tile's keep/(1 − p), drawn from the tokens' global positions
(tp.dropout): any decomposition into blocks, on any rank, applies the serial run's mask, and backward redraws it.
"""
import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from .layout import own_share

if TYPE_CHECKING:
    from ..dropout import CounterDropout

Block = tuple[slice, slice, bool]  # (query rows, key columns, causal)


class Side(NamedTuple):
    """The tokens on one side of attention blocks: global positions [n] and document ids [b, n] (None: one
    document)."""

    positions: torch.Tensor
    documents: torch.Tensor | None


def side_of(share: int, parts: int, seq_len: int, documents: torch.Tensor | None,
            device: torch.device) -> Side:
    """The Side of share `share` of the sequence in the load-balanced layout of `parts` ranks (parts 1: all of it);
    `documents`: [b, seq_len] in sequence order, or None."""
    if parts == 1:
        return Side(torch.arange(seq_len, device=device), documents)
    c = seq_len // (2 * parts)  # (the share's positions only: a ring rank never holds an [s] tensor of its own)
    positions = torch.cat([torch.arange(share * c, (share + 1) * c, device=device),
                           torch.arange((2 * parts - 1 - share) * c, (2 * parts - share) * c, device=device)])
    return Side(positions, None if documents is None else own_share(documents, 1, parts, share))


def block_mask(q_side: Side, k_side: Side, rows: slice, cols: slice, causal: bool) -> torch.Tensor | None:
    """True where a query may not see a key, [b or 1, 1, 1, m, n] (broadcast over heads): a key at a later
    position (causal), or of another document; None when the block hides nothing."""
    hidden = None
    if causal:
        hidden = (k_side.positions[cols] > q_side.positions[rows].unsqueeze(-1)).unsqueeze(0)  # [1, m, n]
    if q_side.documents is not None:
        other = q_side.documents[:, rows].unsqueeze(-1) != k_side.documents[:, cols].unsqueeze(-2)  # [b, m, n]
        hidden = other if hidden is None else other | hidden
    return None if hidden is None else hidden[:, None, None]


def document_attention_mask(document_ids: torch.Tensor, *, causal: bool = True) -> torch.Tensor:
    """SDPA's boolean attn_mask [b, 1, s, s] (True: may attend) of a window whose tokens carry `document_ids`
    [b, s] (equal ids: one document): block-diagonal, causal inside each document."""
    visible = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)  # [b, s, s]
    if causal:
        visible = visible.tril()
    return visible.unsqueeze(1)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
                    documents: torch.Tensor | None) -> torch.Tensor:
    """SDPA on [b, heads, s, d] (GQA when k, v have fewer heads), with the document mask when `documents`."""
    mask = None if documents is None else document_attention_mask(documents, causal=causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _span(visible):
    """[any, first, last] index of the True entries of a bool vector (first = last = 0 when there are none)."""
    last = visible.numel() - 1 - visible.flip(0).int().argmax()
    return torch.stack([visible.any().long(), visible.int().argmax(), last])


def _cut(part, first, last, length):
    start, _, _ = part.indices(length)
    return slice(start + first, start + last + 1)


def trim_blocks(q_side: Side, steps: list[tuple[Side, list[Block]]]) -> list[list[Block]]:
    """Each step's blocks (their keys' Side, the blocks) cut down to the rows and columns that hold a visible
    (query, key) pair, the blocks without one dropped: one host sync for all of them. Without documents nothing is
    cut (the modes' blocks all hold visible pairs), nor under torch.compile (no host sync in a graph: the masks hide
    what a cut would have skipped, a hidden row giving 0 and lse −inf, which merge leaves out exactly)."""
    if q_side.documents is None or torch.compiler.is_compiling():
        return [blocks for _, blocks in steps]
    spans = []
    for k_side, blocks in steps:
        for rows, cols, causal in blocks:
            visible = (~block_mask(q_side, k_side, rows, cols, causal)[:, 0, 0]).any(0)  # [m, n]: in some row
            spans.append(torch.cat([_span(visible.any(1)), _span(visible.any(0))]))
    spans = iter(torch.stack(spans).tolist() if spans else [])
    m, trimmed = q_side.positions.numel(), []
    for k_side, blocks in steps:
        n, kept = k_side.positions.numel(), []
        for (rows, cols, causal), (seen, r0, r1, _, c0, c1) in zip(blocks, spans):
            if seen:
                kept.append((_cut(rows, r0, r1, m), _cut(cols, c0, c1, n), causal))
        trimmed.append(kept)
    return trimmed


# ---- one block ------------------------------------------------------------------------------------------------------


def _finite(lse):
    """lse with fully masked rows (−inf) at 0, so that exp(score − lse) is exp(−inf) = 0 there, never NaN."""
    return lse.masked_fill(lse == -math.inf, 0)


def _scores(q, k, scale, mask):
    s = torch.einsum("bkgmd,bknd->bkgmn", q, k) * scale  # [b, kv_heads, g, m, n]
    return s if mask is None else s.masked_fill(mask, -math.inf)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                  drop: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, kv, g, m, d], lse [b, kv, g, m]) of q over one KV block (`mask`: True hides a key); fully masked
    rows give 0 and −inf. `drop` [b, kv, g, m, n]: dropout's keep/(1 − p) on the probabilities (the lse is the
    undropped one: dropout follows the softmax)."""
    s = _scores(q, k, scale, mask)
    lse = s.logsumexp(-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.einsum("bkgmn,bknd->bkgmd", p if drop is None else p * drop, v), lse


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                   delta: torch.Tensor, scale: float, mask: torch.Tensor | None,
                   drop: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, its probabilities recomputed from the final lse; delta = rowsum(dout · out) of the
    (dropped) output; `drop` as in block_forward (FlashAttention's dropout backward)."""
    p = torch.exp(_scores(q, k, scale, mask) - _finite(lse).unsqueeze(-1))  # [b, kv, g, m, n]
    dp = torch.einsum("bkgmd,bknd->bkgmn", dout, v)
    if drop is not None:
        dp, kept = dp * drop, p * drop
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.einsum("bkgmn,bknd->bkgmd", ds, k) * scale
    dk = torch.einsum("bkgmn,bkgmd->bknd", ds, q) * scale
    return dq, dk, torch.einsum("bkgmn,bkgmd->bknd", p if drop is None else kept, dout)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running ones, in place: lse = log(e^lse + e^block_lse), out weighted."""
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(torch.exp(block_lse - safe).unsqueeze(-1) * block_out)
    lse.copy_(new)


def _no_autocast(x):
    """The blocks run in the accumulation dtype even inside torch.autocast (which would round scores to 16 bits)."""
    return torch.autocast(x.device.type, enabled=False)


def block_dropout(dropout: "CounterDropout | None", q: torch.Tensor, sides: tuple[Side, Side], rows: slice,
                  cols: slice) -> torch.Tensor | None:
    """keep/(1 − p) [b, kv, g, m, n] of a block of q [b, kv, g, ., d]: the mask of its (query, key) tile, drawn from
    the tokens' global positions and the heads' global indices (None without dropout)."""
    if dropout is None:
        return None
    q_side, k_side = sides
    b, kv_heads, g = q.shape[:3]
    keep = dropout.keep(q_side.positions[rows], k_side.positions[cols], heads=kv_heads * g)  # [b, heads, m, n]
    return keep.unflatten(1, (kv_heads, g)).to(q.dtype) * (1.0 / (1.0 - dropout.p))


def attend(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, block: Block,
           sides: tuple[Side, Side], scale: float, dropout: "CounterDropout | None" = None) -> None:
    """Attention of q's rows over kv's columns ([2, b, kv, n, d]) of `block`, merged into out and lse; `sides`:
    (the queries', the keys'); `dropout`: attention dropout's masks (tp.dropout.CounterDropout) or None."""
    rows, cols, causal = block
    k, v = kv[:, :, :, cols].to(q.dtype)
    with _no_autocast(q):
        mask, drop = block_mask(*sides, rows, cols, causal), block_dropout(dropout, q, sides, rows, cols)
        merge(out[..., rows, :], lse[..., rows], *block_forward(q[..., rows, :], k, v, scale, mask, drop))


def attend_backward(dq: torch.Tensor, dkv: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, dout: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, block: Block, sides: tuple[Side, Side],
                    scale: float, dropout: "CounterDropout | None" = None) -> None:
    """One block's gradients, accumulated into dq ([b, kv, g, n, d]) and dkv ([2, b, kv, n', d]); the dropout mask
    regenerated from its counters."""
    rows, cols, causal = block
    k, v = kv[:, :, :, cols].to(q.dtype)
    with _no_autocast(q):
        mask, drop = block_mask(*sides, rows, cols, causal), block_dropout(dropout, q, sides, rows, cols)
        dq_block, dk, dv = block_backward(q[..., rows, :], k, v, dout[..., rows, :], lse[..., rows],
                                          delta[..., rows], scale, mask, drop)
    dq[..., rows, :] += dq_block
    dkv[:, :, :, cols] += torch.stack([dk, dv])


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, heads, n, d] -> [b, kv_heads, g, n, d] in the accumulation dtype."""
    return x.unflatten(1, (kv_heads, -1)).to(acc_dtype(x.dtype))
