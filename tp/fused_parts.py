"""Fused weights split over tensor-parallel ranks part by part (tp.layers' `stride=` / `parts=` / `part_replicas=`):
the parts validated, each rank's slice of every part, and the order the ranks' slices concatenate in."""
import torch


def check_parts(n, size, what, parts, replicas):
    """Validated sizes of the fused parts along the sharded dim and how many ranks hold each chunk of each part."""
    if any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in parts) or sum(parts) != n:
        raise ValueError(f"parts={tuple(parts)} must be positive integers summing to {what} = {n}")
    if len(replicas) != len(parts) or any(not isinstance(r, int) or r < 1 or size % r for r in replicas):
        raise ValueError(f"part_replicas={tuple(replicas)} must give, for each of parts={tuple(parts)}, a divisor "
                         f"of the {size} tensor-parallel ranks")
    if any(p % (size // r) for p, r in zip(parts, replicas)):
        where = f"{what} = {n}" if len(parts) == 1 else f"parts {tuple(parts)} of {what} = {n}"
        ranks = f"{size} ranks" if set(replicas) == {1} else f"{size} ranks / part_replicas {tuple(replicas)}"
        raise ValueError(f"{where} is not divisible across {ranks}" + (len(parts) > 1) * " (each part splits evenly)")
    return tuple(parts), tuple(replicas)


def shard_parts(master, dim, rank, size, parts, replicas):
    """This rank's slice along `dim`: of every fused part, chunk rank // r of size // r chunks, concatenated."""
    pieces = [part.chunk(size // r, dim)[rank // r] for part, r in zip(master.split(parts, dim), replicas)]
    return torch.cat(pieces, dim).contiguous()


def rank_major_order(parts, size):
    """Dense indices in the order the ranks' shards concatenate ([rank 0's slices of each part | rank 1's | ...])."""
    dense = torch.arange(sum(parts), device="cpu")
    return torch.cat([shard_parts(dense, 0, r, size, parts, (1,) * len(parts)) for r in range(size)])
