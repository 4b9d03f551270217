"""GLM-4.5 (`glm4_moe`): Llama's attention with q/k/v biases as attention_bias says (o_proj never has one), RoPE on
the first partial_rotary_factor of each head (0.5), optional q/k RMSNorm over each head (use_qk_norm), and DeepSeek-V3's
mixture of experts (tp/hf/deepseek_v3.py's DeepseekMoE)."""
from typing import Any

from .deepseek_v3 import DENSE_MODULES, DeepseekMoE
from .llama import Llama


class Glm4Moe(DeepseekMoE):
    config_class = "Glm4MoeConfig"
    title = "GLM-4.5"
    # HF's plan splits the heads but leaves the per-head q/k norms out: their weights, shared by the heads, see this
    # rank's heads only, so their grads are summed over tp (as Qwen3's plan says)
    plan_additions = {"layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                      "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"}
    layer_modules = {**DENSE_MODULES, **{k: v for k, v in Llama.layer_modules.items() if k.startswith("attention")}}

    def attention_bias(self, hf: Any) -> bool:
        return False

    def qkv_bias(self, hf: Any) -> bool:
        return bool(hf.attention_bias)

    def config_fields(self, hf: Any) -> dict[str, Any]:
        rotary = (getattr(hf, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        return super().config_fields(hf) | dict(qk_norm="head" if hf.use_qk_norm else None,
                                                rotary_percent=float(rotary))

    def dense_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        c = config
        return [*super().dense_checks(c), (not c.rope_interleave, "rope_interleave", "RoPE on halves"),
                (not c.multi_latent_attention, "multi_latent_attention", "GQA"),
                (c.qk_norm in (None, "head"), "qk_norm", "q/k norms over each head, or none")]

    def bias_window_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        return [(not config.bias, "bias", "biases on q/k/v only (qkv_bias)"),
                (config.sliding_window is None, "sliding_window", "no sliding window")]

    def config_kwargs(self, config: Any) -> dict[str, Any]:
        c = config
        rope = {"rope_type": "default", "rope_theta": c.rope_theta, "partial_rotary_factor": c.rotary_percent}
        return super().config_kwargs(c) | dict(
            num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, attention_bias=c.qkv_bias,
            use_qk_norm=c.qk_norm == "head", rope_parameters=rope)


GLM4_MOE = Glm4Moe("glm4_moe")
