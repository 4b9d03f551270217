"""The runner that executes any schedule of `tp.pipeline.schedules` on this rank's pipeline stage(s).

A stage is any module that follows `PipelineStage`: called as `stage(tokens, targets, hidden=x, **inputs)`, the first
stage reads the micro-batch's tokens, the others the previous stage's activation x; the last returns the micro-batch's
loss, the others their output activation; `inputs`, the micro-batch's per-token tensors every stage needs (a packed
window's document_ids and position_ids, [b, s]) and per-sample ones ([b]: the sample_ids dropout masks are keyed
by), reach every stage from the batch itself, not over p2p.
`stage.activation_shape(micro_batch_size, seq_len)` tells the runner the shape of the activations it moves between
ranks. Each micro-batch's loss is divided by the number of micro-batches, so the summed gradients are those of the
mean loss over the batch.

The runner executes a schedule's action list for this rank (F, B, W, fused BW; `tp.pipeline.schedules`): activations
(e.g. [s(/cp)(/tp), b, h]) and their gradients move between the ranks of neighbouring virtual stages with isend/irecv
on the pipeline group (shapes are fixed by the micro-batch, so both sides know them), each link's transfers issued on
both ends in one agreed order (`schedules.pair_order`): sends never block, a receive waits only when its action needs
it. B runs backward under `tp.pipeline.defer_wgrad()` (the layers queue their weight-gradient GEMMs) and W runs
what it queued.

Data parallelism rides along; every forward runs without gradient sync, and the gradients are complete before `run`
returns:
- DDP: the reducer is armed just before each chunk's last BW, so the all-reduce overlaps it, as
  torch.distributed.pipelining does. Under the B/W split it is armed just before the chunk's last W, whose one
  autograd call also runs every other parameter's accumulator (with zeros): each DDP hook fires once, after the
  parameter's last contribution (the reducer reads .grad when its hook fires), and the all-reduce overlaps that W.
  (DDP must not look for unused parameters: find_unused_parameters=False, the default.)
- FSDP2: gradient sync and resharding are off during the schedule; after the last W every parameter group's
  post-backward (reduce-scatter) runs once, as torch.distributed.pipelining does.
"""
import contextlib
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function

from ..collectives import irecv, isend
from ..host_syncs import host_values
from ..mesh import Mesh
from . import schedules
from .checks import activation_dtype_of, buffer_code, check_loss, check_sent, dtype_name, stage_device
from .wgrad import defer_wgrad

# one micro-batch: (tokens [b, s], targets [b, s]), or with a dict of [b, s] (per token) or [b] (per sample) tensors
# for every stage as a third item
Batch = tuple[torch.Tensor | None, torch.Tensor | None] | tuple[torch.Tensor | None, torch.Tensor | None,
                                                                  dict[str, torch.Tensor]]


class PipelineStage(Protocol):
    """What the runner needs of a stage (an nn.Module; inside DDP, or itself an FSDP2 module). Its parameters give
    the activations' device and, unless the runner is given `activation_dtype`, their dtype."""

    def __call__(self, tokens: torch.Tensor | None, targets: torch.Tensor | None, *,
                 hidden: torch.Tensor | None, **inputs: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] on the first stage (else None), the previous stage's activation `hidden` on the others (else
        None), targets [b, s] on the last stage (else None), the batch's `inputs` on every stage -> the
        micro-batch's mean loss on the last stage, else this stage's output activation (of `activation_shape`)."""

    def activation_shape(self, micro_batch_size: int, seq_len: int) -> tuple[int, ...]:
        """The shape of the activation this rank's stage receives and sends for one micro-batch of
        [micro_batch_size, seq_len] tokens: this rank's share (e.g. [s/cp/tp, b, h] under context and sequence
        parallelism), moved between ranks as it is."""


def tune_kernels(module: nn.Module, tokens: int) -> int:
    """Tune the Triton kernels of every tensor-parallel linear in `module` (each distinct shape once) for `tokens`
    rows per local matmul (a micro-batch's b·s/cp: with sequence parallelism too, the matmuls see the gathered
    sequence); how many linears launched (0 on the torch backend)."""
    seen: set = set()
    return sum(m.tune_kernels(tokens, seen) for m in module.modules() if hasattr(m, "tune_kernels"))


def _param_groups(fsdp_state):
    """An FSDP2 state's parameter groups: a list from torch 2.12 (`_fsdp_param_groups`), before it one group or None
    (`_fsdp_param_group`, torch 2.11: the GPU machine's)."""
    groups = getattr(fsdp_state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(fsdp_state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return groups


def batch_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """The micro-batch's tensors for every stage (its third item), {} for (tokens, targets)."""
    return batch[2] if len(batch) > 2 else {}


def model_chunks(module: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """This rank's model chunks: a list, tuple or ModuleList of chunks (interleaved schedules), or [module]."""
    return list(module) if isinstance(module, (list, tuple, nn.ModuleList)) else [module]


def unwrap(module: nn.Module) -> nn.Module:
    """The stage inside DDP (FSDP2 modules are the stage itself)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


@dataclass
class ScheduleStats:
    mean_loss: torch.Tensor | None = None  # the mean over micro-batches (0-d fp64, on the device: every pipeline rank)
    busy_s: float = 0.0  # time in forward/backward compute on this stage
    total_s: float = 0.0  # the schedule's wall time on this stage (from the stages' common start)
    bubble: float = 0.0  # the pipeline's idle fraction: 1 - Σ busy / (p · the longest stage's wall time)
    max_alive: int = 0  # forward chunks whose activations were alive at once (awaiting their B)
    peak_activations: float = 0.0  # max_alive in micro-batches through a whole stage (a chunk counts 1/V)
    times: dict[str, float] = field(default_factory=dict)  # seconds per action kind ("F", "B", "W", "BW") here
    order: list[schedules.Action] = field(default_factory=list)  # the Actions in execution order

    @property
    def loss(self) -> float:
        """mean_loss read on the host (a host sync: read it when it is logged)."""
        return 0.0 if self.mean_loss is None else self.mean_loss.item()


class _Transfers:
    """This rank's side of a schedule's transfers: each link's sends and receives issued in the order both ends
    agree on; sends asynchronous (waited at the end), receives posted in that order and waited when needed; two
    chunks on this rank hand over locally."""

    def __init__(self, schedule, mesh, runner, device, pairs=None):
        self.rank, self.group, self.ranks = mesh.pp_rank, mesh.pp_group, mesh.ranks("pp")
        self.shape, self.dtype, self.device, self.m = runner.shape, runner.dtype, device, schedule.micro_batches
        self.batch_shape = runner.batch_shape
        self.links = {}  # peer -> [(message, outgoing)]
        for (a, b), transfers in (pairs or schedules.pair_order(schedule)).items():
            if self.rank in (a, b):
                self.links[b if a == self.rank else a] = [(msg, src == self.rank) for msg, src, _ in transfers]
        self.cursor = dict.fromkeys(self.links, 0)
        self.ready, self.posted, self.local, self.sending = {}, {}, {}, []

    def _tag(self, message):
        return (2 * message.stage + (message.kind == "grad")) * self.m + message.micro

    def _issue(self, peer, message):
        """Issue the link's operations up to and including `message`'s."""
        ops = self.links[peer]
        while True:
            msg, outgoing = ops[self.cursor[peer]]
            self.cursor[peer] += 1
            if outgoing:
                if msg not in self.ready:
                    raise RuntimeError(f"pipeline schedule: {tuple(msg)} is due on the link to pipeline rank {peer} "
                                       "before this rank has computed it")
                tensor = self.ready.pop(msg)
                self.sending.append((isend(tensor, self.ranks[peer], group=self.group, tag=self._tag(msg)),
                                     tensor))
            else:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                self.posted[msg] = buffer, irecv(buffer, self.ranks[peer], group=self.group, tag=self._tag(msg))
            if msg == message:
                return

    def send(self, message, dst, tensor):
        local = dst == self.rank  # (a hand-over between two chunks of this rank: no buffer to fit)
        check_sent(message, tensor, None if local else (self.shape, self.dtype, self.batch_shape))
        if local:
            self.local[message] = tensor.detach()
            return
        self.ready[message] = tensor.detach().contiguous()
        self._issue(dst, message)

    def recv(self, message, src):
        if src == self.rank:
            return self.local.pop(message)
        if message not in self.posted:
            self._issue(src, message)
        buffer, work = self.posted.pop(message)
        work.wait()
        return buffer

    def finish(self):
        for work, _ in self.sending:
            work.wait()
        self.sending.clear()


class PipelineRunner:
    """Runs one optimizer step's micro-batches through this rank's stage (or model chunks) with a schedule.

    `module`: the stage (a `PipelineStage`, or DDP / FSDP2 around it), or a list of V chunks for interleaved
    schedules (each wrapped alike). `batches`: per micro-batch (tokens [b, s], targets [b, s]), or (tokens, targets,
    {name: [b, s] tensor, e.g. document_ids}); only the first stage reads tokens, only the last targets, every stage
    the dict.
    """

    def __init__(self, module: nn.Module | Sequence[nn.Module], mesh: Mesh, *, micro_batch_size: int,
                 seq_len: int, activation_dtype: torch.dtype | None = None) -> None:
        self.module, self.mesh = module, mesh
        self.chunks = model_chunks(module)
        self.stages = [unwrap(c) for c in self.chunks]
        self.stage = self.stages[0]
        self.shape = tuple(self.stage.activation_shape(micro_batch_size, seq_len))  # what p2p carries
        self.batch_shape = (micro_batch_size, seq_len)
        # what p2p carries: given (bf16 activations of fp32 parameters under autocast), else the parameters'
        self.dtype = activation_dtype or activation_dtype_of(self.stage)
        self._plans, self._pairs = {}, {}  # (name, m) -> Schedule; Schedule -> its link order (pair_order)
        self._tuned = False
        self._warned_nothing_deferred = False

    def _device(self):
        return stage_device(self.stage)

    def _expected(self, name, t):
        """(what, shape): [micro_batch_size, seq_len], or [micro_batch_size] for a 1-D input (per sample)."""
        if name not in ("tokens", "targets") and t is not None and t.dim() == 1:
            return "[micro_batch_size]", self.batch_shape[:1]
        return "[micro_batch_size, seq_len]", self.batch_shape

    def _check_batches(self, batches):
        """Raise on every stage if any stage's micro-batches differ from the shape the buffers are built for, or
        the stages were given different counts; the one all-reduce is also the schedule's common start."""
        problem = next((f"micro-batch {k}: {name} shape {tuple(t.shape)} != {what} {shape} this runner was built for"
                        for k, batch in enumerate(batches)
                        for name, t in [*zip(("tokens", "targets"), batch[:2]), *batch_inputs(batch).items()]
                        for what, shape in [self._expected(name, t)]
                        if t is not None and tuple(t.shape) != shape), None)
        if self.mesh.pp_size == 1:
            if problem:
                raise ValueError(problem)
            return
        agreed = [len(batches), *buffer_code(self.shape, self.dtype)]  # (the same on every stage, or refused)
        flags = torch.tensor([problem is not None, *agreed, *(-v for v in agreed)], dtype=torch.float64, device="cpu")
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.mesh.pp_group)  # (the host's numbers, over gloo)
        bad, *values = host_values(flags)
        (most, *highest), (fewest, *lowest) = values[:len(agreed)], values[len(agreed):]
        if most != -fewest:
            raise ValueError(f"the pipeline stages were given different numbers of micro-batches: {-fewest:.0f} to "
                             f"{most:.0f}")
        if highest != [-v for v in lowest]:
            raise ValueError(f"the pipeline stages' runners disagree on the activations they move (this one: "
                             f"activation_shape{self.batch_shape} = {self.shape} in {dtype_name(self.dtype)}): each "
                             "stage's activation_shape() and activation dtype (its first floating parameter's, or "
                             "activation_dtype=) must agree")
        if bad:
            raise ValueError(problem or "another pipeline stage's micro-batches do not have the shape "
                             f"[micro_batch_size, seq_len] {self.batch_shape} this runner was built for")

    def schedule(self, name: str, micro_batches: int) -> schedules.Schedule:
        """The Schedule `name` for this pipeline, m micro-batches and this runner's chunks (cached)."""
        key = (name, micro_batches)
        if key not in self._plans:
            self._plans[key] = schedules.build(name, self.mesh.pp_size, micro_batches, len(self.chunks))
        return self._plans[key]

    def run(self, batches: Sequence[Batch], schedule: str | schedules.Schedule = "1f1b") -> ScheduleStats:
        """Forward and backward every micro-batch with `schedule` (a name of tp.pipeline.schedules.SCHEDULES, or a
        Schedule); returns ScheduleStats (loss: the mean over micro-batches)."""
        self._check_batches(batches)
        m, p = len(batches), self.mesh.pp_size
        plan = schedule if isinstance(schedule, schedules.Schedule) else self.schedule(schedule, m)
        if (plan.pp, plan.micro_batches, plan.virtual_stages) != (p, m, len(self.chunks)):
            raise ValueError(f"schedule {plan.name!r} is for pp={plan.pp}, {plan.micro_batches} micro-batches, "
                             f"{plan.virtual_stages} chunks; this run has pp={p}, {m}, {len(self.chunks)}")
        stats = ScheduleStats(times=dict.fromkeys(schedules.KINDS, 0.0))
        if not self._tuned:  # the kernels' first-time autotuning, here rather than inside the schedule's receives
            self._tuned = True
            tokens = self.batch_shape[0] * self.batch_shape[1] // self.mesh.cp_size
            for stage in self.stages:
                tune_kernels(stage, tokens)
        self._start_data_parallel()
        start = time.perf_counter()
        self._execute(plan, batches, stats)
        self._finish_data_parallel()
        stats.total_s = time.perf_counter() - start
        stats.busy_s = sum(stats.times.values())
        # The loss lives on the last stage; the bubble is the theory's quantity: idle time over p x the span, which a
        # stage's own clock would understate (the stages that finish first miss the drain).
        if stats.mean_loss is None:  # (not the last stage: its share of the sum below)
            stats.mean_loss = torch.zeros((), dtype=torch.float64, device=self._device())
        stats.mean_loss = stats.mean_loss.double()
        busy, span = (torch.tensor([t], dtype=torch.float64, device="cpu") for t in (stats.busy_s, stats.total_s))
        if p > 1:  # (the loss on the device; the times on the host, over gloo: neither waits for the device)
            dist.all_reduce(stats.mean_loss, group=self.mesh.pp_group)
            dist.all_reduce(busy, group=self.mesh.pp_group)
            dist.all_reduce(span, op=dist.ReduceOp.MAX, group=self.mesh.pp_group)
        (busy,), (span,) = host_values(busy), host_values(span)
        stats.bubble = max(0.0, 1.0 - busy / (p * span)) if span else 0.0
        return stats

    def _execute(self, plan, batches, stats):
        rank, last_stage, m = self.mesh.pp_rank, plan.num_stages - 1, plan.micro_batches
        if plan not in self._pairs:  # (simulated once per schedule, not every step)
            self._pairs[plan] = schedules.pair_order(plan)
        links = _Transfers(plan, self.mesh, self, self._device(), self._pairs[plan])
        alive, deferred = {}, {}
        backwards, weights = [0] * len(self.chunks), [0] * len(self.chunks)
        split = plan.split_backward
        for action in plan.actions[rank]:
            c, k = action.chunk, action.micro
            chunk, s = self.chunks[c], plan.stage(rank, c)
            with record_function(f"recv for {action.kind} stage={s} chunk={c} micro={k}"):  # (profiles read so)
                received = [links.recv(message, src) for message, src in plan.receives(rank, action)]
            with record_function(f"{action.kind} stage={s} chunk={c} micro={k}"):  # a trace reads as the schedule
                started = time.perf_counter()  # compute only: waiting for the input is the bubble
                if action.kind == "F":
                    tokens, targets = batches[k][:2]
                    x = received[0].requires_grad_() if received else None
                    sync = chunk.no_sync() if isinstance(chunk, DistributedDataParallel) else contextlib.nullcontext()
                    with sync, defer_wgrad() if split else contextlib.nullcontext():
                        out = chunk(tokens if s == 0 else None, targets if s == last_stage else None, hidden=x,
                                    **batch_inputs(batches[k]))
                    if s == last_stage:
                        out = check_loss(out, k) / m  # the mean over micro-batches, as the un-pipelined batch mean
                        total = 0.0 if stats.mean_loss is None else stats.mean_loss  # (a new tensor: out stays)
                        stats.mean_loss = total + out.detach()  # (summed on the device: no host sync)
                    alive[c, k] = x, out
                    stats.max_alive = max(stats.max_alive, len(alive))
                elif action.kind in ("B", "BW"):
                    x, out = alive.pop((c, k))
                    grad = received[0] if received else None
                    backwards[c] += 1
                    if isinstance(chunk, DistributedDataParallel) and action.kind == "BW" and backwards[c] == m:
                        chunk.reducer.prepare_for_backward(list(torch.nn.parallel.distributed._find_tensors(out)))
                    with defer_wgrad() if action.kind == "B" else contextlib.nullcontext() as queue:
                        torch.autograd.backward(out, grad_tensors=grad)
                    if queue is not None:
                        deferred[c, k] = queue
                        self._warn_if_nothing_deferred(plan, s, queue)
                    del out
                else:  # W
                    weights[c] += 1
                    touch = ()
                    if isinstance(chunk, DistributedDataParallel) and weights[c] == m:  # all-reduce during this one
                        chunk.reducer.prepare_for_backward([])
                        touch = [p for n, p in chunk.module.named_parameters()
                                 if p.requires_grad and n not in chunk.parameters_to_ignore]
                    deferred.pop((c, k)).run(touch=touch)
                stats.times[action.kind] += time.perf_counter() - started
            for message, dst in plan.sends(rank, action):
                links.send(message, dst, out if action.kind == "F" else x.grad)
            stats.order.append(action)
        links.finish()
        assert not (alive or deferred or links.posted or links.local), "the schedule left work undone"
        stats.peak_activations = stats.max_alive / plan.virtual_stages

    def _warn_if_nothing_deferred(self, plan, stage, queue):
        if len(queue) or self._warned_nothing_deferred:
            return
        self._warned_nothing_deferred = True
        warnings.warn(f"schedule {plan.name!r}: pipeline stage {stage}'s backward deferred no weight gradient (the "
                      "parallel linears and experts defer theirs; another Function can through "
                      "tp.pipeline.wgrad.defer_weight_grad): B computed them all and W does nothing, 1F1B's timing",
                      stacklevel=4)

    # ---- data parallelism ----------------------------------------------------------------------------------------

    def _fsdp(self):
        return [c for c in self.chunks if hasattr(c, "set_requires_gradient_sync")]

    def _start_data_parallel(self):
        for module in self._fsdp():  # as torch.distributed.pipelining: no reduce-scatter until every W is done
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)

    def _finish_data_parallel(self):
        for module in self._fsdp():  # each parameter group's post-backward once: reduce-scatter, reshard
            from torch.distributed.fsdp import fully_shard

            module.set_is_last_backward(True)
            module.set_reshard_after_backward(True)
            module.set_requires_gradient_sync(True)
            state = fully_shard.state(module)
            for sub in state._state_ctx.all_states:
                for group in _param_groups(sub):
                    group.post_backward()
            state._root_post_backward_final_callback()

    # ---- evaluation ----------------------------------------------------------------------------------------------

    def forward_only(self, batches: Sequence[Batch]) -> float:
        """Evaluation: every micro-batch forward through the stages in eval mode, no graph, no backward (no DDP
        sync); returns the mean loss over the micro-batches, on every rank of the pipeline."""
        self._check_batches(batches)
        plan = schedules.forward_only(self.mesh.pp_size, len(batches), len(self.chunks))
        rank, last_stage = self.mesh.pp_rank, plan.num_stages - 1
        links = _Transfers(plan, self.mesh, self, self._device())
        total = torch.zeros((), dtype=torch.float64, device=self._device())
        was_training = [s.training for s in self.stages]
        try:
            with torch.no_grad():
                for action in plan.actions[rank]:
                    stage, s = self.stages[action.chunk], plan.stage(rank, action.chunk)
                    stage.eval()
                    batch = batches[action.micro]
                    x = None if s == 0 else links.recv(*plan.receives(rank, action)[0])
                    out = stage(batch[0] if s == 0 else None, batch[1] if s == last_stage else None, hidden=x,
                                **batch_inputs(batch))
                    if s == last_stage:
                        total += check_loss(out, action.micro).double()
                    for message, dst in plan.sends(rank, action):
                        links.send(message, dst, out)
            links.finish()
        finally:
            for stage, training in zip(self.stages, was_training):
                stage.train(training)
            for module in self._fsdp():  # no backward reshards the root after its forward: the sharded parameters
                for sub in module.modules():  # registered again, those the optimizer steps and checkpoints save
                    if hasattr(sub, "reshard"):
                        sub.reshard()
        if self.mesh.pp_size > 1:  # the loss lives on the last stage
            dist.all_reduce(total, group=self.mesh.pp_group)
        return total.item() / len(batches)
