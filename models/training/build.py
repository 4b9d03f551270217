"""What the Trainer is built from, besides the model (model.py): the mesh, on the job's device and at its precision,
and AdamW with its per-step hyperparameters."""
import datetime

import torch

import tp

from . import launch
from .config import JobConfig
from .model import data_parallel_chunks


def set_hyperparameters(optimizer: torch.optim.Optimizer, job: JobConfig, step: int) -> None:
    """This step's learning rate, and the job's weight decay (group 0; group 1 holds the 1-D parameters, never
    decayed): the job wins over what a loaded checkpoint's param_groups carried."""
    lr = job.optimizer.learning_rate(step, job.training.steps)
    for group, weight_decay in zip(optimizer.param_groups, (job.optimizer.weight_decay, 0.0)):
        group["lr"], group["weight_decay"] = lr, weight_decay


def build_mesh(job: JobConfig) -> tp.Mesh:
    """The tp x cp x pp x dp mesh (--device cuda: NCCL for CUDA tensors and gloo for CPU ones, one rank per GPU;
    cpu: gloo); rank 0 prints the layout."""
    cuda = job.launch.device == "cuda"
    parallel = job.parallelism
    mesh = tp.init_mesh(tp=parallel.tp, cp=parallel.cp, pp=parallel.pp, dp=parallel.dp, ep=parallel.ep,
                        etp=parallel.etp, backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
                        timeout=datetime.timedelta(minutes=job.launch.distributed_timeout_minutes))
    if cuda and mesh.rank == 0:  # the log's first line: what runs where, at which precision
        print(device_line(job, mesh.world_size), flush=True)
    launch.announce_layout(mesh)  # rank 0 prints which ranks sit on which node, and their coordinates
    if cuda:  # (the weights are drawn on the CPU and moved: the same as a CPU run's)
        torch.set_default_device(f"cuda:{torch.cuda.current_device()}")
        tf32 = job.training.precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    return mesh


def device_line(job: JobConfig, world_size: int) -> str:
    """What a GPU job runs on, and at which precision (fp32 there is the exact IEEE dot: bf16 is the default)."""
    precision = {"bf16": "bf16 (the GPU default; --precision tf32 or fp32 for fp32 parameters)",
                 "tf32": "tf32 (fp32 parameters, TensorFloat-32 matmuls)",
                 "fp32": "fp32 (exact IEEE matmuls, slow on GPUs: --precision tf32 or bf16 are faster)"}
    return (f"cuda: {world_size} rank{'s' * (world_size > 1)}, one per GPU ({torch.cuda.get_device_name()}; NCCL "
            f"for CUDA tensors, gloo for CPU ones), precision {precision[job.training.precision]}")


def build_optimizer(module: torch.nn.Module, job: JobConfig, micro_batches: int) -> torch.optim.Optimizer:
    """AdamW over this rank's chunks (no weight decay on 1-D parameters, norms and biases, as Megatron), fused where
    torch has the kernel (tp.optim.fast_adam: no host sync); with tp.optim.DataParallel chunks (zero1, bf16), one
    DistributedOptimizer over their fp32 masters' shards (fused too)."""
    groups = [{"params": [p for p in module.parameters() if p.dim() > 1]},
              {"params": [p for p in module.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
    optimizer = job.optimizer
    hyperparameters = dict(lr=optimizer.lr, betas=(optimizer.adam_beta1, optimizer.adam_beta2), eps=optimizer.adam_eps,
                           weight_decay=optimizer.weight_decay)
    buffered = data_parallel_chunks(module)
    if not buffered:
        return torch.optim.AdamW(groups, **hyperparameters, **tp.optim.fast_adam(groups))
    for chunk in buffered:  # a bucket reduces once its gradients have arrived from every micro-batch, any schedule
        chunk.set_micro_batches(micro_batches)
    return tp.optim.DistributedOptimizer(module, groups, **hyperparameters)
