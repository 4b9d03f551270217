"""`MoE`: a Llama-style decoder whose MLPs are mixtures of experts, the base of the MoE families' modules.

transformers 5 holds each layer's experts fused in memory (`mlp.experts.gate_up_proj` [E, 2F, h], gate rows first,
and `mlp.experts.down_proj` [E, h, F], the router at `mlp.gate.weight` [E, h]: family.MOE_TENSORS) and writes them
to disk per expert, as the published checkpoints hold them (`experts_on_disk`: Mixtral's
`block_sparse_moe.experts.{e}.w1` gate, `w3` up, `w2` down and `block_sparse_moe.gate`; the others'
`mlp.experts.{e}.{gate,up,down}_proj`). models.hf reads either layout, each rank only its experts, and writes the
per-expert one (which transformers 4 reads too).
"""
from typing import Any

from .llama import Llama


class MoE(Llama):
    qk_norm: str | None = None  # the GPT's qk_norm: "head" (over each head) or "full" (over the projection)
    shared_expert = False  # an always-on FFN beside the experts, times a sigmoid gate
    layer_pattern = False  # experts on some layers only
    experts_field = "num_experts"  # the config's number of experts
    norm_topk_field: str | None = "norm_topk_prob"  # whether the top-k weights are renormalised; None: always

    def config_fields(self, hf: Any) -> dict[str, Any]:
        fields = super().config_fields(hf)
        if getattr(hf, "router_jitter_noise", 0.0):
            raise ValueError(f"router_jitter_noise={hf.router_jitter_noise} is not supported (0: none)")
        if getattr(hf, "clip_qkv", None) is not None:
            raise ValueError(f"clip_qkv={hf.clip_qkv} is not supported (None: no clipping)")
        renormalise = self.norm_topk_field is None or bool(getattr(hf, self.norm_topk_field))
        return fields | self.expert_fields(hf) | dict(
            num_experts=getattr(hf, self.experts_field), moe_router_topk=hf.num_experts_per_tok,
            moe_router_norm_topk=renormalise, qk_norm=self.qk_norm)

    def expert_fields(self, hf: Any) -> dict[str, Any]:
        """The experts' FFN (and which layers have experts, the shared expert)."""
        return dict(moe_ffn_hidden_size=hf.intermediate_size)

    def moe_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        c, shared = config, self.shared_expert
        every = c.moe_layer_freq == 1 or c.moe_layer_freq == [1] * c.num_layers
        return [(c.num_experts > 0, "num_experts", "a mixture of experts"),
                (c.moe_router_score == "softmax", "moe_router_score", "softmax routing"),
                (c.moe_router_norm_topk or self.norm_topk_field is not None, "moe_router_norm_topk",
                 "the top-k weights renormalised"),
                (c.qk_norm == self.qk_norm, "qk_norm", f"'{self.qk_norm}'" if self.qk_norm else "none"),
                (every or self.layer_pattern, "moe_layer_freq", "experts in every layer"),
                (bool(c.moe_shared_expert_size) == shared, "moe_shared_expert_size",
                 "a shared expert" if shared else "no shared expert"),
                (c.moe_shared_expert_gate == shared, "moe_shared_expert_gate",
                 "its sigmoid gate" if shared else "none")]

    def config_kwargs(self, config: Any) -> dict[str, Any]:
        c = config
        norm = {self.norm_topk_field: c.moe_router_norm_topk} if self.norm_topk_field else {}
        return super().config_kwargs(c) | {self.experts_field: c.num_experts, "num_experts_per_tok": c.moe_router_topk,
                                           **norm, "router_aux_loss_coef": c.moe_aux_loss_coeff}

    def intermediate_size(self, config: Any) -> int:
        return config.moe_ffn_hidden_size  # (the experts' FFN: the families here without a dense one)
