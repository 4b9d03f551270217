"""OLMoE (`olmoe`): no biases, no sliding window, q/k RMSNorm over the whole projections, experts in every layer."""
from typing import Any

from .llama import no_biases
from .moe import MoE


class Olmoe(MoE):
    config_class = "OlmoeConfig"
    title = "OLMoE"
    qk_norm = "full"

    def bias_window_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        return [*no_biases(config), (config.sliding_window is None, "sliding_window", "no sliding window")]

    def bias_window_kwargs(self, config: Any) -> dict[str, Any]:
        return {}


OLMOE = Olmoe("olmoe")
