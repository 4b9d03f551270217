"""Where rank 0's log rows go: the JSONL log (progress.open_log), TensorBoard and Weights & Biases, the same rows
under the same names at step = the optimizer step, each kept as one run across resumes.

- TensorBoard (`--tensorboard-dir`, `pip install tensorboard`): every number of a row as a scalar, the resolved
  configuration as text at the first step. A resumed run opens its writer with purge_step = the resumed step + 1:
  TensorBoard (and its EventAccumulator) then hides what an earlier attempt wrote from that step on, so the redone
  steps appear once. Each row is flushed as it is written, so a kill loses nothing the checkpoint kept.
- W&B (`--wandb-project`, `pip install wandb`): `run.log(row, step=step)`; offline (a run directory to `wandb sync`
  later) when no credentials are configured and WANDB_MODE is not set. The run id goes into the checkpoint, so a
  resumed job continues the same run (W&B keeps a step's first value: steps an earlier attempt logged past the
  checkpoint keep that attempt's values, equal ones at the same split). Its run directory is LOG_DIR/wandb/.

The optional packages are imported only when their flag is given; a missing one is refused in one line before any
process starts (`check_packages`).
"""
import importlib.util
import json
import netrc
import os
import urllib.parse
from typing import Any

from . import progress
from .config import JobConfig

PACKAGES = {"tensorboard_dir": ("--tensorboard-dir", "tensorboard"), "wandb_project": ("--wandb-project", "wandb")}


def check_packages(job: JobConfig) -> None:
    """One line (ValueError) when a flag needs an optional package that is not installed."""
    for field, (flag, package) in PACKAGES.items():
        if getattr(job.logging, field) and importlib.util.find_spec(package) is None:
            raise ValueError(f"{flag} needs the {package} package: pip install {package} (or tp-layers[{package}])")


def scalars(row: dict) -> dict[str, float]:
    """The numbers of a log row (not its step, flags or nulls): what TensorBoard and W&B plot."""
    return {k: v for k, v in row.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}


def wandb_mode() -> str | None:
    """"offline" when no W&B credentials are configured (no WANDB_API_KEY, no netrc entry for its host) and
    WANDB_MODE is not set; else None (W&B's own choice)."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return None
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        if netrc.netrc().authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


class Sinks:
    """Rank 0's log: `write(row)` appends to every sink the job names; `close()`. `run_id`: the W&B run's id, for the
    checkpoint (None without W&B)."""

    def __init__(self, job: JobConfig, start_step: int, *, wandb_run_id: str | None = None):
        logging = job.logging
        self.jsonl = progress.open_log(logging.log_jsonl, start_step) if logging.log_jsonl else None
        self.tensorboard = self.wandb = self.run_id = None
        if logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(logging.tensorboard_dir, purge_step=start_step + 1 if start_step else None)
            if not start_step:
                self.tensorboard.add_text("config", "```toml\n" + job.to_toml() + "```", 0)
        if logging.wandb_project:
            self.wandb = _wandb_run(job, wandb_run_id)
            self.run_id = self.wandb.id

    def write(self, row: dict[str, Any]) -> None:
        if self.jsonl:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        numbers = scalars(row)
        if self.tensorboard:
            for name, value in numbers.items():
                self.tensorboard.add_scalar(name, value, row["step"])
            self.tensorboard.flush()
        if self.wandb:
            self.wandb.log(numbers, step=row["step"])

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


def _wandb_run(job, run_id):
    """wandb.init for this job: a new run, or (`run_id`, from the checkpoint) the same one continued."""
    import dataclasses

    import wandb

    return wandb.init(project=job.logging.wandb_project, name=job.logging.wandb_run_name, id=run_id,
                      resume="allow" if run_id else None, dir=job.logging.log_dir, mode=wandb_mode(),
                      config={name: dataclasses.asdict(section) for name, section in job.sections().items()},
                      settings=wandb.Settings(silent=True, console="off"))  # (the terminal is the progress bar's)
