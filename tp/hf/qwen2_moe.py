"""Qwen2-MoE (`qwen2_moe`): Qwen2's attention (q/k/v biases, per its qkv_bias), a shared expert with a sigmoid gate,
experts on the layers its decoder_sparse_step and mlp_only_layers say. `QwenMoE`: what Qwen3-MoE shares with it."""
from typing import Any

from .moe import MoE
from .qwen2 import every_layer_window


class QwenMoE(MoE):
    layer_pattern = True

    def expert_fields(self, hf: Any) -> dict[str, Any]:
        step, dense = hf.decoder_sparse_step, set(hf.mlp_only_layers or [])
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(hf.num_hidden_layers)]
        return dict(moe_ffn_hidden_size=hf.moe_intermediate_size,
                    moe_layer_freq=1 if pattern == [1] * hf.num_hidden_layers else pattern)

    def config_kwargs(self, config: Any) -> dict[str, Any]:
        c = config
        pattern = [int(c.is_moe_layer(i)) for i in range(c.num_layers)]
        return super().config_kwargs(c) | dict(moe_intermediate_size=c.moe_ffn_hidden_size, decoder_sparse_step=1,
                                               mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])

    def intermediate_size(self, config: Any) -> int:
        return config.ffn_hidden_size  # the dense layers' (moe_intermediate_size: the experts')


class Qwen2Moe(QwenMoE):
    config_class = "Qwen2MoeConfig"
    title = "Qwen2-MoE"
    shared_expert = True

    def attention_bias(self, hf: Any) -> bool:
        return False

    def qkv_bias(self, hf: Any) -> bool:
        return bool(getattr(hf, "qkv_bias", True))

    def expert_fields(self, hf: Any) -> dict[str, Any]:
        return super().expert_fields(hf) | dict(moe_shared_expert_size=hf.shared_expert_intermediate_size,
                                                moe_shared_expert_gate=True)

    def bias_window_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        return [(not config.bias, "bias", "biases on q/k/v only (qkv_bias)")]

    def bias_window_kwargs(self, config: Any) -> dict[str, Any]:
        return every_layer_window(config) | {"qkv_bias": config.qkv_bias}

    def config_kwargs(self, config: Any) -> dict[str, Any]:
        return super().config_kwargs(config) | {"shared_expert_intermediate_size": config.moe_shared_expert_size}


QWEN2_MOE = Qwen2Moe("qwen2_moe")
