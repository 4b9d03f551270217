"""Recomputation as the planner prices it: models.recompute's granularities (none, selective, full) and Megatron-Core's
fine-grained modules (--recompute-granularity selective --recompute-modules ...), written as one string: a
granularity, or module names joined by "+" (e.g. "layernorm+moe_act").

MODULES: Megatron-Core's module names (megatron/core/transformer/transformer_config.py, recompute_modules) -> what
recomputing it drops from a layer's saved activations and does again in backward:
  core_attn       the attention core (softmax(QKᵀ)V): its log-sum-exp (flash kernels keep no scores); selective's part
  mlp             the dense MLP from its input: keeps only its input
  moe             the MoE layer from its input (router, dispatch, experts, combine): keeps only its input
  moe_act         output-discarding: the experts' activation output, recomputed from the pre-activation
  layernorm       output-discarding: both norms' outputs (and this package's fp32 copies), recomputed from the input
  shared_experts  the shared expert from its input
  mla_up_proj     multi-latent attention's up-projections (priced once bench.plan prices MLA; nothing here)
The job's own list (models.recompute) is the one to follow once it has these modules: tests/test_plan.py checks the
names against it when it does.
"""
from models.recompute import GRANULARITIES

MODULES = {
    "core_attn": "the attention core",
    "mlp": "the dense MLP",
    "moe": "the MoE layer",
    "moe_act": "the experts' activation (output-discarding)",
    "layernorm": "the norms (output-discarding)",
    "shared_experts": "the shared expert",
    "mla_up_proj": "MLA's up-projections",
}
# models.recompute's parts in module terms ("block": the whole layer from its input)
_PART_MODULE = {"core": "core_attn", "block": "block"}
# recomputation that repeats no GEMM: the search tries it with the granularities
OUTPUT_DISCARDING = ("layernorm", "moe_act")


def parse(text):
    """The canonical recompute string of `text` (a granularity, or modules joined by "+"); ValueError naming an
    unknown one."""
    if text in GRANULARITIES:
        return text
    names = text.split("+")
    unknown = [n for n in names if n not in MODULES]
    if unknown or not text:
        raise ValueError(f"recompute={text!r}: expected one of {', '.join(GRANULARITIES)} or modules joined by '+' "
                         f"from {', '.join(MODULES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"recompute={text!r} names a module twice")
    return "+".join(names)


def parts(recompute):
    """The frozenset of what `recompute` recomputes: module names, or {"block"} for full."""
    if recompute in GRANULARITIES:
        return frozenset(_PART_MODULE[part] for part in GRANULARITIES[recompute])
    return frozenset(parse(recompute).split("+"))


def recomputes(recompute, part):
    """Whether `recompute` recomputes `part`: "block" (the whole layer) or a MODULES name."""
    return part in parts(recompute)


def search_choices(config):
    """What the search tries: the granularities, and the output-discarding modules that apply to the model."""
    applicable = [m for m in OUTPUT_DISCARDING if m != "moe_act" or config.num_experts]
    return (*GRANULARITIES, "+".join(applicable))
