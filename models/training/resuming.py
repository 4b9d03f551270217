"""What a checkpoint keeps of the run that wrote it (`run_record`: checkpoint.save's `extra`), and what a resume does
with it, the way a Megatron-LM user resumes:

- --use-checkpoint-args: the model (the checkpoint's GPTConfig), the tokenizer and the data format come from the
  checkpoint; the command line gives the layout, the steps and the paths (and may give the MoE loss weights and
  capacity factor, config.TRAINING_FIELDS). A model, tokenizer or data-format flag the command line gives that
  differs is refused in one line naming it. Without the flag, a checkpoint of another model
  is refused naming the flags that differ.
- --finetune: the weights alone, from step 0 (a fresh optimizer, schedule and data order); --no-load-optim,
  --no-load-rng: the step, without the optimizer's state or the generators'.
- A fresh --save DIR whose newest checkpoint is later than this run's start is refused: its saves would move
  `latest` back.
- A resume at another learning-rate schedule (a new --steps, --lr, ...) says so in one line, the lr before and after;
  one at another data order (--global-batch-size, --seed, --seq-len) too.
"""
import dataclasses
import math
import os
from typing import Any

from ..config import RUNTIME_FIELDS, TRAINING_FIELDS, GPTConfig
from .checkpoint_dirs import committed, resume_path, saved_step
from .config import JobConfig
from .config.fields import flag_of
from .config.model import MOE_SHAPE_FIELDS, MOE_TRAINING_FIELDS, SHAPE_FIELDS, ModelConfig

DATA_ORDER = ("global_batch_size", "seed", "seq_len")  # [training] fields the data stream's position depends on
DATA_FORMAT = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss", "sft", "column")  # [data]'s
SCHEDULE = ("lr", "warmup_steps", "lr_decay_style", "min_lr", "lr_decay_steps", "lr_wsd_decay_steps")  # [optimizer]'s
MODEL_FLAGS = SHAPE_FIELDS + MOE_SHAPE_FIELDS + MOE_TRAINING_FIELDS  # [model] fields that are GPTConfig fields


def run_record(job: JobConfig, *, tokenizer: str | None, wandb_run_id: str | None) -> dict[str, Any]:
    """What a checkpoint keeps of its run: the fields the data order depends on, the tokenizer directory (absolute;
    None: bytes), the W&B run, the data format and the learning-rate schedule with its --steps."""
    return ({k: getattr(job.training, k) for k in DATA_ORDER}
            | dict(tokenizer=tokenizer, wandb_run_id=wandb_run_id,
                   data_format={k: getattr(job.data, k) for k in DATA_FORMAT},
                   lr_schedule={k: getattr(job.optimizer, k) for k in SCHEDULE} | {"steps": job.training.steps}))


def _saved(job):
    """(the checkpoint path the job resumes from, its meta), or (None, None)."""
    path = resume_path(job.checkpoint.load, job.checkpoint.save)
    if not path:
        return None, None
    from . import checkpoint

    try:
        return path, checkpoint.read_meta(path)
    except ValueError as e:
        raise ValueError(f"--load {job.checkpoint.load}: {e}") from None


def use_checkpoint_args(job: JobConfig) -> dict[str, Any] | None:
    """--use-checkpoint-args: the checkpoint's tokenizer and data format set into `job` (the same again on a second
    call), the model flags the command line gave checked against its GPTConfig; returns that GPTConfig (a dict), or
    None without the flag. ValueError (one line naming the flag) for a given value that differs."""
    if not job.checkpoint.use_checkpoint_args:
        return None
    path, meta = _saved(job)
    if meta is None:
        raise ValueError(f"--use-checkpoint-args: --load {job.checkpoint.load} holds no checkpoint yet to take the "
                         "model from")
    saved, extra = meta["config"], meta["extra"] or {}
    model = job.model
    for flag, value in (("--model", model.preset), ("--from-hf", model.from_hf)):
        if value is not None:
            raise ValueError(f"{flag} {value} with --use-checkpoint-args: the model comes from the checkpoint "
                             f"{path}; drop {flag}")
    shape_flags = [f for f in MODEL_FLAGS if f not in RUNTIME_FIELDS + TRAINING_FIELDS]  # (given training ones win)
    for field in (f for f in shape_flags if getattr(model, f) is not None):
        given = model.layer_freq() if field == "moe_layer_freq" else getattr(model, field)
        if given != saved.get(field):
            raise ValueError(f"{flag_of(field)}={getattr(model, field)}: the checkpoint's model has "
                             f"{saved.get(field)!r} (--use-checkpoint-args takes the model from it: drop the flag)")
    _take_tokenizer(job, extra.get("tokenizer"))
    for field, value in (extra.get("data_format") or {}).items():
        default = next(f.default for f in dataclasses.fields(job.data) if f.name == field)
        if getattr(job.data, field) not in (default, value):
            raise ValueError(f"--{'data-column' if field == 'column' else field.replace('_', '-')}="
                             f"{getattr(job.data, field)}: the checkpoint's run had {value!r} "
                             "(--use-checkpoint-args takes the data format from it)")
        setattr(job.data, field, value)
    return saved


RUN_ARGS = {"seq_len": ("training", "extra"), "dropout": ("model", "config"), "attention_dropout": ("model", "config")}


def take_run_args(job: JobConfig, given: set[str]) -> None:
    """--use-checkpoint-args: the checkpoint's run's sequence length and dropout rates set into `job` where neither
    the command line nor --config gave them (`given`: their field names; Megatron's load_args_from_checkpoint takes
    the sequence length so, its dropout rates even over given flags). Nothing when there is no checkpoint to read
    (use_checkpoint_args says so in one line)."""
    try:
        _, meta = _saved(job)
    except ValueError:
        return
    if "dropout" in given:  # (a given --dropout drives the attention's too, as without the flag)
        given = given | {"attention_dropout"}
    for field, (section, source) in RUN_ARGS.items():
        value = ((meta or {}).get(source) or {}).get(field)
        if field not in given and value is not None:
            setattr(getattr(job, section), field, value)


def _take_tokenizer(job, saved):
    given = job.data.tokenizer
    if given is None:
        job.data.tokenizer = saved
    elif saved is None or os.path.realpath(given) != os.path.realpath(saved):
        raise ValueError(f"--tokenizer {given}: the checkpoint's run used {saved or 'bytes (no --tokenizer)'} "
                         "(--use-checkpoint-args takes the tokenizer from it: drop --tokenizer)")


def checkpoint_model(saved: dict[str, Any], runtime: dict[str, Any], seq_len: int) -> GPTConfig:
    """The GPTConfig of a checkpoint's saved one, with this job's runtime fields; max_seq_len at least `seq_len`
    where positions are not weights."""
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    fields = {k: v for k, v in saved.items() if k in names and k not in RUNTIME_FIELDS} | runtime
    if fields.get("position") != "learned":
        fields["max_seq_len"] = max(fields["max_seq_len"], seq_len)
    return GPTConfig(**fields)


def check_model(job: JobConfig, saved: dict[str, Any], config: GPTConfig) -> None:
    """Raise (one line naming the flags) unless the job's model is the checkpoint's."""
    from . import checkpoint

    differ = checkpoint.config_differences(saved, config)
    if not differ:
        return
    flags = {f.name for f in dataclasses.fields(ModelConfig)}
    named = [f"{flag_of(k) if k in flags else k + ' (--model)'} {theirs!r} (this job: {ours!r})"
             for k, (theirs, ours) in differ.items()]
    raise ValueError(f"--load {job.checkpoint.load}: the checkpoint's model has {', '.join(named)}: give the "
                     "same flags, or --use-checkpoint-args to take them from the checkpoint")


def start_step(job: JobConfig, saved: int) -> int:
    """The step a run resumed from a checkpoint of step `saved` starts after (--finetune: 0)."""
    return 0 if job.checkpoint.finetune else saved


def check_save_forward(job: JobConfig, start: int) -> None:
    """Refuse a --save directory whose newest checkpoint is later than this run's start (step `start`): the run's
    saves would move its `latest` back."""
    save = job.checkpoint.save
    newest = committed(save) if save and not job.evaluation.eval_only else None
    step = saved_step(newest) if newest else None
    if step is not None and step > start:
        raise ValueError(f"--save {save} holds step {step}, later than this run's start (step {start}): its saves "
                         f"would move {os.path.join(save, 'latest')} back; resume it (--load {save}) or give another "
                         "--save")


def notes(job: JobConfig, extra: dict[str, Any], start: int, saved_lr: float | None) -> list[str]:
    """The lines a resume at step `start` prints about what changed since the checkpoint's run: the data order, the
    learning-rate schedule (`saved_lr`: the lr of the checkpoint's last step, for checkpoints that kept no
    schedule); no line for --eval-only, which trains no step."""
    if job.evaluation.eval_only:
        return []
    lines = []
    changed = [f"--{k.replace('_', '-')}={v}" for k, v in extra.items()
               if k in DATA_ORDER and getattr(job.training, k) != v]
    if changed:
        lines.append(f"note: the checkpoint's run had {', '.join(changed)}: the data order from here differs from "
                     "that run's")
    schedule = schedule_change(job, extra.get("lr_schedule"), start, saved_lr)
    return lines + ([schedule] if schedule else [])


def schedule_change(job: JobConfig, saved: dict[str, Any] | None, start: int, saved_lr: float | None) -> str | None:
    """One line when this run's learning rates differ from those the checkpoint's run would have used from step
    start + 1 on, giving the first step that differs and its lr before and after; None when none does."""
    steps, optimizer = job.training.steps, job.optimizer
    if saved:
        mine = {k: getattr(optimizer, k) for k in SCHEDULE} | {"steps": steps}
        differ = [f"{flag_of(k)} {saved.get(k)} -> {v}" for k, v in mine.items() if saved.get(k) != v]
        theirs = dataclasses.replace(optimizer, **{k: saved[k] for k in SCHEDULE})
        for step in range(start, steps) if differ else ():
            before, after = theirs.learning_rate(step, saved["steps"]), optimizer.learning_rate(step, steps)
            if not math.isclose(before, after, rel_tol=1e-9):
                return (f"note: the learning-rate schedule changed ({', '.join(differ)}): step {step + 1}'s lr "
                        f"{before:.4g} -> {after:.4g}")
        return None
    now = optimizer.learning_rate(start - 1, steps)  # (a checkpoint that kept no schedule: its last step's lr)
    if saved_lr is None or start == 0 or math.isclose(saved_lr, now, rel_tol=1e-9):
        return None
    return (f"note: the learning-rate schedule differs from the checkpoint's run: its step {start} ran at lr "
            f"{saved_lr:.4g}, this schedule gives {now:.4g} (step {start + 1}: "
            f"{optimizer.learning_rate(start, steps):.4g})")
