"""Recomputation as the planner prices it: models.recompute's granularities (none, selective, full) and Megatron-Core's
fine-grained modules (--recompute-granularity selective --recompute-modules ...), written as one string: a
granularity, or module names joined by "+" (e.g. "layernorm+moe_act"). The names, and what each recomputes, are the
job's (models.recompute.MODULES): the planner prices exactly what the job runs.
"""
from models.recompute import GRANULARITIES, OUTPUT_DISCARDING, recompute_parts
from models.recompute import MODULES as JOB_MODULES

MODULES = tuple(JOB_MODULES)
_MODULE_OF_PART = {part: module for module, part in JOB_MODULES.items()} | {"block": "block"}
# recomputation that repeats no GEMM (output-discarding): the search tries it with the granularities
OUTPUT_DISCARDING_MODULES = tuple(m for m, part in JOB_MODULES.items() if part in OUTPUT_DISCARDING)


def parse(text):
    """The canonical recompute string of `text` (a granularity, or modules joined by "+"); ValueError naming an
    unknown one."""
    if text in GRANULARITIES:
        return text
    names = text.split("+")
    unknown = [n for n in names if n not in JOB_MODULES]
    if unknown or not text:
        raise ValueError(f"recompute={text!r}: expected one of {', '.join(GRANULARITIES)} or modules joined by '+' "
                         f"from {', '.join(MODULES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"recompute={text!r} names a module twice")
    return "+".join(names)


def block_parts(recompute, modules=None):
    """models.recompute's parts of a block that `recompute` recomputes (with `modules`: the job's granularity and
    --recompute-modules)."""
    if modules is not None or recompute in GRANULARITIES:
        return recompute_parts(recompute, modules)
    return recompute_parts("selective", tuple(parse(recompute).split("+")))


def parts(recompute):
    """The frozenset of module names `recompute` recomputes, or {"block"} for full."""
    return frozenset(_MODULE_OF_PART[part] for part in block_parts(recompute))


def recomputes(recompute, module):
    """Whether `recompute` recomputes `module`: "block" (the whole layer) or a MODULES name."""
    return module in parts(recompute)


def search_choices(config):
    """What the search tries: the granularities, and the output-discarding modules that apply to the model."""
    applicable = [m for m in OUTPUT_DISCARDING_MODULES if JOB_MODULES[m] != "expert_act" or config.num_experts]
    return (*GRANULARITIES, "+".join(applicable))
