"""Hugging Face weights in: each of our parameters read from the HF tensors it is made of, only the rows/columns
this rank holds: from a live model's state_dict, or lazily from a `save_pretrained` directory with safetensors'
`get_slice`."""
import json
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

import tp
from tp.moe import GroupedExperts
from tp.state_dict import index_runs

from .convert import config_from_hf, hf_family
from .experts import disk_name, read_experts
from .names import hf_sources, parameter_owners, router_biases, tp_sharding

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class _StateDictReader:
    def __init__(self, state):
        self.state = state

    def has(self, name):
        return name in self.state

    def shape(self, name):
        return tuple(self.state[name].shape)

    def read(self, name, dim=None, start=None, stop=None):
        t = self.state[name].detach()
        return t if dim is None else t.narrow(dim, start, stop - start)


class _SafetensorsReader:
    """Lazy reads from a save_pretrained directory: only the requested rows/columns leave the file."""

    def __init__(self, path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
        else:
            single = os.path.join(path, "model.safetensors")
            if not os.path.exists(single):
                raise ValueError(f"{path} holds no model.safetensors (or index): save it with safetensors")
            files = dict.fromkeys(_open(single).keys(), "model.safetensors")
        opened = {name: _open(os.path.join(path, name)) for name in set(files.values())}
        self.files = {k: opened[v] for k, v in files.items()}

    def has(self, name):
        return name in self.files

    def shape(self, name):
        return tuple(self.files[name].get_slice(name).get_shape())

    def read(self, name, dim=None, start=None, stop=None):
        piece = self.files[name].get_slice(name)
        if dim is None:
            return piece[:]
        return piece[start:stop] if dim == 0 else piece[:, start:stop]


def _open(file: str) -> Any:
    """safe_open(file), or a one-line ValueError naming it (missing, its header cut or corrupt, its data cut short:
    safetensors checks the header covers the file exactly)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, "pt")
    except (SafetensorError, FileNotFoundError) as e:
        raise ValueError(f"{file} is not a whole safetensors file: {e}") from None


def check_safetensors(path: str) -> None:
    """Raise a one-line ValueError naming the file unless `path` is a save_pretrained directory whose every
    safetensors file opens whole: checked before any process starts (models.train and models.generate --from-hf)."""
    if not os.path.isdir(path):
        raise ValueError("no such directory (a save_pretrained directory)")
    _SafetensorsReader(path)


def _read_dense_slice(reader, sources, dim, indices):
    """The rows/columns `indices` (along our `dim`) of the concatenation of `sources`; indices past its end (a
    padded vocabulary) give zeros."""
    pieces, offset_of = [], []
    offset = 0
    for name, transposed in sources:
        shape = reader.shape(name)
        size = shape[(1 - dim) if transposed else dim]
        offset_of.append((name, transposed, offset, size, shape))
        offset += size
    for start, stop in index_runs(indices):
        for name, transposed, base, size, _shape in offset_of:
            a, b = max(start, base), min(stop, base + size)
            if a < b:
                src_dim = (1 - dim) if transposed else dim
                t = reader.read(name, src_dim, a - base, b - base)
                pieces.append(t.t() if transposed else t)
        if stop > offset:  # padding rows
            ref = pieces[-1] if pieces else reader.read(sources[0][0])
            width = ref.shape[1 - dim]
            missing = stop - max(start, offset)
            zeros = ref.new_zeros((missing, width) if dim == 0 else (width, missing))
            pieces.append(zeros)
    return torch.cat(pieces, dim)


@torch.no_grad()
def load_hf_weights(model: nn.Module, reader: Any) -> None:
    """Copy this rank's shard of every parameter (of this stage's layers) from the HF tensors behind `reader`."""
    family = hf_family(model.config)
    for name, (module, attr) in parameter_owners(model).items():
        param = getattr(module, attr)
        sources = [(n if reader.has(n) else disk_name(n, family), t)
                   for n, t in hf_sources(model.config, name, model.layer_range[0])]
        missing = [n for n, _ in sources if not reader.has(n)]
        if missing and not isinstance(module, GroupedExperts):  # (experts: maybe per expert on disk)
            raise ValueError(f"{name}: the Hugging Face weights hold no {missing[0]}")
        sharding = tp_sharding(module, attr)
        if isinstance(module, GroupedExperts):  # this rank's experts, then its etp slice
            dense = read_experts(reader, sources[0][0], module.expert_range, family)
            dense = module.shard_fc1(dense) if attr == module.names[0] else module.shard_fc2(dense)
        elif sharding is None:
            dense = torch.cat([reader.read(n).t() if t else reader.read(n) for n, t in sources])
        else:
            dim, _, indices = sharding
            dense = _read_dense_slice(reader, sources, dim, indices)
        if tuple(dense.shape) != tuple(param.shape):
            raise ValueError(f"{name}: HF tensors {[n for n, _ in sources]} give shape {tuple(dense.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.copy_(dense)
    for name, bias in router_biases(model):  # (a checkpoint without them: zeros, as transformers initialises them)
        if reader.has(name):
            bias.copy_(reader.read(name))


def _first_mtp_tensor(config):
    return hf_sources(config, "mtp.0.proj.weight")[0][0]


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _generation_config(path):
    """The directory's generation_config.json as a transformers GenerationConfig, or None."""
    if not os.path.isfile(os.path.join(path, "generation_config.json")):
        return None
    import transformers

    return transformers.GenerationConfig.from_pretrained(path)


def load_hf(cls: type[nn.Module], hf_model_or_path: "PreTrainedModel | str | os.PathLike", *,
            group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
            stage: dict[str, Any] | None = None, **overrides: Any) -> nn.Module:
    """`stage`: GPT options of one pipeline stage (layers, pre_process, post_process); `overrides`: GPTConfig fields."""
    if isinstance(hf_model_or_path, (str, os.PathLike)):
        if not os.path.isdir(hf_model_or_path):
            raise ValueError(f"from_hf {os.fspath(hf_model_or_path)}: no such directory (from_hf reads a directory "
                             "save_pretrained wrote)")
        import transformers

        hf_config = transformers.AutoConfig.from_pretrained(hf_model_or_path)
        generation = _generation_config(hf_model_or_path)
        config = config_from_hf(hf_config, **overrides)
        reader = _SafetensorsReader(hf_model_or_path)
    else:
        hf_config, generation = hf_model_or_path.config, getattr(hf_model_or_path, "generation_config", None)
        config = config_from_hf(hf_config, **overrides)
        # the dense tensors of a model tp.parallelize split (a collective over its tp group) or FSDP2 shards
        reader = _StateDictReader(tp.full_state_dict(hf_model_or_path))
    if config.mtp_num_layers and "mtp_num_layers" not in overrides and not reader.has(_first_mtp_tensor(config)):
        config = config.replace(mtp_num_layers=0)  # (a config naming MTP layers whose weights were left out)
    model = cls(config, group=group, _init=False, **(stage or {}))
    load_hf_weights(model, reader)
    # what save_hf writes back: the source's token ids (not the family's defaults) and its generation settings
    model.hf_token_ids = {name: getattr(hf_config, name, None) for name in TOKEN_IDS}
    model.hf_generation_config = generation
    return model if dtype is None else model.to(dtype)
