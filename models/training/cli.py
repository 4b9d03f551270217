"""The 3D-parallel training job: a GPT trained with tensor x pipeline x data parallelism.

    python -m models.train                                   # 8 CPU processes: tp=2 x pp=2 x dp=2, gloo
    python -m models.train --tp 4 --pp 1 --dp 2 --sequence-parallel --dp-mode fsdp
    python -m models.train --dp-mode zero1 --precision bf16 --clip-grad 1.0  # Megatron's distributed optimizer
    torchrun --nproc-per-node 8 -m models.train --tp 2 --pp 2            # under torchrun: dp = WORLD_SIZE / (tp*cp*pp)
    torchrun --nnodes 2 --node-rank N --nproc-per-node 4 --master-addr HOST0 --master-port 29500 -m models.train
    torchrun --standalone --nproc-per-node 8 --max-restarts 3 -m models.train --save ckpt --load ckpt --save-every 50

Not under torchrun, the whole configuration (paths included) is validated in this process first (one line and exit
2 on error), then tp*cp*pp*dp processes are started through torchrun's launcher on this machine (launch.py); a
failure inside the ranks ends the job in one line naming the first failing rank, each rank's traceback in its log
file (failures.py). The data are byte tokens of Python's standard-library sources (data/): no downloads;
`--data PATH --tokenizer DIR` trains on your text, tokenized once by the launcher, or on Megatron's indexed datasets
and their blends. `--config job.toml`
reads the flags' values from a TOML file (config.py; flags given here win), as each run writes its own resolved
configuration beside the ranks' logs.
"""
import argparse
import datetime
import functools
import os
import sys

from tp.mesh import DEFAULT_ORDER, launched_by_torchrun

from ..config import CP_MODES, PRESETS, RECOMPUTE, GPTConfig
from . import data, failures, launch, preflight, trainer
from .config import DP_MODES, LR_DECAY_STYLES, PIPELINE_SCHEDULES, SIZE_FIELDS, JobConfig

_UNSET = object()


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown (once: not for a flag whose help says its default), the description's example commands kept
    as written."""

    def _get_help_string(self, action):
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Also records the flags the command line gave (`given_flags`, argparse dests): with --config, those alone win
    over the file, not the defaults of the others."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        marked, _ = super().parse_known_args(args, argparse.Namespace(**dict.fromkeys(vars(parsed), _UNSET)))
        parsed.given_flags = tuple(k for k, v in vars(marked).items() if v is not _UNSET)
        return parsed, rest


def parser() -> argparse.ArgumentParser:
    """models.train's command line: one flag per JobConfig field (config.py), and --config."""
    p = _Parser(prog="python -m models.train", description=__doc__,
                formatter_class=lambda prog: _HelpFormatter(prog, width=110))
    p.add_argument("--config", metavar="TOML", default=None,
                   help="read the job from a TOML file: the sections of models/training/config/, as every run "
                        "writes its resolved one (LOG_DIR/config.toml); flags given on the command line win")
    _split_and_training_flags(p.add_argument)
    _model_and_data_flags(p.add_argument)
    _document_flags(p.add_argument)
    _output_and_launch_flags(p.add_argument)
    _watch_flags(p.add_argument)
    return p


def _split_and_training_flags(a):
    a("--tp", type=int, default=2, help="tensor-parallel size")
    a("--pp", type=int, default=2, help="pipeline-parallel size (stages)")
    a("--dp", type=int, default=None,
      help="data-parallel size (default: WORLD_SIZE / (tp*cp*pp) under torchrun, as Megatron; else 2)")
    a("--cp", type=int, default=1, help="context-parallel size: each sequence split over cp ranks (ring attention)")
    a("--cp-mode", choices=CP_MODES, default="ring",
      help="context-parallel attention: K/V ringed with p2p (overlapped), all-gathered once (Llama 3's), a2a "
           "(DeepSpeed-Ulysses: all-to-alls trade the sequence split for a head split; heads divisible by tp*cp), "
           "or a2a+ring (a2a inside sub-groups of --cp-a2a-size ranks, a ring across them)")
    a("--cp-a2a-size", type=int, default=None, metavar="A",
      help="--cp-mode a2a+ring: ranks per all-to-all sub-group (consecutive cp ranks, e.g. one node), a divisor of "
           "--cp")
    a("--schedule", choices=PIPELINE_SCHEDULES, default="1f1b",
      help="pipeline schedule (tp/pipeline/schedules.py): interleaved is Megatron's, with --virtual-stages model "
           "chunks per rank; zb is ZB-H1, the backward split into input and weight gradients")
    a("--virtual-stages", type=int, default=1, metavar="V",
      help="model chunks per pipeline rank (--schedule interleaved; Megatron's virtual pipeline size)")
    a("--global-batch-size", type=int, default=16, help="sequences per optimizer step, over all dp ranks")
    a("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
    a("--seq-len", type=int, default=64, help="tokens per sequence")
    a("--steps", type=int, default=100, help="optimizer steps")
    a("--lr", type=float, default=3e-3, help="peak learning rate (AdamW; linear warm-up, then --lr-decay-style)")
    a("--warmup-steps", type=int, default=5, help="learning-rate warm-up steps")
    a("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    a("--seed", type=int, default=1234, help="seed of the weights, the data order and dropout")
    a("--sequence-parallel", action="store_true", help="Megatron sequence parallelism inside each tp group")
    a("--recompute", choices=RECOMPUTE, default="none", help="activation recomputation")
    a("--dp-mode", choices=DP_MODES, default="ddp",
      help="data parallelism: torch DDP on the dp group, FSDP2 (fully_shard) on the dp mesh dim, or zero1: the "
           "distributed optimizer (fp32 grads reduce-scattered in buckets during backward, each rank stepping 1/dp "
           "of the fp32 masters and AdamW state, parameters all-gathered)")
    a("--precision", default=None, metavar="{fp32,tf32,bf16}",
      help="bf16: bf16 parameters and activations, fp32 master weights, fp32 gradient accumulation and reduction "
           "(the GPU default; fp32 on CPU, where bf16 matmuls are slow); tf32: fp32 with TensorFloat-32 matmuls on "
           "GPUs (fp32 there is the exact, slow IEEE dot)")
    a("--compile", action="store_true",
      help="torch.compile each transformer block (fullgraph, as torchtitan): no graph break, the same loss")
    a("--ep", type=int, default=1,
      help="expert-parallel size: the experts of each MoE layer split over ep ranks of a stage's tp*cp*dp (which "
           "exchange tokens by all-to-all); ep*etp must divide tp*cp*dp")
    a("--etp", type=int, default=None,
      help="expert-tensor-parallel size: each expert's FFN split over etp ranks (default: --tp)")
    a("--clip-grad", type=float, default=1.0, metavar="C",
      help="clip the global gradient norm (over tp, pp and dp) to C (0: no clipping); a non-finite norm skips the "
           "step")


def _model_and_data_flags(a):
    a("--model", choices=sorted(PRESETS), default=None, help="model size, default tiny (the overrides below win)")
    for field in SIZE_FIELDS:
        a(f"--{field.replace('_', '-')}", type=int, default=None, help=f"override the preset's {field}")
    a("--dropout", type=float, default=0.0, help="residual (and, unless given, attention) dropout")
    a("--attention-dropout", type=float, default=None,
      help="attention-probability dropout (default: --dropout)")
    a("--from-hf", metavar="PATH", default=None,
      help="start from a Hugging Face Llama/Mistral/Qwen2/GPT-2 directory (save_pretrained); its own tokenizer "
           "is used when the directory holds one (else bytes: the vocabulary must cover 256)")
    _moe_flags(a)
    _data_flags(a)
    a("--eval-every", type=int, default=0, metavar="N",
      help="validation loss (val_loss) on the held-out last ~1%% of the data every N steps and at the end (0: never)")
    a("--eval-iters", type=int, default=10, metavar="K", help="global batches per validation")
    a("--eval-only", action="store_true", help="evaluate the --load checkpoint (or the --from-hf model) and exit")


def _moe_flags(a):
    """A mixture of experts (Megatron's flags; the preset's values, dense unless it has experts, where not given)."""
    a("--num-experts", type=int, default=None, metavar="E",
      help="experts per MoE layer (tp.moe.MoE in the MLP's place; --model tiny-moe / small-moe have them)")
    a("--moe-router-topk", type=int, default=None, metavar="K", help="experts each token is routed to (default 2)")
    a("--moe-ffn-hidden-size", type=int, default=None, metavar="F", help="each expert's FFN size (default --ffn-"
                                                                          "hidden-size)")
    a("--moe-layer-freq", default=None, metavar="N|0,1,..",
      help="MoE on every N-th layer (from the first), or a 0/1 per layer (DeepSeek's dense first layers: 0,1,1,1)")
    a("--moe-shared-expert-size", type=int, default=None, metavar="S",
      help="an FFN of size S every token goes through beside the experts (0: none)")
    a("--moe-router-score", choices=("softmax", "sigmoid"), default=None,
      help="softmax (Mixtral, Qwen) or sigmoid with DeepSeek-V3's auxiliary-loss-free bias, updated after each step "
           "(rate 1e-3)")
    a("--moe-aux-loss-coeff", type=float, default=None, metavar="C",
      help="load-balancing loss coefficient (Switch; over each micro-batch's global tokens)")
    a("--moe-z-loss-coeff", type=float, default=None, metavar="Z", help="router z-loss coefficient")
    a("--moe-capacity-factor", type=float, default=None, metavar="X",
      help="each expert keeps at most ceil(tokens*k/E*X) slots of a micro-batch, the highest-weighted (default: "
           "dropless)")
    a("--moe-dispatcher", choices=("alltoall", "allgather"), default=None,
      help="token dispatch over ep: all-to-all (default) or all-gather (cheaper while ep < k)")


def _document_flags(a):
    """Documents inside a window (Megatron's flags), found by the end-of-document token (models/training/documents.py):
    the tokenizer's EOS, or a token file's eos_id."""
    a("--reset-position-ids", action="store_true", help="positions restart at each document's first token")
    a("--reset-attention-mask", action="store_true",
      help="attention stays inside each document (block-diagonal causal); positions restart too only with "
           "--reset-position-ids")
    a("--eod-mask-loss", action="store_true", help="no loss on the token predicted from an end-of-document token")


def _data_flags(a):
    a("--data", metavar="PATH", nargs="+", default=None,
      help="training data: a Megatron indexed dataset PREFIX (PREFIX.bin + PREFIX.idx); a .txt, .jsonl or .json "
           "(JSON lines) or .parquet file, a directory of them, or a Hugging Face save_to_disk directory, "
           "tokenized once into the token cache; a flat token file PREFIX.bin with its PREFIX.json; or a blend of "
           "them, Megatron's WEIGHT PATH pairs (--data 0.3 A 0.7 B); default: the bundled corpus")
    a("--tokenizer", metavar="DIR", default=None,
      help="a local Hugging Face tokenizer directory (AutoTokenizer): text is tokenized once, documents ended by "
           "its EOS; the model's vocabulary follows it (a Megatron dataset's ids are checked against it); "
           "default: bytes")
    a("--data-column", metavar="NAME", default=None,
      help="the JSON field or parquet/Arrow column to read (default: text; messages with --sft)")
    a("--sft", action="store_true",
      help="chat fine-tuning: rows of \"messages\" rendered by the tokenizer's chat template, only the "
           "assistant's tokens in the loss; conversations packed whole into windows, a longer one left out and "
           "counted")
    a("--data-cache-dir", metavar="DIR", default=None,
      help="where tokenized data is cached (default: $XDG_CACHE_HOME/tp-layers/tokens, else "
           "~/.cache/tp-layers/tokens; on several nodes, a directory they share)")


def _output_and_launch_flags(a):
    a("--save", metavar="DIR", default=None, help="write resharding checkpoints DIR/step-N (at the end, and every "
                                                   "--save-every steps); DIR/latest names the newest")
    a("--save-every", type=int, default=0, metavar="N", help="checkpoint every N steps (0: only at the end)")
    a("--load", metavar="DIR", default=None,
      help="resume from the newest checkpoint in DIR (or the step directory DIR), written at any tp/pp/dp split")
    a("--export-hf", metavar="DIR", default=None, help="write the trained model in Hugging Face format at the end")
    a("--log-jsonl", metavar="PATH", default=None, help="one JSON object per step: step, loss, tokens_per_s, ...")
    a("--check-inputs", action="store_true",
      help="assert every step that all tp ranks of a group read the same tokens (a checksum all-gather)")
    a("--log-interval", type=int, default=10, metavar="N",
      help="when stdout is not a terminal (a file, a pipe): one progress line every N steps instead of a tqdm bar")
    a("--log-dir", metavar="DIR", default=None,
      help="each rank's log DIR/rank-N.log: all the output of ranks other than 0, a failing rank's traceback "
           "(default: DIR/logs of --save, else a new temporary directory)")
    a("--print-layout", action="store_true",
      help="print which global ranks sit on which node, each rank's local rank and tp/cp/pp/dp coordinates, and exit")
    a("--distributed-timeout-minutes", type=float, default=10.0, metavar="M",
      help="collective timeout: a rank that hangs ends the job after M minutes, and is named")
    a("--device", choices=("auto", "cpu", "cuda"), default="auto",
      help="cuda: one rank per GPU over NCCL (gloo for CPU tensors); cpu: gloo ranks on the CPU even with GPUs; "
           "auto: $TP_DEVICE when set, else cuda when a GPU is visible")
    a("--max-restarts", type=int, default=0, metavar="K",
      help="restart every rank up to K times after a failure (torchrun's flag, for our launcher); with --save DIR "
           "--load DIR the job resumes from DIR/latest")
    a("--fail-at-step", type=int, default=None, help=argparse.SUPPRESS)  # fault injection for the tests
    a("--hang-at-step", type=int, default=None, help=argparse.SUPPRESS)  # --fail-rank sleeps there
    a("--slow-save-at-step", type=int, default=None, help=argparse.SUPPRESS)  # a first attempt's save pauses
    a("--nan-grad-at-step", type=int, default=None, help=argparse.SUPPRESS)  # --fail-rank's gradient gets a NaN
    a("--slow-step-s", type=float, default=None, help=argparse.SUPPRESS)  # --fail-rank works longer every step
    a("--fail-rank", type=int, default=0, help=argparse.SUPPRESS)


def _watch_flags(a):
    """Megatron's learning-rate flags; watching a run (TensorBoard, W&B, profiles, stragglers, the plot and sample at
    the end); saving without stalling."""
    a("--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine",
      help="learning-rate decay after the warm-up, from --lr to --min-lr (Megatron's); wsd: warmup-stable-decay")
    a("--min-lr", type=float, default=None, help="the learning rate the decay ends at (default: --lr / 10)")
    a("--lr-decay-steps", type=int, default=None, metavar="N",
      help="steps (from 0) over which the learning rate decays, --min-lr after (default: --steps)")
    a("--lr-wsd-decay-steps", type=int, default=None, metavar="N",
      help="wsd: the last N of the decay steps fall linearly to --min-lr (default: 10%% of the decay steps)")
    a("--async-save", action="store_true",
      help="checkpoints staged to CPU and written in the background (torch.distributed.checkpoint.async_save) "
           "while training goes on; DIR/latest moves once every rank's write is complete")
    a("--tensorboard-dir", metavar="DIR", default=None,
      help="TensorBoard scalars (the JSONL log's) and the configuration, written by rank 0 (pip install tensorboard)")
    a("--wandb-project", metavar="NAME", default=None,
      help="log the same rows to Weights & Biases (pip install wandb); offline without credentials (WANDB_API_KEY "
           "or a wandb login); a resumed job continues the checkpoint's W&B run")
    a("--wandb-run-name", metavar="NAME", default=None, help="the W&B run's display name")
    a("--profile-steps", metavar="A:B", default=None,
      help="torch.profiler over optimizer steps A..B: one Chrome/Perfetto trace per rank (pipeline actions and "
           "collectives named), CUDA memory snapshots on GPUs")
    a("--profile-dir", metavar="DIR", default=None, help="where the traces go (default: LOG_DIR/profile)")
    a("--profile-ranks", metavar="R,R", default=None, help="profile these global ranks only (default: every rank)")
    a("--straggler-factor", type=float, default=1.5, metavar="F",
      help="every --log-interval steps each rank's step time is gathered (slowest_rank, rank_step_s_max/min in the "
           "log); warn when a rank takes F times the median 3 times running")
    a("--no-sample", action="store_true", help="skip the greedy sample from the trained model printed at the end")


def job_config(args: argparse.Namespace) -> JobConfig:
    """The JobConfig of parsed flags; with --config, the file's, the flags the command line gave replacing its
    values."""
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "given_flags")}
    if args.config is None:
        return JobConfig().with_flags(flags)
    given = set(getattr(args, "given_flags", flags)) - {"config"}
    return JobConfig.from_toml(args.config).with_flags({k: flags[k] for k in given})


def validate(args: argparse.Namespace | JobConfig, world_size: int | None = None) -> GPTConfig:
    """Every check that needs no process (preflight.py): raises ValueError with one line naming the bad value;
    returns the GPTConfig. Resolves dp when not given (from `world_size`, torchrun's WORLD_SIZE), in the JobConfig,
    or in the parsed flags `args`."""
    job = args if isinstance(args, JobConfig) else job_config(args)
    config = preflight.check(job, world_size)
    if not isinstance(args, JobConfig):
        args.dp, args.device, args.precision = job.parallelism.dp, job.launch.device, job.training.precision
    return config


def train(args: argparse.Namespace | JobConfig) -> int:
    """The job on this rank (trainer.py), from parsed flags or a JobConfig."""
    if isinstance(args, JobConfig):
        return trainer.train(args)
    return trainer.train(job_config(args), config_file=args.config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    under_torchrun = launched_by_torchrun()
    try:
        job = job_config(args)
        validate(job, int(os.environ["WORLD_SIZE"]) if under_torchrun else None)
        if job.launch.print_layout and not under_torchrun:  # this machine, one node: no process needed
            sizes = job.parallelism.sizes
            print("\n".join(launch.layout_lines(sizes, DEFAULT_ORDER, launch.this_machine(job.parallelism.world_size))))
            return 0
        if not under_torchrun:
            data.prepare(job)  # a user's text tokenized once, here, before any rank starts
    except (ValueError, ImportError, OSError) as e:
        if under_torchrun:  # every rank refuses; rank 0 alone says why
            return failures.refuse(str(e))
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not under_torchrun:
        return launch.launch(job)
    timeout = datetime.timedelta(minutes=job.launch.distributed_timeout_minutes)
    if job.launch.print_layout:
        return launch.print_layout_under_torchrun(job.parallelism.sizes, timeout)
    logs, config_file = launch.log_dir(job), args.config
    job.logging.log_dir = logs  # (resolved: where the profiles and W&B go, what the done line names)
    written = os.path.join(logs, launch.CONFIG_FILE)
    if os.environ["RANK"] == "0" and not (config_file and os.path.realpath(config_file) == os.path.realpath(written)):
        config_file = launch.write_config(job, logs)  # under your own torchrun (ours wrote it and passed --config)
    run = functools.partial(trainer.train, config_file=config_file)
    return failures.run_rank(run, job, logs, timeout.total_seconds())


def entry() -> None:
    """`python -m models.train`: main(), then the process's exit."""
    launch.exit_process(main())
