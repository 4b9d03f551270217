"""The Hugging Face families: `FAMILIES`, model_type -> Family, each declared in its own module (tp/hf/__init__.py
says how to add one)."""
from torch import nn

from . import (
    deepseek_v2,
    deepseek_v3,
    glm4_moe,
    gpt2,
    llama,
    mistral,
    mixtral,
    olmoe,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3_moe,
)
from .family import Family

FAMILIES: dict[str, Family] = {family.name: family for family in (
    # read and written by models.GPT (config_class set), in the order its messages list them
    llama.LLAMA, mistral.MISTRAL, qwen2.QWEN2, gpt2.GPT2, mixtral.MIXTRAL, qwen2_moe.QWEN2_MOE, qwen3_moe.QWEN3_MOE,
    olmoe.OLMOE, deepseek_v3.DEEPSEEK_V3, deepseek_v2.DEEPSEEK_V2, glm4_moe.GLM4_MOE,
    # tp.parallelize only: Llama's attention under HF's plan (Qwen3's q/k norms are whole, grads summed), Phi3's
    Family("qwen3"), Family("gemma"), Family("gemma2"), phi3.PHI3)}


class Unchecked(Family):
    """Any other family: HF's plan with HF's semantics; heads split where the names say so, never replicated (so no
    count an attention module caches changes)."""

    replicate_kv = False
    checked = False

    def localize(self, attention: nn.Module, heads: int, kv_heads: int) -> None:
        pass


UNCHECKED = Unchecked("")


def model_type(module: nn.Module) -> str | None:
    """A Hugging Face model's config.model_type, else None."""
    return getattr(getattr(module, "config", None), "model_type", None)


def family_of(module: nn.Module) -> Family | None:
    """The family of a Hugging Face model, UNCHECKED for a family not in FAMILIES, None for a plain module."""
    if model_type(module) is None:
        return None
    return FAMILIES.get(model_type(module), UNCHECKED)
