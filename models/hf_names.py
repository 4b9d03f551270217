"""Hugging Face tensor names: which HF tensors (q|k|v fused into our QKV, gate|up into fc1, GPT-2's Conv1D
[in, out] transposed) each of our parameters concatenates, and which rows/columns of it this rank holds."""
import torch
from torch import nn

from tp.embedding import VocabParallelEmbedding
from tp.layers import ColumnParallelLinear, RowParallelLinear

from .block import FullQKNorm
from .config import GPTConfig
from .hf_config import hf_family
from .hf_moe import moe_sources


def hf_sources(config: GPTConfig, name: str, layer_offset: int = 0) -> list[tuple[str, bool]]:
    """([(hf name, transposed)], ...) concatenated along our shard dim make our parameter `name` (dense)."""
    gpt2 = hf_family(config) == "gpt2"
    root = "transformer" if gpt2 else "model"
    embed = f"{root}.wte.weight" if gpt2 else f"{root}.embed_tokens.weight"
    if name == "embedding.weight" or (name == "output.weight" and config.tie_embeddings):
        return [(embed, False)]
    if name == "output.weight":
        return [("lm_head.weight", False)]
    if name == "position_embedding.weight":
        return [(f"{root}.wpe.weight", False)]
    if name.startswith("final_norm."):
        return [(f"{root}.{'ln_f' if gpt2 else 'norm'}.{name.split('.')[-1]}", False)]
    _, index, module, *rest = name.split(".")  # layers.<i>.<module>...
    block = f"{root}.{'h' if gpt2 else 'layers'}.{int(index) + layer_offset}"
    moe = moe_sources(".".join([module, *rest]), block)
    if moe is not None:
        return moe
    kind = rest[-1]  # weight / bias
    if gpt2:
        local = {"norm1": "ln_1", "norm2": "ln_2", "attention.qkv": "attn.c_attn", "attention.proj": "attn.c_proj",
                 "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}[".".join([module, *rest[:-1]])]
        return [(f"{block}.{local}.{kind}", kind == "weight" and "norm" not in module)]
    local = {"norm1": ["input_layernorm"], "norm2": ["post_attention_layernorm"],
             "attention.qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             "attention.proj": ["self_attn.o_proj"], "mlp.fc1": ["mlp.gate_proj", "mlp.up_proj"],
             "mlp.fc2": ["mlp.down_proj"]}[".".join([module, *rest[:-1]])]
    return [(f"{block}.{part}.{kind}", False) for part in local]


def parameter_owners(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Our parameter name -> (module, attribute) for every parameter (tied ones under each name)."""
    owners = {}
    for module_name, module in model.named_modules():
        for attr, _ in module.named_parameters(recurse=False):
            owners[f"{module_name}.{attr}" if module_name else attr] = (module, attr)
    return owners


def tp_sharding(module: nn.Module, attr: str) -> tuple[int, int, torch.Tensor] | None:
    """(dim, dense size along it, dense indices this rank holds) for a sharded parameter; None if replicated."""
    if isinstance(module, VocabParallelEmbedding):
        return 0, module.num_embeddings, torch.arange(module.vocab_start, module.vocab_end)
    if isinstance(module, ColumnParallelLinear) or (isinstance(module, RowParallelLinear) and attr == "weight"):
        dim = module.shard_dim if attr == "weight" else 0
        return dim, (module.out_features, module.in_features)[module.shard_dim], module.shard_indices()
    if isinstance(module, FullQKNorm):
        return 0, module.width, module.shard_indices()
    return None  # (GroupedExperts' 3-D weights are read and gathered by expert: hf_load.py, hf_save.py)


def fused_part_size(config: GPTConfig, hf_name: str) -> int:
    """Along our fused dim, the size of one HF tensor that is part of a fused parameter."""
    c = config
    part = hf_name.split(".")[-2]
    ffn = c.moe_shared_expert_size if ".shared_expert." in hf_name else c.ffn_hidden_size
    return {"q_proj": c.num_heads * c.head_dim, "k_proj": c.num_kv_heads * c.head_dim,
            "v_proj": c.num_kv_heads * c.head_dim, "gate_proj": ffn, "up_proj": ffn}.get(part, 0)
