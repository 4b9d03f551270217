"""The training job on one rank: `Trainer` builds it (the mesh, this rank's model chunks wrapped for data parallelism,
AdamW, a resumed checkpoint, the data), then runs optimizer steps through the pipeline schedule, evaluates, saves
checkpoints and logs. `train(job)` is the whole job; models/training/cli.py is its command line."""
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import tp
from tp.pipeline import PipelineRunner

from ..flops import flops_per_token
from ..stages import allreduce_tied_embedding_grads
from . import checkpoint_dirs, data, documents, failures, faults, launch, progress
from .checkpoint_dirs import resume_path
from .config import JobConfig
from .model import build_model, data_parallel_chunks, gpt_config_from_job

DATA_ORDER = ("global_batch_size", "seed", "seq_len")  # [training] fields the data stream's position depends on


def set_hyperparameters(optimizer: torch.optim.Optimizer, job: JobConfig, step: int) -> None:
    """This step's learning rate, and the job's weight decay (group 0; group 1 holds the 1-D parameters, never
    decayed): the job wins over what a loaded checkpoint's param_groups carried."""
    lr = job.optimizer.learning_rate(step, job.training.steps)
    for group, weight_decay in zip(optimizer.param_groups, (job.optimizer.weight_decay, 0.0)):
        group["lr"], group["weight_decay"] = lr, weight_decay


def build_mesh(job: JobConfig) -> tp.Mesh:
    """The tp x cp x pp x dp mesh (nccl on GPUs, else gloo); rank 0 prints the layout."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    parallel = job.parallelism
    mesh = tp.init_mesh(tp=parallel.tp, cp=parallel.cp, pp=parallel.pp, dp=parallel.dp, backend=backend,
                        timeout=datetime.timedelta(minutes=job.launch.distributed_timeout_minutes))
    launch.announce_layout(mesh)  # rank 0 prints which ranks sit on which node, and their coordinates
    if backend == "nccl":
        torch.set_default_device(f"cuda:{torch.cuda.current_device()}")
    return mesh


def build_optimizer(module: torch.nn.Module, job: JobConfig, micro_batches: int) -> torch.optim.Optimizer:
    """AdamW over this rank's chunks (no weight decay on 1-D parameters, norms and biases, as Megatron); with
    tp.optim.DataParallel chunks (zero1, bf16), one DistributedOptimizer over their fp32 masters' shards."""
    groups = [{"params": [p for p in module.parameters() if p.dim() > 1]},
              {"params": [p for p in module.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
    hyperparameters = dict(lr=job.optimizer.lr, betas=(0.9, 0.95), weight_decay=job.optimizer.weight_decay)
    buffered = data_parallel_chunks(module)
    if not buffered:
        return torch.optim.AdamW(groups, **hyperparameters)
    for chunk in buffered:  # a bucket reduces once its gradients have arrived from every micro-batch, any schedule
        chunk.set_micro_batches(micro_batches)
    return tp.optim.DistributedOptimizer(module, groups, **hyperparameters)


class Trainer:
    """One rank's part of the job, built at construction (collective: every rank builds its Trainer together)."""

    def __init__(self, job: JobConfig, *, config_file: str | None = None):
        torch.set_num_threads(1)
        training = job.training
        self.job, self.mesh = job, build_mesh(job)
        self.rank0 = dist.get_rank() == 0
        self.config = gpt_config_from_job(job)
        self.chunks, self.module = build_model(job, self.config, self.mesh)
        # the unwrapped chunks, one module: their grads summed over sequence parallelism and the tied embedding
        self.stage = self.chunks[0] if len(self.chunks) == 1 else torch.nn.ModuleList(self.chunks)
        micro_batches = training.global_batch_size // (self.mesh.dp_size * training.micro_batch_size)
        self.buffered = data_parallel_chunks(self.module)  # zero1 / bf16: tp.optim.DataParallel, one per chunk
        self.optimizer = build_optimizer(self.module, job, micro_batches)
        self.start_step = self.resume()
        self.runner = PipelineRunner(self.module, self.mesh, micro_batch_size=training.micro_batch_size,
                                     seq_len=training.seq_len)
        # rank 0 tokenizes a user's text if the launcher has not (own torchrun); the last ~1% of each dataset's
        # windows: validation only
        dataset, self.held_out = data.shared_datasets(job)
        self.stream = data.batches(dataset, dp=self.mesh.dp_size, dp_rank=self.mesh.dp_rank,
                                   global_batch_size=training.global_batch_size,
                                   micro_batch_size=training.micro_batch_size, seed=training.seed,
                                   start_step=self.start_step)
        self.documents = documents.from_job(job)  # --reset-attention-mask etc.: per-token inputs from the EODs
        if self.rank0:
            print(self.start_line(micro_batches, config_file), flush=True)

    def resume(self) -> int:
        """Load the checkpoint --load names (none: a fresh start); the step to start from."""
        job = self.job
        path = resume_path(job.checkpoint.load, job.checkpoint.save)
        if not path:  # a fresh start (also with --save and --load the same directory, still empty)
            return 0
        from . import checkpoint

        start_step, extra = checkpoint.load(path, self.module, self.optimizer, mesh=self.mesh)
        if self.rank0:
            print(f"resuming from {path} (step {start_step})", flush=True)
            changed = [f"--{k.replace('_', '-')}={v}" for k, v in (extra or {}).items()
                       if k in DATA_ORDER and getattr(job.training, k) != v]
            if changed:
                print(f"note: the checkpoint's run had {', '.join(changed)}: the data order from here differs from "
                      "that run's", file=sys.stderr, flush=True)
        return start_step

    def start_line(self, micro_batches: int, config_file: str | None) -> str:
        job, mesh, config = self.job, self.mesh, self.config
        params = sum(p.numel() for p in self.stage.parameters())
        parallel = job.parallelism
        return (f"{mesh.world_size} ranks: tp={mesh.tp_size} cp={mesh.cp_size} pp={mesh.pp_size} dp={mesh.dp_size} "
                f"({parallel.dp_mode}, {job.training.precision}), schedule={parallel.schedule}, "
                f"micro-batches/step={micro_batches}, sequence_parallel={parallel.sequence_parallel}; model "
                f"{job.model.from_hf or job.model.preset or 'tiny'} ({config.num_layers} layers, hidden "
                f"{config.hidden_size}, {params:,} params on rank 0)"
                + (f"; config: {config_file}" if config_file else ""))

    def step(self, step: int) -> tuple[dict, float]:
        """Optimizer step `step` (from 0) on the next global batch: (its log record, the global gradient norm)."""
        job, mesh, training = self.job, self.mesh, self.job.training
        started = time.perf_counter()
        micro_batches = self.with_documents(next(self.stream))
        if training.check_inputs:  # every tp (and cp) rank of a group reads the same tokens
            for tokens, targets, *_ in micro_batches:
                tp.debug.check(torch.stack([tokens, targets]), mesh.group("tp-cp"), "the training tokens",
                               replicated=True, group_name="tp-cp")
        failures.note_step(step + 1)
        faults.before_step(job.faults, step + 1)
        set_hyperparameters(self.optimizer, job, step)
        stats = self.runner.run(micro_batches, job.parallelism.schedule)
        if not self.config.sequence_parallel_grad_sync:
            tp.allreduce_sequence_parallel_grads(self.stage, mesh.tp_group)  # one all-reduce for every SP param
        if not self.buffered:  # (tp.optim.DataParallel sums the tied copies itself)
            allreduce_tied_embedding_grads(self.stage, mesh)
        faults.after_gradients(job.faults, step + 1, self.module)
        # the global norm over tp, pp and dp (each parameter once); clipped when --clip-grad > 0
        grad_norm = tp.clip_grad_norm_(self.module.parameters(), training.clip_grad, mesh=mesh).item()
        if math.isfinite(grad_norm):
            self.optimizer.step()
        elif self.rank0:  # Megatron's behaviour: no update from a non-finite gradient, the model stays as it was
            print(f"skipped step {step + 1}: grad norm {grad_norm}", file=sys.stderr, flush=True)
        memory = self.max_memory_bytes() if step == self.start_step else {}  # grads and state exist now
        self.optimizer.zero_grad(set_to_none=True)
        loss = _mean_over(stats.loss, mesh.dp_group)
        elapsed = time.perf_counter() - started
        tokens = training.global_batch_size * training.seq_len
        flops = flops_per_token(self.config, training.seq_len) * tokens  # model FLOPs (models/flops.py)
        skipped = not math.isfinite(grad_norm)
        record = {"step": step + 1, "loss": loss, "grad_norm": None if skipped else grad_norm,  # JSON: no NaN
                  "lr": job.optimizer.learning_rate(step, training.steps), "tokens_per_s": tokens / elapsed,
                  "tflops_per_rank": flops / mesh.world_size / elapsed / 1e12,
                  "bubble": stats.bubble if mesh.pp_size > 1 else None, "step_s": elapsed} | memory
        if skipped:
            record["skipped"] = True
        return record, grad_norm

    def evaluate(self) -> float:
        """val_loss: the mean loss over --eval-iters global batches of the held-out windows, forward only; the same
        batches, and so the same value, for any split."""
        training = self.job.training
        batches = data.eval_batches(self.held_out, dp=self.mesh.dp_size, dp_rank=self.mesh.dp_rank,
                                    global_batch_size=training.global_batch_size,
                                    micro_batch_size=training.micro_batch_size, iters=self.job.evaluation.eval_iters)
        micro_batches = self.with_documents([micro for batch in batches for micro in batch])
        return _mean_over(self.runner.forward_only(micro_batches), self.mesh.dp_group)

    def with_documents(self, micro_batches: list) -> list:
        """The micro-batches with their documents' inputs and loss mask (documents.py), when the job asks."""
        return micro_batches if self.documents is None else [self.documents(*micro) for micro in micro_batches]

    def save(self, step: int) -> None:
        """Write --save's DIR/step-N, then point DIR/latest at it (checkpoint_dirs.py): a kill mid-save never spoils
        the previous checkpoint, and what it half wrote is removed here, at the next save."""
        from . import checkpoint

        root = self.job.checkpoint.save
        name = checkpoint_dirs.step_name(step)
        if self.rank0:
            removed = checkpoint_dirs.remove_unfinished(root, step)
            if removed:
                print(f"removed unfinished checkpoint{'s' * (len(removed) > 1)} {', '.join(removed)} in {root}",
                      file=sys.stderr, flush=True)
        dist.barrier()
        checkpoint.save(os.path.join(root, name), self.module, self.optimizer, mesh=self.mesh, step=step,
                        extra={k: getattr(self.job.training, k) for k in DATA_ORDER})
        faults.during_save(self.job.faults, step)
        dist.barrier()
        if self.rank0:
            checkpoint_dirs.commit(root, name)
        dist.barrier()

    def export_hf(self) -> None:
        """The model in Hugging Face format to --export-hf (a rank's model chunks: one file per virtual stage)."""
        from ..hf import save_hf

        mesh = self.mesh
        for chunk in self.buffered:  # zero1: the last step's all-gathers
            chunk.finish_param_sync()
        save_hf(self.chunks, self.job.checkpoint.export_hf, group=mesh.tp_group,
                pp_group=mesh.pp_group if mesh.pp_size > 1 else None, dp_group=mesh.group("dp-cp"))

    def fit(self) -> None:
        """The steps from start_step to --steps: logged, evaluated and saved as the job says; then the final save,
        the export, and rank 0's summary line."""
        job, steps = self.job, self.job.training.steps
        log = progress.open_log(job.logging.log_jsonl, self.start_step) if self.rank0 and job.logging.log_jsonl \
            else None
        bar = progress.progress(self.rank0, self.start_step, steps, interval=job.logging.log_interval)
        first_loss = record = None
        every, save_every = job.evaluation.eval_every, job.checkpoint.save_every
        try:
            for step in range(self.start_step, steps):
                record, grad_norm = self.step(step)
                first_loss = record["loss"] if first_loss is None else first_loss
                if every and ((step + 1) % every == 0 or step + 1 == steps):
                    record["val_loss"] = self.evaluate()
                if log:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4f}", grad_norm=f"{grad_norm:.3f}",
                                tok_s=f"{record['tokens_per_s']:.0f}",
                                **({"bubble": f"{record['bubble']:.2f}"} if self.mesh.pp_size > 1 else {}))
                if job.checkpoint.save and save_every and (step + 1) % save_every == 0 and step + 1 < steps:
                    self.save(step + 1)
            if job.checkpoint.save:
                self.save(steps)
            if job.checkpoint.export_hf:
                self.export_hf()
        finally:
            bar.close()
            if log:
                log.close()
        if self.rank0:
            print(self.done_line(first_loss, record), flush=True)

    def done_line(self, first_loss: float, last: dict) -> str:
        job, mesh = self.job, self.mesh
        ran = f"{job.training.steps - self.start_step} steps ({self.start_step + 1}..{job.training.steps})"
        return (f"done: {ran} at tp={mesh.tp_size} cp={mesh.cp_size} pp={mesh.pp_size} dp={mesh.dp_size}; "
                f"loss {first_loss:.4f} -> {last['loss']:.4f}"
                + (f", val_loss {last['val_loss']:.4f}" if "val_loss" in last else "")
                + (f"; log: {job.logging.log_jsonl}" if job.logging.log_jsonl else "")
                + (f"; checkpoint: {job.checkpoint.save}" if job.checkpoint.save else "")
                + (f"; Hugging Face export: {job.checkpoint.export_hf}" if job.checkpoint.export_hf else ""))

    def evaluate_only(self) -> None:
        """--eval-only: val_loss of the loaded (or --from-hf) model, printed and logged by rank 0."""
        val_loss = self.evaluate()
        if self.rank0:
            job = self.job
            print(f"val_loss {val_loss:.4f} at step {self.start_step} ({job.evaluation.eval_iters} batches of "
                  f"{job.training.global_batch_size} held-out sequences)", flush=True)
            if job.logging.log_jsonl:
                with open(job.logging.log_jsonl, "a") as f:
                    f.write(json.dumps({"step": self.start_step, "val_loss": val_loss}) + "\n")

    def max_memory_bytes(self) -> dict[str, int]:
        """tp.optim.memory_bytes (this rank's param_bytes, grad_bytes, optimizer_bytes), each the largest over all
        ranks (one all-reduce)."""
        sizes = tp.optim.memory_bytes(self.module, self.optimizer)
        totals = torch.tensor(list(sizes.values()), dtype=torch.int64)
        dist.all_reduce(totals, op=dist.ReduceOp.MAX)
        return dict(zip(sizes, totals.tolist()))


def train(job: JobConfig, *, config_file: str | None = None) -> int:
    """The job on this rank (every rank calls it): trains, or with --eval-only evaluates; returns the exit code.
    `config_file`: the --config file the job was read from, named in rank 0's start line."""
    trainer = Trainer(job, config_file=config_file)
    if job.evaluation.eval_only:
        trainer.evaluate_only()
    elif trainer.start_step >= job.training.steps:
        if trainer.rank0:
            print(f"nothing to train: the checkpoint is at step {trainer.start_step}, --steps={job.training.steps}",
                  flush=True)
    else:
        trainer.fit()
    # The groups are kept (a next mesh of the same layout reuses them): destroyed here, the last reference would be
    # DDP's reducer's, dropped with the GIL held as this frame ends, and gloo's destructor joins a worker thread that
    # may need the GIL to free its last work's tensors: a deadlock at exit, seen under load.
    tp.destroy_mesh(keep_groups=True)
    return 0


def _mean_over(value, group):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)
