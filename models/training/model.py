"""The job's model on one rank: the GPTConfig a JobConfig describes, this rank's model chunks, and each chunk wrapped
for data parallelism (data_parallel.py: torch DDP, FSDP2, or tp.optim.DataParallel: zero1 and bf16)."""
import math

import torch
import torch.distributed as dist

import tp
from tp.mesh import Mesh

from ..config import TRAINING_FIELDS, GPTConfig
from ..gpt import GPT
from ..presets import DEFAULT_MODEL, MODELS
from ..stages import build_chunks, tied_embedding
from . import data, resuming
from .config import JobConfig
from .config.model import SHAPE_FIELDS
from .data_parallel import data_parallel_chunks, experts_apart, wrap_data_parallel  # noqa: F401 (also this module's)


def gpt_config_from_job(job: JobConfig) -> GPTConfig:
    """The GPTConfig the job describes: a named shape (or a Hugging Face config) with the job's overrides, its
    vocabulary the data's tokenizer's unless --vocab-size says, max_seq_len at least seq_len."""
    model, parallel = job.model, job.parallelism
    overrides = {f: getattr(model, f) for f in SHAPE_FIELDS if getattr(model, f) is not None} | model.moe_fields()
    # torch DDP (or no dp) in fp32: SP grads summed in one all-reduce after the schedule; FSDP2 drops the tags that
    # needs, and tp.optim.DataParallel (zero1, bf16, experts apart) reduces buckets during backward: summed inside
    # backward there.
    attention_dropout = model.dropout if model.attention_dropout is None else model.attention_dropout
    runtime = dict(sequence_parallel=parallel.sequence_parallel, **parallel.recompute_options, dropout=model.dropout,
                   attention_dropout=attention_dropout, dropout_seed=job.training.seed,
                   sequence_parallel_grad_sync=not uses_torch_ddp(job),
                   cp_mode=parallel.cp_mode, cp_a2a_size=parallel.cp_a2a_size, fp8_recipe=job.training.fp8_recipe)
    saved = resuming.use_checkpoint_args(job)  # --use-checkpoint-args: the checkpoint's GPTConfig
    if saved is not None:
        dispatcher = {"moe_dispatcher": model.moe_dispatcher} if model.moe_dispatcher else {}
        training = {f: v for f, v in model.moe_fields().items() if f in TRAINING_FIELDS}  # (given ones win)
        return resuming.checkpoint_model(saved, runtime | dispatcher | training, job.training.seq_len)
    if model.from_hf:
        import transformers

        from ..hf import config_from_hf

        return config_from_hf(transformers.AutoConfig.from_pretrained(model.from_hf), **runtime, **overrides)
    fields = MODELS[model.preset or DEFAULT_MODEL] | overrides | runtime
    # a given --vocab-size is the model's (preflight checks the data fit it), except NullTokenizer's N: the data's
    # N + 1 ids then (N ends a document, as Megatron's)
    null = job.data.tokenizer_type == "NullTokenizer"
    vocab_size = data.vocab_size(job) if null or not model.vocab_size else None
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
    chunks = build_chunks(config, mesh, job.parallelism.virtual_stages, from_hf=job.model.from_hf,
                          split=job.parallelism.stage_split)
    # (the model's dropout masks are counter-based, keyed by --seed and each sample's index: models/block.py; the
    # streams seeded here are the default generators' and tp.fork_rng's, for anything else that draws)
    tp.model_parallel_seed(job.training.seed)
    for chunk in chunks:  # (MoE) aux losses per micro-batch, their gradient scaled as the runner scales the loss
        aux_losses_per_micro_batch(chunk, mesh)
        chunk.set_moe_aux_loss_scale(1 / job.micro_batches)
    for chunk in chunks:  # the first stage's embedding, held again: its grad norm counted there
        if tied_embedding(chunk, mesh) is not None and not mesh.is_first_stage:
            tied_embedding(chunk, mesh).shared = True
    device = next(chunks[0].parameters()).device.type
    if job.compiles(device):  # --compile: each block, before data parallelism wraps the chunks (as torchtitan)
        for chunk in chunks:
            chunk.compile_blocks()
    apart = any(experts_apart(chunk, mesh) for chunk in chunks)
    wrapped = [wrap_data_parallel(chunk, mesh, job.parallelism.dp_mode, job.training.precision, apart=apart)
               for chunk in chunks]
    return chunks, wrapped[0] if len(wrapped) == 1 else torch.nn.ModuleList(wrapped)


def check_compile(job: JobConfig) -> None:
    """What --compile cannot do, one line: a schedule that splits backward into B and W (the layers defer their
    weight gradients to W, which a compiled block's backward, one graph, cannot split)."""
    kind = tp.pipeline.schedules.SCHEDULES[job.parallelism.schedule]
    if job.training.compile and kind.split_backward:
        others = [name for name, other in tp.pipeline.schedules.SCHEDULES.items() if not other.split_backward]
        raise ValueError(f"--compile --schedule {job.parallelism.schedule}: {kind.title} defers each layer's weight "
                         f"gradient to a W pass, which a compiled block's backward cannot split; use --schedule "
                         f"{', '.join(others[:-1])} or {others[-1]}, or drop --compile")


def aux_losses_per_micro_batch(stage: torch.nn.Module, mesh: Mesh) -> None:
    """The MoE layers' aux losses, capacity and loads over each data-parallel rank's micro-batch, the tokens of its
    tp·cp ranks (Megatron's default), not over the micro-batches of all dp ranks pooled (tp.moe.MoE's default): at the
    same micro-batch size every split then routes, drops and balances as the one-process run does. Each dp rank's
    aux gradient is then its own micro-batch's, averaged over dp like the LM loss's."""
    for m in stage.modules():
        if isinstance(m, tp.moe.MoE):
            m.token_group = m.router.token_group = mesh.group("tp-cp")
            m.data_parallel_size = 1
