"""Qwen2 (`qwen2`): Llama with biases on q/k/v only (always), and a sliding window on every layer or none."""
from typing import Any

from .llama import Llama


def every_layer_window(config: Any) -> dict[str, Any]:
    """Qwen's sliding-window settings for the GPT's: every layer slides (max_window_layers=0), as ours refuse longer
    sequences in all."""
    c = config
    return dict(use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window, max_window_layers=0)


class Qwen2(Llama):
    config_class = "Qwen2Config"
    title = "Qwen2"

    def attention_bias(self, hf: Any) -> bool:
        return False

    def qkv_bias(self, hf: Any) -> bool:
        return True

    def bias_window_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        c = config
        return [(not c.bias, "bias", "biases on q/k/v only"), (c.qkv_bias, "qkv_bias", "always q/k/v biases")]

    def bias_window_kwargs(self, config: Any) -> dict[str, Any]:
        return every_layer_window(config)


QWEN2 = Qwen2("qwen2")
