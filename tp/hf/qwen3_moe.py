"""Qwen3-MoE (`qwen3_moe`): Qwen2-MoE's experts without the shared expert, no biases, q/k RMSNorm over each head."""
from typing import Any

from .llama import no_biases
from .qwen2 import every_layer_window
from .qwen2_moe import QwenMoE


class Qwen3Moe(QwenMoE):
    config_class = "Qwen3MoeConfig"
    title = "Qwen3-MoE"
    qk_norm = "head"

    def bias_window_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        return no_biases(config)

    def bias_window_kwargs(self, config: Any) -> dict[str, Any]:
        return every_layer_window(config)


QWEN3_MOE = Qwen3Moe("qwen3_moe")
