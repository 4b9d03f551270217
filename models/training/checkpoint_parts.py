"""Where each rank's tensors sit in a checkpoint (models.training.checkpoint's layout): every parameter of a GPT stage
as blocks of the dense Hugging Face tensors it is made of (`Part`: the HF key, its dense shape, this rank's runs of
it), the stages and parameters a save or load walks, and the MoE routers' selection biases stored beside them."""
import dataclasses

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

import tp
from tp.pipeline import model_chunks
from tp.state_dict import index_runs

from ..gpt import GPT
from ..hf import (
    disk_name,
    expert_names,
    fused_part_size,
    hf_family,
    hf_sources,
    parameter_owners,
    tp_sharding,
)

_VOCAB_PARAMS = ("embedding.weight", "output.weight")
Model = torch.nn.Module | list[torch.nn.Module]  # a GPT stage (DDP / FSDP2-wrapped or not), or model chunks


@dataclasses.dataclass(frozen=True)
class Part:
    """One HF tensor behind one of our tp-local parameters, and where this rank holds it: for each (start, length,
    offset) in `runs`, local [start, start + length) along our `dim` is the HF tensor's [offset, offset + length)
    (dim None: the whole tensor, replicated over tp)."""

    key: str  # the HF name
    shape: tuple  # the dense HF tensor's shape
    transposed: bool  # HF stores it [in, out] (GPT-2's Conv1D)
    dim: int | None = None
    runs: tuple = ()
    expert: int | None = None  # experts: the local expert (dim 0 of our [E/ep, ...] weight) the part is of

    def held(self):
        return self.dim is None or bool(self.runs)

    def views(self, tensor):
        """This rank's blocks of the part within a tp-local tensor, as views in HF's orientation."""
        tensor = tensor if self.expert is None else tensor[self.expert]
        pieces = [tensor] if self.dim is None else [tensor.narrow(self.dim, s, n) for s, n, _ in self.runs]
        return [p.t() if self.transposed else p for p in pieces]

    def stored(self, pieces, device_mesh):
        """The blocks `pieces` as DCP stores them: the plain tensor if whole, else a DTensor of the HF tensor whose
        local chunks sit at the blocks' offsets."""
        if self.dim is None:
            return pieces[0]
        hf_dim = 1 - self.dim if self.transposed else self.dim
        offsets = [tuple(offset if d == hf_dim else 0 for d in range(len(self.shape))) for *_, offset in self.runs]
        shape = torch.Size(self.shape)
        return DTensor.from_local(LocalShardsWrapper(pieces, offsets), device_mesh, (Shard(hf_dim),),
                                  run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride())


def _expert_parts(model, module, attr, fused):
    """The Parts of a GroupedExperts weight: per local expert, the per-expert HF tensors on disk under its global
    index (Mixtral's `…block_sparse_moe.experts.<e>.w1.weight`, w3, w2; the others' gate/up/down_proj), this rank's
    rows (fc1: of gate, then up) or columns (fc2) of the etp split."""
    family, local = hf_family(model.config), module.local_ffn
    h, ffn, offset = module.hidden_size, module.ffn_hidden_size, module.etp_rank * local
    parts = []
    for e, expert in enumerate(module.expert_range):
        names = expert_names(fused, expert, family)
        if attr == module.names[0]:  # fc1 [E/ep, 2F/etp (gate, up), h]
            names = names if module.activation == "swiglu" else names[:1]
            parts += [Part(n, (ffn, h), False, 0, ((j * local, local, offset),), e) for j, n in enumerate(names)]
        else:  # fc2 [E/ep, h, F/etp]
            parts += [Part(n, (h, ffn), False, 1, ((0, local, offset),), e) for n in names]
    return parts


def hf_parts(model, name, module, attr, local_shape):
    """The Parts of every HF tensor behind our parameter `name` (of tp-local shape `local_shape`), held or not."""
    config = model.config
    sources = [(disk_name(key, hf_family(config)), transposed)  # (Mixtral's router: block_sparse_moe.gate)
               for key, transposed in hf_sources(config, name, model.layer_range[0])]

    def hf_shape(shape, transposed):
        return tuple(reversed(shape)) if transposed else tuple(shape)

    if isinstance(module, tp.moe.GroupedExperts):
        return _expert_parts(model, module, attr, sources[0][0])
    sharding = tp_sharding(module, attr)
    if sharding is None:
        (key, transposed), = sources
        return [Part(key, hf_shape(local_shape, transposed), transposed)]
    dim, total, indices = sharding
    if len(sources) > 1:
        sizes = [fused_part_size(config, key) for key, _ in sources]
    else:
        sizes = [config.vocab_size if name in _VOCAB_PARAMS else total]  # padding rows are not stored
    parts, base = [], 0
    for (key, transposed), size in zip(sources, sizes):
        runs, position = [], 0
        # consecutive dense indices, at local [position, position + stop - start)
        for start, stop in index_runs(indices):
            a, b = max(start, base), min(stop, base + size)
            if a < b:
                runs.append((position + a - start, b - a, a - base))
            position += stop - start
        shape = list(local_shape)
        shape[dim] = size
        parts.append(Part(key, hf_shape(shape, transposed), transposed, dim, tuple(runs)))
        base += size
    return parts


def _parameters(model):
    """(name, module, attribute, parameter) of every distinct parameter (a weight tied on this stage once)."""
    seen = set()
    for name, (module, attr) in parameter_owners(model).items():
        param = getattr(module, attr)
        if id(param) not in seen:
            seen.add(id(param))
            yield name, module, attr, param


def parameter_shapes(model: Model) -> dict[str, tuple]:
    """{key: dense shape} of every Hugging Face tensor behind this rank's parameters (held or not; the vocabulary
    without tp's padding rows): over every rank, the union is the whole model's parameters."""
    return {f"model.{part.key}": part.shape for stage in checked_stages(model, None, None)
            for part in (p for name, module, attr, param in _parameters(stage)
                         for p in hf_parts(stage, name, module, attr, param.shape))}


def is_distributed(optimizer):
    """Whether `optimizer` is tp.optim's DistributedOptimizer (its fp32 masters and state sharded over dp)."""
    return isinstance(optimizer, tp.optim.DistributedOptimizer)


def checked_stages(model, optimizer, mesh):
    """The unwrapped GPT stages (one, or a rank's model chunks: a list or nn.ModuleList of them, for interleaved
    pipelines); raises, the same on every rank, before any collective."""
    chunks = model_chunks(model)
    stages = [getattr(chunk, "module", chunk) for chunk in chunks]  # DDP
    for model in stages:
        if not isinstance(model, GPT):
            raise TypeError(f"model must be a models.GPT stage (or a DDP / FSDP2 wrapping of one), or a list of "
                            f"them, got {type(model).__name__}")
        if mesh is not None and model.tp_size != mesh.tp_size:
            raise ValueError(f"the model is split over tp={model.tp_size} ranks but mesh has tp={mesh.tp_size}")
    if is_distributed(optimizer):  # (over the chunks' DataParallel modules, in the chunks' order)
        if [m.module for m in optimizer.modules] != stages:
            raise ValueError("the DistributedOptimizer steps another module's parameters than the model's")
    elif optimizer is not None:
        ours = {id(p) for stage in stages for *_, p in _parameters(stage)}
        foreign = [i for i, g in enumerate(optimizer.param_groups) for p in g["params"] if id(p) not in ours]
        if foreign:
            raise ValueError(f"optimizer param_groups {sorted(set(foreign))} hold parameters that are not the "
                             f"model's (build the optimizer over model.parameters())")
    return stages


def stage_parameters(stages):
    """(stage, name, module, attribute, parameter) of every distinct parameter of the stages."""
    for stage in stages:
        for name, module, attr, param in _parameters(stage):
            yield stage, name, module, attr, param


def expert_biases(stages):
    """(key, buffer) of every sigmoid router's selection bias (DeepSeek-V3's, updated by the job, not by gradients):
    stored whole, beside the router weight, under HF's DeepSeek-V3 name `…gate.e_score_correction_bias`."""
    for stage, name, module, attr, _ in stage_parameters(stages):
        if isinstance(module, tp.moe.TopKRouter) and module.expert_bias is not None:
            key = hf_parts(stage, name, module, attr, module.weight.shape)[0].key
            yield f"model.{key.rsplit('.', 1)[0]}.e_score_correction_bias", module.expert_bias
