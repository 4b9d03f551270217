"""The job's model on one rank: the GPTConfig a JobConfig describes, this rank's model chunks, and each chunk wrapped
for data parallelism (torch DDP, FSDP2, or tp.optim.DataParallel: zero1 and bf16)."""
import torch
import torch.distributed as dist

import tp
from tp.mesh import Mesh
from tp.pipeline import model_chunks

from ..config import PRESETS, GPTConfig
from ..gpt import GPT
from ..stages import build_chunks, tied_embedding
from . import data
from .config import SIZE_FIELDS, JobConfig


def gpt_config_from_job(job: JobConfig) -> GPTConfig:
    """The GPTConfig the job describes: a preset (or a Hugging Face config) with the job's overrides, its vocabulary
    following the data's tokenizer, max_seq_len at least seq_len."""
    model, parallel = job.model, job.parallelism
    overrides = {f: getattr(model, f) for f in SIZE_FIELDS if getattr(model, f) is not None}
    # torch DDP (or no dp) in fp32: SP grads summed in one all-reduce after the schedule; FSDP2 drops the tags that
    # needs, and tp.optim.DataParallel (zero1, bf16) reduces buckets during backward: summed inside backward there.
    attention_dropout = model.dropout if model.attention_dropout is None else model.attention_dropout
    runtime = dict(sequence_parallel=parallel.sequence_parallel, recompute=parallel.recompute, dropout=model.dropout,
                   attention_dropout=attention_dropout,
                   sequence_parallel_grad_sync=parallel.dp_mode != "ddp" or job.training.precision == "bf16",
                   cp_mode=parallel.cp_mode, cp_a2a_size=parallel.cp_a2a_size)
    if model.from_hf:
        import transformers

        from ..hf import config_from_hf

        return config_from_hf(transformers.AutoConfig.from_pretrained(model.from_hf), **runtime)
    fields = PRESETS[model.preset or "tiny"] | overrides | runtime
    vocab_size = data.vocab_size(job)
    if vocab_size is not None:  # a tokenizer's (or a token file's) vocabulary; GPTConfig pads it for tp
        fields["vocab_size"] = vocab_size
    fields["max_seq_len"] = max(fields.get("max_seq_len", job.training.seq_len), job.training.seq_len)
    return GPTConfig(**fields)


def build_model(job: JobConfig, config: GPTConfig, mesh: Mesh) -> tuple[list[GPT], torch.nn.Module]:
    """(this rank's model chunks, the module the optimizer steps: each chunk wrapped for data parallelism, a
    ModuleList of them when the schedule interleaves). The weights are --seed's (or --from-hf's) for any split."""
    torch.manual_seed(job.training.seed)  # the same on every rank: the weights do not depend on the split
    chunks = build_chunks(config, mesh, job.parallelism.virtual_stages, from_hf=job.model.from_hf)
    tp.model_parallel_seed(job.training.seed)  # dropout streams (per pipeline stage and tp rank)
    for chunk in chunks:  # the first stage's embedding, held again: its grad norm counted there
        if tied_embedding(chunk, mesh) is not None and not mesh.is_first_stage:
            tied_embedding(chunk, mesh).shared = True
    if job.training.compile:  # --compile: each block, before data parallelism wraps the chunks (as torchtitan)
        for chunk in chunks:
            chunk.compile_blocks()
    wrapped = [wrap_data_parallel(chunk, mesh, job.parallelism.dp_mode, job.training.precision) for chunk in chunks]
    return chunks, wrapped[0] if len(wrapped) == 1 else torch.nn.ModuleList(wrapped)


def wrap_data_parallel(stage: GPT, mesh: Mesh, mode: str, precision: str = "fp32") -> torch.nn.Module:
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
        return _fully_shard(stage, mesh, bf16)
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
