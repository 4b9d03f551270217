"""The training job's configuration, typed (torchtitan's JobConfig): one dataclass per section, each checking its own
values, and `JobConfig.validate` for what spans sections.

Every flag of `python -m models.train` is the field of the same name (dashes as underscores) in one section, except
`--model` (`model.preset`), `--data` (`data.path`, a list), `--data-column` and `--data-cache-dir` (`data.column`,
`data.cache_dir`). `--config job.toml` reads the same sections from TOML, keys
being the field names; flags given on the command line win over the file. `python -m models.train` writes the
resolved configuration the same way into the ranks' log directory (config.toml), and starts the ranks from it; a run
repeats with `--config` alone:

    [parallelism]
    tp = 2
    pp = 2
    schedule = "interleaved"
    virtual_stages = 2

    [training]
    steps = 200
    global_batch_size = 32

Checks that read files or build the model (paths, the data, the model's fit to the split, a checkpoint to resume)
are models/training/preflight.py's.
"""
import dataclasses
import json
import math
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

from tp.pipeline import schedules

from ..config import CP_MODES, PRESETS, RECOMPUTE

SIZE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size")
# [model] fields that are GPTConfig fields of the same name: a mixture of experts' shape (a preset's otherwise; not
# with --from-hf, whose config has them), then its training hyperparameters (over a preset or a --from-hf model)
MOE_SHAPE_FIELDS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                    "moe_shared_expert_size", "moe_router_score")
MOE_TRAINING_FIELDS = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_capacity_factor", "moe_dispatcher")
MOE_SCORES, MOE_DISPATCHERS = ("softmax", "sigmoid"), ("alltoall", "allgather")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb")
DP_MODES = ("ddp", "fsdp", "zero1")
PRECISIONS = ("fp32", "tf32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
LR_DECAY_STYLES = ("cosine", "linear", "constant", "wsd")


def _field(default: Any, *, flag: str) -> Any:
    """A field whose command-line flag is named otherwise (--FLAG)."""
    return dataclasses.field(default=default, metadata={"flag": flag})


def _dest(field: dataclasses.Field) -> str:
    """The argparse dest of a section's field: its own name unless it says otherwise."""
    return field.metadata.get("flag", field.name)


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _at_least(section: Any, names: tuple[str, ...], low: int) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value < low:
            raise ValueError(f"{_flag(name)}={value} must be >= {low}")


def _one_of(flag: str, value: Any, allowed: tuple) -> None:
    """(argparse checks the flags' choices; this, a TOML file's)"""
    if value not in allowed:
        raise ValueError(f"{flag}={value} must be one of {', '.join(map(str, allowed))}")


@dataclasses.dataclass
class ModelConfig:
    """[model]: a preset (tiny unless given) with size overrides, or a Hugging Face model to start from."""

    preset: str | None = _field(None, flag="model")
    from_hf: str | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    ffn_hidden_size: int | None = None
    dropout: float = 0.0
    attention_dropout: float | None = None  # None: --dropout
    # a mixture of experts (GPTConfig's fields; None: the preset's, dense unless it has experts)
    num_experts: int | None = None
    moe_router_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_layer_freq: int | str | None = None  # N: every N-th layer; "0,1,1,1": a 0/1 per layer
    moe_shared_expert_size: int | None = None
    moe_router_score: str | None = None
    moe_aux_loss_coeff: float | None = None
    moe_z_loss_coeff: float | None = None
    moe_capacity_factor: float | None = None  # None: dropless (or the preset's)
    moe_dispatcher: str | None = None

    def validate(self) -> None:
        if self.preset is not None:
            _one_of("--model", self.preset, tuple(sorted(PRESETS)))
        if self.from_hf:
            given = [("--model", self.preset), *((_flag(f), getattr(self, f)) for f in SIZE_FIELDS + MOE_SHAPE_FIELDS)]
            shape = [flag for flag, value in given if value is not None]
            if shape:
                raise ValueError(f"--from-hf takes the model's shape from its config: drop {' '.join(shape)}")
        _at_least(self, ("num_experts",), 0)
        _at_least(self, ("moe_router_topk", "moe_ffn_hidden_size"), 1)
        _at_least(self, ("moe_shared_expert_size",), 0)
        self.layer_freq()
        for flag, value, allowed in (("--moe-router-score", self.moe_router_score, MOE_SCORES),
                                     ("--moe-dispatcher", self.moe_dispatcher, MOE_DISPATCHERS)):
            if value is not None:
                _one_of(flag, value, allowed)
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{_flag(name)}={value} must be a finite number >= 0 (0: off)")
        factor = self.moe_capacity_factor
        if factor is not None and not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"--moe-capacity-factor={factor} must be a positive number (leave it out: dropless)")

    def layer_freq(self) -> int | list[int] | None:
        """--moe-layer-freq as GPTConfig takes it: N (every N-th layer, from the first) or a 0/1 list per layer."""
        value = self.moe_layer_freq
        if value is None or isinstance(value, int):
            if value is not None and value < 1:
                raise ValueError(f"--moe-layer-freq={value} must be >= 1 (or a 0/1 list per layer, e.g. 0,1,1,1)")
            return value
        items = value.strip().strip("[]").replace(" ", "").split(",")
        if len(items) == 1 and items[0].isdigit() and int(items[0]) >= 1:
            return int(items[0])
        if not all(i in ("0", "1") for i in items):
            raise ValueError(f"--moe-layer-freq={value!r} must be N >= 1 (every N-th layer) or a 0/1 list per layer, "
                             "e.g. 0,1,1,1")
        return [int(i) for i in items]

    def moe_fields(self) -> dict[str, Any]:
        """The GPTConfig fields the [model] section's MoE flags give (those not left at None)."""
        fields = {f: getattr(self, f) for f in MOE_SHAPE_FIELDS + MOE_TRAINING_FIELDS if getattr(self, f) is not None}
        if "moe_layer_freq" in fields:
            fields["moe_layer_freq"] = self.layer_freq()
        return fields


@dataclasses.dataclass
class ParallelismConfig:
    """[parallelism]: the tp x cp x pp x dp split, the pipeline schedule, data parallelism's mode."""

    tp: int = 2
    cp: int = 1
    cp_mode: str = "ring"
    cp_a2a_size: int | None = None  # --cp-mode a2a+ring: the all-to-all sub-groups' size
    pp: int = 2
    dp: int | None = None  # None: WORLD_SIZE / (tp*cp*pp) under torchrun, else 2 (see resolve_dp)
    dp_mode: str = "ddp"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    ep: int = 1  # expert parallelism: the experts over ep ranks of tp·cp·dp (Megatron's expert layout)
    etp: int | None = None  # expert tensor parallelism; None: tp

    def validate(self) -> None:
        _at_least(self, ("tp", "cp", "pp", "dp", "virtual_stages", "cp_a2a_size", "ep", "etp"), 1)
        for flag, value, allowed in (("--cp-mode", self.cp_mode, CP_MODES), ("--dp-mode", self.dp_mode, DP_MODES),
                                     ("--schedule", self.schedule, PIPELINE_SCHEDULES),
                                     ("--recompute", self.recompute, RECOMPUTE)):
            _one_of(flag, value, allowed)
        if self.cp_a2a_size is not None and self.cp_mode != "a2a+ring":
            raise ValueError(f"--cp-a2a-size={self.cp_a2a_size} is for --cp-mode a2a+ring, not {self.cp_mode}")
        if self.cp_mode == "a2a+ring" and self.cp > 1 and (self.cp_a2a_size is None or self.cp % self.cp_a2a_size):
            raise ValueError(f"--cp-mode a2a+ring needs --cp-a2a-size, a divisor of --cp={self.cp} (the all-to-all "
                             f"sub-groups' size); got {self.cp_a2a_size}")

    def resolve_dp(self, world_size: int | None, *, gpus: int | None = None) -> int:
        """--dp when given; else WORLD_SIZE / (tp·cp·pp) under torchrun (as Megatron); on our own launcher, the GPUs
        over tp·cp·pp (one rank per GPU; at least 1), 2 on the CPU."""
        if self.dp is not None:
            return self.dp
        if world_size is None:
            return 2 if gpus is None else max(1, gpus // (self.tp * self.cp * self.pp))
        model_parallel = self.tp * self.cp * self.pp
        if model_parallel < 1 or world_size % model_parallel:
            raise ValueError(f"WORLD_SIZE={world_size} is not divisible by --tp*--cp*--pp = {self.tp}*{self.cp}*"
                             f"{self.pp} = {model_parallel}: no data-parallel size fits")
        return world_size // model_parallel

    @property
    def experts_apart(self) -> bool:
        """Whether the experts are laid out otherwise than the dense weights (ep > 1 or etp != tp): their gradients
        are then reduced over the expert-data-parallel group, not dp."""
        return self.ep > 1 or self.etp not in (None, self.tp)

    def check_experts(self) -> None:
        """ep·etp must divide a stage's tp·cp·dp ranks (the expert layout re-groups them; Megatron-Core's rule)."""
        etp = self.tp if self.etp is None else self.etp
        stage = self.tp * self.cp * self.dp
        if stage % (self.ep * etp):
            raise ValueError(f"--ep={self.ep} * --etp={etp} = {self.ep * etp} does not divide --tp*--cp*--dp = "
                             f"{self.tp}*{self.cp}*{self.dp} = {stage} (a pipeline stage's ranks, which the experts "
                             "are laid over)")

    @property
    def sizes(self) -> dict[str, int]:
        """tp, cp, pp, dp, and ep, etp (the expert layout, for tp.init_mesh / tp.layout)."""
        return dict(tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, ep=self.ep,
                    etp=self.tp if self.etp is None else self.etp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


@dataclasses.dataclass
class TrainingConfig:
    """[training]: steps, batch sizes, sequence length, seed, precision, gradient clipping."""

    steps: int = 100
    global_batch_size: int = 16
    micro_batch_size: int = 2
    seq_len: int = 64
    seed: int = 1234
    precision: str | None = None  # None: bf16 on CUDA, fp32 on the CPU (resolved by JobConfig.validate)
    clip_grad: float = 1.0
    check_inputs: bool = False
    compile: bool = False  # torch.compile each transformer block (fullgraph)

    def validate(self) -> None:
        _at_least(self, ("global_batch_size", "micro_batch_size", "seq_len", "steps"), 1)
        if not math.isfinite(self.clip_grad) or self.clip_grad < 0:
            raise ValueError(f"--clip-grad={self.clip_grad} must be a finite number >= 0 (0: no clipping)")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"--precision={self.precision} is not supported: fp32, tf32 or bf16 (fp16 would need "
                             "loss scaling)")


@dataclasses.dataclass
class OptimizerConfig:
    """[optimizer]: AdamW's peak learning rate, its warm-up and decay (Megatron's flags), and weight decay."""

    lr: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.01
    lr_decay_style: str = "cosine"
    min_lr: float | None = None  # None: lr / 10
    lr_decay_steps: int | None = None  # None: --steps
    lr_wsd_decay_steps: int | None = None  # wsd's final decay; None: the last 10% of the decay steps

    def validate(self) -> None:
        for name, value in (("lr", self.lr), ("weight_decay", self.weight_decay)):
            if not math.isfinite(value) or value < 0 or (name == "lr" and value == 0):
                raise ValueError(f"{_flag(name)}={value} must be a finite number {'> 0' if name == 'lr' else '>= 0'}")
        _at_least(self, ("warmup_steps",), 0)
        _at_least(self, ("lr_decay_steps", "lr_wsd_decay_steps"), 1)
        _one_of("--lr-decay-style", self.lr_decay_style, LR_DECAY_STYLES)
        if self.min_lr is not None and not (math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"--min-lr={self.min_lr} must be a number in [0, --lr={self.lr}]")

    def learning_rate(self, step: int, steps: int) -> float:
        """The learning rate of step `step` (from 0) of `steps`: linear warm-up over --warmup-steps, then
        --lr-decay-style from --lr down to --min-lr (default lr/10) at --lr-decay-steps (default `steps`, counted
        from step 0 as Megatron does), --min-lr after. wsd (warmup-stable-decay) stays at --lr until the last
        --lr-wsd-decay-steps of the decay, then falls linearly."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_decay_style == "constant":
            return self.lr
        floor = 0.1 if self.min_lr is None else self.min_lr / self.lr
        decay_steps = self.lr_decay_steps or steps
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / max(1, decay_steps - self.warmup_steps)))
        if self.lr_decay_style == "cosine":
            coeff = 0.5 * (1 + math.cos(math.pi * progress))
        elif self.lr_decay_style == "linear":
            coeff = 1.0 - progress
        else:  # wsd
            anneal = self.lr_wsd_decay_steps or max(1, math.ceil(0.1 * decay_steps))
            coeff = min(1.0, max(0.0, (decay_steps - step) / anneal))
        return self.lr * (floor + (1 - floor) * coeff)


@dataclasses.dataclass
class DataConfig:
    """[data]: the training data (None: the bundled corpus), one source or a blend's WEIGHT PATH pairs (Megatron's
    `--data 0.3 A 0.7 B`), its tokenizer (None: bytes), the column of rows to read, chat fine-tuning, the token
    cache's directory (None: the user's cache); the documents inside each window."""

    path: list[str] | None = _field(None, flag="data")
    tokenizer: str | None = None
    column: str | None = _field(None, flag="data_column")  # None: "text" ("messages" with --sft)
    sft: bool = False
    cache_dir: str | None = _field(None, flag="data_cache_dir")
    # documents inside a window, ended by the EOD token (Megatron's flags; models/training/documents.py)
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    def validate(self) -> None:
        """The blend's syntax and weights (the paths are read by preflight.py)."""
        self.blend()
        if self.column is not None and not self.column:
            raise ValueError("--data-column is empty: name the column (or JSON field) to read")

    def blend(self) -> list[tuple[float, str | None]]:
        """[(weight, path), ...]: --data PATH alone (weight 1), or its WEIGHT PATH pairs; [(1, None)] for the bundled
        corpus. One line if the values are not that."""
        if not self.path:
            return [(1.0, None)]
        given = " ".join(self.path)
        if len(self.path) == 1:
            return [(1.0, self.path[0])]
        if len(self.path) % 2:
            raise ValueError(f"--data {given}: a blend is WEIGHT PATH pairs, e.g. --data 0.3 PREFIX_A 0.7 PREFIX_B")
        pairs = []
        for weight, path in zip(self.path[::2], self.path[1::2]):
            try:
                value = float(weight)
            except ValueError:
                value = math.nan
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"--data {given}: the weight {weight!r} of {path} is not a positive number (a "
                                 "blend is WEIGHT PATH pairs, e.g. --data 0.3 PREFIX_A 0.7 PREFIX_B)")
            pairs.append((value, path))
        return pairs


@dataclasses.dataclass
class EvaluationConfig:
    """[evaluation]: validation loss on the held-out data."""

    eval_every: int = 0
    eval_iters: int = 10
    eval_only: bool = False

    def validate(self) -> None:
        _at_least(self, ("eval_every",), 0)
        _at_least(self, ("eval_iters",), 1)


@dataclasses.dataclass
class CheckpointConfig:
    """[checkpoint]: resharding checkpoints written, resumed from, and the Hugging Face export."""

    save: str | None = None
    save_every: int = 0
    load: str | None = None
    export_hf: str | None = None
    async_save: bool = False  # DCP's async_save: staged to CPU, written in the background

    def validate(self) -> None:
        _at_least(self, ("save_every",), 0)


@dataclasses.dataclass
class LoggingConfig:
    """[logging]: the JSONL log (and its plot), TensorBoard, W&B, the progress lines, stragglers, the final sample,
    the ranks' log directory."""

    log_jsonl: str | None = None
    log_interval: int = 10
    log_dir: str | None = None
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    straggler_factor: float = 1.5  # warn when a rank's step takes this many times the median, 3 gathers running
    no_sample: bool = False

    def validate(self) -> None:
        _at_least(self, ("log_interval",), 1)
        if self.wandb_run_name is not None and not self.wandb_project:
            raise ValueError("--wandb-run-name names a W&B run: give --wandb-project too")
        if not (math.isfinite(self.straggler_factor) and self.straggler_factor > 1):
            raise ValueError(f"--straggler-factor={self.straggler_factor} must be a number > 1")


@dataclasses.dataclass
class ProfilingConfig:
    """[profiling]: torch.profiler over a window of optimizer steps, one trace per rank."""

    profile_steps: str | None = None  # "A:B": optimizer steps A..B (from 1), both included
    profile_dir: str | None = None  # None: profile/ beside the ranks' logs
    profile_ranks: str | None = None  # "0,3": those global ranks (None: every rank)

    def validate(self) -> None:
        if self.profile_steps is None:
            for flag, value in (("--profile-dir", self.profile_dir), ("--profile-ranks", self.profile_ranks)):
                if value is not None:
                    raise ValueError(f"{flag} goes with --profile-steps A:B")
            return
        self.window()
        self.ranks()

    def window(self) -> tuple[int, int] | None:
        """(A, B) of --profile-steps A:B, or None."""
        if self.profile_steps is None:
            return None
        first, sep, last = self.profile_steps.partition(":")
        if not (sep and first.strip().isdigit() and last.strip().isdigit()) or not 1 <= int(first) <= int(last):
            raise ValueError(f"--profile-steps {self.profile_steps!r} must be A:B, optimizer steps 1 <= A <= B")
        return int(first), int(last)

    def ranks(self) -> list[int] | None:
        """The global ranks --profile-ranks names (None: every rank)."""
        if self.profile_ranks is None:
            return None
        items = [r.strip() for r in self.profile_ranks.split(",")]
        if not all(r.isdigit() for r in items):
            raise ValueError(f"--profile-ranks {self.profile_ranks!r} must be global ranks separated by commas")
        return sorted({int(r) for r in items})


@dataclasses.dataclass
class LaunchConfig:
    """[launch]: the collectives' timeout, restarts, the layout printed instead of training."""

    distributed_timeout_minutes: float = 10.0
    max_restarts: int = 0
    print_layout: bool = False
    device: str = "auto"  # auto: $TP_DEVICE if set, else cuda when a GPU is visible (one rank per GPU), else cpu

    def validate(self) -> None:
        _at_least(self, ("max_restarts",), 0)
        _one_of("--device", self.device, DEVICES)
        if not self.distributed_timeout_minutes > 0:
            raise ValueError(f"--distributed-timeout-minutes={self.distributed_timeout_minutes} must be > 0")


@dataclasses.dataclass
class FaultsConfig:
    """[faults]: failures the tests inject (hidden flags; models/training/faults.py), all on rank `fail_rank`."""

    fail_at_step: int | None = None  # raises there
    hang_at_step: int | None = None  # sleeps there
    slow_save_at_step: int | None = None  # a first attempt's save pauses (every rank; async: its write)
    nan_grad_at_step: int | None = None  # a NaN in a reduced gradient
    slow_step_s: float | None = None  # every step works this much longer (a straggler)
    fail_rank: int = 0

    def validate(self) -> None:
        """(test-only: any value does what it says)"""


@dataclasses.dataclass
class JobConfig:
    """The whole job: its sections, each a dataclass above."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    evaluation: EvaluationConfig = dataclasses.field(default_factory=EvaluationConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    profiling: ProfilingConfig = dataclasses.field(default_factory=ProfilingConfig)
    launch: LaunchConfig = dataclasses.field(default_factory=LaunchConfig)
    faults: FaultsConfig = dataclasses.field(default_factory=FaultsConfig)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step on each dp rank."""
        return self.training.global_batch_size // (self.parallelism.dp * self.training.micro_batch_size)

    def sections(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def validate(self, world_size: int | None = None) -> None:
        """Every check of the values alone, one ValueError line naming the flag: resolves parallelism.dp (from
        `world_size`, torchrun's WORLD_SIZE, when not given), then each section's checks, then those across them."""
        self.launch.validate()
        gpus = self.resolve_device()
        self.parallelism.dp = self.parallelism.resolve_dp(world_size, gpus=gpus)
        for section in self.sections().values():
            section.validate()
        parallel, training = self.parallelism, self.training
        world = parallel.world_size
        if world_size is not None and world_size != world:
            raise ValueError(f"WORLD_SIZE={world_size} but --tp*--cp*--pp*--dp = {parallel.tp}*{parallel.cp}*"
                             f"{parallel.pp}*{parallel.dp} = {world}")
        parallel.check_experts()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world if world_size is None else 1))
        if gpus is not None and local > gpus:
            raise ValueError(f"{local} ranks on this machine (--tp*--cp*--pp*--dp = {parallel.tp}*{parallel.cp}*"
                             f"{parallel.pp}*{parallel.dp}) but it has {gpus} GPU{'s' * (gpus > 1)}: NCCL needs one "
                             f"GPU per rank; use a layout of at most {gpus} ranks, or --device cpu for {local} gloo "
                             "ranks on the CPU")
        if training.global_batch_size % (parallel.dp * training.micro_batch_size):
            raise ValueError(f"--global-batch-size={training.global_batch_size} is not divisible by --dp * "
                             f"--micro-batch-size = {parallel.dp}*{training.micro_batch_size}")
        if self.evaluation.eval_only and not (self.checkpoint.load or self.model.from_hf):
            raise ValueError("--eval-only evaluates a model: give --load DIR (a checkpoint) or --from-hf DIR")
        try:
            schedules.check_arguments(parallel.schedule, parallel.pp, self.micro_batches, parallel.virtual_stages)
        except schedules.ScheduleError as e:
            raise ValueError(f"--schedule {parallel.schedule}: {e} (micro_batches = --global-batch-size / (--dp * "
                             f"--micro-batch-size) = {self.micro_batches}; virtual_stages = --virtual-stages)"
                             ) from None
        if parallel.sequence_parallel and training.seq_len % parallel.tp:
            raise ValueError(f"--seq-len={training.seq_len} is not divisible by --tp={parallel.tp} (sequence "
                             "parallelism)")
        self._validate_watching()

    def resolve_device(self) -> int | None:
        """--device auto -> $TP_DEVICE (cpu or cuda) when set, else cuda or cpu; --precision unset -> bf16 on cuda,
        fp32 on cpu; the GPUs one rank each can use (None on the CPU)."""
        import torch

        cuda = torch.cuda.is_available()
        if self.launch.device == "auto":
            self.launch.device = os.environ.get("TP_DEVICE") or ("cuda" if cuda else "cpu")
            _one_of("$TP_DEVICE", self.launch.device, DEVICES[1:])
        if self.launch.device == "cuda" and not cuda:
            raise ValueError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
        if self.training.precision is None:  # fp32 on a GPU runs the slow IEEE dot: bf16 there
            self.training.precision = "bf16" if self.launch.device == "cuda" else "fp32"
        return torch.cuda.device_count() if self.launch.device == "cuda" else None

    def _validate_watching(self) -> None:
        """The profile window within the run, the profiled ranks within the world."""
        window, ranks = self.profiling.window(), self.profiling.ranks()
        if window and window[1] > self.training.steps:
            raise ValueError(f"--profile-steps {self.profiling.profile_steps}: step {window[1]} is outside the run "
                             f"(--steps={self.training.steps})")
        if ranks and ranks[-1] >= self.parallelism.world_size:
            raise ValueError(f"--profile-ranks {self.profiling.profile_ranks}: rank {ranks[-1]} is outside the "
                             f"world of {self.parallelism.world_size} ranks")

    # ---- flags and TOML ------------------------------------------------------------------------------------------

    def with_flags(self, flags: Mapping[str, Any]) -> "JobConfig":
        """A copy with the fields of these argparse dests ({"tp": 4, "model": "small", ...}) replaced."""
        unknown = set(flags) - {_dest(f) for section in self.sections().values()
                                for f in dataclasses.fields(section)}
        if unknown:
            raise ValueError(f"not flags of models.train: {', '.join(sorted(unknown))}")
        return JobConfig(**{name: dataclasses.replace(section, **{
            f.name: flags[_dest(f)] for f in dataclasses.fields(section) if _dest(f) in flags})
            for name, section in self.sections().items()})

    @classmethod
    def from_dict(cls, tables: Mapping[str, Any], source: str = "the configuration") -> "JobConfig":
        """The JobConfig of {section: {field: value}} (a TOML file's tables); missing fields keep their defaults, an
        unknown section or key or a value of the wrong type is refused in one line naming `source`."""
        job = cls()
        sections = job.sections()
        for name, table in tables.items():
            if name not in sections or not isinstance(table, Mapping):
                raise ValueError(f"{source}: unknown section [{name}] (sections: {', '.join(sections)})")
            fields = {f.name: f for f in dataclasses.fields(sections[name])}
            for key, value in table.items():
                if key not in fields:
                    raise ValueError(f"{source}: unknown key {key!r} in [{name}] (keys: {', '.join(fields)})")
                setattr(sections[name], key, _typed(value, fields[key].type, f"{source}: [{name}] {key}"))
        return job

    @classmethod
    def from_toml(cls, path: str) -> "JobConfig":
        """The JobConfig of a TOML file (as `to_toml` writes it); one-line errors naming --config PATH."""
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10: its backport, the same API (a dependency there)
            import tomli as tomllib
        try:
            with open(path, "rb") as f:
                tables = tomllib.load(f)
        except OSError as e:
            raise ValueError(f"--config {path}: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {path}: not TOML ({e})") from None
        return cls.from_dict(tables, f"--config {path}")

    def to_toml(self) -> str:
        """TOML that `from_toml` reads back equal: every field, but those at None (TOML has no null: they are left
        out, and read back as their default, None); [faults] only when a fault is set."""
        lines = ["# models.train's configuration: python -m models.train --config THIS_FILE"]
        for name, section in self.sections().items():
            if name == "faults" and section == FaultsConfig():
                continue
            lines.append(f"\n[{name}]")
            lines += [f"{f.name} = {_toml_value(getattr(section, f.name))}" for f in dataclasses.fields(section)
                      if getattr(section, f.name) is not None]
        return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml_value, value)) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):  # repr reads back exactly; TOML spells them inf and nan too
        return repr(value)
    if isinstance(value, str):  # a TOML basic string is a JSON string, but for DEL, which TOML escapes
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return str(value)


def _typed(value: Any, kind: Any, where: str) -> Any:
    """`value` read from TOML, checked against the field's type (an int where a float goes becomes a float)."""
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    for option in options:
        if typing.get_origin(option) is list:  # a list of strings (--data's); a string alone is a list of one
            if isinstance(value, str):
                return [value]
            if isinstance(value, list) and value and all(isinstance(v, str | int | float) and not isinstance(v, bool)
                                                         for v in value):
                return [str(v) for v in value]
        if option is bool and isinstance(value, bool) or option is str and isinstance(value, str):
            return value
        if option in (int, float) and isinstance(value, int | float) and not isinstance(value, bool) \
                and (option is float or isinstance(value, int)):
            return option(value)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             list[str]: "a string or a list of strings and numbers"}
    wanted = " or ".join(names[o] for o in options if o in names)
    raise ValueError(f"{where} = {value!r} must be {wanted}")
