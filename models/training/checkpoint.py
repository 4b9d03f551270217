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

This module saves; beside it checkpoint_parts lays a rank's tensors out as blocks of the HF tensors, checkpoint_load
loads, checkpoint_meta reads and checks a checkpoint's meta and files (their public names importable from here).
"""
import dataclasses
import pickle
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import tp
from tp.pipeline import model_chunks

from . import manifest
from .checkpoint_load import load
from .checkpoint_meta import (
    check_config,
    check_files,
    config_differences,
    has_manifest,
    optimizer_name,
    read_meta,
    split_of,
    verify_files,
)
from .checkpoint_parts import (
    Model,
    checked_stages,
    expert_biases,
    hf_parts,
    is_distributed,
    parameter_shapes,
    stage_parameters,
)

__all__ = ["check_config", "check_files", "config_differences", "has_manifest", "load", "parameter_shapes",
           "read_meta", "save", "verify_files"]


def _tp_local(tensor):
    """The whole tp-local tensor: FSDP2's dp shards gathered."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


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
    stages = checked_stages(model, optimizer, mesh)
    for chunk in model_chunks(model):
        if hasattr(chunk, "finish_param_sync"):  # tp.optim.DataParallel: its parameters' all-gathers complete
            chunk.finish_param_sync()
    # on the tensors' device: a DTensor on a mesh of another device would copy them (async: staged on the CPU)
    device = "cpu" if async_group is not None else next(stages[0].parameters()).device.type
    device_mesh = mesh.flat_device_mesh("tp", device)
    state = {}
    whole = optimizer.full_state() if is_distributed(optimizer) else None  # fp32 masters and state, dp-gathered
    staged = (lambda t: t.detach().to("cpu", copy=True)) if async_group is not None else (lambda t: t)
    for stage, name, module, attr, param in stage_parameters(stages):
        parts = [part for part in hf_parts(stage, name, module, attr, param.shape) if part.held()]
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
    for key, bias in expert_biases(stages):
        state[key] = staged(bias)
    if mesh.rank == 0:
        groups = None if optimizer is None else [{k: v for k, v in g.items() if k != "params"}
                                                 for g in optimizer.param_groups]
        meta = dict(step=step, split=split_of(mesh), config=dataclasses.asdict(stages[0].config), extra=extra,
                    optimizer=None if optimizer is None else optimizer_name(optimizer), param_groups=groups)
        state["meta"] = pickle.dumps(meta)
    state[f"rng.{mesh.rank}"] = pickle.dumps(tp.get_rng_state())
    storage_writer = storage_writer or manifest.ManifestWriter(path)
    if async_group is None:
        dcp.save(state, checkpoint_id=path, storage_writer=storage_writer)
        return None
    return dcp.async_save(state, checkpoint_id=path, storage_writer=storage_writer, process_group=async_group,
                          async_stager=_Staged())
