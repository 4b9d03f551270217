"""Mixtral (`mixtral`): Mistral's attention, experts in every layer, the top-k weights always renormalised, and the
experts on disk under `block_sparse_moe` (w1 gate, w3 up, w2 down)."""
from typing import Any

from .llama import no_biases
from .moe import MoE


class Mixtral(MoE):
    config_class = "MixtralConfig"
    title = "Mixtral"
    experts_field = "num_local_experts"
    norm_topk_field = None
    experts_on_disk = ("block_sparse_moe", "w1", "w3", "w2")

    def bias_window_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        return no_biases(config)

    def bias_window_kwargs(self, config: Any) -> dict[str, Any]:
        return {"sliding_window": config.sliding_window}


MIXTRAL = Mixtral("mixtral")
