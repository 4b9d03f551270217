"""The training job on one rank: `Trainer` builds it (the mesh and AdamW of build.py, this rank's model chunks
wrapped for data parallelism, a resumed checkpoint, the data), then runs optimizer steps through the pipeline
schedule, evaluates, saves checkpoints and logs. `train(job)` is the whole job; models/training/cli.py is its
command line."""
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

import tp
from tp.host_syncs import host_values
from tp.pipeline import PipelineRunner

from ..flops import flops_per_token
from ..stages import EVEN_SPLIT, allreduce_tied_embedding_grads, layers_per_stage
from . import data, destinations, documents, failures, faults, plot, progress, resuming, step_values
from .build import build_mesh, build_optimizer, set_hyperparameters
from .checkpoint_dirs import resume_path
from .config import JobConfig
from .model import build_model, data_parallel_chunks, gpt_config_from_job, total_parameters
from .moe_stats import MoEStats
from .mtp_stats import MTPStats
from .nan_check import NanCheck
from .profiling import StepProfiler
from .resuming import DATA_ORDER  # noqa: F401 (its name here before resuming.py)
from .sample import PROMPT, greedy_sample
from .saves import Saves
from .sinks import Sinks
from .step_values import StepValues
from .stragglers import StepClock, Stragglers

CHECKPOINT_BYTES_PER_PARAMETER = 12  # fp32 weights and AdamW's two moments: what a save writes, about


def to_device(micro_batches: list, device: torch.device) -> list:
    """The micro-batches (read on the CPU: from_numpy, frombuffer) on the model's device."""
    if device.type == "cpu":
        return micro_batches
    return [(*(t.to(device, non_blocking=True) for t in micro[:2]),
             *({k: v.to(device, non_blocking=True) for k, v in extra.items()} for extra in micro[2:]))
            for micro in micro_batches]


class Trainer:
    """One rank's part of the job, built at construction (collective: every rank builds its Trainer together)."""

    def __init__(self, job: JobConfig, *, config_file: str | None = None):
        torch.set_num_threads(1)
        job.resolve_device()  # (a JobConfig not validated here: --device and --precision still "auto")
        training = job.training
        self.job, self.mesh = job, build_mesh(job)
        self.rank0 = dist.get_rank() == 0
        self.config = gpt_config_from_job(job)  # (--use-checkpoint-args: the checkpoint's, its tokenizer into job)
        self.chunks, self.module = build_model(job, self.config, self.mesh)
        self.total_params = total_parameters(self.chunks)
        # the unwrapped chunks, one module: their grads summed over sequence parallelism and the tied embedding
        self.stage = self.chunks[0] if len(self.chunks) == 1 else torch.nn.ModuleList(self.chunks)
        micro_batches = training.global_batch_size // (self.mesh.dp_size * training.micro_batch_size)
        self.buffered = data_parallel_chunks(self.module)  # zero1 / bf16: tp.optim.DataParallel, one per chunk
        self.optimizer = build_optimizer(self.module, job, micro_batches)
        self.moe = None
        if self.config.num_experts:  # moe_aux_loss, moe_load_imbalance, ... in the log
            self.moe = MoEStats(self.chunks, self.mesh, self.config.num_layers, self.config.num_experts,
                                capacity=self.config.moe_capacity_factor is not None,
                                sequence=self.config.moe_seq_aux_loss_coeff > 0)
        self.mtp = MTPStats(self.chunks, self.mesh) if self.config.mtp_num_layers else None  # mtp_loss in the log
        self.extra: dict = {}  # what the resumed checkpoint's run kept (the W&B run id, the tokenizer)
        self.start_step = self.resume()
        self.device = device = next(self.stage.parameters()).device
        self.clock, self.work_s = StepClock(device), 0.0
        self.stragglers = Stragglers(interval=job.logging.log_interval, factor=job.logging.straggler_factor,
                                     rank0=self.rank0)
        self.nan_check = NanCheck(enabled=training.check_for_nan_in_loss_and_grad,
                                  max_skipped=training.max_skipped_steps)
        self.saves = Saves(job, self.mesh, size_bytes=CHECKPOINT_BYTES_PER_PARAMETER * self.total_params) \
            if job.checkpoint.save else None
        self.sinks = None
        self.runner = PipelineRunner(self.module, self.mesh, micro_batch_size=training.micro_batch_size,
                                     seq_len=training.seq_len)
        # rank 0 tokenizes a user's text if the launcher has not (own torchrun), and logs what it found; the last
        # ~1% of each dataset's windows: validation only
        self.data = data.DataPlan.of(job)
        dataset, self.held_out = self.data.shared_datasets(log_dir=job.logging.log_dir)
        self.stream = data.batches(dataset, dp=self.mesh.dp_size, dp_rank=self.mesh.dp_rank,
                                   global_batch_size=training.global_batch_size,
                                   micro_batch_size=training.micro_batch_size, seed=training.seed,
                                   start_step=self.start_step)
        # --reset-attention-mask etc.: per-token inputs from the EODs
        self.documents = documents.from_flags(job.data, self.data.eod_id())
        if self.rank0:
            print(self.start_line(micro_batches, config_file), flush=True)

    def resume(self) -> int:
        """Load the checkpoint --load names (none: a fresh start); the step to start from."""
        job, flags = self.job, self.job.checkpoint
        path = resume_path(flags.load, flags.save)
        if not path:  # a fresh start (also with --save and --load the same directory, still empty)
            if self.rank0 and restart_note():
                print(f"{restart_note()}no checkpoint yet: starting from step 0", flush=True)
            return 0
        from . import checkpoint

        optimizer_state, rng = not (flags.finetune or flags.no_load_optim), not (flags.finetune or flags.no_load_rng)
        saved, extra = checkpoint.load(path, self.module, self.optimizer, mesh=self.mesh,
                                       load_optimizer=optimizer_state, load_rng=rng)
        self.extra = extra or {}
        start_step = resuming.start_step(job, saved)
        if self.rank0:
            print(f"{restart_note()}resuming from {path} (step {saved})"
                  + (": its weights, fine-tuned from step 0 (--finetune)" if flags.finetune else ""), flush=True)
            lines = [] if checkpoint.has_manifest(path) else [
                f"note: {path} has no manifest.json (saved before manifests): its files were not verified"]
            if not flags.finetune:
                saved_lr = self.optimizer.param_groups[0].get("lr") if optimizer_state else None
                lines += resuming.notes(job, self.extra, start_step, saved_lr)
            for line in lines:
                print(line, file=sys.stderr, flush=True)
        return start_step

    def start_line(self, micro_batches: int, config_file: str | None) -> str:
        job, mesh, config = self.job, self.mesh, self.config
        parallel = job.parallelism
        return (f"{mesh.world_size} ranks: tp={mesh.tp_size} cp={mesh.cp_size} pp={mesh.pp_size} dp={mesh.dp_size} "
                f"({parallel.dp_mode}, {job.training.precision}), "
                + (f"schedule={parallel.schedule}, " if mesh.pp_size > 1 else "no pipeline, ")
                + self._uneven_stages()
                + (f"ep={mesh.ep_size} etp={mesh.etp_size} edp={mesh.edp_size}, " if config.num_experts else "")
                + f"micro-batches/step={micro_batches}, sequence_parallel={parallel.sequence_parallel}; model "
                f"{self.model_name()} ({config.num_layers} layers, hidden {config.hidden_size}, "
                f"{self.total_params:,} params)"
                + (f"; config: {config_file}" if config_file else ""))

    def model_name(self) -> str:
        model = self.job.model
        if self.job.checkpoint.use_checkpoint_args:
            return "from the checkpoint"
        return model.from_hf or model.preset or "tiny"

    def _uneven_stages(self) -> str:
        """The start line's layers per (virtual) stage, when Megatron's split flags place them."""
        parallel = self.job.parallelism
        if parallel.stage_split == EVEN_SPLIT:
            return ""
        sizes = layers_per_stage(self.config.num_layers, parallel.pp, parallel.virtual_stages,
                                 split=parallel.stage_split)
        return f"layers per {'virtual ' * (parallel.virtual_stages > 1)}stage {'|'.join(map(str, sizes))}, "

    def step(self, step: int) -> tuple[dict, float]:
        """Optimizer step `step` (from 0) on the next global batch: (its log record, the global gradient norm), read
        at once (run_step, then read)."""
        return self.read([self.run_step(step)])[0]

    def run_step(self, step: int) -> StepValues:
        """Optimizer step `step` (from 0) on the next global batch, without a host sync: its log values stay on the
        device until `read` (a step skipped for a non-finite gradient norm is skipped there too: fused AdamW)."""
        job, mesh, training = self.job, self.mesh, self.job.training
        started = time.perf_counter()
        self.clock.start()
        micro_batches = self.with_mtp_tokens(self.with_samples(self.with_documents(next(self.stream)), step))
        if training.check_inputs:  # every tp (and cp) rank of a group reads the same tokens
            for tokens, targets, *_ in micro_batches:
                tp.debug.check(torch.stack([tokens, targets]), mesh.group("tp-cp"), "the training tokens",
                               replicated=True, group_name="tp-cp")
        failures.note_step(step + 1)
        faults.before_step(job.faults, step + 1)
        faults.before_forward(job.faults, step + 1, self.module)
        set_hyperparameters(self.optimizer, job, step)
        stats = self.runner.run(micro_batches, job.parallelism.schedule)
        if not self.config.sequence_parallel_grad_sync:
            tp.allreduce_sequence_parallel_grads(self.stage, mesh.tp_group)  # one all-reduce for every SP param
        if not self.buffered:  # (tp.optim.DataParallel sums the tied copies itself)
            allreduce_tied_embedding_grads(self.stage, mesh)
        faults.after_gradients(job.faults, step + 1, self.module)
        # the global norm over tp, pp and dp (each parameter once); clipped when --clip-grad > 0; this rank's part
        with record_function("clip_grad_norm"):
            grad_norm, local_norm = tp.clip_grad_norm_(self.module.parameters(), training.clip_grad, mesh=mesh,
                                                       with_local=True)
        with record_function("optimizer.step"):  # Megatron's: no update from a non-finite gradient norm
            tp.optim.step_if_finite(self.optimizer, grad_norm)
        if tp.moe.SCORES[self.config.moe_router_score].selection_bias:  # (DeepSeek-V3) from the step's global loads
            tp.moe.update_expert_bias(self.stage, job.model.moe_router_bias_update_rate, group=mesh.group("tp-cp-dp"))
        memory = self.max_memory_bytes() if step == self.start_step else {}  # grads and state exist now
        self.optimizer.zero_grad(set_to_none=True)
        with record_function("loss all-reduce"):
            loss = stats.mean_loss.clone()
            dist.all_reduce(loss, group=mesh.dp_group)
        elapsed = time.perf_counter() - started
        self.work_s = self.clock.stop(stats)[0]  # this rank's own work in the step (stragglers.py)
        tokens = training.global_batch_size * training.seq_len
        flops = flops_per_token(self.config, training.seq_len) * tokens  # model FLOPs (models/flops.py)
        device = {"loss": loss / mesh.dp_size, "local_loss": stats.mean_loss, "grad_norm": grad_norm,
                  "local_norm": local_norm}
        if self.moe is not None:  # moe_aux_loss, moe_z_loss, moe_load_imbalance (, moe_dropped_tokens)
            device["moe"] = self.moe.gather()
        if self.mtp is not None:
            device["mtp"] = self.mtp.gather()
        record = {"lr": job.optimizer.learning_rate(step, training.steps), "tokens_per_s": tokens / elapsed,
                  "tflops_per_rank": flops / mesh.world_size / elapsed / 1e12,
                  "bubble": stats.bubble if mesh.pp_size > 1 else None, "step_s": elapsed} | memory
        return StepValues(step + 1, record, device)

    def read(self, pending: list[StepValues]) -> list[tuple[dict, float]]:
        """The steps' log records and gradient norms, their device values read in one host sync; each step's NaN
        checks (nan_check.py: they raise JobStopped) before its record, in order."""
        return [self._record(values, host) for values, host in zip(pending, step_values.read(pending))]

    def _record(self, values: StepValues, host: dict) -> tuple[dict, float]:
        step, grad_norm, micro_batches = values.step, host["grad_norm"], self.job.micro_batches * self.mesh.dp_size
        skipped = not math.isfinite(grad_norm)
        if skipped and self.rank0:
            print(f"skipped step {step}: grad norm {grad_norm}", file=sys.stderr, flush=True)
        self.nan_check.after_gradients(step, grad_norm, math.isfinite(host["local_norm"]))
        self.nan_check.after_loss(step, host["local_loss"], host["loss"])  # (non-finite: the job stops, unsaved)
        record = {"step": step, "loss": host["loss"], "grad_norm": None if skipped else grad_norm} | values.record
        if skipped:
            record["skipped"] = True
        if self.moe is not None:
            record |= self.moe.entries(torch.tensor(host["moe"], dtype=torch.float64, device="cpu"), micro_batches)
        if self.mtp is not None:
            record |= self.mtp.entries(host["mtp"], micro_batches)
        return record | values.after, grad_norm

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
        """The micro-batches with their documents' inputs and loss mask (documents.py), when the job asks, on the
        model's device."""
        if self.documents is not None:
            micro_batches = [self.documents(*micro) for micro in micro_batches]
        return to_device(micro_batches, self.device)

    def with_samples(self, micro_batches: list, step: int) -> list:
        """The micro-batches with their samples' global indices in the run, `sample_ids` [mb] (step·B + the place in
        the global batch: micro-batch j of this dp rank is the global batch's micro-batch j·dp + dp_rank), which key
        the dropout masks: the same masks for a sample at any split. Unchanged without dropout."""
        if not (self.config.dropout or self.config.attention_dropout):
            return micro_batches
        training, dp = self.job.training, self.mesh.dp_size
        out = []
        for j, (tokens, targets, *inputs) in enumerate(micro_batches):
            first = step * training.global_batch_size + (j * dp + self.mesh.dp_rank) * training.micro_batch_size
            ids = torch.arange(first, first + tokens.shape[0], device=tokens.device)
            out.append((tokens, targets, {**(inputs[0] if inputs else {}), "sample_ids": ids}))
        return out

    def with_mtp_tokens(self, micro_batches: list) -> list:
        """With multi-token prediction in a pipeline, the micro-batches with their tokens as `mtp_tokens` too: the
        last stage's MTP reads them (models/mtp.py)."""
        if not (self.config.mtp_num_layers and self.mesh.pp_size > 1):
            return micro_batches
        return [(tokens, targets, {**(inputs[0] if inputs else {}), "mtp_tokens": tokens})
                for tokens, targets, *inputs in micro_batches]

    def save(self, step: int) -> float:
        """The checkpoint of step `step` into --save (saves.py), with what the run keeps there (resuming.py); the
        seconds the step loop was blocked."""
        extra = resuming.run_record(self.job, tokenizer=_absolute(self.data.reading.tokenizer_dir),
                                    wandb_run_id=self.sinks.run_id if self.sinks else self.extra.get("wandb_run_id"))
        return self.saves.save(step, self.module, self.optimizer, extra)

    def export_hf(self) -> None:
        """The model in Hugging Face format to --export-hf (a rank's model chunks: one file per virtual stage), with
        the tokenizer the data was tokenized with."""
        from ..hf import save_hf

        mesh = self.mesh
        for chunk in self.buffered:  # zero1: the last step's all-gathers
            chunk.finish_param_sync()
        save_hf(self.chunks, self.job.checkpoint.export_hf, group=mesh.tp_group,
                pp_group=mesh.pp_group if mesh.pp_size > 1 else None, dp_group=mesh.group("dp-cp"),
                tokenizer=self.data.reading.tokenizer())  # its files and token ids go with the model
        if self.rank0:  # (a later run may export over this one: destinations.check_own_export)
            open(os.path.join(self.job.checkpoint.export_hf, destinations.EXPORT_MARK), "w").close()

    def fit(self) -> None:
        """The steps from start_step to --steps: profiled, evaluated, saved and logged as the job says; then the
        last save completed, the export, and rank 0's sample, plot and summary line."""
        job, steps = self.job, self.job.training.steps
        if self.rank0:
            self.sinks = Sinks(job, self.start_step, wandb_run_id=self.extra.get("wandb_run_id"))
        bar = progress.progress(self.rank0, self.start_step, steps, interval=job.logging.log_interval)
        profiler = StepProfiler(job)
        first_loss = record = None
        tokens_per_step = job.training.global_batch_size * job.training.seq_len
        pending: list[StepValues] = []  # the steps not read yet (no host sync until a step logs)
        try:
            for step in range(self.start_step, steps):
                with profiler.step(step + 1):
                    pending.append(self.run_step(step))
                    pending[-1].after = self.stragglers.gather(step + 1, self.work_s, pending[-1].record["step_s"],
                                                               steps)
                progress.exclude(bar, profiler.take_export_s())  # (the trace's writing is not a step's time)
                if not self.reads_at(step + 1):
                    continue
                for values, host in zip(pending, step_values.read(pending)):  # (each logged before the next's check)
                    record, _ = self._record(values, host)
                    first_loss = record["loss"] if first_loss is None else first_loss
                    self.evaluate_and_save(values.step, record, bar)
                    if self.sinks:
                        self.sinks.write(record)
                    bar.update(1)
                    bar.set_postfix(**progress.postfix(record, tokens=values.step * tokens_per_step,
                                                       peak_bytes=progress.peak_memory_bytes(self.device),
                                                       bubble=self.mesh.pp_size > 1))
                pending = []
            if self.saves:
                self.saves.finish()
            if job.checkpoint.export_hf:
                self.export_hf()
        finally:
            profiler.close()
            bar.close()
            if self.sinks:
                self.sinks.close()
        self.finish(first_loss, record)

    def reads_at(self, step: int) -> bool:
        """Whether optimizer step `step` (from 1) reads the values of the steps since the last read (one host sync):
        it logs a progress line (every --log-interval steps, the last), evaluates or saves. The same on every rank."""
        job = self.job
        every, save_every = job.evaluation.eval_every, job.checkpoint.save_every
        return (step % job.logging.log_interval == 0 or step == job.training.steps or bool(every and step % every == 0)
                or bool(job.checkpoint.save and save_every and step % save_every == 0))

    def evaluate_and_save(self, step: int, record: dict, bar) -> None:
        """After optimizer step `step` (from 1): val_loss (its time left out of the progress line's s/step) and a
        checkpoint (save_blocking_s, also left out) when the job says, into `record`; a finished async save
        committed."""
        job = self.job
        every, save_every, steps = job.evaluation.eval_every, job.checkpoint.save_every, job.training.steps
        if every and (step % every == 0 or step == steps):
            started = time.perf_counter()
            record["val_loss"] = self.evaluate()
            progress.exclude(bar, time.perf_counter() - started)
        if job.checkpoint.save and (step == steps or (save_every and step % save_every == 0)):
            record["save_blocking_s"] = self.save(step)
            progress.exclude(bar, record["save_blocking_s"])
        if self.saves:
            self.saves.poll()

    def finish(self, first_loss: float, last: dict) -> None:
        """The end of a run: the greedy sample (every rank), the plot of the log and the summary line (rank 0)."""
        job = self.job
        # (NullTokenizer ids have no text to prompt with: no sample)
        sample = None if job.logging.no_sample or self.data.reading.null_vocab is not None else self.sample()
        if not self.rank0:
            return
        if sample is not None:
            print(f"sample (greedy, after {PROMPT!r}; --no-sample skips it):\n{sample}", flush=True)
        plotted = None
        if job.logging.log_jsonl:
            try:
                plotted = plot.plot_log(job.logging.log_jsonl)
            except ImportError:
                print("note: no plot of the log: pip install matplotlib", file=sys.stderr, flush=True)
        print(self.done_line(first_loss, last, plotted), flush=True)

    def sample(self) -> str:
        """The greedy sample (sample.py): the prompt and its continuation (collective over every rank)."""
        for chunk in self.buffered:  # zero1: the last step's all-gathers
            chunk.finish_param_sync()
        return greedy_sample(self.chunks, self.mesh, self.data.reading.tokenizer(), dtype=self.runner.dtype)

    def done_line(self, first_loss: float, last: dict, plotted: str | None = None) -> str:
        job, mesh = self.job, self.mesh
        ran = f"{job.training.steps - self.start_step} steps ({self.start_step + 1}..{job.training.steps})"
        return (f"done: {ran} at tp={mesh.tp_size} cp={mesh.cp_size} pp={mesh.pp_size} dp={mesh.dp_size}; "
                f"loss {first_loss:.4f} -> {last['loss']:.4f}"
                + (f", val_loss {last['val_loss']:.4f}" if "val_loss" in last else "")
                + (f"; log: {job.logging.log_jsonl}" if job.logging.log_jsonl else "")
                + (f" (plot: {plotted})" if plotted else "")
                + (f"; checkpoint: {job.checkpoint.save}" if job.checkpoint.save else "")
                + (f"; Hugging Face export: {job.checkpoint.export_hf}" if job.checkpoint.export_hf else "")
                + (f"; rank logs: {job.logging.log_dir}" if job.logging.log_dir else ""))

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
        totals = torch.tensor(list(sizes.values()), dtype=torch.int64, device="cpu")
        dist.all_reduce(totals, op=dist.ReduceOp.MAX)
        return dict(zip(sizes, host_values(totals)))


def train(job: JobConfig, *, config_file: str | None = None) -> int:
    """The job on this rank (every rank calls it): trains, or with --eval-only evaluates; returns the exit code.
    `config_file`: the --config file the job was read from, named in rank 0's start line."""
    trainer = Trainer(job, config_file=config_file)
    if job.evaluation.eval_only:
        trainer.evaluate_only()
    elif trainer.start_step >= job.training.steps:
        if trainer.rank0:
            print(f"nothing to train: the checkpoint is at step {trainer.start_step}, --steps={job.training.steps}"
                  + (f"; exporting it to {job.checkpoint.export_hf}" if job.checkpoint.export_hf else ""), flush=True)
        if job.checkpoint.export_hf:  # (Megatron converts a checkpoint with a tool of its own)
            trainer.export_hf()
    else:
        trainer.fit()
    # The groups are kept (a next mesh of the same layout reuses them): destroyed here, the last reference would be
    # DDP's reducer's, dropped with the GIL held as this frame ends, and gloo's destructor joins a worker thread that
    # may need the GIL to free its last work's tensors: a deadlock at exit, seen under load.
    tp.destroy_mesh(keep_groups=True)
    return 0


def restart_note() -> str:
    """The start of rank 0's resume line when torchrun restarted the group ("the group restarted after a failure
    (attempt N); "), else an empty string."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return f"the group restarted after a failure (attempt {attempt + 1}); " if attempt else ""


def _absolute(path):
    return os.path.abspath(path) if path else None


def _mean_over(value, group):
    t = torch.tensor([value], dtype=torch.float64, device="cpu")
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)
