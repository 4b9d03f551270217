"""Hugging Face tensor names: which HF tensors (q|k|v fused into our QKV, gate|up into fc1, GPT-2's Conv1D
[in, out] transposed) each of our parameters concatenates, as its family names them (tp.hf.FAMILIES), and which
rows/columns of it this rank holds."""
import torch
from torch import nn

import tp.hf
from tp.embedding import VocabParallelEmbedding
from tp.hf.family import MTP_MODULES
from tp.layers import ColumnParallelLinear, RowParallelLinear
from tp.moe import TopKRouter

from ..block import FullQKNorm
from ..config import GPTConfig
from .convert import hf_family

# our fused layer parameters (by layer module or parameter) -> the sizes of their parts along the fused dim
_FUSED = {"attention.qkv": lambda c: (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                      c.num_kv_heads * c.head_dim),
          "mlp.fc1": lambda c: (c.ffn_hidden_size,) * 2,
          "mlp.shared.fc1.weight": lambda c: (c.moe_shared_expert_size,) * 2}


def hf_sources(config: GPTConfig, name: str, layer_offset: int = 0) -> list[tuple[str, bool]]:
    """([(hf name, transposed)], ...) concatenated along our shard dim make our parameter `name` (dense)."""
    family = tp.hf.FAMILIES[hf_family(config)]
    root = family.root
    if name == "embedding.weight" or (name == "output.weight" and config.tie_embeddings):
        return [(f"{root}.{family.embedding}.weight", False)]
    if name == "output.weight":
        return [(f"{family.output}.weight", False)]
    if name == "position_embedding.weight":
        return [(f"{root}.{family.position_embedding}.weight", False)]
    if name.startswith("final_norm."):
        return [(f"{root}.{family.final_norm}.{name.split('.')[-1]}", False)]
    if name.startswith("mtp."):  # mtp.<k>.<module>.<kind>: under the layer after the last (DeepSeek-V3's layout)
        _, depth, local = name.split(".", 2)
        layer = config.num_layers + int(depth)
        if local.startswith("block."):
            return hf_sources(config, f"layers.{layer}.{local.removeprefix('block.')}")
        module, _, kind = local.rpartition(".")
        return [(f"{root}.{family.layers}.{layer}.{MTP_MODULES[module]}.{kind}", False)]
    _, index, local = name.split(".", 2)  # layers.<i>.<local>
    block = f"{root}.{family.layers}.{int(index) + layer_offset}"
    if local in family.layer_tensors:
        return [(f"{block}.{part}", False) for part in family.layer_tensors[local]]
    module, _, kind = local.rpartition(".")  # kind: weight / bias
    transposed = family.conv1d and kind == "weight" and "norm" not in local.split(".")[0]
    return [(f"{block}.{part}.{kind}", transposed) for part in family.layer_modules[module]]


def parameter_owners(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Our parameter name -> (module, attribute) for every parameter (tied ones under each name)."""
    owners = {}
    for module_name, module in model.named_modules():
        for attr, _ in module.named_parameters(recurse=False):
            owners[f"{module_name}.{attr}" if module_name else attr] = (module, attr)
    return owners


def router_biases(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(HF name, buffer) of every sigmoid router's selection bias of `model` (DeepSeek-V3's, a buffer updated from
    the loads, not a parameter): beside the router's weight, `…mlp.gate.e_score_correction_bias`."""
    out = []
    for name, (module, _) in parameter_owners(model).items():
        if isinstance(module, TopKRouter) and module.expert_bias is not None:
            (weight, _), = hf_sources(model.config, name, model.layer_range[0])
            out.append((weight.rsplit(".", 1)[0] + ".e_score_correction_bias", module.expert_bias))
    return out


def tp_sharding(module: nn.Module, attr: str) -> tuple[int, int, torch.Tensor] | None:
    """(dim, dense size along it, dense indices this rank holds) for a sharded parameter; None if replicated."""
    if isinstance(module, VocabParallelEmbedding):
        return 0, module.num_embeddings, torch.arange(module.vocab_start, module.vocab_end, device="cpu")
    if isinstance(module, ColumnParallelLinear) or (isinstance(module, RowParallelLinear) and attr == "weight"):
        dim = module.shard_dim if attr == "weight" else 0
        return dim, (module.out_features, module.in_features)[module.shard_dim], module.shard_indices()
    if isinstance(module, FullQKNorm):
        return 0, module.width, module.shard_indices()
    return None  # (GroupedExperts' 3-D weights are read and gathered by expert: load.py, save.py)


def fused_part_size(config: GPTConfig, hf_name: str) -> int:
    """Along our fused dim, the size of one HF tensor that is part of a fused parameter (0: not such a part)."""
    family = tp.hf.FAMILIES[hf_family(config)]
    module = hf_name.rpartition(".")[0]  # (a layer module's tensor: without .weight / .bias)
    for ours, parts in (*family.layer_modules.items(), *family.layer_tensors.items()):
        if ours in _FUSED and len(parts) > 1:
            for part, size in zip(parts, _FUSED[ours](config)):
                if hf_name.endswith(f".{part}") or module.endswith(f".{part}"):
                    return size
    return 0
