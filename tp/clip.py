"""Global gradient-norm clipping (Megatron's clip_grad_norm_fp32) over a model split across tp, pp and dp (x cp).

Every rank passes its parameters; one all-reduce over the world sums the squares, each element counted once, read
from the attributes the layers set: tp-sharded weights (`tensor_parallel`) on every tp rank, their rows replicated
over tp (`replica_rows`: kv heads fewer than tp) once, tp-duplicated parameters (norms, row biases) on tp rank 0, a
copy held by another pipeline stage (`shared`: the last stage's tied output layer) nowhere; gradients replicated
over dp (x cp) once, those sharded over it (zero1's `main_grad_shard`, FSDP2's DTensor shards) on every rank.
Mixture-of-experts weights (`expert_parallel`: each (etp, ep) rank of a stage holds other experts or slices, equal
only over the expert-data-parallel group) are counted on every ep and etp rank, once over edp (or on every rank
when sharded over it): each expert once, not once per ep rank nor once per tp rank.
"""
import contextlib
import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .mesh import Mesh, collective_device, get_mesh


def reduced_grad(p: torch.Tensor) -> tuple[torch.Tensor | None, int, dist.ProcessGroup | None]:
    """(this rank's part of p's reduced gradient, its flat offset in p, the group it is sharded over or None): zero1's
    shard of main_grad, FSDP2's local shard, else main_grad or .grad whole."""
    if getattr(p, "main_grad_shard", None) is not None:
        return p.main_grad_shard, p.main_grad_shard_offset, p.main_grad_shard_group
    grad = getattr(p, "main_grad", None)
    grad = p.grad if grad is None else grad
    if grad is not None and hasattr(grad, "to_local"):  # FSDP2: a DTensor sharded on dim 0
        from torch.distributed.tensor import Shard

        if grad.device_mesh.ndim != 1 or grad.placements[0] != Shard(0):
            raise ValueError(f"clip_grad_norm_: a DTensor gradient placed {grad.placements} on a "
                             f"{grad.device_mesh.ndim}-D mesh (expected FSDP2's Shard(0) on one dim)")
        # Shard(0) splits dim 0 as torch.chunk does: rank r's rows start at min(r·ceil(n/size), n). (torch's
        # compute_local_shape_and_global_offset builds the offsets on the default device and reads them: a device
        # sync per parameter on a GPU.)
        group = grad.device_mesh.get_group()
        rows = grad.shape[0]
        first_row = min(dist.get_rank(group) * -(-rows // dist.get_world_size(group)), rows)
        return grad.to_local(), first_row * math.prod(grad.shape[1:]), group
    return grad, 0, None


def _counted(p, mesh, group):
    """Whether this rank counts its part of p's gradient over the data-parallel ranks (dp x cp; edp for experts)."""
    axis, name = ("edp", "edp") if getattr(p, "expert_parallel", False) else ("dp-cp", "dp x cp")
    if group is None:  # replicated over them: the first rank counts it
        return mesh.local_rank(axis) == 0
    if dist.get_world_size(group) != mesh.size(axis):
        raise ValueError(f"clip_grad_norm_: a gradient sharded over {dist.get_world_size(group)} ranks, not over the "
                         f"{name} = {mesh.size(axis)} ranks that reduce it")
    return True


def _sum_of_squares(p, grad, offset, tp_rank):
    """Σ g² over the elements this tp rank counts: all of a tp-sharded parameter but its replicated rows held first by
    another rank (kv heads fewer than tp), none of a tp-duplicated one except on tp rank 0."""
    flat = grad.reshape(-1).to(torch.float64)
    if not getattr(p, "tensor_parallel", False):
        return flat.dot(flat) if tp_rank == 0 else flat.new_zeros(())
    replicas = getattr(p, "replica_rows", None)
    if replicas is None:
        return flat.dot(flat)
    total, first, cols = flat.new_zeros(()), 0, math.prod(p.shape[1:])
    for rows, r in replicas:  # the elements of each part's rows that fall in this part of the gradient
        if r == 1 or tp_rank % r == 0:
            kept = flat[max(first * cols - offset, 0):max((first + rows) * cols - offset, 0)]
            total += kept.dot(kept)
        first += rows
    return total


@torch.no_grad()
def clip_grad_norm_(params: torch.Tensor | Iterable[torch.Tensor], max_norm: float, *, mesh: Mesh | None = None,
                    with_local: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scale the gradients in place so that their global L2 norm is at most `max_norm` (0: measure only); returns
    the norm before clipping (a 0-d fp32 tensor on the gradients' device, the same on every rank; inf/nan when a
    gradient is not finite: skip that step). No host sync: the norm is read only where the caller reads it.

    Over the whole model (see the module docstring): every rank of `mesh` (default the current one) calls it with
    its parameters. `main_grad` is used when present; tp.optim.DataParallel's reductions are finished first.
    `with_local`: (the norm, this rank's part of it before the all-reduce): not finite where a gradient this rank
    counts is not (the lowest such rank is the lowest rank with a non-finite gradient: a copy a rank does not count
    is counted on a lower one).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"max_norm={max_norm!r} must be a number >= 0 (0: measure only)")
    mesh = get_mesh() if mesh is None else mesh
    params = list(dict.fromkeys([params] if isinstance(params, torch.Tensor) else params))  # (torch takes either)
    for finish in dict.fromkeys(p.finish_grad_sync for p in params if hasattr(p, "finish_grad_sync")):
        finish()
    grads, squares = [], []
    for p in params:
        grad, offset, group = reduced_grad(p)
        if grad is None:
            continue
        grads.append(grad)
        if not getattr(p, "shared", False) and _counted(p, mesh, group):
            tp_rank = 0 if getattr(p, "expert_parallel", False) else mesh.tp_rank  # (experts: no tp duplicates)
            squares.append(_sum_of_squares(p, grad, offset, tp_rank))
    # Summed where the gradients are, moved once: one move per gradient was a host sync each on a GPU under gloo.
    device = grads[0].device if grads else collective_device()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for partial in squares:
        total += partial.to(device)  # (a no-op unless gradients sit on several devices)
    local = total.clone() if with_local else None
    if mesh.world_size > 1:
        reduced = total.to(collective_device())
        dist.all_reduce(reduced)
        total = reduced.to(device)
    exact = total.sqrt()  # (fp64: an fp64 model's coefficient is torch's to the last bits)
    if max_norm > 0:  # on the device, no host sync: a coefficient of 1 (no clipping, a non-finite norm) changes nothing
        coefficient = torch.full_like(exact, max_norm) / (exact + 1e-6)  # (not max_norm / t: t.reciprocal() * max_norm)
        coefficient = torch.where(exact.isfinite() & (coefficient < 1), coefficient, 1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.device))
    return (exact.float(), local.sqrt().float()) if with_local else exact.float()


CLIP_TAGS = ("tensor_parallel", "partition_dim", "replica_rows", "shared", "expert_parallel")


@contextlib.contextmanager
def keep_param_tags(module: nn.Module) -> Iterator[None]:
    """Restore the parameter attributes clip_grad_norm_ reads after a wrapper that replaces the parameters (FSDP2's
    fully_shard drops them): `with keep_param_tags(stage): fully_shard(...)`."""
    tags = {n: {t: getattr(p, t) for t in CLIP_TAGS if hasattr(p, t)} for n, p in module.named_parameters()}
    yield
    for name, p in module.named_parameters():
        for tag, value in tags.get(name, {}).items():
            setattr(p, tag, value)
