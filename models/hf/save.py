"""Hugging Face weights out: the shards gathered over tp into dense HF tensors (hf_state_dict), and a
`save_pretrained` directory written on tp rank 0 (config.json + safetensors, one file per pipeline stage, with an
index)."""
import copy
import json
import os
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import tp
import tp.hf
from tp.moe import GroupedExperts
from tp.pipeline import model_chunks

from .convert import check_hf, config_to_hf, hf_family
from .experts import to_disk
from .load import TOKEN_IDS
from .names import fused_part_size, hf_sources, parameter_owners, router_biases, tp_sharding


def _gather_dense(module, attr, group, grads=False):
    """The full dense parameter (or its grad) on every rank of the tp group (all-gather of the shards, back in
    dense order; replicated chunks carry equal values)."""
    param, sharding = getattr(module, attr), tp_sharding(module, attr)
    param = param.grad if grads else param.detach()
    if hasattr(param, "full_tensor"):  # FSDP2: this rank's dp shard of the tp-local tensor
        param = param.full_tensor()
    if isinstance(module, GroupedExperts):  # over etp and ep, the module's own groups
        return module.gather_dense(param, attr)
    size = dist.get_world_size(group)
    if sharding is None or size == 1:
        return param
    dim, total, indices = sharding
    shards = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(shards, param.contiguous(), group=group)
    every_index = [torch.empty_like(indices) for _ in range(size)]
    dist.all_gather(every_index, indices, group=group)
    dense = param.new_zeros([total if d == dim else n for d, n in enumerate(param.shape)])
    return dense.index_copy_(dim, torch.cat(every_index).to(param.device), torch.cat(shards, dim))


def hf_state_dict(model: nn.Module, group: dist.ProcessGroup | None = None, *,
                  grads: bool = False) -> dict[str, torch.Tensor]:
    """This model's (or stage's) parameters (or, `grads`, their gradients) as HF tensors, dense (gathered over
    tp): {hf name: tensor}."""
    group = tp.mesh.resolve_group(group)
    config, out = model.config, {}
    gated = len(tp.hf.FAMILIES[hf_family(config)].layer_modules["mlp.fc1"]) > 1  # fc1 is gate|up in HF's
    if gated and config.activation != "swiglu":  # no gate to split fc1 into
        check_hf(config)  # raises, naming the activation (before any gather)
    offset = model.layer_range[0]
    for name, (module, attr) in parameter_owners(model).items():
        if name == "output.weight" and config.tie_embeddings:
            continue  # HF ties lm_head to the input embedding and stores it once
        dense = _gather_dense(module, attr, group, grads)
        if name in ("embedding.weight", "output.weight"):
            dense = dense[:config.vocab_size]  # drop the padding rows
        sources = hf_sources(config, name, offset)
        sizes = [fused_part_size(config, n) for n, _ in sources]
        dim = 1 if name.endswith("proj.weight") or name.endswith("fc2.weight") else 0
        for (hf_name, transposed), piece in zip(sources, dense.split(sizes, dim) if len(sources) > 1 else [dense]):
            out[hf_name] = (piece.t() if transposed else piece).contiguous().cpu()
    if not grads:
        out |= {name: bias.detach().cpu() for name, bias in router_biases(model)}
    return out


def save_hf(model: nn.Module | list[nn.Module], path: str | os.PathLike, *, group: dist.ProcessGroup | None = None,
            pp_group: dist.ProcessGroup | None = None, dp_group: dist.ProcessGroup | None = None,
            tokenizer: Any = None) -> None:
    """Write `path` (config.json + safetensors) for transformers.AutoModelForCausalLM.from_pretrained.

    Called on every rank with its stage, or its list of model chunks (interleaved pipelines: chunk c of pipeline
    rank r is virtual stage c·p + r); tp rank 0 of each pipeline rank writes one file per stage it holds (`pp_group`:
    the mesh's pipeline group, when the model is split over several ranks), numbered in virtual-stage (layer) order;
    global pipeline stage 0 writes the config and the index; with `dp_group`, only data-parallel replica 0 writes
    (the others hold the same weights). `tokenizer` (the one the model was trained with, a transformers tokenizer):
    its files are written too, and the config's bos/eos/pad token ids are its own (not the family's defaults), so
    `generate` on the export stops where the training data's documents end. Files get the umask's usual mode.
    """
    from safetensors.torch import save_file

    chunks = model_chunks(model)
    hf_config = config_to_hf(chunks[0].config)  # every rank, before any collective or write: the same error on all
    source_ids = getattr(chunks[0], "hf_token_ids", None)  # (a model from_hf read: its source's ids, where they
    if tokenizer is not None or source_ids:  # are tokens of this vocabulary)
        for name in TOKEN_IDS:
            token = getattr(tokenizer, name, None) if tokenizer is not None else source_ids[name]
            valid = tokenizer is not None or all(0 <= t < hf_config.vocab_size for t in
                                                 (token if isinstance(token, list) else [token]) if t is not None)
            setattr(hf_config, name, token if valid else None)
    group = tp.mesh.resolve_group(group)
    family = hf_family(chunks[0].config)
    tensors = [to_disk(hf_state_dict(chunk, group), family) for chunk in chunks]  # (experts: per expert)
    ranks = dist.get_world_size(pp_group) if pp_group is not None else 1
    rank = dist.get_rank(pp_group) if pp_group is not None else 0
    names = [[sorted(t) for t in tensors]]  # per pipeline rank, per chunk
    if pp_group is not None:
        names = [None] * ranks
        dist.all_gather_object(names, [sorted(t) for t in tensors], group=pp_group)
    if dist.get_rank(group) != 0 or (dp_group is not None and dist.get_rank(dp_group) != 0):
        return
    stages = ranks * len(chunks)
    files = ["model.safetensors"] if stages == 1 else \
        [f"model-{s + 1:05d}-of-{stages:05d}.safetensors" for s in range(stages)] + ["model.safetensors.index.json"]
    os.makedirs(path, exist_ok=True)
    if rank == 0:  # an earlier export's weight files that this one does not write: transformers could load them
        for stale in set(os.listdir(path)) - set(files):
            if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", stale):
                os.remove(os.path.join(path, stale))
    mode = 0o666 & ~_umask()  # (safetensors writes 0600: the same mode as the config's instead)
    for c, chunk_tensors in enumerate(tensors):
        save_file(chunk_tensors, os.path.join(path, files[c * ranks + rank]), metadata={"format": "pt"})
        os.chmod(os.path.join(path, files[c * ranks + rank]), mode)
    if rank == 0:
        hf_config.save_pretrained(path)
        generation = getattr(chunks[0], "hf_generation_config", None)
        if generation is not None:  # (written as it is: transformers' save_pretrained may refuse a config it loads)
            generation = copy.deepcopy(generation)
            for name in TOKEN_IDS:  # (generate reads the ids from here: the config's, the tokenizer's if given)
                setattr(generation, name, getattr(hf_config, name))
            generation.to_json_file(os.path.join(path, "generation_config.json"))
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        if stages > 1:
            weight_map = {n: files[c * ranks + r] for r, per_chunk in enumerate(names)
                          for c, ns in enumerate(per_chunk) for n in ns}
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask
