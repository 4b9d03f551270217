"""The job's model on one rank: the GPTConfig a JobConfig describes, this rank's model chunks, and each chunk wrapped
for data parallelism (torch DDP, FSDP2, or tp.optim.DataParallel: zero1 and bf16)."""
import math

import torch
import torch.distributed as dist

import tp
from tp.mesh import Mesh
from tp.pipeline import model_chunks

from ..config import GPTConfig
from ..gpt import GPT
from ..presets import DEFAULT_MODEL, MODELS
from ..stages import build_chunks, tied_embedding
from . import data, resuming
from .config import JobConfig
from .config.model import SHAPE_FIELDS


def gpt_config_from_job(job: JobConfig) -> GPTConfig:
    """The GPTConfig the job describes: a named shape (or a Hugging Face config) with the job's overrides, its
    vocabulary the data's tokenizer's unless --vocab-size says, max_seq_len at least seq_len."""
    model, parallel = job.model, job.parallelism
    overrides = {f: getattr(model, f) for f in SHAPE_FIELDS if getattr(model, f) is not None} | model.moe_fields()
    # torch DDP (or no dp) in fp32: SP grads summed in one all-reduce after the schedule; FSDP2 drops the tags that
    # needs, and tp.optim.DataParallel (zero1, bf16, experts apart) reduces buckets during backward: summed inside
    # backward there.
    attention_dropout = model.dropout if model.attention_dropout is None else model.attention_dropout
    runtime = dict(sequence_parallel=parallel.sequence_parallel, recompute=parallel.recompute, dropout=model.dropout,
                   attention_dropout=attention_dropout, dropout_seed=job.training.seed,
                   sequence_parallel_grad_sync=not uses_torch_ddp(job),
                   cp_mode=parallel.cp_mode, cp_a2a_size=parallel.cp_a2a_size)
    saved = resuming.use_checkpoint_args(job)  # --use-checkpoint-args: the checkpoint's GPTConfig
    if saved is not None:
        dispatcher = {"moe_dispatcher": model.moe_dispatcher} if model.moe_dispatcher else {}
        return resuming.checkpoint_model(saved, runtime | dispatcher, job.training.seq_len)
    if model.from_hf:
        import transformers

        from ..hf import config_from_hf

        return config_from_hf(transformers.AutoConfig.from_pretrained(model.from_hf), **runtime, **overrides)
    fields = MODELS[model.preset or DEFAULT_MODEL] | overrides | runtime
    vocab_size = None if model.vocab_size else data.vocab_size(job)  # (preflight checks the data fit a given one)
    if vocab_size is not None:  # a tokenizer's (or a token file's) vocabulary; GPTConfig pads it for tp
        fields["vocab_size"] = vocab_size
    fields["max_seq_len"] = max(fields.get("max_seq_len", job.training.seq_len), job.training.seq_len)
    return GPTConfig(**fields)


def total_parameters(chunks: list[GPT]) -> int:
    """The whole model's parameters, each weight once and the vocabulary without tp's padding rows, from every rank's
    model chunks (collective over every rank): what the start line reports, the same at any split."""
    from . import checkpoint

    shapes = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, checkpoint.parameter_shapes(chunks))
    return sum(math.prod(shape) for shape in {k: v for rank in shapes for k, v in rank.items()}.values())


def uses_torch_ddp(job: JobConfig) -> bool:
    """Whether dp is torch's DistributedDataParallel (--dp-mode ddp in fp32/tf32, experts not apart); otherwise FSDP2 or
    tp.optim.DataParallel (zero1, bf16, and experts laid out apart from the dense weights: torch DDP reduces every
    parameter over one group)."""
    parallel = job.parallelism
    return parallel.dp_mode == "ddp" and job.training.precision != "bf16" and not parallel.experts_apart


def build_model(job: JobConfig, config: GPTConfig, mesh: Mesh) -> tuple[list[GPT], torch.nn.Module]:
    """(this rank's model chunks, the module the optimizer steps: each chunk wrapped for data parallelism, a
    ModuleList of them when the schedule interleaves). The weights are --seed's (or --from-hf's) for any split."""
    torch.manual_seed(job.training.seed)  # the same on every rank: the weights do not depend on the split
    chunks = build_chunks(config, mesh, job.parallelism.virtual_stages, from_hf=job.model.from_hf)
    # (the model's dropout masks are counter-based, keyed by --seed and each sample's index: models/block.py; the
    # streams seeded here are the default generators' and tp.fork_rng's, for anything else that draws)
    tp.model_parallel_seed(job.training.seed)
    for chunk in chunks:  # (MoE) aux losses per micro-batch, their gradient scaled as the runner scales the loss
        aux_losses_per_micro_batch(chunk, mesh)
        chunk.set_moe_aux_loss_scale(1 / job.micro_batches)
    for chunk in chunks:  # the first stage's embedding, held again: its grad norm counted there
        if tied_embedding(chunk, mesh) is not None and not mesh.is_first_stage:
            tied_embedding(chunk, mesh).shared = True
    if job.training.compile:  # --compile: each block, before data parallelism wraps the chunks (as torchtitan)
        for chunk in chunks:
            chunk.compile_blocks()
    wrapped = [wrap_data_parallel(chunk, mesh, job.parallelism.dp_mode, job.training.precision) for chunk in chunks]
    return chunks, wrapped[0] if len(wrapped) == 1 else torch.nn.ModuleList(wrapped)


def aux_losses_per_micro_batch(stage: torch.nn.Module, mesh: Mesh) -> None:
    """The MoE layers' aux losses, capacity and loads over each data-parallel rank's micro-batch, the tokens of its
    tp·cp ranks (Megatron's default), not over the micro-batches of all dp ranks pooled (tp.moe.MoE's default): at the
    same micro-batch size every split then routes, drops and balances as the one-process run does. Each dp rank's
    aux gradient is then its own micro-batch's, averaged over dp like the LM loss's."""
    for m in stage.modules():
        if isinstance(m, tp.moe.MoE):
            m.token_group = m.router.token_group = mesh.group("tp-cp")
            m.data_parallel_size = 1


def experts_apart(stage: torch.nn.Module, mesh: Mesh) -> bool:
    """Whether `stage` has expert weights whose replicas (the edp group) are not the dense ones' (dp x cp)."""
    return bool(tp.moe.expert_parameters(stage)) and mesh.ranks("edp") != mesh.ranks("dp-cp")


def wrap_data_parallel(stage: GPT, mesh: Mesh, mode: str, precision: str = "fp32") -> torch.nn.Module:
    """DDP on the dp×cp group, or FSDP2 over it (each block, then the stage), or zero1: tp.optim.DataParallel (the
    DistributedOptimizer's buckets). Gradients are summed over cp (each cp rank holds its tokens' share of the
    gradient of the global loss) and averaged over dp: divided by dp, not dp·cp.

    bf16: zero1 and ddp use tp.optim.DataParallel (bf16 parameters, fp32 main_grad buckets and masters; with ddp its
    all-reduce form, Megatron's DDP: torch DDP would reduce the bf16 .grad); fsdp uses FSDP2's own mixed precision
    (its fp32 shards are the masters, gathered in bf16, gradients reduced in fp32).

    Experts laid out apart (ep > 1 or etp != tp): their gradients are summed over the expert-data-parallel group
    (the ranks holding the same experts) and divided by dp too: tp.optim.DataParallel keeps them in buckets of their
    own over edp (also for fp32 ddp, in its all-reduce form), FSDP2 shards each layer's experts over edp."""
    bf16, apart = precision == "bf16", experts_apart(stage, mesh)
    if mode == "zero1" or (mode == "ddp" and (bf16 or apart)) or (bf16 and mesh.size("dp-cp") == 1 and not apart):
        tied = tied_embedding(stage, mesh)
        return tp.optim.DataParallel(stage, group=mesh.group("dp-cp"), average_over=mesh.dp_size,
                                     shard=mode == "zero1", param_dtype=torch.bfloat16 if bf16 else None,
                                     expert_group=mesh.edp_group if apart else None,
                                     tied=[(tied, mesh.embedding_group)] if tied is not None else ())
    if mode == "fsdp" and (mesh.size("dp-cp") > 1 or apart):
        return _fully_shard(stage, mesh, bf16)
    if mesh.size("dp-cp") == 1:
        return stage
    from torch.nn.parallel import DistributedDataParallel

    module = DistributedDataParallel(stage, process_group=mesh.group("dp-cp"))
    if mesh.cp_size > 1:
        module.register_comm_hook(mesh.group("dp-cp"), _sum_then_divide_by(mesh.dp_size))
    return module


def _fully_shard(stage, mesh, bf16):
    """FSDP2 over the dp (×cp) mesh dimension: each block, then the stage."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp_mesh = mesh.device_mesh["dp"] if mesh.cp_size == 1 else mesh.flat_device_mesh("dp-cp")
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
    # (the stage's output, the activation the next stage receives, leaves in fp32: the pipeline's buffers)
    outer = MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32) if bf16 else policy
    experts = []
    with tp.optim.keep_param_tags(stage):  # fully_shard drops the attributes clip_grad_norm_ reads
        for block in stage.layers:
            if experts_apart(block, mesh):  # the experts over edp first (torchtitan's way)
                experts.append(fully_shard(block.mlp.experts, mesh=mesh.flat_device_mesh("edp"), mp_policy=policy))
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        module = fully_shard(stage, mesh=dp_mesh, mp_policy=outer)
    for m in experts:  # summed over edp, divided by dp (gloo has no PREMUL_SUM: a sum, then the division)
        m.set_gradient_divide_factor(float(mesh.dp_size))
        # (FSDP2 copies a one-rank group's gradient divided by the factor, and divides again after a forced sum)
        m.set_force_sum_reduction_for_comms(mesh.edp_size > 1)
    if mesh.cp_size > 1:
        for m in module.modules():
            if hasattr(m, "set_gradient_divide_factor") and m not in experts:  # summed over cp, divided by dp
                m.set_gradient_divide_factor(float(mesh.dp_size))
                m.set_force_sum_reduction_for_comms(True)
    return module


def _sum_then_divide_by(divisor):
    """A DDP communication hook: the bucket divided by `divisor` and summed over the group (DDP's default divides by
    the group's size)."""
    def hook(group, bucket):
        tensor = bucket.buffer().div_(divisor)
        return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])
    return hook


def data_parallel_chunks(module: torch.nn.Module) -> list[tp.optim.DataParallel]:
    """The tp.optim.DataParallel modules among this rank's wrapped stage or model chunks (zero1, bf16), else []."""
    return [chunk for chunk in model_chunks(module) if isinstance(chunk, tp.optim.DataParallel)]
