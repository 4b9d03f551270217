"""The 3D-parallel training job: a GPT trained with tensor x pipeline x data parallelism.

    python -m models.train                                   # 8 CPU processes: tp=2 x pp=2 x dp=2, gloo
    python -m models.train --tp 4 --pp 1 --dp 2 --sequence-parallel --dp-mode fsdp
    python -m models.train --dp-mode zero1 --precision bf16 --clip-grad 1.0  # Megatron's distributed optimizer
    python -m models.train --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --train-iters 3  # Megatron
    python -m models.train --model llama3-8b --num-layers 2 --hidden-size 256 --ffn-hidden-size 512 --vocab-size 1000
    torchrun --nproc-per-node 8 -m models.train --tp 2 --pp 2            # under torchrun: dp = WORLD_SIZE / (tp*cp*pp)
    torchrun --nnodes 2 --node-rank N --nproc-per-node 4 --master-addr HOST0 --master-port 29500 -m models.train
    torchrun --standalone --nproc-per-node 8 --max-restarts 3 -m models.train --save ckpt --load ckpt --save-every 50

Not under torchrun, the whole configuration (paths included) is validated in this process first (one line and exit
2 on error), then tp*cp*pp*dp processes are started through torchrun's launcher on this machine (launch.py); a
failure inside the ranks ends the job in one line naming the first failing rank, each rank's traceback in its log
file (failures.py). The data are byte tokens of Python's standard-library sources (data/): no downloads;
`--data PATH --tokenizer DIR` trains on your text, tokenized once by the launcher, or on Megatron's indexed datasets
and their blends. Every flag is a field of the typed job config (models/training/config/, its sections the groups
below; Megatron-LM's flag names are aliases); `--config job.toml` reads them from a TOML file (flags given here win),
as each run writes its own resolved configuration beside the ranks' logs (LOG_DIR/config.toml).
"""
import argparse
import datetime
import functools
import os
import re
import sys

from tp.mesh import DEFAULT_ORDER, launched_by_torchrun

from ..config import GPTConfig
from ..presets import DEFAULT_MODEL, MODELS
from ..stages import EVEN_SPLIT
from . import data, failures, launch, preflight, resuming, trainer
from .config import JobConfig
from .config.toml_io import read_toml
from .flags import Parser, add_job_flags, usage_formatter

# Megatron's virtual pipeline flags: no field of ours (virtual_stages counts chunks per rank), converted by job_config
VIRTUAL_PIPELINE_FLAGS = ("num_layers_per_virtual_pipeline_stage", "virtual_pipeline_model_parallel_size")


def parser() -> argparse.ArgumentParser:
    """models.train's command line: one flag per JobConfig field (models/training/config/), grouped by section, and
    --config."""
    p = Parser(prog="python -m models.train", description=__doc__, formatter_class=usage_formatter)
    p.add_argument("--config", metavar="TOML", default=None,
                   help="read the job from a TOML file: the sections of models/training/config/, as every run "
                        "writes its resolved one (LOG_DIR/config.toml); flags given on the command line win")
    parallelism = add_job_flags(p)["parallelism"]
    parallelism.add_argument(
        "--num-layers-per-virtual-pipeline-stage", type=int, metavar="N", default=argparse.SUPPRESS,
        help="Megatron's: --virtual-stages = layers / (pp * N), and the interleaved schedule")
    parallelism.add_argument(
        "--virtual-pipeline-model-parallel-size", type=int, metavar="V", default=argparse.SUPPRESS,
        help="Megatron's: --virtual-stages V, and the interleaved schedule")
    return p


def job_config(args: argparse.Namespace) -> JobConfig:
    """The JobConfig of parsed flags; with --config, the file's, the flags the command line gave replacing its
    values."""
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "given_flags", *VIRTUAL_PIPELINE_FLAGS)}
    given = set(getattr(args, "given_flags", flags)) - {"config"}
    tables = {} if args.config is None else read_toml(args.config)
    if args.config is None:
        job = JobConfig().with_flags(flags)
    else:
        job = JobConfig.from_dict(tables, f"--config {args.config}").with_flags({k: flags[k] for k in given
                                                                                 if k in flags})
    job = megatron_virtual_pipeline(job, args)
    if "schedule" not in given and "schedule" not in tables.get("parallelism", {}):
        interleave(job.parallelism)
    named = given | {key for table in tables.values() for key in table}  # (by a flag or by the --config file)
    if job.checkpoint.use_checkpoint_args:
        resuming.take_run_args(job, named)
    optimizer, decay_steps = job.optimizer, job.optimizer.lr_decay_steps or job.training.steps
    # given on the command line (the default 5 in a short run is left, and so is a --config file's: the resolved one
    # the launcher hands its ranks holds every value)
    if "warmup_steps" in given and 0 < decay_steps <= optimizer.warmup_steps:
        raise ValueError(f"--warmup-steps={optimizer.warmup_steps} must be less than the decay's {decay_steps} steps "
                         "(--lr-decay-steps, default --steps): the learning rate would never reach --lr (Megatron "
                         "asserts it too)")
    return job


def interleave(parallel) -> None:
    """More than one model chunk per pipeline rank and no schedule given (by a flag or the --config file): the
    interleaved one (Megatron's 1F1B with a virtual pipeline), not the default 1f1b's refusal."""
    if parallel.virtual_stages > 1 and parallel.schedule == "1f1b":
        parallel.schedule = "interleaved"


def megatron_virtual_pipeline(job: JobConfig, args: argparse.Namespace) -> JobConfig:
    """`job` with Megatron's virtual pipeline flags, if given, as virtual_stages: V chunks per pipeline rank, or the
    layers per chunk (which must divide each stage's layers); job_config then picks their schedule (interleave)."""
    per_chunk, stages = (getattr(args, name, None) for name in VIRTUAL_PIPELINE_FLAGS)
    if per_chunk is None and stages is None:
        return job
    parallel, model = job.parallelism, job.model
    if per_chunk is not None:
        if parallel.stage_split != EVEN_SPLIT:
            raise ValueError("--num-layers-per-virtual-pipeline-stage with an uneven pipeline split: give "
                             "--virtual-stages V (model chunks per pipeline rank)")
        if stages is not None:
            raise ValueError("give one of --num-layers-per-virtual-pipeline-stage and "
                             "--virtual-pipeline-model-parallel-size")
        if model.from_hf:
            raise ValueError("--num-layers-per-virtual-pipeline-stage with --from-hf: give --virtual-stages V "
                             "(model chunks per pipeline rank)")
        layers = model.num_layers or MODELS[model.preset or DEFAULT_MODEL]["num_layers"]
        if per_chunk < 1 or layers % (parallel.pp * per_chunk):
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage={per_chunk} does not divide the {layers} "
                             f"layers' {layers / parallel.pp:g} per pipeline stage (--pp={parallel.pp})")
        stages = layers // (parallel.pp * per_chunk)
    parallel.virtual_stages = stages
    return job


def validate(args: argparse.Namespace | JobConfig, world_size: int | None = None, *,
             config_file: str | None = None) -> GPTConfig:
    """Every check that needs no process (preflight.py): raises ValueError with one line naming the bad value;
    returns the GPTConfig. Resolves dp when not given (from `world_size`, torchrun's WORLD_SIZE), in the JobConfig,
    or in the parsed flags `args`. `config_file`: the --config file a JobConfig was read from (parsed flags name
    their own)."""
    job = args if isinstance(args, JobConfig) else job_config(args)
    if not isinstance(args, JobConfig):
        config_file = args.config
    config = preflight.check(job, world_size, config_file=config_file)
    if not isinstance(args, JobConfig):
        args.dp, args.device, args.precision = job.parallelism.dp, job.launch.device, job.training.precision
    return config


def train(args: argparse.Namespace | JobConfig) -> int:
    """The job on this rank (trainer.py), from parsed flags or a JobConfig."""
    if isinstance(args, JobConfig):
        return trainer.train(args)
    return trainer.train(job_config(args), config_file=args.config)


def from_the_file(message: str, args: argparse.Namespace) -> str:
    """" ([section] key, ...: from --config FILE)" for the flags a refusal names whose values the --config file gave
    (not the command line), else ""."""
    if args.config is None or message.startswith(f"--config {args.config}"):
        return ""
    tables = read_toml(args.config)
    written = tables.get("logging", {}).get("log_dir")  # (a run's resolved config.toml, in its log directory)
    if written and os.path.realpath(os.path.join(written, launch.CONFIG_FILE)) == os.path.realpath(args.config):
        return ""  # (every key is in it: our launcher's ranks read it; the launcher named the user's file already)
    named = {flag.replace("-", "_") for flag in re.findall(r"--([a-z][a-z0-9-]*)", message)}
    given = set(getattr(args, "given_flags", ()))
    keys = {}
    for section, table in tables.items():
        for key in sorted(named.intersection(table) - given):
            keys.setdefault(section, []).append(key)
    where = ", ".join(f"[{section}] {', '.join(names)}" for section, names in keys.items())
    return f" ({where}: from --config {args.config})" if where else ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    launch.keep_caches_out_of_tmp()
    under_torchrun = launched_by_torchrun()
    try:
        job = job_config(args)
        validate(job, int(os.environ["WORLD_SIZE"]) if under_torchrun else None, config_file=args.config)
        if job.launch.print_layout and not under_torchrun:  # this machine, one node: no process needed
            sizes = job.parallelism.sizes
            print("\n".join(launch.layout_lines(sizes, DEFAULT_ORDER, launch.this_machine(job.parallelism.world_size))))
            return 0
        if not under_torchrun:
            data.prepare(job)  # a user's text tokenized once, here, before any rank starts
    except (ValueError, ImportError, OSError) as e:
        message = f"{e}{from_the_file(str(e), args)}"
        if under_torchrun:  # every rank refuses; rank 0 alone says why
            return failures.refuse(message)
        print(f"error: {message}", file=sys.stderr)
        return 2
    if not under_torchrun:
        return launch.launch(job)
    launch.die_with_launcher()  # (a launcher killed with SIGKILL takes its ranks along)
    timeout = datetime.timedelta(minutes=job.launch.distributed_timeout_minutes)
    if job.launch.print_layout:
        return launch.print_layout_under_torchrun(job.parallelism.sizes, timeout)
    logs, config_file = launch.log_dir(job), args.config
    job.logging.log_dir = logs  # (resolved: where the profiles and W&B go, what the done line names)
    written = os.path.join(logs, launch.CONFIG_FILE)
    if os.environ["RANK"] == "0" and not (config_file and os.path.realpath(config_file) == os.path.realpath(written)):
        config_file = launch.write_config(job, logs)  # under your own torchrun (ours wrote it and passed --config)
        launch.remove_stale_rank_logs(logs, int(os.environ["WORLD_SIZE"]))
    run = functools.partial(trainer.train, config_file=config_file)
    return failures.run_rank(run, job, logs, timeout.total_seconds())


def entry() -> None:
    """`python -m models.train`: main(), then the process's exit."""
    launch.exit_process(main())
