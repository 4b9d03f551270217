"""Loading a checkpoint (models.training.checkpoint's `load`): each rank asks DCP for the blocks of its own layout,
checks them finite on every rank, then fills the model, the optimizer state and the RNG."""
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor

import tp

from .checkpoint_meta import check_config, optimizer_name, read_meta, split_of, verify_files
from .checkpoint_parts import Model, checked_stages, expert_biases, hf_parts, is_distributed, stage_parameters


@torch.no_grad()
def _assign(target, value):
    """Copy a tp-local tensor into `target` (an FSDP2 DTensor keeps only its dp shard)."""
    if isinstance(target, DTensor):
        value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    target.copy_(value)


def _read_meta(path, model, optimizer):
    """The checkpoint's meta, read by this rank alone; raises if it does not fit the model and optimizer (None: the
    optimizer's state is not loaded)."""
    meta = read_meta(path)
    check_config(meta["config"], model.config, path)
    if optimizer is not None and meta["optimizer"] is not None:
        if optimizer_name(optimizer) != meta["optimizer"]:
            raise ValueError(f"checkpoint {path!r} holds {meta['optimizer']} state, not {optimizer_name(optimizer)}")
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
    if is_distributed(optimizer):
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
    for stage, name, module, attr, param in stage_parameters(stages):
        parts = hf_parts(stage, name, module, attr, param.shape)
        target = param
        if is_distributed(optimizer):  # the fp32 master (and, through it, a bf16 parameter) from the stored fp32 values
            target = reads.masters[param] = torch.zeros(param.shape, dtype=optimizer.masters_dtype,
                                                        device=param.device)
        reads.request(target, parts, "model", "", target.dtype)
        if id(param) in groups:
            _request_optimizer_state(reads, param, target, parts, groups[id(param)], stored)
    return reads


def _restore_optimizer(optimizer, reads, saved_groups):
    """Hand the read state to the optimizer (a DistributedOptimizer keeps its shard of the masters and state) and
    restore its param_groups' saved hyperparameters."""
    if is_distributed(optimizer):
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
    stages = checked_stages(model, optimizer, mesh)
    verify_files(path, mesh)
    meta = _read_meta(path, stages[0], optimizer if load_optimizer else None)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    # on the parameters' device: a DTensor of CPU buffers on a CUDA mesh reads into a GPU copy, never into them
    device_mesh = mesh.flat_device_mesh("tp", next(stages[0].parameters()).device.type)
    reads = _request_parameters(stages, optimizer, stored, device_mesh, states=load_optimizer)
    biases = [(key, bias) for key, bias in expert_biases(stages) if key in stored]
    for key, bias in biases:
        reads.state[key] = torch.empty_like(bias)
    rng_key = f"rng.{mesh.rank}"
    same_split = meta["split"] == split_of(mesh)  # only then does each rank's saved stream still belong to it
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
