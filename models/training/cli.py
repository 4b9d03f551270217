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
file (failures.py). The data are byte tokens of Python's standard-library sources (data.py): no downloads;
`--data PATH --tokenizer DIR` trains on your text, tokenized once by the launcher (tokens.py).
"""
import argparse
import datetime
import math
import os
import sys

from tp.mesh import DEFAULT_ORDER
from tp.pipeline import schedules

from ..config import PRESETS
from ..stages import stage_layers
from . import data, failures, launch
from .checkpoint_dirs import resume_path
from .trainer import SIZE_FIELDS, model_config, train  # noqa: F401  (the per-rank job)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, the description's example commands kept as written."""


def parser():
    p = argparse.ArgumentParser(prog="python -m models.train", description=__doc__,
                                formatter_class=lambda prog: _HelpFormatter(prog, width=110))
    a = p.add_argument
    a("--tp", type=int, default=2, help="tensor-parallel size")
    a("--pp", type=int, default=2, help="pipeline-parallel size (stages)")
    a("--dp", type=int, default=None,
      help="data-parallel size (default: WORLD_SIZE / (tp*cp*pp) under torchrun, as Megatron; else 2)")
    a("--cp", type=int, default=1, help="context-parallel size: each sequence split over cp ranks (ring attention)")
    a("--cp-mode", choices=("ring", "allgather"), default="ring",
      help="context-parallel attention: K/V ringed with p2p (overlapped), or all-gathered once (Llama 3's)")
    a("--schedule", choices=("1f1b", "gpipe", "interleaved", "zb"), default="1f1b",
      help="pipeline schedule (tp/pipeline/schedules.py): interleaved is Megatron's, with --virtual-stages model "
           "chunks per rank; zb is ZB-H1, the backward split into input and weight gradients")
    a("--virtual-stages", type=int, default=1, metavar="V",
      help="model chunks per pipeline rank (--schedule interleaved; Megatron's virtual pipeline size)")
    a("--global-batch-size", type=int, default=16, help="sequences per optimizer step, over all dp ranks")
    a("--micro-batch-size", type=int, default=2, help="sequences per micro-batch")
    a("--seq-len", type=int, default=64, help="tokens per sequence")
    a("--steps", type=int, default=100, help="optimizer steps")
    a("--lr", type=float, default=3e-3, help="peak learning rate (AdamW; linear warm-up, cosine decay)")
    a("--warmup-steps", type=int, default=5, help="learning-rate warm-up steps")
    a("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    a("--seed", type=int, default=1234, help="seed of the weights, the data order and dropout")
    a("--sequence-parallel", action="store_true", help="Megatron sequence parallelism inside each tp group")
    a("--recompute", choices=("none", "selective", "full"), default="none", help="activation recomputation")
    a("--dp-mode", choices=("ddp", "fsdp", "zero1"), default="ddp",
      help="data parallelism: torch DDP on the dp group, FSDP2 (fully_shard) on the dp mesh dim, or zero1: the "
           "distributed optimizer (fp32 grads reduce-scattered in buckets during backward, each rank stepping 1/dp "
           "of the fp32 masters and AdamW state, parameters all-gathered)")
    a("--precision", default="fp32", metavar="{fp32,bf16}",
      help="bf16: bf16 parameters and activations, fp32 master weights, fp32 gradient accumulation and reduction "
           "(the GPU default; fp32 on CPU, where bf16 matmuls are slow)")
    a("--clip-grad", type=float, default=1.0, metavar="C",
      help="clip the global gradient norm (over tp, pp and dp) to C (0: no clipping); a non-finite norm skips the "
           "step")
    a("--model", choices=sorted(PRESETS), default=None, help="model size, default tiny (the overrides below win)")
    for field in SIZE_FIELDS:
        a(f"--{field.replace('_', '-')}", type=int, default=None, help=f"override the preset's {field}")
    a("--dropout", type=float, default=0.0, help="residual (and, unless given, attention) dropout")
    a("--attention-dropout", type=float, default=None,
      help="attention-probability dropout (default: --dropout; not supported with --cp > 1)")
    a("--from-hf", metavar="PATH", default=None,
      help="start from a Hugging Face Llama/Mistral/Qwen2/GPT-2 directory (save_pretrained); its own tokenizer "
           "is used when the directory holds one (else bytes: the vocabulary must cover 256)")
    a("--data", metavar="PATH", default=None,
      help="training text: a .txt, .jsonl or .json (JSON lines, field \"text\") file, a directory of .txt/.jsonl "
           "files, or a token file PREFIX.bin "
           "with its PREFIX.json sidecar (python -m models.tokens); default: the bundled corpus")
    a("--tokenizer", metavar="DIR", default=None,
      help="a local Hugging Face tokenizer directory (AutoTokenizer): text is tokenized once into a cache beside "
           "the data, documents ended by its EOS; the model's vocabulary follows it; default: bytes")
    a("--eval-every", type=int, default=0, metavar="N",
      help="validation loss (val_loss) on the held-out last ~1%% of the data every N steps and at the end (0: never)")
    a("--eval-iters", type=int, default=10, metavar="K", help="global batches per validation")
    a("--eval-only", action="store_true", help="evaluate the --load checkpoint (or the --from-hf model) and exit")
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
    a("--max-restarts", type=int, default=0, metavar="K",
      help="restart every rank up to K times after a failure (torchrun's flag, for our launcher); with --save DIR "
           "--load DIR the job resumes from DIR/latest")
    a("--fail-at-step", type=int, default=None, help=argparse.SUPPRESS)  # fault injection for the tests
    a("--hang-at-step", type=int, default=None, help=argparse.SUPPRESS)  # --fail-rank sleeps there
    a("--slow-save-at-step", type=int, default=None, help=argparse.SUPPRESS)  # a first attempt's save pauses
    a("--nan-grad-at-step", type=int, default=None, help=argparse.SUPPRESS)  # --fail-rank's gradient gets a NaN
    a("--fail-rank", type=int, default=0, help=argparse.SUPPRESS)
    return p


def validate(args, world_size=None):
    """Every check that needs no process: raises ValueError with one line naming the bad value. Sets args.dp when
    it was not given (from `world_size`, torchrun's WORLD_SIZE)."""
    args.dp = launch.resolve_dp(args, world_size)
    for name in ("tp", "cp", "pp", "dp", "global_batch_size", "micro_batch_size", "seq_len", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    world = args.tp * args.cp * args.pp * args.dp
    if world_size is not None and world_size != world:
        raise ValueError(f"WORLD_SIZE={world_size} but --tp*--cp*--pp*--dp = {args.tp}*{args.cp}*{args.pp}*{args.dp}"
                         f" = {world}")
    if args.global_batch_size % (args.dp * args.micro_batch_size):
        raise ValueError(f"--global-batch-size={args.global_batch_size} is not divisible by --dp * "
                         f"--micro-batch-size = {args.dp}*{args.micro_batch_size}")
    for name in ("lr", "weight_decay"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0 or (name == "lr" and value == 0):
            raise ValueError(f"--{name.replace('_', '-')}={value} must be a finite number "
                             f"{'> 0' if name == 'lr' else '>= 0'}")
    if not math.isfinite(args.clip_grad) or args.clip_grad < 0:
        raise ValueError(f"--clip-grad={args.clip_grad} must be a finite number >= 0 (0: no clipping)")
    if args.precision not in ("fp32", "bf16"):
        raise ValueError(f"--precision={args.precision} is not supported: fp32 or bf16 (fp16 would need loss "
                         "scaling)")
    for name in ("warmup_steps", "save_every", "eval_every"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 0")
    for name, low in (("log_interval", 1), ("max_restarts", 0)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= {low}")
    if not args.distributed_timeout_minutes > 0:
        raise ValueError(f"--distributed-timeout-minutes={args.distributed_timeout_minutes} must be > 0")
    launch.check_paths(args)  # --save, --load, --export-hf, --log-jsonl, --log-dir: before any process
    if args.from_hf:
        if not os.path.isdir(args.from_hf):
            raise ValueError(f"--from-hf {args.from_hf}: no such directory (a save_pretrained directory)")
        shape_flags = [f"--{f.replace('_', '-')}" for f in ("model", *SIZE_FIELDS) if getattr(args, f) is not None]
        if shape_flags:
            raise ValueError(f"--from-hf takes the model's shape from its config: drop {' '.join(shape_flags)}")
    if args.eval_iters < 1:
        raise ValueError(f"--eval-iters={args.eval_iters} must be >= 1")
    if args.eval_only and not (args.load or args.from_hf):
        raise ValueError("--eval-only evaluates a model: give --load DIR (a checkpoint) or --from-hf DIR")
    data.check_source(args)  # --data / --tokenizer: paths, empty text, a loadable tokenizer
    config = model_config(args)
    limit = min(config.max_seq_len, config.sliding_window or config.max_seq_len)
    if args.seq_len > limit:  # (presets grow max_seq_len to --seq-len; a Hugging Face model's is its own)
        raise ValueError(f"--seq-len={args.seq_len} exceeds the model's max_seq_len={config.max_seq_len}"
                         + (f" / sliding_window={config.sliding_window}" if config.sliding_window else ""))
    config.check_tp(args.tp)
    if args.virtual_stages < 1:
        raise ValueError(f"--virtual-stages={args.virtual_stages} must be >= 1")
    micro_batches = args.global_batch_size // (args.dp * args.micro_batch_size)
    try:
        schedules.check_arguments(args.schedule, args.pp, micro_batches, args.virtual_stages)
    except schedules.ScheduleError as e:
        raise ValueError(f"--schedule {args.schedule}: {e} (micro_batches = --global-batch-size / (--dp * "
                         f"--micro-batch-size) = {micro_batches}; virtual_stages = --virtual-stages)") from None
    stage_layers(config.num_layers, args.pp, 0, args.virtual_stages)
    if args.sequence_parallel and args.seq_len % args.tp:
        raise ValueError(f"--seq-len={args.seq_len} is not divisible by --tp={args.tp} (sequence parallelism)")
    if args.cp > 1:
        if config.attention_dropout:
            raise ValueError(f"--attention-dropout={config.attention_dropout} with --cp={args.cp}: attention dropout "
                             "is not supported under context parallelism (pass --attention-dropout 0)")
        try:
            config.check_seq_len(args.seq_len, tp=args.tp, cp=args.cp)
        except ValueError as e:
            raise ValueError(f"--seq-len={args.seq_len} with --cp={args.cp}"
                             + (f" --tp={args.tp} --sequence-parallel" if args.sequence_parallel else "")
                             + f": {e}") from None
    data.check_vocab(args, config.vocab_size)
    path = resume_path(args.load, args.save)  # None: nothing to load (--save and --load the same, still empty)
    if path:
        from . import checkpoint

        meta = checkpoint.read_meta(path)
        checkpoint.check_config(meta["config"], config, path)
        restarted = os.path.realpath(args.save or "") == os.path.realpath(args.load)  # (the loop says it is done)
        if args.steps <= meta["step"] and not args.eval_only and not restarted:
            raise ValueError(f"--steps={args.steps} does not go beyond the checkpoint's step {meta['step']}: "
                             "nothing to train")
    count = data.token_count(args)  # (None: text not yet tokenized; checked after the launcher tokenizes it)
    if count is not None:
        data.check_size(args, count)
    return config


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        validate(args, int(os.environ["WORLD_SIZE"]) if under_torchrun else None)
        if args.print_layout and not under_torchrun:  # this machine, one node: no process needed
            print("\n".join(launch.layout_lines(launch.sizes_of(args), DEFAULT_ORDER,
                                                launch.this_machine(launch.world_of(args)))))
            return 0
        if not under_torchrun:
            data.prepare(args)  # a user's text tokenized once, here, before any rank starts
    except (ValueError, ImportError, OSError) as e:
        if under_torchrun:  # every rank refuses; rank 0 alone says why
            return failures.refuse(str(e))
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not under_torchrun:
        return launch.launch(args, argv)
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    if args.print_layout:
        return launch.print_layout_under_torchrun(args, timeout)
    return failures.run_rank(train, args, launch.log_dir(args), timeout.total_seconds())


def entry():
    """`python -m models.train`: main(), then the process's exit."""
    code = main()
    if "RANK" in os.environ:
        # One of torchrun's ranks, done: exit without tearing the process groups down (a gloo group destroyed from
        # Python joins its worker thread with the GIL held, and that thread may need the GIL: a deadlock at exit).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
