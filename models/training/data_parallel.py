"""Data parallelism's modes (--dp-mode): how the job wraps each model chunk over the dp×cp group. MODES is the one
list of them (the job's choices, the planner's and bench.train's read it).

Gradients are summed over cp (each cp rank holds its tokens' share of the gradient of the global loss) and averaged
over dp: divided by dp, not dp·cp.

bf16: zero1 and ddp use tp.optim.DataParallel (bf16 parameters, fp32 main_grad buckets and masters; with ddp its
all-reduce form, Megatron's DDP: torch DDP would reduce the bf16 .grad); fsdp uses FSDP2's own mixed precision (its
fp32 shards are the masters, gathered in bf16, gradients reduced in fp32).

Experts laid out apart (ep > 1 or etp != tp): their gradients are summed over the expert-data-parallel group (the
ranks holding the same experts) and divided by dp too: tp.optim.DataParallel keeps them in buckets of their own over
edp (also for fp32 ddp, in its all-reduce form), FSDP2 shards each layer's experts over edp.
"""
import torch
import torch.distributed as dist

import tp
from tp.mesh import Mesh
from tp.pipeline import model_chunks

from ..gpt import GPT
from ..stages import tied_embedding


def experts_apart(stage: torch.nn.Module, mesh: Mesh) -> bool:
    """Whether `stage` has expert weights whose replicas (the edp group) are not the dense ones' (dp x cp)."""
    return bool(tp.moe.expert_parameters(stage)) and mesh.ranks("edp") != mesh.ranks("dp-cp")


def _buckets(stage, mesh, bf16, apart, *, shard):
    """tp.optim.DataParallel: the DistributedOptimizer's buckets, sharded (zero1) or all-reduced."""
    tied = tied_embedding(stage, mesh)
    return tp.optim.DataParallel(stage, group=mesh.group("dp-cp"), average_over=mesh.dp_size, shard=shard,
                                 param_dtype=torch.bfloat16 if bf16 else None,
                                 expert_group=mesh.edp_group if apart else None,
                                 tied=[(tied, mesh.embedding_group)] if tied is not None else ())


def _ddp(stage, mesh, bf16, apart):
    """torch DDP over dp×cp in fp32 (the stage itself on one replica); tp.optim.DataParallel's all-reduce form in
    bf16 or with the experts apart."""
    if bf16 or apart:
        return _buckets(stage, mesh, bf16, apart, shard=False)
    if mesh.size("dp-cp") == 1:
        return stage
    from torch.nn.parallel import DistributedDataParallel

    module = DistributedDataParallel(stage, process_group=mesh.group("dp-cp"))
    if mesh.cp_size > 1:
        module.register_comm_hook(mesh.group("dp-cp"), _sum_then_divide_by(mesh.dp_size))
    return module


def _zero1(stage, mesh, bf16, apart):
    """tp.optim.DataParallel sharding its buckets (Megatron's distributed optimizer)."""
    return _buckets(stage, mesh, bf16, apart, shard=True)


def _fsdp(stage, mesh, bf16, apart):
    """FSDP2 over dp×cp (each block, then the stage); ddp's wrapping where there is nothing to shard."""
    if mesh.size("dp-cp") > 1 or apart:
        return _fully_shard(stage, mesh, bf16)
    return _ddp(stage, mesh, bf16, apart)


# --dp-mode -> how a chunk is wrapped: (stage, mesh, bf16, experts apart) -> the module the optimizer steps
MODES = {"ddp": _ddp, "zero1": _zero1, "fsdp": _fsdp}


def wrap_data_parallel(stage: GPT, mesh: Mesh, mode: str, precision: str = "fp32", *,
                       apart: bool | None = None) -> torch.nn.Module:
    """`stage` wrapped for data parallelism over the dp×cp group in `mode` (one of MODES; module docstring). `apart`:
    whether this rank's chunks hold experts apart (default: whether this stage does): every chunk of a rank is wrapped
    alike, one optimizer steps them all (a chunk of dense layers beside chunks with experts, interleaved)."""
    if mode not in MODES:
        raise ValueError(f"dp mode {mode!r} must be one of {tuple(MODES)}")
    return MODES[mode](stage, mesh, precision == "bf16", experts_apart(stage, mesh) if apart is None else apart)


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
