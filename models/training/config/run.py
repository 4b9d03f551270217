"""The run around the training: [checkpoint], [logging], [profiling], [launch] and the tests' [faults]."""
import dataclasses
import math

from .fields import at_least, one_of

DEVICES = ("auto", "cpu", "cuda")


@dataclasses.dataclass
class CheckpointConfig:
    """[checkpoint]: resharding checkpoints written, resumed from, and the Hugging Face export."""

    save: str | None = None
    save_every: int = 0
    load: str | None = None
    export_hf: str | None = None
    async_save: bool = False  # DCP's async_save: staged to CPU, written in the background

    def validate(self) -> None:
        at_least(self, ("save_every",), 0)


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
        at_least(self, ("log_interval",), 1)
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
        at_least(self, ("max_restarts",), 0)
        one_of("--device", self.device, DEVICES)
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
