"""The run around the training: [checkpoint], [logging], [profiling], [launch] and the tests' [faults]."""
import dataclasses
import math
import os

from .fields import at_least, one_of, option

DEVICES = ("auto", "cpu", "cuda")


@dataclasses.dataclass
class CheckpointConfig:
    """[checkpoint]: resharding checkpoints written, resumed from, and the Hugging Face export."""

    save: str | None = option(None, "write resharding checkpoints DIR/step-N (at the end, and every --save-every "
                                    "steps); DIR/latest names the newest", metavar="DIR", path=True)
    save_every: int = option(0, "checkpoint every N steps (0: only at the end)", metavar="N",
                             aliases=("--save-interval",))
    load: str | None = option(None, "resume from the newest checkpoint in DIR (or the step directory DIR), written "
                                    "at any tp/pp/dp split", metavar="DIR", path=True)
    export_hf: str | None = option(None, "write the trained model in Hugging Face format at the end", metavar="DIR",
                                   path=True)
    async_save: bool = option(
        False, "checkpoints staged to CPU and written in the background (torch.distributed.checkpoint.async_save) "
               "while training goes on; DIR/latest moves once every rank's write is complete")
    keep_last: int | None = option(None, "after each completed save, remove --save's step directories but the K "
                                         "newest (default: keep every one)", metavar="K")
    use_checkpoint_args: bool = option(
        False, "the model, the tokenizer and the data format from --load's checkpoint (the command line gives the "
               "layout, the steps and the paths)")
    finetune: bool = option(False, "load --load's weights only: step 0, a fresh optimizer, schedule and data order, "
                                   "the generators kept")
    no_load_optim: bool = option(False, "resume without the checkpoint's optimizer state (fresh AdamW moments)")
    no_load_rng: bool = option(False, "resume without the checkpoint's random generators' states")

    def validate(self) -> None:
        at_least(self, ("save_every",), 0)
        at_least(self, ("keep_last",), 1)
        given = [flag for flag, on in (("--use-checkpoint-args", self.use_checkpoint_args),
                                       ("--finetune", self.finetune), ("--no-load-optim", self.no_load_optim),
                                       ("--no-load-rng", self.no_load_rng)) if on]
        if given and not self.load:
            raise ValueError(f"{given[0]} goes with --load DIR (the checkpoint it reads)")
        if self.finetune and self.save and os.path.realpath(self.save) == os.path.realpath(self.load):
            raise ValueError("--finetune starts a new run from --load's weights: give --save another directory (a "
                             "restart of the fine-tuning resumes with --load set to that one)")


@dataclasses.dataclass
class LoggingConfig:
    """[logging]: the JSONL log (and its plot), TensorBoard, W&B, the progress lines, stragglers, the final sample,
    the ranks' log directory."""

    log_jsonl: str | None = option(None, "one JSON object per step: step, loss, tokens_per_s, ...", metavar="PATH",
                                   path=True)
    log_interval: int = option(10, "when stdout is not a terminal (a file, a pipe): one progress line every N steps "
                                   "instead of a tqdm bar; the log's rows are written (the steps' values read from "
                                   "the device) every N steps", metavar="N")
    log_dir: str | None = option(
        None, "each rank's log DIR/rank-N.log: all the output of ranks other than 0, a failing rank's traceback; the "
              "run's config.toml (default: DIR/logs of --save, else ~/.local/state/tp-layers/runs/NAME, one "
              "directory per run; $XDG_STATE_HOME in place of ~/.local/state when set)", metavar="DIR",
        path=True)
    tensorboard_dir: str | None = option(
        None, "TensorBoard scalars (the JSONL log's) and the configuration, written by rank 0 (pip install "
              "tensorboard)", metavar="DIR", path=True)
    wandb_project: str | None = option(
        None, "log the same rows to Weights & Biases (pip install wandb); offline without credentials "
              "(WANDB_API_KEY or a wandb login); a resumed job continues the checkpoint's W&B run", metavar="NAME")
    wandb_run_name: str | None = option(None, "the W&B run's display name", metavar="NAME")
    straggler_factor: float = option(
        1.5, "every --log-interval steps each rank's step time is gathered (slowest_rank, rank_step_s_max/min in "
             "the log); warn when a rank takes F times the median 3 times running", metavar="F")
    no_sample: bool = option(False, "skip the greedy sample from the trained model printed at the end")

    def validate(self) -> None:
        at_least(self, ("log_interval",), 1)
        if self.wandb_run_name is not None and not self.wandb_project:
            raise ValueError("--wandb-run-name names a W&B run: give --wandb-project too")
        if not (math.isfinite(self.straggler_factor) and self.straggler_factor > 1):
            raise ValueError(f"--straggler-factor={self.straggler_factor} must be a number > 1")


@dataclasses.dataclass
class ProfilingConfig:
    """[profiling]: torch.profiler over a window of optimizer steps, one trace per rank."""

    profile_steps: str | None = option(
        None, "torch.profiler over optimizer steps A..B (from 1, both included): one Chrome/Perfetto trace per rank "
              "(pipeline actions and collectives named), CUDA memory snapshots on GPUs", metavar="A:B")
    profile_dir: str | None = option(None, "where the traces go (default: LOG_DIR/profile)", metavar="DIR",
                                     path=True)
    profile_ranks: str | None = option(None, "profile these global ranks only, e.g. 0,3 (default: every rank)",
                                       metavar="R,R")

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

    distributed_timeout_minutes: float = option(
        10.0, "collective timeout: a rank that hangs ends the job after M minutes, and is named", metavar="M")
    max_restarts: int = option(
        0, "restart every rank up to K times after a failure (torchrun's flag, for our launcher); with --save DIR "
           "--load DIR the job resumes from DIR/latest", metavar="K")
    print_layout: bool = option(
        False, "print which global ranks sit on which node, each rank's local rank and tp/cp/pp/dp coordinates, and "
               "exit")
    device: str = option(
        "auto", "cuda: one rank per GPU over NCCL (gloo for CPU tensors); cpu: gloo ranks on the CPU even with GPUs; "
                "auto: $TP_DEVICE when set, else cuda when a GPU is visible", choices=DEVICES)

    def validate(self) -> None:
        at_least(self, ("max_restarts",), 0)
        one_of("--device", self.device, DEVICES)
        if not self.distributed_timeout_minutes > 0:
            raise ValueError(f"--distributed-timeout-minutes={self.distributed_timeout_minutes} must be > 0")


@dataclasses.dataclass
class FaultsConfig:
    """[faults]: failures the tests inject (hidden flags; models/training/faults.py), all on rank `fail_rank`."""

    fail_at_step: int | None = option(None, "raises there", hidden=True)
    hang_at_step: int | None = option(None, "sleeps there", hidden=True)
    slow_save_at_step: int | None = option(None, "a first attempt's save pauses (every rank; async: its write)",
                                           hidden=True)
    nan_grad_at_step: int | None = option(None, "a NaN in a reduced gradient", hidden=True)
    nan_weights_at_step: int | None = option(None, "a NaN in a weight before the step (a corrupted update)",
                                             hidden=True)
    no_space_at_step: int | None = option(None, "the save's writes find the device full", hidden=True)
    slow_step_s: float | None = option(None, "every step works this much longer (a straggler)", hidden=True)
    fail_rank: int = option(0, "the rank the faults above happen on", hidden=True)

    def validate(self) -> None:
        """(test-only: any value does what it says)"""
