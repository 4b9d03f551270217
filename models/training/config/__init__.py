"""The training job's configuration, typed (torchtitan's JobConfig): one dataclass per section, each checking its own
values, and `JobConfig.validate` for what spans sections.

Every field declares its command-line flag with `fields.option` (its help, choices, metavar, Megatron-LM's name as an
alias): `python -m models.train`'s parser is built from them (models/training/flags.py). A flag is the field's name
with dashes, except `--model` (`model.preset`), `--data` (`data.path`, a list), `--data-column` and `--data-cache-dir`
(`data.column`, `data.cache_dir`). `--config job.toml` reads the same sections from TOML, keys being the field names;
flags given on the command line win over the file. `python -m models.train` writes the resolved configuration the
same way into the ranks' log directory (config.toml: every field, paths absolute), and starts the ranks from it; a run
repeats with `--config` alone, from any directory:

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

The sections live in model.py, parallelism.py, training.py ([training], [optimizer]), data.py ([data],
[evaluation]) and run.py (the rest); fields.py holds `option` and the shared checks, toml_io.py the TOML plumbing.
"""
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from tp.pipeline import schedules

from ...recompute import OUTPUT_DISCARDING, recompute_parts
from .data import DataConfig, EvaluationConfig
from .fields import absolute, dest, one_of
from .model import MOE_DISPATCHERS, MOE_SCORES, MOE_SHAPE_FIELDS, MOE_TRAINING_FIELDS, SIZE_FIELDS, ModelConfig
from .parallelism import DP_MODES, PIPELINE_SCHEDULES, ParallelismConfig
from .run import DEVICES, CheckpointConfig, FaultsConfig, LaunchConfig, LoggingConfig, ProfilingConfig
from .toml_io import read_toml, toml_value, typed
from .training import FP8_RECIPES, LR_DECAY_STYLES, PRECISIONS, OptimizerConfig, TrainingConfig

__all__ = ["DEVICES", "DP_MODES", "FP8_RECIPES", "LR_DECAY_STYLES", "MOE_DISPATCHERS", "MOE_SCORES", "MOE_SHAPE_FIELDS",
           "MOE_TRAINING_FIELDS", "PIPELINE_SCHEDULES", "PRECISIONS", "SIZE_FIELDS", "CheckpointConfig", "DataConfig",
           "EvaluationConfig", "FaultsConfig", "JobConfig", "LaunchConfig", "LoggingConfig", "ModelConfig",
           "OptimizerConfig", "ParallelismConfig", "ProfilingConfig", "TrainingConfig"]


def world_size_variable(world_size: int) -> str:
    """The variable the world's size came from, for error lines: srun's SLURM_NTASKS (tp/slurm.py turned it into
    WORLD_SIZE) or torchrun's WORLD_SIZE."""
    srun = "SLURM_STEP_ID" in os.environ and os.environ.get("SLURM_NTASKS") == str(world_size)
    return "SLURM_NTASKS" if srun else "WORLD_SIZE"


@dataclasses.dataclass
class JobConfig:
    """The whole job: its sections, each a dataclass of this package's modules."""

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
            raise ValueError(f"{world_size_variable(world_size)}={world_size} but --tp*--cp*--pp*--dp = "
                             f"{parallel.tp}*{parallel.cp}*{parallel.pp}*{parallel.dp} = {world}")
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
        modules = tuple(parallel.recompute_modules or ())
        if training.compile and parallel.recompute == "selective" and recompute_parts("selective", modules) & \
                OUTPUT_DISCARDING:
            raise ValueError(f"--compile with --recompute-modules {' '.join(parallel.recompute_modules)}: layernorm "
                             "and moe_act free and refill their outputs around autograd, which torch.compile cannot "
                             "trace")
        if parallel.sequence_parallel and training.seq_len % parallel.tp:
            raise ValueError(f"--seq-len={training.seq_len} is not divisible by --tp={parallel.tp} (sequence "
                             "parallelism)")
        self._validate_watching()

    def resolve_device(self) -> int | None:
        """--device auto -> $TP_DEVICE (cpu or cuda) when set, else cuda or cpu; --precision unset -> bf16 on cuda,
        fp32 on cpu; --compile auto -> on for cuda, off on cpu; the GPUs one rank each can use (None on the CPU)."""
        import torch

        cuda = torch.cuda.is_available()
        if self.launch.device == "auto":
            self.launch.device = os.environ.get("TP_DEVICE") or ("cuda" if cuda else "cpu")
            one_of("$TP_DEVICE", self.launch.device, DEVICES[1:])
        if self.launch.device == "cuda" and not cuda:
            raise ValueError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
        if self.training.precision is None:  # fp32 on a GPU runs the slow IEEE dot: bf16 there
            self.training.precision = "bf16" if self.launch.device == "cuda" else "fp32"
        self.compiles(self.launch.device)
        return torch.cuda.device_count() if self.launch.device == "cuda" else None

    def compiles(self, device: str) -> bool:
        """Whether the job compiles its blocks on `device`: --compile resolved once (auto: on for CUDA where compiled
        blocks can run, off on the CPU), so a JobConfig never validated reads "auto" as auto, never as a true string."""
        self.training.resolve_compile(device, compilable=self._compilable())
        return self.training.compile

    def _compilable(self) -> bool:
        """Whether compiled blocks can run this job (--compile auto stays eager where they cannot; --compile on is
        refused there in one line): not a schedule that splits backward into B and W (check_compile), not
        selective recomputation of the output-discarding parts (validate)."""
        parallel = self.parallelism
        discarding = parallel.recompute == "selective" and recompute_parts(
            "selective", tuple(parallel.recompute_modules or ())) & OUTPUT_DISCARDING
        kind = schedules.SCHEDULES.get(parallel.schedule)  # (an unknown one: refused by validate)
        return not (discarding or (kind is not None and kind.split_backward))

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
        unknown = set(flags) - {dest(f) for section in self.sections().values()
                                for f in dataclasses.fields(section)}
        if unknown:
            raise ValueError(f"not flags of models.train: {', '.join(sorted(unknown))}")
        return JobConfig(**{name: dataclasses.replace(section, **{
            f.name: flags[dest(f)] for f in dataclasses.fields(section) if dest(f) in flags})
            for name, section in self.sections().items()})

    @classmethod
    def from_dict(cls, tables: Mapping[str, Any], source: str = "the configuration") -> "JobConfig":
        """The JobConfig of {section: {field: value}} (a TOML file's tables); missing fields keep their defaults, an
        unknown section or key or a value of the wrong type is refused in one line naming `source`."""
        job = cls()
        sections = job.sections()
        for name, table in tables.items():
            if name not in sections or not isinstance(table, Mapping):
                shown = [s for s, section in sections.items() if s != "faults"]  # (the tests' fault injection)
                owners = [s for s, section in sections.items() if name in {f.name for f in dataclasses.fields(section)}]
                if not isinstance(table, Mapping):  # a key above every section
                    raise ValueError(f"{source}: {name} = {table!r} is outside any section; each key belongs to one "
                                     f"({f'[{owners[0]}] {name}' if owners else 'sections: ' + ', '.join(shown)})")
                raise ValueError(f"{source}: unknown section [{name}] (sections: {', '.join(shown)})")
            fields = {f.name: f for f in dataclasses.fields(sections[name])}
            for key, value in table.items():
                if key not in fields:
                    raise ValueError(f"{source}: unknown key {key!r} in [{name}] (keys: {', '.join(fields)})")
                value = typed(value, fields[key].type, f"{source}: [{name}] {key}")
                choices = fields[key].metadata.get("choices")
                for item in (value if isinstance(value, (list, tuple)) else [value]) if choices else ():
                    if isinstance(item, str) and item not in choices:  # (TOML's true/false: a section's check)
                        raise ValueError(f"{source}: [{name}] {key} = {item!r} must be one of "
                                         f"{', '.join(map(str, choices))}")
                setattr(sections[name], key, value)
        return job

    @classmethod
    def from_toml(cls, path: str) -> "JobConfig":
        """The JobConfig of a TOML file (as `to_toml` writes it); one-line errors naming --config PATH."""
        return cls.from_dict(read_toml(path), f"--config {path}")

    def to_toml(self) -> str:
        """TOML that `from_toml` reads back equal, paths made absolute (against this process's directory, so that the
        file runs from any other): every field, those at None as a comment (TOML has no null: they read back as
        their default, None); [faults] only when a fault is set."""
        lines = ["# models.train's configuration: python -m models.train --config THIS_FILE"]
        for name, section in self.sections().items():
            if name == "faults" and section == FaultsConfig():
                continue
            lines.append(f"\n[{name}]")
            for f in dataclasses.fields(section):
                value = getattr(section, f.name)
                lines.append(f"# {f.name} (unset)" if value is None else
                             f"{f.name} = {toml_value(absolute(value) if f.metadata.get('path') else value)}")
        return "\n".join(lines) + "\n"
