"""Phi3 (`phi3`), for tp.parallelize only: fused qkv_proj and gate_up_proj. HF's own plan gathers their outputs on
every rank (and computes every head everywhere); tp's keeps them local, the fused parts sharded separately."""
from torch import nn

from .family import Family, LocalHeadsConfig


class Phi3(Family):
    plan = {"layers.*.self_attn.qkv_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.gate_up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    heads = {"qkv_proj": "qkv"}
    fused_mlp = {"gate_up_proj": 2}

    def localize(self, attention: nn.Module, heads: int, kv_heads: int) -> None:
        super().localize(attention, heads, kv_heads)
        attention.num_key_value_heads = kv_heads  # slices the fused qkv output
        attention.config = LocalHeadsConfig(attention.config, num_attention_heads=heads, num_key_value_heads=kv_heads)


PHI3 = Phi3("phi3")
