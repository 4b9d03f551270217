"""Sharded training checkpoints that reshard: save at one tp/pp/dp split, resume at any other, no conversion step.

`save(path, model, optimizer, mesh=, step=)` writes a torch.distributed.checkpoint (DCP) directory, every rank its
own shards; `load(path, model, optimizer, mesh=)` fills a GPT stage and its optimizer built at any split of the same
GPTConfig (sequence_parallel, recompute and dropout may differ) and returns (step, extra).

The directory is DCP's format: `.metadata` (every tensor's dense shape and where each of its chunks lies) and one
`__<rank>_0.distcp` per rank holding the chunks that rank wrote. Its keys do not depend on the split:

- `model.<hf name>`: each parameter as the dense Hugging Face tensor it is made of (`models.hf.hf_sources`): q_proj,
  k_proj, v_proj, gate_proj, up_proj separately, global layer indices, `embed_tokens`/`lm_head` with exactly
  vocab_size rows (the padding rows, which depend on tp, are not stored), GPT-2's Conv1D weights as [in, out].
- `optim.<hf name>.<state>`: the optimizer state of that tensor; entries shaped like the parameter (AdamW's exp_avg,
  exp_avg_sq) are split exactly like it, the others (AdamW's scalar step) are stored whole.
- `meta`: step, split, GPTConfig, optimizer class and param_groups hyperparameters, `extra` (rank 0's), written by
  rank 0. `rng.<rank>`: each rank's `tp.get_rng_state()`.

How it reshards: each rank describes what it holds as blocks of those HF tensors at their offsets (its q_proj rows,
its rows of gate_proj and of up_proj, its o_proj/down_proj columns, its real vocabulary rows), as a DTensor over the
tp group whose local tensor is DCP's LocalShardsWrapper (blocks with their offsets, what torchrec checkpoints with;
the placement is nominal, DCP takes the chunks from the wrapper). A plain Shard(d) DTensor could not describe these
layouts: a rank's vocabulary rows end where the tp-dependent padding starts, kv heads fewer than tp are held whole
by several ranks, and GPT-2's fused c_attn holds a slice of each of q, k and v. What every tp rank holds whole (norms,
row biases, learned positions) is a plain tensor, which DCP treats as replicated. Equal chunks held by several ranks
(dp replicas, replicated kv heads, the tied output layer's copy on the last pipeline stage) are written once. On load
each rank asks for the blocks of its own layout and DCP reads the overlapping parts of whatever was written; stages
hold disjoint layers, so one save/load over the world covers the pipeline. FSDP2 (`fully_shard` over dp) parameters
and states are gathered over dp with `full_tensor()` on save and re-sharded on load; a DDP-wrapped model is
unwrapped. A rank's model chunks (interleaved pipelines: a list of stages) are stages like any other: the keys hold
global layer indices, so a checkpoint moves between any pp x virtual-stages layouts. A tied embedding split across
stages is assumed kept equal on both (its grads summed over the embedding group): both copies write the same chunks
and both are loaded from them.

The distributed optimizer (`tp.optim.DistributedOptimizer`, zero1, and its all-reduce form for ddp under bf16)
keeps each rank's 1/dp of the fp32 masters and AdamW state: they are all-gathered over dp on save and written as
above, and each rank keeps its shard on load, so checkpoints move freely between ddp, zero1 and fsdp at any dp size.
The parameters are always stored as the fp32 masters (bf16 runs: not the bf16 copies; `optimizer` names the inner
torch optimizer, AdamW), so a bf16 run resumes in fp32 and the other way round.

Async saves (`save(..., async_group=)`, the job's --async-save): every tensor is copied to CPU first (the staging:
training may change the originals from then on), then DCP's async_save writes them on a background thread, its
collectives on `async_group` (a gloo group of its own: the training's groups stay the training thread's); the
returned Future is done once the whole checkpoint, `.metadata` last, is on disk.

RNG: restored only when the split (world size, tp, pp, dp, order) is unchanged. At another split no rank's stream
corresponds to a saved one: every rank keeps the generators it has (seed them with `tp.model_parallel_seed` before
loading). The model's dropout masks do not depend on them: they are keyed by GPTConfig.dropout_seed and each sample's
global index (`sample_ids`, which the training job passes), so a resume at any split keeps the curve with dropout on.
Only a forward without sample_ids draws their start from the default generator.
"""
import dataclasses
import os
import pickle
import warnings
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

import tp
from tp.pipeline import model_chunks

from ..config import RUNTIME_FIELDS, GPTConfig
from ..gpt import GPT
from ..hf import (
    disk_name,
    expert_names,
    fused_part_size,
    hf_family,
    hf_sources,
    index_runs,
    parameter_owners,
    tp_sharding,
)
from . import manifest

_VOCAB_PARAMS = ("embedding.weight", "output.weight")
Model = torch.nn.Module | list[torch.nn.Module]  # a GPT stage (DDP / FSDP2-wrapped or not), or model chunks


@dataclasses.dataclass(frozen=True)
class _Part:
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
    """The _Parts of a GroupedExperts weight: per local expert, the per-expert HF tensors on disk under its global
    index (Mixtral's `…block_sparse_moe.experts.<e>.w1.weight`, w3, w2; the others' gate/up/down_proj), this rank's
    rows (fc1: of gate, then up) or columns (fc2) of the etp split."""
    family, local = hf_family(model.config), module.local_ffn
    h, ffn, offset = module.hidden_size, module.ffn_hidden_size, module.etp_rank * local
    parts = []
    for e, expert in enumerate(module.expert_range):
        names = expert_names(fused, expert, family)
        if attr == module.names[0]:  # fc1 [E/ep, 2F/etp (gate, up), h]
            names = names if module.activation == "swiglu" else names[:1]
            parts += [_Part(n, (ffn, h), False, 0, ((j * local, local, offset),), e) for j, n in enumerate(names)]
        else:  # fc2 [E/ep, h, F/etp]
            parts += [_Part(n, (h, ffn), False, 1, ((0, local, offset),), e) for n in names]
    return parts


def _parts(model, name, module, attr, local_shape):
    """The _Parts of every HF tensor behind our parameter `name` (of tp-local shape `local_shape`), held or not."""
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
        return [_Part(key, hf_shape(local_shape, transposed), transposed)]
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
        parts.append(_Part(key, hf_shape(shape, transposed), transposed, dim, tuple(runs)))
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
    return {f"model.{part.key}": part.shape for stage in _check(model, None, None)
            for part in (p for name, module, attr, param in _parameters(stage)
                         for p in _parts(stage, name, module, attr, param.shape))}


def _tp_local(tensor):
    """The whole tp-local tensor: FSDP2's dp shards gathered."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def _assign(target, value):
    """Copy a tp-local tensor into `target` (an FSDP2 DTensor keeps only its dp shard)."""
    if isinstance(target, DTensor):
        value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    target.copy_(value)


def _distributed(optimizer):
    return isinstance(optimizer, tp.optim.DistributedOptimizer)


def _optimizer_name(optimizer):
    return type(optimizer.optimizer if _distributed(optimizer) else optimizer).__name__


def _split(mesh):
    split = dict(world_size=mesh.world_size, order="-".join(mesh.order), **mesh.sizes)
    if mesh.ep_size > 1 or mesh.etp_size != mesh.tp_size:  # (the expert layout, where it differs)
        split.update(ep=mesh.ep_size, etp=mesh.etp_size)
    return split


def _check(model, optimizer, mesh):
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
    if _distributed(optimizer):  # (over the chunks' DataParallel modules, in the chunks' order)
        if [m.module for m in optimizer.modules] != stages:
            raise ValueError("the DistributedOptimizer steps another module's parameters than the model's")
    elif optimizer is not None:
        ours = {id(p) for stage in stages for *_, p in _parameters(stage)}
        foreign = [i for i, g in enumerate(optimizer.param_groups) for p in g["params"] if id(p) not in ours]
        if foreign:
            raise ValueError(f"optimizer param_groups {sorted(set(foreign))} hold parameters that are not the "
                             f"model's (build the optimizer over model.parameters())")
    return stages


def _stage_parameters(stages):
    """(stage, name, module, attribute, parameter) of every distinct parameter of the stages."""
    for stage in stages:
        for name, module, attr, param in _parameters(stage):
            yield stage, name, module, attr, param


def _expert_biases(stages):
    """(key, buffer) of every sigmoid router's selection bias (DeepSeek-V3's, updated by the job, not by gradients):
    stored whole, beside the router weight, under HF's DeepSeek-V3 name `…gate.e_score_correction_bias`."""
    for stage, name, module, attr, _ in _stage_parameters(stages):
        if isinstance(module, tp.moe.TopKRouter) and module.expert_bias is not None:
            key = _parts(stage, name, module, attr, module.weight.shape)[0].key
            yield f"model.{key.rsplit('.', 1)[0]}.e_score_correction_bias", module.expert_bias


class _Staged:
    """DCP's AsyncStager for a state dict `save` has already copied to CPU: nothing more to copy."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def close(self):
        pass


def save(path: str, model: Model, optimizer: torch.optim.Optimizer | None, *, mesh: tp.Mesh, step: int,
         extra: Any = None, async_group: dist.ProcessGroup | None = None,
         storage_writer: dcp.StorageWriter | None = None) -> Future | None:
    """Write a checkpoint of this GPT stage, its optimizer, the RNG and `step` to directory `path` (collective over
    every rank). `extra`: anything picklable to hand back on load (rank 0's is kept).

    With `async_group` (a gloo group over every rank, used by the writing thread alone): the tensors are copied to
    CPU here, then written in the background by DCP's async_save; returns its Future, done on a rank once every
    rank's shards and the `.metadata` (written last, by rank 0) are on disk. `storage_writer`: DCP's, instead of a
    manifest.ManifestWriter for `path` (DCP's FileSystemWriter, which also writes manifest.json: every file's size
    and CRC-32, which `load` checks)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an integer >= 0")
    stages = _check(model, optimizer, mesh)
    for chunk in model_chunks(model):
        if hasattr(chunk, "finish_param_sync"):  # tp.optim.DataParallel: its parameters' all-gathers complete
            chunk.finish_param_sync()
    # on the tensors' device: a DTensor on a mesh of another device would copy them (async: staged on the CPU)
    device = "cpu" if async_group is not None else next(stages[0].parameters()).device.type
    device_mesh = mesh.flat_device_mesh("tp", device)
    state = {}
    whole = optimizer.full_state() if _distributed(optimizer) else None  # fp32 masters and state, dp-gathered
    staged = (lambda t: t.detach().to("cpu", copy=True)) if async_group is not None else (lambda t: t)
    for stage, name, module, attr, param in _stage_parameters(stages):
        parts = [part for part in _parts(stage, name, module, attr, param.shape) if part.held()]
        value = staged(_tp_local(param.detach()) if whole is None else whole[param].pop("param"))
        for part in parts:
            state[f"model.{part.key}"] = part.stored(part.views(value), device_mesh)
        entries = whole[param] if whole is not None else optimizer.state.get(param, {}) if optimizer is not None \
            else {}
        for entry, value in entries.items():
            if not torch.is_tensor(value):
                raise TypeError(f"optimizer state {entry!r} of {name} is a {type(value).__name__}; only tensors are "
                                "checkpointed")
            value = staged(_tp_local(value))
            for part in parts:  # split like the parameter, or whole
                state[f"optim.{part.key}.{entry}"] = part.stored(part.views(value), device_mesh) \
                    if value.shape == param.shape else value
    for key, bias in _expert_biases(stages):
        state[key] = staged(bias)
    if mesh.rank == 0:
        groups = None if optimizer is None else [{k: v for k, v in g.items() if k != "params"}
                                                 for g in optimizer.param_groups]
        meta = dict(step=step, split=_split(mesh), config=dataclasses.asdict(stages[0].config), extra=extra,
                    optimizer=None if optimizer is None else _optimizer_name(optimizer), param_groups=groups)
        state["meta"] = pickle.dumps(meta)
    state[f"rng.{mesh.rank}"] = pickle.dumps(tp.get_rng_state())
    storage_writer = storage_writer or manifest.ManifestWriter(path)
    if async_group is None:
        dcp.save(state, checkpoint_id=path, storage_writer=storage_writer)
        return None
    return dcp.async_save(state, checkpoint_id=path, storage_writer=storage_writer, process_group=async_group,
                          async_stager=_Staged())


def config_differences(saved: dict, config: GPTConfig) -> dict[str, tuple[Any, Any]]:
    """{field: (the checkpoint's value, `config`'s)} of the GPTConfig fields that define weights and differ: runtime
    fields may differ, and max_seq_len too unless positions are learned (RoPE holds no position weights)."""
    free = RUNTIME_FIELDS + (() if config.position == "learned" else ("max_seq_len",))
    return {k: (saved.get(k), v) for k, v in dataclasses.asdict(config).items() if k not in free and saved.get(k) != v}


def check_config(saved: dict, config: GPTConfig, path: str) -> None:
    """Raise unless GPTConfig `config` builds the same weights as the checkpoint's saved config (a dict)."""
    differ = [f"{k}={theirs!r} (model: {ours!r})" for k, (theirs, ours) in config_differences(saved, config).items()]
    if differ:
        raise ValueError(f"checkpoint {path!r} was saved with another GPTConfig: {', '.join(differ)}")


def check_files(path: str) -> None:
    """Raise ValueError (one line naming the file) unless the checkpoint's `.metadata` reads and every shard file it
    names holds at least the bytes it says: a corrupt or truncated checkpoint is refused before any rank loads it."""
    metadata_file = os.path.join(path, ".metadata")
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # (unpickling garbage raises anything)
        raise ValueError(f"{metadata_file} is not a readable checkpoint index ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'corrupt'})") from None
    needed = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ValueError(f"{file} is missing: the checkpoint's .metadata names it")
        if os.path.getsize(file) < size:
            raise ValueError(f"{file} is truncated: {os.path.getsize(file)} bytes, the checkpoint's .metadata "
                             f"says {size}")


def has_manifest(path: str) -> bool:
    """Whether the checkpoint in `path` has a manifest.json to verify its files by (saved before them: not)."""
    return os.path.isfile(os.path.join(path, manifest.MANIFEST))


def verify_files(path: str, mesh: tp.Mesh | None = None) -> None:
    """Raise ValueError (one line naming the file) unless every file of the checkpoint has the size and CRC-32 its
    manifest.json lists (without one: nothing to verify). With `mesh`, collective: each rank reads 1/world of the
    files and every rank raises the first error found."""
    if mesh is None:
        manifest.verify(path)
        return
    try:
        manifest.verify(path, part=mesh.rank, parts=mesh.world_size)
        error = None
    except ValueError as e:
        error = str(e)
    errors = [None] * mesh.world_size
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise ValueError(first)


def read_meta(path: str) -> dict:
    """The checkpoint's meta (step, split, config, optimizer hyperparameters), read by this process alone; a
    corrupt or truncated checkpoint raises ValueError naming the file (check_files)."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"{path!r} holds no checkpoint (no .metadata)")
    check_files(path)
    holder = {"meta": None}
    with warnings.catch_warnings():  # DCP warns that no_dist means a single process: here it means this rank alone
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(holder, checkpoint_id=path, no_dist=True)
    return pickle.loads(holder["meta"])


def _read_meta(path, model, optimizer):
    """The checkpoint's meta, read by this rank alone; raises if it does not fit the model and optimizer (None: the
    optimizer's state is not loaded)."""
    meta = read_meta(path)
    check_config(meta["config"], model.config, path)
    if optimizer is not None and meta["optimizer"] is not None:
        if _optimizer_name(optimizer) != meta["optimizer"]:
            raise ValueError(f"checkpoint {path!r} holds {meta['optimizer']} state, not {_optimizer_name(optimizer)}")
        if len(optimizer.param_groups) != len(meta["param_groups"]):
            raise ValueError(f"checkpoint {path!r} has {len(meta['param_groups'])} optimizer param_groups, the "
                             f"optimizer {len(optimizer.param_groups)}")
    return meta


class _Reads:
    """What `load` asks DCP for (`state`: key -> the buffer DCP reads into) and where each read goes after: the blocks
    of each target tensor (`fills`), the optimizer state per parameter (`new_states`) and, for a DistributedOptimizer,
    the fp32 master each parameter is loaded into (`masters`)."""

    def __init__(self, device_mesh):
        self.device_mesh = device_mesh
        self.state, self.fills, self.new_states, self.masters = {}, [], {}, {}
        self.blocks = {}  # key -> the buffers DCP reads its blocks into

    def request(self, target, parts, prefix, suffix, dtype):
        """Ask for this rank's blocks of `target` (a tp-local tensor made of `parts`); copied in by `copy_in`."""
        fill = []
        for part in parts:
            if part.held():
                buffers = [torch.empty(v.shape, dtype=dtype, device=target.device)
                           for v in part.views(torch.empty(target.shape, device="meta"))]
                self.state[f"{prefix}.{part.key}{suffix}"] = part.stored(buffers, self.device_mesh)
                self.blocks[f"{prefix}.{part.key}{suffix}"] = buffers
                fill.append((part, buffers))
        self.fills.append((target, fill))

    def non_finite(self) -> str | None:
        """The first key read (in request order) holding a NaN or an infinity on this rank, or None."""
        for key, value in self.state.items():
            pieces = self.blocks.get(key, [value] if torch.is_tensor(value) else [])
            if any(p.is_floating_point() and not torch.isfinite(p).all() for p in pieces):
                return key
        return None

    @torch.no_grad()
    def copy_in(self):
        """Assemble each target from its blocks read by DCP (the padding rows stay zero) and assign it."""
        for target, fill in self.fills:
            value = torch.zeros(target.shape, dtype=target.dtype, device=target.device)
            for part, buffers in fill:
                for view, buffer in zip(part.views(value), buffers):
                    view.copy_(buffer)
            _assign(target, value)


def _groups_by_parameter(optimizer):
    """id(parameter) -> its optimizer param_group, for every parameter the optimizer steps."""
    if optimizer is None:
        return {}
    if _distributed(optimizer):
        return {id(p): g for p, g in optimizer.group_of.items()}
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def _request_optimizer_state(reads, param, target, parts, group, stored):
    """Ask for every stored optimizer-state entry of `param` into new zero tensors, which `reads.new_states` keeps."""
    new = reads.new_states[param] = {}
    prefix = f"optim.{parts[0].key}."
    for key in (k for k in stored if k.startswith(prefix)):
        entry, md = key[len(prefix):], stored[key]
        if tuple(md.size) == parts[0].shape:  # split like the parameter
            new[entry] = torch.zeros_like(target, memory_format=torch.preserve_format)
            reads.request(new[entry], parts, "optim", f".{entry}", md.properties.dtype)
        else:  # whole (AdamW's step: on the parameter's device only when capturable or fused, as torch does)
            device = param.device if group.get("capturable") or group.get("fused") else "cpu"
            new[entry] = torch.zeros(md.size, dtype=md.properties.dtype, device=device)
            reads.state[key] = new[entry]


def _request_parameters(stages, optimizer, stored, device_mesh, *, states=True):
    """The _Reads of every parameter of the stages and (`states`) of its optimizer state."""
    reads, groups = _Reads(device_mesh), _groups_by_parameter(optimizer) if states else {}
    for stage, name, module, attr, param in _stage_parameters(stages):
        parts = _parts(stage, name, module, attr, param.shape)
        target = param
        if _distributed(optimizer):  # the fp32 master (and, through it, a bf16 parameter) from the stored fp32 values
            target = reads.masters[param] = torch.zeros(param.shape, dtype=optimizer.masters_dtype,
                                                        device=param.device)
        reads.request(target, parts, "model", "", target.dtype)
        if id(param) in groups:
            _request_optimizer_state(reads, param, target, parts, groups[id(param)], stored)
    return reads


def _restore_optimizer(optimizer, reads, saved_groups):
    """Hand the read state to the optimizer (a DistributedOptimizer keeps its shard of the masters and state) and
    restore its param_groups' saved hyperparameters."""
    if _distributed(optimizer):
        for param, master in reads.masters.items():
            optimizer.load_full_state(param, {"param": master, **reads.new_states.get(param, {})})
    elif optimizer is not None:
        for param, new in reads.new_states.items():
            optimizer.state.pop(param, None)
            if new:
                optimizer.state[param] = new
    for group, saved in zip(optimizer.param_groups if optimizer is not None else (), saved_groups or []):
        group.update(saved)


def load(path: str, model: Model, optimizer: torch.optim.Optimizer | None, *, mesh: tp.Mesh,
         load_optimizer: bool = True, load_rng: bool = True) -> tuple[int, Any]:
    """Fill this GPT stage and its optimizer from the checkpoint in `path`, written at any split (collective over
    every rank). Returns (step, extra). Optimizer state is created as torch would have it after `step` steps.

    First every file is checked against the checkpoint's manifest.json (verify_files, the reading shared by the
    ranks), then what was read is checked finite: a corrupt checkpoint raises ValueError (one line, the same on every
    rank) before the model or the optimizer changes. `load_optimizer=False`: the weights only (a DistributedOptimizer's
    fp32 masters too, its state emptied), a torch optimizer's state and hyperparameters left as they are;
    `load_rng=False`: the generators kept."""
    stages = _check(model, optimizer, mesh)
    verify_files(path, mesh)
    meta = _read_meta(path, stages[0], optimizer if load_optimizer else None)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    # on the parameters' device: a DTensor of CPU buffers on a CUDA mesh reads into a GPU copy, never into them
    device_mesh = mesh.flat_device_mesh("tp", next(stages[0].parameters()).device.type)
    reads = _request_parameters(stages, optimizer, stored, device_mesh, states=load_optimizer)
    biases = [(key, bias) for key, bias in _expert_biases(stages) if key in stored]
    for key, bias in biases:
        reads.state[key] = torch.empty_like(bias)
    rng_key = f"rng.{mesh.rank}"
    same_split = meta["split"] == _split(mesh)  # only then does each rank's saved stream still belong to it
    if same_split and load_rng:
        reads.state[rng_key] = None
    dcp.load(reads.state, checkpoint_id=path)
    _check_finite(path, reads, mesh)

    with torch.no_grad():
        for key, bias in biases:
            bias.copy_(reads.state[key])
    reads.copy_in()
    _restore_optimizer(optimizer, reads, meta["param_groups"] if load_optimizer else None)
    if same_split and load_rng:
        tp.set_rng_state(pickle.loads(reads.state[rng_key]))
    return meta["step"], meta["extra"]


def _check_finite(path, reads, mesh):
    """Raise ValueError on every rank, naming the first tensor any rank read with a NaN or an infinity in it."""
    found = [None] * mesh.world_size
    dist.all_gather_object(found, reads.non_finite())
    key = next((k for k in found if k), None)
    if key:
        raise ValueError(f"checkpoint {path}: {key} holds non-finite values (nan or inf): a run that diverged, or "
                         "files damaged before manifests")
