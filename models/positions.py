"""Where an activation's rows sit in the window: the global positions of this rank's tokens (its context-parallel
share, under sequence parallelism its tp slice), the positions RoPE rotates them at, each token's position inside
its document, and the keys of the counter-based dropout masks (each site's and each sample's global index)."""
import functools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import tp

if TYPE_CHECKING:
    from .generation import LayerCache


@functools.lru_cache(maxsize=64)
def _positions(rows, tp_size, tp_rank, cp_group, device):
    seq = rows * tp_size * dist.get_world_size(cp_group)
    return tp.cp_positions(seq, group=cp_group, device=device).chunk(tp_size)[tp_rank], seq


def token_positions(rows: int, *, sequence_parallel: bool, tp_group: dist.ProcessGroup | None,
                    cp_group: dist.ProcessGroup | None,
                    device: torch.device | str | None) -> tuple[torch.Tensor, int] | None:
    """(global positions [rows], sequence length) of the rows of an activation [rows, b, h] (rows = s/cp, or s/cp/tp
    under SP): this cp rank's load-balanced share, under SP this tp rank's slice of it; None without context
    parallelism."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return None
    tp_size = dist.get_world_size(tp_group) if sequence_parallel else 1
    tp_rank = dist.get_rank(tp_group) if sequence_parallel else 0
    return _positions(rows, tp_size, tp_rank, cp_group, device)


def dropout_positions(rows: int, *, sequence_parallel: bool, tp_group: dist.ProcessGroup | None,
                      cp_group: dist.ProcessGroup | None, device: torch.device | str | None) -> torch.Tensor:
    """The global token positions [rows] of the rows of an activation [rows, b, h] (under cp this rank's share, under
    SP this tp rank's slice): what the residual stream's dropout masks are keyed by."""
    positions = token_positions(rows, sequence_parallel=sequence_parallel, tp_group=tp_group, cp_group=cp_group,
                                device=device)
    if positions is not None:
        return positions[0]
    first = rows * dist.get_rank(tp_group) if sequence_parallel else 0
    return torch.arange(first, first + rows, device=device)


def dropout_module(layer: int | None, site: int) -> int:
    """The global index of a dropout site, which keys its masks: 0 the embedding's (layer None); 1 + 3·layer + site
    for a layer's attention output (site 0), MLP output (1) and attention probabilities (2)."""
    return 0 if layer is None else 1 + 3 * layer + site


def sample_ids_or_drawn(sample_ids: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
    """The samples' global indices [b] that key the dropout masks: `sample_ids`, or (not given) b consecutive ones
    from a random start drawn from the default CPU generator (the same on every rank seeded alike; no host sync)."""
    if sample_ids is not None:
        return sample_ids
    return int(torch.randint(0, 2**62, (1,)).item()) + torch.arange(batch, device=device)


def token_rows(ids: torch.Tensor, *, sequence_parallel: bool, tp_group: dist.ProcessGroup | None,
               cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's rows of a per-token [b, s] tensor of the whole window (position ids): its cp share, under SP its
    tp slice of that -> [b, rows], the rows of its activations [rows, b, h] in their order."""
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        ids = tp.cp_shard(ids, 1, group=cp_group)
    if sequence_parallel:
        ids = ids.chunk(dist.get_world_size(tp_group), dim=1)[dist.get_rank(tp_group)]
    return ids


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] each token's index inside its document (the tokens of equal id), counted in window order: the
    positions a document has when it is run on its own."""
    b, s = document_ids.shape
    order = document_ids.argsort(dim=1, stable=True)  # each document's tokens together, in window order
    ids = document_ids.gather(1, order)
    index = torch.arange(s, device=document_ids.device).expand(b, s)
    first = torch.ones(b, 1, dtype=torch.bool, device=ids.device)
    starts = torch.where(torch.cat([first, ids[:, 1:] != ids[:, :-1]], 1), index, 0).cummax(1).values
    return torch.empty_like(order).scatter_(1, order, index - starts)



def rope_positions(rows: int, device: torch.device | str | None, *, tp_group: dist.ProcessGroup | None,
                   cp_group: dist.ProcessGroup | None, cache: "LayerCache | None" = None,
                   position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, int] | torch.Tensor | None:
    """The positions RoPE rotates an attention's `rows` tokens at (its input gathered over SP: this cp rank's s/cp):
    after the cached ones in generation, each token's of the window's position_ids [b, s] (documents), else this cp
    rank's load-balanced share (None without cp: 0..s-1). `rope`'s `positions` argument."""
    if cache is not None:  # generation: the tokens after the cached ones
        return cache.positions(rows, device)
    if position_ids is None:
        return token_positions(rows, sequence_parallel=False, tp_group=tp_group, cp_group=cp_group, device=device)
    return token_rows(position_ids, sequence_parallel=False, tp_group=tp_group, cp_group=cp_group)  # [b, s/cp]
