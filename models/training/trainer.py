"""The training loop run on every rank: the mesh, the GPT stage under DDP or FSDP2, the pipeline schedule, AdamW with
warm-up and cosine decay, logging, checkpoints. `models/training/cli.py` is its command line."""
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import tp
from tp.pipeline import PipelineRunner, model_chunks

from ..config import PRESETS, RUNTIME_FIELDS, GPTConfig
from ..flops import flops_per_token
from ..gpt import GPT
from ..stages import allreduce_tied_embedding_grads, stage_options, tied_embedding
from . import checkpoint_dirs, data, failures, launch, progress
from .checkpoint_dirs import resume_path

SIZE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size")


def model_config(args):
    """The GPTConfig the flags describe (a preset, or a Hugging Face config, with the overrides)."""
    overrides = {f: getattr(args, f) for f in SIZE_FIELDS if getattr(args, f) is not None}
    # torch DDP (or no dp) in fp32: SP grads summed in one all-reduce after the schedule; FSDP2 drops the tags that
    # needs, and tp.optim.DataParallel (zero1, bf16) reduces buckets during backward: summed inside backward there.
    attention_dropout = args.dropout if args.attention_dropout is None else args.attention_dropout
    flags = dict(sequence_parallel=args.sequence_parallel, recompute=args.recompute, dropout=args.dropout,
                 attention_dropout=attention_dropout,
                 sequence_parallel_grad_sync=args.dp_mode != "ddp" or args.precision != "fp32",
                 cp_mode=args.cp_mode)
    if args.from_hf:
        import transformers

        from ..hf import config_from_hf

        return config_from_hf(transformers.AutoConfig.from_pretrained(args.from_hf), **flags)
    fields = PRESETS[args.model or "tiny"] | overrides | flags
    if data.vocab_size(args) is not None:  # a tokenizer's (or a token file's) vocabulary; GPTConfig pads it for tp
        fields["vocab_size"] = data.vocab_size(args)
    fields.setdefault("max_seq_len", args.seq_len)
    fields["max_seq_len"] = max(fields["max_seq_len"], args.seq_len)
    return GPTConfig(**fields)


def wrap_data_parallel(stage, mesh, mode, precision="fp32"):
    """DDP on the dp×cp group, or FSDP2 over it (each block, then the stage), or zero1: tp.optim.DataParallel (the
    DistributedOptimizer's buckets). Gradients are summed over cp (each cp rank holds its tokens' share of the
    gradient of the global loss) and averaged over dp: divided by dp, not dp·cp.

    bf16: zero1 and ddp use tp.optim.DataParallel (bf16 parameters, fp32 main_grad buckets and masters; with ddp its
    all-reduce form, Megatron's DDP: torch DDP would reduce the bf16 .grad); fsdp uses FSDP2's own mixed precision
    (its fp32 shards are the masters, gathered in bf16, gradients reduced in fp32)."""
    bf16 = precision == "bf16"
    if mode == "zero1" or (bf16 and (mode == "ddp" or mesh.size("dp-cp") == 1)):
        tied = tied_embedding(stage, mesh)
        return tp.optim.DataParallel(stage, group=mesh.group("dp-cp"), average_over=mesh.dp_size,
                                     shard=mode == "zero1", param_dtype=torch.bfloat16 if bf16 else None,
                                     tied=[(tied, mesh.embedding_group)] if tied is not None else ())
    if mesh.size("dp-cp") == 1:
        return stage
    if mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dp_mesh = mesh.device_mesh["dp"] if mesh.cp_size == 1 else mesh.flat_device_mesh("dp-cp")
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
        # (the stage's output, the activation the next stage receives, leaves in fp32: the pipeline's buffers)
        outer = MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32) if bf16 else policy
        with tp.optim.keep_param_tags(stage):  # fully_shard drops the attributes clip_grad_norm_ reads
            for block in stage.layers:
                fully_shard(block, mesh=dp_mesh, mp_policy=policy)
            module = fully_shard(stage, mesh=dp_mesh, mp_policy=outer)
        if mesh.cp_size > 1:
            for m in module.modules():
                if hasattr(m, "set_gradient_divide_factor"):  # summed, then divided (gloo has no PREMUL_SUM)
                    m.set_gradient_divide_factor(float(mesh.dp_size))
                    m.set_force_sum_reduction_for_comms(True)
        return module
    from torch.nn.parallel import DistributedDataParallel

    module = DistributedDataParallel(stage, process_group=mesh.group("dp-cp"))
    if mesh.cp_size > 1:
        module.register_comm_hook(mesh.group("dp-cp"), _sum_then_divide_by(mesh.dp_size))
    return module


def _sum_then_divide_by(divisor):
    """A DDP communication hook: the bucket divided by `divisor` and summed over the group (DDP's default divides by
    the group's size)."""
    def hook(group, bucket):
        tensor = bucket.buffer().div_(divisor)
        return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])
    return hook


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
    mesh = tp.init_mesh(tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp, backend=backend,
                        timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    launch.announce_layout(mesh)  # rank 0 prints which ranks sit on which node, and their coordinates
    if backend == "nccl":
        torch.set_default_device(f"cuda:{torch.cuda.current_device()}")
    config = model_config(args)
    rank0 = dist.get_rank() == 0
    torch.manual_seed(args.seed)  # the same on every rank: the weights do not depend on the split
    rng, chunks = torch.get_rng_state(), []
    for chunk in range(args.virtual_stages):  # this rank's model chunks (one, unless the schedule interleaves)
        torch.set_rng_state(rng)  # each chunk draws the model's one seed, as the whole model does
        options = stage_options(config, mesh, chunk, args.virtual_stages)
        if args.from_hf:
            chunks.append(GPT.from_hf(args.from_hf, group=mesh.tp_group, stage=options,
                                      **{f: getattr(config, f) for f in RUNTIME_FIELDS}))
        else:
            chunks.append(GPT(config, group=mesh.tp_group, **options))
    stage = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
    tp.model_parallel_seed(args.seed)  # dropout streams (per pipeline stage and tp rank)
    for chunk in chunks:  # the first stage's embedding, held again: its grad norm counted there
        if tied_embedding(chunk, mesh) is not None and not mesh.is_first_stage:
            tied_embedding(chunk, mesh).shared = True
    module = wrap_data_parallel(stage, mesh, args.dp_mode, args.precision) if len(chunks) == 1 else \
        torch.nn.ModuleList([wrap_data_parallel(chunk, mesh, args.dp_mode, args.precision) for chunk in chunks])
    # No weight decay on 1-D parameters (norms, biases), as Megatron does.
    groups = [{"params": [p for p in module.parameters() if p.dim() > 1]},
              {"params": [p for p in module.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
    hyperparameters = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    buffered = data_parallel_chunks(module)  # zero1 / bf16: tp.optim.DataParallel, one per model chunk
    if buffered:  # one AdamW over this rank's shards of every chunk's fp32 masters
        optimizer = tp.optim.DistributedOptimizer(module, groups, **hyperparameters)
        for chunk in buffered:  # a bucket reduces once its gradients have arrived from every micro-batch, any schedule
            chunk.set_micro_batches(args.global_batch_size // (mesh.dp_size * args.micro_batch_size))
    else:
        optimizer = torch.optim.AdamW(groups, **hyperparameters)
    start_step = 0
    resume = resume_path(args.load, args.save)  # None: a fresh start (--save and --load the same, still empty)
    if resume:
        from . import checkpoint

        start_step, extra = checkpoint.load(resume, module, optimizer, mesh=mesh)
        if rank0:
            print(f"resuming from {resume} (step {start_step})", flush=True)
        changed = [f"--{k.replace('_', '-')}={v}" for k, v in (extra or {}).items()
                   if k in _DATA_ORDER and getattr(args, k) != v]
        if changed and dist.get_rank() == 0:
            print(f"note: the checkpoint's run had {', '.join(changed)}: the data order from here differs from that "
                  "run's", file=sys.stderr, flush=True)
    runner = PipelineRunner(module, mesh, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len)
    tokens = data.shared_tokens(args)  # rank 0 tokenizes a user's text if the launcher has not (own torchrun)
    data.check_size(args, len(tokens))
    dataset, held_out = data.split(tokens, args.seq_len)  # the last ~1% of the windows: validation only
    stream = data.batches(dataset, dp=mesh.dp_size, dp_rank=mesh.dp_rank, global_batch_size=args.global_batch_size,
                          micro_batch_size=args.micro_batch_size, seed=args.seed, start_step=start_step)
    params = sum(p.numel() for p in stage.parameters())
    if rank0:
        print(f"{mesh.world_size} ranks: tp={mesh.tp_size} cp={mesh.cp_size} pp={mesh.pp_size} dp={mesh.dp_size} "
              f"({args.dp_mode}, {args.precision}), "
              f"schedule={args.schedule}, "
              f"micro-batches/step={args.global_batch_size // (mesh.dp_size * args.micro_batch_size)}, "
              f"sequence_parallel={args.sequence_parallel}; model {args.from_hf or args.model or 'tiny'}"
              f" ({config.num_layers} layers, hidden {config.hidden_size}, {params:,} params on rank 0)", flush=True)
    if args.eval_only:
        val_loss = evaluate(runner, held_out, args, mesh)
        if rank0:
            print(f"val_loss {val_loss:.4f} at step {start_step} ({args.eval_iters} batches of "
                  f"{args.global_batch_size} held-out sequences)", flush=True)
            if args.log_jsonl:
                with open(args.log_jsonl, "a") as f:
                    f.write(json.dumps({"step": start_step, "val_loss": val_loss}) + "\n")
        tp.destroy_mesh(keep_groups=True)
        return 0
    if start_step >= args.steps:
        if rank0:
            print(f"nothing to train: the checkpoint is at step {start_step}, --steps={args.steps}", flush=True)
        tp.destroy_mesh(keep_groups=True)
        return 0
    log = progress.open_log(args.log_jsonl, start_step) if rank0 and args.log_jsonl else None
    bar = progress.progress(rank0, start_step, args.steps, interval=args.log_interval)
    tokens_per_step = args.global_batch_size * args.seq_len
    step_flops = flops_per_token(config, args.seq_len) * tokens_per_step  # model FLOPs (REFERENCE §12)
    first_loss = loss = val_loss = grad_norm = None
    try:
        for step in range(start_step, args.steps):
            started = time.perf_counter()
            micro_batches = next(stream)
            if args.check_inputs:
                for tokens, targets in micro_batches:
                    tp.debug.check(torch.stack([tokens, targets]), mesh.group("tp-cp"), "the training tokens",
                                   replicated=True, group_name="tp-cp")
            if args.fail_at_step == step + 1 and dist.get_rank() == args.fail_rank:
                raise RuntimeError(f"injected failure at step {step + 1} on rank {args.fail_rank}")
            failures.note_step(step + 1)
            if args.hang_at_step == step + 1 and dist.get_rank() == args.fail_rank:
                time.sleep(1e9)  # a hung rank (for the tests): the others time out in their next collective
            set_hyperparameters(optimizer, args, step)
            stats = runner.run(micro_batches, args.schedule)
            if not config.sequence_parallel_grad_sync:
                tp.allreduce_sequence_parallel_grads(stage, mesh.tp_group)  # one all-reduce for every SP param
            if not buffered:  # (tp.optim.DataParallel sums the tied copies itself)
                allreduce_tied_embedding_grads(stage, mesh)
            if args.nan_grad_at_step == step + 1 and dist.get_rank() == args.fail_rank:
                _inject_nan_grad(module)
            # the global norm over tp, pp and dp (each parameter once); clipped when --clip-grad > 0
            grad_norm = tp.clip_grad_norm_(module.parameters(), args.clip_grad, mesh=mesh).item()
            if math.isfinite(grad_norm):
                optimizer.step()
            elif rank0:  # Megatron's behaviour: no update from a non-finite gradient, the model stays as it was
                print(f"skipped step {step + 1}: grad norm {grad_norm}", file=sys.stderr, flush=True)
            memory = max_memory_bytes(module, optimizer) if step == start_step else {}  # grads and state exist now
            optimizer.zero_grad(set_to_none=True)
            loss = _mean_over(stats.loss, mesh.dp_group)
            bubble = stats.bubble
            elapsed = time.perf_counter() - started
            first_loss = loss if first_loss is None else first_loss
            skipped = not math.isfinite(grad_norm)
            record = {"step": step + 1, "loss": loss, "grad_norm": None if skipped else grad_norm,  # JSON: no NaN
                      "lr": learning_rate(args, step), "tokens_per_s": tokens_per_step / elapsed,
                      "tflops_per_rank": step_flops / mesh.world_size / elapsed / 1e12,
                      "bubble": bubble if mesh.pp_size > 1 else None, "step_s": elapsed} | memory
            if skipped:
                record["skipped"] = True
            if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
                record["val_loss"] = val_loss = evaluate(runner, held_out, args, mesh)
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", **({} if grad_norm is None else {"grad_norm": f"{grad_norm:.3f}"}),
                            tok_s=f"{record['tokens_per_s']:.0f}",
                            **({"bubble": f"{bubble:.2f}"} if mesh.pp_size > 1 else {}))  # no pipeline: no bubble
            if args.save and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                _save(args.save, module, optimizer, mesh, step + 1, args)
        if args.save:
            _save(args.save, module, optimizer, mesh, args.steps, args)
        if args.export_hf:
            from ..hf import save_hf

            for chunk in buffered:  # zero1: the last step's all-gathers
                chunk.finish_param_sync()
            save_hf(chunks, args.export_hf, group=mesh.tp_group, pp_group=mesh.pp_group if mesh.pp_size > 1 else None,
                    dp_group=mesh.group("dp-cp"))  # (a rank's model chunks: one file per virtual stage)
    finally:
        bar.close()
        if log:
            log.close()
    if rank0:
        ran = f"{args.steps - start_step} steps ({start_step + 1}..{args.steps})"
        print(f"done: {ran} at tp={mesh.tp_size} cp={mesh.cp_size} pp={mesh.pp_size} dp={mesh.dp_size}; "
              f"loss {first_loss:.4f} -> {loss:.4f}" + (f", val_loss {val_loss:.4f}" if val_loss is not None else "")
              + (f"; log: {args.log_jsonl}" if args.log_jsonl else "")
              + (f"; checkpoint: {args.save}" if args.save else "")
              + (f"; Hugging Face export: {args.export_hf}" if args.export_hf else ""), flush=True)
    # The groups are kept (a next mesh of the same layout reuses them): destroyed here, the last reference would be
    # DDP's reducer's, dropped with the GIL held as this frame ends, and gloo's destructor joins a worker thread that
    # may need the GIL to free its last work's tensors: a deadlock at exit, seen under load.
    tp.destroy_mesh(keep_groups=True)
    return 0


def evaluate(runner, held_out, args, mesh):
    """val_loss: the mean loss over --eval-iters global batches of the held-out windows, forward only; the same
    batches, and so the same value, for any split."""
    batches = data.eval_batches(held_out, dp=mesh.dp_size, dp_rank=mesh.dp_rank,
                                global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                                iters=args.eval_iters)
    return _mean_over(runner.forward_only([micro for batch in batches for micro in batch]), mesh.dp_group)


def max_memory_bytes(module, optimizer):
    """tp.optim.memory_bytes (this rank's param_bytes, grad_bytes, optimizer_bytes), each the largest over all ranks
    (one all-reduce)."""
    from tp.optim import memory_bytes

    sizes = memory_bytes(module, optimizer)
    totals = torch.tensor(list(sizes.values()), dtype=torch.int64)
    dist.all_reduce(totals, op=dist.ReduceOp.MAX)
    return dict(zip(sizes, totals.tolist()))


def data_parallel_chunks(module):
    """The tp.optim.DataParallel modules among this rank's wrapped stage or model chunks (zero1, bf16), else []."""
    return [chunk for chunk in model_chunks(module) if isinstance(chunk, tp.optim.DataParallel)]


def _inject_nan_grad(module):
    """(tests) a NaN in this rank's part of a reduced gradient, as an overflow would leave it."""
    for chunk in data_parallel_chunks(module):
        chunk.finish_grad_sync()
    grad = next(g for p in module.parameters() if (g := tp.optim.reduced_grad(p)[0]) is not None and g.numel())
    grad.view(-1)[0] = math.nan


def _mean_over(value, group):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


_DATA_ORDER = ("global_batch_size", "seed", "seq_len")  # the data stream's position depends on them


def _save(root, module, optimizer, mesh, step, args):
    """Write ROOT/step-N, then point ROOT/latest at it (checkpoint_dirs.py): a kill mid-save never spoils the
    previous checkpoint, and what it half wrote is removed here, at the next save."""
    from . import checkpoint

    name = checkpoint_dirs.step_name(step)
    if dist.get_rank() == 0:
        removed = checkpoint_dirs.remove_unfinished(root, step)
        if removed:
            print(f"removed unfinished checkpoint{'s' * (len(removed) > 1)} {', '.join(removed)} in {root}",
                  file=sys.stderr, flush=True)
    dist.barrier()
    checkpoint.save(os.path.join(root, name), module, optimizer, mesh=mesh, step=step,
                    extra={k: getattr(args, k) for k in _DATA_ORDER})
    if args.slow_save_at_step == step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        time.sleep(60)  # (tests) the step directory is written, `latest` not yet moved: a kill lands mid-save
    dist.barrier()
    if dist.get_rank() == 0:
        checkpoint_dirs.commit(root, name)
    dist.barrier()
