"""The GPT split into pipeline stages: which layers each (virtual) stage holds, the stage modules of this rank, and
the tied embedding that the first and last stages both hold.

A stage is `GPT(config, layers=(start, stop), pre_process=first, post_process=last)`: the embedding lives on the
first stage, the final norm, output layer and loss on the last. With V virtual stages (interleaved schedules) each
rank holds V such chunks: chunk c of rank r is virtual stage c·p + r of p·V equal ones (Megatron's layout), the first
chunk of rank 0 holding the embedding, the last chunk of the last rank the head.
"""
import torch
import torch.distributed as dist

from tp.mesh import Mesh
from tp.pipeline import model_chunks, unwrap

from .config import RUNTIME_FIELDS, GPTConfig
from .gpt import GPT


def stage_layers(num_layers: int, pp: int, stage: int, virtual_stages: int = 1) -> tuple[int, int]:
    """(start, stop) of virtual stage `stage`'s layers, of pp·V stages: an even split, the first `num_layers % pp`
    stages taking one more (V = 1); with V > 1 the layers must divide evenly (Megatron's interleaving)."""
    stages = pp * virtual_stages
    if virtual_stages > 1 and num_layers % stages:
        raise ValueError(f"num_layers={num_layers} is not divisible by pp*virtual_stages = {pp}*{virtual_stages} "
                         "(interleaved chunks hold equal numbers of layers)")
    if stages > num_layers:
        raise ValueError(f"pp={pp} pipeline stages need at least {pp} layers, the model has num_layers={num_layers}")
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (stage < extra)


def stage_options(config: GPTConfig, mesh: Mesh, chunk: int = 0, virtual_stages: int = 1) -> dict:
    """GPT keyword arguments of this rank's pipeline stage (its model chunk `chunk` of V)."""
    stage, stages = chunk * mesh.pp_size + mesh.pp_rank, mesh.pp_size * virtual_stages
    return dict(layers=stage_layers(config.num_layers, mesh.pp_size, stage, virtual_stages),
                pre_process=stage == 0, post_process=stage == stages - 1)


def build_stage(config: GPTConfig, mesh: Mesh) -> GPT:
    """This rank's pipeline stage of the GPT (the whole model when pp = 1), on the mesh's tp and cp groups."""
    return GPT(config, group=mesh.tp_group, cp_group=mesh.cp_group, **stage_options(config, mesh))


# what training sets on a Hugging Face model beyond the runtime fields (HF configs do not carry them for ours)
HF_TRAINING_FIELDS = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_capacity_factor", "moe_seq_aux_loss_coeff",
                      "mtp_loss_scaling_factor")


def build_chunks(config: GPTConfig, mesh: Mesh, virtual_stages: int, *, from_hf: str | None = None) -> list[GPT]:
    """This rank's V model chunks (a list of GPT stages), each with the weights of the one-stage model's layers:
    drawn from the current seed, or read from the Hugging Face directory `from_hf` (`config`'s runtime fields, such
    as sequence_parallel or dropout, and its MoE loss coefficients and capacity applied to its model)."""
    state, chunks = torch.get_rng_state(), []
    for c in range(virtual_stages):
        torch.set_rng_state(state)  # every chunk draws the model's one seed, as the whole model does
        options = stage_options(config, mesh, c, virtual_stages)
        if from_hf:
            chunks.append(GPT.from_hf(from_hf, group=mesh.tp_group, cp_group=mesh.cp_group, stage=options,
                                      **{f: getattr(config, f) for f in RUNTIME_FIELDS + HF_TRAINING_FIELDS}))
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
