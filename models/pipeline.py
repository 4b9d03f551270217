"""Pipeline parallelism for the GPT: stage split, point-to-point transfers, GPipe and 1F1B schedules.

A stage is `GPT(config, layers=(start, stop), pre_process=first, post_process=last)`: the embedding lives on the
first stage, the final norm, output layer and loss on the last. Activations [s(/tp), b, h] and their gradients move
between neighbouring stages with batched isend/irecv on the pipeline group; shapes are fixed by the micro-batch, so
both sides know them in advance. Each micro-batch's loss is divided by the number of micro-batches, so the summed
gradients are those of the mean loss over the whole batch, as the un-pipelined model computes it.

Schedules (p stages, m micro-batches; both idle (p-1)/(m+p-1) of the time):
- GPipe: every forward, then every backward; m micro-batches of activations alive.
- 1F1B: stage i runs min(p-i-1, m) warm-up forwards, then alternates one forward and one backward, then the
  remaining backwards; at most p-i micro-batches alive.

Data parallelism rides along: under DDP every forward runs in `no_sync()` and the reducer is armed just before the
last backward (so gradients are averaged once, overlapped with that backward, as torch.distributed.pipelining does);
under FSDP2 gradient sync is switched on for the last backward only.
"""
import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .gpt import GPT


def stage_layers(num_layers, pp, stage):
    """(start, stop) of `stage`'s layers: an even split, the first `num_layers % pp` stages taking one more."""
    if pp > num_layers:
        raise ValueError(f"pp={pp} pipeline stages need at least {pp} layers, the model has num_layers={num_layers}")
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return start, start + base + (stage < extra)


def stage_options(config, mesh):
    """GPT keyword arguments of this rank's pipeline stage."""
    return dict(layers=stage_layers(config.num_layers, mesh.pp_size, mesh.pp_rank), pre_process=mesh.is_first_stage,
                post_process=mesh.is_last_stage)


def build_stage(config, mesh):
    """This rank's pipeline stage of the GPT (the whole model when pp = 1), on the mesh's tp and cp groups."""
    return GPT(config, group=mesh.tp_group, cp_group=mesh.cp_group, **stage_options(config, mesh))


@dataclass
class ScheduleStats:
    loss: float = 0.0  # the mean over micro-batches (on every rank of the pipeline)
    busy_s: float = 0.0  # time in forward/backward compute on this stage
    total_s: float = 0.0  # the schedule's wall time on this stage (from the stages' common start)
    bubble: float = 0.0  # the pipeline's idle fraction: 1 - Σ busy / (p · the longest stage's wall time)
    max_alive: int = 0  # micro-batches whose activations were alive at once
    order: list = field(default_factory=list)  # ("F" | "B", micro-batch) in execution order


class PipelineRunner:
    """Runs one optimizer step's micro-batches through this rank's stage with a schedule.

    `module`: the stage (a GPT stage, or DDP / FSDP2 around it). `batches`: per micro-batch (tokens [b, s],
    targets [b, s]); only the first stage reads tokens and only the last reads targets.
    """

    def __init__(self, module, mesh, *, micro_batch_size, seq_len):
        self.module, self.mesh = module, mesh
        self.stage = module.module if isinstance(module, DistributedDataParallel) else module
        config = self.stage.config
        seq = seq_len // mesh.cp_size // (mesh.tp_size if config.sequence_parallel else 1)
        self.shape = (seq, micro_batch_size, config.hidden_size)  # [s(/cp)(/tp), b, h]: p2p carries this rank's share
        self.batch_shape = (micro_batch_size, seq_len)
        self.dtype = next(self.stage.parameters()).dtype

    # ---- point-to-point ----------------------------------------------------------------------------------------

    def _communicate(self, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """One batched isend/irecv with the neighbouring stages; returns (from prev, from next)."""
        mesh, ops = self.mesh, []
        from_prev = from_next = None
        if recv_prev:
            from_prev = torch.empty(self.shape, dtype=self.dtype, device=self._device())
            ops.append(dist.P2POp(dist.irecv, from_prev, mesh.prev_stage_rank, mesh.pp_group))
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.contiguous(), mesh.next_stage_rank, mesh.pp_group))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), mesh.prev_stage_rank, mesh.pp_group))
        if recv_next:
            from_next = torch.empty(self.shape, dtype=self.dtype, device=self._device())
            ops.append(dist.P2POp(dist.irecv, from_next, mesh.next_stage_rank, mesh.pp_group))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return from_prev, from_next

    def _device(self):
        return next(self.stage.parameters()).device

    # ---- one micro-batch -----------------------------------------------------------------------------------------

    def _forward(self, index, batch, received, stats, num_micro):
        start = time.perf_counter()
        tokens, targets = batch
        context = self.module.no_sync() if isinstance(self.module, DistributedDataParallel) else \
            contextlib.nullcontext()
        with context:
            if self.mesh.is_first_stage:
                output = self.module(tokens, targets if self.mesh.is_last_stage else None)
            else:
                received.requires_grad_()
                output = self.module(hidden=received, targets=targets if self.mesh.is_last_stage else None)
        if self.mesh.is_last_stage:
            output = output / num_micro  # the mean over micro-batches, as the un-pipelined batch mean
            stats.loss = stats.loss + output.detach()  # (on the device: no host sync per micro-batch)
        stats.busy_s += time.perf_counter() - start
        stats.order.append(("F", index))
        return output

    def _backward(self, index, received, output, grad, stats, last):
        start = time.perf_counter()
        if isinstance(self.module, DistributedDataParallel) and last:  # average over dp during this backward
            self.module.reducer.prepare_for_backward(list(torch.nn.parallel.distributed._find_tensors(output)))
        if hasattr(self.module, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter on the last backward only
            self.module.set_requires_gradient_sync(last)
        torch.autograd.backward(output, grad_tensors=grad)
        stats.busy_s += time.perf_counter() - start
        stats.order.append(("B", index))
        return None if received is None else received.grad

    # ---- schedules -----------------------------------------------------------------------------------------------

    def _check_batches(self, batches):
        """Raise on every stage if any stage's micro-batches differ from the shape the buffers are built for, or
        the stages were given different counts; the one all-reduce is also the schedule's common start."""
        problem = next((f"micro-batch {k}: {name} shape {tuple(t.shape)} != [micro_batch_size, seq_len] "
                        f"{self.batch_shape} this runner was built for"
                        for k, batch in enumerate(batches) for name, t in zip(("tokens", "targets"), batch)
                        if t is not None and tuple(t.shape) != self.batch_shape), None)
        if self.mesh.pp_size == 1:
            if problem:
                raise ValueError(problem)
            return
        flags = torch.tensor([problem is not None, len(batches), -len(batches)], dtype=torch.float64,
                             device=self._device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.mesh.pp_group)
        bad, most, fewest = flags.tolist()
        if most != -fewest:
            raise ValueError(f"the pipeline stages were given different numbers of micro-batches: {-fewest:.0f} to "
                             f"{most:.0f}")
        if bad:
            raise ValueError(problem or "another pipeline stage's micro-batches do not have the shape "
                             f"[micro_batch_size, seq_len] {self.batch_shape} this runner was built for")

    def run(self, batches, schedule="1f1b"):
        """Forward and backward every micro-batch; returns ScheduleStats (loss: the mean over micro-batches)."""
        if schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"schedule={schedule!r} must be '1f1b' or 'gpipe'")
        mesh, m = self.mesh, len(batches)
        p, i = mesh.pp_size, mesh.pp_rank
        warmup = m if schedule == "gpipe" else min(p - i - 1, m)
        stats, alive = ScheduleStats(), []  # alive: (index, received input, output) awaiting backward
        self._check_batches(batches)
        start = time.perf_counter()
        first, last = mesh.is_first_stage, mesh.is_last_stage

        def forward(k, received):
            alive.append((k, received, self._forward(k, batches[k], received, stats, m)))
            stats.max_alive = max(stats.max_alive, len(alive))

        def backward(grad):
            k, received, output = alive.pop(0)
            return self._backward(k, received, output, grad, stats, last=k == m - 1)

        # warm-up forwards (GPipe: all of them)
        for k in range(warmup):
            received, _ = self._communicate(recv_prev=not first)
            forward(k, received)
            self._communicate(send_next=None if last else alive[-1][2])
        # steady state: one forward, one backward
        received = self._communicate(recv_prev=not first)[0] if warmup < m else None
        for k in range(warmup, m):
            forward(k, received)
            _, grad = self._communicate(send_next=None if last else alive[-1][2], recv_next=not last)
            input_grad = backward(grad)
            more = k + 1 < m
            received, _ = self._communicate(send_prev=None if first else input_grad, recv_prev=more and not first)
        # cool-down backwards
        while alive:
            _, grad = self._communicate(recv_next=not last)
            input_grad = backward(grad)
            self._communicate(send_prev=None if first else input_grad)
        stats.total_s = time.perf_counter() - start
        # The loss lives on the last stage; the bubble is the theory's (p-1)/(m+p-1) quantity: idle time over p x the
        # span, which a stage's own clock would understate (the stages that finish first miss the drain).
        sums = torch.tensor([float(stats.loss), stats.busy_s], dtype=torch.float64)
        span = torch.tensor([stats.total_s], dtype=torch.float64)
        if p > 1:
            dist.all_reduce(sums, group=mesh.pp_group)
            dist.all_reduce(span, op=dist.ReduceOp.MAX, group=mesh.pp_group)
        stats.loss = sums[0].item()
        stats.bubble = max(0.0, 1.0 - sums[1].item() / (p * span.item())) if span.item() else 0.0
        return stats

    def forward_only(self, batches):
        """Evaluation: every micro-batch forward through the stages in eval mode, no graph, no backward (no DDP
        sync); returns the mean loss over the micro-batches, on every rank of the pipeline."""
        self._check_batches(batches)
        first, last = self.mesh.is_first_stage, self.mesh.is_last_stage
        total = torch.zeros((), dtype=torch.float64, device=self._device())
        was_training = self.stage.training
        self.stage.eval()
        try:
            with torch.no_grad():
                for tokens, targets in batches:
                    received, _ = self._communicate(recv_prev=not first)
                    output = self.stage(tokens if first else None, targets if last else None, hidden=received)
                    if last:
                        total += output.double()
                    else:
                        self._communicate(send_next=output)
        finally:
            self.stage.train(was_training)
        if self.mesh.pp_size > 1:  # the loss lives on the last stage
            dist.all_reduce(total, group=self.mesh.pp_group)
        return total.item() / len(batches)


def allreduce_tied_embedding_grads(stage, mesh):
    """Sum the first stage's embedding grad and the last stage's tied output grad (their two copies of one weight)."""
    if not stage.config.tie_embeddings or mesh.pp_size == 1 or not mesh.in_embedding_group:
        return
    weight = stage.embedding.weight if mesh.is_first_stage else stage.output.weight
    grad = weight.grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2: same dp shard on both stages
    dist.all_reduce(local, group=mesh.embedding_group)
