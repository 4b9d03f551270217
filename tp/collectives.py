"""Collective helpers: plain functions on tensors over a process group, no autograd.

tp.mappings wraps them into the conjugate autograd Functions; the layers' fused backward, context parallelism, the
vocab-parallel loss, the data-parallel buckets and the debug checks call them directly. Activations are [s, b, h]
(sequence first, Megatron's): the `*_first` helpers work on dim 0 (the sequence, contiguous memory), the `*_last`
ones on the last dim (the tensor-parallel features).
"""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# torch >= 2.13 renames the tensor collectives (*_single); older releases (e.g. 2.11) only have the old names.
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Under torch.compile the helpers call the functional collectives (out of place): the compiler waits on a result
# where it is first used and schedules the overlap. (Traced in-place c10d calls are not enough: torch 2.11 then saves
# the buffer as it was before the collective for backward, and the gradients are wrong.)
_traced_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_traced_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor

# (the output, the collective's handle) of an async_op call; the handle is None under torch.compile
Async = tuple[torch.Tensor, dist.Work | None]


def _traced(out: torch.Tensor, async_op: bool) -> torch.Tensor | Async:
    """A functional collective's result as the c10d path returns it (no handle to wait for)."""
    return (out, None) if async_op else out


def wait(handle: dist.Work | None) -> None:
    """Wait for an async collective's handle (None: nothing to wait for, e.g. under torch.compile)."""
    if handle is not None:
        handle.wait()


def _check_divisible(size: int, parts: int, what: str) -> None:
    if size % parts:
        raise ValueError(f"cannot split {what} of size {size} evenly across {parts} tensor-parallel ranks")


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, *, inplace: bool = False,
               async_op: bool = False) -> torch.Tensor | Async:
    """Sum over the group. Reduces (and returns) a contiguous copy unless `inplace` and x is already contiguous."""
    if torch.compiler.is_compiling():
        return _traced(funcol.all_reduce(x, "sum", group), async_op)
    out = x.contiguous()
    if out is x and not inplace:
        out = x.clone()
    handle = dist.all_reduce(out, group=group, async_op=async_op)
    return (out, handle) if async_op else out


def split_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's chunk of the last dim."""
    parts = dist.get_world_size(group)
    _check_divisible(x.shape[-1], parts, "the last dim")
    return x.chunk(parts, dim=-1)[dist.get_rank(group)].clone(memory_format=torch.contiguous_format)  # never a view


def gather_last(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's x along the last dim."""
    parts = dist.get_world_size(group)
    if torch.compiler.is_compiling():
        out = _traced_gather(x.contiguous(), 0, group)
    else:
        out = x.new_empty((parts * x.shape[0], *x.shape[1:]))
        all_gather_into_tensor(out, x.contiguous(), group=group)
    return torch.cat(out.chunk(parts), dim=-1)


def split_first(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's chunk of dim 0 (the sequence)."""
    parts = dist.get_world_size(group)
    _check_divisible(x.shape[0], parts, "the sequence dim (dim 0)")
    return x.chunk(parts, dim=0)[dist.get_rank(group)].clone()


def gather_first(x: torch.Tensor, group: dist.ProcessGroup, *,
                 async_op: bool = False) -> torch.Tensor | Async:
    """Concatenate every rank's x along dim 0."""
    if torch.compiler.is_compiling():
        return _traced(_traced_gather(x.contiguous(), 0, group), async_op)
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    handle = all_gather_into_tensor(out, x.contiguous(), group=group, async_op=async_op)
    return (out, handle) if async_op else out


def reduce_scatter_first(x: torch.Tensor, group: dist.ProcessGroup, *,
                         async_op: bool = False) -> torch.Tensor | Async:
    """Sum over the group, keep this rank's chunk of dim 0."""
    parts = dist.get_world_size(group)
    _check_divisible(x.shape[0], parts, "the sequence dim (dim 0)")
    if torch.compiler.is_compiling():
        return _traced(_traced_reduce_scatter(x.contiguous(), "sum", 0, group), async_op)
    out = x.new_empty((x.shape[0] // parts, *x.shape[1:]))
    handle = reduce_scatter_tensor(out, x.contiguous(), group=group, async_op=async_op)
    return (out, handle) if async_op else out


@torch.no_grad()
def all_reduce_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup, *,
                         average: bool = False, inplace: bool = True) -> list[torch.Tensor]:
    """Sum (or average) tensors over the group, one all-reduce per dtype: in place, or (inplace=False) returned as
    new tensors, the inputs untouched."""
    size = dist.get_world_size(group)
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    out = list(tensors)
    for same in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in same])
        dist.all_reduce(flat, group=group)
        if average:
            flat /= size
        for i, reduced in zip(same, flat.split([tensors[i].numel() for i in same])):
            out[i] = tensors[i].copy_(reduced.view_as(tensors[i])) if inplace else reduced.view_as(tensors[i])
    return out


# Point-to-point: gloo's send and recv read and write host memory only (a CUDA tensor fails with "writev: Bad
# address"), so over gloo a device tensor travels through a host copy; NCCL takes it as it is.
GLOO_P2P_DEVICES = ("cpu",)


def _backend_for(group: dist.ProcessGroup | None, device: torch.device) -> str:
    """The backend `group` runs `device`'s tensors on ("cpu:gloo,cuda:nccl" -> per device)."""
    name = str(dist.get_backend(group))
    if ":" not in name:
        return name
    return dict(part.split(":", 1) for part in name.split(",")).get(device.type, "")


def _through_host(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    return tensor.device.type not in GLOO_P2P_DEVICES and _backend_for(group, tensor.device) == "gloo"


class _Landing:
    """Transfers of host buffers, which it keeps alive: wait() waits for the works, then copies each received buffer
    into its device tensor. `pairs`: (host buffer, device tensor, or None for a send)."""

    def __init__(self, works: list, pairs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        self.works, self.pairs = works, pairs

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        for host, target in self.pairs:
            if target is not None:
                target.copy_(host)
        return True


def _staged(tensor: torch.Tensor, group: dist.ProcessGroup | None, receive: bool):
    """(the tensor to hand the backend: a host copy where it needs one, (that copy, the device tensor a receive
    lands in) or None where nothing is staged)."""
    if not _through_host(tensor, group):
        return tensor, None
    if receive:
        host = torch.empty_like(tensor, device="cpu")
        return host, (host, tensor)
    host = tensor.to("cpu", copy=True)
    return host, (host, None)


def batch_isend_irecv(ops: list[dist.P2POp]) -> list:
    """dist.batch_isend_irecv, device tensors staged through the host over gloo; each wait() lands its receive."""
    staged = [_staged(op.tensor, op.group, op.op in (dist.irecv, dist.recv)) for op in ops]
    works = dist.batch_isend_irecv([dist.P2POp(op.op, host, op.peer, op.group, op.tag)
                                    for op, (host, _) in zip(ops, staged)])
    pairs = [pair for _, pair in staged]
    if not any(pairs):
        return works
    if len(works) != len(ops):  # a backend that coalesced the batch into one work: every landing after it
        return [_Landing(works, [pair for pair in pairs if pair])]
    return [_Landing([work], [pair]) if pair else work for work, pair in zip(works, pairs)]


def isend(tensor: torch.Tensor, dst: int, *, group: dist.ProcessGroup | None = None, tag: int = 0):
    """dist.isend (dst: a global rank), a device tensor staged through the host over gloo."""
    host, pair = _staged(tensor, group, receive=False)
    work = dist.isend(host, dst, group=group, tag=tag)
    return _Landing([work], [pair]) if pair else work


def irecv(tensor: torch.Tensor, src: int, *, group: dist.ProcessGroup | None = None, tag: int = 0):
    """dist.irecv (src: a global rank) into `tensor`, through a host buffer over gloo: wait() lands it."""
    host, pair = _staged(tensor, group, receive=True)
    work = dist.irecv(host, src, group=group, tag=tag)
    return _Landing([work], [pair]) if pair else work
