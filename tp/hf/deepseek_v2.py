"""DeepSeek-V2 (`deepseek_v2`): DeepSeek-V3's multi-head latent attention, RoPE always on interleaved pairs (its
complex-number rotation), and softmax routing: greedy top-k, or group-limited ("group_limited_greedy": a group scored
by its best expert), the weights times routed_scaling_factor and never renormalised (transformers' DeepseekV2TopkRouter
reads no norm_topk_prob), no selection bias; shared experts, the first first_k_dense_replace layers dense."""
from typing import Any

from .deepseek_v3 import DeepseekV3


class DeepseekV2(DeepseekV3):
    config_class = "DeepseekV2Config"
    title = "DeepSeek-V2"
    experts_field = "n_routed_experts"
    score = "softmax"
    norm_topk_field = None  # (fixed below: never renormalised)

    def config_fields(self, hf: Any) -> dict[str, Any]:
        fields = super().config_fields(hf) | dict(moe_router_norm_topk=False, mtp_num_layers=0)
        if hf.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method={hf.topk_method!r} is not supported (greedy or group_limited_greedy)")
        if hf.topk_method == "greedy":
            fields |= dict(moe_router_num_groups=1, moe_router_group_topk=None)
        return fields

    def interleaved(self, hf: Any) -> bool:
        return True

    def moe_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        c = config
        return super().moe_checks(c) + [
            (not c.moe_router_norm_topk, "moe_router_norm_topk", "the top-k weights not renormalised"),
            (c.mtp_num_layers == 0, "mtp_num_layers", "no multi-token prediction")]

    def dense_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        return super().dense_checks(config) + [(config.rope_interleave, "rope_interleave", "interleaved RoPE")]

    def config_kwargs(self, config: Any) -> dict[str, Any]:
        c = config
        kwargs = super().config_kwargs(c) | dict(
            topk_method="group_limited_greedy" if c.moe_router_num_groups > 1 else "greedy", norm_topk_prob=False)
        for name in ("rope_interleave", "num_nextn_predict_layers"):  # (not DeepseekV2Config's)
            del kwargs[name]
        return kwargs


DEEPSEEK_V2 = DeepseekV2("deepseek_v2")
