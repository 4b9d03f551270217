"""The 3D-parallel training job: a GPT trained with tensor x pipeline x data parallelism.

    python -m models.train                                   # 8 CPU processes: tp=2 x pp=2 x dp=2, gloo
    python -m models.train --tp 4 --pp 1 --dp 2 --sequence-parallel --dp-mode fsdp
    torchrun --nproc-per-node 8 -m models.train --tp 2 --pp 2 --dp 2     # under torchrun: its environment (NCCL)

Not under torchrun, the whole configuration is validated in this process first (one line and exit 2 on error),
then tp*pp*dp processes are started through torchrun's launcher on this machine; a rank that fails stops the others
and is named. The data are byte tokens of Python's standard-library sources (models/data.py): no downloads.
"""
import argparse
import json
import math
import os
import re
import sys
import time

import torch
import torch.distributed as dist

import tp

from . import data
from .config import PRESETS, RUNTIME_FIELDS, GPTConfig
from .gpt import GPT
from .pipeline import PipelineRunner, allreduce_tied_embedding_grads, stage_layers, stage_options

SIZE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, the description's example commands kept as written."""


def parser():
    p = argparse.ArgumentParser(prog="python -m models.train", description=__doc__,
                                formatter_class=lambda prog: _HelpFormatter(prog, width=110))
    a = p.add_argument
    a("--tp", type=int, default=2, help="tensor-parallel size")
    a("--pp", type=int, default=2, help="pipeline-parallel size (stages)")
    a("--dp", type=int, default=2, help="data-parallel size")
    a("--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="pipeline schedule")
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
    a("--dp-mode", choices=("ddp", "fsdp"), default="ddp",
      help="data parallelism: torch DDP on the dp group, or FSDP2 (fully_shard) on the dp mesh dim")
    a("--model", choices=sorted(PRESETS), default=None, help="model size, default tiny (the overrides below win)")
    for field in SIZE_FIELDS:
        a(f"--{field.replace('_', '-')}", type=int, default=None, help=f"override the preset's {field}")
    a("--dropout", type=float, default=0.0, help="residual and attention dropout")
    a("--from-hf", metavar="PATH", default=None,
      help="start from a Hugging Face Llama/Mistral/Qwen2/GPT-2 directory (save_pretrained); its vocabulary "
           "must cover bytes (>= 256)")
    a("--save", metavar="DIR", default=None, help="write resharding checkpoints DIR/step-N (at the end, and every "
                                                   "--save-every steps); DIR/latest names the newest")
    a("--save-every", type=int, default=0, metavar="N", help="checkpoint every N steps (0: only at the end)")
    a("--load", metavar="DIR", default=None,
      help="resume from the newest checkpoint in DIR (or the step directory DIR), written at any tp/pp/dp split")
    a("--export-hf", metavar="DIR", default=None, help="write the trained model in Hugging Face format at the end")
    a("--log-jsonl", metavar="PATH", default=None, help="one JSON object per step: step, loss, tokens_per_s, ...")
    a("--check-inputs", action="store_true",
      help="assert every step that all tp ranks of a group read the same tokens (a checksum all-gather)")
    a("--fail-at-step", type=int, default=None, help=argparse.SUPPRESS)  # fault injection for the tests
    a("--fail-rank", type=int, default=0, help=argparse.SUPPRESS)
    return p


def model_config(args):
    """The GPTConfig the flags describe (a preset, or a Hugging Face config, with the overrides)."""
    overrides = {f: getattr(args, f) for f in SIZE_FIELDS if getattr(args, f) is not None}
    # DDP (or no dp): SP grads summed in one all-reduce after the schedule; FSDP2 drops the tags that needs.
    flags = dict(sequence_parallel=args.sequence_parallel, recompute=args.recompute, dropout=args.dropout,
                 attention_dropout=args.dropout, sequence_parallel_grad_sync=args.dp_mode == "fsdp")
    if args.from_hf:
        import transformers

        from .hf import config_from_hf

        return config_from_hf(transformers.AutoConfig.from_pretrained(args.from_hf), **flags)
    fields = PRESETS[args.model or "tiny"] | overrides | flags
    fields.setdefault("max_seq_len", args.seq_len)
    fields["max_seq_len"] = max(fields["max_seq_len"], args.seq_len)
    return GPTConfig(**fields)


def validate(args, world_size=None):
    """Every check that needs no process: raises ValueError with one line naming the bad value."""
    for name in ("tp", "pp", "dp", "global_batch_size", "micro_batch_size", "seq_len", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    world = args.tp * args.pp * args.dp
    if world_size is not None and world_size != world:
        raise ValueError(f"WORLD_SIZE={world_size} but --tp*--pp*--dp = {args.tp}*{args.pp}*{args.dp} = {world}")
    if args.global_batch_size % (args.dp * args.micro_batch_size):
        raise ValueError(f"--global-batch-size={args.global_batch_size} is not divisible by --dp * "
                         f"--micro-batch-size = {args.dp}*{args.micro_batch_size}")
    for name in ("lr", "weight_decay"):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0 or (name == "lr" and value == 0):
            raise ValueError(f"--{name.replace('_', '-')}={value} must be a finite number "
                             f"{'> 0' if name == 'lr' else '>= 0'}")
    for name in ("warmup_steps", "save_every"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 0")
    for name in ("save", "export_hf"):
        path = getattr(args, name)
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"--{name.replace('_', '-')} {path} exists and is not a directory")
    if args.from_hf:
        if not os.path.isdir(args.from_hf):
            raise ValueError(f"--from-hf {args.from_hf}: no such directory (a save_pretrained directory)")
        shape_flags = [f"--{f.replace('_', '-')}" for f in ("model", *SIZE_FIELDS) if getattr(args, f) is not None]
        if shape_flags:
            raise ValueError(f"--from-hf takes the model's shape from its config: drop {' '.join(shape_flags)}")
    config = model_config(args)
    limit = min(config.max_seq_len, config.sliding_window or config.max_seq_len)
    if args.seq_len > limit:  # (presets grow max_seq_len to --seq-len; a Hugging Face model's is its own)
        raise ValueError(f"--seq-len={args.seq_len} exceeds the model's max_seq_len={config.max_seq_len}"
                         + (f" / sliding_window={config.sliding_window}" if config.sliding_window else ""))
    config.check_tp(args.tp)
    stage_layers(config.num_layers, args.pp, 0)
    if args.sequence_parallel and args.seq_len % args.tp:
        raise ValueError(f"--seq-len={args.seq_len} is not divisible by --tp={args.tp} (sequence parallelism)")
    if config.vocab_size < data.VOCAB_SIZE:
        raise ValueError(f"vocab_size={config.vocab_size} cannot hold the {data.VOCAB_SIZE} byte tokens")
    if args.load:
        from . import checkpoint

        if not os.path.isdir(args.load):
            raise ValueError(f"--load {args.load}: no such directory")
        path = _latest(args.load)
        meta = checkpoint.read_meta(path)
        checkpoint.check_config(meta["config"], config, path)
        if args.steps <= meta["step"]:
            raise ValueError(f"--steps={args.steps} does not go beyond the checkpoint's step {meta['step']}: "
                             "nothing to train")
    sequences = (len(data.corpus()) - 1) // args.seq_len
    if args.global_batch_size > sequences:
        raise ValueError(f"--global-batch-size={args.global_batch_size} exceeds the {sequences} sequences of "
                         f"--seq-len={args.seq_len} in the corpus")
    return config


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        validate(args, int(os.environ["WORLD_SIZE"]) if under_torchrun else None)
    except (ValueError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if under_torchrun:
        try:
            return _record(train)(args)
        finally:  # tp.destroy_mesh keeps torchrun's default group (for a next mesh); the job is over
            if dist.is_initialized():
                dist.destroy_process_group()
    return launch(args, argv)


def _record(fn):
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


def launch(args, argv):
    """Start tp*pp*dp CPU processes on this machine through torchrun's launcher; name the rank that failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    world = args.tp * args.pp * args.dp
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launcher = get_args_parser().parse_args([f"--nproc-per-node={world}", "--standalone", "--max-restarts=0",
                                             "-m", "models.train", *argv])
    try:
        run(launcher)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()  # the others were stopped because of it
        message = failure.message
        while isinstance(message, dict):  # the worker's error file: {"message": "...", "extraInfo": {...}}
            message = message.get("message", "")
        lines = str(message).strip().splitlines()
        # the exception's line, not torchelastic's trailer ("To enable traceback see: ...") when it adds one
        errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b.*:", line)]
        last = (errors or lines or ["see its output above"])[-1]
        print(f"error: rank {rank} of {world} failed (exit code {failure.exitcode}): {last}", file=sys.stderr)
        return 1
    return 0


def wrap_data_parallel(stage, mesh, mode):
    """DDP on the dp group, or FSDP2 over the dp mesh dim (each block, then the stage)."""
    if mesh.dp_size == 1:
        return stage
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        dp_mesh = mesh.device_mesh["dp"]
        for block in stage.layers:
            fully_shard(block, mesh=dp_mesh)
        return fully_shard(stage, mesh=dp_mesh)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(stage, process_group=mesh.dp_group)


def set_hyperparameters(optimizer, args, step):
    """This step's learning rate, and the flags' weight decay (group 0; group 1 holds the 1-D parameters, never
    decayed): the flags win over what a loaded checkpoint's param_groups carried."""
    for group, weight_decay in zip(optimizer.param_groups, (args.weight_decay, 0.0)):
        group["lr"], group["weight_decay"] = learning_rate(args, step), weight_decay


def learning_rate(args, step):
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train(args):
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    mesh = tp.init_mesh(tp=args.tp, pp=args.pp, dp=args.dp, backend=backend)
    if backend == "nccl":
        torch.set_default_device(f"cuda:{torch.cuda.current_device()}")
    config = model_config(args)
    rank0 = dist.get_rank() == 0
    torch.manual_seed(args.seed)  # the same on every rank: the weights do not depend on the split
    if args.from_hf:
        stage = GPT.from_hf(args.from_hf, group=mesh.tp_group, stage=stage_options(config, mesh),
                            **{f: getattr(config, f) for f in RUNTIME_FIELDS})
    else:
        stage = GPT(config, group=mesh.tp_group, **stage_options(config, mesh))
    tp.model_parallel_seed(args.seed)  # dropout streams (per pipeline stage and tp rank)
    module = wrap_data_parallel(stage, mesh, args.dp_mode)
    # No weight decay on 1-D parameters (norms, biases), as Megatron does.
    decay = [p for p in module.parameters() if p.dim() > 1]
    no_decay = [p for p in module.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr,
                                  betas=(0.9, 0.95), weight_decay=args.weight_decay)
    start_step = 0
    if args.load:
        from . import checkpoint

        start_step, extra = checkpoint.load(_latest(args.load), module, optimizer, mesh=mesh)
        changed = [f"--{k.replace('_', '-')}={v}" for k, v in (extra or {}).items()
                   if k in _DATA_ORDER and getattr(args, k) != v]
        if changed and dist.get_rank() == 0:
            print(f"note: the checkpoint's run had {', '.join(changed)}: the data order from here differs from that "
                  "run's", file=sys.stderr, flush=True)
    runner = PipelineRunner(module, mesh, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len)
    dataset = data.TokenWindows(data.corpus(), args.seq_len)
    stream = data.batches(dataset, dp=mesh.dp_size, dp_rank=mesh.dp_rank, global_batch_size=args.global_batch_size,
                          micro_batch_size=args.micro_batch_size, seed=args.seed, start_step=start_step)
    params = sum(p.numel() for p in stage.parameters())
    if rank0:
        print(f"{mesh.world_size} ranks: tp={mesh.tp_size} pp={mesh.pp_size} dp={mesh.dp_size} ({args.dp_mode}), "
              f"schedule={args.schedule}, micro-batches/step={args.global_batch_size // (mesh.dp_size * args.micro_batch_size)}, "
              f"sequence_parallel={args.sequence_parallel}; model {args.from_hf or args.model or 'tiny'}"
              f" ({config.num_layers} layers, hidden {config.hidden_size}, {params:,} params on rank 0)", flush=True)
    if start_step >= args.steps:
        if rank0:
            print(f"nothing to train: the checkpoint is at step {start_step}, --steps={args.steps}", flush=True)
        tp.destroy_mesh()
        return 0
    log = open(args.log_jsonl, "a" if args.load else "w") if rank0 and args.log_jsonl else None
    bar = _progress(rank0, start_step, args.steps)
    tokens_per_step = args.global_batch_size * args.seq_len
    first_loss = loss = None
    try:
        for step in range(start_step, args.steps):
            started = time.perf_counter()
            micro_batches = next(stream)
            if args.check_inputs:
                for tokens, targets in micro_batches:
                    tp.debug.check(torch.stack([tokens, targets]), mesh.tp_group, "the training tokens",
                                   replicated=True)
            if args.fail_at_step == step + 1 and dist.get_rank() == args.fail_rank:
                raise RuntimeError(f"injected failure at step {step + 1} on rank {args.fail_rank}")
            set_hyperparameters(optimizer, args, step)
            stats = runner.run(micro_batches, args.schedule)
            if not config.sequence_parallel_grad_sync:
                tp.allreduce_sequence_parallel_grads(stage, mesh.tp_group)  # one all-reduce for every SP param
            allreduce_tied_embedding_grads(stage, mesh)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = _mean_over(stats.loss, mesh.dp_group)
            bubble = stats.bubble
            elapsed = time.perf_counter() - started
            first_loss = loss if first_loss is None else first_loss
            record = {"step": step + 1, "loss": loss, "tokens_per_s": tokens_per_step / elapsed,
                      "lr": learning_rate(args, step), "bubble": bubble, "step_s": elapsed}
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", bubble=f"{bubble:.2f}")
            if args.save and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                _save(args.save, module, optimizer, mesh, step + 1, args)
        if args.save:
            _save(args.save, module, optimizer, mesh, args.steps, args)
        if args.export_hf:
            stage.save_hf(args.export_hf, pp_group=mesh.pp_group if mesh.pp_size > 1 else None,
                          dp_group=mesh.dp_group)
    finally:
        bar.close()
        if log:
            log.close()
    if rank0:
        ran = f"{args.steps - start_step} steps ({start_step + 1}..{args.steps})"
        print(f"done: {ran} at tp={mesh.tp_size} pp={mesh.pp_size} dp={mesh.dp_size}; loss {first_loss:.4f} -> "
              f"{loss:.4f}" + (f"; log: {args.log_jsonl}" if args.log_jsonl else "")
              + (f"; checkpoint: {args.save}" if args.save else "")
              + (f"; Hugging Face export: {args.export_hf}" if args.export_hf else ""), flush=True)
    tp.destroy_mesh()
    return 0


def _mean_over(value, group):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def _progress(show, start, total):
    if not show:
        return _Quiet()
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout)


class _Quiet:
    def update(self, n):
        pass

    def set_postfix(self, **kw):
        pass

    def close(self):
        pass


_DATA_ORDER = ("global_batch_size", "seed", "seq_len")  # the data stream's position depends on them


def _save(root, module, optimizer, mesh, step, args):
    """Write ROOT/step-N, then point ROOT/latest at it: a crash mid-save never spoils the previous checkpoint."""
    from . import checkpoint

    name = f"step-{step:06d}"
    checkpoint.save(os.path.join(root, name), module, optimizer, mesh=mesh, step=step,
                    extra={k: getattr(args, k) for k in _DATA_ORDER})
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(name)
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    dist.barrier()


def _saved_step(path):
    """The step of a checkpoint directory named step-N (as --save writes them), else None."""
    name = os.path.basename(os.path.normpath(path))
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def _latest(root):
    """The checkpoint --load reads: ROOT/latest's step directory, else ROOT's newest step-N, else ROOT itself."""
    latest = os.path.join(root, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            return os.path.join(root, f.read().strip())
    steps = [name for name in os.listdir(root) if _saved_step(name) is not None
             and os.path.isdir(os.path.join(root, name))]
    return os.path.join(root, max(steps, key=_saved_step)) if steps else root


if __name__ == "__main__":
    sys.exit(main())
