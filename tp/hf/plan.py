"""The plan `tp.parallelize` applies to a Hugging Face model by default: its family's (`Family.plan`), else the
config's own `base_model_tp_plan` with the family's `plan_additions`, prefixed with the model's `base_model_prefix`."""
from torch import nn

from .registry import family_of, model_type

EXPERTS_STYLES = ("moe_experts", "moe_tp_experts", "ep_dispatch_experts")  # (HF's names read as moe_experts)


def _base_plan(module):
    family, config = family_of(module), getattr(module, "config", None)
    if family is not None and family.plan is not None:
        return family.plan, f"tp's plan for {model_type(module)}"
    plan, source = _config_plan(config), f"{type(config).__name__}.base_model_tp_plan"
    if plan and family is not None and family.plan_additions:
        return plan | family.plan_additions, f"{source} + tp's {', '.join(family.plan_additions)}"
    return plan, source


def _config_plan(config):
    """The config's tensor-parallel plan, the same on transformers 5.17 and 5.24:
    - 5.17 (not 5.24) adds "embed_tokens": "embedding_rowwise" to a tied-embedding config's plan at init (its loader
      then also shards lm_head by the model's _tp_plan): the embedding alone sharded would break the tie, so tp's
      default keeps both whole, as the class declares its plan;
    - 5.17 names some families' fused experts only in base_model_ep_plan (Qwen2-MoE): taken from there."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return plan
    if "embed_tokens" in plan and "embed_tokens" not in (getattr(type(config), "base_model_tp_plan", None) or {}):
        plan = {pattern: style for pattern, style in plan.items() if pattern != "embed_tokens"}
    if not any(style in EXPERTS_STYLES for style in plan.values()):
        ep_plan = getattr(config, "base_model_ep_plan", None) or {}
        plan = plan | {pattern: style for pattern, style in ep_plan.items() if style in EXPERTS_STYLES}
    return plan


def default_plan(module: nn.Module) -> dict[str, str]:
    """The plan `tp.parallelize(module)` applies (full module-name patterns -> styles), a dict to extend:
    `tp.parallelize(model, {**tp.default_plan(model), "model.embed_tokens": "vocab", "lm_head": "colwise"})`."""
    base, _ = _base_plan(module)
    if not base:
        raise ValueError(f"{type(module).__name__} has no tensor-parallel plan (no config.base_model_tp_plan, "
                         f"and tp ships none for model_type {model_type(module)!r}): pass plan=")
    base_model = getattr(module, "base_model", module)
    prefix = "" if base_model is module else f"{module.base_model_prefix}."
    return {prefix + pattern: style for pattern, style in base.items()}


def plan_source(module: nn.Module) -> str:
    """Where the default plan comes from, for `tp.describe`."""
    return _base_plan(module)[1]
