"""The GPT split into pipeline stages: which layers each (virtual) stage holds, the stage modules of this rank, and
the tied embedding that the first and last stages both hold.

A stage is `GPT(config, layers=(start, stop), pre_process=first, post_process=last)`: the embedding lives on the
first stage, the final norm, output layer and loss on the last. With V virtual stages (interleaved schedules) each
rank holds V such chunks: chunk c of rank r is virtual stage c·p + r of p·V (Megatron's layout), the first chunk of
rank 0 holding the embedding, the last chunk of the last rank the head.

How many layers each virtual stage holds is `layers_per_stage` (the job and the planner both read it), from
Megatron-LM's pipeline split flags (`StageSplit`): the layers of the first and of the last stage
(--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers), the rest split evenly over the middle
stages; or the embedding and the loss each counted as one layer (--account-for-embedding-in-pipeline-split /
--account-for-loss-in-pipeline-split), the layers plus those split evenly. A rank's chunks hold equal shares of its
layers; the chunk with the embedding (or the loss) one fewer when it is counted. Megatron-Core's
get_num_layers_to_build and get_transformer_layer_offset (megatron/core/transformer/transformer_block.py,
transformer_layer.py) split the same way; like Megatron-LM, the first/last flags do not combine with the
embedding/loss ones. Without any flag, as before: p·V equal stages when V > 1, else an even split whose first
`num_layers % pp` stages take one more.
"""
from typing import NamedTuple

import torch
import torch.distributed as dist

from tp.mesh import Mesh
from tp.pipeline import model_chunks, unwrap

from .config import RUNTIME_FIELDS, TRAINING_FIELDS, GPTConfig
from .gpt import GPT


class StageSplit(NamedTuple):
    """Megatron-LM's pipeline split flags (the job's [parallelism] fields of the same names)."""

    first_stage_layers: int | None = None  # layers of the first stage (--decoder-first-pipeline-num-layers)
    last_stage_layers: int | None = None  # layers of the last stage (--decoder-last-pipeline-num-layers)
    embedding_as_layer: bool = False  # the embedding counted as one layer (--account-for-embedding-in-pipeline-split)
    loss_as_layer: bool = False  # the loss counted as one layer (--account-for-loss-in-pipeline-split)


EVEN_SPLIT = StageSplit()  # no flag given


def layers_per_stage(num_layers: int, pp: int, virtual_stages: int = 1, *,
                     split: StageSplit = EVEN_SPLIT) -> tuple[int, ...]:
    """The layers of each of the pp·V virtual stages, in pipeline order (virtual stage c·pp + r: rank r's chunk c),
    as `split` places them (the module docstring). Raises ValueError naming what does not divide or fit."""
    first, last, embedding, loss = split
    stages = pp * virtual_stages
    if first is not None or last is not None:
        per_rank = _uneven_ranks(num_layers, pp, virtual_stages, split)
        sizes = [per_rank[stage % pp] // virtual_stages for stage in range(stages)]
    elif embedding or loss:
        counted = num_layers + embedding + loss
        if counted % stages:
            raise ValueError(f"num_layers={num_layers} + {int(embedding) + int(loss)} (the embedding and/or loss "
                             f"counted as layers) = {counted} is not divisible by pp*virtual_stages = "
                             f"{pp}*{virtual_stages}")
        sizes = [counted // stages] * stages
        sizes[0] -= embedding
        sizes[-1] -= loss
    else:
        if virtual_stages > 1 and num_layers % stages:
            raise ValueError(f"num_layers={num_layers} is not divisible by pp*virtual_stages = {pp}*{virtual_stages} "
                             "(interleaved chunks hold equal numbers of layers)")
        if stages > num_layers:
            raise ValueError(f"pp={pp} pipeline stages need at least {pp} layers, the model has "
                             f"num_layers={num_layers}")
        base, extra = divmod(num_layers, stages)
        sizes = [base + (stage < extra) for stage in range(stages)]
    return tuple(sizes)  # (each >= 1 but the first or last counted chunk, which may hold the embedding or loss alone)


def _uneven_ranks(num_layers, pp, virtual_stages, split):
    """Each pipeline rank's layers with the first and/or last stage's given: the rest evenly over the others."""
    first, last, embedding, loss = split
    if embedding or loss:
        raise ValueError(f"{split_text(split)}: the first/last stage's layers do not combine with the embedding or "
                         "loss counted as a layer (as in Megatron-LM)")
    given = [n for n in (first, last) if n is not None]
    if pp < 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in given):
        raise ValueError(f"{split_text(split)}: the first/last stage's layers need pp >= 2 (pp={pp}) and are >= 1")
    middle, rest = pp - len(given), num_layers - sum(given)
    if not middle and rest:
        raise ValueError(f"{split_text(split)}: the first and last stages' layers must add up to "
                         f"num_layers={num_layers} (pp={pp}: no middle stage)")
    stages = f"{f'{middle} middle' if len(given) == 2 else f'other {middle}'} stage{'s' * (middle != 1)} of pp={pp}"
    if rest < middle:
        raise ValueError(f"{split_text(split)}: the given stage{'s hold' if len(given) == 2 else ' holds'} "
                         f"{sum(given)} of num_layers={num_layers} layers, leaving {max(rest, 0)} for the {stages} "
                         "(each needs at least one)")
    if middle and rest % middle:
        raise ValueError(f"{split_text(split)}: the other {rest} of num_layers={num_layers} layers do not split "
                         f"evenly over the {stages}")
    ranks = [rest // middle if middle else 0] * pp
    ranks[0] = ranks[0] if first is None else first
    ranks[-1] = ranks[-1] if last is None else last
    uneven = [(r, n) for r, n in enumerate(ranks) if n % virtual_stages]
    if uneven:
        raise ValueError(f"{split_text(split)}: pipeline rank {uneven[0][0]}'s {uneven[0][1]} layers do not split "
                         f"into virtual_stages={virtual_stages} equal chunks")
    return ranks


def split_text(split: StageSplit) -> str:
    """The split's fields that are set, as `name=value` (for messages)."""
    return " ".join(f"{name}={value}" for name, value in split._asdict().items()
                    if value is not None and value is not False) or "an even split"


def stage_layers(num_layers: int, pp: int, stage: int, virtual_stages: int = 1, *,
                 split: StageSplit = EVEN_SPLIT) -> tuple[int, int]:
    """(start, stop) of virtual stage `stage`'s layers, of pp·V stages (layers_per_stage)."""
    sizes = layers_per_stage(num_layers, pp, virtual_stages, split=split)
    start = sum(sizes[:stage])
    return start, start + sizes[stage]


def stage_options(config: GPTConfig, mesh: Mesh, chunk: int = 0, virtual_stages: int = 1, *,
                  split: StageSplit = EVEN_SPLIT) -> dict:
    """GPT keyword arguments of this rank's pipeline stage (its model chunk `chunk` of V)."""
    stage, stages = chunk * mesh.pp_size + mesh.pp_rank, mesh.pp_size * virtual_stages
    return dict(layers=stage_layers(config.num_layers, mesh.pp_size, stage, virtual_stages, split=split),
                pre_process=stage == 0, post_process=stage == stages - 1)


def build_stage(config: GPTConfig, mesh: Mesh, *, split: StageSplit = EVEN_SPLIT) -> GPT:
    """This rank's pipeline stage of the GPT (the whole model when pp = 1), on the mesh's tp and cp groups."""
    return GPT(config, group=mesh.tp_group, cp_group=mesh.cp_group, **stage_options(config, mesh, split=split))


# what training sets on a Hugging Face model beyond the runtime fields (HF configs do not carry them for ours)
def build_chunks(config: GPTConfig, mesh: Mesh, virtual_stages: int, *, from_hf: str | None = None,
                 split: StageSplit = EVEN_SPLIT) -> list[GPT]:
    """This rank's V model chunks (a list of GPT stages), each with the weights of the one-stage model's layers
    (placed by `split`): drawn from the current seed, or read from the Hugging Face directory `from_hf` (`config`'s
    runtime fields, such as sequence_parallel or dropout, and its MoE loss coefficients and capacity applied to its
    model)."""
    state, chunks = torch.get_rng_state(), []
    for c in range(virtual_stages):
        torch.set_rng_state(state)  # every chunk draws the model's one seed, as the whole model does
        options = stage_options(config, mesh, c, virtual_stages, split=split)
        if from_hf:
            chunks.append(GPT.from_hf(from_hf, group=mesh.tp_group, cp_group=mesh.cp_group, stage=options,
                                      **{f: getattr(config, f) for f in RUNTIME_FIELDS + TRAINING_FIELDS}))
        else:
            chunks.append(GPT(config, group=mesh.tp_group, cp_group=mesh.cp_group, **options))
    return chunks


def shares_embedding(config: GPTConfig) -> bool:
    """Whether the last pipeline stage holds a copy of the first stage's embedding: as its output layer (tied
    embeddings), or for multi-token prediction."""
    return config.tie_embeddings or config.mtp_num_layers > 0


def _last_copy(stage):
    return (stage.embedding if hasattr(stage, "embedding") else stage.output).weight


def tied_embedding(stage: GPT, mesh: Mesh) -> torch.nn.Parameter | None:
    """This stage's copy of an embedding held by the first and last pipeline stages (shares_embedding), else None
    (also for a model chunk of theirs without the embedding or the head)."""
    if not shares_embedding(stage.config) or mesh.pp_size == 1 or not mesh.in_embedding_group:
        return None
    if mesh.is_first_stage and stage.pre_process:
        return stage.embedding.weight
    return _last_copy(stage) if mesh.is_last_stage and stage.post_process else None


def allreduce_tied_embedding_grads(stage: torch.nn.Module | list[torch.nn.Module], mesh: Mesh) -> None:
    """Sum the first stage's embedding grad and the last stage's (its tied output layer's, or its MTP copy's): their
    two copies of one weight. `stage`: this rank's GPT stage, or its list of model chunks."""
    chunks = [unwrap(c) for c in model_chunks(stage)]
    if not shares_embedding(chunks[0].config) or mesh.pp_size == 1 or not mesh.in_embedding_group:
        return
    weight = chunks[0].embedding.weight if mesh.is_first_stage else _last_copy(chunks[-1])
    grad = weight.grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2: same dp shard on both stages
    dist.all_reduce(local, group=mesh.embedding_group)
