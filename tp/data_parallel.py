"""Data parallelism with fp32 gradient buckets (Megatron's DDP and the buckets of its distributed optimizer), for
any module on any data-parallel group.

`DataParallel(module, group=, shard=True, param_dtype=None)`: the parameters and their gradients live in contiguous
buckets (reverse registration order, roughly the order backward produces them): the values in `param_dtype` (bf16:
Megatron's mixed precision), the gradients in fp32 `param.main_grad` (the fused wgrad of the tp linears accumulates
into it; other parameters' `.grad` is added into it by a post-accumulate-grad hook and freed), so micro-batches
accumulate in fp32 and the dp reduction runs in fp32: a bf16 sum would round every partial gradient to 8 mantissa
bits and make the result depend on the dp size; fp32 costs twice the bytes of a bf16 reduction (Megatron's
`grad_reduce_in_fp32`). Floating buffers and frozen parameters are cast to `param_dtype` too, except the buffers a
module lists in `fixed_dtype_buffers`. A bucket's reduce-scatter (`shard=False`: all-reduce, Megatron's DDP) starts
asynchronously once each of its parameters has reported its gradient of every micro-batch of the step
(`set_micro_batches(m)`, default 1): arrivals are counted per parameter, in whatever order a schedule produces them
(a deferred weight-gradient pass is waited for), so no pipeline runner needs to switch anything; `no_sync()`
accumulates without counting (DDP's way). Gradients are summed over the group and divided by `average_over` (default
the group size: pass the dp size when the group is dp x cp). tp/optim.py's DistributedOptimizer steps the buckets'
shards.

Mixture-of-experts layers (`expert_group=`): the parameters tagged `expert_parallel` (tp.moe's experts) are held the
same only by the ranks of the expert-data-parallel group (the others hold other experts), so they live in buckets of
their own, never mixed with the dense ones, reduced (and, sharded, split and all-gathered) over `expert_group`, and
divided by the same `average_over` (Megatron-Core's expert buffers over its expert-data-parallel group).
"""
import contextlib
import functools
import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from . import debug
from .collectives import all_gather_into_tensor, reduce_scatter_tensor
from .mesh import SharedGroup, get_mesh

_DONE = object()  # the handle of a reduction that needed no collective (a group of one rank)
_QUEUED = object()  # a bucket ready to reduce whose collective waits for the debug-mode order check


def default_bucket_numel(dp_size: int) -> int:
    """Megatron's bucket size: max(4e7, 1e6 x dp) parameters."""
    return max(40_000_000, 1_000_000 * dp_size)


class Bucket:
    """Contiguous parameters: values in the parameters' dtype, gradients in fp32 (fp64 for fp64 parameters), padded
    to a multiple of the group size; this rank's shard of both and the fp32 masters of that shard."""

    tied_group = SharedGroup()

    def __init__(self, params, *, group, shard, param_dtype, tied_group):
        self.params, self.tied_group, self.group = params, tied_group, group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        size, rank = self.size, self.rank
        self.offsets = list(itertools.accumulate([0] + [p.numel() for p in params]))[:-1]
        self.offset = dict(zip(params, self.offsets))
        numel = sum(p.numel() for p in params)
        padded = -(-numel // size) * size if shard else numel
        device = params[0].device
        grad_dtype = torch.float64 if params[0].dtype == torch.float64 else torch.float32
        values = torch.zeros(padded, dtype=grad_dtype, device=device)  # the (fp32) values as they are now
        for p, offset in zip(params, self.offsets):
            values[offset:offset + p.numel()] = p.detach().reshape(-1)
        if size > 1:  # torch DDP's start: every replica (and its masters) from the group's first rank
            dist.broadcast(values, group_src=0, group=group)
        self.param_data = values if param_dtype == grad_dtype else values.to(param_dtype)
        self.grad_data = torch.zeros(padded, dtype=grad_dtype, device=device)
        n = padded // size if shard else padded
        self.start, self.stop = (rank * n, (rank + 1) * n) if shard else (0, n)
        self.param_shard = self.param_data[self.start:self.stop]
        self.grad_shard = self.grad_data[self.start:self.stop]
        # masters: the fp32 parameters themselves, or the fp32 values from before the cast (never the bf16 ones)
        self.master_shard = self.param_shard if self.param_data is values else values[self.start:self.stop].clone()
        for p, offset in zip(params, self.offsets):  # (views made with grad mode on: updated in place in any mode)
            p.data = self.param_data[offset:offset + p.numel()].view_as(p)
            p.main_grad = self.grad_data[offset:offset + p.numel()].view_as(p)
        self.waiting, self.handle, self.gather, self.deferred = set(params), None, None, False

    def piece(self, p: nn.Parameter) -> tuple[int, slice] | None:
        """(offset of this rank's shard within p, the shard's range within the bucket's shard) or None if empty."""
        offset = self.offset[p]
        a, b = max(offset, self.start), min(offset + p.numel(), self.stop)
        return (a - offset, slice(a - self.start, b - self.start)) if a < b else None


def _bucket_groups(params, alone, expert, bucket_numel):
    """The parameters of each bucket, in reverse registration order (the backward's): the dense ones, then the
    experts' (each kind in buckets of their own), `alone` ones each in its own, others up to bucket_numel each."""
    groups = []
    for kind in (False, True):
        current = []
        for p in reversed(params):
            if (p in expert) != kind:
                continue
            if p in alone:
                groups.append([p])
                continue
            current.append(p)
            if sum(q.numel() for q in current) >= bucket_numel:
                groups, current = groups + [current], []
        groups += [current] if current else []
    return groups


def _cast_floating_state(module, dtype):
    """Floating buffers and frozen parameters follow the parameters' dtype (the forward runs in one dtype), except the
    buffers a module names in `fixed_dtype_buffers` (counts and accumulators a narrower dtype would round: the
    sigmoid router's selection bias and loads; FSDP2's mixed precision leaves every buffer as it is)."""
    for m in module.modules():
        fixed = getattr(m, "fixed_dtype_buffers", ())
        for name, buf in m._buffers.items():
            if buf is not None and buf.is_floating_point() and name not in fixed:
                m._buffers[name] = buf.to(dtype)
        for p in m.parameters(recurse=False):
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(dtype)


class DataParallel(nn.Module):
    """Data parallelism over `group` through contiguous fp32 gradient buckets (see the module docstring).

    `tied`: pairs (parameter, group) of a weight held by several ranks outside dp (a tied embedding on the first and
    last pipeline stages): its gradient is summed over that group before the dp reduction, at `finish_grad_sync`,
    in a bucket of its own so the dp shards line up on every copy (Megatron's rule). Parameters registered under
    several names (a tied weight within one module) are also reduced there.
    `overlap_param_gather=False` waits for the all-gathers at the end of `step()`. `expert_group`: the group over
    which the `expert_parallel` parameters are reduced, in buckets of their own (the module docstring); None: like
    the others.
    """

    group, expert_group = SharedGroup(), SharedGroup()

    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None = None,
                 expert_group: dist.ProcessGroup | None = None, average_over: float | None = None,
                 shard: bool = True, param_dtype: torch.dtype | None = None,
                 bucket_numel: int | None = None, tied: Iterable[tuple[nn.Parameter, dist.ProcessGroup]] = (),
                 overlap_param_gather: bool = True) -> None:
        super().__init__()
        self.group = get_mesh().dp_group if group is None else group
        self.expert_group = expert_group
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        average_over = self.size if average_over is None else average_over
        if isinstance(average_over, bool) or not isinstance(average_over, (int, float)) or not average_over > 0:
            raise ValueError(f"average_over={average_over!r} must be a number > 0 (the gradients' divisor)")
        bucket_numel = default_bucket_numel(self.size) if bucket_numel is None else bucket_numel
        if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
            raise ValueError(f"bucket_numel={bucket_numel!r} must be an integer >= 1")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        dtypes = sorted({str(p.dtype) for _, p in named})
        if len(dtypes) != 1 or any(not p.is_floating_point() for _, p in named):
            raise ValueError(f"DataParallel needs trainable parameters of one floating dtype, got {dtypes}")
        if param_dtype is not None and not param_dtype.is_floating_point:
            raise ValueError(f"param_dtype={param_dtype} must be a floating dtype")
        if param_dtype == torch.float16:
            raise ValueError("param_dtype=torch.float16 needs loss scaling, which DataParallel does not do: use "
                             "torch.bfloat16")
        self.module, self.average_over, self.shard = module, average_over, shard
        self.overlap_param_gather = overlap_param_gather
        self.param_dtype, self._built_dtype = param_dtype or named[0][1].dtype, named[0][1].dtype
        self._names = {p: n for n, p in named}
        tied = dict(tied)
        if any(p not in self._names for p in tied):
            raise ValueError("tied= names parameters that are not this module's trainable parameters")
        uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
        alone = {p for _, p in named if p in tied or uses[id(p)] > 1}  # reduced at finish_grad_sync, on their own
        expert = {p for _, p in named if expert_group is not None and getattr(p, "expert_parallel", False)}
        groups = _bucket_groups([p for _, p in named], alone, expert, bucket_numel)
        self.buckets = [Bucket(ps, group=expert_group if ps[0] in expert else self.group, shard=shard,
                               param_dtype=self.param_dtype, tied_group=tied.get(ps[0])) for ps in groups]
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        for b in self.buckets:
            b.deferred = b.params[0] in alone
            for p in b.params:
                p.main_grad.post_accumulate_hook = functools.partial(self._arrived, p)  # the fused wgrad calls it
                p.register_post_accumulate_grad_hook(self._fold_grad)
                p.folds_grad_into_main_grad = True  # (a layer may then let .grad carry what main_grad cannot)
                p.finish_grad_sync = self.finish_grad_sync  # clip_grad_norm_ reduces before it measures
                if shard:
                    start, where = b.piece(p) or (0, slice(0, 0))
                    p.main_grad_shard, p.main_grad_shard_offset = b.grad_shard[where], start
                    p.main_grad_shard_group = b.group
        if self.param_dtype != self._built_dtype:
            _cast_floating_state(module, self.param_dtype)
        self._sync, self._reduced, self._micro_batches, self._arrivals = True, False, 1, Counter()
        self._order = []  # bucket indices in the order their reductions started this step (checked in debug mode)
        # the first forward records the modules whose pre-hook ran; buckets holding parameters of the others (read
        # outside their own module's forward, e.g. a position table added by the parent) are waited for at entry
        self._seen, self._eager, self._calibrated = None, [], False
        for m in module.modules():
            mine = sorted({self.buckets.index(self._bucket_of[p]) for p in m.parameters(recurse=False)
                           if p in self._bucket_of})
            if mine:
                m.register_forward_pre_hook(functools.partial(self._before, m, [self.buckets[i] for i in mine]))
        module.register_forward_pre_hook(self._before_root, prepend=True)
        module.register_forward_hook(self._after_root)
        module.register_load_state_dict_pre_hook(self._load_masters)  # (load_state_dict of self or of module)
        # a state dict taken right after a step holds views of parameters whose all-gathers may still be running
        module.register_state_dict_pre_hook(lambda *_: self.finish_param_sync())

    def __getattr__(self, name):  # the wrapped module's attributes (config, ...), as FSDP2's in-place wrapping keeps
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.param_dtype != self._built_dtype:  # floating inputs in param_dtype (Megatron's Float16Module)
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(self.param_dtype) if t.is_floating_point() else t,
                                         (args, kwargs))
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def _load_masters(self, module, state_dict, prefix, *_):
        """Weights loaded after wrapping: the fp32 masters kept apart from bf16 parameters take the loaded values
        (unrounded), or the next step would copy the old masters back over them; a value that is its master rounded
        to the value's dtype leaves the master as it is."""
        for name, p in module.named_parameters():
            b, value = self._bucket_of.get(p), state_dict.get(prefix + name)
            if b is None or b.master_shard is b.param_shard or not torch.is_tensor(value) or value.shape != p.shape:
                continue
            if (piece := b.piece(p)) is not None:
                start, where = piece
                loaded = value.reshape(-1)[start:start + where.stop - where.start]
                # (a checkpoint's bf16 weights are this master rounded when the optimizer's state dict, holding the
                # fp32 master, loaded first: keep its low bits)
                if not torch.equal(b.master_shard[where].to(loaded.dtype), loaded.to(b.master_shard.device)):
                    b.master_shard[where] = loaded

    def extra_repr(self) -> str:
        experts = sum(b.group is not self.group for b in self.buckets)
        return (f"dp={self.size}, shard={self.shard}, average_over={self.average_over}, param_dtype={self.param_dtype}"
                f", buckets={len(self.buckets)}" + (f" ({experts} of experts over edp="
                                                    f"{dist.get_world_size(self.expert_group)})" if experts else "")
                + f", params={sum(p.numel() for b in self.buckets for p in b.params)}")

    # ---- gradients -------------------------------------------------------------------------------------------------

    def set_micro_batches(self, micro_batches: int) -> None:
        """The number of backward passes whose gradients make up each step: a parameter's gradient is complete once
        it has arrived that many times (outside `no_sync`), and its bucket reduces when all of its are."""
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches!r} must be an integer >= 1")
        self._micro_batches = micro_batches

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate into main_grad without counting towards the reduction (DDP's name)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _fold_grad(self, p):  # post-accumulate-grad hook: .grad (any dtype) into the fp32 buffer
        if p.grad is None:  # (a fused wgrad returned None: main_grad has it, and its hook reported it)
            return
        p.main_grad.add_(p.grad)
        p.grad = None
        self._arrived(p)

    def _arrived(self, p):
        self._reduced = False
        b = self._bucket_of[p]
        if not self._sync or b.deferred:
            return
        self._arrivals[p] += 1
        if b.handle is not None or self._arrivals[p] > self._micro_batches:
            raise RuntimeError(f"the gradient of {self._names[p]} arrived {self._arrivals[p]} times in a step of "
                               f"{self._micro_batches} micro-batches (set_micro_batches), or after its bucket's "
                               "reduction had started: a parameter used more than once per backward must be "
                               "registered under each name or passed in tied=")
        if self._arrivals[p] == self._micro_batches:
            b.waiting.discard(p)
            if not b.waiting:
                self._reduce(b)

    def _reduce(self, b):
        """Start bucket `b`'s reduction; in debug mode queue it: finish_grad_sync compares the ranks' orders first
        (buckets of other sizes paired up abort gloo or hang NCCL before any check could run)."""
        self._order.append(self.buckets.index(b))
        b.handle = _QUEUED
        if not debug.is_debug():
            self._launch(b)

    def _launch(self, b):
        if b.tied_group is not None and dist.get_world_size(b.tied_group) > 1:
            dist.all_reduce(b.grad_data, group=b.tied_group)  # the copies' sum first, then dp
        if b.size == 1:
            b.handle = _DONE
        elif self.shard:  # in place: this rank's shard of the buffer receives the sum
            b.handle = reduce_scatter_tensor(b.grad_shard, b.grad_data, group=b.group, async_op=True)
        else:
            b.handle = dist.all_reduce(b.grad_data, group=b.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Reduce every bucket that has not started (deferred, tied, unused parameters), wait for all, divide by
        `average_over`. Idempotent until new gradients arrive; the optimizer's step calls it."""
        if self._reduced:
            return
        for b in self.buckets:
            if b.handle is None:
                self._reduce(b)
        if debug.is_debug():  # the collectives pair up in launch order: a parameter unused on some ranks reorders it
            debug.check(torch.tensor(self._order, dtype=torch.float64, device=self.buckets[0].grad_data.device),
                        self.group, "the order DataParallel reduced its buckets in (a parameter used on some dp "
                        "ranks only?)", replicated=True, group_name="dp")
        for b in (self.buckets[i] for i in self._order):  # (queued in debug mode, even if it was turned off since)
            if b.handle is _QUEUED:
                self._launch(b)
        self._order = []
        for b in self.buckets:
            if b.handle is not _DONE:
                b.handle.wait()
            if self.average_over != 1:
                b.grad_shard.div_(self.average_over)
            b.handle, b.waiting = None, set(b.params)
        self._reduced = True
        self._arrivals.clear()

    def zero_grad_buffer(self) -> None:
        """Zero every main_grad (and drop .grad) for the next step."""
        for b in self.buckets:
            if b.handle not in (None, _DONE, _QUEUED):
                b.handle.wait()
            b.grad_data.zero_()
            b.handle, b.waiting = None, set(b.params)
            for p in b.params:
                p.grad = None
        self._reduced, self._order = False, []
        self._arrivals.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """nn.Module's zero_grad (torch's idiom between steps): the gradients live in main_grad, so zero_grad_buffer."""
        super().zero_grad(set_to_none)
        self.zero_grad_buffer()

    # ---- parameters ------------------------------------------------------------------------------------------------

    def start_param_sync(self) -> None:
        """All-gather every bucket's updated shard, asynchronously, in forward order (no-op when not sharded)."""
        if not self.shard:
            return
        for b in reversed(self.buckets):
            if b.size > 1:
                b.gather = all_gather_into_tensor(b.param_data, b.param_shard, group=b.group, async_op=True)
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def finish_param_sync(self, buckets: Sequence[Bucket] | None = None) -> None:
        """Wait for the parameters' all-gathers (of `buckets`, default all): call before reading parameters outside
        a forward (checkpoints, exports)."""
        for b in self.buckets if buckets is None else buckets:
            if b.gather is not None:
                b.gather.wait()
                b.gather = None

    def _before(self, module, buckets, *_):
        if self._seen is not None:
            self._seen.add(module)
        self.finish_param_sync(buckets)

    def _before_root(self, *_):
        if not self._calibrated and self._seen is None:
            self._seen = set()
        self.finish_param_sync(self._eager)

    def _after_root(self, *_):
        if self._seen is not None:
            hooked = {p for m in self._seen for p in m.parameters(recurse=False)}
            self._eager = [b for b in self.buckets if any(p not in hooked for p in b.params)]
            self._seen, self._calibrated = None, True
