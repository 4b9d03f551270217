"""Hugging Face model families: one module per family, one registry (`FAMILIES`: config.model_type -> `Family`).

A family's module (llama.py, mistral.py, qwen2.py, gpt2.py, mixtral.py, qwen2_moe.py, qwen3_moe.py, olmoe.py,
deepseek_v3.py, deepseek_v2.py, glm4_moe.py, phi3.py) holds everything the package knows of it, as a `Family`
subclass (family.py) and one instance named by its model_type:
- for `tp.parallelize` of the transformers model: the plan where tp ships a better one than the config's
  `base_model_tp_plan` (Phi3, GPT-2), which projections carry heads, which attention counts to set when heads split;
- for `models.GPT.from_hf` / `save_hf` (the families with a `config_class`): the config as GPTConfig fields and
  back, the GPTConfig fields it cannot represent, the tensor names (each GPT parameter -> the HF tensors it fuses),
  the experts' layout on disk.

Why here, in tp/ and not models/: `tp.parallelize(hf_model)` works on plain transformers models, without the GPT, so
a family's plan must be reachable from tp/, and tp never imports models/. The GPT side is data and functions of
duck-typed configs, written in the GPT's field and parameter names; models/hf/ is generic (it builds the GPTConfig,
reads and writes the tensors, gathers the shards) and finds each family through `FAMILIES`, as GPTConfig's
hf_model_type check (models.config.HF_FAMILIES), save_hf's choice of family and tp's plan lookup do.

Adding a family: one module here (a subclass of the closest family's class, overriding what differs: its
`config_class`, how its config reads and writes, its checks, its tensor names; for tp.parallelize alone, only what
differs from Llama's attention) and its instance in registry.py's `FAMILIES`. docs/gpt.md shows one.

The generic parts: plan.py (`default_plan`), heads.py (splitting the heads), registry.py (`FAMILIES`, `family_of`).
"""
from .family import Family, LocalHeadsConfig
from .heads import shard_options, shared_tail_width
from .plan import default_plan, plan_source
from .registry import FAMILIES, UNCHECKED, family_of, model_type

__all__ = ["FAMILIES", "UNCHECKED", "Family", "LocalHeadsConfig", "default_plan", "family_of", "model_type",
           "plan_source", "shard_options", "shared_tail_width"]
