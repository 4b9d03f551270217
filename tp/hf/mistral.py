"""Mistral (`mistral`): Llama without biases, with a sliding window (the GPT refuses sequences longer than it)."""
from typing import Any

from .llama import Llama, no_biases


class Mistral(Llama):
    config_class = "MistralConfig"
    title = "Mistral"

    def bias_window_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        return no_biases(config)

    def bias_window_kwargs(self, config: Any) -> dict[str, Any]:
        return {"sliding_window": config.sliding_window}


MISTRAL = Mistral("mistral")
