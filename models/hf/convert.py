"""Hugging Face configs in and out: the GPTConfig of a transformers config, the family a GPTConfig is written as,
whether it fits that family, and the transformers config it is saved with. Each family's side is its module in
tp/hf/ (tp.hf.FAMILIES); RoPE's parameters read the same in every family, here. transformers is imported only when
config_to_hf runs."""
from typing import TYPE_CHECKING, Any

import tp.hf
from tp.hf.deepseek_v3 import DEEPSEEK_V3
from tp.hf.gpt2 import GPT2
from tp.hf.llama import LLAMA
from tp.hf.mixtral import MIXTRAL

from ..config import ROPE_SCALING_FIELDS, ROPE_SCALING_OPTIONAL, GPTConfig, hf_families

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _rope(hf):
    """(rope_theta, rope_scaling or None) of a RoPE family's HF config: plain, "linear" or "llama3" RoPE."""
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = float(params.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))  # ("type": transformers 4's key)
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALING_FIELDS:
        raise ValueError(f"rope_type={kind!r} (rope scaling) is not supported; only plain RoPE and "
                         f"{', '.join(ROPE_SCALING_FIELDS)} scaling")
    fields = (*ROPE_SCALING_FIELDS[kind], *ROPE_SCALING_OPTIONAL.get(kind, ()))
    return theta, {"rope_type": kind} | {f: params[f] for f in fields if params.get(f) is not None}


def config_from_hf(hf: "PretrainedConfig", **overrides: Any) -> GPTConfig:
    """GPTConfig of a transformers config of one of the families models.GPT reads (models.config.hf_families())."""
    family = hf.model_type
    if family not in hf_families():
        raise ValueError(f"model_type={family!r} is not supported; expected one of {hf_families()}")
    fields = tp.hf.FAMILIES[family].config_fields(hf)
    if fields["position"] == "rope":
        fields["rope_theta"], fields["rope_scaling"] = _rope(hf)
    return GPTConfig(**(fields | {"hf_model_type": family} | overrides))


def hf_family(config: GPTConfig) -> str:
    """The Hugging Face family `config` is written as (config_to_hf, save_hf) and whose tensor names it uses
    (hf_sources: hf_state_dict, checkpoints): its hf_model_type, else DeepSeek-V3 for multi-head latent attention,
    GPT-2 for learned positions (the only family with them), Mixtral with experts, else Llama. Whether the config
    fits that family is check_hf's question."""
    if config.hf_model_type:
        return config.hf_model_type
    if config.multi_latent_attention:
        return DEEPSEEK_V3.name
    return (GPT2 if config.position == "learned" else MIXTRAL if config.num_experts else LLAMA).name


def hf_problems(config: GPTConfig, family: str | None = None) -> list[str]:
    """'field=value (what the family has)' for every field of `config` that `family` (default: hf_family) cannot
    represent; empty when a checkpoint of that family holds exactly this model."""
    return tp.hf.FAMILIES[family or hf_family(config)].problems(config)


def check_hf(config: GPTConfig) -> str:
    """Raise a ValueError naming every field the Hugging Face family of `config` (hf_family) cannot represent.
    Collective-free: save_hf calls it on every rank before it gathers or writes anything."""
    family = hf_family(config)
    problems = hf_problems(config, family)
    if problems:
        why = ""
        if config.hf_model_type is None:
            fits = [f for f in hf_families() if f != family and not hf_problems(config, f)]
            why = (f" (hf_model_type=None: {family} inferred from position={config.position!r}; "
                   + (f"hf_model_type={fits[0]!r} fits)" if fits else "no other family fits either)"))
        raise ValueError(f"this GPTConfig has no Hugging Face {family} equivalent{why}: " + "; ".join(problems))
    return family


def config_to_hf(config: GPTConfig) -> "PretrainedConfig":
    """The transformers config a saved model is loaded with; a ValueError (check_hf) if there is none."""
    import transformers

    c, family = config, tp.hf.FAMILIES[check_hf(config)]
    hf = getattr(transformers, family.config_class)(**family.config_kwargs(c))
    if c.rope_scaling:  # transformers 5: rope_parameters holds theta and the scaling together
        hf.rope_parameters = {**(hf.rope_parameters or {}), "rope_theta": c.rope_theta, **c.rope_scaling}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the family's defaults (GPT-2's 50256) may not
        token = getattr(hf, name, None)  # exist in this vocabulary: no such token then
        if token is not None and not 0 <= token < c.vocab_size:
            setattr(hf, name, None)
    return hf
