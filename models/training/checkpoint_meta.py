"""A checkpoint's meta and files, read without loading it: the split and optimizer it records, its GPTConfig checked
against a model's, its `.metadata` and shard files checked for damage (and against manifest.json's sizes and
CRC-32s)."""
import dataclasses
import os
import pickle
import warnings
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tp

from ..config import RUNTIME_FIELDS, TRAINING_FIELDS, GPTConfig
from . import manifest
from .checkpoint_parts import is_distributed


def optimizer_name(optimizer):
    """The torch optimizer's class name the meta records (a DistributedOptimizer's inner one)."""
    return type(optimizer.optimizer if is_distributed(optimizer) else optimizer).__name__


def split_of(mesh):
    """The split the meta records: RNG streams are restored only at the same one."""
    split = dict(world_size=mesh.world_size, order="-".join(mesh.order), **mesh.sizes)
    if mesh.ep_size > 1 or mesh.etp_size != mesh.tp_size:  # (the expert layout, where it differs)
        split.update(ep=mesh.ep_size, etp=mesh.etp_size)
    return split


def config_differences(saved: dict, config: GPTConfig) -> dict[str, tuple[Any, Any]]:
    """{field: (the checkpoint's value, `config`'s)} of the GPTConfig fields that define weights and differ: runtime
    and training fields may differ, and max_seq_len too unless positions are learned (RoPE holds no position
    weights)."""
    free = RUNTIME_FIELDS + TRAINING_FIELDS + (() if config.position == "learned" else ("max_seq_len",))
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
